// SPDX-License-Identifier: MIT
//! Defects between kernels that the host CUDA device must expose to a sanitizer or to its NCCL
//! watchdog (each mode has one).
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "host_cuda.hpp"

namespace {

void write_one(void* p) { *static_cast<float*>(p) = 1.0f; }
void read_one(void* p) { std::printf("%f\n", static_cast<double>(*static_cast<volatile float*>(p))); }

// Rank 0 of two enters an all-reduce that rank 1 never reaches, and the host waits for it: with
// LOCKSTEP_HOSTCUDA_WATCHDOG_S=1 the watchdog names the collective and rank 1, then aborts.
int never_arrives() {
    if (!lockstep::host_cuda::set_device_count(2)) return 2;
    ncclComm_t comms[2] = {nullptr, nullptr};
    const int devices[2] = {0, 1};
    if (ncclCommInitAll(comms, 2, devices) != ncclSuccess) return 2;
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    void* d = nullptr;
    cudaMalloc(&d, 64 * sizeof(float));
    ncclAllReduce(d, d, 64, ncclFloat32, ncclSum, comms[0], s);
    cudaStreamSynchronize(s);  // never returns: the watchdog ends the process
    std::puts("the all-reduce completed without rank 1");
    return 1;
}

int run(const char* mode) {
    if (std::strcmp(mode, "never-arrives") == 0) return never_arrives();
    cudaStream_t a = nullptr, b = nullptr;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    void* d = nullptr;
    cudaMalloc(&d, sizeof(float));
    if (std::strcmp(mode, "missing-wait") == 0) {
        // Stream b reads what stream a writes, with no event between them: ThreadSanitizer's race.
        // The host sleeps between the launches (a sleep orders nothing), so that the write has run
        // when the read comes: read first, the report could be lost to an order the host's own
        // calls give the two workers at exit.
        cudaLaunchHostFunc(a, write_one, d);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        cudaLaunchHostFunc(b, read_one, d);
    } else if (std::strcmp(mode, "free-host-early") == 0) {
        // The pinned buffer is freed before the copy into it ran: AddressSanitizer's use after free.
        void* pinned = nullptr;
        cudaMallocHost(&pinned, sizeof(float));
        lockstep::host_cuda::stall_launch(1);
        cudaLaunchHostFunc(a, write_one, d);
        cudaMemcpyAsync(pinned, d, sizeof(float), cudaMemcpyDeviceToHost, a);
        cudaFreeHost(pinned);
        lockstep::host_cuda::release_stalls();
    } else if (std::strcmp(mode, "free-async-early") == 0) {
        // Freed in stream a's order while stream b, not ordered after it, still reads the block.
        lockstep::host_cuda::stall_launch(1);
        cudaLaunchHostFunc(b, read_one, d);
        cudaFreeAsync(d, a);
        cudaStreamSynchronize(a);
        lockstep::host_cuda::release_stalls();
        d = nullptr;
    } else if (std::strcmp(mode, "ordered") == 0) {
        // The control: the same accesses ordered as CUDA promises must raise no report.
        cudaEvent_t e = nullptr;
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
        cudaLaunchHostFunc(a, write_one, d);
        cudaEventRecord(e, a);
        cudaStreamWaitEvent(b, e, 0);
        cudaLaunchHostFunc(b, read_one, d);
        cudaStream_t blocking = nullptr;
        cudaStreamCreate(&blocking);
        cudaEventRecord(e, b);
        cudaStreamWaitEvent(blocking, e, 0);
        cudaLaunchHostFunc(blocking, write_one, d);
        cudaLaunchHostFunc(nullptr, read_one, d);  // the legacy stream waits for `blocking`
        float* pinned = nullptr;
        cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(float));
        cudaMemcpyAsync(pinned, d, sizeof(float), cudaMemcpyDeviceToHost, nullptr);
        cudaEventRecord(e, nullptr);
        cudaEventSynchronize(e);
        std::printf("%f\n", static_cast<double>(*pinned));
        cudaFreeHost(pinned);
        cudaEventDestroy(e);
        cudaStreamDestroy(blocking);
    } else {
        std::fprintf(stderr, "modes: missing-wait, free-host-early, free-async-early, ordered, never-arrives\n");
        return 2;
    }
    cudaStreamSynchronize(a);
    cudaStreamSynchronize(b);
    cudaFree(d);
    return 0;
}

}  // namespace

int main(int argc, char** argv) { return run(argc > 1 ? argv[1] : ""); }
