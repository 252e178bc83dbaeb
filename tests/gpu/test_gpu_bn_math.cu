// SPDX-License-Identifier: MIT
//! The batch-norm math shared with the host, run inside a CUDA kernel and compared with the host's
//! results of the same functions. Exits 77 (skipped) where no GPU is present.
#include <lockstep/cuda.cuh>
#include <lockstep/kernels/batch_norm_math.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu_check.hpp"

namespace bn = lockstep::kernels::bn;

namespace {

struct Row {
    float x, dy;
};
struct Out {
    float y, dx, running_mean, running_var;
    double invstd;
};

LOCKSTEP_HD Out apply(Row r, double n, double s, double q) {
    const auto st = bn::finish(n, s, q, 0.5, 1e-5);
    const auto m = bn::split_mean(st.mean);
    const auto f = bn::normalize_constants(st.mean, st.invstd, 1.25, 0.25);
    const double sum_dy_xmu = bn::centred_sum(-2.0, 3.0, m.lo);
    const auto k = bn::backward_constants(n, 3.0, sum_dy_xmu, st.mean, st.invstd, 1.25);
    Out o{};
    o.y = bn::normalize(r.x, m.hi, f.scale, f.shift);
    o.dx = bn::backward(r.dy, r.x, m.hi, k.a, k.b, k.c);
    o.running_mean = 0.0f;
    o.running_var = 1.0f;
    bn::update_running(o.running_mean, o.running_var, st, n, 0.1);
    o.invstd = st.invstd;
    return o;
}

// out[i] = apply(rows[i]), one row a thread, written as lockstep's kernels are.
struct ApplyParams {
    const Row* rows = nullptr;
    Out* out = nullptr;
    int count = 0;
    double n = 0, s = 0, q = 0;
};
struct Apply {
    using Params = ApplyParams;
    static constexpr int threads = 256;
    LOCKSTEP_HD static void run(const Params& p, const lockstep::kernels::device::Where& w) {
        const int i = w.bx * threads + w.t;
        if (i < p.count) p.out[i] = apply(p.rows[i], p.n, p.s, p.q);
    }
};

}  // namespace

int main() {
    if (lockstep::cuda::device_count() == 0) {
        std::puts("no CUDA device: skipping (exit 77)");
        return 77;
    }
    const int count = 1000;
    std::vector<Row> rows(count);
    for (int i = 0; i < count; ++i)
        rows[i] = {0.5f + 0.01f * static_cast<float>(i % 37), 0.1f * static_cast<float>(i % 11) - 0.5f};
    const double n = 1000, s = 12.5, q = 40.0;
    Row* d_rows = nullptr;
    Out* d_out = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaMalloc(&d_rows, sizeof(Row) * count));
    LOCKSTEP_CUDA_CHECK(cudaMalloc(&d_out, sizeof(Out) * count));
    LOCKSTEP_CUDA_CHECK(cudaMemcpy(d_rows, rows.data(), sizeof(Row) * count, cudaMemcpyHostToDevice));
    lockstep::kernels::device::launch_map<Apply>({d_rows, d_out, count, n, s, q}, {(count + 255) / 256, 1, Apply::threads},
                                                 nullptr);
    std::vector<Out> got(count);
    LOCKSTEP_CUDA_CHECK(cudaMemcpy(got.data(), d_out, sizeof(Out) * count, cudaMemcpyDeviceToHost));
    LOCKSTEP_CUDA_CHECK(cudaFree(d_rows));
    LOCKSTEP_CUDA_CHECK(cudaFree(d_out));
    // One check per quantity over every row. Device fp32 may contract to FMA where the host does
    // not: allow a few ulps.
    int bad[5] = {};
    for (int i = 0; i < count; ++i) {
        const Out want = apply(rows[i], n, s, q);
        bad[0] += std::abs(got[i].y - want.y) > 1e-6f * (1 + std::abs(want.y));
        bad[1] += std::abs(got[i].dx - want.dx) > 1e-6f * (1 + std::abs(want.dx));
        bad[2] += std::abs(got[i].running_mean - want.running_mean) > 1e-6f * (1 + std::abs(want.running_mean));
        bad[3] += std::abs(got[i].running_var - want.running_var) > 1e-6f * (1 + std::abs(want.running_var));
        bad[4] += std::abs(got[i].invstd - want.invstd) > 1e-15 * want.invstd;
    }
    const char* names[5] = {"y", "dx", "running mean", "running var", "invstd"};
    for (int k = 0; k < 5; ++k)
        lockstep::gpu_test::expect(bad[k] == 0, std::string("batch-norm math in a kernel equals the host's: ") + names[k] + " (" +
                                                    std::to_string(bad[k]) + " of " + std::to_string(count) + " rows differ)");
    return lockstep::gpu_test::finish();
}
