// The fake CUDA driver: the subset of libcuda's API that cmm's CUDA backend (through
// cudarc) calls, implemented on the CPU, so that `CudaBackend` itself, its driver calls
// included, runs without a GPU (cmm-cuda `fake`, `CMM_FAKE_CUDA=1`).
//
// Appended to the host twin's translation unit (runtime.h, common.cuh, the kernels and
// their launchers) and built as a shared library whose soname is `libcuda.so`; loaded
// before cudarc looks for the driver, it is the driver cudarc finds.
//
// The model, and what it checks:
// - Device memory is host memory with 256 guard bytes of 0xff on both sides of every
//   allocation. A kernel or copy that writes a guard is a sticky
//   CUDA_ERROR_ILLEGAL_ADDRESS of its context, as a fault is on a GPU; a read of one
//   gives NaN. Copies and stream memory operations outside every allocation, frees of
//   unknown pointers and use of a context after it was reset are errors too, as are a
//   stream memory operation or a cuBLAS operand on another device's memory without
//   peer access, and a function launched outside its module's context. A free
//   does not wait for queued work: the memory is poisoned and kept out of reuse, so
//   work that still uses it computes NaN. (After a sticky error a GPU kills the
//   context's kernels; here a running kernel goes on to its own deadline, which is
//   why freed memory, host memory included, is never handed out again while it might.)
// - Modules are PTX or sm_90 cubins: cuModuleLoadData records the PTX's `.entry` names
//   or the cubin's entry symbols, and cuModuleGetFunction finds only those, running the host twin's launcher of that
//   name. cuLaunchKernelEx (the backend's only launch call) copies the parameter values
//   at the call, as the driver does (their sizes come from the kernel's C++ signature),
//   checks the launch bounds, and takes two launch attributes: a priority within the
//   range cuCtxGetStreamPriorityRange reports (0 to -5, as on an H100), and a cluster
//   dimension along x of at most the host twin's clusters (2) that tiles the grid.
//   cuOccupancyMaxActiveClusters says a cluster of the SM count's fit (one CTA per SM),
//   or CMM_FAKE_CUDA_CLUSTERS.
// - Streams feed FIFO hardware queues, one worker thread each: stream k of a context
//   (in creation order) feeds queue k mod CUDA_DEVICE_MAX_CONNECTIONS, the NULL stream
//   queue 0. A queue runs one item at a time, so a spinning kernel, a stream wait on a
//   value or an event holds everything behind it in its queue, other streams' work
//   included: the hazard cmm's hang check (cmm_core::verify::queues) is about. With
//   CUDA_LAUNCH_BLOCKING=1 a launch returns only once its kernel has run.
// - Copies are cuMemcpy2DAsync and CUDA 13's cuMemcpyBatchAsync (source read in stream
//   order, the one order modelled); both run as items of their stream, and the fake counts
//   the copies a batch asked of the copy engines. Where a GPU runs a copy (copy engine or
//   SMs) does not show here.
// - The NULL stream is the legacy default stream without its implicit synchronisation
//   with blocking streams (cmm creates only non-blocking ones). Synchronous copies and
//   memsets first drain it, as they do on a GPU.
// - Loading code waits for the context's running work, as on a GPU: a function's first
//   launch under lazy module loading (unless CUDA_MODULE_LOADING=EAGER), and the fake
//   cuBLAS's first GEMM of each shape (cuBLASLt loads its kernels then). A kernel that
//   spins until the host acts after such a load, as cmm's gate does, holds the host.
// - A sticky error makes every later item of its context a no-op and every call
//   return it, until cuDevicePrimaryCtxReset. Tests can inject one (a faulting launch)
//   or drop a launch or a stream write (a lost signal): cmm_fake_inject.
// What it cannot show: timing, the GPU's memory model, co-residency of persistent
// kernels (every block of a launch that waits for others gets its own OS thread), and
// any check the real driver makes that is not written here.

#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>

#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>

namespace cmm_fake {

typedef int CUresult;
enum : int {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    NO_BINARY_FOR_GPU = 209,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    PEER_ACCESS_UNSUPPORTED = 217,
    PEER_ACCESS_ALREADY_ENABLED = 704,
    LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
};

constexpr size_t GUARD = 256;
constexpr u64 TOTAL_MEMORY = 80ull << 30;

typedef int (*Entry)(const u32*, const u32*, u32, void**, char*, u64);
typedef u32 (*ParamSizes)(u64*, u32);
typedef u32 (*ModeOf)();

struct Context;

struct Stream {
    Context* ctx;
    int queue;
    std::atomic<u64> submitted{0}, completed{0};
    // The priority attribute (cuStreamSetAttribute); 0, the default, when created.
    std::atomic<int> priority{0};
};

// For tests: how many items were enqueued on streams of each priority (index -priority).
constexpr int PRIORITY_SLOTS = 64;
static std::atomic<u64> enqueued_at_priority[PRIORITY_SLOTS];

struct Item {
    Stream* stream;
    std::function<void()> work;
};

struct Queue {
    std::mutex m;
    std::condition_variable cv;
    std::deque<Item> items;
};

struct Context {
    int device;
    int queue_count;
    std::vector<std::unique_ptr<Queue>> queues;
    std::unique_ptr<Stream> legacy;
    std::atomic<int> sticky{0};
    std::atomic<bool> dead{false};
    int streams_created = 0;
    int retained = 0;
    std::set<Context*> peers;
    std::vector<char*> freed;  // raw blocks freed by cuMemFree, poisoned, not yet reused
    u64 freed_bytes = 0;
};

struct Allocation {
    char* base;  // first byte the caller owns
    size_t bytes;
    Context* ctx;  // nullptr for page-locked host memory
    bool guarded = true;  // false for a mapping of shared memory (cuMemMap): no guard bytes
};

struct Event {
    Context* ctx;
    u32 flags;
    std::atomic<u64> recorded{0}, completed{0}, at_ns{0};
};

struct Module {
    Context* ctx;
    std::set<std::string> entries;
};

struct Function {
    Context* ctx;  // of its module: it launches only on that context's streams
    std::string name;
    Entry entry;
    ParamSizes params;
    u32 mode;
    std::atomic<bool> loaded{false};  // under lazy loading, its first launch loads it
    std::atomic<int> max_dynamic_shared{0};  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
};

// An sm_90 CTA's shared memory: 48 KiB unasked, 227 KiB after cuFuncSetAttribute.
constexpr int DEFAULT_SHARED = 49152, OPT_IN_SHARED = 232448;

inline int shared_limit(const Function* f) { return std::max(DEFAULT_SHARED, f->max_dynamic_shared.load()); }

// One lock for the tables; queues have their own. The tables are never destroyed: the
// workers are detached threads, and one may still be running a kernel of a lost context
// when the process exits.
static std::mutex& lock = *new std::mutex;
static std::condition_variable& progress = *new std::condition_variable;  // an item completed
static bool initialised = false;
static std::vector<Context*>& primary = *new std::vector<Context*>;  // per device, its primary context
static std::map<u64, Allocation>& allocations = *new std::map<u64, Allocation>;  // by caller address
static thread_local Context* current = nullptr;
// An injected failure (cmm_fake_inject): the call on `injected_target` (a kernel's
// entry name, or "cuStreamWriteValue32") that brings `injected_countdown` to zero
// faults (INJECT_FAULT) or is silently dropped (INJECT_DROP) instead of running.
enum : int { INJECT_FAULT = 1, INJECT_DROP = 2 };
static std::string& injected_target = *new std::string;
static u32 injected_countdown = 0;
static int injected_kind = 0;

// What happens to this call on `target`: 0 (it runs), INJECT_FAULT or INJECT_DROP.
inline int take_injection(const std::string& target) {
    std::lock_guard<std::mutex> g(lock);
    if (injected_countdown == 0 || target != injected_target || --injected_countdown != 0) return 0;
    return injected_kind;
}

inline void report(Context* ctx, int code, const std::string& why) {
    int expected = 0;
    if (ctx->sticky.compare_exchange_strong(expected, code)) {
        std::fprintf(stderr, "cmm fake CUDA driver: device %d: %s (sticky error %d)\n", ctx->device, why.c_str(), code);
    }
}

// An integer from the environment, `fallback` when unset, clamped to [lo, hi].
inline int env_int(const char* name, int fallback, int lo, int hi) {
    const char* text = std::getenv(name);
    int n = text != nullptr ? std::atoi(text) : fallback;
    return n < lo ? lo : (n > hi ? hi : n);
}

inline int device_count() { return env_int("CMM_FAKE_CUDA_GPUS", 2, 1, 8); }
inline int sm_count() { return env_int("CMM_FAKE_CUDA_SMS", 132, 1, 1 << 16); }  // an H100's
inline int queue_count() { return env_int("CUDA_DEVICE_MAX_CONNECTIONS", 8, 1, 32); }

// CUDA_LAUNCH_BLOCKING=1: every kernel launch returns once its kernel has run, as the
// driver does for debugging. CMM_FAKE_CUDA_BLOCKING_LAUNCHES=1 does the same without
// telling the backend (which reads CUDA_LAUNCH_BLOCKING), as a tool that serialises GPU
// work would; cmm_fake_set_launch_blocking overrides both, for tests.
static std::atomic<int> launch_blocking{-1};

inline bool env_is_one(const char* name) {
    const char* text = std::getenv(name);
    return text != nullptr && std::strcmp(text, "1") == 0;
}

inline bool launches_block() {
    int v = launch_blocking.load();
    if (v < 0) {
        v = env_is_one("CUDA_LAUNCH_BLOCKING") || env_is_one("CMM_FAKE_CUDA_BLOCKING_LAUNCHES") ? 1 : 0;
        launch_blocking.store(v);
    }
    return v == 1;
}


// The allocation holding [addr, addr + bytes), or null (lock held by the caller).
inline const Allocation* find(u64 addr, u64 bytes) {
    auto it = allocations.upper_bound(addr);
    if (it == allocations.begin()) return nullptr;
    --it;
    const Allocation& a = it->second;
    u64 base = (u64)a.base;
    if (addr >= base && addr + bytes <= base + a.bytes) return &a;
    return nullptr;
}

inline bool inside(u64 addr, u64 bytes) {
    std::lock_guard<std::mutex> g(lock);
    return find(addr, bytes) != nullptr;
}

// Whether work of `ctx` may address [addr, addr + bytes): one allocation, mapped host
// memory or device memory of `ctx` itself or of a peer it enabled access to.
inline bool accessible(Context* ctx, u64 addr, u64 bytes) {
    std::lock_guard<std::mutex> g(lock);
    const Allocation* a = find(addr, bytes);
    return a != nullptr && (a->ctx == nullptr || a->ctx == ctx || ctx->peers.count(a->ctx) != 0);
}

// Checks (and restores) the guards of every device allocation; the first broken one
// is reported on `ctx`, naming the allocation and the first byte written.
inline void check_guards(Context* ctx, const char* after) {
    std::lock_guard<std::mutex> g(lock);
    for (auto& [addr, a] : allocations) {
        if (a.ctx == nullptr || !a.guarded) continue;
        for (int side = 0; side < 2; ++side) {
            unsigned char* guard = (unsigned char*)(side == 0 ? a.base - GUARD : a.base + a.bytes);
            // Intact guards (nearly always): one comparison of the whole guard.
            static const std::array<unsigned char, GUARD> intact = [] {
                std::array<unsigned char, GUARD> ones{};
                ones.fill(0xff);
                return ones;
            }();
            if (std::memcmp(guard, intact.data(), GUARD) == 0) continue;
            for (size_t i = 0; i < GUARD; ++i) {
                if (guard[i] == 0xff) continue;
                char why[256];
                std::snprintf(why, sizeof why, "%s wrote %s the %zu-byte allocation at 0x%llx (guard byte %zu)", after,
                              side == 0 ? "before" : "past", a.bytes, (unsigned long long)addr,
                              side == 0 ? GUARD - i : i);
                report(ctx, ILLEGAL_ADDRESS, why);
                std::memset(guard, 0xff, GUARD);
                break;
            }
        }
    }
}

inline void worker(Context* ctx, Queue* q) {
    for (;;) {
        Item item;
        {
            std::unique_lock<std::mutex> g(q->m);
            q->cv.wait(g, [&] { return !q->items.empty(); });
            item = std::move(q->items.front());
        }
        if (ctx->sticky.load() == 0 && !ctx->dead.load()) item.work();
        {
            std::lock_guard<std::mutex> g(q->m);
            q->items.pop_front();
        }
        {
            std::lock_guard<std::mutex> g(lock);
            item.stream->completed.fetch_add(1);
        }
        progress.notify_all();
    }
}

inline Context* new_context(int device) {
    Context* ctx = new Context();
    ctx->device = device;
    ctx->queue_count = queue_count();
    for (int i = 0; i < ctx->queue_count; ++i) {
        ctx->queues.emplace_back(new Queue());
        std::thread(worker, ctx, ctx->queues.back().get()).detach();
    }
    ctx->legacy.reset(new Stream());
    ctx->legacy->ctx = ctx;
    ctx->legacy->queue = 0;
    return ctx;
}

inline void enqueue(Stream* s, std::function<void()> work) {
    Queue* q = s->ctx->queues[s->queue].get();
    std::lock_guard<std::mutex> g(q->m);
    s->submitted.fetch_add(1);
    int slot = -s->priority.load();
    if (slot >= 0 && slot < PRIORITY_SLOTS) enqueued_at_priority[slot].fetch_add(1);
    q->items.push_back(Item{s, std::move(work)});
    q->cv.notify_one();
}

// The stream a handle names: NULL (and CU_STREAM_LEGACY / PER_THREAD) is the current
// context's legacy stream.
inline Stream* stream_of(void* handle) {
    if ((uintptr_t)handle <= 2) return current != nullptr ? current->legacy.get() : nullptr;
    return static_cast<Stream*>(handle);
}

inline void drain(Stream* s) {
    u64 target = s->submitted.load();
    std::unique_lock<std::mutex> g(lock);
    progress.wait(g, [&] { return s->completed.load() >= target || s->ctx->dead.load(); });
}

inline bool idle(Stream* s) { return s->completed.load() >= s->submitted.load(); }

inline CUresult ready() {
    if (!initialised) return NOT_INITIALIZED;
    if (current == nullptr || current->dead.load()) return INVALID_CONTEXT;
    return current->sticky.load();
}

inline u64 now_ns() { return cmm_globaltimer_ns(); }

// Spins (with naps) until `done`, or the context is reset under it.
template <class F>
inline void spin_until(Context* ctx, F done) {
    u32 nap = 1000;
    while (!done()) {
        if (ctx->dead.load() || ctx->sticky.load() != 0) return;
        timespec t{0, (long)nap};
        nanosleep(&t, nullptr);
        nap = nap < 200000 ? nap * 2 : nap;
    }
}

// cuMemcpyBatchAsync's per-copy attributes (CUmemcpyAttributes, CUDA 12.8 to 13.1).
struct MemLocation {
    int type;
    int id;
};
struct MemcpyAttributes {
    int srcAccessOrder;
    MemLocation srcLocHint, dstLocHint;
    unsigned flags;
};
enum : int { MEMCPY_SRC_ACCESS_ORDER_STREAM = 1 };
enum : unsigned { MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1 };

struct Memcpy2D {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void* srcHost;
    u64 srcDevice;
    void* srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void* dstHost;
    u64 dstDevice;
    void* dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
};

}  // namespace cmm_fake

using namespace cmm_fake;

extern "C" {

CUresult cuInit(unsigned flags) {
    if (flags != 0) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(lock);
    if (!initialised) {
        primary.assign(device_count(), nullptr);
        initialised = true;
    }
    return SUCCESS;
}

CUresult cuDriverGetVersion(int* version) {
    if (version == nullptr) return INVALID_VALUE;
    *version = 13000;
    return SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
    switch (error) {
        case SUCCESS: *name = "CUDA_SUCCESS"; break;
        case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
        case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
        case INVALID_IMAGE: *name = "CUDA_ERROR_INVALID_IMAGE"; break;
        case NO_BINARY_FOR_GPU: *name = "CUDA_ERROR_NO_BINARY_FOR_GPU"; break;
        case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
        case NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
        case NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
        case ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
        case LAUNCH_OUT_OF_RESOURCES: *name = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; break;
        case PEER_ACCESS_UNSUPPORTED: *name = "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"; break;
        case PEER_ACCESS_ALREADY_ENABLED: *name = "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"; break;
        case LAUNCH_FAILED: *name = "CUDA_ERROR_LAUNCH_FAILED"; break;
        case NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *name = nullptr; return INVALID_VALUE;
    }
    return SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** text) {
    CUresult r = cuGetErrorName(error, text);
    if (r == SUCCESS && error != SUCCESS) *text = *text + 11;  // past "CUDA_ERROR_"
    return r;
}

CUresult cuDeviceGetCount(int* count) {
    if (!initialised) return NOT_INITIALIZED;
    *count = (int)primary.size();
    return SUCCESS;
}

CUresult cuDeviceGet(int* device, int ordinal) {
    if (!initialised) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= (int)primary.size()) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, int device) {
    if (device < 0 || device >= (int)primary.size()) return INVALID_DEVICE;
    std::snprintf(name, len, "cmm fake CUDA driver (host twin kernels on the CPU)");
    return SUCCESS;
}

CUresult cuDeviceGetUuid(unsigned char* uuid, int device) {
    if (device < 0 || device >= (int)primary.size()) return INVALID_DEVICE;
    for (int i = 0; i < 16; ++i) uuid[i] = (unsigned char)(i == 15 ? device : 0xc0 + i);
    return SUCCESS;
}

CUresult cuDeviceGetUuid_v2(unsigned char* uuid, int device) { return cuDeviceGetUuid(uuid, device); }

CUresult cuDeviceTotalMem_v2(size_t* bytes, int device) {
    if (device < 0 || device >= (int)primary.size()) return INVALID_DEVICE;
    *bytes = TOTAL_MEMORY;
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, int device) {
    if (device < 0 || device >= (int)primary.size()) return INVALID_DEVICE;
    switch (attribute) {
        case 1: *value = 1024; break;    // MAX_THREADS_PER_BLOCK
        case 2: *value = 1024; break;    // MAX_BLOCK_DIM_X
        case 3: *value = 1024; break;    // MAX_BLOCK_DIM_Y
        case 4: *value = 64; break;      // MAX_BLOCK_DIM_Z
        case 5: *value = 2147483647; break;  // MAX_GRID_DIM_X
        case 6: *value = 65535; break;   // MAX_GRID_DIM_Y
        case 7: *value = 65535; break;   // MAX_GRID_DIM_Z
        case 8: *value = 49152; break;   // MAX_SHARED_MEMORY_PER_BLOCK
        case 10: *value = 32; break;     // WARP_SIZE
        case 16: *value = sm_count(); break;  // MULTIPROCESSOR_COUNT
        case 38: *value = 1 << 20; break;   // L2_CACHE_SIZE (small, as the SM count is)
        case 41: *value = 1; break;      // UNIFIED_ADDRESSING
        case 75: *value = 9; break;      // COMPUTE_CAPABILITY_MAJOR
        case 76: *value = 0; break;      // COMPUTE_CAPABILITY_MINOR
        case 115: *value = 1; break;     // MEMORY_POOLS_SUPPORTED
        default: *value = 0; break;
    }
    return SUCCESS;
}

// For tests: what each ordered pair of GPUs lacks (cmm_fake_deny_peer), as a GPU in
// another PCIe root or without NVLink does: 1 no peer access at all, 2 access without
// native peer atomics.
static std::map<std::pair<int, int>, int>& denied_peers = *new std::map<std::pair<int, int>, int>;

inline int peer_denial(int device, int peer) {
    std::lock_guard<std::mutex> g(lock);
    auto it = denied_peers.find({device, peer});
    return it == denied_peers.end() ? 0 : it->second;
}

CUresult cuDeviceCanAccessPeer(int* can, int device, int peer) {
    if (device < 0 || device >= (int)primary.size() || peer < 0 || peer >= (int)primary.size()) return INVALID_DEVICE;
    *can = device != peer && peer_denial(device, peer) != 1;
    return SUCCESS;
}

// CU_DEVICE_P2P_ATTRIBUTE_*: 1 performance rank, 2 access, 3 native atomics, 4 arrays.
CUresult cuDeviceGetP2PAttribute(int* value, int attribute, int device, int peer) {
    if (device < 0 || device >= (int)primary.size() || peer < 0 || peer >= (int)primary.size() || device == peer)
        return INVALID_DEVICE;
    int denial = peer_denial(device, peer);
    switch (attribute) {
        case 1: *value = 0; break;
        case 2: case 4: *value = denial != 1; break;
        case 3: *value = denial == 0; break;
        default: return INVALID_VALUE;
    }
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(Context** out, int device) {
    if (!initialised) return NOT_INITIALIZED;
    if (device < 0 || device >= (int)primary.size()) return INVALID_DEVICE;
    std::lock_guard<std::mutex> g(lock);
    if (primary[device] == nullptr) primary[device] = new_context(device);
    primary[device]->retained += 1;
    *out = primary[device];
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(int device) {
    if (device < 0 || device >= (int)primary.size()) return INVALID_DEVICE;
    std::lock_guard<std::mutex> g(lock);
    if (primary[device] != nullptr && primary[device]->retained > 0) primary[device]->retained -= 1;
    return SUCCESS;
}

// Destroys the device's primary context: its work is abandoned (workers stuck in a
// kernel stay stuck, so its memory is not reused), every handle of it becomes invalid,
// and the next retain gives a fresh context.
CUresult cuDevicePrimaryCtxReset_v2(int device) {
    if (device < 0 || device >= (int)primary.size()) return INVALID_DEVICE;
    std::lock_guard<std::mutex> g(lock);
    Context* old = primary[device];
    if (old != nullptr) {
        old->dead.store(true);
        for (auto it = allocations.begin(); it != allocations.end();) {
            it = it->second.ctx == old ? allocations.erase(it) : std::next(it);
        }
        primary[device] = nullptr;
    }
    progress.notify_all();
    return SUCCESS;
}

CUresult cuCtxSetCurrent(Context* ctx) {
    if (ctx != nullptr && ctx->dead.load()) return INVALID_CONTEXT;
    current = ctx;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(Context** ctx) {
    *ctx = current;
    return SUCCESS;
}

CUresult cuCtxPushCurrent_v2(Context* ctx) { return cuCtxSetCurrent(ctx); }

CUresult cuCtxGetDevice(int* device) {
    if (current == nullptr) return INVALID_CONTEXT;
    *device = current->device;
    return SUCCESS;
}

// Until every queue of `ctx` is empty (or the context is lost).
static void wait_idle(Context* ctx) {
    std::unique_lock<std::mutex> g(lock);
    progress.wait(g, [&] {
        if (ctx->dead.load()) return true;
        for (auto& q : ctx->queues) {
            std::lock_guard<std::mutex> qg(q->m);
            if (!q->items.empty()) return false;
        }
        return true;
    });
}

// Loading code into a context waits for its running work, as on a GPU: a function's
// first launch under lazy module loading (CUDA's default; CUDA_MODULE_LOADING=EAGER
// loads every function with its module), and a library's kernels (cmm_fake_load_code).
// A kernel that spins until the host acts after that load holds the host there.
// -1: as CUDA_MODULE_LOADING says; 0 lazy, 1 eager (cmm_fake_set_module_loading).
std::atomic<int> module_loading{-1};

static bool lazy_loading() {
    if (int chosen = module_loading.load(); chosen >= 0) return chosen == 0;
    const char* chosen = std::getenv("CUDA_MODULE_LOADING");
    return chosen == nullptr || std::strcmp(chosen, "EAGER") != 0;
}

CUresult cuCtxSynchronize() {
    if (!initialised) return NOT_INITIALIZED;
    if (current == nullptr || current->dead.load()) return INVALID_CONTEXT;
    Context* ctx = current;
    wait_idle(ctx);
    return ctx->sticky.load();
}

CUresult cuCtxEnablePeerAccess(Context* peer, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (flags != 0 || peer == nullptr || peer == current || peer->dead.load()) return INVALID_VALUE;
    if (peer_denial(current->device, peer->device) == 1) return PEER_ACCESS_UNSUPPORTED;
    std::lock_guard<std::mutex> g(lock);
    if (!current->peers.insert(peer).second) return PEER_ACCESS_ALREADY_ENABLED;
    return SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    std::lock_guard<std::mutex> g(lock);
    u64 used = 0;
    for (auto& [addr, a] : allocations) used += a.ctx == current ? a.bytes : 0;
    *free_bytes = TOTAL_MEMORY - used;
    *total = TOTAL_MEMORY;
    return SUCCESS;
}

CUresult cuMemAlloc_v2(u64* out, size_t bytes) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (bytes == 0) return INVALID_VALUE;
    size_t padded = (bytes + 255) / 256 * 256;
    char* raw = static_cast<char*>(std::aligned_alloc(256, padded + 2 * GUARD));
    if (raw == nullptr) return OUT_OF_MEMORY;
    // Fresh device memory holds whatever it held: 0xff here, so a read of memory nobody
    // wrote gives NaN rather than a plausible zero.
    std::memset(raw, 0xff, padded + 2 * GUARD);
    std::lock_guard<std::mutex> g(lock);
    allocations[(u64)(raw + GUARD)] = Allocation{raw + GUARD, bytes, current};
    *out = (u64)(raw + GUARD);
    return SUCCESS;
}

// CU_POINTER_ATTRIBUTE_*: 2 memory type (1 host, 2 device), 9 device ordinal, 11 the
// allocation's start, 12 its size. A pointer inside no allocation is INVALID_VALUE, as
// the driver says of memory it does not know.
CUresult cuPointerGetAttribute(void* data, int attribute, u64 ptr) {
    if (!initialised) return NOT_INITIALIZED;
    std::lock_guard<std::mutex> g(lock);
    const Allocation* a = find(ptr, 1);
    if (a == nullptr) return INVALID_VALUE;
    switch (attribute) {
        case 2: *static_cast<unsigned*>(data) = a->ctx == nullptr ? 1 : 2; break;
        case 9: *static_cast<int*>(data) = a->ctx == nullptr ? -1 : a->ctx->device; break;
        case 11: *static_cast<u64*>(data) = (u64)a->base; break;
        case 12: *static_cast<size_t*>(data) = a->bytes; break;
        default: return INVALID_VALUE;
    }
    return SUCCESS;
}

// Virtual memory management (cuMemCreate and friends), for symmetric heaps shared
// between processes: a physical allocation is a memfd of its size, exported as a POSIX
// file descriptor (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1, the only type taken) and
// imported from one; cuMemAddressReserve reserves inaccessible pages, cuMemMap maps the
// memfd there still inaccessible, and cuMemSetAccess makes it readable and writable, as
// the driver requires. A mapping is an allocation of the context that mapped it, without
// guard bytes (a write past its end lands in the reservation's inaccessible pages and
// kills the process). cuMemUnmap leaves inaccessible pages in its place, or in a lost
// context private poison, which cuMemAddressFree then keeps, for the kernels that may
// still run. Processes that map the same memfd share its memory, semaphores and atomics
// included.
struct MemProp {  // mirror of CUmemAllocationProp
    int type;
    int handle_types;
    int location_type;
    int location_id;
    void* win32;
    unsigned char flags[8];
};

struct MemLocationDesc {  // mirror of CUmemAccessDesc
    int location_type;
    int location_id;
    int flags;
};

struct PhysicalMemory {
    int fd;
    size_t bytes;
};

constexpr size_t VMM_GRANULARITY = 2u << 20;  // as the driver reports for device memory
constexpr int HANDLE_TYPE_POSIX_FD = 1;

static std::map<u64, size_t>& reservations = *new std::map<u64, size_t>;  // address -> bytes
static std::atomic<u64> live_vmm_handles{0};

CUresult cuMemGetAllocationGranularity(size_t* granularity, const MemProp* prop, int option) {
    if (granularity == nullptr || prop == nullptr || option < 0 || option > 1) return INVALID_VALUE;
    *granularity = VMM_GRANULARITY;
    return SUCCESS;
}

CUresult cuMemCreate(u64* handle, size_t bytes, const MemProp* prop, unsigned long long flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (handle == nullptr || prop == nullptr || flags != 0 || bytes == 0 || bytes % VMM_GRANULARITY != 0) return INVALID_VALUE;
    if (prop->type != 1 || prop->location_type != 1 || prop->location_id != current->device) return INVALID_VALUE;
    if ((prop->handle_types & ~HANDLE_TYPE_POSIX_FD) != 0) return NOT_SUPPORTED;
    int fd = memfd_create("cmm-fake-cuda-vmm", MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    *handle = (u64) new PhysicalMemory{fd, bytes};
    live_vmm_handles += 1;
    return SUCCESS;
}

CUresult cuMemExportToShareableHandle(void* shareable, u64 handle, int type, unsigned long long flags) {
    if (shareable == nullptr || handle == 0 || flags != 0) return INVALID_VALUE;
    if (type != HANDLE_TYPE_POSIX_FD) return NOT_SUPPORTED;
    int fd = dup(((PhysicalMemory*)handle)->fd);
    if (fd < 0) return OUT_OF_MEMORY;
    *(int*)shareable = fd;
    return SUCCESS;
}

CUresult cuMemImportFromShareableHandle(u64* handle, void* os_handle, int type) {
    if (!initialised) return NOT_INITIALIZED;
    if (handle == nullptr) return INVALID_VALUE;
    if (type != HANDLE_TYPE_POSIX_FD) return NOT_SUPPORTED;
    struct stat st;
    int fd = (int)(intptr_t)os_handle;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) return INVALID_VALUE;
    int own = dup(fd);
    if (own < 0) return OUT_OF_MEMORY;
    *handle = (u64) new PhysicalMemory{own, (size_t)st.st_size};
    live_vmm_handles += 1;
    return SUCCESS;
}

CUresult cuMemRelease(u64 handle) {
    if (handle == 0) return INVALID_VALUE;
    PhysicalMemory* m = (PhysicalMemory*)handle;
    close(m->fd);
    delete m;
    live_vmm_handles -= 1;
    return SUCCESS;
}

CUresult cuMemAddressReserve(u64* ptr, size_t bytes, size_t alignment, u64 addr, unsigned long long flags) {
    if (ptr == nullptr || bytes == 0 || bytes % VMM_GRANULARITY != 0 || addr != 0 || flags != 0) return INVALID_VALUE;
    if (alignment != 0 && alignment > VMM_GRANULARITY) return NOT_SUPPORTED;
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(lock);
    reservations[(u64)p] = bytes;
    *ptr = (u64)p;
    return SUCCESS;
}

CUresult cuMemAddressFree(u64 ptr, size_t bytes) {
    std::lock_guard<std::mutex> g(lock);
    auto it = reservations.find(ptr);
    if (it == reservations.end() || it->second != bytes) return INVALID_VALUE;
    for (auto& [addr, a] : allocations) {
        if (addr >= ptr && addr < ptr + bytes) return INVALID_VALUE;  // still mapped
    }
    // After a sticky error a kernel of the lost context may still run here (see the
    // model above): its pages stay, poisoned, rather than vanish under it.
    bool lost = current != nullptr && (current->sticky.load() != 0 || current->dead.load());
    if (!lost) munmap((void*)ptr, bytes);
    reservations.erase(it);
    return SUCCESS;
}

// Whether [ptr, ptr + bytes) lies in one reservation (the lock is held).
static bool reserved(u64 ptr, size_t bytes) {
    auto it = reservations.upper_bound(ptr);
    if (it == reservations.begin()) return false;
    --it;
    return ptr + bytes <= it->first + it->second;
}

CUresult cuMemMap(u64 ptr, size_t bytes, size_t offset, u64 handle, unsigned long long flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (handle == 0 || flags != 0 || offset != 0) return INVALID_VALUE;
    PhysicalMemory* m = (PhysicalMemory*)handle;
    std::lock_guard<std::mutex> g(lock);
    if (bytes != m->bytes || !reserved(ptr, bytes) || find(ptr, 1) != nullptr) return INVALID_VALUE;
    void* p = mmap((void*)ptr, bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, m->fd, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    return SUCCESS;
}

CUresult cuMemSetAccess(u64 ptr, size_t bytes, const MemLocationDesc* desc, size_t count) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (desc == nullptr || count != 1 || desc->location_type != 1 || desc->location_id != current->device) return INVALID_VALUE;
    if (desc->flags != 3) return NOT_SUPPORTED;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE only
    std::lock_guard<std::mutex> g(lock);
    if (!reserved(ptr, bytes) || mprotect((void*)ptr, bytes, PROT_READ | PROT_WRITE) != 0) return INVALID_VALUE;
    allocations[ptr] = Allocation{(char*)ptr, bytes, current, false};
    return SUCCESS;
}

CUresult cuMemUnmap(u64 ptr, size_t bytes) {
    std::lock_guard<std::mutex> g(lock);
    if (!reserved(ptr, bytes)) return INVALID_VALUE;
    allocations.erase(ptr);
    // Off the shared memory. In a lost context, onto private poison (0xff, NaN to a
    // reader): a kernel that still runs neither faults nor reaches the peers' memory.
    // Otherwise every stream has drained (the backend's promise) and nothing may touch
    // the range again: it becomes inaccessible, as unmapped device memory is, and costs
    // no page (poisoning it wrote every page of every peer's part, on every run).
    const bool lost = current != nullptr && (current->sticky.load() != 0 || current->dead.load());
    const int prot = lost ? PROT_READ | PROT_WRITE : PROT_NONE;
    void* p = mmap((void*)ptr, bytes, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | (lost ? 0 : MAP_NORESERVE), -1, 0);
    if (p == MAP_FAILED) return INVALID_VALUE;
    if (lost) std::memset(p, 0xff, bytes);
    return SUCCESS;
}

// Freeing does not wait for the streams here: the backend promises to free only what no
// queued work uses (it drains first, or leaks). So freed memory is poisoned (0xff, NaN
// to a reader) and kept out of reuse until the context goes: work that still reads it
// computes NaN, and work that writes it cannot corrupt a later allocation.
CUresult cuMemFree_v2(u64 ptr) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    check_guards(current, "a kernel or copy");
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.find(ptr);
    if (it == allocations.end() || it->second.ctx == nullptr) return INVALID_VALUE;
    if (it->second.ctx != current) return INVALID_CONTEXT;
    std::memset(it->second.base, 0xff, it->second.bytes);
    current->freed.push_back(it->second.base - GUARD);
    current->freed_bytes += it->second.bytes;
    allocations.erase(it);
    // Past a bound, the oldest half goes back to the allocator: long runs stay bounded.
    if (current->freed_bytes > (1ull << 30)) {
        size_t half = current->freed.size() / 2;
        for (size_t i = 0; i < half; ++i) std::free(current->freed[i]);
        current->freed.erase(current->freed.begin(), current->freed.begin() + half);
        current->freed_bytes /= 2;
    }
    return current->sticky.load();
}

CUresult cuMemHostAlloc(void** out, size_t bytes, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (bytes == 0) return INVALID_VALUE;
    char* p = static_cast<char*>(std::calloc(1, bytes));
    if (p == nullptr) return OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(lock);
    // Mapped (DEVICEMAP) host memory is reachable from kernels; record it as such.
    allocations[(u64)p] = Allocation{p, bytes, nullptr};
    (void)flags;
    *out = p;
    return SUCCESS;
}

CUresult cuMemHostGetDevicePointer_v2(u64* out, void* host, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (flags != 0) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(lock);
    const Allocation* a = find((u64)host, 1);
    if (a == nullptr || a->ctx != nullptr) return INVALID_VALUE;
    *out = (u64)host;
    return SUCCESS;
}

// Like device memory, freed host memory is poisoned and never reused: after a sticky
// error a GPU kills the context's kernels, but here a kernel that was running goes on
// until its own deadline, and may still write its status words. (0xff also reads as a
// raised abort word, so such kernels stop at their next look.)
CUresult cuMemFreeHost(void* p) {
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.find((u64)p);
    if (it == allocations.end() || it->second.ctx != nullptr) return INVALID_VALUE;
    std::memset(p, 0xff, it->second.bytes);
    allocations.erase(it);
    return SUCCESS;
}

CUresult cuMemcpyHtoD_v2(u64 dst, const void* src, size_t bytes) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    drain(current->legacy.get());
    if (!inside(dst, bytes)) return INVALID_VALUE;
    std::memcpy((void*)dst, src, bytes);
    return SUCCESS;
}

CUresult cuMemcpyDtoD_v2(u64 dst, u64 src, size_t bytes) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    drain(current->legacy.get());
    if (!accessible(current, dst, bytes) || !accessible(current, src, bytes)) return INVALID_VALUE;
    std::memmove((void*)dst, (const void*)src, bytes);
    return SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void* dst, u64 src, size_t bytes) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    drain(current->legacy.get());
    if (!inside(src, bytes)) return INVALID_VALUE;
    std::memcpy(dst, (const void*)src, bytes);
    return SUCCESS;
}

CUresult cuMemsetD8_v2(u64 dst, unsigned char value, size_t count) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    drain(current->legacy.get());
    if (!inside(dst, count)) return INVALID_VALUE;
    std::memset((void*)dst, value, count);
    return SUCCESS;
}

CUresult cuMemcpy2DAsync_v2(const Memcpy2D* d, void* handle) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr || s->ctx != current) return INVALID_HANDLE;
    // The backend copies device to device only, from the origin of both pointers.
    if (d->srcMemoryType != 2 || d->dstMemoryType != 2 || d->srcXInBytes != 0 || d->srcY != 0 ||
        d->dstXInBytes != 0 || d->dstY != 0) {
        return NOT_SUPPORTED;
    }
    if (d->WidthInBytes > d->srcPitch || d->WidthInBytes > d->dstPitch) return INVALID_VALUE;
    Memcpy2D copy = *d;
    Context* ctx = current;
    enqueue(s, [copy, ctx] {
        u64 rows = copy.Height, width = copy.WidthInBytes;
        if (rows == 0 || width == 0) return;
        u64 src_end = copy.srcPitch * (rows - 1) + width, dst_end = copy.dstPitch * (rows - 1) + width;
        if (!inside(copy.srcDevice, src_end) || !inside(copy.dstDevice, dst_end)) {
            report(ctx, ILLEGAL_ADDRESS, "a 2D copy outside every allocation");
            return;
        }
        for (u64 r = 0; r < rows; ++r) {
            std::memmove((char*)copy.dstDevice + r * copy.dstPitch, (const char*)copy.srcDevice + r * copy.srcPitch,
                         width);
        }
    });
    return SUCCESS;
}

// Copies asked of the copy engines so far (cuMemcpyBatchAsync with the overlap flag).
static std::atomic<u64> copy_engine_copies{0};

// CUDA 13's batched copy: `count` 1D copies in stream order, each under the attributes
// whose range holds it (attrs[i] from attr_idxs[i] on; the first range starts at 0).
// The backend asks the source read in stream order, the order this driver models; a
// source read at the call or in any order is refused, as is an unknown flag.
CUresult cuMemcpyBatchAsync_v2(u64* dsts, u64* srcs, size_t* sizes, size_t count, MemcpyAttributes* attrs,
                               size_t* attr_idxs, size_t num_attrs, void* handle) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr || s->ctx != current) return INVALID_HANDLE;
    if (count == 0 || dsts == nullptr || srcs == nullptr || sizes == nullptr || attrs == nullptr ||
        attr_idxs == nullptr || num_attrs == 0 || num_attrs > count || attr_idxs[0] != 0) {
        return INVALID_VALUE;
    }
    bool engines = true;
    for (size_t i = 0; i < num_attrs; ++i) {
        if ((i > 0 && attr_idxs[i] <= attr_idxs[i - 1]) || attr_idxs[i] >= count) return INVALID_VALUE;
        if (attrs[i].flags & ~MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE) return INVALID_VALUE;
        if (attrs[i].srcAccessOrder != MEMCPY_SRC_ACCESS_ORDER_STREAM) return NOT_SUPPORTED;
        engines = engines && (attrs[i].flags & MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE) != 0;
    }
    std::vector<u64> to(dsts, dsts + count), from(srcs, srcs + count), bytes(sizes, sizes + count);
    if (engines) copy_engine_copies.fetch_add(count);
    Context* ctx = current;
    enqueue(s, [to, from, bytes, ctx] {
        for (size_t i = 0; i < to.size(); ++i) {
            if (bytes[i] == 0) continue;
            if (!inside(from[i], bytes[i]) || !inside(to[i], bytes[i])) {
                report(ctx, ILLEGAL_ADDRESS, "a batched copy outside every allocation");
                return;
            }
            std::memmove((char*)to[i], (const char*)from[i], bytes[i]);
        }
    });
    return SUCCESS;
}

CUresult cuStreamCreate(Stream** out, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (flags > 1) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(lock);
    Stream* s = new Stream();
    s->ctx = current;
    s->queue = current->streams_created++ % current->queue_count;
    *out = s;
    return SUCCESS;
}

CUresult cuStreamCreateWithPriority(Stream** out, unsigned flags, int priority) {
    (void)priority;  // clamped to the range by the driver; no effect here
    return cuStreamCreate(out, flags);
}

// The stream's remaining work still runs, as on a GPU; its record is kept.
CUresult cuStreamDestroy_v2(Stream* s) {
    if (s == nullptr) return INVALID_HANDLE;
    return SUCCESS;
}

CUresult cuStreamSynchronize(void* handle) {
    if (!initialised) return NOT_INITIALIZED;
    Stream* s = stream_of(handle);
    if (s == nullptr) return INVALID_CONTEXT;
    if (s->ctx->dead.load()) return INVALID_CONTEXT;
    drain(s);
    return s->ctx->sticky.load();
}

CUresult cuStreamQuery(void* handle) {
    Stream* s = stream_of(handle);
    if (s == nullptr || s->ctx->dead.load()) return INVALID_CONTEXT;
    if (int e = s->ctx->sticky.load(); e != 0) return e;
    return idle(s) ? SUCCESS : NOT_READY;
}

CUresult cuStreamWaitValue32_v2(void* handle, u64 addr, u32 value, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr || s->ctx != current) return INVALID_HANDLE;
    unsigned kind = flags & 3u;
    if ((flags & ~(3u | 0x40000000u)) != 0) return INVALID_VALUE;
    if (!accessible(current, addr, 4) || addr % 4 != 0) return INVALID_VALUE;
    Context* ctx = current;
    enqueue(s, [=] {
        auto met = [=] {
            u32 v = __atomic_load_n((const u32*)addr, __ATOMIC_ACQUIRE);
            switch (kind) {
                case 0: return (int32_t)(v - value) >= 0;  // GEQ (cyclic, as documented)
                case 1: return v == value;                 // EQ
                case 2: return (v & value) != 0;           // AND
                default: return ~(v | value) != 0;        // NOR
            }
        };
        spin_until(ctx, met);
    });
    return SUCCESS;
}

CUresult cuStreamWriteValue32_v2(void* handle, u64 addr, u32 value, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr || s->ctx != current) return INVALID_HANDLE;
    if (flags > 1) return INVALID_VALUE;
    if (!accessible(current, addr, 4) || addr % 4 != 0) return INVALID_VALUE;
    if (take_injection("cuStreamWriteValue32") == INJECT_DROP) return SUCCESS;
    enqueue(s, [=] { __atomic_store_n((u32*)addr, value, flags == 0 ? __ATOMIC_SEQ_CST : __ATOMIC_RELAXED); });
    return SUCCESS;
}

CUresult cuEventCreate(Event** out, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (flags > 15) return INVALID_VALUE;
    Event* e = new Event();
    e->ctx = current;
    e->flags = flags;
    *out = e;
    return SUCCESS;
}

CUresult cuEventDestroy_v2(Event* e) {
    if (e == nullptr) return INVALID_HANDLE;
    // Kept: a queued record or wait may still refer to it.
    return SUCCESS;
}

CUresult cuEventRecord(Event* e, void* handle) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (e == nullptr || s == nullptr) return INVALID_HANDLE;
    if (e->ctx != s->ctx) return INVALID_HANDLE;
    u64 generation = e->recorded.fetch_add(1) + 1;
    enqueue(s, [e, generation] {
        e->at_ns.store(now_ns());
        e->completed.store(generation);
    });
    return SUCCESS;
}

CUresult cuEventQuery(Event* e) {
    if (e == nullptr) return INVALID_HANDLE;
    if (e->ctx->dead.load()) return INVALID_CONTEXT;
    if (int err = e->ctx->sticky.load(); err != 0) return err;
    return e->completed.load() >= e->recorded.load() ? SUCCESS : NOT_READY;
}

CUresult cuEventSynchronize(Event* e) {
    if (e == nullptr) return INVALID_HANDLE;
    u64 target = e->recorded.load();
    {
        std::unique_lock<std::mutex> g(lock);
        progress.wait(g, [&] { return e->completed.load() >= target || e->ctx->dead.load() || e->ctx->sticky != 0; });
    }
    if (e->ctx->dead.load()) return INVALID_CONTEXT;
    return e->ctx->sticky.load();
}

CUresult cuEventElapsedTime(float* ms, Event* start, Event* end) {
    if (start == nullptr || end == nullptr) return INVALID_HANDLE;
    if ((start->flags | end->flags) & 2u) return INVALID_HANDLE;  // DISABLE_TIMING
    if (start->recorded.load() == 0 || end->recorded.load() == 0) return INVALID_HANDLE;
    if (start->completed.load() < start->recorded.load() || end->completed.load() < end->recorded.load()) {
        return NOT_READY;
    }
    *ms = (float)((double)((int64_t)(end->at_ns.load() - start->at_ns.load())) / 1e6);
    return SUCCESS;
}

CUresult cuEventElapsedTime_v2(float* ms, Event* start, Event* end) { return cuEventElapsedTime(ms, start, end); }

CUresult cuStreamWaitEvent(void* handle, Event* e, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr || e == nullptr) return INVALID_HANDLE;
    if (flags != 0) return INVALID_VALUE;
    u64 target = e->recorded.load();
    Context* ctx = s->ctx;
    enqueue(s, [=] { spin_until(ctx, [=] { return e->completed.load() >= target; }); });
    return SUCCESS;
}

// The kernels of a cubin: an ELF64 image for the CUDA machine (190) whose kernels are
// global function symbols marked as entries (st_other 0x10), built for the architecture
// in bits 8-15 of e_flags, which must be this GPU's (sm_90); else the driver's refusal.
// (The driver gets no size with the image: the section headers say where everything is,
// and the backend has checked that they and the sections lie within the file.)
CUresult cubin_entries(const unsigned char* elf, std::set<std::string>& entries) {
    auto read = [elf](u64 at, auto& value) { std::memcpy(&value, elf + at, sizeof value); };
    uint16_t machine = 0, shentsize = 0, shnum = 0;
    uint32_t flags = 0;
    u64 shoff = 0;
    read(18, machine);
    read(40, shoff);
    read(48, flags);
    read(58, shentsize);
    read(60, shnum);
    if (elf[4] != 2 || machine != 190 || shentsize != 64) return INVALID_IMAGE;
    if (((flags >> 8) & 0xff) != 90) return NO_BINARY_FOR_GPU;
    for (u64 i = 0; i < shnum; i++) {
        u64 header = shoff + i * 64;
        uint32_t type = 0, link = 0;
        u64 offset = 0, size = 0, strtab = 0;
        read(header + 4, type);
        if (type != 2) continue;  // SHT_SYMTAB
        read(header + 24, offset);
        read(header + 32, size);
        read(header + 40, link);
        if (link >= shnum) return INVALID_IMAGE;
        read(shoff + u64(link) * 64 + 24, strtab);
        for (u64 symbol = offset; symbol + 24 <= offset + size; symbol += 24) {
            uint32_t name = 0;
            read(symbol, name);
            bool global_function = elf[symbol + 4] == 0x12;  // STB_GLOBAL, STT_FUNC
            if (global_function && (elf[symbol + 5] & 0x10) != 0) {
                entries.insert(reinterpret_cast<const char*>(elf + strtab + name));
            }
        }
    }
    return SUCCESS;
}

CUresult cuModuleLoadData(Module** out, const void* image) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (image == nullptr) return INVALID_IMAGE;
    std::set<std::string> entries;
    const char* ptx = static_cast<const char*>(image);
    if (std::memcmp(image, "\x7f" "ELF", 4) == 0) {
        if (CUresult r = cubin_entries(static_cast<const unsigned char*>(image), entries); r != SUCCESS) return r;
    } else if (std::strstr(ptx, ".version") == nullptr) {
        return INVALID_IMAGE;
    } else {
        for (const char* at = std::strstr(ptx, ".entry "); at != nullptr; at = std::strstr(at + 1, ".entry ")) {
            const char* name = at + 7;
            size_t len = std::strcspn(name, " (\t\n");
            entries.insert(std::string(name, len));
        }
    }
    Module* m = new Module();
    m->ctx = current;
    m->entries = std::move(entries);
    *out = m;
    return SUCCESS;
}

// CUDA's default since 12.2 is lazy loading; CUDA_MODULE_LOADING=EAGER chooses eager.
CUresult cuModuleGetLoadingMode(int* mode) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (mode == nullptr) return INVALID_VALUE;
    *mode = lazy_loading() ? 2 : 1;
    return SUCCESS;
}

CUresult cuModuleUnload(Module* m) { return m == nullptr ? INVALID_HANDLE : SUCCESS; }

CUresult cuModuleGetFunction(Function** out, Module* m, const char* name) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (m == nullptr || m->ctx != current) return INVALID_HANDLE;
    if (m->entries.count(name) == 0) return NOT_FOUND;
    // This library's own handle, looked up once: the launchers are its symbols.
    static void* const self = [] {
        Dl_info info;
        return dladdr((void*)&cuModuleGetFunction, &info) == 0 ? nullptr
                                                              : dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    }();
    if (self == nullptr) return NOT_FOUND;
    std::string entry = std::string("cmm_host_") + name;
    auto launcher = (Entry)dlsym(self, entry.c_str());
    auto params = (ParamSizes)dlsym(self, ("cmm_host_params_" + std::string(name)).c_str());
    auto mode = (ModeOf)dlsym(self, ("cmm_host_mode_" + std::string(name)).c_str());
    if (launcher == nullptr || params == nullptr || mode == nullptr) return NOT_FOUND;
    *out = new Function{current, name, launcher, params, mode(), {}};
    return SUCCESS;
}

CUresult cuFuncGetAttribute(int* value, int attribute, Function* f) {
    if (f == nullptr) return INVALID_HANDLE;
    *value = attribute == 0 ? 1024 : 0;  // MAX_THREADS_PER_BLOCK
    return SUCCESS;
}

// CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT takes a percentage (or -1, the
// default); the other settable attributes are accepted as they are.
CUresult cuFuncSetAttribute(Function* f, int attribute, int value) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (f == nullptr) return INVALID_HANDLE;
    if (attribute == 9 && (value < -1 || value > 100)) return INVALID_VALUE;
    if (attribute == 8) {  // MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (value < 0 || value > OPT_IN_SHARED) return INVALID_VALUE;
        f->max_dynamic_shared.store(value);
    }
    return SUCCESS;
}

// Blocks of a kernel one SM holds: what ptxas's register counts give cmm's persistent
// GEMM kernels on an H100 (the 64×64 tensor-core tile 3, the SIMT tile 2, the 128×128
// tile 1), 3 for any other kernel; CMM_FAKE_CUDA_OCCUPANCY overrides it for every kernel.
// The fake has no registers to count.
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, Function* f, int block_size,
                                                             size_t dynamic_smem, unsigned flags) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (f == nullptr || blocks == nullptr) return INVALID_HANDLE;
    if (block_size <= 0 || block_size > 1024 || dynamic_smem > (size_t)shared_limit(f) || flags > 1) {
        return INVALID_VALUE;
    }
    const int h100 = f->name.find("_wide_") != std::string::npos || f->name.find("hopper") != std::string::npos ? 1
                     : f->name.find("simt") != std::string::npos ? 2
                                                                  : 3;
    *blocks = env_int("CMM_FAKE_CUDA_OCCUPANCY", h100, 1, 32);
    return SUCCESS;
}

static CUresult fake_launch(Function* f, u32 gx, u32 gy, u32 gz, u32 bx, u32 by, u32 bz, u32 shared, void* handle,
                            void** params, void** extra, u32 cluster = 1) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (f == nullptr || s == nullptr || s->ctx != current || f->ctx != current) return INVALID_HANDLE;
    if (extra != nullptr || params == nullptr) return NOT_SUPPORTED;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) return INVALID_VALUE;
    if (gy > 65535 || gz > 65535 || gx > 2147483647u || bz > 64 || bx > 1024 || by > 1024) return INVALID_VALUE;
    if ((u64)bx * by * bz > 1024) return INVALID_VALUE;
    if ((int)shared > shared_limit(f)) return INVALID_VALUE;
    // The driver reads every parameter at the call: copy them now.
    u64 sizes[32];
    u32 count = f->params(sizes, 32);
    if (count > 32) return NOT_SUPPORTED;
    auto values = std::make_shared<std::vector<std::vector<char>>>();
    for (u32 i = 0; i < count; ++i) {
        const char* p = static_cast<const char*>(params[i]);
        values->emplace_back(p, p + sizes[i]);
    }
    Context* ctx = current;
    Function* fn = f;
    const int injected = take_injection(fn->name);
    u32 grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    enqueue(s, [=] {
        if (injected == INJECT_FAULT) {
            report(ctx, ILLEGAL_ADDRESS, fn->name + ": an injected fault");
            return;
        }
        if (injected == INJECT_DROP) return;
        std::vector<void*> args;
        for (auto& v : *values) args.push_back(v.data());
        u32 g3[3] = {grid[0], grid[1], grid[2]}, b3[3] = {block[0], block[1], block[2]};
        char error[256] = {0};
        if (fn->entry(g3, b3, fn->mode | cluster << 8, args.data(), error, sizeof error) != 0) {
            report(ctx, LAUNCH_FAILED, fn->name + ": " + error);
            return;
        }
        check_guards(ctx, fn->name.c_str());
    });
    if (launches_block()) drain(s);
    return ctx->sticky.load();
}

// Stream priorities: numerically smaller is more urgent, as on the GPU. Priorities do not
// change what runs first here (every queue runs one item at a time); the driver records
// which launches carried one, so tests can see what the backend asked for.
static std::atomic<int> greatest_priority{-5};
static std::map<std::string, u64>& prioritised = *new std::map<std::string, u64>;

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (least != nullptr) *least = 0;
    if (greatest != nullptr) *greatest = greatest_priority.load();
    return SUCCESS;
}

// The mirror of CUlaunchAttributeValue (a 64-byte union), CUlaunchAttribute (id,
// padding, the value) and CUlaunchConfig, as cuda.h lays them out.
union LaunchAttributeValue {
    char bytes[64];
    int priority;
    unsigned cluster[3];  // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: x, y, z
    void* align;
};
struct LaunchAttribute {
    int id;
    char pad[4];
    LaunchAttributeValue value;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes");
constexpr int LAUNCH_ATTRIBUTE_PRIORITY = 8;
constexpr int LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4;

struct LaunchConfig {
    u32 grid[3];
    u32 block[3];
    u32 shared;
    void* stream;
    LaunchAttribute* attrs;
    u32 attr_count;
};

// Takes the launch attribute cmm uses, a priority within the context's range, and
// refuses the others (this driver does not model them).
// A TMA tensor map in the host twin's encoding (cmm-cuda launch.rs `host_tensor_map`,
// read by host/hopper.h), for what the Hopper engine asks: two dimensions (or three,
// read a layer at a time) of f16, bf16 or (C's map for TMA stores) f32
// (CU_TENSOR_MAP_DATA_TYPE_FLOAT16 6, BFLOAT16 9, FLOAT32 7), the 128-byte swizzle (3), no
// interleave, element strides 1, zeros past the edges; the driver's own checks of those
// (16-byte aligned base and stride, boxes of at most 256 with a first dimension of at
// most the swizzle span) are made, and the tensor must lie in one allocation.
CUresult cuTensorMapEncodeTiled(u64* map, int dtype, u32 rank, void* base, const u64* dims, const u64* strides,
                                const u32* box, const u32* element_strides, int interleave, int swizzle,
                                int promotion, int fill) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    (void)promotion;
    if (map == nullptr || base == nullptr || dims == nullptr || strides == nullptr || box == nullptr ||
        element_strides == nullptr) {
        return INVALID_VALUE;
    }
    if ((rank != 2 && rank != 3) || (dtype != 6 && dtype != 9 && dtype != 7) || interleave != 0 || swizzle != 3 ||
        fill != 0) {
        return NOT_SUPPORTED;
    }
    const u64 at = (u64)base;
    for (u32 i = 0; i + 1 < rank; ++i) {
        if (strides[i] % 16 != 0 || strides[i] >= (1ull << 40)) return INVALID_VALUE;
    }
    for (u32 i = 0; i < rank; ++i) {
        if (dims[i] == 0 || dims[i] > (1ull << 32) || box[i] == 0 || box[i] > 256 || element_strides[i] != 1) {
            return INVALID_VALUE;
        }
    }
    const u64 size = dtype == 7 ? 4 : 2;
    if (at % 16 != 0 || box[0] * size > 128) return INVALID_VALUE;
    // The Hopper engine's 3D maps are read a layer at a time.
    if (rank == 3 && box[2] != 1) return NOT_SUPPORTED;
    u64 extent = (dims[1] - 1) * strides[0] + dims[0] * size;
    if (rank == 3) extent += (dims[2] - 1) * strides[1];
    if (!inside(at, extent)) return INVALID_VALUE;
    for (int i = 0; i < 16; ++i) map[i] = 0;
    map[0] = at;
    map[1] = dims[0];
    map[2] = dims[1];
    map[3] = strides[0];
    map[4] = (u64)box[0] | ((u64)box[1] << 32);
    map[5] = dtype == 6 ? 1 : dtype == 9 ? 2 : 0;
    map[6] = 128;
    if (rank == 3) {
        map[7] = dims[2];
        map[8] = strides[1];
    }
    map[15] = 0x636d6d5f746d6170ull;  // "cmm_tmap"
    return SUCCESS;
}

CUresult cuLaunchKernelEx(const LaunchConfig* config, Function* f, void** params, void** extra) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (config == nullptr || (config->attr_count > 0 && config->attrs == nullptr)) return INVALID_VALUE;
    bool has_priority = false;
    u32 cluster = 1;
    for (u32 i = 0; i < config->attr_count; ++i) {
        const LaunchAttribute& a = config->attrs[i];
        if (a.id == LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) {
            // Clusters along x, of at most the twin's size, tiling the grid (the driver
            // refuses a grid that is not whole clusters).
            const u32 x = a.value.cluster[0], y = a.value.cluster[1], z = a.value.cluster[2];
            if (x == 0 || y != 1 || z != 1 || x > cmm_host::MAX_CLUSTER || config->grid[0] % x != 0) return INVALID_VALUE;
            cluster = x;
            continue;
        }
        if (a.id != LAUNCH_ATTRIBUTE_PRIORITY) return NOT_SUPPORTED;
        if (a.value.priority < greatest_priority.load() || a.value.priority > 0) return INVALID_VALUE;
        has_priority = true;
    }
    if (f != nullptr && f->ctx == current && lazy_loading() && !f->loaded.exchange(true)) wait_idle(current);
    CUresult r = fake_launch(f, config->grid[0], config->grid[1], config->grid[2], config->block[0], config->block[1],
                             config->block[2], config->shared, config->stream, params, extra, cluster);
    if (r == SUCCESS && has_priority) {
        std::lock_guard<std::mutex> g(lock);
        prioritised[f->name] += 1;
    }
    return r;
}

// Clusters of a kernel that the GPU holds at once, for a configuration whose cluster
// dimension (required, as the driver requires it of a kernel without a compiled one) is
// along x and at most the twin's: each SM a CTA (the Hopper engine's fill one), so the
// SM count over the cluster size; CMM_FAKE_CUDA_CLUSTERS overrides it (0: none fits;
// `fail`: the query fails).
CUresult cuOccupancyMaxActiveClusters(int* clusters, Function* f, const LaunchConfig* config) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    if (f == nullptr || clusters == nullptr) return INVALID_HANDLE;
    if (config == nullptr || (config->attr_count > 0 && config->attrs == nullptr)) return INVALID_VALUE;
    if ((int)config->shared > shared_limit(f)) return INVALID_VALUE;
    u32 cluster = 0;
    for (u32 i = 0; i < config->attr_count; ++i) {
        const LaunchAttribute& a = config->attrs[i];
        if (a.id != LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) continue;
        const u32 x = a.value.cluster[0], y = a.value.cluster[1], z = a.value.cluster[2];
        if (x == 0 || y != 1 || z != 1 || x > cmm_host::MAX_CLUSTER || config->grid[0] % x != 0) return INVALID_VALUE;
        cluster = x;
    }
    if (cluster == 0) return INVALID_VALUE;
    const char* asked = std::getenv("CMM_FAKE_CUDA_CLUSTERS");
    if (asked != nullptr && std::string(asked) == "fail") return NOT_SUPPORTED;
    *clusters = env_int("CMM_FAKE_CUDA_CLUSTERS", sm_count() / (int)cluster, 0, 1 << 16);
    return SUCCESS;
}

// Takes the stream attribute cmm sets, a priority within the context's range, which later
// work on the stream carries; refuses the others (this driver does not model them).
CUresult cuStreamSetAttribute(void* handle, int attr, const LaunchAttributeValue* value) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr) return INVALID_HANDLE;
    if (value == nullptr) return INVALID_VALUE;
    if (attr != LAUNCH_ATTRIBUTE_PRIORITY) return NOT_SUPPORTED;
    if (value->priority < greatest_priority.load() || value->priority > 0) return INVALID_VALUE;
    s->priority.store(value->priority);
    return SUCCESS;
}

// For tests: how many items (launches, copies, memory operations, cuBLAS GEMMs) were
// enqueued so far on streams whose priority attribute was `priority`.
u64 cmm_fake_enqueued_at_stream_priority(int priority) {
    int slot = -priority;
    return slot >= 0 && slot < PRIORITY_SLOTS ? enqueued_at_priority[slot].load() : 0;
}

// For tests: how many copies were asked of the copy engines so far (cuMemcpyBatchAsync
// with CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE).
u64 cmm_fake_copy_engine_copies() { return copy_engine_copies.load(); }

// For tests: how many launches of kernel `name` carried a priority attribute so far.
u64 cmm_fake_prioritised_launches(const char* name) {
    std::lock_guard<std::mutex> g(lock);
    auto it = prioritised.find(name);
    return it == prioritised.end() ? 0 : it->second;
}

// For tests: VMM handles not yet released plus address reservations not yet freed.
u64 cmm_fake_vmm_live() {
    std::lock_guard<std::mutex> g(lock);
    return live_vmm_handles.load() + reservations.size();
}

// For tests: from now on GPU `device` lacks, towards GPU `peer`, peer access (what = 1)
// or native peer atomics (2); 0 gives both back; a negative device gives every pair back.
void cmm_fake_deny_peer(int device, int peer, int what) {
    std::lock_guard<std::mutex> g(lock);
    if (device < 0) {
        denied_peers.clear();
    } else if (what == 0) {
        denied_peers.erase({device, peer});
    } else {
        denied_peers[{device, peer}] = what;
    }
}

// For tests: the greatest priority contexts report from now on (0: a single priority,
// as on a GPU without stream priorities).
void cmm_fake_set_greatest_priority(int greatest) { greatest_priority.store(greatest); }

// For the fake cuBLAS: loading a library's kernels into the context of `stream` (see
// lazy_loading above).
int cmm_fake_load_code(void* handle) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr || s->ctx != current) return INVALID_HANDLE;
    wait_idle(s->ctx);
    return SUCCESS;
}

// For the fake cuBLAS: runs `work(arg)` in order on `stream`, then `release(arg)`.
int cmm_fake_enqueue(void* handle, void (*work)(void*), void* arg, void (*release)(void*)) {
    if (CUresult r = ready(); r != SUCCESS) return r;
    Stream* s = stream_of(handle);
    if (s == nullptr || s->ctx != current) return INVALID_HANDLE;
    Context* ctx = current;
    // Released when the item is gone, whether it ran or a sticky error skipped it.
    std::shared_ptr<void> owned(arg, release);
    enqueue(s, [=] {
        work(owned.get());
        check_guards(ctx, "a cuBLAS GEMM");
    });
    return SUCCESS;
}

// For tests: the `nth` (from 1) call on `target` from now on faults (kind 1), as a
// kernel that touches unmapped memory does (a sticky CUDA_ERROR_ILLEGAL_ADDRESS), or is
// silently dropped (kind 2), as a lost signal would be. `nth` = 0 cancels.
void cmm_fake_inject(const char* target, int kind, u32 nth) {
    std::lock_guard<std::mutex> g(lock);
    injected_target = target;
    injected_kind = kind;
    injected_countdown = nth;
}

// For tests: module loading eager (1), lazy (0), or as CUDA_MODULE_LOADING says (-1).
void cmm_fake_set_module_loading(int eager) { module_loading.store(eager); }

// For tests: whether launches block (1), do not (0), or follow CUDA_LAUNCH_BLOCKING (-1).
void cmm_fake_set_launch_blocking(int blocking) { launch_blocking.store(blocking); }

// For the fake cuBLAS: whether the current context may address [addr, addr + bytes).
int cmm_fake_accessible(u64 addr, u64 bytes) {
    return current != nullptr && accessible(current, addr, bytes) ? 1 : 0;
}

}  // extern "C"
