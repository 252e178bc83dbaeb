// SPDX-License-Identifier: MIT
//! lockstep::torch::DataParallel across processes (labels torch, mpi): P processes x 2 replicas,
//! each process passing only its rows of the global batch. Prints "PASS rank R: ..." /
//! "FAIL rank R: ..." lines for tests/mpi/run.cmake. Scenarios (argv[1]):
//!   train    3 steps of the residual network with SyncBatchNorm on a global batch of 11 (process
//!            0 holds the first 6 rows): every tensor, running statistics included, within 1e-5 of
//!            the plain module's after 3 steps on the whole batch (each process seeds its own model:
//!            the construction's broadcast makes them all process 0's); both replicas of a process
//!            bit-identical; every process holding the same values
//!   differ   process 1 builds a wider model: every process refuses, naming the difference
#include <lockstep/mpi.hpp>

#include <cstdio>
#include <string>

#include "../mpi/mpi_test_support.hpp"
#include "torch_models.hpp"

using namespace std::chrono_literals;
namespace models = lockstep_test_torch;
using lockstep_test_torch::images;
using lockstep_test_torch::labels;
namespace lt = lockstep::torch;
using lockstep::test::mpi::expect;

namespace {

std::shared_ptr<lockstep::comm::ProcessGroup> borrowed(lockstep::comm::MpiProcessGroup& world) {
    return {&world, [](lockstep::comm::ProcessGroup*) {}};
}

void train(lockstep::comm::MpiProcessGroup& world) {
    constexpr std::int64_t batch = 11, first = 6;
    ::torch::manual_seed(7);
    models::ResNet reference(6);
    // Each process initializes its own model differently: the construction's broadcast of global
    // replica 0's values makes them all process 0's, which equals the reference.
    ::torch::manual_seed(7 + static_cast<std::uint64_t>(world.rank()));
    models::ResNet model(6);
    auto opt = models::sgd(*reference);
    lt::Options options;
    options.process_group = borrowed(world);
    options.bucket_bytes = 2048;
    lt::DataParallel dp(model, 2, models::sgd, options);
    expect(dp.global_size() == 2 * world.size(), "4 replicas over 2 processes");
    for (int k = 0; k < 3; ++k) {
        const auto x = images(batch, 100 + k), y = labels(batch, 100 + k);
        opt->zero_grad();
        const auto loss = models::cross_entropy(reference->forward(x), y);
        loss.backward();
        opt->step();
        const auto rows = world.rank() == 0 ? std::pair{0L, first} : std::pair{first, batch - first};
        const auto r = dp.train_step(x.narrow(0, rows.first, rows.second), y.narrow(0, rows.first, rows.second),
                                     models::cross_entropy);
        expect(r.count == batch && std::abs(r.loss - loss.item<double>()) <= 1e-5 * std::abs(loss.item<double>()),
               "step " + std::to_string(k) + ": the global batch's loss (" + std::to_string(r.loss) + ")");
    }
    std::string where;
    const double worst = models::worst_relative(*dp.module(), *reference, &where);
    expect(worst <= 1e-5, "every tensor within 1e-5 of the whole batch's (worst " + std::to_string(worst) + " at " + where + ")");
    expect(models::identical(*dp.replica(1), *dp.module()), "the process's replicas are bit-identical");
    double sum = 0;
    for (const auto& p : dp.module()->parameters()) sum += p.to(at::kDouble).sum().item<double>();
    double low = 0, high = 0;
    MPI_Allreduce(&sum, &low, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&sum, &high, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    expect(low == high, "every process holds the same parameters");
}

void differ(lockstep::comm::MpiProcessGroup& world) {
    lt::Options options;
    options.process_group = borrowed(world);
    std::string message;
    try {
        lt::DataParallel dp(models::ResNet(world.rank() == 0 ? 6 : 8), 2, models::sgd, options);
    } catch (const lockstep::UsageError& e) {
        message = e.what();
    }
    expect(message.find("module holds other parameters or buffers than replica 0's") != std::string::npos,
           "a process with another model is refused everywhere (" + message.substr(0, 100) + ")");
}

}  // namespace

int main(int argc, char** argv) {
    lockstep::mpi::Environment env(&argc, &argv);
    lockstep::test::mpi::rank() = env.rank();
    const std::string what = argc > 1 ? argv[1] : "train";
    try {
        lockstep::comm::MpiProcessGroup world(MPI_COMM_WORLD, 20s);
        if (what == "train")
            train(world);
        else if (what == "differ")
            differ(world);
        else
            expect(false, "unknown scenario " + what);
    } catch (const std::exception& e) {
        expect(false, std::string("unexpected exception: ") + e.what());
    }
    return lockstep::test::mpi::failures() == 0 ? 0 : 1;
}
