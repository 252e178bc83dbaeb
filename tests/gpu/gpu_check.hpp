// SPDX-License-Identifier: MIT
//! The checks of the GPU tests (tests/gpu): each check prints "ok" or "FAIL" and its description,
//! and a test ends with one "N passed, N failed" line, on a GPU and on the host CUDA device alike.
#pragma once

#include <cstdio>
#include <string>

namespace lockstep::gpu_test {

struct Tally {
    int passed = 0;
    int failed = 0;
};
inline Tally& tally() {
    static Tally t;
    return t;
}

//! One check: prints it and counts it.
inline void expect(bool ok, const std::string& what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    std::fflush(stdout);
    ++(ok ? tally().passed : tally().failed);
}

//! The test's exit code after its closing "N passed, N failed" line (a test that checked
//! nothing fails: it proved nothing).
inline int finish() {
    std::printf("%d passed, %d failed\n", tally().passed, tally().failed);
    return tally().failed == 0 && tally().passed > 0 ? 0 : 1;
}

//! An exception that ended the test early: a failed check of its own.
inline int fail_unexpected(const std::exception& e) {
    expect(false, std::string("unexpected exception: ") + e.what());
    return finish();
}

}  // namespace lockstep::gpu_test
