// SPDX-License-Identifier: MIT
//! What the MPI test programs share: each check prints "PASS rank R: what" or "FAIL rank R: what"
//! on its own line, which tests/mpi/run.cmake counts per rank.
#pragma once

#include <cstdio>
#include <string>

namespace lockstep::test::mpi {

inline int& rank() {
    static int r = -1;
    return r;
}
inline int& failures() {
    static int n = 0;
    return n;
}
inline void expect(bool ok, const std::string& what) {
    std::printf("%s rank %d: %s\n", ok ? "PASS" : "FAIL", rank(), what.c_str());
    std::fflush(stdout);
    if (!ok) ++failures();
}

}  // namespace lockstep::test::mpi
