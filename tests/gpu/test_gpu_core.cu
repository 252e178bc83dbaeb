// SPDX-License-Identifier: MIT
//! GPU test of the CUDA core types: Tensor<T, Cuda> storage, copies, streams, events, error checks.
//! Exits 77 (skipped) where no GPU is present; built in CI so compile and link are always proven.
#include <lockstep/cuda.cuh>

#include <cstdio>
#include <numeric>
#include <vector>

#include "gpu_check.hpp"

namespace {
using lockstep::gpu_test::expect;

// x[i] *= a, one element a thread: a kernel written as lockstep's kernels are (Note [kernels
// proven on the host]), so it runs on a GPU and on the host CUDA device alike.
struct ScaleParams {
    float* x = nullptr;
    long n = 0;
    float a = 1;
};
struct Scale {
    using Params = ScaleParams;
    static constexpr int threads = 256;
    LOCKSTEP_HD static void run(const Params& p, const lockstep::kernels::device::Where& w) {
        const long i = static_cast<long>(w.bx) * threads + w.t;
        if (i < p.n) p.x[i] *= p.a;
    }
};
}  // namespace

int main() {
    using namespace lockstep;
    const int devices = lockstep::cuda::device_count();
    if (devices == 0) {
        std::puts("no CUDA device: skipping (exit 77)");
        return 77;
    }
    try {
        lockstep::cuda::DeviceGuard guard(0);
        lockstep::cuda::Stream stream(0);
        lockstep::cuda::StreamGuard on(stream);

        std::vector<float> values(1000003);
        std::iota(values.begin(), values.end(), 0.0f);
        auto host = make_tensor<float>(Shape{1000003}, values);
        auto dev = host.to<Cuda>(Device::cuda(0));
        Tensor<float, Cuda> copy = dev;  // deep copy on the device
        lockstep::kernels::device::launch_map<Scale>({copy.data(), static_cast<long>(copy.numel()), 2.0f},
                                                     {(1000003 + 255) / 256, 1, Scale::threads}, stream.get());
        lockstep::cuda::Event done;
        done.record(stream.get());
        done.synchronize();
        auto back = copy.to_host();
        auto orig = dev.to_host();
        bool ok = true;
        for (long i = 0; i < host.numel(); ++i) ok &= back[i] == 2.0f * values[i] && orig[i] == values[i];
        expect(ok, "device tensor copy, kernel on the replica stream, round trip");

        Tensor<float, Cuda> zeros(Shape{2, 3, 4, 5}, MemoryFormat::nhwc, Device::cuda(0));
        auto z = zeros.to_host();
        ok = z.format() == MemoryFormat::nhwc;
        for (long i = 0; i < z.numel(); ++i) ok &= z[i] == 0.0f;
        expect(ok, "new device tensors are zero-filled and keep their memory format");

        bool threw = false;
        try {
            LOCKSTEP_CUDA_CHECK(cudaSetDevice(devices + 7));
        } catch (const DeviceError& e) {
            threw = std::string(e.what()).find("cudaSetDevice") != std::string::npos;
        }
        expect(threw, "LOCKSTEP_CUDA_CHECK throws DeviceError naming the failed call");
    } catch (const std::exception& e) {
        return lockstep::gpu_test::fail_unexpected(e);
    }
    return lockstep::gpu_test::finish();
}
