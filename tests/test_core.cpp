// SPDX-License-Identifier: MIT
//! Tests of core/: Shape, Tensor, the error types, the backend tags and the device waits' watches.
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <algorithm>
#include <limits>
#include <cmath>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

using namespace lockstep;

namespace {

// Backend tags defined outside lockstep: BackendTag asks only for their members.
struct ThirdBackend {
    static constexpr std::string_view name = "third";
    static constexpr Device::Kind device_kind = Device::Kind::host;
};
struct ThirdDeviceBackend {
    static constexpr std::string_view name = "third-device";
    static constexpr Device::Kind device_kind = Device::Kind::cuda;
};
struct WithoutDeviceKind {
    static constexpr std::string_view name = "incomplete";
};
struct WithRuntimeKind {
    static constexpr std::string_view name = "runtime";
    static inline Device::Kind device_kind = Device::Kind::host;  // not a constant
};

template <BackendTag B>
constexpr std::string_view name_of() {
    return B::name;
}

}  // namespace

static_assert(BackendTag<ThirdBackend> && BackendTag<ThirdDeviceBackend>, "a third backend's tag is a BackendTag");
static_assert(!BackendTag<WithoutDeviceKind> && !BackendTag<WithRuntimeKind> && !BackendTag<int>,
              "a tag needs constant `name` and `device_kind` members");
static_assert(device_kind_of<ThirdBackend>() == Device::Kind::host && device_kind_of<ThirdDeviceBackend>() == Device::Kind::cuda,
              "device_kind_of reads the tag's member");

TEST_CASE("A backend tag is any type that names itself and its device kind", "[core]") {
    CHECK(device_kind_of<Host>() == Device::Kind::host);
    CHECK(device_kind_of<Cuda>() == Device::Kind::cuda);
    CHECK(device_kind_of<ThirdBackend>() == Device::Kind::host);
    CHECK(device_kind_of<ThirdDeviceBackend>() == Device::Kind::cuda);
    CHECK(name_of<ThirdBackend>() == "third");
    CHECK(name_of<Cuda>() == "cuda");
}

namespace {

//! A group as a replica's waits see it: records what it was told, throws from poll when failed.
struct RecordingWatch final : DeviceWatch {
    int id = 0;
    bool failed = false;
    std::vector<std::string>* log = nullptr;
    void poll() override {
        log->push_back("poll " + std::to_string(id));
        if (failed) throw std::runtime_error("group " + std::to_string(id) + " failed");
    }
    void timed_out(const std::string& what) noexcept override { log->push_back("timed out " + std::to_string(id) + ": " + what); }
};

}  // namespace

TEST_CASE("A replica's device waits consult any number of groups, each once, with the shortest timeout", "[core]") {
    using std::chrono::milliseconds;
    std::vector<std::string> log;
    std::vector<RecordingWatch> groups(DeviceWaits::inline_watches + 3);  // past the ones held in place
    for (std::size_t i = 0; i < groups.size(); ++i) {
        groups[i].id = static_cast<int>(i);
        groups[i].log = &log;
    }
    DeviceWaits waits;
    CHECK(waits.size() == 0);
    CHECK(waits.timeout() == DeviceWaits::default_timeout);
    waits.poll();  // no group: nothing to consult
    CHECK(log.empty());

    for (std::size_t i = 0; i < groups.size(); ++i) waits.watch(&groups[i], milliseconds(1000 + static_cast<int>(i)));
    waits.watch(&groups[1], milliseconds(500));  // a group bound again is not added twice; its timeout still counts
    CHECK(waits.size() == groups.size());
    CHECK(waits.timeout() == milliseconds(500));

    const DeviceWaits copy = waits;  // an execution's copy consults the same groups
    copy.poll();
    REQUIRE(log.size() == groups.size());
    for (std::size_t i = 0; i < groups.size(); ++i) CHECK(log[i] == "poll " + std::to_string(i));

    log.clear();
    groups.back().failed = true;
    CHECK_THROWS_WITH(waits.poll(), "group " + std::to_string(groups.size() - 1) + " failed");
    log.clear();
    waits.timed_out("a step's scalars");
    REQUIRE(log.size() == groups.size());
    CHECK(log.front() == "timed out 0: a step's scalars");
    CHECK(log.back() == "timed out " + std::to_string(groups.size() - 1) + ": a step's scalars");
}

TEST_CASE("Shape counts elements and rejects bad extents", "[core]") {
    Shape s{2, 3, 4, 5};
    CHECK(s.rank() == 4);
    CHECK(s.numel() == 120);
    CHECK(s.row_numel() == 60);
    CHECK(s.with(0, 7) == Shape{7, 3, 4, 5});
    CHECK(s.str() == "(2, 3, 4, 5)");
    CHECK(Shape{}.numel() == 1);
    CHECK_THROWS_AS((Shape{1, 2, 3, 4, 5, 6}), InvalidArgument);
    CHECK_THROWS_AS((Shape{2, -1}), InvalidArgument);
    CHECK_THROWS_AS(s[4], InvalidArgument);
}

TEST_CASE("Tensor is zero-filled, deep-copies, moves and reshapes", "[core]") {
    Tensor<float> t(Shape{2, 3, 4, 5}, MemoryFormat::nhwc);
    REQUIRE(t.numel() == 120);
    CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
    for (auto v : t.span()) CHECK(v == 0.0f);
    std::iota(t.span().begin(), t.span().end(), 1.0f);

    Tensor<float> copy = t;
    REQUIRE(copy.data() != t.data());
    CHECK(copy.format() == MemoryFormat::nhwc);
    copy[0] = -1.0f;
    CHECK(t[0] == 1.0f);

    Tensor<float> moved = std::move(copy);
    CHECK(moved[0] == -1.0f);
    CHECK(copy.empty());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract

    Tensor<float> flat = Tensor<float>(Shape{2, 60}).reshaped(Shape{120});
    CHECK(flat.shape() == Shape{120});
    CHECK_THROWS_AS(Tensor<float>(Shape{2, 3}).reshaped(Shape{7}), ShapeError);
    CHECK_THROWS_AS(Tensor<float>(Shape{2, 3}, MemoryFormat::nhwc), InvalidArgument);

    Tensor<double> empty;
    CHECK(empty.numel() == 0);
    Tensor<double> empty_copy = empty;
    CHECK(empty_copy.numel() == 0);

    std::vector<float> v{1, 2, 3, 4, 5, 6};
    auto m = make_tensor<float>(Shape{2, 3}, v);
    CHECK(m[5] == 6.0f);
    CHECK_THROWS_AS(make_tensor<float>(Shape{4}, v), ShapeError);
}

TEST_CASE("A tensor view uses memory it does not own, and copies of it own theirs", "[core]") {
    Tensor<float> storage(Shape{10});
    std::iota(storage.span().begin(), storage.span().end(), 0.0f);
    {
        auto a = Tensor<float>::view(storage, 2, Shape{2, 2});
        auto b = Tensor<float>::view(storage, 6, Shape{3});
        CHECK(a.is_view());
        CHECK_FALSE(storage.is_view());
        CHECK(a[0] == 2.0f);
        a[3] = -5.0f;  // writes through
        CHECK(storage[5] == -5.0f);
        CHECK(b.follows(a));
        CHECK_FALSE(a.follows(b));
        CHECK(a.views(storage, 2));
        CHECK_FALSE(a.views(storage, 3));
        CHECK(b.views(storage));
        Tensor<float> copy = a;  // a copy owns its memory
        CHECK_FALSE(copy.is_view());
        copy[0] = 100.0f;
        CHECK(storage[2] == 2.0f);
        CHECK_FALSE(copy.views(storage));
        Tensor<float> moved = std::move(b);  // moving keeps the view
        CHECK(moved.is_view());
        CHECK(moved.views(storage, 6));
        moved = Tensor<float>(Shape{3});  // assigning replaces the view, never writes through
        CHECK_FALSE(moved.is_view());
        CHECK(storage[6] == 6.0f);
        auto r = std::move(a).reshaped(Shape{4});
        CHECK(r.is_view());
    }  // the views are gone; the storage is untouched and still owned
    CHECK(storage[9] == 9.0f);
    CHECK_THROWS_AS(Tensor<float>::view(storage, 8, Shape{3}), ShapeError);
    CHECK_THROWS_AS(Tensor<float>::view(storage, -1, Shape{1}), ShapeError);
    CHECK_THROWS_AS(Tensor<float>::view(nullptr, Shape{2}, Device::host(0)), InvalidArgument);
    CHECK(Tensor<float>::view(nullptr, Shape{0}, Device::host(0)).empty());
}

namespace {

// The bf16 nearest to `f` found by distance, independently of BFloat16::round's carry: the two
// bf16 values around f (the truncation and the next one away from zero) compared in fp64 (exact
// for float operands), a tie to the even one; past the largest finite value the next one is
// infinity, at 2^128 for the comparison; every NaN is 0x7FFF.
std::uint16_t nearest_bf16(float f) {
    if (std::isnan(f)) return 0x7fff;
    const auto x = std::bit_cast<std::uint32_t>(f);
    const auto lo = static_cast<std::uint16_t>(x >> 16);
    if ((x & 0xffffu) == 0) return lo;  // representable (infinities too)
    const auto hi = static_cast<std::uint16_t>(lo + 1);
    const double lo_v = BFloat16{lo}.widen();
    const double hi_v = (hi & 0x7fffu) == 0x7f80u ? std::copysign(std::ldexp(1.0, 128), f) : double(BFloat16{hi}.widen());
    const double d_lo = std::abs(double(f) - lo_v), d_hi = std::abs(hi_v - double(f));
    if (d_lo != d_hi) return d_lo < d_hi ? lo : hi;
    return (lo & 1u) == 0 ? lo : hi;
}

}  // namespace

TEST_CASE("BFloat16 rounds to nearest, ties to even, as the fp64 distance says, and widens exactly", "[core]") {
    // Every upper half with the lower halves that decide rounding: exact, just above, below, at
    // and just past the tie, and the largest (NaN payloads in the lower half included).
    std::int64_t mismatched = 0;
    for (std::uint32_t upper = 0; upper <= 0xffffu; ++upper)
        for (const std::uint32_t lower : {0x0u, 0x1u, 0x7fffu, 0x8000u, 0x8001u, 0xfffeu, 0xffffu, 0x1234u, 0xc000u}) {
            const float f = std::bit_cast<float>(upper << 16 | lower);
            const std::uint16_t got = BFloat16::round(f).bits, want = nearest_bf16(f);
            if (got != want && ++mismatched <= 5)
                FAIL_CHECK("round(" << std::hex << (upper << 16 | lower) << ") gave " << got << ", nearest is " << want);
        }
    CHECK(mismatched == 0);

    // A coarse sweep over every bit pattern besides.
    for (std::uint64_t b = 0; b <= 0xffffffffu; b += 65521) {
        const float f = std::bit_cast<float>(static_cast<std::uint32_t>(b));
        if (BFloat16::round(f).bits != nearest_bf16(f)) FAIL_CHECK("round(" << std::hex << b << ")");
    }

    // Widening is exact, and rounding a widened value gives it back (NaNs become the one NaN).
    for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
        const BFloat16 v{static_cast<std::uint16_t>(bits)};
        const float w = v.widen();
        CHECK(std::bit_cast<std::uint32_t>(w) == bits << 16);
        if (std::isnan(w))
            CHECK(BFloat16::round(w).bits == 0x7fff);
        else
            CHECK(BFloat16::round(w) == v);
    }

    // The named cases.
    CHECK(BFloat16::round(1.0f).bits == 0x3f80);
    CHECK(BFloat16::round(-0.0f).bits == 0x8000);
    CHECK(BFloat16::round(std::bit_cast<float>(0x3f808000u)).bits == 0x3f80);  // tie, even below
    CHECK(BFloat16::round(std::bit_cast<float>(0x3f818000u)).bits == 0x3f82);  // tie, even above
    CHECK(BFloat16::round(std::numeric_limits<float>::max()).bits == 0x7f80);  // past the largest finite: infinity
    CHECK(BFloat16::round(-std::numeric_limits<float>::infinity()).bits == 0xff80);
    CHECK(BFloat16::round(std::bit_cast<float>(0xffc12345u)).bits == 0x7fff);  // any NaN: the one NaN
    CHECK(BFloat16::round(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
    CHECK(BFloat16::round(std::bit_cast<float>(0x00008000u + 0x10000u)).bits == 0x0002);  // subnormal tie, odd: up
}

TEST_CASE("An Activation holds fp32 or bf16, refuses the other type by name, reshapes and views", "[core]") {
    Tensor<float> t(Shape{2, 3});
    t[4] = 1.5f;
    Activation<Host> a(std::move(t));
    CHECK(a.precision() == Precision::fp32);
    CHECK(a.is_fp32());
    CHECK(a.shape() == Shape{2, 3});
    CHECK(a.get<float>()[4] == 1.5f);
    try {
        (void)a.get<BFloat16>();
        FAIL("get<BFloat16> of an fp32 activation did not throw");
    } catch (const UsageError& e) {
        CHECK_THAT(e.what(), Catch::Contains("stored in fp32, not bf16"));
    }

    Tensor<BFloat16> h(Shape{2, 2, 1, 3});
    h[5] = BFloat16::round(-2.0f);
    Activation<Host> b(std::move(h));
    CHECK(b.precision() == Precision::bf16);
    CHECK_THROWS_AS(b.get<float>(), UsageError);
    auto flat = std::move(b).reshaped(Shape{2, 6});
    CHECK(flat.precision() == Precision::bf16);
    CHECK(flat.shape() == Shape{2, 6});
    CHECK(flat.get<BFloat16>()[5].widen() == -2.0f);

    // A view reads the tensor's memory; a copy of it owns its own.
    const Tensor<float>& held = a.get<float>();
    const auto v = Activation<Host>::view_of(held);
    CHECK(v.get<float>().is_view());
    CHECK(v.get<float>().views(held, 0));
    Activation<Host> copy = v;
    CHECK_FALSE(copy.get<float>().is_view());
    CHECK(copy.get<float>()[4] == 1.5f);
    auto taken = std::move(copy).take<float>();
    CHECK(taken[4] == 1.5f);
}

#if defined(__linux__)
namespace {
// The VmFlags line of the /proc/self/smaps entry whose range holds `p` ("" when none does).
std::string vm_flags_of(const void* p) {
    std::ifstream smaps("/proc/self/smaps");
    REQUIRE(smaps.is_open());
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::string line;
    bool inside = false;
    while (std::getline(smaps, line)) {
        unsigned long lo = 0, hi = 0;
        if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
            inside = a >= lo && a < hi;
        } else if (inside && line.rfind("VmFlags:", 0) == 0) {
            return line;
        }
    }
    return "";
}
bool advised_huge(const void* p) {
    std::istringstream flags(vm_flags_of(p));
    std::string f;
    while (flags >> f)
        if (f == "hg") return true;
    return false;
}
}  // namespace

TEST_CASE("Host blocks of 2 MiB or more sit on huge-page boundaries, advised MADV_HUGEPAGE", "[core]") {
    auto& cache = detail::HostBlockCache::instance();
    REQUIRE(cache.huge_pages());
    // Sizes no other test allocates, so no cached block of another history is handed out.
    Tensor<float> big(Shape{3, 262147});  // 3 MiB + 12 bytes
    CHECK(reinterpret_cast<std::uintptr_t>(big.data()) % detail::HostBlockCache::huge_page == 0);
    CHECK(advised_huge(big.data()));
    CHECK(std::all_of(big.span().begin(), big.span().end(), [](float v) { return v == 0.0f; }));
    std::iota(big.span().begin(), big.span().end(), 0.0f);
    CHECK(big[big.numel() - 1] == static_cast<float>(big.numel() - 1));

    set_host_huge_pages(false);
    Tensor<float> plain(Shape{5, 262147});
    set_host_huge_pages(true);
    CHECK_FALSE(advised_huge(plain.data()));
    CHECK(vm_flags_of(plain.data()) != "");  // the lookup itself works: the block is mapped

    Tensor<float> small(Shape{1000});  // below 2 MiB: cache-line aligned, no advice asked
    CHECK(reinterpret_cast<std::uintptr_t>(small.data()) % 64 == 0);
}
#endif

TEST_CASE("Errors carry rank and device and say where a check failed", "[core]") {
    try {
        LOCKSTEP_CHECK(1 + 1 == 3, "arithmetic is broken: ", 42);
        FAIL("no throw");
    } catch (const InvalidArgument& e) {
        const std::string what = e.what();
        CHECK(what.find("arithmetic is broken: 42") != std::string::npos);
        CHECK(what.find("1 + 1 == 3") != std::string::npos);
        CHECK(e.rank() == -1);
    }
    Error e("boom");
    e.set_origin(3, 1);
    CHECK(std::string(e.what()) == "[rank 3, device 1] boom");
    e.set_origin(5, 5);  // the first origin sticks
    CHECK(e.rank() == 3);
}

TEST_CASE("LOCKSTEP_CHECK without a message still names the failed expression", "[core]") {
    const int replicas = 0;
    CHECK_THROWS_WITH([&] { LOCKSTEP_CHECK(replicas > 0); }(), Catch::StartsWith("(check `replicas > 0` failed at"));
    CHECK_THROWS_AS([&] { LOCKSTEP_CHECK_AS(ShapeError, replicas == 1); }(), ShapeError);
}

TEST_CASE("A tensor knows its device and copies between devices", "[core]") {
    // A tensor made on a thread takes the thread's current host device (a replica thread's own).
    CHECK(Tensor<float>(Shape{2}).device() == Device::host(0));
    std::thread([] {
        set_current_host_device(3);
        CHECK(Tensor<float>(Shape{2}).device() == Device::host(3));
    }).join();
    CHECK(current_host_device() == Device::host(0));  // per thread

    const std::vector<float> values{1, 2, 3, 4, 5, 6};
    const auto a = make_tensor<float>(Shape{2, 3}, values);
    const auto b = a.to(Device::host(2));
    CHECK(b.device() == Device::host(2));
    CHECK(b.shape() == a.shape());
    CHECK(std::equal(b.span().begin(), b.span().end(), values.begin()));
    CHECK(b.data() != a.data());
    const auto h = b.to_host();
    CHECK(h.device() == Device::host(2));
    CHECK(h[5] == 6.0f);

    Tensor<float> c(Shape{2, 3}, MemoryFormat::nchw, Device::host(1));
    c.copy_from(a);
    CHECK(c[4] == 5.0f);
    CHECK(c.device() == Device::host(1));
    Tensor<float> wrong(Shape{3, 2});
    CHECK_THROWS_WITH(wrong.copy_from(a), Catch::Contains("cannot copy a (2, 3) NCHW tensor into a (3, 2) NCHW one"));
    CHECK_THROWS_AS((Tensor<float>(Shape{2}, MemoryFormat::nchw, Device::cuda(0))), DeviceMismatch);

    // Host replicas share one memory; GPUs and backends do not.
    CHECK(same_memory(Device::host(0), Device::host(1)));
    CHECK_FALSE(same_memory(Device::cuda(0), Device::cuda(1)));
    CHECK_FALSE(same_memory(Device::host(0), Device::cuda(0)));
    CHECK_NOTHROW(check_device(Device::host(0), Device::host(1), "x"));
    CHECK_THROWS_WITH(check_device(Device::cuda(1), Device::cuda(0), "Conv2d(1, 2): the input"),
                      Catch::Contains("Conv2d(1, 2): the input is on cuda:0 but runs on cuda:1"));
    CHECK_THROWS_AS(check_device(Device::cuda(0), Device::host(0), "x"), DeviceMismatch);
}
