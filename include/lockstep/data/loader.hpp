// SPDX-License-Identifier: MIT
//! `lockstep::data::BatchLoader`: batches of any indexable dataset, shuffled per epoch from a
//! seed, sharded across processes as torch.utils.data.DistributedSampler shards, the next batch
//! made on a background thread while the caller trains on this one.
#pragma once

#include <algorithm>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::data {

//! What BatchLoader needs of a dataset: its samples, one sample's shape, a sample's values and
//! its class. data::IdxSource is one.
template <class D>
concept Dataset = requires(const D& d, std::int64_t i, std::span<float> out) {
    { d.size() } -> std::convertible_to<std::int64_t>;
    { d.sample_shape() } -> std::same_as<Shape>;
    d.read(i, out);
    { d.label(i) } -> std::convertible_to<std::int64_t>;
};

struct LoaderOptions {
    //! Samples per batch of this process.
    std::int64_t batch_size = 64;
    //! A new order every epoch, drawn from (seed, epoch) alike in every process.
    bool shuffle = true;
    std::uint64_t seed = 0;
    //! Drop the last batch of an epoch when it is short (else it comes, smaller).
    bool drop_last = false;
    //! This process's part: `world` processes take disjoint strided parts of the epoch's order
    //! (rank, rank + world, ...), as DistributedSampler does; the order is padded by repeating
    //! its start so that every part has ceil(N / world) samples.
    int rank = 0;
    int world = 1;
    //! Make the next batch on a background thread while the caller uses this one.
    bool prefetch = true;
    //! Where batches are stored: given a size in bytes, a block the returned pointer keeps alive
    //! (the batch holds it). Called on the loader's worker thread, and the blocks are released on
    //! whichever thread drops a batch: it must be thread-safe. `lockstep::cuda::pinned_batch_memory()`
    //! gives page-locked memory, from which a copy to a GPU is one transfer; empty: ordinary host memory.
    std::function<std::shared_ptr<void>(std::size_t bytes)> memory = {};
};

//! One batch: samples (n, sample_shape...) on the host and their classes.
struct Batch {
    Tensor<float, Host> x;
    std::vector<std::int64_t> labels;
    std::int64_t epoch = 0;
    std::int64_t index = 0;  //!< the batch's place in its epoch
    //! The block `x` views when the loader was given `LoaderOptions::memory` (else null): `x` is
    //! valid while this batch (or a copy of this pointer) lives; moving `x` out of the batch and
    //! dropping the batch returns the block for reuse under it. Copy `x` to keep it.
    std::shared_ptr<void> memory;
};

//! The samples process `rank` of `world` visits in epoch `epoch`, in order: DistributedSampler's
//! rule (a permutation of [0, n) drawn from (seed, epoch) when shuffling, padded by its own start
//! to a multiple of `world`, then every world-th from `rank`).
inline std::vector<std::int64_t> epoch_indices(std::int64_t n, const LoaderOptions& o, std::int64_t epoch) {
    std::vector<std::int64_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    if (o.shuffle) {
        std::mt19937_64 gen(o.seed ^ (0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(epoch + 1)));
        std::shuffle(order.begin(), order.end(), gen);
    }
    const std::int64_t per = (n + o.world - 1) / o.world;
    for (std::int64_t k = 0; static_cast<std::int64_t>(order.size()) < per * o.world; ++k)
        order.push_back(order[static_cast<std::size_t>(k % n)]);
    std::vector<std::int64_t> mine;
    for (std::int64_t k = o.rank; k < per * o.world; k += o.world) mine.push_back(order[static_cast<std::size_t>(k)]);
    return mine;
}

//! Batches of `dataset` for one process (LoaderOptions). Iterate an epoch with
//!   loader.start_epoch(e); while (auto batch = loader.next()) { ... }
//! With `prefetch`, the batch after the one returned is made on the loader's thread meanwhile
//! (the dataset's read() is then called from that thread). A read that throws is rethrown by
//! the next() that would have returned its batch. The dataset must outlive the loader.
template <Dataset D>
class BatchLoader {
public:
    BatchLoader(const D& dataset, LoaderOptions options) : data_(&dataset), o_(options) {
        LOCKSTEP_CHECK(options.batch_size > 0, "BatchLoader: batch_size must be > 0, got ", options.batch_size);
        LOCKSTEP_CHECK(options.world > 0 && options.rank >= 0 && options.rank < options.world, "BatchLoader: rank ", options.rank,
                       " of ", options.world, " processes; give 0 <= rank < world");
        LOCKSTEP_CHECK(dataset.size() > 0, "BatchLoader: the dataset is empty");
        if (o_.prefetch) worker_ = std::thread([this] { work(); });
    }
    BatchLoader(const BatchLoader&) = delete;
    BatchLoader& operator=(const BatchLoader&) = delete;
    ~BatchLoader() {
        {
            std::lock_guard lock(mutex_);
            stop_ = true;
        }
        changed_.notify_all();
        if (worker_.joinable()) worker_.join();
    }

    //! Batches per epoch for this process.
    std::int64_t batches_per_epoch() const {
        const std::int64_t n = samples_per_epoch();
        return o_.drop_last ? n / o_.batch_size : (n + o_.batch_size - 1) / o_.batch_size;
    }
    //! Samples per epoch for this process (ceil(N / world)).
    std::int64_t samples_per_epoch() const { return (data_->size() + o_.world - 1) / o_.world; }

    //! Starts epoch `epoch` (its order drawn from the seed and the epoch), dropping what was
    //! prefetched of the one before.
    void start_epoch(std::int64_t epoch) {
        std::unique_lock lock(mutex_);
        ++generation_;
        order_ = epoch_indices(data_->size(), o_, epoch);
        epoch_ = epoch;
        next_index_ = 0;
        ready_.reset();
        failure_ = nullptr;
        requested_ = 0;
        started_ = true;
        if (o_.prefetch) request(lock);
    }

    //! The epoch's next batch, or nothing after its last.
    std::optional<Batch> next() {
        std::unique_lock lock(mutex_);
        LOCKSTEP_CHECK_AS(UsageError, started_, "BatchLoader::next before start_epoch(epoch)");
        if (next_index_ >= batches_per_epoch()) return std::nullopt;
        if (!o_.prefetch) {
            const std::int64_t index = next_index_++;
            const auto samples = samples_of(index);
            lock.unlock();
            return make(epoch_, index, samples);
        }
        changed_.wait(lock, [&] { return ready_.has_value() || failure_ != nullptr; });
        if (failure_ != nullptr) {
            auto f = failure_;
            failure_ = nullptr;
            ++next_index_;
            request(lock);
            std::rethrow_exception(f);
        }
        Batch b = std::move(*ready_);
        ready_.reset();
        ++next_index_;
        request(lock);
        return b;
    }

private:
    // Asks the worker for batch next_index_ (if the epoch has one): under the lock.
    void request(std::unique_lock<std::mutex>&) {
        requested_ = next_index_ < batches_per_epoch() ? next_index_ + 1 : 0;  // 0: nothing to make
        changed_.notify_all();
    }

    static Shape with_batch(std::int64_t n, const Shape& s) {
        switch (s.rank()) {
            case 0: return {n};
            case 1: return {n, s[0]};
            case 2: return {n, s[0], s[1]};
            case 3: return {n, s[0], s[1], s[2]};
            default: return {n, s[0], s[1], s[2], s[3]};
        }
    }

    // The samples of batch `index` of the current order (under the lock, or on the caller's
    // thread without prefetch).
    std::vector<std::int64_t> samples_of(std::int64_t index) const {
        const std::int64_t first = index * o_.batch_size;
        const std::int64_t n = std::min(o_.batch_size, static_cast<std::int64_t>(order_.size()) - first);
        return {order_.begin() + first, order_.begin() + first + n};
    }

    Batch make(std::int64_t epoch, std::int64_t index, const std::vector<std::int64_t>& samples) const {
        const Shape s = data_->sample_shape();
        LOCKSTEP_CHECK(s.rank() < Shape::max_rank, "BatchLoader: a sample of shape ", s,
                       " leaves no room for the batch dimension");
        const auto n = static_cast<std::int64_t>(samples.size());
        const std::int64_t per = s.numel();
        Batch b;
        if (o_.memory) {
            const auto bytes = static_cast<std::size_t>(n * per) * sizeof(float);
            b.memory = o_.memory(bytes);
            LOCKSTEP_CHECK_AS(UsageError, b.memory != nullptr, "BatchLoader: LoaderOptions::memory gave no block for ", bytes,
                              " bytes; return a block that holds them, or leave it empty for ordinary host memory");
            b.x = Tensor<float, Host>::view(static_cast<float*>(b.memory.get()), with_batch(n, s), Device::host());
        } else {
            b.x = Tensor<float, Host>(with_batch(n, s), MemoryFormat::nchw, Device::host(), uninitialized);
        }
        b.epoch = epoch;
        b.index = index;
        for (std::int64_t k = 0; k < n; ++k) {
            const std::int64_t i = samples[static_cast<std::size_t>(k)];
            data_->read(i, b.x.span().subspan(static_cast<std::size_t>(k * per), static_cast<std::size_t>(per)));
            b.labels.push_back(static_cast<std::int64_t>(data_->label(i)));
        }
        return b;
    }

    void work() {
        std::unique_lock lock(mutex_);
        for (;;) {
            changed_.wait(lock, [&] { return stop_ || requested_ != 0; });
            if (stop_) return;
            const std::int64_t index = requested_ - 1, epoch = epoch_;
            const std::uint64_t generation = generation_;
            const auto samples = samples_of(index);
            requested_ = 0;
            std::optional<Batch> made;
            std::exception_ptr failed;
            lock.unlock();
            try {
                made = make(epoch, index, samples);
            } catch (...) {
                failed = std::current_exception();
            }
            lock.lock();
            if (generation != generation_) continue;  // start_epoch came meanwhile: its batch is asked anew
            if (failed)
                failure_ = failed;
            else
                ready_ = std::move(made);
            changed_.notify_all();
        }
    }

    const D* data_;
    LoaderOptions o_;
    std::mutex mutex_;
    std::condition_variable changed_;
    std::vector<std::int64_t> order_;
    std::int64_t epoch_ = 0, next_index_ = 0;
    std::int64_t requested_ = 0;  // 1 + the batch the worker is to make; 0: none
    std::uint64_t generation_ = 0;
    std::optional<Batch> ready_;
    std::exception_ptr failure_;
    bool started_ = false, stop_ = false;
    std::thread worker_;
};

}  // namespace lockstep::data
