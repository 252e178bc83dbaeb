// SPDX-License-Identifier: MIT
//! lockstep's host CUDA device: the cuBLAS entry points, SGEMM enqueued on the handle's stream and run by OpenBLAS.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "detail.hpp"

namespace {

using namespace lockstep::host_cuda::detail;

struct Handle {
    int device = 0;
    cudaStream_t stream = nullptr;  // resolved at each call: a destroyed stream shows there
    void* workspace = nullptr;
    std::size_t workspace_bytes = 0;
    cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

struct Handles {
    std::mutex m;
    std::unordered_map<const void*, std::shared_ptr<Handle>> live;
    std::vector<std::shared_ptr<Handle>> dead;  // so that a dead handle's address is never reused
};

Handles& handles() {
    static Handles* h = new Handles;
    return *h;
}

std::shared_ptr<Handle> find(cublasHandle_t h) {
    Handles& hs = handles();
    std::lock_guard lock(hs.m);
    auto it = hs.live.find(h);
    return it == hs.live.end() ? nullptr : it->second;
}

std::vector<float> tf32_copy(const float* p, int rows, int cols, int ld) {
    std::vector<float> out(static_cast<std::size_t>(ld) * static_cast<std::size_t>(cols - 1) + static_cast<std::size_t>(rows));
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < rows; ++r) {
            const std::size_t i = static_cast<std::size_t>(c) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(r);
            out[i] = to_tf32(p[i]);
        }
    return out;
}

//! One column-major GEMM with cuBLAS's semantics: beta == 0 ignores C (NaN in C does not
//! propagate), alpha == 0 or k == 0 reads neither A nor B.
void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb, float beta,
          float* c, int ldc, bool tf32) {
    if (m == 0 || n == 0) return;
    for (int j = 0; j < n; ++j) {
        float* col = c + static_cast<std::ptrdiff_t>(j) * ldc;
        if (beta == 0.0f)
            std::fill(col, col + m, 0.0f);
        else if (beta != 1.0f && (k == 0 || alpha == 0.0f))
            for (int i = 0; i < m; ++i) col[i] *= beta;
    }
    if (k == 0 || alpha == 0.0f) return;
    std::vector<float> ra, rb;
    if (tf32) {
        ra = tf32_copy(a, ta ? k : m, ta ? m : k, lda);
        rb = tf32_copy(b, tb ? n : k, tb ? k : n, ldb);
        a = ra.data();
        b = rb.data();
    }
    cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb,
                beta == 0.0f ? 0.0f : beta, c, ldc);
}

//! Bytes spanned by a column-major rows x cols operand of `size`-byte elements with leading dimension ld.
std::size_t extent(int rows, int cols, int ld, std::size_t size) {
    if (rows == 0 || cols == 0) return 0;
    return (static_cast<std::size_t>(ld) * static_cast<std::size_t>(cols - 1) + static_cast<std::size_t>(rows)) * size;
}

//! The operand [p + first .. p + last element of the batch) lies in a device block of `device`.
//! The bytes a batched operand spans (0: none); false for a negative stride.
bool operand_bytes(int rows, int cols, int ld, long long stride, int batch, std::size_t size, std::size_t& bytes) {
    const std::size_t one = extent(rows, cols, ld, size);
    bytes = 0;
    if (one == 0 || batch == 0) return true;
    if (stride < 0) return false;
    bytes = static_cast<std::size_t>(stride) * static_cast<std::size_t>(batch - 1) * size + one;
    return true;
}

bool operand_ok(const void* p, int rows, int cols, int ld, long long stride, int batch, std::size_t size, int device,
                std::vector<std::pair<const void*, std::size_t>>& ranges) {
    std::size_t bytes = 0;
    if (!operand_bytes(rows, cols, ld, stride, batch, size, bytes)) return false;
    if (bytes == 0) return true;
    ranges.emplace_back(p, bytes);
    return device_of_range(p, bytes) == device;
}

bool op_ok(cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }

//! A bfloat16 operand widened to fp32 (exactly), the elements of a rows x cols column-major
//! matrix with leading dimension ld; what lies between its columns stays 0.
std::vector<float> widened(const __nv_bfloat16* p, int rows, int cols, int ld) {
    std::vector<float> out(extent(rows, cols, ld, 1), 0.0f);
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < rows; ++r) {
            const std::size_t i = static_cast<std::size_t>(c) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(r);
            out[i] = __bfloat162float(p[i]);
        }
    return out;
}

//! What the operands A and B hold: fp32, or bfloat16 (cublasGemmEx with CUDA_R_16BF).
enum class Operands { f32, bf16 };

cublasStatus_t gemm_batched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                            const float* alpha, const void* A, int lda, long long strideA, const void* B, int ldb,
                            long long strideB, const float* beta, float* C, int ldc, long long strideC, int batchCount,
                            Operands in) {
    const auto h = find(handle);
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!op_ok(transa) || !op_ok(transb) || m < 0 || n < 0 || k < 0 || batchCount < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
    if (lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0 || batchCount == 0) return CUBLAS_STATUS_SUCCESS;
    const std::size_t size = in == Operands::bf16 ? sizeof(__nv_bfloat16) : sizeof(float);
    std::vector<std::pair<const void*, std::size_t>> ranges;
    if (!operand_ok(A, ta ? k : m, ta ? m : k, lda, strideA, batchCount, size, h->device, ranges) ||
        !operand_ok(B, tb ? n : k, tb ? k : n, ldb, strideB, batchCount, size, h->device, ranges) ||
        !operand_ok(C, m, n, ldc, strideC, batchCount, sizeof(float), h->device, ranges))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (h->workspace != nullptr && device_of_range(h->workspace, h->workspace_bytes) != h->device)
        return CUBLAS_STATUS_EXECUTION_FAILED;  // its workspace was freed
    if (h->workspace != nullptr) ranges.emplace_back(h->workspace, h->workspace_bytes);
    // The kernel runs on the current device with the handle's stream: a stream that is gone, or
    // of another device, fails the launch.
    std::shared_ptr<Stream> s;
    if (current_device() != h->device || stream_for_work(h->stream, s) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    Op op;
    op.device_ranges = std::move(ranges);
    const float a = *alpha, b = *beta;  // host pointer mode: read at the call
    // bf16 operands: their products are exact in fp32 and summed in fp32, whatever the math mode.
    const bool tf32 = in == Operands::f32 && (h->math & 0xF) == CUBLAS_TF32_TENSOR_OP_MATH;
    op.body = [=] {
        for (int i = 0; i < batchCount; ++i) {
            if (in == Operands::f32) {
                gemm(ta, tb, m, n, k, a, static_cast<const float*>(A) + strideA * i, lda,
                     static_cast<const float*>(B) + strideB * i, ldb, b, C + strideC * i, ldc, tf32);
            } else {
                const auto wa = widened(static_cast<const __nv_bfloat16*>(A) + strideA * i, ta ? k : m, ta ? m : k, lda);
                const auto wb = widened(static_cast<const __nv_bfloat16*>(B) + strideB * i, tb ? n : k, tb ? k : n, ldb);
                gemm(ta, tb, m, n, k, a, wa.data(), lda, wb.data(), ldb, b, C + strideC * i, ldc, false);
            }
        }
    };
    enqueue(s, std::move(op));
    return CUBLAS_STATUS_SUCCESS;
}

//! The types cublasGemmEx is asked for: bf16 A and B, fp32 C, fp32 compute (what lockstep's bf16
//! products use, Note [precision]), or fp32 throughout; anything else is not modelled.
bool ex_types(cudaDataType at, cudaDataType bt, cudaDataType ct, cublasComputeType_t compute, Operands& in) {
    if (ct != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F || at != bt) return false;
    if (at == CUDA_R_16BF)
        in = Operands::bf16;
    else if (at == CUDA_R_32F)
        in = Operands::f32;
    else
        return false;
    return true;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
    if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (sticky(current_device()) != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
    static std::once_flag once;
    std::call_once(once, [] { openblas_set_num_threads(1); });  // the stream workers are the parallelism
    auto h = std::make_shared<Handle>();
    h->device = current_device();
    Handles& hs = handles();
    std::lock_guard lock(hs.m);
    hs.live[h.get()] = h;
    *handle = reinterpret_cast<cublasHandle_t>(h.get());
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
    Handles& hs = handles();
    std::lock_guard lock(hs.m);
    auto it = hs.live.find(handle);
    if (it == hs.live.end()) return CUBLAS_STATUS_NOT_INITIALIZED;
    hs.dead.push_back(std::move(it->second));
    hs.live.erase(it);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t streamId) {
    const auto h = find(handle);
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = streamId;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* streamId) {
    const auto h = find(handle);
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (streamId == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *streamId = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t workspaceSizeInBytes) {
    const auto h = find(handle);
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (workspaceSizeInBytes > 0) {
        if (reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0) return CUBLAS_STATUS_INVALID_VALUE;
        if (device_of_range(workspace, workspaceSizeInBytes) != h->device) return CUBLAS_STATUS_INVALID_VALUE;
    }
    h->workspace = workspaceSizeInBytes > 0 ? workspace : nullptr;
    h->workspace_bytes = workspaceSizeInBytes;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    const auto h = find(handle);
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    const int base = mode & 0xF;
    if (base != CUBLAS_DEFAULT_MATH && base != CUBLAS_TENSOR_OP_MATH && base != CUBLAS_PEDANTIC_MATH &&
        base != CUBLAS_TF32_TENSOR_OP_MATH)
        return CUBLAS_STATUS_INVALID_VALUE;
    h->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
    const auto h = find(handle);
    if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->math;
    return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
        case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
        default: return "CUBLAS_STATUS_UNKNOWN";
    }
}

const char* cublasGetStatusString(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
        case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
        case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
        case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
        case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
        default: return "unknown error";
    }
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                           const float* alpha, const float* A, int lda, const float* B, int ldb, const float* beta, float* C,
                           int ldc) {
    return gemm_batched(handle, transa, transb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1, Operands::f32);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                                         int k, const float* alpha, const float* A, int lda, long long int strideA,
                                         const float* B, int ldb, long long int strideB, const float* beta, float* C, int ldc,
                                         long long int strideC, int batchCount) {
    return gemm_batched(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC,
                        batchCount, Operands::f32);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B, cudaDataType Btype,
                            int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
    Operands in{};
    if (!ex_types(Atype, Btype, Ctype, computeType, in)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (algo != CUBLAS_GEMM_DEFAULT) return CUBLAS_STATUS_NOT_SUPPORTED;
    return gemm_batched(handle, transa, transb, m, n, k, static_cast<const float*>(alpha), A, lda, 0, B, ldb, 0,
                        static_cast<const float*>(beta), static_cast<float*>(C), ldc, 0, 1, in);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                                          int k, const void* alpha, const void* A, cudaDataType Atype, int lda,
                                          long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t algo) {
    Operands in{};
    if (!ex_types(Atype, Btype, Ctype, computeType, in)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (algo != CUBLAS_GEMM_DEFAULT) return CUBLAS_STATUS_NOT_SUPPORTED;
    return gemm_batched(handle, transa, transb, m, n, k, static_cast<const float*>(alpha), A, lda, strideA, B, ldb, strideB,
                        static_cast<const float*>(beta), static_cast<float*>(C), ldc, strideC, batchCount, in);
}

}  // extern "C"
