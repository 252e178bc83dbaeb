// SPDX-License-Identifier: MIT
//! The seed's MNIST conv-net written in libtorch, with lockstep's SyncBatchNorm, trained on real
//! IDX data (by default Fashion-MNIST from Debian's dataset-fashion-mnist) by
//! lockstep::torch::DataParallel on host replicas; evaluates it on the test set after each epoch.
//! Usage: torch_mnist [--replicas 2] [--epochs 2] [--batch 64] [--lr 0.01] [--data DIR] ...
#include <CLI/CLI.hpp>
#include <lockstep/data/idx.hpp>
#include <lockstep/torch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "net.hpp"

namespace {

using torch_mnist::Net;
using torch_mnist::NetImpl;


// Samples order[begin, begin + n) as an (n, 1, 28, 28) batch scaled to [0, 1], and their labels.
std::pair<torch::Tensor, torch::Tensor> batch(const lockstep::data::IdxSource& ds, const std::vector<std::int64_t>& order,
                                              std::int64_t begin, std::int64_t n) {
    auto pixels = torch::empty({n, 1, 28, 28}, torch::kUInt8);
    auto labels = torch::empty({n}, torch::kLong);
    auto* px = pixels.data_ptr<std::uint8_t>();
    auto* lab = labels.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < n; ++i) {
        const auto s = order[static_cast<std::size_t>(begin + i)];
        ds.read_images(s, 1, px + i * ds.image_bytes());
        lab[i] = ds.label(s);
    }
    return {pixels.to(torch::kFloat).div_(255.0), labels};
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"lockstep for libtorch: the seed's conv-net with SyncBatchNorm, data-parallel on Fashion-MNIST"};
    int replicas = 2, epochs = 2;
    std::int64_t batch_size = 64, train_limit = 0, test_limit = 0, steps = 0;
    double lr = 0.01, momentum = 0.9, expect_accuracy = 0;
    std::uint64_t seed = 1;
    std::string data = "/usr/share/datasets/fashion-mnist", save;
    std::vector<int> devices;
    app.add_option("--replicas", replicas, "host replicas")->check(CLI::Range(1, 256));
    app.add_option("--devices", devices, "CUDA devices to train on (one replica each; CPU replicas when empty)");
    app.add_option("--epochs", epochs, "epochs")->check(CLI::Range(1, 1000));
    app.add_option("--batch", batch_size, "global batch size")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
    app.add_option("--lr", lr, "SGD learning rate")->check(CLI::Range(0.0, 100.0));
    app.add_option("--momentum", momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0));
    app.add_option("--seed", seed, "seed for initialization and shuffling");
    app.add_option("--steps", steps, "stop after this many steps in total");
    app.add_option("--train-limit", train_limit, "use only the first M training images");
    app.add_option("--test-limit", test_limit, "evaluate on the first M test images only");
    app.add_option("--data", data, "directory with the IDX files (gzipped or not)");
    app.add_option("--save", save, "write the model as safetensors here at the end (atomic; PyTorch loads it)");
    app.add_option("--expect-accuracy", expect_accuracy, "exit with 1 if the final test accuracy is lower");
    CLI11_PARSE(app, argc, argv);

    try {
        const auto file = [&](const char* name) {
            for (const char* suffix : {"", ".gz"})
                if (std::FILE* f = std::fopen((data + "/" + name + suffix).c_str(), "rb")) {
                    std::fclose(f);
                    return data + "/" + name + suffix;
                }
            throw lockstep::data::DataError(data + "/" + name +
                                            "[.gz] not found; pass --data DIR (Debian: dataset-fashion-mnist)");
        };
        const lockstep::data::IdxSource train(file("train-images-idx3-ubyte"), file("train-labels-idx1-ubyte"),
                                              {.limit = train_limit, .rows = 28, .cols = 28, .classes = 10});
        const lockstep::data::IdxSource test(file("t10k-images-idx3-ubyte"), file("t10k-labels-idx1-ubyte"),
                                             {.limit = test_limit, .rows = 28, .cols = 28, .classes = 10});

        torch::manual_seed(seed);
        Net net;
        std::vector<torch::Device> where;
        for (const int d : devices) where.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(d));
        if (where.empty()) where.assign(static_cast<std::size_t>(replicas), torch::kCPU);
        net->to(where.front());  // a CUDA module for GPU replicas (each replica is cloned to its own)
        lockstep::torch::DataParallel dp(net, where, [&](NetImpl& m) -> std::unique_ptr<torch::optim::Optimizer> {
            return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
        });
        const auto loss = [](const torch::Tensor& out, const torch::Tensor& y) {
            return torch::nn::functional::cross_entropy(out, y);
        };
        std::printf(
            "lockstep::torch: %d replicas (%s), libtorch %s, %d intra-op threads each, %lld training and %lld test images\n",
            dp.size(), where.front().str().c_str(), TORCH_VERSION, dp.intra_op_threads(), static_cast<long long>(train.count()),
            static_cast<long long>(test.count()));

        std::vector<std::int64_t> order(static_cast<std::size_t>(train.count()));
        std::mt19937_64 rng(seed);
        std::int64_t done = 0;
        double accuracy = 0;
        for (int epoch = 1; epoch <= epochs && (steps == 0 || done < steps); ++epoch) {
            std::iota(order.begin(), order.end(), 0);
            std::shuffle(order.begin(), order.end(), rng);
            dp.train();
            const auto t0 = std::chrono::steady_clock::now();
            double loss_sum = 0;
            std::int64_t seen = 0, correct = 0;
            for (std::int64_t b = 0; b + dp.size() <= train.count() && (steps == 0 || done < steps); b += batch_size) {
                const auto n = std::min(batch_size, train.count() - b);
                const auto [x, y] = batch(train, order, b, n);
                const auto r = dp.train_step(x, y, loss);
                loss_sum += r.loss * static_cast<double>(r.count);
                seen += r.count;
                correct += r.correct;
                ++done;
            }
            const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            dp.eval();
            std::vector<std::int64_t> all(static_cast<std::size_t>(test.count()));
            std::iota(all.begin(), all.end(), 0);
            std::int64_t right = 0, evaluated = 0;
            for (std::int64_t b = 0; b < test.count();) {
                // A last batch smaller than the replicas joins the one before it.
                auto n = std::min<std::int64_t>(1000, test.count() - b);
                if (test.count() - (b + n) < dp.size()) n = test.count() - b;
                const auto [x, y] = batch(test, all, b, n);
                right += dp.forward(x).argmax(1).eq(y).sum().item<std::int64_t>();
                evaluated += n;
                b += n;
            }
            accuracy = static_cast<double>(right) / static_cast<double>(std::max<std::int64_t>(evaluated, 1));
            std::printf("epoch %d: train loss %.4f, train accuracy %.2f%%, test accuracy %.2f%%, %.0f images/s\n", epoch,
                        loss_sum / static_cast<double>(std::max<std::int64_t>(seen, 1)),
                        100.0 * static_cast<double>(correct) / static_cast<double>(std::max<std::int64_t>(seen, 1)),
                        100.0 * accuracy, static_cast<double>(seen) / seconds);
            std::fflush(stdout);
        }
        if (!save.empty()) std::printf("saved %s\n", dp.save(save).written.c_str());
        if (accuracy < expect_accuracy) {
            std::fprintf(stderr, "torch_mnist: test accuracy %.4f is below --expect-accuracy %.4f\n", accuracy, expect_accuracy);
            return 1;
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "torch_mnist: %s\n", e.what());
        return 2;
    }
    return 0;
}
