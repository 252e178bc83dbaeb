// SPDX-License-Identifier: MIT
//! The public tensor operations (nn/tensor_ops.hpp, issue #45) on the host: each against an fp64
//! loop over logical indices (NCHW and NHWC), each backward against central finite differences,
//! their bad input, and a custom module written with them (examples/resnet/channel_gate.hpp)
//! through nn::gradcheck and DataParallel.
#include <catch2/catch.hpp>

#include <lockstep/host.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "../examples/resnet/channel_gate.hpp"
#include "test_support.hpp"

using namespace lockstep;

namespace {

using test::random_tensor;

const nn::Context<Host> ctx{};

// Logical element (n, c, h, w) of a 4-D tensor, or element i of another rank, in fp64.
double at4(const Tensor<float>& t, std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
    const Shape& s = t.shape();
    const std::int64_t i =
        t.format() == MemoryFormat::nhwc ? ((n * s[2] + h) * s[3] + w) * s[1] + c : ((n * s[1] + c) * s[2] + h) * s[3] + w;
    return t[i];
}

// The same values in the other memory format (an (N, C, H, W) tensor re-laid out).
Tensor<float> relayout(const Tensor<float>& t, MemoryFormat f) {
    const Shape& s = t.shape();
    Tensor<float> out(s, f);
    for (std::int64_t n = 0; n < s[0]; ++n)
        for (std::int64_t c = 0; c < s[1]; ++c)
            for (std::int64_t h = 0; h < s[2]; ++h)
                for (std::int64_t w = 0; w < s[3]; ++w) {
                    const std::int64_t i =
                        f == MemoryFormat::nhwc ? ((n * s[2] + h) * s[3] + w) * s[1] + c : ((n * s[1] + c) * s[2] + h) * s[3] + w;
                    out[i] = static_cast<float>(at4(t, n, c, h, w));
                }
    return out;
}

// Central differences of the scalar sum(f(x) * probe) with respect to each element of x.
std::vector<double> numeric_grad(const std::function<Tensor<float>(const Tensor<float>&)>& f, const Tensor<float>& x,
                                 const Tensor<float>& probe, double step = 1e-3) {
    std::vector<double> g(static_cast<std::size_t>(x.numel()));
    const auto objective = [&](const Tensor<float>& at) {
        const Tensor<float> y = f(at);
        double s = 0;
        for (std::int64_t i = 0; i < y.numel(); ++i) s += static_cast<double>(y[i]) * probe[i];
        return s;
    };
    for (std::int64_t i = 0; i < x.numel(); ++i) {
        Tensor<float> plus = x, minus = x;
        plus[i] += static_cast<float>(step);
        minus[i] -= static_cast<float>(step);
        g[static_cast<std::size_t>(i)] = (objective(plus) - objective(minus)) / (static_cast<double>(plus[i]) - minus[i]);
    }
    return g;
}

double max_error(const Tensor<float>& got, const std::vector<double>& want) {
    double worst = 0, scale = 1e-3;
    for (std::size_t i = 0; i < want.size(); ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(got[static_cast<std::int64_t>(i)]) - want[i]));
        scale = std::max(scale, std::abs(want[i]));
    }
    return worst / scale;
}

}  // namespace

TEST_CASE("elementwise tensor operations match fp64 and keep the operands' layout", "[ops]") {
    std::mt19937_64 gen(1);
    const auto a = random_tensor(Shape{2, 3, 4, 5}, gen), b = random_tensor(Shape{2, 3, 4, 5}, gen);
    const auto sum = ops::add(ctx, a, b), diff = ops::sub(ctx, a, b), prod = ops::mul(ctx, a, b);
    const auto comb = ops::axpby(ctx, 0.5f, a, -2.0f, b);
    const auto scaled = ops::scale(ctx, a, 3.0f);
    Tensor<float> y = b;
    ops::axpy(ctx, -0.25f, a, y);
    for (std::int64_t i = 0; i < a.numel(); ++i) {
        const double x = a[i], z = b[i];
        CHECK(sum[i] == static_cast<float>(x + z));
        CHECK(diff[i] == static_cast<float>(x - z));
        CHECK(prod[i] == static_cast<float>(x * z));
        CHECK(comb[i] == Approx(0.5 * x - 2.0 * z).epsilon(1e-6).margin(1e-7));
        CHECK(scaled[i] == static_cast<float>(x * 3.0));
        CHECK(y[i] == Approx(z - 0.25 * x).epsilon(1e-6).margin(1e-7));
    }
    // An infinity scaled stays infinite (no 0 * inf from an unused operand).
    Tensor<float> inf(Shape{2});
    inf[0] = std::numeric_limits<float>::infinity();
    inf[1] = 1;
    const auto s2 = ops::scale(ctx, inf, 2.0f);
    CHECK(std::isinf(s2[0]));
    CHECK(s2[1] == 2.0f);
    // mul's backward: da = dy b, db = dy a.
    const auto dy = random_tensor(a.shape(), gen);
    const auto [da, db] = ops::mul_backward(ctx, a, b, dy);
    for (std::int64_t i = 0; i < a.numel(); ++i) {
        CHECK(da[i] == dy[i] * b[i]);
        CHECK(db[i] == dy[i] * a[i]);
    }
}

TEST_CASE("sum and mean over any dimensions match fp64, in NCHW and NHWC", "[ops]") {
    std::mt19937_64 gen(2);
    const auto x = random_tensor(Shape{3, 4, 5, 2}, gen);
    const auto xh = relayout(x, MemoryFormat::nhwc);
    for (const ops::Dims& dims : std::vector<ops::Dims>{{2, 3}, {0}, {1}, {0, 2}, {-1}, {}, {3, 0, 1}}) {
        bool reduced[4] = {dims.empty(), dims.empty(), dims.empty(), dims.empty()};
        for (int d : dims) reduced[d < 0 ? d + 4 : d] = true;
        std::int64_t count = 1;
        for (int d = 0; d < 4; ++d)
            if (reduced[d]) count *= x.dim(d);
        for (bool keepdim : {false, true}) {
            const auto s = ops::sum(ctx, x, dims, keepdim), m = ops::mean(ctx, x, dims, keepdim);
            const auto sh = ops::sum(ctx, xh, dims, keepdim);
            CHECK(s.numel() == x.numel() / count);
            CHECK(s.rank() == (keepdim ? 4 : 4 - static_cast<int>(dims.empty() ? 4 : dims.size())));
            // The fp64 reference, output elements in the kept dimensions' row-major order.
            std::vector<double> want(static_cast<std::size_t>(s.numel()), 0.0);
            for (std::int64_t n = 0; n < 3; ++n)
                for (std::int64_t c = 0; c < 4; ++c)
                    for (std::int64_t h = 0; h < 5; ++h)
                        for (std::int64_t w = 0; w < 2; ++w) {
                            const std::int64_t idx[4] = {n, c, h, w};
                            std::int64_t o = 0;
                            for (int d = 0; d < 4; ++d)
                                if (!reduced[d]) o = o * x.dim(d) + idx[d];
                            want[static_cast<std::size_t>(o)] += at4(x, n, c, h, w);
                        }
            for (std::int64_t o = 0; o < s.numel(); ++o) {
                CHECK(s[o] == static_cast<float>(want[static_cast<std::size_t>(o)]));
                CHECK(sh[o] == s[o]);  // the same sum in the same order, whatever the layout
                CHECK(m[o] == static_cast<float>(want[static_cast<std::size_t>(o)] / static_cast<double>(count)));
            }
        }
    }
}

TEST_CASE("the backward of sum, mean and expand against finite differences", "[ops]") {
    std::mt19937_64 gen(3);
    for (MemoryFormat f : {MemoryFormat::nchw, MemoryFormat::nhwc}) {
        const auto x = relayout(random_tensor(Shape{2, 3, 2, 3}, gen), f);
        for (const ops::Dims& dims : std::vector<ops::Dims>{{2, 3}, {0, 1}, {1}}) {
            const auto probe = random_tensor(ops::sum(ctx, x, dims).shape(), gen);
            const auto ds = ops::sum_backward(ctx, probe, x.shape(), dims, f);
            const auto dm = ops::mean_backward(ctx, probe, x.shape(), dims, f);
            CHECK(ds.format() == f);
            CHECK(max_error(ds, numeric_grad([&](const Tensor<float>& t) { return ops::sum(ctx, t, dims); }, x, probe)) < 2e-3);
            CHECK(max_error(dm, numeric_grad([&](const Tensor<float>& t) { return ops::mean(ctx, t, dims); }, x, probe)) < 2e-3);
        }
    }
    // expand: a per-channel value at every pixel, and its keepdim form.
    const auto v = random_tensor(Shape{2, 3}, gen);
    const auto e = ops::expand(ctx, v, Shape{2, 3, 4, 4}, {2, 3}, MemoryFormat::nhwc);
    for (std::int64_t n = 0; n < 2; ++n)
        for (std::int64_t c = 0; c < 3; ++c) CHECK(at4(e, n, c, 3, 1) == v[n * 3 + c]);
    Tensor<float> v4 = v;
    const auto e4 = ops::expand(ctx, Tensor<float>::view(v4.data(), Shape{2, 3, 1, 1}, v4.device()), Shape{2, 3, 4, 4}, {2, 3});
    CHECK(at4(e4, 1, 2, 2, 3) == v[5]);
}

TEST_CASE("softmax along each dimension matches fp64, and its backward finite differences", "[ops]") {
    std::mt19937_64 gen(4);
    const auto base = random_tensor(Shape{2, 4, 3, 3}, gen, -3.0, 3.0);
    for (MemoryFormat f : {MemoryFormat::nchw, MemoryFormat::nhwc}) {
        const auto x = relayout(base, f);
        for (int dim : {0, 1, 2, 3, -1}) {
            const auto y = ops::softmax(ctx, x, dim);
            const int d = dim < 0 ? dim + 4 : dim;
            // fp64 reference per logical element.
            double worst = 0;
            for (std::int64_t n = 0; n < 2; ++n)
                for (std::int64_t c = 0; c < 4; ++c)
                    for (std::int64_t h = 0; h < 3; ++h)
                        for (std::int64_t w = 0; w < 3; ++w) {
                            std::int64_t idx[4] = {n, c, h, w};
                            double m = -1e300, s = 0;
                            for (std::int64_t k = 0; k < x.dim(d); ++k) {
                                idx[d] = k;
                                m = std::max(m, at4(x, idx[0], idx[1], idx[2], idx[3]));
                            }
                            for (std::int64_t k = 0; k < x.dim(d); ++k) {
                                idx[d] = k;
                                s += std::exp(at4(x, idx[0], idx[1], idx[2], idx[3]) - m);
                            }
                            const double want = std::exp(at4(x, n, c, h, w) - m) / s;
                            worst = std::max(worst, std::abs(at4(y, n, c, h, w) - want) / want);
                        }
            CHECK(worst < 1e-6);
            const auto probe = random_tensor(x.shape(), gen);
            const auto dx = ops::softmax_backward(ctx, y, relayout(relayout(probe, MemoryFormat::nchw), f), dim);
            CHECK(max_error(dx, numeric_grad([&](const Tensor<float>& t) { return ops::softmax(ctx, t, dim); }, x,
                                             relayout(relayout(probe, MemoryFormat::nchw), f))) < 5e-3);
        }
    }
    // Large logits do not overflow; a NaN spoils its line only.
    Tensor<float> big(Shape{2, 3});
    const float vals[6] = {1000.0f, 1001.0f, 999.0f, std::nanf(""), 0.0f, 1.0f};
    for (int i = 0; i < 6; ++i) big[i] = vals[i];
    const auto p = ops::softmax(ctx, big, 1);
    CHECK(p[1] == Approx(std::exp(1.0) / (1 + std::exp(1.0) + std::exp(-1.0))));
    CHECK(std::isnan(p[3]));
    CHECK(std::isnan(p[5]));
    CHECK(p[0] + p[1] + p[2] == Approx(1.0));
}

TEST_CASE("argmax: the first of equals, NaN as the largest, on logical dimensions", "[ops]") {
    Tensor<float> x(Shape{3, 4});
    const float vals[12] = {1, 5, 5, 2, -1, -2, -3, -4, 0, std::nanf(""), 7, std::nanf("")};
    for (int i = 0; i < 12; ++i) x[i] = vals[i];
    const auto rows = ops::argmax(ctx, x, 1);
    REQUIRE(rows.shape() == Shape{3});
    CHECK(rows[0] == 1);
    CHECK(rows[1] == 0);
    CHECK(rows[2] == 1);
    const auto cols = ops::argmax(ctx, x, 0);
    REQUIRE(cols.shape() == Shape{4});
    CHECK(cols[0] == 0);
    CHECK(cols[1] == 2);
    CHECK(cols[2] == 2);
    CHECK(cols[3] == 2);
    // Over channels of an NHWC batch: the same answers as NCHW.
    std::mt19937_64 gen(5);
    const auto t = random_tensor(Shape{2, 5, 3, 2}, gen);
    const auto a = ops::argmax(ctx, t, 1), b = ops::argmax(ctx, relayout(t, MemoryFormat::nhwc), 1);
    REQUIRE(a.shape() == (Shape{2, 3, 2}));
    for (std::int64_t i = 0; i < a.numel(); ++i) {
        CHECK(a[i] == b[i]);
        const std::int64_t n = i / 6, h = (i / 2) % 3, w = i % 2;
        for (std::int64_t c = 0; c < 5; ++c) CHECK(at4(t, n, a[i], h, w) >= at4(t, n, c, h, w));
    }
}

TEST_CASE("concat along any dimension and split undo each other, in NCHW and NHWC", "[ops]") {
    std::mt19937_64 gen(6);
    for (MemoryFormat f : {MemoryFormat::nchw, MemoryFormat::nhwc}) {
        for (int dim : {0, 1, 2, 3}) {
            Shape sa{2, 3, 4, 2}, sb = sa.with(dim, 1), sc = sa.with(dim, 3);
            const auto a = relayout(random_tensor(sa, gen), f), b = relayout(random_tensor(sb, gen), f),
                       c = relayout(random_tensor(sc, gen), f);
            const auto y = ops::concat(ctx, {a, b, c}, dim);
            REQUIRE(y.shape() == sa.with(dim, sa[dim] + 1 + 3));
            CHECK(y.format() == f);
            // Logical element by element.
            for (std::int64_t n = 0; n < y.dim(0); ++n)
                for (std::int64_t ch = 0; ch < y.dim(1); ++ch)
                    for (std::int64_t h = 0; h < y.dim(2); ++h)
                        for (std::int64_t w = 0; w < y.dim(3); ++w) {
                            std::int64_t idx[4] = {n, ch, h, w};
                            const Tensor<float>* src = &a;
                            if (idx[dim] >= sa[dim] + 1) {
                                src = &c;
                                idx[dim] -= sa[dim] + 1;
                            } else if (idx[dim] >= sa[dim]) {
                                src = &b;
                                idx[dim] -= sa[dim];
                            }
                            CHECK(at4(y, n, ch, h, w) == at4(*src, idx[0], idx[1], idx[2], idx[3]));
                        }
            const auto parts = ops::split(ctx, y, {sa[dim], 1, 3}, dim);
            REQUIRE(parts.size() == 3);
            for (std::int64_t i = 0; i < a.numel(); ++i) CHECK(parts[0][i] == a[i]);
            for (std::int64_t i = 0; i < b.numel(); ++i) CHECK(parts[1][i] == b[i]);
            for (std::int64_t i = 0; i < c.numel(); ++i) CHECK(parts[2][i] == c[i]);
        }
    }
    // Rank 2, negative dimension, and an empty piece.
    const auto p = random_tensor(Shape{3, 2}, gen), q = random_tensor(Shape{3, 0}, gen);
    const auto pq = ops::concat(ctx, {p, q, p}, -1);
    REQUIRE(pq.shape() == (Shape{3, 4}));
    CHECK(pq[5] == p[3]);
    CHECK(pq[7] == p[3]);
    CHECK(pq[10] == p[4]);
}

TEST_CASE("tensor operations refuse bad input with a typed error", "[ops]") {
    std::mt19937_64 gen(7);
    const auto a = random_tensor(Shape{2, 3}, gen), b = random_tensor(Shape{3, 2}, gen);
    CHECK_THROWS_AS(ops::add(ctx, a, b), ShapeError);
    CHECK_THROWS_WITH(ops::mul(ctx, a, b), Catch::Contains("give both the same shape"));
    Tensor<float> y = b;
    CHECK_THROWS_AS(ops::axpy(ctx, 1.0f, a, y), ShapeError);
    CHECK_THROWS_WITH(ops::sum(ctx, a, {2}), Catch::Contains("dimension 2 is out of range for a tensor of rank 2"));
    CHECK_THROWS_WITH(ops::mean(ctx, a, {1, -1}), Catch::Contains("named twice"));
    CHECK_THROWS_AS(ops::softmax(ctx, a, -3), ShapeError);
    CHECK_THROWS_WITH(ops::concat(ctx, {a, b}, 1), Catch::Contains("may differ only along dimension 1"));
    CHECK_THROWS_WITH(ops::split(ctx, a, {1, 1}, 1), Catch::Contains("add up to 2 but dimension 1"));
    CHECK_THROWS_WITH(ops::expand(ctx, a, Shape{2, 4, 5}, {2}), Catch::Contains("does not repeat into"));
    CHECK_THROWS_WITH(
        ops::expand(ctx, relayout(random_tensor(Shape{2, 3, 4, 1}, gen), MemoryFormat::nhwc), Shape{2, 3, 4, 5}, {3}),
        Catch::Contains("reads the repeated tensor in NCHW order"));
    CHECK_THROWS_AS(ops::argmax(ctx, random_tensor(Shape{2, 0}, gen), 1), ShapeError);
    const auto x4 = random_tensor(Shape{1, 2, 2, 2}, gen);
    CHECK_THROWS_WITH(ops::add(ctx, x4, relayout(x4, MemoryFormat::nhwc)), Catch::Contains("same memory format"));
}

TEST_CASE("a custom module written with the tensor operations passes gradcheck, and a wrong backward fails it", "[ops]") {
    std::mt19937_64 gen(8);
    nn::Generator init(3);
    resnet::ChannelGate<Host> gate(4);
    // A weight away from 1, so that its gradient is not special.
    for (std::int64_t c = 0; c < 4; ++c) gate.weight.value[c] = static_cast<float>(0.5 + 0.3 * static_cast<double>(c));
    for (MemoryFormat f : {MemoryFormat::nchw, MemoryFormat::nhwc}) {
        const auto x = relayout(random_tensor(Shape{3, 4, 3, 3}, gen, -2.0, 2.0), f);
        const auto check = nn::gradcheck(gate, x);
        INFO(check.report());
        CHECK(check.passed());
    }
    // The same module with a backward that forgets the softmax's Jacobian (da passed as dt).
    struct Broken : resnet::ChannelGate<Host> {
        using resnet::ChannelGate<Host>::ChannelGate;
        Tensor<float> backward(const nn::Context<Host>& c, const Tensor<float>& dy) {
            // Only the direct path x * g: the gate's dependence on x and on the weight is dropped.
            auto saved_dx = resnet::ChannelGate<Host>::backward(c, dy);
            const auto y_direct = dy;  // pretend g == 1
            (void)saved_dx;
            return y_direct;
        }
    };
    Broken broken(4);
    const auto x = random_tensor(Shape{2, 4, 3, 3}, gen, -2.0, 2.0);
    CHECK_FALSE(nn::gradcheck(broken, x).passed());
}

TEST_CASE("a network with the custom module trains under DataParallel as one module on the whole batch", "[ops]") {
    std::mt19937_64 gen(9);
    nn::Generator g1(5), g2(5);
    const auto make = [](nn::Generator& g) {
        return nn::Sequential(nn::Conv2d<>(1, 4, 3, {.padding = 1}, g), resnet::ChannelGate<Host>(4), nn::ReLU<>(),
                              nn::AdaptiveAvgPool2d<>(1), nn::Flatten<>(), nn::Linear<>(4, 3, true, g));
    };
    auto single = make(g1);
    DataParallel dp(make(g2), 3);
    nn::Sgd<Host> sgd_single({.lr = 0.5, .momentum = 0.9}), sgd_dp({.lr = 0.5, .momentum = 0.9});
    DataParallel one(std::move(single), 1);
    const auto x = random_tensor(Shape{7, 1, 5, 5}, gen);
    const std::vector<std::int64_t> labels = {0, 1, 2, 1, 0, 2, 2};
    for (int step = 0; step < 3; ++step) {
        const auto r1 = one.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_single);
        const auto r3 = dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd_dp);
        CHECK(r3.loss == Approx(r1.loss).epsilon(1e-5));
    }
    // The gate's weight moved, and the same way in both.
    const auto w1 = one.module().get<1>().weight.value, w3 = dp.module().get<1>().weight.value;
    double moved = 0;
    for (std::int64_t c = 0; c < 4; ++c) {
        CHECK(w3[c] == Approx(w1[c]).epsilon(1e-5));
        moved += std::abs(w1[c] - 1.0);
    }
    CHECK(moved > 1e-4);
}
