// SPDX-License-Identifier: MIT
//! The nn kit: layer gradients against finite differences, PyTorch semantics of SGD and the
//! loss, checkpoints in safetensors format, and bad input.
#include <catch2/catch.hpp>

#include <lockstep/nn.hpp>

#include <cmath>
#include <cstdio>
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

Tensor<float> random_tensor(Shape s, std::mt19937_64& gen, double lo = -1.0, double hi = 1.0) {
    Tensor<float> t(s);
    std::uniform_real_distribution<double> d(lo, hi);
    for (auto& v : t.span()) v = static_cast<float>(d(gen));
    return t;
}

double dot(const Tensor<float>& a, const Tensor<float>& w) {
    double s = 0;
    for (std::int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a[i]) * w[i];
    return s;
}

// Checks d(sum(w * layer(x)))/d(x) and /d(parameters) from backward against central differences
// of the forward, evaluated in fp64 from the layer's fp32 outputs.
template <class Layer>
void check_gradients(Layer& layer, const Tensor<float>& x, std::mt19937_64& gen, double h, double tol) {
    nn::Context ctx;
    auto y = layer.forward(ctx, x);
    const auto w = random_tensor(y.shape(), gen);
    nn::zero_grad(layer);
    const auto dx = layer.backward(ctx, w);
    const auto loss = [&](const Tensor<float>& input) {
        nn::Context eval;
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
    for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 0.01f * static_cast<float>(order[static_cast<std::size_t>(i)] - 72) + 0.005f;
    nn::ReLU<> relu;
    check_gradients(relu, x, gen, 1e-3, 1e-3);
    nn::MaxPool2d<> pool(2);
    check_gradients(pool, x, gen, 1e-3, 1e-3);
    nn::Flatten<> flat;
    check_gradients(flat, x, gen, 1e-3, 1e-5);
}

TEST_CASE("SoftmaxCrossEntropy: value and gradient of the mean over the global batch", "[nn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    auto logits = random_tensor(Shape{4, 5}, gen, -3, 3);
    const std::vector<std::int64_t> labels{0, 4, 2, 2};
    nn::Context ctx;
    ctx.global_batch = 10;  // this shard is 4 of a global batch of 10
    const nn::SoftmaxCrossEntropy ce;
    const auto out = ce(ctx, logits, labels);
    double ref = 0;
    for (int n = 0; n < 4; ++n) {
        double denom = 0;
        for (int k = 0; k < 5; ++k) denom += std::exp(static_cast<double>(logits[n * 5 + k]));
        ref += -std::log(std::exp(static_cast<double>(logits[n * 5 + labels[static_cast<std::size_t>(n)]])) / denom);
    }
    CHECK(out.sum == Approx(ref).epsilon(1e-12));
    std::vector<double> numeric;
    for (std::int64_t i = 0; i < logits.numel(); ++i) {
        auto p = logits, m = logits;
        p[i] += 1e-3f;
        m[i] -= 1e-3f;
        numeric.push_back((ce(ctx, p, labels).sum - ce(ctx, m, labels).sum) / 10.0 / (static_cast<double>(p[i]) - m[i]));
    }
    CHECK(test::rel_error(out.grad.span(), numeric) <= 1e-4);
    CHECK_THROWS_WITH(ce(ctx, logits, std::vector<std::int64_t>{0, 1, 2}), Catch::Contains("3 labels for a batch of 4"));
    CHECK_THROWS_WITH(ce(ctx, logits, std::vector<std::int64_t>{0, 1, 5, 2}), Catch::Contains("label 5 of sample 2 is out of range"));
}

TEST_CASE("Sgd follows torch.optim.SGD", "[nn]") {
    const auto opts = GENERATE(nn::SgdOptions{.lr = 0.1, .momentum = 0.9},
                               nn::SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true},
                               nn::SgdOptions{.lr = 0.2, .momentum = 0.5, .dampening = 0.3},
                               nn::SgdOptions{.lr = 0.3});
    nn::Linear<> fc(3, 2);
    nn::Sgd sgd(opts);
    sgd.prepare(1);
    std::vector<double> p(fc.weight.value.span().begin(), fc.weight.value.span().end()), v(p.size(), 0.0);
    for (int step = 0; step < 3; ++step) {
        for (std::int64_t i = 0; i < fc.weight.numel(); ++i) fc.weight.grad[i] = 0.1f * static_cast<float>(i + step) - 0.2f;
        sgd.step(0, fc);
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
    nn::Sequential net(nn::Conv2d<>(1, 2, 3, {}, g), nn::SyncBatchNorm<>(2), nn::ReLU<>(), nn::Flatten<>(), nn::Linear<>(2, 3, true, g));
    std::vector<std::string> names;
    nn::walk(net, [&](const std::string& n, auto&) { names.push_back(n); }, [&](const std::string& n, auto&) { names.push_back(n); });
    CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                            "1.num_batches_tracked", "4.weight", "4.bias"});
    nn::Generator a(3), b(3);
    CHECK(nn::Linear<>(4, 4, true, a).weight.value[5] == nn::Linear<>(4, 4, true, b).weight.value[5]);  // seeded
}

TEST_CASE("Layers reject input that does not fit, naming the layer", "[nn]") {
    nn::Context ctx;
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
    CHECK_THROWS_WITH(nn::load(path, wider), Catch::Contains("'0.weight' has shape (3, 4) but the model expects (3, 5)"));
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
    b.get<0>().weight.value[0] += 1.0f;
    b.get<1>().running_mean[0] = 5.0f;
    CHECK(a.get<0>().weight.value[0] != b.get<0>().weight.value[0]);
    CHECK(a.get<1>().running_mean[0] == 0.0f);
    CHECK_THROWS_WITH(nn::clone(a, Device::cuda(0)), Catch::Contains("cannot clone a host module onto device cuda:0"));
}
