// SPDX-License-Identifier: MIT
//! `Tensor<T, Backend>`: an owning, contiguous tensor of up to 5 dimensions on one device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

#include "lockstep/core/backend.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/shape.hpp"

namespace lockstep {
namespace detail {

//! Memory of one backend. `Allocator<Host>` is defined here; `Allocator<Cuda>` in `<lockstep/cuda.cuh>`.
template <class B>
struct Allocator;

template <>
struct Allocator<Host> {
    static constexpr std::size_t alignment = 64;  // a cache line: vector loads never split one
    static void* allocate(std::size_t bytes, Device) {
        if (bytes == 0) return nullptr;
        const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
        void* p = std::aligned_alloc(alignment, rounded);
        if (p == nullptr) throw std::bad_alloc();
        return p;
    }
    static void deallocate(void* p, std::size_t, Device) noexcept { std::free(p); }
    static void copy(void* dst, const void* src, std::size_t bytes, Device) {
        if (bytes != 0) std::memcpy(dst, src, bytes);
    }
    static void fill_zero(void* dst, std::size_t bytes, Device) {
        if (bytes != 0) std::memset(dst, 0, bytes);
    }
};

}  // namespace detail

//! An owning, contiguous tensor. Copying deep-copies on the same device; moving transfers the
//! storage. The shape is logical (N, C, H, W for images); `format()` says how a 4-D tensor is
//! laid out in memory.
template <class T, BackendTag B = Host>
class Tensor {
    static_assert(std::is_trivially_copyable_v<T>, "Tensor elements must be trivially copyable");
    using alloc = detail::Allocator<B>;

public:
    using value_type = T;
    using backend = B;

    Tensor() = default;

    //! Zero-filled tensor of `shape` on `device`.
    explicit Tensor(Shape shape, MemoryFormat format = MemoryFormat::nchw,
                    Device device = Device{device_kind_of<B>(), 0})
        : shape_(shape), format_(format), device_(device) {
        LOCKSTEP_CHECK(device.kind == device_kind_of<B>(), "a ", B::name, " tensor cannot live on device ", device);
        LOCKSTEP_CHECK(format == MemoryFormat::nchw || shape.rank() == 4,
                       "NHWC applies to 4-D tensors only; got shape ", shape);
        data_ = static_cast<T*>(alloc::allocate(bytes(), device_));
        alloc::fill_zero(data_, bytes(), device_);
    }

    Tensor(const Tensor& other) : shape_(other.shape_), format_(other.format_), device_(other.device_) {
        data_ = static_cast<T*>(alloc::allocate(bytes(), device_));
        alloc::copy(data_, other.data_, bytes(), device_);
    }
    Tensor(Tensor&& other) noexcept
        : data_(std::exchange(other.data_, nullptr)),
          shape_(std::exchange(other.shape_, Shape{0})),
          format_(other.format_),
          device_(other.device_) {}
    Tensor& operator=(const Tensor& other) {
        if (this != &other) *this = Tensor(other);
        return *this;
    }
    Tensor& operator=(Tensor&& other) noexcept {
        if (this != &other) {
            release();
            data_ = std::exchange(other.data_, nullptr);
            shape_ = std::exchange(other.shape_, Shape{0});
            format_ = other.format_;
            device_ = other.device_;
        }
        return *this;
    }
    ~Tensor() { release(); }

    const Shape& shape() const noexcept { return shape_; }
    MemoryFormat format() const noexcept { return format_; }
    const Device& device() const noexcept { return device_; }
    int rank() const noexcept { return shape_.rank(); }
    std::int64_t dim(int i) const { return shape_[i]; }
    std::int64_t numel() const noexcept { return shape_.numel(); }
    std::size_t bytes() const noexcept { return static_cast<std::size_t>(shape_.numel()) * sizeof(T); }
    bool empty() const noexcept { return numel() == 0; }

    T* data() noexcept { return data_; }
    const T* data() const noexcept { return data_; }
    //! Whole storage as a span (host backend, or device pointers for kernels).
    std::span<T> span() noexcept { return {data_, static_cast<std::size_t>(numel())}; }
    std::span<const T> span() const noexcept { return {data_, static_cast<std::size_t>(numel())}; }

    //! Element access for host tensors, in memory order.
    T& operator[](std::int64_t i) noexcept requires std::same_as<B, Host> { return data_[i]; }
    const T& operator[](std::int64_t i) const noexcept requires std::same_as<B, Host> { return data_[i]; }

    //! Same storage, new logical shape with the same element count (NCHW only).
    Tensor reshaped(Shape s) && {
        LOCKSTEP_CHECK_AS(ShapeError, s.numel() == shape_.numel(), "cannot reshape ", shape_, " into ", s,
                          ": element counts differ");
        LOCKSTEP_CHECK_AS(ShapeError, format_ == MemoryFormat::nchw || s.rank() == 4,
                          "reshape an NHWC tensor only after converting it to NCHW");
        Tensor t = std::move(*this);
        t.shape_ = s;
        return t;
    }

    void zero() { alloc::fill_zero(data_, bytes(), device_); }

private:
    void release() noexcept {
        if (data_ != nullptr) alloc::deallocate(data_, bytes(), device_);
        data_ = nullptr;
    }

    T* data_ = nullptr;
    Shape shape_{0};  // a default tensor is empty, not a scalar
    MemoryFormat format_ = MemoryFormat::nchw;
    Device device_{device_kind_of<B>(), 0};
};

//! Host tensor holding a copy of `values` with `shape`.
template <class T>
Tensor<T, Host> make_tensor(Shape shape, std::span<const T> values, MemoryFormat format = MemoryFormat::nchw) {
    LOCKSTEP_CHECK_AS(ShapeError, static_cast<std::int64_t>(values.size()) == shape.numel(), "shape ", shape,
                      " holds ", shape.numel(), " elements but ", values.size(), " values were given");
    Tensor<T, Host> t(shape, format);
    if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(T));
    return t;
}

}  // namespace lockstep
