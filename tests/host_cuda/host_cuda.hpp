// SPDX-License-Identifier: MIT
//! Test controls of lockstep's host CUDA device (libcudart, libcublas and libnccl run on the host).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::host_cuda {

//! Number of modelled devices, 1 to 4 (default: LOCKSTEP_HOSTCUDA_DEVICES, else 1). Call it
//! before creating streams on the devices it removes; false for a count out of range.
bool set_device_count(int count);

//! The compute capability every device reports (cudaGetDeviceProperties, cudaDeviceGetAttribute;
//! default 9.0, an H200), until reset(); false for one below 5.0.
bool set_compute_capability(int major, int minor);

//! The "capacity" cudaMalloc counts against on `device` (default 8 GiB); false for a bad device.
bool set_memory_capacity(int device, std::size_t bytes);

//! The k-th device allocation (cudaMalloc, cudaMallocAsync) from now fails with
//! cudaErrorMemoryAllocation (not sticky). k <= 0 cancels.
void fail_allocation(int k);

// Memory pools (Note [memory pools on the host CUDA device], runtime.cpp). The default pool keeps
// the bytes of stream-ordered frees, up to its release threshold, counted against the capacity
// and reused by cudaMallocAsync alone, until cudaMemPoolTrimTo. Allocations made in a capture
// take no memory until their graph's executable is uploaded (cudaGraphUpload) or first launched,
// which then fails with cudaErrorMemoryAllocation where they do not fit; the graph pool keeps the
// bytes of destroyed executables until cudaDeviceGraphMemTrim.

//! The k-th mapping of a graph executable's memory from now (at its upload or first launch),
//! on `device` (every device for -1), fails with cudaErrorMemoryAllocation. k <= 0 cancels.
void fail_graph_memory(int k, int device = -1);
//! Bytes the default pool of `device` keeps after stream-ordered frees.
std::size_t pool_cached_bytes(int device);
//! Bytes graphs hold on `device`: their executables' mapped memory and the graph pool's cache.
std::size_t graph_memory_bytes(int device);

// Launch injections count every cudaLaunchHostFunc, or with `kernel` only the launches named
// so by lockstep_host_cuda_name_next_launch, and with `device` >= 0 only the launches on that
// device. k <= 0 cancels.

//! The k-th launch from now returns cudaErrorLaunchFailure (not sticky) and enqueues nothing.
void fail_launch(int k, const char* kernel = nullptr, int device = -1);
//! The k-th launch from now runs, then puts its device in a sticky cudaErrorIllegalAddress.
void fault_launch(int k, const char* kernel = nullptr, int device = -1);
//! The k-th launch from now does not start until release_stalls(): its stream, and whatever
//! waits for it, stands still (a host wait on it ends only by a deadline).
void stall_launch(int k, const char* kernel = nullptr, int device = -1);
//! Lets every stalled launch injected so far run.
void release_stalls();

//! The k-th collective (counted from now over every communicator in which it is rank `rank`,
//! at enqueue) of rank `rank` fails: its communicator gets ncclSystemError, the peers waiting in that collective
//! are released with ncclRemoteError and their buffers are left as they were.
void fail_nccl(int rank, int k);

//! The hazard model of collectives of several communicators on one device (default:
//! LOCKSTEP_HOSTCUDA_NCCL_HAZARD, on unless "0"; off under ThreadSanitizer unless set): a collective holds its device until its
//! peers arrive, and without NCCL_LAUNCH_ORDER_IMPLICIT (read when a communicator is made) devices start them in orders that
//! differ, so two communicators per device can deadlock as on a GPU.
void set_nccl_hazard(bool on);

//! While held, the threads that launch a non-blocking communicator's collectives (NCCL 2.28's
//! groupLaunchNonBlocking) wait before they enqueue: the communicator stays in progress, as a
//! slow launch leaves it. reset() releases them.
void hold_nccl_launches(bool held);

//! One line per collective a stream worker waits in now: the rank, device, collective, its
//! sequence number and communicator, and the ranks that never arrived (or that another
//! collective holds the device). The watchdog prints the same before it ends a process whose
//! collective waited longer than LOCKSTEP_HOSTCUDA_WATCHDOG_S (default 60), with exit status 3.
std::vector<std::string> nccl_waits();

//! What ncclGetVersion reports (default 22805, NCCL 2.28.5).
void set_nccl_version(int version);

//! One cuDNN convolution call accepted (cudnn.cpp): the handle's device, the direction ('f'
//! forward, 'd' backward data, 'w' backward filter), the algorithm, whether the descriptor's math
//! allowed TF32, the workspace bytes given, the shape (N, C, H, W, O), whether its tensors were
//! bfloat16, and the convolution descriptor's math type (a cudnnMathType_t).
struct CudnnCall {
    int device = 0;
    char direction = 'f';
    int algorithm = 0;
    bool tf32 = false;
    std::size_t workspace_bytes = 0;
    int n = 0, c = 0, h = 0, w = 0, o = 0;
    bool bf16 = false;
    int math = 0;
};
//! Every cuDNN convolution call accepted since the last reset(), in the order of the calls.
std::vector<CudnnCall> cudnn_calls();
//! From now until reset(), cuDNN's heuristics still rank `algorithm` of `direction` ('f', 'd' or
//! 'w') as supported, but its workspace query and its calls refuse it (CUDNN_STATUS_NOT_SUPPORTED).
//! LOCKSTEP_HOSTCUDA_CUDNN_CREATE=fail in the environment: cudnnCreate fails
//! (CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER), as a cuDNN newer than the driver does.
void refuse_cudnn_algorithm(char direction, int algorithm);
//! Whether the cuDNN heuristics offer a deterministic backward-filter algorithm (default true;
//! false: every one they rank is non-deterministic, until reset()).
void set_cudnn_deterministic(bool offered);

//! Upper bound of the random delay a stream worker may add before an op, in microseconds
//! (default: LOCKSTEP_HOSTCUDA_DELAY_US, else 200; 0 disables).
void set_delay_cap_us(unsigned us);

//! For the next test case: releases the stalls, waits (at most 5 s, then warns on stderr) until
//! every stream ran what is queued, then clears every injection, the sticky errors, the calling
//! thread's last error and capture mode, the NCCL version and hazard setting, the capacities, the
//! cuDNN call log and offer, and ends every capture left open. Work still blocked after the wait
//! (a collective whose peers never come) would run in the cleared state: abort such
//! communicators first.
void reset();

//! reset() when made and when destroyed: a test case that starts and ends on a clean device.
struct Clean {
    Clean() { reset(); }
    ~Clean() { reset(); }
    Clean(const Clean&) = delete;
    Clean& operator=(const Clean&) = delete;
};

//! The seed of the workers' delays (LOCKSTEP_TEST_SEED, else random, printed once to stderr).
std::uint64_t seed();

//! Device blocks allocated and not yet freed (cudaFreeAsync counts until its op ran).
std::size_t live_device_blocks();

//! cudaLaunchHostFunc calls accepted so far (each one is a kernel launch).
std::uint64_t launches();
//! Host-to-device copies accepted so far whose source is page-locked memory (the library's
//! staging buffer or a pinned block of the caller's).
std::uint64_t uploads_from_pinned();

}  // namespace lockstep::host_cuda

//! Names the calling thread's next cudaLaunchHostFunc (for named injections and the fault
//! message). The library's host-compiler launch path may declare and call it itself (C linkage),
//! so that it needs no test header.
extern "C" void lockstep_host_cuda_name_next_launch(const char* kernel);
