// SPDX-License-Identifier: MIT
//! The CUDA layer kernels (layer_kernels.cuh, gemm_layers.cuh, loss_kernels.cuh, table_kernels.cuh)
//! and the rank-order sum (comm_kernels.cuh), run on the host through the grid emulator (Note
//! [kernels proven on the host]) with the launch configurations, vector widths and cuBLAS
//! arguments the device uses, against the host backend on the same inputs: bit for bit where the
//! kernels promise it (fills, arithmetic, ReLU, max pooling with its gather backward, SGD), and
//! against fp64 references where a GEMM or an fp64 sum in another order is involved (convolution,
//! linear, losses, sums of squares). The GEMMs are the exact `GemmCall`s the device hands cuBLAS,
//! run by a column-major reference here: a wrong transpose, leading dimension or stride fails.
#include <catch2/catch.hpp>

#include <lockstep/kernels/device/comm_kernels.cuh>
#include <lockstep/kernels/device/gemm_layers.cuh>
#include <lockstep/kernels/device/layer_kernels.cuh>
#include <lockstep/kernels/device/loss_kernels.cuh>
#include <lockstep/kernels/device/table_kernels.cuh>
#include <lockstep/comm/host_communicator.hpp>
#include <lockstep/kernels/host_ops.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../test_support.hpp"

using namespace lockstep;
namespace lk = lockstep::kernels::device::layer_kernels;
namespace ck = lockstep::kernels::device::comm_kernels;
namespace dev = lockstep::kernels::device;
using HostOps = kernels::Ops<Host>;

namespace {

// ---- the emulated device ---------------------------------------------------------------------

//! cuBLAS's SGEMM as the column-major definition: C = alpha op(A) op(B) + beta C, per batch,
//! accumulated in fp64 (the device's rounding differs; the tests compare with tolerances).
void reference_gemm(const lk::GemmCall& c) {
    REQUIRE(c.m > 0);
    REQUIRE(c.n > 0);
    REQUIRE(c.k > 0);
    REQUIRE(c.batch >= 1);
    // cuBLAS's argument rules: leading dimensions at least the stored rows.
    REQUIRE(c.lda >= (c.trans_a ? c.k : c.m));
    REQUIRE(c.ldb >= (c.trans_b ? c.n : c.k));
    REQUIRE(c.ldc >= c.m);
    for (int b = 0; b < c.batch; ++b) {
        const float* A = c.a + b * c.stride_a;
        const float* B = c.b + b * c.stride_b;
        float* C = c.c + b * c.stride_c;
        for (int j = 0; j < c.n; ++j)
            for (int i = 0; i < c.m; ++i) {
                double s = 0;
                for (int l = 0; l < c.k; ++l) {
                    const double a =
                        c.trans_a ? A[l + static_cast<std::int64_t>(i) * c.lda] : A[i + static_cast<std::int64_t>(l) * c.lda];
                    const double v =
                        c.trans_b ? B[j + static_cast<std::int64_t>(l) * c.ldb] : B[l + static_cast<std::int64_t>(j) * c.ldb];
                    s += a * v;
                }
                float& out = C[i + static_cast<std::int64_t>(j) * c.ldc];
                out = static_cast<float>(c.alpha * s + (c.beta == 0.0f ? 0.0 : c.beta * static_cast<double>(out)));
            }
    }
}

//! The layer operations' runner on the host: kernels through the grid emulator, GEMMs through the
//! reference above; counts the GEMMs so a test sees how many cuBLAS calls an operation makes.
struct EmulatedLayerRun {
    dev::DeviceInfo device;
    dev::HostScratch* host_scratch = nullptr;
    int gemms = 0;
    int launches = 0;  // kernels launched
    dev::DeviceInfo info() const { return device; }
    dev::Scratch scratch() const { return host_scratch->view(); }
    template <class K>
    void map(const typename K::Params& p, const dev::Grid& g) {
        check_grid(g);
        ++launches;
        dev::emulate_map<K>(p, g);
    }
    template <class K>
    void reduce(const typename K::Params& p, const dev::Grid& g) {
        check_grid(g);
        ++launches;
        dev::emulate_reduce<K>(p, g);
        // A reducing kernel's last block resets its tickets: the next launch starts from zero.
        const dev::Scratch s = host_scratch->view();
        for (int i = 0; i < s.counter_count; ++i) REQUIRE(s.counters[i] == 0u);
    }
    void gemm(const lk::GemmCall& c) {
        ++gemms;
        reference_gemm(c);
    }
    // Every launch stays inside the device's limits, and the blocks along x (a map's, or one
    // group's chunks) within the one-wave cap of Note [layer kernels]. An empty grid launches
    // nothing (launch.cuh), and is only made when there is nothing to do.
    void check_grid(const dev::Grid& g) const {
        REQUIRE(g.x >= 0);
        REQUIRE(g.y >= 0);
        REQUIRE(g.y <= 65535);
        REQUIRE(g.x <= std::max(1, lk::blocks_per_sm * device.multiprocessors));
        REQUIRE(g.threads <= 1024);
    }
};

//! A device-like buffer of T starting `misalign` elements past a 16-byte boundary, so both the
//! vector path and the scalar path of every map are taken.
template <class T>
struct Buffer {
    std::vector<unsigned char> bytes;
    T* p = nullptr;
    std::size_t n = 0;
    Buffer(std::size_t count, int misalign) : bytes((count + 16) * sizeof(T) + 32), n(count) {
        auto base = reinterpret_cast<std::uintptr_t>(bytes.data());
        base = (base + 15) / 16 * 16 + static_cast<std::uintptr_t>(misalign) * sizeof(T);
        p = reinterpret_cast<T*>(base);
    }
    Buffer(const std::vector<T>& v, int misalign) : Buffer(v.size(), misalign) {
        if (!v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(T));
    }
    T* data() { return p; }
    std::vector<T> vec() const { return {p, p + n}; }
};

template <class T>
Tensor<T, Host> host_tensor(const std::vector<T>& v, Shape shape) {
    Tensor<T, Host> t(shape);
    REQUIRE(t.numel() == static_cast<std::int64_t>(v.size()));
    if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(T));
    return t;
}
template <class T>
Tensor<T, Host> host_tensor(const std::vector<T>& v) {
    return host_tensor(v, Shape{static_cast<std::int64_t>(v.size())});
}

template <class T>
std::vector<T> values_of(const Tensor<T, Host>& t) {
    return {t.data(), t.data() + t.numel()};
}

std::vector<float> random_floats(std::size_t n, std::mt19937_64& rng, float lo = -2.0f, float hi = 2.0f) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
}

//! The same bits (NaN payloads included), element by element.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

//! Largest |a - b| over the largest |b| (at least `floor`: the size of the O(1) terms a result is
//! summed from, for results that cancel to nearly zero). fp32 within 1e-5 of it, as the issue of
//! these kernels asks; an index or argument error is off by O(1).
double rel_err(const std::vector<float>& a, const std::vector<double>& b, double floor = 1e-30) {
    REQUIRE(a.size() == b.size());
    double num = 0, den = floor;
    for (std::size_t i = 0; i < a.size(); ++i) {
        num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
        den = std::max(den, std::abs(b[i]));
    }
    return num / den;
}

const std::vector<dev::DeviceInfo> devices = {{132, 60 << 20}, {2, 1 << 20}, {1, 1 << 20}};
const std::vector<std::int64_t> sizes = {0, 1, 3, 4, 5, 17, 255, 256, 257, 1023, 4099, 70001};

std::string where(const dev::DeviceInfo& d, std::int64_t n, int misalign) {
    return "sms=" + std::to_string(d.multiprocessors) + " n=" + std::to_string(n) + " misalign=" + std::to_string(misalign);
}

//! The bits of `v` rounded to bfloat16, to nearest with ties to even (for a value that is not NaN).
std::uint16_t bf16_bits(float v) {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

// ---- elementwise: bit for bit ---------------------------------------------------------------------

TEST_CASE("emulated fill, scale and add equal the host bit for bit", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    for (const auto& d : devices)
        for (const std::int64_t n : sizes)
            for (const int misalign : {0, 1, 3}) {
                INFO(where(d, n, misalign));
                dev::HostScratch scratch;
                EmulatedLayerRun run{d, &scratch};
                const auto a = random_floats(static_cast<std::size_t>(n), rng),
                           b = random_floats(static_cast<std::size_t>(n), rng);

                Buffer<float> f(a, misalign);
                lk::fill(run, f.data(), n, 0.75f);
                auto hf = host_tensor(a);
                HostOps::fill(ex, hf, 0.75f);
                CHECK(same_bits(f.vec(), values_of(hf)));

                std::vector<double> ad(a.begin(), a.end());
                Buffer<double> fd(ad, misalign);
                lk::fill(run, fd.data(), n, -3.5);
                CHECK(std::all_of(fd.p, fd.p + n, [](double v) { return v == -3.5; }));

                Buffer<float> s(a, misalign);
                lk::scale(run, s.data(), n, 0.3f);
                auto hs = host_tensor(a);
                HostOps::scale(ex, hs, 0.3f);
                CHECK(same_bits(s.vec(), values_of(hs)));

                Buffer<float> acc(a, misalign), x(b, misalign == 0 ? 0 : 2);
                lk::add(run, acc.data(), x.data(), n);
                auto hacc = host_tensor(a);
                HostOps::add(ex, hacc, host_tensor(b));
                CHECK(same_bits(acc.vec(), values_of(hacc)));

                std::vector<double> bd(b.begin(), b.end());
                Buffer<double> accd(ad, misalign), xd(bd, misalign);
                lk::add(run, accd.data(), xd.data(), n);
                auto haccd = host_tensor(ad);
                HostOps::add(ex, haccd, host_tensor(bd));
                CHECK(same_bits(accd.vec(), values_of(haccd)));
            }
}

// bf16 rounding (Note [precision]) against the bits: to nearest, ties to even, NaN kept NaN.
TEST_CASE("emulated rounding to bf16 rounds to nearest with ties to even, and widening is exact, for every vector path",
          "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const auto from_bits = [](std::uint32_t u) {
        float f;
        std::memcpy(&f, &u, sizeof f);
        return f;
    };
    // The edges: ties both ways (even and odd kept bit), just above and below a tie, the largest
    // float (rounds to infinity), the largest value rounding to bf16's largest, zeros, infinities,
    // subnormals, NaNs (a payload only in the low bits too, which truncation would make infinity).
    const std::vector<std::uint32_t> edges = {0x3F808000u, 0x3F818000u, 0x3F808001u, 0x3F807FFFu, 0x7F7FFFFFu, 0x7F7F7FFFu,
                                              0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x00018000u, 0x00008000u,
                                              0x80028000u, 0x7FC00000u, 0x7F800001u, 0xFF800001u, 0xBF808000u, 0xC0018000u};
    for (const auto& d : devices)
        for (const std::int64_t n : sizes)
            for (const int misalign : {0, 1, 2}) {
                INFO(where(d, n, misalign));
                dev::HostScratch scratch;
                EmulatedLayerRun run{d, &scratch};
                std::vector<float> x = random_floats(static_cast<std::size_t>(n), rng, -1e4f, 1e4f);
                for (std::size_t i = 0; i < x.size(); ++i)
                    if (i % 7 == 3) x[i] = from_bits(edges[(i / 7) % edges.size()]);
                Buffer<float> in(x, misalign == 2 ? 1 : 0);
                Buffer<__nv_bfloat16> out(static_cast<std::size_t>(n), misalign == 1 ? 1 : 0);
                lk::to_bf16(run, in.data(), out.data(), n);
                std::int64_t wrong = 0;
                for (std::int64_t i = 0; i < n; ++i) {
                    std::uint32_t u;
                    std::memcpy(&u, &x[static_cast<std::size_t>(i)], sizeof u);
                    std::uint16_t got;
                    std::memcpy(&got, out.p + i, sizeof got);
                    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
                    if (nan ? !((got & 0x7FFFu) > 0x7F80u) : got != bf16_bits(x[static_cast<std::size_t>(i)])) ++wrong;
                }
                CHECK(wrong == 0);
                // And back: every bf16 widens to the float of its bits and 16 zero bits.
                Buffer<float> back(static_cast<std::size_t>(n), misalign == 2 ? 1 : 0);
                lk::from_bf16(run, out.data(), back.data(), n);
                std::int64_t wrong_back = 0;
                for (std::int64_t i = 0; i < n; ++i) {
                    std::uint16_t bits;
                    std::memcpy(&bits, out.p + i, sizeof bits);
                    std::uint32_t got;
                    std::memcpy(&got, back.p + i, sizeof got);
                    if (got != static_cast<std::uint32_t>(bits) << 16) ++wrong_back;
                }
                CHECK(wrong_back == 0);
            }
}

namespace {

//! Calls f(device, n, x_misalign, mask_misalign) for every map case of the ReLU tests: both
//! vector paths and an aligned tensor whose mask is not aligned to the tensor's vector.
template <class F>
void for_each_relu_case(F&& f) {
    for (const auto& d : devices)
        for (const std::int64_t n : sizes)
            for (const auto& [xm, mm] : {std::pair{0, 0}, std::pair{1, 1}, std::pair{4, 4}, std::pair{0, 4}}) {
                INFO(where(d, n, xm) << " mask misalign=" << mm);
                f(d, n, xm, mm);
            }
}

//! Calls f(geometry, device, in, out) for every max-pooling case: overlapping windows (k > s),
//! a kernel of 1, an empty batch, a window as large as the plane.
template <class F>
void for_each_pool_case(F&& f) {
    struct Shape4 {
        std::int64_t N, C, H, W, k, s;
    };
    for (const Shape4& sh : {Shape4{2, 3, 28, 28, 2, 2}, Shape4{3, 2, 7, 5, 3, 1}, Shape4{1, 5, 9, 9, 3, 2},
                             Shape4{2, 1, 4, 6, 4, 4}, Shape4{0, 3, 8, 8, 2, 2}, Shape4{1, 1, 1, 1, 1, 1}})
        for (const auto& d : devices) {
            kernels::PoolGeometry g;
            g.batch = sh.N, g.channels = sh.C, g.height = sh.H, g.width = sh.W, g.kernel = sh.k, g.stride = sh.s;
            const std::int64_t in = g.batch * g.channels * g.height * g.width,
                               out = g.batch * g.channels * g.out_height() * g.out_width();
            INFO("N=" << sh.N << " C=" << sh.C << " " << sh.H << "x" << sh.W << " k=" << sh.k << " s=" << sh.s
                      << " sms=" << d.multiprocessors);
            f(g, d, in, out);
        }
}

}  // namespace

TEST_CASE("emulated ReLU forward and backward equal the host bit for bit, NaN and masks included", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    for_each_relu_case([&](const dev::DeviceInfo& d, std::int64_t n, int misalign, int mask_misalign) {
        dev::HostScratch scratch;
        EmulatedLayerRun run{d, &scratch};
        auto a = random_floats(static_cast<std::size_t>(n), rng);
        if (n > 3) {
            a[1] = std::numeric_limits<float>::quiet_NaN();
            a[2] = -0.0f;
            a[3] = 0.0f;
        }
        const auto dy = random_floats(static_cast<std::size_t>(n), rng);

        Buffer<float> x(a, misalign);
        Buffer<std::uint8_t> mask(static_cast<std::size_t>(n), mask_misalign);
        std::memset(mask.p, 7, static_cast<std::size_t>(n));
        lk::relu_forward(run, x.data(), mask.data(), n);
        auto hx = host_tensor(a);
        Tensor<std::uint8_t, Host> hmask(Shape{n});
        HostOps::relu_forward(ex, hx, &hmask);
        CHECK(same_bits(x.vec(), values_of(hx)));
        CHECK(same_bits(mask.vec(), values_of(hmask)));

        Buffer<float> x2(a, misalign);
        lk::relu_forward(run, x2.data(), nullptr, n);
        CHECK(same_bits(x2.vec(), values_of(hx)));

        Buffer<float> g(dy, misalign), dx(std::vector<float>(static_cast<std::size_t>(n), 9.0f), misalign);
        lk::relu_backward(run, g.data(), mask.data(), dx.data(), n);  // writes every element, zeros included
        auto hdx = host_tensor(std::vector<float>(static_cast<std::size_t>(n), 9.0f));
        HostOps::relu_backward(ex, host_tensor(dy), hmask, hdx);
        CHECK(same_bits(dx.vec(), values_of(hdx)));
    });
}

TEST_CASE("emulated SGD equals the host's update bit for bit in every mode", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    std::vector<kernels::SgdUpdate> updates;
    updates.push_back({0.1, 0.0, 0.0, 0.0, false});
    updates.push_back({0.05, 0.0, 0.0, 1e-4, false});
    updates.push_back({0.01, 0.9, 0.0, 5e-4, false});
    updates.push_back({0.01, 0.9, 0.1, 0.0, false});
    updates.push_back({0.02, 0.9, 0.0, 1e-3, true});
    for (const auto& u : updates)
        for (const std::int64_t n : {0, 1, 3, 5, 7, 257, 4099})
            for (const int misalign : {0, 1})
                for (const bool first : {true, false}) {
                    INFO(where(devices[1], n, misalign)
                         << " lr=" << u.lr << " momentum=" << u.momentum << " dampening=" << u.dampening
                         << " wd=" << u.weight_decay << " nesterov=" << u.nesterov << " first=" << first);
                    dev::HostScratch scratch;
                    EmulatedLayerRun run{devices[1], &scratch};
                    const auto w = random_floats(static_cast<std::size_t>(n), rng),
                               g = random_floats(static_cast<std::size_t>(n), rng),
                               v = random_floats(static_cast<std::size_t>(n), rng);
                    Buffer<float> dw(w, misalign), dg(g, misalign), dv(v, misalign);
                    lk::sgd_step(run, dw.data(), dg.data(), dv.data(), n, first, u);
                    auto hw = host_tensor(w), hv = host_tensor(v);
                    HostOps::sgd_step(ex, hw, host_tensor(g), hv, first, u);
                    CHECK(same_bits(dw.vec(), values_of(hw)));
                    if (u.momentum != 0.0)
                        CHECK(same_bits(dv.vec(), values_of(hv)));
                    else
                        CHECK(same_bits(dv.vec(), v));  // untouched without momentum
                }
}

// ---- sums: fp64, another order than the host's ---------------------------------------------------

TEST_CASE("emulated sums of squares and clipping by norm match the host", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    for (const auto& d : devices)
        for (const std::int64_t n : sizes)
            for (const int misalign : {0, 1}) {
                INFO(where(d, n, misalign));
                dev::HostScratch scratch;
                EmulatedLayerRun run{d, &scratch};
                const auto a = random_floats(static_cast<std::size_t>(n), rng);
                Buffer<float> x(a, misalign);
                double acc[2] = {1.5, 0.0};
                lk::add_sum_squares(run, x.data(), n, acc);
                lk::add_sum_squares(run, x.data(), n, acc + 1);
                long double exact = 0;
                for (const float v : a) exact += static_cast<long double>(v) * v;
                CHECK(std::abs(acc[0] - 1.5 - static_cast<double>(exact)) <= 1e-13 * (1.0 + static_cast<double>(exact)));
                CHECK(std::abs(acc[1] - static_cast<double>(exact)) <= 1e-13 * (1.0 + static_cast<double>(exact)));

                // Clipping: a norm below the threshold leaves the values alone; above, scales them.
                for (const double max_norm : {1e9, 0.5}) {
                    Buffer<float> c(a, misalign);
                    lk::clip_to_norm(run, c.data(), n, acc + 1, max_norm);
                    auto hc = host_tensor(a);
                    auto hsum = host_tensor(std::vector<double>{acc[1]});
                    HostOps::clip_to_norm(ex, hc, hsum, max_norm);
                    CHECK(same_bits(c.vec(), values_of(hc)));
                }
            }
    // Non-finite values make the sum non-finite (the finite check reads it).
    dev::HostScratch scratch;
    EmulatedLayerRun run{devices[0], &scratch};
    std::vector<float> a(1000, 1.0f);
    a[777] = std::numeric_limits<float>::infinity();
    Buffer<float> x(a, 0);
    double acc = 0;
    lk::add_sum_squares(run, x.data(), 1000, &acc);
    CHECK(std::isinf(acc));
    a[777] = std::numeric_limits<float>::quiet_NaN();
    Buffer<float> y(a, 1);
    acc = 0;
    lk::add_sum_squares(run, y.data(), 1000, &acc);
    CHECK(std::isnan(acc));
}

// ---- max pooling: bit for bit, argmax included ------------------------------------------------

TEST_CASE("emulated max pooling equals the host bit for bit, overlapping windows, ties and NaN included", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    for_each_pool_case([&](const kernels::PoolGeometry& g, const dev::DeviceInfo& d, std::int64_t in, std::int64_t out) {
        dev::HostScratch scratch;
        EmulatedLayerRun run{d, &scratch};
        // Few distinct values, so windows hold ties; some NaN.
        std::uniform_int_distribution<int> pick(-3, 3);
        std::vector<float> x(static_cast<std::size_t>(in));
        for (float& v : x) v = static_cast<float>(pick(rng));
        for (std::size_t i = 5; i < x.size(); i += 37) x[i] = std::numeric_limits<float>::quiet_NaN();
        const auto dy = random_floats(static_cast<std::size_t>(out), rng);

        Buffer<float> dx_(x, 0), y(static_cast<std::size_t>(out), 0);
        Buffer<std::int32_t> at(static_cast<std::size_t>(out), 0);
        lk::maxpool_forward(run, g, dx_.data(), y.data(), at.data());
        auto hy = Tensor<float, Host>(Shape{out});
        auto hat = Tensor<std::int32_t, Host>(Shape{out});
        HostOps::maxpool_forward(ex, g, host_tensor(x), hy, hat);
        CHECK(same_bits(y.vec(), values_of(hy)));
        CHECK(same_bits(at.vec(), values_of(hat)));

        Buffer<float> gdy(dy, 0), gdx(static_cast<std::size_t>(in), 0);
        std::fill(gdx.p, gdx.p + in, 123.0f);  // every element is written, not accumulated into
        lk::maxpool_backward(run, g, gdy.data(), at.data(), gdx.data());
        auto hdx = Tensor<float, Host>(Shape{in});
        HostOps::maxpool_backward(ex, g, host_tensor(dy), hat, hdx);
        CHECK(same_bits(gdx.vec(), values_of(hdx)));
    });
}

namespace {

using bf16 = __nv_bfloat16;

std::vector<bf16> rounded(const std::vector<float>& v) {
    std::vector<bf16> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) r[i] = dev::from_float<bf16>(v[i]);
    return r;
}

std::vector<float> widened(const std::vector<bf16>& v) {
    std::vector<float> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) r[i] = dev::to_float(v[i]);
    return r;
}

std::uint16_t bits_of(bf16 v) { return static_cast<__nv_bfloat16_raw>(v).x; }

bf16 from_bits(std::uint16_t b) {
    __nv_bfloat16_raw r;
    r.x = b;
    return bf16(r);
}

//! Whether `got` widened is `want` bit for bit (either NaN where `want` is NaN).
bool same_widened(const std::vector<bf16>& got, const std::vector<float>& want) {
    if (got.size() != want.size()) return false;
    const std::vector<float> g = widened(got);
    for (std::size_t i = 0; i < g.size(); ++i) {
        if (std::isnan(want[i]) ? !std::isnan(g[i]) : std::memcmp(&g[i], &want[i], sizeof(float)) != 0) return false;
    }
    return true;
}

}  // namespace

TEST_CASE("emulated ReLU in bfloat16 storage: the fp32 ReLU of the widened input, NaN bits kept", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    for_each_relu_case([&](const dev::DeviceInfo& d, std::int64_t n, int misalign, int mask_misalign) {
        dev::HostScratch scratch;
        EmulatedLayerRun run{d, &scratch};
        auto a = rounded(random_floats(static_cast<std::size_t>(n), rng));
        if (n > 4) {
            a[1] = from_bits(0x7fc5);  // a NaN with a payload
            a[2] = from_bits(0x8000);  // -0
            a[3] = from_bits(0x0000);
            a[4] = from_bits(0x0001);  // the smallest subnormal
        }
        const auto dy = rounded(random_floats(static_cast<std::size_t>(n), rng));

        Buffer<bf16> x(a, misalign);
        Buffer<std::uint8_t> mask(static_cast<std::size_t>(n), mask_misalign);
        std::memset(mask.p, 7, static_cast<std::size_t>(n));
        lk::relu_forward(run, x.data(), mask.data(), n);
        auto hx = host_tensor(widened(a));
        Tensor<std::uint8_t, Host> hmask(Shape{n});
        HostOps::relu_forward(ex, hx, &hmask);
        CHECK(same_widened(x.vec(), values_of(hx)));
        CHECK(same_bits(mask.vec(), values_of(hmask)));
        if (n > 4) CHECK(bits_of(x.p[1]) == 0x7fc5);  // the NaN itself, not a rounded one

        Buffer<bf16> x2(a, misalign);
        lk::relu_forward(run, x2.data(), nullptr, n);
        CHECK(same_widened(x2.vec(), values_of(hx)));

        Buffer<bf16> g(dy, misalign), dx(rounded(std::vector<float>(static_cast<std::size_t>(n), 9.0f)), misalign);
        lk::relu_backward(run, g.data(), mask.data(), dx.data(), n);  // writes every element, zeros included
        auto hdx = host_tensor(std::vector<float>(static_cast<std::size_t>(n), 9.0f));
        HostOps::relu_backward(ex, host_tensor(widened(dy)), hmask, hdx);
        CHECK(same_widened(dx.vec(), values_of(hdx)));
    });
}

TEST_CASE("emulated max pooling in bfloat16 storage: the winning element itself, dx rounded once from fp32 sums",
          "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    for_each_pool_case([&](const kernels::PoolGeometry& g, const dev::DeviceInfo& d, std::int64_t in, std::int64_t out) {
        dev::HostScratch scratch;
        EmulatedLayerRun run{d, &scratch};
        // Few distinct values (ties), -0 beside +0, and NaNs with payloads.
        std::uniform_int_distribution<int> pick(-3, 3);
        std::vector<bf16> x(static_cast<std::size_t>(in));
        for (bf16& v : x) v = dev::from_float<bf16>(static_cast<float>(pick(rng)) * 0.375f);
        for (std::size_t i = 3; i < x.size(); i += 29) x[i] = dev::from_float<bf16>(-0.0f);
        for (std::size_t i = 5; i < x.size(); i += 37) x[i] = from_bits(static_cast<std::uint16_t>(0x7fc0u | (i & 0x3fu)));
        const auto dy = rounded(random_floats(static_cast<std::size_t>(out), rng));

        Buffer<bf16> bx(x, 0), y(static_cast<std::size_t>(out), 0);
        Buffer<std::int32_t> at(static_cast<std::size_t>(out), 0);
        lk::maxpool_forward(run, g, bx.data(), y.data(), at.data());
        auto hy = Tensor<float, Host>(Shape{out});
        auto hat = Tensor<std::int32_t, Host>(Shape{out});
        HostOps::maxpool_forward(ex, g, host_tensor(widened(x)), hy, hat);
        CHECK(same_widened(y.vec(), values_of(hy)));
        CHECK(same_bits(at.vec(), values_of(hat)));
        const std::int64_t plane = g.height * g.width, out_plane = g.out_height() * g.out_width();
        bool winners = true;
        for (std::int64_t o = 0; o < out; ++o)
            winners = winners && bits_of(y.p[o]) == bits_of(x[static_cast<std::size_t>(o / out_plane * plane + at.p[o])]);
        CHECK(winners);

        Buffer<bf16> gdy(dy, 0), gdx(static_cast<std::size_t>(in), 0);
        std::fill(gdx.p, gdx.p + in, dev::from_float<bf16>(123.0f));  // every element is written, not accumulated into
        lk::maxpool_backward(run, g, gdy.data(), at.data(), gdx.data());
        auto hdx = Tensor<float, Host>(Shape{in});
        HostOps::maxpool_backward(ex, g, host_tensor(widened(dy)), hat, hdx);
        std::vector<std::uint16_t> got(static_cast<std::size_t>(in)), want(got.size());
        for (std::int64_t i = 0; i < in; ++i) {
            got[static_cast<std::size_t>(i)] = bits_of(gdx.p[i]);
            want[static_cast<std::size_t>(i)] = bits_of(dev::from_float<bf16>(hdx[i]));
        }
        CHECK(same_bits(got, want));
    });
}

// ---- convolution and linear layers: the cuBLAS calls against fp64 references ---------------------

namespace {

struct ConvCase {
    std::int64_t N, C, H, W, O, k, s, pad;
    bool bias;
};

//! Direct convolution in fp64: y, and the gradients of sum(y * dy) for the given dy.
struct ConvReference {
    std::vector<double> y, dw, db, dx;
    ConvReference(const kernels::ConvGeometry& g, const std::vector<float>& x, const std::vector<float>& w,
                  const std::vector<float>* b, const std::vector<float>& dy) {
        const std::int64_t N = g.batch, C = g.in_channels, H = g.height, W = g.width, O = g.out_channels, k = g.kernel;
        const std::int64_t OH = g.out_height(), OW = g.out_width();
        y.assign(static_cast<std::size_t>(N * O * OH * OW), 0.0);
        dw.assign(w.size(), 0.0);
        db.assign(static_cast<std::size_t>(O), 0.0);
        dx.assign(x.size(), 0.0);
        for (std::int64_t n = 0; n < N; ++n)
            for (std::int64_t o = 0; o < O; ++o)
                for (std::int64_t oh = 0; oh < OH; ++oh)
                    for (std::int64_t ow = 0; ow < OW; ++ow) {
                        const std::size_t yi = static_cast<std::size_t>(((n * O + o) * OH + oh) * OW + ow);
                        double s = b != nullptr ? (*b)[static_cast<std::size_t>(o)] : 0.0;
                        const double g_out = dy[yi];
                        db[static_cast<std::size_t>(o)] += g_out;
                        for (std::int64_t c = 0; c < C; ++c)
                            for (std::int64_t i = 0; i < k; ++i)
                                for (std::int64_t j = 0; j < k; ++j) {
                                    const std::int64_t h = oh * g.stride - g.padding + i, xx = ow * g.stride - g.padding + j;
                                    if (h < 0 || h >= H || xx < 0 || xx >= W) continue;
                                    const std::size_t xi = static_cast<std::size_t>(((n * C + c) * H + h) * W + xx);
                                    const std::size_t wi = static_cast<std::size_t>(((o * C + c) * k + i) * k + j);
                                    s += static_cast<double>(x[xi]) * w[wi];
                                    dw[wi] += g_out * x[xi];
                                    dx[xi] += g_out * w[wi];
                                }
                        y[yi] = s;
                    }
    }
};

}  // namespace

TEST_CASE("emulated convolution (im2col, cuBLAS calls, col2im) matches a direct fp64 convolution", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    for (const ConvCase& cc :
         {ConvCase{2, 1, 28, 28, 4, 5, 1, 0, true}, ConvCase{3, 3, 7, 5, 4, 3, 1, 1, true},
          ConvCase{2, 4, 9, 8, 3, 3, 2, 1, false}, ConvCase{1, 2, 5, 5, 2, 5, 1, 2, true}, ConvCase{2, 3, 6, 6, 5, 1, 1, 0, true},
          ConvCase{1, 1, 1, 1, 1, 1, 1, 0, true}, ConvCase{0, 3, 8, 8, 4, 3, 1, 1, true}})
        for (const auto& d : {devices[0], devices[2]}) {
            kernels::ConvGeometry g;
            g.batch = cc.N, g.in_channels = cc.C, g.height = cc.H, g.width = cc.W, g.out_channels = cc.O, g.kernel = cc.k,
            g.stride = cc.s, g.padding = cc.pad;
            INFO("N=" << cc.N << " C=" << cc.C << " " << cc.H << "x" << cc.W << " O=" << cc.O << " k=" << cc.k << " s=" << cc.s
                      << " pad=" << cc.pad << " bias=" << cc.bias << " sms=" << d.multiprocessors);
            const lk::ConvPlan plan(g);
            const std::int64_t nx = cc.N * cc.C * cc.H * cc.W, ny = cc.N * cc.O * plan.P, nw = cc.O * cc.C * cc.k * cc.k;
            const auto x = random_floats(static_cast<std::size_t>(nx), rng), w = random_floats(static_cast<std::size_t>(nw), rng),
                       b = random_floats(static_cast<std::size_t>(cc.O), rng),
                       dy = random_floats(static_cast<std::size_t>(ny), rng);
            const auto w_grad0 = random_floats(static_cast<std::size_t>(nw), rng),
                       b_grad0 = random_floats(static_cast<std::size_t>(cc.O), rng);
            const ConvReference ref(g, x, w, cc.bias ? &b : nullptr, dy);

            dev::HostScratch scratch;
            EmulatedLayerRun run{d, &scratch};
            Buffer<float> X(x, 0), Wt(w, 0), B(b, 0), Y(static_cast<std::size_t>(ny), 0), DY(dy, 0),
                DX(static_cast<std::size_t>(nx), 0), WG(w_grad0, 0), BG(b_grad0, 0);
            std::fill(DX.p, DX.p + nx, 77.0f);
            const auto fwd = lk::conv_forward_buffers(plan), bwd = lk::conv_backward_buffers(plan);
            std::vector<float> cols(static_cast<std::size_t>(std::max(fwd.cols, bwd.cols) + 1)),
                dcols(static_cast<std::size_t>(bwd.dcols + 1)), dyt(static_cast<std::size_t>(bwd.dyt + 1));
            lk::conv2d_forward(run, plan, X.data(), Wt.data(), cc.bias ? B.data() : nullptr, Y.data(), cols.data());
            CHECK(run.gemms == (cc.N > 0 ? 1 : 0));  // one strided-batched GEMM over the shard
            lk::conv2d_backward(run, plan, X.data(), DY.data(), Wt.data(), WG.data(), cc.bias ? BG.data() : nullptr, DX.data(),
                                cols.data(), dcols.data(), dyt.data());
            CHECK(run.gemms == (cc.N > 0 ? 3 : 0));  // one GEMM for dW over the whole shard, one for dcols

            std::vector<double> wg_ref(static_cast<std::size_t>(nw)), bg_ref(static_cast<std::size_t>(cc.O));
            for (std::size_t i = 0; i < wg_ref.size(); ++i) wg_ref[i] = w_grad0[i] + ref.dw[i];
            for (std::size_t i = 0; i < bg_ref.size(); ++i) bg_ref[i] = b_grad0[i] + (cc.bias ? ref.db[i] : 0.0);
            CHECK(rel_err(Y.vec(), ref.y, 1.0) < 1e-5);
            CHECK(rel_err(WG.vec(), wg_ref, 1.0) < 1e-5);
            CHECK(rel_err(BG.vec(), bg_ref, 1.0) < 1e-5);
            CHECK(rel_err(DX.vec(), ref.dx, 1.0) < 1e-5);
        }
}

// The columns of a bf16 product (Note [precision]) are im2col's, rounded: bit for bit, in both layouts.
TEST_CASE("emulated im2col and col2im into bf16 give their fp32 results rounded to nearest even, from fp32 or bf16 input",
          "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    for (const ConvCase& cc : {ConvCase{2, 1, 28, 28, 4, 5, 1, 0, true}, ConvCase{3, 3, 7, 5, 4, 3, 1, 1, true},
                               ConvCase{2, 4, 9, 8, 3, 3, 2, 1, false}, ConvCase{1, 2, 5, 5, 2, 5, 1, 2, true}})
        for (const auto& d : {devices[0], devices[2]})
            for (const bool sample_major : {true, false}) {
                kernels::ConvGeometry g;
                g.batch = cc.N, g.in_channels = cc.C, g.height = cc.H, g.width = cc.W, g.out_channels = cc.O, g.kernel = cc.k,
                g.stride = cc.s, g.padding = cc.pad;
                INFO("N=" << cc.N << " C=" << cc.C << " " << cc.H << "x" << cc.W << " k=" << cc.k << " s=" << cc.s
                          << " pad=" << cc.pad << " sample_major=" << sample_major << " sms=" << d.multiprocessors);
                const lk::ConvPlan plan(g);
                const auto x = random_floats(static_cast<std::size_t>(cc.N * cc.C * cc.H * cc.W), rng, -300.0f, 300.0f);
                dev::HostScratch scratch;
                EmulatedLayerRun run{d, &scratch};
                Buffer<float> X(x, 0), cols(static_cast<std::size_t>(plan.cols()), 0);
                Buffer<__nv_bfloat16> cols16(static_cast<std::size_t>(plan.cols()), 0);
                lk::im2col(run, plan, X.data(), cols.data(), sample_major);
                lk::im2col_bf16(run, plan, X.data(), cols16.data(), sample_major);
                std::int64_t wrong = 0;
                for (std::int64_t i = 0; i < plan.cols(); ++i) {
                    std::uint16_t got;
                    std::memcpy(&got, cols16.p + i, sizeof got);
                    if (got != bf16_bits(cols.p[i])) ++wrong;
                }
                CHECK(wrong == 0);

                // From an input stored in bf16 (Note [activation precision]): the columns of the
                // widened input, each element its own bits.
                Buffer<__nv_bfloat16> X16(x.size(), 1), from16(static_cast<std::size_t>(plan.cols()), 0);
                std::vector<float> wide(x.size());
                for (std::size_t i = 0; i < x.size(); ++i) {
                    X16.p[i] = __float2bfloat16_rn(x[i]);
                    wide[i] = __bfloat162float(X16.p[i]);
                }
                Buffer<float> W(wide, 0), cols_wide(static_cast<std::size_t>(plan.cols()), 0);
                lk::im2col_bf16(run, plan, X16.data(), from16.data(), sample_major);
                lk::im2col(run, plan, W.data(), cols_wide.data(), sample_major);
                std::int64_t wrong16 = 0;
                for (std::int64_t i = 0; i < plan.cols(); ++i) {
                    std::uint16_t got;
                    std::memcpy(&got, from16.p + i, sizeof got);
                    if (got != bf16_bits(cols_wide.p[i]) || __bfloat162float(from16.p[i]) != cols_wide.p[i]) ++wrong16;
                }
                CHECK(wrong16 == 0);

                // col2im into bf16: each of col2im's fp32 sums rounded once.
                const auto dcols = random_floats(static_cast<std::size_t>(plan.cols()), rng);
                Buffer<float> D(dcols, 0), dx32(x.size(), 0);
                Buffer<__nv_bfloat16> dx16(x.size(), 1);
                lk::col2im(run, plan, D.data(), dx32.data(), sample_major);
                lk::col2im(run, plan, D.data(), dx16.data(), sample_major);
                std::int64_t wrong_dx = 0;
                for (std::size_t i = 0; i < x.size(); ++i) {
                    std::uint16_t got;
                    std::memcpy(&got, dx16.p + i, sizeof got);
                    if (got != bf16_bits(dx32.p[i])) ++wrong_dx;
                }
                CHECK(wrong_dx == 0);
            }
}

TEST_CASE("emulated convolution: NHWC is refused on CUDA, bad geometry is a ShapeError", "[emulation][layers]") {
    kernels::ConvGeometry g;
    g.batch = 1, g.in_channels = 1, g.height = 4, g.width = 4, g.out_channels = 1, g.kernel = 3;
    g.channels_last = true;
    CHECK_THROWS_AS(lk::ConvPlan(g), NotImplemented);
    g.channels_last = false;
    g.kernel = 7;
    CHECK_THROWS_AS(lk::ConvPlan(g), ShapeError);
    g.kernel = 3;
    g.batch = std::int64_t{1} << 32;  // an index space beyond the kernels' 32-bit index math
    CHECK_THROWS_AS(lk::ConvPlan(g), ShapeError);
}

TEST_CASE("emulated linear layer (cuBLAS calls, bias, fused ReLU) matches fp64 and the host's mask", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    struct LinCase {
        std::int64_t N, in, out;
    };
    for (const LinCase& lc :
         {LinCase{64, 1024, 128}, LinCase{3, 5, 7}, LinCase{1, 1, 1}, LinCase{33, 40, 10}, LinCase{0, 8, 4}, LinCase{5, 0, 3}})
        for (const bool bias : {true, false})
            for (const bool relu : {true, false}) {
                INFO("N=" << lc.N << " in=" << lc.in << " out=" << lc.out << " bias=" << bias << " relu=" << relu);
                const std::int64_t N = lc.N, in = lc.in, out = lc.out;
                const auto x = random_floats(static_cast<std::size_t>(N * in), rng),
                           w = random_floats(static_cast<std::size_t>(out * in), rng),
                           b = random_floats(static_cast<std::size_t>(out), rng),
                           dy = random_floats(static_cast<std::size_t>(N * out), rng),
                           wg0 = random_floats(static_cast<std::size_t>(out * in), rng),
                           bg0 = random_floats(static_cast<std::size_t>(out), rng);
                dev::HostScratch scratch;
                EmulatedLayerRun run{devices[1], &scratch};
                Buffer<float> X(x, 0), Wt(w, 0), B(b, 0), Y(static_cast<std::size_t>(N * out), 0), DY(dy, 0), WG(wg0, 0),
                    BG(bg0, 0), DX(static_cast<std::size_t>(N * in), 0), masked(static_cast<std::size_t>(N * out), 0);
                Buffer<std::uint8_t> M(static_cast<std::size_t>(N * out), 0);
                lk::linear_forward(run, N, in, out, X.data(), Wt.data(), bias ? B.data() : nullptr, Y.data(), relu,
                                   relu ? M.data() : nullptr);

                // fp64 reference.
                std::vector<double> y(static_cast<std::size_t>(N * out)), dx(static_cast<std::size_t>(N * in), 0.0),
                    wg(wg0.begin(), wg0.end()), bg(bg0.begin(), bg0.end());
                std::vector<std::uint8_t> mask(static_cast<std::size_t>(N * out));
                for (std::int64_t n = 0; n < N; ++n)
                    for (std::int64_t o = 0; o < out; ++o) {
                        double s = bias ? b[static_cast<std::size_t>(o)] : 0.0;
                        for (std::int64_t i = 0; i < in; ++i)
                            s += static_cast<double>(x[static_cast<std::size_t>(n * in + i)]) *
                                 w[static_cast<std::size_t>(o * in + i)];
                        const std::size_t yi = static_cast<std::size_t>(n * out + o);
                        mask[yi] = s > 0;
                        y[yi] = relu ? std::max(s, 0.0) : s;
                        const double g = relu && !(Y.p[yi] > 0.0f) ? 0.0 : dy[yi];  // the device's own mask decides
                        if (bias) bg[static_cast<std::size_t>(o)] += g;
                        for (std::int64_t i = 0; i < in; ++i) {
                            wg[static_cast<std::size_t>(o * in + i)] += g * x[static_cast<std::size_t>(n * in + i)];
                            dx[static_cast<std::size_t>(n * in + i)] += g * w[static_cast<std::size_t>(o * in + i)];
                        }
                    }
                CHECK(rel_err(Y.vec(), y, 1.0) < 1e-5);
                if (relu) {
                    // The mask is the output's sign, exactly as the host's epilogue writes it.
                    auto hy = Tensor<float, Host>(Shape{N, out});
                    Tensor<std::uint8_t, Host> hm(Shape{N * out});
                    const Tensor<float, Host> hb = host_tensor(b);
                    HostOps::linear_forward(ex, host_tensor(x, Shape{N, in}), host_tensor(w, Shape{out, in}),
                                            bias ? &hb : nullptr, hy, true, &hm);
                    std::vector<std::uint8_t> from_y(static_cast<std::size_t>(N * out));
                    for (std::size_t i = 0; i < from_y.size(); ++i) from_y[i] = Y.p[i] > 0.0f;
                    CHECK(same_bits(M.vec(), from_y));
                    std::size_t agree = 0;
                    for (std::size_t i = 0; i < from_y.size(); ++i) agree += M.p[i] == hm.data()[i];
                    CHECK(agree + 2 >= from_y.size());  // the host's GEMM rounds differently: a near-zero may flip
                }
                lk::linear_backward(run, N, in, out, X.data(), DY.data(), relu ? M.data() : nullptr, masked.data(), Wt.data(),
                                    WG.data(), bias ? BG.data() : nullptr, DX.data());
                CHECK(rel_err(WG.vec(), wg, 1.0) < 1e-5);
                CHECK(rel_err(BG.vec(), bg, 1.0) < 1e-5);
                CHECK(rel_err(DX.vec(), dx, 1.0) < 1e-5);
            }
}

// ---- losses -----------------------------------------------------------------------------------------

TEST_CASE("emulated softmax cross-entropy and MSE match the host", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    for (const auto& d : devices)
        for (const std::int64_t N : {0, 1, 7, 64, 300, 1000})
            for (const std::int64_t K : {1, 10, 33}) {
                INFO("N=" << N << " K=" << K << " sms=" << d.multiprocessors);
                dev::HostScratch scratch;
                EmulatedLayerRun run{d, &scratch};
                auto z = random_floats(static_cast<std::size_t>(N * K), rng, -8.0f, 8.0f);
                std::uniform_int_distribution<std::int64_t> label(0, K - 1);
                std::vector<std::int64_t> labels(static_cast<std::size_t>(N));
                for (auto& l : labels) l = label(rng);
                if (N >= 7 && K >= 10)
                    z[static_cast<std::size_t>(3 * K + 2)] = z[static_cast<std::size_t>(3 * K + 5)] = 50.0f;  // a tie
                const double inv = 1.0 / (2.0 * static_cast<double>(std::max<std::int64_t>(N, 1)));

                Buffer<float> Z(z, 0), G(static_cast<std::size_t>(N * K), 0);
                Buffer<std::int64_t> L(labels, 0);
                double totals[2] = {-1, -1};
                lk::softmax_cross_entropy(run, Z.data(), N, K, L.data(), inv, G.data(), totals);
                auto hg = Tensor<float, Host>(Shape{std::max<std::int64_t>(N * K, 0)});
                auto ht = Tensor<double, Host>(Shape{2});
                HostOps::softmax_cross_entropy(ex, host_tensor(z, Shape{N, K}), labels, inv, hg, ht);
                CHECK(same_bits(G.vec(), values_of(hg)));  // the same fp64 formula per element
                CHECK(std::abs(totals[0] - ht.data()[0]) <= 1e-12 * (1.0 + std::abs(ht.data()[0])));
                CHECK(totals[1] == ht.data()[1]);

                const std::int64_t D = K;
                const auto o = random_floats(static_cast<std::size_t>(N * D), rng),
                           t = random_floats(static_cast<std::size_t>(N * D), rng);
                for (const int misalign : {0, 1}) {
                    Buffer<float> O(o, misalign), T(t, misalign), MG(static_cast<std::size_t>(N * D), misalign);
                    double mt[2] = {-1, -1};
                    lk::mse(run, O.data(), T.data(), N, D, inv, MG.data(), mt);
                    auto hmg = Tensor<float, Host>(Shape{N * D});
                    auto hmt = Tensor<double, Host>(Shape{2});
                    HostOps::mse(ex, host_tensor(o, Shape{N, D}), host_tensor(t, Shape{N, D}), inv, hmg, hmt);
                    CHECK(same_bits(MG.vec(), values_of(hmg)));
                    CHECK(std::abs(mt[0] - hmt.data()[0]) <= 1e-12 * (1.0 + std::abs(hmt.data()[0])));
                    CHECK(mt[1] == 0.0);
                }
            }
}

TEST_CASE("emulated cross-entropy: a label outside the classes gives NaN, never a read outside the row", "[emulation][layers]") {
    dev::HostScratch scratch;
    EmulatedLayerRun run{devices[0], &scratch};
    std::vector<float> z = {1, 2, 3, 4, 5, 6};
    Buffer<float> Z(z, 0), G(6, 0);
    for (const std::int64_t bad : {std::int64_t{3}, std::int64_t{-1}, std::int64_t{1} << 40}) {
        Buffer<std::int64_t> L(std::vector<std::int64_t>{0, bad}, 0);
        double totals[2] = {0, 0};
        lk::softmax_cross_entropy(run, Z.data(), 2, 3, L.data(), 0.5, G.data(), totals);
        CHECK(std::isnan(totals[0]));
    }
}

// ---- channel sums and scratch ----------------------------------------------------------------------

TEST_CASE("emulated per-channel sums cover every channel and stay within the scratch", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    struct SumCase {
        std::int64_t N, C, P;
    };
    for (const SumCase& sc : {SumCase{1, 1, 1}, SumCase{64, 10, 1}, SumCase{3, 70, 1}, SumCase{2, 33, 49}, SumCase{1000, 3, 1},
                              SumCase{16, 2, 4096}, SumCase{0, 5, 7}})
        for (const auto& d : devices) {
            INFO("N=" << sc.N << " C=" << sc.C << " P=" << sc.P << " sms=" << d.multiprocessors);
            dev::HostScratch scratch;
            EmulatedLayerRun run{d, &scratch};
            const auto v = random_floats(static_cast<std::size_t>(sc.N * sc.C * sc.P), rng);
            const auto acc0 = random_floats(static_cast<std::size_t>(sc.C), rng);
            Buffer<float> V(v, 0), A(acc0, 0);
            lk::channel_sums(run, V.data(), sc.N, sc.C, sc.P, A.data());
            std::vector<double> ref(acc0.begin(), acc0.end());
            for (std::int64_t n = 0; n < sc.N; ++n)
                for (std::int64_t c = 0; c < sc.C; ++c)
                    for (std::int64_t p = 0; p < sc.P; ++p)
                        ref[static_cast<std::size_t>(c)] += v[static_cast<std::size_t>((n * sc.C + c) * sc.P + p)];
            CHECK(rel_err(A.vec(), ref, 1.0) < 1e-5);
        }
}

// bf16 storage in the layers' epilogues and gradients (Note [cuDNN convolutions], Note
// [precision]): the bias added to a bf16 output is the fp32 bias on the widened value rounded
// once, and from an fp32 source (the fused epilogue) the fp32 epilogue rounded once, its mask the
// fp32 one; a bf16 weight gradient is added widened; a bf16 dy's per-channel sums are those of its
// widened copy; its channel-major copy in bf16 is the fp32 one rounded (from fp32) or the same
// bits (from bf16); all bit for bit.
TEST_CASE("emulated bias on bf16 storage, bf16 gradients added widened, and sums of a bf16 dy equal the fp32 ones",
          "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    struct Case {
        std::int64_t N, C, P;
    };
    for (const Case& sc : {Case{2, 3, 20}, Case{3, 5, 7}, Case{4, 70, 1}, Case{1, 2, 4096}, Case{0, 3, 4}})
        for (const auto& d : devices)
            for (const int misalign : {0, 1}) {
                INFO("N=" << sc.N << " C=" << sc.C << " P=" << sc.P << " sms=" << d.multiprocessors << " misalign=" << misalign);
                dev::HostScratch scratch;
                EmulatedLayerRun run{d, &scratch};
                const auto n = static_cast<std::size_t>(sc.N * sc.C * sc.P);
                const auto y16 = rounded(random_floats(n, rng));
                const auto bias = random_floats(static_cast<std::size_t>(sc.C), rng);
                Buffer<float> b(bias, 0);

                // bias: bf16 in place against fp32 on the widened values, then rounded once
                Buffer<bf16> y(y16, misalign);
                Buffer<float> y32(widened(y16), misalign);
                lk::bias_act(run, y.data(), sc.N, sc.C, sc.P, b.data(), false, nullptr);
                lk::bias_act(run, y32.data(), sc.N, sc.C, sc.P, b.data(), false, nullptr);
                CHECK(same_widened(y.vec(), widened(rounded(y32.vec()))));

                // a bf16 gradient added to an fp32 one: the fp32 sum with its widened copy
                const auto acc0 = random_floats(n, rng);
                const auto g16 = rounded(random_floats(n, rng));
                Buffer<float> acc(acc0, misalign), acc_ref(acc0, misalign);
                Buffer<bf16> g(g16, misalign);
                Buffer<float> gw(widened(g16), misalign);
                lk::add_widened(run, acc.data(), g.data(), static_cast<std::int64_t>(n));
                lk::add(run, acc_ref.data(), gw.data(), static_cast<std::int64_t>(n));
                CHECK(same_bits(acc.vec(), acc_ref.vec()));

                // per-channel sums of a bf16 dy: the bits of its widened copy's sums
                const auto s0 = random_floats(static_cast<std::size_t>(sc.C), rng);
                Buffer<float> s16(s0, 0), s32(s0, 0);
                lk::channel_sums(run, g.data(), sc.N, sc.C, sc.P, s16.data());
                lk::channel_sums(run, gw.data(), sc.N, sc.C, sc.P, s32.data());
                CHECK(same_bits(s16.vec(), s32.vec()));
                if (sc.N > 0) CHECK_FALSE(same_bits(s16.vec(), s0));  // the sums were added

                // the fused epilogue: from fp32 into bf16, with and without ReLU and its mask
                for (const bool relu : {false, true}) {
                    const auto src = random_floats(n, rng);
                    Buffer<float> S(src, misalign), ref(src, misalign);
                    Buffer<bf16> out(n, misalign);
                    Buffer<std::uint8_t> m16(n, 0), m32(n, 0);
                    lk::bias_act(run, out.data(), sc.N, sc.C, sc.P, b.data(), relu, m16.data(), S.data());
                    lk::bias_act(run, ref.data(), sc.N, sc.C, sc.P, b.data(), relu, m32.data());
                    CHECK(same_widened(out.vec(), widened(rounded(ref.vec()))));
                    CHECK(same_bits(m16.vec(), m32.vec()));
                    CHECK(same_bits(S.vec(), src));  // the source is read only
                }

                // channel-major copies into bf16: from fp32 rounded, from bf16 the same bits
                Buffer<bf16> t16(n, misalign), tt16(n, misalign);
                Buffer<float> t32(n, misalign);
                lk::channel_major(run, gw.data(), t16.data(), sc.N, sc.C, sc.P);
                lk::channel_major(run, gw.data(), t32.data(), sc.N, sc.C, sc.P);
                lk::channel_major(run, g.data(), tt16.data(), sc.N, sc.C, sc.P);
                CHECK(same_widened(t16.vec(), t32.vec()));  // gw holds bf16 values: exact either way
                CHECK(same_widened(tt16.vec(), t32.vec()));
                const auto r = random_floats(n, rng);
                Buffer<float> R(r, misalign), R32(n, misalign);
                Buffer<bf16> R16(n, misalign);
                lk::channel_major(run, R.data(), R16.data(), sc.N, sc.C, sc.P);
                lk::channel_major(run, R.data(), R32.data(), sc.N, sc.C, sc.P);
                CHECK(same_widened(R16.vec(), widened(rounded(R32.vec()))));
            }
}

// ---- many tensors per launch: SGD and bucket pack/unpack ----------------------------------------

TEST_CASE("emulated SGD over a table of tensors equals the host's per-tensor update bit for bit", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    const Execution<Host> ex;
    // 70 tensors (three launches of at most 32), sizes from empty to a few vectors, each offset by
    // its own misalignment so vector and scalar tensors share a launch; `first` mixed.
    const std::vector<std::int64_t> pattern = {0, 1, 3, 4, 5, 8, 17, 128, 1000, 2, 33};
    for (const kernels::SgdUpdate& u :
         {kernels::SgdUpdate{0.1, 0.0, 0.0, 1e-4, false}, kernels::SgdUpdate{0.01, 0.9, 0.1, 5e-4, false},
          kernels::SgdUpdate{0.02, 0.9, 0.0, 0.0, true}})
        for (const auto& d : devices) {
            INFO("momentum=" << u.momentum << " nesterov=" << u.nesterov << " sms=" << d.multiprocessors);
            dev::HostScratch scratch;
            EmulatedLayerRun run{d, &scratch};
            const std::size_t count = 70;
            std::vector<Buffer<float>> w, g, v;
            std::vector<Tensor<float, Host>> hw, hg, hv;
            std::vector<lk::SgdEntry> entries;
            std::vector<kernels::SgdTensors<Host>> items;
            w.reserve(count), g.reserve(count), v.reserve(count), hw.reserve(count), hg.reserve(count), hv.reserve(count);
            std::int64_t nonempty = 0;
            for (std::size_t t = 0; t < count; ++t) {
                const std::int64_t n = pattern[t % pattern.size()];
                nonempty += n > 0;
                const int misalign = static_cast<int>(t % 3 == 2);
                const auto a = random_floats(static_cast<std::size_t>(n), rng),
                           b = random_floats(static_cast<std::size_t>(n), rng),
                           c = random_floats(static_cast<std::size_t>(n), rng);
                w.emplace_back(a, misalign), g.emplace_back(b, 0), v.emplace_back(c, t % 5 == 1 ? 1 : 0);
                hw.push_back(host_tensor(a)), hg.push_back(host_tensor(b)), hv.push_back(host_tensor(c));
                const bool first = t % 4 == 0;
                entries.push_back({w.back().data(), g.back().data(), v.back().data(), n, first});
                items.push_back({&hw.back(), &hg.back(), &hv.back(), first});
            }
            lk::sgd_step_many(run, entries, u);
            CHECK(run.launches == static_cast<int>((nonempty + lk::table_max - 1) / lk::table_max));
            HostOps::sgd_step_many(ex, items, u);
            for (std::size_t t = 0; t < count; ++t) {
                INFO("tensor " << t << " of " << w[t].n << " elements");
                CHECK(same_bits(w[t].vec(), values_of(hw[t])));
                if (u.momentum != 0.0) CHECK(same_bits(v[t].vec(), values_of(hv[t])));
            }
        }
}

TEST_CASE("emulated bucket pack and unpack move every gradient in and out of the flat buffer", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    for (const auto& d : devices) {
        INFO("sms=" << d.multiprocessors);
        dev::HostScratch scratch;
        EmulatedLayerRun run{d, &scratch};
        // 45 gradients packed back to back (most offsets unaligned), then unpacked into fresh buffers.
        std::vector<std::vector<float>> grads;
        std::int64_t total = 0;
        for (int t = 0; t < 45; ++t) {
            grads.push_back(random_floats(static_cast<std::size_t>((t * 37) % 301), rng));
            total += static_cast<std::int64_t>(grads.back().size());
        }
        Buffer<float> flat(static_cast<std::size_t>(total) + 1, 0);
        flat.p[total] = 42.0f;  // past the end: never written
        std::vector<Buffer<float>> src, dst;
        std::vector<lk::CopyEntry> pack, unpack;
        src.reserve(grads.size()), dst.reserve(grads.size());
        std::vector<float> expected;
        std::int64_t at = 0;
        for (const auto& gr : grads) {
            src.emplace_back(gr, 0);
            dst.emplace_back(gr.size(), 0);
            pack.push_back({flat.data() + at, src.back().data(), static_cast<std::int64_t>(gr.size())});
            unpack.push_back({dst.back().data(), flat.data() + at, static_cast<std::int64_t>(gr.size())});
            expected.insert(expected.end(), gr.begin(), gr.end());
            at += static_cast<std::int64_t>(gr.size());
        }
        expected.push_back(42.0f);
        lk::copy_many(run, pack);
        CHECK(same_bits(flat.vec(), expected));
        lk::copy_many(run, unpack);
        for (std::size_t t = 0; t < grads.size(); ++t) CHECK(same_bits(dst[t].vec(), grads[t]));
    }
}

TEST_CASE("tensor tables find every item's tensor, empty tensors skipped", "[emulation][layers]") {
    const long long begin[] = {0, 0, 3, 3, 3, 7, 8};  // tensors of 0, 3, 0, 0, 4, 1 items
    const int expect[] = {1, 1, 1, 4, 4, 4, 4, 5};
    for (long long i = 0; i < 8; ++i) CHECK(lk::table_find(begin, 6, i) == expect[i]);
    // A tensor of 10 floats in vectors of 4: items 0, 1 are vectors at 0 and 4, items 2, 3 the tail 8, 9.
    CHECK(lk::table_item(1, 10, 4).is_vector);
    CHECK(lk::table_item(1, 10, 4).element == 4);
    CHECK(!lk::table_item(2, 10, 4).is_vector);
    CHECK(lk::table_item(3, 10, 4).element == 9);
    CHECK(lk::table_item(7, 10, 1).element == 7);
}

// ---- the device-local all-reduce -----------------------------------------------------------------

namespace {

// The host group's all-reduce of `inputs` (one thread per rank): what the kernel must equal.
template <class T>
std::vector<std::vector<T>> host_group_sum(std::vector<std::vector<T>> inputs) {
    auto comms = comm::HostCommunicator::create_group(static_cast<int>(inputs.size()));
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < inputs.size(); ++r)
        threads.emplace_back([&, r] { comms[r].all_reduce_sum(std::span<T>(inputs[r])); });
    for (auto& t : threads) t.join();
    return inputs;
}

template <class T>
void check_rank_sum(std::mt19937_64& rng) {
    for (const auto& d : devices) {
        for (const int ranks : {1, 2, 3, 5, 16}) {
            for (const std::int64_t n :
                 {std::int64_t{0}, std::int64_t{1}, std::int64_t{17}, std::int64_t{4099}, std::int64_t{70001}}) {
                INFO(where(d, n, 0) << " ranks=" << ranks);
                dev::HostScratch scratch;
                EmulatedLayerRun run{d, &scratch};
                // Magnitudes far apart, so a sum in another order gives other bits.
                std::vector<std::vector<T>> in(static_cast<std::size_t>(ranks));
                std::uniform_real_distribution<double> u(-1, 1);
                for (int r = 0; r < ranks; ++r)
                    for (std::int64_t i = 0; i < n; ++i)
                        in[static_cast<std::size_t>(r)].push_back(static_cast<T>(u(rng) * std::pow(10.0, (r * 7 + i) % 9 - 4)));
                const auto want = host_group_sum(in);
                std::vector<T*> bufs;
                for (auto& b : in) bufs.push_back(b.data());
                const int before = run.launches;
                ck::rank_sum<T>(run, std::span<T* const>(bufs), n);
                CHECK(run.launches - before == (n > 0 ? 1 : 0));  // one kernel for all ranks
                for (int r = 0; r < ranks; ++r)
                    CHECK(same_bits(in[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)]));
            }
        }
    }
}

}  // namespace

// 16-bit floats: every buffer holds the fp32 rank-order sum, rounded once.
template <class H>
void check_rank_sum_16(std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-4, 4);
    for (const int ranks : {2, 3, 16}) {
        for (const std::int64_t n : {std::int64_t{1}, std::int64_t{17}, std::int64_t{4099}}) {
            INFO("ranks=" << ranks << " n=" << n << " bf16=" << (std::is_same_v<H, __nv_bfloat16>));
            dev::HostScratch scratch;
            EmulatedLayerRun run{devices[1], &scratch};
            std::vector<std::vector<H>> in(static_cast<std::size_t>(ranks));
            for (auto& b : in)
                for (std::int64_t i = 0; i < n; ++i) b.push_back(dev::from_float<H>(u(rng)));
            std::vector<H> want;
            for (std::int64_t i = 0; i < n; ++i) {
                float acc = dev::to_float(in[0][static_cast<std::size_t>(i)]);
                for (int r = 1; r < ranks; ++r)
                    acc += dev::to_float(in[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)]);
                want.push_back(dev::from_float<H>(acc));
            }
            std::vector<H*> bufs;
            for (auto& b : in) bufs.push_back(b.data());
            ck::rank_sum<H>(run, std::span<H* const>(bufs), n);
            for (const auto& b : in) CHECK(same_bits(b, want));
        }
    }
}

TEST_CASE("emulated device-local all-reduce equals the host group's bit for bit in every buffer", "[emulation][layers]") {
    const std::uint64_t seed = lockstep::test::fresh_seed();
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    check_rank_sum<float>(rng);
    check_rank_sum<double>(rng);
    check_rank_sum_16<__half>(rng);
    check_rank_sum_16<__nv_bfloat16>(rng);
    dev::HostScratch scratch;
    EmulatedLayerRun run{devices[0], &scratch};
    std::vector<float*> too_many(17, nullptr);
    CHECK_THROWS_WITH(ck::rank_sum<float>(run, std::span<float* const>(too_many), 4),
                      Catch::Contains("fewer replicas on each GPU"));
}
