// SPDX-License-Identifier: MIT
//! The nn kit: layer gradients against finite differences, PyTorch semantics of SGD and the
//! loss, checkpoints in safetensors format, and bad input.
#include <catch2/catch.hpp>

#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <algorithm>
#include <random>
#include <vector>

#include "test_support.hpp"

using namespace lockstep;
namespace fs = std::filesystem;

namespace {

using test::random_tensor;

double dot(const Tensor<float>& a, const Tensor<float>& w) {
    double s = 0;
    for (std::int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a[i]) * w[i];
    return s;
}

// Checks d(sum(w * layer(x)))/d(x) and /d(parameters) from backward against central differences
// of the forward, evaluated in fp64 from the layer's fp32 outputs.
template <class Layer>
void check_gradients(Layer& layer, const Tensor<float>& x, std::mt19937_64& gen, double h, double tol) {
    nn::Context<> ctx;
    auto y = layer.forward(ctx, x);
    const auto w = random_tensor(y.shape(), gen);
    nn::zero_grad(layer);
    const auto dx = layer.backward(ctx, w);
    const auto loss = [&](const Tensor<float>& input) {
        nn::Context<> eval;
        eval.training = false;
        return dot(layer.forward(eval, input), w);
    };
    std::vector<double> analytic, numeric;
    for (std::int64_t i = 0; i < x.numel(); ++i) {
        auto xp = x, xm = x;
        xp[i] += static_cast<float>(h);
        xm[i] -= static_cast<float>(h);
        numeric.push_back((loss(xp) - loss(xm)) / (static_cast<double>(xp[i]) - xm[i]));
        analytic.push_back(dx[i]);
    }
    CHECK(test::rel_error(analytic, numeric) <= tol);
    nn::for_each_parameter(layer, [&](const std::string& name, nn::Parameter<>& p) {
        std::vector<double> a, n;
        for (std::int64_t i = 0; i < p.numel(); ++i) {
            const float orig = p.value[i];
            p.value[i] = orig + static_cast<float>(h);
            const double up = loss(x);
            const double dh = static_cast<double>(p.value[i]) - orig;
            p.value[i] = orig - static_cast<float>(h);
            const double down = loss(x);
            const double dl = orig - static_cast<double>(p.value[i]);
            p.value[i] = orig;
            n.push_back((up - down) / (dh + dl));
            a.push_back(p.grad[i]);
        }
        INFO("parameter " << name);
        CHECK(test::rel_error(a, n) <= tol);
    });
}

}  // namespace

TEST_CASE("Conv2d gradients match finite differences", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    SECTION("padding 1, stride 1") {
        nn::Conv2d<> conv(2, 3, 3, {.stride = 1, .padding = 1}, g);
        check_gradients(conv, random_tensor(Shape{2, 2, 5, 4}, gen), gen, 1e-2, 1e-3);
    }
    SECTION("no padding, stride 2, no bias") {
        nn::Conv2d<> conv(3, 2, 2, {.stride = 2, .padding = 0, .bias = false}, g);
        check_gradients(conv, random_tensor(Shape{3, 3, 6, 7}, gen), gen, 1e-2, 1e-3);
    }
}

TEST_CASE("Linear gradients match finite differences", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    nn::Linear<> fc(7, 4, true, g);
    check_gradients(fc, random_tensor(Shape{5, 7}, gen), gen, 1e-2, 1e-3);
}

TEST_CASE("ReLU, MaxPool2d and Flatten gradients match finite differences", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    // Distinct values at least 0.01 apart and away from 0, so h = 1e-3 never crosses a kink.
    Tensor<float> x(Shape{2, 3, 4, 6});
    std::vector<int> order(static_cast<std::size_t>(x.numel()));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen);
    for (std::int64_t i = 0; i < x.numel(); ++i)
        x[i] = 0.01f * static_cast<float>(order[static_cast<std::size_t>(i)] - 72) + 0.005f;
    nn::ReLU<> relu;
    check_gradients(relu, x, gen, 1e-3, 1e-3);
    nn::MaxPool2d<> pool(2);
    check_gradients(pool, x, gen, 1e-3, 1e-3);
    nn::Flatten<> flat;
    check_gradients(flat, x, gen, 1e-3, 1e-5);
}

namespace {

// A layer of the activation protocol that stores its output in bf16, as a convolution does under
// Precision::bf16: y = bf16(2x); dx = 2 dy in fp32 (Sequential rounds it to what it was given).
// It records the precisions it was given.
struct TwiceToBf16 {
    using backend = Host;
    template <class V>
    void visit(V&&) {}
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) {
        return nn::widened(ctx, forward(ctx, Activation<Host>(std::move(x))));
    }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
        return backward(ctx, Activation<Host>::view_of(dy)).take<float>();
    }
    Activation<Host> forward(const nn::Context<>& ctx, Activation<Host> x) {
        given = x.precision();
        auto wide = nn::widened(ctx, std::move(x));
        Tensor<BFloat16> y(wide.shape(), wide.format());
        for (std::int64_t i = 0; i < y.numel(); ++i) y[i] = BFloat16::round(2.0f * wide[i]);
        return Activation<Host>(std::move(y));
    }
    Activation<Host> backward(const nn::Context<>& ctx, const Activation<Host>& dy) {
        dy_given = dy.precision();
        auto dx = nn::converted(ctx, dy, Precision::fp32).take<float>();
        for (float& v : dx.span()) v *= 2.0f;
        return Activation<Host>(std::move(dx));
    }
    Precision given = Precision::fp32, dy_given = Precision::fp32;
};

// The identity on the activation protocol, recording the precisions it was given.
struct Probe {
    using backend = Host;
    template <class V>
    void visit(V&&) {}
    Tensor<float> forward(const nn::Context<>&, Tensor<float> x) { return x; }
    Tensor<float> backward(const nn::Context<>&, const Tensor<float>& dy) { return dy; }
    Activation<Host> forward(const nn::Context<>&, Activation<Host> x) {
        given = x.precision();
        return x;
    }
    Activation<Host> backward(const nn::Context<>&, const Activation<Host>& dy) {
        dy_given = dy.precision();
        return dy;
    }
    Precision given = Precision::fp32, dy_given = Precision::fp32;
};

static_assert(nn::HasActivationPath<TwiceToBf16> && nn::HasActivationPath<Probe>);
static_assert(nn::HasActivationPath<nn::Flatten<Host>>, "Flatten keeps the type on every backend");
static_assert(!nn::HasActivationPath<nn::ReLU<Host>> && !nn::HasActivationPath<nn::MaxPool2d<Host>>,
              "the host has no bf16 activation kernels: Sequential widens for its ReLU and pooling");
static_assert(!nn::HasActivationPath<nn::Linear<Host>> && !nn::HasActivationPath<nn::Conv2d<Host>> &&
              !nn::HasActivationPath<nn::SyncBatchNorm<Host>>);

Tensor<float> rounded_to_bf16(const Tensor<float>& t) {
    Tensor<float> r = t;
    for (float& v : r.span()) v = BFloat16::round(v).widen();
    return r;
}

}  // namespace

TEST_CASE("Sequential passes bf16 activations to layers that take them and widens them for the rest", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    nn::Context<> ctx;
    const auto x = random_tensor(Shape{3, 2, 4, 4}, gen);
    const auto dy = random_tensor(Shape{3, 5}, gen);

    // bf16 out of the first layer; the inner Sequential's probe sees it, Flatten keeps it, the
    // next probe sees it, pooling and ReLU (fp32 only on the host) get it widened, then Linear.
    nn::Sequential net(TwiceToBf16{}, nn::Sequential(Probe{}, nn::MaxPool2d<>(2), Probe{}), nn::Flatten<>{}, Probe{},
                       nn::ReLU<>{}, Probe{}, nn::Linear<>(8, 5, true, g));
    auto y = net.forward(ctx, x);
    auto& inner = net.get<1>();
    CHECK(net.get<0>().given == Precision::fp32);
    CHECK(inner.get<0>().given == Precision::bf16);
    CHECK(inner.get<2>().given == Precision::fp32);  // the host's pooling gave fp32
    CHECK(net.get<3>().given == Precision::fp32);
    CHECK(net.get<5>().given == Precision::fp32);

    // The same chain by hand in fp32 on the rounded values: every bit equal.
    nn::MaxPool2d<> pool(2);
    nn::Flatten<> flat;
    nn::ReLU<> relu;
    nn::Linear<> fc = net.get<6>();
    Tensor<float> twice = x;
    for (float& v : twice.span()) v *= 2.0f;
    const auto r = rounded_to_bf16(twice);
    const auto want = fc.forward(ctx, relu.forward(ctx, flat.forward(ctx, pool.forward(ctx, r))));
    REQUIRE(y.shape() == want.shape());
    for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y[i] == want[i]);

    // Backward: each dx in the precision its layer was given; the pooling's dx (fp32) rounded to
    // bf16 for the probe before it, which was given bf16.
    nn::zero_grad(net);
    nn::zero_grad(fc);
    const auto dx = net.backward(ctx, dy);
    CHECK(net.get<5>().dy_given == Precision::fp32);
    CHECK(inner.get<2>().dy_given == Precision::fp32);
    CHECK(inner.get<0>().dy_given == Precision::bf16);
    CHECK(net.get<0>().dy_given == Precision::bf16);
    const auto dpool = pool.backward(ctx, flat.backward(ctx, relu.backward(ctx, fc.backward(ctx, dy))));
    auto want_dx = rounded_to_bf16(dpool);
    for (float& v : want_dx.span()) v *= 2.0f;
    REQUIRE(dx.shape() == x.shape());
    for (std::int64_t i = 0; i < dx.numel(); ++i) REQUIRE(dx[i] == want_dx[i]);
    for (std::int64_t i = 0; i < fc.weight.grad.numel(); ++i) REQUIRE(net.get<6>().weight.grad[i] == fc.weight.grad[i]);

    // Through the activation protocol the output keeps its precision, and a dy of the other
    // precision is converted to the output's first.
    nn::Sequential head(TwiceToBf16{}, nn::Flatten<>{}, Probe{});
    auto out = head.forward(ctx, Activation<Host>(Tensor<float>(x)));
    CHECK(out.precision() == Precision::bf16);
    CHECK(out.shape() == Shape{3, 32});
    const auto back = head.backward(ctx, Activation<Host>(random_tensor(Shape{3, 32}, gen)));
    CHECK(head.get<2>().dy_given == Precision::bf16);
    CHECK(back.precision() == Precision::fp32);
    CHECK(back.shape() == x.shape());
}

TEST_CASE("Sequential of fp32 layers alone gives the fp32 protocol's bits through either protocol", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    nn::Context<> ctx;
    nn::Sequential net(nn::Conv2d<>(2, 3, 3, {.stride = 1, .padding = 1}, g), nn::ReLU<>{}, nn::MaxPool2d<>(2), nn::Flatten<>{},
                       nn::Linear<>(12, 4, true, g));
    auto twin = net;
    const auto x = random_tensor(Shape{2, 2, 4, 4}, gen);
    const auto dy = random_tensor(Shape{2, 4}, gen);
    const auto y = net.forward(ctx, x);
    const auto dx = net.backward(ctx, dy);
    auto ya = twin.forward(ctx, Activation<Host>(Tensor<float>(x)));
    REQUIRE(ya.precision() == Precision::fp32);
    const auto dxa = twin.backward(ctx, Activation<Host>(Tensor<float>(dy)));
    REQUIRE(dxa.precision() == Precision::fp32);
    for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y[i] == ya.get<float>()[i]);
    for (std::int64_t i = 0; i < dx.numel(); ++i) REQUIRE(dx[i] == dxa.get<float>()[i]);
    // By hand, layer by layer.
    nn::Conv2d<> conv = net.get<0>();
    nn::ReLU<> relu;
    nn::MaxPool2d<> pool(2);
    nn::Flatten<> flat;
    nn::Linear<> fc = net.get<4>();
    const auto want = fc.forward(ctx, flat.forward(ctx, pool.forward(ctx, relu.forward(ctx, conv.forward(ctx, x)))));
    for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y[i] == want[i]);
    const auto want_dx = conv.backward(ctx, relu.backward(ctx, pool.backward(ctx, flat.backward(ctx, fc.backward(ctx, dy)))));
    for (std::int64_t i = 0; i < dx.numel(); ++i) REQUIRE(dx[i] == want_dx[i]);
}

TEST_CASE("An ActivationTrail keeps Sequential's precision rules for a hand-written chain", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Context<> ctx;
    TwiceToBf16 twice;
    Probe probe;
    nn::ReLU<> relu;
    nn::ActivationTrail<Host> trail;
    const auto x = random_tensor(Shape{2, 5}, gen);
    auto a = trail.forward(twice, ctx, Activation<Host>(Tensor<float>(x)));
    a = trail.forward(probe, ctx, std::move(a));
    a = trail.forward(relu, ctx, std::move(a));
    CHECK(probe.given == Precision::bf16);
    REQUIRE(a.precision() == Precision::fp32);  // the host's ReLU gave fp32
    const auto dy = random_tensor(Shape{2, 5}, gen);
    auto g = trail.backward(relu, ctx, Activation<Host>(Tensor<float>(dy)));
    CHECK(g.precision() == Precision::bf16);  // ReLU was given bf16: its dx rounded back
    g = trail.backward(probe, ctx, g);
    CHECK(probe.dy_given == Precision::bf16);
    g = trail.backward(twice, ctx, g);
    CHECK(twice.dy_given == Precision::bf16);
    REQUIRE(g.precision() == Precision::fp32);
    // dx = 2 bf16(relu'(2x) dy), as the chain by hand.
    for (std::int64_t i = 0; i < x.numel(); ++i) {
        const float r = BFloat16::round(2.0f * x[i]).widen();
        const float want = 2.0f * BFloat16::round(r > 0.0f ? dy[i] : 0.0f).widen();
        REQUIRE(g.get<float>()[i] == want);
    }
    // A dy of the other precision is converted to what the layer gave.
    auto b = trail.forward(twice, ctx, Activation<Host>(Tensor<float>(x)));
    REQUIRE(b.precision() == Precision::bf16);
    (void)trail.backward(twice, ctx, Activation<Host>(Tensor<float>(dy)));
    CHECK(twice.dy_given == Precision::bf16);
    // More backwards than forwards: a typed error, not a read past the record.
    try {
        (void)trail.backward(twice, ctx, Activation<Host>(Tensor<float>(dy)));
        FAIL("a backward with no forward recorded did not throw");
    } catch (const UsageError& e) {
        CHECK_THAT(e.what(), Catch::Contains("no forward recorded"));
    }
}

TEST_CASE("A bf16 activation reaching a host layer without the activation protocol is widened exactly", "[nn]") {
    nn::Context<> ctx;
    Tensor<BFloat16> h(Shape{1, 4});
    const float values[] = {1.0f, -3.5f, 0.0078125f, -0.0f};
    for (int i = 0; i < 4; ++i) h[i] = BFloat16::round(values[i]);
    nn::ReLU<> relu;
    auto y = nn::forward_any(relu, ctx, Activation<Host>(std::move(h)));
    REQUIRE(y.precision() == Precision::fp32);
    CHECK(y.get<float>()[0] == 1.0f);
    CHECK(y.get<float>()[1] == 0.0f);
    CHECK(y.get<float>()[2] == 0.0078125f);
    // dy in bf16 to a layer of the fp32 protocol: widened; dx rounded back to the input's type.
    Tensor<BFloat16> d(Shape{1, 4});
    for (int i = 0; i < 4; ++i) d[i] = BFloat16::round(0.5f + static_cast<float>(i));
    const auto dx = nn::backward_any(relu, ctx, Activation<Host>(std::move(d)), Precision::bf16);
    REQUIRE(dx.precision() == Precision::bf16);
    CHECK(dx.get<BFloat16>()[0].widen() == 0.5f);
    CHECK(dx.get<BFloat16>()[1].widen() == 0.0f);
    CHECK(dx.get<BFloat16>()[2].widen() == 2.5f);
    CHECK(dx.get<BFloat16>()[3].widen() == 0.0f);
    // Converting checks the element counts on the host too.
    Tensor<BFloat16> wrong(Shape{3});
    CHECK_THROWS_AS(kernels::Ops<Host>::to_bf16(ctx.exec, Tensor<float>(Shape{4}), wrong), ShapeError);
}

TEST_CASE("SoftmaxCrossEntropy: value and gradient of the mean over the global batch", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    auto logits = random_tensor(Shape{4, 5}, gen, -3, 3);
    const std::vector<std::int64_t> labels{0, 4, 2, 2};
    nn::Context<> ctx;
    ctx.global_batch = 10;  // this shard is 4 of a global batch of 10
    const nn::SoftmaxCrossEntropy ce;
    const auto out = ce(ctx, logits, labels);
    double ref = 0;
    for (int n = 0; n < 4; ++n) {
        double denom = 0;
        for (int k = 0; k < 5; ++k) denom += std::exp(static_cast<double>(logits[n * 5 + k]));
        ref += -std::log(std::exp(static_cast<double>(logits[n * 5 + labels[static_cast<std::size_t>(n)]])) / denom);
    }
    CHECK(out.sum() == Approx(ref).epsilon(1e-12));
    std::vector<double> numeric;
    for (std::int64_t i = 0; i < logits.numel(); ++i) {
        auto p = logits, m = logits;
        p[i] += 1e-3f;
        m[i] -= 1e-3f;
        numeric.push_back((ce(ctx, p, labels).sum() - ce(ctx, m, labels).sum()) / 10.0 / (static_cast<double>(p[i]) - m[i]));
    }
    CHECK(test::rel_error(out.grad.span(), numeric) <= 1e-4);
    CHECK_THROWS_WITH(ce(ctx, logits, std::vector<std::int64_t>{0, 1, 2}), Catch::Contains("3 labels for a batch of 4"));
    CHECK_THROWS_WITH(ce(ctx, logits, std::vector<std::int64_t>{0, 1, 5, 2}),
                      Catch::Contains("label 5 of sample 2 is out of range"));
}

TEST_CASE("Sgd follows torch.optim.SGD", "[nn]") {
    const auto opts = GENERATE(nn::SgdOptions{.lr = 0.1, .momentum = 0.9},
                               nn::SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true},
                               nn::SgdOptions{.lr = 0.2, .momentum = 0.5, .dampening = 0.3}, nn::SgdOptions{.lr = 0.3});
    nn::Linear<> fc(3, 2);
    nn::Sgd sgd(opts);
    sgd.prepare(1);
    std::vector<double> p(fc.weight.value.span().begin(), fc.weight.value.span().end()), v(p.size(), 0.0);
    for (int step = 0; step < 3; ++step) {
        for (std::int64_t i = 0; i < fc.weight.numel(); ++i) fc.weight.grad[i] = 0.1f * static_cast<float>(i + step) - 0.2f;
        sgd.step(nn::Context<>{}, fc);
        for (std::size_t i = 0; i < p.size(); ++i) {
            double g = 0.1 * static_cast<double>(i + static_cast<std::size_t>(step)) - 0.2;
            g = static_cast<float>(g) + opts.weight_decay * p[i];
            if (opts.momentum != 0) {
                v[i] = step == 0 ? g : opts.momentum * v[i] + (1 - opts.dampening) * g;
                g = opts.nesterov ? g + opts.momentum * v[i] : v[i];
            }
            p[i] -= opts.lr * g;
        }
    }
    std::vector<double> got(fc.weight.value.span().begin(), fc.weight.value.span().end());
    CHECK(test::rel_error(got, p) <= 1e-6);
    CHECK_THROWS_AS(nn::Sgd({.lr = -1}), InvalidArgument);
    CHECK_THROWS_AS(nn::Sgd({.lr = 0.1, .momentum = 0, .nesterov = true}), InvalidArgument);
}

TEST_CASE("SGD over parameters that lie back to back runs as one loop with the bits of one loop each", "[nn]") {
    const auto u = GENERATE(kernels::SgdUpdate{.lr = 0.1, .momentum = 0.9},
                            kernels::SgdUpdate{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true},
                            kernels::SgdUpdate{.lr = 0.2, .momentum = 0.5, .dampening = 0.3}, kernels::SgdUpdate{.lr = 0.3});
    using K = kernels::Ops<Host>;
    const std::vector<std::int64_t> sizes{5, 17, 1, 40};  // parameters of a bucket, in visit order
    const std::int64_t total = std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
    std::mt19937 gen(11);
    std::normal_distribution<float> d(0.0f, 1.0f);
    // The same parameters twice: once as views of three flat blocks (a DataParallel bucket), once
    // as tensors of their own.
    Tensor<float> w_flat(Shape{total}), g_flat(Shape{total}), v_flat(Shape{total});
    std::vector<Tensor<float>> w, g, v, w_own, g_own, v_own;
    std::int64_t offset = 0;
    for (const auto n : sizes) {
        w.push_back(Tensor<float>::view(w_flat, offset, Shape{n}));
        g.push_back(Tensor<float>::view(g_flat, offset, Shape{n}));
        v.push_back(Tensor<float>::view(v_flat, offset, Shape{n}));
        offset += n;
    }
    for (auto& t : w) std::generate(t.span().begin(), t.span().end(), [&] { return d(gen); });
    for (std::size_t i = 0; i < sizes.size(); ++i) {
        w_own.push_back(w[i]);
        g_own.push_back(Tensor<float>(Shape{sizes[i]}));
        v_own.push_back(Tensor<float>(Shape{sizes[i]}));
    }
    const nn::Context<> ctx;
    const auto& ex = ctx.exec;
    for (int step = 0; step < 3; ++step) {
        for (std::size_t i = 0; i < sizes.size(); ++i) {
            std::generate(g[i].span().begin(), g[i].span().end(), [&] { return d(gen); });
            g_own[i].copy_from(g[i]);
        }
        // At the first step the third parameter's buffer is already there (a loaded checkpoint),
        // the others' are made from their gradients: the runs split where `first` changes.
        std::vector<kernels::SgdTensors<Host>> fused, apart;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
            const bool first = step == 0 && i != 2;
            fused.push_back({&w[i], &g[i], &v[i], first});
            apart.push_back({&w_own[i], &g_own[i], &v_own[i], first});
        }
        K::sgd_step_many(ex, fused, u);
        for (const auto& it : apart) K::sgd_step(ex, *it.value, *it.grad, *it.momentum, it.first, u);
        for (std::size_t i = 0; i < sizes.size(); ++i) {
            CAPTURE(step, i);
            CHECK(std::equal(w[i].span().begin(), w[i].span().end(), w_own[i].span().begin()));
            if (u.momentum != 0) CHECK(std::equal(v[i].span().begin(), v[i].span().end(), v_own[i].span().begin()));
        }
    }
}

TEST_CASE("Sgd keeps a module's momentum buffers back to back where its parameters are, and moves loaded ones there", "[nn]") {
    nn::Generator gen(5);
    nn::Linear<> fc(6, 4, true, gen);
    // As DataParallel lays a bucket out: weight then bias, values and gradients each in one block.
    Tensor<float> values(Shape{28}), grads(Shape{28});
    const auto lay_out = [](nn::Parameter<>& p, Tensor<float>& block, std::int64_t offset) {
        auto t = Tensor<float>::view(block, offset, p.shape());
        t.copy_from(p.value);
        p.value = std::move(t);
    };
    lay_out(fc.weight, values, 0);
    lay_out(fc.bias, values, 24);
    fc.weight.grad = Tensor<float>::view(grads, 0, fc.weight.shape());
    fc.bias.grad = Tensor<float>::view(grads, 24, fc.bias.shape());
    for (std::int64_t i = 0; i < 28; ++i) grads[i] = 0.01f * static_cast<float>(i);
    nn::Linear<> twin = fc;  // tensors of their own: the same updates one parameter at a time
    nn::Sgd sgd({.lr = 0.1, .momentum = 0.9}), sgd_twin({.lr = 0.1, .momentum = 0.9});
    // The layout DataParallel hands its optimizer for that bucket (parameters by visit index).
    const nn::BucketLayout layout{{{{0, 1}, {0, 24}, 28}}};
    sgd.prepare(1, layout);
    sgd_twin.prepare(1);
    const auto buffers = [](nn::Sgd<>& o, nn::Linear<>& m) {
        std::vector<Tensor<float>*> out;
        o.visit_state(0, m, [&](const std::string&, Tensor<float>& t, const nn::Parameter<>&) { out.push_back(&t); });
        return out;
    };
    const auto same = [&] {
        return std::equal(fc.weight.value.span().begin(), fc.weight.value.span().end(), twin.weight.value.span().begin()) &&
               std::equal(fc.bias.value.span().begin(), fc.bias.value.span().end(), twin.bias.value.span().begin());
    };
    sgd.step(nn::Context<>{}, fc);
    sgd_twin.step(nn::Context<>{}, twin);
    CHECK(same());
    auto b = buffers(sgd, fc);
    CHECK(b[0]->is_view());
    CHECK(b[1]->follows(*b[0]));
    // A loaded buffer (a tensor of its own, as get_optimizer makes it) is moved back beside the other.
    *b[1] = Tensor<float>(*b[1]);
    CHECK_FALSE(b[1]->is_view());
    sgd.step(nn::Context<>{}, fc);
    sgd_twin.step(nn::Context<>{}, twin);
    CHECK(same());
    b = buffers(sgd, fc);
    CHECK(b[1]->follows(*b[0]));
    // A buffer reset (no state in a checkpoint) starts again from its gradient, as PyTorch's None.
    *b[0] = Tensor<float>();
    *buffers(sgd_twin, twin)[0] = Tensor<float>();
    sgd.step(nn::Context<>{}, fc);
    sgd_twin.step(nn::Context<>{}, twin);
    CHECK(same());
    b = buffers(sgd, fc);
    CHECK(b[1]->follows(*b[0]));
    // An Sgd stepped without a layout, then handed one, keeps its momentum through the move (the
    // blocks it leaves are read before they go), and a prepare without a layout keeps the one it has.
    nn::Linear<> lone = fc, lone_twin = fc;
    nn::Sgd switching({.lr = 0.1, .momentum = 0.9}), switching_twin({.lr = 0.1, .momentum = 0.9});
    switching.prepare(1);
    switching_twin.prepare(1);
    switching.step(nn::Context<>{}, lone);
    switching_twin.step(nn::Context<>{}, lone_twin);
    switching.prepare(1, layout);
    switching.prepare(1);
    for (int i = 0; i < 2; ++i) {
        switching.step(nn::Context<>{}, lone);
        switching_twin.step(nn::Context<>{}, lone_twin);
    }
    CHECK(std::equal(lone.weight.value.span().begin(), lone.weight.value.span().end(), lone_twin.weight.value.span().begin()));
    CHECK(std::equal(lone.bias.value.span().begin(), lone.bias.value.span().end(), lone_twin.bias.value.span().begin()));
    b = buffers(switching, lone);
    CHECK(b[1]->follows(*b[0]));
    // The layout of another model is refused, saying what to pass.
    nn::Sgd other({.lr = 0.1, .momentum = 0.9});
    other.prepare(1, nn::BucketLayout{{{{0}, {0}, 24}}});
    CHECK_THROWS_WITH(other.step(nn::Context<>{}, fc), Catch::Contains("places 1 parameters, but the model has 2"));
    other.prepare(1, nn::BucketLayout{{{{0, 0}, {0, 24}, 28}}});
    CHECK_THROWS_WITH(other.step(nn::Context<>{}, fc), Catch::Contains("names parameter 0 twice"));
    other.prepare(1, nn::BucketLayout{{{{0, 1}, {0, 26}, 28}}});
    CHECK_THROWS_WITH(other.step(nn::Context<>{}, fc), Catch::Contains("parameter 1 does not fit its place"));
}

TEST_CASE("Layers use PyTorch layouts, names and default initialization", "[nn]") {
    nn::Generator g(7);
    nn::Conv2d<> conv(3, 8, 5, {}, g);
    CHECK(conv.weight.shape() == (Shape{8, 3, 5, 5}));
    const double bound = 1.0 / std::sqrt(75.0);
    float lo = 1, hi = -1;
    for (auto v : conv.weight.value.span()) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
    }
    CHECK(lo >= -bound);
    CHECK(hi <= bound);
    CHECK(hi - lo > 1.8 * bound);  // spread over the whole interval
    nn::Sequential net(nn::Conv2d<>(1, 2, 3, {}, g), nn::SyncBatchNorm<>(2), nn::ReLU<>(), nn::Flatten<>(),
                       nn::Linear<>(2, 3, true, g));
    std::vector<std::string> names;
    nn::walk(
        net, [&](const std::string& n, auto&) { names.push_back(n); }, [&](const std::string& n, auto&) { names.push_back(n); });
    CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                            "1.num_batches_tracked", "4.weight", "4.bias"});
    nn::Generator a(3), b(3);
    CHECK(nn::Linear<>(4, 4, true, a).weight.value[5] == nn::Linear<>(4, 4, true, b).weight.value[5]);  // seeded
}

TEST_CASE("Layers reject input that does not fit, naming the layer", "[nn]") {
    nn::Context<> ctx;
    nn::Conv2d<> conv(3, 4, 3);
    CHECK_THROWS_WITH(conv.forward(ctx, Tensor<float>(Shape{2, 1, 8, 8})),
                      Catch::Contains("Conv2d(3, 4, kernel_size=3): expected input (N, 3, H, W), got shape (2, 1, 8, 8)"));
    CHECK_THROWS_AS(conv.forward(ctx, Tensor<float>(Shape{2, 3, 2, 2})), ShapeError);
    CHECK_THROWS_AS(conv.backward(ctx, Tensor<float>(Shape{2, 4, 6, 6})), UsageError);
    nn::Linear<> fc(10, 2);
    CHECK_THROWS_WITH(fc.forward(ctx, Tensor<float>(Shape{2, 10, 1, 1})), Catch::Contains("put a Flatten before it"));
    nn::MaxPool2d<> pool(2);
    CHECK_THROWS_AS(pool.forward(ctx, Tensor<float>(Shape{1, 1, 1, 1})), ShapeError);
}

TEST_CASE("Checkpoints round-trip exactly in safetensors format", "[nn][checkpoint]") {
    const auto dir = fs::temp_directory_path() / ("lockstep-ckpt-" + std::to_string(test::unique_number()));
    fs::create_directories(dir);
    const std::string path = (dir / "model.safetensors").string();
    nn::Generator g(11);
    nn::Sequential a(nn::Conv2d<>(1, 2, 3, {}, g), nn::SyncBatchNorm<>(2), nn::Flatten<>(), nn::Linear<>(2, 3, true, g));
    a.get<1>().running_mean[1] = 0.25f;
    a.get<1>().num_batches_tracked[0] = 42;
    nn::save(path, a);
    nn::Generator g2(12);
    nn::Sequential b(nn::Conv2d<>(1, 2, 3, {}, g2), nn::SyncBatchNorm<>(2), nn::Flatten<>(), nn::Linear<>(2, 3, true, g2));
    nn::load(path, b);
    CHECK(std::memcmp(a.get<0>().weight.value.data(), b.get<0>().weight.value.data(), a.get<0>().weight.value.bytes()) == 0);
    CHECK(b.get<3>().bias.value[2] == a.get<3>().bias.value[2]);
    CHECK(b.get<1>().running_mean[1] == 0.25f);
    CHECK(b.get<1>().num_batches_tracked[0] == 42);

    // The file is what safetensors readers expect: u64 header length, JSON, 8-byte aligned data.
    std::ifstream in(path, std::ios::binary);
    std::uint64_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 8);
    std::string header(len, '\0');
    in.read(header.data(), static_cast<std::streamsize>(len));
    CHECK(len % 8 == 0);
    const auto j = nlohmann::json::parse(header);
    CHECK(j.at("0.weight").at("dtype") == "F32");
    CHECK(j.at("0.weight").at("shape") == std::vector<int>{2, 1, 3, 3});
    CHECK(j.at("1.num_batches_tracked").at("dtype") == "I64");
    CHECK(j.at("1.num_batches_tracked").at("shape").empty());

    for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename() == "model.safetensors");  // no temp left
    fs::remove_all(dir);
}

TEST_CASE("Loading a checkpoint that does not fit the model names the tensor", "[nn][checkpoint]") {
    const auto dir = fs::temp_directory_path() / ("lockstep-ckpt-" + std::to_string(test::unique_number()));
    fs::create_directories(dir);
    const std::string path = (dir / "m.safetensors").string();
    nn::Sequential small(nn::Linear<>(4, 3), nn::ReLU<>());
    nn::save(path, small);
    nn::Sequential wider(nn::Linear<>(5, 3), nn::ReLU<>());
    CHECK_THROWS_WITH(nn::load(path, wider),
                      Catch::Contains("m.safetensors' has tensor '0.weight' of shape (3, 4) but the model's is (3, 5)"));
    nn::Sequential more(nn::Linear<>(4, 3), nn::ReLU<>(), nn::Linear<>(3, 2));
    CHECK_THROWS_WITH(nn::load(path, more), Catch::Contains("missing tensor '2.weight'"));
    nn::Sequential nobias(nn::Linear<>(4, 3, false), nn::ReLU<>());
    CHECK_THROWS_WITH(nn::load(path, nobias), Catch::Contains("has tensor '0.bias' that the model does not have"));

    const auto bytes = fs::file_size(path);
    fs::resize_file(path, bytes - 5);  // truncated
    CHECK_THROWS_AS(nn::load(path, small), IoError);
    {
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        const std::uint64_t len = 1000;
        out.write(reinterpret_cast<const char*>(&len), 8);
        out << "{not json";
    }
    CHECK_THROWS_WITH(nn::load(path, small), Catch::Contains("is not a valid checkpoint"));
    CHECK_THROWS_WITH(nn::load((dir / "absent.safetensors").string(), small), Catch::Contains("cannot open checkpoint"));
    CHECK_THROWS_AS(nn::save((dir / "no-such-dir" / "x.safetensors").string(), small), IoError);
    fs::remove_all(dir);
}

TEST_CASE("clone makes an independent deep copy for a device of the module's backend", "[nn]") {
    nn::Sequential a(nn::Linear<>(3, 2), nn::SyncBatchNorm<>(2));
    auto b = nn::clone(a, Device::host(1));
    nn::walk(
        b,
        [](const std::string&, const nn::Parameter<>& p) {
            CHECK((p.value.device() == Device::host(1) && p.grad.device() == Device::host(1)));
        },
        [](const std::string&, const auto& t) { CHECK(t.device() == Device::host(1)); });
    b.get<0>().weight.value[0] += 1.0f;
    b.get<1>().running_mean[0] = 5.0f;
    CHECK(a.get<0>().weight.value[0] != b.get<0>().weight.value[0]);
    CHECK(a.get<1>().running_mean[0] == 0.0f);
    CHECK_THROWS_WITH(nn::clone(a, Device::cuda(0)), Catch::Contains("cannot clone a host module onto device cuda:0"));
}

// Note [layer ids]: ids drawn at construction depend on what was built before; number_layers
// gives the ids of a layer's place in the module instead, depth first, the same for two models
// built apart, and messages name such a layer by its place.
TEST_CASE("number_layers gives layers the ids of their place in the module, whatever was built before", "[nn]") {
    using Inner = nn::Sequential<nn::ReLU<>, nn::SyncBatchNorm<>>;
    const auto make = [] {
        return nn::Sequential(nn::SyncBatchNorm<>(2), Inner(nn::ReLU<>(), nn::SyncBatchNorm<>(2)), nn::SyncBatchNorm<>(2));
    };
    auto a = make();
    (void)nn::SyncBatchNorm<>(3);  // built in between, as another model would be
    auto b = make();
    const auto ids = [](const auto& m) {
        return std::vector<std::uint64_t>{m.template get<0>().layer_id(), m.template get<1>().template get<1>().layer_id(),
                                          m.template get<2>().layer_id()};
    };
    CHECK(ids(a) != ids(b));
    nn::number_layers(a);
    nn::number_layers(b);
    const auto first = nn::detail::placed_layer_ids;
    CHECK(ids(a) == std::vector<std::uint64_t>{first, first + 1, first + 2});
    CHECK(ids(b) == ids(a));
    CHECK(nn::clone(a, Device::host(1)).get<2>().layer_id() == first + 2);  // copies keep them
    CHECK(comm::CollectiveSite::layer(first + 1, 1).str() == "layer #2 of the model's communicating layers (backward)");
    CHECK(comm::CollectiveSite::layer(7, 0).str() == "layer 7 (forward)");
    CHECK(comm::CollectiveSite::layer(7, 2).str() == "layer 7 (forward, second)");
}

// ---- independent references: direct fp64 loops written here, not the layers' own code ----

namespace {

std::vector<double> to_f64(const Tensor<float>& t) { return {t.span().begin(), t.span().end()}; }

// y[n, o, oh, ow] = b[o] + sum_{c, i, j} w[o, c, i, j] * x[n, c, oh*s - p + i, ow*s - p + j] (zero outside).
std::vector<double> conv_reference(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b,
                                   std::int64_t N, std::int64_t C, std::int64_t H, std::int64_t W, std::int64_t O, std::int64_t k,
                                   std::int64_t s, std::int64_t p) {
    const std::int64_t OH = (H + 2 * p - k) / s + 1, OW = (W + 2 * p - k) / s + 1;
    std::vector<double> y(static_cast<std::size_t>(N * O * OH * OW));
    for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t o = 0; o < O; ++o)
            for (std::int64_t oh = 0; oh < OH; ++oh)
                for (std::int64_t ow = 0; ow < OW; ++ow) {
                    double acc = b.empty() ? 0.0 : b[static_cast<std::size_t>(o)];
                    for (std::int64_t c = 0; c < C; ++c)
                        for (std::int64_t i = 0; i < k; ++i)
                            for (std::int64_t j = 0; j < k; ++j) {
                                const std::int64_t h = oh * s - p + i, v = ow * s - p + j;
                                if (h < 0 || h >= H || v < 0 || v >= W) continue;
                                acc += w[static_cast<std::size_t>(((o * C + c) * k + i) * k + j)] *
                                       x[static_cast<std::size_t>(((n * C + c) * H + h) * W + v)];
                            }
                    y[static_cast<std::size_t>(((n * O + o) * OH + oh) * OW + ow)] = acc;
                }
    return y;
}

double dot64(const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
}

// Central difference of f at v[i] with step h (exact for f linear in v[i], up to fp64 rounding).
template <class F>
double central_difference(std::vector<double>& v, std::size_t i, double h, F&& f) {
    const double orig = v[i];
    v[i] = orig + h;
    const double up = f();
    v[i] = orig - h;
    const double down = f();
    v[i] = orig;
    return (up - down) / (2 * h);
}

std::vector<double> abs_of(std::vector<double> v) {
    for (auto& x : v) x = std::abs(x);
    return v;
}

// Checks the layer's fp32 derivatives `got(i)` of L at the sampled indices of `v` against central
// differences of the fp64 reference L. The error is measured against the sum of the absolute
// values of the terms each derivative adds up (the same central difference of `loss_abs`, L over
// the absolute values, at the same index of `av`): that is the size of an fp32 sum's rounding,
// however much the terms cancel.
template <class Loss, class LossAbs, class Got>
double derivative_error(std::vector<double>& v, std::vector<double>& av, const std::vector<std::size_t>& indices, Loss&& loss,
                        LossAbs&& loss_abs, Got&& got) {
    double worst = 0;
    for (const auto i : indices) {
        const double want = central_difference(v, i, 0.5, loss);
        const double scale = central_difference(av, i, 0.5, loss_abs);
        worst = std::max(worst, std::abs(got(i) - want) / std::max(scale, 1e-30));
    }
    return worst;
}

// Up to `count` distinct indices in [0, n), drawn from `gen` (all of them when n is small).
std::vector<std::size_t> sample_indices(std::size_t n, std::size_t count, std::mt19937_64& gen) {
    std::vector<std::size_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), gen);
    all.resize(std::min(n, count));
    return all;
}

}  // namespace

namespace {
// Element `i` (in logical NCHW order) of a 4-D tensor in either format.
float at_logical(const Tensor<float>& t, std::size_t i) {
    const std::int64_t C = t.dim(1), P = t.dim(2) * t.dim(3), li = static_cast<std::int64_t>(i);
    return t[test::offset(li / (C * P), (li / P) % C, li % P, C, P, t.format())];
}
// `t` (NCHW) laid out in `format`.
Tensor<float> in_format(const Tensor<float>& t, MemoryFormat format) {
    Tensor<float> out(t.shape(), format);
    const std::int64_t C = t.dim(1), P = t.dim(2) * t.dim(3);
    for (std::int64_t i = 0; i < t.numel(); ++i) out[test::offset(i / (C * P), (i / P) % C, i % P, C, P, format)] = t[i];
    return out;
}
}  // namespace

TEST_CASE("Conv2d forward and backward match direct fp64 loops and their finite differences", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    const std::int64_t N = 2, H = 7, W = 6;
    for (const auto format : {MemoryFormat::nchw, MemoryFormat::nhwc})
        for (const std::int64_t stride : {1, 2})
            for (const std::int64_t pad : {0, 1, 2})
                for (const std::int64_t k : {1, 3, 5})
                    for (const std::int64_t C : {1, 3, 8})
                        for (const std::int64_t O : {1, 3, 8}) {
                            if (format == MemoryFormat::nhwc && (k == 5 || O == 1)) continue;  // a smaller sweep for NHWC
                            CAPTURE(to_string(format), stride, pad, k, C, O);
                            const bool bias = (C + O + k) % 2 == 0;  // both kinds over the sweep
                            nn::Conv2d<> conv(C, O, k, {.stride = stride, .padding = pad, .bias = bias}, g);
                            const auto x_nchw = random_tensor(Shape{N, C, H, W}, gen);
                            const auto x = in_format(x_nchw, format);
                            auto xs = to_f64(x_nchw), ws = to_f64(conv.weight.value);
                            auto bs = bias ? to_f64(conv.bias.value) : std::vector<double>{};
                            auto axs = abs_of(xs), aws = abs_of(ws), abs_ = abs_of(bs);
                            nn::Context<> ctx;
                            const auto y = conv.forward(ctx, x);
                            REQUIRE(y.format() == format);
                            const auto ref = conv_reference(xs, ws, bs, N, C, H, W, O, k, stride, pad);
                            const auto terms = conv_reference(axs, aws, abs_, N, C, H, W, O, k, stride, pad);
                            REQUIRE(y.numel() == static_cast<std::int64_t>(ref.size()));
                            double forward_error = 0;
                            for (std::size_t i = 0; i < ref.size(); ++i)
                                forward_error =
                                    std::max(forward_error, std::abs(at_logical(y, i) - ref[i]) / std::max(terms[i], 1e-30));
                            CHECK(forward_error <= 1e-5);

                            const auto dy_nchw = random_tensor(y.shape(), gen);
                            const auto dys = to_f64(dy_nchw), adys = abs_of(dys);
                            nn::zero_grad(conv);
                            const auto dx = conv.backward(ctx, in_format(dy_nchw, format));
                            REQUIRE(dx.format() == format);
                            // L = sum(dy * conv(x)) in fp64; its derivatives by central differences.
                            const auto L = [&] { return dot64(dys, conv_reference(xs, ws, bs, N, C, H, W, O, k, stride, pad)); };
                            const auto La = [&] {
                                return dot64(adys, conv_reference(axs, aws, abs_, N, C, H, W, O, k, stride, pad));
                            };
                            CHECK(derivative_error(xs, axs, sample_indices(xs.size(), 16, gen), L, La,
                                                   [&](std::size_t i) { return at_logical(dx, i); }) <= 1e-5);
                            CHECK(derivative_error(ws, aws, sample_indices(ws.size(), 16, gen), L, La, [&](std::size_t i) {
                                      return conv.weight.grad[static_cast<std::int64_t>(i)];
                                  }) <= 1e-5);
                            if (bias)
                                CHECK(derivative_error(
                                          bs, abs_, sample_indices(bs.size(), bs.size(), gen), L, La,
                                          [&](std::size_t i) { return conv.bias.grad[static_cast<std::int64_t>(i)]; }) <= 1e-5);
                        }
}

TEST_CASE("Linear forward and backward match direct fp64 loops and their finite differences", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    for (const std::int64_t in : {1, 3, 8, 37})
        for (const std::int64_t out : {1, 3, 8})
            for (const bool bias : {true, false}) {
                CAPTURE(in, out, bias);
                const std::int64_t N = 5;
                nn::Linear<> fc(in, out, bias, g);
                const auto x = random_tensor(Shape{N, in}, gen);
                auto xs = to_f64(x), ws = to_f64(fc.weight.value);
                auto bs = bias ? to_f64(fc.bias.value) : std::vector<double>{};
                const auto reference = [&] {
                    std::vector<double> y(static_cast<std::size_t>(N * out));
                    for (std::int64_t n = 0; n < N; ++n)
                        for (std::int64_t o = 0; o < out; ++o) {
                            double acc = bias ? bs[static_cast<std::size_t>(o)] : 0.0;
                            for (std::int64_t i = 0; i < in; ++i)
                                acc += ws[static_cast<std::size_t>(o * in + i)] * xs[static_cast<std::size_t>(n * in + i)];
                            y[static_cast<std::size_t>(n * out + o)] = acc;
                        }
                    return y;
                };
                auto axs = abs_of(xs), aws = abs_of(ws), abs_ = abs_of(bs);
                const auto terms = [&] {  // the reference over absolute values: each output's sum of |terms|
                    std::swap(xs, axs), std::swap(ws, aws), std::swap(bs, abs_);
                    auto t = reference();
                    std::swap(xs, axs), std::swap(ws, aws), std::swap(bs, abs_);
                    return t;
                };
                nn::Context<> ctx;
                const auto y = fc.forward(ctx, x);
                const auto ref = reference(), scale = terms();
                double forward_error = 0;
                for (std::size_t i = 0; i < ref.size(); ++i)
                    forward_error =
                        std::max(forward_error, std::abs(y[static_cast<std::int64_t>(i)] - ref[i]) / std::max(scale[i], 1e-30));
                CHECK(forward_error <= 1e-5);
                const auto dy = random_tensor(y.shape(), gen);
                const auto dys = to_f64(dy), adys = abs_of(dys);
                nn::zero_grad(fc);
                const auto dx = fc.backward(ctx, dy);
                const auto L = [&] { return dot64(dys, reference()); };
                const auto La = [&] { return dot64(adys, terms()); };
                const auto all = [](std::size_t n) {
                    std::vector<std::size_t> v(n);
                    std::iota(v.begin(), v.end(), 0);
                    return v;
                };
                CHECK(derivative_error(xs, axs, all(xs.size()), L, La,
                                       [&](std::size_t i) { return dx[static_cast<std::int64_t>(i)]; }) <= 1e-5);
                CHECK(derivative_error(ws, aws, all(ws.size()), L, La,
                                       [&](std::size_t i) { return fc.weight.grad[static_cast<std::int64_t>(i)]; }) <= 1e-5);
                if (bias)
                    CHECK(derivative_error(bs, abs_, all(bs.size()), L, La,
                                           [&](std::size_t i) { return fc.bias.grad[static_cast<std::int64_t>(i)]; }) <= 1e-5);
            }
}

TEST_CASE("MaxPool2d forward and backward match direct fp64 loops and their finite differences", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const std::int64_t N = 2, C = 3, H = 7, W = 8;
    // Distinct values at least 0.01 apart, so a step of 1e-3 never changes which value wins.
    std::vector<double> xs(static_cast<std::size_t>(N * C * H * W));
    std::vector<int> order(xs.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen);
    for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<float>(0.01 * order[i] - 1.5);
    for (const std::int64_t k : {2, 3})
        for (const std::int64_t s : {1, 2, 3}) {
            CAPTURE(k, s);
            const std::int64_t OH = (H - k) / s + 1, OW = (W - k) / s + 1;
            const auto reference = [&] {
                std::vector<double> y(static_cast<std::size_t>(N * C * OH * OW));
                for (std::int64_t nc = 0; nc < N * C; ++nc)
                    for (std::int64_t oh = 0; oh < OH; ++oh)
                        for (std::int64_t ow = 0; ow < OW; ++ow) {
                            double m = -std::numeric_limits<double>::infinity();
                            for (std::int64_t i = 0; i < k; ++i)
                                for (std::int64_t j = 0; j < k; ++j)
                                    m = std::max(m, xs[static_cast<std::size_t>((nc * H + oh * s + i) * W + ow * s + j)]);
                            y[static_cast<std::size_t>((nc * OH + oh) * OW + ow)] = m;
                        }
                return y;
            };
            nn::MaxPool2d<> pool(k, s);
            Tensor<float> x(Shape{N, C, H, W});
            for (std::size_t i = 0; i < xs.size(); ++i) x[static_cast<std::int64_t>(i)] = static_cast<float>(xs[i]);
            nn::Context<> ctx;
            const auto y = pool.forward(ctx, x);
            REQUIRE(y.shape() == (Shape{N, C, OH, OW}));
            CHECK(test::rel_error(y.span(), reference()) == 0);
            const auto dy = random_tensor(y.shape(), gen);
            const auto dys = to_f64(dy);
            const auto dx = pool.backward(ctx, dy);
            const auto L = [&] { return dot64(dys, reference()); };
            std::vector<double> got, want;
            for (std::size_t i = 0; i < xs.size(); ++i) {
                want.push_back(central_difference(xs, i, 1e-3, L));
                got.push_back(dx[static_cast<std::int64_t>(i)]);
            }
            CHECK(test::rel_error(got, want) <= 1e-6);
        }
}

TEST_CASE("MseLoss: the mean over the global batch of each sample's mean squared error, and its gradient", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto out = random_tensor(Shape{4, 3}, gen, -2, 2);
    const auto target = random_tensor(Shape{4, 3}, gen, -2, 2);
    nn::Context<> ctx;
    ctx.global_batch = 10;  // this shard is 4 of a global batch of 10
    const nn::MseLoss mse;
    const auto res = mse(ctx, out, target);
    double ref = 0;
    for (std::int64_t i = 0; i < 12; ++i) ref += std::pow(static_cast<double>(out[i]) - target[i], 2) / 3.0;
    CHECK(res.sum() == Approx(ref).epsilon(1e-12));
    CHECK(res.count == 4);
    CHECK(res.correct() == 0);
    std::vector<double> numeric;
    for (std::int64_t i = 0; i < out.numel(); ++i) {
        auto p = out, m = out;
        p[i] += 1e-3f;
        m[i] -= 1e-3f;
        numeric.push_back((mse(ctx, p, target).sum() - mse(ctx, m, target).sum()) / 10.0 / (static_cast<double>(p[i]) - m[i]));
    }
    CHECK(test::rel_error(res.grad.span(), numeric) <= 1e-4);
    CHECK_THROWS_WITH(mse(ctx, out, Tensor<float>(Shape{4, 2})),
                      Catch::Contains("MseLoss: targets of shape (4, 2) NCHW for an output of shape (4, 3) NCHW"));
}

// Issue 23, item 2: a context reused with global_batch 0 made the CUDA loss gradient zero, silently.
TEST_CASE("A loss refuses a global batch smaller than the replica's shard", "[nn]") {
    const auto out = Tensor<float>(Shape{4, 3});
    const std::vector<std::int64_t> labels{0, 1, 2, 0};
    nn::Context<> ctx;
    for (const std::int64_t global : {0, 3}) {
        ctx.global_batch = global;
        CAPTURE(global);
        CHECK_THROWS_AS(nn::SoftmaxCrossEntropy{}(ctx, out, labels), UsageError);
        CHECK_THROWS_WITH(nn::MseLoss{}(ctx, out, Tensor<float>(Shape{4, 3})),
                          Catch::Contains("global_batch is " + std::to_string(global) + " but this replica's shard holds 4"));
    }
    ctx.global_batch = 4;  // the whole batch, or -1 for a replica alone: accepted
    CHECK(nn::SoftmaxCrossEntropy{}(ctx, out, labels).count == 4);
    ctx.global_batch = -1;
    CHECK(nn::SoftmaxCrossEntropy{}(ctx, out, labels).count == 4);
    ctx.global_batch = 0;  // an empty shard of an empty batch has nothing to scale
    CHECK(nn::SoftmaxCrossEntropy{}(ctx, Tensor<float>(Shape{0, 3}), std::vector<std::int64_t>{}).count == 0);
}

TEST_CASE("Modules are walked read-only through a const reference", "[nn]") {
    nn::Sequential net(nn::Linear<>(3, 2), nn::SyncBatchNorm<>(2));
    const auto& view = net;
    std::vector<std::string> names;
    nn::for_each_parameter(view, [&](const std::string& name, const auto& p) {
        static_assert(std::is_const_v<std::remove_reference_t<decltype(p)>>);
        names.push_back(name);
    });
    nn::for_each_buffer(view, [&](const std::string& name, const auto& t) {
        static_assert(std::is_const_v<std::remove_reference_t<decltype(t)>>);
        names.push_back(name);
    });
    CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                            "1.num_batches_tracked"});
    CHECK(nn::parameter_count(view) == 3 * 2 + 2 + 2 + 2);
}

TEST_CASE("Checkpoints get the mode of a new file and hold optimizer state", "[nn][checkpoint]") {
    const auto dir = fs::temp_directory_path() / ("lockstep-ckpt-" + std::to_string(test::unique_number()));
    fs::create_directories(dir);
    const std::string path = (dir / "model.safetensors").string();
    const mode_t old_mask = ::umask(027);
    nn::Sequential net(nn::Linear<>(3, 2));
    nn::save(path, net);
    ::umask(old_mask);
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == (0666 & ~027));  // not mkstemp's 0600

    // Momentum buffers round-trip under PyTorch's names; a state never created stays absent.
    nn::Sgd sgd({.lr = 0.1, .momentum = 0.9});
    sgd.prepare(1);
    for (std::int64_t i = 0; i < net.get<0>().weight.numel(); ++i) net.get<0>().weight.grad[i] = 0.5f * static_cast<float>(i);
    sgd.step(nn::Context<>{}, net);
    nn::Checkpoint ck;
    nn::put_optimizer(ck, sgd, net);
    CHECK(ck.contains("optimizer.0.weight.momentum_buffer"));
    CHECK(ck.contains("optimizer.0.bias.momentum_buffer"));
    nn::Sgd fresh({.lr = 0.1, .momentum = 0.9});
    nn::get_optimizer(ck, fresh, net, 0);
    std::vector<float> a, b;
    sgd.visit_state(0, net, [&](const std::string&, const Tensor<float>& m, const nn::Parameter<>&) {
        a.insert(a.end(), m.span().begin(), m.span().end());
    });
    fresh.visit_state(0, net, [&](const std::string&, const Tensor<float>& m, const nn::Parameter<>&) {
        b.insert(b.end(), m.span().begin(), m.span().end());
    });
    CHECK(a == b);
    CHECK(a.size() == 8);
    fs::remove_all(dir);
}

TEST_CASE("Conv2d stays exact across input shapes and an evaluation between forward and backward", "[nn]") {
    // The host path keeps per-shape state (oneDNN primitives and staged inputs, Note [oneDNN
    // convolutions]): three batch sizes in turn evict and rebuild it, and an evaluation forward
    // between a training forward and its backward must not change what backward uses.
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g(seed);
    const std::int64_t C = 16, O = 8, H = 9, W = 9, k = 3;  // 16 channels: oneDNN stages the input blocked
    nn::Conv2d<> conv(C, O, k, {.padding = 1}, g);
    auto copy = conv;  // a replica: it must not share the original's per-shape state
    const auto check = [&](nn::Conv2d<>& layer, std::int64_t N) {
        CAPTURE(N);
        const auto x = random_tensor(Shape{N, C, H, W}, gen);
        const auto other = random_tensor(Shape{N, C, H, W}, gen);
        auto xs = to_f64(x), ws = to_f64(layer.weight.value), bs = to_f64(layer.bias.value);
        nn::Context<> train, eval;
        eval.training = false;
        const auto y = layer.forward(train, x);
        CHECK(test::rel_error(y.span(), conv_reference(xs, ws, bs, N, C, H, W, O, k, 1, 1)) <= 1e-5);
        (void)layer.forward(eval, other);  // same shape, another input, between forward and backward
        const auto dy = random_tensor(y.shape(), gen);
        const auto dys = to_f64(dy);
        nn::zero_grad(layer);
        (void)layer.backward(train, dy);
        const auto L = [&] { return dot64(dys, conv_reference(xs, ws, bs, N, C, H, W, O, k, 1, 1)); };
        auto aws = abs_of(ws);
        const auto axs = abs_of(xs), abs_ = abs_of(bs), adys = abs_of(dys);
        const auto La = [&] { return dot64(adys, conv_reference(axs, aws, abs_, N, C, H, W, O, k, 1, 1)); };
        CHECK(derivative_error(ws, aws, sample_indices(ws.size(), 24, gen), L, La,
                               [&](std::size_t i) { return layer.weight.grad[static_cast<std::int64_t>(i)]; }) <= 1e-5);
    };
    for (const std::int64_t N : {8, 5, 8, 3, 5, 8}) {
        check(conv, N);
        check(copy, N == 8 ? 3 : 8);
    }
}

TEST_CASE("Linear with fused ReLU equals Linear then ReLU, bit for bit", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    nn::Generator g1(seed), g2(seed);
    nn::Linear<> fused(9, 7, {.fused_relu = true}, g1);
    nn::Sequential plain(nn::Linear<>(9, 7, true, g2), nn::ReLU<>());
    const auto x = random_tensor(Shape{6, 9}, gen);
    nn::Context<> ctx;
    const auto y1 = fused.forward(ctx, x);
    const auto y2 = plain.forward(ctx, x);
    CHECK(std::memcmp(y1.data(), y2.data(), y1.bytes()) == 0);
    const auto dy = random_tensor(y1.shape(), gen);
    nn::zero_grad(fused);
    nn::zero_grad(plain);
    const auto dx1 = fused.backward(ctx, dy);
    const auto dx2 = plain.backward(ctx, dy);
    CHECK(std::memcmp(dx1.data(), dx2.data(), dx1.bytes()) == 0);
    CHECK(std::memcmp(fused.weight.grad.data(), plain.get<0>().weight.grad.data(), fused.weight.grad.bytes()) == 0);
    CHECK(std::memcmp(fused.bias.grad.data(), plain.get<0>().bias.grad.data(), fused.bias.grad.bytes()) == 0);
    nn::Context<> eval;
    eval.training = false;
    const auto e = fused.forward(eval, x);
    CHECK(std::memcmp(e.data(), y2.data(), e.bytes()) == 0);
    CHECK(fused.describe() == "Linear(9, 7, fused_relu)");
    CHECK(nn::parameter_count(nn::Linear<>(3, 2, {}, g1)) == 8);  // `{}` is the options, with their bias
    CHECK(nn::parameter_count(nn::Linear<>(3, 2, false, g1)) == 6);
}

#if LOCKSTEP_WITH_DNNL
TEST_CASE("Where lockstep is built with oneDNN, oneDNN serves host convolutions", "[nn]") {
    // Both CI paths are real: this build's release preset asks for oneDNN (LOCKSTEP_DNNL=ON), the
    // sanitizer presets build im2col.
    const long before = kernels::dnnl_conv::plans_made();
    nn::Conv2d<> conv(16, 8, 3, {.padding = 1});
    nn::Context<> ctx;
    (void)conv.forward(ctx, Tensor<float>(Shape{2, 16, 9, 9}));
    CHECK(kernels::dnnl_conv::plans_made() == before + 1);
    (void)conv.forward(ctx, Tensor<float>(Shape{2, 16, 9, 9}));
    CHECK(kernels::dnnl_conv::plans_made() == before + 1);  // made once per shape
    CHECK(kernels::detail::host_conv_engine().forward != nullptr);
}

TEST_CASE("Where lockstep is built with oneDNN, its matmul serves the linear layers", "[nn]") {
    // Note [oneDNN matmul for linear layers]; the results themselves are checked against fp64 loops
    // and finite differences by the Linear tests above, which run on this path in this build.
    const long before = kernels::dnnl_conv::matmuls_made();
    nn::Generator g(3);
    nn::Linear<> fc(40, 6, true, g);
    nn::Context<> ctx;
    Tensor<float> x(Shape{5, 40});
    for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 0.01f * static_cast<float>(i % 37) - 0.2f;
    const auto y = fc.forward(ctx, x);
    CHECK(kernels::dnnl_conv::matmuls_made() == before + 1);
    (void)fc.forward(ctx, x);
    CHECK(kernels::dnnl_conv::matmuls_made() == before + 1);  // made once per shape on a thread
    (void)fc.backward(ctx, y);
    CHECK(kernels::dnnl_conv::matmuls_made() == before + 3);  // backward-weights and backward-data
    CHECK(kernels::detail::host_conv_engine().gemm != nullptr);
}
#endif

// ---- checkpoint files that break the format, and paths a save must not destroy ----

namespace {
// Writes a safetensors file with the given header text and `data_bytes` zero bytes of data.
void write_raw(const std::string& path, const std::string& header, std::size_t data_bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const std::uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << header;
    out << std::string(data_bytes, '\0');
}
}  // namespace

TEST_CASE("Checkpoint files looser than the safetensors format are refused, naming the file", "[nn][checkpoint]") {
    const auto dir = fs::temp_directory_path() / ("lockstep-ckpt-" + std::to_string(test::unique_number()));
    fs::create_directories(dir);
    const std::string path = (dir / "bad.safetensors").string();
    const auto refused = [&](const std::string& header, std::size_t data, const std::string& why) {
        CAPTURE(header);
        write_raw(path, header, data);
        CHECK_THROWS_WITH(nn::Checkpoint::load(path),
                          Catch::Contains("'" + path + "' is not a valid checkpoint") && Catch::Contains(why));
    };
    // Two tensors of 8 bytes each, well formed: accepted.
    write_raw(path,
              R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
              16);
    CHECK(nn::Checkpoint::load(path).names() == std::vector<std::string>{"a", "b"});
    refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 16,
            "overlap or leave a gap");  // b loads a's bytes
    refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
            20, "overlap or leave a gap");
    refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12, "4 bytes after the last tensor");
    refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16,
            "names 'a' twice");
    refused(R"({"a":{"dtype":"F32","shape":[10.7],"data_offsets":[0,40]}})", 40, "not a non-negative integer: 10.7");
    refused(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,0]}})", 0, "not a non-negative integer: -2");
    refused(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0, "does not fit 64 bits");
    refused(R"({"a":{"dtype":"F32","shape":[1073741824,4294967296],"data_offsets":[0,0]}})", 0, "does not fit 64 bits");
    refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0.5,8]}})", 8, "two non-negative integers");
    refused(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1],"data_offsets":[0,4]}})", 4, "rank 6");
    refused(R"({"a":{"dtype":"F32","shape":[2]}})", 8, "needs dtype, shape and data_offsets");
    fs::remove_all(dir);
}

// Found with fuzz_safetensors (a hand-made input: the fuzzer's 4 KiB inputs nest too shallow): an
// extent nested 20000 arrays deep overflowed the stack while the error message printed it. The
// input is tests/fuzz/corpus/safetensors/crashed-stack-overflow-shape-nested-20000-deep.
TEST_CASE("Checkpoint headers nested deeper than 128 levels are refused without a stack overflow", "[nn][checkpoint]") {
    const auto dir = fs::temp_directory_path() / ("lockstep-ckpt-" + std::to_string(test::unique_number()));
    fs::create_directories(dir);
    const std::string path = (dir / "deep.safetensors").string();
    const auto load_error = [&](const std::string& header) {
        write_raw(path, header, 0);
        try {
            nn::Checkpoint::load(path);
        } catch (const IoError& e) {
            return std::string(e.what());
        }
        return std::string("(loaded)");
    };
    const auto nested = [](std::size_t depth, const std::string& inner) {
        return std::string(depth, '[') + inner + std::string(depth, ']');
    };
    const std::string deep = "header nests JSON deeper than 128 levels";
    // A million levels: far past any stack, were the header printed or walked recursively.
    CHECK_THAT(load_error(R"({"a":{"dtype":"F32","shape":[)" + nested(1'000'000, "") + R"(],"data_offsets":[0,0]}})"),
               Catch::Contains("'" + path + "' is not a valid checkpoint") && Catch::Contains(deep));
    std::string objects;
    for (int i = 0; i < 1'000'000; ++i) objects += R"({"a":)";
    CHECK_THAT(load_error(objects + "1" + std::string(1'000'000, '}')), Catch::Contains(deep));
    // 128 levels parse: the shape array is the third, so an extent nested 125 arrays deeper is the
    // 128th; it is refused for what it is, and the message shows its type, not the value.
    CHECK_THAT(load_error(R"({"a":{"dtype":"F32","shape":[)" + nested(125, "1") + R"(],"data_offsets":[0,4]}})"),
               Catch::Contains("has an extent that is not a non-negative integer: an array"));
    CHECK_THAT(load_error(R"({"a":{"dtype":"F32","shape":[)" + nested(126, "1") + R"(],"data_offsets":[0,4]}})"),
               Catch::Contains(deep));
    // A long scalar is cut in the message.
    const std::string message =
        load_error(R"({"a":{"dtype":"F32","shape":[")" + std::string(100'000, 'x') + R"("],"data_offsets":[0,4]}})");
    CHECK_THAT(message, Catch::Contains(R"(integer: "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...)"));
    CHECK(message.size() < 300);
    fs::remove_all(dir);
}

TEST_CASE("A save replaces only a regular file, writes through a symlink and clears killed saves' leftovers",
          "[nn][checkpoint]") {
    const auto dir = fs::temp_directory_path() / ("lockstep-ckpt-" + std::to_string(test::unique_number()));
    fs::create_directories(dir);
    nn::Sequential net(nn::Linear<>(3, 2));
    // A FIFO (and, where this process may make one, a device node) stays what it is.
    const std::string fifo = (dir / "fifo").string();
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK_THROWS_WITH(nn::save(fifo, net), Catch::Contains("is a FIFO; a checkpoint replaces only a regular file"));
    CHECK(fs::is_fifo(fifo));
    CHECK_THROWS_WITH(nn::save(dir.string(), net), Catch::Contains("is a directory"));
    const std::string node = (dir / "full").string();
    if (::mknod(node.c_str(), S_IFCHR | 0600, makedev(1, 7)) == 0) {  // what /dev/full is, in our own folder
        CHECK_THROWS_WITH(nn::save(node, net), Catch::Contains("is a device node"));
        CHECK(fs::is_character_file(node));
    } else {
        WARN("this process may not make device nodes (" << std::strerror(errno) << "): the FIFO stands in for them");
    }
    CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == (fs::exists(node) ? 2 : 1));  // no temporaries
    // A symlink is written through: the file it points to gets the checkpoint, the link stays.
    const std::string real = (dir / "real.safetensors").string(), link = (dir / "link.safetensors").string();
    fs::create_symlink(real, link);
    const auto report = nn::save(link, net);
    CHECK(fs::is_symlink(link));
    CHECK(fs::is_regular_file(real));
    CHECK(report.written == fs::weakly_canonical(real).string());
    nn::Sequential back(nn::Linear<>(3, 2));
    nn::load(link, back);
    CHECK(std::memcmp(back.get<0>().weight.value.data(), net.get<0>().weight.value.data(), net.get<0>().weight.value.bytes()) ==
          0);
    // A killed save's full-size temporary is removed by the next save of the same file, and said.
    const std::string stale = real + ".tmp-Ab12Cd", other = (dir / "other.safetensors.tmp-Ab12Cd").string();
    std::ofstream(stale) << "partial";
    std::ofstream(other) << "someone else's";
    const auto again = nn::save(real, net);
    CHECK(again.removed_stale == std::vector<std::string>{stale});
    CHECK_FALSE(fs::exists(stale));
    CHECK(fs::exists(other));
    // Writability is known before any training.
    CHECK_NOTHROW(nn::Checkpoint::check_writable(real));
    CHECK_THROWS_WITH(nn::Checkpoint::check_writable((dir / "no-such-dir" / "x.safetensors").string()),
                      Catch::Contains("cannot write a checkpoint at"));
    CHECK_THROWS_AS(nn::Checkpoint::check_writable(fifo), IoError);
    fs::remove_all(dir);
}
