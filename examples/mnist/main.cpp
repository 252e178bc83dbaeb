// SPDX-License-Identifier: MIT
//! Trains the seed's MNIST conv-net data-parallel with SyncBatchNorm on real IDX data (by default
//! Fashion-MNIST from Debian's dataset-fashion-mnist), on host replicas or CUDA GPUs, evaluates it
//! and saves checkpoints. The training itself is train.hpp.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "train.hpp"

#if defined(LOCKSTEP_EXAMPLE_MPI)
#include <lockstep/mpi.hpp>
#endif

// host_train.cpp, shared with the example's build on the host CUDA device.
int mnist_train_host(const mnist_example::Options& opt, const std::vector<lockstep::Device>& devices,
                     std::shared_ptr<lockstep::comm::ProcessGroup> procs);

#if defined(LOCKSTEP_EXAMPLE_CUDA)
// cuda_train.cu, compiled by nvcc.
int mnist_train_cuda(const mnist_example::Options& opt, const std::vector<lockstep::Device>& devices,
                     std::shared_ptr<lockstep::comm::ProcessGroup> procs);
int mnist_cuda_device_count();
#else
inline int mnist_cuda_device_count() { return 0; }
#endif

namespace {

using lockstep::Device;
using mnist_example::Options;

// "0,1" or "0,0,0,0": one CUDA device index per replica.
std::vector<int> parse_devices(const std::string& text) {
    const auto bad = [&] {
        return lockstep::InvalidArgument(
            "--devices: expected GPU indices separated by commas, such as 0,1 or 0,0,0,0 (one "
            "per replica); got \"" +
            text + "\"");
    };
    std::vector<int> out;
    std::size_t at = 0;
    while (true) {
        const std::size_t comma = text.find(',', at);
        const std::string item = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
        int v = -1;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
        if (item.empty() || ec != std::errc() || end != item.data() + item.size() || v < 0) throw bad();
        out.push_back(v);
        if (comma == std::string::npos) break;
        at = comma + 1;
    }
    if (out.size() > 64) throw lockstep::InvalidArgument("--devices: at most 64 replicas, got " + std::to_string(out.size()));
    return out;
}

// The processes of this run: several when started by mpirun (or another MPI launcher).
int launched_processes() {
    for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
        if (const char* v = std::getenv(name)) return std::max(1, std::atoi(v));
    return 1;
}

// This process's index among the processes of the run on its machine (mpirun's local rank).
int local_process_index() {
    for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK"})
        if (const char* v = std::getenv(name)) return std::max(0, std::atoi(v));
    return 0;
}

// The processes of this run when mpirun started several (README, "Several processes"); null when alone.
std::shared_ptr<lockstep::comm::ProcessGroup> launched_process_group() {
    if (launched_processes() <= 1) return nullptr;
#if defined(LOCKSTEP_EXAMPLE_MPI)
    static lockstep::mpi::Environment env;
    return std::make_shared<lockstep::comm::MpiProcessGroup>(MPI_COMM_WORLD, std::chrono::minutes(5));
#else
    throw lockstep::UsageError("started as one of " + std::to_string(launched_processes()) +
                               " MPI processes, but this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
}

// The backend and the replicas' devices the options ask for, checked against this machine.
std::pair<std::string, std::vector<Device>> plan(const Options& opt) {
    // A malformed --devices is reported as such, whatever else is wrong.
    const std::vector<int> listed = opt.devices_given ? parse_devices(opt.devices) : std::vector<int>{};
    const int gpus = mnist_cuda_device_count();
    const std::string backend = opt.backend == "auto" ? (gpus > 0 || !listed.empty() ? "cuda" : "host") : opt.backend;
    if (backend == "host") {
        if (!opt.devices.empty())
            throw lockstep::UsageError(
                "--devices names CUDA devices, but this run trains on the host backend; count host "
                "replicas with --replicas N");
        // Under mpirun: each process with --replicas host replicas.
        return {backend, lockstep::kernels::Ops<lockstep::Host>::default_devices(opt.replicas > 0 ? opt.replicas : 2)};
    }
#if !defined(LOCKSTEP_EXAMPLE_CUDA)
    throw lockstep::UsageError(
        "--backend cuda: this build has no CUDA backend (nvcc and NCCL were not found when it was "
        "configured); use --backend host");
#else
    if (gpus == 0)
        throw lockstep::DeviceMismatch("--backend cuda: no GPU is visible here (no driver or no device); use --backend host");
    std::vector<Device> devices;
    if (!opt.devices.empty()) {
        for (const int d : listed) {
            if (d >= gpus)
                throw lockstep::DeviceMismatch("--devices: there is no GPU cuda:" + std::to_string(d) + " here; " +
                                               std::to_string(gpus) + " visible (cuda:0..cuda:" + std::to_string(gpus - 1) + ")");
            devices.push_back(Device::cuda(d));
        }
        if (opt.replicas > 0 && opt.replicas != static_cast<int>(devices.size()))
            throw lockstep::UsageError("--replicas " + std::to_string(opt.replicas) + " but --devices lists " +
                                       std::to_string(devices.size()) +
                                       "; --devices gives one replica per entry, so pass one of them");
    } else {  // round-robin over the visible GPUs: one per GPU, or all on the one GPU there is
        // Under mpirun, one replica per process by default, the processes of a machine taking its
        // GPUs in turn from their local rank on.
        const bool several = launched_processes() > 1;
        const int n = opt.replicas > 0 ? opt.replicas : several ? 1 : gpus;
        if (n > gpus && gpus > 1)
            throw lockstep::UsageError("--replicas " + std::to_string(n) + " over " + std::to_string(gpus) +
                                       " GPUs would put two replicas on some GPUs and one on others, which a replica "
                                       "group does not take; use at most " +
                                       std::to_string(gpus) + " replicas, or --devices 0,0,0,0 for several on one GPU");
        const int first = several && gpus > 1 ? local_process_index() * n : 0;
        for (int r = 0; r < n; ++r) devices.push_back(Device::cuda((first + r) % gpus));
    }
    return {backend, devices};
#endif
}

int run(const Options& opt) {
    // Under mpirun, MPI first: every process checks its own options and devices, then all learn
    // whether any failed and exit with the same message (mnist_example::agree_on_setup).
    const auto procs = launched_process_group();
    std::pair<std::string, std::vector<Device>> chosen;
    std::exception_ptr failure;
    try {
        chosen = plan(opt);
    } catch (...) {
        failure = std::current_exception();
    }
    mnist_example::agree_on_setup(procs, failure);
    const auto& [backend, devices] = chosen;
    if (backend == "host") return mnist_train_host(opt, devices, procs);
#if defined(LOCKSTEP_EXAMPLE_CUDA)
    return mnist_train_cuda(opt, devices, procs);
#else
    throw lockstep::UsageError("--backend cuda: this build has no CUDA backend");  // plan() refused it already
#endif
}

}  // namespace

int main(int argc, char** argv) {
    Options opt;
    CLI::App app{"Train the MNIST conv-net data-parallel with lockstep (SyncBatchNorm, host or CUDA replicas)"};
    app.add_option("--backend", opt.backend, "auto | host | cuda")->check(CLI::IsMember({"auto", "host", "cuda"}));
    app.add_option("--replicas", opt.replicas,
                   "replicas (default: one per visible GPU, or 2 host replicas); on CUDA "
                   "spread over the visible GPUs round-robin")
        ->check(CLI::Range(1, 64));
    app.add_option("--devices", opt.devices,
                   "CUDA devices of the replicas, one entry per replica: 0,1 or 0,0,0,0 "
                   "(several replicas may share a GPU)");
    const std::map<std::string, lockstep::Math> maths{{"pytorch_default", lockstep::Math::pytorch_default},
                                                      {"strict_fp32", lockstep::Math::strict_fp32},
                                                      {"tf32", lockstep::Math::tf32}};
    std::string math = "pytorch_default";
    app.add_option("--math", math,
                   "how convolutions and linear layers may round on CUDA: pytorch_default (TF32 convolutions, "
                   "strict fp32 linear layers, as PyTorch), strict_fp32 or tf32; the host computes all in fp32")
        ->check(CLI::IsMember({"pytorch_default", "strict_fp32", "tf32"}));
    std::string precision = "fp32";
    app.add_option("--precision", precision,
                   "CUDA: what convolutions and linear layers multiply and the layers pass between them: fp32 (as "
                   "--math allows) or bf16 (bfloat16 operands and activations, fp32 accumulation, fp32 weights and "
                   "batch-norm statistics, as PyTorch's autocast)")
        ->check(CLI::IsMember({"fp32", "bf16"}));
    std::string gradient_precision = "fp32";
    app.add_option("--gradient-precision", gradient_precision,
                   "CUDA: what the gradient buckets are all-reduced in: fp32 or bf16 (rounded before the sum, widened "
                   "after it: half the bytes)")
        ->check(CLI::IsMember({"fp32", "bf16"}));
    app.add_flag("--graphs", opt.graphs,
                 "CUDA: run each replica's training step as CUDA graphs, captured at its second step of each batch "
                 "shape (one replica per GPU)");
    app.add_option("--epochs", opt.epochs, "epochs")->check(CLI::Range(1, 1000));
    app.add_option("--batch", opt.batch, "global batch size")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
    // NaN passes a range check (every comparison with it is false): refuse it first.
    const CLI::Validator finite(
        [](const std::string& text) -> std::string {
            try {
                return std::isfinite(std::stod(text)) ? "" : "must be a finite number, got " + text;
            } catch (const std::exception&) {
                return "must be a number, got " + text;
            }
        },
        "FINITE");
    app.add_option("--lr", opt.lr, "learning rate")->check(finite & CLI::Range(0.0, 100.0));
    app.add_option("--momentum", opt.momentum, "SGD momentum")->check(finite & CLI::Range(0.0, 1.0));
    // Digits only, and it must fit 64 bits: "-1" or 2^64 is a mistake, not a wrapped seed.
    const CLI::Validator seed_digits(
        [](const std::string& text) -> std::string {
            std::uint64_t v = 0;
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
            return !text.empty() && ec == std::errc() && end == text.data() + text.size()
                       ? ""
                       : "must be an integer in [0, 2^64), got " + text;
        },
        "SEED");
    app.add_option("--seed", opt.seed, "seed for initialization and shuffling")->check(seed_digits);
    app.add_flag("--no-shuffle", opt.no_shuffle, "take batches in file order");
    app.add_option("--steps", opt.steps, "stop after this many steps in total")
        ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
    app.add_option("--train-limit", opt.train_limit, "use only the first M training images")
        ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
    app.add_option("--test-limit", opt.test_limit, "evaluate on the first M test images only")
        ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
    app.add_option("--data", opt.data, "directory with the IDX files (gzipped or not)");
    app.add_option("--init", opt.init, "start from this safetensors checkpoint's weights");
    app.add_option("--save", opt.save, "write a checkpoint here after each epoch and at the end (atomic)");
    app.add_option("--resume", opt.resume, "continue from a checkpoint written by --save");
    app.add_option("--metrics", opt.metrics, "write JSON lines of step and epoch metrics here");
    app.add_option("--expect-accuracy", opt.expect_accuracy, "exit with 1 if the final test accuracy is lower")
        ->check(finite & CLI::Range(0.0, 1.0));
    app.add_flag("--quiet", opt.quiet, "print only the final line");
    try {
        app.parse(argc, argv);
        opt.devices_given = app.count("--devices") > 0;
        opt.math = maths.at(math);
        opt.precision = precision == "bf16" ? lockstep::Precision::bf16 : lockstep::Precision::fp32;
        opt.gradient_precision = gradient_precision == "bf16" ? lockstep::Precision::bf16 : lockstep::Precision::fp32;
    } catch (const CLI::ParseError& e) {
        const int rc = app.exit(e);
        return rc == 0 ? 0 : 2;
    }
    try {
        return run(opt);
    } catch (const lockstep::data::DataError& e) {
        std::fprintf(stderr, "mnist: %s\n", e.what());
    } catch (const lockstep::Error& e) {
        std::fprintf(stderr, "mnist: %s\n", e.what());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "mnist: %s\n", e.what());
    }
    return 2;
}
