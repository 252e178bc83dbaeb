// SPDX-License-Identifier: MIT
//! `lockstep::torch::SyncBatchNorm`: batch normalization over the global batch of a
//! lockstep::torch::DataParallel, as a libtorch module with its own autograd function, and
//! `convert_sync_batchnorm`, which swaps a model's BatchNorm layers for it.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "lockstep/comm/collective_tag.hpp"
#include "lockstep/comm/collectives.hpp"
#include "lockstep/core/device_span.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::torch {

// Note [libtorch SyncBatchNorm]
// A forward in training mode computes each channel's mean and biased variance of the replica's
// shard (libtorch's batch-norm statistics, at::batch_norm_update_stats: two passes, the second
// over x - mean, in x's type, or in fp32 for fp16 and bf16), turns them into the shard's sums in fp64 (S = n*m,
// Q = n*(v + m^2), n) and all-reduces [S | Q | n], 2C+1 doubles, once on the replica's layer
// group: mean = S/N, var = Q/N - mean^2. The fp64 sums keep the variance's digits unless
// |mean|/std approaches 1e6; the shard's own variance is taken about its mean, so it does not
// depend on where the data sits. y = (x - mean) * invstd * weight + bias. (at::var_mean gives the
// same statistics at 4x the time on a CPU: 34 against 8 ms for 128x64x28x28 on one thread.) The running statistics are updated
// once per forward, from the global statistics, identically on every replica (unbiased variance
// N/(N-1), PyTorch's momentum or cumulative average). The normalization is libtorch's fused
// eval-mode batch norm given the global statistics. The backward takes the shard's sums of dy and
// dy*xhat (the weight's and bias's gradients of this replica: DataParallel's gradient all-reduce
// sums them), all-reduces those sums (2C doubles) once and computes
//   dx = weight*invstd * (dy - sum_dy/N - xhat * sum_dy_xhat/N) = a*dy + b*x + d,
// with a, b, d per channel (in fp64, then x's type; fp32 for fp16 and bf16 inputs, whose
// statistics are fp32 too, as in libtorch's batch norm: their cost is an fp32 copy of x forward
// and fp32 temporaries of its size backward; in eval mode such an input is normalized with fp32
// parameters and running statistics, whatever their own type). On a CPU, for the layouts batch norm meets
// (contiguous, channels-last, fp32 or fp64), the sums come from libtorch's eval-mode backward with
// the global statistics (its reductions only) and dx from one pass over dy and x; elsewhere (other
// strides, CUDA) from libtorch's generic ops, which the strided CPU inputs of the tests run. Outside a
// DataParallel (no replica group) the layer is a BatchNorm of its own batch, and computes the same
// numbers, so a model keeps its SyncBatchNorm layers when it runs alone. In eval mode it
// normalizes by the running statistics and makes no collective; a layer without running
// statistics normalizes by the global batch's in eval mode too (PyTorch's SyncBatchNorm by each
// replica's own there), so DataParallel::forward gives the same rows whatever the replicas.

namespace detail {

//! What a replica's SyncBatchNorm layers reach their peers through, set by DataParallel on the
//! replica's thread for the duration of a call (null: the layer runs alone).
struct ReplicaLink {
    comm::Collectives* layer = nullptr;  // the replica's layer group
    // The buffers of this call's collectives: a peer may still read one after an abort, so they
    // live until the replica's next call (HostCommunicator's rule).
    std::vector<at::Tensor> held;
};

//! DataParallel's warning of an unconverted BatchNorm, once per process.
inline std::once_flag& unconverted_warning() {
    static std::once_flag once;
    return once;
}

inline ReplicaLink*& current_link() noexcept {
    thread_local ReplicaLink* link = nullptr;
    return link;
}

//! Sets the calling thread's replica link for a scope.
class LinkScope {
public:
    explicit LinkScope(ReplicaLink* link) noexcept : saved_(std::exchange(current_link(), link)) {}
    LinkScope(const LinkScope&) = delete;
    LinkScope& operator=(const LinkScope&) = delete;
    ~LinkScope() { current_link() = saved_; }

private:
    ReplicaLink* saved_;
};

// Sums `t` (a contiguous fp64 CPU tensor) over the replicas in place.
inline void all_reduce(ReplicaLink* link, at::Tensor& t, comm::CollectiveSite site) {
    if (link == nullptr || link->layer == nullptr) return;
    link->held.push_back(t);
    auto* comm = link->layer;
    LOCKSTEP_CHECK(t.device().is_cpu(), "SyncBatchNorm's sums are all-reduced on the host");
    comm->all_reduce_sum(DeviceSpan<double>(t.data_ptr<double>(), static_cast<std::size_t>(t.numel()), Device::host()),
                         site);
}

// Every dimension but the channels (1).
inline std::vector<std::int64_t> reduced_dims(const at::Tensor& x) {
    std::vector<std::int64_t> dims{0};
    for (std::int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    return dims;
}

// A per-channel vector shaped to broadcast against `x` (channel dimension 1).
inline at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
    std::vector<std::int64_t> shape(static_cast<std::size_t>(x.dim()), 1);
    shape[1] = v.numel();
    return v.view(shape);
}

template <class T>
void affine_rows(const T* dy, const T* x, T* dx, const T* a, const T* b, const T* d, std::int64_t channels, std::int64_t inner,
                 std::int64_t numel) {
    if (inner == 1) {  // the channel is the innermost dimension (channels-last, or rank 2)
        const std::int64_t positions = numel / channels;
        at::parallel_for(0, positions, std::max<std::int64_t>(1, 32768 / channels), [&](std::int64_t begin, std::int64_t end) {
            for (std::int64_t p = begin; p < end; ++p) {
                const std::int64_t o = p * channels;
                for (std::int64_t c = 0; c < channels; ++c) dx[o + c] = a[c] * dy[o + c] + b[c] * x[o + c] + d[c];
            }
        });
        return;
    }
    const std::int64_t rows = numel / inner;  // (sample, channel) rows of the spatial positions
    at::parallel_for(0, rows, std::max<std::int64_t>(1, 32768 / inner), [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t row = begin; row < end; ++row) {
            const std::int64_t c = row % channels;
            const T ac = a[c], bc = b[c], dc = d[c];
            const std::int64_t o = row * inner;
            for (std::int64_t i = 0; i < inner; ++i) dx[o + i] = ac * dy[o + i] + bc * x[o + i] + dc;
        }
    });
}

// The CPU layouts the backward's one-pass paths serve (Note [libtorch SyncBatchNorm]): x and dy
// fp32 or fp64 CPU tensors, both contiguous or both channels-last. `none`: libtorch's generic ops.
enum class OnePass { none, contiguous, channels_last };
inline at::MemoryFormat channels_last_format(const at::Tensor& x) {
    return x.dim() == 5 ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::ChannelsLast;
}
inline OnePass one_pass_layout(const at::Tensor& dy, const at::Tensor& x) {
    const bool fits = x.device().is_cpu() && dy.device().is_cpu() && dy.scalar_type() == x.scalar_type() &&
                      (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) && x.numel() > 0;
    if (!fits) return OnePass::none;
    if (x.is_contiguous() && dy.is_contiguous()) return OnePass::contiguous;
    const auto last = channels_last_format(x);
    if ((x.dim() == 4 || x.dim() == 5) && x.is_contiguous(last) && dy.is_contiguous(last)) return OnePass::channels_last;
    return OnePass::none;
}

// a*dy + b*x + d with a, b, d per channel (dim 1), in x's type and memory format; `layout` is
// one_pass_layout(dy, x).
inline at::Tensor per_channel_affine(OnePass layout, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& a,
                                     const at::Tensor& b, const at::Tensor& d) {
    const std::int64_t C = x.size(1);
    if (layout == OnePass::none)  // in a, b and d's type (fp32 for an fp16 or bf16 x), then x's
        return at::addcmul(per_channel(d, x), dy, per_channel(a, x)).addcmul_(x, per_channel(b, x)).to(x.scalar_type());
    const bool last = layout == OnePass::channels_last;
    auto dx = at::empty_like(x, last ? channels_last_format(x) : at::MemoryFormat::Contiguous);
    const std::int64_t inner = last ? 1 : x.numel() / (x.size(0) * C);
    const auto run = [&]<class T>(T*) {
        const auto ac = a.contiguous(), bc = b.contiguous(), dc = d.contiguous();
        affine_rows<T>(dy.data_ptr<T>(), x.data_ptr<T>(), dx.data_ptr<T>(), ac.data_ptr<T>(), bc.data_ptr<T>(), dc.data_ptr<T>(),
                       C, inner, x.numel());
    };
    if (x.scalar_type() == at::kFloat)
        run(static_cast<float*>(nullptr));
    else
        run(static_cast<double*>(nullptr));
    return dx;
}

// The type of the statistics and of dx's coefficients: fp32 for an fp16 or bf16 input (whatever
// its parameters' type: libtorch's mixed-type batch norm then gets fp32 parameters), x's type
// otherwise.
inline at::ScalarType stat_type(const at::Tensor& x) {
    const bool reduced = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
    return reduced ? at::kFloat : x.scalar_type();
}
inline at::Tensor in_stat_type(const at::Tensor& parameter, const at::Tensor& x) {
    return parameter.defined() ? parameter.to(stat_type(x)) : parameter;
}

struct SyncBnArgs {
    ReplicaLink* link = nullptr;
    std::uint64_t layer_id = 0;
    double eps = 1e-5;
    std::optional<double> momentum = 0.1;
    at::Tensor running_mean;  // undefined: not tracked
    at::Tensor running_var;
    at::Tensor num_batches_tracked;
    std::string name;  // for messages
};

//! The autograd function of a training-mode forward (Note [libtorch SyncBatchNorm]).
struct SyncBnFunction : ::torch::autograd::Function<SyncBnFunction> {
    static at::Tensor forward(::torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& bias, const SyncBnArgs* args) {
        const std::int64_t C = x.size(1);
        const std::int64_t n = C > 0 ? x.numel() / C : 0;
        auto payload = at::zeros({2 * C + 1}, x.options().dtype(at::kDouble).device(at::kCPU));
        if (n > 0) {
            // libtorch's batch-norm statistics on a CPU; elsewhere at::var_mean, whose variance is
            // the biased one by its contract (correction 0). Both give an fp16 or bf16 input's
            // statistics in its own type (a mean of 40 to the nearest 0.25 in bf16): they read an
            // fp32 copy of it.
            const auto xs = x.to(stat_type(x));  // x itself unless fp16 or bf16
            at::Tensor mean, var;
            if (x.device().is_cpu())
                std::tie(mean, var) = at::batch_norm_update_stats(xs, std::nullopt, std::nullopt, 0.0);
            else
                std::tie(var, mean) = at::var_mean(xs, reduced_dims(x), /*correction=*/0, /*keepdim=*/false);
            const auto m = mean.to(at::kDouble).cpu();
            const auto v = var.to(at::kDouble).cpu();
            payload.narrow(0, 0, C).copy_(m * static_cast<double>(n));
            payload.narrow(0, C, C).copy_((v + m * m) * static_cast<double>(n));
            payload[2 * C] = static_cast<double>(n);
        }
        all_reduce(args->link, payload, comm::CollectiveSite::layer(args->layer_id, 0));
        const double N = payload[2 * C].item<double>();
        LOCKSTEP_CHECK_AS(ShapeError, N > 1, args->name, ": expected more than 1 value per channel when training, got ",
                          static_cast<std::int64_t>(N), " over the global batch (input of shape ", x.sizes(), ")");
        const auto mean64 = payload.narrow(0, 0, C) / N;
        const auto var64 = (payload.narrow(0, C, C) / N - mean64 * mean64).clamp_min(0.0);
        const auto mean = mean64.to(stat_type(x)).to(x.device());
        const auto var = var64.to(stat_type(x)).to(x.device());
        if (args->running_mean.defined()) {
            ::torch::NoGradGuard no_grad;
            args->num_batches_tracked.add_(1);
            const double f = args->momentum ? *args->momentum
                                            : 1.0 / static_cast<double>(args->num_batches_tracked.item<std::int64_t>());
            const auto unbiased = var64 * (N / (N - 1.0));
            args->running_mean.mul_(1.0 - f).add_(mean64.to(args->running_mean.scalar_type()).to(x.device()), f);
            args->running_var.mul_(1.0 - f).add_(unbiased.to(args->running_var.scalar_type()).to(x.device()), f);
        }
        // The normalization with the global statistics: libtorch's fused eval-mode batch norm.
        auto y = at::batch_norm(x, in_stat_type(weight, x), in_stat_type(bias, x), mean, var, /*training=*/false, 0.0, args->eps,
                                /*cudnn_enabled=*/false);
        ctx->save_for_backward({x, weight, mean, var});
        ctx->saved_data["link"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(args->link));
        ctx->saved_data["layer"] = static_cast<std::int64_t>(args->layer_id);
        ctx->saved_data["count"] = N;
        ctx->saved_data["eps"] = args->eps;
        return y;
    }

    static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                     ::torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();
        const auto& x = saved[0];
        const auto& weight = saved[1];
        const auto& mean = saved[2];
        const auto& var = saved[3];
        auto* link = reinterpret_cast<ReplicaLink*>(static_cast<std::intptr_t>(ctx->saved_data["link"].toInt()));
        const auto layer = static_cast<std::uint64_t>(ctx->saved_data["layer"].toInt());
        const double N = ctx->saved_data["count"].toDouble();
        const double eps = ctx->saved_data["eps"].toDouble();
        const std::int64_t C = x.size(1);
        const auto dy = grads[0].defined() ? grads[0].contiguous(x.suggest_memory_format()) : at::zeros_like(x);
        // The shard's sums of dy * xhat and of dy, the weight's and the bias's gradients of this
        // replica. On the CPU's one-pass layouts: libtorch's eval-mode backward with the global
        // statistics, its reductions only (CUDA's asserts on that call without saved statistics).
        // Elsewhere libtorch's generic ops, which run on any device.
        const auto layout = one_pass_layout(dy, x);
        at::Tensor sum_dy_xhat, sum_dy;
        if (layout != OnePass::none) {
            std::tie(std::ignore, sum_dy_xhat, sum_dy) = at::native_batch_norm_backward(
                dy, x, weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt, mean, var, std::nullopt, std::nullopt,
                /*train=*/false, eps, {false, true, true});
        } else {
            const auto dims = reduced_dims(x);
            const auto type = mean.scalar_type();
            sum_dy = dy.sum(dims, /*keepdim=*/false, type);
            sum_dy_xhat = (dy.to(type) * (x.to(type) - per_channel(mean, x))).sum(dims) * (var + eps).rsqrt();
        }
        auto sums = at::cat({sum_dy.to(at::kDouble).cpu(), sum_dy_xhat.to(at::kDouble).cpu()}).contiguous();
        all_reduce(link, sums, comm::CollectiveSite::layer(layer, 1));
        // dx = a * (dy - mean(dy) - xhat * mean(dy * xhat)), a = weight * invstd, the means over the
        //    global batch; = a*dy + b*x + d with b = -k, k = a * invstd * mean(dy * xhat), and
        //    d = k * mean - a * mean(dy). Per channel in fp64, then the statistics' type.
        const auto invstd = (var.to(at::kDouble).cpu() + eps).rsqrt();
        const auto a = weight.defined() ? invstd * weight.to(at::kDouble).cpu() : invstd;
        const auto k = a * invstd * sums.narrow(0, C, C) / N;
        const auto d = k * mean.to(at::kDouble).cpu() - a * sums.narrow(0, 0, C) / N;
        const auto as_stat = [&](const at::Tensor& v) { return v.to(mean.scalar_type()).to(x.device()); };
        auto dx = per_channel_affine(layout, dy, x, as_stat(a), as_stat(-k), as_stat(d));
        at::Tensor dweight, dbias;
        if (weight.defined()) {
            dweight = sum_dy_xhat.to(weight.scalar_type());
            dbias = sum_dy.to(weight.scalar_type());
        }
        return {dx, dweight, dbias, at::Tensor()};
    }
};

}  // namespace detail

//! Batch normalization whose statistics cover every replica's shard of the global batch under a
//! lockstep::torch::DataParallel (Note [libtorch SyncBatchNorm]); alone, a BatchNorm. Takes
//! torch::nn::BatchNormOptions, holds PyTorch's state_dict names (weight, bias, running_mean,
//! running_var, num_batches_tracked), and accepts inputs of rank 2 to 5 (BatchNorm1d/2d/3d).
class SyncBatchNormImpl : public ::torch::nn::Cloneable<SyncBatchNormImpl> {
public:
    explicit SyncBatchNormImpl(std::int64_t num_features) : SyncBatchNormImpl(::torch::nn::BatchNormOptions(num_features)) {}
    explicit SyncBatchNormImpl(const ::torch::nn::BatchNormOptions& options) : options(options) { reset(); }

    void reset() override {
        LOCKSTEP_CHECK(options.num_features() > 0, "SyncBatchNorm needs a positive num_features, got ",
                       options.num_features());
        if (options.affine()) {
            weight = register_parameter("weight", ::torch::ones({options.num_features()}));
            bias = register_parameter("bias", ::torch::zeros({options.num_features()}));
        } else {
            weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
            bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
        }
        if (options.track_running_stats()) {
            running_mean = register_buffer("running_mean", ::torch::zeros({options.num_features()}));
            running_var = register_buffer("running_var", ::torch::ones({options.num_features()}));
            num_batches_tracked = register_buffer("num_batches_tracked", ::torch::tensor(std::int64_t{0}, ::torch::kLong));
        } else {
            running_mean = register_buffer("running_mean", at::Tensor());
            running_var = register_buffer("running_var", at::Tensor());
            num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
        }
    }

    at::Tensor forward(const at::Tensor& x) {
        LOCKSTEP_CHECK_AS(ShapeError, x.dim() >= 2 && x.dim() <= 5, "SyncBatchNorm expects an input of rank 2 to 5 (N, C, ...), got ",
                          x.sizes());
        LOCKSTEP_CHECK_AS(ShapeError, x.size(1) == options.num_features(), "SyncBatchNorm(", options.num_features(),
                          ") got an input of ", x.size(1), " channels (shape ", x.sizes(), ")");
        if (!is_training() && options.track_running_stats())
            return at::batch_norm(x, detail::in_stat_type(weight, x), detail::in_stat_type(bias, x),
                                  detail::in_stat_type(running_mean, x), detail::in_stat_type(running_var, x), false, 0.0,
                                  options.eps(), false);
        detail::SyncBnArgs args;
        args.link = detail::current_link();
        args.layer_id = layer_id;
        args.eps = options.eps();
        args.momentum = options.momentum();
        if (is_training() && options.track_running_stats()) {
            args.running_mean = running_mean;
            args.running_var = running_var;
            args.num_batches_tracked = num_batches_tracked;
        }
        args.name = "SyncBatchNorm(" + std::to_string(options.num_features()) + ")";
        return detail::SyncBnFunction::apply(x, weight, bias, &args);
    }

    void pretty_print(std::ostream& stream) const override {
        stream << "lockstep::torch::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
               << ", momentum=";
        if (options.momentum())
            stream << *options.momentum();
        else
            stream << "None";
        stream << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats() << ")";
    }

    ::torch::nn::BatchNormOptions options;
    at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
    //! The layer's collectives' id, the same on every replica (DataParallel numbers its layers).
    std::uint64_t layer_id = 0;
};
//! The module holder of SyncBatchNormImpl (what TORCH_MODULE would declare).
class SyncBatchNorm : public ::torch::nn::ModuleHolder<SyncBatchNormImpl> {
public:
    using ::torch::nn::ModuleHolder<SyncBatchNormImpl>::ModuleHolder;
    using Impl = SyncBatchNormImpl;
};

namespace detail {

template <class Impl>
std::shared_ptr<SyncBatchNormImpl> sync_from(const std::shared_ptr<::torch::nn::Module>& m) {
    auto bn = std::dynamic_pointer_cast<Impl>(m);
    if (!bn) return nullptr;
    auto sync = std::make_shared<SyncBatchNormImpl>(bn->options);
    ::torch::NoGradGuard no_grad;
    if (bn->options.affine()) {
        sync->weight.copy_(bn->weight);
        sync->bias.copy_(bn->bias);
        sync->weight.set_requires_grad(bn->weight.requires_grad());
        sync->bias.set_requires_grad(bn->bias.requires_grad());
    }
    if (bn->options.track_running_stats()) {
        sync->running_mean.copy_(bn->running_mean);
        sync->running_var.copy_(bn->running_var);
        sync->num_batches_tracked.copy_(bn->num_batches_tracked);
    }
    sync->to(bn->running_mean.defined() ? bn->running_mean.device()
                                        : (bn->weight.defined() ? bn->weight.device() : ::torch::Device(::torch::kCPU)));
    if (!bn->is_training()) sync->eval();
    return sync;
}

inline std::shared_ptr<SyncBatchNormImpl> as_sync(const std::shared_ptr<::torch::nn::Module>& m) {
    if (auto s = sync_from<::torch::nn::BatchNorm1dImpl>(m)) return s;
    if (auto s = sync_from<::torch::nn::BatchNorm2dImpl>(m)) return s;
    return sync_from<::torch::nn::BatchNorm3dImpl>(m);
}

inline void convert_children(const std::shared_ptr<::torch::nn::Module>& m, const std::string& path) {
    const auto where = [&](const std::string& key) { return path.empty() ? key : path + "." + key; };
    // A container's entries, in order, are its children, under their names ("0", "1", ... or the
    // names given to a Sequential); each BatchNorm entry is swapped in the list and in the registry.
    const auto names = m->named_children().keys();
    if (auto seq = std::dynamic_pointer_cast<::torch::nn::SequentialImpl>(m)) {
        std::size_t i = 0;
        for (auto it = seq->begin(); it != seq->end(); ++it, ++i) {
            auto child = it->ptr();
            if (auto sync = as_sync(child)) {
                seq->replace_module(names.at(i), sync);
                *it = ::torch::nn::AnyModule(sync);
            } else {
                convert_children(child, where(names.at(i)));
            }
        }
        return;
    }
    if (auto list = std::dynamic_pointer_cast<::torch::nn::ModuleListImpl>(m)) {
        std::size_t i = 0;
        for (auto it = list->begin(); it != list->end(); ++it, ++i) {
            if (auto sync = as_sync(*it)) {
                list->replace_module(names.at(i), sync);
                *it = sync;
            } else {
                convert_children(*it, where(names.at(i)));
            }
        }
        return;
    }
    for (const auto& item : m->named_children()) {
        if (as_sync(item.value()))
            throw UsageError("convert_sync_batchnorm: '" + where(item.key()) + "' is a " + item.value()->name() +
                             " held by a module of type " + m->name() +
                             ", which calls it through its own member, so it cannot be swapped from outside; declare it "
                             "as lockstep::torch::SyncBatchNorm (a plain BatchNorm when the model runs alone), or hold it "
                             "in a torch::nn::Sequential or ModuleList");
        convert_children(item.value(), where(item.key()));
    }
}

}  // namespace detail

//! Swaps every torch::nn::BatchNorm1d/2d/3d of `module` for a SyncBatchNorm with the same options,
//! parameters, buffers and mode, and returns the module (the new layer when `module` is itself a
//! BatchNorm). Layers inside torch::nn::Sequential and ModuleList are swapped in place; a BatchNorm
//! that a custom module holds as a member cannot be rebound from outside and is refused with
//! UsageError naming it (declare that one as SyncBatchNorm).
inline std::shared_ptr<::torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<::torch::nn::Module> module) {
    LOCKSTEP_CHECK(module != nullptr, "convert_sync_batchnorm: the module is null");
    if (auto sync = detail::as_sync(module)) return sync;
    detail::convert_children(module, "");
    return module;
}

template <class Impl>
::torch::nn::ModuleHolder<Impl> convert_sync_batchnorm(::torch::nn::ModuleHolder<Impl> module) {
    detail::convert_children(module.ptr(), "");
    return module;
}

}  // namespace lockstep::torch
