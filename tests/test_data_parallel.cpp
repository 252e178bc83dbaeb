// SPDX-License-Identifier: MIT
//! DataParallel and the equivalence property: K steps on any number of replicas and any split
//! equal K steps of one replica on the whole batch, and replicas stay bit-identical.
#include <catch2/catch.hpp>

#include <cblas.h>
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "golden/compare.hpp"
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
std::vector<double> flatten_state(const Net& net) {
    std::vector<double> v;
    nn::walk(
        net, [&](const std::string&, auto& p) { v.insert(v.end(), p.value.span().begin(), p.value.span().end()); },
        [&](const std::string&, auto& t) { v.insert(v.end(), t.span().begin(), t.span().end()); });
    return v;
}

bool bit_identical(const Net& a, const Net& b) {
    bool same = true;
    auto ta = flatten_state(a), tb = flatten_state(b);
    same &= ta.size() == tb.size() && std::memcmp(ta.data(), tb.data(), ta.size() * sizeof(double)) == 0;
    return same;
}

// Every parameter and buffer of a module by name, in fp64.
template <class M>
std::map<std::string, std::vector<double>> tensors_of(const M& m) {
    std::map<std::string, std::vector<double>> out;
    nn::walk(
        m, [&](const std::string& name, const auto& p) { out[name].assign(p.value.span().begin(), p.value.span().end()); },
        [&](const std::string& name, const auto& t) { out[name].assign(t.span().begin(), t.span().end()); });
    return out;
}

// Largest ||a - b|| / ||b|| over the tensors, each measured against its own norm (a wrong bias
// cannot hide under a large running_var); `worst` names the tensor. Tensors named in `exact_zero`
// are zero in exact arithmetic and are measured by ||a - b|| alone.
double per_tensor_error(const std::map<std::string, std::vector<double>>& a, const std::map<std::string, std::vector<double>>& b,
                        std::string& worst, const std::set<std::string>& exact_zero = {}) {
    double e = 0;
    for (const auto& [name, want] : b) {
        const auto& got = a.at(name);
        REQUIRE(got.size() == want.size());
        double diff = 0, norm = 0;
        for (std::size_t i = 0; i < want.size(); ++i) {
            diff += (got[i] - want[i]) * (got[i] - want[i]);
            norm += want[i] * want[i];
        }
        // A tensor that is zero in exact arithmetic is all rounding noise: measured absolutely.
        const double scale = exact_zero.count(name) != 0 ? 1.0 : std::max(std::sqrt(norm), 1e-30);
        const double rel = std::sqrt(diff) / scale;
        if (rel > e) {
            e = rel;
            worst = name;
        }
    }
    return e;
}

// Replica `rank`'s momentum buffers, in parameter order, as one flat vector.
std::vector<double> momentum_of(nn::Sgd<>& sgd, const Net& net, int rank) {
    std::vector<double> v;
    sgd.visit_state(rank, net, [&](const std::string&, const Tensor<float>& m, const nn::Parameter<>&) {
        v.insert(v.end(), m.span().begin(), m.span().end());
    });
    return v;
}

// Replica `rank`'s momentum buffers by name.
std::map<std::string, std::vector<double>> momentum_tensors_of(nn::Sgd<>& sgd, const Net& net, int rank) {
    std::map<std::string, std::vector<double>> out;
    sgd.visit_state(rank, net, [&](const std::string& name, const Tensor<float>& m, const nn::Parameter<>&) {
        out[name].assign(m.span().begin(), m.span().end());
    });
    return out;
}

struct Run {
    std::vector<double> losses;
    std::map<std::string, std::vector<double>> state, momentum;
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
    run.state = tensors_of(dp.module());
    run.momentum = momentum_tensors_of(sgd, dp.module(), 0);
    if (check_replicas)
        for (int r = 1; r < replicas; ++r) CHECK(momentum_tensors_of(sgd, dp.replica(r), r) == run.momentum);
    return run;
}

// How far the forward's discrete decisions on `x` are from a tie: the smallest |value| entering
// ReLU (on or off) and the smallest gap between the two largest positive values of a max-pool
// window (which one wins), with `net` as it stands, batch statistics as in a training step.
double decision_margin(const Net& net, const Tensor<float>& x) {
    Net probe = net;  // a deep copy: the forward below changes no state of `net`
    const nn::Context<> ctx;
    const auto h = probe.get<1>().forward(ctx, probe.get<0>().forward(ctx, Tensor<float>(x)));
    double margin = std::numeric_limits<double>::infinity();
    for (const float v : h.span()) margin = std::min(margin, std::abs(static_cast<double>(v)));
    const std::int64_t planes = h.dim(0) * h.dim(1), H = h.dim(2), W = h.dim(3);
    for (std::int64_t p = 0; p < planes; ++p)
        for (std::int64_t i = 0; i + 1 < H; i += 2)
            for (std::int64_t j = 0; j + 1 < W; j += 2) {
                std::array<float, 4> w{};
                for (int k = 0; k < 4; ++k)
                    w[static_cast<std::size_t>(k)] = std::max(0.0f, h[(p * H + i + k / 2) * W + j + k % 2]);
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
            std::string worst_state, worst_momentum;
            const double state_error = per_tensor_error(run.state, reference.state, worst_state);
            // The conv bias's gradient, and so its momentum, is zero in exact arithmetic: the batch
            // norm after the conv cancels any shift of its input.
            const double momentum_error =
                per_tensor_error(run.momentum, reference.momentum, worst_momentum, {"0.bias.momentum_buffer"});
            CAPTURE(worst_state, worst_momentum);
            CHECK(state_error <= 1e-5);  // each tensor against its own norm
            CHECK(momentum_error <= 1e-5);
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

TEST_CASE("One training step makes one all-reduce per bucket, three per SyncBatchNorm, two commit barriers", "[parallel]") {
    DataParallel<Net> dp(make_net(1), 2, {.bucket_bytes = 1});
    nn::Sgd sgd({.lr = 0.1});
    std::mt19937_64 gen(1);
    const auto b = make_batches(1, 6, gen)[0];
    const auto layer0 = dp.layer_collectives(0), grad0 = dp.gradient_collectives(0);
    dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    CHECK(dp.layer_collectives(0) - layer0 == 3);                        // SyncBatchNorm forward (2) + backward
    CHECK(dp.gradient_collectives(0) - grad0 == dp.bucket_count() + 2);  // + the barriers around the optimizer
}

namespace {
// The network with a slow first layer: its backward (the last to run) takes 100 ms more, time in
// which the buckets of the layers after it can be all-reduced.
struct SlowStart {
    using backend = Host;
    Net net;
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) { return net.forward(ctx, std::move(x)); }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
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

namespace {
// y = x * w per feature. Backward adds into the weight's gradient (in_place), or assigns the
// weight a new gradient tensor (as a user's layer may) before marking it ready (replace), or
// after (replace_late: the gradient misses the all-reduce).
enum GradWrite { in_place, replace, replace_late };
template <GradWrite Mode>
struct Scale {
    using backend = Host;
    nn::Parameter<> weight{Shape{5}};
    Tensor<float> input;
    Scale() {
        for (std::int64_t i = 0; i < 5; ++i) weight.value[i] = 0.5f + 0.25f * static_cast<float>(i);
    }
    Tensor<float> forward(const nn::Context<>&, Tensor<float> x) {
        input = x;
        for (std::int64_t r = 0; r < x.dim(0); ++r)
            for (std::int64_t i = 0; i < 5; ++i) x[r * 5 + i] *= weight.value[i];
        return x;
    }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
        Tensor<float> dx = dy;
        Tensor<float> g = weight.grad;  // an owning copy
        for (std::int64_t r = 0; r < dy.dim(0); ++r)
            for (std::int64_t i = 0; i < 5; ++i) {
                g[i] += input[r * 5 + i] * dy[r * 5 + i];
                dx[r * 5 + i] = dy[r * 5 + i] * weight.value[i];
            }
        if constexpr (Mode == replace)
            weight.grad = std::move(g);
        else
            weight.grad.copy_from(g);
        ctx.mark_grad_ready(&weight);
        // A new tensor of zeros, not a copy: reading the gradient after marking it ready would race
        // with its bucket's all-reduce on the communication thread (the misuse this mode stands for).
        if constexpr (Mode == replace_late) weight.grad = Tensor<float>(weight.grad.shape());
        return dx;
    }
    template <class V>
    void visit(V&& v) {
        v.parameter("weight", weight);
    }
};
template <GradWrite Mode>
using Scaled = nn::Sequential<nn::Flatten<>, nn::Linear<>, Scale<Mode>>;
template <GradWrite Mode>
Scaled<Mode> make_scaled() {
    nn::Generator g(4);
    return Scaled<Mode>(nn::Flatten<>(), nn::Linear<>(2 * 8 * 8, 5, true, g), Scale<Mode>());
}

// Whether `next` lies after `prev` as DataParallel lays a bucket out: at the first 64-byte
// boundary past its end (16 floats).
bool next_in_bucket(const Tensor<float>& next, const Tensor<float>& prev) {
    const auto d = next.offset_from(prev);
    return d && *d == (prev.numel() + 15) / 16 * 16;
}

// Whether every parameter of `m` has its value and gradient as views and, with `one_bucket`, each
// lies after the one before it in visit order, values and gradients alike.
template <class M>
bool laid_out_in_buckets(const M& m, bool one_bucket) {
    const nn::Parameter<>* prev = nullptr;
    bool ok = true;
    nn::for_each_parameter(m, [&](const std::string&, const nn::Parameter<>& p) {
        ok &= p.value.is_view() && p.grad.is_view();
        if (prev != nullptr && one_bucket) ok &= next_in_bucket(p.value, prev->value) && next_in_bucket(p.grad, prev->grad);
        prev = &p;
    });
    return ok;
}
}  // namespace

TEST_CASE("Gradients and values live in their buckets, and a tensor replaced from outside is put back", "[parallel]") {
    std::mt19937_64 gen(21);
    const auto batches = make_batches(3, 9, gen);
    for (const std::size_t bucket_bytes : {std::size_t{1} << 20, std::size_t{1}}) {
        CAPTURE(bucket_bytes);
        const bool one_bucket = bucket_bytes > 1;
        // A layer that assigns itself a new gradient each backward trains as one that adds in place.
        DataParallel<Scaled<replace>> replacing(make_scaled<replace>(), 2, {.bucket_bytes = bucket_bytes});
        DataParallel<Scaled<in_place>> adding(make_scaled<in_place>(), 2, {.bucket_bytes = bucket_bytes});
        CHECK(laid_out_in_buckets(replacing.replica(1), one_bucket));
        nn::Sgd a({.lr = 0.1, .momentum = 0.9}), b({.lr = 0.1, .momentum = 0.9});
        for (const auto& batch : batches) {
            CHECK(replacing.train_step(batch.x, batch.labels, nn::SoftmaxCrossEntropy{}, a).loss ==
                  adding.train_step(batch.x, batch.labels, nn::SoftmaxCrossEntropy{}, b).loss);
            CHECK(tensors_of(replacing.module()) == tensors_of(adding.module()));
            CHECK(laid_out_in_buckets(replacing.replica(0), one_bucket));
        }
        // With momentum, each bucket's buffers lie back to back (Note [momentum beside its bucket]).
        std::vector<const Tensor<float>*> buffers;
        a.visit_state(0, replacing.replica(0),
                      [&](const std::string&, const Tensor<float>& t, const nn::Parameter<>&) { buffers.push_back(&t); });
        REQUIRE(buffers.size() == 3);
        // (With a bucket per parameter, separate allocations may still happen to lie back to back,
        // as ThreadSanitizer's allocator lays them: nothing to check there.)
        if (one_bucket)
            for (std::size_t i = 1; i < buffers.size(); ++i) CHECK(next_in_bucket(*buffers[i], *buffers[i - 1]));

        // Two parameters of one shape swapped through parallel_apply: each takes the other's place.
        DataParallel<Scaled<in_place>> swapped(make_scaled<in_place>(), 2, {.bucket_bytes = bucket_bytes});
        const auto before = tensors_of(swapped.module());
        swapped.parallel_apply([](Scaled<in_place>& m, nn::Context<>&) { std::swap(m.get<1>().bias, m.get<2>().weight); });
        nn::Sgd still({.lr = 0.0});
        swapped.train_step(batches[0].x, batches[0].labels, nn::SoftmaxCrossEntropy{}, still);
        auto after = tensors_of(swapped.module());
        CHECK(after.at("1.bias") == before.at("2.weight"));
        CHECK(after.at("2.weight") == before.at("1.bias"));
        CHECK(after.at("1.weight") == before.at("1.weight"));
        CHECK(laid_out_in_buckets(swapped.replica(1), one_bucket));

        // A parameter whose size changed, and a gradient replaced after it was marked ready, fail
        // the step with a message that says what to do.
        swapped.parallel_apply([](Scaled<in_place>& m, nn::Context<>&) { m.get<2>().weight.value = Tensor<float>(Shape{6}); });
        CHECK_THROWS_WITH(swapped.train_step(batches[0].x, batches[0].labels, nn::SoftmaxCrossEntropy{}, still),
                          Catch::Contains("parameter '2.weight' holds 6 elements, but DataParallel was made with 5"));
        // (In one bucket, launched only once the Linear's gradients are in too, the late gradient
        // is still put in its place in time.)
        DataParallel<Scaled<replace_late>> late(make_scaled<replace_late>(), 2, {.bucket_bytes = bucket_bytes});
        if (one_bucket)
            CHECK_NOTHROW(late.train_step(batches[0].x, batches[0].labels, nn::SoftmaxCrossEntropy{}, still));
        else
            CHECK_THROWS_WITH(
                late.train_step(batches[0].x, batches[0].labels, nn::SoftmaxCrossEntropy{}, still),
                Catch::Contains("the gradient of parameter '2.weight' was replaced after its layer marked it ready"));

        // A value assigned through parallel_apply is what the next step starts from.
        DataParallel<Net> dp(make_net(3), 2, {.bucket_bytes = bucket_bytes}),
            twin(make_net(3), 2, {.bucket_bytes = bucket_bytes});
        dp.parallel_apply([](Net& m, nn::Context<>&) {
            auto& w = m.get<5>().weight;
            Tensor<float> halved = w.value;
            for (auto& v : halved.span()) v *= 0.5f;
            w.value = std::move(halved);
            w.grad = Tensor<float>();  // and a gradient dropped
        });
        twin.parallel_apply([](Net& m, nn::Context<>&) {
            for (auto& v : m.get<5>().weight.value.span()) v *= 0.5f;
        });
        CHECK_FALSE(dp.module().get<5>().weight.value.is_view());
        nn::Sgd c({.lr = 0.1}), d({.lr = 0.1});
        CHECK(dp.train_step(batches[0].x, batches[0].labels, nn::SoftmaxCrossEntropy{}, c).loss ==
              twin.train_step(batches[0].x, batches[0].labels, nn::SoftmaxCrossEntropy{}, d).loss);
        CHECK(tensors_of(dp.module()) == tensors_of(twin.module()));
        CHECK(laid_out_in_buckets(dp.replica(1), one_bucket));
    }
}

// An optimizer that keeps the layout DataParallel hands it.
struct LayoutRecorder {
    nn::Sgd<> sgd{{.lr = 0.1, .momentum = 0.9}};
    nn::BucketLayout seen;
    int prepared = 0;
    void prepare(int replicas, const nn::BucketLayout& layout) {
        seen = layout;
        ++prepared;
        sgd.prepare(replicas, layout);
    }
    template <class M>
    void step(const nn::Context<>& ctx, M& module) {
        sgd.step(ctx, module);
    }
    template <class M, class F>
    void visit_state(int rank, M& module, F&& f) {
        sgd.visit_state(rank, module, f);
    }
};

TEST_CASE("DataParallel hands its optimizer the bucket layout its parameters lie in", "[parallel]") {
    std::mt19937_64 gen(22);
    const auto batches = make_batches(1, 9, gen);
    for (const std::size_t bucket_bytes : {std::size_t{1} << 20, std::size_t{1}}) {
        CAPTURE(bucket_bytes);
        DataParallel<Scaled<in_place>> dp(make_scaled<in_place>(), 2, {.bucket_bytes = bucket_bytes});
        const auto& layout = dp.bucket_layout();
        std::vector<const nn::Parameter<>*> params;
        nn::for_each_parameter(dp.replica(1), [&](const std::string&, const nn::Parameter<>& p) { params.push_back(&p); });
        REQUIRE(layout.parameters() == params.size());
        CHECK(layout.buckets.size() == (bucket_bytes > 1 ? 1u : params.size()));
        CHECK(dp.bucket_count() == layout.buckets.size());
        for (const auto& b : layout.buckets) {  // each parameter where the layout says, values and gradients alike
            REQUIRE_FALSE(b.params.empty());
            const auto& first = *params[b.params[0]];
            for (std::size_t k = 0; k < b.params.size(); ++k) {
                const auto& p = *params[b.params[k]];
                CHECK(p.value.offset_from(first.value) == b.offsets[k] - b.offsets[0]);
                CHECK(p.grad.offset_from(first.grad) == b.offsets[k] - b.offsets[0]);
                CHECK(b.offsets[k] % 16 == 0);
                CHECK(b.offsets[k] + p.numel() <= b.size);
            }
        }
        LayoutRecorder opt;
        dp.train_step(batches[0].x, batches[0].labels, nn::SoftmaxCrossEntropy{}, opt);
        CHECK(opt.prepared == 1);
        CHECK(opt.seen == layout);
    }
}

TEST_CASE("DataParallel forward scatters and gathers in rank order", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    auto x = make_batches(1, 7, gen)[0].x;
    DataParallel<Net> dp(make_net(seed), 3);
    dp.eval();
    const auto y = dp.forward(x);
    Net single = make_net(seed);
    nn::Context<> ctx;
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
    const auto path =
        (std::filesystem::temp_directory_path() / ("lockstep-resume-" + std::to_string(test::unique_number()) + ".safetensors"))
            .string();
    std::vector<double> uninterrupted, resumed;
    {
        DataParallel<Net> dp(make_net(seed), 3);
        nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
        for (int s = 0; s < 5; ++s) {
            const auto& b = batches[static_cast<std::size_t>(s)];
            uninterrupted.push_back(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss);
            if (s == 1) dp.save(path, sgd);  // model and momentum buffers of replica 0
        }
    }
    {
        DataParallel<Net> dp(make_net(seed + 1), 2);  // a different start and replica count
        nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});   // told nothing about the replicas
        dp.load(path, sgd);
        for (int r = 1; r < 2; ++r) {
            CHECK(bit_identical(dp.replica(r), dp.module()));
            CHECK(momentum_of(sgd, dp.replica(r), r) == momentum_of(sgd, dp.module(), 0));
        }
        for (int s = 2; s < 5; ++s) {
            const auto& b = batches[static_cast<std::size_t>(s)];
            resumed.push_back(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd).loss);
        }
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
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) {
        if (ctx.rank == 1 && *fail == 1) throw std::runtime_error("replica 1 failed in forward");
        return net.forward(ctx, std::move(x));
    }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
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

// ---- training loops beyond one classification step ----

namespace {

using Plain = nn::Sequential<nn::Conv2d<>, nn::ReLU<>, nn::MaxPool2d<>, nn::Flatten<>, nn::Linear<>>;

Plain make_plain(std::uint64_t seed) {
    nn::Generator g(seed);
    return Plain(nn::Conv2d<>(2, 4, 3, {.padding = 1}, g), nn::ReLU<>(), nn::MaxPool2d<>(2), nn::Flatten<>(),
                 nn::Linear<>(4 * 4 * 4, 5, true, g));
}

Batch concat(const Batch& a, const Batch& b) {
    Batch u{Tensor<float>(a.x.shape().with(0, a.x.dim(0) + b.x.dim(0))), a.labels};
    std::copy(a.x.span().begin(), a.x.span().end(), u.x.span().begin());
    std::copy(b.x.span().begin(), b.x.span().end(), u.x.span().begin() + a.x.numel());
    u.labels.insert(u.labels.end(), b.labels.begin(), b.labels.end());
    return u;
}

}  // namespace

TEST_CASE("accumulate then train_step equals one step on the union, micro-batches weighted by their samples", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    for (int replicas = 1; replicas <= 3; ++replicas)
        for (const auto& [n1, n2] : {std::pair<std::int64_t, std::int64_t>{5, 8}, {9, 3}}) {
            CAPTURE(replicas, n1, n2);
            const auto b1 = make_batches(1, n1, gen)[0], b2 = make_batches(1, n2, gen)[0], next = make_batches(1, 7, gen)[0];
            DataParallel<Plain> split(make_plain(seed), replicas), whole(make_plain(seed), replicas);
            nn::Sgd sgd_split({.lr = 0.05, .momentum = 0.9}), sgd_whole({.lr = 0.05, .momentum = 0.9});
            const auto grad0 = split.gradient_collectives(0), layer0 = split.layer_collectives(0);
            split.accumulate(b1.x, b1.labels, nn::SoftmaxCrossEntropy{});
            CHECK(split.gradient_collectives(0) == grad0);  // no gradient collective in accumulate
            CHECK(split.layer_collectives(0) == layer0);
            CHECK(split.accumulated_samples() == n1);
            const auto a = split.train_step(b2.x, b2.labels, nn::SoftmaxCrossEntropy{}, sgd_split);
            CHECK(split.accumulated_samples() == 0);
            const auto u = concat(b1, b2);
            const auto b = whole.train_step(u.x, u.labels, nn::SoftmaxCrossEntropy{}, sgd_whole);
            CHECK(a.count == n1 + n2);
            CHECK(a.correct == b.correct);
            CHECK(a.loss == Approx(b.loss).epsilon(1e-5));
            std::string worst;
            const double error = per_tensor_error(tensors_of(split.module()), tensors_of(whole.module()), worst);
            CAPTURE(worst);
            CHECK(error <= 1e-5);
            // The next step starts afresh on both.
            CHECK(split.train_step(next.x, next.labels, nn::SoftmaxCrossEntropy{}, sgd_split).loss ==
                  Approx(whole.train_step(next.x, next.labels, nn::SoftmaxCrossEntropy{}, sgd_whole).loss).epsilon(1e-5));
            CHECK(per_tensor_error(tensors_of(split.module()), tensors_of(whole.module()), worst) <= 1e-5);
        }
}

TEST_CASE("accumulate still runs the layers' collectives, and refuses eval mode", "[parallel]") {
    DataParallel<Net> dp(make_net(2), 2);
    std::mt19937_64 gen(2);
    const auto b = make_batches(1, 6, gen)[0];
    const auto layer0 = dp.layer_collectives(1), grad0 = dp.gradient_collectives(1);
    dp.accumulate(b.x, b.labels, nn::SoftmaxCrossEntropy{});
    CHECK(dp.layer_collectives(1) - layer0 == 3);  // SyncBatchNorm forward (2) + backward
    CHECK(dp.gradient_collectives(1) == grad0);
    nn::Sgd sgd({.lr = 0.1});
    const auto r = dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
    CHECK(r.count == 12);
    CHECK(dp.gradient_collectives(1) - grad0 == dp.bucket_count() + 2);  // once, for both micro-batches
    dp.eval();
    CHECK_THROWS_WITH(dp.accumulate(b.x, b.labels, nn::SoftmaxCrossEntropy{}), Catch::Contains("call train() first"));
    CHECK_THROWS_AS(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd), UsageError);
}

TEST_CASE("Regression with MseLoss: any replica count equals one replica, targets sharded with the batch", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    using Reg = nn::Sequential<nn::Linear<>, nn::ReLU<>, nn::Linear<>>;
    const auto make_reg = [&] {
        nn::Generator g(seed);
        return Reg(nn::Linear<>(4, 16, true, g), nn::ReLU<>(), nn::Linear<>(16, 2, true, g));
    };
    std::normal_distribution<float> d;
    std::vector<Tensor<float>> xs, ts;
    for (int s = 0; s < 4; ++s) {
        xs.emplace_back(Shape{11, 4});
        ts.emplace_back(Shape{11, 2});
        for (auto& v : xs.back().span()) v = d(gen);
        for (std::int64_t n = 0; n < 11; ++n) {  // t = (x0 + x1, x2 * x3)
            ts.back()[n * 2] = xs.back()[n * 4] + xs.back()[n * 4 + 1];
            ts.back()[n * 2 + 1] = xs.back()[n * 4 + 2] * xs.back()[n * 4 + 3];
        }
    }
    std::vector<double> one_losses;
    std::map<std::string, std::vector<double>> one_state;
    for (int replicas = 1; replicas <= 3; ++replicas) {
        CAPTURE(replicas);
        DataParallel dp(make_reg(), replicas);
        nn::Sgd sgd({.lr = 0.05, .momentum = 0.5});
        std::vector<double> losses;
        for (int s = 0; s < 4; ++s) {
            const auto r = dp.train_step(xs[static_cast<std::size_t>(s)], ts[static_cast<std::size_t>(s)], nn::MseLoss{}, sgd);
            CHECK(r.count == 11);
            CHECK(r.correct == 0);
            losses.push_back(r.loss);
        }
        if (replicas == 1) {
            // The first step's loss is torch.nn.MSELoss()(net(x), t), computed here in fp64.
            Reg ref = make_reg();
            nn::Context<> ctx;
            const auto y = ref.forward(ctx, xs[0]);
            double sq = 0;
            for (std::int64_t i = 0; i < y.numel(); ++i) sq += std::pow(static_cast<double>(y[i]) - ts[0][i], 2);
            CHECK(losses[0] == Approx(sq / static_cast<double>(y.numel())).epsilon(1e-6));
            one_losses = losses;
            one_state = tensors_of(dp.module());
        } else {
            CHECK(test::rel_error(losses, one_losses) <= 1e-5);
            std::string worst;
            const double error = per_tensor_error(tensors_of(dp.module()), one_state, worst);
            CAPTURE(worst);
            CHECK(error <= 1e-5);
        }
        CHECK_THROWS_WITH(dp.train_step(xs[0], Tensor<float>(Shape{10, 2}), nn::MseLoss{}, sgd),
                          Catch::Contains("train_step: 10 target rows for a batch of 11"));
        CHECK_THROWS_WITH(
            dp.train_step(xs[0], Tensor<float>(Shape{11, 3}), nn::MseLoss{}, sgd),
            Catch::Contains("MseLoss: targets of shape (") && Catch::Contains(", 3) NCHW for an output of shape ("));
    }
}

TEST_CASE("clip_grad_norm scales the all-reduced gradients as torch.nn.utils.clip_grad_norm_", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const auto b = make_batches(1, 9, gen)[0];
    // lr 0: the step leaves the parameters alone and the gradients in place to be read.
    const auto grads_after_step = [&](std::optional<double> clip, int replicas) {
        DataParallel<Net> dp(make_net(seed), replicas, {.clip_grad_norm = clip});
        nn::Sgd sgd({.lr = 0.0});
        dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
        std::vector<double> g;
        for (int r = 0; r < replicas; ++r) {
            std::vector<double> mine;
            nn::for_each_parameter(dp.replica(r), [&](const std::string&, const nn::Parameter<>& p) {
                mine.insert(mine.end(), p.grad.span().begin(), p.grad.span().end());
            });
            if (r == 0)
                g = mine;
            else
                CHECK(mine == g);  // the same bits on every replica
        }
        return g;
    };
    const auto raw = grads_after_step(std::nullopt, 3);
    double norm = 0;
    for (const double v : raw) norm += v * v;
    norm = std::sqrt(norm);
    REQUIRE(norm > 0);
    for (const double max_norm : {0.25 * norm, 0.9 * norm}) {
        CAPTURE(max_norm);
        const auto clipped = grads_after_step(max_norm, 3);
        std::vector<double> expect(raw);
        for (auto& v : expect) v *= max_norm / (norm + 1e-6);
        CHECK(test::rel_error(clipped, expect) <= 1e-6);
    }
    CHECK(grads_after_step(2.0 * norm, 3) == raw);  // below the bound: untouched, bit for bit
    CHECK_THROWS_WITH(DataParallel<Net>(make_net(seed), 2, {.clip_grad_norm = 0.0}),
                      Catch::Contains("clip_grad_norm must be positive"));
    CHECK_THROWS_AS(DataParallel<Net>(make_net(seed), 2, {.clip_grad_norm = -1.0}), InvalidArgument);
}

// Note [math modes]: the host backend has no TF32 arithmetic; every mode trains in strict fp32,
// bit for bit alike, and a value that is no lockstep::Math is refused.
TEST_CASE("Every math mode trains alike on the host, in strict fp32", "[parallel]") {
    const auto params_after = [](Math math) {
        DataParallel<Net> dp(make_net(5), 2, {.math = math});
        CHECK(dp.options().math == math);
        nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
        std::mt19937_64 gen(5);
        for (const auto& b : make_batches(3, 10, gen)) dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);
        std::vector<float> v;
        nn::for_each_parameter(dp.replica(0), [&](const std::string&, const nn::Parameter<>& p) {
            v.insert(v.end(), p.value.data(), p.value.data() + p.value.numel());
        });
        return v;
    };
    const auto strict = params_after(Math::strict_fp32);
    CHECK(params_after(Math::pytorch_default) == strict);
    CHECK(params_after(Math::tf32) == strict);
    CHECK(DataParallelOptions{}.math == Math::pytorch_default);  // PyTorch's defaults unless asked
    CHECK_THROWS_WITH(DataParallel<Net>(make_net(5), 2, {.math = static_cast<Math>(7)}),
                      Catch::Contains("DataParallelOptions::math is not a lockstep::Math (7)"));
}

// Issue 27: captured steps are CUDA graphs; the host backend refuses them by name rather than
// running eagerly under an option that promises otherwise (Note [captured steps]).
TEST_CASE("DataParallelOptions::graphs is refused on the host backend, naming it", "[parallel]") {
    DataParallelOptions o;
    o.graphs = true;
    CHECK_THROWS_AS(DataParallel<Net>(make_net(5), 2, o), UsageError);
    CHECK_THROWS_WITH(DataParallel<Net>(make_net(5), 2, o), Catch::Contains("DataParallelOptions::graphs"));
    DataParallel<Net> dp(make_net(5), 2);
    CHECK(dp.captured_graphs(0) == 0);
    CHECK(dp.graph_launches(1) == 0);
}

// Issue 27: bf16 products are CUDA's (Note [precision]); the host backend refuses them by name
// rather than training in fp32 under an option that promises bf16 rounding.
TEST_CASE("bf16 products and bf16 gradient all-reduces are refused on the host backend, naming the option", "[parallel]") {
    CHECK(DataParallelOptions{}.precision == Precision::fp32);
    CHECK_THROWS_AS(DataParallel<Net>(make_net(5), 2, {.precision = Precision::bf16}), UsageError);
    CHECK_THROWS_WITH(DataParallel<Net>(make_net(5), 2, {.precision = Precision::bf16}),
                      Catch::Contains("DataParallelOptions::precision = bf16: the host backend has no bf16 products"));
    CHECK_THROWS_WITH(DataParallel<Net>(make_net(5), 2, {.precision = static_cast<Precision>(5)}),
                      Catch::Contains("DataParallelOptions::precision is not a lockstep::Precision (5)"));
    CHECK_NOTHROW(DataParallel<Net>(make_net(5), 2, {.precision = Precision::fp32}));
    CHECK(DataParallelOptions{}.gradient_precision == Precision::fp32);
    CHECK_THROWS_WITH(DataParallel<Net>(make_net(5), 2, {.gradient_precision = Precision::bf16}),
                      Catch::Contains("DataParallelOptions::gradient_precision = bf16: the host backend has no bf16 all-reduce"));
    CHECK_THROWS_WITH(DataParallel<Net>(make_net(5), 2, {.gradient_precision = static_cast<Precision>(9)}),
                      Catch::Contains("DataParallelOptions::gradient_precision is not a lockstep::Precision (9)"));
}

TEST_CASE("A step that fails in backward changes no replica's parameters or optimizer state", "[parallel]") {
    Faulty proto{make_net(4)};
    DataParallel<Faulty> dp(proto, 3, {.timeout = 60s});
    nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
    std::mt19937_64 gen(4);
    const auto b = make_batches(1, 9, gen)[0];
    dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd);  // momentum buffers exist
    const auto params_of = [&](int r) {
        std::vector<double> v;
        nn::for_each_parameter(dp.replica(r), [&](const std::string&, const nn::Parameter<>& p) {
            v.insert(v.end(), p.value.span().begin(), p.value.span().end());
        });
        return v;
    };
    const auto momentum = [&](int r) {
        std::vector<double> v;
        sgd.visit_state(r, dp.replica(r), [&](const std::string&, const Tensor<float>& m, const nn::Parameter<>&) {
            v.insert(v.end(), m.span().begin(), m.span().end());
        });
        return v;
    };
    std::vector<std::vector<double>> before_params, before_momentum;
    for (int r = 0; r < 3; ++r) {
        before_params.push_back(params_of(r));
        before_momentum.push_back(momentum(r));
    }
    *dp.replica(0).fail = 2;  // replica 1 throws in backward, with gradient buckets in flight
    CHECK_THROWS_WITH(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, sgd), Catch::Contains("replica 1 failed"));
    for (int r = 0; r < 3; ++r) {
        CHECK(std::memcmp(params_of(r).data(), before_params[static_cast<std::size_t>(r)].data(),
                          before_params[0].size() * sizeof(double)) == 0);
        CHECK(momentum(r) == before_momentum[static_cast<std::size_t>(r)]);
    }
    // The forward collectives completed everywhere, so the running statistics moved alike.
    std::map<std::string, std::vector<double>> buffers0;
    nn::for_each_buffer(dp.replica(0),
                        [&](const std::string& n, const auto& t) { buffers0[n].assign(t.span().begin(), t.span().end()); });
    for (int r = 1; r < 3; ++r)
        nn::for_each_buffer(dp.replica(r), [&](const std::string& n, const auto& t) {
            CHECK(std::vector<double>(t.span().begin(), t.span().end()) == buffers0.at(n));
        });
    *dp.replica(0).fail = 0;
}

namespace {

// fp64 batch norm of a whole batch followed by the MSE against `t`, PyTorch semantics; x and t in
// logical (N, C, P) order.
struct BnStep {
    double loss = 0;
    std::vector<double> y, mean, var, dgamma, dbeta;
};

BnStep bn_mse_reference(const std::vector<double>& x, const std::vector<double>& t, const std::vector<double>& gamma,
                        const std::vector<double>& beta, std::int64_t N, std::int64_t C, std::int64_t P, double eps,
                        const std::vector<double>* running_mean = nullptr, const std::vector<double>* running_var = nullptr) {
    BnStep r;
    const auto at = [&](std::int64_t n, std::int64_t c, std::int64_t p) { return static_cast<std::size_t>((n * C + c) * P + p); };
    const double M = static_cast<double>(N * P), D = static_cast<double>(C * P);
    r.y.resize(x.size());
    r.mean.assign(static_cast<std::size_t>(C), 0);
    r.var.assign(static_cast<std::size_t>(C), 0);
    r.dgamma.assign(static_cast<std::size_t>(C), 0);
    r.dbeta.assign(static_cast<std::size_t>(C), 0);
    for (std::int64_t c = 0; c < C; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        double mean = 0, var = 0;
        if (running_mean != nullptr) {
            mean = (*running_mean)[uc];
            var = (*running_var)[uc];
        } else {
            for (std::int64_t n = 0; n < N; ++n)
                for (std::int64_t p = 0; p < P; ++p) mean += x[at(n, c, p)] / M;
            for (std::int64_t n = 0; n < N; ++n)
                for (std::int64_t p = 0; p < P; ++p) var += (x[at(n, c, p)] - mean) * (x[at(n, c, p)] - mean) / M;
        }
        r.mean[uc] = mean;
        r.var[uc] = var;
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t p = 0; p < P; ++p) {
                const double xh = (x[at(n, c, p)] - mean) / std::sqrt(var + eps);
                const double y = xh * gamma[uc] + beta[uc];
                r.y[at(n, c, p)] = y;
                const double diff = y - t[at(n, c, p)];
                r.loss += diff * diff / D / static_cast<double>(N);
                const double dy = 2.0 * diff / D / static_cast<double>(N);
                r.dgamma[uc] += dy * xh;
                r.dbeta[uc] += dy;
            }
    }
    return r;
}

}  // namespace

TEST_CASE("SyncBatchNorm options through DataParallel match an fp64 batch norm of the whole batch", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    struct Case {
        const char* name;
        nn::BatchNormOptions options;
    };
    const Case cases[] = {
        {"NHWC", {.format = MemoryFormat::nhwc}},
        {"affine = false", {.affine = false}},
        {"track_running_stats = false", {.track_running_stats = false, .format = MemoryFormat::nhwc}},
        {"momentum = nullopt (cumulative average)", {.momentum = std::nullopt}},
    };
    const std::int64_t N = 7, C = 3, H = 2, W = 3, P = H * W;
    const double lr = 0.1;
    for (const auto& c : cases) {
        for (int replicas = 1; replicas <= 3; ++replicas) {
            CAPTURE(c.name, replicas);
            const auto& o = c.options;
            using BnNet = nn::Sequential<nn::SyncBatchNorm<>>;
            nn::SyncBatchNorm<> bn(C, o);
            if (o.affine)
                for (std::int64_t k = 0; k < C; ++k) {
                    bn.weight.value[k] = 1.0f + 0.25f * static_cast<float>(k);
                    bn.bias.value[k] = -0.5f + 0.5f * static_cast<float>(k);
                }
            DataParallel dp(BnNet(bn), replicas);
            nn::Sgd sgd({.lr = lr});
            std::vector<double> gamma(C, 1.0), beta(C, 0.0), rmean(C, 0.0), rvar(C, 1.0);
            for (std::int64_t k = 0; k < C && o.affine; ++k) {
                gamma[static_cast<std::size_t>(k)] = 1.0 + 0.25 * static_cast<double>(k);
                beta[static_cast<std::size_t>(k)] = -0.5 + 0.5 * static_cast<double>(k);
            }
            std::vector<double> x, t;
            for (int step = 1; step <= 2; ++step) {
                std::normal_distribution<double> dx(3.0 * step, 2.0), dt(0.0, 1.0);
                x.resize(static_cast<std::size_t>(N * C * P));
                t.resize(x.size());
                Tensor<float> xt(Shape{N, C, H, W}, o.format), tt(Shape{N, C, H, W}, o.format);
                for (std::int64_t n = 0; n < N; ++n)
                    for (std::int64_t k = 0; k < C; ++k)
                        for (std::int64_t p = 0; p < P; ++p) {
                            const auto i = static_cast<std::size_t>((n * C + k) * P + p);
                            x[i] = static_cast<float>(dx(gen));
                            t[i] = static_cast<float>(dt(gen));
                            xt[test::offset(n, k, p, C, P, o.format)] = static_cast<float>(x[i]);
                            tt[test::offset(n, k, p, C, P, o.format)] = static_cast<float>(t[i]);
                        }
                const auto ref = bn_mse_reference(x, t, gamma, beta, N, C, P, o.eps);
                const auto result = dp.train_step(xt, tt, nn::MseLoss{}, sgd);
                CHECK(result.loss == Approx(ref.loss).epsilon(1e-5));
                for (std::size_t k = 0; k < static_cast<std::size_t>(C); ++k) {
                    if (o.affine) {
                        gamma[k] -= lr * ref.dgamma[k];
                        beta[k] -= lr * ref.dbeta[k];
                    }
                    const double f = o.momentum ? *o.momentum : 1.0 / step;
                    rmean[k] = (1 - f) * rmean[k] + f * ref.mean[k];
                    rvar[k] = (1 - f) * rvar[k] + f * ref.var[k] * static_cast<double>(N * P) / static_cast<double>(N * P - 1);
                }
                for (int r = 0; r < replicas; ++r) {
                    const auto& layer = dp.replica(r).get<0>();
                    if (o.affine) {
                        CHECK(test::rel_error(layer.weight.value.span(), gamma) <= 1e-5);
                        CHECK(test::rel_error(layer.bias.value.span(), beta, 1.0) <= 1e-5);
                    }
                    if (o.track_running_stats) {
                        CHECK(test::rel_error(layer.running_mean.span(), rmean) <= 1e-5);
                        CHECK(test::rel_error(layer.running_var.span(), rvar) <= 1e-5);
                        CHECK(layer.num_batches_tracked[0] == step);
                    }
                }
            }
            // Eval: running statistics where tracked, the batch's own otherwise.
            dp.eval();
            Tensor<float> xt(Shape{N, C, H, W}, o.format);
            for (std::int64_t n = 0; n < N; ++n)
                for (std::int64_t k = 0; k < C; ++k)
                    for (std::int64_t p = 0; p < P; ++p)
                        xt[test::offset(n, k, p, C, P, o.format)] =
                            static_cast<float>(x[static_cast<std::size_t>((n * C + k) * P + p)]);
            const auto y = dp.forward(xt);
            const auto ref = o.track_running_stats ? bn_mse_reference(x, t, gamma, beta, N, C, P, o.eps, &rmean, &rvar)
                                                   : bn_mse_reference(x, t, gamma, beta, N, C, P, o.eps);
            std::vector<double> got(ref.y.size());
            for (std::int64_t n = 0; n < N; ++n)
                for (std::int64_t k = 0; k < C; ++k)
                    for (std::int64_t p = 0; p < P; ++p)
                        got[static_cast<std::size_t>((n * C + k) * P + p)] = y[test::offset(n, k, p, C, P, o.format)];
            CHECK(test::rel_error(got, ref.y) <= 1e-5);
        }
    }
}

TEST_CASE("DataParallel loads only a checkpoint of its own model, and the failed load changes nothing",
          "[parallel][checkpoint]") {
    const auto dir = std::filesystem::temp_directory_path() / ("lockstep-dp-" + std::to_string(test::unique_number()));
    std::filesystem::create_directories(dir);
    const std::string other = (dir / "other.safetensors").string();
    DataParallel<Plain> plain(make_plain(1), 2);
    nn::Sgd plain_sgd({.lr = 0.1, .momentum = 0.9});
    plain.save(other, plain_sgd);
    DataParallel<Net> dp(make_net(1), 2);
    nn::Sgd sgd({.lr = 0.1, .momentum = 0.9});
    const auto before = tensors_of(dp.module());
    CHECK_THROWS_WITH(dp.load(other, sgd), Catch::Contains("checkpoint '" + other + "'") && Catch::Contains("tensor '1."));
    CHECK(tensors_of(dp.module()) == before);
    CHECK(tensors_of(dp.replica(1)) == before);
    // Optimizer state of a parameter the model lacks is refused too.
    auto ck = dp.checkpoint(sgd);
    ck.put("optimizer.9.weight.momentum_buffer", Tensor<float>(Shape{2}));
    CHECK_THROWS_WITH(dp.load(ck, sgd), Catch::Contains("optimizer state 'optimizer.9.weight.momentum_buffer'"));
    std::filesystem::remove_all(dir);
}

TEST_CASE("OpenBLAS runs one thread while a DataParallel exists and gets its setting back after", "[parallel]") {
    const int before = openblas_get_num_threads();
    {
        DataParallel<Net> a(make_net(1), 2);
        CHECK(openblas_get_num_threads() == 1);
        {
            DataParallel<Net> b(make_net(1), 1);
            CHECK(openblas_get_num_threads() == 1);
        }
        CHECK(openblas_get_num_threads() == 1);  // `a` still exists
    }
    CHECK(openblas_get_num_threads() == before);
}

// ---- a reference produced by PyTorch: tests/golden/make_golden.py ----

TEST_CASE("Three SGD steps on 1 and 2 replicas match PyTorch's losses, parameters and momentum", "[parallel][golden]") {
    const auto golden = nn::Checkpoint::load(LOCKSTEP_GOLDEN_DIR "/tiny_net.safetensors");
    const auto want_losses = nlohmann::json::parse(golden.metadata.at("losses")).get<std::vector<double>>();
    REQUIRE(want_losses.size() == 3);
    using Tiny = nn::Sequential<nn::Conv2d<>, nn::SyncBatchNorm<>, nn::ReLU<>, nn::MaxPool2d<>, nn::Flatten<>, nn::Linear<>>;
    for (int replicas = 1; replicas <= 2; ++replicas) {  // 7 samples: shards of 4 and 3
        CAPTURE(replicas);
        nn::Generator g(0);
        Tiny net(nn::Conv2d<>(2, 3, 3, {.padding = 1}, g), nn::SyncBatchNorm<>(3), nn::ReLU<>(), nn::MaxPool2d<>(2),
                 nn::Flatten<>(), nn::Linear<>(12, 4, true, g));
        nn::get_module(golden, net, "init");  // PyTorch's initial values, stored as "init.<name>"
        DataParallel dp(net, replicas);
        nn::Sgd sgd({.lr = 0.1, .momentum = 0.9});
        for (int k = 0; k < 3; ++k) {
            Tensor<float> x(Shape{7, 2, 4, 4});
            Tensor<std::int64_t> labels(Shape{7});
            golden.get("data.x." + std::to_string(k), x);
            golden.get("data.labels." + std::to_string(k), labels);
            const auto r = dp.train_step(x, labels.span(), nn::SoftmaxCrossEntropy{}, sgd);
            CHECK(r.loss == Approx(want_losses[static_cast<std::size_t>(k)]).epsilon(1e-4));
        }
        const auto ours = dp.checkpoint(sgd);
        int compared = 0;
        for (const auto& name : ours.names()) {
            CAPTURE(name);
            const auto& mine = ours.at(name);
            const auto& theirs = golden.at("final." + name);
            REQUIRE(mine.dtype == theirs.dtype);
            REQUIRE(mine.data.size() == theirs.data.size());
            const auto d = golden::distance(mine, theirs);
            CAPTURE(d.diff, d.norm);
            CHECK(d.close());
            ++compared;
        }
        CHECK(compared == 9 + 6);  // 9 state_dict entries, 6 momentum buffers
    }
}

namespace {
// Batch norm over every time step of a sequence: (N, T*C) is seen by SyncBatchNorm as (N*T, C),
// so the layer's rows are not the samples DataParallel counts.
struct PerStep {
    using backend = Host;
    static constexpr std::int64_t T = 4, C = 3;
    nn::SyncBatchNorm<> bn{C};
    Tensor<float> forward(const nn::Context<>& ctx, Tensor<float> x) {
        const std::int64_t n = x.dim(0);
        return bn.forward(ctx, std::move(x).reshaped(Shape{n * T, C})).reshaped(Shape{n, T * C});
    }
    Tensor<float> backward(const nn::Context<>& ctx, const Tensor<float>& dy) {
        const std::int64_t n = dy.dim(0);
        return bn.backward(ctx, Tensor<float>(dy).reshaped(Shape{n * T, C})).reshaped(Shape{n, T * C});
    }
    template <class V>
    void visit(V&& v) {
        v.module("bn", bn);
    }
};
}  // namespace

TEST_CASE("SyncBatchNorm counts the values it normalizes, not the samples of the batch", "[parallel]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 gen(seed);
    const std::int64_t N = 5, T = PerStep::T, C = PerStep::C;
    std::normal_distribution<double> d(2.0, 1.5);
    std::vector<double> x(static_cast<std::size_t>(N * T * C)), t(x.size());
    Tensor<float> xt(Shape{N, T * C}), tt(Shape{N, T * C});
    for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = static_cast<float>(d(gen));
        t[i] = static_cast<float>(d(gen));
        xt[static_cast<std::int64_t>(i)] = static_cast<float>(x[i]);
        tt[static_cast<std::int64_t>(i)] = static_cast<float>(t[i]);
    }
    // (N, T*C) in memory is (N*T, C) with one value per row and channel: P = 1.
    const auto ref = bn_mse_reference(x, t, std::vector<double>(C, 1.0), std::vector<double>(C, 0.0), N * T, C, 1, 1e-5);
    for (int replicas = 1; replicas <= 2; ++replicas) {
        CAPTURE(replicas);
        DataParallel dp(PerStep{}, replicas);
        nn::Sgd sgd({.lr = 0.0});
        CHECK(dp.train_step(xt, tt, nn::MseLoss{}, sgd).loss == Approx(ref.loss).epsilon(1e-6));
        const double M = static_cast<double>(N * T);
        for (std::size_t c = 0; c < static_cast<std::size_t>(C); ++c) {
            CHECK(dp.module().bn.running_mean[static_cast<std::int64_t>(c)] == Approx(0.1 * ref.mean[c]).epsilon(1e-6));
            CHECK(dp.module().bn.running_var[static_cast<std::int64_t>(c)] ==
                  Approx(0.9 + 0.1 * ref.var[c] * M / (M - 1)).epsilon(1e-6));
            CHECK(dp.module().bn.weight.grad[static_cast<std::int64_t>(c)] == Approx(ref.dgamma[c]).margin(1e-6));
        }
    }
}

// ---- steps that must not be applied, and replicas that must be made equal again ----

namespace {
// A loss that gives a NaN gradient on demand, with a finite loss value.
struct PoisonedLoss {
    bool poison = false;
    nn::LossOutput<> operator()(const nn::Context<>& ctx, const Tensor<float>& out, std::span<const std::int64_t> labels) const {
        auto res = nn::SoftmaxCrossEntropy{}(ctx, out, labels);
        if (poison && ctx.rank == 1) res.grad[0] = std::numeric_limits<float>::quiet_NaN();
        return res;
    }
};

// An optimizer whose step throws on replica 1 on demand, after the commit point.
struct FlakyOptimizer {
    nn::Sgd<> sgd{{.lr = 0.05, .momentum = 0.9}};
    bool fail = false;
    void prepare(int replicas, const nn::BucketLayout& layout) { sgd.prepare(replicas, layout); }
    template <class M>
    void step(const nn::Context<>& ctx, M& module) {
        if (fail && ctx.rank == 1) throw std::runtime_error("optimizer of replica 1 failed");
        sgd.step(ctx, module);
    }
    template <class M, class F>
    void visit_state(int rank, M& module, F&& f) {
        sgd.visit_state(rank, module, f);
    }
};

std::vector<double> parameters_of(const Net& net) {
    std::vector<double> v;
    nn::for_each_parameter(net, [&](const std::string&, const nn::Parameter<>& p) {
        v.insert(v.end(), p.value.span().begin(), p.value.span().end());
    });
    return v;
}
}  // namespace

TEST_CASE("check_finite: a step with a NaN gradient or loss is refused on every replica, naming it", "[parallel]") {
    DataParallel<Net> dp(make_net(6), 3, {.check_finite = true});
    nn::Sgd sgd({.lr = 0.05, .momentum = 0.9});
    std::mt19937_64 gen(6);
    const auto b = make_batches(1, 9, gen)[0];
    PoisonedLoss loss;
    dp.train_step(b.x, b.labels, loss, sgd);
    const auto before = parameters_of(dp.module());
    loss.poison = true;
    CHECK_THROWS_AS(dp.train_step(b.x, b.labels, loss, sgd), NonFinite);
    CHECK_THROWS_WITH(dp.train_step(b.x, b.labels, loss, sgd),
                      Catch::Contains("step 2: the all-reduced gradient of '") && Catch::Contains("no replica applied the step"));
    for (int r = 0; r < 3; ++r) CHECK(parameters_of(dp.replica(r)) == before);
    CHECK(dp.steps() == 1);
    auto nan_input = b.x;
    nan_input[5] = std::numeric_limits<float>::quiet_NaN();
    loss.poison = false;
    CHECK_THROWS_WITH(dp.train_step(nan_input, b.labels, loss, sgd), Catch::Contains("step 2: the loss over replica"));
    for (int r = 0; r < 3; ++r) CHECK(parameters_of(dp.replica(r)) == before);
    CHECK(std::isfinite(dp.train_step(b.x, b.labels, loss, sgd).loss));  // and it goes on
    CHECK(dp.steps() == 2);
    // Off (the default), the same step goes through and poisons the parameters.
    DataParallel<Net> unchecked(make_net(6), 3);
    loss.poison = true;
    unchecked.train_step(b.x, b.labels, loss, sgd);
    const auto p = parameters_of(unchecked.module());
    CHECK(std::any_of(p.begin(), p.end(), [](double v) { return !std::isfinite(v); }));
}

TEST_CASE("A failure after the commit point marks DataParallel diverged until resync", "[parallel]") {
    DataParallel<Net> dp(make_net(8), 3, {.timeout = 60s});
    FlakyOptimizer opt;
    std::mt19937_64 gen(8);
    const auto b = make_batches(1, 9, gen)[0];
    dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, opt);
    opt.fail = true;
    CHECK_THROWS_WITH(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, opt),
                      Catch::Contains("optimizer of replica 1 failed"));
    CHECK(dp.diverged());
    CHECK_FALSE(bit_identical(dp.replica(0), dp.replica(1)));  // replica 1 did not step, 0 and 2 did
    opt.fail = false;
    CHECK_THROWS_WITH(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, opt),
                      Catch::Contains("the replicas may differ since step 2 failed after its commit point") &&
                          Catch::Contains("call resync(optimizer) to copy replica 0"));
    CHECK_THROWS_AS(dp.forward(b.x), Diverged);
    CHECK_THROWS_AS(dp.checkpoint(), Diverged);
    dp.resync(opt);
    CHECK_FALSE(dp.diverged());
    for (int r = 1; r < 3; ++r) {
        CHECK(bit_identical(dp.replica(0), dp.replica(r)));
        CHECK(momentum_of(opt.sgd, dp.replica(r), r) == momentum_of(opt.sgd, dp.module(), 0));
    }
    CHECK(std::isfinite(dp.train_step(b.x, b.labels, nn::SoftmaxCrossEntropy{}, opt).loss));
    for (int r = 1; r < 3; ++r) CHECK(bit_identical(dp.replica(0), dp.replica(r)));
}
