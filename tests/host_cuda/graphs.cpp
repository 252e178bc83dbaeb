// SPDX-License-Identifier: MIT
//! lockstep's host CUDA device: stream capture, graphs and their replay, user objects.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>

#include "detail.hpp"

namespace lockstep::host_cuda::detail {
namespace {

struct UserObject {
    void* ptr = nullptr;
    cudaHostFn_t destroy = nullptr;
    std::atomic<long long> refs{0};
};

//! Drops `count` references; the last one calls the destructor (wherever it is dropped: a host
//! call, or the worker of the last replay, as CUDA's own thread does for cudaUserObjectNoDestructorSync).
void release_object(UserObject& o, unsigned count) {
    if (o.refs.fetch_sub(count) == static_cast<long long>(count)) o.destroy(o.ptr);
}

//! One node of a captured graph: a kernel launch (`fn`) or other work (`submit`).
struct Node {
    int lane = 0;           // the capturing stream it came from
    std::vector<int> deps;  // earlier nodes it waits for (besides the one before it on its lane)
    Submit submit;
    cudaHostFn_t fn = nullptr;
    void* data = nullptr;
    std::string name;
    std::vector<std::pair<const void*, std::size_t>> device_ranges;  // checked again at each launch
};

//! What a graph is, shared by the graph handle and its executables; the last replay may release it.
struct GraphData {
    int device = 0;
    int lanes = 0;
    std::vector<Node> nodes;
    std::vector<GraphBlock> blocks;  // cudaMallocAsync in the capture
    std::size_t memory_bytes = 0;    // what they need once mapped (each rounded as a device block)
    std::set<void*> unfreed;         // of those, not freed in it
    std::vector<std::pair<std::shared_ptr<UserObject>, unsigned>> objects;
    // Released with the graph's data: once its last handle is gone and its launches in flight have
    // run (capture_hold), as CUDA frees an executable destroyed in flight when its launch ends.
    std::vector<std::shared_ptr<void>> holds;
    int handles = 0;  // the graph and its executables (under Graphs::m)
    int execs = 0;    // its executables: one at most where it allocates (under Graphs::m)
    ~GraphData() {
        for (const GraphBlock& b : blocks) release_graph_block(b);
        for (auto& [o, n] : objects) release_object(*o, n);
    }
};

struct GraphHandle {
    std::shared_ptr<GraphData> data;  // null once destroyed
    bool capturing = false;           // still being built by a capture
};

struct ExecHandle {
    std::shared_ptr<GraphData> data;                                         // null once destroyed
    bool mapped = false;  // its allocations have memory (uploaded or launched; under Graphs::m)
    std::vector<std::shared_ptr<Stream>> lanes;                              // one internal stream per lane
    std::shared_ptr<std::mutex> replaying = std::make_shared<std::mutex>();  // one launch enqueues at a time
    // Under `replaying`: each lane's last op of the previous launch, which the next launch follows
    // (CUDA orders the launches of one executable, whatever their streams).
    std::shared_ptr<std::vector<std::uint64_t>> tails = std::make_shared<std::vector<std::uint64_t>>();
};

struct LaneState {
    std::shared_ptr<Stream> stream;
    int lane = 0;
    int last = -1;             // its last node
    std::vector<int> pending;  // what its next node waits for (events it waited on)
};

}  // namespace

struct Capture {
    unsigned long long id = 0;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
    std::thread::id thread;
    std::shared_ptr<Stream> origin;
    std::shared_ptr<GraphData> data;
    GraphHandle* graph = nullptr;
    std::map<const Stream*, LaneState> streams;
    bool invalidated = false;
};

namespace {

struct Graphs {
    std::mutex m;
    std::vector<std::shared_ptr<Capture>> active;
    std::atomic<int> active_count{0};
    std::unordered_map<const void*, std::unique_ptr<GraphHandle>> graphs;
    std::unordered_map<const void*, std::unique_ptr<ExecHandle>> execs;
    std::unordered_map<const void*, std::shared_ptr<UserObject>> objects;
    // Destroyed handles are kept so that their addresses never come back as new ones.
    std::vector<std::unique_ptr<GraphHandle>> dead_graphs;
    std::vector<std::unique_ptr<ExecHandle>> dead_execs;
    unsigned long long next_id = 1;
};

Graphs& graphs() {
    static Graphs* g = new Graphs;  // leaked: workers may release graphs during static destruction
    return *g;
}

thread_local cudaStreamCaptureMode thread_mode = cudaStreamCaptureModeGlobal;

LaneState& lane_of(Capture& c, const Stream& s) { return c.streams.at(&s); }

void append(Capture& c, const Stream& s, Node n) {
    LaneState& l = lane_of(c, s);
    n.lane = l.lane;
    n.deps = std::exchange(l.pending, {});
    l.last = static_cast<int>(c.data->nodes.size());
    c.data->nodes.push_back(std::move(n));
}

//! Appends `n` to the capture of `s`; dropped where the capture has ended or failed (its end says so).
void record(const std::shared_ptr<Stream>& s, Node n) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    if (s->capture != nullptr && !s->capture->invalidated) append(*s->capture, *s, std::move(n));
}

std::vector<int> tail_of(const LaneState& l) {
    std::vector<int> t = l.pending;
    if (l.last >= 0) t.push_back(l.last);
    return t;
}

//! A graph's last handle is gone: its blocks are no longer usable (released with its data).
void drop_handle(GraphData& d) {
    if (--d.handles == 0)
        for (const GraphBlock& b : d.blocks) retire_graph_block(b);
}

//! Ends capture `c` on every stream it holds (under Graphs::m).
void end(Graphs& g, const std::shared_ptr<Capture>& c) {
    for (auto& [_, l] : c->streams) {
        l.stream->capturing.store(false);
        l.stream->capture.reset();
    }
    std::erase(g.active, c);
    g.active_count.store(static_cast<int>(g.active.size()));
}

//! Discards the graph of capture `c`, which ended without one.
void discard(Graphs& g, Capture& c) {
    c.graph->capturing = false;
    c.graph->data.reset();
    drop_handle(*c.data);
    auto it = g.graphs.find(c.graph);
    g.dead_graphs.push_back(std::move(it->second));
    g.graphs.erase(it);
}

//! Whether every stream that joined `c` rejoined its origin: each one's last node is an
//! ancestor of the origin's tail.
bool joined(const Capture& c) {
    const auto& nodes = c.data->nodes;
    std::vector<int> previous(nodes.size(), -1);  // the node before on the same lane
    std::map<int, int> last_on_lane;
    for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
        if (auto it = last_on_lane.find(nodes[i].lane); it != last_on_lane.end()) previous[i] = it->second;
        last_on_lane[nodes[i].lane] = i;
    }
    std::vector<bool> seen(nodes.size(), false);
    std::vector<int> todo = tail_of(c.streams.at(c.origin.get()));
    while (!todo.empty()) {
        const int i = todo.back();
        todo.pop_back();
        if (seen[i]) continue;
        seen[i] = true;
        todo.insert(todo.end(), nodes[i].deps.begin(), nodes[i].deps.end());
        if (previous[i] >= 0) todo.push_back(previous[i]);
    }
    for (const auto& [_, l] : c.streams)
        if (l.last >= 0 && !seen[l.last]) return false;
    return true;
}

}  // namespace

cudaError_t capture_admits(const std::shared_ptr<Stream>& s, bool invalidate) {
    Graphs& g = graphs();
    if (g.active_count.load() == 0 || (!s->capturing.load() && !s->legacy)) return cudaSuccess;
    std::lock_guard lock(g.m);
    if (s->capture != nullptr) return s->capture->invalidated ? fail(cudaErrorStreamCaptureInvalidated) : cudaSuccess;
    if (!s->legacy) return cudaSuccess;
    bool implicit = false;
    for (const auto& c : g.active)
        if (c->data->device == s->device)
            for (const auto& [_, l] : c->streams)
                if (l.stream->blocking) {
                    if (invalidate) c->invalidated = true;
                    implicit = true;
                }
    return implicit ? fail(cudaErrorStreamCaptureImplicit) : cudaSuccess;
}

void capture_op(const std::shared_ptr<Stream>& s, Op op) {
    Node n;
    n.device_ranges = op.device_ranges;
    n.submit = [op = std::move(op)](const std::shared_ptr<Stream>& lane, std::vector<Dep> deps) {
        Op o;
        o.deps = std::move(deps);
        o.body = op.body;
        o.device_work = op.device_work;
        return enqueue(lane, std::move(o));
    };
    record(s, std::move(n));
}

void capture_submit(const std::shared_ptr<Stream>& s, Submit submit) {
    Node n;
    n.submit = std::move(submit);
    record(s, std::move(n));
}

void capture_launch(const std::shared_ptr<Stream>& s, cudaHostFn_t fn, void* data, std::string name) {
    Node n;
    n.fn = fn;
    n.data = data;
    n.name = std::move(name);
    record(s, std::move(n));
}

cudaError_t capture_unsafe_call() {
    Graphs& g = graphs();
    if (g.active_count.load() == 0 || thread_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
    std::lock_guard lock(g.m);
    const auto me = std::this_thread::get_id();
    bool refused = false;
    for (const auto& c : g.active) {
        const bool own = c->thread == me && c->mode != cudaStreamCaptureModeRelaxed;
        const bool other =
            c->thread != me && c->mode == cudaStreamCaptureModeGlobal && thread_mode == cudaStreamCaptureModeGlobal;
        if (own || other) {
            c->invalidated = true;
            refused = true;
        }
    }
    return refused ? fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

cudaError_t capture_refuse(const std::shared_ptr<Stream>& s) {
    if (!s->capturing.load()) return cudaSuccess;
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    if (s->capture == nullptr) return cudaSuccess;
    s->capture->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported);
}

void unmap_idle_executables(int device) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    for (auto& [handle, x] : g.execs) {
        if (x->data == nullptr || !x->mapped || x->data->device != device) continue;
        bool idle = true;
        {
            std::lock_guard replaying(*x->replaying);
            for (std::size_t l = 0; l < x->tails->size() && l < x->lanes.size(); ++l)
                idle = idle && ((*x->tails)[l] == 0 || reached(*x->lanes[l], (*x->tails)[l]));
        }
        if (!idle) continue;
        x->mapped = false;  // its next launch maps again, and may fail
        unmap_graph_memory(device, x->data->memory_bytes);
    }
}

cudaError_t capture_refuse_device(int device) {
    Graphs& g = graphs();
    if (g.active_count.load() == 0) return cudaSuccess;
    std::lock_guard lock(g.m);
    bool refused = false;
    for (const auto& c : g.active)
        if (c->data->device == device) {
            c->invalidated = true;
            refused = true;
        }
    return refused ? fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

std::shared_ptr<CaptureMark> capture_mark(const std::shared_ptr<Stream>& s) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    auto mark = std::make_shared<CaptureMark>();
    if (s->capture == nullptr) return mark;
    mark->capture = s->capture;
    mark->tail = tail_of(lane_of(*s->capture, *s));
    return mark;
}

cudaError_t capture_wait(const std::shared_ptr<Stream>& s, const CaptureMark& mark) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    const auto c = mark.capture.lock();
    if (c == nullptr || std::find(g.active.begin(), g.active.end(), c) == g.active.end())
        return fail(cudaErrorCapturedEvent);  // recorded in a capture that has ended
    if (s->capture != nullptr && s->capture != c) {
        s->capture->invalidated = c->invalidated = true;
        return fail(cudaErrorStreamCaptureMerge);
    }
    if (c->invalidated) return fail(cudaErrorStreamCaptureInvalidated);
    if (s->capture == nullptr) {
        if (s->legacy) {
            c->invalidated = true;
            return fail(cudaErrorStreamCaptureImplicit);
        }
        // The double's graphs run on one device (its lanes are streams of that device).
        if (s->device != c->data->device) return fail(cudaErrorNotSupported);
        c->streams[s.get()] = LaneState{s, c->data->lanes++, -1, mark.tail};
        s->capture = c;
        s->capturing.store(true);
        return cudaSuccess;
    }
    auto& pending = lane_of(*c, *s).pending;
    for (int t : mark.tail)
        if (std::find(pending.begin(), pending.end(), t) == pending.end()) pending.push_back(t);
    return cudaSuccess;
}

cudaError_t capture_isolation(const std::shared_ptr<Stream>& s) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    if (s->capture != nullptr) s->capture->invalidated = true;
    return fail(cudaErrorStreamCaptureIsolation);
}

//! A node that fills a graph's block with 0xFF (NaN as float) when it runs: memory a graph
//! allocates is new at each launch, and unusable after its free, as on a GPU whose graph
//! allocations may share memory with others.
Node poison_node(const GraphBlock& b) {
    Node n;
    n.submit = [p = b.p, size = b.size](const std::shared_ptr<Stream>& lane, std::vector<Dep> deps) {
        Op op;
        op.deps = std::move(deps);
        op.body = [p, size] { std::memset(p, 0xFF, size); };
        return enqueue(lane, std::move(op));
    };
    return n;
}

void capture_hold(const std::shared_ptr<Stream>& s, std::shared_ptr<void> hold) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    if (s->capture != nullptr) s->capture->data->holds.push_back(std::move(hold));
}

void capture_allocation(const std::shared_ptr<Stream>& s, void* p) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    if (s->capture == nullptr || p == nullptr) return;
    const GraphBlock b = own_by_graph(p);
    s->capture->data->blocks.push_back(b);
    s->capture->data->memory_bytes += (std::max<std::size_t>(b.size, 1) + 255) / 256 * 256;
    s->capture->data->unfreed.insert(p);
    if (!s->capture->invalidated) append(*s->capture, *s, poison_node(b));
}

cudaError_t capture_free(const std::shared_ptr<Stream>& s, void* p) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    if (s->capture == nullptr) return cudaSuccess;
    if (s->capture->data->unfreed.erase(p) == 1) {
        for (const GraphBlock& b : s->capture->data->blocks)
            if (b.p == p && !s->capture->invalidated) append(*s->capture, *s, poison_node(b));
        return cudaSuccess;
    }
    // The double's graphs free only what they allocated (CUDA could free other memory once).
    s->capture->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported);
}

Op fault_op(int device, std::string what) {
    Op op;
    op.body = [device, what = std::move(what)] {
        std::fprintf(stderr, "host CUDA device: %s\n", what.c_str());
        set_sticky(device, cudaErrorIllegalAddress);
    };
    return op;
}

void reset_captures() {
    std::vector<std::shared_ptr<Capture>> ended;  // their graphs' data is released after the lock
    {
        Graphs& g = graphs();
        std::lock_guard lock(g.m);
        ended = g.active;
        for (const auto& c : ended) {
            end(g, c);
            discard(g, *c);
        }
    }
    thread_mode = cudaStreamCaptureModeGlobal;
}

namespace {
//! The live executable `h` for work on `s`, its allocations given their memory unless they have
//! it (at its upload or first launch; under Graphs::m): null, with the error in `e`, when it is
//! not a live executable, belongs to another device than `s` or its memory cannot be had.
ExecHandle* ready_exec(Graphs& g, cudaGraphExec_t h, const Stream& s, cudaError_t& e) {
    auto it = g.execs.find(h);
    e = it == g.execs.end() || it->second->data == nullptr ? cudaErrorInvalidResourceHandle
        : s.device != it->second->data->device             ? cudaErrorInvalidValue
                                                           : cudaSuccess;
    if (e != cudaSuccess) return nullptr;
    ExecHandle& x = *it->second;
    if (!x.mapped && x.data->memory_bytes != 0) {
        if ((e = map_graph_memory(x.data->device, x.data->memory_bytes)) != cudaSuccess) return nullptr;
        x.mapped = true;
    }
    return &x;
}
}  // namespace

}  // namespace lockstep::host_cuda::detail

using namespace lockstep::host_cuda::detail;

extern "C" {

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(stream, s); e != cudaSuccess) return e;
    if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal && mode != cudaStreamCaptureModeRelaxed)
        return fail(cudaErrorInvalidValue);
    if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported);
    if (const cudaError_t e = sticky(s->device); e != cudaSuccess) return e;
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    if (s->capture != nullptr) return fail(cudaErrorIllegalState);
    auto c = std::make_shared<Capture>();
    c->id = g.next_id++;
    c->mode = mode;
    c->thread = std::this_thread::get_id();
    c->origin = s;
    c->data = std::make_shared<GraphData>();
    c->data->device = s->device;
    c->data->lanes = 1;
    c->data->handles = 1;
    auto handle = std::make_unique<GraphHandle>();
    handle->data = c->data;
    handle->capturing = true;
    c->graph = handle.get();
    g.graphs[handle.get()] = std::move(handle);
    c->streams[s.get()] = LaneState{s, 0, -1, {}};
    s->capture = c;
    s->capturing.store(true);
    g.active.push_back(c);
    g.active_count.store(static_cast<int>(g.active.size()));
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
    if (pGraph == nullptr) return fail(cudaErrorInvalidValue);
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(stream, s); e != cudaSuccess) return e;
    std::shared_ptr<Capture> c;  // released after the lock: a dropped graph's user objects may call back
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    c = s->capture;
    if (c == nullptr) return fail(cudaErrorIllegalState);
    if (c->origin != s) return fail(cudaErrorStreamCaptureUnmatched);
    if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
        return fail(cudaErrorStreamCaptureWrongThread);
    end(g, c);
    *pGraph = nullptr;
    if (c->invalidated) {
        discard(g, *c);
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    if (!joined(*c)) {
        discard(g, *c);
        return fail(cudaErrorStreamCaptureUnjoined);
    }
    c->graph->capturing = false;
    *pGraph = reinterpret_cast<cudaGraph_t>(c->graph);
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* pCaptureStatus) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(stream, s); e != cudaSuccess) return e;
    if (pCaptureStatus == nullptr) return fail(cudaErrorInvalidValue);
    if (s->legacy)
        if (const cudaError_t e = capture_admits(s, false); e != cudaSuccess) return e;
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    *pCaptureStatus = s->capture == nullptr     ? cudaStreamCaptureStatusNone
                      : s->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                                : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, cudaStreamCaptureStatus* captureStatus_out, unsigned long long* id_out,
                                     cudaGraph_t* graph_out, const cudaGraphNode_t** dependencies_out,
                                     const cudaGraphEdgeData** edgeData_out, size_t* numDependencies_out) {
    // The double models no node handles: a caller asking for the dependencies is refused.
    if (captureStatus_out == nullptr || dependencies_out != nullptr || edgeData_out != nullptr || numDependencies_out != nullptr)
        return fail(cudaErrorInvalidValue);
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = resolve_stream(stream, s); e != cudaSuccess) return e;
    if (s->legacy)
        if (const cudaError_t e = capture_admits(s, false); e != cudaSuccess) return e;
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    const auto& c = s->capture;
    *captureStatus_out = c == nullptr     ? cudaStreamCaptureStatusNone
                         : c->invalidated ? cudaStreamCaptureStatusInvalidated
                                          : cudaStreamCaptureStatusActive;
    if (c != nullptr) {
        if (id_out != nullptr) *id_out = c->id;
        if (graph_out != nullptr) *graph_out = reinterpret_cast<cudaGraph_t>(c->graph);
    }
    return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
    if (mode == nullptr || (*mode != cudaStreamCaptureModeGlobal && *mode != cudaStreamCaptureModeThreadLocal &&
                            *mode != cudaStreamCaptureModeRelaxed))
        return fail(cudaErrorInvalidValue);
    std::swap(*mode, thread_mode);
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph, unsigned long long flags) {
    if (pGraphExec == nullptr) return fail(cudaErrorInvalidValue);
    if (flags != 0 && flags != cudaGraphInstantiateFlagAutoFreeOnLaunch) return fail(cudaErrorInvalidValue);
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    auto it = g.graphs.find(graph);
    if (it == g.graphs.end() || it->second->data == nullptr) return fail(cudaErrorInvalidValue);
    GraphHandle& h = *it->second;
    if (h.capturing) return fail(cudaErrorIllegalState);
    // The double's graphs keep no allocation past their end (a CUDA graph could, launched once
    // until the memory is freed outside it).
    if (!h.data->unfreed.empty()) return fail(cudaErrorNotSupported);
    // CUDA: a graph with allocation nodes has one executable at a time.
    if (!h.data->blocks.empty() && h.data->execs > 0) return fail(cudaErrorInvalidValue);
    if (const cudaError_t e = sticky(h.data->device); e != cudaSuccess) return e;
    auto exec = std::make_unique<ExecHandle>();
    exec->data = h.data;
    for (int i = 0; i < h.data->lanes; ++i) exec->lanes.push_back(internal_stream(h.data->device));
    ++h.data->handles;
    ++h.data->execs;
    *pGraphExec = reinterpret_cast<cudaGraphExec_t>(exec.get());
    g.execs[exec.get()] = std::move(exec);
    return cudaSuccess;
}

cudaError_t cudaGraphUpload(cudaGraphExec_t graphExec, cudaStream_t stream) {
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = stream_for_work(stream, s); e != cudaSuccess) return e;
    if (s->capturing.load()) return capture_refuse(s);
    {
        Graphs& g = graphs();
        std::lock_guard lock(g.m);
        cudaError_t e = cudaSuccess;
        if (ready_exec(g, graphExec, *s, e) == nullptr) return fail(e);
    }
    Op op;  // the upload is stream-ordered: the stream's later work follows it
    op.body = [] {};
    enqueue(s, std::move(op));
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
    std::shared_ptr<GraphData> data;
    std::vector<std::shared_ptr<Stream>> lanes;
    std::shared_ptr<std::mutex> replaying;
    std::shared_ptr<std::vector<std::uint64_t>> tails;
    std::shared_ptr<Stream> s;
    if (const cudaError_t e = stream_for_work(stream, s); e != cudaSuccess) return e;
    // A graph launched into a capture would become a child graph: the double does not model those.
    if (s->capturing.load()) return capture_refuse(s);
    {
        Graphs& g = graphs();
        std::lock_guard lock(g.m);
        cudaError_t e = cudaSuccess;
        const ExecHandle* x = ready_exec(g, graphExec, *s, e);  // not uploaded: its memory now, or no launch
        if (x == nullptr) return fail(e);
        data = x->data;
        lanes = x->lanes;
        replaying = x->replaying;
        tails = x->tails;
    }
    std::lock_guard order(*replaying);
    // Each kernel counts for the injections at each replay, as an eager launch; an injected
    // launch failure fails the whole launch before anything is enqueued.
    std::vector<LaunchPlan> plans(data->nodes.size());
    for (std::size_t i = 0; i < data->nodes.size(); ++i)
        if (data->nodes[i].fn != nullptr)
            if (const cudaError_t e = plan_launch(data->nodes[i].name, data->device, plans[i]); e != cudaSuccess) return e;
    Op fork;
    fork.device_work = false;
    fork.body = [] {};
    tails->resize(lanes.size(), 0);
    for (std::size_t l = 0; l < lanes.size(); ++l)
        if ((*tails)[l] != 0) fork.deps.push_back({lanes[l], (*tails)[l]});  // after the previous launch, on any stream
    const std::uint64_t start = enqueue(s, std::move(fork));
    std::vector<std::uint64_t> seq(data->nodes.size(), 0);
    std::vector<std::uint64_t> last(lanes.size(), 0);
    for (std::size_t i = 0; i < data->nodes.size(); ++i) {
        const Node& n = data->nodes[i];
        std::vector<Dep> deps;
        for (int d : n.deps) deps.push_back({lanes[static_cast<std::size_t>(data->nodes[d].lane)], seq[d]});
        auto& lane_last = last[static_cast<std::size_t>(n.lane)];
        if (lane_last == 0) deps.push_back({s, start});  // the lane's first node: after the stream's earlier work
        const auto& lane = lanes[static_cast<std::size_t>(n.lane)];
        // A GPU graph's copy or library call on memory freed since its capture faults (the
        // memory a graph allocates itself stays its own).
        const auto gone = std::find_if(n.device_ranges.begin(), n.device_ranges.end(),
                                       [&](const auto& r) { return device_of_range(r.first, r.second) != data->device; });
        if (gone != n.device_ranges.end()) {
            Op op = fault_op(data->device, "a graph launch reads or writes " + std::to_string(gone->second) +
                                               " bytes of device memory freed since its capture (cudaErrorIllegalAddress); "
                                               "capture it again");
            op.deps = std::move(deps);
            seq[i] = enqueue(lane, std::move(op));
        } else if (n.fn != nullptr) {
            Op op = launch_op(n.fn, n.data, plans[i], data->device);
            op.deps = std::move(deps);
            seq[i] = enqueue(lane, std::move(op));
        } else {
            seq[i] = n.submit(lane, std::move(deps));
        }
        lane_last = seq[i];
    }
    // The stream's later work follows every lane; the graph's data lives until then.
    Op join;
    join.device_work = false;
    for (std::size_t l = 0; l < lanes.size(); ++l)
        if (last[l] != 0) {
            join.deps.push_back({lanes[l], last[l]});
            (*tails)[l] = last[l];
        }
    join.body = [keep = std::move(data)] {};
    enqueue(s, std::move(join));
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
    std::shared_ptr<GraphData> dropped;  // released after the lock: user objects' destructors may call back
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    auto it = g.execs.find(graphExec);
    if (it == g.execs.end() || it->second->data == nullptr) return fail(cudaErrorInvalidValue);
    // Replays still queued finish (their ops hold the graph's data); the lanes then exit.
    for (const auto& l : it->second->lanes) close_stream(l);
    if (it->second->mapped) unmap_graph_memory(it->second->data->device, it->second->data->memory_bytes);
    drop_handle(*it->second->data);
    --it->second->data->execs;
    dropped = std::move(it->second->data);
    g.dead_execs.push_back(std::move(it->second));
    g.execs.erase(it);
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    std::shared_ptr<GraphData> dropped;  // released after the lock
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    auto it = g.graphs.find(graph);
    if (it == g.graphs.end() || it->second->data == nullptr) return fail(cudaErrorInvalidValue);
    if (it->second->capturing) return fail(cudaErrorIllegalState);
    drop_handle(*it->second->data);
    dropped = std::move(it->second->data);
    g.dead_graphs.push_back(std::move(it->second));
    g.graphs.erase(it);
    return cudaSuccess;
}

cudaError_t cudaUserObjectCreate(cudaUserObject_t* object_out, void* ptr, cudaHostFn_t destroy, unsigned int initialRefcount,
                                 unsigned int flags) {
    // CUDA requires cudaUserObjectNoDestructorSync: the destructor may run on any thread.
    if (object_out == nullptr || destroy == nullptr || initialRefcount == 0 || flags != cudaUserObjectNoDestructorSync)
        return fail(cudaErrorInvalidValue);
    auto o = std::make_shared<UserObject>();
    o->ptr = ptr;
    o->destroy = destroy;
    o->refs.store(initialRefcount);
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    g.objects[o.get()] = o;  // kept: the handle stays valid for refusing after the last release
    *object_out = reinterpret_cast<cudaUserObject_t>(o.get());
    return cudaSuccess;
}

cudaError_t cudaUserObjectRetain(cudaUserObject_t object, unsigned int count) {
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    auto it = g.objects.find(object);
    if (it == g.objects.end() || count == 0 || it->second->refs.load() <= 0) return fail(cudaErrorInvalidValue);
    it->second->refs += count;
    return cudaSuccess;
}

cudaError_t cudaUserObjectRelease(cudaUserObject_t object, unsigned int count) {
    std::shared_ptr<UserObject> o;
    {
        Graphs& g = graphs();
        std::lock_guard lock(g.m);
        auto it = g.objects.find(object);
        if (it == g.objects.end() || count == 0 || it->second->refs.load() < static_cast<long long>(count))
            return fail(cudaErrorInvalidValue);
        o = it->second;
    }
    release_object(*o, count);
    return cudaSuccess;
}

cudaError_t cudaGraphRetainUserObject(cudaGraph_t graph, cudaUserObject_t object, unsigned int count, unsigned int flags) {
    if (count == 0 || (flags != 0 && flags != cudaGraphUserObjectMove)) return fail(cudaErrorInvalidValue);
    Graphs& g = graphs();
    std::lock_guard lock(g.m);
    auto git = g.graphs.find(graph);
    auto oit = g.objects.find(object);
    if (git == g.graphs.end() || git->second->data == nullptr || oit == g.objects.end()) return fail(cudaErrorInvalidValue);
    if (flags == cudaGraphUserObjectMove) {
        if (oit->second->refs.load() < static_cast<long long>(count)) return fail(cudaErrorInvalidValue);
    } else {
        oit->second->refs += count;
    }
    git->second->data->objects.emplace_back(oit->second, count);
    return cudaSuccess;
}

}  // extern "C"
