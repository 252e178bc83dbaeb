// SPDX-License-Identifier: MIT
//! Tests of core/: Shape, Tensor and the error types.
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <numeric>
#include <vector>

using namespace lockstep;

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
