// SPDX-License-Identifier: MIT
//! Helper for the MNIST example's tests:
//!   mnist_tool losses A.jsonl B.jsonl TOL        per-step losses agree to relative TOL (0: bit-equal)
//!   mnist_tool differ A.jsonl B.jsonl            the runs' first step losses differ (as many steps in each)
//!   mnist_tool checkpoints A B TOL               every tensor: ||a - b|| <= TOL (||b|| + 1e-3) (0: bit-equal)
//!   mnist_tool accuracy A.jsonl B.jsonl TOL      the runs' final test accuracies differ by at most TOL
//!   mnist_tool make-data DIR KIND                writes IDX files to DIR: KIND = good | bad-magic |
//!                                                truncated | count-mismatch | bad-label | empty-test |
//!                                                tail-test (1001 test images) | huge-header
//!   mnist_tool other-model FILE                  writes a checkpoint of a different model
//!   mnist_tool set-metadata IN OUT KEY VALUE     a copy of checkpoint IN with metadata KEY = VALUE
//!   mnist_tool mkfifo PATH                       makes a FIFO at PATH
//!   mnist_tool data METRICS.jsonl P [N]          the run's P processes read every image it used
//!                                                once, each about its 1/P share (not the data set),
//!                                                and inflated each gzipped file at most once (with
//!                                                N: exactly N inflations over all processes)
#include <sys/stat.h>

#include <lockstep/nn.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace {

std::vector<double> losses(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::vector<double> out;
    std::string line;
    while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line);
        if (j.at("kind") == "step") out.push_back(j.at("loss").get<double>());
    }
    return out;
}

bool close(double a, double b, double tol) {
    if (tol == 0) return std::memcmp(&a, &b, sizeof a) == 0;
    return std::abs(a - b) <= tol * std::max(std::abs(b), 1e-12);
}

int compare_losses(const std::string& a, const std::string& b, double tol) {
    const auto la = losses(a), lb = losses(b);
    if (la.size() != lb.size() || la.empty()) {
        std::fprintf(stderr, "%zu steps in %s but %zu in %s\n", la.size(), a.c_str(), lb.size(), b.c_str());
        return 1;
    }
    for (std::size_t i = 0; i < la.size(); ++i) {
        if (!close(la[i], lb[i], tol)) {
            std::fprintf(stderr, "step %zu: loss %.17g vs %.17g (tolerance %g)\n", i + 1, la[i], lb[i], tol);
            return 1;
        }
    }
    std::printf("%zu step losses agree (tolerance %g)\n", la.size(), tol);
    return 0;
}

// Two runs that must not be the same computation (another precision): as many steps, and the
// first step's loss differs.
int losses_differ(const std::string& a, const std::string& b) {
    const auto la = losses(a), lb = losses(b);
    if (la.size() != lb.size() || la.empty()) {
        std::fprintf(stderr, "%zu steps in %s but %zu in %s\n", la.size(), a.c_str(), lb.size(), b.c_str());
        return 1;
    }
    if (la[0] == lb[0]) {
        std::fprintf(stderr, "step 1: both runs have loss %.17g; they should differ\n", la[0]);
        return 1;
    }
    std::printf("step 1: loss %.17g vs %.17g differ\n", la[0], lb[0]);
    return 0;
}

// The run's final test accuracy (its "final" metrics line).
double final_accuracy(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::string line;
    double accuracy = -1;
    while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line);
        if (j.at("kind") == "final") accuracy = j.at("test_accuracy").get<double>();
    }
    if (accuracy < 0) throw std::runtime_error(path + " has no final test accuracy");
    return accuracy;
}

int compare_accuracy(const std::string& a, const std::string& b, double tol) {
    const double x = final_accuracy(a), y = final_accuracy(b);
    if (!(std::abs(x - y) <= tol)) {
        std::fprintf(stderr, "test accuracy %.4f in %s vs %.4f in %s (tolerance %g)\n", x, a.c_str(), y, b.c_str(), tol);
        return 1;
    }
    std::printf("test accuracies %.4f and %.4f agree (tolerance %g)\n", x, y, tol);
    return 0;
}

int compare_checkpoints(const std::string& a, const std::string& b, double tol) {
    const auto ca = lockstep::nn::Checkpoint::load(a), cb = lockstep::nn::Checkpoint::load(b);
    if (ca.names() != cb.names()) {
        std::fprintf(stderr, "the checkpoints hold different tensors\n");
        return 1;
    }
    for (const auto& name : ca.names()) {
        const auto& ea = ca.at(name);
        const auto& eb = cb.at(name);
        if (ea.dtype != eb.dtype || ea.shape != eb.shape) {
            std::fprintf(stderr, "%s: dtype or shape differ\n", name.c_str());
            return 1;
        }
        if (ea.dtype == "I64" || tol == 0) {
            if (ea.data != eb.data) {
                std::fprintf(stderr, "%s: bytes differ\n", name.c_str());
                return 1;
            }
            continue;
        }
        // Per tensor ||a - b|| <= tol * (||b|| + 1e-3) (2-norms): relative, except for tensors of
        // norm near 0. Gradients that are zero in exact arithmetic (the conv biases: batch norm
        // follows each conv and cancels any shift) leave only rounding noise in their momentum
        // buffers, 1e-6 to 1e-5 depending on the convolution's algorithm, where no relative measure
        // means anything: those are bounded absolutely, by tol * 1e-2.
        // Normwise, not per element: where replicas split the batch differently,
        // float rounding can tip a ReLU or max-pool decision at a near-tie, which moves a few
        // gradients by far more than rounding, and batch norm spreads that over the channel.
        const auto* fa = reinterpret_cast<const float*>(ea.data.data());
        const auto* fb = reinterpret_cast<const float*>(eb.data.data());
        double diff2 = 0, norm2 = 0;
        for (std::size_t i = 0; i < ea.data.size() / 4; ++i) {
            const double d = static_cast<double>(fa[i]) - fb[i];
            diff2 += d * d;
            norm2 += static_cast<double>(fb[i]) * fb[i];
        }
        static const std::set<std::string> exact_zero{"optimizer.conv1.bias.momentum_buffer",
                                                      "optimizer.conv2.bias.momentum_buffer"};
        const double bound = exact_zero.count(name) != 0 ? tol * 1e-2 : tol * (std::sqrt(norm2) + 1e-3);
        if (std::sqrt(diff2) > bound) {
            std::fprintf(stderr, "%s: ||a - b|| = %.3g with ||b|| = %.3g exceeds tolerance %g\n", name.c_str(), std::sqrt(diff2),
                         std::sqrt(norm2), tol);
            return 1;
        }
    }
    std::printf("%zu tensors agree (tolerance %g)\n", ca.names().size(), tol);
    return 0;
}

void put32(std::ofstream& out, std::uint32_t v) {
    const unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                                static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
    out.write(reinterpret_cast<const char*>(b), 4);
}

// A small, learnable IDX set (each class a different bright band), optionally corrupted.
int make_data(const std::string& dir, const std::string& kind) {
    std::filesystem::create_directories(dir);
    for (const std::string split : {"train", "t10k"}) {
        const std::uint32_t test_images = kind == "empty-test" ? 0 : kind == "tail-test" ? 1001 : 40;
        const std::uint32_t n = split == "train" ? 120 : test_images;
        std::ofstream img(dir + "/" + split + "-images-idx3-ubyte", std::ios::binary);
        put32(img, kind == "bad-magic" ? 0x0803u + 1 : 0x0803u);
        const bool huge = kind == "huge-header" && split == "train";  // sizes whose product overflows 64 bits
        put32(img, huge ? 0xFFFFFFFFu : n);
        put32(img, huge ? 0xFFFFFFFFu : 28);
        put32(img, huge ? 0xFFFFFFFFu : 28);
        const std::uint32_t written = kind == "truncated" ? n - 1 : n;
        for (std::uint32_t i = 0; i < written; ++i)
            for (int p = 0; p < 784; ++p)
                img.put(static_cast<char>((p / 28) / 3 == static_cast<int>(i % 10) ? 200 + (i * 7 + p) % 50 : (i * 13 + p) % 40));
        std::ofstream lab(dir + "/" + split + "-labels-idx1-ubyte", std::ios::binary);
        put32(lab, 0x0801u);
        const std::uint32_t labels = kind == "count-mismatch" ? n - 2 : n;
        put32(lab, labels);
        for (std::uint32_t i = 0; i < labels; ++i) lab.put(static_cast<char>(kind == "bad-label" && i == 17 ? 12 : i % 10));
    }
    return 0;
}

// A copy of checkpoint `in` with metadata `key` set to `value` (a forged --resume file).
int set_metadata(const std::string& in, const std::string& out, const std::string& key, const std::string& value) {
    auto ck = lockstep::nn::Checkpoint::load(in);
    ck.metadata[key] = value;
    ck.save(out);
    return 0;
}

int make_fifo(const std::string& path) {
    std::filesystem::remove(path);
    if (::mkfifo(path.c_str(), 0600) != 0) {
        std::perror("mkfifo");
        return 1;
    }
    return 0;
}

int other_model(const std::string& path) {
    lockstep::nn::Sequential net(lockstep::nn::Linear<>(4, 3));
    lockstep::nn::save(path, net);
    return 0;
}

// The "data" line of a run's metrics: every image the run used (trained on or evaluated) was read
// from the files exactly once over all processes, each process reading its share: at most
// used / P + one image per batch (shards differ by one row) and never the whole data set.
int check_data(const std::string& path, int processes, int want_inflations) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::string line;
    nlohmann::json data;
    while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line);
        if (j.at("kind") == "data") data = j;
    }
    if (data.is_null()) throw std::runtime_error(path + " has no \"data\" line");
    const auto read = data.at("images_read").get<std::vector<double>>();
    const auto used = data.at("images_used").get<double>();
    const double steps = static_cast<double>(losses(path).size());
    double sum = 0;
    for (const double r : read) sum += r;
    if (static_cast<int>(read.size()) != processes || sum != used || used <= 0) {
        std::fprintf(stderr, "%zu processes read %.0f images in all; the run used %.0f (want %d processes reading each once)\n",
                     read.size(), sum, used, processes);
        return 1;
    }
    const auto inflated = data.at("files_inflated").get<std::vector<double>>();
    double inflations = 0;
    for (const double f : inflated) inflations += f;
    // The two images files, once for the machine (none when a copy was there already).
    if (inflations > 2 || (want_inflations >= 0 && inflations != want_inflations)) {
        std::fprintf(stderr, "the processes inflated %.0f gzipped files (by process: ", inflations);
        for (const double f : inflated) std::fprintf(stderr, "%.0f ", f);
        std::fprintf(stderr, "); expected %d: one process makes the machine's copy of each, the others use it\n",
                     want_inflations >= 0 ? want_inflations : 2);
        return 1;
    }
    const double share = used / processes + steps + 20;  // + one row per training batch and per test chunk
    for (std::size_t p = 0; p < read.size(); ++p) {
        if (read[p] > share) {
            std::fprintf(stderr, "process %zu read %.0f images, more than its share %.0f of %.0f\n", p, read[p], share, used);
            return 1;
        }
        std::printf("process %zu read %.0f of the %.0f images used\n", p, read[p], used);
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const std::vector<std::string> a(argv + 1, argv + argc);
        if (a.size() == 4 && a[0] == "losses") return compare_losses(a[1], a[2], std::stod(a[3]));
        if (a.size() == 3 && a[0] == "differ") return losses_differ(a[1], a[2]);
        if (a.size() == 4 && a[0] == "checkpoints") return compare_checkpoints(a[1], a[2], std::stod(a[3]));
        if (a.size() == 4 && a[0] == "accuracy") return compare_accuracy(a[1], a[2], std::stod(a[3]));
        if (a.size() == 3 && a[0] == "make-data") return make_data(a[1], a[2]);
        if (a.size() == 2 && a[0] == "other-model") return other_model(a[1]);
        if (a.size() == 5 && a[0] == "set-metadata") return set_metadata(a[1], a[2], a[3], a[4]);
        if (a.size() == 2 && a[0] == "mkfifo") return make_fifo(a[1]);
        if (a.size() == 3 && a[0] == "data") return check_data(a[1], std::stoi(a[2]), -1);
        if (a.size() == 4 && a[0] == "data") return check_data(a[1], std::stoi(a[2]), std::stoi(a[3]));
        std::fprintf(stderr, "usage: see the comment at the top of mnist_tool.cpp\n");
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "mnist_tool: %s\n", e.what());
        return 2;
    }
}
