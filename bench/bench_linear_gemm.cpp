// SPDX-License-Identifier: MIT
//! The host linear layer's GEMMs through CBLAS (OpenBLAS, what `linear_forward` and
//! `linear_backward` call) against oneDNN's matmul primitive, one thread each, on the shapes of
//! the example's fc1 (12544 -> 128): forward, backward-weights (accumulating, as a layer does) and
//! backward-data, at a replica's share of a batch of 64 over 2 replicas (32 rows) and at 64 rows.
//! The two are timed alternately in the same run; `vs_openblas` is oneDNN's rate over OpenBLAS's
//! (above 1: oneDNN is faster). Both results are compared (`max_rel_diff`) so that a wrong
//! descriptor cannot pass for a fast one.
#include <benchmark/benchmark.h>

#include <lockstep/kernels/host_blas.hpp>

#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct Shape {
    bool trans_a, trans_b;
    std::int64_t m, n, k;
    float beta;  // 1: accumulate into C (backward-weights)
};

// C (m x n) = op(A) op(B) + beta C, row-major, the layer's three products for `rows` rows.
Shape shape_of(int which, std::int64_t rows) {
    constexpr std::int64_t in = 64 * 14 * 14, out = 128;
    switch (which) {
        case 0: return {false, true, rows, out, in, 0.0f};    // forward: y = x W^T
        case 1: return {true, false, out, in, rows, 1.0f};    // backward-weights: dW += dy^T x
        default: return {false, false, rows, in, out, 0.0f};  // backward-data: dx = dy W
    }
}

// oneDNN's matmul for `s`, on plain row-major buffers (transposes as strides), made once.
struct DnnlMatmul {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    dnnl::matmul prim;
    dnnl::memory::desc a_md, b_md, c_md;

    explicit DnnlMatmul(const Shape& s) {
        using dims = dnnl::memory::dims;
        const auto f32 = dnnl::memory::data_type::f32;
        a_md = dnnl::memory::desc(dims{s.m, s.k}, f32, s.trans_a ? dims{1, s.m} : dims{s.k, 1});
        b_md = dnnl::memory::desc(dims{s.k, s.n}, f32, s.trans_b ? dims{1, s.k} : dims{s.n, 1});
        c_md = dnnl::memory::desc(dims{s.m, s.n}, f32, dims{s.n, 1});
        dnnl::primitive_attr attr;
        if (s.beta != 0.0f) {
            dnnl::post_ops ops;
            ops.append_sum(s.beta);
            attr.set_post_ops(ops);
        }
        prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine));
    }
    void run(const float* a, const float* b, float* c) {
        dnnl::memory am(a_md, engine, const_cast<float*>(a)), bm(b_md, engine, const_cast<float*>(b)), cm(c_md, engine, c);
        prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
        stream.wait();
    }
};

void BM_LinearGemm(benchmark::State& state) {
    const Shape s = shape_of(static_cast<int>(state.range(0)), state.range(1));
    lockstep::kernels::blas::SingleThreadScope one_blas_thread;
    omp_set_num_threads(1);
    std::mt19937 gen(3);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> a(static_cast<std::size_t>(s.m * s.k)), b(static_cast<std::size_t>(s.k * s.n));
    for (auto& v : a) v = d(gen);
    for (auto& v : b) v = d(gen);
    std::vector<float> c0(static_cast<std::size_t>(s.m * s.n), 0.5f), c_blas = c0, c_dnnl = c0;
    const std::int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    DnnlMatmul mm(s);

    // The same product once each, from the same C, compared.
    lockstep::kernels::blas::gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, s.beta, c_blas.data(),
                                  s.n);
    mm.run(a.data(), b.data(), c_dnnl.data());
    double diff = 0, scale = 0;
    for (std::size_t i = 0; i < c0.size(); ++i) {
        diff = std::max(diff, static_cast<double>(std::abs(c_blas[i] - c_dnnl[i])));
        scale = std::max(scale, static_cast<double>(std::abs(c_blas[i])));
    }

    double blas_s = 0, dnnl_s = 0;
    std::int64_t rounds = 0;
    for (auto _ : state) {  // one round: OpenBLAS, then oneDNN
        auto t0 = clock_type::now();
        lockstep::kernels::blas::gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, s.beta,
                                      c_blas.data(), s.n);
        auto t1 = clock_type::now();
        mm.run(a.data(), b.data(), c_dnnl.data());
        auto t2 = clock_type::now();
        blas_s += std::chrono::duration<double>(t1 - t0).count();
        dnnl_s += std::chrono::duration<double>(t2 - t1).count();
        ++rounds;
        benchmark::DoNotOptimize(c_blas.data());
        benchmark::DoNotOptimize(c_dnnl.data());
    }
    const double flops = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
    const double blas_rate = flops * static_cast<double>(rounds) / blas_s,
                 dnnl_rate = flops * static_cast<double>(rounds) / dnnl_s;
    state.counters["openblas_GFLOPs"] = blas_rate / 1e9;
    state.counters["onednn_GFLOPs"] = dnnl_rate / 1e9;
    state.counters["vs_openblas"] = dnnl_rate / blas_rate;
    state.counters["max_rel_diff"] = diff / std::max(scale, 1e-30);
    if (diff > 1e-3 * std::max(scale, 1.0)) state.SkipWithError("OpenBLAS and oneDNN disagree: a descriptor is wrong");
    static constexpr const char* names[] = {"forward", "backward_weights", "backward_data"};
    state.SetLabel(std::string(names[state.range(0)]) + " " + std::to_string(s.m) + "x" + std::to_string(s.n) + "x" +
                   std::to_string(s.k));
}

}  // namespace

BENCHMARK(BM_LinearGemm)->ArgNames({"product", "rows"})->ArgsProduct({{0, 1, 2}, {32, 64}})->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
