// SPDX-License-Identifier: MIT
//! libFuzzer target for lockstep's safetensors reader, `lockstep::nn::Checkpoint::load`.
//!
//! The reader takes a path, so each input is written to a per-process scratch file (an in-memory
//! memfd, opened again through /proc/self/fd) and loaded from there. An `lockstep::Error` is the
//! expected outcome for a bad file; a checkpoint that loads must be self-consistent. Anything else
//! (a sanitizer report, a crash, another exception, a broken invariant) is a finding.
//!
//! LOCKSTEP_FUZZ_SELF_TEST=1 in the environment plants a heap read one byte past a copy of every
//! tensor that loads, so that the test fuzz_safetensors_self_test can check that such a read fails
//! the replay (the sanitizers are in, the corpus reaches a successful load, the exit code says so).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <lockstep/nn/checkpoint.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "scratch_file.hpp"

namespace {

using lockstep::fuzz::ScratchFile;

[[noreturn]] void finding(const char* what, const std::string& name) {
    std::fprintf(stderr, "fuzz_safetensors: a loaded checkpoint breaks an invariant: %s (tensor '%s')\n", what, name.c_str());
    std::abort();
}

// What `load` promises about a checkpoint it returns.
void check_loaded(const lockstep::nn::Checkpoint& ck, std::size_t file_size) {
    std::uint64_t total = 0;
    for (const auto& name : ck.names()) {
        if (name == "__metadata__") finding("__metadata__ read as a tensor", name);
        const auto& e = ck.at(name);
        std::uint64_t elem = 0;
        if (e.dtype == "F32")
            elem = 4;
        else if (e.dtype == "I64")
            elem = 8;
        else
            finding("dtype other than F32 or I64", name);
        if (e.shape.size() > static_cast<std::size_t>(lockstep::Shape::max_rank)) finding("rank beyond Shape::max_rank", name);
        std::uint64_t count = 1;
        for (const auto d : e.shape) {
            if (d < 0) finding("negative extent", name);
            count *= static_cast<std::uint64_t>(d);  // cannot wrap: load refused overflowing shapes
        }
        if (count * elem != e.data.size()) finding("byte count differs from dtype and shape", name);
        total += e.data.size();
    }
    if (total > file_size) finding("tensors hold more bytes than the file", "");
}

// The self-test's planted defect: a heap copy of `v` and a read one element past its end (not
// for an empty `v`: ASan gives a 0-byte allocation one byte it does not poison).
bool self_test() {
    static const bool on = [] {
        const char* v = std::getenv("LOCKSTEP_FUZZ_SELF_TEST");
        return v != nullptr && std::strcmp(v, "1") == 0;
    }();
    return on;
}
void read_past_the_end(const std::vector<unsigned char>& v) {
    if (v.empty()) return;
    const std::unique_ptr<unsigned char[]> copy(new unsigned char[v.size()]);
    std::copy(v.begin(), v.end(), copy.get());
    std::fprintf(stderr, "fuzz_safetensors: self-test: reading byte %zu of a %zu-byte copy\n", v.size(), v.size());
    const volatile unsigned char* at = copy.get();
    const unsigned char sink = at[v.size()];  // out of bounds on purpose
    (void)sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    static ScratchFile file("lockstep-fuzz-safetensors");
    const std::string& path = file.write(data, size);
    try {
        const auto ck = lockstep::nn::Checkpoint::load(path);
        check_loaded(ck, size);
        if (self_test())
            for (const auto& name : ck.names()) read_past_the_end(ck.at(name).data);
    } catch (const lockstep::Error&) {
        // a refused file: the expected outcome
    }
    return 0;
}
