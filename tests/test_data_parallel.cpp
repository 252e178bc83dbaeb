// SPDX-License-Identifier: MIT
//! DataParallel and the equivalence property: K steps on any number of replicas and any split
//! equal K steps of one replica on the whole batch, and replicas stay bit-identical.
#include <catch2/catch.hpp>

#include <lockstep/nn.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "test_support.hpp"

using namespace lockstep;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

// Conv2d -> SyncBatchNorm -> ReLU -> MaxPool2d -> Flatten -> Linear, as the issue names it.
using Net = nn::Sequential<nn::Conv2d<>, nn::SyncBatchNorm<>, nn::ReLU<>, nn::MaxPool2d<>, nn::Flatten<>, nn::Linear<>>;

Net make_net(std::uint64_t seed) {
    nn::Generator g(seed);
    return Net(nn::Conv2d<>(2, 4, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(4), nn::ReLU<>(), nn::MaxPool2d<>(2),
               nn::Flatten<>(), nn::Linear<>(4 * 4 * 4, 5, true, g));
}

struct Batch {
    Tensor<float> x;
    std::vector<std::int64_t> labels;
};

std::vector<Batch> make_batches(int steps, std::int64_t n, std::mt19937_64& gen) {
    std::normal_distribution<float> d(0.5f, 1.0f);
    std::uniform_int_distribution<std::int64_t> l(0, 4);
    std::vector<Batch> out;
    for (int s = 0; s < steps; ++s) {
        Batch b{Tensor<float>(Shape{n, 2, 8, 8}), {}};
        for (auto& v : b.x.span()) v = d(gen);
        for (std::int64_t i = 0; i < n; ++i) b.labels.push_back(l(gen));
        out.push_back(std::move(b));
    }
    return out;
}

// Every parameter, buffer and momentum buffer of a module as one flat fp64 vector.
std::vector<double> flatten_state(Net& net) {
    std::vector<double> v;
    nn::walk(
        net, [&](const std::string&, auto& p) { v.insert(v.end(), p.value.span().begin(), p.value.span().end()); },
        [&](const std::string&, auto& t) { v.insert(v.end(), t.span().begin(), t.span().end()); });
    return v;
}

bool bit_identical(Net& a, Net& b) {
    bool same = true;
    auto ta = flatten_state(a), tb = flatten_state(b);
    same &= ta.size() == tb.size() && std::memcmp(ta.data(), tb.data(), ta.size() * sizeof(double)) == 0;
    return same;
}

struct Run {
    std::vector<double> losses;
    std::vector<double> state;
    std::vector<double> momentum;
};

Run train(int replicas, const std::vector<Batch>& batches, std::uint64_t seed, DataParallelOptions opts, bool check_replicas) {
    DataParallel<Net> dp(make_net(seed), replicas, opts);
    nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
    Run run;
    for (const auto& b : batches) {
        run.losses.push_back(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss);
        if (check_replicas)
            for (int r = 1; r < replicas; ++r) CHECK(bit_identical(dp.replica(0), dp.replica(r)));
    }
    run.state = flatten_state(dp.module());
    for (auto& m : sgd.momentum_buffers(0)) run.momentum.insert(run.momentum.end(), m.span().begin(), m.span().end());
    if (check_replicas)
        for (int r = 1; r < replicas; ++r) {
            auto& mine = sgd.momentum_buffers(r);
            auto& first = sgd.momentum_buffers(0);
            for (std::size_t i = 0; i < first.size(); ++i) CHECK(std::memcmp(mine[i].data(), first[i].data(), first[i].bytes()) == 0);
        }
    return run;
}

// How far the forward's discrete decisions on `x` are from a tie: the smallest |value| entering
// ReLU (on or off) and the smallest gap between the two largest positive values of a max-pool
// window (which one wins), with `net` as it stands, batch statistics as in a training step.
double decision_margin(const Net& net, const Tensor<float>& x) {
    Net probe = net;  // a deep copy: the forward below changes no state of `net`
    const nn::Context ctx;
    const auto h = probe.get<1>().forward(ctx, probe.get<0>().forward(ctx, Tensor<float>(x)));
    double margin = std::numeric_limits<double>::infinity();
    for (const float v : h.span()) margin = std::min(margin, std::abs(static_cast<double>(v)));
    const std::int64_t planes = h.dim(0) * h.dim(1), H = h.dim(2), W = h.dim(3);
    for (std::int64_t p = 0; p < planes; ++p)
        for (std::int64_t i = 0; i + 1 < H; i += 2)
            for (std::int64_t j = 0; j + 1 < W; j += 2) {
                std::array<float, 4> w{};
                for (int k = 0; k < 4; ++k) w[static_cast<std::size_t>(k)] = std::max(0.0f, h[(p * H + i + k / 2) * W + j + k % 2]);
                std::sort(w.begin(), w.end());
                if (w[3] > 0) margin = std::min(margin, static_cast<double>(w[3] - w[2]));
            }
    return margin;
}

// Batches for comparing different splits of the same steps. Splits round differently (sums in
// another order), by about 1e-7 of a value; where a value entering ReLU or max-pool lies that
// close to a tie, the splits may decide it differently and then rightly differ by a whole
// gradient element. Each batch is drawn again until, for the one-replica run as it stands at that
// step, every decision is at least 1e-5 from a tie: a hundred times the rounding, so every split
// decides alike and the results must agree to rounding.
std::vector<Batch> tie_free_batches(int steps, std::int64_t n, std::mt19937_64& gen, std::uint64_t seed) {
    DataParallel<Net> reference(make_net(seed), 1);
    nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});  // as train() below
    std::vector<Batch> out;
    for (int step = 0; step < steps; ++step) {
        for (int draw = 0;; ++draw) {
            REQUIRE(draw < 1000);
            auto b = std::move(make_batches(1, n, gen)[0]);
            if (decision_margin(reference.module(), b.x) < 1e-5) continue;
            reference.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
            out.push_back(std::move(b));
            break;
        }
    }
    return out;
}

}  // namespace

TEST_CASE("DataParallel on any replica count and split equals one replica on the whole batch", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    for (const std::int64_t batch : {10, 12}) {  // 10 over 4 replicas is 3, 3, 2, 2
        const auto batches = tie_free_batches(5, batch, gen, seed);
        const auto reference = train(1, batches, seed, {}, false);
        for (int replicas = 2; replicas <= 4; ++replicas) {
            CAPTURE(batch, replicas);
            const auto run = train(replicas, batches, seed, {}, true);
            CHECK(test::rel_error(run.losses, reference.losses) <= 1e-5);
            CHECK(test::rel_error(run.state, reference.state) <= 1e-5);
            CHECK(test::rel_error(run.momentum, reference.momentum) <= 1e-5);
        }
    }
}

TEST_CASE("Bucketing and overlap change no bit of the result", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto batches = make_batches(3, 11, gen);
    const auto one_bucket = train(3, batches, seed, {.bucket_bytes = std::size_t{1} << 30}, false);
    const auto per_param = train(3, batches, seed, {.bucket_bytes = 1}, false);  // one bucket per parameter
    const auto inline_reduce = train(3, batches, seed, {.bucket_bytes = 256, .overlap = false}, false);
    CHECK(one_bucket.state == per_param.state);
    CHECK(one_bucket.losses == per_param.losses);
    CHECK(inline_reduce.state == per_param.state);
    DataParallel<Net> dp(make_net(seed), 2, {.bucket_bytes = 1});
    CHECK(dp.bucket_count() == 6);  // conv w, b; bn w, b; fc w, b
}

TEST_CASE("One training step makes one all-reduce per bucket, two per SyncBatchNorm, one commit barrier", "[parallel]") {
    DataParallel<Net> dp(make_net(1), 2, {.bucket_bytes = 1});
    nn::Sgd sgd({.lr = 0.1});
    std::mt19937_64 gen(1);
    const auto b = make_batches(1, 6, gen)[0];
    const auto layer0 = dp.layer_collectives(0), grad0 = dp.gradient_collectives(0);
    dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    CHECK(dp.layer_collectives(0) - layer0 == 2);  // SyncBatchNorm forward + backward
    CHECK(dp.gradient_collectives(0) - grad0 == dp.bucket_count() + 1);  // + the commit barrier
}

namespace {
// The network with a slow first layer: its backward (the last to run) takes 100 ms more, time in
// which the buckets of the layers after it can be all-reduced.
struct SlowStart {
    using backend = Host;
    Net net;
    Tensor<float> forward(const nn::Context& ctx, Tensor<float> x) { return net.forward(ctx, std::move(x)); }
    Tensor<float> backward(const nn::Context& ctx, const Tensor<float>& dy) {
        auto& seq = net;
        Tensor<float> g = dy;
        g = seq.get<5>().backward(ctx, g);
        g = seq.get<4>().backward(ctx, g);
        g = seq.get<3>().backward(ctx, g);
        g = seq.get<2>().backward(ctx, g);
        g = seq.get<1>().backward(ctx, g);
        std::this_thread::sleep_for(100ms);
        return seq.get<0>().backward(ctx, g);
    }
    template <class V>
    void visit(V&& v) {
        v.module("net", net);
    }
};
}  // namespace

TEST_CASE("Gradient all-reduce overlaps backward", "[parallel]") {
    std::mt19937_64 gen(9);
    const auto b = make_batches(1, 8, gen)[0];
    nn::Sgd sgd({.lr = 0.01});
    DataParallel<SlowStart> overlapped(SlowStart{make_net(9)}, 2, {.bucket_bytes = 1, .overlap = true});
    overlapped.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    // Linear and SyncBatchNorm buckets (4 of 6) were done while the first conv was still in backward.
    CHECK(overlapped.overlapped_buckets(0) >= 4);
    CHECK(overlapped.overlapped_buckets(1) >= 4);
    DataParallel<SlowStart> serial(SlowStart{make_net(9)}, 2, {.bucket_bytes = 1, .overlap = false});
    serial.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    CHECK(serial.overlapped_buckets(0) == 0);
}

TEST_CASE("DataParallel forward scatters and gathers in rank order", "[parallel]") {
    const auto seed = test::fresh_seed();
    std::mt19937_64 gen(seed);
    auto x = make_batches(1, 7, gen)[0].x;
    DataParallel<Net> dp(make_net(seed), 3);
    dp.eval();
    const auto y = dp.forward(x);
    Net single = make_net(seed);
    nn::Context ctx;
    ctx.training = false;
    const auto ref = single.forward(ctx, x);
    REQUIRE(y.shape() == (Shape{7, 5}));
    CHECK(test::rel_error(y.span(), ref.span()) <= 1e-6);
    const auto shards = parallel::shard_ranges(10, 4);
    CHECK(shards[0].count == 3);
    CHECK(shards[1].count == 3);
    CHECK(shards[2].count == 2);
    CHECK(shards[3].begin == 8);
}

TEST_CASE("A checkpoint saved during training continues with identical losses", "[parallel][checkpoint]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto batches = make_batches(5, 9, gen);
    const auto path = (std::filesystem::temp_directory_path() / ("lockstep-resume-" + std::to_string(seed) + ".safetensors")).string();
    std::vector<double> uninterrupted, resumed;
    {
        DataParallel<Net> dp(make_net(seed), 3);
        nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
        for (int s = 0; s < 5; ++s) {
            uninterrupted.push_back(dp.train_step(batches[static_cast<std::size_t>(s)].x, batches[static_cast<std::size_t>(s)].labels,
                                                  nn::SoftmaxCrossEntropy{}, sgd).loss);
            if (s == 1) {
                nn::Checkpoint ck;
                nn::put_module(ck, dp.module());
                sgd.save_state(ck, dp.module());
                ck.save(path);
            }
        }
    }
    {
        DataParallel<Net> dp(make_net(seed + 1), 2);  // a different start and replica count
        nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
        const auto ck = nn::Checkpoint::load(path);
        DataParallel<Net> loaded = [&]() -> DataParallel<Net> {
            Net net = make_net(seed + 1);
            nn::get_module(ck, net, {}, false);
            return DataParallel<Net>(net, 2);
        }();
        sgd.load_state(ck, loaded.module(), loaded.size());
        for (int s = 2; s < 5; ++s)
            resumed.push_back(loaded.train_step(batches[static_cast<std::size_t>(s)].x, batches[static_cast<std::size_t>(s)].labels,
                                                nn::SoftmaxCrossEntropy{}, sgd).loss);
    }
    CHECK(test::rel_error(resumed, std::vector<double>(uninterrupted.begin() + 2, uninterrupted.end())) <= 1e-5);
    std::filesystem::remove(path);
}

namespace {
// A model whose replica 1 throws on demand, inside forward (after SyncBatchNorm's collective on
// the others has started) or inside backward (while gradient buckets are in flight).
struct Faulty {
    using backend = Host;
    Net net;
    std::shared_ptr<std::atomic<int>> fail = std::make_shared<std::atomic<int>>(0);  // 1: forward, 2: backward
    Tensor<float> forward(const nn::Context& ctx, Tensor<float> x) {
        if (ctx.rank == 1 && *fail == 1) throw std::runtime_error("replica 1 failed in forward");
        return net.forward(ctx, std::move(x));
    }
    Tensor<float> backward(const nn::Context& ctx, const Tensor<float>& dy) {
        auto dx = net.backward(ctx, dy);
        if (ctx.rank == 1 && *fail == 2) throw std::runtime_error("replica 1 failed in backward");
        return dx;
    }
    template <class V>
    void visit(V&& v) {
        v.module("net", net);
    }
};
}  // namespace

TEST_CASE("A replica that throws inside train_step fails the call quickly and leaves DataParallel usable", "[parallel]") {
    Faulty proto{make_net(3)};
    DataParallel<Faulty> dp(proto, 3, {.timeout = 60s});
    nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
    std::mt19937_64 gen(3);
    const auto b = make_batches(1, 9, gen)[0];
    for (int where : {1, 2}) {
        *dp.replica(0).fail = where;  // the flag is shared by the replicas' copies
        const auto t0 = clock_type::now();
        CHECK_THROWS_WITH(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd), Catch::Contains("replica 1 failed"));
        CHECK(clock_type::now() - t0 < 1s);
        *dp.replica(0).fail = 0;
        const auto ok = dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
        CHECK(std::isfinite(ok.loss));
        for (int r = 1; r < 3; ++r) CHECK(bit_identical(dp.replica(0).net, dp.replica(r).net));
    }
}

TEST_CASE("DataParallel binds its replica threads as DataParallelOptions::cpu_binding says", "[parallel]") {
    DataParallel<Net> spread(make_net(5), 1, {.cpu_binding = CpuBinding::spread});
#if defined(__linux__)
    CHECK(spread.bound_cpus().size() == 1);
#else
    CHECK(spread.bound_cpus().empty());
#endif
    DataParallel<Net> unbound(make_net(5), 1, {.cpu_binding = CpuBinding::none});
    CHECK(unbound.bound_cpus().empty());
    // Bound or not, training gives the same bits.
    nn::Sgd a({.lr = 0.1}), b({.lr = 0.1});
    std::mt19937_64 gen(5);
    const auto batch = make_batches(1, 8, gen)[0];
    CHECK(spread.train_step(batch.x, batch.labels, nn::SoftmaxCrossEntropy{}, a).loss ==
          unbound.train_step(batch.x, batch.labels, nn::SoftmaxCrossEntropy{}, b).loss);
}

TEST_CASE("DataParallel rejects bad input with a message that says what to do", "[parallel]") {
    DataParallel<Net> dp(make_net(5), 4);
    nn::Sgd sgd({.lr = 0.1});
    std::mt19937_64 gen(5);
    const auto b = make_batches(1, 3, gen)[0];
    CHECK_THROWS_WITH(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd),
                      Catch::Contains("batch of 3 cannot be split over 4 replicas; use a batch of at least 4"));
    const auto big = make_batches(1, 8, gen)[0];
    CHECK_THROWS_WITH(dp.train_step(big.x, std::vector<std::int64_t>(7, 0), nn::SoftmaxCrossEntropy{}, sgd),
                      Catch::Contains("7 labels for a batch of 8"));
    auto bad_labels = big.labels;
    bad_labels[5] = 9;
    CHECK_THROWS_WITH(dp.train_step(big.x, bad_labels, nn::SoftmaxCrossEntropy{}, sgd), Catch::Contains("label 9"));
    CHECK_THROWS_WITH(dp.train_step(Tensor<float>(Shape{8, 3, 8, 8}), big.labels, nn::SoftmaxCrossEntropy{}, sgd),
                      Catch::Contains("Conv2d(2, 4, kernel_size=3): expected input (N, 2, H, W)"));
    CHECK(std::isfinite(dp.train_step(big.x, big.labels, nn::SoftmaxCrossEntropy{}, sgd).loss));  // still usable
    CHECK_THROWS_AS(DataParallel<Net>(make_net(5), 0), InvalidArgument);
    CHECK_THROWS_AS(DataParallel<Net>(make_net(5), std::vector<Device>{Device::cuda(0)}), InvalidArgument);
}
