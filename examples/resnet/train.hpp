// SPDX-License-Identifier: MIT
//! The residual example's training on any backend: main.cpp runs it on the host, cuda_train.cu
//! instantiates it for CUDA (compiled by nvcc).
#pragma once

#include <lockstep/data/idx.hpp>
#include <lockstep/data/loader.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "net.hpp"
#include "options.hpp"

namespace resnet {

inline std::string find_file(const std::string& dir, const std::string& name) {
    for (const auto& candidate : {dir + "/" + name, dir + "/" + name + ".gz"})
        if (std::filesystem::exists(candidate)) return candidate;
    throw lockstep::data::DataError(dir + "/" + name + "[.gz] not found; pass --data DIR (Debian: dataset-fashion-mnist)");
}

// A one-line progress bar on stderr: the epoch's batches done, the loss so far, images per second.
inline void progress(int epoch, std::int64_t done, std::int64_t total, double loss, double rate) {
    const int width = 30, filled = static_cast<int>(width * done / std::max<std::int64_t>(total, 1));
    std::fprintf(stderr, "\repoch %d [%s%s] %lld/%lld loss %.4f %.0f img/s", epoch, std::string(filled, '=').c_str(),
                 std::string(width - filled, ' ').c_str(), static_cast<long long>(done), static_cast<long long>(total), loss,
                 rate);
    if (done == total) std::fputc('\n', stderr);
}

//! A host batch on the replicas' first device: the batch itself on the host backend (a
//! reference, no copy), a copy on the device otherwise.
template <class B>
decltype(auto) on_device(const lockstep::Tensor<float>& x, const lockstep::Device& d) {
    if constexpr (std::is_same_v<B, lockstep::Host>)
        return (x);
    else
        return x.template to<B>(d);
}

//! Test accuracy: each gathered row's largest logit against the label, read on the host.
template <class Dp>
double accuracy(Dp& dp, const lockstep::data::IdxSource& test) {
    using B = typename Dp::backend;
    dp.eval();
    lockstep::data::BatchLoader loader(test, {.batch_size = 1000, .shuffle = false});
    loader.start_epoch(0);
    std::int64_t correct = 0;
    while (auto b = loader.next()) {
        // A last batch smaller than the replicas goes to replica 0 alone.
        const auto logits = dp.forward(on_device<B>(b->x, dp.devices()[0])).to_host();
        const std::int64_t classes = logits.dim(1);
        for (std::int64_t i = 0; i < logits.dim(0); ++i) {
            const float* row = logits.data() + i * classes;
            correct += std::max_element(row, row + classes) - row == b->labels[static_cast<std::size_t>(i)];
        }
    }
    dp.train();
    return static_cast<double>(correct) / static_cast<double>(test.size());
}

template <class B, class Net>
int train_net(const Options& o, Net net, const std::vector<lockstep::Device>& devices) {
    namespace data = lockstep::data;
    const data::IdxSource train(find_file(o.data, "train-images-idx3-ubyte"), find_file(o.data, "train-labels-idx1-ubyte"),
                                {.limit = o.train_limit, .rows = 28, .cols = 28, .classes = 10});
    const data::IdxSource test(find_file(o.data, "t10k-images-idx3-ubyte"), find_file(o.data, "t10k-labels-idx1-ubyte"),
                               {.limit = o.test_limit, .rows = 28, .cols = 28, .classes = 10});
    lockstep::DataParallelOptions dpo;
    dpo.math = o.math;
    lockstep::DataParallel<Net> dp(std::move(net), devices, dpo);
    nn::AdamW<B> adamw({.lr = o.lr, .weight_decay = o.weight_decay}, {nn::no_decay_on_norms_and_biases()});
    // drop_last: every batch has at least as many samples as replicas.
    data::BatchLoader loader(train, {.batch_size = o.batch, .seed = o.seed, .drop_last = true, .memory = o.batch_memory});
    const std::int64_t per_epoch = loader.batches_per_epoch();
    const std::int64_t total = o.steps > 0 ? std::min(o.steps, per_epoch * o.epochs) : per_epoch * o.epochs;
    const nn::CosineWithWarmup schedule(o.lr, std::max<std::int64_t>(1, per_epoch / 2), per_epoch * o.epochs);
    std::printf("resnet: %lld parameters, %zu replicas on %s, %lld steps of %lld images%s\n",
                static_cast<long long>(nn::parameter_count(dp.module())), devices.size(), o.backend.c_str(),
                static_cast<long long>(total), static_cast<long long>(o.batch), o.gate ? ", with channel gates" : "");
    std::ofstream metrics;
    if (!o.metrics.empty()) {
        metrics.open(o.metrics);
        if (!metrics) throw lockstep::IoError("cannot write --metrics " + o.metrics);
        metrics.precision(17);  // every bit of a loss, for comparisons to 0
    }
    const auto start = std::chrono::steady_clock::now();
    double acc = 0;
    std::int64_t step = 0;
    for (int epoch = 1; epoch <= o.epochs && step < total; ++epoch) {
        const auto t0 = std::chrono::steady_clock::now();
        loader.start_epoch(epoch);
        double loss = 0;
        std::int64_t seen = 0;
        while (step < total) {
            auto b = loader.next();
            if (!b) break;
            adamw.set_lr(schedule.lr(step));
            const auto r = dp.train_step(on_device<B>(b->x, devices[0]), b->labels, nn::SoftmaxCrossEntropy{}, adamw);
            if (metrics.is_open()) metrics << R"({"kind": "step", "step": )" << step << R"(, "loss": )" << r.loss << "}\n";
            ++step;
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
                    loss / static_cast<double>(std::max<std::int64_t>(seen, 1)), acc, train_s,
                    static_cast<double>(seen) / train_s);
        std::fflush(stdout);
    }
    const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("test accuracy %.4f | replicas %zu | %lld steps | %.1f s total\n", acc, devices.size(),
                static_cast<long long>(step), total_s);
    if (metrics.is_open()) {
        metrics << R"({"kind": "test", "accuracy": )" << acc << "}\n";
        metrics.flush();
        if (!metrics) throw lockstep::IoError("cannot write --metrics " + o.metrics);
    }
    if (o.expect_accuracy > 0 && acc < o.expect_accuracy) {
        std::fprintf(stderr, "resnet: test accuracy %.4f is below the expected %.4f\n", acc, o.expect_accuracy);
        return 1;
    }
    return 0;
}

//! Trains the network (with channel gates if asked) on backend B, one replica per device.
template <class B>
int train(const Options& o, const std::vector<lockstep::Device>& devices) {
    nn::Generator gen(o.seed);
    if (o.gate) return train_net<B>(o, make_gated_net<B>(o.width, gen), devices);
    return train_net<B>(o, make_net<B>(o.width, gen), devices);
}

}  // namespace resnet
