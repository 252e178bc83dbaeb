// SPDX-License-Identifier: MIT
//! Backend tag types (`Host`, `Cuda`) and `Device`, the place a replica runs.
#pragma once

#include <concepts>
#include <ostream>
#include <string_view>

namespace lockstep {

//! Threads of this process act as devices; memory is ordinary host memory.
struct Host {
    static constexpr std::string_view name = "host";
};

//! CUDA devices. Storage, kernels and communicators for it live behind `<lockstep/cuda.cuh>`.
struct Cuda {
    static constexpr std::string_view name = "cuda";
};

template <class B>
concept BackendTag = std::same_as<B, Host> || std::same_as<B, Cuda>;

//! Where a replica lives: a backend and an index (GPU ordinal, or host replica number).
struct Device {
    enum class Kind { host, cuda };
    Kind kind = Kind::host;
    int index = 0;

    static constexpr Device host(int i = 0) { return {Kind::host, i}; }
    static constexpr Device cuda(int i) { return {Kind::cuda, i}; }

    friend constexpr bool operator==(const Device&, const Device&) = default;
    friend std::ostream& operator<<(std::ostream& os, const Device& d) {
        return os << (d.kind == Kind::host ? "host:" : "cuda:") << d.index;
    }
};

template <BackendTag B>
constexpr Device::Kind device_kind_of() {
    return std::same_as<B, Host> ? Device::Kind::host : Device::Kind::cuda;
}

}  // namespace lockstep
