// SPDX-License-Identifier: MIT
//! Every public header was compiled on its own (see tests/CMakeLists.txt); this checks the count.
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <type_traits>

TEST_CASE("every public header compiles on its own", "[headers]") {
    // One translation unit per header was compiled into this executable; a header that does not
    // stand alone fails the build. The count guards against the glob silently matching nothing.
    STATIC_REQUIRE(LOCKSTEP_PUBLIC_HEADERS >= 10);
}

TEST_CASE("the host umbrella header reaches no CUDA header", "[headers]") {
#if defined(CUDART_VERSION) || defined(__CUDA_RUNTIME_H__) || defined(NCCL_MAJOR)
    FAIL("a CUDA header is reachable from <lockstep/lockstep.hpp>");
#else
    STATIC_REQUIRE(std::is_class_v<lockstep::Host>);
#endif
}
