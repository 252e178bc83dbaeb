// SPDX-License-Identifier: MIT
//! `DeviceSpan<T>`: a view of elements in one device's memory (pointer, count, device), the
//! buffer type every collective takes.
#pragma once

#include <cstddef>
#include <span>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep {

//! Elements [data, data + size) in the memory of `device`. A collective checks that the device is
//! one its communicator reaches, so no signature changes between backends.
template <class T>
struct DeviceSpan {
    T* data = nullptr;
    std::size_t size = 0;
    Device device{};

    DeviceSpan() = default;
    DeviceSpan(T* p, std::size_t n, Device d) : data(p), size(n), device(d) {}
    //! The whole storage of `t`.
    template <BackendTag B>
    explicit DeviceSpan(Tensor<T, B>& t) : data(t.data()), size(static_cast<std::size_t>(t.numel())), device(t.device()) {}
    //! Host memory (a vector, an array) on host device `index`.
    static DeviceSpan host(std::span<T> s, int index = 0) { return {s.data(), s.size(), Device::host(index)}; }

    bool empty() const noexcept { return size == 0; }
    //! Elements [offset, offset + count) of this span; a range beyond it is a ShapeError.
    DeviceSpan subspan(std::size_t offset, std::size_t count) const {
        LOCKSTEP_CHECK_AS(ShapeError, offset <= size && count <= size - offset, "a span of ", size,
                          " elements has no elements [", offset, ", ", offset + count, ")");
        return {data + offset, count, device};
    }
};

template <class T, BackendTag B>
DeviceSpan(Tensor<T, B>&) -> DeviceSpan<T>;

}  // namespace lockstep
