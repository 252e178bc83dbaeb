// SPDX-License-Identifier: MIT
//! `kernels::Ops<Cuda>`: the backend operations on CUDA devices, made of the layer operations
//! (cuda_layer_ops.cuh), the batch-norm operations (cuda_bn_ops.cuh), the replica's resources and
//! the copies.
#pragma once

#include <chrono>
#include <cstdlib>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/core/cuda_graph.cuh"
#include "lockstep/kernels/cuda_bn_ops.cuh"
#include "lockstep/kernels/cuda_common.cuh"
#include "lockstep/kernels/cuda_layer_ops.cuh"

namespace lockstep::kernels {

//! The CUDA backend's operations (see Note [backend operations]): every operation is enqueued on
//! the replica's stream (`Execution<Cuda>::stream`).
template <>
struct Ops<Cuda> : cuda_ops::LayerOps, cuda_ops::BatchNormOps {
    using Ex = Execution<Cuda>;
    template <class T>
    using T_ = Tensor<T, Cuda>;

    // ---- replicas ----------------------------------------------------------------------------

    //! Process-wide, while replicas exist: asks CUDA to load every kernel of the program when it
    //! initializes (CUDA_MODULE_LOADING=EAGER, unless the environment says otherwise). CUDA loads
    //! kernels lazily by default, and loading one can wait for the device while a peer's NCCL
    //! kernel spins. This takes effect only if CUDA is not initialized yet in the process: set
    //! CUDA_MODULE_LOADING=EAGER in the environment to be sure (scripts/gpu-check.sh does).
    struct Runtime {
        Runtime() noexcept { (void)::setenv("CUDA_MODULE_LOADING", "EAGER", 0); }
    };

    //! What a replica owns on its GPU: a non-blocking compute stream, a cuBLAS handle bound to it
    //! with its own workspace, and the reducing kernels' scratch (one allocation laid out by
    //! device::ScratchLayout; tickets zeroed once, then left at zero by every kernel). Made on the
    //! replica's thread. A thread works for the replica through `enter()` (a guard) or, for the
    //! replica's own persistent threads, `bind_thread()` (Note [current stream]).
    struct ReplicaResources {
        //! cuBLAS workspace per replica (what cuBLAS asks for on Hopper).
        static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;

        explicit ReplicaResources(const Device& d) : device(d.index) {
            LOCKSTEP_CHECK_AS(DeviceMismatch, d.kind == Device::Kind::cuda, "a CUDA replica needs a CUDA device, got ", d.str());
            const int gpus = cuda::device_count();
            LOCKSTEP_CHECK_AS(DeviceMismatch, d.index >= 0 && d.index < gpus, "no GPU ", d.str(), " here (", gpus,
                              " visible); pick one of cuda:0..cuda:", gpus - 1, " or use the host backend");
            cuda::DeviceGuard guard(device);
            stream = cuda::Stream(device);
            try {
                done = cuda::Event();
                inputs_read = cuda::Event();
                LOCKSTEP_CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
                LOCKSTEP_CUDA_CHECK(cudaMalloc(&scratch, device::ScratchLayout::total_bytes));
                scratch_view = device::ScratchLayout::view(scratch);
                LOCKSTEP_CUDA_CHECK(
                    cudaMemsetAsync(scratch_view.counters, 0, device::ScratchLayout::counter_bytes, stream.get()));
                LOCKSTEP_CUBLAS_CHECK(cublasCreate(&blas));
                LOCKSTEP_CUBLAS_CHECK(cublasSetStream(blas, stream.get()));
                LOCKSTEP_CUBLAS_CHECK(cublasSetWorkspace(blas, workspace, workspace_bytes));
                layers = std::make_unique<cuda_ops::LayerWorkspace>();
                scalars = std::make_unique<cuda::PinnedScalars>();
#if LOCKSTEP_WITH_CUDNN
                cudnn = cuda_ops::CudnnConvolutions::make(device);  // null: im2col (Note [cuDNN convolutions])
#endif
                cuda::wait_stream(stream.get(), "zeroing a replica's scratch");  // once, at creation: the tickets are zero
            } catch (...) {
                release();
                throw;
            }
        }
        ReplicaResources(const ReplicaResources&) = delete;
        ReplicaResources& operator=(const ReplicaResources&) = delete;
        ~ReplicaResources() { release(); }

        Ex execution() const {
            Ex ex;
            ex.device = device;
            ex.stream = stream.get();
            ex.stream_owner = stream.token();
            ex.blas = blas;
            ex.workspace = workspace;
            ex.workspace_bytes = workspace_bytes;
            ex.scratch = scratch_view;
            ex.layer_workspace = layers.get();
#if LOCKSTEP_WITH_CUDNN
            ex.cudnn = cudnn.get();
#endif
            ex.done_event = done.get();
            ex.inputs_read_event = inputs_read.get();
            ex.scalars = scalars.get();
            return ex;
        }

        //! While the guard lives, the replica's device and stream are the calling thread's (new
        //! tensors are allocated, and freed, on that stream); then the previous ones are again.
        class Entered {
        public:
            explicit Entered(const ReplicaResources& r) : device_(r.device), stream_(r.stream) {}

        private:
            cuda::DeviceGuard device_;
            cuda::StreamGuard stream_;
        };
        [[nodiscard]] Entered enter() const { return Entered(*this); }

        //! Makes the replica's device and stream the calling thread's for the rest of its life (the
        //! replica's own threads). Once these resources are destroyed, the thread's current stream
        //! reads as the legacy stream (Note [current stream]).
        void bind_thread() const {
            LOCKSTEP_CUDA_CHECK(cudaSetDevice(device));
            cuda::StreamGuard::bind_thread(stream);
        }

        int device;
        cuda::Stream stream;
        cuda::Event done{nullptr};         // host waits on the stream poll it (Ops<Cuda>::wait)
        cuda::Event inputs_read{nullptr};  // recorded after a call's copies of the caller's input
        cublasHandle_t blas = nullptr;
        void* workspace = nullptr;
        void* scratch = nullptr;
        device::Scratch scratch_view;
        std::unique_ptr<cuda_ops::LayerWorkspace> layers;    // the convolutions' buffers (Note [one layer workspace])
        std::unique_ptr<cuda_ops::CudnnConvolutions> cudnn;  // with cuDNN only (Note [cuDNN convolutions])
        std::unique_ptr<cuda::PinnedScalars> scalars;        // captured steps' scalars (Note [captured steps])

    private:
        void release() noexcept {
            if (device < 0) return;
            cuda::QuietDeviceGuard guard(device);  // this replica's device, whichever thread releases it
            if (stream.get() != nullptr) {
                try {  // the stream's work must be done before its handles go: bounded, then released anyway
                    cuda::wait_stream(stream.get(), "a replica's last work at teardown");
                } catch (...) {
                    if (scalars) scalars->abandon();  // a graph's copy may still land there
                }
            }
            scalars.reset();
            layers.reset();  // freed in the stream's order, before the stream goes
            cudnn.reset();   // its work on the stream is done (waited above)
            if (blas != nullptr) (void)cublasDestroy(blas);
            if (workspace != nullptr) (void)cudaFree(workspace);
            if (scratch != nullptr) (void)cudaFree(scratch);
            blas = nullptr;
            workspace = scratch = nullptr;
            scratch_view = {};
            stream = cuda::Stream();  // its token expires: no thread's current stream names it now
        }
    };

    //! A named NVTX range (Nsight Systems shows the step's forward, backward, collectives and
    //! optimizer step on each replica thread, and their overlap with the streams' work).
    using Range = cuda::NvtxRange;

    // ---- captured steps (Note [captured steps] in parallel/step.hpp) --------------------------

    //! A replica's step can be captured as a CUDA graph and launched again (Note [graphs]).
    static constexpr bool graphs = true;
    //! Convolutions and linear layers can run their products on bfloat16 (Note [precision]).
    static constexpr bool bf16_products = true;
    //! Convolutions, linear layers, ReLU, max pooling and batch norm take activations stored in
    //! bf16 (Note [activation precision]).
    static constexpr bool bf16_activations = true;
    //! Throws UsageError unless `device` can run bf16 products (compute capability 8.0 or newer);
    //! `what` names the option that asked.
    static void check_bf16(const Device& device, const char* what) { cuda_ops::check_bf16_device(device.index, what); }
    using GraphCache = cuda::GraphCache;
    //! Launches `cache`'s graph for `key` on the replica's stream, capturing `record` first when
    //! it holds none; returns whether it captured.
    template <class Record>
    static bool launch_graph(const Ex& ex, GraphCache& cache, const GraphCache::Key& key, Record&& record) {
        return cache.launch(key, ex.stream, std::forward<Record>(record));
    }
    //! Makes the replica's pinned step scalars hold at least `n` values: before a captured step's
    //! key is made, which holds their address (add_graph_key).
    static void reserve_step_scalars(const Ex& ex, std::size_t n) {
        LOCKSTEP_CHECK(ex.scalars != nullptr, "an execution made by hand has no pinned step scalars");
        ex.scalars->reserve(n);
    }
    //! Enqueues the copy of `t` into the replica's pinned step scalars (reserved for it): in a
    //! captured step, the end of its graph (a).
    static void stage_step_scalars(const Ex& ex, const T_<double>& t) {
        LOCKSTEP_CHECK(ex.scalars != nullptr && static_cast<std::size_t>(t.numel()) <= ex.scalars->capacity(),
                       "the step scalars hold ", ex.scalars != nullptr ? ex.scalars->capacity() : 0, " values, not ", t.numel(),
                       "; reserve_step_scalars first");
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(ex.scalars->data(), t.data(), t.bytes(), cudaMemcpyDeviceToHost, ex.stream));
    }
    //! The first `n` staged step scalars, once the replica's stream has done its work so far (a
    //! polled wait against the replica's deadline, as `wait`).
    static std::vector<double> read_step_scalars(const Ex& ex, std::size_t n) {
        LOCKSTEP_CHECK(ex.scalars != nullptr && n <= ex.scalars->capacity(), "reading ", n, " step scalars from a block of ",
                       ex.scalars != nullptr ? ex.scalars->capacity() : 0);
        wait(ex, "reading a step's results from the device");
        const double* p = ex.scalars->data();
        return std::vector<double>(p, p + n);
    }

    //! Appends to `key` what a captured step holds of the replica beyond its module and its step's
    //! tensors: its device, where its convolutions' workspaces and its pinned step scalars lie,
    //! its math mode and precision.
    static void add_graph_key(const Ex& ex, GraphCache::Key& key) {
        key.push_back(ex.device);
        key.push_back(
            static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(ex.scalars != nullptr ? ex.scalars->data() : nullptr)));
        const void* ws = ex.layer_workspace != nullptr ? ex.layer_workspace->address() : nullptr;
        const void* ws16 = ex.layer_workspace != nullptr ? ex.layer_workspace->bf16_address() : nullptr;
        key.push_back(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(ws)));
        key.push_back(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(ws16)));
        key.push_back(static_cast<std::int64_t>(ex.precision) * 16 + static_cast<std::int64_t>(ex.math));
    }

    //! `replicas` replicas over the visible GPUs, round-robin: one per GPU, or all on the one GPU
    //! there is (a group takes no mix of both: Note [stream-ordered collectives]).
    static std::vector<Device> default_devices(int replicas) {
        LOCKSTEP_CHECK(replicas > 0, "DataParallel needs at least one replica, got ", replicas);
        const int gpus = cuda::device_count();
        LOCKSTEP_CHECK_AS(DeviceMismatch, gpus > 0, "DataParallel on CUDA found no GPU; use the host backend");
        LOCKSTEP_CHECK_AS(NotImplemented, replicas <= gpus || gpus == 1, replicas, " replicas over ", gpus,
                          " GPUs would put two on some GPUs and one on others, which a replica group does not "
                          "take; use at most ",
                          gpus, " replicas, or list the devices (all on one GPU: cuda:0, cuda:0, ...)");
        std::vector<Device> d;
        for (int r = 0; r < replicas; ++r) d.push_back(Device::cuda(r % gpus));
        return d;
    }

    // ---- generic (the rest is in LayerOps and BatchNormOps) -----------------------------------

    //! None: device memory is read on the host only after a wait, which a loss does not make
    //! (SoftmaxCrossEntropy leaves a CUDA tensor of labels unchecked: Note [captured steps]).
    static std::optional<std::span<const std::int64_t>> host_values(const T_<std::int64_t>&) { return std::nullopt; }

    //! dst[dst_offset, +count) = src[src_offset, +count), on the replica's stream, after the work
    //! of the streams the tensors were allocated on, which free them only after this copy (Note
    //! [current stream]): the caller's batch, made on the caller's stream, is read here.
    template <class T>
    static void copy(const Ex& ex, T_<T>& dst, std::int64_t dst_offset, const T_<T>& src, std::int64_t src_offset,
                     std::int64_t count) {
        if (count <= 0) return;
        cuda::DeviceGuard guard(ex.device);  // ex.stream may be a device's legacy stream (caller_execution)
        const cuda::detail::AllocationStreams::StreamRef stream{ex.stream, ex.device, ex.stream_owner,
                                                                cuda::detail::has_owner(ex.stream_owner)};
        cuda::detail::after_allocations(stream, {dst.data(), src.data()});
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst.data() + dst_offset, src.data() + src_offset,
                                            static_cast<std::size_t>(count) * sizeof(T), cudaMemcpyDefault, ex.stream));
    }

    //! Element `i` of `t`, on the host: waits for the replica's stream (see `wait`).
    template <class T>
    static T read(const Ex& ex, const T_<T>& t, std::int64_t i) {
        T value{};
        cuda::read_to_host(&value, t.data() + i, sizeof(T), ex.stream, [&] { wait(ex, "reading a value from the device"); });
        return value;
    }

    //! All of `t`'s elements on the host, in one copy into pinned memory whose completion is
    //! polled against the replica's deadline (see `wait`): a pageable copy would block until the
    //! stream drains, past any deadline, when a peer is dead.
    template <class T>
    static std::vector<T> to_vector(const Ex& ex, const T_<T>& t) {
        std::vector<T> out(static_cast<std::size_t>(t.numel()));
        if (!out.empty())
            cuda::read_to_host(out.data(), t.data(), t.bytes(), ex.stream,
                               [&] { wait(ex, "reading a step's results from the device"); });
        return out;
    }

    //! The caller's input has been read (its copies are enqueued on the replica's stream): record
    //! the point `wait_inputs_read` waits for.
    static void mark_inputs_read(const Ex& ex) {
        if (ex.inputs_read_event != nullptr)
            LOCKSTEP_CUDA_CHECK(cudaEventRecord(ex.inputs_read_event, ex.stream));
        else
            wait(ex, "copying the caller's input");  // an execution made by hand: wait now
    }
    //! Waits (bounded, see `wait`) until the copies marked by `mark_inputs_read` have run, so the
    //! caller may free or refill its input.
    static void wait_inputs_read(const Ex& ex) {
        if (ex.inputs_read_event != nullptr) wait_for(ex, ex.inputs_read_event, "copying the caller's input");
    }

    //! The execution of work the calling thread itself does on `d` (outside any replica): its
    //! current stream when that is of `d`, else `d`'s legacy stream.
    static Ex caller_execution(const Device& d) {
        const auto stream = cuda::detail::stream_on(d.index);
        Ex ex;
        ex.device = d.index;
        ex.stream = stream.stream;
        ex.stream_owner = stream.owner;
        return ex;
    }
    //! `waiter`'s stream runs its later work after what `producer`'s stream holds now (no host wait).
    static void order_after(const Ex& waiter, const Ex& producer) {
        cuda::order_after(waiter.stream, waiter.device, producer.stream, producer.device);
    }

    //! Waits until the replica's stream has done everything enqueued so far, with a deadline: an
    //! event polled until `ex.waits.timeout()` passes, consulting the replica's groups meanwhile
    //! (an aborted group or an NCCL error ends the wait). Past the deadline the groups are aborted
    //! and `Timeout` is thrown (Note [stream-ordered collectives] in comm/stream_group.hpp).
    static void wait(const Ex& ex, const char* what) {
        if (ex.done_event == nullptr) {  // an execution made by hand, not by ReplicaResources
            cuda::wait_stream(ex.stream, what, ex.waits.timeout());
            return;
        }
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(ex.done_event, ex.stream));
        wait_for(ex, ex.done_event, what);
    }

private:
    // Polls `event` until `ex.waits.timeout()` passes, consulting the replica's groups meanwhile.
    static void wait_for(const Ex& ex, cudaEvent_t event, const char* what) {
        cuda::wait_watched(event, ex.device, ex.waits, what, "DataParallelOptions::timeout");
    }
};

static_assert(BackendOps<Ops<Cuda>, Cuda>, "Ops<Cuda> lacks an operation of BackendOps (kernels/ops.hpp)");

}  // namespace lockstep::kernels
