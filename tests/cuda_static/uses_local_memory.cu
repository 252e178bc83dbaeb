// SPDX-License-Identifier: MIT
//! The static gate's own negative test (cuda_static_gate_catches_lmem): two kernels that use local
//! memory, which the gate must refuse both ways, by ptxas -Werror and by
//! scripts/check-kernel-resources.py. Compiled to an object file only; nothing here runs.

//! A private array indexed by data: it cannot live in registers, so it is on the stack (1 KiB).
__global__ void __launch_bounds__(256, 4) uses_local_memory(const int* in, int* out, int n) {
    int a[256];
    for (int i = 0; i < 256; ++i) a[i] = in[i * n + threadIdx.x];
    a[in[threadIdx.x + n] & 255] += 1;
    out[threadIdx.x] = a[in[threadIdx.x] & 255];
}

//! 96 live values under a budget of 64 registers (a block of 1024 threads): spills.
__global__ void __launch_bounds__(1024, 1) spills_registers(const float* in, float* out, int n) {
    float v[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) v[i] = in[i * n + threadIdx.x];
    float s = 0;
#pragma unroll
    for (int i = 0; i < 96; ++i) s += v[i] * v[95 - i] + v[(i * 7) % 96];
#pragma unroll
    for (int i = 0; i < 96; ++i) out[i * n + threadIdx.x] = v[i] * s;
}
