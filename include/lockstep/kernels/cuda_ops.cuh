// SPDX-License-Identifier: MIT
//! `kernels::Ops<Cuda>`: the backend operations on CUDA devices, made of the layer operations
//! (cuda_layer_ops.cuh), the batch-norm operations (cuda_bn_ops.cuh), the replica's resources and
//! the copies.
#pragma once

#include <chrono>
#include <cstdlib>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

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
    //! with its own workspace, and the reducing kernels' scratch (tickets zeroed once, then left at
    //! zero by every kernel). Made on the replica's thread; `enter()` runs on every thread that
    //! works for the replica and makes the replica's device and stream current there.
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
                LOCKSTEP_CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
                const std::size_t counter_bytes = sizeof(unsigned int) * device::scratch_counters;
                LOCKSTEP_CUDA_CHECK(cudaMalloc(&scratch, counter_bytes + device::scratch_partial_bytes));
                LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(scratch, 0, counter_bytes, stream.get()));
                partials = static_cast<char*>(scratch) + counter_bytes;
                LOCKSTEP_CUBLAS_CHECK(cublasCreate(&blas));
                LOCKSTEP_CUBLAS_CHECK(cublasSetStream(blas, stream.get()));
                LOCKSTEP_CUBLAS_CHECK(cublasSetWorkspace(blas, workspace, workspace_bytes));
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
            ex.blas = blas;
            ex.workspace = workspace;
            ex.workspace_bytes = workspace_bytes;
            ex.reduce_counters = static_cast<unsigned int*>(scratch);
            ex.reduce_counter_count = device::scratch_counters;
            ex.reduce_partials = partials;
            ex.reduce_partial_bytes = device::scratch_partial_bytes;
            ex.done_event = done.get();
            return ex;
        }
        //! The replica's device and stream become the calling thread's (new tensors are allocated
        //! and freed on that stream).
        void enter() const {
            LOCKSTEP_CUDA_CHECK(cudaSetDevice(device));
            cuda::current_stream() = stream.get();
        }

        int device;
        cuda::Stream stream;
        cuda::Event done{nullptr};  // host waits on the stream poll it (Ops<Cuda>::wait)
        cublasHandle_t blas = nullptr;
        void* workspace = nullptr;
        void* scratch = nullptr;
        void* partials = nullptr;

    private:
        void release() noexcept {
            if (stream.get() != nullptr) {
                try {  // the stream's work must be done before its handles go: bounded, then released anyway
                    cuda::wait_stream(stream.get(), "a replica's last work at teardown");
                } catch (...) {
                }
            }
            if (blas != nullptr) (void)cublasDestroy(blas);
            if (workspace != nullptr) (void)cudaFree(workspace);
            if (scratch != nullptr) (void)cudaFree(scratch);
            blas = nullptr;
            workspace = scratch = partials = nullptr;
        }
    };

    //! A named NVTX range (Nsight Systems shows the step's forward, backward, collectives and
    //! optimizer step on each replica thread, and their overlap with the streams' work).
    using Range = cuda::NvtxRange;

    //! `replicas` replicas over the visible GPUs, round-robin: one per GPU, or all on the one GPU
    //! there is (a group takes no mix of both: Note [stream-ordered collectives]).
    static std::vector<Device> default_devices(int replicas) {
        LOCKSTEP_CHECK(replicas > 0, "DataParallel needs at least one replica, got ", replicas);
        const int gpus = cuda::device_count();
        LOCKSTEP_CHECK_AS(DeviceMismatch, gpus > 0, "DataParallel on CUDA found no GPU; use the host backend");
        LOCKSTEP_CHECK_AS(NotImplemented, replicas <= gpus || gpus == 1, replicas, " replicas over ", gpus,
                          " GPUs would put two on some GPUs and one on others, which a replica group does not "
                          "take; use at most ", gpus, " replicas, or list the devices (all on one GPU: cuda:0, cuda:0, ...)");
        std::vector<Device> d;
        for (int r = 0; r < replicas; ++r) d.push_back(Device::cuda(r % gpus));
        return d;
    }

    // ---- generic (the rest is in LayerOps and BatchNormOps) -----------------------------------

    //! dst[dst_offset, +count) = src[src_offset, +count), on the replica's stream.
    template <class T>
    static void copy(const Ex& ex, T_<T>& dst, std::int64_t dst_offset, const T_<T>& src, std::int64_t src_offset,
                     std::int64_t count) {
        if (count <= 0) return;
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst.data() + dst_offset, src.data() + src_offset,
                                            static_cast<std::size_t>(count) * sizeof(T), cudaMemcpyDefault, ex.stream));
    }

    //! Element `i` of `t`, on the host: waits for the replica's stream (see `wait`).
    template <class T>
    static T read(const Ex& ex, const T_<T>& t, std::int64_t i) {
        T value{};
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(&value, t.data() + i, sizeof(T), cudaMemcpyDeviceToHost, ex.stream));
        wait(ex, "reading a value from the device");
        return value;
    }

    //! All of `t`'s elements on the host, in one copy: waits for the replica's stream (see `wait`).
    template <class T>
    static std::vector<T> to_vector(const Ex& ex, const T_<T>& t) {
        std::vector<T> out(static_cast<std::size_t>(t.numel()));
        if (!out.empty()) {
            LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(out.data(), t.data(), t.bytes(), cudaMemcpyDeviceToHost, ex.stream));
            wait(ex, "reading a step's results from the device");
        }
        return out;
    }

    //! Waits until the replica's stream has done everything enqueued so far, with a deadline: an
    //! event polled until `ex.wait_timeout_ms` passes, consulting the replica's groups meanwhile
    //! (an aborted group or an NCCL error ends the wait). Past the deadline the groups are aborted
    //! and `Timeout` is thrown (Note [stream-ordered collectives] in comm/stream_group.hpp).
    static void wait(const Ex& ex, const char* what) {
        if (ex.done_event == nullptr) {  // an execution made by hand, not by ReplicaResources
            cuda::wait_stream(ex.stream, what, std::chrono::milliseconds(ex.wait_timeout_ms));
            return;
        }
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(ex.done_event, ex.stream));
        cuda::poll_event(
            ex.done_event, std::chrono::milliseconds(ex.wait_timeout_ms),
            [&] {
                for (DeviceWatch* w : ex.watches)
                    if (w != nullptr) w->poll();
            },
            [&] {
                const std::string message = std::string(what) + " on cuda:" + std::to_string(ex.device) + " took longer than " +
                                            std::to_string(ex.wait_timeout_ms) +
                                            " ms; a peer replica may be stuck (raise DataParallelOptions::timeout if "
                                            "the step is legitimately that slow)";
                for (DeviceWatch* w : ex.watches)
                    if (w != nullptr) w->timed_out(message);
                throw Timeout(message);
            });
    }
};

}  // namespace lockstep::kernels
