// SPDX-License-Identifier: MIT
//! lockstep::data: DistributedSampler's sharding, the batch loader (shuffling, last batches,
//! prefetching, failures), and the IDX reader on real Fashion-MNIST files.
#include <catch2/catch.hpp>

#include <lockstep/data/idx.hpp>
#include <lockstep/data/loader.hpp>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_support.hpp"

using namespace lockstep;

namespace {

// Sample i is (i, 2i, 3i) with class i % 7; reading sample `poison` throws.
struct Counting {
    std::int64_t n = 23;
    std::int64_t poison = -1;
    mutable std::atomic<std::int64_t> reads{0};
    std::int64_t size() const { return n; }
    Shape sample_shape() const { return Shape{3}; }
    void read(std::int64_t i, std::span<float> out) const {
        ++reads;
        if (i == poison) throw std::runtime_error("sample " + std::to_string(i) + " is unreadable");
        for (std::size_t k = 0; k < out.size(); ++k) out[k] = static_cast<float>(i * static_cast<std::int64_t>(k + 1));
    }
    std::int64_t label(std::int64_t i) const { return i % 7; }
};
static_assert(data::Dataset<Counting> && data::Dataset<data::IdxSource>);

std::vector<data::Batch> epoch(data::BatchLoader<Counting>& loader, std::int64_t e) {
    loader.start_epoch(e);
    std::vector<data::Batch> out;
    while (auto b = loader.next()) out.push_back(std::move(*b));
    return out;
}

std::vector<std::int64_t> samples_of(const std::vector<data::Batch>& batches) {
    std::vector<std::int64_t> s;
    for (const auto& b : batches)
        for (std::int64_t k = 0; k < b.x.dim(0); ++k) s.push_back(static_cast<std::int64_t>(b.x[k * 3]));
    return s;
}

}  // namespace

TEST_CASE("Processes take disjoint parts of every epoch that together cover it, as DistributedSampler does", "[data]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    for (const std::int64_t n : {20, 23}) {
        for (const int world : {1, 2, 3, 4}) {
            CAPTURE(n, world);
            std::vector<std::int64_t> previous;
            for (std::int64_t e = 0; e < 3; ++e) {
                std::vector<std::int64_t> all;
                for (int rank = 0; rank < world; ++rank) {
                    const auto mine = data::epoch_indices(n, {.seed = seed, .rank = rank, .world = world}, e);
                    REQUIRE(static_cast<std::int64_t>(mine.size()) == (n + world - 1) / world);
                    all.insert(all.end(), mine.begin(), mine.end());
                }
                // Every sample once, and the padding (n not a multiple of world) repeats the first ones.
                std::set<std::int64_t> distinct(all.begin(), all.end());
                CHECK(static_cast<std::int64_t>(distinct.size()) == n);
                CHECK(static_cast<std::int64_t>(all.size()) - n == (world - n % world) % world);
                if (e > 0 && world == 1) CHECK(all != previous);  // a new order every epoch
                previous = all;
            }
        }
    }
    // Without shuffling, rank r takes r, r + world, ...
    CHECK(data::epoch_indices(7, {.shuffle = false, .rank = 1, .world = 3}, 0) == std::vector<std::int64_t>{1, 4, 0});
}

TEST_CASE("BatchLoader gives each sample's values and class in batches, the last kept or dropped", "[data]") {
    const auto seed = test::fresh_seed();
    CAPTURE(seed);
    Counting ds;
    for (const bool prefetch : {false, true}) {
        for (const bool drop_last : {false, true}) {
            CAPTURE(prefetch, drop_last);
            data::BatchLoader loader(ds, {.batch_size = 5, .seed = seed, .drop_last = drop_last, .prefetch = prefetch});
            CHECK(loader.batches_per_epoch() == (drop_last ? 4 : 5));
            const auto batches = epoch(loader, 0);
            REQUIRE(static_cast<std::int64_t>(batches.size()) == loader.batches_per_epoch());
            for (std::size_t b = 0; b < batches.size(); ++b) {
                const auto& batch = batches[b];
                CHECK(batch.index == static_cast<std::int64_t>(b));
                CHECK(batch.x.shape() == (Shape{b == 4 ? 3 : 5, 3}));
                for (std::int64_t k = 0; k < batch.x.dim(0); ++k) {
                    const auto i = static_cast<std::int64_t>(batch.x[k * 3]);
                    CHECK(batch.x[k * 3 + 2] == static_cast<float>(3 * i));
                    CHECK(batch.labels[static_cast<std::size_t>(k)] == i % 7);
                }
            }
            auto s = samples_of(batches);
            std::sort(s.begin(), s.end());
            CHECK(std::adjacent_find(s.begin(), s.end()) == s.end());
            CHECK(static_cast<std::int64_t>(s.size()) == (drop_last ? 20 : 23));
        }
    }
    // Prefetching changes nothing: the same batches in the same order, epoch after epoch.
    data::BatchLoader eager(ds, {.batch_size = 4, .seed = seed, .prefetch = false});
    data::BatchLoader ahead(ds, {.batch_size = 4, .seed = seed, .prefetch = true});
    for (std::int64_t e = 0; e < 3; ++e) CHECK(samples_of(epoch(eager, e)) == samples_of(epoch(ahead, e)));
}

TEST_CASE("BatchLoader stores batches where LoaderOptions::memory says, each block kept by its batch", "[data]") {
    // The hook of lockstep::cuda::pinned_batch_memory(), with counted host blocks.
    struct Blocks {
        std::atomic<int> made{0}, live{0};
        std::atomic<std::size_t> bytes{0};
    };
    auto blocks = std::make_shared<Blocks>();
    const auto memory = [blocks](std::size_t bytes) -> std::shared_ptr<void> {
        ++blocks->made;
        ++blocks->live;
        blocks->bytes += bytes;
        return std::shared_ptr<void>(::operator new(bytes), [blocks](void* p) {
            --blocks->live;
            ::operator delete(p);
        });
    };
    Counting ds;
    for (const bool prefetch : {false, true}) {
        CAPTURE(prefetch);
        blocks->made = 0;
        blocks->bytes = 0;
        std::vector<data::Batch> batches;
        {
            data::BatchLoader loader(ds, {.batch_size = 5, .shuffle = false, .prefetch = prefetch, .memory = memory});
            batches = epoch(loader, 0);
        }
        // Every batch in a block of its own, of its size, alive after the loader is gone.
        REQUIRE(batches.size() == 5);
        CHECK(blocks->made == 5);
        CHECK(blocks->bytes == static_cast<std::size_t>(23 * 3) * sizeof(float));
        CHECK(blocks->live == 5);
        for (std::size_t b = 0; b < batches.size(); ++b) {
            CHECK(batches[b].memory != nullptr);
            CHECK(static_cast<const void*>(batches[b].x.data()) == batches[b].memory.get());
            CHECK(batches[b].x[0] == static_cast<float>(5 * b));  // sample 5b, unshuffled
        }
        batches.clear();
        CHECK(blocks->live == 0);
    }
    // A hook that gives no block is a usage error, reported at next().
    data::BatchLoader bad(ds, {.batch_size = 5, .memory = [](std::size_t) { return std::shared_ptr<void>(); }});
    bad.start_epoch(0);
    CHECK_THROWS_WITH(bad.next(), Catch::Contains("LoaderOptions::memory gave no block"));
}

TEST_CASE("BatchLoader restarts an epoch mid-way, rethrows a failed read once and goes on", "[data]") {
    Counting ds;
    ds.poison = 6;
    data::BatchLoader loader(ds, {.batch_size = 4, .shuffle = false});
    loader.start_epoch(0);
    CHECK(loader.next()->index == 0);
    loader.start_epoch(1);  // what was prefetched of epoch 0 is dropped
    auto first = loader.next();
    CHECK((first->epoch == 1 && first->index == 0));
    CHECK_THROWS_WITH(loader.next(), Catch::Contains("sample 6 is unreadable"));
    std::int64_t rest = 0;
    while (auto b = loader.next()) rest += b->x.dim(0);
    CHECK(rest == 23 - 8);  // the batches after the failed one
    CHECK_THROWS_AS(data::BatchLoader<Counting>(ds, {.batch_size = 0}), InvalidArgument);
    CHECK_THROWS_AS(data::BatchLoader<Counting>(ds, {.rank = 2, .world = 2}), InvalidArgument);
    data::BatchLoader unstarted(ds, {});
    CHECK_THROWS_AS(unstarted.next(), UsageError);
    {
        data::BatchLoader abandoned(ds, {.batch_size = 2});  // destroyed with a batch in the making
        abandoned.start_epoch(0);
        (void)abandoned.next();
    }
}

TEST_CASE("IdxSource reads real Fashion-MNIST files and refuses what the caller's network cannot take", "[data]") {
    const std::string dir = "/usr/share/datasets/fashion-mnist/";
    const auto file = [&](const std::string& name) {
        const auto plain = dir + name;
        return std::filesystem::exists(plain) ? plain : plain + ".gz";
    };
    const data::IdxSource test(file("t10k-images-idx3-ubyte"), file("t10k-labels-idx1-ubyte"),
                               {.limit = 300, .rows = 28, .cols = 28, .classes = 10});
    CHECK(test.size() == 300);
    CHECK(test.sample_shape() == (Shape{1, 28, 28}));
    data::BatchLoader loader(test, {.batch_size = 64, .rank = 1, .world = 2});
    loader.start_epoch(0);
    std::int64_t seen = 0;
    std::set<std::int64_t> classes;
    while (auto b = loader.next()) {
        REQUIRE(b->x.dim(1) == 1);
        for (const float v : b->x.span()) REQUIRE((v >= 0.0f && v <= 1.0f));
        classes.insert(b->labels.begin(), b->labels.end());
        seen += b->x.dim(0);
    }
    CHECK(seen == 150);
    CHECK(classes.size() == 10);
    CHECK_THROWS_WITH(data::IdxSource(file("t10k-images-idx3-ubyte"), file("t10k-labels-idx1-ubyte"), {.rows = 32, .cols = 32}),
                      Catch::Contains("images are 28x28; this network takes 32x32"));
    CHECK_THROWS_AS(data::IdxSource(file("t10k-images-idx3-ubyte"), file("t10k-labels-idx1-ubyte"), {.classes = 5}),
                    data::DataError);
    CHECK_THROWS_AS(data::IdxSource(dir + "no-such-file", file("t10k-labels-idx1-ubyte")), IoError);
}
