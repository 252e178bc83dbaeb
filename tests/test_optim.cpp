// SPDX-License-Identifier: MIT
//! Adam, AdamW, parameter groups and the learning-rate schedules against PyTorch's own
//! (tests/golden/make_optim_golden.py), Adam's state through checkpoints and DataParallel.
#include <catch2/catch.hpp>

#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "test_support.hpp"

using namespace lockstep;
namespace fs = std::filesystem;

namespace {

const nn::Checkpoint& golden() {
    static const auto ck = nn::Checkpoint::load(LOCKSTEP_GOLDEN_DIR "/optim.safetensors");
    return ck;
}

Tensor<float> golden_tensor(const std::string& name, Shape shape) {
    Tensor<float> t(shape);
    golden().get(name, t);
    return t;
}

std::vector<double> golden_list(const std::string& key) {
    return nlohmann::json::parse(golden().metadata.at(key)).get<std::vector<double>>();
}

// ||a - b|| / ||b||.
double norm_error(const Tensor<float>& a, const Tensor<float>& b) {
    double d = 0, n = 0;
    for (std::int64_t i = 0; i < b.numel(); ++i) {
        d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
        n += static_cast<double>(b[i]) * b[i];
    }
    return std::sqrt(d / n);
}

nn::Linear<> golden_linear() {
    nn::Generator g(0);
    nn::Linear<> lin(4, 3, true, g);
    lin.weight.value = golden_tensor("init.weight", Shape{3, 4});
    lin.bias.value = golden_tensor("init.bias", Shape{3});
    return lin;
}

template <class Optimizer>
void check_against_golden(const std::string& cfg, Optimizer& opt) {
    auto lin = golden_linear();
    opt.prepare(1);
    nn::Context<> ctx;
    for (int k = 0; k < 5; ++k) {
        CAPTURE(cfg, k);
        lin.weight.grad = golden_tensor("grad." + std::to_string(k) + ".weight", Shape{3, 4});
        lin.bias.grad = golden_tensor("grad." + std::to_string(k) + ".bias", Shape{3});
        opt.step(ctx, lin);
        CHECK(norm_error(lin.weight.value, golden_tensor(cfg + "." + std::to_string(k) + ".weight", Shape{3, 4})) <= 1e-6);
        CHECK(norm_error(lin.bias.value, golden_tensor(cfg + "." + std::to_string(k) + ".bias", Shape{3})) <= 1e-6);
    }
    std::map<std::string, Tensor<float>> state;
    opt.visit_state(0, lin, [&](const std::string& name, const Tensor<float>& t, const nn::Parameter<>&) { state[name] = t; });
    REQUIRE(state.size() == 4);
    for (const auto& [name, t] : state) {
        CAPTURE(name);
        CHECK(norm_error(t, golden_tensor(cfg + ".state." + name, t.shape())) <= 1e-6);
    }
    std::vector<std::int64_t> steps;
    opt.visit_counters(0, lin, [&](const std::string&, std::int64_t& s) { steps.push_back(s); });
    CHECK(steps == std::vector<std::int64_t>{5, 5});
}

}  // namespace

TEST_CASE("Adam with L2 weight decay follows torch.optim.Adam for five steps", "[nn][golden]") {
    nn::Adam<> adam({.lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1});
    check_against_golden("adam", adam);
}

TEST_CASE("AdamW with a group free of weight decay follows torch.optim.AdamW for five steps", "[nn][golden]") {
    nn::AdamW<> adamw({.lr = 0.01, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.05},
                      {nn::no_decay_on_norms_and_biases()});
    check_against_golden("adamw", adamw);
}

TEST_CASE("Adam and AdamW deduce the host backend and refuse bad hyper-parameters", "[nn]") {
    nn::AdamW deduced({.lr = 0.01, .weight_decay = 0.05}, {nn::no_decay_on_norms_and_biases()});
    nn::Adam plain({.lr = 0.01});
    static_assert(std::is_same_v<decltype(deduced), nn::AdamW<Host>> && std::is_same_v<decltype(plain), nn::Adam<Host>>);
    CHECK(deduced.options().decoupled);
    CHECK_FALSE(plain.options().decoupled);
    CHECK_THROWS_WITH(nn::Adam<>({.beta1 = 1.0}), Catch::Contains("betas must lie in [0, 1)"));
    CHECK_THROWS_WITH(nn::Adam<>({.lr = -1}), Catch::Contains("learning rate must be >= 0"));
    CHECK_THROWS_WITH(nn::AdamW<>({}, {nn::ParamGroup{nullptr, 0.0, 1.0}}),
                      Catch::Contains("parameter group 0 has no `matches`"));
    nn::Generator g(1);
    nn::Linear<> lin(2, 2, true, g);
    nn::Context<> ctx;
    CHECK_THROWS_AS(deduced.step(ctx, lin), UsageError);  // no prepare()
}

TEST_CASE("A mutated Adam fails the comparison: the golden file can tell", "[nn][golden]") {
    // Weight decay applied to the bias too: the group is what makes AdamW match.
    nn::AdamW<> wrong({.lr = 0.01, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.05});
    auto lin = golden_linear();
    wrong.prepare(1);
    nn::Context<> ctx;
    for (int k = 0; k < 5; ++k) {
        lin.weight.grad = golden_tensor("grad." + std::to_string(k) + ".weight", Shape{3, 4});
        lin.bias.grad = golden_tensor("grad." + std::to_string(k) + ".bias", Shape{3});
        wrong.step(ctx, lin);
    }
    CHECK(norm_error(lin.bias.value, golden_tensor("adamw.4.bias", Shape{3})) > 1e-5);
    CHECK(norm_error(lin.weight.value, golden_tensor("adamw.4.weight", Shape{3, 4})) <= 1e-6);
}

TEST_CASE("Schedules give PyTorch's learning rates step by step", "[nn][golden]") {
    const auto close = [](const std::vector<double>& got, const std::vector<double>& want) {
        REQUIRE(got.size() == want.size());
        for (std::size_t i = 0; i < want.size(); ++i) {
            CAPTURE(i, got[i], want[i]);
            CHECK(std::abs(got[i] - want[i]) <= 1e-12 + 1e-9 * std::abs(want[i]));
        }
    };
    const auto values = [](std::size_t n, auto&& f) {
        std::vector<double> v;
        for (std::size_t i = 0; i < n; ++i) v.push_back(f(static_cast<std::int64_t>(i)));
        return v;
    };
    SECTION("StepLR") {
        const nn::StepLR s(0.1, 3, 0.5);
        close(values(12, [&](std::int64_t e) { return s.lr(e); }), golden_list("step_lr"));
    }
    SECTION("linear warm-up then cosine") {
        const nn::CosineWithWarmup s(0.1, 5, 20, 1e-4, 0.01);
        close(values(20, [&](std::int64_t e) { return s.lr(e); }), golden_list("cosine_warmup"));
    }
    SECTION("one cycle, learning rate and momentum") {
        const nn::OneCycleLR s(0.1, 20);
        close(values(20, [&](std::int64_t e) { return s.lr(e); }), golden_list("onecycle_lr"));
        close(values(20, [&](std::int64_t e) { return s.momentum(e); }), golden_list("onecycle_beta1"));
    }
    SECTION("bad settings are refused") {
        CHECK_THROWS_AS(nn::StepLR(0.1, 0), InvalidArgument);
        CHECK_THROWS_AS(nn::CosineWithWarmup(0.1, 10, 10), InvalidArgument);
        CHECK_THROWS_AS(nn::OneCycleLR(0.1, 20, {.pct_start = 1.0}), InvalidArgument);
    }
}

namespace {

using Net = nn::Sequential<nn::Conv2d<>, nn::SyncBatchNorm<>, nn::ReLU<>, nn::AdaptiveAvgPool2d<>, nn::Flatten<>, nn::Linear<>>;

Net make_net(std::uint64_t seed) {
    nn::Generator g(seed);
    return Net(nn::Conv2d<>(2, 4, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(4), nn::ReLU<>(), nn::AdaptiveAvgPool2d<>(1),
               nn::Flatten<>(), nn::Linear<>(4, 3, true, g));
}

std::vector<std::pair<Tensor<float>, std::vector<std::int64_t>>> batches(int n, std::mt19937_64& gen) {
    std::normal_distribution<float> d(0, 1);
    std::vector<std::pair<Tensor<float>, std::vector<std::int64_t>>> out;
    for (int s = 0; s < n; ++s) {
        Tensor<float> x(Shape{9, 2, 6, 6});
        for (auto& v : x.span()) v = d(gen);
        std::vector<std::int64_t> y;
        for (int i = 0; i < 9; ++i) y.push_back(static_cast<std::int64_t>(gen() % 3));
        out.emplace_back(std::move(x), std::move(y));
    }
    return out;
}

std::vector<float> flat(const Net& net) {
    std::vector<float> v;
    nn::for_each_parameter(net, [&](const std::string&, const nn::Parameter<>& p) {
        v.insert(v.end(), p.value.span().begin(), p.value.span().end());
    });
    return v;
}

}  // namespace

TEST_CASE("AdamW under DataParallel: replicas stay identical, and a checkpoint resumes exactly, steps included",
          "[nn][parallel][checkpoint]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto data = batches(6, gen);
    const auto path =
        (fs::temp_directory_path() / ("lockstep_adamw_" + std::to_string(test::unique_number()) + ".safetensors")).string();
    const nn::CosineWithWarmup schedule(0.01, 2, 6);
    const auto opt = [] { return nn::AdamW<>({.lr = 0.01, .weight_decay = 0.05}, {nn::no_decay_on_norms_and_biases()}); };

    DataParallel straight(make_net(seed), 3);
    auto a = opt();
    for (int s = 0; s < 6; ++s) {
        a.set_lr(schedule.lr(s));
        straight.train_step(data[s].first, data[s].second, nn::SoftmaxCrossEntropy{}, a);
        for (int r = 1; r < 3; ++r) REQUIRE(flat(straight.replica(r)) == flat(straight.replica(0)));
    }

    DataParallel first(make_net(seed), 3);
    auto b = opt();
    for (int s = 0; s < 3; ++s) {
        b.set_lr(schedule.lr(s));
        first.train_step(data[s].first, data[s].second, nn::SoftmaxCrossEntropy{}, b);
    }
    first.save(path, b);
    const auto ck = nn::Checkpoint::load(path);
    CHECK(ck.contains("optimizer.0.weight.exp_avg"));
    CHECK(ck.contains("optimizer.5.bias.step"));
    CHECK(nn::get_counter(ck, "optimizer.5.bias.step") == 3);

    DataParallel resumed(make_net(seed + 1), 3);  // another start: the checkpoint decides
    auto c = opt();
    resumed.load(path, c);
    for (int s = 3; s < 6; ++s) {
        c.set_lr(schedule.lr(s));
        resumed.train_step(data[s].first, data[s].second, nn::SoftmaxCrossEntropy{}, c);
    }
    CHECK(flat(resumed.module()) == flat(straight.module()));  // bit for bit: moments and step counts resumed

    // A step count that is not a whole number is refused, naming it, before anything changes.
    auto bad = nn::Checkpoint::load(path);
    Tensor<float> half(Shape{});
    half[0] = 2.5f;
    bad.put("optimizer.5.bias.step", half);
    bad.save(path);
    const auto before = flat(resumed.module());
    CHECK_THROWS_WITH(resumed.load(path, c), Catch::Contains("optimizer.5.bias.step") && Catch::Contains("whole number"));
    CHECK(flat(resumed.module()) == before);
    fs::remove(path);
}
