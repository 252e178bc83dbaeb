// SPDX-License-Identifier: MIT
//! Reading MNIST-style IDX files (gzipped or not) with every check a corrupt file can fail.
#pragma once

#include <zlib.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mnist {

//! A data error: which file and what is wrong with it (the example prints it and exits 2).
struct DataError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

//! Images as bytes (n x rows x cols) and their labels.
struct Dataset {
    std::int64_t count = 0, rows = 0, cols = 0;
    std::vector<std::uint8_t> pixels;
    std::vector<std::int64_t> labels;
};

namespace detail {

// Whole content of a file, inflated if it is gzip (zlib reads plain files unchanged).
inline std::vector<std::uint8_t> read_all(const std::string& path) {
    gzFile f = gzopen(path.c_str(), "rb");
    if (f == nullptr) throw DataError(path + ": cannot open (missing file or directory?)");
    std::vector<std::uint8_t> data;
    std::uint8_t buf[1 << 16];
    for (;;) {
        const int n = gzread(f, buf, sizeof buf);
        if (n < 0) {
            int err = 0;
            const std::string msg = gzerror(f, &err);
            gzclose(f);
            throw DataError(path + ": corrupt compressed data (" + msg + ")");
        }
        if (n == 0) break;
        data.insert(data.end(), buf, buf + n);
        if (data.size() > (std::size_t{1} << 31)) {
            gzclose(f);
            throw DataError(path + ": larger than 2 GiB; not an MNIST-style file");
        }
    }
    gzclose(f);
    return data;
}

inline std::uint32_t be32(const std::vector<std::uint8_t>& d, std::size_t at) {
    return (std::uint32_t{d[at]} << 24) | (std::uint32_t{d[at + 1]} << 16) | (std::uint32_t{d[at + 2]} << 8) | d[at + 3];
}

}  // namespace detail

//! Reads an images file (magic 0x803) and a labels file (magic 0x801); `limit` > 0 keeps the
//! first `limit` samples.
inline Dataset load_idx(const std::string& images_path, const std::string& labels_path, std::int64_t limit = 0) {
    const auto img = detail::read_all(images_path);
    const auto lab = detail::read_all(labels_path);
    if (img.size() < 16 || detail::be32(img, 0) != 0x803)
        throw DataError(images_path + ": bad magic (not an IDX image file of unsigned bytes, 0x00000803)");
    if (lab.size() < 8 || detail::be32(lab, 0) != 0x801)
        throw DataError(labels_path + ": bad magic (not an IDX label file of unsigned bytes, 0x00000801)");
    Dataset ds;
    ds.count = detail::be32(img, 4);
    ds.rows = detail::be32(img, 8);
    ds.cols = detail::be32(img, 12);
    std::int64_t pixels = 0;  // the header's three 32-bit sizes can overflow 64 bits together
    if (__builtin_mul_overflow(ds.count, ds.rows, &pixels) || __builtin_mul_overflow(pixels, ds.cols, &pixels))
        throw DataError(images_path + ": header says " + std::to_string(ds.count) + " images of " + std::to_string(ds.rows) +
                        "x" + std::to_string(ds.cols) + ", more than any file holds");
    if (ds.rows == 0 || ds.cols == 0 || static_cast<std::int64_t>(img.size()) - 16 != pixels)
        throw DataError(images_path + ": header says " + std::to_string(ds.count) + " images of " + std::to_string(ds.rows) +
                        "x" + std::to_string(ds.cols) + " but the file holds " + std::to_string(img.size() - 16) +
                        " pixel bytes (truncated or corrupt)");
    const std::int64_t nlabels = detail::be32(lab, 4);
    if (static_cast<std::int64_t>(lab.size()) - 8 != nlabels)
        throw DataError(labels_path + ": header says " + std::to_string(nlabels) + " labels but the file holds " +
                        std::to_string(lab.size() - 8) + " (truncated or corrupt)");
    if (nlabels != ds.count)
        throw DataError(labels_path + ": " + std::to_string(nlabels) + " labels for " + std::to_string(ds.count) +
                        " images in " + images_path);
    if (ds.rows != 28 || ds.cols != 28)
        throw DataError(images_path + ": images are " + std::to_string(ds.rows) + "x" + std::to_string(ds.cols) +
                        "; this network takes 28x28");
    if (limit > 0 && limit < ds.count) ds.count = limit;
    ds.pixels.assign(img.begin() + 16, img.begin() + 16 + ds.count * ds.rows * ds.cols);
    ds.labels.resize(static_cast<std::size_t>(ds.count));
    for (std::int64_t i = 0; i < ds.count; ++i) {
        const int l = lab[8 + static_cast<std::size_t>(i)];
        if (l > 9) throw DataError(labels_path + ": label " + std::to_string(l) + " of sample " + std::to_string(i) + " is not a digit class 0-9");
        ds.labels[static_cast<std::size_t>(i)] = l;
    }
    return ds;
}

}  // namespace mnist
