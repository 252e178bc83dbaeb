// SPDX-License-Identifier: MIT
//! Deliberate misuse of a 1 MiB host tensor, run only in the AddressSanitizer build: ASan must
//! report it. It can only when the host block cache is bypassed (a cached block stays mapped and
//! allocated, and its size is rounded up), so this proves the bypass (Note [host allocation cache]).
//! Usage: tensor_misuse overflow|use-after-free
#include <lockstep/lockstep.hpp>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
    const char* what = argc > 1 ? argv[1] : "";
    volatile float sink = 0;
    if (std::strcmp(what, "overflow") == 0) {
        lockstep::Tensor<float> t(lockstep::Shape{262145});  // 1 MiB + one float
        const float* p = t.data();
        sink = p[t.numel()];  // one element past the end
    } else if (std::strcmp(what, "use-after-free") == 0) {
        const float* p = nullptr;
        {
            lockstep::Tensor<float> t(lockstep::Shape{262144});
            p = t.data();
        }
        sink = p[7];
    } else {
        std::fprintf(stderr, "usage: tensor_misuse overflow|use-after-free\n");
        return 2;
    }
    std::printf("no report: %g\n", static_cast<double>(sink));
    return 0;
}
