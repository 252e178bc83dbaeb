// SPDX-License-Identifier: MIT
//! The static gate's negative test of vector accesses (cuda_static_gate_catches_scalar_packs):
//! kernels of width 4 whose packs are read or written element by element, which
//! scripts/check-kernel-resources.py must refuse, beside kernels it must pass. None uses local
//! memory, so only the vector check can refuse them. Compiled to an object file only.
#include <cuda_fp16.h>

//! The drivers' names, as the gate reads them from the mangled names (launch.cuh): a map kernel
//! writes its output in packs, a reducing kernel only reads them.
template <class K>
__global__ void __launch_bounds__(256) map_kernel(float* y, const float* x) {
    K::run(y, x, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
}
template <class K>
__global__ void __launch_bounds__(256) reduce_kernel(float* y, const float* x) {
    K::run(y, x, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
}

//! The defect the gate is for: a pack loaded as one vector, stored as V scalars (a float* the
//! compiler cannot prove 16-byte aligned), as nvcc once compiled the channels-first windows.
template <int V>
struct ScalarStores {
    __device__ static void run(float* y, const float* x, int i) {
        const float4 v = reinterpret_cast<const float4*>(x)[i];
        y[i * V + 0] = v.x;
        y[i * V + 1] = v.y;
        y[i * V + 2] = v.z;
        y[i * V + 3] = v.w;
    }
};

//! A pack read as V scalars, stored as one vector.
template <int V>
struct ScalarLoads {
    __device__ static void run(float* y, const float* x, int i) {
        reinterpret_cast<float4*>(y)[i] = make_float4(x[i * V], x[i * V + 1], x[i * V + 2], x[i * V + 3]);
    }
};

//! A reducing kernel of width V that reads its packs as scalars (its scalar store is no pack).
template <int V>
struct ScalarSum {
    __device__ static void run(float* y, const float* x, int i) {
        float s = 0;
        for (int e = 0; e < V; ++e) s += x[i * V + e];
        y[i] = s;
    }
};

//! A pair of 16-bit values (4 bytes, one `.v2.u16` or `.u32` access) read and written as two.
template <class T, int V>
struct ScalarPairs {
    __device__ static void run(float* y, const float* x, int i) {
        const T* in = reinterpret_cast<const T*>(x);
        T* out = reinterpret_cast<T*>(y);
        out[i * V] = in[i * V + 1];
        out[i * V + 1] = in[i * V];
    }
};

//! What the gate passes: width 4 in vectors, a 16-bit pair as one access, and width 1 (no pack)
//! in scalars.
template <int V>
struct Vectors {
    __device__ static void run(float* y, const float* x, int i) {
        const float4 v = reinterpret_cast<const float4*>(x)[i];
        reinterpret_cast<float4*>(y)[i] = make_float4(v.x * 2, v.y * 2, v.z * 2, v.w * 2);
    }
};
template <class T, int V>
struct Pairs {
    __device__ static void run(float* y, const float* x, int i) {
        const __half2 v = reinterpret_cast<const __half2*>(x)[i];
        reinterpret_cast<__half2*>(y)[i] = __lowhigh2highlow(v);
    }
};
template <int V>
struct Scalars {
    __device__ static void run(float* y, const float* x, int i) { y[i] = x[i] * 2; }
};

template __global__ void map_kernel<ScalarStores<4>>(float*, const float*);
template __global__ void map_kernel<ScalarLoads<4>>(float*, const float*);
template __global__ void reduce_kernel<ScalarSum<4>>(float*, const float*);
template __global__ void map_kernel<ScalarPairs<__half, 2>>(float*, const float*);
template __global__ void map_kernel<Vectors<4>>(float*, const float*);
template __global__ void map_kernel<Pairs<__half, 2>>(float*, const float*);
template __global__ void map_kernel<Scalars<1>>(float*, const float*);
