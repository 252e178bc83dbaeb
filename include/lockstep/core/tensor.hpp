// SPDX-License-Identifier: MIT
//! `Tensor<T, Backend>`: an owning, contiguous tensor of up to 5 dimensions on one device.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "lockstep/core/backend.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/shape.hpp"

namespace lockstep {

//! Tag for a tensor whose elements are about to be overwritten: skips the zero fill.
struct Uninitialized {
    explicit Uninitialized() = default;
};
inline constexpr Uninitialized uninitialized{};

#if defined(__SANITIZE_ADDRESS__)
#define LOCKSTEP_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOCKSTEP_ASAN 1
#endif
#endif
#ifndef LOCKSTEP_ASAN
#define LOCKSTEP_ASAN 0
#endif

namespace detail {

//! Memory of one backend. `Allocator<Host>` is defined here; `Allocator<Cuda>` in `<lockstep/cuda.cuh>`.
template <class B>
struct Allocator;

// Note [host allocation cache]
// Large host blocks come from mmap and go back on free, so every new activation of a training
// step would fault its pages in again (for a 12 MiB tensor that costs more than the layer's
// arithmetic). Freed blocks are kept by size, up to a cap, and handed out again: a step's
// tensors have the same sizes every step, so after the first step nothing is faulted in.
//
// Under AddressSanitizer the cache is bypassed: every tensor's memory comes from and goes back
// to the sanitizer's allocator, so a use after free or an overflow of a tensor is reported
// instead of landing in a cached block that is still mapped.
//
// Note [huge pages]
// On Linux, blocks of 2 MiB or more start on a 2 MiB boundary and their whole 2 MiB pages are
// advised MADV_HUGEPAGE (the tail stays in 4 KiB pages, so at most the advice is wasted, never
// memory). A layer streams its tensors front to back; with 4 KiB pages every 4 KiB of every
// stream costs a TLB miss, which under a hypervisor is a two-level page walk (docs/reference.md, Benchmarks,
// has what it buys). The kernel grants huge pages
// only where transparent huge pages are "always" or "madvise"; elsewhere nothing changes.
// `lockstep::set_host_huge_pages(false)` turns the advice off for blocks allocated afterwards.

//! Process-wide cache of freed host blocks, keyed by rounded size.
class HostBlockCache {
public:
    static constexpr std::size_t alignment = 64;                     // a cache line: vector loads never split one
    static constexpr std::size_t min_cached = std::size_t{1} << 16;  // small blocks: malloc is fast enough
    static constexpr std::size_t cap = std::size_t{1} << 30;         // at most 1 GiB kept idle
    static constexpr std::size_t huge_page = std::size_t{2} << 20;   // see Note [huge pages]

    static HostBlockCache& instance() {
        // Never destroyed: a tensor with static storage may be freed after any static object's
        // destructor has run. Idle blocks go back to the OS with the process.
        static HostBlockCache* cache = new HostBlockCache;
        return *cache;
    }

    static std::size_t rounded(std::size_t bytes) {
        const std::size_t page = bytes >= min_cached ? 4096 : alignment;
        return (bytes + page - 1) / page * page;
    }

    //! Whether freed blocks are kept for reuse (not under AddressSanitizer: see the Note).
    static constexpr bool caching = !LOCKSTEP_ASAN;

    void* allocate(std::size_t bytes) {
        if constexpr (!caching) {  // exactly `bytes`: an access one element past the end is reported
            void* p = allocate_new(bytes);
            if (p == nullptr) throw std::bad_alloc();
            return p;
        }
        const std::size_t size = rounded(bytes);
        if (size >= min_cached) {
            std::lock_guard lock(mutex_);
            // The most recently freed block of this size (the last of its equal range): it is
            // the likeliest to still be in cache.
            auto it = free_.upper_bound(size);
            if (it != free_.begin() && (--it)->first == size) {
                void* p = it->second;
                free_.erase(it);
                idle_ -= size;
                return p;
            }
        }
        void* p = allocate_new(size);
        if (p == nullptr) {
            release_all();
            p = allocate_new(size);
            if (p == nullptr) throw std::bad_alloc();
        }
        return p;
    }

    //! Whether new blocks of `huge_page` bytes or more are advised onto huge pages (default on).
    void set_huge_pages(bool on) noexcept { huge_pages_.store(on, std::memory_order_relaxed); }
    bool huge_pages() const noexcept { return huge_pages_.load(std::memory_order_relaxed); }

    void deallocate(void* p, std::size_t bytes) noexcept {
        const std::size_t size = rounded(bytes);
        if (caching && size >= min_cached) {
            std::lock_guard lock(mutex_);
            if (idle_ + size <= cap) {
                try {
                    free_.emplace(size, p);
                    idle_ += size;
                    return;
                } catch (...) {  // no room to remember it: free it below
                }
            }
        }
        std::free(p);
    }

    //! Frees every idle block (also called when an allocation fails).
    void release_all() noexcept {
        std::lock_guard lock(mutex_);
        for (auto& [size, p] : free_) std::free(p);
        free_.clear();
        idle_ = 0;
    }

private:
    void* allocate_new(std::size_t size) const noexcept {
        void* p = nullptr;
#if defined(__linux__)
        if (size >= huge_page) {
            if (::posix_memalign(&p, huge_page, size) != 0) return nullptr;
            // Advice only: where the kernel declines, the block is as good with 4 KiB pages.
            if (huge_pages()) ::madvise(p, size / huge_page * huge_page, MADV_HUGEPAGE);
            return p;
        }
#endif
        return ::posix_memalign(&p, alignment, size) == 0 ? p : nullptr;
    }

    std::mutex mutex_;
    std::atomic<bool> huge_pages_{true};
    std::multimap<std::size_t, void*> free_;
    std::size_t idle_ = 0;
};

template <>
struct Allocator<Host> {
    static Device current_device() noexcept { return current_host_device(); }
    static void* allocate(std::size_t bytes, Device) {
        if (bytes == 0) return nullptr;
        return HostBlockCache::instance().allocate(bytes);
    }
    static void deallocate(void* p, std::size_t bytes, Device) noexcept { HostBlockCache::instance().deallocate(p, bytes); }
    static void copy(void* dst, const void* src, std::size_t bytes, Device) {
        if (bytes != 0) std::memcpy(dst, src, bytes);
    }
    static void fill_zero(void* dst, std::size_t bytes, Device) {
        if (bytes != 0) std::memset(dst, 0, bytes);
    }
};

//! Copies between the memories of two backends. `Transfer<Host, Host>` is defined here; those
//! that involve `Cuda` in `<lockstep/cuda.cuh>`.
template <class From, class To>
struct Transfer;

template <>
struct Transfer<Host, Host> {
    static void copy(void* dst, Device, const void* src, Device, std::size_t bytes) {
        if (bytes != 0) std::memcpy(dst, src, bytes);
    }
};

template <class D>
inline constexpr bool dependent_false = false;

}  // namespace detail

//! Whether host tensors of 2 MiB or more are advised onto transparent huge pages (default: yes,
//! on Linux). Applies to blocks allocated afterwards; see Note [huge pages].
inline void set_host_huge_pages(bool on) noexcept { detail::HostBlockCache::instance().set_huge_pages(on); }

//! An owning, contiguous tensor on one device. Copying deep-copies on the same device; moving
//! transfers the storage. A view (`Tensor::view`) uses memory it does not own; copying a view
//! gives an owning tensor, assigning to a view replaces the view (it does not write through).
//! The shape is logical (N, C, H, W for images); `format()` says how a 4-D tensor is laid out in
//! memory. Element access (`span()`, `operator[]`) exists for host
//! tensors only; a CUDA tensor is read on the host through `to_host()`.
template <class T, BackendTag B = Host>
class Tensor {
    static_assert(std::is_trivially_copyable_v<T>, "Tensor elements must be trivially copyable");
    using alloc = detail::Allocator<B>;

public:
    using value_type = T;
    using backend = B;

    Tensor() = default;

    //! Zero-filled tensor of `shape` on the calling thread's current device of the backend (the
    //! replica's device on a replica thread, see `current_host_device`).
    explicit Tensor(Shape shape, MemoryFormat format = MemoryFormat::nchw) : Tensor(shape, format, alloc::current_device()) {}

    //! Zero-filled tensor of `shape` on `device`.
    Tensor(Shape shape, MemoryFormat format, Device device) : Tensor(shape, format, device, uninitialized) {
        alloc::fill_zero(data_, bytes(), device_);
    }

    //! Tensor of `shape` whose elements are left unset; for outputs that are written in full.
    Tensor(Shape shape, MemoryFormat format, Device device, Uninitialized) : shape_(shape), format_(format), device_(device) {
        check_layout();
        data_ = static_cast<T*>(alloc::allocate(bytes(), device_));
    }

    //! A view of `shape.numel()` elements of memory that the caller owns, from `data` on `device`
    //! (a device pointer on CUDA): the tensor reads and writes that memory and never frees it. The
    //! caller keeps the memory alive while the view (or what it is moved into) lives. DataParallel
    //! makes each replica's parameters and gradients views of its flat bucket buffers (Note
    //! [gradients in their buckets] in parallel/replica.hpp).
    static Tensor view(T* data, Shape shape, Device device, MemoryFormat format = MemoryFormat::nchw) {
        LOCKSTEP_CHECK(data != nullptr || shape.numel() == 0, "a view of ", shape.numel(), " elements needs memory, got null");
        Tensor t;
        t.shape_ = shape;
        t.format_ = format;
        t.device_ = device;
        t.check_layout();
        t.data_ = data;
        t.owned_ = false;
        return t;
    }

    //! A view of `shape.numel()` elements of `storage` from element `offset`, on its device. The
    //! caller keeps `storage` (and its size) while the view lives.
    static Tensor view(Tensor& storage, std::int64_t offset, Shape shape, MemoryFormat format = MemoryFormat::nchw) {
        LOCKSTEP_CHECK_AS(ShapeError, offset >= 0 && offset + shape.numel() <= storage.numel(), "a view of ", shape.numel(),
                          " elements from offset ", offset, " does not fit a tensor of ", storage.numel());
        return view(storage.data_ + offset, shape, storage.device_, format);
    }

    //! Whether this tensor's memory begins where `prev`'s ends, on the same device: two tensors
    //! that one loop (or one copy) can cover as one.
    bool follows(const Tensor& prev) const noexcept { return offset_from(prev) == prev.numel(); }
    //! Elements from the start of `base`'s memory to the start of this tensor's, on the same
    //! device (nullopt on another device or without memory): where two views of one buffer lie
    //! relative to each other.
    std::optional<std::int64_t> offset_from(const Tensor& base) const noexcept {
        if (data_ == nullptr || base.data_ == nullptr || !(device_ == base.device_)) return std::nullopt;
        return static_cast<std::int64_t>(data_ - base.data_);
    }
    //! Whether this tensor is a view of `storage` at element `offset`.
    bool views(const Tensor& storage, std::int64_t offset) const noexcept { return !owned_ && offset_from(storage) == offset; }
    //! Whether this tensor is a view of memory inside `storage`.
    bool views(const Tensor& storage) const noexcept {
        const auto d = offset_from(storage);
        return !owned_ && d && *d >= 0 && *d < storage.numel();
    }

    //! An uninitialized tensor with `like`'s shape, format and device.
    template <class U>
    static Tensor empty_like(const Tensor<U, B>& like) {
        return Tensor(like.shape(), like.format(), like.device(), uninitialized);
    }

    Tensor(const Tensor& other) : Tensor(other.shape_, other.format_, other.device_, uninitialized) {
        alloc::copy(data_, other.data_, bytes(), device_);
    }
    Tensor(Tensor&& other) noexcept
        : data_(std::exchange(other.data_, nullptr)),
          shape_(std::exchange(other.shape_, Shape{0})),
          format_(other.format_),
          device_(other.device_),
          owned_(std::exchange(other.owned_, true)) {}
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
            owned_ = std::exchange(other.owned_, true);
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
    //! Whether this tensor uses memory it does not own (`Tensor::view`).
    bool is_view() const noexcept { return !owned_; }

    //! The storage on the tensor's device (a device pointer on CUDA, for kernels and libraries).
    T* data() noexcept { return data_; }
    const T* data() const noexcept { return data_; }

    //! Whole storage as a span (host tensors).
    std::span<T> span() noexcept requires(B::device_kind == Device::Kind::host) {
        return {data_, static_cast<std::size_t>(numel())};
    }
    std::span<const T> span() const noexcept requires(B::device_kind == Device::Kind::host) {
        return {data_, static_cast<std::size_t>(numel())};
    }
    template <class D = void>
    void span() const requires(B::device_kind != Device::Kind::host) {
        static_assert(detail::dependent_false<D>,
                      "lockstep: a CUDA tensor's memory is not readable on the host; copy it with to_host() first");
    }

    //! Element access for host tensors, in memory order.
    T& operator[](std::int64_t i) noexcept requires(B::device_kind == Device::Kind::host) { return data_[i]; }
    const T& operator[](std::int64_t i) const noexcept requires(B::device_kind == Device::Kind::host) { return data_[i]; }
    template <class D = void>
    void operator[](std::int64_t) const requires(B::device_kind != Device::Kind::host) {
        static_assert(detail::dependent_false<D>,
                      "lockstep: a CUDA tensor's elements are not readable on the host; copy it with to_host() first");
    }

    //! A copy on `device`, of backend `To` (the same backend unless named): `x.to(Device::host(1))`,
    //! `x.to<Cuda>(Device::cuda(0))`. Synchronous: the copy is complete when it returns.
    template <BackendTag To = B>
    Tensor<T, To> to(Device device) const {
        Tensor<T, To> out(shape_, format_, device, uninitialized);
        detail::Transfer<B, To>::copy(out.data(), device, data_, device_, bytes());
        return out;
    }

    //! A host copy (of a host tensor too), for reading values on the host.
    Tensor<T, Host> to_host() const { return to<Host>(B::device_kind == Device::Kind::host ? device_ : current_host_device()); }

    //! Overwrites this tensor's elements with `src`'s, which may live on any backend and device;
    //! shapes and formats must match.
    template <BackendTag From>
    void copy_from(const Tensor<T, From>& src) {
        LOCKSTEP_CHECK_AS(ShapeError, src.shape() == shape_ && src.format() == format_, "cannot copy a ", src.shape(), " ",
                          to_string(src.format()), " tensor into a ", shape_, " ", to_string(format_), " one");
        detail::Transfer<From, B>::copy(data_, device_, src.data(), src.device(), bytes());
    }

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

    //! The same storage read as elements of U, of T's size (16-bit float types kept as raw bits
    //! where their type cannot be named).
    template <class U>
    Tensor<U, B> bitcast() && {
        static_assert(sizeof(U) == sizeof(T), "bitcast keeps the storage: U must have T's size");
        Tensor<U, B> t;
        t.data_ = reinterpret_cast<U*>(std::exchange(data_, nullptr));
        t.shape_ = std::exchange(shape_, Shape{0});
        t.format_ = format_;
        t.device_ = device_;
        t.owned_ = std::exchange(owned_, true);
        return t;
    }

private:
    template <class, BackendTag>
    friend class Tensor;

    void check_layout() const {
        LOCKSTEP_CHECK_AS(DeviceMismatch, device_.kind == device_kind_of<B>(), "a ", B::name, " tensor cannot live on device ",
                          device_);
        LOCKSTEP_CHECK(format_ == MemoryFormat::nchw || shape_.rank() == 4, "NHWC applies to 4-D tensors only; got shape ",
                       shape_);
    }

    void release() noexcept {
        if (data_ != nullptr && owned_) alloc::deallocate(data_, bytes(), device_);
        data_ = nullptr;
        owned_ = true;
    }

    T* data_ = nullptr;
    Shape shape_{0};  // a default tensor is empty, not a scalar
    MemoryFormat format_ = MemoryFormat::nchw;
    Device device_{device_kind_of<B>(), 0};  // no storage: where it would live does not matter
    bool owned_ = true;                      // false for a view: the memory is someone else's
};

//! Host tensor holding a copy of `values` with `shape`.
template <class T>
Tensor<T, Host> make_tensor(Shape shape, std::span<const T> values, MemoryFormat format = MemoryFormat::nchw) {
    LOCKSTEP_CHECK_AS(ShapeError, static_cast<std::int64_t>(values.size()) == shape.numel(), "shape ", shape, " holds ",
                      shape.numel(), " elements but ", values.size(), " values were given");
    Tensor<T, Host> t(shape, format);
    if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(T));
    return t;
}

}  // namespace lockstep
