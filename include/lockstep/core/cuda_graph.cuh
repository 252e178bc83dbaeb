// SPDX-License-Identifier: MIT
//! CUDA graphs: `cuda::Graph` (stream work captured once and launched again) and `cuda::GraphCache`
//! (graphs kept by what they depend on), with the memory rules their allocations follow.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/core/cuda_runtime.cuh"
#include "lockstep/core/error.hpp"

namespace lockstep::cuda {

namespace detail {
//! Live executables of this process on `device` (none counted past device 255): where
//! GraphCache::clear may trim the graph pool (Note [graph memory]).
inline std::atomic<int>& live_graphs(int device) {
    static std::atomic<int> counts[256];
    static std::atomic<int> beyond{1};  // never 0: no trim where nothing is counted
    return device >= 0 && device < 256 ? counts[device] : beyond;
}
}  // namespace detail

// Note [graphs]
// A `Graph` is stream work recorded once and run again by one launch: the kernels, copies, cuBLAS
// and cuDNN calls and NCCL collectives that a function enqueues on a stream, and on streams it
// forks from that one through events (which must join it again before the end), are captured
// instead of run; each launch() runs them all with what they had at capture: the same buffers,
// sizes and host scalars. A launch costs one call however many kernels the graph holds.
// - The capture is thread-local (cudaStreamCaptureModeThreadLocal): replica threads capture side
//   by side, and other threads' allocations do not break them. The capturing thread must not do
//   what CUDA refuses during a capture: synchronize, cudaMalloc or cudaFree, copy pageable host
//   memory, wait for work recorded outside the capture. The first step, run eagerly, grows the
//   replica's workspaces so that a captured step allocates none of them.
// - Memory the stream-ordered allocator gives inside the capture is the graph's: a tensor made
//   there must also be released there (temporaries of a step are).
// - A collective in a graph meets its peers' collectives at each launch: every replica launches
//   its graph of the same collectives, in the same order, as an eager step would enqueue them. A
//   graph holds its communicators: after an abort or a group rebuild, capture again.
// - A graph holds the addresses it was captured with: `GraphCache` keys graphs by everything
//   they depend on (the input's shape, nn::structure_signature of the module), so a new shape or
//   a replaced parameter captures again.
// - Memory (Note [graph memory]): allocations made in the capture get memory from the device's
//   graph pool at the executable's upload or first launch, and that can fail. `capture` gives the
//   default pool's cached bytes back first and uploads the executable on the capturing stream, so
//   a graph that does not fit fails where it is made (its caller waits for the upload), never at
//   a launch that peers' launches depend on; `GraphCache::clear` trims the graph pool.
// On the host CUDA device a kernel is a host function whose parameters live in a heap block; a GPU
// graph keeps a kernel's parameters in its node, and here the graph keeps the block, as a user
// object freed with the graph (launch.cuh).

// Note [graph memory]
// A graph's allocation nodes (the stream-ordered allocations of its capture) get physical memory
// from the device's graph pool when its executable is uploaded or first launched, not at the
// capture: a launch near the device's capacity returns cudaErrorMemoryAllocation. DataParallel's
// replicas launch graph (a) after agreeing to (Note [captured steps]), and a replica whose launch
// fails then leaves its peers' launched collectives waiting for it. So `Graph::capture` uploads
// the executable at once (on the capturing stream, which the caller waits for before any replica
// launches), and the memory stays the executable's while it lives: later launches take none,
// unless a trim of the graph pool takes it back. Two caches would otherwise keep memory from the
// graphs: the default pool keeps every freed byte (its release threshold: configure_pool), so
// `capture` trims it first; the graph pool keeps the memory of destroyed executables, so
// `GraphCache::clear` trims it after, but only where no graph of this process is alive on the
// device (cudaDeviceGraphMemTrim takes back the memory of every graph not running, uploaded or
// not, whose next launch would then need it again: after another object's replicas voted).

//! Captured stream work, instantiated for launching (move-only; Note [graphs]).
class Graph {
public:
    Graph() = default;
    //! Captures what `record()` enqueues on `stream` (a stream of its own, not the legacy one) and
    //! instantiates it for the stream's device. When `record` throws, the capture is ended and
    //! dropped and the exception goes on; a capture CUDA refuses throws DeviceError saying why.
    //! The executable is uploaded on `stream` (Note [graph memory]): wait for the stream before
    //! relying on the upload's success.
    template <class Record>
    static Graph capture(cudaStream_t stream, Record&& record) {
        LOCKSTEP_CHECK_AS(UsageError, stream != nullptr && stream != cudaStreamLegacy,
                          "cuda::Graph::capture needs a stream of its own: the legacy default stream cannot capture");
        int device = -1;
        LOCKSTEP_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
        DeviceGuard guard(device);
        Graph g;
        g.device_ = device;
        // The default pool's cached bytes (it keeps them all: configure_pool) could otherwise
        // leave the graph pool no memory; the pool grows again as eager steps need it.
        cudaMemPool_t pool = nullptr;
        LOCKSTEP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
        LOCKSTEP_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
        LOCKSTEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        try {
            record();
        } catch (...) {
            cudaGraph_t dropped = nullptr;
            if (cudaStreamEndCapture(stream, &dropped) == cudaSuccess && dropped != nullptr) (void)cudaGraphDestroy(dropped);
            (void)cudaGetLastError();
            throw;
        }
        if (const cudaError_t e = cudaStreamEndCapture(stream, &g.graph_); e != cudaSuccess) refused(e, "capturing");
        if (const cudaError_t e = cudaGraphInstantiate(&g.exec_, g.graph_, 0); e != cudaSuccess) refused(e, "instantiating");
        detail::live_graphs(device).fetch_add(1);
        if (const cudaError_t e = cudaGraphUpload(g.exec_, stream); e != cudaSuccess) refused(e, "uploading");
        return g;
    }
    Graph(Graph&& o) noexcept
        : graph_(std::exchange(o.graph_, nullptr)), exec_(std::exchange(o.exec_, nullptr)), device_(o.device_) {}
    Graph& operator=(Graph&& o) noexcept {
        if (this != &o) {
            destroy();
            graph_ = std::exchange(o.graph_, nullptr);
            exec_ = std::exchange(o.exec_, nullptr);
            device_ = o.device_;
        }
        return *this;
    }
    ~Graph() { destroy(); }

    //! Enqueues one run of the graph on `stream` (of the graph's device), after its earlier work.
    void launch(cudaStream_t stream) const {
        LOCKSTEP_CHECK_AS(UsageError, exec_ != nullptr, "launching an empty cuda::Graph: make one with Graph::capture");
        DeviceGuard guard(device_);
        LOCKSTEP_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
    }
    bool empty() const noexcept { return exec_ == nullptr; }
    int device() const noexcept { return device_; }

private:
    [[noreturn]] static void refused(cudaError_t e, const char* doing) {
        (void)cudaGetLastError();
        int device = -1;
        if (cudaGetDevice(&device) != cudaSuccess) device = -1;
        // The capture's own refusals (and a graph whose memory outlives it) get what to change;
        // anything else (a fault, memory) is the device's error as every other call reports it.
        const bool capture_rule =
            (e >= cudaErrorStreamCaptureUnsupported && e <= cudaErrorStreamCaptureWrongThread) || e == cudaErrorNotSupported;
        std::string message =
            std::string(doing) + " a CUDA graph failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
        if (e == cudaErrorMemoryAllocation)
            throw OutOfMemory(std::move(message) +
                                  "; the graph's allocations do not fit beside what the GPU holds: use a smaller batch, "
                                  "fewer replicas per GPU, or leave graphs off",
                              ::lockstep::detail::replica_rank_slot(), device);
        if (!capture_rule) throw DeviceError(std::move(message), ::lockstep::detail::replica_rank_slot(), device);
        throw CaptureRefused(std::move(message) +
                                 "; the recorded work must not synchronize, allocate with cudaMalloc, free memory made "
                                 "outside the capture, copy pageable host memory, wait for work outside the capture, leave "
                                 "a stream it forked unjoined, or keep memory allocated in the capture past its end",
                             ::lockstep::detail::replica_rank_slot(), device);
    }
    void destroy() noexcept {
        if (exec_ != nullptr) {
            (void)cudaGraphExecDestroy(std::exchange(exec_, nullptr));
            detail::live_graphs(device_).fetch_sub(1);
        }
        if (graph_ != nullptr) (void)cudaGraphDestroy(std::exchange(graph_, nullptr));
    }
    cudaGraph_t graph_ = nullptr;
    cudaGraphExec_t exec_ = nullptr;
    int device_ = -1;
};

//! Captured graphs by what they depend on, at most `capacity` of them, the least recently
//! launched dropped first (Note [graphs]). A key is compared whole: say in it everything the
//! recorded work depends on, such as the input's shape and nn::structure_signature of the module,
//! so that a new shape or a changed module captures again instead of launching a stale graph.
class GraphCache {
public:
    using Key = std::vector<std::int64_t>;

    explicit GraphCache(std::size_t capacity = 8) : capacity_(capacity) {
        LOCKSTEP_CHECK_AS(UsageError, capacity > 0, "a cuda::GraphCache holds at least one graph");
    }

    //! Launches the graph kept for `key` on `stream`; without one, first captures `record` on
    //! `stream` (Graph::capture), dropping the least recently launched graph past the capacity.
    //! Returns whether it captured. A capture that throws keeps nothing.
    template <class Record>
    bool launch(const Key& key, cudaStream_t stream, Record&& record) {
        const bool captured = prepare(key, stream, std::forward<Record>(record));
        const auto it = index_.find(key);
        order_.splice(order_.begin(), order_, it->second);  // most recent first
        it->second->second.launch(stream);
        return captured;
    }

    //! Captures `record` for `key` unless a graph is kept for it, without launching; returns
    //! whether it captured (`launch` then launches it). A capture that throws keeps nothing.
    template <class Record>
    bool prepare(const Key& key, cudaStream_t stream, Record&& record) {
        if (index_.count(key) != 0) return false;
        Graph g = Graph::capture(stream, std::forward<Record>(record));
        if (order_.size() >= capacity_) {
            index_.erase(order_.back().first);
            order_.pop_back();  // its graph is destroyed; its launches already enqueued still run
        }
        order_.emplace_front(key, std::move(g));
        index_.emplace(key, order_.begin());
        return true;
    }
    //! Drops the graph kept for `key`, if any.
    void erase(const Key& key) {
        const auto it = index_.find(key);
        if (it == index_.end()) return;
        order_.erase(it->second);
        index_.erase(it);
    }

    //! Drops every graph: after an abort or a group rebuild, whose communicators the graphs hold.
    //! The graph pool's memory they held goes back to each device where no graph of this process
    //! is left (Note [graph memory]).
    void clear() noexcept {
        std::vector<int> devices;
        for (const auto& [key, g] : order_)
            if (std::find(devices.begin(), devices.end(), g.device()) == devices.end()) devices.push_back(g.device());
        index_.clear();
        order_.clear();
        for (const int d : devices)
            if (detail::live_graphs(d).load() == 0) (void)cudaDeviceGraphMemTrim(d);
        (void)cudaGetLastError();
    }
    bool contains(const Key& key) const { return index_.count(key) != 0; }
    std::size_t size() const noexcept { return order_.size(); }
    std::size_t capacity() const noexcept { return capacity_; }

private:
    struct KeyHash {
        std::size_t operator()(const Key& k) const noexcept {
            std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the values; equality decides
            for (const std::int64_t v : k) h = (h ^ static_cast<std::uint64_t>(v)) * 1099511628211ull;
            return static_cast<std::size_t>(h);
        }
    };
    std::size_t capacity_;
    std::list<std::pair<Key, Graph>> order_;  // most recently launched first
    std::unordered_map<Key, std::list<std::pair<Key, Graph>>::iterator, KeyHash> index_;
};

}  // namespace lockstep::cuda
