// SPDX-License-Identifier: MIT
//! SyncBatchNorm on host replicas against an fp64 batch norm of the whole (concatenated) batch.
#include <catch2/catch.hpp>

#include <lockstep/host.hpp>
#include <lockstep/lockstep.hpp>
#include <lockstep/nn/activation.hpp>
#include <lockstep/nn/sync_batch_norm.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

using namespace lockstep;
using namespace std::chrono_literals;
using nn::SyncBatchNorm;

namespace {

// fp64 batch norm of the global batch, PyTorch semantics.
struct Reference {
    std::vector<double> y, dx, dgamma, dbeta, mean, var;
    double dx_terms = 0;                       // largest |gamma * invstd * dy|: the size of the terms dx cancels from
    double dgamma_terms = 0, dbeta_terms = 0;  // largest sum |dy * xhat|, sum |dy| over channels
};

Reference reference_bn(const std::vector<double>& x, const std::vector<double>& dy, const std::vector<double>& gamma,
                       const std::vector<double>& beta, std::int64_t N, std::int64_t C, std::int64_t P, double eps) {
    Reference r;
    const auto idx = [&](std::int64_t n, std::int64_t c, std::int64_t p) {
        return static_cast<std::size_t>((n * C + c) * P + p);
    };
    r.y.resize(x.size());
    r.dx.resize(x.size());
    r.dgamma.assign(static_cast<std::size_t>(C), 0.0);
    r.dbeta.assign(static_cast<std::size_t>(C), 0.0);
    r.mean.assign(static_cast<std::size_t>(C), 0.0);
    r.var.assign(static_cast<std::size_t>(C), 0.0);
    const double M = static_cast<double>(N * P);
    for (std::int64_t c = 0; c < C; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        double s = 0;
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) s += x[idx(n, c, p)];
        const double mean = s / M;
        double v = 0;
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) v += (x[idx(n, c, p)] - mean) * (x[idx(n, c, p)] - mean);
        const double var = v / M, invstd = 1.0 / std::sqrt(var + eps);
        r.mean[uc] = mean;
        r.var[uc] = var;
        double sdy = 0, sdyxh = 0;
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) {
                const double xh = (x[idx(n, c, p)] - mean) * invstd;
                r.y[idx(n, c, p)] = xh * gamma[uc] + beta[uc];
                r.dx_terms = std::max(r.dx_terms, std::abs(gamma[uc] * invstd * dy[idx(n, c, p)]));
                sdy += dy[idx(n, c, p)];
                sdyxh += dy[idx(n, c, p)] * xh;
            }
        r.dgamma[uc] = sdyxh;
        r.dbeta[uc] = sdy;
        double adyxh = 0, ady = 0;
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) {
                adyxh += std::abs(dy[idx(n, c, p)] * (x[idx(n, c, p)] - mean) * invstd);
                ady += std::abs(dy[idx(n, c, p)]);
            }
        r.dgamma_terms = std::max(r.dgamma_terms, adyxh);
        r.dbeta_terms = std::max(r.dbeta_terms, ady);
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) {
                const double xh = (x[idx(n, c, p)] - mean) * invstd;
                r.dx[idx(n, c, p)] = gamma[uc] * invstd * (dy[idx(n, c, p)] - sdy / M - xh * sdyxh / M);
            }
    }
    return r;
}

// Host replicas of one SyncBatchNorm prototype, each with its own communicator, as DataParallel
// will hold them.
struct Replicas {
    Replicas(int world, const SyncBatchNorm<>& proto) : comms(comm::HostCommunicator::create_group(world, 30s)), pool(world) {
        pool.attach(comms[0].group_ptr());
        for (int r = 0; r < world; ++r) {
            bns.push_back(proto);
            nn::Context<> ctx;
            ctx.rank = r;
            ctx.world = world;
            ctx.comm = &comms[static_cast<std::size_t>(r)];
            contexts.push_back(ctx);
        }
    }
    std::vector<comm::HostCommunicator> comms;
    ReplicaPool pool;
    std::vector<SyncBatchNorm<>> bns;
    std::vector<nn::Context<>> contexts;
};

// Logical (N, C, P) values of a global batch -> one shard tensor per replica, in `format`.
std::vector<Tensor<float>> scatter(const std::vector<double>& global, const std::vector<std::int64_t>& sizes, std::int64_t C,
                                   std::int64_t H, std::int64_t W, bool four_d, MemoryFormat format) {
    std::vector<Tensor<float>> shards;
    std::int64_t row = 0;
    const std::int64_t P = H * W;
    for (auto n_r : sizes) {
        Tensor<float> t(four_d ? Shape{n_r, C, H, W} : Shape{n_r, C}, four_d ? format : MemoryFormat::nchw);
        for (std::int64_t n = 0; n < n_r; ++n)
            for (std::int64_t c = 0; c < C; ++c)
                for (std::int64_t p = 0; p < P; ++p)
                    t[test::offset(n, c, p, C, P, t.format())] =
                        static_cast<float>(global[static_cast<std::size_t>(((row + n) * C + c) * P + p)]);
        row += n_r;
        shards.push_back(std::move(t));
    }
    return shards;
}

// Gathers shard tensors back into logical NCHW order.
std::vector<double> gather(const std::vector<Tensor<float>>& shards, std::int64_t C, std::int64_t P) {
    std::vector<double> out;
    for (const auto& t : shards)
        for (std::int64_t n = 0; n < t.dim(0); ++n)
            for (std::int64_t c = 0; c < C; ++c)
                for (std::int64_t p = 0; p < P; ++p) out.push_back(t[test::offset(n, c, p, C, P, t.format())]);
    return out;
}

std::vector<double> random_values(std::size_t n, std::mt19937_64& gen, double mean, double stddev) {
    std::normal_distribution<double> dist(mean, stddev);
    std::vector<double> v(n);
    for (auto& x : v) x = static_cast<double>(static_cast<float>(dist(gen)));  // representable in fp32
    return v;
}

// Restores the SIMD level a test changed (see Note [simd levels]).
struct SimdLevelScope {
    kernels::simd::Level saved = kernels::simd::active();
    ~SimdLevelScope() { kernels::simd::set_active(saved); }
};

}  // namespace

// Runs the rest of the enclosing test once per SIMD level of the host kernels; a level this CPU
// lacks is reported and not run. The ThreadSanitizer build checks the threads, which no level
// changes, so it runs the active level only (all three triple its longest test, to ~5 minutes).
#if defined(__SANITIZE_THREAD__)
#define LOCKSTEP_SIMD_LEVELS kernels::simd::active()
#else
#define LOCKSTEP_SIMD_LEVELS kernels::simd::Level::baseline, kernels::simd::Level::avx2, kernels::simd::Level::avx512
#endif
#define LOCKSTEP_EACH_SIMD_LEVEL()                                                                           \
    const auto simd_level = GENERATE(LOCKSTEP_SIMD_LEVELS);                                                  \
    SimdLevelScope simd_scope;                                                                               \
    if (kernels::simd::set_active(simd_level) != simd_level) {                                               \
        WARN("SIMD level " << kernels::simd::to_string(simd_level) << " is not supported here: not tested"); \
        return;                                                                                              \
    }                                                                                                        \
    INFO("SIMD level " << kernels::simd::to_string(simd_level))

// The image sizes (H, W; 0: 2-D input) the fp64 comparison sweeps. Under ThreadSanitizer it
// checks the replicas' rendezvous around the kernels, which no image size changes, and the
// kernels run single-threaded; under ASan+UBSan the odd sizes and C = 129 take every kernel's
// vector body and tail, which is where an access goes astray. 28x28, more than 20 times the work
// of the others together (76 s of the ASan phase), is swept by the release build only.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define LOCKSTEP_BN_IMAGE_SIZES \
    {0, 0}, {1, 1}, { 7, 5 }
#else
#define LOCKSTEP_BN_IMAGE_SIZES \
    {0, 0}, {1, 1}, {7, 5}, { 28, 28 }
#endif

TEST_CASE("SyncBatchNorm matches fp64 batch norm of the whole batch", "[syncbn]") {
    LOCKSTEP_EACH_SIMD_LEVEL();
    const std::int64_t C = GENERATE(1, 3, 64, 129);
    const auto hw = GENERATE(values<std::pair<std::int64_t, std::int64_t>>({LOCKSTEP_BN_IMAGE_SIZES}));
    const auto format = GENERATE(MemoryFormat::nchw, MemoryFormat::nhwc);
    const bool four_d = hw.first > 0;
    if (!four_d && format == MemoryFormat::nhwc) return;  // 2-D input has one layout
    const std::int64_t H = four_d ? hw.first : 1, W = four_d ? hw.second : 1, P = H * W;
    const auto seed = test::fresh_seed();
    std::mt19937_64 gen(seed);
    const double eps = 1e-5, momentum = 0.1;

    for (int world = 1; world <= 4; ++world) {
        for (const std::string split : {"even", "uneven", "empty"}) {
            if (split == "empty" && world == 1) continue;
            const auto sizes = test::shard_sizes(world, split);
            const std::int64_t N = std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
            CAPTURE(seed, C, H, W, to_string(format), world, split);

            SyncBatchNorm<> proto(C, {.eps = eps, .momentum = momentum, .format = format});
            std::uniform_real_distribution<double> u(0.5, 1.5);
            std::vector<double> gamma(static_cast<std::size_t>(C)), beta(static_cast<std::size_t>(C));
            for (std::int64_t c = 0; c < C; ++c) {
                proto.weight.value[c] = static_cast<float>(gamma[static_cast<std::size_t>(c)] = static_cast<float>(u(gen)));
                proto.bias.value[c] = static_cast<float>(beta[static_cast<std::size_t>(c)] = static_cast<float>(u(gen) - 1.0));
            }
            Replicas reps(world, proto);
            std::vector<double> rm(static_cast<std::size_t>(C), 0.0), rv(static_cast<std::size_t>(C), 1.0);
            double rm_terms = 0;  // largest |running mean| along the way: what its fp32 updates round at

            for (int step = 0; step < 5; ++step) {
                const auto xg = random_values(static_cast<std::size_t>(N * C * P), gen, 2.0, 3.0);
                const auto dyg = random_values(xg.size(), gen, 0.0, 1.0);
                auto xs = scatter(xg, sizes, C, H, W, four_d, format);
                auto dys = scatter(dyg, sizes, C, H, W, four_d, format);
                std::vector<Tensor<float>> ys(static_cast<std::size_t>(world)), dxs(static_cast<std::size_t>(world));
                std::vector<std::uint64_t> fwd_collectives(static_cast<std::size_t>(world)),
                    bwd_collectives(static_cast<std::size_t>(world));
                for (auto& bn : reps.bns) {
                    bn.weight.grad.zero();
                    bn.bias.grad.zero();
                }
                reps.pool.run([&](int r) {
                    const auto ur = static_cast<std::size_t>(r);
                    const auto c0 = reps.comms[ur].collective_count();
                    ys[ur] = reps.bns[ur].forward(reps.contexts[ur], xs[ur]);
                    const auto c1 = reps.comms[ur].collective_count();
                    dxs[ur] = reps.bns[ur].backward(reps.contexts[ur], dys[ur]);
                    fwd_collectives[ur] = c1 - c0;
                    bwd_collectives[ur] = reps.comms[ur].collective_count() - c1;
                });
                const auto ref = reference_bn(xg, dyg, gamma, beta, N, C, P, eps);
                CHECK(test::rel_error(gather(ys, C, P), ref.y) <= 1e-5);
                CHECK(test::rel_error(gather(dxs, C, P), ref.dx, ref.dx_terms) <= 1e-5);
                std::vector<double> dgamma(static_cast<std::size_t>(C), 0.0), dbeta(static_cast<std::size_t>(C), 0.0);
                for (const auto& bn : reps.bns)
                    for (std::int64_t c = 0; c < C; ++c) {
                        dgamma[static_cast<std::size_t>(c)] += bn.weight.grad[c];
                        dbeta[static_cast<std::size_t>(c)] += bn.bias.grad[c];
                    }
                // Sums of random-signed terms: relative to the size of their terms (fp32 summation bound).
                CHECK(test::rel_error(dgamma, ref.dgamma, ref.dgamma_terms) <= 1e-5);
                CHECK(test::rel_error(dbeta, ref.dbeta, ref.dbeta_terms) <= 1e-5);
                for (int r = 0; r < world; ++r) {
                    CHECK(fwd_collectives[static_cast<std::size_t>(r)] == 2u);  // Note [fixed-size collectives]
                    CHECK(bwd_collectives[static_cast<std::size_t>(r)] == 1u);
                }
                const double M = static_cast<double>(N * P);
                for (std::int64_t c = 0; c < C; ++c) {
                    const auto uc = static_cast<std::size_t>(c);
                    rm[uc] = (1 - momentum) * rm[uc] + momentum * ref.mean[uc];
                    rm_terms = std::max({rm_terms, std::abs(rm[uc]), momentum * std::abs(ref.mean[uc])});
                    rv[uc] = (1 - momentum) * rv[uc] + momentum * ref.var[uc] * M / (M - 1);
                }
            }
            std::vector<double> got_rm(reps.bns[0].running_mean.span().begin(), reps.bns[0].running_mean.span().end());
            std::vector<double> got_rv(reps.bns[0].running_var.span().begin(), reps.bns[0].running_var.span().end());
            // A running mean can end near zero after larger steps (one channel, two samples a
            // step): relative to the size of the values it was updated through.
            CHECK(test::rel_error(got_rm, rm, rm_terms) <= 1e-5);
            CHECK(test::rel_error(got_rv, rv) <= 1e-5);
            CHECK(reps.bns[0].num_batches_tracked[0] == 5);
            for (int r = 1; r < world; ++r) {  // bit-identical running statistics on every replica
                const auto& other = reps.bns[static_cast<std::size_t>(r)];
                CHECK(std::memcmp(other.running_mean.data(), reps.bns[0].running_mean.data(), other.running_mean.bytes()) == 0);
                CHECK(std::memcmp(other.running_var.data(), reps.bns[0].running_var.data(), other.running_var.bytes()) == 0);
            }
        }
    }
}

TEST_CASE("SyncBatchNorm gradient matches finite differences of the fp64 forward", "[syncbn]") {
    // L = sum(w * y(x)); dL/dx from our backward with dy = w, against central differences of
    // the fp64 reference forward (the function the layer is meant to compute).
    const std::int64_t N = 6, C = 3, H = 2, W = 3, P = H * W;
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto x = random_values(static_cast<std::size_t>(N * C * P), gen, 0.5, 1.0);
    const auto w = random_values(x.size(), gen, 0.0, 1.0);
    std::vector<double> gamma{0.7, 1.3, -0.4}, beta{0.1, -0.2, 0.3};
    SyncBatchNorm<> proto(C);
    for (std::int64_t c = 0; c < C; ++c) {
        proto.weight.value[c] = static_cast<float>(gamma[static_cast<std::size_t>(c)]);
        proto.bias.value[c] = static_cast<float>(beta[static_cast<std::size_t>(c)]);
    }
    Replicas reps(2, proto);
    const std::vector<std::int64_t> sizes{4, 2};
    auto xs = scatter(x, sizes, C, H, W, true, MemoryFormat::nchw);
    auto ws = scatter(w, sizes, C, H, W, true, MemoryFormat::nchw);
    std::vector<Tensor<float>> dxs(2);
    reps.pool.run([&](int r) {
        const auto ur = static_cast<std::size_t>(r);
        reps.bns[ur].forward(reps.contexts[ur], xs[ur]);
        dxs[ur] = reps.bns[ur].backward(reps.contexts[ur], ws[ur]);
    });
    const auto analytic = gather(dxs, C, P);
    const auto loss = [&](const std::vector<double>& xv) {
        const auto r = reference_bn(xv, w, gamma, beta, N, C, P, 1e-5);
        double l = 0;
        for (std::size_t i = 0; i < xv.size(); ++i) l += w[i] * r.y[i];
        return l;
    };
    std::vector<double> numeric(x.size());
    const double h = 1e-6;
    for (std::size_t i = 0; i < x.size(); ++i) {
        auto xp = x, xm = x;
        xp[i] += h;
        xm[i] -= h;
        numeric[i] = (loss(xp) - loss(xm)) / (2 * h);
    }
    CHECK(test::rel_error(analytic, numeric) <= 1e-4);
}

TEST_CASE("SyncBatchNorm keeps the variance when |mean| >> std", "[syncbn]") {
    LOCKSTEP_EACH_SIMD_LEVEL();
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const std::int64_t C = 4, H = 16, W = 16, P = H * W;
    const std::vector<std::int64_t> sizes{5, 3};
    const std::int64_t N = 8;
    const auto format = GENERATE(MemoryFormat::nchw, MemoryFormat::nhwc);
    const auto x = random_values(static_cast<std::size_t>(N * C * P), gen, 1e4, 1e-2);
    const auto dy = random_values(x.size(), gen, 0.0, 1.0);
    SyncBatchNorm<> proto(C, {.momentum = 1.0, .format = format});  // running_var = the unbiased batch variance
    Replicas reps(2, proto);
    auto xs = scatter(x, sizes, C, H, W, true, format);
    auto dys = scatter(dy, sizes, C, H, W, true, format);
    std::vector<Tensor<float>> ys(2), dxs(2);
    reps.pool.run([&](int r) {
        const auto ur = static_cast<std::size_t>(r);
        ys[ur] = reps.bns[ur].forward(reps.contexts[ur], xs[ur]);
        dxs[ur] = reps.bns[ur].backward(reps.contexts[ur], dys[ur]);
    });
    // The sums are about the batch's own shift (Note [shifted statistics]), so the variance keeps
    // fp32 precision of x - mean. x - mean is exact to fp32 precision (Note [split mean]);
    // x - fp32(mean) would be off by up to 5% of a std (about 1e-2 normwise here).
    const auto ref = reference_bn(x, dy, std::vector<double>(C, 1.0), std::vector<double>(C, 0.0), N, C, P, 1e-5);
    CHECK(test::rel_error(gather(ys, C, P), ref.y) <= 1e-5);
    CHECK(test::rel_error(gather(dxs, C, P), ref.dx, ref.dx_terms) <= 1e-5);
    const double M = static_cast<double>(N * P);
    for (std::int64_t c = 0; c < C; ++c) {
        double mean = 0, var = 0;  // exact two-pass variance of the same fp32 values
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) mean += x[static_cast<std::size_t>((n * C + c) * P + p)];
        mean /= M;
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) {
                const double d = x[static_cast<std::size_t>((n * C + c) * P + p)] - mean;
                var += d * d;
            }
        var /= M;
        const double ours = reps.bns[0].running_var[c] * (M - 1) / M;
        CHECK(std::abs(ours - var) / var <= 1e-5);

        float s = 0, q = 0;  // the naive fp32 E[x^2] - E[x]^2 this case is built to break
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) {
                const float v = static_cast<float>(x[static_cast<std::size_t>((n * C + c) * P + p)]);
                s += v;
                q += v * v;
            }
        const float naive = q / static_cast<float>(M) - (s / static_cast<float>(M)) * (s / static_cast<float>(M));
        CHECK(std::abs(static_cast<double>(naive) - var) / var > 1e-3);
    }
}

// Issue 43, item 11: the batch statistics depend on the batch alone, as PyTorch's do. A shift
// taken from the running mean (as lockstep once did) gives a clamped zero variance for unit-variance
// data under a running mean of 1e8, and loses the variance's digits to (mean / std)^2 in a first
// step whose mean is 1e6 standard deviations from zero. Mutation-checked: with the shift taken
// from the running mean again, both cases fail.
TEST_CASE("SyncBatchNorm's batch statistics do not depend on the running statistics", "[syncbn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const std::int64_t C = 3, H = 6, W = 5, P = H * W;
    const std::vector<std::int64_t> sizes{4, 0, 1, 2};  // uneven shards, one empty
    const std::int64_t N = 7;
    const auto format = GENERATE(MemoryFormat::nchw, MemoryFormat::nhwc);
    struct Case {
        const char* what;
        double data_mean, data_std;
        float running_mean;
    };
    for (const Case k : {Case{"unit variance, running mean 1e8", 0.0, 1.0, 1e8f},
                         Case{"first step, mean 1e6 standard deviations from zero", 3e3, 3e-3, 0.0f},
                         Case{"first step, running mean far below a large mean", 1e6, 1.0, -1e8f}}) {
        CAPTURE(k.what, to_string(format));
        const auto x = random_values(static_cast<std::size_t>(N * C * P), gen, k.data_mean, k.data_std);
        const auto dy = random_values(x.size(), gen, 0.0, 1.0);
        std::vector<double> gamma(static_cast<std::size_t>(C), 1.5), beta(static_cast<std::size_t>(C), -0.5);
        const auto run = [&](float running_mean) {
            SyncBatchNorm<> proto(C, {.momentum = 1.0, .format = format});  // running_var = the unbiased batch variance
            for (std::int64_t c = 0; c < C; ++c) {
                proto.weight.value[c] = 1.5f;
                proto.bias.value[c] = -0.5f;
                proto.running_mean[c] = running_mean;
            }
            Replicas reps(static_cast<int>(sizes.size()), proto);
            auto xs = scatter(x, sizes, C, H, W, true, format);
            auto dys = scatter(dy, sizes, C, H, W, true, format);
            std::vector<Tensor<float>> ys(sizes.size()), dxs(sizes.size());
            reps.pool.run([&](int r) {
                const auto ur = static_cast<std::size_t>(r);
                ys[ur] = reps.bns[ur].forward(reps.contexts[ur], xs[ur]);
                dxs[ur] = reps.bns[ur].backward(reps.contexts[ur], dys[ur]);
            });
            std::vector<double> rv(reps.bns[0].running_var.span().begin(), reps.bns[0].running_var.span().end());
            return std::tuple{gather(ys, C, P), gather(dxs, C, P), rv};
        };
        const auto [y, dx, rv] = run(k.running_mean);
        const auto ref = reference_bn(x, dy, gamma, beta, N, C, P, 1e-5);
        CHECK(test::rel_error(y, ref.y) <= 1e-5);
        CHECK(test::rel_error(dx, ref.dx, ref.dx_terms) <= 1e-5);
        const double M = static_cast<double>(N * P);
        for (std::int64_t c = 0; c < C; ++c) {
            const double var = ref.var[static_cast<std::size_t>(c)];
            CHECK(std::abs(rv[static_cast<std::size_t>(c)] * (M - 1) / M - var) / var <= 1e-5);
        }
        // The same batch under another running mean: the same bits.
        const auto [y0, dx0, rv0] = run(0.5f);
        CHECK(y == y0);
        CHECK(dx == dx0);
        CHECK(rv == rv0);
    }
}

TEST_CASE("SyncBatchNorm in eval mode uses running statistics and no collective", "[syncbn]") {
    SyncBatchNorm<> proto(3);
    for (std::int64_t c = 0; c < 3; ++c) {
        proto.running_mean[c] = 0.5f * static_cast<float>(c);
        proto.running_var[c] = 2.0f + static_cast<float>(c);
        proto.weight.value[c] = 1.5f;
        proto.bias.value[c] = -0.25f;
    }
    Replicas reps(2, proto);
    std::vector<Tensor<float>> xs{Tensor<float>(Shape{1, 3, 2, 2}), Tensor<float>(Shape{0, 3, 2, 2})};
    std::iota(xs[0].span().begin(), xs[0].span().end(), 1.0f);
    std::vector<Tensor<float>> ys(2);
    std::vector<std::uint64_t> counts(2);
    reps.pool.run([&](int r) {
        const auto ur = static_cast<std::size_t>(r);
        reps.contexts[ur].training = false;
        const auto c0 = reps.comms[ur].collective_count();
        ys[ur] = reps.bns[ur].forward(reps.contexts[ur], xs[ur]);
        counts[ur] = reps.comms[ur].collective_count() - c0;
    });
    CHECK(counts == std::vector<std::uint64_t>{0, 0});
    for (std::int64_t c = 0; c < 3; ++c)
        for (std::int64_t p = 0; p < 4; ++p) {
            const double x = xs[0][c * 4 + p];
            const double expect = (x - 0.5 * c) / std::sqrt(2.0 + c + 1e-5) * 1.5 - 0.25;
            CHECK(ys[0][c * 4 + p] == Approx(expect).epsilon(1e-6));
        }
    CHECK(reps.bns[0].num_batches_tracked[0] == 0);
}

TEST_CASE("SyncBatchNorm rejects bad input naming the layer and the shapes", "[syncbn]") {
    SyncBatchNorm<> bn(4);
    nn::Context<> ctx;
    CHECK_THROWS_WITH(bn.forward(ctx, Tensor<float>(Shape{2, 3, 5, 5})),
                      Catch::Contains("SyncBatchNorm(4): expected 4 channels") && Catch::Contains("(2, 3, 5, 5)"));
    CHECK_THROWS_AS(bn.forward(ctx, Tensor<float>(Shape{2, 4, 5})), ShapeError);
    CHECK_THROWS_WITH(bn.forward(ctx, Tensor<float>(Shape{2, 4, 5, 5}, MemoryFormat::nhwc)),
                      Catch::Contains("built for NCHW input but got an NHWC tensor"));
    CHECK_THROWS_AS(bn.backward(ctx, Tensor<float>(Shape{2, 4, 5, 5})), UsageError);
    bn.forward(ctx, Tensor<float>(Shape{2, 4, 5, 5}));
    CHECK_THROWS_WITH(bn.backward(ctx, Tensor<float>(Shape{2, 4, 5, 6})),
                      Catch::Contains("dy has shape (2, 4, 5, 6)") && Catch::Contains("(2, 4, 5, 5)"));
    CHECK_THROWS_WITH(bn.forward(ctx, Tensor<float>(Shape{1, 4})),
                      Catch::Contains("expected more than 1 value per channel when training"));
    CHECK_THROWS_AS(SyncBatchNorm<>(0), InvalidArgument);
    CHECK_THROWS_AS(SyncBatchNorm<>(3, {.eps = 0}), InvalidArgument);
}

TEST_CASE("SyncBatchNorm: one value per channel over all replicas is an error on every replica", "[syncbn]") {
    SyncBatchNorm<> proto(2);
    Replicas reps(2, proto);
    std::vector<Tensor<float>> xs{Tensor<float>(Shape{1, 2}), Tensor<float>(Shape{0, 2})};
    std::atomic<int> failures{0};
    CHECK_THROWS_WITH(reps.pool.run([&](int r) {
        try {
            reps.bns[static_cast<std::size_t>(r)].forward(reps.contexts[static_cast<std::size_t>(r)],
                                                          xs[static_cast<std::size_t>(r)]);
        } catch (const InvalidArgument&) {
            ++failures;
            throw;
        }
    }),
                      Catch::Contains("expected more than 1 value per channel when training"));
    CHECK(failures == 2);
}

TEST_CASE("SyncBatchNorm propagates NaN instead of hiding it", "[syncbn]") {
    LOCKSTEP_EACH_SIMD_LEVEL();
    SyncBatchNorm<> bn(1);
    nn::Context<> ctx;
    auto x = Tensor<float>(Shape{4, 1});
    x[2] = std::numeric_limits<float>::quiet_NaN();
    const auto y = bn.forward(ctx, x);
    for (std::int64_t i = 0; i < 4; ++i) CHECK(std::isnan(y[i]));
    CHECK(std::isnan(bn.running_mean[0]));
}

TEST_CASE("SIMD level: parsed by name, capped at what the CPU runs, chosen by LOCKSTEP_SIMD", "[syncbn]") {
    namespace simd = kernels::simd;
    CHECK(simd::parse("baseline") == simd::Level::baseline);
    CHECK(simd::parse("avx2") == simd::Level::avx2);
    CHECK(simd::parse("avx512") == simd::Level::avx512);
    CHECK_FALSE(simd::parse("AVX2").has_value());
    CHECK_FALSE(simd::parse("").has_value());
    // Before any test changes it: the level LOCKSTEP_SIMD names, else AVX2; capped at what there is.
    const char* env = std::getenv("LOCKSTEP_SIMD");
    const auto wanted = env != nullptr && *env != '\0' ? simd::parse(env).value() : simd::Level::avx2;
    const auto expected = static_cast<int>(wanted) < static_cast<int>(simd::supported()) ? wanted : simd::supported();
    CHECK(simd::active() == expected);
    SimdLevelScope scope;
    CHECK(simd::set_active(simd::Level::baseline) == simd::Level::baseline);
    CHECK(simd::active() == simd::Level::baseline);
    CHECK(simd::set_active(simd::Level::avx512) == simd::supported());
    CHECK(simd::active() == simd::supported());
}

TEST_CASE("SyncBatchNorm refuses a context of several replicas without their group", "[syncbn]") {
    SyncBatchNorm<> bn(2);
    nn::Context<> ctx;
    ctx.world = 2;  // but no ctx.comm: local statistics would silently differ from the global ones
    CHECK_THROWS_WITH(bn.forward(ctx, Tensor<float>(Shape{4, 2})),
                      Catch::Contains("SyncBatchNorm(2): the context says world 2 but has no communicator"));
    ctx.training = false;  // eval with running statistics needs no group
    CHECK_NOTHROW(bn.forward(ctx, Tensor<float>(Shape{4, 2})));
}

TEST_CASE("SyncBatchNorm with fused ReLU equals SyncBatchNorm then ReLU", "[syncbn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    for (const auto format : {MemoryFormat::nchw, MemoryFormat::nhwc}) {
        CAPTURE(to_string(format));
        const std::int64_t N = 5, C = 3, H = 4, W = 3;
        SyncBatchNorm<> fused(C, {.format = format, .fused_relu = true}), plain(C, {.format = format});
        nn::ReLU<> relu;
        Tensor<float> x(Shape{N, C, H, W}, format), dy(Shape{N, C, H, W}, format);
        std::normal_distribution<float> d(0.3f, 1.0f);
        for (auto& v : x.span()) v = d(gen);
        for (auto& v : dy.span()) v = d(gen);
        nn::Context<> ctx;
        const auto y1 = fused.forward(ctx, x);
        const auto y2 = relu.forward(ctx, plain.forward(ctx, x));
        CHECK(test::rel_error(y1.span(), y2.span()) <= 1e-7);
        std::int64_t zeros = 0;
        for (const float v : y1.span()) zeros += v == 0.0f;
        CHECK(zeros > 0);  // the ReLU did cut
        const auto dx1 = fused.backward(ctx, dy);
        const auto dx2 = plain.backward(ctx, relu.backward(ctx, dy));
        CHECK(test::rel_error(dx1.span(), dx2.span()) <= 1e-6);
        CHECK(test::rel_error(fused.weight.grad.span(), plain.weight.grad.span()) <= 1e-6);
        CHECK(test::rel_error(fused.bias.grad.span(), plain.bias.grad.span()) <= 1e-6);
        CHECK(test::rel_error(fused.running_var.span(), plain.running_var.span()) == 0);
        ctx.training = false;  // evaluation: ReLU applied, nothing saved
        const auto e1 = fused.forward(ctx, x);
        const auto e2 = relu.forward(ctx, plain.forward(ctx, x));
        CHECK(test::rel_error(e1.span(), e2.span()) <= 1e-7);
    }
}

TEST_CASE("SyncBatchNorm trains on after a NaN batch poisoned its running statistics", "[syncbn]") {
    // As in PyTorch, NaN reaches the running statistics; the next batch's statistics, which depend
    // on the batch alone (Note [shifted statistics]), stay clean.
    SyncBatchNorm<> bn(2), fresh(2);
    nn::Context<> ctx;
    Tensor<float> bad(Shape{4, 2});
    bad[3] = std::numeric_limits<float>::quiet_NaN();
    (void)bn.forward(ctx, bad);
    CHECK(std::isnan(bn.running_mean[1]));
    Tensor<float> x(Shape{4, 2});
    for (std::int64_t i = 0; i < 8; ++i) x[i] = 0.5f * static_cast<float>(i) - 1.0f;
    const auto y = bn.forward(ctx, x);
    const auto want = fresh.forward(ctx, x);
    CHECK(std::memcmp(y.data(), want.data(), y.bytes()) == 0);
}
