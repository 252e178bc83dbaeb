// SPDX-License-Identifier: MIT
//! lockstep's host CUDA device: the cuDNN entry points of NCHW convolutions in fp32 or bfloat16
//! (forward, backward data, backward filter), their descriptors and heuristics. A call checks its
//! descriptors against each other and its operands and workspace against the handle's device,
//! then enqueues im2col + OpenBLAS on the handle's stream (docs/gpus.md, "Convolutions on cuDNN").
#include <cuda_bf16.h>
#include <cudnn.h>

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "detail.hpp"
#include "host_cuda.hpp"

// The opaque types of cudnn.h, completed here.
struct cudnnContext {
    int device = 0;
    cudaStream_t stream = nullptr;  // resolved at each call
};
struct cudnnTensorStruct {
    bool set = false;
    int n = 0, c = 0, h = 0, w = 0;
    cudnnDataType_t type = CUDNN_DATA_FLOAT;
};
struct cudnnFilterStruct {
    bool set = false;
    int k = 0, c = 0, h = 0, w = 0;
    cudnnDataType_t type = CUDNN_DATA_FLOAT;
};
struct cudnnConvolutionStruct {
    bool set = false;
    int pad_h = 0, pad_w = 0, u = 1, v = 1;
    cudnnMathType_t math = CUDNN_DEFAULT_MATH;
};

namespace {

using namespace lockstep::host_cuda::detail;
namespace hc = lockstep::host_cuda;

struct State {
    std::mutex m;
    std::set<const void*> live;  // handles and descriptors not destroyed
    std::vector<std::unique_ptr<cudnnContext>> handles;
    std::vector<std::unique_ptr<cudnnTensorStruct>> tensors;
    std::vector<std::unique_ptr<cudnnFilterStruct>> filters;
    std::vector<std::unique_ptr<cudnnConvolutionStruct>> convolutions;  // kept: a dead address is never reused
    std::vector<hc::CudnnCall> calls;
    bool deterministic = true;
    std::set<std::pair<char, int>> refused;  // (direction, algorithm) ranked as supported, then refused
};

State& state() {
    static State* s = new State;
    return *s;
}

bool live(const void* p) {
    State& s = state();
    std::lock_guard lock(s.m);
    return p != nullptr && s.live.count(p) != 0;
}

template <class T>
cudnnStatus_t create(T** out, std::vector<std::unique_ptr<T>> State::*store) {
    if (out == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
    State& s = state();
    std::lock_guard lock(s.m);
    auto p = std::make_unique<T>();
    *out = p.get();
    s.live.insert(p.get());
    (s.*store).push_back(std::move(p));
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t destroy(const void* p) {
    State& s = state();
    std::lock_guard lock(s.m);
    if (p == nullptr) return CUDNN_STATUS_SUCCESS;
    if (s.live.erase(p) == 0) return CUDNN_STATUS_BAD_PARAM;
    return CUDNN_STATUS_SUCCESS;
}

// ---- geometry -----------------------------------------------------------------------------------

struct Geometry {
    int N = 0, C = 0, H = 0, W = 0, O = 0, kh = 1, kw = 1, ph = 0, pw = 0, u = 1, v = 1, OH = 0, OW = 0;
    bool tf32 = false;
    bool bf16 = false;              // every tensor bfloat16 (cuDNN's PSEUDO_BFLOAT16 configuration), else fp32
    int math = CUDNN_DEFAULT_MATH;  // the convolution descriptor's cudnnMathType_t
    std::int64_t K() const { return std::int64_t{C} * kh * kw; }
    std::int64_t P() const { return std::int64_t{OH} * OW; }
    std::size_t element() const { return bf16 ? sizeof(__nv_bfloat16) : sizeof(float); }
    std::size_t x_count() const { return std::size_t(N) * C * H * W; }
    std::size_t y_count() const { return std::size_t(N) * O * OH * OW; }
    std::size_t w_count() const { return std::size_t(O) * C * kh * kw; }
    std::size_t x_bytes() const { return x_count() * element(); }
    std::size_t y_bytes() const { return y_count() * element(); }
    std::size_t w_bytes() const { return w_count() * element(); }
};

//! The descriptors as one convolution, or an error when they do not fit together.
cudnnStatus_t geometry(const cudnnTensorStruct* x, const cudnnFilterStruct* w, const cudnnConvolutionStruct* conv,
                       const cudnnTensorStruct* y, Geometry& g) {
    if (!live(x) || !live(w) || !live(conv) || !live(y)) return CUDNN_STATUS_BAD_PARAM;
    if (!x->set || !w->set || !conv->set || !y->set) return CUDNN_STATUS_BAD_PARAM;
    if (w->c != x->c || y->n != x->n || y->c != w->k) return CUDNN_STATUS_BAD_PARAM;
    // cuDNN's configurations: every tensor of one type (fp32, or bf16 with fp32 compute).
    if (x->type != w->type || y->type != x->type) return CUDNN_STATUS_NOT_SUPPORTED;
    g.N = x->n, g.C = x->c, g.H = x->h, g.W = x->w, g.O = w->k, g.kh = w->h, g.kw = w->w;
    g.ph = conv->pad_h, g.pw = conv->pad_w, g.u = conv->u, g.v = conv->v;
    if (g.H + 2 * g.ph < g.kh || g.W + 2 * g.pw < g.kw) return CUDNN_STATUS_BAD_PARAM;
    g.OH = (g.H + 2 * g.ph - g.kh) / g.u + 1;
    g.OW = (g.W + 2 * g.pw - g.kw) / g.v + 1;
    if (y->h != g.OH || y->w != g.OW) return CUDNN_STATUS_BAD_PARAM;
    g.bf16 = x->type == CUDNN_DATA_BFLOAT16;
    g.math = conv->math;
    g.tf32 = !g.bf16 && conv->math != CUDNN_FMA_MATH;  // bf16 operands: their products are exact in fp32
    return CUDNN_STATUS_SUCCESS;
}

// ---- the heuristics -----------------------------------------------------------------------------
// Each direction's ranking puts what the caller must skip first -- an algorithm that is not
// supported, one whose workspace is too large, a non-deterministic one -- then the deterministic
// ones, rotated by the handle's device, so that replicas choosing each for themselves on
// different devices would choose differently.

struct Offer {
    int algo = 0;
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    bool deterministic = true;
    std::size_t memory = 0;
};

enum class Direction { forward, backward_data, backward_filter };

//! Workspace an algorithm needs: none for the implicit GEMM forward and ALGO_1 backward (device 1's
//! choice), one sample's columns (K x P floats) for the others (device 0's), which then hold them.
std::size_t need(Direction d, int algo, const Geometry& g) {
    const std::size_t cols = std::size_t(g.K()) * std::size_t(g.P()) * sizeof(float);
    switch (d) {
        case Direction::forward: return algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM ? 0 : cols;
        case Direction::backward_data: return algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1 ? 0 : cols;
        case Direction::backward_filter: return algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ? 0 : cols;
    }
    return 0;
}

std::vector<Offer> offers(Direction d, int device, const Geometry& g) {
    bool deterministic = true;
    {
        State& s = state();
        std::lock_guard lock(s.m);
        deterministic = s.deterministic;
    }
    std::vector<Offer> out;
    std::vector<int> good;
    switch (d) {
        case Direction::forward:
            out.push_back({CUDNN_CONVOLUTION_FWD_ALGO_FFT, CUDNN_STATUS_NOT_SUPPORTED, true, 0});
            out.push_back({CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED, CUDNN_STATUS_SUCCESS, true, std::size_t{2} << 30});
            good = {CUDNN_CONVOLUTION_FWD_ALGO_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                    CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM};
            break;
        case Direction::backward_data:
            out.push_back({CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, CUDNN_STATUS_SUCCESS, false, 0});
            good = {CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1};
            break;
        case Direction::backward_filter:
            out.push_back({CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, CUDNN_STATUS_SUCCESS, false, 0});
            out.push_back({CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3, CUDNN_STATUS_SUCCESS, false, 0});
            good = {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1};
            break;
    }
    std::rotate(good.begin(), good.begin() + device % static_cast<int>(good.size()), good.end());
    // Without deterministic algorithms (set_cudnn_deterministic(false)) the backward filter has none.
    const bool det = deterministic || d != Direction::backward_filter;
    for (int a : good) out.push_back({a, CUDNN_STATUS_SUCCESS, det, need(d, a, g)});
    return out;
}

char letter(Direction d) { return d == Direction::forward ? 'f' : d == Direction::backward_data ? 'd' : 'w'; }

//! The offer of `algo` if the heuristics rank it as supported and it is not refused (as a
//! ranking may list an algorithm that the workspace query or the call then refuses).
const Offer* offered(Direction d, int device, const Geometry& g, int algo, std::vector<Offer>& all) {
    {
        State& s = state();
        std::lock_guard lock(s.m);
        if (s.refused.count({letter(d), algo}) != 0) return nullptr;
    }
    all = offers(d, device, g);
    for (const Offer& o : all)
        if (o.algo == algo && o.status == CUDNN_STATUS_SUCCESS) return &o;
    return nullptr;
}

template <class Perf, class Algo>
cudnnStatus_t rank(cudnnHandle_t handle, Direction d, const Geometry& g, int requested, int* returned, Perf* perf) {
    if (!live(handle)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (returned == nullptr || perf == nullptr || requested < 1) return CUDNN_STATUS_BAD_PARAM;
    const auto all = offers(d, handle->device, g);
    const int n = std::min<int>(requested, static_cast<int>(all.size()));
    for (int i = 0; i < n; ++i) {
        perf[i] = Perf{};
        perf[i].algo = static_cast<Algo>(all[static_cast<std::size_t>(i)].algo);
        perf[i].status = all[static_cast<std::size_t>(i)].status;
        perf[i].time = static_cast<float>(i + 1);
        perf[i].memory = all[static_cast<std::size_t>(i)].memory;
        perf[i].determinism = all[static_cast<std::size_t>(i)].deterministic ? CUDNN_DETERMINISTIC : CUDNN_NON_DETERMINISTIC;
        perf[i].mathType = g.tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
    }
    *returned = n;
    return CUDNN_STATUS_SUCCESS;
}

// ---- the arithmetic -----------------------------------------------------------------------------

//! cols (K x P) of sample `x` (C x H x W), zero outside the image; TF32-rounded with `tf32`.
void im2col(const Geometry& g, const float* x, float* cols, bool tf32) {
    const std::int64_t P = g.P();
    for (int c = 0; c < g.C; ++c)
        for (int i = 0; i < g.kh; ++i)
            for (int j = 0; j < g.kw; ++j) {
                float* row = cols + ((std::int64_t{c} * g.kh + i) * g.kw + j) * P;
                for (int oh = 0; oh < g.OH; ++oh)
                    for (int ow = 0; ow < g.OW; ++ow) {
                        const int ih = oh * g.u - g.ph + i, iw = ow * g.v - g.pw + j;
                        const float v =
                            ih >= 0 && ih < g.H && iw >= 0 && iw < g.W ? x[(std::int64_t{c} * g.H + ih) * g.W + iw] : 0.0f;
                        row[std::int64_t{oh} * g.OW + ow] = tf32 ? to_tf32(v) : v;
                    }
            }
}

//! img (C x H x W) += the columns' contributions.
void col2im(const Geometry& g, const float* cols, float* img) {
    const std::int64_t P = g.P();
    for (int c = 0; c < g.C; ++c)
        for (int i = 0; i < g.kh; ++i)
            for (int j = 0; j < g.kw; ++j) {
                const float* row = cols + ((std::int64_t{c} * g.kh + i) * g.kw + j) * P;
                for (int oh = 0; oh < g.OH; ++oh)
                    for (int ow = 0; ow < g.OW; ++ow) {
                        const int ih = oh * g.u - g.ph + i, iw = ow * g.v - g.pw + j;
                        if (ih >= 0 && ih < g.H && iw >= 0 && iw < g.W)
                            img[(std::int64_t{c} * g.H + ih) * g.W + iw] += row[std::int64_t{oh} * g.OW + ow];
                    }
            }
}

std::vector<float> rounded(const float* p, std::size_t n, bool tf32) {
    std::vector<float> out(p, p + n);
    if (tf32)
        for (float& v : out) v = to_tf32(v);
    return out;
}

//! out = alpha * value + beta * out (beta == 0 ignores out: NaN there does not propagate); a
//! bf16 output is widened, blended in fp32 and rounded once to nearest even.
void blend(float* out, const float* value, std::size_t n, float alpha, float beta) {
    for (std::size_t i = 0; i < n; ++i) out[i] = alpha * value[i] + (beta == 0.0f ? 0.0f : beta * out[i]);
}
void blend(__nv_bfloat16* out, const float* value, std::size_t n, float alpha, float beta) {
    for (std::size_t i = 0; i < n; ++i)
        out[i] = __float2bfloat16_rn(alpha * value[i] + (beta == 0.0f ? 0.0f : beta * __bfloat162float(out[i])));
}
void blend(void* out, const float* value, std::size_t n, float alpha, float beta, bool bf16) {
    if (bf16)
        blend(static_cast<__nv_bfloat16*>(out), value, n, alpha, beta);
    else
        blend(static_cast<float*>(out), value, n, alpha, beta);
}

//! An operand as fp32: its own elements, or a bf16 operand widened (exactly) at the op.
struct Wide {
    const float* p = nullptr;
    std::vector<float> own;
    Wide(const void* src, std::size_t n, bool bf16) {
        if (!bf16) {
            p = static_cast<const float*>(src);
            return;
        }
        own.resize(n);
        const auto* b = static_cast<const __nv_bfloat16*>(src);
        for (std::size_t i = 0; i < n; ++i) own[i] = __bfloat162float(b[i]);
        p = own.data();
    }
};

// ---- the calls ----------------------------------------------------------------------------------

//! A convolution call admitted: the handle's stream, alpha and beta (read at the call), and the
//! workspace where the algorithm keeps its columns (null where it needs none).
struct Admitted {
    std::shared_ptr<Stream> stream;
    float alpha = 1, beta = 0;
    float* work = nullptr;
    std::vector<std::pair<const void*, std::size_t>> ranges;  // the operands and the workspace used
};

//! Whether [a, a + an) and [b, b + bn) share a byte.
bool overlap(const void* a, std::size_t an, const void* b, std::size_t bn) {
    const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
    return an > 0 && bn > 0 && x < y + bn && y < x + an;
}

//! The checks every convolution call makes, the operands' pointers first; `operands[output]` is
//! the one written, which may share no byte with another operand or the workspace (cuDNN would
//! read what it already overwrote: garbage on a GPU, refused here).
cudnnStatus_t admit(cudnnHandle_t handle, const Geometry& g, Direction d, int algo, void* work, std::size_t work_bytes,
                    const void* alpha, const void* beta, const std::vector<std::pair<const void*, std::size_t>>& operands,
                    std::size_t output, Admitted& out) {
    if (alpha == nullptr || beta == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
    for (const auto& operand : operands)
        if (operand.first == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
    if (!live(handle)) return CUDNN_STATUS_NOT_INITIALIZED;
    std::vector<Offer> all;
    const Offer* o = offered(d, handle->device, g, algo, all);
    if (o == nullptr) return CUDNN_STATUS_NOT_SUPPORTED;
    if (work_bytes < o->memory) return CUDNN_STATUS_BAD_PARAM;  // the workspace is smaller than the algorithm needs
    if (o->memory > 0 && device_of_range(work, o->memory) != handle->device) return CUDNN_STATUS_EXECUTION_FAILED;
    for (const auto& [p, bytes] : operands)
        if (bytes > 0 && device_of_range(p, bytes) != handle->device) return CUDNN_STATUS_EXECUTION_FAILED;
    const auto& [written, written_bytes] = operands[output];
    if (overlap(written, written_bytes, work, o->memory)) return CUDNN_STATUS_BAD_PARAM;
    for (std::size_t i = 0; i < operands.size(); ++i)
        if (i != output && overlap(written, written_bytes, operands[i].first, operands[i].second)) return CUDNN_STATUS_BAD_PARAM;
    if (current_device() != handle->device || stream_for_work(handle->stream, out.stream) != cudaSuccess)
        return CUDNN_STATUS_EXECUTION_FAILED;
    out.alpha = *static_cast<const float*>(alpha);
    out.beta = *static_cast<const float*>(beta);
    out.work = o->memory > 0 ? static_cast<float*>(work) : nullptr;
    for (const auto& [p, bytes] : operands)
        if (bytes > 0) out.ranges.emplace_back(p, bytes);
    if (o->memory > 0) out.ranges.emplace_back(work, o->memory);
    State& st = state();
    std::lock_guard lock(st.m);
    st.calls.push_back({handle->device, letter(d), algo, g.tf32, work_bytes, g.N, g.C, g.H, g.W, g.O, g.bf16, g.math});
    return CUDNN_STATUS_SUCCESS;
}

//! The workspace `algo` of direction `d` needs for the convolution the descriptors made `g`.
cudnnStatus_t workspace_size(cudnnHandle_t handle, Direction d, cudnnStatus_t described, const Geometry& g, int algo,
                             std::size_t* bytes) {
    if (!live(handle)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (described != CUDNN_STATUS_SUCCESS) return described;
    std::vector<Offer> all;
    const Offer* o = offered(d, handle->device, g, algo, all);
    if (o == nullptr) return CUDNN_STATUS_NOT_SUPPORTED;
    if (bytes == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
    *bytes = o->memory;
    return CUDNN_STATUS_SUCCESS;
}

}  // namespace

namespace lockstep::host_cuda {

std::vector<CudnnCall> cudnn_calls() {
    State& s = state();
    std::lock_guard lock(s.m);
    return s.calls;
}

void refuse_cudnn_algorithm(char direction, int algorithm) {
    State& s = state();
    std::lock_guard lock(s.m);
    s.refused.insert({direction, algorithm});
}

void set_cudnn_deterministic(bool offered) {
    State& s = state();
    std::lock_guard lock(s.m);
    s.deterministic = offered;
}

namespace detail {
void reset_cudnn() {
    State& s = state();
    std::lock_guard lock(s.m);
    s.calls.clear();
    s.deterministic = true;
    s.refused.clear();
}
}  // namespace detail

}  // namespace lockstep::host_cuda

extern "C" {

size_t cudnnGetVersion(void) { return CUDNN_VERSION; }

const char* cudnnGetErrorString(cudnnStatus_t status) {
    switch (status) {
        case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
        case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
        case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
        case CUDNN_STATUS_BAD_PARAM_NULL_POINTER: return "CUDNN_STATUS_BAD_PARAM_NULL_POINTER";
        case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
        case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
        case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
        case CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER: return "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER";
        default: return "CUDNN_STATUS_UNKNOWN";
    }
}

cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
    if (handle == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
    if (sticky(current_device()) != cudaSuccess) return CUDNN_STATUS_NOT_INITIALIZED;
    // A cuDNN that cannot start (a library newer than the driver), for a whole process.
    if (const char* e = std::getenv("LOCKSTEP_HOSTCUDA_CUDNN_CREATE"); e != nullptr && std::string(e) == "fail")
        return CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER;
    static std::once_flag once;
    std::call_once(once, [] { openblas_set_num_threads(1); });  // the stream workers are the parallelism
    const cudnnStatus_t st = create(handle, &State::handles);
    if (st == CUDNN_STATUS_SUCCESS) (*handle)->device = current_device();
    return st;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) { return handle == nullptr ? CUDNN_STATUS_BAD_PARAM : destroy(handle); }
cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId) {
    if (!live(handle)) return CUDNN_STATUS_NOT_INITIALIZED;
    std::shared_ptr<Stream> s;
    if (resolve_stream_on(streamId, handle->device, s) != cudaSuccess) return CUDNN_STATUS_BAD_PARAM;
    handle->stream = streamId;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d) { return create(d, &State::tensors); }
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) { return destroy(d); }
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t format, cudnnDataType_t type, int n,
                                         int c, int h, int w) {
    if (!live(d)) return CUDNN_STATUS_BAD_PARAM;
    if (format != CUDNN_TENSOR_NCHW || (type != CUDNN_DATA_FLOAT && type != CUDNN_DATA_BFLOAT16))
        return CUDNN_STATUS_NOT_SUPPORTED;
    if (n <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
    *d = {true, n, c, h, w, type};
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d) { return create(d, &State::filters); }
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) { return destroy(d); }
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t type, cudnnTensorFormat_t format, int k,
                                         int c, int h, int w) {
    if (!live(d)) return CUDNN_STATUS_BAD_PARAM;
    if (format != CUDNN_TENSOR_NCHW || (type != CUDNN_DATA_FLOAT && type != CUDNN_DATA_BFLOAT16))
        return CUDNN_STATUS_NOT_SUPPORTED;
    if (k <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
    *d = {true, k, c, h, w, type};
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d) { return create(d, &State::convolutions); }
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) { return destroy(d); }
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h, int pad_w, int u, int v, int dilation_h,
                                              int dilation_w, cudnnConvolutionMode_t mode, cudnnDataType_t compute) {
    if (!live(d)) return CUDNN_STATUS_BAD_PARAM;
    if (pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dilation_h <= 0 || dilation_w <= 0) return CUDNN_STATUS_BAD_PARAM;
    // lockstep's convolutions are cross-correlations with fp32 compute (fp32 or bf16 tensors)
    // without dilation: the double does no other.
    if (dilation_h != 1 || dilation_w != 1 || mode != CUDNN_CROSS_CORRELATION || compute != CUDNN_DATA_FLOAT)
        return CUDNN_STATUS_NOT_SUPPORTED;
    d->set = true;
    d->pad_h = pad_h, d->pad_w = pad_w, d->u = u, d->v = v;
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t math) {
    if (!live(d)) return CUDNN_STATUS_BAD_PARAM;
    if (math != CUDNN_DEFAULT_MATH && math != CUDNN_TENSOR_OP_MATH && math != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION &&
        math != CUDNN_FMA_MATH)
        return CUDNN_STATUS_BAD_PARAM;
    d->math = math;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t handle, const cudnnTensorDescriptor_t x,
                                                     const cudnnFilterDescriptor_t w, const cudnnConvolutionDescriptor_t conv,
                                                     const cudnnTensorDescriptor_t y, const int requested, int* returned,
                                                     cudnnConvolutionFwdAlgoPerf_t* perf) {
    Geometry g;
    if (const cudnnStatus_t st = geometry(x, w, conv, y, g); st != CUDNN_STATUS_SUCCESS) return st;
    return rank<cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t>(handle, Direction::forward, g, requested, returned,
                                                                          perf);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t handle, const cudnnFilterDescriptor_t w,
                                                          const cudnnTensorDescriptor_t dy,
                                                          const cudnnConvolutionDescriptor_t conv,
                                                          const cudnnTensorDescriptor_t dx, const int requested, int* returned,
                                                          cudnnConvolutionBwdDataAlgoPerf_t* perf) {
    Geometry g;
    if (const cudnnStatus_t st = geometry(dx, w, conv, dy, g); st != CUDNN_STATUS_SUCCESS) return st;
    return rank<cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t>(handle, Direction::backward_data, g, requested,
                                                                                  returned, perf);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t handle, const cudnnTensorDescriptor_t x,
                                                            const cudnnTensorDescriptor_t dy,
                                                            const cudnnConvolutionDescriptor_t conv,
                                                            const cudnnFilterDescriptor_t dw, const int requested, int* returned,
                                                            cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
    Geometry g;
    if (const cudnnStatus_t st = geometry(x, dw, conv, dy, g); st != CUDNN_STATUS_SUCCESS) return st;
    return rank<cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t>(handle, Direction::backward_filter, g,
                                                                                      requested, returned, perf);
}

cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t handle, const cudnnTensorDescriptor_t x,
                                                      const cudnnFilterDescriptor_t w, const cudnnConvolutionDescriptor_t conv,
                                                      const cudnnTensorDescriptor_t y, cudnnConvolutionFwdAlgo_t algo,
                                                      size_t* bytes) {
    Geometry g;
    const cudnnStatus_t described = geometry(x, w, conv, y, g);
    return workspace_size(handle, Direction::forward, described, g, algo, bytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(cudnnHandle_t handle, const cudnnFilterDescriptor_t w,
                                                           const cudnnTensorDescriptor_t dy,
                                                           const cudnnConvolutionDescriptor_t conv,
                                                           const cudnnTensorDescriptor_t dx, cudnnConvolutionBwdDataAlgo_t algo,
                                                           size_t* bytes) {
    Geometry g;
    const cudnnStatus_t described = geometry(dx, w, conv, dy, g);
    return workspace_size(handle, Direction::backward_data, described, g, algo, bytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(cudnnHandle_t handle, const cudnnTensorDescriptor_t x,
                                                             const cudnnTensorDescriptor_t dy,
                                                             const cudnnConvolutionDescriptor_t conv,
                                                             const cudnnFilterDescriptor_t dw,
                                                             cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
    Geometry g;
    const cudnnStatus_t described = geometry(x, dw, conv, dy, g);
    return workspace_size(handle, Direction::backward_filter, described, g, algo, bytes);
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t handle, const void* alpha, const cudnnTensorDescriptor_t xDesc, const void* x,
                                      const cudnnFilterDescriptor_t wDesc, const void* w,
                                      const cudnnConvolutionDescriptor_t convDesc, cudnnConvolutionFwdAlgo_t algo,
                                      void* workSpace, size_t workSpaceSizeInBytes, const void* beta,
                                      const cudnnTensorDescriptor_t yDesc, void* y) {
    Geometry g;
    if (const cudnnStatus_t st = geometry(xDesc, wDesc, convDesc, yDesc, g); st != CUDNN_STATUS_SUCCESS) return st;
    Admitted call;
    if (const cudnnStatus_t st = admit(handle, g, Direction::forward, algo, workSpace, workSpaceSizeInBytes, alpha, beta,
                                       {{x, g.x_bytes()}, {w, g.w_bytes()}, {y, g.y_bytes()}}, 2, call);
        st != CUDNN_STATUS_SUCCESS)
        return st;
    const float a = call.alpha, b = call.beta;
    float* work = call.work;
    Op op;
    op.body = [=] {
        const std::int64_t K = g.K(), P = g.P();
        const Wide xs(x, g.x_count(), g.bf16), ws(w, g.w_count(), g.bf16);
        const auto wr = rounded(ws.p, g.w_count(), g.tf32);
        std::vector<float> own(work == nullptr ? std::size_t(K * P) : 0), out(std::size_t(g.O) * std::size_t(P));
        float* cols = work != nullptr ? work : own.data();  // the algorithm's workspace holds the columns
        for (int n = 0; n < g.N; ++n) {
            im2col(g, xs.p + std::int64_t{n} * g.C * g.H * g.W, cols, g.tf32);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g.O, static_cast<int>(P), static_cast<int>(K), 1.0f, wr.data(),
                        static_cast<int>(K), cols, static_cast<int>(P), 0.0f, out.data(), static_cast<int>(P));
            blend(static_cast<char*>(y) + std::size_t(n) * g.O * P * g.element(), out.data(), out.size(), a, b, g.bf16);
        }
    };
    op.device_ranges = call.ranges;
    enqueue(call.stream, std::move(op));
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t handle, const void* alpha, const cudnnFilterDescriptor_t wDesc,
                                           const void* w, const cudnnTensorDescriptor_t dyDesc, const void* dy,
                                           const cudnnConvolutionDescriptor_t convDesc, cudnnConvolutionBwdDataAlgo_t algo,
                                           void* workSpace, size_t workSpaceSizeInBytes, const void* beta,
                                           const cudnnTensorDescriptor_t dxDesc, void* dx) {
    Geometry g;
    if (const cudnnStatus_t st = geometry(dxDesc, wDesc, convDesc, dyDesc, g); st != CUDNN_STATUS_SUCCESS) return st;
    Admitted call;
    if (const cudnnStatus_t st = admit(handle, g, Direction::backward_data, algo, workSpace, workSpaceSizeInBytes, alpha, beta,
                                       {{dx, g.x_bytes()}, {w, g.w_bytes()}, {dy, g.y_bytes()}}, 0, call);
        st != CUDNN_STATUS_SUCCESS)
        return st;
    const float a = call.alpha, b = call.beta;
    float* work = call.work;
    Op op;
    op.body = [=] {
        const std::int64_t K = g.K(), P = g.P(), image = std::int64_t{g.C} * g.H * g.W;
        const Wide ws(w, g.w_count(), g.bf16), dys(dy, g.y_count(), g.bf16);
        const auto wr = rounded(ws.p, g.w_count(), g.tf32);
        std::vector<float> own(work == nullptr ? std::size_t(K * P) : 0), img(static_cast<std::size_t>(image));
        float* dcols = work != nullptr ? work : own.data();
        for (int n = 0; n < g.N; ++n) {
            const auto dyr = rounded(dys.p + std::int64_t{n} * g.O * P, std::size_t(g.O) * std::size_t(P), g.tf32);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(K), static_cast<int>(P), g.O, 1.0f, wr.data(),
                        static_cast<int>(K), dyr.data(), static_cast<int>(P), 0.0f, dcols, static_cast<int>(P));
            std::fill(img.begin(), img.end(), 0.0f);
            col2im(g, dcols, img.data());
            blend(static_cast<char*>(dx) + std::size_t(n) * std::size_t(image) * g.element(), img.data(), img.size(), a, b,
                  g.bf16);
        }
    };
    op.device_ranges = call.ranges;
    enqueue(call.stream, std::move(op));
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t handle, const void* alpha, const cudnnTensorDescriptor_t xDesc,
                                             const void* x, const cudnnTensorDescriptor_t dyDesc, const void* dy,
                                             const cudnnConvolutionDescriptor_t convDesc, cudnnConvolutionBwdFilterAlgo_t algo,
                                             void* workSpace, size_t workSpaceSizeInBytes, const void* beta,
                                             const cudnnFilterDescriptor_t dwDesc, void* dw) {
    Geometry g;
    if (const cudnnStatus_t st = geometry(xDesc, dwDesc, convDesc, dyDesc, g); st != CUDNN_STATUS_SUCCESS) return st;
    Admitted call;
    if (const cudnnStatus_t st = admit(handle, g, Direction::backward_filter, algo, workSpace, workSpaceSizeInBytes, alpha, beta,
                                       {{x, g.x_bytes()}, {dw, g.w_bytes()}, {dy, g.y_bytes()}}, 1, call);
        st != CUDNN_STATUS_SUCCESS)
        return st;
    const float a = call.alpha, b = call.beta;
    float* work = call.work;
    Op op;
    op.body = [=] {
        const std::int64_t K = g.K(), P = g.P();
        const Wide xs(x, g.x_count(), g.bf16), dys(dy, g.y_count(), g.bf16);
        std::vector<float> own(work == nullptr ? std::size_t(K * P) : 0), acc(std::size_t(g.O) * std::size_t(K), 0.0f);
        float* cols = work != nullptr ? work : own.data();
        for (int n = 0; n < g.N; ++n) {
            im2col(g, xs.p + std::int64_t{n} * g.C * g.H * g.W, cols, g.tf32);
            const auto dyr = rounded(dys.p + std::int64_t{n} * g.O * P, std::size_t(g.O) * std::size_t(P), g.tf32);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g.O, static_cast<int>(K), static_cast<int>(P), 1.0f, dyr.data(),
                        static_cast<int>(P), cols, static_cast<int>(P), 1.0f, acc.data(), static_cast<int>(K));
        }
        blend(dw, acc.data(), acc.size(), a, b, g.bf16);
    };
    op.device_ranges = call.ranges;
    enqueue(call.stream, std::move(op));
    return CUDNN_STATUS_SUCCESS;
}

}  // extern "C"
