// SPDX-License-Identifier: MIT
//! Checkpoints in the safetensors format, with PyTorch `state_dict` names, written atomically.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <climits>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/nn/module.hpp"

namespace lockstep::nn {

static_assert(std::endian::native == std::endian::little,
              "lockstep checkpoints store little-endian data; add byte swapping for big-endian hosts");

// Note [atomic checkpoint]
// A checkpoint is written to a temporary file in the destination's directory, flushed to disk,
// and renamed over the destination; the directory is then flushed too. A crash at any point
// leaves either the previous file or the complete new one, never a torn file.
//
// Note [checkpoint path]
// A save replaces only a regular file: a path that exists and is anything else (a device node, a
// FIFO, a directory, a socket) is refused, since renaming over it would destroy it. A symlink is
// written through: the checkpoint replaces the file the link points to (resolved to its final
// target, which must be a regular file or not exist yet), and the link stays. A save that was
// killed leaves its temporary file (`<name>.tmp-XXXXXX`, full size); the next save of the same
// checkpoint removes such files and reports them, so two processes must not save to one path at
// the same time.

namespace detail {

//! Where a save may be interrupted, for tests of Note [atomic checkpoint]: in a program built with
//! LOCKSTEP_TEST_HOOKS defined (lockstep's own test builds), a save kills its process with
//! SIGKILL at the stage named by the environment variable LOCKSTEP_TEST_KILL_AT: `after-write`
//! (every byte written, not flushed), `after-fsync`, `before-rename` (closed), `after-rename`
//! (before the directory is flushed). Elsewhere it compiles to nothing.
inline void save_stage([[maybe_unused]] const char* stage) {
#if defined(LOCKSTEP_TEST_HOOKS)
    const char* at = std::getenv("LOCKSTEP_TEST_KILL_AT");
    if (at != nullptr && std::strcmp(at, stage) == 0) ::raise(SIGKILL);
#endif
}

}  // namespace detail

//! Named tensors and string metadata, as one safetensors file holds them.
class Checkpoint {
public:
    struct Entry {
        std::string dtype;  // "F32" or "I64"
        std::vector<std::int64_t> shape;
        std::vector<unsigned char> data;
    };

    std::map<std::string, std::string> metadata;

    //! Adds (or replaces) tensor `name` with a copy of `t`, which may live on any backend.
    template <BackendTag B>
    void put(const std::string& name, const Tensor<float, B>& t) {
        put_host(name, "F32", t.to_host());
    }
    template <BackendTag B>
    void put(const std::string& name, const Tensor<std::int64_t, B>& t) {
        put_host(name, "I64", t.to_host());
    }

    //! Adds (or replaces) tensor `name` from its host bytes: dtype "F32" or "I64", row-major
    //! `shape` (any rank), `bytes` exactly shape's product x the dtype's size (a library's own
    //! tensors, e.g. libtorch's in <lockstep/torch.hpp>).
    void put_bytes(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape,
                   std::span<const unsigned char> bytes) {
        LOCKSTEP_CHECK(!name.empty() && name != "__metadata__", "invalid checkpoint tensor name '", name, "'");
        LOCKSTEP_CHECK_AS(NotImplemented, dtype == "F32" || dtype == "I64", "checkpoint tensor '", name, "' of dtype ", dtype,
                          ": lockstep's checkpoints hold F32 and I64 tensors; convert it to float32 or int64");
        std::int64_t n = 1;
        for (const auto d : shape) {
            LOCKSTEP_CHECK(d >= 0, "checkpoint tensor '", name, "' has a negative extent ", d);
            n *= d;
        }
        LOCKSTEP_CHECK(static_cast<std::uint64_t>(n) * 4u * (dtype == "I64" ? 2u : 1u) == bytes.size(), "checkpoint tensor '",
                       name, "': ", bytes.size(), " bytes for ", n, " values of dtype ", dtype);
        Entry e;
        e.dtype = dtype;
        e.shape = std::move(shape);
        e.data.assign(bytes.begin(), bytes.end());
        entries_[name] = std::move(e);
    }

    //! Where this checkpoint was read from ("" when built in memory), for error messages.
    const std::string& source() const noexcept { return source_; }
    //! "checkpoint 'path'" or "the checkpoint", the way errors name it.
    std::string label() const { return source_.empty() ? std::string("the checkpoint") : "checkpoint '" + source_ + "'"; }

    bool contains(const std::string& name) const { return entries_.count(name) != 0; }
    std::vector<std::string> names() const {
        std::vector<std::string> n;
        for (const auto& [k, v] : entries_) n.push_back(k);
        return n;
    }
    const Entry& at(const std::string& name) const {
        auto it = entries_.find(name);
        if (it == entries_.end()) throw IoError(label() + " has no tensor named '" + name + "'");
        return it->second;
    }

    //! Throws `IoError` unless tensor `name` exists with the dtype and shape of `t`.
    template <class T, BackendTag B>
    void check_fits(const std::string& name, const Tensor<T, B>& t) const {
        const Entry& e = at(name);
        const char* want = std::is_same_v<T, float> ? "F32" : "I64";
        if (e.dtype != want)
            throw IoError(label() + " has tensor '" + name + "' of dtype " + e.dtype + " but the model's is " + want);
        if (shape_of(e) != t.shape())
            throw IoError(label() + " has tensor '" + name + "' of shape " + shape_of(e).str() + " but the model's is " +
                          t.shape().str());
    }

    //! Copies tensor `name` into `t` (any backend), which must have the checkpoint's dtype and shape.
    template <class T, BackendTag B>
    void get(const std::string& name, Tensor<T, B>& t) const {
        check_fits(name, t);
        copy_into(name, t);
    }

    //! `get` without the check, for a tensor `check_fits` has passed.
    template <class T, BackendTag B>
    void copy_into(const std::string& name, Tensor<T, B>& t) const {
        const Entry& e = at(name);
        const auto* values = reinterpret_cast<const T*>(e.data.data());  // seam: file bytes, aligned for any T
        t.copy_from(make_tensor<T>(t.shape(), std::span<const T>(values, static_cast<std::size_t>(t.numel())), t.format()));
    }

    //! What a save did besides writing the checkpoint.
    struct SaveReport {
        std::string written;                     //!< the file written: `path`, or a symlink's target
        std::vector<std::string> removed_stale;  //!< temporary files of earlier, killed saves of it
    };

    //! Writes the file atomically (see Note [atomic checkpoint] and Note [checkpoint path]).
    SaveReport save(const std::string& path) const {
        nlohmann::json header = nlohmann::json::object();
        std::uint64_t offset = 0;
        for (const auto& [name, e] : entries_) {
            header[name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.data.size()}}};
            offset += e.data.size();
        }
        if (!metadata.empty()) header["__metadata__"] = metadata;
        std::string text = header.dump();
        text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
        const std::uint64_t length = text.size();

        SaveReport report;
        report.written = target_of(path);
        const std::string& target = report.written;
        const std::string dir = directory_of(target);
        std::string tmp = target + ".tmp-XXXXXX";
        const int fd = ::mkstemp(tmp.data());
        if (fd < 0) throw IoError("cannot create a temporary file next to '" + target + "': " + std::strerror(errno));
        // mkstemp makes the file 0600; the checkpoint gets the mode any new file would (0666 less
        // the umask), as an ordinary open-and-write would have given it.
        (void)::fchmod(fd, 0666 & ~process_umask());
        const auto fail = [&](const std::string& what) {
            const std::string err = std::strerror(errno);
            ::close(fd);
            ::unlink(tmp.c_str());
            throw IoError("cannot write checkpoint '" + path + "': " + what + ": " + err);
        };
        if (!write_all(fd, &length, sizeof length) || !write_all(fd, text.data(), text.size())) fail("writing the header");
        for (const auto& [name, e] : entries_)
            if (!write_all(fd, e.data.data(), e.data.size())) fail("writing tensor '" + name + "'");
        detail::save_stage("after-write");
        if (::fsync(fd) != 0) fail("flushing to disk");
        detail::save_stage("after-fsync");
        if (::close(fd) != 0) {
            ::unlink(tmp.c_str());
            throw IoError("cannot write checkpoint '" + path + "': closing: " + std::strerror(errno));
        }
        detail::save_stage("before-rename");
        if (::rename(tmp.c_str(), target.c_str()) != 0) {
            const std::string err = std::strerror(errno);
            ::unlink(tmp.c_str());
            throw IoError("cannot write checkpoint '" + path + "': renaming into place: " + err);
        }
        detail::save_stage("after-rename");
        const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
        if (dfd >= 0) {
            (void)::fsync(dfd);
            ::close(dfd);
        }
        report.removed_stale = remove_stale_temporaries(target);
        return report;
    }

    //! Throws `IoError` unless a checkpoint can be written at `path` (Note [checkpoint path]):
    //! makes and removes a temporary file where the save would, so a run learns before it trains.
    static void check_writable(const std::string& path) {
        const std::string target = target_of(path);
        std::string tmp = target + ".tmp-XXXXXX";
        const int fd = ::mkstemp(tmp.data());
        if (fd < 0)
            throw IoError("cannot write a checkpoint at '" + path + "': creating a file in '" + directory_of(target) +
                          "' failed: " + std::strerror(errno));
        ::close(fd);
        ::unlink(tmp.c_str());
    }

    //! Reads and validates a safetensors file (float32 and int64 tensors).
    static Checkpoint load(const std::string& path) {
        std::ifstream in(path, std::ios::binary);
        if (!in) throw IoError("cannot open checkpoint '" + path + "': " + std::strerror(errno));
        in.seekg(0, std::ios::end);
        const auto file_size = static_cast<std::uint64_t>(in.tellg());
        in.seekg(0);
        const Invalid bad{path};
        std::uint64_t length = 0;
        if (file_size < 8 || !in.read(reinterpret_cast<char*>(&length), 8)) throw bad("shorter than the 8-byte header length");
        if (length > file_size - 8 || length > (std::uint64_t{100} << 20))
            throw bad("header length " + std::to_string(length) + " does not fit a file of " + std::to_string(file_size) +
                      " bytes (truncated?)");
        std::string text(length, '\0');
        if (!in.read(text.data(), static_cast<std::streamsize>(length))) throw bad("header truncated");
        const nlohmann::json header = parse_header(text, bad);
        const std::uint64_t data_size = file_size - 8 - length;
        Checkpoint ck;
        ck.source_ = path;
        std::vector<Span> spans;
        for (auto it = header.begin(); it != header.end(); ++it) {
            if (it.key() == "__metadata__") {
                if (!it->is_object()) throw bad("__metadata__ is not an object");
                for (auto m = it->begin(); m != it->end(); ++m) {
                    if (!m->is_string()) throw bad("metadata '" + m.key() + "' is not a string");
                    ck.metadata[m.key()] = m->get<std::string>();
                }
                continue;
            }
            const std::string& name = it.key();
            Entry e = parse_entry(name, *it, data_size, bad, spans);
            e.data.resize(spans.back().end - spans.back().begin);
            in.seekg(static_cast<std::streamoff>(8 + length + spans.back().begin));
            if (!e.data.empty() && !in.read(reinterpret_cast<char*>(e.data.data()), static_cast<std::streamsize>(e.data.size())))
                throw bad("tensor '" + name + "' data truncated");
            ck.entries_.emplace(name, std::move(e));
        }
        check_tiling(spans, data_size, bad);
        return ck;
    }

private:
    // The error of a file that is not a valid checkpoint.
    struct Invalid {
        const std::string& path;
        IoError operator()(const std::string& what) const { return IoError("'" + path + "' is not a valid checkpoint: " + what); }
    };

    // Where a tensor's bytes lie in the data area.
    struct Span {
        std::uint64_t begin, end;
        std::string name;
    };

    // The header as JSON: an object whose keys are unique at every level, nested at most 128 deep.
    static nlohmann::json parse_header(const std::string& text, const Invalid& bad) {
        nlohmann::json header;
        std::string duplicate;  // a name the header gives twice (the JSON parser would keep the last)
        // A header nests three levels (header, tensor, shape). Deeper nesting is refused, as the
        // reference reader's JSON parser (serde_json) refuses it, before anything recurses on it:
        // the parser here does not, but printing a value does (an extent nested 20000 arrays deep
        // overflowed the stack: tests/fuzz/corpus/safetensors/crashed-stack-overflow-*).
        constexpr std::size_t max_depth = 128;
        struct TooDeep {};
        try {
            std::vector<std::set<std::string>> keys_at_depth;
            header = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& value) {
                using E = nlohmann::json::parse_event_t;
                const auto d = static_cast<std::size_t>(depth);  // the containers around this event
                if ((event == E::object_start || event == E::array_start) && d >= max_depth) throw TooDeep{};
                if (event == E::object_start) {
                    if (keys_at_depth.size() <= d + 1) keys_at_depth.resize(d + 2);
                    keys_at_depth[d + 1].clear();
                } else if (event == E::key && duplicate.empty() && d < keys_at_depth.size() &&
                           !keys_at_depth[d].insert(value.get<std::string>()).second) {
                    duplicate = value.get<std::string>();
                }
                return true;
            });
        } catch (const TooDeep&) {
            throw bad("header nests JSON deeper than " + std::to_string(max_depth) + " levels");
        } catch (const std::exception& e) {
            throw bad(std::string("header is not JSON (") + e.what() + ")");
        }
        if (!duplicate.empty()) throw bad("the header names '" + duplicate + "' twice");
        if (!header.is_object()) throw bad("header is not a JSON object");
        return header;
    }

    // Tensor `name`'s header entry, checked against the data area of `data_size` bytes; its bytes'
    // place is appended to `spans`.
    static Entry parse_entry(const std::string& name, const nlohmann::json& value, std::uint64_t data_size, const Invalid& bad,
                             std::vector<Span>& spans) {
        const auto malformed = [&](const std::string& what) { return bad("tensor '" + name + "' " + what); };
        if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets"))
            throw malformed("needs dtype, shape and data_offsets");
        const auto& dtype = value.at("dtype");
        const auto& shape = value.at("shape");
        const auto& offsets = value.at("data_offsets");
        if (!dtype.is_string()) throw malformed("has a dtype that is not a string");
        Entry e;
        e.dtype = dtype.get<std::string>();
        std::uint64_t elem = 0;
        if (e.dtype == "F32")
            elem = 4;
        else if (e.dtype == "I64")
            elem = 8;
        else
            throw malformed("has dtype " + e.dtype + "; lockstep reads F32 and I64");
        if (!shape.is_array()) throw malformed("has a shape that is not an array");
        if (shape.size() > static_cast<std::size_t>(Shape::max_rank))
            throw malformed("has rank " + std::to_string(shape.size()) + ", beyond lockstep's " +
                            std::to_string(Shape::max_rank));
        std::uint64_t count = 1;
        for (const auto& d : shape) {
            if (!d.is_number_integer() || (d.is_number_unsigned() ? false : d.get<std::int64_t>() < 0))
                throw malformed("has an extent that is not a non-negative integer: " + excerpt(d));
            const auto extent = d.get<std::uint64_t>();
            if (extent > static_cast<std::uint64_t>(INT64_MAX) || __builtin_mul_overflow(count, extent, &count))
                throw malformed("has a shape whose element count does not fit 64 bits");
            e.shape.push_back(static_cast<std::int64_t>(extent));
        }
        std::uint64_t bytes = 0;
        if (__builtin_mul_overflow(count, elem, &bytes)) throw malformed("has a shape whose byte count does not fit 64 bits");
        if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
            throw malformed("needs data_offsets [begin, end] of two non-negative integers");
        const auto begin = offsets[0].get<std::uint64_t>(), end = offsets[1].get<std::uint64_t>();
        if (end < begin || end > data_size || end - begin != bytes)
            throw malformed("has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                            ") that do not match its shape or the " + std::to_string(data_size) + " data bytes (truncated?)");
        spans.push_back({begin, end, name});
        return e;
    }

    // As the safetensors format requires: the tensors' bytes tile the data area exactly, one
    // after another, with no gap, no overlap and nothing after the last.
    static void check_tiling(std::vector<Span>& spans, std::uint64_t data_size, const Invalid& bad) {
        std::sort(spans.begin(), spans.end(),
                  [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
        std::uint64_t at = 0;
        for (const auto& sp : spans) {
            if (sp.begin != at)
                throw bad("tensor '" + sp.name + "' starts at data byte " + std::to_string(sp.begin) + " where " +
                          std::to_string(at) + " was expected (tensors overlap or leave a gap)");
            at = sp.end;
        }
        if (at != data_size)
            throw bad(std::to_string(data_size - at) + " bytes after the last tensor (the data area is " +
                      std::to_string(data_size) + " bytes, the tensors cover " + std::to_string(at) + ")");
    }

    // A header value as an error message shows it: a scalar as written (its first 40 characters),
    // an array or object by its type.
    static std::string excerpt(const nlohmann::json& j) {
        if (j.is_structured()) return std::string("an ") + j.type_name();
        std::string s = j.dump();
        if (s.size() > 40) s = s.substr(0, 37) + "...";
        return s;
    }

    static Shape shape_of(const Entry& e) {
        Shape s;
        switch (e.shape.size()) {
            case 0: s = Shape{}; break;
            case 1: s = Shape{e.shape[0]}; break;
            case 2: s = Shape{e.shape[0], e.shape[1]}; break;
            case 3: s = Shape{e.shape[0], e.shape[1], e.shape[2]}; break;
            case 4: s = Shape{e.shape[0], e.shape[1], e.shape[2], e.shape[3]}; break;
            case 5: s = Shape{e.shape[0], e.shape[1], e.shape[2], e.shape[3], e.shape[4]}; break;
            default: throw IoError("checkpoint tensor of rank " + std::to_string(e.shape.size()) + " is beyond lockstep's 5");
        }
        return s;
    }

    template <class T>
    void put_host(const std::string& name, const char* dtype, const Tensor<T, Host>& t) {
        LOCKSTEP_CHECK(!name.empty() && name != "__metadata__", "invalid checkpoint tensor name '", name, "'");
        Entry e;
        e.dtype = dtype;
        for (int i = 0; i < t.rank(); ++i) e.shape.push_back(t.dim(i));
        const auto* bytes = reinterpret_cast<const unsigned char*>(t.data());  // seam: a host copy's bytes
        e.data.assign(bytes, bytes + t.bytes());
        entries_[name] = std::move(e);
    }

    // The process's file-creation mask, read without changing it where /proc says it (Linux 4.7+).
    static mode_t process_umask() {
        std::ifstream status("/proc/self/status");
        std::string line;
        while (std::getline(status, line))
            if (line.rfind("Umask:", 0) == 0) return static_cast<mode_t>(std::stoul(line.substr(6), nullptr, 8));
        static std::mutex mutex;  // umask() both reads and sets: keep two readers from racing
        std::lock_guard lock(mutex);
        const mode_t m = ::umask(0);
        ::umask(m);
        return m;
    }

    static bool write_all(int fd, const void* p, std::size_t n) {
        const auto* c = static_cast<const char*>(p);
        while (n > 0) {
            const ssize_t w = ::write(fd, c, n);
            if (w < 0) {
                if (errno == EINTR) continue;
                return false;
            }
            c += w;
            n -= static_cast<std::size_t>(w);
        }
        return true;
    }

    // The file a save of `path` writes (Note [checkpoint path]).
    static std::string target_of(const std::string& path) {
        namespace fs = std::filesystem;
        std::error_code ec;
        fs::path target = path;
        for (int hops = 0; fs::is_symlink(fs::symlink_status(target, ec)); ++hops) {  // to the final file
            if (hops == 40) throw IoError("cannot resolve the symlink '" + path + "': too many levels of links");
            const fs::path next = fs::read_symlink(target, ec);
            if (ec) throw IoError("cannot resolve the symlink '" + path + "': " + ec.message());
            target = (next.is_absolute() ? next : target.parent_path() / next).lexically_normal();
        }
        ec.clear();
        const auto st = fs::status(target, ec);
        if (!ec && fs::exists(st) && !fs::is_regular_file(st)) {
            const char* kind = fs::is_directory(st)                                 ? "a directory"
                               : fs::is_fifo(st)                                    ? "a FIFO"
                               : fs::is_socket(st)                                  ? "a socket"
                               : fs::is_character_file(st) || fs::is_block_file(st) ? "a device node"
                                                                                    : "not a regular file";
            throw IoError("'" + path + "' is " + kind + "; a checkpoint replaces only a regular file: choose another path");
        }
        return target.string();
    }

    // Removes the temporary files earlier saves of `target` left behind (killed mid-save).
    static std::vector<std::string> remove_stale_temporaries(const std::string& target) {
        namespace fs = std::filesystem;
        std::vector<std::string> removed;
        const fs::path t = target;
        const std::string stem = t.filename().string() + ".tmp-";
        std::error_code ec;
        for (fs::directory_iterator it(t.has_parent_path() ? t.parent_path() : fs::path("."), ec), end; !ec && it != end;
             it.increment(ec)) {
            const std::string name = it->path().filename().string();
            if (name.size() == stem.size() + 6 && name.rfind(stem, 0) == 0 && it->is_regular_file(ec)) {
                std::error_code rm;
                if (fs::remove(it->path(), rm)) removed.push_back(it->path().string());
            }
        }
        return removed;
    }

    static std::string directory_of(const std::string& path) {
        const auto slash = path.find_last_of('/');
        return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
    }

    std::map<std::string, Entry> entries_;
    std::string source_;
};

//! Adds every parameter value and buffer of `module`, PyTorch state_dict names under `prefix`.
template <class M>
void put_module(Checkpoint& ck, const M& module, std::string_view prefix = {}) {
    const auto put_parameter = [&](const std::string& name, const auto& p) { ck.put(name, p.value); };
    const auto put_buffer = [&](const std::string& name, const auto& t) { ck.put(name, t); };
    walk(module, put_parameter, put_buffer, prefix);
}

//! What `check_module_fits` and `get_module` make of a checkpoint's tensors the model does not have.
enum class Unmatched { refused, allowed };

//! Throws `IoError` naming the checkpoint and the tensor unless `ck` holds every parameter and
//! buffer of `module` with its dtype and shape, and (unless `unmatched` is allowed) nothing else
//! under `prefix` except names starting with `ignore` (e.g. "optimizer." state). Changes nothing.
template <class M>
void check_module_fits(const Checkpoint& ck, const M& module, std::string_view prefix = {},
                       Unmatched unmatched = Unmatched::refused, std::string_view ignore = {}) {
    std::map<std::string, bool> used;
    for (const auto& n : ck.names())
        if ((prefix.empty() || n.rfind(std::string(prefix) + ".", 0) == 0) && (ignore.empty() || n.rfind(ignore, 0) != 0))
            used[n] = false;
    const auto fits = [&](const std::string& name, const auto& t) {
        if (!ck.contains(name)) throw IoError(ck.label() + " is missing tensor '" + name + "' that the model has");
        ck.check_fits(name, t);
        used[name] = true;
    };
    const auto parameter_fits = [&](const std::string& name, const auto& p) { fits(name, p.value); };
    walk(module, parameter_fits, fits, prefix);
    if (unmatched == Unmatched::refused)
        for (const auto& [name, seen] : used)
            if (!seen) throw IoError(ck.label() + " has tensor '" + name + "' that the model does not have");
}

//! Copies every parameter and buffer of `module` from `ck`, which `check_module_fits` has passed.
template <class M>
void assign_module(const Checkpoint& ck, M& module, std::string_view prefix = {}) {
    const auto get_parameter = [&](const std::string& name, auto& p) { ck.copy_into(name, p.value); };
    const auto get_buffer = [&](const std::string& name, auto& t) { ck.copy_into(name, t); };
    walk(module, get_parameter, get_buffer, prefix);
}

//! Loads every parameter and buffer of `module` from `ck` after `check_module_fits` passed, so a
//! checkpoint that does not fit leaves the module unchanged.
template <class M>
void get_module(const Checkpoint& ck, M& module, std::string_view prefix = {}, Unmatched unmatched = Unmatched::refused,
                std::string_view ignore = {}) {
    check_module_fits(ck, module, prefix, unmatched, ignore);
    assign_module(ck, module, prefix);
}

namespace detail {

// Whether optimizer O counts steps per parameter (Note [optimizer protocol]: visit_counters).
template <class O, class M>
concept has_counters = requires(O& o, M& m, void (*f)(const std::string&, std::int64_t&)) {
    o.visit_counters(0, m, f);
};

}  // namespace detail

//! The step count saved as `key` (a float32 scalar, PyTorch's "step"), 0 where `ck` has none;
//! IoError unless it is a whole number >= 0.
inline std::int64_t get_counter(const Checkpoint& ck, const std::string& key) {
    if (!ck.contains(key)) return 0;
    Tensor<float, Host> scalar(Shape{});
    ck.get(key, scalar);
    const float v = scalar[0];
    if (!(v >= 0.0f) || v != static_cast<float>(static_cast<std::int64_t>(v)))
        throw IoError(ck.label() + " holds step count '" + key + "' = " + std::to_string(v) + ", not a whole number >= 0");
    return static_cast<std::int64_t>(v);
}

//! Adds replica `rank`'s optimizer state for `module` under `prefix` ("optimizer.<parameter>.momentum_buffer").
template <class O, class M>
void put_optimizer(Checkpoint& ck, O& optimizer, const M& module, int rank = 0, std::string_view prefix = "optimizer") {
    optimizer.visit_state(rank, module, [&](const std::string& name, const auto& state, const auto&) {
        if (state.numel() > 0) ck.put(std::string(prefix) + "." + name, state);
    });
    if constexpr (detail::has_counters<O, M>)
        optimizer.visit_counters(rank, module, [&](const std::string& name, const std::int64_t& count) {
            if (count == 0) return;  // PyTorch has no state before a parameter's first step
            Tensor<float, Host> scalar(Shape{});
            scalar[0] = static_cast<float>(count);  // PyTorch's float32 "step"
            ck.put(std::string(prefix) + "." + name, scalar);
        });
}

//! Sets replica `rank`'s optimizer state for `module` from `ck`: a state the checkpoint has is
//! loaded on its parameter's device, one it lacks is reset (not created yet, as before a first step).
template <class O, class M>
void get_optimizer(const Checkpoint& ck, O& optimizer, const M& module, int rank = 0, std::string_view prefix = "optimizer") {
    optimizer.visit_state(rank, module, [&](const std::string& name, auto& state, const auto& p) {
        using S = std::remove_reference_t<decltype(state)>;
        const std::string key = std::string(prefix) + "." + name;
        if (!ck.contains(key)) {
            state = S();
            return;
        }
        S loaded(p.value.shape(), MemoryFormat::nchw, p.value.device(), uninitialized);
        ck.get(key, loaded);
        state = std::move(loaded);
    });
    if constexpr (detail::has_counters<O, M>)
        optimizer.visit_counters(rank, module, [&](const std::string& name, std::int64_t& count) {
            count = get_counter(ck, std::string(prefix) + "." + name);
        });
}

//! Saves `module`'s state_dict to `path` atomically.
template <class M>
Checkpoint::SaveReport save(const std::string& path, const M& module) {
    Checkpoint ck;
    put_module(ck, module);
    return ck.save(path);
}

//! Loads `module`'s state_dict from `path`, checking every name, dtype and shape first.
template <class M>
void load(const std::string& path, M& module) {
    get_module(Checkpoint::load(path), module);
}

}  // namespace lockstep::nn
