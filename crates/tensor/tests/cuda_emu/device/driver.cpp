// The driver half of the emulated CUDA device (README.md beside this file): the entry points
// of libcuda, libnvrtc and libcublasLt that cudarc loads, answered on the CPU. Kernels and
// products run in kernels.cpp on the CUDA emulator; memory is the emulator's guarded buffers,
// filled with 0xFF bytes (NaN in every float type) when allocated.
//
// Streams, two ways. By default every call runs to completion before it returns (a stream's
// work is done when it is queued), one of the orders the real device may choose, so stream
// and event semantics hold and nothing is found that needs another order. With
// EMU_DEVICE_STREAMS=async each stream is a queue with a thread of its own, as a GPU's
// engines are: calls return at once, work runs in stream order and streams overlap (one
// kernel, copy or product at a time across all of them), events complete when their stream
// reaches them, cuStreamWaitEvent holds a stream, and EMU_DEVICE_STREAM_DELAY_US adds a
// random delay before each piece of work to shake the interleaving. Then a missing wait shows
// up as a read of data not yet written (NaN from the poison, or wrong numbers).
#include <cuda.h>
#include <nvrtc.h>

#include "emu_device.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>


namespace {

// The emulator's state is never destroyed (each piece a `*new` that is never deleted): the
// threads of the process that uses it (its stream threads, a caller's watchdog polling events
// or freeing buffers) may still call in while the process exits and static destructors run,
// and a map destroyed under such a call dereferences freed nodes (SIGSEGV at exit under load).
std::recursive_mutex& lock() {
    static std::recursive_mutex& m = *new std::recursive_mutex;
    return m;
}
#define EMU_LOCKED std::lock_guard<std::recursive_mutex> emu_guard(lock())

/// EMU_DEVICE_CC: the compute capability the device reports, "90" (the default: Hopper, so
/// the sm_90a kernels run) or "80".
int compute_capability() {
    const char* v = std::getenv("EMU_DEVICE_CC");
    return v && *v ? std::atoi(v) : 90;
}

bool trace() {
    static const bool on = [] {
        const char* v = std::getenv("EMU_DEVICE_TRACE");
        return v && *v && std::strcmp(v, "0") != 0;
    }();
    return on;
}

/// Unknown or unsupported requests are named on stderr, so a missing piece of the emulation
/// is told from a bug in the caller.
CUresult unsupported(const char* what) {
    std::fprintf(stderr, "emulated CUDA device: %s is not emulated\n", what);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/// EMU_DEVICE_PROFILE=1: seconds and calls per kernel (and for the products), printed to
/// stderr when the process exits, the slowest first.
struct Profile {
    std::map<std::string, std::pair<double, long>> spent;
    ~Profile() {
        if (spent.empty()) return;
        std::vector<std::pair<std::string, std::pair<double, long>>> v(spent.begin(), spent.end());
        std::sort(v.begin(), v.end(),
                  [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
        std::fprintf(stderr, "emulated CUDA device: time by kernel\n");
        for (const auto& e : v)
            std::fprintf(stderr, "%10.3f s %8ld  %s\n", e.second.first, e.second.second,
                         e.first.c_str());
    }
};
Profile g_profile;
bool profiling() {
    static const bool on = [] {
        const char* v = std::getenv("EMU_DEVICE_PROFILE");
        return v && *v && std::strcmp(v, "0") != 0;
    }();
    return on;
}
/// Adds the time since `start` to `what`'s row when profiling.
void account(const char* what, std::chrono::steady_clock::time_point start) {
    if (!profiling()) return;
    auto& row = g_profile.spent[what];
    row.first += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    row.second += 1;
}

constexpr size_t kTotalMemory = size_t(16) << 30;
size_t g_allocated = 0;
std::map<uintptr_t, size_t>& device_buffers() {
    static auto& m = *new std::map<uintptr_t, size_t>;
    return m;
}

/// Whether [p, p + bytes) lies inside one of `ranges` (start -> length).
bool in_ranges(const std::map<uintptr_t, size_t>& ranges, uintptr_t p, size_t bytes) {
    auto it = ranges.upper_bound(p);
    if (it == ranges.begin()) return false;
    --it;
    return p >= it->first && p + bytes <= it->first + it->second;
}

/// EMU_DEVICE_COUNT: how many devices there are (default 1). They share one memory (any
/// device's pointer works on every other, as with peer access), each has its own primary
/// context, so a process may put ranks on cuda:0, cuda:1, ... as on a node of GPUs.
constexpr int kMaxDevices = 16;
int device_count() {
    static const int n = [] {
        const char* v = std::getenv("EMU_DEVICE_COUNT");
        const int n = v && *v ? std::atoi(v) : 1;
        return n < 1 ? 1 : n > kMaxDevices ? kMaxDevices : n;
    }();
    return n;
}

struct Ctx {
    int device = 0;
};
Ctx g_ctx[kMaxDevices] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7},
                          {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}};
thread_local CUcontext t_current = nullptr;

/// The current context's device (0 when none is current).
int current_device() {
    return t_current ? reinterpret_cast<Ctx*>(t_current)->device : 0;
}

// ---- asynchronous streams (EMU_DEVICE_STREAMS=async) ------------------------------------

bool async_streams() {
    static const bool on = [] {
        const char* v = std::getenv("EMU_DEVICE_STREAMS");
        return v && std::strcmp(v, "async") == 0;
    }();
    return on;
}

/// Microseconds of random delay before each piece of a stream's work (0: none).
unsigned stream_delay_us() {
    static const unsigned us = [] {
        const char* v = std::getenv("EMU_DEVICE_STREAM_DELAY_US");
        return v && *v ? (unsigned)std::atoi(v) : 0u;
    }();
    return us;
}

/// EMU_DEVICE_REFUSE_CAPTURED_LAUNCH=N: the N-th kernel launched into each capture is
/// refused as a call the capture cannot hold (0: none). A real driver may refuse a kernel
/// this emulator would capture (a launch attribute, a library's own call); the host code
/// must then fall back to eager launches, and this is how a test makes it.
unsigned refused_captured_launch() {
    static const unsigned n = [] {
        const char* v = std::getenv("EMU_DEVICE_REFUSE_CAPTURED_LAUNCH");
        return v && *v ? (unsigned)std::atoi(v) : 0u;
    }();
    return n;
}

/// Guards every stream's queue and every event's counts; notified whenever work completes.
/// Never destroyed: stream threads may still wait on them while the process exits (glibc's
/// condition variable destructor would wait for them forever).
std::mutex& g_sched = *new std::mutex;
std::condition_variable& g_changed = *new std::condition_variable;
/// The first error of work that ran after its call returned (a failed launch), reported by
/// the synchronising calls from then on, as CUDA's sticky errors are.
CUresult g_sticky = CUDA_SUCCESS;

void set_sticky(CUresult r) {
    std::lock_guard<std::mutex> g(g_sched);
    if (g_sticky == CUDA_SUCCESS) g_sticky = r;
}

/// A stream's work while it is being captured into a graph (cuStreamBeginCapture): kept,
/// not run; a graph launch queues it again, in order, as often as it is launched.
using Captured = std::vector<std::function<void()>>;

struct Stream {
    int flags = 0;
    std::deque<std::function<void()>> queue;
    uint64_t enqueued = 0, completed = 0;
    bool stop = false;
    std::thread worker;
    /// While capturing: the work so far, whether the capture was invalidated (a call the
    /// capture cannot hold was made), and whether its mode lets other calls run meanwhile
    /// (CU_STREAM_CAPTURE_MODE_RELAXED; the other modes refuse cuMemAlloc, as CUDA does).
    std::shared_ptr<Captured> capture;
    bool invalidated = false;
    bool relaxed = false;
    unsigned captured_launches = 0;
    bool idle() const { return completed == enqueued; }
};

/// The live streams (under g_sched).
std::set<Stream*>& all_streams() {
    static auto& s = *new std::set<Stream*>;
    return s;
}

void run_stream(Stream* s) {
    std::mt19937 random(std::random_device{}());
    std::unique_lock<std::mutex> l(g_sched);
    for (;;) {
        g_changed.wait(l, [&] { return s->stop || !s->queue.empty(); });
        if (s->queue.empty()) return;
        std::function<void()> work = std::move(s->queue.front());
        s->queue.pop_front();
        l.unlock();
        if (const unsigned us = stream_delay_us()) usleep(random() % (us + 1));
        work();
        l.lock();
        ++s->completed;
        g_changed.notify_all();
    }
}

/// Waits until every stream is idle (cuCtxSynchronize; cuMemFree, which synchronises), or
/// with `blocking_only` every stream made without CU_STREAM_NON_BLOCKING (what the legacy
/// null stream waits for).
void wait_for_streams(bool blocking_only = false) {
    std::unique_lock<std::mutex> l(g_sched);
    g_changed.wait(l, [&] {
        for (Stream* s : all_streams())
            if ((!blocking_only || s->flags == 0) && !s->idle()) return false;
        return true;
    });
}

/// The stream being captured, if `stream` is one (under g_sched).
Stream* capturing_locked(CUstream stream) {
    Stream* s = reinterpret_cast<Stream*>(stream);
    return s && s->capture ? s : nullptr;
}
bool capturing(CUstream stream) {
    std::lock_guard<std::mutex> g(g_sched);
    return capturing_locked(stream) != nullptr;
}
/// The streams being captured (under g_sched).
std::set<Stream*>& captures() {
    static auto& s = *new std::set<Stream*>;
    return s;
}
bool any_capture() {
    std::lock_guard<std::mutex> g(g_sched);
    return !captures().empty();
}
/// Whether a capture in a mode that refuses unsafe calls (not relaxed) is under way.
bool strict_capture() {
    std::lock_guard<std::mutex> g(g_sched);
    for (Stream* s : captures())
        if (!s->relaxed) return true;
    return false;
}

/// A call that a capture cannot hold (a synchronisation, a copy to pageable memory, an
/// event from outside): named on stderr, and the capture of `stream` (or every capture,
/// for a call that concerns the whole device) is invalidated, as on CUDA.
CUresult capture_refuses(const char* what, CUstream stream) {
    std::fprintf(stderr, "emulated CUDA device: %s while a stream is being captured\n", what);
    std::lock_guard<std::mutex> g(g_sched);
    if (Stream* s = capturing_locked(stream)) {
        s->invalidated = true;
    } else {
        for (Stream* s : captures()) s->invalidated = true;
    }
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

/// Whether a call on `stream` runs at once: streams are synchronous and it is not being
/// captured.
bool direct(CUstream stream) { return !async_streams() && !capturing(stream); }

/// Runs `work` in `stream`'s order: kept when the stream is being captured; at once when
/// streams are synchronous or for the null stream (the legacy stream waits for blocking
/// streams first; cudarc makes none), else queued.
void enqueue(CUstream stream, std::function<void()> work) {
    {
        std::lock_guard<std::mutex> g(g_sched);
        if (Stream* s = capturing_locked(stream)) {
            s->capture->push_back(std::move(work));
            return;
        }
    }
    if (!async_streams()) {
        work();
        return;
    }
    if (!stream) {
        wait_for_streams(true);
        work();
        return;
    }
    Stream* s = reinterpret_cast<Stream*>(stream);
    std::lock_guard<std::mutex> g(g_sched);
    s->queue.push_back(std::move(work));
    ++s->enqueued;
    g_changed.notify_all();
}

/// What an event knows: how many times it was recorded, and up to which record its streams
/// have run (shared with the work that completes it, so destroying an event in flight is
/// safe, as it is on CUDA).
struct EventState {
    uint64_t recorded = 0, completed = 0;
    std::chrono::steady_clock::time_point at;
};
struct Event {
    std::shared_ptr<EventState> state = std::make_shared<EventState>();
};

/// Pinned host memory (cuMemAllocHost, cuMemHostRegister): an asynchronous copy reads or
/// writes it when the stream gets there; pageable memory is read when the call is made.
std::map<uintptr_t, size_t>& pinned_ranges() {
    static auto& m = *new std::map<uintptr_t, size_t>;
    return m;
}
bool is_pinned(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> g(g_sched);
    return in_ranges(pinned_ranges(), (uintptr_t)p, bytes);
}
struct Module {
    std::string file;
};

const char kCubinMagic[] = "EMU-CUBIN:";

/// Whether [p, p + bytes) lies inside one device buffer.
bool in_device_buffer(uintptr_t p, size_t bytes) { return in_ranges(device_buffers(), p, bytes); }

CUresult copy(void* dst, const void* src, size_t bytes) {
    if (bytes) std::memmove(dst, src, bytes);
    return CUDA_SUCCESS;
}

CUresult device_range(CUdeviceptr p, size_t bytes, const char* what) {
    if (bytes && !in_device_buffer((uintptr_t)p, bytes)) {
        std::fprintf(stderr,
                     "emulated CUDA device: %s of %zu bytes at 0x%llx is outside every device "
                     "buffer\n",
                     what, bytes, (unsigned long long)p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/// The memsets: n values of v from p, all inside one device buffer.
template <class T> CUresult fill(CUdeviceptr p, T v, size_t n) {
    EMU_LOCKED;
    if (CUresult r = device_range(p, n * sizeof(T), "a memset")) return r;
    T* q = (T*)(uintptr_t)p;
    for (size_t i = 0; i < n; ++i) q[i] = v;
    return CUDA_SUCCESS;
}

/// Runs a synchronous-API body as queued work: its error, which the call would have returned,
/// becomes the sticky error.
std::function<void()> as_work(std::function<CUresult()> body) {
    return [body] {
        if (CUresult r = body()) set_sticky(r);
    };
}
/// A memset queued on `s` (the range checked now and again when it runs).
template <class T> CUresult fill_async(CUdeviceptr p, T v, size_t n, CUstream s) {
    if (direct(s)) return fill(p, v, n);
    {
        EMU_LOCKED;
        if (CUresult r = device_range(p, n * sizeof(T), "a memset")) return r;
    }
    enqueue(s, as_work([=] { return fill(p, v, n); }));
    return CUDA_SUCCESS;
}

} // namespace

extern "C" {

// ---- initialisation, devices, contexts -------------------------------------------------

CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
    *n = device_count();
    return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    std::snprintf(name, (size_t)len, "Emulated CUDA device (sm_%d, CPU)", compute_capability());
    return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem(size_t* bytes, CUdevice) {
    *bytes = kTotalMemory;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice d) {
    std::memset(uuid, 0x5a, sizeof *uuid);
    uuid->bytes[15] = (char)d;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
    const int cc = compute_capability();
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = cc / 10; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = cc % 10; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 4; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 48 << 10; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = 227 << 10; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *v = 228 << 10; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = 0x7fffffff; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *v = 1000000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *v = 1000000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 4 << 20; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *v = 0; break;
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = reinterpret_cast<CUcontext>(&g_ctx[d]);
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxReset(CUdevice) { return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxGetState(CUdevice, unsigned int* flags, int* active) {
    *flags = 0;
    *active = 1;
    return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
    t_current = ctx;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* ctx) {
    *ctx = t_current;
    return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent(CUcontext ctx) {
    t_current = ctx;
    return CUDA_SUCCESS;
}
CUresult cuCtxPopCurrent(CUcontext* ctx) {
    if (ctx) *ctx = t_current;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice* d) {
    *d = current_device();
    return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize() {
    if (any_capture()) return capture_refuses("cuCtxSynchronize", nullptr);
    if (!async_streams()) return CUDA_SUCCESS;
    wait_for_streams();
    std::lock_guard<std::mutex> g(g_sched);
    return g_sticky;
}
CUresult cuCtxSetLimit(CUlimit, size_t) { return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t* v, CUlimit) {
    *v = 0;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult e, const char** s) {
    switch (e) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
    case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; break;
    }
    return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char** s) { return cuGetErrorName(e, s); }

// ---- streams and events ---------------------------------------------------------------

CUresult cuStreamCreate(CUstream* s, unsigned int flags) {
    Stream* st = new Stream;
    st->flags = (int)flags;
    if (async_streams()) {
        std::lock_guard<std::mutex> g(g_sched);
        all_streams().insert(st);
        st->worker = std::thread(run_stream, st);
    }
    *s = reinterpret_cast<CUstream>(st);
    return CUDA_SUCCESS;
}
CUresult cuStreamCreateWithPriority(CUstream* s, unsigned int flags, int) {
    return cuStreamCreate(s, flags);
}
/// A stream with work queued is destroyed once the work is done (CUDA returns at once and
/// releases it later; waiting here is one of the orders that allows).
CUresult cuStreamDestroy(CUstream s) {
    Stream* st = reinterpret_cast<Stream*>(s);
    {
        std::lock_guard<std::mutex> g(g_sched);
        captures().erase(st);
    }
    if (st->worker.joinable()) {
        {
            std::unique_lock<std::mutex> l(g_sched);
            g_changed.wait(l, [&] { return st->idle(); });
            st->stop = true;
            all_streams().erase(st);
            g_changed.notify_all();
        }
        st->worker.join();
    }
    delete st;
    return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream s) {
    if (capturing(s)) return capture_refuses("cuStreamSynchronize of it", s);
    if (!async_streams()) return CUDA_SUCCESS;
    std::unique_lock<std::mutex> l(g_sched);
    if (s) {
        Stream* st = reinterpret_cast<Stream*>(s);
        g_changed.wait(l, [&] { return st->idle(); });
    }
    return g_sticky;
}
CUresult cuStreamQuery(CUstream s) {
    if (capturing(s)) return capture_refuses("cuStreamQuery of it", s);
    if (!async_streams() || !s) return CUDA_SUCCESS;
    std::lock_guard<std::mutex> g(g_sched);
    if (g_sticky != CUDA_SUCCESS) return g_sticky;
    return reinterpret_cast<Stream*>(s)->idle() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
/// Holds `s` until `e`'s latest record (at the time of this call) has completed.
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int) {
    if (capturing(s)) return capture_refuses("cuStreamWaitEvent (events are not emulated in graphs)", s);
    if (!async_streams()) return CUDA_SUCCESS;
    std::shared_ptr<EventState> state = reinterpret_cast<Event*>(e)->state;
    uint64_t record;
    {
        std::lock_guard<std::mutex> g(g_sched);
        record = state->recorded;
    }
    if (record == 0) return CUDA_SUCCESS;
    enqueue(s, [state, record] {
        std::unique_lock<std::mutex> l(g_sched);
        g_changed.wait(l, [&] { return state->completed >= record; });
    });
    return CUDA_SUCCESS;
}
CUresult cuStreamGetPriority(CUstream, int* p) {
    *p = 0;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = -1;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    return cuDeviceGetStreamPriorityRange(least, greatest);
}
CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void* data) {
    enqueue(s, [fn, data] { fn(data); });
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned int) {
    *e = reinterpret_cast<CUevent>(new Event);
    return CUDA_SUCCESS;
}
CUresult cuEventDestroy(CUevent e) {
    delete reinterpret_cast<Event*>(e);
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    if (capturing(s)) return capture_refuses("cuEventRecord (events are not emulated in graphs)", s);
    std::shared_ptr<EventState> state = reinterpret_cast<Event*>(e)->state;
    uint64_t record;
    {
        std::lock_guard<std::mutex> g(g_sched);
        record = ++state->recorded;
    }
    enqueue(s, [state, record] {
        std::lock_guard<std::mutex> g(g_sched);
        state->completed = std::max(state->completed, record);
        state->at = std::chrono::steady_clock::now();
        g_changed.notify_all();
    });
    return CUDA_SUCCESS;
}
CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(CUevent e) {
    std::shared_ptr<EventState> state = reinterpret_cast<Event*>(e)->state;
    std::unique_lock<std::mutex> l(g_sched);
    g_changed.wait(l, [&] { return state->completed >= state->recorded; });
    return g_sticky;
}
CUresult cuEventQuery(CUevent e) {
    std::shared_ptr<EventState> state = reinterpret_cast<Event*>(e)->state;
    std::lock_guard<std::mutex> g(g_sched);
    if (g_sticky != CUDA_SUCCESS) return g_sticky;
    return state->completed >= state->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    std::shared_ptr<EventState> a = reinterpret_cast<Event*>(start)->state;
    std::shared_ptr<EventState> b = reinterpret_cast<Event*>(end)->state;
    std::lock_guard<std::mutex> g(g_sched);
    if (!a->recorded || !b->recorded || a->completed < a->recorded || b->completed < b->recorded)
        return CUDA_ERROR_NOT_READY;
    *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
    return CUDA_SUCCESS;
}

// ---- memory ---------------------------------------------------------------------------

CUresult cuMemAlloc(CUdeviceptr* p, size_t bytes) {
    if (strict_capture())
        return capture_refuses("cuMemAlloc (allowed only in CU_STREAM_CAPTURE_MODE_RELAXED)", nullptr);
    EMU_LOCKED;
    if (g_allocated + bytes > kTotalMemory) return CUDA_ERROR_OUT_OF_MEMORY;
    void* m = emu_device_alloc(bytes);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    std::memset(m, 0xff, bytes);
    device_buffers()[(uintptr_t)m] = bytes;
    g_allocated += bytes;
    *p = (CUdeviceptr)(uintptr_t)m;
    if (trace()) std::fprintf(stderr, "emu: cuMemAlloc %zu -> 0x%llx\n", bytes, (unsigned long long)*p);
    return CUDA_SUCCESS;
}
/// Gives device buffer `p` back (`what`: the call, for the message).
static CUresult release(CUdeviceptr p, const char* what) {
    EMU_LOCKED;
    auto it = device_buffers().find((uintptr_t)p);
    if (it == device_buffers().end()) {
        std::fprintf(stderr, "emulated CUDA device: %s(0x%llx): not a device buffer\n", what,
                     (unsigned long long)p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    g_allocated -= it->second;
    device_buffers().erase(it);
    return emu_device_free((void*)(uintptr_t)p) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult cuMemFree(CUdeviceptr p) {
    if (!p) return CUDA_SUCCESS;
    // A captured graph may use the buffer whenever it is launched.
    if (any_capture()) return capture_refuses("cuMemFree", nullptr);
    // cuMemFree synchronises the device: no queued work may still use the buffer.
    if (async_streams()) wait_for_streams();
    return release(p, "cuMemFree");
}
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) { return cuMemAlloc(p, bytes); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    if (capturing(s)) return capture_refuses("cuMemFreeAsync (not emulated in graphs)", s);
    if (!async_streams()) return cuMemFree(p);
    enqueue(s, as_work([p] { return release(p, "cuMemFreeAsync"); }));
    return CUDA_SUCCESS;
}
CUresult cuMemGetInfo(size_t* free_bytes, size_t* total) {
    EMU_LOCKED;
    *free_bytes = kTotalMemory - g_allocated;
    *total = kTotalMemory;
    return CUDA_SUCCESS;
}
CUresult cuMemAllocHost(void** p, size_t bytes) {
    *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096 + 4096);
    if (!*p) return CUDA_ERROR_OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(g_sched);
    pinned_ranges()[(uintptr_t)*p] = bytes;
    return CUDA_SUCCESS;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int) { return cuMemAllocHost(p, bytes); }
CUresult cuMemFreeHost(void* p) {
    {
        std::lock_guard<std::mutex> g(g_sched);
        pinned_ranges().erase((uintptr_t)p);
    }
    std::free(p);
    return CUDA_SUCCESS;
}
CUresult cuMemHostRegister(void* p, size_t bytes, unsigned int) {
    std::lock_guard<std::mutex> g(g_sched);
    pinned_ranges()[(uintptr_t)p] = bytes;
    return CUDA_SUCCESS;
}
CUresult cuMemHostUnregister(void* p) {
    std::lock_guard<std::mutex> g(g_sched);
    pinned_ranges().erase((uintptr_t)p);
    return CUDA_SUCCESS;
}
CUresult cuMemHostGetDevicePointer(CUdeviceptr* d, void* p, unsigned int) {
    *d = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t bytes) {
    EMU_LOCKED;
    if (CUresult r = device_range(dst, bytes, "a copy to the device")) return r;
    return copy((void*)(uintptr_t)dst, src, bytes);
}
CUresult cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t bytes) {
    EMU_LOCKED;
    if (CUresult r = device_range(src, bytes, "a copy from the device")) return r;
    return copy(dst, (const void*)(uintptr_t)src, bytes);
}
CUresult cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    EMU_LOCKED;
    if (CUresult r = device_range(src, bytes, "a device copy's source")) return r;
    if (CUresult r = device_range(dst, bytes, "a device copy's destination")) return r;
    return copy((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, bytes);
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t bytes, CUstream s) {
    if (direct(s)) return cuMemcpyHtoD(dst, src, bytes);
    // A graph's copy reads its source when the graph runs: from pageable memory CUDA refuses
    // it (the caller may reuse the memory at once).
    if (capturing(s) && !is_pinned(src, bytes))
        return capture_refuses("a copy to the device from pageable memory", s);
    {
        EMU_LOCKED;
        if (CUresult r = device_range(dst, bytes, "a copy to the device")) return r;
    }
    if (is_pinned(src, bytes)) {
        enqueue(s, as_work([=] { return cuMemcpyHtoD(dst, src, bytes); }));
    } else {
        // Pageable memory is staged when the call is made (the caller may reuse it at once).
        auto staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
        enqueue(s, as_work([=] { return cuMemcpyHtoD(dst, staged->data(), bytes); }));
    }
    return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream s) {
    if (direct(s)) return cuMemcpyDtoH(dst, src, bytes);
    if (capturing(s) && !is_pinned(dst, bytes))
        return capture_refuses("a copy from the device to pageable memory", s);
    {
        EMU_LOCKED;
        if (CUresult r = device_range(src, bytes, "a copy from the device")) return r;
    }
    enqueue(s, as_work([=] { return cuMemcpyDtoH(dst, src, bytes); }));
    // Into pageable memory the copy is synchronous: done, in stream order, when it returns.
    return is_pinned(dst, bytes) ? CUDA_SUCCESS : cuStreamSynchronize(s);
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
    if (direct(s)) return cuMemcpyDtoD(dst, src, bytes);
    {
        EMU_LOCKED;
        if (CUresult r = device_range(src, bytes, "a device copy's source")) return r;
        if (CUresult r = device_range(dst, bytes, "a device copy's destination")) return r;
    }
    enqueue(s, as_work([=] { return cuMemcpyDtoD(dst, src, bytes); }));
    return CUDA_SUCCESS;
}
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    EMU_LOCKED;
    return copy((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, bytes);
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
    enqueue(s, as_work([=] { return cuMemcpy(dst, src, bytes); }));
    return CUDA_SUCCESS;
}
CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext, CUdeviceptr src, CUcontext, size_t bytes) {
    return cuMemcpy(dst, src, bytes);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext, CUdeviceptr src, CUcontext, size_t bytes,
                           CUstream s) {
    return cuMemcpyAsync(dst, src, bytes, s);
}
CUresult cuMemsetD8(CUdeviceptr p, unsigned char v, size_t n) { return fill(p, v, n); }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
    return fill_async(p, v, n, s);
}
CUresult cuMemsetD16(CUdeviceptr p, unsigned short v, size_t n) { return fill(p, v, n); }
CUresult cuMemsetD16Async(CUdeviceptr p, unsigned short v, size_t n, CUstream s) {
    return fill_async(p, v, n, s);
}
CUresult cuMemsetD32(CUdeviceptr p, unsigned int v, size_t n) { return fill(p, v, n); }
CUresult cuMemsetD32Async(CUdeviceptr p, unsigned int v, size_t n, CUstream s) {
    return fill_async(p, v, n, s);
}
CUresult cuPointerGetAttribute(void* data, CUpointer_attribute a, CUdeviceptr p) {
    EMU_LOCKED;
    if (a == CU_POINTER_ATTRIBUTE_MEMORY_TYPE) {
        *(unsigned int*)data = in_device_buffer((uintptr_t)p, 1) ? CU_MEMORYTYPE_DEVICE
                                                                  : CU_MEMORYTYPE_HOST;
        return CUDA_SUCCESS;
    }
    if (a == CU_POINTER_ATTRIBUTE_CONTEXT) {
        *(CUcontext*)data = reinterpret_cast<CUcontext>(&g_ctx[current_device()]);
        return CUDA_SUCCESS;
    }
    return unsupported("cuPointerGetAttribute of this attribute");
}

// ---- modules and launches -------------------------------------------------------------

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    const char* s = static_cast<const char*>(image);
    if (std::strncmp(s, kCubinMagic, sizeof kCubinMagic - 1) != 0) {
        std::fprintf(stderr, "emulated CUDA device: a module image that the emulated NVRTC did "
                             "not write (a real CUBIN from a kernel cache? set "
                             "MESHTRAIN_KERNEL_CACHE=off)\n");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    Module* mod = new Module;
    mod->file = s + sizeof kCubinMagic - 1;
    *m = reinterpret_cast<CUmodule>(mod);
    return CUDA_SUCCESS;
}
CUresult cuModuleLoadDataEx(CUmodule* m, const void* image, unsigned int, CUjit_option*, void**) {
    return cuModuleLoadData(m, image);
}
CUresult cuModuleUnload(CUmodule m) {
    delete reinterpret_cast<Module*>(m);
    return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
    const void* k = emu_device_find_kernel(name);
    if (!k) {
        std::fprintf(stderr, "emulated CUDA device: no kernel called %s\n", name);
        return CUDA_ERROR_NOT_FOUND;
    }
    *f = reinterpret_cast<CUfunction>(const_cast<void*>(k));
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction, CUfunction_attribute a, int v) {
    if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES && v > (227 << 10))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction) {
    switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 64; break;
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}
CUresult cuFuncSetCacheConfig(CUfunction, CUfunc_cache) { return CUDA_SUCCESS; }
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, CUfunction, int block, size_t) {
    *n = block > 0 ? 2048 / block : 1;
    if (*n < 1) *n = 1;
    return CUDA_SUCCESS;
}

/// Runs kernel `f` now; a failure is printed and returned.
static CUresult launch_now(CUfunction f, const unsigned grid[3], const unsigned block[3],
                           unsigned smem, void** params) {
    EMU_LOCKED;
    if (trace())
        std::fprintf(stderr, "emu: launch %s grid (%u,%u,%u) block (%u,%u,%u) smem %u\n",
                     emu_device_kernel_name(f), grid[0], grid[1], grid[2], block[0], block[1],
                     block[2], smem);
    char err[4096] = {0};
    const auto start = std::chrono::steady_clock::now();
    const int failed = emu_device_launch(f, grid, block, smem, params, err, sizeof err);
    account(emu_device_kernel_name(f), start);
    if (failed) {
        std::fprintf(stderr, "emulated CUDA device: launch of %s failed: %s\n",
                     emu_device_kernel_name(f), err);
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int smem,
                        CUstream s, void** params, void** extra) {
    if (extra) return unsupported("cuLaunchKernel with `extra` arguments");
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    if (direct(s)) return launch_now(f, grid, block, smem, params);
    if (const unsigned refused = refused_captured_launch()) {
        bool refuse = false;
        {
            std::lock_guard<std::mutex> g(g_sched);
            if (Stream* st = capturing_locked(s)) refuse = ++st->captured_launches == refused;
        }
        if (refuse) return capture_refuses("a kernel (EMU_DEVICE_REFUSE_CAPTURED_LAUNCH)", s);
    }
    // The arguments are copied now: `params` points into the caller's frame.
    const size_t* sizes = nullptr;
    const size_t count = emu_device_kernel_params(f, &sizes);
    auto args = std::make_shared<std::vector<std::vector<char>>>();
    for (size_t i = 0; i < count; ++i)
        args->emplace_back((const char*)params[i], (const char*)params[i] + sizes[i]);
    enqueue(s, [=] {
        std::vector<void*> p;
        for (auto& a : *args) p.push_back(a.data());
        const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
        if (CUresult r = launch_now(f, g, b, smem, p.data())) set_sticky(r);
    });
    return CUDA_SUCCESS;
}

// ---- graphs: a stream's captured work, replayed -----------------------------------------
// A capture keeps the work queued on its stream (kernels with their arguments copied,
// copies, memsets, products) instead of running it; a graph launch queues that work again,
// in order. Calls a capture cannot hold are refused and invalidate it (capture_refuses).

struct Graph {
    std::shared_ptr<Captured> work;
};

CUresult cuStreamBeginCapture(CUstream s, CUstreamCaptureMode mode) {
    if (!s) return unsupported("capturing the null stream");
    std::lock_guard<std::mutex> g(g_sched);
    Stream* st = reinterpret_cast<Stream*>(s);
    if (st->capture) return CUDA_ERROR_ILLEGAL_STATE;
    st->capture = std::make_shared<Captured>();
    st->invalidated = false;
    st->relaxed = mode == CU_STREAM_CAPTURE_MODE_RELAXED;
    st->captured_launches = 0;
    captures().insert(st);
    return CUDA_SUCCESS;
}
CUresult cuStreamEndCapture(CUstream s, CUgraph* graph) {
    std::lock_guard<std::mutex> g(g_sched);
    Stream* st = capturing_locked(s);
    *graph = nullptr;
    if (!st) return CUDA_ERROR_ILLEGAL_STATE;
    std::shared_ptr<Captured> work = std::move(st->capture);
    st->capture.reset();
    captures().erase(st);
    if (st->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    *graph = reinterpret_cast<CUgraph>(new Graph{work});
    return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status) {
    std::lock_guard<std::mutex> g(g_sched);
    Stream* st = capturing_locked(s);
    *status = !st                ? CU_STREAM_CAPTURE_STATUS_NONE
              : st->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    return CUDA_SUCCESS;
}
CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long) {
    *exec = reinterpret_cast<CUgraphExec>(new Graph{reinterpret_cast<Graph*>(graph)->work});
    return CUDA_SUCCESS;
}
CUresult cuGraphUpload(CUgraphExec, CUstream) { return CUDA_SUCCESS; }
/// The graph's work queued on `s` in its order; with synchronous streams it runs now and its
/// first failure is returned.
CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) {
    if (capturing(s)) return capture_refuses("cuGraphLaunch into a capture (not emulated)", s);
    for (const auto& work : *reinterpret_cast<Graph*>(exec)->work) enqueue(s, work);
    if (async_streams()) return CUDA_SUCCESS;
    std::lock_guard<std::mutex> g(g_sched);
    return g_sticky;
}
CUresult cuGraphExecDestroy(CUgraphExec exec) {
    delete reinterpret_cast<Graph*>(exec);
    return CUDA_SUCCESS;
}
CUresult cuGraphDestroy(CUgraph graph) {
    delete reinterpret_cast<Graph*>(graph);
    return CUDA_SUCCESS;
}

} // extern "C"

// ---- NVRTC ----------------------------------------------------------------------------
// A "compilation" keeps the program's name; its CUBIN is that name behind a magic prefix, and
// the module it loads finds its kernels by name in kernels.cpp's table (the same text,
// compiled by g++ when the device was built).

namespace {
struct Program {
    std::string name;
    std::string cubin;
};
} // namespace

extern "C" {

nvrtcResult nvrtcVersion(int* major, int* minor) {
    // Not NVRTC's version: the kernel cache keys its CUBINs by this, and the emulated
    // device's "CUBINs" must never be taken for real ones (or the reverse).
    *major = 0;
    *minor = 1;
    return NVRTC_SUCCESS;
}
const char* nvrtcGetErrorString(nvrtcResult) { return "emulated NVRTC error"; }
nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char*, const char* name, int,
                               const char* const*, const char* const*) {
    Program* p = new Program;
    p->name = name ? name : "program";
    *prog = reinterpret_cast<nvrtcProgram>(p);
    return NVRTC_SUCCESS;
}
nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog) {
    delete reinterpret_cast<Program*>(*prog);
    *prog = nullptr;
    return NVRTC_SUCCESS;
}
nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int, const char* const*) {
    Program* p = reinterpret_cast<Program*>(prog);
    p->cubin = std::string(kCubinMagic) + p->name;
    p->cubin.push_back('\0');
    return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t* n) {
    *n = reinterpret_cast<Program*>(prog)->cubin.size();
    return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char* out) {
    const std::string& c = reinterpret_cast<Program*>(prog)->cubin;
    std::memcpy(out, c.data(), c.size());
    return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetPTXSize(nvrtcProgram prog, size_t* n) { return nvrtcGetCUBINSize(prog, n); }
nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char* out) { return nvrtcGetCUBIN(prog, out); }
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram, size_t* n) {
    *n = 1;
    return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetProgramLog(nvrtcProgram, char* log) {
    log[0] = '\0';
    return NVRTC_SUCCESS;
}

} // extern "C"

// ---- cuBLASLt -------------------------------------------------------------------------
// Declared here (cublasLt.h is not among the headers pip's CUDA wheels install); the values
// are cublasLt.h's.

namespace {
enum LtStatus { LT_SUCCESS = 0, LT_INVALID_VALUE = 7, LT_NOT_SUPPORTED = 15 };
enum DescAttr {
    DESC_COMPUTE_TYPE = 0,
    DESC_SCALE_TYPE = 1,
    DESC_POINTER_MODE = 2,
    DESC_TRANSA = 3,
    DESC_TRANSB = 4,
    DESC_EPILOGUE = 7,
    DESC_BIAS_POINTER = 8,
    DESC_EPILOGUE_AUX_POINTER = 11,
    DESC_EPILOGUE_AUX_LD = 12,
    DESC_A_SCALE_POINTER = 17,
    DESC_B_SCALE_POINTER = 18,
};
constexpr int kComputeTf32 = 77;

struct LtDesc {
    int compute = 68, scale = 0;
    int transa = 0, transb = 0;
    int epilogue = EMU_EPILOGUE_DEFAULT;
    uint64_t bias = 0, aux = 0, a_scale = 0, b_scale = 0;
    int64_t aux_ld = 0;
};
struct LtLayout {
    int type;
    uint64_t rows, cols;
    int64_t ld;
};
struct LtAlgo {
    uint64_t data[8];
};
struct LtHeuristic {
    LtAlgo algo;
    size_t workspace;
    int state;
    float waves;
    int reserved[4];
};

template <class T> T read_value(const void* buf, size_t size) {
    T v{};
    std::memcpy(&v, buf, size < sizeof v ? size : sizeof v);
    return v;
}

} // namespace

extern "C" {

int cublasLtCreate(void** handle) {
    *handle = new int(0);
    return LT_SUCCESS;
}
int cublasLtDestroy(void* handle) {
    delete static_cast<int*>(handle);
    return LT_SUCCESS;
}
size_t cublasLtGetVersion() { return 130000; }
int cublasLtMatmulDescCreate(void** desc, int compute, int scale) {
    LtDesc* d = new LtDesc;
    d->compute = compute;
    d->scale = scale;
    *desc = d;
    return LT_SUCCESS;
}
int cublasLtMatmulDescDestroy(void* desc) {
    delete static_cast<LtDesc*>(desc);
    return LT_SUCCESS;
}
int cublasLtMatmulDescSetAttribute(void* desc, int attr, const void* buf, size_t size) {
    LtDesc* d = static_cast<LtDesc*>(desc);
    switch (attr) {
    case DESC_COMPUTE_TYPE: d->compute = read_value<int>(buf, size); break;
    case DESC_SCALE_TYPE: d->scale = read_value<int>(buf, size); break;
    case DESC_POINTER_MODE:
        if (read_value<int>(buf, size) != 0) {
            std::fprintf(stderr, "emulated cuBLASLt: only host alpha/beta are emulated\n");
            return LT_NOT_SUPPORTED;
        }
        break;
    case DESC_TRANSA: d->transa = read_value<int>(buf, size); break;
    case DESC_TRANSB: d->transb = read_value<int>(buf, size); break;
    case DESC_EPILOGUE: d->epilogue = (int)read_value<unsigned>(buf, size); break;
    case DESC_BIAS_POINTER: d->bias = read_value<uint64_t>(buf, size); break;
    case DESC_EPILOGUE_AUX_POINTER: d->aux = read_value<uint64_t>(buf, size); break;
    case DESC_EPILOGUE_AUX_LD: d->aux_ld = read_value<int64_t>(buf, size); break;
    case DESC_A_SCALE_POINTER: d->a_scale = read_value<uint64_t>(buf, size); break;
    case DESC_B_SCALE_POINTER: d->b_scale = read_value<uint64_t>(buf, size); break;
    default:
        std::fprintf(stderr, "emulated cuBLASLt: matmul attribute %d is not emulated\n", attr);
        return LT_NOT_SUPPORTED;
    }
    return LT_SUCCESS;
}
int cublasLtMatrixLayoutCreate(void** layout, int type, uint64_t rows, uint64_t cols,
                               int64_t ld) {
    *layout = new LtLayout{type, rows, cols, ld};
    return LT_SUCCESS;
}
int cublasLtMatrixLayoutDestroy(void* layout) {
    delete static_cast<LtLayout*>(layout);
    return LT_SUCCESS;
}
int cublasLtMatmulPreferenceCreate(void** pref) {
    *pref = new int(0);
    return LT_SUCCESS;
}
int cublasLtMatmulPreferenceDestroy(void* pref) {
    delete static_cast<int*>(pref);
    return LT_SUCCESS;
}
int cublasLtMatmulPreferenceSetAttribute(void*, int, const void*, size_t) { return LT_SUCCESS; }

/// One "algorithm" for every description the products below run; none for the rest (the
/// caller then takes its unfused path, as it does where cuBLASLt offers nothing).
int cublasLtMatmulAlgoGetHeuristic(void*, void* desc, void* a, void* b, void* c, void* d, void*,
                                   int requested, LtHeuristic* results, int* count) {
    const LtDesc* ds = static_cast<const LtDesc*>(desc);
    const LtLayout *la = static_cast<LtLayout*>(a), *lb = static_cast<LtLayout*>(b),
                   *ld = static_cast<LtLayout*>(d);
    (void)c;
    *count = 0;
    if (!emu_device_gemm_runs(la->type, lb->type, ld->type, ds->epilogue) || requested < 1)
        return LT_SUCCESS;
    std::memset(&results[0], 0, sizeof results[0]);
    results[0].algo.data[0] = 0x454d55; // "EMU"
    results[0].state = LT_SUCCESS;
    results[0].waves = 1.0f;
    *count = 1;
    return LT_SUCCESS;
}

int cublasLtMatmul(void*, void* desc, const void* alpha, const void* a, void* adesc,
                   const void* b, void* bdesc, const void* beta, const void* c, void* cdesc,
                   void* d, void* ddesc, const void*, void*, size_t, void* stream) {
    EMU_LOCKED;
    const LtDesc* ds = static_cast<const LtDesc*>(desc);
    const LtLayout *la = static_cast<LtLayout*>(adesc), *lb = static_cast<LtLayout*>(bdesc),
                   *lc = static_cast<LtLayout*>(cdesc), *ld = static_cast<LtLayout*>(ddesc);
    if (c != d || lc->type != ld->type || lc->ld != ld->ld) {
        std::fprintf(stderr, "emulated cuBLASLt: only C = D products are emulated\n");
        return LT_NOT_SUPPORTED;
    }
    EmuGemm g{};
    g.m = ld->rows;
    g.n = ld->cols;
    g.transa = ds->transa;
    g.transb = ds->transb;
    g.k = ds->transa ? la->rows : la->cols;
    const uint64_t b_k = ds->transb ? lb->cols : lb->rows;
    const uint64_t a_m = ds->transa ? la->cols : la->rows;
    const uint64_t b_n = ds->transb ? lb->rows : lb->cols;
    if (b_k != g.k || a_m != g.m || b_n != g.n) {
        std::fprintf(stderr, "emulated cuBLASLt: the layouts' shapes disagree\n");
        return LT_INVALID_VALUE;
    }
    g.a = a;
    g.lda = (size_t)la->ld;
    g.a_type = la->type;
    g.b = b;
    g.ldb = (size_t)lb->ld;
    g.b_type = lb->type;
    g.d = d;
    g.ldd = (size_t)ld->ld;
    g.d_type = ld->type;
    g.alpha = *static_cast<const float*>(alpha);
    g.beta = *static_cast<const float*>(beta);
    g.compute_tf32 = ds->compute == kComputeTf32;
    g.epilogue = ds->epilogue;
    g.bias = (void*)(uintptr_t)ds->bias;
    g.aux = (void*)(uintptr_t)ds->aux;
    g.aux_ld = (size_t)ds->aux_ld;
    g.a_scale = (const float*)(uintptr_t)ds->a_scale;
    g.b_scale = (const float*)(uintptr_t)ds->b_scale;
    // Every operand must lie in device memory, as on the GPU.
    auto elem = [](int t) { return t == EMU_R_32F ? 4 : (t == EMU_R_8F_E4M3 || t == EMU_R_8F_E5M2) ? 1 : 2; };
    auto span = [](uint64_t rows, uint64_t cols, int64_t ldv) { return (size_t)((cols - 1) * (uint64_t)ldv + rows); };
    if (device_range((CUdeviceptr)(uintptr_t)a, span(la->rows, la->cols, la->ld) * elem(la->type), "cuBLASLt's A") ||
        device_range((CUdeviceptr)(uintptr_t)b, span(lb->rows, lb->cols, lb->ld) * elem(lb->type), "cuBLASLt's B") ||
        device_range((CUdeviceptr)(uintptr_t)d, span(ld->rows, ld->cols, ld->ld) * elem(ld->type), "cuBLASLt's D"))
        return LT_INVALID_VALUE;
    auto run = [g] {
        EMU_LOCKED;
        char err[512] = {0};
        const auto start = std::chrono::steady_clock::now();
        const int failed = emu_device_gemm(&g, err, sizeof err);
        account("cublasLtMatmul", start);
        if (failed) std::fprintf(stderr, "emulated cuBLASLt: %s\n", err);
        return failed;
    };
    if (direct((CUstream)stream)) return run() ? LT_NOT_SUPPORTED : LT_SUCCESS;
    // The descriptors are resolved now (the caller may change or destroy them), the product
    // runs in stream order.
    enqueue((CUstream)stream, [run] {
        if (run()) set_sticky(CUDA_ERROR_LAUNCH_FAILED);
    });
    return LT_SUCCESS;
}

} // extern "C"

// ---- for the emulated NCCL (nccl.cpp) ---------------------------------------------------

extern "C" int emu_device_in_memory(const void* p, size_t bytes) {
    EMU_LOCKED;
    return in_device_buffer((uintptr_t)p, bytes);
}

extern "C" int emu_device_current_ordinal() { return current_device(); }

extern "C" void emu_device_enqueue(void* stream, void (*fn)(void*), void* arg) {
    enqueue(reinterpret_cast<CUstream>(stream), [fn, arg] { fn(arg); });
}
