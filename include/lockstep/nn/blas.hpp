// SPDX-License-Identifier: MIT
//! The host GEMM lockstep's layers use: CBLAS (OpenBLAS), one BLAS thread per replica thread.
#pragma once

#include <cblas.h>

#include <cstdint>
#include <mutex>

namespace lockstep::nn::blas {

// Note [one BLAS thread per replica]
// Each host replica is already one thread per core; a multi-threaded BLAS under every replica
// would oversubscribe the cores and slow everything down. The first GEMM of the process sets
// OpenBLAS to one thread. (This is process-wide: code outside lockstep that wants a threaded
// OpenBLAS can call openblas_set_num_threads() again after its replicas are done.)
inline void single_threaded() {
    static std::once_flag once;
    std::call_once(once, [] {
#if defined(OPENBLAS_VERSION) || defined(OPENBLAS_CONST)
        openblas_set_num_threads(1);
#endif
    });
}

//! C = alpha * op(A) * op(B) + beta * C, row-major, float. Zero-sized products are no-ops
//! (beta still applies to C when k = 0).
inline void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                 std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
    if (m == 0 || n == 0) return;
    single_threaded();
    if (k == 0) {
        for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
        return;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

}  // namespace lockstep::nn::blas
