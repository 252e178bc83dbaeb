// SPDX-License-Identifier: MIT
//! The host GEMM of the host backend operations: CBLAS (OpenBLAS), one BLAS thread per replica.
#pragma once

#include <cblas.h>

#include <cstdint>
#include <mutex>

namespace lockstep::kernels::blas {

// Note [one BLAS thread per replica]
// Each host replica is already one thread on a core of its own; a multi-threaded BLAS under every
// replica would oversubscribe the cores and slow everything down. OpenBLAS's thread count is
// process-wide (0.3.21 has no per-thread setting), so it is set to 1 while any `SingleThreadScope`
// exists (DataParallel holds one for its lifetime) and restored to its previous value when the
// last scope ends. A layer used alone, outside DataParallel, keeps OpenBLAS's own setting.

//! Holds OpenBLAS at one thread for its lifetime (counted: nested and concurrent scopes share it).
class SingleThreadScope {
public:
    SingleThreadScope() {
        std::lock_guard lock(state().mutex);
        if (state().users++ == 0) {
#if defined(OPENBLAS_VERSION) || defined(OPENBLAS_CONST)
            state().saved = openblas_get_num_threads();
            openblas_set_num_threads(1);
#endif
        }
    }
    SingleThreadScope(const SingleThreadScope&) = delete;
    SingleThreadScope& operator=(const SingleThreadScope&) = delete;
    ~SingleThreadScope() {
        std::lock_guard lock(state().mutex);
        if (--state().users == 0) {
#if defined(OPENBLAS_VERSION) || defined(OPENBLAS_CONST)
            openblas_set_num_threads(state().saved);
#endif
        }
    }

private:
    struct State {
        std::mutex mutex;
        int users = 0;
        int saved = 1;
    };
    static State& state() {
        static State s;
        return s;
    }
};

//! C = alpha * op(A) * op(B) + beta * C, row-major, float. Zero-sized products are no-ops
//! (beta still applies to C when k = 0).
inline void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                 std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
    if (m == 0 || n == 0) return;
    if (k == 0) {
        for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
        return;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m),
                static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
                static_cast<int>(ldc));
}

}  // namespace lockstep::kernels::blas
