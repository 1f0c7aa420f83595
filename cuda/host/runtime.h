// The host twin of the CUDA runtime the kernels use, so that cuda/kernels/*.cu compile
// with the system C++ compiler and run on the CPU (cmm-cuda `host`): the same sources,
// the same launches, the same arguments, without a GPU.
//
// - Every thread of a block is a fiber of the OS thread that runs the block (its own
//   stack; on x86-64 a switch is a few instructions, elsewhere ucontext);
//   `__syncthreads` switches back to the block's scheduler, which resumes every fiber in
//   turn (first to last, last to first, or shuffled afresh each round from a seed), so a
//   barrier is a real rendezvous. A block whose threads reach different
//   barriers, or whose threads exit while others wait, is an error (CUDA leaves it
//   undefined).
// - `__shared__` is `static thread_local`: one copy per OS thread, and a block runs on
//   one OS thread, so each block has its own shared memory even when the blocks of a
//   launch run concurrently (persistent kernels).
// - The warp-collective mma and ldmatrix (gemm.cu) are rendezvous of the warp's 32
//   lanes through shared staging, with PTX's fragment layouts; cp.async copies land only
//   when their thread waits for their group (host/mma.h).
// - Shared memory is checked for hazards between threads, as racecheck does on a GPU,
//   in barrier epochs (an epoch ends at each __syncthreads): what cp.async writes and
//   ldmatrix reads by 16-byte chunk (SharedChunk: a read of a chunk another thread's copy
//   landed in needs a barrier after the copy's wait, a copy over a chunk another warp
//   read needs one after the read), and every CMM_SHARED array or variable element by
//   element (Shared: a read of what another thread wrote, or a write over what another
//   thread read or wrote, in the same epoch; a read of what no thread wrote).
// - Atomics, acquire loads and release adds are the compiler's __atomic builtins;
//   %globaltimer is CLOCK_MONOTONIC.
// Prepended to common.cuh; defines CMM_HOST, which swaps out the inline PTX.

#define CMM_HOST 1

#include <time.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static thread_local
#define __align__(n) __attribute__((aligned(n)))
#define CMM_SHARED(type, name, dims) static thread_local cmm_host::Shared<type dims> name

struct dim3 {
    u32 x, y, z;
};

static thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

using std::max;
using std::min;

inline float __uint_as_float(u32 u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline u32 __float_as_uint(float f) {
    u32 u;
    std::memcpy(&u, &f, 4);
    return u;
}

// Round-to-nearest add and multiply; the host compiler contracts nothing on x86-64
// without -mfma, so plain operators are the same operations.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline u32 atomicAdd(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline u32 atomicExch(u32* p, u32 v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }

namespace cmm_host {
inline void note_acquire();
}

inline u32 cmm_load_acquire(u64 addr) {
    const u32 v = __atomic_load_n((const u32*)addr, __ATOMIC_ACQUIRE);
    cmm_host::note_acquire();
    return v;
}

inline u64 cmm_globaltimer_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (u64)t.tv_sec * 1000000000ull + (u64)t.tv_nsec;
}

inline void cmm_red_release_add(u64 addr, u32 value) { __atomic_fetch_add((u32*)addr, value, __ATOMIC_RELEASE); }
inline void cmm_store_release_gpu(u64 addr, u32 value) { __atomic_store_n((u32*)addr, value, __ATOMIC_RELEASE); }

namespace cmm_host {

// What a fiber waits for: a block-wide __syncthreads, a warp collective (released once
// every live thread of its warp waits at one), nothing but its turn (YIELD: a spin on an
// mbarrier, host/hopper.h, which only the block's threads can complete; SLEEP: a spin on
// global memory, `__nanosleep`, which other launches may complete), a cluster barrier
// (every thread of every CTA of the cluster), or named barrier `NAMED + id` (bar.sync id,
// count: released once `count` threads of the block wait at it).
// The first and the longest nap of a block whose threads all sleep on global memory, ns.
constexpr long MIN_NAP_NS = 200, MAX_NAP_NS = 1000000;

enum Barrier { SYNCTHREADS = 1, WARP_COLLECTIVE = 2, YIELD = 3, CLUSTER_SYNC = 4, SLEEP = 5, NAMED = 16 };
constexpr u32 NAMED_BARRIERS = 16;
// The most CTAs of a cluster the twin runs (the Hopper engine's pairs).
constexpr u32 MAX_CLUSTER = 2;

// A cp.async copy the thread has issued and that has not landed yet (host/mma.h).
struct AsyncCopy {
    void* dst;
    const void* src;  // nullptr: zero-fill
    u32 group;        // the commit group it belongs to
};

#if defined(__x86_64__) && !defined(CMM_HOST_UCONTEXT)
// A fiber switch swaps stacks: the callee-saved registers, MXCSR and the x87 control
// word go on the old stack, its pointer into `*save_sp`, then the same come off the
// stack at `load_sp`. (swapcontext also saves and restores the signal mask, a system
// call per switch: that was most of the host twin's time.)
extern "C" void cmm_fiber_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl cmm_fiber_switch
    .hidden cmm_fiber_switch
    .type cmm_fiber_switch, @function
cmm_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cmm_fiber_switch, .-cmm_fiber_switch
)");

struct FiberContext {
    void* sp = nullptr;
};

inline void fiber_switch(FiberContext& save, FiberContext& load) {
    cmm_fiber_switch(&save.sp, load.sp);
}
#else
struct FiberContext {
    ucontext_t uc;
};

inline void fiber_switch(FiberContext& save, FiberContext& load) {
    swapcontext(&save.uc, &load.uc);
}
#endif

struct Fiber {
    FiberContext context;
    dim3 thread;
    dim3 block;  // its CTA's blockIdx
    u32 cta;     // its CTA's rank in the cluster
    int waiting;  // 0: running or runnable, else the Barrier it waits at
    bool done;
    bool runnable;  // resumed in the scheduler's next round
    // The block's progress when this thread last spun (YIELD): until progress moves on,
    // its next try can only fail again, so the scheduler passes it over.
    u64 spun_at;
    // An acquire load since this thread's last fence.proxy.async (host/hopper.h: a TMA
    // copy must not follow one unfenced).
    bool acquired;
    std::vector<AsyncCopy> in_flight;  // oldest first
    u32 committed;                     // groups committed so far
};

// What the block did to one 16-byte chunk of shared memory through cp.async (writes) and
// ldmatrix (reads), in epochs: an epoch ends at every __syncthreads of the block.
struct SharedChunk {
    static constexpr u32 PENDING = 0xffffffffu;
    u32 writer;      // the thread whose cp.async wrote it last
    u32 landed;      // the epoch of its thread's wait that landed it, or PENDING
    u32 read_epoch;  // the epoch of the reads in `readers`
    u32 readers;     // the warps that read it in `read_epoch` (bit w)
};

struct Block {
    FiberContext scheduler;
    std::vector<Fiber> fibers;
    u64 serial = 0;  // which block this is on its OS thread (SharedCell::block)
    u32 epoch = 0;
    std::unordered_map<uintptr_t, SharedChunk> shared_chunks;
    std::unique_ptr<char[]> stacks;  // untouched until used: not value-initialised
    size_t stack_threads = 0;
    Fiber* current = nullptr;
    void (*body)(void*) = nullptr;
    void* closure = nullptr;
    // Bumped by whatever lets a spinning thread go on (an mbarrier's arrive, a copy's
    // bytes): a round of the scheduler in which every thread only spun, with no
    // progress, is a deadlock.
    u64 progress = 0;
    // A cluster's CTAs run as one scheduler's fibers (one OS thread, so their interleaving
    // is deterministic): how many, the threads of each, the threads of each still
    // running, and the cluster barriers completed.
    u32 ctas = 1;
    u32 cta_threads = 0;
    u32 live[MAX_CLUSTER] = {};
    u64 cluster_syncs = 0;
    u32 named_count[MAX_CLUSTER][NAMED_BARRIERS] = {};  // threads a named barrier waits for
    std::vector<u32> round;  // the fibers in the order of this round (a shuffled order)
};

// The order in which a scheduler round resumes a block's fibers: first to last, last to
// first, or (seed ≠ 0) a permutation drawn afresh each round from the seed.
struct FiberOrder {
    bool reversed = false;
    u32 seed = 0;
};

// Draws the next round's permutation of `order` (Fisher–Yates on a xorshift32 stream).
inline void shuffle_round(std::vector<u32>& order, u32& state) {
    for (u32 i = (u32)order.size(); i > 1u; --i) {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        std::swap(order[i - 1u], order[state % i]);
    }
}

static thread_local Block* running_block = nullptr;
// The first error of the launch on this OS thread (a fixed message).
static thread_local const char* thread_error = nullptr;

inline void fail(const char* why) {
    if (thread_error == nullptr) thread_error = why;
}

// What the running block did to one element of a CMM_SHARED variable: its last write
// and its reads, in barrier epochs. Stale (another block's) when `block` is not the
// running block's serial.
struct SharedCell {
    static constexpr u32 MANY = 0xffffffffu;
    u64 block = 0;
    u32 write_epoch = 0, writer = 0;
    u32 read_epoch = MANY, reader = 0;  // reader: a thread, or MANY
};

inline u32 linear_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

inline void shared_write(SharedCell& c) {
    Block* block = running_block;
    if (block == nullptr) return;  // a launch without fibers (barrier-free kernels)
    const u32 me = linear_thread();
    if (c.block != block->serial) {
        c = SharedCell{};
        c.block = block->serial;
    } else if (c.write_epoch == block->epoch && c.writer != me) {
        fail("shared-memory hazard: two threads write one shared element with no __syncthreads between");
    } else if (c.read_epoch == block->epoch && c.reader != me) {
        fail("shared-memory hazard: a thread overwrites a shared element another thread read, with no "
             "__syncthreads between the read and the write");
    }
    c.write_epoch = block->epoch;
    c.writer = me;
}

inline void shared_read(SharedCell& c) {
    Block* block = running_block;
    if (block == nullptr) return;
    const u32 me = linear_thread();
    if (c.block != block->serial) {
        fail("shared-memory hazard: a thread reads a shared element no thread of its block wrote");
        return;
    }
    if (c.write_epoch == block->epoch && c.writer != me) {
        fail("shared-memory hazard: a thread reads a shared element another thread wrote, with no "
             "__syncthreads between the write and the read");
    }
    if (c.read_epoch != block->epoch) {
        c.read_epoch = block->epoch;
        c.reader = me;
    } else if (c.reader != me) {
        c.reader = SharedCell::MANY;
    }
}

// A CMM_SHARED variable of type T (a scalar, or an array of any rank, indexed as one):
// every element keeps its SharedCell beside its value.
template <class T>
struct Shared {
    T value;
    SharedCell cell;
    operator T() {
        shared_read(cell);
        return value;
    }
    Shared& operator=(T v) {
        shared_write(cell);
        value = v;
        return *this;
    }
};

template <class T, size_t N>
struct Shared<T[N]> {
    Shared<T> items[N];
    Shared<T>& operator[](size_t i) { return items[i]; }
};

inline void barrier(Barrier kind) {
    Block* block = running_block;
    if (block == nullptr) {
        fail("a barrier in a kernel launched without fibers (its Kernel entry says no barriers)");
        return;
    }
    Fiber* me = block->current;
    me->waiting = kind;
    fiber_switch(me->context, block->scheduler);
}

// Lets the block's other threads run (a thread whose spin found nothing yet).
inline void yield_thread() {
    Block* block = running_block;
    if (block == nullptr) {
        fail("a spin on shared memory in a kernel launched without fibers");
        return;
    }
    Fiber* me = block->current;
    me->waiting = YIELD;
    me->spun_at = block->progress;
    fiber_switch(me->context, block->scheduler);
}

// Lets the block's other threads run while this one spins on global memory: on a GPU
// its warp sleeps and the others issue (a persistent kernel's producer waiting for a
// peer's release must not hold back its consumers, whose release the peer may await).
// Outside fibers the OS thread sleeps instead (`__nanosleep`).
inline bool sleep_thread() {
    Block* block = running_block;
    if (block == nullptr || block->current == nullptr) return false;
    Fiber* me = block->current;
    me->waiting = SLEEP;
    fiber_switch(me->context, block->scheduler);
    return true;
}

// bar.sync id, threads: waits until `threads` threads of the block wait at barrier `id`.
inline void named_barrier(u32 id, u32 threads) {
    Block* block = running_block;
    if (block == nullptr || id >= NAMED_BARRIERS || threads == 0 || threads % 32 != 0) {
        fail("a named barrier outside fibers, past barrier 15, or of a thread count that is not a multiple of 32");
        return;
    }
    Fiber* me = block->current;
    u32& count = block->named_count[me->cta][id];
    if (count != 0 && count != threads) {
        fail("named barrier divergence: threads wait at one barrier with different thread counts");
        return;
    }
    count = threads;
    me->waiting = NAMED + (int)id;
    fiber_switch(me->context, block->scheduler);
}

inline void fiber_main() {
    Block* block = running_block;
    block->body(block->closure);
    block->current->done = true;
    block->live[block->current->cta] -= 1;
#if defined(__x86_64__) && !defined(CMM_HOST_UCONTEXT)
    fiber_switch(block->current->context, block->scheduler);  // never resumed
    __builtin_unreachable();
#endif
    // (ucontext: returning resumes `uc_link`, the scheduler.)
}

constexpr size_t FIBER_STACK = 64 * 1024;

// Prepares `f` to run fiber_main on the stack [stack, stack + FIBER_STACK) at its first
// switch.
inline void fiber_start(Fiber& f, char* stack, FiberContext& scheduler) {
#if defined(__x86_64__) && !defined(CMM_HOST_UCONTEXT)
    (void)scheduler;
    // The stack cmm_fiber_switch pops on the way in: the control words (as this thread
    // has them), six zeroed registers, then fiber_main as the return address, above a
    // slot for fiber_main's own (never used) return address, so that it starts with
    // the stack aligned as after a call.
    auto top = reinterpret_cast<uintptr_t>(stack + FIBER_STACK) & ~uintptr_t(15);
    auto* sp = reinterpret_cast<u64*>(top);
    *--sp = 0;
    *--sp = reinterpret_cast<u64>(&fiber_main);
    for (int r = 0; r < 6; ++r) *--sp = 0;
    u32 mxcsr;
    u16 fcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fcw));
    *--sp = u64(mxcsr) | (u64(fcw) << 32);
    f.context.sp = sp;
#else
    getcontext(&f.context.uc);
    f.context.uc.uc_stack.ss_sp = stack;
    f.context.uc.uc_stack.ss_size = FIBER_STACK;
    f.context.uc.uc_link = &scheduler.uc;
    makecontext(&f.context.uc, fiber_main, 0);
#endif
}

// Runs a cluster of `ctas` CTAs (1: a lone block) of `threads` threads each as fibers of
// one scheduler until all return; CTA c is block `first` + (c, 0, 0). The CTAs share the
// OS thread's static `__shared__` variables and its barrier epochs: only the Hopper
// engine, whose shared memory is all dynamic (host/hopper.h keeps one per CTA), runs in
// clusters.
inline void run_cluster_fibers(u32 ctas, u32 threads, dim3 first, FiberOrder order, void (*body)(void*),
                               void* closure) {
    static thread_local Block block;
    const u32 fibers = ctas * threads;
    block.fibers.assign(fibers, Fiber{});
    if (block.stack_threads < fibers) {
        block.stacks.reset(new char[fibers * FIBER_STACK]);
        block.stack_threads = fibers;
    }
    block.body = body;
    block.closure = closure;
    // A block starts with shared memory no thread of it wrote.
    block.serial += 1;
    block.epoch = 0;
    block.shared_chunks.clear();
    block.ctas = ctas;
    block.cta_threads = threads;
    block.cluster_syncs = 0;
    for (u32 i = 0; i < fibers; ++i) {
        Fiber& f = block.fibers[i];
        const u32 t = i % threads;
        f.cta = i / threads;
        f.block = dim3{first.x + f.cta, first.y, first.z};
        f.thread = dim3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
        fiber_start(f, block.stacks.get() + i * FIBER_STACK, block.scheduler);
    }
    running_block = &block;
    block.progress = 0;
    for (u32 c = 0; c < MAX_CLUSTER; ++c) {
        block.live[c] = c < ctas ? threads : 0;
        for (u32& n : block.named_count[c]) n = 0;
    }
    for (Fiber& f : block.fibers) f.runnable = true;
    bool spun_without_progress = false;  // the last round ran only spins and changed nothing
    long nap_ns = MIN_NAP_NS;  // how long a block with only sleeps gives the core away
    block.round.resize(fibers);
    for (u32 i = 0; i < fibers; ++i) block.round[i] = order.reversed ? fibers - 1u - i : i;
    u32 draws = order.seed * 0x9E3779B9u | 1u;  // never 0: xorshift would stay there
    for (;;) {
        const u64 before = block.progress;
        bool only_spins = true;
        if (order.seed != 0u) shuffle_round(block.round, draws);
        for (u32 i = 0; i < fibers; ++i) {
            Fiber& f = block.fibers[block.round[i]];
            if (f.done || !f.runnable) continue;
            // A spin on an mbarrier or a wgmma group ends only by a change that bumps
            // `progress`: resuming it before one would repeat a failed try (and its clock
            // read). Skipping it changes no order of the block's effects.
            if (f.waiting == YIELD && f.spun_at == block.progress) continue;
            f.runnable = false;
            f.waiting = 0;
            threadIdx = f.thread;
            blockIdx = f.block;
            block.current = &f;
            fiber_switch(block.scheduler, f.context);
            // A sleep may end by another launch's write: not a spin that nothing can end.
            if (f.done || f.waiting != YIELD) only_spins = false;
        }
        if (thread_error != nullptr) break;
        // Who runs next: threads that spun; every thread of a CTA, at a CTA-wide barrier
        // they all reached; every thread of the cluster at its barrier; the threads of a
        // named barrier with its count reached.
        u32 live[MAX_CLUSTER] = {}, spinning[MAX_CLUSTER] = {}, at[MAX_CLUSTER][NAMED + NAMED_BARRIERS] = {};
        bool some_done[MAX_CLUSTER] = {};
        // Per warp: live threads, those at a warp collective, and whether one has exited.
        u32 warp_live[MAX_CLUSTER][32] = {}, warp_at[MAX_CLUSTER][32] = {};
        bool warp_done[MAX_CLUSTER][32] = {};
        for (u32 i = 0; i < fibers; ++i) {
            const Fiber& f = block.fibers[i];
            const u32 warp = (i % threads) / 32u;
            if (f.done) {
                some_done[f.cta] = true;
                warp_done[f.cta][warp] = true;
                continue;
            }
            live[f.cta] += 1;
            warp_live[f.cta][warp] += 1;
            if (f.waiting == YIELD || f.waiting == SLEEP) spinning[f.cta] += 1;
            if (f.waiting == WARP_COLLECTIVE) warp_at[f.cta][warp] += 1;
            if (f.waiting > 0 && f.waiting < NAMED + (int)NAMED_BARRIERS) at[f.cta][f.waiting] += 1;
        }
        u32 all_live = 0, all_spinning = 0, at_cluster = 0;
        bool any_done = false;
        for (u32 c = 0; c < ctas; ++c) {
            all_live += live[c];
            all_spinning += spinning[c];
            at_cluster += at[c][CLUSTER_SYNC];
            any_done = any_done || some_done[c];
        }
        if (all_live == 0) break;
        for (Fiber& f : block.fibers) {
            if (!f.done && (f.waiting == YIELD || f.waiting == SLEEP)) f.runnable = true;
        }
        bool released = false;
        for (u32 c = 0; c < ctas && thread_error == nullptr; ++c) {
            if (at[c][SYNCTHREADS] == 0) continue;
            if (at[c][SYNCTHREADS] == live[c]) {
                if (some_done[c]) {
                    fail("barrier divergence: threads of a block exited while others wait at a barrier");
                    break;
                }
                for (Fiber& f : block.fibers) {
                    if (f.cta == c) f.runnable = !f.done;
                }
                block.epoch += 1;
                released = true;
            } else if (spinning[c] == 0 && at[c][WARP_COLLECTIVE] == 0) {
                fail(some_done[c] ? "barrier divergence: threads of a block exited while others wait at a barrier"
                                  : "barrier divergence: threads of a block wait at different barriers");
                break;
            }
        }
        // A warp collective releases its warp alone: the warps of a warp-specialised block
        // (the Hopper engine's producer and consumers) reach different ones.
        bool warp_waits = false;
        for (u32 c = 0; c < ctas && thread_error == nullptr; ++c) {
            for (u32 warp = 0; warp * 32u < threads; ++warp) {
                if (warp_at[c][warp] == 0) continue;
                if (warp_done[c][warp]) {
                    fail("barrier divergence: threads of a warp exited while others wait at a warp collective");
                    break;
                }
                if (warp_at[c][warp] < warp_live[c][warp]) {
                    warp_waits = true;
                    continue;
                }
                const u32 first = c * threads + warp * 32u;
                for (u32 j = first; j < first + 32u && j < (c + 1u) * threads; ++j) block.fibers[j].runnable = true;
                block.progress += 1;
                released = true;
            }
        }
        if (thread_error != nullptr) break;
        if (at_cluster != 0 && at_cluster == all_live) {
            if (any_done) {
                fail("cluster barrier divergence: threads of the cluster exited while others wait at its barrier");
                break;
            }
            for (Fiber& f : block.fibers) f.runnable = !f.done;
            block.cluster_syncs += 1;
            block.progress += 1;
            released = true;
        }
        for (u32 c = 0; c < ctas && thread_error == nullptr; ++c) {
            for (u32 id = 0; id < NAMED_BARRIERS; ++id) {
                const u32 count = block.named_count[c][id];
                if (count == 0 || at[c][NAMED + id] < count) continue;
                if (at[c][NAMED + id] > count) {
                    fail("named barrier: more threads wait at it than it counts");
                    break;
                }
                for (Fiber& f : block.fibers) {
                    if (!f.done && f.cta == c && f.waiting == NAMED + (int)id) f.runnable = true;
                }
                block.named_count[c][id] = 0;
                block.progress += 1;
                released = true;
            }
        }
        if (thread_error != nullptr) break;
        if (!released && all_spinning == 0) {
            fail(at_cluster != 0 ? "deadlock: threads wait at the cluster barrier that others never reach"
                 : warp_waits   ? "barrier divergence: threads of a warp wait at a warp collective (__shfl_sync) "
                                  "that others of the warp never reach"
                                : "deadlock: every live thread of the block waits at a named barrier that too few "
                                  "threads reach");
            break;
        }
        // Two rounds of nothing but spins with no progress between: nothing any thread of
        // the block can do will complete what they wait for.
        const bool stalled = only_spins && !released && block.progress == before;
        if (stalled && spun_without_progress) {
            fail(warp_waits ? "barrier divergence: threads of a warp wait at a warp collective (__shfl_sync) that "
                              "others of the warp, spinning, never reach"
                            : "deadlock: every live thread of the block spins on an mbarrier phase that no thread "
                              "can complete (a missing arrive, too many expected bytes, or a wait for the wrong "
                              "parity)");
            break;
        }
        spun_without_progress = stalled;
        // Nothing for the next round but sleeps (spins on global memory) and spins that
        // nothing has changed for: the block waits on other launches. Give them the core
        // for a moment rather than spin on it.
        bool local_work = false, some_sleep = false;
        for (const Fiber& f : block.fibers) {
            if (f.done || !f.runnable) continue;
            some_sleep = some_sleep || f.waiting == SLEEP;
            if (f.waiting != SLEEP && !(f.waiting == YIELD && f.spun_at == block.progress)) local_work = true;
        }
        if (some_sleep && !local_work) {
            // Longer each round nothing wakes, as a GPU's __nanosleep backs off: dozens of
            // persistent blocks sleeping at once (fused_push at D = 8) would otherwise take
            // the cores from the few that work, and a loaded machine could starve those
            // past a wait's deadline.
            timespec t{0, nap_ns};
            nanosleep(&t, nullptr);
            nap_ns = nap_ns * 2 > MAX_NAP_NS ? MAX_NAP_NS : nap_ns * 2;
        } else {
            nap_ns = MIN_NAP_NS;
        }
    }
    running_block = nullptr;
}

// How a launch runs its blocks: one after another with plain threads (no barriers),
// one after another with fibers, or every block on its own OS thread with fibers (a
// persistent kernel whose blocks wait for each other).
enum Mode { PLAIN = 0, FIBERS = 1, CONCURRENT_BLOCKS = 2 };

// Beside the mode: each scheduler round resumes a block's fibers from the last thread to
// the first (consumers before producers), or in an order drawn each round from the seed
// in the mode's top 16 bits; for the orderings that the first thread's head start hides.
constexpr u32 REVERSED_ROUNDS = 0x10u;

inline void run_blocks(const u32* grid, const u32* block, u32 mode, u32 cluster, u64 first, u64 step,
                       FiberOrder order, void (*body)(void*), void* closure) {
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    const u64 blocks = (u64)grid[0] * grid[1] * grid[2];
    const u32 threads = block[0] * block[1] * block[2];
    // Cluster q is blocks q·cluster .. q·cluster + cluster − 1 (consecutive along x).
    for (u64 q = first; q * cluster < blocks && thread_error == nullptr; q += step) {
        const u64 b = q * cluster;
        blockIdx = dim3{(u32)(b % grid[0]), (u32)((b / grid[0]) % grid[1]), (u32)(b / ((u64)grid[0] * grid[1]))};
        if (mode == PLAIN) {
            for (u32 t = 0; t < threads; ++t) {
                threadIdx = dim3{t % block[0], (t / block[0]) % block[1], t / (block[0] * block[1])};
                body(closure);
            }
        } else {
            run_cluster_fibers(cluster, threads, blockIdx, order, body, closure);
        }
    }
}

// Launches `kernel` over `grid` × `block` with `args` as cuLaunchKernelEx takes them
// (one pointer per parameter). Returns 0, or 1 with the reason in `error`.
template <class... P, size_t... I>
inline void call(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<P>*>(args[I])...);
}

// OS threads for the blocks of a launch that must all run at once, kept between launches:
// each keeps its thread-local block (the fibers' stacks, the Hopper engine's shared
// memory) mapped and touched, where a fresh thread per block and launch spent a fifth of
// a run on the fake driver in page faults. Up to IDLE threads wait for the next launch;
// more exit.
//
// A process may load several builds of this runtime (the host twin, the fake driver, the
// tests' variants), and unload some: each has its own pool (internal linkage; an inline
// function's static would be one object for them all), and its threads are stopped and
// joined when the library is unloaded, before its code goes.
namespace {
class BlockThreads {
  public:
    // Runs task(0) … task(count − 1), each on its own thread, and returns when all have.
    void run(u64 count, const std::function<void(u64)>& task) {
        std::vector<Worker*> mine;
        {
            std::lock_guard<std::mutex> g(lock);
            while (mine.size() < count && !idle.empty()) {
                mine.push_back(idle.back());
                idle.pop_back();
            }
        }
        while (mine.size() < count) mine.push_back(new Worker());
        Latch done{count};
        for (u64 i = 0; i < count; ++i) {
            mine[i]->give([&task, &done, i] {
                task(i);
                done.count_down();
            });
        }
        done.wait();
        std::vector<Worker*> surplus;
        {
            std::lock_guard<std::mutex> g(lock);
            for (Worker* w : mine) (closed || idle.size() >= IDLE ? surplus : idle).push_back(w);
        }
        for (Worker* w : surplus) w->stop();
    }

    // Stops and joins the waiting threads; threads of a launch still running stop when it
    // returns.
    void close() {
        std::vector<Worker*> waiting;
        {
            std::lock_guard<std::mutex> g(lock);
            closed = true;
            waiting.swap(idle);
        }
        for (Worker* w : waiting) w->stop();
    }

  private:
    static constexpr size_t IDLE = 32;

    struct Latch {
        u64 left;
        std::mutex m;
        std::condition_variable cv;
        void count_down() {
            std::lock_guard<std::mutex> g(m);
            if (--left == 0) cv.notify_all();
        }
        void wait() {
            std::unique_lock<std::mutex> g(m);
            cv.wait(g, [&] { return left == 0; });
        }
    };

    struct Worker {
        std::mutex m;
        std::condition_variable cv;
        std::function<void()> task;
        bool given = false;
        std::thread thread{[this] { serve(); }};

        // A task to run; an empty one ends the thread.
        void give(std::function<void()> next) {
            std::lock_guard<std::mutex> g(m);
            task = std::move(next);
            given = true;
            cv.notify_one();
        }
        // Ends the thread, waits for it, and frees the worker.
        void stop() {
            give(nullptr);
            thread.join();
            delete this;
        }
        void serve() {
            for (;;) {
                std::function<void()> next;
                {
                    std::unique_lock<std::mutex> g(m);
                    cv.wait(g, [&] { return given; });
                    given = false;
                    next = std::move(task);
                }
                if (!next) return;
                next();
            }
        }
    };

    std::mutex lock;
    std::vector<Worker*> idle;
    bool closed = false;
};

// This library's pool; never destroyed (a hung launch's threads may still return to it
// at exit), only closed when the library is unloaded or the process exits.
BlockThreads* const block_threads = new BlockThreads();
__attribute__((destructor)) void close_block_threads() { block_threads->close(); }
}  // namespace

template <class... P>
inline int launch(void (*kernel)(P...), const u32* grid, const u32* block, u32 mode, void** args, char* error,
                  u64 error_len) {
    struct Closure {
        void (*kernel)(P...);
        void** args;
    } closure{kernel, args};
    auto body = [](void* c) {
        auto* k = static_cast<Closure*>(c);
        call(k->kernel, k->args, std::index_sequence_for<P...>{});
    };
    const char* why = nullptr;
    const u64 blocks = (u64)grid[0] * grid[1] * grid[2];
    // The launch's cluster size along x rides above the mode (the fake driver's
    // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, the twin executor's kernel).
    const u32 cluster = std::max((mode >> 8) & 0xffu, 1u);
    const FiberOrder order{(mode & REVERSED_ROUNDS) != 0u, mode >> 16};
    mode &= 0xfu;
    if (block[0] * block[1] * block[2] == 0 || blocks == 0) {
        why = "an empty grid or block";
    } else if (cluster > MAX_CLUSTER || grid[0] % cluster != 0 || (cluster > 1 && mode == PLAIN)) {
        why = "a cluster the host twin does not run: at most 2 CTAs along x, a grid of whole clusters, fibers";
    } else if (mode == CONCURRENT_BLOCKS && blocks > cluster) {
        // Every cluster (every block, without clusters) on its own OS thread.
        const u64 clusters = blocks / cluster;
        std::vector<const char*> errors(clusters, nullptr);
        block_threads->run(clusters, [&](u64 q) {
            thread_error = nullptr;
            run_blocks(grid, block, FIBERS, cluster, q, clusters, order, body, &closure);
            errors[q] = thread_error;
        });
        for (const char* e : errors) why = why != nullptr ? why : e;
    } else {
        thread_error = nullptr;
        run_blocks(grid, block, mode == PLAIN ? PLAIN : FIBERS, cluster, 0, 1, order, body, &closure);
        why = thread_error;
    }
    if (why == nullptr) return 0;
    std::snprintf(error, error_len, "%s", why);
    return 1;
}

// The byte size of each parameter of `kernel`, for a driver that must copy the values
// cuLaunchKernelEx's pointers point at (host/driver.cpp). Returns the count.
template <class... P>
inline u32 param_sizes(void (*)(P...), u64* sizes, u32 capacity) {
    const u64 each[] = {(u64)sizeof(P)..., 0};
    for (u32 i = 0; i < sizeof...(P) && i < capacity; ++i) sizes[i] = each[i];
    return (u32)sizeof...(P);
}

}  // namespace cmm_host

inline void __syncthreads() { cmm_host::barrier(cmm_host::SYNCTHREADS); }

namespace cmm_host {
// An acquire by the running thread (of a block with fibers): a TMA copy it issues next
// needs a fence.proxy.async first (host/hopper.h).
inline void note_acquire() {
    if (running_block != nullptr && running_block->current != nullptr) running_block->current->acquired = true;
}
}  // namespace cmm_host

inline void __nanosleep(u32 ns) {
    if (cmm_host::sleep_thread()) return;
    // A thread without fibers (a wait or gate kernel: one thread) naps longer each time it
    // comes back within a nap of the last, as a block of fibers does: a hundred stream
    // threads each waking every few microseconds would take the cores from the few that
    // work. A spin that resumes after a pause starts again at `ns`.
    static thread_local long nap_ns = 0;
    static thread_local u64 woke_ns = 0;
    const u64 now = cmm_globaltimer_ns();
    const bool spinning = woke_ns != 0 && now - woke_ns <= (u64)nap_ns;
    nap_ns = spinning ? std::min(2 * nap_ns, cmm_host::MAX_NAP_NS) : std::max((long)ns, 1L);
    timespec t{0, nap_ns};
    nanosleep(&t, nullptr);
    woke_ns = cmm_globaltimer_ns();
}
