// SPDX-License-Identifier: MIT
//! A small residual network trained data-parallel on Fashion-MNIST with the kit for real models:
//! residual blocks with SyncBatchNorm, a global average pool, AdamW without weight decay on norms
//! and biases, a cosine schedule with warm-up, and lockstep::data's loader (examples/resnet/README.md).
#include <CLI/CLI.hpp>
#include <lockstep/data/idx.hpp>
#include <lockstep/data/loader.hpp>
#include <lockstep/host.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "net.hpp"

using namespace lockstep;

namespace {

struct Options {
    std::string data = "/usr/share/datasets/fashion-mnist";
    int epochs = 8;
    int replicas = 2;
    std::int64_t batch = 128;
    std::int64_t width = 16;
    double lr = 3e-3;
    double weight_decay = 0.05;
    std::int64_t train_limit = 0, test_limit = 0;
    std::uint64_t seed = 1;
    double expect_accuracy = 0;
    bool progress = ::isatty(2) != 0;
};

std::string find_file(const std::string& dir, const std::string& name) {
    for (const auto& candidate : {dir + "/" + name, dir + "/" + name + ".gz"})
        if (std::filesystem::exists(candidate)) return candidate;
    throw data::DataError(dir + "/" + name + "[.gz] not found; pass --data DIR (Debian: dataset-fashion-mnist)");
}

// A one-line progress bar on stderr: the epoch's batches done, the loss so far, images per second.
void progress(int epoch, std::int64_t done, std::int64_t total, double loss, double rate) {
    const int width = 30, filled = static_cast<int>(width * done / std::max<std::int64_t>(total, 1));
    std::fprintf(stderr, "\repoch %d [%s%s] %lld/%lld loss %.4f %.0f img/s", epoch, std::string(filled, '=').c_str(),
                 std::string(width - filled, ' ').c_str(), static_cast<long long>(done), static_cast<long long>(total), loss,
                 rate);
    if (done == total) std::fputc('\n', stderr);
}

template <class Dp>
double accuracy(Dp& dp, const data::IdxSource& test) {
    dp.eval();
    data::BatchLoader loader(test, {.batch_size = 1000, .shuffle = false});
    loader.start_epoch(0);
    std::int64_t correct = 0;
    while (auto b = loader.next()) {
        // A last batch smaller than the replicas goes to replica 0 alone.
        const auto out = nn::SoftmaxCrossEntropy{}(nn::Context{}, dp.forward(b->x), b->labels);
        correct += out.correct();
    }
    dp.train();
    return static_cast<double>(correct) / static_cast<double>(test.size());
}

int run(const Options& o) {
    const data::IdxSource train(find_file(o.data, "train-images-idx3-ubyte"), find_file(o.data, "train-labels-idx1-ubyte"),
                                {.limit = o.train_limit, .rows = 28, .cols = 28, .classes = 10});
    const data::IdxSource test(find_file(o.data, "t10k-images-idx3-ubyte"), find_file(o.data, "t10k-labels-idx1-ubyte"),
                               {.limit = o.test_limit, .rows = 28, .cols = 28, .classes = 10});
    nn::Generator gen(o.seed);
    DataParallel dp(resnet::make_net<Host>(o.width, gen), o.replicas);
    nn::AdamW adamw({.lr = o.lr, .weight_decay = o.weight_decay}, {nn::no_decay_on_norms_and_biases()});
    // drop_last: every batch has at least as many samples as replicas.
    data::BatchLoader loader(train, {.batch_size = o.batch, .seed = o.seed, .drop_last = true});
    const std::int64_t per_epoch = loader.batches_per_epoch(), total = per_epoch * o.epochs;
    const nn::CosineWithWarmup schedule(o.lr, std::max<std::int64_t>(1, per_epoch / 2), total);
    std::printf("resnet: %lld parameters, %d replicas, %lld steps of %lld images\n",
                static_cast<long long>(nn::parameter_count(dp.module())), o.replicas, static_cast<long long>(total),
                static_cast<long long>(o.batch));
    const auto start = std::chrono::steady_clock::now();
    double acc = 0;
    std::int64_t step = 0;
    for (int epoch = 1; epoch <= o.epochs; ++epoch) {
        const auto t0 = std::chrono::steady_clock::now();
        loader.start_epoch(epoch);
        double loss = 0;
        std::int64_t seen = 0;
        while (auto b = loader.next()) {
            adamw.set_lr(schedule.lr(step++));
            const auto r = dp.train_step(b->x, b->labels, nn::SoftmaxCrossEntropy{}, adamw);
            loss += r.loss * static_cast<double>(r.count);
            seen += r.count;
            if (o.progress) {
                const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                progress(epoch, b->index + 1, per_epoch, loss / static_cast<double>(seen), static_cast<double>(seen) / s);
            }
        }
        const double train_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        acc = accuracy(dp, test);
        std::printf("epoch %d: train loss %.4f, test accuracy %.4f, %.1f s, %.0f img/s training\n", epoch,
                    loss / static_cast<double>(seen), acc, train_s, static_cast<double>(seen) / train_s);
        std::fflush(stdout);
    }
    const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("test accuracy %.4f | replicas %d | %lld steps | %.1f s total\n", acc, o.replicas, static_cast<long long>(step),
                total_s);
    if (o.expect_accuracy > 0 && acc < o.expect_accuracy) {
        std::fprintf(stderr, "resnet: test accuracy %.4f is below the expected %.4f\n", acc, o.expect_accuracy);
        return 1;
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    CLI::App app{"lockstep: a residual network on Fashion-MNIST, data-parallel on host replicas"};
    app.add_option("--data", o.data, "directory of the IDX files (gzipped or not)");
    app.add_option("--epochs", o.epochs, "epochs")->check(CLI::PositiveNumber);
    app.add_option("--replicas", o.replicas, "host replicas (threads)")->check(CLI::PositiveNumber);
    app.add_option("--batch", o.batch, "global batch")->check(CLI::PositiveNumber);
    app.add_option("--width", o.width, "channels of the first stage (the others: 2x and 4x)")->check(CLI::PositiveNumber);
    app.add_option("--lr", o.lr, "AdamW's peak learning rate (cosine schedule, warm-up over half an epoch)");
    app.add_option("--weight-decay", o.weight_decay, "AdamW's weight decay (none on norms and biases)");
    app.add_option("--train-limit", o.train_limit, "train on the first N images only");
    app.add_option("--test-limit", o.test_limit, "test on the first N images only");
    app.add_option("--seed", o.seed, "initialization and data order");
    app.add_option("--expect-accuracy", o.expect_accuracy, "exit 1 below this test accuracy");
    app.add_flag("--progress,!--no-progress", o.progress, "a progress bar on stderr (default: when it is a terminal)");
    CLI11_PARSE(app, argc, argv);
    try {
        return run(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "resnet: %s\n", e.what());
        return 2;
    }
}
