// SPDX-License-Identifier: MIT
//! The grid emulator's model of global memory within one launch (Note [the emulator's memory
//! model]): which block wrote each byte, whether the write was published before its block's
//! ticket, and whether a block that reads it acquired it. Host only; the device has no part in it.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

//! Whether emulated launches check their global memory (Note [the emulator's memory model]): on
//! by default; the sanitizer builds turn it off (tests/CMakeLists.txt), whose tests look for other
//! defects and would pay for the shadow in every launch.
#ifndef LOCKSTEP_EMULATOR_MEMORY_MODEL
#define LOCKSTEP_EMULATOR_MEMORY_MODEL 1
#endif

namespace lockstep::kernels::device::emulated {

// Note [the emulator's memory model]
// On a GPU the blocks of a launch run at once, and a store of one block reaches another block
// only through a release and an acquire: the writer's `fence()` (__threadfence) before its
// ticket (the atomic on the group's counter), and the reader's `fence()` after its own ticket.
// The emulator runs the blocks one after another, so every store would be seen at once; it
// records instead, per byte written in the launch, the write's block, thread, time and the
// first fence of its thread after it, and the per-block events the drivers report (fences,
// tickets, barriers: `Memory::sync`), and ends the process, as a GPU would corrupt the result:
// - when a `load_other_block` reads a byte no block wrote in this launch (a partial never
//   stored), or another block's byte whose store was not followed, in that writer's thread, by
//   a fence ordered before the writer's ticket (same thread: program order; another thread of
//   the block: a barrier between), or read without a fence of the reader's thread ordered after
//   the reader's own ticket;
// - when two blocks of one launch write one byte (a race whatever the schedule).
// Within a block, events of two threads are ordered only by a barrier between them (the
// epoch), so a barrier dropped from a driver is seen too (Note [one barrier placement]).
// Every global store of a kernel goes through `store` or `store_pack` (grid.cuh), which report
// it here. A thread's stores between two fences share one write record; the shadow holds, per
// 4-byte word written in the launch, its record (per byte where a narrower store split the word),
// in pages of the emulating thread that the next launch reuses.

//! An event's place: its thread, the block's barrier epoch and the launch's clock.
struct Stamp {
    int thread = -1;
    std::uint64_t epoch = 0;
    std::uint64_t time = 0;  // 0: never
    bool before(const Stamp& o) const { return thread == o.thread ? time < o.time : epoch < o.epoch; }
};

//! One launch's memory on the emulating thread.
class Memory {
public:
    //! Begins a launch of `blocks` blocks, `gx` along x; `fences`: whether its threads fence (a
    //! map kernel's do not, and its threads share their block's write record).
    void begin(int blocks, int gx, bool fences) {
        fences_ = fences;
        writes_.clear();
        tickets_.assign(static_cast<std::size_t>(blocks), Stamp{});
        gx_ = gx;
        for (auto& [key, page] : pages_) free_.push_back(std::move(page));
        pages_.clear();
        recent_.fill(Recent{});
    }
    //! Block `block` begins: its threads' unfenced stores and fences start empty.
    void enter_block(int block, int threads) {
        block_ = block;
        open_.assign(static_cast<std::size_t>(threads), 0);
        acquired_.assign(static_cast<std::size_t>(threads), Stamp{});
    }
    void set_thread(int t) { thread_ = t; }
    //! A barrier of the current block.
    void sync() { ++epoch_; }

    //! The current thread stores `bytes` bytes at `p`.
    void store(const void* p, std::size_t bytes) {
        // One record for a thread's stores between two fences.
        std::uint32_t& open = open_[fences_ ? static_cast<std::size_t>(thread_) : 0];
        if (open == 0) {
            writes_.push_back(Write{block_, Stamp{}});
            open = static_cast<std::uint32_t>(writes_.size());
        }
        const auto at = reinterpret_cast<std::uintptr_t>(p);
        for (std::size_t i = 0; i < bytes;) {
            Page& pg = *page(at + i, true);
            const std::size_t off = (at + i) % page_bytes, run = std::min(bytes - i, page_bytes - off);
            if (off % 4 == 0 && run % 4 == 0) {
                for (std::size_t w = off / 4; w < (off + run) / 4; ++w) {
                    if (pg.word[w] == mixed) {
                        for (std::size_t b = 4 * w; b < 4 * w + 4; ++b) claim(pg.byte[b], open, at - off + b);
                    } else {
                        claim(pg.word[w], open, at - off + 4 * w);
                    }
                }
            } else {
                for (std::size_t b = off; b < off + run; ++b) claim(pg.split(b / 4)[b % 4], open, at - off + b);
            }
            i += run;
        }
    }
    //! The current thread fences: its earlier stores are published (to be released by a ticket).
    void fence() {
        const Stamp f = now();
        std::uint32_t& open = open_[fences_ ? static_cast<std::size_t>(thread_) : 0];
        if (open != 0) writes_[open - 1].fenced = f;
        open = 0;
        acquired_[static_cast<std::size_t>(thread_)] = f;
    }
    //! The current thread takes its block's ticket.
    void ticket() { tickets_[static_cast<std::size_t>(block_)] = now(); }

    //! The current thread reads `bytes` bytes at `p` that another block may have written (load_other_block).
    void read_other(const void* p, std::size_t bytes) {
        const auto at = reinterpret_cast<std::uintptr_t>(p);
        for (std::size_t i = 0; i < bytes; ++i) {
            const Page* pg = page(at + i, false);
            const std::uint32_t s = pg == nullptr ? 0 : pg->at((at + i) % page_bytes);
            if (s == 0) fail(at + i, "reads a byte that no block wrote in this launch (a store missing?)", -1);
            const Write& w = writes_[s - 1];
            if (w.block == block_) continue;
            const Stamp& released = tickets_[static_cast<std::size_t>(w.block)];
            if (w.fenced.time == 0 || released.time == 0 || !w.fenced.before(released))
                fail(at + i, "reads another block's store that was not published: no fence after the store before that block's ticket",
                     w.block);
            const Stamp& mine = tickets_[static_cast<std::size_t>(block_)];
            const Stamp& acquired = acquired_[static_cast<std::size_t>(thread_)];
            if (mine.time == 0 || mine.time < released.time || acquired.time == 0 || !mine.before(acquired))
                fail(at + i, "reads another block's store without a fence after taking its own ticket", w.block);
        }
    }

private:
    static constexpr std::size_t page_bytes = 4096;
    static constexpr std::uint32_t mixed = 0xffffffffu;
    //! A page's shadow: per 4-byte word, the index + 1 of the write record that stored it (0:
    //! none), or `mixed` where a narrower store split the word into bytes, kept per byte.
    struct Page {
        std::uint32_t word[page_bytes / 4]{};
        std::unique_ptr<std::uint32_t[]> byte;  // page_bytes entries, valid where a word is mixed
        std::uint32_t at(std::size_t b) const { return word[b / 4] == mixed ? byte[b] : word[b / 4]; }
        //! Word w's bytes' entries, splitting the word if it is whole.
        std::uint32_t* split(std::size_t w) {
            if (!byte) byte = std::make_unique<std::uint32_t[]>(page_bytes);
            if (word[w] != mixed) {
                std::fill_n(&byte[4 * w], 4, word[w]);
                word[w] = mixed;
            }
            return &byte[4 * w];
        }
    };
    struct Write {
        int block = 0;
        Stamp fenced{};  // the first fence of the writing thread after the stores (time 0: none yet)
    };

    Stamp now() { return {thread_, epoch_, ++clock_}; }

    //! The shadow of the page holding `at` in this launch: made (empty) when `make`, else null if absent.
    Page* page(std::uintptr_t at, bool make) {
        const std::uintptr_t key = at / page_bytes;
        Recent& recent = recent_[key % recent_.size()];
        if (recent.page != nullptr && recent.key == key) return recent.page;
        auto it = pages_.find(key);
        if (it == pages_.end()) {
            if (!make) return nullptr;
            std::unique_ptr<Page> fresh;
            if (free_.empty()) {
                fresh = std::make_unique<Page>();
            } else {
                fresh = std::move(free_.back());
                free_.pop_back();
                std::memset(fresh->word, 0, sizeof(fresh->word));
            }
            it = pages_.emplace(key, std::move(fresh)).first;
        }
        recent = {key, it->second.get()};
        return recent.page;
    }

    //! Write record `open` stores the byte or word whose shadow entry is `entry`.
    void claim(std::uint32_t& entry, std::uint32_t open, std::uintptr_t at) {
        if (entry != 0 && entry != open && writes_[entry - 1].block != block_) second_writer(at, writes_[entry - 1].block);
        entry = open;
    }

    [[noreturn]] void second_writer(std::uintptr_t at, int other) const {
        std::fprintf(stderr,
                     "lockstep: blocks (%d, %d) and (%d, %d) of one emulated launch both write the byte at %p: on a GPU "
                     "they race\n",
                     other % gx_, other / gx_, block_ % gx_, block_ / gx_, reinterpret_cast<const void*>(at));
        std::abort();
    }
    [[noreturn]] void fail(std::uintptr_t at, const char* what, int writer) const {
        if (writer >= 0)
            std::fprintf(stderr, "lockstep: thread %d of block (%d, %d) of an emulated launch %s (block (%d, %d) wrote %p)\n",
                         thread_, block_ % gx_, block_ / gx_, what, writer % gx_, writer / gx_,
                         reinterpret_cast<const void*>(at));
        else
            std::fprintf(stderr, "lockstep: thread %d of block (%d, %d) of an emulated launch %s (%p)\n", thread_,
                         block_ % gx_, block_ / gx_, what, reinterpret_cast<const void*>(at));
        std::abort();
    }

    std::uint64_t clock_ = 0, epoch_ = 0;
    int gx_ = 1, block_ = 0, thread_ = 0;
    bool fences_ = true;
    std::vector<Write> writes_;                         // this launch's write records
    std::vector<Stamp> tickets_;                        // per block
    std::vector<std::uint32_t> open_;                   // per thread of the current block: its unfenced record + 1, or 0
    std::vector<Stamp> acquired_;                       // per thread of the current block: its last fence
    std::unordered_map<std::uintptr_t, std::unique_ptr<Page>> pages_;  // this launch's, by address / page_bytes
    std::vector<std::unique_ptr<Page>> free_;                            // the earlier launches', for reuse
    struct Recent {
        std::uintptr_t key = 0;
        Page* page = nullptr;
    };
    std::array<Recent, 256> recent_{};  // a direct-mapped cache of pages_
};

//! The memory of the launch this thread is emulating; null outside a launch.
inline thread_local Memory* active = nullptr;

//! This thread's memory model, kept between launches (its shadow pages and buffers).
inline Memory& thread_memory() {
    thread_local Memory memory;
    return memory;
}

//! Makes this thread's memory the active one for the launch in scope.
class Launch {
public:
    Launch(int blocks, int gx, bool fences) : memory_(thread_memory()) {
        memory_.begin(blocks, gx, fences);
        if constexpr (LOCKSTEP_EMULATOR_MEMORY_MODEL != 0) active = &memory_;
    }
    ~Launch() { active = nullptr; }
    Launch(const Launch&) = delete;
    Launch& operator=(const Launch&) = delete;
    Memory& memory() { return memory_; }

private:
    Memory& memory_;
};

}  // namespace lockstep::kernels::device::emulated
