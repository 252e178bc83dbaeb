// SPDX-License-Identifier: MIT
// lockstep for libtorch (issue #44): SyncBatchNorm against PyTorch's BatchNorm in fp64, the
// equivalence of DataParallel's steps with the plain module's on the whole batch, its failures,
// convert_sync_batchnorm and checkpoints.
#include <unistd.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../stream_group_double.hpp"
#include "torch_models.hpp"

// libtorch's headers define a glog-style CHECK (c10/util/logging_is_not_google_glog.h) that logs
// and goes on: Catch's must be the one these tests use.
#undef CHECK
#include <catch2/catch.hpp>

namespace models = lockstep_test_torch;
using lockstep_test_torch::images;
using lockstep_test_torch::labels;
namespace lt = lockstep::torch;
using lockstep_test_torch::ResNet;

namespace {

ResNet fresh_model(std::uint64_t seed = 7) {
    ::torch::manual_seed(seed);
    return ResNet(6);
}

// K steps of the plain module on the whole batch, as PyTorch trains it in one process.
void reference_steps(ResNet& model, ::torch::optim::Optimizer& opt, int steps, std::int64_t batch) {
    model->train();
    for (int k = 0; k < steps; ++k) {
        opt.zero_grad();
        auto loss = models::cross_entropy(model->forward(images(batch, 100 + k)), labels(batch, 100 + k));
        loss.backward();
        opt.step();
    }
}

}  // namespace

TEST_CASE("torch SyncBatchNorm alone equals PyTorch's BatchNorm in fp64: output, gradients, running statistics", "[torch]") {
    // Every path of the backward: one pass for contiguous and channels-last inputs (rows of
    // positions, or the channel innermost as at rank 2), libtorch's generic ops for a strided view
    // (CUDA's path) and for bf16, whose statistics and coefficients are fp32, with fp32 parameters
    // (mixed precision) or bf16 ones (a model converted whole).
    enum class Layout { contiguous, channels_last, strided };
    for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16})
        for (const bool bf16_parameters : {false, true})
            for (const int rank : {2, 3, 4, 5})
                for (const auto layout : {Layout::contiguous, Layout::channels_last, Layout::strided}) {
                    if (layout == Layout::channels_last && rank < 4) continue;
                    if (bf16_parameters && dtype != at::kBFloat16) continue;
                    std::vector<std::int64_t> shape{6, 3};
                    for (int d = 2; d < rank; ++d) shape.push_back(7 - d);
                    ::torch::manual_seed(rank);
                    // A mean far from zero: the statistics must not lose it (Note [libtorch SyncBatchNorm]).
                    auto x = (::torch::randn(shape) * 3.0 + 40.0).to(dtype);
                    auto dy = ::torch::randn(shape).to(dtype);
                    if (layout == Layout::channels_last) {
                        const auto format = rank == 5 ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::ChannelsLast;
                        x = x.contiguous(format);
                        dy = dy.contiguous(format);
                    }
                    if (layout == Layout::strided) {  // every other sample of a batch twice as big
                        x = at::repeat_interleave(x, 2, 0).slice(0, 0, 12, 2);
                        dy = at::repeat_interleave(dy, 2, 0).slice(0, 0, 12, 2);
                        REQUIRE(!x.is_contiguous());
                    }
                    lt::SyncBatchNorm sync(::torch::nn::BatchNormOptions(3).momentum(0.3));
                    ::torch::nn::BatchNorm2d ref(::torch::nn::BatchNormOptions(3).momentum(0.3));
                    {
                        ::torch::NoGradGuard g;
                        sync->weight.copy_(::torch::tensor({0.5f, 1.5f, -2.0f}));
                        sync->bias.copy_(::torch::tensor({0.1f, -0.2f, 0.3f}));
                    }
                    if (dtype != at::kBFloat16 || bf16_parameters) sync->to(dtype);
                    ref->to(at::kDouble);
                    {
                        ::torch::NoGradGuard g;
                        ref->weight.copy_(sync->weight);
                        ref->bias.copy_(sync->bias);
                    }
                    auto xs = x.detach().requires_grad_(true);
                    auto xr = x.to(at::kDouble).contiguous().requires_grad_(true);
                    auto ys = sync(xs);
                    // BatchNorm2d's implementation takes any rank: at::batch_norm through the functional API.
                    auto yr = ::torch::nn::functional::batch_norm(xr, ref->running_mean, ref->running_var,
                                                                  ::torch::nn::functional::BatchNormFuncOptions()
                                                                      .weight(ref->weight)
                                                                      .bias(ref->bias)
                                                                      .training(true)
                                                                      .momentum(0.3));
                    (ys * dy).sum().backward();
                    (yr * dy.to(at::kDouble)).sum().backward();
                    // bf16: its own rounding of y and dx (2^-9 of their largest values) and a little more.
                    const double tolerance = dtype == at::kBFloat16 ? 8e-3 : 1e-5;
                    const auto close = [&](const at::Tensor& a, const at::Tensor& b) {
                        return (a.to(at::kDouble) - b).abs().max().item<double>() <=
                               tolerance * std::max(1.0, b.abs().max().item<double>());
                    };
                    INFO("dtype " << dtype << (bf16_parameters ? " (bf16 parameters)" : "") << ", rank " << rank << ", layout "
                                  << static_cast<int>(layout));
                    CHECK(close(ys, yr));
                    CHECK(close(xs.grad(), xr.grad()));
                    CHECK(close(sync->weight.grad(), ref->weight.grad()));
                    CHECK(close(sync->bias.grad(), ref->bias.grad()));
                    CHECK(close(sync->running_mean, ref->running_mean));
                    CHECK(close(sync->running_var, ref->running_var));
                    CHECK(sync->num_batches_tracked.item<std::int64_t>() == 1);
                    sync->eval();
                    CHECK(
                        close(sync(x), ::torch::nn::functional::batch_norm(x.to(at::kDouble), ref->running_mean, ref->running_var,
                                                                           ::torch::nn::functional::BatchNormFuncOptions()
                                                                               .weight(ref->weight)
                                                                               .bias(ref->bias)
                                                                               .training(false))));
                }
}

TEST_CASE("torch SyncBatchNorm refuses a batch with one value per channel, as PyTorch does", "[torch]") {
    lt::SyncBatchNorm bn(4);
    CHECK_THROWS_AS(bn(::torch::randn({1, 4})), lockstep::ShapeError);
    CHECK_THROWS_WITH(bn(::torch::randn({2, 3, 5})), Catch::Contains("got an input of 3 channels"));
}

TEST_CASE("torch DataParallel: K steps on 1-4 replicas with uneven shards equal the plain module's on the whole batch",
          "[torch]") {
    constexpr int steps = 3;
    constexpr std::int64_t batch = 11;  // shards 11 / 6,5 / 4,4,3 / 3,3,3,2
    auto reference = fresh_model();
    auto ref_opt = models::sgd(*reference);
    reference_steps(reference, *ref_opt, steps, batch);

    for (const int replicas : {1, 2, 3, 4}) {
        INFO(replicas << " replicas");
        auto model = fresh_model();
        lt::Options options;
        options.bucket_bytes = 2048;  // several buckets, most launched from the hooks
        lt::DataParallel dp(model, replicas, models::sgd, options);
        REQUIRE(dp.bucket_count() > 2);
        for (int k = 0; k < steps; ++k) {
            const auto result = dp.train_step(images(batch, 100 + k), labels(batch, 100 + k), models::cross_entropy);
            CHECK(result.count == batch);
        }
        std::string where;
        const double worst = models::worst_relative(*dp.module(), *reference, &where);
        INFO("worst tensor " << where);
        CHECK(worst <= 1e-5);
        for (int r = 1; r < replicas; ++r) CHECK(models::identical(*dp.replica(r), *dp.module()));
        // Each SyncBatchNorm layer: one all-reduce forward, one backward; plus the step's totals.
        CHECK(dp.layer_collectives(0) > 0);
        if (replicas > 1) CHECK(dp.overlapped_buckets(0) > 0);
    }
}

TEST_CASE("torch DataParallel: the loss and accuracy it reports are the global batch's", "[torch]") {
    auto model = fresh_model();
    auto plain = fresh_model();
    lt::DataParallel dp(model, 3, models::sgd);
    const auto x = images(10, 1), y = labels(10, 1);
    const auto out = plain->forward(x);
    const double loss = models::cross_entropy(out, y).item<double>();
    const auto correct = out.argmax(1).eq(y).sum().item<std::int64_t>();
    const auto r = dp.train_step(x, y, models::cross_entropy);
    CHECK(r.loss == Approx(loss).epsilon(1e-6));
    CHECK(r.correct == correct);
    CHECK(r.count == 10);
}

TEST_CASE("torch DataParallel: accumulate then train_step equals one step on both batches for a model without batch norm",
          "[torch]") {
    struct MlpImpl : ::torch::nn::Cloneable<MlpImpl> {
        MlpImpl() { reset(); }
        void reset() override {
            l1 = register_module("l1", ::torch::nn::Linear(64, 16));
            l2 = register_module("l2", ::torch::nn::Linear(16, 10));
        }
        at::Tensor forward(const at::Tensor& x) { return l2(::torch::tanh(l1(x.flatten(1)))); }
        ::torch::nn::Linear l1{nullptr}, l2{nullptr};
    };
    ::torch::manual_seed(3);
    auto proto = std::make_shared<MlpImpl>();
    auto reference = std::dynamic_pointer_cast<MlpImpl>(proto->clone());
    auto ref_opt = models::sgd(*reference);
    const auto x1 = images(5, 11), y1 = labels(5, 11), x2 = images(8, 12), y2 = labels(8, 12);
    ref_opt->zero_grad();
    models::cross_entropy(reference->forward(::torch::cat({x1, x2})), ::torch::cat({y1, y2})).backward();
    ref_opt->step();

    lt::DataParallel dp(proto, 2, [](MlpImpl& m) { return models::sgd(m); });
    dp.accumulate(x1, y1, models::cross_entropy);
    CHECK(dp.accumulated_samples() == 5);
    CHECK(dp.gradient_collectives(0) == 0);
    const auto r = dp.train_step(x2, y2, models::cross_entropy);
    CHECK(r.count == 13);
    CHECK(models::worst_relative(*dp.module(), *reference) <= 1e-5);
}

TEST_CASE("torch DataParallel: clipping is applied to the all-reduced gradients, as clip_grad_norm_ on the whole batch",
          "[torch]") {
    auto reference = fresh_model();
    auto ref_opt = models::sgd(*reference);
    ref_opt->zero_grad();
    models::cross_entropy(reference->forward(images(9, 5)), labels(9, 5)).backward();
    const double norm = ::torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
    REQUIRE(norm > 0.05);  // the clip does act
    ref_opt->step();
    lt::Options options;
    options.clip_grad_norm = 0.05;
    auto model = fresh_model();
    lt::DataParallel dp(model, 2, models::sgd, options);
    dp.train_step(images(9, 5), labels(9, 5), models::cross_entropy);
    CHECK(models::worst_relative(*dp.module(), *reference) <= 1e-5);
}

TEST_CASE("torch DataParallel: forward in eval mode gathers every replica's rows in order", "[torch]") {
    auto model = fresh_model();
    lt::DataParallel dp(model, 3, models::sgd);
    dp.train_step(images(12, 1), labels(12, 1), models::cross_entropy);
    dp.eval();
    auto copy = std::dynamic_pointer_cast<models::ResNetImpl>(dp.module()->clone());
    copy->eval();
    const auto x = images(7, 9);
    ::torch::NoGradGuard g;
    const auto out = dp.forward(x);
    // Each replica's rows, in order, exactly as the module computes its shard: a convolution's
    // result may depend on the batch it runs in (oneDNN picks its kernel by shape: on an AMD EPYC
    // the whole batch differs from the shards in the last bits), so the whole batch is compared
    // within rounding.
    std::vector<at::Tensor> shards;
    for (const auto& s : lockstep::parallel::shard_ranges(7, 3)) shards.push_back(copy->forward(x.narrow(0, s.begin, s.count)));
    CHECK(out.equal(::torch::cat(shards)));
    const auto whole = copy->forward(x);
    CHECK(((out - whole).norm() / whole.norm()).item<double>() <= 1e-6);
}

namespace {

// A module that fails where a test tells it to, on one replica.
struct FlakyImpl : ::torch::nn::Cloneable<FlakyImpl> {
    FlakyImpl() { reset(); }
    void reset() override {
        net = register_module("net", ResNet(4));
    }
    at::Tensor forward(const at::Tensor& x) {
        if (fail_forward) throw std::runtime_error("replica forward failed on purpose");
        auto y = net->forward(x);
        if (nan_output) y = y * std::numeric_limits<float>::quiet_NaN();
        return y;
    }
    ResNet net{nullptr};
    bool fail_forward = false;
    bool nan_output = false;
};

struct ThrowingSgd : ::torch::optim::SGD {
    ThrowingSgd(std::vector<at::Tensor> p, std::shared_ptr<std::atomic<bool>> fail)
        : ::torch::optim::SGD(std::move(p), ::torch::optim::SGDOptions(0.1).momentum(0.9)), fail(std::move(fail)) {}
    at::Tensor step(LossClosure closure = nullptr) override {
        if (fail->load()) throw std::runtime_error("optimizer failed on purpose");
        return ::torch::optim::SGD::step(std::move(closure));
    }
    std::shared_ptr<std::atomic<bool>> fail;
};

std::vector<at::Tensor> snapshot(const ::torch::nn::Module& m) {
    std::vector<at::Tensor> all;
    for (const auto& p : m.parameters(true)) all.push_back(p.detach().clone());
    for (const auto& b : m.buffers(true)) all.push_back(b.clone());
    return all;
}
bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
        if (!a[i].equal(b[i])) return false;
    return true;
}

}  // namespace

TEST_CASE("torch DataParallel: a replica that throws in forward, in a hook or under check_finite fails the step everywhere: "
          "nothing is applied and the object stays usable",
          "[torch]") {
    ::torch::manual_seed(5);
    auto proto = std::make_shared<FlakyImpl>();
    lt::Options options;
    options.check_finite = true;
    options.bucket_bytes = 1024;
    options.timeout = std::chrono::seconds(20);
    lt::DataParallel dp(proto, 3, [](FlakyImpl& m) { return models::sgd(m); }, options);
    dp.train_step(images(9, 1), labels(9, 1), models::cross_entropy);
    const auto before = snapshot(*dp.module());

    const auto expect_nothing_applied = [&] {
        for (int r = 0; r < dp.size(); ++r) CHECK(same(snapshot(*dp.replica(r)), before));
    };
    SECTION("forward") {
        dp.parallel_apply([](FlakyImpl& m, int r) { m.fail_forward = r == 1; });
        const auto t0 = std::chrono::steady_clock::now();
        CHECK_THROWS_WITH(dp.train_step(images(9, 2), labels(9, 2), models::cross_entropy),
                          Catch::Contains("replica forward failed on purpose"));
        CHECK(std::chrono::steady_clock::now() - t0 < options.timeout);  // the peers were released, not timed out
        expect_nothing_applied();
        dp.parallel_apply([](FlakyImpl& m, int) { m.fail_forward = false; });
    }
    SECTION("a gradient hook") {
        dp.parallel_apply([](FlakyImpl& m, int r) {
            if (r == 2)
                m.net->block1->conv1->weight.register_hook([](at::Tensor) -> at::Tensor {
                    throw std::runtime_error("hook failed on purpose");
                });
        });
        CHECK_THROWS_WITH(dp.train_step(images(9, 2), labels(9, 2), models::cross_entropy),
                          Catch::Contains("hook failed on purpose"));
        expect_nothing_applied();
        dp.parallel_apply([](FlakyImpl& m, int r) {
            if (r == 2) m.net->block1->conv1->weight.remove_hook(0);
        });
    }
    SECTION("NaN under check_finite") {
        dp.parallel_apply([](FlakyImpl& m, int r) { m.nan_output = r == 0; });
        CHECK_THROWS_AS(dp.train_step(images(9, 2), labels(9, 2), models::cross_entropy), lockstep::NonFinite);
        expect_nothing_applied();
        dp.parallel_apply([](FlakyImpl& m, int) { m.nan_output = false; });
    }
    // Usable again: the next step runs and keeps the replicas identical.
    dp.train_step(images(9, 3), labels(9, 3), models::cross_entropy);
    CHECK_FALSE(same(snapshot(*dp.module()), before));
    for (int r = 1; r < dp.size(); ++r) CHECK(models::identical(*dp.replica(r), *dp.module()));
}

namespace {

// The NCCL buckets' logic (Note [libtorch NCCL buckets]) on CPU replicas: the stream group over
// the recording double, whose "NCCL" sums in rank order when every rank has enqueued, and whose
// streams run nothing, so that the log shows what each stream was told to wait for. As a GPU's,
// an all-reduce's sums are seen on the compute stream only once it waited for the communication
// stream behind them: until then the double leaves NaN in the buffer, and the wait puts them there.
struct TorchRecordingApi : lockstep_test::stream_double::RecordingApi {
    using Base = lockstep_test::stream_double::RecordingApi;
    static constexpr const char* name = "recording";
    static lockstep::Execution<lockstep::Host> execution(const ::torch::Device&) { return {}; }
    static void release(lockstep::Execution<lockstep::Host>&) noexcept {}
    static void wait_for_work(lockstep::Execution<lockstep::Host>& ex, const char*) {
        const long compute = compute_stream(ex, 0);  // the calling replica thread's
        lockstep_test::stream_double::log_of_calls().add({.op = "wait_for_work", .stream = compute});
    }

    static void all_reduce(Comm c, void* buf, std::size_t count, lockstep::comm::DType t, Stream s, tp deadline,
                           const std::atomic<bool>& stop) {
        Base::all_reduce(c, buf, count, t, s, deadline, stop);
        if (t != lockstep::comm::DType::f32) throw std::logic_error("a bucket that is not float32");
        auto* data = static_cast<float*>(buf);
        Held h{data, std::vector<float>(data, data + count)};
        std::fill(data, data + count, std::numeric_limits<float>::quiet_NaN());
        std::lock_guard lock(held().m);
        held().by_stream[s].push_back(std::move(h));
        held().reduced.insert(s);
    }
    // How many communication streams completed an all-reduce since forget_reduced().
    static std::size_t streams_reduced() {
        std::lock_guard lock(held().m);
        return held().reduced.size();
    }
    static void forget_reduced() {
        std::lock_guard lock(held().m);
        held().reduced.clear();
    }
    static void record(Event e, Stream s) {
        Base::record(e, s);
        std::lock_guard lock(held().m);
        if (auto it = held().by_stream.find(s); it != held().by_stream.end()) held().by_event[e] = {s, it->second.size()};
    }
    static void wait(Stream s, Event e) {
        Base::wait(s, e);
        std::lock_guard lock(held().m);
        const auto it = held().by_event.find(e);
        if (it == held().by_event.end()) return;
        auto& sums = held().by_stream[it->second.first];
        const std::size_t n = std::min(it->second.second, sums.size());  // everything before the event
        for (std::size_t i = 0; i < n; ++i) std::copy(sums[i].sums.begin(), sums[i].sums.end(), sums[i].buffer);
        sums.erase(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(n));
        for (auto& [event, mark] : held().by_event)
            if (mark.first == it->second.first) mark.second -= std::min(mark.second, n);
    }

private:
    struct Held {
        float* buffer;
        std::vector<float> sums;
    };
    struct Pending {
        std::mutex m;
        std::map<long, std::vector<Held>> by_stream;            // communication stream -> sums not yet seen
        std::map<long, std::pair<long, std::size_t>> by_event;  // event -> its stream, sums before it
        std::set<long> reduced;
    };
    static Pending& held() {
        static Pending p;
        return p;
    }
};

lt::detail::ExchangeMaker recording_exchange() {
    return [](const std::vector<::torch::Device>& devices, std::chrono::milliseconds timeout,
              std::shared_ptr<lockstep::comm::ProcessGroup> processes) -> std::unique_ptr<lt::detail::GradientExchange> {
        return std::make_unique<lt::detail::StreamExchange<TorchRecordingApi>>(
            lt::detail::host_devices(static_cast<int>(devices.size())), timeout, std::move(processes));
    };
}

// What each rank's streams were told during one step: every all-reduce of a bucket waits (on the
// communication stream) for an event recorded on the rank's compute stream; after the last event
// recorded on the communication stream (behind its last all-reduce), the compute stream waits for
// it (join), and, in a step that reached its commit point, only then does the replica's host wait
// for its device (wait_for_work). Returns the all-reduces seen per communication stream.
std::map<long, int> check_bucket_ordering(const std::vector<lockstep_test::stream_double::Call>& calls, bool committed = true) {
    std::map<long, int> reduces;
    std::map<long, long> compute_of;  // communication stream -> the compute stream its rank records on
    for (std::size_t i = 0; i < calls.size(); ++i) {
        const auto& c = calls[i];
        if (c.op != "all_reduce") continue;
        ++reduces[c.stream];
        // The last wait of this communication stream before it, and the record of that event.
        long event = 0;
        std::size_t at = 0;
        for (std::size_t j = i; j-- > 0;)
            if (calls[j].op == "wait" && calls[j].stream == c.stream) {
                event = calls[j].event;
                at = j;
                break;
            }
        INFO("all_reduce #" << i << " on stream " << c.stream);
        REQUIRE(event != 0);
        long recorded_on = 0;
        for (std::size_t j = at; j-- > 0;)
            if (calls[j].op == "record" && calls[j].event == event) {
                recorded_on = calls[j].stream;
                break;
            }
        REQUIRE(recorded_on != 0);
        CHECK(recorded_on != c.stream);
        if (compute_of.count(c.stream)) CHECK(compute_of[c.stream] == recorded_on);
        compute_of[c.stream] = recorded_on;
    }
    for (const auto& [comm, compute] : compute_of) {
        INFO("communication stream " << comm << ", compute stream " << compute);
        std::size_t done_at = 0, join_at = 0, host_at = 0;
        long done = 0;
        for (std::size_t j = 0; j < calls.size(); ++j)
            if (calls[j].op == "record" && calls[j].stream == comm) {
                done = calls[j].event;
                done_at = j;
            }
        REQUIRE(done != 0);
        for (std::size_t j = done_at + 1; j < calls.size() && join_at == 0; ++j)
            if (calls[j].op == "wait" && calls[j].stream == compute && calls[j].event == done) join_at = j;
        CHECK(join_at != 0);  // the buckets are written again only behind the all-reduces
        if (!committed) continue;
        for (std::size_t j = join_at + 1; j < calls.size() && host_at == 0; ++j)
            if (calls[j].op == "wait_for_work" && calls[j].stream == compute) host_at = j;
        CHECK(host_at != 0);  // the host waits for them before the commit point
    }
    return reduces;
}

}  // namespace

TEST_CASE(
    "torch DataParallel over a stream-ordered gradient group (NCCL's path, with a recording double) equals the host "
    "group bit for bit, starts each bucket behind the compute stream and joins it before the sums are read",
    "[torch]") {
    namespace sd = lockstep_test::stream_double;
    constexpr std::int64_t batch = 11;
    for (const auto& [replicas, overlap] : {std::pair{2, true}, std::pair{3, true}, std::pair{2, false}}) {
        INFO(replicas << " replicas, overlap " << overlap);
        lt::Options options;
        options.bucket_bytes = 2048;
        options.overlap = overlap;
        auto host_model = fresh_model();
        lt::DataParallel host(host_model, replicas, models::sgd, options);
        auto stream_model = fresh_model();
        lt::DataParallel<models::ResNetImpl> stream(
            stream_model.ptr(), std::vector<::torch::Device>(static_cast<std::size_t>(replicas), ::torch::kCPU), models::sgd,
            options, recording_exchange());
        CHECK(std::string(host.gradient_transport()) == "host");
        CHECK(std::string(stream.gradient_transport()) == "recording");
        for (int k = 0; k < 3; ++k) {
            sd::log_of_calls().clear();
            const auto a = host.train_step(images(batch, 100 + k), labels(batch, 100 + k), models::cross_entropy);
            const auto b = stream.train_step(images(batch, 100 + k), labels(batch, 100 + k), models::cross_entropy);
            CHECK(a.loss == b.loss);
            const auto reduces = check_bucket_ordering(sd::log_of_calls().snapshot());
            CHECK(reduces.size() == static_cast<std::size_t>(replicas));
            for (const auto& [comm, n] : reduces) CHECK(n == static_cast<int>(stream.bucket_count()));
        }
        CHECK(stream.overlapped_buckets(0) > 0);  // from the hooks, in line without overlap
        for (int r = 0; r < replicas; ++r) CHECK(models::identical(*stream.replica(r), *host.module()));
    }
}

TEST_CASE(
    "torch DataParallel over a stream-ordered gradient group: a replica that throws in a hook while its peers' "
    "buckets are started fails the step everywhere, nothing is applied, and the next step runs on new communicators",
    "[torch]") {
    namespace sd = lockstep_test::stream_double;
    ::torch::manual_seed(5);
    auto proto = std::make_shared<FlakyImpl>();
    lt::Options options;
    options.bucket_bytes = 1024;
    options.timeout = std::chrono::seconds(20);
    lt::DataParallel<FlakyImpl> dp(
        proto, std::vector<::torch::Device>(3, ::torch::kCPU), [](FlakyImpl& m) { return models::sgd(m); }, options,
        recording_exchange());
    dp.train_step(images(9, 1), labels(9, 1), models::cross_entropy);
    const auto before = snapshot(*dp.module());
    dp.parallel_apply([](FlakyImpl& m, int r) {
        if (r == 2)  // the first layer's, once every rank has completed an all-reduce (at most 5 s)
            m.net->stem->weight.register_hook([](at::Tensor) -> at::Tensor {
                const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
                while (TorchRecordingApi::streams_reduced() < 3 && std::chrono::steady_clock::now() < until)
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                throw std::runtime_error("hook failed on purpose");
            });
    });
    TorchRecordingApi::forget_reduced();
    sd::log_of_calls().clear();
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(dp.train_step(images(9, 2), labels(9, 2), models::cross_entropy),
                      Catch::Contains("hook failed on purpose"));
    CHECK(std::chrono::steady_clock::now() - t0 < options.timeout);  // released by the abort, not timed out
    const auto failed = sd::log_of_calls().snapshot();
    CHECK(std::count_if(failed.begin(), failed.end(), [](const sd::Call& c) { return c.op == "abort"; }) == 3);
    CHECK(check_bucket_ordering(failed, /*committed=*/false).size() == 3);  // every rank had started buckets
    for (int r = 0; r < dp.size(); ++r) CHECK(same(snapshot(*dp.replica(r)), before));
    dp.parallel_apply([](FlakyImpl& m, int r) {
        if (r == 2) m.net->stem->weight.remove_hook(0);
    });
    sd::log_of_calls().clear();
    dp.train_step(images(9, 3), labels(9, 3), models::cross_entropy);
    const auto next = sd::log_of_calls().snapshot();
    CHECK(std::count_if(next.begin(), next.end(), [](const sd::Call& c) { return c.op == "init"; }) == 3);
    check_bucket_ordering(next);
    CHECK_FALSE(same(snapshot(*dp.module()), before));
    for (int r = 1; r < dp.size(); ++r) CHECK(models::identical(*dp.replica(r), *dp.module()));
}

TEST_CASE("torch DataParallel: an optimizer that throws after the commit point marks the object diverged until resync "
          "or load",
          "[torch]") {
    const bool by_load = GENERATE(false, true);
    INFO((by_load ? "load" : "resync"));
    const auto dir = std::filesystem::temp_directory_path() / ("lockstep_torch_div_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    const auto path = (dir / "model.safetensors").string();
    auto fail = std::make_shared<std::atomic<bool>>(false);
    auto model = fresh_model();
    // Replica 0's optimizer fails: it then holds no momentum while replica 1's does.
    lt::DataParallel dp(model, 2, [&](models::ResNetImpl& m) -> std::unique_ptr<::torch::optim::Optimizer> {
        const bool mine = lockstep::ReplicaPool::current_rank() == 0;
        return std::make_unique<ThrowingSgd>(m.parameters(), mine ? fail : std::make_shared<std::atomic<bool>>(false));
    });
    dp.save(path);
    fail->store(true);
    CHECK_THROWS_WITH(dp.train_step(images(8, 2), labels(8, 2), models::cross_entropy), Catch::Contains("optimizer failed"));
    CHECK(dp.diverged());
    CHECK_FALSE(models::identical(*dp.replica(1), *dp.module()));
    CHECK_THROWS_AS(dp.train_step(images(8, 3), labels(8, 3), models::cross_entropy), lockstep::Diverged);
    fail->store(false);
    if (by_load)
        dp.load(path);
    else
        dp.resync();
    CHECK_FALSE(dp.diverged());
    CHECK(models::identical(*dp.replica(1), *dp.module()));
    // Equal optimizer states too: two more steps keep the replicas identical.
    dp.train_step(images(8, 3), labels(8, 3), models::cross_entropy);
    dp.train_step(images(8, 4), labels(8, 4), models::cross_entropy);
    CHECK(models::identical(*dp.replica(1), *dp.module()));
    std::filesystem::remove_all(dir);
}

namespace {
// A module whose clone cannot be made (its reset() registers a parameter the original lacks).
std::atomic<int> resets{0};
struct UnevenImpl : ::torch::nn::Cloneable<UnevenImpl> {
    UnevenImpl() { reset(); }
    void reset() override {
        fc = register_module("fc", ::torch::nn::Linear(64, 10));
        if (resets++ > 0) extra = register_parameter("extra", ::torch::zeros({3}));
    }
    at::Tensor forward(const at::Tensor& x) { return fc(x.flatten(1)); }
    ::torch::nn::Linear fc{nullptr};
    at::Tensor extra;
};
}  // namespace

// Replicas in one process are clones and cannot differ; processes that build different models
// are refused by tests/torch/test_torch_mpi.cpp.
TEST_CASE("torch DataParallel refuses a module it cannot clone, and devices it cannot run replicas on", "[torch]") {
    resets = 0;
    auto proto = std::make_shared<UnevenImpl>();
    CHECK_THROWS_WITH(lt::DataParallel(proto, 2, [](UnevenImpl& m) { return models::sgd(m); }),
                      Catch::Contains("cloning it failed (derive the module from torch::nn::Cloneable<Impl>"));
    using Devices = std::vector<::torch::Device>;
    const auto make = [](Devices devices) { lt::DataParallel dp(fresh_model(), std::move(devices), models::sgd); };
    CHECK_THROWS_WITH(make(Devices{::torch::Device("cpu"), ::torch::Device("cuda:0")}),
                      Catch::Contains("put every replica on a CPU or every one on a GPU"));
    CHECK_THROWS_WITH(make(Devices{::torch::Device("meta")}), Catch::Contains("runs replicas on CPU or CUDA devices; got meta"));
    CHECK_THROWS_WITH(make(Devices{::torch::Device("cuda")}), Catch::Contains("give each CUDA replica its device index"));
    CHECK_THROWS_WITH(make(Devices{::torch::Device("cuda:0"), ::torch::Device("cuda:0")}),
                      Catch::Contains("two replicas on cuda:0; one replica per GPU"));
    if (::torch::cuda::device_count() == 0) {
        CHECK_THROWS_AS(make(Devices{::torch::Device("cuda:0")}), lockstep::DeviceError);
        CHECK_THROWS_WITH(make(Devices{::torch::Device("cuda:0")}), Catch::Contains("libtorch sees no CUDA device"));
    } else {  // a CPU module given GPUs
        CHECK_THROWS_AS(make(Devices{::torch::Device("cuda:0")}), lockstep::DeviceMismatch);
        CHECK_THROWS_WITH(make(Devices{::torch::Device(::torch::kCUDA, 99)}), Catch::Contains("does not exist"));
    }
}

TEST_CASE("convert_sync_batchnorm swaps BatchNorm in Sequential and ModuleList, keeping values, and names what it cannot swap",
          "[torch]") {
    ::torch::manual_seed(1);
    // A Sequential held as a custom module's member: its entries are swapped in place.
    struct NetImpl : ::torch::nn::Module {
        NetImpl() {
            body = register_module("body", ::torch::nn::Sequential(::torch::nn::Conv2d(::torch::nn::Conv2dOptions(1, 3, 3)),
                                                                   ::torch::nn::BatchNorm2d(3), ::torch::nn::ReLU(),
                                                                   ::torch::nn::Flatten(), ::torch::nn::BatchNorm1d(3 * 6 * 6)));
        }
        at::Tensor forward(const at::Tensor& x) { return body->forward(x); }
        ::torch::nn::Sequential body{nullptr};
    };
    auto net = std::make_shared<NetImpl>();
    auto& seq = net->body;
    {
        ::torch::NoGradGuard g;
        seq[1]->as<::torch::nn::BatchNorm2d>()->weight.uniform_();
        seq[1]->as<::torch::nn::BatchNorm2d>()->running_mean.uniform_();
    }
    const auto x = images(4, 2);
    net->eval();
    const auto before = net->forward(x);
    const auto weight = seq[1]->as<::torch::nn::BatchNorm2d>()->weight.clone();
    lt::convert_sync_batchnorm(net);
    auto* bn = seq[1]->as<lt::SyncBatchNormImpl>();
    REQUIRE(bn != nullptr);
    CHECK(bn->weight.equal(weight));
    CHECK(seq[4]->as<lt::SyncBatchNormImpl>() != nullptr);
    CHECK(net->named_modules()["body.1"]->as<lt::SyncBatchNormImpl>() != nullptr);
    CHECK(net->forward(x).allclose(before, 1e-5, 1e-6));  // eval mode kept, the same function

    // A Sequential of named layers: swapped under its names, in the list and in the registry alike.
    ::torch::nn::Sequential named({{"conv", ::torch::nn::Conv2d(::torch::nn::Conv2dOptions(1, 2, 3))},
                                   {"norm", ::torch::nn::BatchNorm2d(2)}});
    lt::convert_sync_batchnorm(named.ptr());
    CHECK(named[1]->as<lt::SyncBatchNormImpl>() != nullptr);
    CHECK(named->named_children()["norm"]->as<lt::SyncBatchNormImpl>() != nullptr);
    CHECK(named->named_parameters().contains("norm.weight"));
    CHECK(named->parameters().size() == 4);  // conv's weight and bias, the SyncBatchNorm's weight and bias

    ::torch::nn::ModuleList list(::torch::nn::BatchNorm1d(2));
    lt::convert_sync_batchnorm(list.ptr());
    CHECK(list[0]->as<lt::SyncBatchNormImpl>() != nullptr);

    struct HeldImpl : ::torch::nn::Module {
        HeldImpl() { bn = register_module("bn", ::torch::nn::BatchNorm2d(3)); }
        ::torch::nn::BatchNorm2d bn{nullptr};
    };
    CHECK_THROWS_WITH(lt::convert_sync_batchnorm(std::make_shared<HeldImpl>()), Catch::Contains("'bn' is a torch::nn::BatchNorm2d"));
}

TEST_CASE("torch checkpoints: written atomically, read back exactly, another model's refused whole", "[torch]") {
    const auto dir = std::filesystem::temp_directory_path() / ("lockstep_torch_ck_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    const auto path = (dir / "model.safetensors").string();
    auto model = fresh_model();
    lt::DataParallel dp(model, 2, models::sgd);
    dp.train_step(images(8, 1), labels(8, 1), models::cross_entropy);
    dp.save(path);
    auto other = fresh_model(99);
    lt::load(*other, path);
    CHECK(models::identical(*other, *dp.module()));
    // A checkpoint of another architecture changes nothing.
    auto wide = ResNet(8);
    const auto before = snapshot(*wide);
    CHECK_THROWS_AS(lt::load(*wide, path), lockstep::IoError);
    CHECK(same(snapshot(*wide), before));
    // DataParallel::load puts it into every replica.
    dp.train_step(images(8, 2), labels(8, 2), models::cross_entropy);
    dp.load(path);
    CHECK(models::identical(*dp.replica(1), *other));
    std::filesystem::remove_all(dir);
}

TEST_CASE("torch DataParallel matches PyTorch DDP with synchronized batch norm (gloo, 2 processes) step for step", "[torch]") {
    // tests/golden/make_torch_golden.py: the same network, batches and optimizer under DDP.
    const auto ck = lockstep::nn::Checkpoint::load(std::string(LOCKSTEP_GOLDEN_DIR) + "/torch_resnet.safetensors");
    const auto tensor = [&](const std::string& name) {
        const auto& e = ck.at(name);
        const auto dtype = e.dtype == "F32" ? at::kFloat : at::kLong;
        return at::from_blob(const_cast<unsigned char*>(e.data.data()), e.shape, at::TensorOptions().dtype(dtype)).clone();
    };
    auto model = ResNet(6);
    {
        ::torch::NoGradGuard g;
        for (auto& item : model->named_parameters()) item.value().copy_(tensor("init." + item.key()));
        for (auto& item : model->named_buffers()) item.value().copy_(tensor("init." + item.key()));
    }
    const auto losses = nlohmann::json::parse(ck.metadata.at("losses"));
    lt::DataParallel dp(model, 2, models::sgd);  // shards 6 and 5, as the two DDP processes'
    for (int k = 0; k < 3; ++k) {
        const auto r = dp.train_step(tensor("x." + std::to_string(k)), tensor("y." + std::to_string(k)), models::cross_entropy);
        CHECK(r.loss == Approx(losses[static_cast<std::size_t>(k)].get<double>()).epsilon(1e-5));
    }
    int compared = 0;
    const auto compare = [&](const std::string& name, const at::Tensor& ours) {
        const auto theirs = tensor("final." + name);
        INFO(name);
        if (ours.is_floating_point())
            CHECK((ours.to(at::kDouble) - theirs.to(at::kDouble)).norm().item<double>() <=
                  1e-5 * std::max(theirs.to(at::kDouble).norm().item<double>(), 1e-30));
        else
            CHECK(ours.equal(theirs));
        ++compared;
    };
    for (const auto& item : dp.module()->named_parameters()) compare(item.key(), item.value());
    for (const auto& item : dp.module()->named_buffers()) compare(item.key(), item.value());
    CHECK(compared == 32);
}

TEST_CASE("torch checkpoint for PyTorch: a trained model with an input and its eval output", "[torch]") {
    // tests/torch/load_in_pytorch.py runs this case with LOCKSTEP_TORCH_EXPORT set, then loads the
    // files into the Python twin of the network and compares its output.
    const char* where = std::getenv("LOCKSTEP_TORCH_EXPORT");
    const auto dir = where != nullptr ? std::filesystem::path(where)
                                      : std::filesystem::temp_directory_path() / ("lockstep_torch_export_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    auto model = fresh_model();
    lt::DataParallel dp(model, 2, models::sgd);
    for (int k = 0; k < 2; ++k) dp.train_step(images(10, k), labels(10, k), models::cross_entropy);
    const auto report = dp.save((dir / "model.safetensors").string());
    CHECK(std::filesystem::exists(report.written));
    dp.eval();
    const auto x = images(5, 42);
    const auto y = dp.forward(x);
    lockstep::nn::Checkpoint io;
    for (const auto& [name, t] : {std::pair{std::string("x"), x}, std::pair{std::string("y"), y}}) {
        const auto c = t.contiguous();
        io.put_bytes(name, "F32", c.sizes().vec(),
                     std::span<const unsigned char>(static_cast<const unsigned char*>(c.data_ptr()), c.numel() * 4));
    }
    io.save((dir / "io.safetensors").string());
    // What the Python side will read: every tensor by its state_dict name, num_batches_tracked as I64.
    const auto ck = lockstep::nn::Checkpoint::load((dir / "model.safetensors").string());
    CHECK(ck.at("block1.bn2.num_batches_tracked").dtype == "I64");
    CHECK(ck.at("fc.weight").shape == std::vector<std::int64_t>{10, 6});
    if (where == nullptr) std::filesystem::remove_all(dir);
}

namespace {
struct NoParamsImpl : ::torch::nn::Cloneable<NoParamsImpl> {
    NoParamsImpl() { reset(); }
    void reset() override {}
    at::Tensor forward(const at::Tensor& x) { return ::torch::relu(x); }
};
struct PlainBnImpl : ::torch::nn::Cloneable<PlainBnImpl> {
    PlainBnImpl() { reset(); }
    void reset() override {
        conv = register_module("conv", ::torch::nn::Conv2d(::torch::nn::Conv2dOptions(1, 2, 3)));
        norm = register_module("norm", ::torch::nn::BatchNorm2d(2));
        fc = register_module("fc", ::torch::nn::Linear(2 * 6 * 6, 10));
    }
    at::Tensor forward(const at::Tensor& x) { return fc(norm(conv(x)).flatten(1)); }
    ::torch::nn::Conv2d conv{nullptr};
    ::torch::nn::BatchNorm2d norm{nullptr};
    ::torch::nn::Linear fc{nullptr};
};
}  // namespace

TEST_CASE("torch DataParallel: misuse gets a typed error that says what to do", "[torch]") {
    SECTION("a module with no parameters") {
        CHECK_THROWS_AS(lt::DataParallel(std::make_shared<NoParamsImpl>(), 2, [](NoParamsImpl& m) { return models::sgd(m); }),
                        lockstep::UsageError);
    }
    SECTION("a batch smaller than the replicas") {
        auto model = fresh_model();
        lt::DataParallel dp(model, 3, models::sgd);
        CHECK_THROWS_WITH(dp.train_step(images(2, 1), labels(2, 1), models::cross_entropy),
                          Catch::Contains("cannot be split over 3 replicas"));
        CHECK_THROWS_AS(dp.train_step(images(4, 1), labels(3, 1), models::cross_entropy), lockstep::ShapeError);
        dp.train_step(images(3, 1), labels(3, 1), models::cross_entropy);  // still usable
    }
    SECTION("a module whose tensors are elsewhere than its replicas") {
        struct ElsewhereImpl : ::torch::nn::Cloneable<ElsewhereImpl> {  // as a CUDA module given CPU devices
            ElsewhereImpl() { reset(); }
            void reset() override { w = register_parameter("w", ::torch::empty({3}, ::torch::kMeta)); }
            at::Tensor forward(const at::Tensor& x) { return x * w; }
            at::Tensor w;
        };
        CHECK_THROWS_WITH(lt::DataParallel(std::make_shared<ElsewhereImpl>(), 2, [](ElsewhereImpl& m) { return models::sgd(m); }),
                          Catch::Contains("the module's parameters are on meta but its replicas are to run on cpu"));
    }
    SECTION("an optimizer over another module's parameters") {
        auto model = fresh_model();
        CHECK_THROWS_WITH(lt::DataParallel(model, 2, [&](models::ResNetImpl&) { return models::sgd(*model); }),
                          Catch::Contains("not a parameter of the replica it was given"));
    }
    SECTION("a BatchNorm left unconverted is warned of once") {
        std::ostringstream captured;
        auto* old = std::cerr.rdbuf(captured.rdbuf());
        {
            lt::DataParallel dp(std::make_shared<PlainBnImpl>(), 2, [](PlainBnImpl& m) { return models::sgd(m); });
            lt::DataParallel again(std::make_shared<PlainBnImpl>(), 2, [](PlainBnImpl& m) { return models::sgd(m); });
        }
        std::cerr.rdbuf(old);
        const auto text = captured.str();
        CHECK_THAT(text, Catch::Contains("'norm' is a torch::nn::BatchNorm2d") && Catch::Contains("convert_sync_batchnorm"));
        CHECK(text.find("warning") == text.rfind("warning"));  // once
    }
}

// libtorch's OpenMP build keeps the count per thread (Note [intra-op threads]); its native thread
// pool has one count per process, fixed at its first use.
#if AT_PARALLEL_OPENMP
TEST_CASE("torch DataParallel: every call runs its replicas with the intra-op threads it resolves, whatever they ran before",
          "[torch]") {
    const int before = at::get_num_threads();
    const auto replica_threads = [](auto& dp) {
        std::vector<int> seen(static_cast<std::size_t>(dp.size()), 0);
        dp.parallel_apply([&](models::ResNetImpl&, int r) { seen[static_cast<std::size_t>(r)] = at::get_num_threads(); });
        return seen;
    };
    SECTION("libtorch's setting (-1) follows at::set_num_threads made after construction") {
        at::set_num_threads(3);
        lt::Options options;
        options.intra_op_threads = -1;
        auto dp = lt::DataParallel(fresh_model(), 2, models::sgd, options);
        CHECK(replica_threads(dp) == std::vector<int>{3, 3});
        at::set_num_threads(1);  // a replica thread keeps its first count unless the call sets it
        CHECK(dp.intra_op_threads() == 1);
        CHECK(replica_threads(dp) == std::vector<int>{1, 1});
        dp.train_step(images(6, 1), labels(6, 1), models::cross_entropy);
        at::set_num_threads(2);
        CHECK(replica_threads(dp) == std::vector<int>{2, 2});
    }
    SECTION("an explicit count holds whatever the caller's setting") {
        lt::Options options;
        options.intra_op_threads = 2;
        at::set_num_threads(1);
        auto dp = lt::DataParallel(fresh_model(), 2, models::sgd, options);
        at::set_num_threads(4);
        CHECK(replica_threads(dp) == std::vector<int>{2, 2});
        CHECK(at::get_num_threads() == 4);  // the caller's own count is left alone
    }
    SECTION("by default the machine's CPUs are shared among the replicas, never more than the caller's count") {
        const int cpus = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
        at::set_num_threads(cpus);
        auto two = lt::DataParallel(fresh_model(), 2, models::sgd);
        const int share = std::max(1, cpus / 2);
        CHECK(replica_threads(two) == std::vector<int>{share, share});
        auto one = lt::DataParallel(fresh_model(), 1, models::sgd);  // its share: every CPU
        CHECK(replica_threads(one) == std::vector<int>{cpus});
        at::set_num_threads(1);  // fewer than the share: the caller's count
        CHECK(replica_threads(one) == std::vector<int>{1});
        CHECK(replica_threads(two) == std::vector<int>{1, 1});
    }
    at::set_num_threads(before);
}
#endif
