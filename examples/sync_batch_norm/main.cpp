// SPDX-License-Identifier: MIT
//! SyncBatchNorm on its own: two host replicas normalize their shards with the statistics of the
//! whole batch, and the result equals batch norm of the whole batch on one replica.
#include <lockstep/host.hpp>
#include <lockstep/lockstep.hpp>
#include <lockstep/nn/sync_batch_norm.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
    using namespace lockstep;
    // A global batch of 5 samples, 3 channels, 4x4 pixels; replica 0 takes 3 samples, replica 1 takes 2.
    Tensor<float> batch(Shape{5, 3, 4, 4});
    for (std::int64_t i = 0; i < batch.numel(); ++i) batch[i] = std::sin(0.37f * static_cast<float>(i)) * 4.0f + 10.0f;

    // --- the snippet shown in docs/reference.md ("SyncBatchNorm") ---
    auto comms = comm::HostCommunicator::create_group(2);  // one group of 2 replicas
    nn::SyncBatchNorm<> prototype(3);                      // eps 1e-5, momentum 0.1, affine, NCHW
    std::vector<nn::SyncBatchNorm<>> bn(2, prototype);     // one copy per replica
    std::vector<Tensor<float>> shard{Tensor<float>(Shape{3, 3, 4, 4}), Tensor<float>(Shape{2, 3, 4, 4})};
    std::copy_n(batch.data(), shard[0].numel(), shard[0].data());
    std::copy_n(batch.data() + shard[0].numel(), shard[1].numel(), shard[1].data());
    std::vector<Tensor<float>> y(2);
    ReplicaPool pool(2);
    pool.attach(comms[0].group_ptr());
    pool.run([&](int rank) {
        nn::Context<> ctx;
        ctx.rank = rank;
        ctx.world = 2;
        ctx.comm = &comms[rank];  // two fixed-size all-reduces in forward (C+1, 2C values), one in backward (2C)
        y[rank] = bn[rank].forward(ctx, shard[rank]);
    });
    // --- end of snippet ---

    nn::SyncBatchNorm<> whole(3);
    nn::Context<> alone;
    const auto reference = whole.forward(alone, batch);
    double worst = 0;
    for (std::int64_t i = 0; i < y[0].numel(); ++i) worst = std::max(worst, std::abs(double(y[0][i]) - reference[i]));
    for (std::int64_t i = 0; i < y[1].numel(); ++i)
        worst = std::max(worst, std::abs(double(y[1][i]) - reference[y[0].numel() + i]));
    const bool same_stats = bn[0].running_mean[0] == bn[1].running_mean[0] && bn[0].running_var[2] == bn[1].running_var[2];
    std::printf("2 replicas vs 1: largest output difference %.3g; running statistics identical on both replicas: %s\n", worst,
                same_stats ? "yes" : "no");
    std::printf("running_mean = [%.5f, %.5f, %.5f]\n", bn[0].running_mean[0], bn[0].running_mean[1], bn[0].running_mean[2]);
    return worst < 1e-5 && same_stats ? 0 : 1;
}
