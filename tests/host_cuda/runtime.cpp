// SPDX-License-Identifier: MIT
//! lockstep's host CUDA device: the CUDA runtime entry points (devices, memory, streams, events, copies).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <unordered_map>

#include "detail.hpp"
#include "host_cuda.hpp"

namespace lockstep::host_cuda::detail {
namespace {

constexpr std::size_t default_capacity = std::size_t{8} << 30;
constexpr std::size_t device_alignment = 256;
constexpr std::size_t host_alignment = 4096;

std::size_t round_up(std::size_t n, std::size_t a) { return (std::max<std::size_t>(n, 1) + a - 1) / a * a; }

struct Block {
    std::size_t size = 0;     // as requested: copies and kernels may use this much
    std::size_t charged = 0;  // counted against the capacity
    int device = 0;
    bool freeing = false;  // cudaFreeAsync called: no longer usable, freed when its op runs
    // Set (relaxed) by the worker that freed it: the worker takes no registry lock, which would
    // order it after whatever host call last took that lock. Dead entries are purged lazily.
    std::shared_ptr<std::atomic<bool>> released;
    bool graph = false;  // made in a capture: its graph frees it (graphs.cpp)
    bool pooled = false;  // cudaMallocAsync's: its free goes back to the default pool
};

struct Event {
    struct Record {
        std::shared_ptr<Stream> stream;
        std::uint64_t seq = 0;
        std::chrono::steady_clock::time_point time;  // written by the worker, read after completion
    };
    int device = 0;
    unsigned flags = 0;
    std::mutex m;
    std::shared_ptr<Record> record;     // null: never recorded (complete)
    std::shared_ptr<CaptureMark> mark;  // last recorded in a capturing stream (then record is null)
};

struct Device {
    std::shared_ptr<Stream> legacy;
    // Every stream of the device not yet destroyed and drained (for legacy-stream semantics and
    // cudaDeviceSynchronize).
    std::vector<std::shared_ptr<Stream>> streams;
    std::size_t capacity = default_capacity;
    std::atomic<std::size_t> used{0};  // relaxed: a stream-ordered free updates it from a worker
    // Note [memory pools on the host CUDA device]: bytes the default pool keeps after
    // stream-ordered frees (up to its release threshold), reused by cudaMallocAsync only; bytes
    // graphs' allocations hold (mapped at upload or first launch, for each live executable);
    // bytes the graph pool keeps after those executables are gone, until cudaDeviceGraphMemTrim.
    // All count against the capacity.
    std::atomic<std::size_t> pool_cached{0};
    std::size_t graph_mapped = 0;  // under State::m
    std::size_t graph_cached = 0;  // under State::m
    // Serializes enqueues that take part in legacy-stream ordering, so two of them never see each
    // other half done. Held only while enqueuing, never while an op runs.
    std::mutex order;
};

//! "The k-th launch from now", of every launch or only of the launches named `kernel`.
struct LaunchCounter {
    int k = 0;
    std::string kernel;
    int device = -1;  // every device
};

struct Injections {
    int fail_alloc = 0;
    LaunchCounter fail_launch, fault_launch, stall_launch;
    LaunchCounter fail_graph_memory;  // counts graph memory mappings (kernel name unused)
};

//! Everything shared. Leaked on purpose: detached workers may still run during static destruction.
struct State {
    std::mutex m;  // registries; never held while an op runs
    std::map<std::uintptr_t, Block> device_blocks;
    std::map<std::uintptr_t, std::size_t> pinned_blocks;
    std::unordered_map<const void*, std::shared_ptr<Stream>> streams;
    std::unordered_map<const void*, std::shared_ptr<Event>> events;
    // Dead handles are kept so that their addresses are never handed out again.
    std::vector<std::shared_ptr<Stream>> dead_streams;
    std::vector<std::shared_ptr<Event>> dead_events;
    Device devices[max_devices];
    std::uint64_t next_serial = 1;
    Injections inject;
    std::uint64_t stall_generation = 0;
    std::mutex stall_m;
    std::condition_variable stall_cv;
    std::uint64_t launches = 0;
    std::uint64_t uploads_from_pinned = 0;  // host-to-device copies whose source is page-locked memory
};

State& state() {
    static State* s = new State;
    return *s;
}

std::atomic<cudaError_t> sticky_errors[max_devices];
std::atomic<unsigned> delay_cap_us{200};
std::atomic<int> devices_in_use{0};
std::atomic<int> compute_capability{90};  // major * 10 + minor, as every device reports it
thread_local int current = 0;
thread_local cudaError_t last_error = cudaSuccess;

int env_int(const char* name, int fallback) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return fallback;
    return static_cast<int>(std::strtol(v, nullptr, 0));
}

std::uint64_t delay_seed() {
    static const std::uint64_t seed = [] {
        std::uint64_t s = 0;
        if (const char* v = std::getenv("LOCKSTEP_TEST_SEED"); v != nullptr && *v != '\0') {
            s = std::strtoull(v, nullptr, 0);
        } else {
            std::random_device rd;
            s = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
        }
        if (const char* v = std::getenv("LOCKSTEP_HOSTCUDA_DELAY_US"); v != nullptr && *v != '\0')
            delay_cap_us.store(static_cast<unsigned>(std::strtoul(v, nullptr, 0)));
        std::fprintf(stderr,
                     "host CUDA device: delay seed %llu (LOCKSTEP_TEST_SEED=%llu replays the delays, not the OS's "
                     "thread interleavings)\n",
                     static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
        return s;
    }();
    return seed;
}

void worker(std::shared_ptr<Stream> s) {
    for (;;) {
        Op op;
        {
            std::unique_lock lock(s->m);
            s->cv.wait(lock, [&] { return !s->queue.empty() || s->closing.load(); });
            if (s->queue.empty()) return;  // destroyed and drained
            op = std::move(s->queue.front());
            s->queue.pop_front();
        }
        // Acquires the other stream's work: the happens-before edge exists only where CUDA
        // promises the order.
        for (const Dep& d : op.deps) wait_for(*d.stream, d.seq);
        if (const unsigned cap = delay_cap_us.load(std::memory_order_relaxed); cap > 0 && (s->rng() & 3) == 0)
            std::this_thread::sleep_for(std::chrono::microseconds(s->rng() % (cap + 1)));
        if (!op.device_work || sticky_errors[s->device].load(std::memory_order_relaxed) == cudaSuccess) op.body();
        op = Op{};  // release what the op captured before it counts as completed
        s->completed.store(s->completed.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
}

std::shared_ptr<Stream> start_stream(int device, bool blocking, bool legacy) {
    const std::uint64_t seed = delay_seed();
    auto s = std::make_shared<Stream>();
    s->device = device;
    s->blocking = blocking;
    s->legacy = legacy;
    State& st = state();
    {
        std::lock_guard lock(st.m);
        s->serial = st.next_serial++;
    }
    s->rng.seed(seed ^ (s->serial * 0x9E3779B97F4A7C15ull));
    std::thread(worker, s).detach();  // never joined: a worker may stand on a stall at exit
    return s;
}

Device& device_state(int d) { return state().devices[d]; }

std::shared_ptr<Stream> legacy_stream(int d) {
    Device& dev = device_state(d);
    std::lock_guard lock(dev.order);
    if (!dev.legacy) dev.legacy = start_stream(d, true, true);
    return dev.legacy;
}

//! The registry entry (base, block) whose block holds address `a`: the live block, else an
//! entry freed in stream order but not yet released (a newer block may overlap the range of a
//! released one), else {0, nullptr}.
std::pair<std::uintptr_t, const Block*> block_at(const State& st, std::uintptr_t a) {
    std::pair<std::uintptr_t, const Block*> freed{0, nullptr};
    for (auto it = st.device_blocks.upper_bound(a); it != st.device_blocks.begin();) {
        --it;
        const bool holds = a < it->first + it->second.size;
        if (!it->second.freeing) return holds ? std::pair{it->first, &it->second} : freed;  // live blocks never overlap
        if (holds && freed.second == nullptr && !it->second.released->load(std::memory_order_relaxed))
            freed = {it->first, &it->second};
    }
    return freed;
}

//! The live block holding all of [p, p + bytes), or nullptr.
const Block* live_block(const State& st, const void* p, std::size_t bytes) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    const auto [base, b] = block_at(st, a);
    if (b == nullptr || b->freeing || a + bytes < a || a + bytes > base + b->size) return nullptr;
    return b;
}

bool is_pinned(const void* p) {
    State& st = state();
    std::lock_guard lock(st.m);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = st.pinned_blocks.upper_bound(a);
    if (it == st.pinned_blocks.begin()) return false;
    --it;
    return a < it->first + it->second;
}

//! Counts one use of the injection `counter`: true when this use is the k-th.
bool hit(int& counter) {
    if (counter <= 0) return false;
    return --counter == 0;
}

bool hit(LaunchCounter& c, const std::string& kernel, int device) {
    if (!c.kernel.empty() && c.kernel != kernel) return false;
    if (c.device >= 0 && c.device != device) return false;
    return hit(c.k);
}

thread_local std::string next_launch_name;

//! Bytes of `dev` that nothing holds (Note [memory pools on the host CUDA device]; under State::m).
std::size_t free_bytes(const Device& dev) {
    const std::size_t held = dev.used.load() + dev.pool_cached.load() + dev.graph_mapped + dev.graph_cached;
    return dev.capacity - std::min(dev.capacity, held);
}

//! How a device block is made: cudaMalloc (from the device), cudaMallocAsync (from the default
//! pool, which reuses what it keeps), or in a capture (the graph's: no memory until mapped).
enum class Source { device, pool, graph };

cudaError_t allocate_device(void** p, std::size_t size, int device, Source source = Source::device) {
    if (p == nullptr) return fail(cudaErrorInvalidValue);
    *p = nullptr;
    State& st = state();
    const std::size_t bytes = round_up(size, device_alignment);
    const std::size_t charged = source == Source::graph ? 0 : bytes;
    std::size_t reused = 0;  // of the default pool's cached bytes
    {
        std::lock_guard lock(st.m);
        if (hit(st.inject.fail_alloc)) return fail(cudaErrorMemoryAllocation);
        if (size == 0) return cudaSuccess;
        Device& dev = st.devices[device];
        // A stream-ordered free adds to the cache (and clamps it to its threshold) without the lock:
        // the part reused is taken by compare-and-swap, never below zero.
        std::size_t cached = dev.pool_cached.load();
        for (;;) {
            reused = source == Source::pool ? std::min(charged, cached) : 0;
            if (charged - reused > free_bytes(dev)) return fail(cudaErrorMemoryAllocation);
            if (reused == 0 || dev.pool_cached.compare_exchange_weak(cached, cached - reused)) break;
        }
        dev.used += charged;
    }
    // The requested size, not the rounded one: AddressSanitizer sees an access past the end.
    void* block = nullptr;
    if (posix_memalign(&block, device_alignment, std::max<std::size_t>(size, 1)) != 0) block = nullptr;
    if (block == nullptr) {
        std::lock_guard lock(st.m);
        st.devices[device].used -= charged;
        st.devices[device].pool_cached += reused;  // back to the pool
        return fail(cudaErrorMemoryAllocation);
    }
    std::memset(block, 0xFF, size);  // NaN as float: reading memory never written shows
    std::lock_guard lock(st.m);
    std::erase_if(st.device_blocks, [](const auto& e) { return e.second.released->load(std::memory_order_relaxed); });
    // An entry still there is a block freed in stream order whose address came back.
    st.device_blocks[reinterpret_cast<std::uintptr_t>(block)] =
        Block{size, charged, device, false, std::make_shared<std::atomic<bool>>(false), false, source == Source::pool};
    *p = block;
    return cudaSuccess;
}

std::atomic<std::uint64_t> pool_release_threshold[max_devices];  // the default pools' (0 until set)

//! Gives a block back to the system allocator, so that AddressSanitizer reports any later use;
//! the bytes of a pooled block stay the default pool's, up to its release threshold.
//! The caller has removed it from the registry (cudaFree) or marked it freeing (cudaFreeAsync).
void release_block(void* base, int device, std::size_t charged, std::atomic<bool>& released, bool pooled = false) {
    released.store(true, std::memory_order_relaxed);  // before the address can come back
    Device& dev = device_state(device);
    if (pooled) {
        // Kept by the pool (counted before the block stops counting: never briefly free), then
        // whatever exceeds the threshold goes back (CUDA does at the next synchronization).
        const std::uint64_t keep = pool_release_threshold[device].load(std::memory_order_relaxed);
        std::size_t cached = dev.pool_cached.fetch_add(charged, std::memory_order_relaxed) + charged;
        while (cached > keep && !dev.pool_cached.compare_exchange_weak(cached, static_cast<std::size_t>(keep),
                                                                        std::memory_order_relaxed)) {
        }
    }
    dev.used.fetch_sub(charged, std::memory_order_relaxed);
    std::free(base);
}

//! Where a copy's end lies: a live device block, pinned host memory or pageable host memory.
//! `invalid`: starts in a device block but runs past it, or in a block cudaFreeAsync released.
enum class Space { device, pinned, pageable, invalid };

Space space_of(const void* p, std::size_t bytes) {
    {
        State& st = state();
        std::lock_guard lock(st.m);
        if (live_block(st, p, bytes) != nullptr) return Space::device;
        if (block_at(st, reinterpret_cast<std::uintptr_t>(p)).second != nullptr) return Space::invalid;
    }
    return is_pinned(p) ? Space::pinned : Space::pageable;
}

//! cudaMemcpy and cudaMemcpyAsync. `sync_api`: the synchronous call, on the legacy stream.
cudaError_t copy(void* dst, const void* src, std::size_t count, cudaMemcpyKind kind, cudaStream_t h, bool sync_api) {
    if (sync_api)
        if (const cudaError_t e = capture_unsafe_call(); e != cudaSuccess) return e;
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = stream_for_work(h, s); e != cudaSuccess) return e;
    if (count == 0) return cudaSuccess;
    if (dst == nullptr || src == nullptr) return fail(cudaErrorInvalidValue);
    Space ds = space_of(dst, count), ss = space_of(src, count);
    if (ds == Space::invalid || ss == Space::invalid) return fail(cudaErrorInvalidValue);
    switch (kind) {
        case cudaMemcpyHostToHost:
            if (ds == Space::device) ds = Space::pageable;
            if (ss == Space::device) ss = Space::pageable;
            break;
        case cudaMemcpyHostToDevice:
            if (ds != Space::device) return fail(cudaErrorInvalidValue);
            if (ss == Space::device) ss = Space::pageable;
            break;
        case cudaMemcpyDeviceToHost:
            if (ss != Space::device) return fail(cudaErrorInvalidValue);
            if (ds == Space::device) ds = Space::pageable;
            break;
        case cudaMemcpyDeviceToDevice:
            if (ds != Space::device || ss != Space::device) return fail(cudaErrorInvalidValue);
            break;
        case cudaMemcpyDefault: break;
        default: return fail(cudaErrorInvalidMemcpyDirection);
    }
    const bool to_device = ds == Space::device, from_device = ss == Space::device;
    if (to_device && ss == Space::pinned) {
        std::lock_guard lock(state().m);
        ++state().uploads_from_pinned;
    }
    // A graph copies between device and pinned memory only.
    if (ds == Space::pageable || ss == Space::pageable)
        if (const cudaError_t e = capture_refuse(s); e != cudaSuccess) return e;
    Op op;
    if (to_device) op.device_ranges.emplace_back(dst, count);
    if (from_device) op.device_ranges.emplace_back(src, count);
    bool wait = false;
    if (!from_device && ss == Space::pageable && to_device) {
        // Pageable source: the driver may stage it synchronously, behind the stream's earlier work;
        // the double always does, so the call returns only once the stream has drained (a hung
        // kernel before it holds the caller), and the caller may then reuse its memory at once.
        wait_for(*s, s->submitted.load());
        auto staged = std::make_shared<std::vector<unsigned char>>(static_cast<const unsigned char*>(src),
                                                                   static_cast<const unsigned char*>(src) + count);
        op.body = [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); };
    } else {
        op.body = [dst, src, count] { std::memcpy(dst, src, count); };
        if (!to_device && !from_device)
            wait = true;  // host to host: synchronous
        else if (!to_device && ds == Space::pageable)
            wait = true;  // into pageable memory
        else if (sync_api && !(to_device && from_device))
            wait = true;  // cudaMemcpy except D2D
    }
    const std::uint64_t seq = enqueue(s, std::move(op));
    if (wait) {
        wait_for(*s, seq);
        if (const cudaError_t e = sticky(s->device); e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t memset_on(void* p, int value, std::size_t count, cudaStream_t h) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = stream_for_work(h, s); e != cudaSuccess) return e;
    if (count == 0) return cudaSuccess;
    if (space_of(p, count) != Space::device) return fail(cudaErrorInvalidValue);
    Op op;
    op.device_ranges.emplace_back(p, count);
    op.body = [p, value, count] { std::memset(p, value, count); };
    enqueue(s, std::move(op));
    return cudaSuccess;
}

template <class T>
T* lookup(const std::unordered_map<const void*, std::shared_ptr<T>>& live, const void* h, std::shared_ptr<T>& out) {
    auto it = live.find(h);
    if (it == live.end()) return nullptr;
    out = it->second;
    return out.get();
}

std::shared_ptr<Event::Record> record_of(Event& ev) {
    std::lock_guard lock(ev.m);
    return ev.record;
}

std::shared_ptr<CaptureMark> mark_of(Event& ev) {
    std::lock_guard lock(ev.m);
    return ev.mark;
}

cudaError_t resolve_event(cudaEvent_t h, std::shared_ptr<Event>& out) {
    State& st = state();
    std::lock_guard lock(st.m);
    if (h == nullptr || lookup(st.events, h, out) == nullptr) return fail(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

}  // namespace

int current_device() noexcept { return current; }

int device_count() noexcept {
    int n = devices_in_use.load();
    if (n == 0) {
        n = std::clamp(env_int("LOCKSTEP_HOSTCUDA_DEVICES", 1), 1, max_devices);
        int expected = 0;
        if (!devices_in_use.compare_exchange_strong(expected, n)) n = expected;
    }
    return n;
}

cudaError_t sticky(int device) noexcept {
    if (device < 0 || device >= max_devices) return cudaSuccess;
    return sticky_errors[device].load(std::memory_order_relaxed);
}

void set_sticky(int device, cudaError_t e) noexcept {
    cudaError_t expected = cudaSuccess;
    sticky_errors[device].compare_exchange_strong(expected, e, std::memory_order_relaxed);
}

cudaError_t fail(cudaError_t e) noexcept {
    if (e != cudaSuccess && e != cudaErrorNotReady) last_error = e;
    return e;
}

cudaError_t resolve_stream(cudaStream_t h, std::shared_ptr<Stream>& out) { return resolve_stream_on(h, current, out); }

cudaError_t resolve_stream_on(cudaStream_t h, int device, std::shared_ptr<Stream>& out) {
    if (h == nullptr || h == cudaStreamLegacy) {
        out = legacy_stream(device);
        return cudaSuccess;
    }
    // The per-thread default stream is not modelled: refused rather than approximated.
    if (h == cudaStreamPerThread) return fail(cudaErrorNotSupported);
    State& st = state();
    std::lock_guard lock(st.m);
    if (lookup(st.streams, h, out) == nullptr) return fail(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

cudaError_t stream_for_work(cudaStream_t h, std::shared_ptr<Stream>& out) {
    if (const cudaError_t e = resolve_stream(h, out); e != cudaSuccess) return e;
    if (out->device != current) return fail(cudaErrorInvalidResourceHandle);
    if (const cudaError_t e = sticky(out->device); e != cudaSuccess) return e;
    return capture_admits(out);
}

std::uint64_t enqueue(const std::shared_ptr<Stream>& s, Op op) {
    if (s->capturing.load()) {  // recorded into the stream's capture: runs at each replay
        capture_op(s, std::move(op));
        return 0;
    }
    Device& dev = device_state(s->device);
    std::unique_lock order(dev.order, std::defer_lock);
    if (s->blocking) {
        order.lock();
        if (s->legacy) {
            // Legacy stream: waits for all earlier work of the device's blocking streams.
            std::erase_if(dev.streams, [](const std::shared_ptr<Stream>& o) {
                return o->closing.load() &&
                       o->completed.load(std::memory_order_relaxed) == o->submitted.load(std::memory_order_relaxed);
            });
            for (const auto& o : dev.streams)
                if (o->blocking && o != s)
                    if (const std::uint64_t n = o->submitted.load(std::memory_order_relaxed); n > 0) op.deps.push_back({o, n});
        } else if (dev.legacy) {
            // Blocking stream: waits for earlier legacy-stream work.
            if (const std::uint64_t n = dev.legacy->submitted.load(std::memory_order_relaxed); n > 0)
                op.deps.push_back({dev.legacy, n});
        }
    }
    std::uint64_t seq = 0;
    {
        std::lock_guard lock(s->m);
        s->queue.push_back(std::move(op));
        seq = s->submitted.fetch_add(1, std::memory_order_relaxed) + 1;
    }
    s->cv.notify_all();
    return seq;
}

bool wait_until(Stream& s, std::uint64_t seq, std::chrono::steady_clock::time_point deadline) {
    // Polls with a growing pause (yield, then 5 us doubling to 200 us): a condition variable
    // would need a mutex the worker also takes.
    for (int round = 0; s.completed.load(std::memory_order_acquire) < seq; ++round) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        if (round < 16)
            std::this_thread::yield();
        else
            std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, 5 << std::min(round - 16, 6))));
    }
    return true;
}

void wait_for(Stream& s, std::uint64_t seq) { (void)wait_until(s, seq, std::chrono::steady_clock::time_point::max()); }

bool reached(Stream& s, std::uint64_t seq) { return s.completed.load(std::memory_order_acquire) >= seq; }

int device_of_range(const void* p, std::size_t bytes) {
    State& st = state();
    std::lock_guard lock(st.m);
    const Block* b = live_block(st, p, bytes);
    return b == nullptr ? -1 : b->device;
}

std::shared_ptr<Stream> internal_stream(int device) {
    auto s = start_stream(device, false, false);
    std::lock_guard lock(device_state(device).order);
    device_state(device).streams.push_back(s);
    return s;
}

void close_stream(const std::shared_ptr<Stream>& s) {
    {
        std::lock_guard lock(s->m);
        s->closing.store(true);
    }
    s->cv.notify_all();
}

GraphBlock own_by_graph(void* p) {
    State& st = state();
    std::lock_guard lock(st.m);
    Block& b = st.device_blocks.at(reinterpret_cast<std::uintptr_t>(p));
    b.graph = true;
    return GraphBlock{p, b.size, b.device, b.charged, b.released};
}

cudaError_t map_graph_memory(int device, std::size_t bytes) {
    State& st = state();
    std::lock_guard lock(st.m);
    if (hit(st.inject.fail_graph_memory, "", device)) return cudaErrorMemoryAllocation;
    Device& dev = st.devices[device];
    const std::size_t reused = std::min(bytes, dev.graph_cached);
    if (bytes - reused > free_bytes(dev)) return cudaErrorMemoryAllocation;
    dev.graph_cached -= reused;
    dev.graph_mapped += bytes;
    return cudaSuccess;
}

void unmap_graph_memory(int device, std::size_t bytes) {
    State& st = state();
    std::lock_guard lock(st.m);
    Device& dev = st.devices[device];
    dev.graph_mapped -= std::min(bytes, dev.graph_mapped);
    dev.graph_cached += bytes;
}

void retire_graph_block(const GraphBlock& b) {
    State& st = state();
    std::lock_guard lock(st.m);
    if (auto it = st.device_blocks.find(reinterpret_cast<std::uintptr_t>(b.p));
        it != st.device_blocks.end() && it->second.released == b.released)
        it->second.freeing = true;
}

void release_graph_block(const GraphBlock& b) {
    if (!b.released->load(std::memory_order_relaxed)) release_block(b.p, b.device, b.charged, *b.released);
}

cudaError_t plan_launch(std::string name, int device, LaunchPlan& plan) {
    State& st = state();
    plan = LaunchPlan{};
    plan.name = std::move(name);
    {
        std::lock_guard lock(st.m);
        if (hit(st.inject.fail_launch, plan.name, device)) return fail(cudaErrorLaunchFailure);
        plan.fault = hit(st.inject.fault_launch, plan.name, device);
        plan.stall = hit(st.inject.stall_launch, plan.name, device);
        plan.number = ++st.launches;
    }
    if (plan.stall) {
        std::lock_guard lock(st.stall_m);
        plan.generation = st.stall_generation;
    }
    return cudaSuccess;
}

Op launch_op(cudaHostFn_t fn, void* data, const LaunchPlan& plan, int device) {
    Op op;
    op.body = [fn, data, plan, device] {
        if (plan.stall) {
            State& st = state();
            std::unique_lock lock(st.stall_m);
            st.stall_cv.wait(lock, [&] { return st.stall_generation != plan.generation; });
        }
        // As CUDA does for host functions, a launch queued behind a fault is never called.
        fn(data);
        if (plan.fault) {
            std::fprintf(stderr,
                         "host CUDA device: launch %llu%s%s%s on device %d faults as injected (cudaErrorIllegalAddress)\n",
                         static_cast<unsigned long long>(plan.number), plan.name.empty() ? "" : " (", plan.name.c_str(),
                         plan.name.empty() ? "" : ")", device);
            set_sticky(device, cudaErrorIllegalAddress);
        }
    };
    return op;
}

}  // namespace lockstep::host_cuda::detail

// ---------------------------------------------------------------------------------------------
// Test controls.

namespace lockstep::host_cuda {

using namespace detail;

bool set_device_count(int count) {
    if (count < 1 || count > max_devices) return false;
    devices_in_use.store(count);
    return true;
}

bool set_compute_capability(int major, int minor) {
    if (major < 5 || major > 12 || minor < 0 || minor > 9) return false;
    compute_capability.store(major * 10 + minor);
    return true;
}

bool set_memory_capacity(int device, std::size_t bytes) {
    if (device < 0 || device >= max_devices) return false;
    State& st = state();
    std::lock_guard lock(st.m);
    st.devices[device].capacity = bytes;
    return true;
}

void fail_allocation(int k) {
    std::lock_guard lock(state().m);
    state().inject.fail_alloc = k;
}
void fail_graph_memory(int k, int device) {
    std::lock_guard lock(state().m);
    state().inject.fail_graph_memory = {k, "", device};
}
std::size_t pool_cached_bytes(int device) {
    if (device < 0 || device >= max_devices) return 0;
    return device_state(device).pool_cached.load();
}
std::size_t graph_memory_bytes(int device) {
    if (device < 0 || device >= max_devices) return 0;
    std::lock_guard lock(state().m);
    return state().devices[device].graph_mapped + state().devices[device].graph_cached;
}
void fail_launch(int k, const char* kernel, int device) {
    std::lock_guard lock(state().m);
    state().inject.fail_launch = {k, kernel == nullptr ? "" : kernel, device};
}
void fault_launch(int k, const char* kernel, int device) {
    std::lock_guard lock(state().m);
    state().inject.fault_launch = {k, kernel == nullptr ? "" : kernel, device};
}
void stall_launch(int k, const char* kernel, int device) {
    std::lock_guard lock(state().m);
    state().inject.stall_launch = {k, kernel == nullptr ? "" : kernel, device};
}

void release_stalls() {
    State& st = state();
    {
        std::lock_guard lock(st.stall_m);
        ++st.stall_generation;
    }
    st.stall_cv.notify_all();
}

void set_delay_cap_us(unsigned us) {
    (void)delay_seed();  // the environment's cap is read once, first: this call wins over it
    delay_cap_us.store(us);
}

void reset() {
    release_stalls();
    // Drain what is queued (device work behind a fault is dropped, as before), bounded: an op
    // blocked in a collective whose peers never come would otherwise hold reset forever.
    std::vector<std::pair<std::shared_ptr<Stream>, std::uint64_t>> queued;
    for (int d = 0; d < max_devices; ++d) {
        Device& dev = device_state(d);
        std::lock_guard lock(dev.order);
        for (const auto& s : dev.streams) queued.emplace_back(s, s->submitted.load());
        if (dev.legacy) queued.emplace_back(dev.legacy, dev.legacy->submitted.load());
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int stuck = 0;
    for (auto& [s, n] : queued)
        if (!wait_until(*s, n, deadline)) ++stuck;
    if (stuck > 0)
        std::fprintf(stderr, "host CUDA device: reset() with %d stream(s) still busy (blocked in a collective?)\n", stuck);
    State& st = state();
    {
        std::lock_guard lock(st.m);
        st.inject = Injections{};
        for (Device& d : st.devices) {
            d.capacity = default_capacity;
            d.pool_cached.store(0);  // the caches empty (release thresholds stay, set once per process)
            d.graph_cached = 0;      // executables that outlive a reset keep their mapped bytes
        }
    }
    compute_capability.store(90);
    reset_captures();
    for (auto& e : sticky_errors) e.store(cudaSuccess);
    last_error = cudaSuccess;
    reset_nccl_injections();
#if LOCKSTEP_WITH_CUDNN
    reset_cudnn();
#endif
}

std::uint64_t seed() { return delay_seed(); }

std::size_t live_device_blocks() {
    std::lock_guard lock(state().m);
    return static_cast<std::size_t>(std::count_if(state().device_blocks.begin(), state().device_blocks.end(), [](const auto& e) {
        return !e.second.released->load(std::memory_order_relaxed);
    }));
}

std::uint64_t launches() {
    std::lock_guard lock(state().m);
    return state().launches;
}

std::uint64_t uploads_from_pinned() {
    std::lock_guard lock(state().m);
    return state().uploads_from_pinned;
}

}  // namespace lockstep::host_cuda

// ---------------------------------------------------------------------------------------------
// The CUDA runtime API. Every call that works on a device returns that device's sticky error
// once one happened; API errors are returned, recorded as the thread's last error, not sticky.

using namespace lockstep::host_cuda::detail;

namespace {

#define LOCKSTEP_HOST_CUDA_ERRORS(X)                                                                                  \
    X(cudaSuccess, "no error")                                                                                        \
    X(cudaErrorInvalidValue, "invalid argument")                                                                      \
    X(cudaErrorMemoryAllocation, "out of memory")                                                                     \
    X(cudaErrorInitializationError, "initialization error")                                                           \
    X(cudaErrorCudartUnloading, "driver shutting down")                                                               \
    X(cudaErrorInvalidConfiguration, "invalid configuration argument")                                                \
    X(cudaErrorInvalidPitchValue, "invalid pitch argument")                                                           \
    X(cudaErrorInvalidSymbol, "invalid device symbol")                                                                \
    X(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")                                           \
    X(cudaErrorMissingConfiguration, "__global__ function call is not configured")                                    \
    X(cudaErrorLaunchMaxDepthExceeded, "launch would exceed maximum depth of nested launches")                        \
    X(cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version")                    \
    X(cudaErrorCallRequiresNewerDriver, "API call is not supported in the installed CUDA driver")                     \
    X(cudaErrorInvalidSurface, "invalid surface reference")                                                           \
    X(cudaErrorNoDevice, "no CUDA-capable device is detected")                                                        \
    X(cudaErrorInvalidDevice, "invalid device ordinal")                                                               \
    X(cudaErrorStartupFailure, "device kernel image is invalid")                                                      \
    X(cudaErrorInvalidKernelImage, "device kernel image is invalid")                                                  \
    X(cudaErrorDeviceUninitialized, "invalid device context")                                                         \
    X(cudaErrorMapBufferObjectFailed, "mapping of buffer object failed")                                              \
    X(cudaErrorNoKernelImageForDevice, "no kernel image is available for execution on the device")                    \
    X(cudaErrorECCUncorrectable, "uncorrectable ECC error encountered")                                               \
    X(cudaErrorUnsupportedLimit, "limit is not supported on this architecture")                                       \
    X(cudaErrorPeerAccessUnsupported, "peer access is not supported between these two devices")                       \
    X(cudaErrorInvalidPtx, "a PTX JIT compilation failed")                                                            \
    X(cudaErrorUnsupportedPtxVersion, "the provided PTX was compiled with an unsupported toolchain.")                 \
    X(cudaErrorInvalidSource, "device kernel image is invalid")                                                       \
    X(cudaErrorFileNotFound, "file not found")                                                                        \
    X(cudaErrorSharedObjectSymbolNotFound, "shared object symbol not found")                                          \
    X(cudaErrorSharedObjectInitFailed, "shared object initialization failed")                                         \
    X(cudaErrorOperatingSystem, "OS call failed or operation not supported on this OS")                               \
    X(cudaErrorInvalidResourceHandle, "invalid resource handle")                                                      \
    X(cudaErrorIllegalState, "the operation cannot be performed in the present state")                                \
    X(cudaErrorSymbolNotFound, "named symbol not found")                                                              \
    X(cudaErrorNotReady, "device not ready")                                                                          \
    X(cudaErrorIllegalAddress, "an illegal memory access was encountered")                                            \
    X(cudaErrorLaunchOutOfResources, "too many resources requested for launch")                                       \
    X(cudaErrorLaunchTimeout, "the launch timed out and was terminated")                                              \
    X(cudaErrorLaunchIncompatibleTexturing, "launch uses incompatible texturing mode")                                \
    X(cudaErrorPeerAccessAlreadyEnabled, "peer access is already enabled")                                            \
    X(cudaErrorPeerAccessNotEnabled, "peer access has not been enabled")                                              \
    X(cudaErrorSetOnActiveProcess, "cannot set while device is active in this process")                               \
    X(cudaErrorContextIsDestroyed, "context is destroyed")                                                            \
    X(cudaErrorAssert, "device-side assert triggered")                                                                \
    X(cudaErrorTooManyPeers, "peer mapping resources exhausted")                                                      \
    X(cudaErrorHostMemoryAlreadyRegistered, "part or all of the requested memory range is already mapped")            \
    X(cudaErrorHostMemoryNotRegistered, "pointer does not correspond to a registered memory region")                  \
    X(cudaErrorHardwareStackError, "hardware stack error")                                                            \
    X(cudaErrorIllegalInstruction, "an illegal instruction was encountered")                                          \
    X(cudaErrorMisalignedAddress, "misaligned address")                                                               \
    X(cudaErrorInvalidAddressSpace, "operation not supported on global/shared address space")                         \
    X(cudaErrorInvalidPc, "invalid program counter")                                                                  \
    X(cudaErrorLaunchFailure, "unspecified launch failure")                                                           \
    X(cudaErrorCooperativeLaunchTooLarge, "too many blocks in cooperative launch")                                    \
    X(cudaErrorNotPermitted, "operation not permitted")                                                               \
    X(cudaErrorNotSupported, "operation not supported")                                                               \
    X(cudaErrorSystemNotReady, "system not yet initialized")                                                          \
    X(cudaErrorSystemDriverMismatch, "system has unsupported display driver / cuda driver combination")               \
    X(cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is capturing")                          \
    X(cudaErrorStreamCaptureInvalidated, "operation failed due to a previous error during capture")                   \
    X(cudaErrorStreamCaptureMerge, "operation would result in a merge of separate capture sequences")                 \
    X(cudaErrorStreamCaptureUnmatched, "capture was not ended in the same stream as it began")                        \
    X(cudaErrorStreamCaptureUnjoined, "capturing stream has unjoined work")                                           \
    X(cudaErrorStreamCaptureIsolation, "dependency created on uncaptured work in another stream")                     \
    X(cudaErrorStreamCaptureImplicit, "operation would make the legacy stream depend on a capturing blocking stream") \
    X(cudaErrorCapturedEvent, "operation not permitted on an event last recorded in a capturing stream")              \
    X(cudaErrorStreamCaptureWrongThread, "attempt to terminate a thread-local capture sequence from another thread")  \
    X(cudaErrorTimeout, "wait operation timed out")                                                                   \
    X(cudaErrorInvalidDeviceFunction, "invalid device function")                                                      \
    X(cudaErrorDevicesUnavailable, "CUDA-capable device(s) is/are busy or unavailable")                               \
    X(cudaErrorUnknown, "unknown error")

constexpr int sm_count = 132;
constexpr int l2_bytes = 60 << 20;
constexpr int shared_per_block = 48 << 10;
constexpr int shared_per_block_optin = 227 << 10;
constexpr int shared_per_sm = 228 << 10;

struct MemPool {
    int device = 0;
    std::uint64_t release_threshold = 0;
};
MemPool pools[max_devices];

cudaError_t device_sticky() { return sticky(current_device()); }

MemPool* pool_of(cudaMemPool_t p) {
    for (MemPool& q : pools)
        if (reinterpret_cast<cudaMemPool_t>(&q) == p) return &q;
    return nullptr;
}

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
    if (count == nullptr) return fail(cudaErrorInvalidValue);
    *count = device_count();
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
    current = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
    if (device == nullptr) return fail(cudaErrorInvalidValue);
    *device = current_device();
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    if (prop == nullptr) return fail(cudaErrorInvalidValue);
    if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
    std::memset(prop, 0, sizeof *prop);
    std::snprintf(prop->name, sizeof prop->name, "lockstep host CUDA device %d (models an NVIDIA H200)", device);
    for (std::size_t i = 0; i < sizeof prop->uuid.bytes; ++i)
        prop->uuid.bytes[i] = static_cast<char>(0x4C + 17 * static_cast<int>(i) + 101 * device);
    {
        std::lock_guard lock(state().m);
        prop->totalGlobalMem = state().devices[device].capacity;
    }
    prop->sharedMemPerBlock = shared_per_block;
    prop->sharedMemPerBlockOptin = shared_per_block_optin;
    prop->sharedMemPerMultiprocessor = shared_per_sm;
    prop->reservedSharedMemPerBlock = 1024;
    prop->regsPerBlock = 65536;
    prop->regsPerMultiprocessor = 65536;
    prop->warpSize = 32;
    prop->memPitch = 2147483647;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = 1024;
    prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 2147483647;
    prop->maxGridSize[1] = 65535;
    prop->maxGridSize[2] = 65535;
    prop->totalConstMem = 65536;
    prop->major = compute_capability.load() / 10;
    prop->minor = compute_capability.load() % 10;
    prop->textureAlignment = 512;
    prop->texturePitchAlignment = 32;
    prop->multiProcessorCount = sm_count;
    prop->canMapHostMemory = 1;
    prop->concurrentKernels = 1;
    prop->ECCEnabled = 1;
    prop->pciBusID = 0x18 + device;
    prop->asyncEngineCount = 3;
    prop->unifiedAddressing = 1;
    prop->memoryBusWidth = 6144;
    prop->l2CacheSize = l2_bytes;
    prop->persistingL2CacheMaxSize = 78643200 / 2;
    prop->maxThreadsPerMultiProcessor = 2048;
    prop->streamPrioritiesSupported = 1;
    prop->globalL1CacheSupported = 1;
    prop->localL1CacheSupported = 1;
    prop->managedMemory = 1;
    prop->cooperativeLaunch = 1;
    prop->maxBlocksPerMultiProcessor = 32;
    prop->memoryPoolsSupported = 1;
    prop->clusterLaunch = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
    if (value == nullptr) return fail(cudaErrorInvalidValue);
    if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
    switch (attr) {
        case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
        case cudaDevAttrMaxBlockDimX: *value = 1024; break;
        case cudaDevAttrMaxBlockDimY: *value = 1024; break;
        case cudaDevAttrMaxBlockDimZ: *value = 64; break;
        case cudaDevAttrMaxGridDimX: *value = 2147483647; break;
        case cudaDevAttrMaxGridDimY: *value = 65535; break;
        case cudaDevAttrMaxGridDimZ: *value = 65535; break;
        case cudaDevAttrMaxSharedMemoryPerBlock: *value = shared_per_block; break;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = shared_per_block_optin; break;
        case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = shared_per_sm; break;
        case cudaDevAttrTotalConstantMemory: *value = 65536; break;
        case cudaDevAttrWarpSize: *value = 32; break;
        case cudaDevAttrMaxRegistersPerBlock: *value = 65536; break;
        case cudaDevAttrMaxRegistersPerMultiprocessor: *value = 65536; break;
        case cudaDevAttrMultiProcessorCount: *value = sm_count; break;
        case cudaDevAttrComputeCapabilityMajor: *value = compute_capability.load() / 10; break;
        case cudaDevAttrComputeCapabilityMinor: *value = compute_capability.load() % 10; break;
        case cudaDevAttrL2CacheSize: *value = l2_bytes; break;
        case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
        case cudaDevAttrMaxBlocksPerMultiprocessor: *value = 32; break;
        case cudaDevAttrGlobalMemoryBusWidth: *value = 6144; break;
        case cudaDevAttrAsyncEngineCount: *value = 3; break;
        case cudaDevAttrUnifiedAddressing: *value = 1; break;
        case cudaDevAttrConcurrentKernels: *value = 1; break;
        case cudaDevAttrEccEnabled: *value = 1; break;
        case cudaDevAttrPciBusId: *value = 0x18 + device; break;
        case cudaDevAttrPciDeviceId: *value = 0; break;
        case cudaDevAttrPciDomainId: *value = 0; break;
        case cudaDevAttrIntegrated: *value = 0; break;
        case cudaDevAttrCanMapHostMemory: *value = 1; break;
        case cudaDevAttrComputeMode: *value = cudaComputeModeDefault; break;
        case cudaDevAttrCooperativeLaunch: *value = 1; break;
        case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
        case cudaDevAttrManagedMemory: *value = 1; break;
        case cudaDevAttrStreamPrioritiesSupported: *value = 1; break;
        case cudaDevAttrGlobalL1CacheSupported: *value = 1; break;
        case cudaDevAttrLocalL1CacheSupported: *value = 1; break;
        case cudaDevAttrClusterLaunch: *value = 1; break;
        default: return fail(cudaErrorInvalidValue);  // not modelled: refused rather than guessed
    }
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    return std::exchange(last_error, cudaSuccess);
}

cudaError_t cudaPeekAtLastError(void) {
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    return last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
    switch (error) {
#define LOCKSTEP_HOST_CUDA_NAME(code, text) \
    case code: return #code;
        LOCKSTEP_HOST_CUDA_ERRORS(LOCKSTEP_HOST_CUDA_NAME)
#undef LOCKSTEP_HOST_CUDA_NAME
        default: return "unrecognized error code";
    }
}

const char* cudaGetErrorString(cudaError_t error) {
    switch (error) {
#define LOCKSTEP_HOST_CUDA_TEXT(code, text) \
    case code: return text;
        LOCKSTEP_HOST_CUDA_ERRORS(LOCKSTEP_HOST_CUDA_TEXT)
#undef LOCKSTEP_HOST_CUDA_TEXT
        default: return "unrecognized error code";
    }
}

cudaError_t cudaDriverGetVersion(int* version) {
    if (version == nullptr) return fail(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
    if (version == nullptr) return fail(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
    if (attr == nullptr) return fail(cudaErrorInvalidValue);
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    if (func == nullptr) return fail(cudaErrorInvalidDeviceFunction);
    std::memset(attr, 0, sizeof *attr);
    attr->numRegs = 32;
    attr->maxThreadsPerBlock = 1024;
    attr->localSizeBytes = 0;
    attr->sharedSizeBytes = 0;
    attr->constSizeBytes = 0;
    attr->ptxVersion = 90;
    attr->binaryVersion = 90;
    attr->maxDynamicSharedSizeBytes = shared_per_block;
    attr->preferredShmemCarveout = -1;
    return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    if (func == nullptr) return fail(cudaErrorInvalidDeviceFunction);
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize && (value < 0 || value > shared_per_block_optin))
        return fail(cudaErrorInvalidValue);
    return cudaSuccess;
}

// --- Memory ----------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** devPtr, size_t size) {
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_unsafe_call(); e != cudaSuccess) return e;
    return allocate_device(devPtr, size, current_device());
}

cudaError_t cudaFree(void* devPtr) {
    // Freed at once, without waiting for the device: work still queued that uses the block is a
    // use after free, as CUDA promises no synchronization here.
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_unsafe_call(); e != cudaSuccess) return e;
    if (devPtr == nullptr) return cudaSuccess;
    Block block;
    {
        State& st = state();
        std::lock_guard lock(st.m);
        auto it = st.device_blocks.find(reinterpret_cast<std::uintptr_t>(devPtr));
        if (it == st.device_blocks.end() || it->second.freeing || it->second.graph) return fail(cudaErrorInvalidValue);
        block = std::move(it->second);
        st.device_blocks.erase(it);
    }
    release_block(devPtr, block.device, block.charged, *block.released, block.pooled);
    return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(hStream, s); e != cudaSuccess) return e;
    if (const cudaError_t e = sticky(s->device); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_admits(s); e != cudaSuccess) return e;
    // Usable at once; in a capture the graph's, for its lifetime, with memory only once mapped.
    const bool capturing = s->capturing.load();
    if (const cudaError_t e = allocate_device(devPtr, size, s->device, capturing ? Source::graph : Source::pool); e != cudaSuccess)
        return e;
    if (capturing) capture_allocation(s, *devPtr);
    return cudaSuccess;
}

cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(hStream, s); e != cudaSuccess) return e;
    if (const cudaError_t e = sticky(s->device); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_admits(s); e != cudaSuccess) return e;
    if (devPtr == nullptr) return cudaSuccess;
    if (s->capturing.load()) return capture_free(s, devPtr);  // a graph frees what it made with itself
    Block block;
    {
        State& st = state();
        std::lock_guard lock(st.m);
        auto it = st.device_blocks.find(reinterpret_cast<std::uintptr_t>(devPtr));
        if (it == st.device_blocks.end() || it->second.freeing || it->second.graph) return fail(cudaErrorInvalidValue);
        it->second.freeing = true;  // unusable from now on, freed when the stream reaches the op
        block = it->second;
    }
    Op op;
    op.device_work = false;
    op.body = [devPtr, block] { release_block(devPtr, block.device, block.charged, *block.released, block.pooled); };
    enqueue(s, std::move(op));
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int /*flags*/) {
    if (pHost == nullptr) return fail(cudaErrorInvalidValue);
    *pHost = nullptr;
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_unsafe_call(); e != cudaSuccess) return e;
    void* p = nullptr;
    if (posix_memalign(&p, host_alignment, std::max<std::size_t>(size, 1)) != 0) return fail(cudaErrorMemoryAllocation);
    std::memset(p, 0xFF, std::max<std::size_t>(size, 1));
    State& st = state();
    std::lock_guard lock(st.m);
    st.pinned_blocks[reinterpret_cast<std::uintptr_t>(p)] = std::max<std::size_t>(size, 1);
    *pHost = p;
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) { return cudaHostAlloc(ptr, size, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void* ptr) {
    // Freed at once: a copy still queued that reads or writes it is a use after free.
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_unsafe_call(); e != cudaSuccess) return e;
    if (ptr == nullptr) return cudaSuccess;
    {
        State& st = state();
        std::lock_guard lock(st.m);
        if (st.pinned_blocks.erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0) return fail(cudaErrorInvalidValue);
    }
    std::free(ptr);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    if (free == nullptr || total == nullptr) return fail(cudaErrorInvalidValue);
    State& st = state();
    std::lock_guard lock(st.m);
    const Device& d = st.devices[current_device()];
    *total = d.capacity;
    *free = free_bytes(d);  // what the pools keep is not free (Note [memory pools on the host CUDA device])
    return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* memPool, int device) {
    if (memPool == nullptr) return fail(cudaErrorInvalidValue);
    if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
    if (const cudaError_t e = sticky(device); e != cudaSuccess) return e;
    pools[device].device = device;
    *memPool = reinterpret_cast<cudaMemPool_t>(&pools[device]);
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t memPool, cudaMemPoolAttr attr, void* value) {
    MemPool* pool = pool_of(memPool);
    if (pool == nullptr || value == nullptr) return fail(cudaErrorInvalidValue);
    if (const cudaError_t e = sticky(pool->device); e != cudaSuccess) return e;
    // The threshold bounds what the pool keeps counted (Note [memory pools on the host CUDA
    // device]); the blocks themselves always go back to the system at once, so ASan sees a late use.
    if (attr == cudaMemPoolAttrReleaseThreshold) {
        pool->release_threshold = *static_cast<std::uint64_t*>(value);
        pool_release_threshold[pool->device].store(pool->release_threshold);
    }
    return cudaSuccess;
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t memPool, size_t minBytesToKeep) {
    MemPool* pool = pool_of(memPool);
    if (pool == nullptr) return fail(cudaErrorInvalidValue);
    if (const cudaError_t e = sticky(pool->device); e != cudaSuccess) return e;
    State& st = state();
    std::lock_guard lock(st.m);  // allocate_device reads and takes the cache under it
    auto& cached = st.devices[pool->device].pool_cached;
    std::size_t now = cached.load();
    while (now > minBytesToKeep && !cached.compare_exchange_weak(now, minBytesToKeep)) {
    }
    return cudaSuccess;
}

cudaError_t cudaDeviceGraphMemTrim(int device) {
    if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
    if (const cudaError_t e = sticky(device); e != cudaSuccess) return e;
    // As CUDA: the memory of every graph not executing or scheduled, uploaded or not, goes back.
    unmap_idle_executables(device);
    State& st = state();
    std::lock_guard lock(st.m);
    st.devices[device].graph_cached = 0;
    return cudaSuccess;
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t memPool, cudaMemPoolAttr attr, void* value) {
    MemPool* pool = pool_of(memPool);
    if (pool == nullptr || value == nullptr) return fail(cudaErrorInvalidValue);
    if (attr == cudaMemPoolAttrReleaseThreshold)
        *static_cast<std::uint64_t*>(value) = pool->release_threshold;
    else if (attr == cudaMemPoolReuseFollowEventDependencies || attr == cudaMemPoolReuseAllowOpportunistic ||
             attr == cudaMemPoolReuseAllowInternalDependencies)
        *static_cast<int*>(value) = 1;
    else
        *static_cast<std::uint64_t*>(value) = 0;
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
    if (attributes == nullptr) return fail(cudaErrorInvalidValue);
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    std::memset(attributes, 0, sizeof *attributes);
    if (const int d = device_of_range(ptr, 1); d >= 0) {
        attributes->type = cudaMemoryTypeDevice;
        attributes->device = d;
        attributes->devicePointer = const_cast<void*>(ptr);
    } else if (ptr != nullptr && is_pinned(ptr)) {
        attributes->type = cudaMemoryTypeHost;
        attributes->device = current_device();
        attributes->devicePointer = const_cast<void*>(ptr);
        attributes->hostPointer = const_cast<void*>(ptr);
    } else {
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = -2;
        attributes->hostPointer = const_cast<void*>(ptr);
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
    return copy(dst, src, count, kind, nullptr, true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
    return copy(dst, src, count, kind, stream, false);
}

cudaError_t cudaMemset(void* devPtr, int value, size_t count) { return memset_on(devPtr, value, count, nullptr); }

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
    return memset_on(devPtr, value, count, stream);
}

// --- Streams -----------------------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
    if (pStream == nullptr || (flags & ~static_cast<unsigned>(cudaStreamNonBlocking)) != 0) return fail(cudaErrorInvalidValue);
    const int d = current_device();
    if (const cudaError_t e = sticky(d); e != cudaSuccess) return e;
    auto s = start_stream(d, (flags & cudaStreamNonBlocking) == 0, false);
    {
        std::lock_guard lock(device_state(d).order);
        device_state(d).streams.push_back(s);
    }
    State& st = state();
    std::lock_guard lock(st.m);
    st.streams[s.get()] = s;
    *pStream = reinterpret_cast<cudaStream_t>(s.get());
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* pStream) { return cudaStreamCreateWithFlags(pStream, cudaStreamDefault); }

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* pStream, unsigned int flags, int /*priority*/) {
    return cudaStreamCreateWithFlags(pStream, flags);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
        return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<Stream> s;
    {
        State& st = state();
        std::lock_guard lock(st.m);
        auto it = st.streams.find(stream);
        if (it == st.streams.end()) return fail(cudaErrorInvalidResourceHandle);
        if (it->second->capturing.load()) return fail(cudaErrorStreamCaptureUnsupported);
        s = it->second;
        st.streams.erase(it);
        st.dead_streams.push_back(s);
    }
    {
        // Returns at once; the worker finishes the queued work, then exits.
        std::lock_guard lock(s->m);
        s->closing.store(true);
    }
    s->cv.notify_all();
    return sticky(s->device);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(stream, s); e != cudaSuccess) return e;
    if (const cudaError_t e = sticky(s->device); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_refuse(s); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_admits(s); e != cudaSuccess) return e;
    wait_for(*s, s->submitted.load());
    return sticky(s->device);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(stream, s); e != cudaSuccess) return e;
    if (const cudaError_t e = sticky(s->device); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_refuse(s); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_admits(s); e != cudaSuccess) return e;
    return reached(*s, s->submitted.load()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamGetFlags(cudaStream_t hStream, unsigned int* flags) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(hStream, s); e != cudaSuccess) return e;
    if (flags == nullptr) return fail(cudaErrorInvalidValue);
    *flags = s->blocking ? cudaStreamDefault : cudaStreamNonBlocking;
    return cudaSuccess;
}

cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int* device) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(hStream, s); e != cudaSuccess) return e;
    if (device == nullptr) return fail(cudaErrorInvalidValue);
    *device = s->device;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    const int d = current_device();
    if (const cudaError_t e = sticky(d); e != cudaSuccess) return e;
    if (const cudaError_t e = capture_unsafe_call(); e != cudaSuccess) return e;
    // Context-wide: refused while any stream of the device captures, whatever the modes and
    // threads (those captures are invalidated).
    if (const cudaError_t e = capture_refuse_device(d); e != cudaSuccess) return e;
    std::vector<std::pair<std::shared_ptr<Stream>, std::uint64_t>> targets;
    {
        std::lock_guard lock(device_state(d).order);
        for (const auto& s : device_state(d).streams) targets.emplace_back(s, s->submitted.load());
    }
    if (auto l = legacy_stream(d)) targets.emplace_back(l, l->submitted.load());
    for (auto& [s, n] : targets) wait_for(*s, n);
    return sticky(d);
}

void lockstep_host_cuda_name_next_launch(const char* kernel) { next_launch_name = kernel == nullptr ? "" : kernel; }

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData) {
    std::shared_ptr<Stream> s;
    std::string name = std::exchange(next_launch_name, std::string());
    if (const cudaError_t e = stream_for_work(stream, s); e != cudaSuccess) return e;
    if (fn == nullptr) return fail(cudaErrorInvalidValue);
    if (s->capturing.load()) {  // planned at each replay
        capture_launch(s, fn, userData, std::move(name));
        return cudaSuccess;
    }
    LaunchPlan plan;
    if (const cudaError_t e = plan_launch(std::move(name), s->device, plan); e != cudaSuccess) return e;
    enqueue(s, launch_op(fn, userData, plan, s->device));
    return cudaSuccess;
}

// --- Events ------------------------------------------------------------------------------------

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
    constexpr unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
    if (event == nullptr || (flags & ~known) != 0) return fail(cudaErrorInvalidValue);
    if ((flags & cudaEventInterprocess) != 0 && (flags & cudaEventDisableTiming) == 0) return fail(cudaErrorInvalidValue);
    if (const cudaError_t e = device_sticky(); e != cudaSuccess) return e;
    auto ev = std::make_shared<Event>();
    ev->device = current_device();
    ev->flags = flags;
    State& st = state();
    std::lock_guard lock(st.m);
    st.events[ev.get()] = ev;
    *event = reinterpret_cast<cudaEvent_t>(ev.get());
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    State& st = state();
    std::lock_guard lock(st.m);
    auto it = st.events.find(event);
    if (event == nullptr || it == st.events.end()) return fail(cudaErrorInvalidResourceHandle);
    const int device = it->second->device;
    st.dead_events.push_back(std::move(it->second));
    st.events.erase(it);
    return sticky(device);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    std::shared_ptr<Event> ev;
    if (const cudaError_t e = resolve_event(event, ev); e != cudaSuccess) return e;
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = stream_for_work(stream, s); e != cudaSuccess) return e;
    if (ev->device != s->device) return fail(cudaErrorInvalidResourceHandle);
    // A marker op: on the legacy stream it also waits for the blocking streams, as CUDA's does.
    auto rec = std::make_shared<Event::Record>();
    rec->stream = s;
    Op op;
    op.device_work = false;
    op.body = [rec] { rec->time = std::chrono::steady_clock::now(); };
    if (s->capturing.load()) {  // a position in the capture, for streams that wait on it to fork from
        auto mark = capture_mark(s);
        std::lock_guard lock(ev->m);
        ev->record = nullptr;
        ev->mark = std::move(mark);
        return cudaSuccess;
    }
    rec->seq = enqueue(s, std::move(op));
    std::lock_guard lock(ev->m);
    ev->record = std::move(rec);
    ev->mark = nullptr;
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    std::shared_ptr<Event> ev;
    if (const cudaError_t e = resolve_event(event, ev); e != cudaSuccess) return e;
    if (const cudaError_t e = sticky(ev->device); e != cudaSuccess) return e;
    if (mark_of(*ev) != nullptr) return fail(cudaErrorCapturedEvent);
    const auto rec = record_of(*ev);
    if (rec == nullptr) return cudaSuccess;  // never recorded: complete
    return reached(*rec->stream, rec->seq) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    std::shared_ptr<Event> ev;
    if (const cudaError_t e = resolve_event(event, ev); e != cudaSuccess) return e;
    if (const cudaError_t e = sticky(ev->device); e != cudaSuccess) return e;
    if (mark_of(*ev) != nullptr) return fail(cudaErrorCapturedEvent);
    if (const auto rec = record_of(*ev)) wait_for(*rec->stream, rec->seq);
    return sticky(ev->device);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    std::shared_ptr<Event> a, b;
    if (const cudaError_t e = resolve_event(start, a); e != cudaSuccess) return e;
    if (const cudaError_t e = resolve_event(end, b); e != cudaSuccess) return e;
    if (ms == nullptr) return fail(cudaErrorInvalidValue);
    if (const cudaError_t e = sticky(a->device); e != cudaSuccess) return e;
    if (mark_of(*a) != nullptr || mark_of(*b) != nullptr) return fail(cudaErrorCapturedEvent);
    if (((a->flags | b->flags) & cudaEventDisableTiming) != 0) return fail(cudaErrorInvalidResourceHandle);
    const auto ra = record_of(*a), rb = record_of(*b);
    if (ra == nullptr || rb == nullptr) return fail(cudaErrorInvalidResourceHandle);
    if (!reached(*ra->stream, ra->seq) || !reached(*rb->stream, rb->seq)) return cudaErrorNotReady;
    *ms = std::chrono::duration<float, std::milli>(rb->time - ra->time).count();
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    if (flags != cudaEventWaitDefault && flags != cudaEventWaitExternal) return fail(cudaErrorInvalidValue);
    std::shared_ptr<Event> ev;
    if (const cudaError_t e = resolve_event(event, ev); e != cudaSuccess) return e;
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(stream, s); e != cudaSuccess) return e;
    if (const cudaError_t e = sticky(s->device); e != cudaSuccess) return e;
    if (const auto mark = mark_of(*ev)) return capture_wait(s, *mark);  // forks or joins a capture
    if (const cudaError_t e = capture_admits(s); e != cudaSuccess) return e;
    // The event's state now: a later re-record does not change what the stream waits for.
    const auto rec = record_of(*ev);
    if (rec == nullptr) return cudaSuccess;
    if (s->capturing.load()) return capture_isolation(s);  // a capture depends on nothing outside it
    Op op;
    op.device_work = false;
    op.deps.push_back({rec->stream, rec->seq});
    op.body = [] {};
    enqueue(s, std::move(op));
    return cudaSuccess;
}

}  // extern "C"
