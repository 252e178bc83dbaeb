// SPDX-License-Identifier: MIT
//! The CUDA backend's convolutions through cuDNN, where lockstep was configured with it
//! (LOCKSTEP_CUDNN, which defines LOCKSTEP_WITH_CUDNN=1 for lockstep::cuda): Note [cuDNN
//! convolutions]. Without it `CudnnConvolutions` is an empty type and convolutions run im2col +
//! cuBLAS (Note [convolution on CUDA]).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "lockstep/kernels/cuda_common.cuh"
#include "lockstep/kernels/device/gemm_layers.cuh"

#if LOCKSTEP_WITH_CUDNN
#include <cudnn.h>

//! Throws `lockstep::DeviceError` when a cuDNN call fails.
#define LOCKSTEP_CUDNN_CHECK(expr)                                                                                      \
    do {                                                                                                                \
        const cudnnStatus_t lockstep_st_ = (expr);                                                                      \
        if (lockstep_st_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                                                          \
            ::lockstep::cuda::detail::raise("cuDNN", static_cast<int>(lockstep_st_), cudnnGetErrorString(lockstep_st_), \
                                            "see cuDNN's status codes", #expr, __FILE__, __LINE__);                     \
    } while (0)
#endif

namespace lockstep::kernels::cuda_ops {

// Note [cuDNN convolutions]
// Built with cuDNN, a replica's NCHW fp32 convolutions run cuDNN's convolution forward, backward
// data and backward filter; the bias and its gradient stay lockstep's kernels (the per-channel
// map and the fp64 per-channel sum of im2col's path, so both paths give the bias the same bits).
// - The algorithms. For each shape (N, C, H, W, O, kernel, stride, padding) and math, cuDNN's
//   heuristics rank the algorithms of each direction (cudnnGet*Algorithm_v7: no timing runs, as
//   PyTorch with cudnn.benchmark off); the first that cuDNN supports, that is deterministic and
//   whose workspace fits `max_workspace_bytes` is taken. The choice is made once, by the first
//   replica of the process that meets the shape, and kept in a process-wide table that every
//   other replica reads: replicas run the same algorithms on the same shapes even where their
//   GPUs' heuristics would rank differently, so they stay bit-identical, and none pays the
//   choice again. Processes choose each for themselves; the heuristics are a function of the GPU
//   model and cuDNN's version, so processes on one GPU model choose alike.
// - A shape where some direction has no deterministic algorithm runs im2col + cuBLAS in every
//   direction (the table says so), never a non-deterministic algorithm.
// - Math (Note [math modes]): strict fp32 sets CUDNN_FMA_MATH (no tensor cores); a mode that
//   allows TF32 for convolutions sets CUDNN_DEFAULT_MATH, which lets cuDNN use TF32, as PyTorch
//   does with torch.backends.cudnn.allow_tf32.
// - Precision (Note [precision]): under Precision::bf16 a convolution runs cuDNN's bf16
//   configuration (x, w and y, or dy and dx, or x, dy and dw in bfloat16, fp32 compute, tensor
//   cores allowed: CUDNN_TENSOR_OP_MATH) with its own algorithm choices (the table is keyed by
//   the data type too). cuDNN's legacy API gives every output in the inputs' type, so each is
//   rounded to bf16 once by cuDNN:
//   y before the bias is added in fp32 (and rounded again where y is stored in bf16), dx where x
//   was fp32 (then widened), and the weight gradient, which is then added, widened, to the fp32
//   gradient (as PyTorch's autocast does: its convolution's weight gradient is bf16). The operands
//   that arrive in fp32 (x, dy, and always the fp32 master weight) are rounded once into the
//   workspace's bf16 buffer. Shapes without a deterministic bf16 algorithm run im2col + cuBLAS in
//   bf16 (`conv_forward_on_bf16`), whose outputs are not rounded before the bias and whose weight
//   gradient accumulates in fp32.
// - Workspace: the replica's one LayerWorkspace (Note [one layer workspace]), grown to the largest
//   need of its layers: the algorithms' workspace in its fp32 buffer, bf16 operands in its bf16 one.
// - Sums: an fp32 weight gradient accumulates (beta = 1), as every backend's conv2d_backward does;
//   a bf16 one, y and dx are written (beta = 0).
// - Handle and descriptors: one cuDNN handle per replica, set to the replica's stream at each
//   call; the descriptors of a shape are made once per replica and kept (a replica serves one
//   thread at a time, as its stream does).
// - Off at run time: LOCKSTEP_CUDNN=0 in the environment, or a cuDNN that cannot start on the
//   process's first replica (a library that does not match the driver or the GPU: a warning on
//   stderr), runs every convolution of the process through im2col + cuBLAS. The first replica
//   decides for all of its process. Processes decide each for themselves: one whose cuDNN cannot
//   start while its peers' can would round differently from them, so the warning says to give
//   every process the same LOCKSTEP_CUDNN (they are not made to agree yet).
// - The algorithm is checked where it is chosen: one whose workspace query fails or exceeds the
//   cap is skipped for the next. Replicas on GPUs of different models share the first one's
//   choice; where that algorithm is refused on another model, that replica's query throws
//   DeviceError (run such a mix with LOCKSTEP_CUDNN=0).

#if LOCKSTEP_WITH_CUDNN

//! A replica's cuDNN handle and the descriptors of the shapes its convolutions met.
class CudnnConvolutions {
public:
    //! The largest workspace an algorithm may ask for.
    static constexpr std::size_t max_workspace_bytes = std::size_t{1} << 30;

    //! What the process chose for a shape (Note [cuDNN convolutions]).
    struct Choice {
        bool usable = false;  // false: this shape runs im2col + cuBLAS
        cudnnConvolutionFwdAlgo_t forward{};
        cudnnConvolutionBwdDataAlgo_t backward_data{};
        cudnnConvolutionBwdFilterAlgo_t backward_filter{};
    };

    //! A replica's handle, made with its device current; null where the process runs without
    //! cuDNN: the environment turns it off (off_by_environment), or cuDNN cannot start here on the
    //! process's first replica (cannot_start: a warning says why, once). Once the first replica
    //! has decided, every later one follows it: a process's replicas never mix engines. Any other
    //! failure, and a later replica whose cuDNN cannot start where the first one's could, throws
    //! DeviceError.
    static std::unique_ptr<CudnnConvolutions> make(int device) {
        static std::mutex m;    // cuDNN's handles are made one at a time
        static int state = -1;  // -1: undecided, 0: without cuDNN, 1: with it
        std::lock_guard lock(m);
        if (state == 0) return nullptr;
        if (state < 0 && off_by_environment()) {
            state = 0;
            return nullptr;
        }
        cudnnHandle_t h = nullptr;
        const cudnnStatus_t st = cudnnCreate(&h);
        if (st == CUDNN_STATUS_SUCCESS) {
            state = 1;
            return std::unique_ptr<CudnnConvolutions>(new CudnnConvolutions(h));
        }
        const std::string why =
            std::string("cuDNN could not start on cuda:") + std::to_string(device) + " (" + cudnnGetErrorString(st) + ")";
        if (state < 0 && cannot_start(st)) {
            state = 0;
            std::fprintf(stderr,
                         "lockstep: %s: this cuDNN does not run with this driver or GPU; convolutions run through im2col + "
                         "cuBLAS in this process (give every process of a DataParallel the same LOCKSTEP_CUDNN)\n",
                         why.c_str());
            return nullptr;
        }
        throw DeviceError(why + (state == 1 ? " although it did on an earlier replica; every replica of a process runs one "
                                              "engine: set LOCKSTEP_CUDNN=0 in the environment to run convolutions through cuBLAS"
                                            : "; set LOCKSTEP_CUDNN=0 in the environment to run convolutions through cuBLAS"),
                          ::lockstep::detail::replica_rank_slot(), device);
    }

    //! Whether LOCKSTEP_CUDNN in the environment turns cuDNN off (0, OFF, off, false, FALSE).
    static bool off_by_environment() {
        const char* v = std::getenv("LOCKSTEP_CUDNN");
        if (v == nullptr) return false;
        const std::string s(v);
        return s == "0" || s == "OFF" || s == "off" || s == "false" || s == "FALSE";
    }

    CudnnConvolutions(const CudnnConvolutions&) = delete;
    CudnnConvolutions& operator=(const CudnnConvolutions&) = delete;
    ~CudnnConvolutions() {
        for (auto& [key, d] : shapes_) d.release();
        if (handle_ != nullptr) (void)cudnnDestroy(handle_);
    }

    //! The choice for `c` in `math` and `precision` (fp32 or bf16 tensors), made now if the process
    //! has none yet; false when the shape runs im2col (forward and backward answer the same).
    bool usable(const device::layer_kernels::ConvPlan& c, Math math, Precision precision = Precision::fp32) {
        return shape(c, math, precision).choice.usable;
    }

    //! y = conv(x, w), on `stream`; T: float (in `math`) or __nv_bfloat16 (Precision::bf16);
    //! `workspace(bytes)` returns at least that many bytes on the device. False, with nothing
    //! enqueued, for a shape that runs im2col (one lookup: the choice and the descriptors).
    template <class T, class Workspace>
    bool forward(cudaStream_t stream, const device::layer_kernels::ConvPlan& c, Math math, const T* x, const T* w, T* y,
                 Workspace&& workspace) {
        Shape_& s = shape(c, math, precision_of<T>());
        if (!s.choice.usable) return false;
        LOCKSTEP_CUDNN_CHECK(cudnnSetStream(handle_, stream));
        const float one = 1.0f, zero = 0.0f;
        LOCKSTEP_CUDNN_CHECK(cudnnConvolutionForward(handle_, &one, s.x, x, s.w, w, s.conv, s.choice.forward,
                                                     workspace(s.forward_bytes), s.forward_bytes, &zero, s.y, y));
        return true;
    }

    //! weight_grad += dL/dw (fp32) or weight_grad = dL/dw (bf16: the caller adds it to its fp32
    //! gradient), dx = dL/dx, on `stream`; false, with nothing enqueued, where the shape runs im2col.
    template <class T, class Workspace>
    bool backward(cudaStream_t stream, const device::layer_kernels::ConvPlan& c, Math math, const T* x, const T* dy, const T* w,
                  T* weight_grad, T* dx, Workspace&& workspace) {
        Shape_& s = shape(c, math, precision_of<T>());
        if (!s.choice.usable) return false;
        LOCKSTEP_CUDNN_CHECK(cudnnSetStream(handle_, stream));
        const float one = 1.0f, zero = 0.0f;
        const float* accumulate = precision_of<T>() == Precision::fp32 ? &one : &zero;
        const std::size_t bytes = std::max(s.filter_bytes, s.data_bytes);
        void* ws = workspace(bytes);
        LOCKSTEP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(handle_, &one, s.x, x, s.y, dy, s.conv, s.choice.backward_filter, ws,
                                                            bytes, accumulate, s.w, weight_grad));
        LOCKSTEP_CUDNN_CHECK(cudnnConvolutionBackwardData(handle_, &one, s.w, w, s.y, dy, s.conv, s.choice.backward_data, ws,
                                                          bytes, &zero, s.x, dx));
        return true;
    }

    //! The process's choice for a shape, if one was made (tests and diagnostics).
    static bool chosen(const device::layer_kernels::ConvPlan& c, Math math, Choice& out, Precision precision = Precision::fp32) {
        Table& t = table();
        std::lock_guard lock(t.m);
        const auto it = t.choices.find(key_of(c, math, precision));
        if (it == t.choices.end()) return false;
        out = it->second;
        return true;
    }

private:
    explicit CudnnConvolutions(cudnnHandle_t h) : handle_(h) {}

    // A status of cudnnCreate that says this cuDNN cannot run here (its libraries, the driver, the
    // GPU), as opposed to a failure of the moment (memory, a device error left behind).
    static bool cannot_start(cudnnStatus_t st) {
        switch (st) {
            case CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH:
            case CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED:
            case CUDNN_STATUS_LICENSE_ERROR:
            case CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER:
            case CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART:
            case CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH:
            case CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING:
            case CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE: return true;
            default: return false;
        }
    }

    using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::int64_t, bool, bool>;  // the shape, TF32, bf16

    // The process's choices, one per shape and math (Note [cuDNN convolutions]).
    struct Table {
        std::mutex m;
        std::map<Key, Choice> choices;
    };
    static Table& table() {
        static Table* t = new Table;  // never destroyed: replicas may outlive static destruction
        return *t;
    }

    template <class T>
    static constexpr Precision precision_of() {
        static_assert(std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16>, "cuDNN convolutions take float or bf16");
        return std::is_same_v<T, float> ? Precision::fp32 : Precision::bf16;
    }
    // TF32 is a question for fp32 tensors only: bf16 operands are already rounded.
    static bool tf32(Math math, Precision precision) {
        return precision == Precision::fp32 && allows_tf32(math, ProductOf::convolution);
    }
    static Key key_of(const device::layer_kernels::ConvPlan& c, Math math, Precision precision) {
        return {c.N, c.C, c.H, c.W, c.O, c.k, c.s, c.pad, tf32(math, precision), precision == Precision::bf16};
    }

    // A shape's descriptors on this replica, its choice and the workspace each direction needs.
    struct Shape_ {
        cudnnTensorDescriptor_t x = nullptr, y = nullptr;
        cudnnFilterDescriptor_t w = nullptr;
        cudnnConvolutionDescriptor_t conv = nullptr;
        Choice choice;
        std::size_t forward_bytes = 0, data_bytes = 0, filter_bytes = 0;

        void release() noexcept {
            if (x != nullptr) (void)cudnnDestroyTensorDescriptor(x);
            if (y != nullptr) (void)cudnnDestroyTensorDescriptor(y);
            if (w != nullptr) (void)cudnnDestroyFilterDescriptor(w);
            if (conv != nullptr) (void)cudnnDestroyConvolutionDescriptor(conv);
            x = y = nullptr;
            w = nullptr;
            conv = nullptr;
        }
    };

    static int dim(std::int64_t v) { return static_cast<int>(v); }  // ConvPlan checked the index space

    Shape_& shape(const device::layer_kernels::ConvPlan& c, Math math, Precision precision) {
        LOCKSTEP_CHECK_AS(NotImplemented, precision == Precision::fp32 || precision == Precision::bf16, "cuDNN convolutions in ",
                          to_string(precision), " (fp32 and bf16 only)");
        const Key key = key_of(c, math, precision);
        if (const auto it = shapes_.find(key); it != shapes_.end()) return it->second;
        Shape_ s;
        try {
            describe(c, math, precision, s);
            s.choice = choose(key, s);
            if (s.choice.usable) {
                LOCKSTEP_CUDNN_CHECK(
                    cudnnGetConvolutionForwardWorkspaceSize(handle_, s.x, s.w, s.conv, s.y, s.choice.forward, &s.forward_bytes));
                LOCKSTEP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(handle_, s.w, s.y, s.conv, s.x,
                                                                                  s.choice.backward_data, &s.data_bytes));
                LOCKSTEP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(handle_, s.x, s.y, s.conv, s.w,
                                                                                    s.choice.backward_filter, &s.filter_bytes));
            }
        } catch (...) {
            s.release();
            throw;
        }
        if (shapes_.size() >= max_shapes) {  // a replica meeting ever new shapes keeps the latest ones
            for (auto& [k, d] : shapes_) d.release();
            shapes_.clear();
        }
        return shapes_.emplace(key, s).first->second;
    }

    void describe(const device::layer_kernels::ConvPlan& c, Math math, Precision precision, Shape_& s) {
        const cudnnDataType_t type = precision == Precision::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
        LOCKSTEP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&s.x));
        LOCKSTEP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&s.y));
        LOCKSTEP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&s.w));
        LOCKSTEP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&s.conv));
        LOCKSTEP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(s.x, CUDNN_TENSOR_NCHW, type, dim(c.N), dim(c.C), dim(c.H), dim(c.W)));
        LOCKSTEP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(s.y, CUDNN_TENSOR_NCHW, type, dim(c.N), dim(c.O), dim(c.OH), dim(c.OW)));
        LOCKSTEP_CUDNN_CHECK(cudnnSetFilter4dDescriptor(s.w, type, CUDNN_TENSOR_NCHW, dim(c.O), dim(c.C), dim(c.k), dim(c.k)));
        // fp32 compute in both precisions (bf16: cuDNN's PSEUDO_BFLOAT16 configuration)
        LOCKSTEP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(s.conv, dim(c.pad), dim(c.pad), dim(c.s), dim(c.s), 1, 1,
                                                             CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
        const cudnnMathType_t m = precision == Precision::bf16 ? CUDNN_TENSOR_OP_MATH
                                  : tf32(math, precision)      ? CUDNN_DEFAULT_MATH
                                                               : CUDNN_FMA_MATH;
        LOCKSTEP_CUDNN_CHECK(cudnnSetConvolutionMathType(s.conv, m));
    }

    // The process's choice for `key`, made here with this replica's handle if there is none yet.
    Choice choose(const Key& key, const Shape_& s) {
        Table& t = table();
        std::lock_guard lock(t.m);
        if (const auto it = t.choices.find(key); it != t.choices.end()) return it->second;
        Choice ch;
        bool f = false, d = false, w = false;
        {
            cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
            int n = 0;
            LOCKSTEP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle_, s.x, s.w, s.conv, s.y,
                                                                        CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, perf));
            f = pick(perf, n, ch.forward, [&](cudnnConvolutionFwdAlgo_t a, std::size_t* b) {
                return cudnnGetConvolutionForwardWorkspaceSize(handle_, s.x, s.w, s.conv, s.y, a, b);
            });
        }
        {
            cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
            int n = 0;
            LOCKSTEP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle_, s.w, s.y, s.conv, s.x,
                                                                             CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &n, perf));
            d = pick(perf, n, ch.backward_data, [&](cudnnConvolutionBwdDataAlgo_t a, std::size_t* b) {
                return cudnnGetConvolutionBackwardDataWorkspaceSize(handle_, s.w, s.y, s.conv, s.x, a, b);
            });
        }
        {
            cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
            int n = 0;
            LOCKSTEP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                handle_, s.x, s.y, s.conv, s.w, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, perf));
            w = pick(perf, n, ch.backward_filter, [&](cudnnConvolutionBwdFilterAlgo_t a, std::size_t* b) {
                return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle_, s.x, s.y, s.conv, s.w, a, b);
            });
        }
        ch.usable = f && d && w;
        t.choices.emplace(key, ch);
        return ch;
    }

    // The first supported, deterministic algorithm within the workspace cap, in cuDNN's ranking,
    // whose workspace query (`bytes(algo, &size)`) succeeds within the cap too: a ranking may list
    // an algorithm that the query then refuses, and the next one serves instead.
    template <class Perf, class Algo, class Bytes>
    static bool pick(const Perf* perf, int n, Algo& out, Bytes&& bytes) {
        for (int i = 0; i < n; ++i) {
            if (perf[i].status != CUDNN_STATUS_SUCCESS || perf[i].determinism != CUDNN_DETERMINISTIC ||
                perf[i].memory > max_workspace_bytes)
                continue;
            std::size_t size = 0;
            if (bytes(perf[i].algo, &size) != CUDNN_STATUS_SUCCESS || size > max_workspace_bytes) continue;
            out = perf[i].algo;
            return true;
        }
        return false;
    }

    static constexpr std::size_t max_shapes = 64;

    cudnnHandle_t handle_ = nullptr;
    std::map<Key, Shape_> shapes_;
};

#else

//! Without cuDNN: no handle; every convolution runs im2col + cuBLAS.
class CudnnConvolutions {};

#endif

}  // namespace lockstep::kernels::cuda_ops
