// The NCCL half of the emulated CUDA device (README.md beside this file): the entry points of
// libnccl.so.2 that meshtrain's NCCL backend calls, answered on the CPU, so that backend (its
// communicators, streams and events, the watchdog's abort, sub-groups, launch --gpus) runs
// somewhere before a card. A call's work runs in its stream's order, as the driver's does: at
// once by default, or on the stream's own thread under EMU_DEVICE_STREAMS=async, where the
// call returns first, as NCCL's do.
//
// Ranks meet in a file mapped by every member of a communicator, found by the unique id (ranks
// may be threads of one process or processes of one machine, as NCCL's may): per rank a slot
// for the collectives and per ordered pair of ranks a byte ring for sends and receives. A
// collective is: each rank copies its input into its slot, all meet at a barrier, each rank
// computes its own output from every slot (reductions in rank order, in f32 for 16-bit types,
// so every rank gets the same bits), and all meet again before the slots are reused; longer
// buffers go in pieces. Sends and receives are issued together at ncclGroupEnd and progress
// together until all are done, so a ring of exchanges does not deadlock, and bytes between a
// pair arrive in issue order (NCCL's matching: no tags). As on NCCL, a send is not buffered:
// it completes only when its receiver has taken every byte, so an order of calls that would
// deadlock on a card (two ranks each sending before receiving, outside a group) deadlocks
// here too, and the watchdog's timeout names it.
//
// A rank that never arrives leaves the others' work waiting (inside the call, or on the stream's
// thread: as NCCL's kernels spin on the GPU) until ncclCommAbort from another thread
// (meshtrain's watchdog) ends the wait.
// Not emulated: ncclReduce, ncclCommSplit, user-defined reductions, the FP8 types.
#include "emu_device.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <random>
#include <sched.h>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

namespace {

// NCCL's values (nccl.h, as cudarc's bindings have them).
enum Result {
    kSuccess = 0,
    kSystemError = 2,
    kInternalError = 3,
    kInvalidArgument = 4,
    kInvalidUsage = 5,
};
enum DataType {
    kInt8 = 0, kUint8, kInt32, kUint32, kInt64, kUint64, kFloat16, kFloat32, kFloat64,
    kBfloat16,
};
enum RedOp { kSum = 0, kProd, kMax, kMin, kAvg };

constexpr int kVersion = 22809; // 2.28.9: the lent machine's, which refuses two ranks a GPU
constexpr size_t kSlot = size_t(4) << 20;        // a rank's collective slot
constexpr size_t kRing = size_t(1) << 20;        // a pair's send ring
constexpr int kMaxRanks = 64;

/// What the ranks of one communicator share (the start of the mapped file).
struct Header {
    std::atomic<int32_t> arrived;
    std::atomic<uint32_t> barrier_count;
    std::atomic<uint32_t> barrier_generation;
};
/// One direction of one pair: bytes written and read so far (the ring's positions).
struct Ring {
    std::atomic<uint64_t> written;
    std::atomic<uint64_t> read;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics in shared memory");

size_t header_bytes() { return 4096; }
size_t rings_offset(int n) { return header_bytes() + size_t(n) * kSlot; }
size_t file_bytes(int n) {
    return rings_offset(n) + size_t(n) * n * (sizeof(Ring) * 8 + kRing);
}

struct Comm {
    int rank = 0, nranks = 1, device = 0;
    char* base = nullptr;
    size_t bytes = 0;
    std::atomic<bool> aborted{false};
    Header* header() const { return reinterpret_cast<Header*>(base); }
    char* slot(int r) const { return base + header_bytes() + size_t(r) * kSlot; }
    /// The ring from rank `from` to rank `to`: its positions, then its bytes.
    Ring* ring(int from, int to) const {
        return reinterpret_cast<Ring*>(base + rings_offset(nranks) +
                                       size_t(from * nranks + to) * (sizeof(Ring) * 8 + kRing));
    }
    char* ring_bytes(int from, int to) const {
        return reinterpret_cast<char*>(ring(from, to)) + sizeof(Ring) * 8;
    }
};

/// Never destroyed, as the driver's state: a watchdog thread of the process may still ask for
/// the last error while the process exits.
std::mutex& g_error_lock = *new std::mutex;
std::string& g_last_error = *new std::string;

Result fail(Result r, const std::string& why) {
    std::fprintf(stderr, "emulated NCCL: %s\n", why.c_str());
    std::lock_guard<std::mutex> g(g_error_lock);
    g_last_error = why;
    return r;
}

/// Waits a little longer each time: spinning first, then sleeping, so ranks waiting for a
/// slow peer leave the CPU to it.
struct Backoff {
    unsigned spins = 0;
    void pause() {
        if (++spins < 64) {
            sched_yield();
        } else {
            usleep(spins < 1024 ? 20 : 200);
        }
    }
};

/// Meets every rank of `c`; false when `c` was aborted while waiting.
bool barrier(Comm* c) {
    Header* h = c->header();
    const uint32_t generation = h->barrier_generation.load(std::memory_order_acquire);
    if (h->barrier_count.fetch_add(1, std::memory_order_acq_rel) + 1 == (uint32_t)c->nranks) {
        h->barrier_count.store(0, std::memory_order_relaxed);
        h->barrier_generation.fetch_add(1, std::memory_order_acq_rel);
        return true;
    }
    Backoff wait;
    while (h->barrier_generation.load(std::memory_order_acquire) == generation) {
        if (c->aborted.load()) return false;
        wait.pause();
    }
    return true;
}

size_t element_bytes(int t) {
    switch (t) {
    case kInt8: case kUint8: return 1;
    case kFloat16: case kBfloat16: return 2;
    case kInt32: case kUint32: case kFloat32: return 4;
    case kInt64: case kUint64: case kFloat64: return 8;
    default: return 0;
    }
}

/// Element `i` of a buffer of type `t`, as double (exact for every type but 64-bit integers
/// beyond 2^53, which the reductions below keep as integers).
double load(const char* p, int t, size_t i) {
    switch (t) {
    case kInt8: return ((const int8_t*)p)[i];
    case kUint8: return ((const uint8_t*)p)[i];
    case kInt32: return ((const int32_t*)p)[i];
    case kUint32: return ((const uint32_t*)p)[i];
    case kFloat16: return emu_device_from_f16(((const uint16_t*)p)[i]);
    case kBfloat16: return emu_device_from_bf16(((const uint16_t*)p)[i]);
    case kFloat32: return ((const float*)p)[i];
    default: return ((const double*)p)[i];
    }
}
void store(char* p, int t, size_t i, double v) {
    switch (t) {
    case kInt8: ((int8_t*)p)[i] = (int8_t)v; break;
    case kUint8: ((uint8_t*)p)[i] = (uint8_t)v; break;
    case kInt32: ((int32_t*)p)[i] = (int32_t)v; break;
    case kUint32: ((uint32_t*)p)[i] = (uint32_t)v; break;
    case kFloat16: ((uint16_t*)p)[i] = emu_device_to_f16(v); break;
    case kBfloat16: ((uint16_t*)p)[i] = emu_device_to_bf16(v); break;
    case kFloat32: ((float*)p)[i] = (float)v; break;
    default: ((double*)p)[i] = v; break;
    }
}

template <class T> T combine(T a, T b, int op) {
    switch (op) {
    case kProd: return a * b;
    case kMax: return a > b ? a : b;
    case kMin: return a < b ? a : b;
    default: return a + b; // sum, and avg's sum
    }
}

/// out[i] = the reduction of `n` elements at `offset` of every rank's slot (in rank order).
/// Floats accumulate in f32 (f64 for f64), as NCCL's kernels do, and avg multiplies each
/// input by 1/n first (NCCL's ncclAvg for floats); integers stay integers.
void reduce_slots(Comm* c, size_t offset, char* out, size_t n, int t, int op) {
    const size_t es = element_bytes(t);
    const bool floating = t == kFloat16 || t == kBfloat16 || t == kFloat32 || t == kFloat64;
    for (size_t i = 0; i < n; ++i) {
        if (t == kInt64 || t == kUint64) {
            int64_t acc = 0;
            for (int r = 0; r < c->nranks; ++r) {
                int64_t v;
                std::memcpy(&v, c->slot(r) + offset + i * es, 8);
                acc = r == 0 ? v : combine(acc, v, op);
            }
            if (op == kAvg) acc /= c->nranks;
            std::memcpy(out + i * es, &acc, 8);
        } else if (floating && t != kFloat64) {
            float acc = 0;
            for (int r = 0; r < c->nranks; ++r) {
                float v = (float)load(c->slot(r) + offset, t, i);
                if (op == kAvg) v *= 1.0f / (float)c->nranks;
                acc = r == 0 ? v : combine(acc, v, op);
            }
            store(out, t, i, acc);
        } else {
            double acc = 0;
            for (int r = 0; r < c->nranks; ++r) {
                double v = load(c->slot(r) + offset, t, i);
                if (op == kAvg && floating) v *= 1.0 / c->nranks;
                acc = r == 0 ? v : combine(acc, v, op);
            }
            if (op == kAvg && !floating) acc = std::trunc(acc / c->nranks);
            store(out, t, i, acc);
        }
    }
}

/// Runs `work` in `stream`'s order.
template <class F> void on_stream(void* stream, F work) {
    emu_device_enqueue(
        stream,
        [](void* p) {
            F* f = static_cast<F*>(p);
            (*f)();
            delete f;
        },
        new F(std::move(work)));
}

/// Checks a call's communicator, type and buffers before anything moves.
Result check(Comm* c, int t, const void* a, const void* b, size_t a_bytes, size_t b_bytes,
             const char* what) {
    if (!c) return fail(kInvalidArgument, std::string(what) + ": a null communicator");
    if (c->aborted.load())
        return fail(kInvalidUsage, std::string(what) + " on an aborted communicator");
    if (!element_bytes(t))
        return fail(kInvalidArgument, std::string(what) + ": data type " + std::to_string(t) +
                                          " is not emulated");
    if ((a_bytes && !emu_device_in_memory(a, a_bytes)) ||
        (b_bytes && !emu_device_in_memory(b, b_bytes)))
        return fail(kInvalidArgument,
                    std::string(what) + ": a buffer is not (all) in device memory");
    return kSuccess;
}

/// Runs a collective in pieces of `piece` elements: `deposit(start, n)` fills this rank's
/// slot, `collect(start, n)` computes this rank's output from every slot.
template <class Deposit, class Collect>
void in_pieces(Comm* c, size_t count, size_t piece, Deposit deposit, Collect collect) {
    for (size_t start = 0; start < count; start += piece) {
        const size_t n = std::min(piece, count - start);
        deposit(start, n);
        if (!barrier(c)) return; // aborted: the output is undefined, as on NCCL
        collect(start, n);
        if (!barrier(c)) return;
    }
}

/// A send or receive of the current group.
struct PointToPoint {
    bool send;
    Comm* comm;
    void* stream;
    char* buf;
    size_t bytes, done;
    int peer;
    /// A send's last byte's position in its ring, once every byte is written: the send is
    /// done when the receiver has read up to it.
    uint64_t end;
    bool finished() const;
};
bool PointToPoint::finished() const {
    if (done < bytes) return false;
    return !send || comm->ring(comm->rank, peer)->read.load(std::memory_order_acquire) >= end;
}
thread_local int t_group_depth = 0;
thread_local std::vector<PointToPoint> t_group;

/// Moves what can move now for `op` (after the earlier ops between the same pair, in the
/// same direction, are done); whether anything moved.
bool progress(PointToPoint& op) {
    Comm* c = op.comm;
    const int from = op.send ? c->rank : op.peer, to = op.send ? op.peer : c->rank;
    Ring* ring = c->ring(from, to);
    char* bytes = c->ring_bytes(from, to);
    const uint64_t written = ring->written.load(std::memory_order_acquire),
                   read = ring->read.load(std::memory_order_acquire);
    const size_t ready = op.send ? kRing - (written - read) : written - read;
    const size_t n = std::min(ready, op.bytes - op.done);
    if (n == 0) return false;
    const uint64_t at = op.send ? written : read;
    for (size_t moved = 0; moved < n;) {
        const size_t pos = (at + moved) % kRing, run = std::min(n - moved, kRing - pos);
        if (op.send) {
            std::memcpy(bytes + pos, op.buf + op.done + moved, run);
        } else {
            std::memcpy(op.buf + op.done + moved, bytes + pos, run);
        }
        moved += run;
    }
    op.done += n;
    op.end = at + n;
    (op.send ? ring->written : ring->read).store(at + n, std::memory_order_release);
    return true;
}

/// Runs the sends and receives of a group until all are done (or a communicator is aborted).
void run_point_to_point(std::vector<PointToPoint>& ops) {
    Backoff wait;
    for (;;) {
        bool all_done = true, moved = false;
        for (size_t i = 0; i < ops.size(); ++i) {
            PointToPoint& op = ops[i];
            if (op.finished()) continue;
            all_done = false;
            if (op.comm->aborted.load()) return;
            bool earlier_pending = false;
            for (size_t j = 0; j < i; ++j)
                earlier_pending |= ops[j].comm == op.comm && ops[j].send == op.send &&
                                   ops[j].peer == op.peer && ops[j].done < ops[j].bytes;
            if (!earlier_pending && op.done < op.bytes && progress(op)) moved = true;
        }
        if (all_done) return;
        if (moved) {
            wait.spins = 0;
        } else {
            wait.pause();
        }
    }
}

/// Issues the current group's sends and receives as one piece of work, on the stream of its
/// first (meshtrain's groups use one stream).
Result issue_group() {
    std::vector<PointToPoint> ops;
    ops.swap(t_group);
    if (ops.empty()) return kSuccess;
    void* stream = ops[0].stream;
    on_stream(stream, [ops]() mutable { run_point_to_point(ops); });
    return kSuccess;
}

Result point_to_point(bool send, const void* buf, size_t count, int t, int peer, Comm* c,
                      void* stream) {
    const size_t bytes = count * element_bytes(t);
    if (Result r = check(c, t, buf, nullptr, bytes, 0, send ? "ncclSend" : "ncclRecv")) return r;
    if (peer < 0 || peer >= c->nranks)
        return fail(kInvalidArgument, "a send or receive with peer " + std::to_string(peer) +
                                          " of " + std::to_string(c->nranks) + " ranks");
    t_group.push_back({send, c, stream, (char*)buf, bytes, 0, peer, 0});
    if (t_group_depth > 0) return kSuccess;
    return issue_group();
}

} // namespace

extern "C" {

typedef struct {
    char internal[128];
} ncclUniqueId;
typedef Comm* ncclComm_t;

int ncclGetVersion(int* version) {
    *version = kVersion;
    return kSuccess;
}

const char* ncclGetErrorString(int result) {
    switch (result) {
    case kSuccess: return "no error";
    case kSystemError: return "unhandled system error (emulated NCCL)";
    case kInternalError: return "internal error (emulated NCCL)";
    case kInvalidArgument: return "invalid argument (emulated NCCL)";
    case kInvalidUsage: return "invalid usage (emulated NCCL)";
    default: return "unknown result (emulated NCCL)";
    }
}

const char* ncclGetLastError(ncclComm_t) {
    std::lock_guard<std::mutex> g(g_error_lock);
    static thread_local std::string copy;
    copy = g_last_error;
    return copy.c_str();
}

/// A random name for the communicator's meeting file.
int ncclGetUniqueId(ncclUniqueId* id) {
    std::memset(id->internal, 0, sizeof id->internal);
    std::random_device seed;
    std::snprintf(id->internal, sizeof id->internal, "emu-nccl-%d-%08x%08x", (int)getpid(),
                  seed(), seed());
    return kSuccess;
}

/// Maps the id's file (made by whichever rank comes first) and waits for every rank; the last
/// to arrive removes its name, so nothing is left behind (the mappings stay).
int ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
    *out = nullptr;
    if (std::strncmp(id.internal, "emu-nccl-", 9) != 0)
        return fail(kInvalidArgument, "ncclCommInitRank: not an id of the emulated NCCL");
    if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
        return fail(kInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) +
                                          " of " + std::to_string(nranks));
    const char* dir = std::getenv("TMPDIR");
    const std::string path = std::string(dir && *dir ? dir : "/tmp") + "/" + id.internal;
    const int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) return fail(kSystemError, "ncclCommInitRank: cannot open " + path);
    const size_t bytes = file_bytes(nranks);
    if (ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        return fail(kSystemError, "ncclCommInitRank: cannot size " + path);
    }
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return fail(kSystemError, "ncclCommInitRank: cannot map " + path);
    auto* c = new Comm;
    c->rank = rank;
    c->nranks = nranks;
    c->base = (char*)base;
    c->bytes = bytes;
    c->device = emu_device_current_ordinal();
    Header* h = c->header(); // zeroed: the file is new
    if (h->arrived.fetch_add(1) + 1 == nranks) unlink(path.c_str());
    Backoff wait;
    const auto start = std::chrono::steady_clock::now();
    while (h->arrived.load() < nranks) {
        if (std::chrono::steady_clock::now() - start > std::chrono::minutes(10))
            return fail(kSystemError, "ncclCommInitRank: not every rank arrived in 10 minutes");
        wait.pause();
    }
    *out = c;
    return kSuccess;
}

int ncclCommDestroy(ncclComm_t c) {
    if (!c) return kSuccess;
    munmap(c->base, c->bytes);
    delete c;
    return kSuccess;
}

/// Ends the waits of calls in progress on `c` (another thread's, as the watchdog's abort does
/// on a card). The memory stays mapped: a call may still be reading it as it returns.
int ncclCommAbort(ncclComm_t c) {
    if (c) c->aborted.store(true);
    return kSuccess;
}

int ncclCommGetAsyncError(ncclComm_t, int* state) {
    *state = kSuccess;
    return kSuccess;
}
int ncclCommCount(const ncclComm_t c, int* count) {
    *count = c->nranks;
    return kSuccess;
}
int ncclCommUserRank(const ncclComm_t c, int* rank) {
    *rank = c->rank;
    return kSuccess;
}
int ncclCommCuDevice(const ncclComm_t c, int* device) {
    *device = c->device;
    return kSuccess;
}

int ncclAllReduce(const void* send, void* recv, size_t count, int t, int op, ncclComm_t c,
                  void* stream) {
    const size_t es = element_bytes(t);
    if (Result r = check(c, t, send, recv, count * es, count * es, "ncclAllReduce")) return r;
    on_stream(stream, [=] {
        in_pieces(
            c, count, kSlot / es,
            [&](size_t s, size_t n) { std::memcpy(c->slot(c->rank), (const char*)send + s * es, n * es); },
            [&](size_t s, size_t n) { reduce_slots(c, 0, (char*)recv + s * es, n, t, op); });
    });
    return kSuccess;
}

int ncclBroadcast(const void* send, void* recv, size_t count, int t, int root, ncclComm_t c,
                  void* stream) {
    const size_t es = element_bytes(t);
    const size_t send_bytes = c && c->rank == root ? count * es : 0;
    if (Result r = check(c, t, send, recv, send_bytes, count * es, "ncclBroadcast")) return r;
    if (root < 0 || root >= c->nranks)
        return fail(kInvalidArgument, "ncclBroadcast: root " + std::to_string(root));
    on_stream(stream, [=] {
        in_pieces(
            c, count, kSlot / es,
            [&](size_t s, size_t n) {
                if (c->rank == root) std::memcpy(c->slot(root), (const char*)send + s * es, n * es);
            },
            [&](size_t s, size_t n) { std::memmove((char*)recv + s * es, c->slot(root), n * es); });
    });
    return kSuccess;
}

int ncclAllGather(const void* send, void* recv, size_t count, int t, ncclComm_t c, void* stream) {
    const size_t es = element_bytes(t);
    if (Result r = check(c, t, send, recv, count * es, c ? count * es * c->nranks : 0,
                         "ncclAllGather"))
        return r;
    on_stream(stream, [=] {
        in_pieces(
            c, count, kSlot / es,
            [&](size_t s, size_t n) { std::memcpy(c->slot(c->rank), (const char*)send + s * es, n * es); },
            [&](size_t s, size_t n) {
                for (int r = 0; r < c->nranks; ++r)
                    std::memcpy((char*)recv + (r * count + s) * es, c->slot(r), n * es);
            });
    });
    return kSuccess;
}

int ncclReduceScatter(const void* send, void* recv, size_t count, int t, int op, ncclComm_t c,
                      void* stream) {
    const size_t es = element_bytes(t);
    if (Result r = check(c, t, send, recv, c ? count * es * c->nranks : 0, count * es,
                         "ncclReduceScatter"))
        return r;
    // A piece holds every destination's part: rank d's at d × piece.
    const size_t piece = kSlot / es / c->nranks;
    on_stream(stream, [=] {
        in_pieces(
            c, count, piece,
            [&](size_t s, size_t n) {
                for (int d = 0; d < c->nranks; ++d)
                    std::memcpy(c->slot(c->rank) + d * piece * es, (const char*)send + (d * count + s) * es,
                                n * es);
            },
            [&](size_t s, size_t n) {
                reduce_slots(c, c->rank * piece * es, (char*)recv + s * es, n, t, op);
            });
    });
    return kSuccess;
}

int ncclSend(const void* send, size_t count, int t, int peer, ncclComm_t c, void* stream) {
    return point_to_point(true, send, count, t, peer, c, stream);
}
int ncclRecv(void* recv, size_t count, int t, int peer, ncclComm_t c, void* stream) {
    return point_to_point(false, recv, count, t, peer, c, stream);
}

int ncclGroupStart() {
    ++t_group_depth;
    return kSuccess;
}
int ncclGroupEnd() {
    if (t_group_depth == 0) return fail(kInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_group_depth > 0) return kSuccess;
    return issue_group();
}

} // extern "C"
