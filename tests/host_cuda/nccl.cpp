// SPDX-License-Identifier: MIT
//! lockstep's host CUDA device: the NCCL entry points, collectives that meet on the ranks' stream workers.
#include <nccl.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "detail.hpp"
#include "host_cuda.hpp"

namespace {

using namespace lockstep::host_cuda::detail;
using clock_type = std::chrono::steady_clock;

//! How long a blocking init or finalize waits for the other ranks before giving up.
constexpr auto blocking_deadline = std::chrono::seconds(60);
constexpr int default_version = 22805;

struct Comm;

//! One collective of a clique, by sequence number: the ranks' arguments as they arrive.
struct Slot {
    struct Arrival {
        const void* send = nullptr;
        void* recv = nullptr;
        bool here = false;
    };
    std::vector<Arrival> in;
    int arrived = 0;
    int left = 0;
    bool ready = false;   // result computed from every input
    bool failed = false;  // a rank failed it: nobody writes
    std::vector<unsigned char> result;
};

//! The ranks of one unique id.
struct Clique {
    Clique(int n, std::uint64_t serial) : nranks(n), id(serial), members(static_cast<std::size_t>(n), nullptr) {}
    const int nranks;
    const std::uint64_t id;  // "communicator <id>" in the watchdog's reports
    std::mutex m;
    std::condition_variable cv;
    std::vector<Comm*> members;  // joined ranks (under m)
    int joined = 0;
    int finalized = 0;
    std::map<std::uint64_t, Slot> slots;
};

struct Comm {
    std::shared_ptr<Clique> clique;
    int rank = 0;
    int device = 0;
    bool blocking = true;
    bool ordered = false;  // NCCL_LAUNCH_ORDER_IMPLICIT was set when it was made
    // ncclInProgress until every rank joined (or, after ncclCommFinalize, until finalized);
    // ncclSystemError / ncclRemoteError after a failed collective.
    std::atomic<ncclResult_t> error{ncclInProgress};
    std::atomic<bool> aborted{false};
    std::atomic<bool> destroyed{false};  // ncclCommDestroy: a graph that still holds it must not run it
    // Live graphs that captured one of its collectives (a hold each, released when the graph's last
    // handle goes): abort, destroy and finalize wait for them, as NCCL 2.26 and newer do.
    std::atomic<int> graph_holds{0};
    std::mutex m;                        // the fields below
    std::uint64_t next_seq = 0;
    bool finalizing = false;
    std::vector<std::pair<std::shared_ptr<Stream>, std::uint64_t>> last_ops;  // per stream, for finalize
};

struct Registry {
    std::mutex m;
    std::unordered_map<std::string, std::weak_ptr<Clique>> cliques;
    std::unordered_map<const void*, std::shared_ptr<Comm>> live;
    std::vector<std::shared_ptr<Comm>> dead;  // so that a dead handle's address is never reused
    std::map<int, int> fail_in;               // rank -> k-th collective from now fails
    std::uint64_t next_id = 1;
    std::uint64_t next_clique = 1;
    int version = default_version;
};

Registry& registry() {
    static Registry* r = new Registry;
    return *r;
}

thread_local int group_depth = 0;
// Blocking inits and finalizes deferred to ncclGroupEnd (second: a finalize).
thread_local std::vector<std::pair<std::shared_ptr<Comm>, bool>> group_blocking;
thread_local bool group_in_progress = false;  // a non-blocking init in the group
thread_local std::string last_message;

ncclResult_t refuse(ncclResult_t r, const std::string& why) {
    last_message = why;
    return r;
}

std::shared_ptr<Comm> find(ncclComm_t c) {
    Registry& reg = registry();
    std::lock_guard lock(reg.m);
    auto it = reg.live.find(c);
    return it == reg.live.end() ? nullptr : it->second;
}

bool failure(ncclResult_t r) { return r != ncclSuccess && r != ncclInProgress; }

std::size_t type_size(ncclDataType_t t) {
    switch (t) {
        case ncclInt8:
        case ncclUint8: return 1;
        case ncclFloat16:
        case ncclBfloat16: return 2;
        case ncclInt32:
        case ncclUint32:
        case ncclFloat32: return 4;
        case ncclInt64:
        case ncclUint64:
        case ncclFloat64: return 8;
        default: return 0;  // the fp8 types are not modelled
    }
}

template <class T>
struct Acc {
    using type = T;
};
template <>
struct Acc<__half> {
    using type = float;
};
template <>
struct Acc<__nv_bfloat16> {
    using type = float;
};

template <class T>
typename Acc<T>::type load(T x) {
    return x;
}
template <>
float load(__half x) {
    return __half2float(x);
}
template <>
float load(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

template <class T>
T store(typename Acc<T>::type x) {
    return x;
}
template <>
__half store<__half>(float x) {
    return __float2half_rn(x);
}
template <>
__nv_bfloat16 store<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

template <class A>
A combine(A a, A b, ncclRedOp_t op) {
    if constexpr (std::is_integral_v<A>) {
        using U = std::make_unsigned_t<A>;  // wraps as the device does, without UB
        if (op == ncclSum || op == ncclAvg) return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
        if (op == ncclProd) return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    } else {
        if (op == ncclSum || op == ncclAvg) return a + b;
        if (op == ncclProd) return a * b;
    }
    if (op == ncclMax) return b > a ? b : a;
    return b < a ? b : a;
}

// Note [the double's summation order]
// NCCL's ring, tree and NVLS algorithms add the ranks' values in an order that depends on where an
// element falls in the message (its chunk), on the message's size (which picks the algorithm) and
// on the plan (a captured collective may be planned otherwise than an eager one), never simply in
// rank order 0..n-1. Every rank still gets the same bits: each element is reduced once and the
// result copied to all. The double does the same, so a test that asks for rank-order sums, or for
// eager and captured collectives to agree to the bit, fails here as it could on a GPU (with two
// ranks every order gives the same sum: IEEE addition commutes):
// - small messages (at most 32 KiB): a pairwise tree over the ranks, in an order rotated by the
//   element's 64-element line, one rank further in a captured plan;
// - larger ones: a ring, each of n chunks reduced starting at the rank after its own, the
//   direction reversed in a captured plan.

//! Which reduction plan a collective's elements follow (Note [the double's summation order]).
struct Plan {
    std::size_t count = 0;
    std::size_t bytes = 0;
    bool captured = false;
};

//! The ranks in the order element `i` adds them (at most `ranks.size()` of them).
void order_of(std::size_t i, const Plan& plan, std::vector<std::size_t>& ranks) {
    const std::size_t n = ranks.size();
    if (plan.bytes <= (std::size_t{32} << 10)) {
        const std::size_t rot = (i / 64 + (plan.captured ? 1 : 0)) % n;
        for (std::size_t k = 0; k < n; ++k) ranks[k] = (rot + k) % n;
        return;
    }
    const std::size_t chunk = (plan.count + n - 1) / n, c = i / chunk;
    for (std::size_t k = 0; k < n; ++k) ranks[k] = plan.captured ? (c + 2 * n - 1 - k) % n : (c + 1 + k) % n;
}

//! out[i] = the op over the ranks' in[r][i], in the order of the plan (a pairwise tree for small
//! messages, else a ring); in float for the 16-bit types (rounded once, to nearest even). Each
//! element is reduced once, for every rank: the same bits on every rank.
template <class T>
void reduce(const std::vector<const void*>& in, void* out, std::size_t count, ncclRedOp_t op, const Plan& plan) {
    using A = typename Acc<T>::type;
    const std::size_t n = in.size();
    std::vector<std::size_t> ranks(n);
    std::vector<A> level(n);
    const bool tree = plan.bytes <= (std::size_t{32} << 10);
    for (std::size_t i = 0; i < count; ++i) {
        order_of(i, plan, ranks);
        for (std::size_t k = 0; k < n; ++k) level[k] = load(static_cast<const T*>(in[ranks[k]])[i]);
        A acc;
        if (tree) {
            for (std::size_t width = n; width > 1; width = (width + 1) / 2)
                for (std::size_t k = 0; k < width / 2; ++k) {
                    level[k] = combine(level[2 * k], level[2 * k + 1], op);
                    if (k == width / 2 - 1 && width % 2 == 1) level[k + 1] = level[width - 1];
                }
            acc = level[0];
        } else {
            acc = level[0];
            for (std::size_t k = 1; k < n; ++k) acc = combine(acc, level[k], op);
        }
        if (op == ncclAvg) acc = static_cast<A>(acc / static_cast<A>(n));
        static_cast<T*>(out)[i] = store<T>(acc);
    }
}

void reduce_any(ncclDataType_t t, const std::vector<const void*>& in, void* out, std::size_t count, ncclRedOp_t op,
                const Plan& plan) {
    switch (t) {
        case ncclInt8: reduce<std::int8_t>(in, out, count, op, plan); break;
        case ncclUint8: reduce<std::uint8_t>(in, out, count, op, plan); break;
        case ncclInt32: reduce<std::int32_t>(in, out, count, op, plan); break;
        case ncclUint32: reduce<std::uint32_t>(in, out, count, op, plan); break;
        case ncclInt64: reduce<std::int64_t>(in, out, count, op, plan); break;
        case ncclUint64: reduce<std::uint64_t>(in, out, count, op, plan); break;
        case ncclFloat16: reduce<__half>(in, out, count, op, plan); break;
        case ncclBfloat16: reduce<__nv_bfloat16>(in, out, count, op, plan); break;
        case ncclFloat32: reduce<float>(in, out, count, op, plan); break;
        case ncclFloat64: reduce<double>(in, out, count, op, plan); break;
        default: break;
    }
}

struct Collective {
    std::size_t count = 0;
    ncclDataType_t type = ncclFloat32;
    ncclRedOp_t op = ncclSum;
    int root = -1;  // broadcast: the root; all-reduce: -1
    const void* send = nullptr;
    void* recv = nullptr;
    bool fails = false;  // injected
    const char* name = "";
    std::uint64_t ticket = 0;  // its place in the device's enqueue order (hazard model), or 0
    bool ordered = false;      // the communicator follows the launch-order rule
    bool captured = false;     // launched from a graph: its own plan (Note [the double's summation order])
};

const char* type_name(ncclDataType_t t) {
    switch (t) {
        case ncclInt8: return "int8";
        case ncclUint8: return "uint8";
        case ncclInt32: return "int32";
        case ncclUint32: return "uint32";
        case ncclInt64: return "int64";
        case ncclUint64: return "uint64";
        case ncclFloat16: return "float16";
        case ncclBfloat16: return "bfloat16";
        case ncclFloat32: return "float32";
        case ncclFloat64: return "float64";
        default: return "?";
    }
}

// --- The hazard model (docs/design.md, "The NCCL double") -----------------------------------
// A running collective holds its device until every rank has arrived (its kernel occupies the
// GPU while it waits for its peers), so collectives of two communicators on one device run one
// after the other. In which order: with the launch-order rule (NCCL_LAUNCH_ORDER_IMPLICIT), the
// order the host enqueued them; without it, the device's draw. Devices alternate between taking
// the earliest collective whose stream reached it and waiting a while for a later one to take
// that instead, starting from a draw of the seed: two devices that choose differently, each
// holding a collective the other has not started, deadlock as NCCL documents.

struct DeviceSched {
    std::mutex m;
    std::condition_variable cv;
    bool busy = false;  // a collective holds the device
    std::uint64_t next_ticket = 0;
    std::map<std::uint64_t, std::uint64_t> unstarted;  // enqueued and not started: ticket -> communicator
    std::set<std::uint64_t> ready;                     // of those, the ones whose stream reached them
    std::uint64_t generation = 0;                      // reset() starts a new one: holders from before release nothing
};

DeviceSched& sched(int device) {
    static DeviceSched* s = new DeviceSched[max_devices];  // leaked: detached workers may use it at exit
    return s[device];
}

std::atomic<int> hazard_setting{-1};  // -1: LOCKSTEP_HOSTCUDA_NCCL_HAZARD

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define LOCKSTEP_HOSTCUDA_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define LOCKSTEP_HOSTCUDA_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define LOCKSTEP_HOSTCUDA_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LOCKSTEP_HOSTCUDA_TSAN 1
#endif
#endif

#if defined(LOCKSTEP_HOSTCUDA_TSAN)
// The device lock orders collectives of different streams, which a GPU does not promise: it
// would hide from ThreadSanitizer a missing event between them. Off unless a test asks.
constexpr bool hazard_by_default = false;
#else
constexpr bool hazard_by_default = true;
#endif

bool hazard_on() {
    const int v = hazard_setting.load();
    if (v >= 0) return v != 0;
    const char* e = std::getenv("LOCKSTEP_HOSTCUDA_NCCL_HAZARD");
    return e == nullptr ? hazard_by_default : std::string(e) != "0";
}

bool prefers_latest(int device) { return ((lockstep::host_cuda::seed() & 1u) ^ static_cast<unsigned>(device)) & 1u; }

//! How long a device that prefers a later collective waits for one to become ready (longer
//! where a sanitizer slows the streams down).
#if defined(LOCKSTEP_HOSTCUDA_SANITIZED)
constexpr auto hazard_window = std::chrono::milliseconds(200);
#else
constexpr auto hazard_window = std::chrono::milliseconds(20);
#endif

//! Whether a collective of another communicator than `clique` is queued on the device.
bool others_queued(const DeviceSched& d, std::uint64_t clique) {
    for (const auto& [ticket, owner] : d.unstarted)
        if (owner != clique) return true;
    return false;
}

void drop_ticket(int device, std::uint64_t ticket) {
    if (ticket == 0) return;
    DeviceSched& d = sched(device);
    {
        std::lock_guard lock(d.m);
        d.unstarted.erase(ticket);
        d.ready.erase(ticket);
    }
    d.cv.notify_all();
}

// --- The watchdog ------------------------------------------------------------------------------
// A collective that has waited longer than LOCKSTEP_HOSTCUDA_WATCHDOG_S (default 60) prints what
// every waiting collective waits for and ends the process (exit status 3): an ordering mistake fails its test
// with the collective named instead of hanging CI. nccl_waits() gives the same report to a test.

struct Waiting {
    std::weak_ptr<Clique> clique;
    std::uint64_t clique_id = 0, seq = 0;
    int rank = 0, device = 0;
    const char* name = "";
    std::size_t count = 0;
    ncclDataType_t type = ncclFloat32;
    bool started = false;  // holds its device (else it waits for it)
    clock_type::time_point since;
    std::string call;  // a host call blocked on graphs (ncclCommAbort, ...): what it waits for; empty for a collective
};

std::mutex waits_m;
std::list<Waiting>& waits() {
    static auto* w = new std::list<Waiting>;
    return *w;
}

std::chrono::seconds watchdog_limit() {
    static const std::chrono::seconds limit = [] {
        const char* e = std::getenv("LOCKSTEP_HOSTCUDA_WATCHDOG_S");
        const long v = e == nullptr ? 0 : std::strtol(e, nullptr, 10);
        return std::chrono::seconds(v > 0 ? v : 60);
    }();
    return limit;
}

std::vector<std::string> describe_waits() {
    std::vector<Waiting> now;
    {
        std::lock_guard lock(waits_m);
        now.assign(waits().begin(), waits().end());
    }
    std::vector<std::string> out;
    for (const Waiting& w : now) {
        const double s = std::chrono::duration<double>(clock_type::now() - w.since).count();
        if (!w.call.empty()) {
            out.push_back("rank " + std::to_string(w.rank) + " (device " + std::to_string(w.device) + ") has waited " +
                          std::to_string(static_cast<int>(s * 1000)) + " ms in " + w.call);
            continue;
        }
        std::string line = "rank " + std::to_string(w.rank) + " (device " + std::to_string(w.device) + ") has waited " +
                           std::to_string(static_cast<int>(s * 1000)) + " ms in " + w.name + " (" + std::to_string(w.count) +
                           " x " + type_name(w.type) + ") #" + std::to_string(w.seq) + " of communicator " +
                           std::to_string(w.clique_id);
        if (!w.started) {
            line += ": its device runs another collective first";
        } else if (auto q = w.clique.lock()) {
            std::lock_guard lock(q->m);
            std::string missing;
            if (auto it = q->slots.find(w.seq); it != q->slots.end())
                for (std::size_t r = 0; r < it->second.in.size(); ++r)
                    if (!it->second.in[r].here) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            line += missing.empty() ? std::string(": every rank arrived") : ": rank(s) " + missing + " never arrived";
        }
        out.push_back(std::move(line));
    }
    return out;
}

[[noreturn]] void watchdog_fires() {
    std::fprintf(stderr, "host NCCL watchdog: a collective or an NCCL call waited longer than %lld s:\n",
                 static_cast<long long>(watchdog_limit().count()));
    for (const auto& line : describe_waits()) std::fprintf(stderr, "  %s\n", line.c_str());
    std::fflush(stderr);
    std::_Exit(3);  // a failed test, without unwinding threads that stand in collectives
}

//! The calling stream worker's wait, for the watchdog and nccl_waits(). It is published (under
//! the global `waits_m`) only once it has lasted `publish_after`: a lock every collective took
//! would order the stream workers for ThreadSanitizer where CUDA promises nothing.
class WaitRecord {
public:
    static constexpr auto publish_after = std::chrono::milliseconds(100);

    //! A host call (`call`: what it is and what it waits for) blocked in communicator `comm`.
    WaitRecord(const Comm& comm, std::string call) {
        w_.clique = comm.clique;
        w_.clique_id = comm.clique->id;
        w_.rank = comm.rank;
        w_.device = comm.device;
        w_.call = std::move(call);
        w_.since = clock_type::now();
    }
    WaitRecord(const std::shared_ptr<Comm>& comm, std::uint64_t seq, const Collective& c) {
        w_.clique = comm->clique;
        w_.clique_id = comm->clique->id;
        w_.seq = seq;
        w_.rank = comm->rank;
        w_.device = comm->device;
        w_.name = c.name;
        w_.count = c.count;
        w_.type = c.type;
        w_.since = clock_type::now();
    }
    ~WaitRecord() {
        if (!published_) return;
        std::lock_guard lock(waits_m);
        waits().erase(it_);
    }
    WaitRecord(const WaitRecord&) = delete;
    WaitRecord& operator=(const WaitRecord&) = delete;
    void started() {
        w_.started = true;
        if (!published_) return;
        std::lock_guard lock(waits_m);
        it_->started = true;
    }
    //! In a wait loop: publishes a long wait, and ends the process past the watchdog's limit.
    void tick() {
        const auto waited = clock_type::now() - w_.since;
        if (!published_ && waited >= publish_after) {
            std::lock_guard lock(waits_m);
            it_ = waits().insert(waits().end(), w_);
            published_ = true;
        }
        if (waited > watchdog_limit()) watchdog_fires();
    }

private:
    Waiting w_;
    bool published_ = false;
    std::list<Waiting>::iterator it_;
};

// --- Graphs that hold a communicator ---------------------------------------------------------
// A graph that captured a collective holds its communicator (NCCL 2.26 and newer): ncclCommAbort,
// ncclCommDestroy and ncclCommFinalize of that communicator do not complete until every such
// graph is destroyed, and ncclCommAbort blocks its caller meanwhile even for a non-blocking
// communicator. A thread that aborts while it, or a thread waiting for it, still owns such a graph
// never returns: the watchdog names the call.

//! One captured collective's hold on its communicator, released with the graph's last handle.
struct GraphHold {
    explicit GraphHold(std::shared_ptr<Comm> c) : comm(std::move(c)) { comm->graph_holds.fetch_add(1); }
    ~GraphHold() { comm->graph_holds.fetch_sub(1); }
    GraphHold(const GraphHold&) = delete;
    GraphHold& operator=(const GraphHold&) = delete;
    std::shared_ptr<Comm> comm;
};

std::string holds_text(const Comm& c) {
    return std::to_string(c.graph_holds.load()) + " collective(s) captured in CUDA graphs that are not destroyed";
}

//! Blocks the calling host thread until no live graph holds `comm`; the watchdog ends a process
//! that waits past its limit, naming `call`.
void wait_for_graphs(const Comm& comm, const char* call) {
    if (comm.graph_holds.load() == 0) return;
    WaitRecord record(comm, std::string(call) + " of communicator " + std::to_string(comm.clique->id) + ": it waits for " +
                                holds_text(comm));
    while (comm.graph_holds.load() > 0) {
        record.tick();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

//! How a collective got past acquire_device.
enum class Grant { untracked, held, aborted };

//! Waits until collective `c` may hold its device (hazard model): `held` with the device's
//! generation in `generation`, `untracked` outside the model (or cleared by reset()), `aborted`
//! if its communicator was aborted or failed meanwhile.
Grant acquire_device(Comm& comm, const Collective& c, WaitRecord& record, std::uint64_t& generation) {
    if (c.ticket == 0) return Grant::untracked;
    DeviceSched& d = sched(comm.device);
    std::unique_lock lock(d.m);
    if (d.unstarted.count(c.ticket) == 0) return Grant::untracked;  // cleared by reset()
    d.ready.insert(c.ticket);
    d.cv.notify_all();
    const bool latest = prefers_latest(comm.device);
    const auto window_end = clock_type::now() + hazard_window;
    for (;;) {
        if (comm.aborted.load() || failure(comm.error.load())) {
            d.unstarted.erase(c.ticket);
            d.ready.erase(c.ticket);
            d.cv.notify_all();
            return Grant::aborted;
        }
        if (d.unstarted.count(c.ticket) == 0) return Grant::untracked;  // cleared by reset()
        if (!d.busy) {
            std::uint64_t pick = 0;
            if (c.ordered)
                pick = d.unstarted.begin()->first;  // the launch-order rule: the host's order
            else if (!latest)
                pick = *d.ready.begin();
            else if (d.ready.size() > 1 || clock_type::now() >= window_end || !others_queued(d, comm.clique->id))
                pick = *d.ready.rbegin();
            if (pick == c.ticket) {
                d.busy = true;
                d.unstarted.erase(c.ticket);
                d.ready.erase(c.ticket);
                generation = d.generation;
                return Grant::held;
            }
        }
        lock.unlock();
        record.tick();
        lock.lock();
        d.cv.wait_for(lock, std::chrono::milliseconds(1));
    }
}

void release_device(int device, std::uint64_t generation) {
    DeviceSched& d = sched(device);
    {
        std::lock_guard lock(d.m);
        if (d.generation != generation) return;  // reset() cleared the device meanwhile
        d.busy = false;
    }
    d.cv.notify_all();
}

//! The op a rank's stream worker runs: blocks it until every rank's op of this sequence number
//! arrived (or the collective failed, or this communicator was aborted).
void meet(const std::shared_ptr<Comm>& comm, std::uint64_t seq, const Collective& c, WaitRecord& record) {
    Clique& q = *comm->clique;
    std::unique_lock lock(q.m);
    if (comm->aborted.load() || failure(comm->error.load())) return;  // no-op: its error stays
    Slot& slot = q.slots[seq];
    const auto leave = [&] {
        if (++slot.left == q.nranks) q.slots.erase(seq);
    };
    if (slot.in.empty()) slot.in.resize(static_cast<std::size_t>(q.nranks));
    if (slot.failed) {
        comm->error.store(ncclRemoteError);
        leave();
        return;
    }
    if (c.fails) {
        slot.failed = true;
        comm->error.store(ncclSystemError);
        for (std::size_t r = 0; r < slot.in.size(); ++r)
            if (slot.in[r].recv != nullptr && q.members[r] != nullptr) q.members[r]->error.store(ncclRemoteError);
        q.cv.notify_all();
        leave();
        return;
    }
    slot.in[static_cast<std::size_t>(comm->rank)] = {c.send, c.recv, true};
    if (++slot.arrived == q.nranks) {
        // Every input is read here, before any rank's op completes (in-place buffers stay intact).
        slot.result.resize(c.count * type_size(c.type));
        if (c.root >= 0) {
            std::memcpy(slot.result.data(), slot.in[static_cast<std::size_t>(c.root)].send, slot.result.size());
        } else {
            std::vector<const void*> inputs;
            for (const auto& a : slot.in) inputs.push_back(a.send);
            reduce_any(c.type, inputs, slot.result.data(), c.count, c.op, Plan{c.count, slot.result.size(), c.captured});
        }
        slot.ready = true;
        q.cv.notify_all();
    } else {
        while (
            !q.cv.wait_for(lock, WaitRecord::publish_after, [&] { return slot.ready || slot.failed || comm->aborted.load(); })) {
            lock.unlock();  // describe_waits() takes the clique's lock
            record.tick();
            lock.lock();
        }
    }
    if (slot.ready && !comm->aborted.load())
        std::memcpy(c.recv, slot.result.data(), slot.result.size());
    else if (slot.failed)
        comm->error.store(ncclRemoteError);
    leave();
}

void run_collective(const std::shared_ptr<Comm>& comm, std::uint64_t seq, const Collective& c) {
    if (sticky(comm->device) != cudaSuccess) {  // a dead context runs no kernel
        drop_ticket(comm->device, c.ticket);
        return;
    }
    WaitRecord record(comm, seq, c);
    std::uint64_t generation = 0;
    const Grant grant = acquire_device(*comm, c, record, generation);
    if (grant == Grant::aborted) return;
    record.started();
    meet(comm, seq, c, record);
    if (grant == Grant::held) release_device(comm->device, generation);
}

//! Enqueues collective `c` of `comm` on `s` after `deps`: its sequence number, its injection, its
//! ticket under the hazard model. Returns its op's number on `s`.
std::uint64_t submit_collective(const std::shared_ptr<Comm>& comm, const std::shared_ptr<Stream>& s, Collective c,
                                std::vector<Dep> deps) {
    {
        Registry& reg = registry();
        std::lock_guard lock(reg.m);
        if (auto it = reg.fail_in.find(comm->rank); it != reg.fail_in.end() && it->second > 0 && --it->second == 0) {
            c.fails = true;
            reg.fail_in.erase(it);
        }
    }
    std::uint64_t seq = 0;
    {
        std::lock_guard lock(comm->m);
        seq = ++comm->next_seq;
    }
    c.ordered = comm->ordered;
    // Under the hazard model the ticket and the stream position are taken together, so that the
    // host's order is the enqueue order.
    std::unique_lock<std::mutex> ticketing;
    if (hazard_on()) {
        DeviceSched& d = sched(comm->device);
        ticketing = std::unique_lock(d.m);
        c.ticket = ++d.next_ticket;
        d.unstarted.emplace(c.ticket, comm->clique->id);
    }
    Op op;
    op.deps = std::move(deps);
    op.device_work = false;  // run_collective drops it on a dead device, giving its ticket back
    op.body = [comm, seq, c] { run_collective(comm, seq, c); };
    const std::uint64_t at = enqueue(s, std::move(op));
    if (ticketing.owns_lock()) ticketing.unlock();
    std::lock_guard lock(comm->m);
    bool found = false;
    for (auto& [st, n] : comm->last_ops)
        if (st == s) n = at, found = true;
    if (!found) comm->last_ops.emplace_back(s, at);
    return at;
}

// hold_nccl_launches: non-blocking launch threads wait at this gate while it is closed.
std::mutex gate_m;
std::condition_variable gate_cv;
bool gate_closed = false;

void launch_gate_wait() {
    std::unique_lock lock(gate_m);
    gate_cv.wait(lock, [] { return !gate_closed; });
}

ncclResult_t enqueue_collective(ncclComm_t handle, cudaStream_t stream, Collective c, const char* name) {
    const auto comm = find(handle);
    if (comm == nullptr) return refuse(ncclInvalidArgument, std::string(name) + ": not a live communicator");
    if (const ncclResult_t e = comm->error.load(); e != ncclSuccess)
        return e == ncclInProgress ? refuse(ncclInvalidUsage, std::string(name) + ": the communicator is not ready")
                                   : refuse(e, std::string(name) + ": the communicator holds an error");
    if (type_size(c.type) == 0) return refuse(ncclInvalidArgument, std::string(name) + ": data type not modelled");
    if (c.op < ncclSum || c.op > ncclAvg) return refuse(ncclInvalidArgument, std::string(name) + ": invalid reduction");
    if (c.root >= comm->clique->nranks) return refuse(ncclInvalidArgument, std::string(name) + ": invalid root");
    std::shared_ptr<Stream> s;
    if (resolve_stream_on(stream, comm->device, s) != cudaSuccess)
        return refuse(ncclInvalidArgument, std::string(name) + ": invalid stream");
    if (s->device != comm->device)
        return refuse(ncclInvalidUsage, std::string(name) + ": the stream belongs to another device than the communicator");
    if (sticky(comm->device) != cudaSuccess) return refuse(ncclUnhandledCudaError, std::string(name) + ": CUDA error");
    if (capture_admits(s) != cudaSuccess) return refuse(ncclInvalidUsage, std::string(name) + ": the stream's capture failed");
    if (c.count == 0) return ncclSuccess;
    const std::size_t bytes = c.count * type_size(c.type);
    const bool needs_send = c.root < 0 || c.root == comm->rank;
    if ((needs_send && device_of_range(c.send, bytes) != comm->device) || device_of_range(c.recv, bytes) != comm->device)
        return refuse(ncclInvalidArgument, std::string(name) + ": a buffer is not device memory of the communicator's device");
    c.name = name;
    if (s->capturing.load()) {
        // A graph's collective takes its sequence number, and counts for the injections, at each
        // replay, as NCCL's captured kernels meet their peers' at each launch.
        capture_hold(s, std::make_shared<GraphHold>(comm));
        capture_submit(s, [comm, c](const std::shared_ptr<Stream>& lane, std::vector<Dep> deps) {
            if (comm->aborted.load() || comm->destroyed.load()) {
                // A GPU graph whose communicator is gone runs a kernel on freed NCCL state: a fault
                // or a hang. The double faults, named: such a graph must be captured again.
                Op op = fault_op(comm->device, std::string("a graph launched ") + c.name + " of rank " +
                                                   std::to_string(comm->rank) + " after its communicator was " +
                                                   (comm->destroyed.load() ? "destroyed" : "aborted") +
                                                   " (cudaErrorIllegalAddress); capture it again on the new communicator");
                op.deps = std::move(deps);
                return enqueue(lane, std::move(op));
            }
            const std::size_t bytes = c.count * type_size(c.type);
            if ((c.root < 0 || c.root == comm->rank ? device_of_range(c.send, bytes) != comm->device : false) ||
                device_of_range(c.recv, bytes) != comm->device) {
                Op op =
                    fault_op(comm->device, std::string("a graph launched ") + c.name + " of rank " + std::to_string(comm->rank) +
                                               " on a buffer freed since its capture (cudaErrorIllegalAddress)");
                op.deps = std::move(deps);
                return enqueue(lane, std::move(op));
            }
            Collective replayed = c;
            replayed.captured = true;
            return submit_collective(comm, lane, replayed, std::move(deps));
        });
        return ncclSuccess;
    }
    if (!comm->blocking && group_depth == 0) {
        // NCCL 2.28 launches a non-blocking communicator's (implicitly grouped) work on a thread
        // it starts for the call (groupLaunchNonBlocking): the call returns ncclInProgress, and the
        // communicator reads ncclInProgress, refusing more work, until that thread has enqueued
        // it. The caller polls ncclCommGetAsyncError before its next call on the stream.
        // From success only: an earlier collective's failure, stored meanwhile by a stream worker,
        // stays the communicator's error.
        ncclResult_t ready = ncclSuccess;
        if (!comm->error.compare_exchange_strong(ready, ncclInProgress))
            return refuse(failure(ready) ? ready : ncclInvalidUsage, std::string(name) + ": the communicator is not ready");
        try {
            std::thread([comm, s, c] {
                launch_gate_wait();
                submit_collective(comm, s, c, {});
                ncclResult_t launching = ncclInProgress;
                comm->error.compare_exchange_strong(launching, ncclSuccess);
            }).detach();
        } catch (...) {
            comm->error.store(ncclSystemError);
            return refuse(ncclSystemError, std::string(name) + ": could not start NCCL's launch thread");
        }
        return ncclInProgress;
    }
    submit_collective(comm, s, c, {});
    return ncclSuccess;
}

//! Finalize completes once every rank called it and this rank's collectives all ran.
void settle_finalize(Comm& comm) {
    std::vector<std::pair<std::shared_ptr<Stream>, std::uint64_t>> ops;
    {
        std::lock_guard lock(comm.m);
        if (!comm.finalizing || comm.error.load() != ncclInProgress) return;
        ops = comm.last_ops;
    }
    {
        std::lock_guard lock(comm.clique->m);
        if (comm.clique->finalized < comm.clique->nranks) return;
    }
    if (comm.graph_holds.load() > 0) return;  // a live graph still holds it
    for (auto& [s, n] : ops)
        if (!reached(*s, n)) return;
    ncclResult_t expected = ncclInProgress;
    comm.error.compare_exchange_strong(expected, ncclSuccess);
}

//! Waits (bounded) until `comm` leaves ncclInProgress; for blocking communicators.
ncclResult_t wait_ready(Comm& comm, bool finalizing) {
    const auto deadline = clock_type::now() + blocking_deadline;
    for (;;) {
        if (finalizing) settle_finalize(comm);
        const ncclResult_t e = comm.error.load();
        if (e != ncclInProgress) return e;
        if (clock_type::now() > deadline) return refuse(ncclSystemError, "timed out waiting for the other ranks");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

std::string id_key(const ncclUniqueId& id) { return std::string(id.internal, sizeof id.internal); }


//! NCCL_LAUNCH_ORDER_IMPLICIT as NCCL reads it: once per process, when NCCL initializes, which is
//! the first ncclGetUniqueId or communicator init (that starts its bootstrap thread, whose reads
//! race a later setenv): the variable must be set before either.
bool launch_order_rule() {
    static const bool rule = [] {
        const char* order = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
        return order != nullptr && std::strtol(order, nullptr, 10) != 0;
    }();
    return rule;
}

}  // namespace

namespace lockstep::host_cuda {

void fail_nccl(int rank, int k) {
    Registry& reg = registry();
    std::lock_guard lock(reg.m);
    if (k <= 0)
        reg.fail_in.erase(rank);
    else
        reg.fail_in[rank] = k;
}

void set_nccl_hazard(bool on) { hazard_setting.store(on ? 1 : 0); }

void hold_nccl_launches(bool held) {
    {
        std::lock_guard lock(gate_m);
        gate_closed = held;
    }
    gate_cv.notify_all();
}

std::vector<std::string> nccl_waits() { return describe_waits(); }

void set_nccl_version(int version) {
    Registry& reg = registry();
    std::lock_guard lock(reg.m);
    reg.version = version;
}

namespace detail {
void reset_nccl_injections() {
    Registry& reg = registry();
    std::lock_guard lock(reg.m);
    reg.fail_in.clear();
    reg.version = default_version;
    hazard_setting.store(-1);
    hold_nccl_launches(false);
    for (int d = 0; d < max_devices; ++d) {
        DeviceSched& ds = sched(d);
        {
            std::lock_guard dl(ds.m);
            ++ds.generation;
            ds.busy = false;
            ds.unstarted.clear();
            ds.ready.clear();
        }
        ds.cv.notify_all();
    }
}
}  // namespace detail

}  // namespace lockstep::host_cuda

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
    if (version == nullptr) return refuse(ncclInvalidArgument, "ncclGetVersion: null pointer");
    Registry& reg = registry();
    std::lock_guard lock(reg.m);
    *version = reg.version;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
    if (uniqueId == nullptr) return refuse(ncclInvalidArgument, "ncclGetUniqueId: null pointer");
    (void)launch_order_rule();  // NCCL initializes here
    std::memset(uniqueId->internal, 0, sizeof uniqueId->internal);
    static std::random_device rd;
    Registry& reg = registry();
    std::lock_guard lock(reg.m);
    const std::uint64_t n = reg.next_id++, r = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    std::memcpy(uniqueId->internal, "lockstep-hostcuda", 17);
    std::memcpy(uniqueId->internal + 24, &n, sizeof n);
    std::memcpy(uniqueId->internal + 32, &r, sizeof r);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config) {
    if (comm == nullptr) return refuse(ncclInvalidArgument, "ncclCommInitRankConfig: null comm pointer");
    *comm = nullptr;
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return refuse(ncclInvalidArgument, "ncclCommInitRankConfig: invalid rank or nranks");
    const int device = current_device();
    if (sticky(device) != cudaSuccess) return refuse(ncclUnhandledCudaError, "ncclCommInitRankConfig: CUDA error");
    auto c = std::make_shared<Comm>();
    c->rank = rank;
    c->device = device;
    c->blocking = config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
    c->ordered = launch_order_rule();
    Registry& reg = registry();
    {
        std::lock_guard lock(reg.m);
        std::shared_ptr<Clique> q = reg.cliques[id_key(commId)].lock();
        if (q == nullptr) {
            q = std::make_shared<Clique>(nranks, reg.next_clique++);
            reg.cliques[id_key(commId)] = q;
        }
        std::lock_guard qlock(q->m);
        if (q->nranks != nranks)
            return refuse(ncclInvalidArgument, "ncclCommInitRankConfig: nranks differs from the other ranks'");
        if (q->members[static_cast<std::size_t>(rank)] != nullptr)
            return refuse(ncclInvalidUsage, "ncclCommInitRankConfig: rank joined twice");
        for (const Comm* m : q->members)
            if (m != nullptr && m->device == device)
                return refuse(ncclInvalidUsage, "ncclCommInitRankConfig: two ranks on one device (NCCL refuses them)");
        c->clique = q;
        q->members[static_cast<std::size_t>(rank)] = c.get();
        if (++q->joined == nranks)
            for (Comm* m : q->members) m->error.store(ncclSuccess);
        reg.live[c.get()] = c;
    }
    *comm = reinterpret_cast<ncclComm_t>(c.get());
    if (c->error.load() == ncclSuccess) return ncclSuccess;
    if (!c->blocking) {
        if (group_depth > 0) {
            group_in_progress = true;
            return ncclSuccess;
        }
        return ncclInProgress;
    }
    if (group_depth > 0) {  // one thread may init several ranks in a group: wait at ncclGroupEnd
        group_blocking.emplace_back(c, false);
        return ncclSuccess;
    }
    return wait_ready(*c, false);
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
    return ncclCommInitRankConfig(comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
    if (comms == nullptr || ndev < 1) return refuse(ncclInvalidArgument, "ncclCommInitAll: invalid arguments");
    for (int i = 0; i < ndev; ++i) {
        const int d = devlist == nullptr ? i : devlist[i];
        if (d < 0 || d >= device_count()) return refuse(ncclInvalidArgument, "ncclCommInitAll: invalid device");
        for (int j = 0; j < i; ++j)
            if ((devlist == nullptr ? j : devlist[j]) == d)
                return refuse(ncclInvalidUsage, "ncclCommInitAll: two ranks on one device (NCCL refuses them)");
    }
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    const int previous = current_device();
    ncclGroupStart();
    for (int i = 0; i < ndev; ++i) {
        (void)cudaSetDevice(devlist == nullptr ? i : devlist[i]);
        if (const ncclResult_t r = ncclCommInitRank(&comms[i], ndev, id, i); r != ncclSuccess) {
            (void)cudaSetDevice(previous);
            ncclGroupEnd();
            return r;
        }
    }
    (void)cudaSetDevice(previous);
    return ncclGroupEnd();
}

ncclResult_t ncclGroupStart(void) {
    ++group_depth;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (group_depth == 0) return refuse(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--group_depth > 0) return ncclSuccess;
    auto deferred = std::move(group_blocking);
    group_blocking.clear();
    ncclResult_t result = std::exchange(group_in_progress, false) ? ncclInProgress : ncclSuccess;
    for (const auto& [c, finalizing] : deferred)
        if (const ncclResult_t r = wait_ready(*c, finalizing); r != ncclSuccess) result = r;
    return result;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    Collective c;
    c.send = sendbuff;
    c.recv = recvbuff;
    c.count = count;
    c.type = datatype;
    c.op = op;
    return enqueue_collective(comm, stream, c, "ncclAllReduce");
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
    if (root < 0) return refuse(ncclInvalidArgument, "ncclBroadcast: invalid root");
    Collective c;
    c.send = sendbuff;
    c.recv = recvbuff;
    c.count = count;
    c.type = datatype;
    c.root = root;
    return enqueue_collective(comm, stream, c, "ncclBroadcast");
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
    return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
    const auto c = find(comm);
    if (c == nullptr || asyncError == nullptr) return refuse(ncclInvalidArgument, "ncclCommGetAsyncError: invalid argument");
    settle_finalize(*c);
    *asyncError = c->error.load();
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm == nullptr) return ncclSuccess;
    std::shared_ptr<Comm> c;
    {
        Registry& reg = registry();
        std::lock_guard lock(reg.m);
        auto it = reg.live.find(comm);
        if (it == reg.live.end()) return refuse(ncclInvalidArgument, "ncclCommAbort: not a live communicator");
        c = it->second;
        reg.live.erase(it);
        reg.dead.push_back(c);
    }
    {
        // Releases this communicator's ops waiting in a collective; its queued ones become no-ops.
        std::lock_guard lock(c->clique->m);
        c->aborted.store(true);
    }
    c->clique->cv.notify_all();
    // Then the call returns only once no graph holds the communicator, non-blocking or not.
    wait_for_graphs(*c, "ncclCommAbort");
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    const auto c = find(comm);
    if (c == nullptr) return refuse(ncclInvalidArgument, "ncclCommFinalize: not a live communicator");
    if (const ncclResult_t e = c->error.load(); e != ncclSuccess)
        return e == ncclInProgress ? refuse(ncclInvalidUsage, "ncclCommFinalize: the communicator is busy") : e;
    {
        std::lock_guard lock(c->m);
        c->finalizing = true;
        c->error.store(ncclInProgress);
    }
    {
        std::lock_guard lock(c->clique->m);
        ++c->clique->finalized;
    }
    if (!c->blocking) {
        settle_finalize(*c);
        return c->error.load() == ncclSuccess ? ncclSuccess : ncclInProgress;
    }
    if (group_depth > 0) {  // one thread may finalize several ranks in a group
        group_blocking.emplace_back(c, true);
        return ncclSuccess;
    }
    return wait_ready(*c, true);
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm == nullptr) return ncclSuccess;
    std::shared_ptr<Comm> c;
    {
        Registry& reg = registry();
        std::lock_guard lock(reg.m);
        auto it = reg.live.find(comm);
        if (it == reg.live.end()) return refuse(ncclInvalidArgument, "ncclCommDestroy: not a live communicator");
        c = it->second;
    }
    wait_for_graphs(*c, "ncclCommDestroy");  // as NCCL: a graph that captured it must be destroyed first
    Registry& reg = registry();
    std::lock_guard lock(reg.m);
    auto it = reg.live.find(comm);
    if (it == reg.live.end()) return refuse(ncclInvalidArgument, "ncclCommDestroy: not a live communicator");
    it->second->destroyed.store(true);
    reg.dead.push_back(std::move(it->second));
    reg.live.erase(it);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
    const auto c = find(comm);
    if (c == nullptr || count == nullptr) return refuse(ncclInvalidArgument, "ncclCommCount: invalid argument");
    *count = c->clique->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
    const auto c = find(comm);
    if (c == nullptr || rank == nullptr) return refuse(ncclInvalidArgument, "ncclCommUserRank: invalid argument");
    *rank = c->rank;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
    const auto c = find(comm);
    if (c == nullptr || device == nullptr) return refuse(ncclInvalidArgument, "ncclCommCuDevice: invalid argument");
    *device = c->device;
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
        case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
        case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
        case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
        case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
        default: return "unknown result code";
    }
}

const char* ncclGetLastError(ncclComm_t /*comm*/) { return last_message.c_str(); }

}  // extern "C"
