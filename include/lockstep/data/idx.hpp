// SPDX-License-Identifier: MIT
//! `lockstep::data::IdxSource`: MNIST-style IDX files (gzipped or not) read with every check a
//! corrupt file can fail, the images read from the file when they are needed. Link
//! lockstep::data (zlib).
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/shape.hpp"

namespace lockstep::data {

//! A data error: which file and what is wrong with it.
class DataError : public IoError {
public:
    using IoError::IoError;
};

//! What an IdxSource checks and keeps.
struct IdxOptions {
    //! > 0: keep the first `limit` samples.
    std::int64_t limit = 0;
    //! A gzipped images file is inflated once per machine into a copy its processes share
    //! (detail::shared_copy); false: into an anonymous file of this object's own.
    bool share_inflated = true;
    //! > 0: the images must be this many rows and columns (a network's input size).
    std::int64_t rows = 0, cols = 0;
    //! > 0: every label must be a class below it.
    std::int64_t classes = 0;
};

namespace detail {

inline std::uint32_t be32(const std::uint8_t* d) {
    return (std::uint32_t{d[0]} << 24) | (std::uint32_t{d[1]} << 16) | (std::uint32_t{d[2]} << 8) | d[3];
}

// An open file descriptor, closed with the object.
struct Fd {
    int fd = -1;
    Fd() = default;
    explicit Fd(int f) : fd(f) {}
    Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
    Fd& operator=(Fd&& o) noexcept {
        if (this != &o) {
            if (fd >= 0) ::close(fd);
            fd = std::exchange(o.fd, -1);
        }
        return *this;
    }
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

inline std::string errno_text() { return std::strerror(errno); }

// Exactly `n` bytes at `offset` of `fd`, or a DataError naming `path`.
inline void read_at(int fd, const std::string& path, std::uint8_t* out, std::size_t n, std::int64_t offset) {
    while (n > 0) {
        const ssize_t got = ::pread(fd, out, n, static_cast<off_t>(offset));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
            throw DataError(path + ": reading " + std::to_string(n) + " bytes at offset " + std::to_string(offset) + " failed (" +
                            (got < 0 ? errno_text() : std::string("the file is shorter than it was")) + ")");
        out += got;
        n -= static_cast<std::size_t>(got);
        offset += got;
    }
}

// Reads gzip file `f` (opened for `path`; zlib reads a plain file unchanged) in 64 KiB chunks,
// passing each to `sink(bytes, n)`, and closes it; refuses corrupt data and files over 2 GiB.
// Returns the size read.
template <class Sink>
std::int64_t inflate_chunks(const std::string& path, gzFile f, Sink&& sink) {
    if (f == nullptr) throw DataError(path + ": cannot open (missing file or directory?)");
    std::int64_t size = 0;
    std::vector<std::uint8_t> buf(std::size_t{1} << 16);
    try {
        for (;;) {
            const int n = gzread(f, buf.data(), static_cast<unsigned>(buf.size()));
            if (n < 0) {
                int err = 0;
                throw DataError(path + ": corrupt compressed data (" + std::string(gzerror(f, &err)) + ")");
            }
            if (n == 0) break;
            sink(buf.data(), static_cast<std::size_t>(n));
            size += n;
            if (size > (std::int64_t{1} << 31)) throw DataError(path + ": larger than 2 GiB; not an MNIST-style IDX file");
        }
    } catch (...) {
        gzclose(f);
        throw;
    }
    gzclose(f);
    return size;
}

// Whole content of a file, inflated if it is gzip: for the labels file, one byte per sample.
inline std::vector<std::uint8_t> read_all(const std::string& path) {
    std::vector<std::uint8_t> data;
    inflate_chunks(path, gzopen(path.c_str(), "rb"),
                   [&](const std::uint8_t* bytes, std::size_t n) { data.insert(data.end(), bytes, bytes + n); });
    return data;
}

// Inflates the gzip file `path` (open as `in`) into `out` from offset 0; returns the inflated size.
inline std::int64_t inflate_into(const std::string& path, int in, int out) {
    const int zfd = ::dup(in);
    gzFile f = zfd < 0 ? nullptr : gzdopen(zfd, "rb");
    if (f == nullptr) {
        if (zfd >= 0) ::close(zfd);
        throw DataError(path + ": cannot open it as gzip");
    }
    std::int64_t at = 0;
    return inflate_chunks(path, f, [&](const std::uint8_t* bytes, std::size_t n) {
        for (std::size_t done = 0; done < n;) {
            const ssize_t w = ::pwrite(out, bytes + done, n - done, static_cast<off_t>(at));
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0)
                throw DataError(path + ": writing its inflated copy to a temporary file failed (" + errno_text() +
                                "); free space in TMPDIR, or gunzip the data files");
            done += static_cast<std::size_t>(w);
            at += w;
        }
    });
}

inline std::string temp_dir() {
    const char* env = std::getenv("TMPDIR");
    return env != nullptr && *env != '\0' ? env : "/tmp";
}

using Opened = std::pair<Fd, std::int64_t>;  // a descriptor and the uncompressed size

// The inflated copy of gzip file `path` (open as `fd`) that this user's processes on this machine
// share: TMPDIR/lockstep-<uid>/idx-<key>.raw, in a directory of the user's own (mode 0700; one
// that is not, or is not a directory, means no sharing), the key a hash of the file's device,
// inode, size, modification time and gzip trailer (CRC-32 and length of the content). A copy is
// used only if it is a regular file of this user's, not writable by others, whose size agrees
// with the trailer. The first process to want it makes it under an exclusive lock (flock on a
// .lock file beside it, polled for at most 2 minutes, less than a process group's timeout),
// inflating into a temporary name, syncing it and renaming it into place, so no reader sees a
// partial copy; the others open it. Empty when the shared copy cannot be had: the caller then
// inflates a copy of its own.
inline std::optional<Opened> shared_copy(const std::string& path, int fd, bool& inflated) {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 18) return std::nullopt;
    std::uint8_t trailer[8] = {};
    if (::pread(fd, trailer, 8, st.st_size - 8) != 8) return std::nullopt;
    const std::uint32_t length = std::uint32_t{trailer[4]} | (std::uint32_t{trailer[5]} << 8) |
                                 (std::uint32_t{trailer[6]} << 16) | (std::uint32_t{trailer[7]} << 24);
    const uid_t me = ::getuid();
    const std::string dir = temp_dir() + "/lockstep-" + std::to_string(me);
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return std::nullopt;
    struct stat ds {};
    if (::lstat(dir.c_str(), &ds) != 0 || !S_ISDIR(ds.st_mode) || ds.st_uid != me || (ds.st_mode & 077) != 0) return std::nullopt;
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a
    const auto mix = [&](const void* p, std::size_t n) {
        for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const std::uint8_t*>(p)[i]) * 1099511628211ull;
    };
    mix(&st.st_dev, sizeof st.st_dev);
    mix(&st.st_ino, sizeof st.st_ino);
    mix(&st.st_size, sizeof st.st_size);
    mix(&st.st_mtim.tv_sec, sizeof st.st_mtim.tv_sec);
    mix(&st.st_mtim.tv_nsec, sizeof st.st_mtim.tv_nsec);
    mix(trailer, sizeof trailer);
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    const std::string name = dir + "/idx-" + hex + ".raw";
    const auto open_made = [&]() -> std::optional<Opened> {
        Fd made(::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
        struct stat ms {};
        if (made.fd < 0 || ::fstat(made.fd, &ms) != 0) return std::nullopt;
        if (!S_ISREG(ms.st_mode) || ms.st_uid != me || (ms.st_mode & 022) != 0 ||
            static_cast<std::uint32_t>(ms.st_size) != length)
            return std::nullopt;
        return Opened{std::move(made), static_cast<std::int64_t>(ms.st_size)};
    };
    if (auto made = open_made()) return made;
    Fd lock(::open((name + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (lock.fd < 0) return std::nullopt;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
    while (::flock(lock.fd, LOCK_EX | LOCK_NB) != 0) {
        if ((errno != EWOULDBLOCK && errno != EINTR) || std::chrono::steady_clock::now() > deadline) return std::nullopt;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (auto made = open_made()) return made;  // made while this process waited
    std::string part = name + ".XXXXXX";
    Fd out(::mkstemp(part.data()));
    if (out.fd < 0) return std::nullopt;
    std::int64_t size = 0;
    try {
        size = inflate_into(path, fd, out.fd);
        inflated = true;
    } catch (...) {
        ::unlink(part.c_str());
        throw;
    }
    // Whole on disk before it has its name; replaces a copy that was refused above.
    if (::fchmod(out.fd, 0600) != 0 || ::fsync(out.fd) != 0 || ::rename(part.c_str(), name.c_str()) != 0)
        ::unlink(part.c_str());           // this process's copy still serves it
    return Opened{std::move(out), size};  // the lock is released as `lock` closes
}

// The images file uncompressed, for reads at any offset: the file itself when it is plain, else
// an inflated copy, written in chunks (never the whole file in memory): the one the machine's
// processes share (`share`), or failing that an anonymous temporary file of this process's own.
// `inflated` says whether this call inflated the file (not when it found the shared copy made).
inline Opened open_uncompressed(const std::string& path, bool share, bool& inflated) {
    Fd plain(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (plain.fd < 0) throw DataError(path + ": cannot open (" + errno_text() + "; missing file or directory?)");
    std::uint8_t magic[2] = {0, 0};
    const ssize_t got = ::pread(plain.fd, magic, 2, 0);
    if (got != 2 || magic[0] != 0x1f || magic[1] != 0x8b) {
        struct stat st {};
        if (::fstat(plain.fd, &st) != 0) throw DataError(path + ": cannot stat (" + errno_text() + ")");
        if (!S_ISREG(st.st_mode)) throw DataError(path + ": not a regular file");
        return {std::move(plain), static_cast<std::int64_t>(st.st_size)};
    }
    if (share)
        if (auto copy = shared_copy(path, plain.fd, inflated)) return std::move(*copy);
    const std::string dir = temp_dir();
    std::string name = dir + "/lockstep-idx-XXXXXX";
    Fd out(::mkstemp(name.data()));
    if (out.fd < 0)
        throw DataError(path + ": cannot make a temporary file in " + dir + " to inflate it into (" + errno_text() +
                        "); set TMPDIR to a writable directory, or gunzip the data files");
    ::unlink(name.c_str());  // anonymous from now on: gone when closed, whatever happens
    const std::int64_t size = inflate_into(path, plain.fd, out.fd);
    inflated = true;
    return {std::move(out), size};
}

}  // namespace detail

//! An MNIST-style data set (an IDX images file of unsigned bytes, magic 0x803, and its labels
//! file, magic 0x801; gzipped or not) opened for reading the images of given samples when they
//! are needed: each process of a multi-process run reads only the rows it trains on. Opening
//! checks every header field against the files' sizes and every label; the labels (one byte per
//! sample) stay in memory, the images in the file (a gzipped one is first inflated into a copy
//! the machine's processes share). Reads may come from several threads.
class IdxSource {
public:
    //! `limit` > 0 keeps the first `limit` samples. `share_inflated`: a gzipped images file is
    //! inflated once per machine into a copy its processes share (detail::shared_copy), else
    //! into an anonymous file of this object's own.
    IdxSource(const std::string& images_path, const std::string& labels_path, IdxOptions options = {}) : path_(images_path) {
        const std::int64_t limit = options.limit;
        auto [fd, size] = detail::open_uncompressed(images_path, options.share_inflated, inflated_);
        fd_ = std::move(fd);
        const auto lab = detail::read_all(labels_path);
        std::uint8_t header[16] = {};
        if (size >= 16) detail::read_at(fd_.fd, images_path, header, 16, 0);
        if (size < 16 || detail::be32(header) != 0x803)
            throw DataError(images_path + ": bad magic (not an IDX image file of unsigned bytes, 0x00000803)");
        if (lab.size() < 8 || detail::be32(lab.data()) != 0x801)
            throw DataError(labels_path + ": bad magic (not an IDX label file of unsigned bytes, 0x00000801)");
        count_ = detail::be32(header + 4);
        rows_ = detail::be32(header + 8);
        cols_ = detail::be32(header + 12);
        std::int64_t pixels = 0;  // the header's three 32-bit sizes can overflow 64 bits together
        if (__builtin_mul_overflow(count_, rows_, &pixels) || __builtin_mul_overflow(pixels, cols_, &pixels))
            throw DataError(images_path + ": header says " + std::to_string(count_) + " images of " + std::to_string(rows_) +
                            "x" + std::to_string(cols_) + ", more than any file holds");
        if (rows_ == 0 || cols_ == 0 || size - 16 != pixels)
            throw DataError(images_path + ": header says " + std::to_string(count_) + " images of " + std::to_string(rows_) +
                            "x" + std::to_string(cols_) + " but the file holds " + std::to_string(size - 16) +
                            " pixel bytes (truncated or corrupt)");
        const std::int64_t nlabels = detail::be32(lab.data() + 4);
        if (static_cast<std::int64_t>(lab.size()) - 8 != nlabels)
            throw DataError(labels_path + ": header says " + std::to_string(nlabels) + " labels but the file holds " +
                            std::to_string(lab.size() - 8) + " (truncated or corrupt)");
        if (nlabels != count_)
            throw DataError(labels_path + ": " + std::to_string(nlabels) + " labels for " + std::to_string(count_) +
                            " images in " + images_path);
        if ((options.rows > 0 && rows_ != options.rows) || (options.cols > 0 && cols_ != options.cols))
            throw DataError(images_path + ": images are " + std::to_string(rows_) + "x" + std::to_string(cols_) +
                            "; this network takes " + std::to_string(options.rows) + "x" + std::to_string(options.cols));
        if (limit > 0 && limit < count_) count_ = limit;
        labels_.assign(lab.begin() + 8, lab.begin() + 8 + count_);
        if (options.classes > 0)
            for (std::int64_t i = 0; i < count_; ++i)
                if (labels_[static_cast<std::size_t>(i)] >= options.classes)
                    throw DataError(labels_path + ": label " + std::to_string(labels_[static_cast<std::size_t>(i)]) +
                                    " of sample " + std::to_string(i) + " is not a class 0-" +
                                    std::to_string(options.classes - 1));
    }

    //! Samples, and each image's height and width.
    std::int64_t count() const noexcept { return count_; }
    std::int64_t rows() const noexcept { return rows_; }
    std::int64_t cols() const noexcept { return cols_; }
    std::int64_t image_bytes() const noexcept { return rows_ * cols_; }

    //! Sample `i`'s label, 0-9.
    std::int64_t label(std::int64_t i) const { return labels_.at(static_cast<std::size_t>(i)); }

    //! Reads the images of samples [first, first + n) into `out` (n x rows x cols bytes), from the file.
    void read_images(std::int64_t first, std::int64_t n, std::uint8_t* out) const {
        if (first < 0 || n < 0 || first + n > count_)
            throw std::out_of_range("images [" + std::to_string(first) + ", " + std::to_string(first + n) +
                                    ") of a data set of " + std::to_string(count_));
        detail::read_at(fd_.fd, path_, out, static_cast<std::size_t>(n * image_bytes()), 16 + first * image_bytes());
        read_ += n;
    }

    //! The dataset protocol of data::BatchLoader: samples, one sample's shape (1, rows, cols),
    //! and sample i's pixels scaled to [0, 1] into `out`.
    std::int64_t size() const noexcept { return count_; }
    Shape sample_shape() const { return Shape{1, rows_, cols_}; }
    void read(std::int64_t i, std::span<float> out) const {
        if (static_cast<std::int64_t>(out.size()) != image_bytes())
            throw InvalidArgument("IdxSource::read: room for " + std::to_string(out.size()) + " values, an image has " +
                                  std::to_string(image_bytes()));
        std::vector<std::uint8_t> px(static_cast<std::size_t>(image_bytes()));
        read_images(i, 1, px.data());
        for (std::size_t k = 0; k < px.size(); ++k) out[k] = static_cast<float>(px[k]) / 255.0f;
    }

    //! Whether opening inflated the gzipped images file here (not when a shared copy was there).
    bool inflated() const noexcept { return inflated_; }

    //! Images read from the file so far.
    std::int64_t images_read() const noexcept { return read_.load(std::memory_order_relaxed); }

private:
    std::string path_;
    detail::Fd fd_;
    std::int64_t count_ = 0, rows_ = 0, cols_ = 0;
    std::vector<std::uint8_t> labels_;
    mutable std::atomic<std::int64_t> read_{0};
    bool inflated_ = false;
};

}  // namespace lockstep::data
