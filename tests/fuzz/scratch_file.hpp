// SPDX-License-Identifier: MIT
//! The fuzz targets' scratch file: one per reader input, for the whole process, rewritten for
//! every input (the readers take paths). A memfd where the kernel has them, else a file under /tmp
//! named after the process, removed at exit.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace lockstep::fuzz {

class ScratchFile {
public:
    explicit ScratchFile(const char* name) : name_(name) {
        fd_ = ::memfd_create(name, 0);
        if (fd_ >= 0) {
            path_ = "/proc/self/fd/" + std::to_string(fd_);
        } else {  // no memfd: a file under /tmp named after this process
            path_ = "/tmp/" + name_ + "-" + std::to_string(::getpid());
            fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
            unlink_ = true;
        }
        if (fd_ < 0) {
            std::perror((name_ + ": cannot make a scratch file").c_str());
            std::abort();
        }
    }
    ScratchFile(const ScratchFile&) = delete;
    ScratchFile& operator=(const ScratchFile&) = delete;
    ~ScratchFile() {
        ::close(fd_);
        if (unlink_) ::unlink(path_.c_str());
    }
    //! The file now holds exactly `data`; returns its path.
    const std::string& write(const std::uint8_t* data, std::size_t size) {
        if (::ftruncate(fd_, 0) != 0 || (size > 0 && ::pwrite(fd_, data, size, 0) != static_cast<ssize_t>(size))) {
            std::perror((name_ + ": cannot write a scratch file").c_str());
            std::abort();
        }
        return path_;
    }

private:
    std::string name_;
    int fd_ = -1;
    bool unlink_ = false;
    std::string path_;
};

}  // namespace lockstep::fuzz
