// SPDX-License-Identifier: MIT
//! GPU test of the CUDA core types: Tensor<T, Cuda> storage, copies, streams, events, error checks.
//! Exits 77 (skipped) where no GPU is present; built in CI so compile and link are always proven.
#include <lockstep/cuda.cuh>

#include <cstdio>
#include <numeric>
#include <vector>

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) ++failures;
}
__global__ void scale(float* x, long n, float a) {
    const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
    if (i < n) x[i] *= a;
}
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
        lockstep::cuda::StreamGuard on(stream.get());

        std::vector<float> values(1000003);
        std::iota(values.begin(), values.end(), 0.0f);
        auto host = make_tensor<float>(Shape{1000003}, values);
        auto dev = host.to<Cuda>(Device::cuda(0));
        Tensor<float, Cuda> copy = dev;  // deep copy on the device
        scale<<<(1000003 + 255) / 256, 256, 0, stream.get()>>>(copy.data(), copy.numel(), 2.0f);
        LOCKSTEP_CUDA_CHECK(cudaGetLastError());
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
        std::printf("FAIL unexpected exception: %s\n", e.what());
        return 1;
    }
    std::printf("%d failure(s)\n", failures);
    return failures == 0 ? 0 : 1;
}
