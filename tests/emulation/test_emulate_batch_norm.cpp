// SPDX-License-Identifier: MIT
//! The CUDA SyncBatchNorm kernels, run on the host through the grid emulator (Note [kernels
//! proven on the host]) with the launch configurations the device uses, against the host
//! backend's batch norm on the same inputs: every pass, both layouts, fp32/fp16/bf16, fused ReLU,
//! running statistics, edge shapes, unaligned pointers, empty shards and a two-replica split.
#include <catch2/catch.hpp>

#include <lockstep/kernels/device/bn_passes.cuh>
#include <lockstep/kernels/host_ops.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../test_support.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define LOCKSTEP_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOCKSTEP_TEST_ASAN 1
#endif
#endif
#ifndef LOCKSTEP_TEST_ASAN
#define LOCKSTEP_TEST_ASAN 0
#endif
#if LOCKSTEP_TEST_ASAN
#include <sanitizer/asan_interface.h>
#endif

using namespace lockstep;
namespace bk = lockstep::kernels::device::bn_kernels;
namespace dev = lockstep::kernels::device;
using HostOps = kernels::Ops<Host>;

namespace {

// Unit roundoff of the storage type: the error of rounding one fp32 result into it.
template <class T>
constexpr double unit_roundoff() {
    if constexpr (std::is_same_v<T, float>)
        return 0.0;
    else if constexpr (std::is_same_v<T, __half>)
        return 1.0 / 2048;  // 2^-11
    else
        return 1.0 / 256;  // bf16: 2^-8
}

template <class T>
std::string type_name() {
    if constexpr (std::is_same_v<T, float>)
        return "fp32";
    else if constexpr (std::is_same_v<T, __half>)
        return "fp16";
    else
        return "bf16";
}

struct Case {
    std::int64_t N = 2, C = 3, H = 7, W = 5;
    bool two_d = false;  // (N, C) input
    bool nhwc = false;
    bool relu = false;
    bool affine = true;
    bool track = true;
    std::optional<double> momentum = 0.1;
    int misalign = 0;  // elements the emulated tensors are offset by from a 16-byte boundary
    dev::DeviceInfo info{};
    float centre = 0;  // added to x: a large mean tests the shifted sums
    std::string str() const {
        return "N=" + std::to_string(N) + " C=" + std::to_string(C) +
               (two_d ? " 2-D" : " HxW=" + std::to_string(H) + "x" + std::to_string(W)) + (nhwc ? " nhwc" : " nchw") +
               (relu ? " relu" : "") + (affine ? "" : " no-affine") + (track ? "" : " untracked") +
               (momentum ? "" : " cumulative") + " misalign=" + std::to_string(misalign) +
               " sms=" + std::to_string(info.multiprocessors) + " l2=" + std::to_string(info.l2_bytes) +
               " centre=" + std::to_string(centre);
    }
};

// A device-like buffer of T starting `misalign` elements past a 16-byte boundary, with guard bytes
// on both sides that no kernel may write (checked by guards_intact) nor, under AddressSanitizer,
// read (they are poisoned, to ASan's 8-byte granules: a vector load past the tensor's end is
// reported).
template <class T>
struct Buffer {
    static constexpr unsigned char guard = 0xa5;
    static constexpr std::uintptr_t lead = 32;  // guard bytes at least, before the tensor
    std::vector<unsigned char> bytes;
    T* p = nullptr;
    std::size_t n = 0;
    Buffer(std::size_t count, int misalign) : bytes((count + 64) * sizeof(T) + 64, guard), n(count) {
        auto base = reinterpret_cast<std::uintptr_t>(bytes.data());
        base = (base + 15) / 16 * 16 + lead + static_cast<std::uintptr_t>(misalign) * sizeof(T);
        p = reinterpret_cast<T*>(base);
        poison(true);
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { poison(false); }
    void poison([[maybe_unused]] bool on) {
#if LOCKSTEP_TEST_ASAN
        unsigned char* const first = reinterpret_cast<unsigned char*>(p);
        unsigned char* const last = reinterpret_cast<unsigned char*>(p + n);
        unsigned char* const end = bytes.data() + bytes.size();
        if (on) {
            ASAN_POISON_MEMORY_REGION(bytes.data(), static_cast<std::size_t>(first - bytes.data()));
            ASAN_POISON_MEMORY_REGION(last, static_cast<std::size_t>(end - last));
        } else {
            ASAN_UNPOISON_MEMORY_REGION(bytes.data(), bytes.size());
        }
#endif
    }
    T* data() { return n == 0 ? nullptr : p; }
    float get(std::size_t i) const { return dev::to_float(p[i]); }
    //! Whether every byte outside the n elements still holds the guard.
    bool guards_intact() {
        poison(false);
        const auto* first = reinterpret_cast<const unsigned char*>(p);
        const auto* last = reinterpret_cast<const unsigned char*>(p + n);
        bool intact = true;
        for (const unsigned char* b = bytes.data(); b != bytes.data() + bytes.size(); ++b)
            if ((b < first || b >= last) && *b != guard) intact = false;
        poison(true);
        return intact;
    }
};

kernels::BnGeometry geometry_of(const Case& k) {
    kernels::BnGeometry g;
    g.batch = k.N;
    g.channels = k.C;
    g.inner = k.two_d ? 1 : k.H * k.W;
    g.channels_last = k.two_d || k.nhwc || g.inner == 1;
    return g;
}

Tensor<float, Host> host_tensor(std::vector<float> v) {
    const auto n = static_cast<std::int64_t>(v.size());
    return make_tensor<float>(Shape{n}, std::move(v));
}

// Elementwise closeness with a scale: |a - b| <= tol * max(scale, |b|) for each element.
template <class A>
void require_close(const A& got, const std::vector<float>& want, double rel, double roundoff, double scale, const char* what) {
    double worst = 0;
    std::size_t at = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
        const double w = want[i], g = got(i);
        const double allowed = rel * std::max(scale, std::abs(w)) + roundoff * std::abs(w) + 1e-30;
        const double e = std::abs(g - w) / allowed;
        if (!(e <= worst)) {  // NaN counts as worst
            worst = e;
            at = i;
        }
    }
    INFO(what << ": worst at element " << at << ": got " << (want.empty() ? 0.0 : got(at)) << ", want "
              << (want.empty() ? 0.0 : want[at]) << " (" << worst << " of the allowed error)");
    CHECK(worst <= 1.0);
}

// The channel of element i of a batch-norm input in layout `g`.
std::int64_t channel_of(const kernels::BnGeometry& g, std::int64_t i) {
    return g.channels_last ? i % g.channels : (i / g.inner) % g.channels;
}

template <class T>
void run_case(const Case& k) {
    CAPTURE(k.str(), type_name<T>());
    const std::uint64_t seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const kernels::BnGeometry g = geometry_of(k);
    const std::int64_t C = k.C, total = k.N * C * g.inner;
    const auto count = static_cast<std::size_t>(total);

    // Inputs in T; the host computes on their exact fp32 values.
    Buffer<T> x(count, k.misalign), dy(count, k.misalign), y(count, k.misalign);
    std::vector<float> xf(count), dyf(count);
    for (std::size_t i = 0; i < count; ++i) {
        x.p[i] = dev::from_float<T>(k.centre + 1.5f * normal(rng) + 0.25f * static_cast<float>(i % static_cast<std::size_t>(C)));
        dy.p[i] = dev::from_float<T>(normal(rng));
        xf[i] = x.get(i);
        dyf[i] = dy.get(i);
    }
    std::vector<float> gamma(static_cast<std::size_t>(C)), beta(gamma.size()), rmean(gamma.size()), rvar(gamma.size());
    for (std::size_t c = 0; c < gamma.size(); ++c) {
        gamma[c] = 1.0f + 0.5f * normal(rng);
        beta[c] = normal(rng);
        rmean[c] = k.centre + 0.3f * normal(rng);
        rvar[c] = 1.0f + 0.2f * std::abs(normal(rng));
    }
    std::int64_t nbt0 = 3;

    // ---- host reference ----
    const Execution<Host> ex;
    auto hx = host_tensor(xf), hdy = host_tensor(dyf), hy = host_tensor(std::vector<float>(count));
    auto hw = host_tensor(gamma), hb = host_tensor(beta), hrm = host_tensor(rmean), hrv = host_tensor(rvar);
    auto hnbt = make_tensor<std::int64_t>(Shape{}, std::vector<std::int64_t>{nbt0});
    kernels::BnConstants<Host> hk{Tensor<double, Host>(Shape{2 * C + 1}), Tensor<float, Host>(Shape{4 * C}), {}};
    auto hpay = Tensor<double, Host>(Shape{3 * C + 1});
    auto hbpay = Tensor<double, Host>(Shape{2 * C});
    auto hmask = Tensor<std::uint8_t, Host>(Shape{total});
    auto hwg = host_tensor(std::vector<float>(gamma.size(), 0.5f)), hbg = host_tensor(std::vector<float>(gamma.size(), -0.25f));
    HostOps::bn_local_stats(ex, hx, g, hk, hpay);
    const std::vector<double> hlocal(hpay.data(), hpay.data() + hpay.numel());  // before the centring
    HostOps::bn_centre(ex, g, hk, hpay);
    const kernels::BnFinishOptions fo{1e-5, k.momentum, k.track};
    HostOps::bn_forward_finish(ex, hpay, fo, k.track ? &hrm : nullptr, k.track ? &hrv : nullptr, k.track ? &hnbt : nullptr,
                               k.affine ? &hw : nullptr, k.affine ? &hb : nullptr, hk);
    HostOps::bn_normalize(ex, hx, hy, g, hk, k.relu, k.relu ? &hmask : nullptr);
    // The host's reference backward takes the mask the kernels find from x (Note [ReLU mask from
    // x]): the host's own may differ where y rounds to 0 (its forward may fuse the multiply-add
    // differently), and each pass is compared alone.
    auto kmask = Tensor<std::uint8_t, Host>(Shape{total});
    for (std::int64_t i = 0; i < total; ++i) {
        const std::int64_t c = channel_of(g, i);
        kmask[i] = kernels::bn::normalize(xf[static_cast<std::size_t>(i)], hk.folded[c], hk.folded[2 * C + c],
                                          hk.folded[3 * C + c]) > 0.0f;
    }
    HostOps::bn_backward_sums(ex, hx, hdy, k.relu, k.relu ? &kmask : nullptr, g, hk, hbpay);
    HostOps::bn_param_grads(ex, hbpay, hk, hwg, hbg);
    auto hdx = hx;
    HostOps::bn_backward_dx(ex, hbpay, hk, k.affine ? &hw : nullptr, hdx, hdy, k.relu, k.relu ? &kmask : nullptr, g);

    // ---- emulated kernels ----
    dev::HostScratch scratch;
    bk::EmulatedRun run{k.info, &scratch};
    std::vector<double> payload(static_cast<std::size_t>(3 * C + 1), -1.0), bpayload(static_cast<std::size_t>(2 * C), -1.0);
    std::vector<double> stats(static_cast<std::size_t>(2 * C + 1), -1.0);
    std::vector<float> folded(static_cast<std::size_t>(4 * C), -1.0f), shift(static_cast<std::size_t>(C), -1.0f);
    std::vector<float> erm = rmean, erv = rvar, wg(gamma.size(), 0.5f), bg(gamma.size(), -0.25f);
    std::int64_t nbt = nbt0;

    bk::local_stats(run, x.data(), g, payload.data(), shift.data());
    const double n = static_cast<double>(k.N * g.inner);
    const kernels::bn::ForwardPayload layout{C};
    REQUIRE(payload[static_cast<std::size_t>(layout.count())] == n);
    // Sums of n terms of size |x - k| each (k: a value of the channel): fp32 partial sums over
    // `flush` items, fp64 beyond; the totals M = n k + s of n terms of size |x|.
    double term = 0;
    for (std::size_t i = 0; i < count; ++i) term = std::max(term, 2 * std::abs(static_cast<double>(xf[i])) + 4);
    require_close([&](std::size_t i) { return payload[i]; }, std::vector<float>(hlocal.begin(), hlocal.end()), 1e-5, 0,
                  n * term * term, "forward payload");
    for (std::int64_t c = 0; c < C; ++c) CHECK(shift[static_cast<std::size_t>(c)] == hk.shift[c]);  // the same local shift
    // The centring, from the host's local payload: the host's bits (the same fp64 formula).
    std::copy(hlocal.begin(), hlocal.end(), payload.begin());
    bk::centre(run, g, shift.data(), payload.data());
    for (std::size_t i = 0; i < payload.size(); ++i) CHECK(payload[i] == hpay[static_cast<std::int64_t>(i)]);
    // Tickets are left at zero for the next launch.
    for (int i = 0; i < 64; ++i) REQUIRE(scratch.view().counters[i] == 0u);

    // The payload the normalize pass finishes from is the host's: it isolates this pass's error.
    std::vector<double> hpayload(hpay.data(), hpay.data() + hpay.numel());
    bk::FinishRequest f;
    f.payload = hpayload.data();
    if (k.track) {
        f.running_mean = erm.data();
        f.running_var = erv.data();
        f.num_batches_tracked = &nbt;
    }
    f.cumulative = !k.momentum;
    f.momentum = k.momentum.value_or(0);
    bk::forward_normalize(run, x.data(), y.data(), g, &f, k.affine ? gamma.data() : nullptr, k.affine ? beta.data() : nullptr,
                          stats.data(), folded.data(), k.relu);
    for (std::size_t i = 0; i < stats.size(); ++i) CHECK(stats[i] == hk.stats[static_cast<std::int64_t>(i)]);
    for (std::size_t i = 0; i < folded.size(); ++i) CHECK(folded[i] == hk.folded[static_cast<std::int64_t>(i)]);
    if (k.track) {
        CHECK(nbt == hnbt[0]);
        for (std::size_t c = 0; c < erm.size(); ++c) {
            CHECK(erm[c] == hrm[static_cast<std::int64_t>(c)]);
            CHECK(erv[c] == hrv[static_cast<std::int64_t>(c)]);
        }
    } else {
        CHECK(nbt == nbt0);
    }
    const std::vector<float> hyv(hy.data(), hy.data() + hy.numel());
    require_close([&](std::size_t i) { return y.get(i); }, hyv, 1e-5, unit_roundoff<T>(), 1.0, "y");
    REQUIRE(y.guards_intact());
    if (k.relu) {
        // Note [ReLU mask from x]: backward passes dy exactly where this forward's y > 0 (in the
        // forward's fp32, before the store in T), channel by channel: with dy = 1 its sum of dy
        // counts them. A mask recomputed differently, or for the wrong channel, fails here.
        std::vector<double> passed(static_cast<std::size_t>(C), 0.0);
        for (std::size_t i = 0; i < count; ++i) {
            const auto c = static_cast<std::size_t>(channel_of(g, static_cast<std::int64_t>(i)));
            const float v = kernels::bn::normalize(xf[i], folded[c], folded[2 * C + c], folded[3 * C + c]);
            if constexpr (std::is_same_v<T, float>) REQUIRE((v > 0.0f) == (y.get(i) > 0.0f));
            passed[c] += v > 0.0f ? 1.0 : 0.0;
        }
        Buffer<T> ones(count, k.misalign);
        for (std::size_t i = 0; i < count; ++i) ones.p[i] = dev::from_float<T>(1.0f);
        std::vector<double> counted(static_cast<std::size_t>(2 * C), -1.0);
        bk::backward_sums(run, x.data(), ones.data(), true, g, folded.data(), counted.data());
        const kernels::bn::BackwardPayload layout{C};
        for (std::int64_t c = 0; c < C; ++c) REQUIRE(counted[static_cast<std::size_t>(layout.sum_dy(c))] == passed[c]);
        // backward_dx with dy = 1 and zero payload gives a constant where the mask lets dy through
        // and a different one where it does not (dx = a dy + b (x - mean) + c, b = c = 0 here).
        std::vector<double> zero(static_cast<std::size_t>(2 * C), 0.0);
        Buffer<T> dx(count, k.misalign);
        bk::backward_dx(run, x.data(), ones.data(), true, dx.data(), g, zero.data(), stats.data(), folded.data(),
                        static_cast<const float*>(nullptr));
        for (std::size_t i = 0; i < count; ++i) {
            const auto c = static_cast<std::size_t>(channel_of(g, static_cast<std::int64_t>(i)));
            const float v = kernels::bn::normalize(xf[i], folded[c], folded[2 * C + c], folded[3 * C + c]);
            REQUIRE((dx.get(i) != 0.0f) == (v > 0.0f));
        }
        REQUIRE(dx.guards_intact());
    }

    // Backward, from the host's constants so each pass is compared alone.
    std::vector<float> hfolded(hk.folded.data(), hk.folded.data() + hk.folded.numel());
    std::vector<double> hstats(hk.stats.data(), hk.stats.data() + hk.stats.numel());
    bk::backward_sums(run, x.data(), dy.data(), k.relu, g, hfolded.data(), bpayload.data());
    double dterm = 0;
    for (std::size_t i = 0; i < count; ++i)
        dterm = std::max(dterm, std::abs(static_cast<double>(dyf[i])) *
                                    (std::abs(static_cast<double>(xf[i]) - hstats[i % static_cast<std::size_t>(C)]) + 1));
    require_close([&](std::size_t i) { return bpayload[i]; }, std::vector<float>(hbpay.data(), hbpay.data() + hbpay.numel()),
                  1e-5, 0, n * dterm, "backward payload");
    for (int i = 0; i < 64; ++i) REQUIRE(scratch.view().counters[i] == 0u);

    std::vector<double> hbpayload(hbpay.data(), hbpay.data() + hbpay.numel());
    bk::param_grads(run, C, hbpayload.data(), hstats.data(), wg.data(), bg.data());
    for (std::size_t c = 0; c < wg.size(); ++c) {
        CHECK(wg[c] == hwg[static_cast<std::int64_t>(c)]);
        CHECK(bg[c] == hbg[static_cast<std::int64_t>(c)]);
    }

    // dx over x itself, as the layer does.
    bk::backward_dx(run, x.data(), dy.data(), k.relu, x.data(), g, hbpayload.data(), hstats.data(), hfolded.data(),
                    k.affine ? gamma.data() : nullptr);
    double dxterm = 0;
    for (std::size_t i = 0; i < count; ++i) dxterm = std::max(dxterm, std::abs(static_cast<double>(dyf[i])) * 4);
    require_close([&](std::size_t i) { return x.get(i); }, std::vector<float>(hdx.data(), hdx.data() + hdx.numel()), 1e-5,
                  unit_roundoff<T>(), dxterm, "dx");
    REQUIRE(x.guards_intact());
}

template <class T>
void run_shapes() {
    const dev::DeviceInfo h200{132, 60 << 20}, tiny{1, 0}, two{2, 1 << 10};
    // C = 36, 64 and 132: channels-last takes vectors of nhwc_vec channels (36: 16 lanes a row, 64: 16
    // lanes a row, every one with channels; 132: 32 lanes a row, a last group of one lane);
    // 34: only the 16-bit backward sums take vectors (of nhwc_sums_vec).
    for (const std::int64_t C : {1, 3, 33, 34, 36, 64, 132, 257})
        // Channels-first (Note [channels-first windows]): 28 x 28 planes are whole 16-byte vectors;
        // 14 x 14 whole 8-byte ones for 16-bit types; 7 x 5 and 7 x 7 take 16-byte windows; 3 x 6
        // whole 8-byte vectors of fp32 and 8-byte windows of 16-bit types; 3 x 3 4-byte windows of
        // 16-bit types and 8-byte ones of fp32.
        for (const auto& hw : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 5}, {7, 7}, {14, 14}, {3, 6}, {3, 3}, {28, 28}})
            for (const bool nhwc : {false, true}) {
                Case k;
                k.C = C;
                k.H = hw.first;
                k.W = hw.second;
                k.nhwc = nhwc;
                k.N = C * hw.first * hw.second > 20000 ? 2 : 3;
                k.info = h200;
                run_case<T>(k);
                k.relu = true;  // aligned: the vector path with the mask
                run_case<T>(k);
                k.info = tiny;  // one multiprocessor: few chunks; no L2: forward order
                k.relu = true;
                k.misalign = 1;
                run_case<T>(k);
                k.info = two;
                k.relu = false;
                k.misalign = 0;
                k.centre = 300;
                k.momentum.reset();
                run_case<T>(k);
            }
}

}  // namespace

// Issue 43: the device normalizes with one correctly rounded fma (__fmaf_rn); the host's
// (x - h) * s + t rounds twice wherever the compiler does not contract it, so the emulator gave
// other bits than the device. bn::normalize is std::fma on the host: the same rounding.
// Mutation-checked: with the host's two roundings back, the first check fails.
TEST_CASE("the normalize rounds once on the host, as __fmaf_rn does on the device", "[emulation][syncbn]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    std::mt19937 rng(static_cast<std::mt19937::result_type>(seed));
    std::normal_distribution<float> d(0.0f, 3.0f);
    int differ = 0, exact = 0;
    for (int i = 0; i < 20000; ++i) {
        const float x = d(rng), h = d(rng), s = d(rng), t = d(rng);
        const float y = kernels::bn::normalize(x, h, s, t);
        const float once = std::fma(x - h, s, t);
        exact += std::memcmp(&y, &once, sizeof y) == 0 ? 1 : 0;
        volatile float product = (x - h) * s;  // rounded, then added: two roundings
        const float twice = product + t;
        differ += y != twice ? 1 : 0;
    }
    CHECK(exact == 20000);
    CHECK(differ > 0);  // the values do tell one rounding from two
}

TEST_CASE("emulated SyncBatchNorm kernels match the host backend, fp32", "[emulation][syncbn]") { run_shapes<float>(); }
TEST_CASE("emulated SyncBatchNorm kernels match the host backend, fp16", "[emulation][syncbn]") { run_shapes<__half>(); }
TEST_CASE("emulated SyncBatchNorm kernels match the host backend, bf16", "[emulation][syncbn]") { run_shapes<__nv_bfloat16>(); }

TEST_CASE("emulated SyncBatchNorm kernels: 2-D input, small batches, options", "[emulation][syncbn]") {
    for (const int misalign : {0, 1, 3}) {
        Case k;
        k.two_d = true;
        k.C = 33;
        k.N = 5;
        k.misalign = misalign;
        run_case<float>(k);
        k.affine = false;
        k.track = false;
        run_case<float>(k);
        k.relu = true;
        run_case<__half>(k);
    }
    // Fewer values per channel than one block has threads; many chunks per channel.
    Case k;
    k.N = 2;
    k.C = 4;
    k.H = 3;
    k.W = 3;
    run_case<float>(k);
    k.N = 64;
    k.H = k.W = 28;
    k.info = {132, 60 << 20};
    run_case<float>(k);
    k.nhwc = true;
    run_case<float>(k);
}

TEST_CASE("channels-first windows: the widths chosen, and each plane's elements once", "[emulation][syncbn]") {
    alignas(16) static const unsigned char storage[32] = {};
    const void* aligned = storage;
    const void* off4 = storage + 4;  // 4-byte aligned only
    const auto width = [](auto tag, std::int64_t P, const void* p) {
        using T = decltype(tag);
        return bk::vector_width<T>(kernels::BnGeometry{2, 3, P, false}, {p});
    };
    // fp32: whole 16-byte vectors, whole 8-byte ones, 16-byte windows (7 x 7), 8-byte windows (3 x 3).
    CHECK(width(float{}, 784, aligned) == 4);
    CHECK(width(float{}, 18, aligned) == 2);
    CHECK(width(float{}, 49, aligned) == 4);
    CHECK(width(float{}, 9, aligned) == 2);
    CHECK(width(float{}, 3, aligned) == 1);
    CHECK(width(float{}, 49, off4) == 1);
    // bf16: whole 16-byte vectors, whole 8-byte ones (14 x 14), 16-byte windows for any odd plane of
    // at least 32, 4-byte windows of 3 x 3, whole 4-byte vectors of a plane of 2.
    CHECK(width(__nv_bfloat16{}, 784, aligned) == 8);
    CHECK(width(__nv_bfloat16{}, 196, aligned) == 4);
    CHECK(width(__nv_bfloat16{}, 49, aligned) == 8);
    CHECK(width(__nv_bfloat16{}, 35, aligned) == 8);
    CHECK(width(__nv_bfloat16{}, 9, aligned) == 2);
    CHECK(width(__nv_bfloat16{}, 2, aligned) == 2);
    CHECK(width(__nv_bfloat16{}, 3, aligned) == 1);
    CHECK(width(__nv_bfloat16{}, 49, off4) == 2);  // 4-byte windows where the tensor is 4-byte aligned

    // Every item's window is aligned, inside the tensor where it has elements, and together a
    // channel's items name each of its N P elements exactly once.
    const auto cover = [](auto v, std::int64_t N, std::int64_t C, std::int64_t P) {
        constexpr int V = decltype(v)::value;
        const kernels::BnGeometry g{N, C, P, false};
        dev::Grid grid;
        const bk::Span s = bk::plan(g, V, dev::DeviceInfo{1, 0}, grid);
        CAPTURE(V, N, C, P);
        REQUIRE(s.items == static_cast<unsigned int>(N * bk::windows_per_plane(P, V)));
        std::vector<int> seen(static_cast<std::size_t>(N * C * P), 0);
        for (std::int64_t c = 0; c < C; ++c)
            for (unsigned int j = 0; j < s.items; ++j) {
                const bk::Window w = s.template window<V>(j, c);
                REQUIRE(w.at % V == 0);
                for (int e = w.lo; e < w.hi; ++e) {
                    const std::int64_t i = w.at + e;
                    REQUIRE(i >= 0);
                    REQUIRE(i < N * C * P);
                    REQUIRE((i / P) % C == c);
                    ++seen[static_cast<std::size_t>(i)];
                }
            }
        for (const int n : seen) REQUIRE(n == 1);
    };
    // Offsets past 2^32 elements: the last item of the last channel ends the tensor.
    {
        const std::int64_t N = 100000, C = 1024, P = 49;
        const kernels::BnGeometry g{N, C, P, false};
        dev::Grid grid;
        const bk::Span s = bk::plan(g, 8, dev::DeviceInfo{132, 60 << 20}, grid);
        std::int64_t last = -1;
        for (unsigned int j = s.items - bk::windows_per_plane(P, 8); j < s.items; ++j) {
            const bk::Window w = s.window<8>(j, C - 1);
            if (w.hi > w.lo) last = w.at + w.hi;
        }
        CHECK(last == N * C * P);
        const bk::Window first = s.window<8>(static_cast<unsigned int>((N - 1) * bk::windows_per_plane(P, 8)), C - 1);
        CHECK(first.at + first.lo == (N * C - 1) * P);
    }
    for (const std::int64_t P : {1, 2, 3, 7, 9, 18, 35, 49, 64, 196})
        for (const std::int64_t C : {1, 3, 8})
            for (const std::int64_t N : {1, 5}) {
                cover(std::integral_constant<int, 8>{}, N, C, P);
                cover(std::integral_constant<int, 4>{}, N, C, P);
                cover(std::integral_constant<int, 2>{}, N, C, P);
                cover(std::integral_constant<int, 1>{}, N, C, P);
            }
}

TEST_CASE("emulated batch-norm launch plans stay inside the grid and the scratch", "[emulation][syncbn]") {
    for (const dev::DeviceInfo info : {dev::DeviceInfo{1, 0}, dev::DeviceInfo{132, 60 << 20}, dev::DeviceInfo{1000, 1 << 30}})
        for (const std::int64_t C : {1, 64, 4096, 65535})
            for (const std::int64_t N : {1, 256})
                for (const int layout : {0, 1, 2}) {  // channels-first, channels-last, channels-last in vectors
                    const bool last = layout > 0;
                    const int V = layout == 0 ? 4 : layout == 1 ? 1 : bk::nhwc_vec;
                    if (layout == 2 && C % V != 0) continue;
                    kernels::BnGeometry g{N, C, 56 * 56, last};
                    dev::Grid grid;
                    const bk::Span s = bk::plan(g, V, info, grid);
                    CAPTURE(C, N, layout, info.multiprocessors);
                    REQUIRE(grid.x >= 1);
                    REQUIRE(static_cast<std::int64_t>(grid.x - 1) * s.chunk_items < s.items);  // no empty chunk
                    REQUIRE(static_cast<std::int64_t>(grid.x) * s.chunk_items >= s.items);     // every item covered
                    REQUIRE(static_cast<std::size_t>(grid.x) * static_cast<std::size_t>(grid.y) *
                                (last ? 32u * static_cast<unsigned>(V) : 1u) * sizeof(bk::Sums2) <=
                            dev::scratch_partial_bytes);
                    if (last) {
                        REQUIRE(static_cast<std::int64_t>(grid.y) * s.lanes * V >= C);  // every channel in a group
                        // The fewest lanes that cover C, up to 32 (Note [channels-last lanes]).
                        REQUIRE((s.lanes == 32 || std::int64_t{s.lanes} * V >= C));
                        REQUIRE((s.lanes == 1 || std::int64_t{s.lanes / 2} * V < C));
                        REQUIRE((s.lanes & (s.lanes - 1)) == 0);
                    }
                    REQUIRE(grid.y <= dev::scratch_counters);
                }
    kernels::BnGeometry too_many{2, 65536, 4, false};
    dev::Grid grid;
    CHECK_THROWS_AS(bk::plan(too_many, 1, {}, grid), ShapeError);
}

TEST_CASE("emulated SyncBatchNorm: an empty shard contributes zeros and still finishes", "[emulation][syncbn]") {
    for (const bool nhwc : {false, true}) {
        kernels::BnGeometry g{0, 5, 4, nhwc};
        const kernels::bn::ForwardPayload layout{5};
        dev::HostScratch scratch;
        bk::EmulatedRun run{{}, &scratch};
        std::vector<double> payload(16, 9.0);
        std::vector<float> shift(5, 9.0f), rm{1, 2, std::nanf(""), 4, 5};
        bk::local_stats<bk::EmulatedRun, float>(run, nullptr, g, payload.data(), shift.data());
        for (const double v : payload) CHECK(v == 0.0);
        CHECK(shift == std::vector<float>(5, 0.0f));
        // The other replicas' totals (the first all-reduce): the empty shard's centred sums stay 0.
        for (int c = 0; c < 5; ++c) payload[static_cast<std::size_t>(layout.total(c))] = 4.0 * (1.0 + 0.5 * c);
        payload[static_cast<std::size_t>(layout.count())] = 4;
        bk::centre(run, g, shift.data(), payload.data());
        for (std::int64_t i = 0; i < layout.second_size(); ++i) CHECK(payload[static_cast<std::size_t>(i)] == 0.0);
        // The second all-reduce: the empty shard still finishes and updates its running statistics.
        std::vector<double> global = payload;
        for (int c = 0; c < 5; ++c) global[static_cast<std::size_t>(layout.sum_sq(c))] = 8.0;  // Q about mu
        std::vector<double> stats(11);
        std::vector<float> folded(20), rv(5, 1.0f);
        std::int64_t nbt = 0;
        bk::FinishRequest f;
        f.payload = global.data();
        f.running_mean = rm.data();
        f.running_var = rv.data();
        f.num_batches_tracked = &nbt;
        bk::forward_normalize<bk::EmulatedRun, float>(run, nullptr, nullptr, g, &f, nullptr, nullptr, stats.data(), folded.data(),
                                                      false);
        CHECK(nbt == 1);
        CHECK(stats[10] == 4.0);
        CHECK(stats[0] == 1.0);  // mu + S/N
        CHECK(stats[2] == 2.0);  // a NaN running mean leaves the batch's statistics alone
        CHECK(stats[5] == Approx(1.0 / std::sqrt(2.0 + 1e-5)));
        CHECK(rm[0] == Approx(0.9 * 1.0 + 0.1 * 1.0));
    }
}

TEST_CASE("emulated SyncBatchNorm over two replicas equals the host on the whole batch", "[emulation][syncbn]") {
    for (const bool nhwc : {false, true})
        for (const std::int64_t first : {0, 1, 3}) {
            const std::int64_t N = 4, C = 33, P = 35;
            CAPTURE(nhwc, first);
            std::mt19937_64 rng(test::fresh_seed());
            std::normal_distribution<float> normal(5.0f, 2.0f);
            std::vector<float> x(static_cast<std::size_t>(N * C * P));
            for (float& v : x) v = normal(rng);
            std::vector<float> rm(static_cast<std::size_t>(C), 4.0f), rv(static_cast<std::size_t>(C), 1.0f);

            // Host: the whole batch.
            const Execution<Host> ex;
            auto hx = host_tensor(x), hy = host_tensor(std::vector<float>(x.size())), hrm = host_tensor(rm),
                 hrv = host_tensor(rv);
            auto hnbt = make_tensor<std::int64_t>(Shape{}, std::vector<std::int64_t>{0});
            kernels::BnConstants<Host> hk{Tensor<double, Host>(Shape{2 * C + 1}), Tensor<float, Host>(Shape{4 * C}), {}};
            auto hpay = Tensor<double, Host>(Shape{3 * C + 1});
            const kernels::BnGeometry whole{N, C, P, nhwc};
            HostOps::bn_local_stats(ex, hx, whole, hk, hpay);
            HostOps::bn_centre(ex, whole, hk, hpay);
            HostOps::bn_forward_finish(ex, hpay, {}, &hrm, &hrv, &hnbt, nullptr, nullptr, hk);
            HostOps::bn_normalize(ex, hx, hy, whole, hk, false, nullptr);

            // Emulated: two shards, payloads added in two parts (the all-reduces, the centring between
            // them), each replica finishes.
            const kernels::bn::ForwardPayload layout{C};
            const std::int64_t sizes[2] = {first, N - first};
            std::vector<std::vector<double>> payloads(2, std::vector<double>(static_cast<std::size_t>(layout.size())));
            std::vector<std::vector<float>> shifts(2, std::vector<float>(static_cast<std::size_t>(C)));
            dev::HostScratch scratch;
            bk::EmulatedRun run{{2, 1 << 20}, &scratch};
            std::int64_t row = 0;
            for (int r = 0; r < 2; ++r) {
                const kernels::BnGeometry g{sizes[r], C, P, nhwc};
                bk::local_stats(run, x.data() + row * C * P, g, payloads[static_cast<std::size_t>(r)].data(),
                                shifts[static_cast<std::size_t>(r)].data());
                row += sizes[r];
            }
            const auto all_reduce = [&](std::int64_t from, std::int64_t to) {
                for (std::int64_t i = from; i < to; ++i) {
                    const auto u = static_cast<std::size_t>(i);
                    payloads[0][u] = payloads[1][u] = payloads[0][u] + payloads[1][u];
                }
            };
            all_reduce(layout.first_offset(), layout.size());
            for (int r = 0; r < 2; ++r)
                bk::centre(run, kernels::BnGeometry{sizes[r], C, P, nhwc}, shifts[static_cast<std::size_t>(r)].data(),
                           payloads[static_cast<std::size_t>(r)].data());
            all_reduce(0, layout.second_size());
            const std::vector<double>& sum = payloads[0];
            std::vector<float> y(x.size());
            std::vector<std::vector<float>> rms(2, rm), rvs(2, rv);
            row = 0;
            for (int r = 0; r < 2; ++r) {
                const kernels::BnGeometry g{sizes[r], C, P, nhwc};
                std::vector<double> stats(static_cast<std::size_t>(2 * C + 1));
                std::vector<float> folded(static_cast<std::size_t>(4 * C));
                std::int64_t nbt = 0;
                bk::FinishRequest f;
                f.payload = sum.data();
                f.running_mean = rms[static_cast<std::size_t>(r)].data();
                f.running_var = rvs[static_cast<std::size_t>(r)].data();
                f.num_batches_tracked = &nbt;
                bk::forward_normalize(run, x.data() + row * C * P, y.data() + row * C * P, g, &f, nullptr, nullptr, stats.data(),
                                      folded.data(), false);
                CHECK(nbt == 1);
                row += sizes[r];
            }
            CHECK(rms[0] == rms[1]);  // bit-identical replicas
            CHECK(rvs[0] == rvs[1]);
            CHECK(test::rel_error(rms[0], std::vector<float>(hrm.data(), hrm.data() + C)) < 1e-6);
            CHECK(test::rel_error(rvs[0], std::vector<float>(hrv.data(), hrv.data() + C)) < 1e-6);
            CHECK(test::rel_error(y, std::vector<float>(hy.data(), hy.data() + hy.numel())) < 1e-5);
        }
}

// Note [one scratch layout]: the emulator's scratch is the device's layout, one allocation with
// the partials on a 256-byte boundary. Mutation-checked by hand (2026-12-04): with
// ScratchLayout::partials_offset set to counter_bytes (the first GPU run's 262140), the
// static_assert beside it stops the build; with that assert removed, Scratch::partials_as throws
// UsageError in every reducing test here; with that check removed too, the ASan+UBSan build's
// `emulation` label fails on "store to misaligned address" in store_partial.
TEST_CASE("emulated scratch: the device's one allocation, partials on a 256-byte boundary", "[emulation][syncbn]") {
    dev::HostScratch scratch;
    const dev::Scratch s = scratch.view();
    const auto base = reinterpret_cast<std::uintptr_t>(s.counters);
    CHECK(base % dev::ScratchLayout::alignment == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(s.partials) - base == dev::ScratchLayout::partials_offset);
    CHECK(dev::ScratchLayout::partials_offset % 256 == 0);
    CHECK(dev::ScratchLayout::partials_offset >= sizeof(unsigned int) * dev::scratch_counters);
    CHECK(s.partial_bytes == dev::scratch_partial_bytes);
    CHECK(s.counter_count == dev::scratch_counters);
    // A misaligned scratch is refused before any kernel stores to it.
    dev::Scratch shifted = s;
    shifted.partials = static_cast<char*>(s.partials) + 4;
    CHECK_THROWS_AS(shifted.partials_as<double>(1), UsageError);
    CHECK_THROWS_AS(dev::ScratchLayout::view(static_cast<char*>(s.partials) + 4), UsageError);
}

// Issue 23, item 9: partials that do not fit the scratch were a null pointer the kernel stored
// through (NHWC with more than 262144 channels); now a ShapeError at plan time names the sizes.
TEST_CASE("emulated SyncBatchNorm: partials beyond the scratch are a ShapeError, not a fault", "[emulation][syncbn]") {
    dev::HostScratch scratch;
    bk::EmulatedRun run{dev::DeviceInfo{}, &scratch};
    const std::int64_t C = 300000;
    const kernels::BnGeometry g{2, C, 1, true};
    std::vector<float> x(static_cast<std::size_t>(2 * C), 1.0f), shift(static_cast<std::size_t>(C));
    std::vector<double> payload(static_cast<std::size_t>(3 * C + 1));
    try {
        bk::local_stats(run, x.data(), g, payload.data(), shift.data());
        FAIL("300000 channels in NHWC fit the scratch");
    } catch (const ShapeError& e) {
        CHECK(std::string(e.what()).find("scratch") != std::string::npos);
    }
    CHECK_THROWS_AS(scratch.view().partials_as<double>(static_cast<std::int64_t>(dev::scratch_partial_bytes / 8) + 1),
                    ShapeError);
    CHECK(scratch.view().partials_as<double>(static_cast<std::int64_t>(dev::scratch_partial_bytes / 8)) != nullptr);
}
