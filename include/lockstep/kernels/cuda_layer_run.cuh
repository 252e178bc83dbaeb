// SPDX-License-Identifier: MIT
//! What the CUDA layer operations (cuda_layer_ops.cuh) run with: the replica's convolution
//! workspace, the device as a runner of the layer kernels and cuBLAS products, the argument checks
//! and the pinned staging of the labels.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "lockstep/kernels/cuda_common.cuh"
#include "lockstep/kernels/device/gemm_layers.cuh"
#include "lockstep/kernels/device/launch.cuh"
#include "lockstep/kernels/device/layer_kernels.cuh"

namespace lockstep::kernels::cuda_ops {

// Note [one layer workspace]
// A convolution on CUDA needs its shard's im2col columns, their gradient and a channel-major dy
// (Note [convolution on CUDA]): floats in proportion to the batch, for the length of one call (in
// bf16 precision the columns, dy's copy and the weight are bf16, in the workspace's second buffer,
// and the first holds a bf16 output's fp32 sums before their rounding: Note [precision]). They live in the replica's one
// LayerWorkspace (owned by its ReplicaResources, reached through Execution<Cuda>::layer_workspace), not in each layer: a
// network's convolutions run one after the other on the replica's stream, so each may reuse what the previous one wrote, and the
// replica holds the largest layer's need once instead of every layer's. The workspace grows when a larger need comes (the old
// allocation is freed in the stream's order, after the work that read it) and never shrinks. An execution, and so its workspace,
// serves one thread at a time, as its stream does.

//! A replica's buffer for its convolutions (Note [one layer workspace]).
class LayerWorkspace {
public:
    //! Offsets of the buffers inside the workspace are multiples of this many floats (256 bytes).
    static constexpr std::int64_t align = 64;

    //! At least `floats` floats on `device`, grown when needed; call it while a LayerRun lives
    //! (the allocation and any free are on the replica's stream).
    float* at_least(std::int64_t floats, int device) { return grown(buffer_, floats, device); }
    //! At least `elements` bfloat16 values on `device` (Note [precision]: a product's operands
    //! rounded for cuBLAS), a second buffer grown and freed as the first.
    __nv_bfloat16* bf16_at_least(std::int64_t elements, int device) { return grown(narrow_, elements, device); }
    //! Where the buffer lies (a captured step's identity: it holds the address; Note [captured
    //! steps] in parallel/step.hpp). A buffer grown in place of another may lie where that one
    //! did: it is then at least as large, so a graph made with the old one still fits.
    const void* address() const noexcept { return buffer_.data(); }
    //! Where the bfloat16 buffer lies (the same identity for it).
    const void* bf16_address() const noexcept { return narrow_.data(); }
    //! Floats held now: the largest need so far.
    std::int64_t floats() const noexcept { return buffer_.numel(); }
    //! `n` rounded up to the alignment.
    static constexpr std::int64_t aligned(std::int64_t n) noexcept { return (n + align - 1) / align * align; }

private:
    //! `buffer`, replaced by one of at least `n` elements on `device` when it is smaller or elsewhere.
    template <class T>
    static T* grown(T_<T>& buffer, std::int64_t n, int device) {
        if (n <= 0) return buffer.data();
        if (buffer.numel() < n || buffer.device() != Device::cuda(device)) {
            buffer = T_<T>();  // freed first (in stream order): the pool may hand its memory to the new one
            buffer = T_<T>(Shape{n}, MemoryFormat::nchw, Device::cuda(device), uninitialized);
        }
        return buffer.data();
    }

    T_<float> buffer_;
    T_<__nv_bfloat16> narrow_;
};

namespace layer_detail {

namespace lk = device::layer_kernels;

//! The device as a runner of the layer kernels (Note [kernel runners]): kernels and cuBLAS calls on
//! the replica's stream. For the runner's lifetime the replica's device is current and its stream
//! is the thread's current one, so tensors made meanwhile are allocated, and freed, in the
//! stream's order.
struct LayerRun : device::DeviceRun {
    explicit LayerRun(const Ex& ex)
        : device_guard(ex.device),
          stream_guard(ex.stream, ex.device, ex.stream_owner),
          blas(ex.blas),
          math(ex.math),
          precision(ex.precision),
          layer_workspace(ex.layer_workspace),
          ordinal(ex.device) {
        LOCKSTEP_CHECK_AS(UsageError, ex.blas != nullptr,
                          "a CUDA layer operation ran without its replica's cuBLAS handle; "
                          "run it with the execution of a replica's resources (kernels::Ops<Cuda>::ReplicaResources)");
        stream = ex.stream;
        device = device_info(ex.device);
        scratch_view = cuda_ops::scratch(ex);
    }

    //! One cuBLAS SGEMM as `call` says (gemm_layers.cuh: Note [convolution on CUDA]), in the math
    //! the replica's mode allows the layer it serves (Note [math modes]); in bf16 precision one
    //! GEMM on the operands rounded to bfloat16 (Note [precision]).
    void gemm(const lk::GemmCall& c) {
        if (precision == Precision::bf16) return gemm_bf16(c);
        LOCKSTEP_CUBLAS_CHECK(
            cublasSetMathMode(blas, allows_tf32(math, c.of) ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
        const cublasOperation_t ta = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
        if (c.batch == 1)
            LOCKSTEP_CUBLAS_CHECK(
                cublasSgemm(blas, ta, tb, c.m, c.n, c.k, &c.alpha, c.a, c.lda, c.b, c.ldb, &c.beta, c.c, c.ldc));
        else
            LOCKSTEP_CUBLAS_CHECK(cublasSgemmStridedBatched(blas, ta, tb, c.m, c.n, c.k, &c.alpha, c.a, c.lda, c.stride_a, c.b,
                                                            c.ldb, c.stride_b, &c.beta, c.c, c.ldc, c.stride_c, c.batch));
    }

    //! Elements an operand of `rows` x `cols` (column-major, leading dimension `ld`) spans over
    //! `batch` matrices `stride` apart: what its bfloat16 copy holds, gaps included.
    static std::int64_t span_of(int rows, int cols, int ld, long long stride, int batch) {
        const std::int64_t one = std::int64_t{ld} * (cols - 1) + rows;
        return batch > 1 ? std::int64_t{stride} * (batch - 1) + one : one;
    }

    //! UsageError unless `device` can run bf16 products (asked once per device and thread, as
    //! device_info).
    static void check_bf16_once(int device) {
        static thread_local int checked = -1;
        if (checked == device) return;
        check_bf16_device(device, "Precision::bf16 products");
        checked = device;
    }

    //! `c` on bfloat16 copies of its operands (rounded to nearest by lk::to_bf16, in the replica's
    //! workspace), accumulated in fp32 into its fp32 result with alpha and beta as given.
    void gemm_bf16(const lk::GemmCall& c) {
        LOCKSTEP_CHECK_AS(UsageError, layer_workspace != nullptr,
                          "a bf16 product on CUDA ran without its replica's layer workspace; "
                          "run it with the execution of a replica's resources (kernels::Ops<Cuda>::ReplicaResources)");
        const std::int64_t na = span_of(c.trans_a ? c.k : c.m, c.trans_a ? c.m : c.k, c.lda, c.stride_a, c.batch),
                           nb = span_of(c.trans_b ? c.n : c.k, c.trans_b ? c.k : c.n, c.ldb, c.stride_b, c.batch);
        // The second operand at a 256-byte boundary, as the first (cuBLAS's fastest kernels want
        // 16-byte aligned operands).
        const std::int64_t at_b = bf16_aligned(na);
        __nv_bfloat16* a16 = layer_workspace->bf16_at_least(at_b + nb, ordinal);
        __nv_bfloat16* b16 = a16 + at_b;
        lk::to_bf16(*this, c.a, a16, na);
        lk::to_bf16(*this, c.b, b16, nb);
        gemm_on_bf16(c, a16, b16);
    }

    //! bf16 elements rounded up to 256 bytes: where the next operand starts in the bf16 buffer.
    static constexpr std::int64_t bf16_aligned(std::int64_t n) noexcept { return (n + 127) / 128 * 128; }

    //! `c` with its operands already rounded to bfloat16 at `a16` and `b16` (laid out as c.a and
    //! c.b), accumulated in fp32 into its fp32 result; an empty product as lk::gemm does it
    //! (nothing, or C = 0 for an empty inner dimension with beta 0).
    void gemm_on_bf16(const lk::GemmCall& c, const __nv_bfloat16* a16, const __nv_bfloat16* b16) {
        if (c.m == 0 || c.n == 0 || c.batch == 0) return;
        if (c.k == 0) {
            if (c.beta == 0.0f) lk::fill(*this, c.c, std::int64_t{c.m} * c.n * c.batch, 0.0f);
            return;
        }
        check_bf16_once(ordinal);
        LOCKSTEP_CUBLAS_CHECK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
        const cublasOperation_t ta = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
        if (c.batch == 1)
            LOCKSTEP_CUBLAS_CHECK(cublasGemmEx(blas, ta, tb, c.m, c.n, c.k, &c.alpha, a16, CUDA_R_16BF, c.lda, b16, CUDA_R_16BF,
                                               c.ldb, &c.beta, c.c, CUDA_R_32F, c.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        else
            LOCKSTEP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
                blas, ta, tb, c.m, c.n, c.k, &c.alpha, a16, CUDA_R_16BF, c.lda, c.stride_a, b16, CUDA_R_16BF, c.ldb, c.stride_b,
                &c.beta, c.c, CUDA_R_32F, c.ldc, c.stride_c, c.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }

    cuda::DeviceGuard device_guard;
    cuda::StreamGuard stream_guard;
    cublasHandle_t blas;
    Math math;
    Precision precision;
    LayerWorkspace* layer_workspace;
    int ordinal;
};

//! The replica's convolution workspace, or UsageError for an execution made without one.
inline LayerWorkspace& workspace(const Ex& ex) {
    LOCKSTEP_CHECK_AS(UsageError, ex.layer_workspace != nullptr,
                      "a CUDA convolution ran without its replica's layer workspace; "
                      "run it with the execution of a replica's resources (kernels::Ops<Cuda>::ReplicaResources)");
    return *ex.layer_workspace;
}

//! The replica's workspace as cuDNN takes it: at least `bytes` bytes (null for none).
struct WorkspaceBytes {
    const Ex& ex;
    void* operator()(std::size_t bytes) const {
        if (bytes == 0) return nullptr;
        const auto floats = static_cast<std::int64_t>((bytes + sizeof(float) - 1) / sizeof(float));
        return workspace(ex).at_least(floats, ex.device);
    }
};

//! Throws DeviceMismatch unless a tensor with elements is on the replica's device.
template <class T>
void check_on(const Ex& ex, const T_<T>& t, const char* what) {
    if (t.numel() > 0) check_device(Device::cuda(ex.device), t.device(), what);
}

//! Throws ShapeError unless `t` has `n` elements.
template <class T>
void check_numel(const T_<T>& t, std::int64_t n, const char* op, const char* what) {
    LOCKSTEP_CHECK_AS(ShapeError, t.numel() == n, op, " on CUDA: ", what, " has ", t.numel(), " elements, expected ", n);
}

// Note [labels on the device]
// softmax_cross_entropy takes its labels as a host span, and the kernel reads them on the device.
// A cudaMemcpyAsync from pageable memory may first wait for the stream's earlier work (the driver
// stages pageable memory synchronously), which would stall the host at every loss until the
// forward has run. So the labels are copied into a pinned staging slot of the calling thread (a
// ring of 4 per device, each grown as needed), and the copy from there is enqueued on the
// replica's stream, asynchronous; an event recorded after it says when the slot may be written
// again, and a slot is rewritten only after that event (four losses later: normally long past,
// so the wait is free). The device copy is a tensor made on the replica's stream for the call and
// freed in stream order after the kernel that reads it, so it is never overwritten early either.

//! The pinned staging slots of the calling thread for one device.
class LabelStaging {
public:
    static constexpr int slots = 4;

    explicit LabelStaging(int device) : device_(device) {}
    LabelStaging(const LabelStaging&) = delete;
    LabelStaging& operator=(const LabelStaging&) = delete;
    ~LabelStaging() {
        int previous = 0;
        const bool switched =
            cudaGetDevice(&previous) == cudaSuccess && previous != device_ && cudaSetDevice(device_) == cudaSuccess;
        for (Slot& s : slots_) {
            if (s.done != nullptr) {
                try {  // its copy has read the slot before the slot goes
                    cuda::wait_event(s.done, "an upload of labels at teardown");
                } catch (...) {
                }
                (void)cudaEventDestroy(s.done);
            }
            if (s.host != nullptr) (void)cudaFreeHost(s.host);
        }
        if (switched) (void)cudaSetDevice(previous);
    }

    //! The calling thread's staging for `device`.
    static LabelStaging& of(int device) {
        thread_local std::vector<std::unique_ptr<LabelStaging>> per_device;
        if (static_cast<int>(per_device.size()) <= device) per_device.resize(static_cast<std::size_t>(device) + 1);
        auto& s = per_device[static_cast<std::size_t>(device)];
        if (s == nullptr) s = std::make_unique<LabelStaging>(device);
        return *s;
    }

    //! Copies `labels` to `dst` (device memory) on `stream`, through the next staging slot.
    //! The device of `stream` is current.
    void upload(std::span<const std::int64_t> labels, std::int64_t* dst, cudaStream_t stream) {
        if (labels.empty()) return;
        Slot& s = slots_[static_cast<std::size_t>(next_)];
        next_ = (next_ + 1) % slots;
        if (s.done == nullptr)
            LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
        else
            cuda::wait_event(s.done, "the previous upload of labels");  // the slot's last copy has read it
        if (s.capacity < labels.size()) {
            if (s.host != nullptr) LOCKSTEP_CUDA_CHECK(cudaFreeHost(s.host));
            s.host = nullptr;
            s.capacity = 0;
            LOCKSTEP_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&s.host), labels.size_bytes()));
            s.capacity = labels.size();
        }
        std::memcpy(s.host, labels.data(), labels.size_bytes());
        LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, s.host, labels.size_bytes(), cudaMemcpyHostToDevice, stream));
        LOCKSTEP_CUDA_CHECK(cudaEventRecord(s.done, stream));
    }

private:
    struct Slot {
        std::int64_t* host = nullptr;
        std::size_t capacity = 0;
        cudaEvent_t done = nullptr;
    };
    std::array<Slot, slots> slots_{};
    int next_ = 0;
    int device_;
};

}  // namespace layer_detail

}  // namespace lockstep::kernels::cuda_ops
