// SPDX-License-Identifier: MIT
//! Runs two host replicas and all-reduces, and runs a layer, through an installed lockstep;
//! exits non-zero on a wrong result.
#include <lockstep/data/idx.hpp>
#include <lockstep/data/loader.hpp>
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>

#include <cstdio>
#include <vector>

int main() {
    auto comms = lockstep::comm::HostCommunicator::create_group(2);
    lockstep::ReplicaPool pool(2);
    std::vector<std::vector<double>> data(2, std::vector<double>(5));
    pool.run([&](int rank) {
        for (auto& v : data[rank]) v = rank + 1.0;
        comms[rank].all_reduce_sum(std::span<double>(data[rank]));
    });
    for (const auto& d : data)
        for (double v : d)
            if (v != 3.0) {
                std::fprintf(stderr, "consumer: expected 3, got %g\n", v);
                return 1;
            }
    lockstep::nn::Linear<> fc(3, 2);  // the nn component: CBLAS through the installed package
    lockstep::nn::Context ctx;
    const auto y = fc.forward(ctx, lockstep::Tensor<float>(lockstep::Shape{4, 3}));
    if (y.shape() != lockstep::Shape{4, 2}) {
        std::fprintf(stderr, "consumer: Linear gave shape %s\n", y.shape().str().c_str());
        return 1;
    }
    // The data component: a batch loader over a dataset of its own, prefetching.
    struct Squares {
        std::int64_t size() const { return 10; }
        lockstep::Shape sample_shape() const { return lockstep::Shape{2}; }
        void read(std::int64_t i, std::span<float> out) const { out[0] = out[1] = static_cast<float>(i * i); }
        std::int64_t label(std::int64_t i) const { return i % 3; }
    } squares;
    lockstep::data::BatchLoader loader(squares, {.batch_size = 4});
    loader.start_epoch(0);
    std::int64_t seen = 0;
    while (auto b = loader.next()) seen += b->x.dim(0);
    if (seen != 10) {
        std::fprintf(stderr, "consumer: the loader gave %lld samples of 10\n", static_cast<long long>(seen));
        return 1;
    }
    std::puts("consumer: all-reduce, a Linear layer and a batch loader through the installed lockstep package work");
    return 0;
}
