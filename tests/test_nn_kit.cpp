// SPDX-License-Identifier: MIT
//! The kit for real models (issue #45): average pooling against fp64 loops, Dropout's draws,
//! Add and Residual through nn::gradcheck (which must also catch a backward that drops the
//! skip gradient), and a residual network under DataParallel against one module.
#include <catch2/catch.hpp>

#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <map>
#include <sstream>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

using namespace lockstep;

namespace {

using test::random_tensor;

// PyTorch's windows, computed in fp64 from their definition: AvgPool2d's [o s, o s + k),
// AdaptiveAvgPool2d's [floor(o in / out), ceil((o + 1) in / out)).
struct Win {
    std::int64_t begin, end;
};
Win reference_window(std::int64_t o, std::int64_t in, std::int64_t out, std::int64_t k, std::int64_t s, bool adaptive) {
    if (!adaptive) return {o * s, o * s + k};
    return {static_cast<std::int64_t>(std::floor(static_cast<double>(o) * in / out)),
            static_cast<std::int64_t>(std::ceil(static_cast<double>(o + 1) * in / out))};
}

// y = pool(x) and dx = pool^T(dy) in fp64, by the windows above.
void reference_pool(const std::vector<double>& x, const std::vector<double>& dy, std::int64_t planes, std::int64_t H,
                    std::int64_t W, std::int64_t OH, std::int64_t OW, std::int64_t kh, std::int64_t kw, std::int64_t sh,
                    std::int64_t sw, bool adaptive, std::vector<double>& y, std::vector<double>& dx) {
    y.assign(static_cast<std::size_t>(planes * OH * OW), 0.0);
    dx.assign(x.size(), 0.0);
    for (std::int64_t p = 0; p < planes; ++p)
        for (std::int64_t oh = 0; oh < OH; ++oh)
            for (std::int64_t ow = 0; ow < OW; ++ow) {
                const Win r = reference_window(oh, H, OH, kh, sh, adaptive), c = reference_window(ow, W, OW, kw, sw, adaptive);
                const double size = static_cast<double>((r.end - r.begin) * (c.end - c.begin));
                const auto o = static_cast<std::size_t>((p * OH + oh) * OW + ow);
                for (std::int64_t h = r.begin; h < r.end; ++h)
                    for (std::int64_t w = c.begin; w < c.end; ++w) {
                        const auto i = static_cast<std::size_t>((p * H + h) * W + w);
                        y[o] += x[i] / size;
                        dx[i] += dy[o] / size;
                    }
            }
}

template <class Pool>
void check_pool(Pool pool, Shape in, std::int64_t OH, std::int64_t OW, std::int64_t kh, std::int64_t kw, std::int64_t sh,
                std::int64_t sw, bool adaptive, std::mt19937_64& gen) {
    CAPTURE(pool.describe(), in);
    const auto x = random_tensor(in, gen);
    nn::Context<> ctx;
    const auto y = pool.forward(ctx, x);
    REQUIRE(y.shape() == (Shape{in[0], in[1], OH, OW}));
    const auto dy = random_tensor(y.shape(), gen);
    const auto dx = pool.backward(ctx, dy);
    std::vector<double> ry, rdx;
    reference_pool({x.span().begin(), x.span().end()}, {dy.span().begin(), dy.span().end()}, in[0] * in[1], in[2], in[3], OH, OW,
                   kh, kw, sh, sw, adaptive, ry, rdx);
    CHECK(test::rel_error(y.span(), ry) <= 1e-6);
    CHECK(test::rel_error(dx.span(), rdx) <= 1e-6);
    const auto check = nn::gradcheck(pool, x);
    INFO(check.report());
    CHECK(check.passed());
}

}  // namespace

TEST_CASE("AvgPool2d and AdaptiveAvgPool2d match PyTorch's windows in fp64, forward and backward", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    for (const auto& [k, s] : std::vector<std::pair<std::int64_t, std::int64_t>>{{2, 2}, {3, 1}, {3, 2}, {2, 3}})
        check_pool(nn::AvgPool2d<>(k, s), Shape{2, 3, 7, 8}, (7 - k) / s + 1, (8 - k) / s + 1, k, k, s, s, false, gen);
    check_pool(nn::AvgPool2d<>(2, 3, 1, 2), Shape{1, 2, 5, 9}, 4, 4, 2, 3, 1, 2, false, gen);
    for (const auto& [in_h, in_w, oh, ow] :
         std::vector<std::array<std::int64_t, 4>>{{7, 8, 3, 5}, {5, 5, 1, 1}, {4, 6, 4, 6}, {3, 3, 5, 4}, {10, 7, 4, 3}})
        check_pool(nn::AdaptiveAvgPool2d<>(oh, ow), Shape{2, 3, in_h, in_w}, oh, ow, 0, 0, 0, 0, true, gen);
}

TEST_CASE("AdaptiveAvgPool2d(1) is the mean of each plane", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto x = random_tensor(Shape{3, 4, 6, 5}, gen);
    nn::AdaptiveAvgPool2d<> pool(1);
    nn::Context<> ctx;
    const auto y = pool.forward(ctx, x);
    REQUIRE(y.shape() == (Shape{3, 4, 1, 1}));
    for (std::int64_t p = 0; p < 12; ++p) {
        double m = 0;
        for (std::int64_t i = 0; i < 30; ++i) m += x[p * 30 + i];
        CHECK(std::abs(y[p] - m / 30) <= 1e-6);
    }
}

TEST_CASE("Pooling refuses input that does not fit, naming the layer", "[nn]") {
    nn::Context<> ctx;
    nn::AvgPool2d<> pool(3);
    CHECK_THROWS_WITH(pool.forward(ctx, Tensor<float>(Shape{1, 1, 2, 5})),
                      Catch::Contains("AvgPool2d(3x3") && Catch::Contains("smaller than the window"));
    CHECK_THROWS_AS(pool.forward(ctx, Tensor<float>(Shape{4, 9})), ShapeError);
    nn::AdaptiveAvgPool2d<> adaptive(2);
    CHECK_THROWS_WITH(adaptive.backward(ctx, Tensor<float>(Shape{1, 1, 2, 2})),
                      Catch::Contains("without a training-mode forward"));
    CHECK_THROWS_AS(nn::AvgPool2d<>(0), InvalidArgument);
}

TEST_CASE("Dropout keeps each element with probability 1 - p, scaled, and its backward uses the same mask", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    for (const double p : {0.1, 0.5, 0.8}) {
        CAPTURE(p);
        nn::Dropout<> drop(p, seed);
        nn::Context<> ctx;
        const auto x = random_tensor(Shape{4, 25, 10, 10}, gen, 0.5, 1.5);  // no zeros: a zero output means dropped
        const auto y = drop.forward(ctx, x);
        const auto dy = random_tensor(y.shape(), gen);
        const auto dx = drop.backward(ctx, dy);
        const float scale = static_cast<float>(1.0 / (1.0 - p));
        std::int64_t kept = 0;
        for (std::int64_t i = 0; i < x.numel(); ++i) {
            const bool k = y[i] != 0.0f;
            kept += k;
            REQUIRE(y[i] == (k ? x[i] * scale : 0.0f));
            REQUIRE(dx[i] == (k ? dy[i] * scale : 0.0f));
        }
        // Within 5 standard deviations of the binomial's mean.
        const double n = static_cast<double>(x.numel()), sd = std::sqrt(n * p * (1 - p));
        CHECK(std::abs(static_cast<double>(kept) - n * (1 - p)) <= 5 * sd);
    }
}

TEST_CASE("Dropout's masks are reproducible from the seed and differ by replica and call", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto x = random_tensor(Shape{8, 64}, gen, 0.5, 1.5);
    const auto mask = [&](nn::Dropout<>& d, int rank) {
        nn::Context<> ctx;
        ctx.rank = rank;
        ctx.world = 4;
        const auto y = d.forward(ctx, x);
        std::vector<bool> m;
        for (const float v : y.span()) m.push_back(v != 0.0f);
        return m;
    };
    nn::Dropout<> a(0.5, seed), b(0.5, seed), other_seed(0.5, seed + 1);
    const auto first = mask(a, 0);
    CHECK(mask(b, 0) == first);           // same seed, rank and call
    CHECK(mask(other_seed, 0) != first);  // another seed
    nn::Dropout<> c(0.5, seed);
    CHECK(mask(c, 1) != first);  // another replica
    nn::Dropout<> copy = a;      // after one call: the copy continues where a is
    const auto second = mask(a, 0);
    CHECK(second != first);  // the next call
    CHECK(mask(copy, 0) == second);
    // Evaluation and p = 0 pass x through untouched; p = 1 drops everything.
    nn::Context<> eval;
    eval.training = false;
    const auto same = a.forward(eval, x);
    CHECK(test::rel_error(same.span(), x.span()) == 0);
    nn::Dropout<> all(1.0, seed);
    nn::Context<> ctx;
    const auto dropped = all.forward(ctx, x);
    for (const float v : dropped.span()) REQUIRE(v == 0.0f);
    CHECK_THROWS_AS(nn::Dropout<>(1.5, seed), InvalidArgument);
    const auto check = nn::gradcheck(nn::Dropout<>(0.3, seed), x);  // each evaluation draws the same mask
    INFO(check.report());
    CHECK(check.passed());
}

namespace {

// A residual block whose hand-written backward forgets the skip gradient: what nn::gradcheck
// exists to catch.
struct ForgetfulResidual {
    using backend = Host;
    nn::Linear<> fc;
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) {
        Tensor<float> skip = x;
        auto y = fc.forward(ctx, std::move(x));
        kernels::Ops<Host>::add({}, y, skip);
        return y;
    }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) { return fc.backward(ctx, dy); }
    template <class V>
    void visit(V&& v) {
        v.module("fc", fc);
    }
};

// Inputs whose ReLU and max-pool decisions stay put under the check's steps: away from zero.
Tensor<float> away_from_zero(Shape s, std::mt19937_64& gen) {
    auto t = random_tensor(s, gen, 0.2, 1.0);
    std::bernoulli_distribution sign(0.5);
    for (auto& v : t.span()) v = sign(gen) ? v : -v;
    return t;
}

}  // namespace

TEST_CASE("Add and Residual: the sum of the branches forward, both branches' gradients backward", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    const auto x = away_from_zero(Shape{3, 4, 5, 5}, gen);

    SECTION("Add of two convolutions is their sum, and gradcheck passes") {
        nn::Add add(nn::Conv2d<>(4, 3, 3, {.padding = 1}, g), nn::Conv2d<>(4, 3, 1, {}, g));
        nn::Context<> ctx;
        auto left = add.left(), right = add.right();
        const auto want_a = left.forward(ctx, x), want_b = right.forward(ctx, x);
        const auto y = add.forward(ctx, x);
        for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y[i] == want_a[i] + want_b[i]);
        const auto check = nn::gradcheck(add, x);
        INFO(check.report());
        CHECK(check.passed());
        CHECK(check.parameter_errors.size() == 4);
        CHECK(check.parameter_errors[0].first == "0.weight");
        CHECK(check.parameter_errors[3].first == "1.bias");
    }
    SECTION("Residual with an identity shortcut: y = relu(branch(x) + x)") {
        nn::Residual block(nn::Sequential(nn::Conv2d<>(2, 2, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(2)));
        nn::Context<> ctx;
        // An input whose every sum lies at least 0.05 from the ReLU's kink, so the check's steps
        // never cross it (small, so such an input is a few draws away).
        Tensor<float> in;
        Tensor<float> b;
        for (int draw = 0;; ++draw) {
            REQUIRE(draw < 1000);
            in = random_tensor(Shape{2, 2, 3, 3}, gen);
            auto branch = block.branch();
            b = branch.forward(ctx, in);
            double margin = 1;
            for (std::int64_t i = 0; i < in.numel(); ++i) margin = std::min(margin, std::abs(static_cast<double>(b[i]) + in[i]));
            if (margin > 0.05) break;
        }
        const auto y = block.forward(ctx, in);
        for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y[i] == std::max(b[i] + in[i], 0.0f));
        const auto check = nn::gradcheck(block, in);
        INFO(check.report());
        CHECK(check.passed());
        std::vector<std::string> names;
        nn::for_each_parameter(block, [&](const std::string& n, auto&) { names.push_back(n); });
        CHECK(names.front() == "branch.0.weight");
        CHECK(names.back() == "branch.1.bias");
    }
    SECTION("Residual with a strided projection on the shortcut") {
        nn::Residual block(nn::Sequential(nn::Conv2d<>(4, 6, 3, {.stride = 2, .padding = 1}, g), nn::SyncBatchNorm<>(6)),
                           nn::Sequential(nn::Conv2d<>(4, 6, 1, {.stride = 2, .bias = false}, g), nn::SyncBatchNorm<>(6)),
                           {.relu = false});
        nn::Context<> ctx;
        REQUIRE(block.forward(ctx, x).shape() == (Shape{3, 6, 3, 3}));
        const auto check = nn::gradcheck(block, x);
        INFO(check.report());
        CHECK(check.passed());
        std::vector<std::string> names;
        nn::for_each_parameter(block, [&](const std::string& n, auto&) { names.push_back(n); });
        CHECK(names.back() == "shortcut.1.bias");
    }
    SECTION("branches that disagree in shape are refused, naming the fix") {
        nn::Residual block(nn::Conv2d<>(4, 6, 3, {.padding = 1}, g));
        nn::Context<> ctx;
        CHECK_THROWS_WITH(block.forward(ctx, x), Catch::Contains("Residual") && Catch::Contains("projection on the shortcut"));
    }
}

TEST_CASE("gradcheck catches a residual backward that drops the skip gradient", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    const auto x = random_tensor(Shape{4, 6}, gen);
    ForgetfulResidual broken{nn::Linear<>(6, 6, true, g)};
    const auto bad = nn::gradcheck(broken, x);
    INFO(bad.report());
    CHECK_FALSE(bad.passed());
    CHECK(bad.input_error > 0.1);
    CHECK(bad.report().find("FAIL  dx") != std::string::npos);
    // Its parameters' gradients are right: only dx is named.
    CHECK(bad.parameter_errors.at(0).second <= 1e-2);
    nn::Residual fixed(nn::Linear<>(6, 6, true, g), {.relu = false});
    CHECK(nn::gradcheck(fixed, x).passed());
}

namespace {

// A residual network with no kink anywhere (no ReLU, no max pooling): every split of the batch
// must give one module's result to rounding.
auto make_residual_net(std::uint64_t seed) {
    nn::Generator g(seed);
    return nn::Sequential(
        nn::Conv2d<>(2, 4, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(4),
        nn::Residual(nn::Sequential(nn::Conv2d<>(4, 4, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(4)), {.relu = false}),
        nn::Residual(nn::Sequential(nn::Conv2d<>(4, 6, 3, {.stride = 2, .padding = 1}, g), nn::SyncBatchNorm<>(6)),
                     nn::Sequential(nn::Conv2d<>(4, 6, 1, {.stride = 2, .bias = false}, g), nn::SyncBatchNorm<>(6)),
                     {.relu = false}),
        nn::AvgPool2d<>(2), nn::AdaptiveAvgPool2d<>(1), nn::Flatten<>(), nn::Linear<>(6, 5, true, g));
}

template <class M>
std::map<std::string, std::vector<double>> named_state(const M& m) {
    std::map<std::string, std::vector<double>> out;
    nn::walk(
        m, [&](const std::string& name, const auto& p) { out[name].assign(p.value.span().begin(), p.value.span().end()); },
        [&](const std::string& name, const auto& t) { out[name].assign(t.span().begin(), t.span().end()); });
    return out;
}

}  // namespace

TEST_CASE("A residual network with pooling trains alike on 1 to 4 replicas with uneven shards", "[nn][parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    std::vector<std::pair<Tensor<float>, std::vector<std::int64_t>>> batches;
    for (int s = 0; s < 3; ++s) {
        std::vector<std::int64_t> labels;
        for (int i = 0; i < 11; ++i) labels.push_back(static_cast<std::int64_t>(gen() % 5));
        batches.emplace_back(random_tensor(Shape{11, 2, 8, 8}, gen), labels);
    }
    const auto run = [&](int replicas) {
        DataParallel dp(make_residual_net(seed), replicas);
        nn::Sgd sgd({.lr = 0.1, .momentum = 0.9});
        std::vector<double> losses;
        for (const auto& [x, y] : batches) losses.push_back(dp.train_step(x, y, nn::SoftmaxCrossEntropy{}, sgd).loss);
        return std::pair{losses, named_state(dp.module())};
    };
    const auto [want_losses, want] = run(1);
    for (int replicas = 2; replicas <= 4; ++replicas) {
        CAPTURE(replicas);
        const auto [losses, got] = run(replicas);
        CHECK(test::rel_error(losses, want_losses) <= 1e-5);
        for (const auto& [name, w] : want) {
            CAPTURE(name);
            double diff = 0, norm = 0;
            for (std::size_t i = 0; i < w.size(); ++i) {
                diff += (got.at(name)[i] - w[i]) * (got.at(name)[i] - w[i]);
                norm += w[i] * w[i];
            }
            // Biases whose gradients a later batch norm cancels (the convolutions', those of the
            // batch norms before the last block) stay at rounding noise: measured against 1e-2,
            // the weights' scale.
            CHECK(std::sqrt(diff) <= 1e-5 * std::max(std::sqrt(norm), 1e-2));
        }
    }
}

namespace {

// Two linear layers; forward uses the second only when `use_second`, visit() lists the second
// only when `list_second`.
struct TwoLayers {
    using backend = Host;
    nn::Linear<> first, second;
    bool use_second = true, list_second = true;
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) {
        auto h = first.forward(ctx, std::move(x));
        return use_second ? second.forward(ctx, std::move(h)) : h;
    }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
        return first.backward(ctx, use_second ? second.backward(ctx, dy) : dy);
    }
    template <class V>
    void visit(V&& v) {
        v.module("first", first);
        if (list_second) v.module("second", second);
    }
};

TwoLayers two_layers(std::uint64_t seed, bool use_second, bool list_second) {
    nn::Generator g(seed);
    return TwoLayers{nn::Linear<>(6, 6, true, g), nn::Linear<>(6, 6, true, g), use_second, list_second};
}

// What `f` writes to std::cerr.
template <class F>
std::string cerr_of(F&& f) {
    std::ostringstream captured;
    auto* old = std::cerr.rdbuf(captured.rdbuf());
    try {
        f();
    } catch (...) {
        std::cerr.rdbuf(old);
        throw;
    }
    std::cerr.rdbuf(old);
    return captured.str();
}

}  // namespace

TEST_CASE("DataParallel names a parameter that received no gradient, once, unless it is frozen", "[nn][parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto x = random_tensor(Shape{6, 6}, gen);
    const std::vector<std::int64_t> labels{0, 1, 2, 3, 4, 5};
    SECTION("a child listed by visit() that forward skips is named at the first step only") {
        DataParallel dp(two_layers(seed, false, true), 2);
        nn::Sgd sgd({.lr = 0.1});
        const auto first = cerr_of([&] { dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd); });
        CHECK(first.find("2 parameters received no gradient") != std::string::npos);
        CHECK(first.find("'second.weight' 'second.bias'") != std::string::npos);
        CHECK(first.find("'first.") == std::string::npos);
        CHECK(cerr_of([&] { dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd); }).empty());
    }
    SECTION("frozen parameters are not named, and Sgd leaves them as they are") {
        auto net = two_layers(seed, false, true);
        net.second.weight.frozen = net.second.bias.frozen = true;
        const auto before = net.second.weight.value;
        DataParallel dp(std::move(net), 2);
        nn::Sgd sgd({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1});
        CHECK(cerr_of([&] { dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd); }).empty());
        dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
        CHECK(test::rel_error(dp.module().second.weight.value.span(), before.span()) == 0);
        CHECK(test::rel_error(dp.replica(1).second.weight.value.span(), before.span()) == 0);
    }
    SECTION("a model whose every parameter gets a gradient is not warned about") {
        DataParallel dp(two_layers(seed, true, true), 2);
        nn::Sgd sgd({.lr = 0.1});
        CHECK(cerr_of([&] { dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd); }).empty());
    }
    SECTION("a child that forward uses but visit() leaves out fails the step, naming visit()") {
        DataParallel dp(two_layers(seed, true, false), 2);
        nn::Sgd sgd({.lr = 0.1});
        CHECK_THROWS_WITH(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd),
                          Catch::Contains("mark_grad_ready") && Catch::Contains("visit()"));
        const auto before = dp.module().first.weight.value;
        CHECK_THROWS_AS(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd), UsageError);
        CHECK(test::rel_error(dp.module().first.weight.value.span(), before.span()) == 0);  // nothing applied
    }
}

TEST_CASE("LayerNorm matches an fp64 layer norm, forward and backward, and gradcheck passes", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    for (const bool affine : {true, false}) {
        CAPTURE(affine);
        const std::int64_t R = 6, M = 10;
        nn::LayerNorm<> ln(Shape{2, 5}, {.eps = 1e-5, .elementwise_affine = affine});
        if (affine) {
            ln.weight.value = random_tensor(Shape{2, 5}, gen, 0.5, 1.5);
            ln.bias.value = random_tensor(Shape{2, 5}, gen);
        }
        const auto x = random_tensor(Shape{3, 2, 2, 5}, gen, -2.0, 3.0);  // 6 rows of 10
        nn::Context<> ctx;
        nn::zero_grad(ln);
        const auto y = ln.forward(ctx, x);
        const auto dy = random_tensor(y.shape(), gen);
        const auto dx = ln.backward(ctx, dy);
        // fp64: y = xhat w + b; dx from the definition; dw = sum dy xhat, db = sum dy.
        std::vector<double> ry(static_cast<std::size_t>(R * M)), rdx(ry.size()), rdw(M, 0.0), rdb(M, 0.0);
        for (std::int64_t i = 0; i < R; ++i) {
            double mu = 0, var = 0;
            for (std::int64_t j = 0; j < M; ++j) mu += x[i * M + j];
            mu /= M;
            for (std::int64_t j = 0; j < M; ++j) var += (x[i * M + j] - mu) * (x[i * M + j] - mu);
            var /= M;
            const double r = 1 / std::sqrt(var + 1e-5);
            double a = 0, c = 0;
            for (std::int64_t j = 0; j < M; ++j) {
                const double w = affine ? ln.weight.value[j] : 1.0, b = affine ? ln.bias.value[j] : 0.0;
                const double xhat = (x[i * M + j] - mu) * r;
                ry[static_cast<std::size_t>(i * M + j)] = xhat * w + b;
                a += dy[i * M + j] * w;
                c += dy[i * M + j] * w * xhat;
                rdw[static_cast<std::size_t>(j)] += dy[i * M + j] * xhat;
                rdb[static_cast<std::size_t>(j)] += dy[i * M + j];
            }
            for (std::int64_t j = 0; j < M; ++j) {
                const double w = affine ? ln.weight.value[j] : 1.0;
                const double xhat = (x[i * M + j] - mu) * r;
                rdx[static_cast<std::size_t>(i * M + j)] = r * (dy[i * M + j] * w - a / M - xhat * c / M);
            }
        }
        CHECK(test::rel_error(y.span(), ry) <= 1e-6);
        CHECK(test::rel_error(dx.span(), rdx) <= 1e-6);
        if (affine) {
            CHECK(test::rel_error(ln.weight.grad.span(), rdw) <= 1e-6);
            CHECK(test::rel_error(ln.bias.grad.span(), rdb) <= 1e-6);
        }
        const auto check = nn::gradcheck(ln, x);
        INFO(check.report());
        CHECK(check.passed());
    }
    nn::LayerNorm<> ln(8);
    nn::Context<> ctx;
    CHECK_THROWS_WITH(ln.forward(ctx, Tensor<float>(Shape{4, 7})),
                      Catch::Contains("LayerNorm(8)") && Catch::Contains("(N, ..., 8)"));
    CHECK_THROWS_AS(ln.backward(ctx, Tensor<float>(Shape{4, 8})), UsageError);
    std::vector<std::string> names;
    nn::for_each_parameter(ln, [&](const std::string& n, auto&) { names.push_back(n); });
    CHECK(names == std::vector<std::string>{"weight", "bias"});
}

namespace {

// A module that runs one Linear twice per forward (y = lin(relu(lin(x)))): what the kit cannot
// train correctly, since the second forward overwrites what the first kept for backward.
struct LinearTwice {
    using backend = Host;
    nn::Linear<> lin;
    nn::ReLU<> relu;
    template <class V>
    void visit(V&& v) {
        v.module("lin", lin);
    }
    Tensor<float> forward(const nn::Context<Host>& ctx, Tensor<float> x) {
        return lin.forward(ctx, relu.forward(ctx, lin.forward(ctx, std::move(x))));
    }
    Tensor<float> backward(const nn::Context<Host>& ctx, const Tensor<float>& dy) {
        return lin.backward(ctx, relu.backward(ctx, lin.backward(ctx, dy)));
    }
};

}  // namespace

TEST_CASE("a layer instance used twice in one training forward is refused, naming the layer", "[nn][kit]") {
    nn::Generator gen(4);
    std::mt19937_64 rng(4);
    DataParallel dp(LinearTwice{nn::Linear<>(3, 3, true, gen), nn::ReLU<>()}, 2);
    nn::Sgd sgd({.lr = 0.1});
    const auto x = random_tensor(Shape{4, 3}, rng);
    const std::vector<std::int64_t> labels = {0, 1, 2, 0};
    const auto before = dp.module().lin.weight.value;
    CHECK_THROWS_WITH(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd),
                      Catch::Contains("Linear(") && Catch::Contains("ran twice in one training forward") &&
                          Catch::Contains("Give each use its own instance"));
    // Nothing was applied, and the refusal repeats on the next step (it is no leftover of the first).
    for (std::int64_t i = 0; i < before.numel(); ++i) CHECK(dp.module().lin.weight.value[i] == before[i]);
    CHECK_THROWS_AS(dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd), UsageError);
    // An evaluation keeps nothing, so there reuse is harmless and allowed.
    dp.eval();
    CHECK(dp.forward(x).shape() == (Shape{4, 3}));
    dp.train();
    // One use per pass is fine step after step, and outside DataParallel (pass 0) nothing is checked.
    nn::Generator g2(4);
    DataParallel ok(nn::Sequential(nn::Linear<>(3, 3, true, g2), nn::ReLU<>(), nn::Linear<>(3, 3, true, g2)), 2);
    for (int step = 0; step < 3; ++step) CHECK_NOTHROW(ok.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd));
    LinearTwice alone{nn::Linear<>(3, 3, true, gen), nn::ReLU<>()};
    CHECK_NOTHROW(alone.forward(nn::Context<Host>{}, x));
    // A module copied out of one DataParallel trains in another: pass numbers are unique in the
    // process, so the copy's layers have seen none of the new one's.
    DataParallel again(ok.module(), 2);
    for (int step = 0; step < 3; ++step) CHECK_NOTHROW(again.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd));
    // parallel_apply's function drives the module itself: its forwards are not numbered.
    CHECK_NOTHROW(ok.parallel_apply([](auto& m, nn::Context<Host>& c) {
        const Tensor<float> in(Shape{2, 3});
        m.forward(c, in);
        m.forward(c, in);
    }));
    CHECK_NOTHROW(ok.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd));
}
