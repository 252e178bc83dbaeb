// SPDX-License-Identifier: MIT
//! libFuzzer target for the MNIST example's IDX reader, `lockstep::data::IdxSource` (include/lockstep/data/idx.hpp),
//! on plain and gzipped files: opening them, then reading every image.
//!
//! An input is an images file and a labels file with a small frame around them:
//!   byte 0      flags: bit 0 gzips the images part and bit 1 the labels part before they are
//!               written (so mutations reach the IDX checks behind a valid gzip stream); bits 2-3
//!               pick the reader's `limit`: 0, 1, 2 or -1
//!   bytes 1-2   length of the images part, little-endian (cut to what the input holds)
//!   then        the images part, and the labels part (the rest of the input)
//! A part that is not gzipped by the flags is written as it is: the reader inflates whatever starts
//! with the gzip magic (zlib's transparent read), so raw parts also reach corrupt gzip streams.
//! Each part goes to a per-process scratch file (an in-memory memfd, opened again through
//! /proc/self/fd). `lockstep::data::DataError` is the expected outcome for bad files; a data set that loads
//! must be self-consistent. Anything else (a sanitizer report, a crash, another exception, a
//! broken invariant) is a finding.
//!
//! LOCKSTEP_FUZZ_SELF_TEST=1 in the environment plants a heap read one byte past a copy of every
//! data set that loads, so that the test fuzz_idx_self_test can check that such a read fails the
//! replay (the sanitizers are in, the corpus reaches a successful load, the exit code says so).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <lockstep/data/idx.hpp>

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

// `data` as one gzip member (what `gzip` writes), made with zlib.
std::vector<std::uint8_t> gzip(const std::uint8_t* data, std::size_t size) {
    z_stream s{};
    if (deflateInit2(&s, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) std::abort();
    std::vector<std::uint8_t> out(deflateBound(&s, static_cast<uLong>(size)));
    s.next_in = const_cast<Bytef*>(data);  // zlib's API is not const; it does not write the input
    s.avail_in = static_cast<uInt>(size);
    s.next_out = out.data();
    s.avail_out = static_cast<uInt>(out.size());
    if (deflate(&s, Z_FINISH) != Z_STREAM_END) std::abort();
    out.resize(s.total_out);
    deflateEnd(&s);
    return out;
}

[[noreturn]] void finding(const char* what) {
    std::fprintf(stderr, "fuzz_idx: a loaded data set breaks an invariant: %s\n", what);
    std::abort();
}

// What `IdxSource` promises about a data set it opens: every image can be read, in one read or one
// by one with the same bytes, and every label is a class. Returns the images.
std::vector<std::uint8_t> check_opened(const lockstep::data::IdxSource& ds, std::int64_t limit) {
    if (ds.rows() != 28 || ds.cols() != 28 || ds.image_bytes() != 28 * 28) finding("images are not 28x28");
    if (ds.count() < 0 || (limit > 0 && ds.count() > limit)) finding("count is negative or beyond the limit");
    std::vector<std::uint8_t> all(static_cast<std::size_t>(ds.count() * ds.image_bytes()));
    ds.read_images(0, ds.count(), all.data());
    std::vector<std::uint8_t> one(static_cast<std::size_t>(ds.image_bytes()));
    for (std::int64_t i = 0; i < ds.count(); ++i) {
        ds.read_images(i, 1, one.data());
        if (!std::equal(one.begin(), one.end(), all.begin() + i * ds.image_bytes())) finding("an image read alone differs");
        if (ds.label(i) < 0 || ds.label(i) > 9) finding("a label outside 0-9");
    }
    try {
        ds.read_images(ds.count(), 1, one.data());
        finding("an image past the end was read");
    } catch (const std::out_of_range&) {
    }
    return all;
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
template <class T>
void read_past_the_end(const std::vector<T>& v) {
    if (v.empty()) return;
    const std::unique_ptr<T[]> copy(new T[v.size()]);
    std::copy(v.begin(), v.end(), copy.get());
    std::fprintf(stderr, "fuzz_idx: self-test: reading element %zu of a %zu-element copy\n", v.size(), v.size());
    const volatile T* at = copy.get();
    const T sink = at[v.size()];  // out of bounds on purpose
    (void)sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size < 3) return 0;
    static ScratchFile images("lockstep-fuzz-idx-images"), labels("lockstep-fuzz-idx-labels");
    const unsigned flags = data[0];
    static constexpr std::int64_t limits[] = {0, 1, 2, -1};
    const std::int64_t limit = limits[(flags >> 2) & 3];
    std::size_t images_size = data[1] | (std::size_t{data[2]} << 8);
    data += 3;
    size -= 3;
    if (images_size > size) images_size = size;
    const auto write = [](ScratchFile& file, bool compress, const std::uint8_t* part, std::size_t n) {
        if (!compress) return file.write(part, n);
        const auto z = gzip(part, n);
        return file.write(z.data(), z.size());
    };
    const std::string images_path = write(images, (flags & 1) != 0, data, images_size);
    const std::string labels_path = write(labels, (flags & 2) != 0, data + images_size, size - images_size);
    try {
        const lockstep::data::IdxSource ds(images_path, labels_path,
                                           {.limit = limit,
                                            .share_inflated = false,
                                            .rows = 28,
                                            .cols = 28,
                                            .classes = 10});  // no shared copies of fuzz inputs in TMPDIR
        const auto pixels = check_opened(ds, limit);
        if (self_test()) read_past_the_end(pixels);
    } catch (const lockstep::data::DataError&) {
        // a refused file: the expected outcome
    }
    return 0;
}
