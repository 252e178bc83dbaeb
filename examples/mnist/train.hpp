// SPDX-License-Identifier: MIT
//! The MNIST example's training, written once for both backends: `mnist_example::train<B>` loads
//! the data, trains data-parallel, evaluates, writes metrics and checkpoints. main.cpp (host) and
//! cuda_train.cu (the CUDA backend, built where nvcc is) instantiate it.
#pragma once

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <lockstep/data/idx.hpp>
#include <lockstep/parallel.hpp>

#include "net.hpp"

namespace mnist_example {

using lockstep::DataParallel;
using lockstep::Shape;
using lockstep::Tensor;
using Clock = std::chrono::steady_clock;
namespace nn = lockstep::nn;

struct Options {
    std::string backend = "auto";
    int replicas = 0;
    std::string devices;         // CUDA devices of the replicas, "0,1" or "0,0,0,0"
    bool devices_given = false;  // --devices was passed (an empty list is an error, not "not given")
    int epochs = 2;
    std::int64_t batch = 64;
    double lr = 0.01;
    double momentum = 0.9;
    std::uint64_t seed = 0;
    bool no_shuffle = false;
    std::int64_t steps = 0;
    std::int64_t train_limit = 0;
    std::int64_t test_limit = 0;  // evaluate on the first M test images (0: all)
    std::string data = "/usr/share/datasets/fashion-mnist";
    std::string init, save, resume, metrics;
    double expect_accuracy = -1;
    bool quiet = false;
    lockstep::Math math = lockstep::Math::pytorch_default;               // --math (Note [math modes])
    bool graphs = false;                                                 // --graphs (Note [captured steps]), CUDA only
    lockstep::Precision precision = lockstep::Precision::fp32;           // --precision (Note [precision]), CUDA only
    lockstep::Precision gradient_precision = lockstep::Precision::fp32;  // --gradient-precision, CUDA only
};

// "name" or "name.gz" in dir, whichever exists.
inline std::string find_file(const std::string& dir, const std::string& name) {
    namespace fs = std::filesystem;
    if (!fs::is_directory(dir))
        throw lockstep::data::DataError(dir + ": no such data directory (pass --data DIR with the IDX files)");
    for (const auto& candidate : {fs::path(dir) / name, fs::path(dir) / (name + ".gz")})
        if (fs::exists(candidate)) return candidate.string();
    throw lockstep::data::DataError((std::filesystem::path(dir) / name).string() + "[.gz]: missing in the data directory");
}

// Note [each process reads its rows]
// The data sets are opened, not loaded (lockstep::data::IdxSource): the labels (one byte per sample) are
// kept, the images stay in their files. Every process computes the same global order of an epoch
// (the same seed) and the same batch boundaries; for each step it reads, from the files, only
// the images of its own rows of the global batch (my_rows: those of its replicas' global ranks),
// and evaluation reads only its rows of each test chunk. A gzipped file cannot be read at an
// offset: it is inflated once per machine, in 64 KiB chunks (never whole in memory), into a copy
// in TMPDIR that the machine's processes share (the first one makes it under a lock, the others,
// and later runs, open it), and rows are read from there. So with gzipped files one process per
// machine reads the compressed file through once; with plain IDX files (gunzip them) no process
// reads more than the header, the labels and its rows.

// This process's rows [first, first + count) of a global batch of n rows: all of them in one
// process; across processes, those of its replicas' global ranks (DataParallelOptions::process_group).
template <class Dp>
std::pair<std::int64_t, std::int64_t> my_rows(const Dp& dp, std::int64_t n) {
    const auto& procs = dp.process_group();
    if (!procs) return {0, n};
    const auto all = lockstep::parallel::shard_ranges(n, dp.global_size());
    const auto first = static_cast<std::size_t>(procs->rank() * dp.size());
    const auto last = first + static_cast<std::size_t>(dp.size()) - 1;
    return {all[first].begin, all[last].begin + all[last].count - all[first].begin};
}

// Samples `order[begin, begin + n)` as a (n, 1, 28, 28) batch scaled to [0, 1], with labels: their
// images read from the data file now, runs of consecutive samples in one read (Note [each
// process reads its rows]).
inline void make_batch(const lockstep::data::IdxSource& ds, const std::vector<std::int64_t>& order, std::int64_t begin,
                       std::int64_t n, Tensor<float>& x, std::vector<std::int64_t>& labels) {
    x = Tensor<float>(Shape{n, 1, 28, 28}, lockstep::MemoryFormat::nchw, lockstep::Device::host(0), lockstep::uninitialized);
    labels.resize(static_cast<std::size_t>(n));
    const std::int64_t bytes = ds.image_bytes();
    std::vector<std::uint8_t> px(static_cast<std::size_t>(n * bytes));
    for (std::int64_t i = 0; i < n;) {
        const std::int64_t s = order[static_cast<std::size_t>(begin + i)];
        std::int64_t run = 1;
        while (i + run < n && order[static_cast<std::size_t>(begin + i + run)] == s + run) ++run;
        ds.read_images(s, run, px.data() + i * bytes);
        i += run;
    }
    for (std::int64_t i = 0; i < n; ++i) {
        const std::uint8_t* p = px.data() + i * bytes;
        for (std::int64_t k = 0; k < bytes; ++k) x[i * bytes + k] = static_cast<float>(p[k]) / 255.0f;
        labels[static_cast<std::size_t>(i)] = ds.label(order[static_cast<std::size_t>(begin + i)]);
    }
}

// Batch boundaries of an epoch: full batches, then the last partial one (folded into the one
// before when it is smaller than the replica count, since every replica needs a sample).
inline std::vector<std::int64_t> batch_starts(std::int64_t count, std::int64_t batch, int replicas) {
    std::vector<std::int64_t> starts;
    for (std::int64_t b = 0; b < count; b += batch) starts.push_back(b);
    if (starts.size() > 1 && count - starts.back() < replicas) starts.pop_back();
    starts.push_back(count);
    return starts;
}

inline std::vector<std::int64_t> epoch_order(std::int64_t count, std::uint64_t seed, int epoch, bool shuffle) {
    std::vector<std::int64_t> order(static_cast<std::size_t>(count));
    std::iota(order.begin(), order.end(), 0);
    if (shuffle) {
        std::mt19937_64 gen(seed * 1000003u + static_cast<std::uint64_t>(epoch));
        std::shuffle(order.begin(), order.end(), gen);
    }
    return order;
}

struct Eval {
    double loss = 0, accuracy = 0;
};

// Test loss and accuracy, in chunks of 1000 images (the last folded into the one before when it
// has fewer images than there are replicas, as in training).
template <class B>
Eval evaluate(DataParallel<mnist::Net<B>>& dp, const lockstep::data::IdxSource& test) {
    dp.eval();
    const auto order = epoch_order(test.count(), 0, 0, false);
    double loss = 0;
    std::int64_t correct = 0;
    Tensor<float> x;
    std::vector<std::int64_t> labels;
    const auto starts = batch_starts(test.count(), 1000, dp.global_size());
    for (std::size_t i = 0; i + 1 < starts.size(); ++i) {
        const std::int64_t b = starts[i], n = starts[i + 1] - b;
        const auto [first, count] = my_rows(dp, n);
        make_batch(test, order, b + first, count, x, labels);
        Tensor<float> logits;
        if constexpr (std::is_same_v<B, lockstep::Host>)
            logits = dp.forward(x);
        else
            logits = dp.forward(x.template to<B>(dp.devices()[0])).to_host();
        const auto out = nn::SoftmaxCrossEntropy{}(nn::Context{}, logits, labels);
        loss += out.sum();
        correct += out.correct();
    }
    dp.train();
    if (const auto& procs = dp.process_group()) {  // this process's rows' sums, then over all processes
        std::vector<double> sums{loss, static_cast<double>(correct)};
        procs->channel(lockstep::comm::ProcessGroup::control)
            .all_reduce_sum(lockstep::DeviceSpan<double>::host(sums), lockstep::comm::CollectiveSite::user(1));
        loss = sums[0];
        correct = static_cast<std::int64_t>(sums[1]);
    }
    return {loss / static_cast<double>(test.count()), static_cast<double>(correct) / static_cast<double>(test.count())};
}

inline std::string clock_text(double seconds) {
    const auto s = static_cast<long>(seconds + 0.5);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
    return buf;
}

// The integer `text` of checkpoint field `key`, in [lo, hi]: all digits (an optional '-'), no more.
inline std::int64_t counter(const nn::Checkpoint& ck, const std::string& path, const std::string& key, std::int64_t lo,
                            std::int64_t hi, const std::string& range) {
    const auto it = ck.metadata.find(key);
    if (it == ck.metadata.end())
        throw lockstep::IoError("'" + path + "' has no '" + key + "' counter; it was not written by --save");
    const std::string& text = it->second;
    std::int64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size() || text.empty())
        throw lockstep::IoError("'" + path + "': '" + key + "' is \"" + text + "\", not an integer");
    if (value < lo || value > hi) throw lockstep::IoError("'" + path + "': '" + key + "' is " + text + ", outside " + range);
    return value;
}

// A resume continues the same run only with the same data order and batches: the checkpoint's
// seed, batch size and number of training images must be this run's.
inline void check_same_run(const nn::Checkpoint& ck, const std::string& path, const std::string& key, const std::string& flag,
                           const std::string& ours) {
    const auto it = ck.metadata.find(key);
    if (it == ck.metadata.end())
        throw lockstep::IoError("'" + path + "' does not record its " + flag + "; it was not written by this version's --save");
    if (it->second != ours)
        throw lockstep::InvalidArgument("'" + path + "' was written with " + flag + " " + it->second + " but this run has " +
                                        flag + " " + ours + ": the resumed run could not continue the same one; pass " + flag +
                                        " " + it->second + ", or start afresh from its weights with --init");
}

// The checkpoint of --resume, checked against this run, and the counters it continues from.
inline void load_resume(const Options& opt, const lockstep::data::IdxSource& train, int replicas,
                        std::optional<nn::Checkpoint>& resume, int& start_epoch, std::int64_t& epoch_step, std::int64_t& step) {
    resume = nn::Checkpoint::load(opt.resume);
    const auto& ck = *resume;
    check_same_run(ck, opt.resume, "seed", "--seed", std::to_string(opt.seed));
    check_same_run(ck, opt.resume, "batch", "--batch", std::to_string(opt.batch));
    check_same_run(ck, opt.resume, "train_images", "training images (--data, --train-limit)", std::to_string(train.count()));
    const auto batches = static_cast<std::int64_t>(batch_starts(train.count(), opt.batch, replicas).size()) - 1;
    start_epoch = static_cast<int>(counter(ck, opt.resume, "epoch", 0, opt.epochs,
                                           "[0, " + std::to_string(opt.epochs) + "] for --epochs " + std::to_string(opt.epochs)));
    epoch_step =
        counter(ck, opt.resume, "epoch_step", 0, batches - 1,
                "[0, " + std::to_string(batches - 1) + "]: an epoch of this data has " + std::to_string(batches) + " batches");
    step =
        counter(ck, opt.resume, "step", start_epoch * batches + epoch_step, INT64_MAX,
                "the steps its epoch and epoch_step imply (at least " + std::to_string(start_epoch * batches + epoch_step) + ")");
}

//! The error every process of a run reports when one of them failed to set up.
struct SetupError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

//! After each process has checked its own setup (options, devices, data files, checkpoints),
//! which needs no collective: every process learns whether any failed, and then all throw the
//! same SetupError naming the first failed process and quoting its error (comm::agreed_failure),
//! so that under mpirun every rank exits with the same message and none waits in a collective
//! for one that left. With no process group, `failure` is rethrown as it is.
inline void agree_on_setup(const std::shared_ptr<lockstep::comm::ProcessGroup>& procs, const std::exception_ptr& failure) {
    if (!procs) {
        if (failure) std::rethrow_exception(failure);
        return;
    }
    const std::string agreed = lockstep::comm::agreed_failure(*procs, lockstep::comm::ProcessGroup::control, failure);
    if (!agreed.empty()) throw SetupError(agreed);
}

//! Trains on backend `B` with one replica per entry of `devices` in this process, over the
//! processes of `procs` when there is one (run by mpirun); the exit code.
template <class B>
int train(const Options& opt, const std::vector<lockstep::Device>& devices,
          std::shared_ptr<lockstep::comm::ProcessGroup> procs = nullptr) {
    using Model = mnist::Net<B>;
    const int processes = procs ? procs->size() : 1;
    const int replicas = static_cast<int>(devices.size()) * processes;  // over all processes
    const bool leader = !procs || procs->rank() == 0;                   // prints and writes metrics
    nn::Generator gen(opt.seed);
    Model prototype(gen);
    nn::Sgd<B> sgd({.lr = opt.lr, .momentum = opt.momentum});
    std::int64_t step = 0, epoch_step = 0;
    int start_epoch = 0;
    std::optional<nn::Checkpoint> resume;
    std::optional<lockstep::data::IdxSource> train_data, test_data;
    std::exception_ptr setup_failure;
    try {  // this process's own checks, then agree_on_setup
        // Before any training, not after an epoch; process 0 alone writes checkpoints.
        if (!opt.save.empty() && leader) nn::Checkpoint::check_writable(opt.save);
        // Note [each process reads its rows]: the images stay in the files until a step needs them.
        // The network takes 28x28 images of 10 classes: anything else is refused when opened.
        train_data.emplace(find_file(opt.data, "train-images-idx3-ubyte"), find_file(opt.data, "train-labels-idx1-ubyte"),
                           lockstep::data::IdxOptions{.limit = opt.train_limit, .rows = 28, .cols = 28, .classes = 10});
        test_data.emplace(find_file(opt.data, "t10k-images-idx3-ubyte"), find_file(opt.data, "t10k-labels-idx1-ubyte"),
                          lockstep::data::IdxOptions{.limit = opt.test_limit, .rows = 28, .cols = 28, .classes = 10});
        const auto& train = *train_data;
        const auto& test = *test_data;
        if (train.count() < replicas)
            throw lockstep::InvalidArgument("only " + std::to_string(train.count()) + " training images for " +
                                            std::to_string(replicas) + " replicas");
        if (test.count() < replicas)
            throw lockstep::data::DataError(find_file(opt.data, "t10k-images-idx3-ubyte") + ": " + std::to_string(test.count()) +
                                            " test images, fewer than the " + std::to_string(replicas) +
                                            " replicas; the test set must give every replica an image");
        if (!opt.init.empty())
            nn::get_module(nn::Checkpoint::load(opt.init), prototype, {}, nn::Unmatched::refused, "optimizer.");
        if (!opt.resume.empty()) load_resume(opt, train, replicas, resume, start_epoch, epoch_step, step);
    } catch (...) {
        setup_failure = std::current_exception();
    }
    agree_on_setup(procs, setup_failure);
    const auto& train = *train_data;
    const auto& test = *test_data;
    // A step whose loss or gradients are NaN or infinite is refused (lockstep::NonFinite): the run
    // stops with the message, and nothing is saved over the last good checkpoint.
    DataParallel<Model> dp(prototype, devices,
                           {.check_finite = true,
                            .math = opt.math,
                            .precision = opt.precision,
                            .gradient_precision = opt.gradient_precision,
                            .graphs = opt.graphs,
                            .process_group = procs});
    if (resume) dp.load(*resume, sgd);  // model and momentum into every replica

    std::ofstream metrics;
    if (!opt.metrics.empty() && leader) {
        metrics.open(opt.metrics, resume ? std::ios::app : std::ios::trunc);
        if (!metrics) throw lockstep::IoError(opt.metrics + ": cannot open the metrics file for writing");
    }
    const auto write_metrics = [&](const nlohmann::json& line) {
        if (opt.metrics.empty() || !leader) return;
        metrics << line.dump() << '\n' << std::flush;
        if (!metrics) throw lockstep::IoError(opt.metrics + ": writing the metrics failed (disk full?)");
    };
    const auto save = [&](int epoch, std::int64_t in_epoch) {
        if (opt.save.empty()) return;
        nn::Checkpoint ck = dp.checkpoint(sgd);
        ck.metadata = {{"step", std::to_string(step)},
                       {"epoch", std::to_string(epoch)},
                       {"epoch_step", std::to_string(in_epoch)},
                       {"seed", std::to_string(opt.seed)},
                       {"batch", std::to_string(opt.batch)},
                       {"train_images", std::to_string(train.count())},
                       {"format", "pt"}};
        for (const auto& stale : dp.save(ck, opt.save).removed_stale)
            std::fprintf(stderr, "mnist: removed %s, left by an earlier save that was killed\n", stale.c_str());
    };

    const bool tty = isatty(STDOUT_FILENO) != 0 && !opt.quiet && leader;
    const bool quiet = opt.quiet || !leader;
    const auto t_start = Clock::now();
    std::int64_t images = 0;
    double train_seconds = 0;  // time in the training loops, without evaluation
    bool stopped = false;
    Eval last{};
    std::int64_t evaluations = 0;
    for (int epoch = start_epoch; epoch < opt.epochs && !stopped; ++epoch) {
        const auto order = epoch_order(train.count(), opt.seed, epoch, !opt.no_shuffle);
        const auto starts = batch_starts(train.count(), opt.batch, replicas);
        const auto total = static_cast<std::int64_t>(starts.size()) - 1;
        const auto t_epoch = Clock::now();
        auto t_print = t_epoch;
        double loss_sum = 0;
        std::int64_t loss_count = 0, epoch_images = 0;
        Tensor<float> x;
        std::vector<std::int64_t> labels;
        std::int64_t b = epoch == start_epoch ? epoch_step : 0;
        for (; b < total; ++b) {
            if (opt.steps > 0 && step >= opt.steps) {
                stopped = true;
                break;
            }
            const std::int64_t n = starts[static_cast<std::size_t>(b + 1)] - starts[static_cast<std::size_t>(b)];
            const auto [first, count] = my_rows(dp, n);
            make_batch(train, order, starts[static_cast<std::size_t>(b)] + first, count, x, labels);
            const auto t0 = Clock::now();
            lockstep::StepResult res;
            if constexpr (std::is_same_v<B, lockstep::Host>)
                res = dp.train_step(x, labels, nn::SoftmaxCrossEntropy{}, sgd);
            else
                res = dp.train_step(x.template to<B>(devices[0]), labels, nn::SoftmaxCrossEntropy{}, sgd);
            const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
            ++step;
            images += n;
            epoch_images += n;
            loss_sum += res.loss * static_cast<double>(n);
            loss_count += n;
            write_metrics({{"kind", "step"},
                           {"step", step},
                           {"epoch", epoch},
                           {"loss", res.loss},
                           {"images_per_s", static_cast<double>(n) / secs}});
            const double elapsed = std::chrono::duration<double>(Clock::now() - t_epoch).count();
            const double rate = static_cast<double>(epoch_images) / std::max(elapsed, 1e-9);
            const double eta =
                static_cast<double>(train.count() - starts[static_cast<std::size_t>(b + 1)]) / std::max(rate, 1e-9);
            if (tty) {
                const int width = 30, filled = static_cast<int>(width * (b + 1) / total);
                std::printf("\repoch %d/%d [%s%s] %lld/%lld loss %.4f %6.0f img/s ETA %s   ", epoch + 1, opt.epochs,
                            std::string(static_cast<std::size_t>(filled), '=').c_str(),
                            std::string(static_cast<std::size_t>(width - filled), ' ').c_str(), static_cast<long long>(b + 1),
                            static_cast<long long>(total), res.loss, rate, clock_text(eta).c_str());
                std::fflush(stdout);
            } else if (!quiet && std::chrono::duration<double>(Clock::now() - t_print).count() >= 5.0) {
                t_print = Clock::now();
                std::printf("epoch %d/%d step %lld/%lld loss %.4f %.0f img/s ETA %s\n", epoch + 1, opt.epochs,
                            static_cast<long long>(b + 1), static_cast<long long>(total), res.loss, rate,
                            clock_text(eta).c_str());
                std::fflush(stdout);
            }
        }
        if (tty) std::printf("\n");
        const double epoch_train_s = std::chrono::duration<double>(Clock::now() - t_epoch).count();
        train_seconds += epoch_train_s;
        const bool complete = b == total;
        save(complete ? epoch + 1 : epoch, complete ? 0 : b);
        if (!complete) break;
        last = evaluate(dp, test);
        ++evaluations;
        const double secs = std::chrono::duration<double>(Clock::now() - t_epoch).count();
        const double train_loss = loss_count ? loss_sum / static_cast<double>(loss_count) : 0.0;
        if (!quiet)
            std::printf("epoch %d: train loss %.4f, test loss %.4f, test accuracy %.4f, %.1f s, %.0f img/s training\n", epoch + 1,
                        train_loss, last.loss, last.accuracy, secs, static_cast<double>(epoch_images) / epoch_train_s);
        write_metrics({{"kind", "epoch"},
                       {"epoch", epoch},
                       {"train_loss", train_loss},
                       {"test_loss", last.loss},
                       {"test_accuracy", last.accuracy},
                       {"seconds", secs}});
    }
    if (evaluations == 0) {
        last = evaluate(dp, test);
        ++evaluations;
    }
    write_metrics({{"kind", "final"}, {"test_loss", last.loss}, {"test_accuracy", last.accuracy}});
    {  // Note [each process reads its rows]: what each process read, against what the run used
        const auto P = static_cast<std::size_t>(processes), p = static_cast<std::size_t>(procs ? procs->rank() : 0);
        std::vector<double> read(2 * P, 0.0);  // images read, then gzipped files inflated, by process
        read[p] = static_cast<double>(train.images_read() + test.images_read());
        read[P + p] = static_cast<double>(train.inflated()) + static_cast<double>(test.inflated());
        if (procs)
            procs->channel(lockstep::comm::ProcessGroup::control)
                .all_reduce_sum(lockstep::DeviceSpan<double>::host(read), lockstep::comm::CollectiveSite::user(2));
        write_metrics({{"kind", "data"},
                       {"images_read", std::vector<double>(read.begin(), read.begin() + static_cast<std::ptrdiff_t>(P))},
                       {"files_inflated", std::vector<double>(read.begin() + static_cast<std::ptrdiff_t>(P), read.end())},
                       {"images_used", images + evaluations * test.count()}});
    }
    const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
    // Captured steps (--graphs): replica 0's graphs captured and launched.
    const std::string graphs = opt.graphs ? " | graphs: " + std::to_string(dp.captured_graphs(0)) + " captured, " +
                                                std::to_string(dp.graph_launches(0)) + " launched"
                                          : "";
    if (leader)
        std::printf("test accuracy %.4f | replicas %d%s | backend %s | %lld steps | %.1f s total | %.0f img/s training%s\n",
                    last.accuracy, replicas, procs ? (" over " + std::to_string(processes) + " processes").c_str() : "",
                    std::string(B::name).c_str(), static_cast<long long>(step), total_s,
                    train_seconds > 0 ? static_cast<double>(images) / train_seconds : 0.0, graphs.c_str());
    if (opt.expect_accuracy >= 0 && last.accuracy < opt.expect_accuracy) {
        std::fprintf(stderr, "mnist: test accuracy %.4f is below the expected %.4f\n", last.accuracy, opt.expect_accuracy);
        return 1;
    }
    return 0;
}

}  // namespace mnist_example
