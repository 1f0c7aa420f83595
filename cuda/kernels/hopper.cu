// The Hopper GEMM engine: C (+)= A·op(B) for f16/bf16 A and B, f32 accumulation, on
// sm_90a. Same contract as the tile kernels of gemm.cu (twin: the `Op::Gemm` arm of
// cmm-core cpu/mod.rs), another mainloop:
//
// - Tiles of 128×BN (BN = 256 or 128) in a persistent grid: CTA c takes tiles c, c + G,
//   c + 2G, … of the run, in the run's order (block after block; inside a block, groups
//   of CMM_HOPPER_GROUP_M tile rows column by column, so that the CTAs at work share
//   A's and B's tiles in L2).
// - One producer warpgroup (its first thread issues every load) and two consumer
//   warpgroups (64 rows of the tile each). `setmaxnreg` moves registers from the
//   producer to the consumers, which hold BN/2 f32 accumulators a thread.
// - K in steps of 64 (one 128-byte row of 16-bit elements), STAGES stages of shared
//   memory. The producer fills a stage with TMA copies (cp.async.bulk.tensor, 128-byte
//   swizzle, zero fill past the tensor's edges) completing on the stage's `full` mbarrier
//   (expect-tx); the consumers multiply it with wgmma m64nBNk16 from shared-memory
//   descriptors and give it back on its `empty` mbarrier once the wgmma that read it has
//   completed (one wgmma group stays in flight).
// - A is K-major (stored M×K); B is N-major (stored K×N, the plans' usual weight) or
//   K-major (stored N×K: a transposed B). The descriptor bits other than the address come
//   from the host (`desc_a`, `desc_b`), which knows the layout it asked TMA for.
// - Epilogue: straight from the accumulators to global memory, two adjacent columns per
//   store where C's alignment allows (`CMM_HOPPER_PAIRS`), rounded once (RNE) to C's
//   dtype, or added onto f32 C (β = 1).
// - A grouped GEMM (MoE, `CMM_HOPPER_GROUPED`): the tiles of expert e's rows, segment
//   (e, chunk) of the routing tables, follow those of the experts before it; every
//   thread walks the segment offsets on the GPU as its tiles go, so an empty expert
//   costs no tile and the host never reads the routing. A is one map over all the rows
//   (a tile's rows past its segment are loaded but never stored); B is a 3D map (N, K,
//   experts), so that K past an expert's rows is zero fill, not the next expert's.
//   Gathered rows (`CMM_HOPPER_GATHER`: row r of C multiplies the token of perm[r], a row
//   of a token shard) are no box TMA can load: the whole producer warpgroup loads A, eight
//   threads a row of the tile (a warp's copy reads four whole rows), with 16-byte cp.async
//   copies into the 128-byte-swizzled layout TMA would have written, tracked by the
//   stage's `full` mbarrier
//   (the barrier expects one arrival per producer thread besides the first thread's
//   expect-tx). Each producer thread commits a stage's copies as one cp.async group and
//   hands the stage over STAGES − 2 stages later: cp.async.wait_group (its copies have
//   landed), fence.proxy.async.shared::cta (its generic-proxy writes made visible to
//   wgmma's async proxy), then a plain arrive, whose release the consumers' wait
//   acquires. So the proxy fence is the producer's, off the tensor cores' path.
//   `CMM_HOPPER_READER_FENCE` (the GEMM sweep's `reader-fence` variant, the engine's way
//   until 2026-11-28) instead tracks the copies with cp.async.mbarrier.arrive.noinc and
//   has every consumer thread fence after each stage's wait, with one wgmma group of the
//   stage before in flight.
//   With `CMM_HOPPER_ZERO_UNROUTED` the tiles after the last expert's store zeros over
//   C's rows past the routed ones, with no load and no wgmma.
// - A tile-granular (fused) run: the producer performs the waits of a block before the
//   loads of its first tile (acquire, then `fence.proxy.async.global`, which orders the
//   generic-proxy acquire before the async-proxy TMA reads); the consumers count a
//   block's tiles once its stores are done (a named barrier, then one fence and one count
//   per CTA) and the CTA that writes a block's last tile releases it, after the blocks
//   before it, as the tile kernels' persistent GEMM does. A failed wait (deadline or
//   abort) marks the run failed: the CTAs still run their tiles to the end (a consumer
//   that left its wgmma loop early would make ptxas serialise every wgmma) but make no
//   further wait and release no block.
// - No wait can hang the GPU: an mbarrier wait that outlasts the run's wait deadline
//   (twice it, plus a second) traps, which the host reports as a lost context.
// - Clusters of two (`CLUSTER` 2; the GEMM sweep's `_c2` kernels, plain GEMMs with B
//   N-major only): the two CTAs of a cluster take the two row tiles of a pair that share
//   their columns (a phantom second tile past M loads zeros and stores nothing), and each
//   loads half of B's boxes of a stage into both CTAs' shared memory with one multicast
//   TMA copy, so B crosses from L2 once per pair. A stage is refilled only once the
//   consumers of both CTAs gave it back: its `empty` barrier counts four arrivals, two of
//   them remote (mapa, then mbarrier.arrive.release.cluster). A cluster barrier makes the
//   barriers' initialisation visible to the peer before any copy or remote arrive, and
//   another keeps each CTA alive until its peer has made its last one.
// - Ping-pong (`PINGPONG`; the GEMM sweep's `_pp` kernels, 128×128 tiles): the consumer
//   warpgroups take the CTA's tiles in turn, each a whole tile (two m64n128 blocks of
//   rows, 128 accumulators a thread), while the producer loads every tile's stages in
//   order, as before. A stage has one consumer, so its `empty` barrier counts one arrival,
//   and a warpgroup lets the other's stages pass it by. The warpgroups take turns: one
//   starts waiting for its tile's stages once the other has waited for every stage of the
//   tile before (a turn mbarrier each), so that one's epilogue runs beside the other's
//   wgmma rather than with the tensor cores idle, and so that no parity wait is made
//   for a phase two ahead of the last completed one (which it would take for complete).
//
// - TMA stores (`TMA_STORE`; the GEMM sweep's `_ts` kernels, one stage fewer of 128×256,
//   one fewer of 128×128): each consumer warpgroup rounds its 64 rows of a tile into its
//   own 32 KiB staging in shared memory, laid out as the 128-byte swizzle lays a box out,
//   makes fence.proxy.async.shared::cta (generic writes, read by TMA's async proxy), meets
//   its warpgroup at a named barrier, and one thread stores the boxes by TMA
//   (cp.async.bulk.tensor, columns past N clipped) while the warpgroup goes on to its next
//   tile; the staging is written again only after that thread's
//   cp.async.bulk.wait_group.read, and the CTA leaves only after its stores completed.
//   For tiles wholly inside their block's rows, of runs that do not add onto C and whose
//   blocks' C maps the host encoded (`CMM_HOPPER_STORE_TMA`); the others store from
//   registers as above. In a fused run a block is released only once its stores are
//   complete: each issuing thread waits for them (cp.async.bulk.wait_group 0) and makes
//   fence.proxy.async.global before the tile is counted.
//
// The host twin (cuda/host/hopper.h) runs the same code with its own mbarriers, TMA
// copies and wgmma, which check what the GPU leaves undefined.

// An opaque TMA descriptor, encoded on the host (`cuTensorMapEncodeTiled`). Mirror:
// `TensorMap` in cuda/src/launch.rs.
struct __align__(64) CmmTensorMap {
    u64 words[16];
};

// One block of a Hopper GEMM: the tensor map of its A, its C and its rows; a plain GEMM
// is one block. Mirror: `HopperBlockArgs` in cuda/src/launch.rs.
struct __align__(64) CmmHopperBlock {
    CmmTensorMap a;
    u64 c;              // byte address of C's element (0, 0)
    u64 c_stride;       // in elements
    u32 rows;           // rows of A and C
    u32 first_tile;     // tiles of the blocks before it
    u32 waits_end;      // waits [0, waits_end) gate it
    u32 signals_begin;  // signals [signals_begin, signals_end) release it
    u32 signals_end;
    u32 pad[7];
    CmmTensorMap c_map;  // TMA_STORE kernels with CMM_HOPPER_STORE_TMA: C (boxes of 128 bytes × 64 rows)
};

// Mirror: `HopperArgs` in cuda/src/launch.rs.
struct __align__(64) CmmHopperArgs {
    CmmTensorMap b;
    CmmHopperBlock first;  // block 0: a plain GEMM's only block
    u64 blocks;            // CmmHopperBlock[count] in global memory, or 0: `first` is the only one
    u64 waits;             // CmmHopperSync[]
    u64 signals;           // CmmHopperSync[]
    u64 control;           // u32[3 + count], zero at launch, or 0 (no waits or signals):
                           // unused, blocks released, failed, then per block its tiles done
    u64 status;            // per wait u32[2]: why it gave up (1: deadline, 2: aborted), the value seen
    u64 abort;             // the run's abort word
    u64 timeout_ns;        // deadline of one wait
    u64 desc_a;            // wgmma descriptor bits of A's and B's stages besides the address
    u64 desc_b;
    u64 seg;               // grouped: the segment offsets, u32[experts·chunks + 1]
    u64 perm;              // gather: the row permutation (u32 token·slots + slot per row)
    u64 perm_stride;       // in elements
    u64 a;                 // gather: byte address of the token shard's row 0 (A's map unused)
    u64 a_stride;          // in elements
    u32 n;
    u32 k;
    u32 c_dtype;
    u32 flags;             // CMM_HOPPER_*
    u32 count;             // blocks
    u32 tiles;             // tiles of all blocks (grouped: unused, the segments say)
    u32 tiles_n;           // column tiles of a row of tiles
    u32 chunks;            // grouped: the tables' token chunks, the chunk whose segments,
    u32 chunk;             // and the experts [group_begin, group_end) computed
    u32 group_begin;
    u32 group_end;
    u32 experts;           // grouped: experts of the tables (the zero tiles' first row)
    u32 slots;             // gather: slots per token, the shard's first token and its tokens
    u32 gather_base;
    u32 a_rows;
    u32 pad[5];
};

static_assert(sizeof(CmmHopperBlock) == 320 && sizeof(CmmHopperArgs) == 640, "the mirrors' sizes");

// One wait or signal of a fused run. Mirror: `FusedSyncArgs`.
struct CmmHopperSync {
    u64 sem;
    u32 value;
    u32 pad;
};

#define CMM_HOPPER_B_N_MAJOR 1u   // B stored K×N (else N×K)
#define CMM_HOPPER_ACCUMULATE 4u  // C += A·B (C is f32)
#define CMM_HOPPER_PAIRS 8u       // C's base and row stride allow two-element stores
#define CMM_HOPPER_GROUPED 16u    // a grouped GEMM: `first` holds A and C of every row, B is 3D
#define CMM_HOPPER_GATHER 32u     // grouped, a's rows gathered by token through perm (cp.async)
#define CMM_HOPPER_ZERO_UNROUTED 64u  // grouped: zero C's rows past the routed ones
#define CMM_HOPPER_READER_FENCE 128u  // gather: the consumers fence, the copies tracked by noinc arrives
#define CMM_HOPPER_STORE_TMA 256u     // TMA_STORE kernels: every block's `c_map` is encoded, whole tiles leave through it
#define CMM_HOPPER_NONE 0xffffffffu   // a permutation entry of no (token, slot)

#define CMM_HOPPER_BM 128u
#define CMM_HOPPER_BK 64u
#define CMM_HOPPER_GROUP_M 8u
#define CMM_HOPPER_THREADS 384u

// Shared memory of one stage of A (128 rows of 128 bytes) and of B (BN × 128 bytes).
#define CMM_HOPPER_A_BYTES (CMM_HOPPER_BM * CMM_HOPPER_BK * 2u)
// A consumer warpgroup's staging of C (TMA_STORE kernels): 64 rows of 512 bytes.
#define CMM_HOPPER_STAGING_BYTES 32768u

#define CMM_ACC8(d, i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])

#ifndef CMM_HOST
// wgmma's accumulator operand lists (m64nNk16: N/2 f32 registers a thread).
#define CMM_WGMMA_N128_D \
    "%0, %1, %2, %3, %4, %5, %6, %7, " \
    "%8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63"
#define CMM_WGMMA_N128_OPERANDS(d) \
    CMM_ACC8(d, 0), \
    CMM_ACC8(d, 8), \
    CMM_ACC8(d, 16), \
    CMM_ACC8(d, 24), \
    CMM_ACC8(d, 32), \
    CMM_ACC8(d, 40), \
    CMM_ACC8(d, 48), \
    CMM_ACC8(d, 56)

#define CMM_WGMMA_N256_D \
    "%0, %1, %2, %3, %4, %5, %6, %7, " \
    "%8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, " \
    "%72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, " \
    "%88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, " \
    "%104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127"
#define CMM_WGMMA_N256_OPERANDS(d) \
    CMM_ACC8(d, 0), \
    CMM_ACC8(d, 8), \
    CMM_ACC8(d, 16), \
    CMM_ACC8(d, 24), \
    CMM_ACC8(d, 32), \
    CMM_ACC8(d, 40), \
    CMM_ACC8(d, 48), \
    CMM_ACC8(d, 56), \
    CMM_ACC8(d, 64), \
    CMM_ACC8(d, 72), \
    CMM_ACC8(d, 80), \
    CMM_ACC8(d, 88), \
    CMM_ACC8(d, 96), \
    CMM_ACC8(d, 104), \
    CMM_ACC8(d, 112), \
    CMM_ACC8(d, 120)

// d (+)= A·B for one m64n128k16 step of the warpgroup, A and B read from shared memory
// through their descriptors; `accumulate` 0 overwrites d. TRANS_B 1: B is N-major.
template <bool BF16, int TRANS_B>
__device__ __forceinline__ void cmm_wgmma_n128(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    if constexpr (BF16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" CMM_WGMMA_N128_D
                     "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
                     : CMM_WGMMA_N128_OPERANDS(d)
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" CMM_WGMMA_N128_D
                     "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
                     : CMM_WGMMA_N128_OPERANDS(d)
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
    }
}

// The same, m64n256k16.
template <bool BF16, int TRANS_B>
__device__ __forceinline__ void cmm_wgmma_n256(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    if constexpr (BF16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" CMM_WGMMA_N256_D
                     "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
                     : CMM_WGMMA_N256_OPERANDS(d)
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" CMM_WGMMA_N256_D
                     "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
                     : CMM_WGMMA_N256_OPERANDS(d)
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
    }
}

__device__ __forceinline__ void cmm_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void cmm_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

// Waits until at most N of the warpgroup's committed wgmma groups are in flight.
template <int N>
__device__ __forceinline__ void cmm_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses of a register across this point (the
// accumulators change under a wgmma in flight, which the compiler does not see).
__device__ __forceinline__ void cmm_pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }

// Keeps the compiler from computing an address early, beside the ones computed before
// this point (an epilogue with every row's address at once spills accumulators).
__device__ __forceinline__ void cmm_address_here(u64& x) { asm volatile("" : "+l"(x)::"memory"); }

__device__ __forceinline__ void cmm_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the barriers' initialisation visible to the async proxy (the TMA unit).
__device__ __forceinline__ void cmm_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Arrives and expects `bytes` more of transactions (the TMA copies of the stage).
__device__ __forceinline__ void cmm_mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cmm_mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Whether the phase of parity `parity` has completed (the instruction itself waits a
// while before it says no).
__device__ __forceinline__ bool cmm_mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0u;
}

// A TMA copy of the box at (x, y) (x along the contiguous dimension) into shared `dst`,
// completing `bytes` of transactions on `bar`.
__device__ __forceinline__ void cmm_tma_load_2d(u32 dst, const CmmTensorMap* map, u32 x, u32 y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
            "r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

// The same from a 3D tensor map, at (x, y, z): z picks the layer (an expert's B).
__device__ __forceinline__ void cmm_tma_load_3d(u32 dst, const CmmTensorMap* map, u32 x, u32 y, u32 z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
            "r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

// The same as cmm_tma_load_2d into the shared memory at `dst` of every CTA of the cluster
// in `mask` (bit r: rank r), completing the bytes on the barrier at `bar` of each.
__device__ __forceinline__ void cmm_tma_load_2d_multicast(u32 dst, const CmmTensorMap* map, u32 x, u32 y, u32 bar,
                                                          u16 mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(bar), "h"(mask)
        : "memory");
}

// This CTA's rank in its cluster.
__device__ __forceinline__ u32 cmm_cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Every thread of the cluster meets here; what each did before is visible to all after.
__device__ __forceinline__ void cmm_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// An arrive on the barrier at `bar` of the cluster's CTA of rank `cta`.
__device__ __forceinline__ void cmm_mbar_arrive_cluster(u32 bar, u32 cta) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(cta));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// A 16-byte copy from global `src` to shared `dst` (cp.async.cg); bytes past
// `src_bytes` (all 16 when 0) are zeros.
__device__ __forceinline__ void cmm_hopper_cp_async16(u32 dst, u64 src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Makes `bar` track this thread's cp.async copies so far: it receives one arrival once
// they have landed (noinc: the arrival is one of those the barrier was initialised with).
__device__ __forceinline__ void cmm_hopper_cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Closes this thread's cp.async copies issued so far into one group.
__device__ __forceinline__ void cmm_hopper_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most the N latest groups of this thread's cp.async copies are in flight.
template <u32 N>
__device__ __forceinline__ void cmm_hopper_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Orders the shared memory this thread has written or seen written through the generic
// proxy (cp.async) before later async-proxy reads of it (wgmma), its own or, through a
// release it makes after, another thread's.
__device__ __forceinline__ void cmm_fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Stores to the staging of C in shared memory (TMA_STORE kernels), through the generic
// proxy: two f32 values, or one word of two 16-bit ones.
__device__ __forceinline__ void cmm_hopper_stage_f32x2(u32 addr, float v0, float v1) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(v0), "f"(v1) : "memory");
}

__device__ __forceinline__ void cmm_hopper_stage_b32(u32 addr, u32 bits) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(bits) : "memory");
}

// A TMA store of the box at (x, y) of `map` from the shared memory at `src` (128-byte
// swizzle, clipped at the tensor's edges), in this thread's current bulk group.
__device__ __forceinline__ void cmm_tma_store_2d(const CmmTensorMap* map, u32 src, u32 x, u32 y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"((u64)map),
                 "r"(src), "r"(x), "r"(y)
                 : "memory");
}

// Closes this thread's bulk copies (TMA stores) issued so far into one group.
__device__ __forceinline__ void cmm_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until this thread's TMA stores have read their shared memory (it may be
// written again).
__device__ __forceinline__ void cmm_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Waits until this thread's TMA stores have completed.
__device__ __forceinline__ void cmm_bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void cmm_tma_prefetch(const CmmTensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"((u64)map) : "memory");
}

template <u32 N>
__device__ __forceinline__ void cmm_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

template <u32 N>
__device__ __forceinline__ void cmm_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// A barrier of `threads` threads (a multiple of 32) on hardware barrier `id`.
__device__ __forceinline__ void cmm_bar_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Orders this thread's earlier generic-proxy accesses of global memory (an acquire)
// before its later async-proxy ones (TMA loads).
__device__ __forceinline__ void cmm_fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ void cmm_fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Two values rounded to nearest even into one word, `lo` in the low half.
__device__ __forceinline__ u32 cmm_pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 cmm_pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The shared address of the dynamic shared memory.
__device__ __forceinline__ u32 cmm_dynamic_smem() {
    extern __shared__ __align__(1024) unsigned char cmm_hopper_smem[];
    return cmm_smem_addr(cmm_hopper_smem);
}

__device__ __forceinline__ void cmm_trap() { asm volatile("trap;"); }

// A plain load that orders nothing (the failed word: it gates no data).
__device__ __forceinline__ u32 cmm_load_relaxed(u64 addr) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}
#endif  // CMM_HOST (the host twin's are in cuda/host/hopper.h)

// Waits for the phase of parity `parity` of `bar`; traps once `limit_ns` has passed.
__device__ __forceinline__ void cmm_mbar_wait(u32 bar, u32 parity, u64 limit_ns) {
    if (cmm_mbar_try_wait(bar, parity)) return;
    const u64 start = cmm_globaltimer_ns();
    while (!cmm_mbar_try_wait(bar, parity)) {
        if (cmm_globaltimer_ns() - start > limit_ns) cmm_trap();
    }
}

// The address bits of a shared-memory matrix descriptor.
__device__ __forceinline__ u64 cmm_desc_addr(u32 smem) { return (u64)((smem & 0x3FFFFu) >> 4); }

template <u32 BN_, u32 STAGES_, u32 CLUSTER_ = 1u, bool PINGPONG_ = false, bool TMA_STORE_ = false>
struct CmmHopperShape {
    static constexpr u32 BN = BN_, STAGES = STAGES_, CLUSTER = CLUSTER_;
    static constexpr bool PINGPONG = PINGPONG_, TMA_STORE = TMA_STORE_;
    // Rows of a tile one consumer warpgroup multiplies, in m64 blocks: half of every
    // tile, or (PINGPONG) the whole of every other tile of the CTA.
    static constexpr u32 HALVES = PINGPONG ? 2u : 1u;
    static constexpr u32 B_BYTES = BN * CMM_HOPPER_BK * 2u;
    // Stages, 1024-byte aligned (the swizzle pattern's period), then the barriers: full
    // and empty per stage, and (PINGPONG) each consumer warpgroup's turn.
    // (TMA_STORE) After the stages, each consumer warpgroup's staging of C: its 64 rows,
    // 32 KiB, in boxes of 128 bytes × 64 rows as the 128-byte swizzle lays them out.
    static constexpr u32 STAGING = STAGES * (CMM_HOPPER_A_BYTES + B_BYTES);
    static constexpr u32 BARRIERS = STAGING + (TMA_STORE ? 2u * CMM_HOPPER_STAGING_BYTES : 0u);
    static constexpr u32 SMEM_BYTES = 1024u + BARRIERS + 16u * STAGES + (PINGPONG ? 16u : 0u);
    static_assert(BN == 128 || BN == 256, "wgmma n128 or n256");
    static_assert(CLUSTER == 1 || CLUSTER == 2, "one CTA, or a cluster of two");
    static_assert(!PINGPONG || (BN == 128 && CLUSTER == 1), "a warpgroup holds 128 accumulators a thread");
    static_assert(!TMA_STORE || (CLUSTER == 1 && !PINGPONG), "the staged epilogue has one warpgroup per half tile");
    static_assert(SMEM_BYTES <= 232448u, "an sm_90 CTA's dynamic shared memory");
};

// Where the run's tiles are: the block of the latest tile located (grouped: its
// expert), the block's first tile, and its rows [row0, row0 + rows) of A's map and C.
struct CmmHopperCursor {
    u32 block;
    u32 first_tile;
    u32 row0;
    u32 rows;
};

// The end of a grouped run's blocks: its experts, then with CMM_HOPPER_ZERO_UNROUTED one
// block of the rows past the routed ones.
__device__ __forceinline__ u32 cmm_hopper_blocks_end(const CmmHopperArgs& p) {
    return p.group_end + ((p.flags & CMM_HOPPER_ZERO_UNROUTED) ? 1u : 0u);
}

// Whether the cursor's block is the zero block.
__device__ __forceinline__ bool cmm_hopper_zero_block(const CmmHopperArgs& p, const CmmHopperCursor& at) {
    return (p.flags & CMM_HOPPER_GROUPED) && at.block >= p.group_end;
}

// Moves a grouped run's cursor onto segment (at.block, chunk), or past the routed rows
// for the zero block, bounded by C's rows.
__device__ __forceinline__ void cmm_hopper_segment(const CmmHopperArgs& p, CmmHopperCursor& at) {
    const u32* seg = (const u32*)p.seg;
    const u32 i = at.block * p.chunks + p.chunk;
    const bool zero = at.block >= p.group_end;
    const u32 begin = min(zero ? seg[p.experts * p.chunks] : seg[i], p.first.rows);
    const u32 end = zero ? p.first.rows : min(seg[i + 1u], p.first.rows);
    at.row0 = begin;
    at.rows = end > begin ? end - begin : 0u;
}

// The cursor before the run's first tile.
__device__ __forceinline__ CmmHopperCursor cmm_hopper_start(const CmmHopperArgs& p, const CmmHopperBlock* table) {
    CmmHopperCursor at = {0u, 0u, 0u, table[0].rows};
    if (p.flags & CMM_HOPPER_GROUPED) {
        at.block = p.group_begin;
        if (at.block < cmm_hopper_blocks_end(p)) cmm_hopper_segment(p, at);
    }
    return at;
}

// The entry of the block table that holds the tile's A map and C: the cursor's block,
// or for a grouped run `first`, which covers every row.
__device__ __forceinline__ u32 cmm_hopper_entry(const CmmHopperArgs& p, const CmmHopperCursor& at) {
    return (p.flags & CMM_HOPPER_GROUPED) ? 0u : at.block;
}

// Moves `at` to the block of tile `t` (t only grows) and gives the tile's first row
// (among the block's rows) and first column; false past the run's last tile.
template <u32 BN>
__device__ __forceinline__ bool cmm_hopper_locate(const CmmHopperArgs& p, const CmmHopperBlock* table, u32 t,
                                                  CmmHopperCursor& at, u32& m0, u32& n0) {
    if (p.flags & CMM_HOPPER_GROUPED) {
        // An expert's tiles follow the experts' before it (t ≥ at.first_tile throughout).
        const u32 end = cmm_hopper_blocks_end(p);
        while (at.block < end) {
            const u32 tiles = (at.rows + CMM_HOPPER_BM - 1u) / CMM_HOPPER_BM * p.tiles_n;
            if (t - at.first_tile < tiles) break;
            at.first_tile += tiles;
            if (++at.block < end) cmm_hopper_segment(p, at);
        }
        if (at.block >= end) return false;
    } else {
        if (t >= p.tiles) return false;
        while (at.block + 1u < p.count && table[at.block + 1u].first_tile <= t) ++at.block;
        at.first_tile = table[at.block].first_tile;
        at.rows = table[at.block].rows;
    }
    const u32 local = t - at.first_tile;
    const u32 tiles_m = (at.rows + CMM_HOPPER_BM - 1u) / CMM_HOPPER_BM;
    const u32 per_group = CMM_HOPPER_GROUP_M * p.tiles_n;
    const u32 group = local / per_group;
    const u32 first_m = group * CMM_HOPPER_GROUP_M;
    const u32 group_rows = min(CMM_HOPPER_GROUP_M, tiles_m - first_m);
    const u32 in_group = local - group * per_group;
    m0 = (first_m + in_group % group_rows) * CMM_HOPPER_BM;
    n0 = (in_group / group_rows) * BN;
    return true;
}

// A plain GEMM's tiles in pairs of row tiles for a cluster of two: pair q (in groups of
// CMM_HOPPER_GROUP_M / 2 pairs of rows, column by column) and this CTA's tile of it, row
// tile 2·(pair row) + rank; false past the last pair. A second tile past M is a phantom.
template <u32 BN>
__device__ __forceinline__ bool cmm_hopper_locate_pair(const CmmHopperArgs& p, u32 q, const CmmHopperCursor& at,
                                                       u32& m0, u32& n0) {
    const u32 tiles_m = (at.rows + CMM_HOPPER_BM - 1u) / CMM_HOPPER_BM;
    const u32 pairs_m = (tiles_m + 1u) / 2u;
    if (q >= pairs_m * p.tiles_n) return false;
    const u32 per_group = CMM_HOPPER_GROUP_M / 2u * p.tiles_n;
    const u32 group = q / per_group;
    const u32 first_pair = group * (CMM_HOPPER_GROUP_M / 2u);
    const u32 group_pairs = min(CMM_HOPPER_GROUP_M / 2u, pairs_m - first_pair);
    const u32 in_group = q - group * per_group;
    m0 = (2u * (first_pair + in_group % group_pairs) + cmm_cluster_ctarank()) * CMM_HOPPER_BM;
    n0 = (in_group / group_pairs) * BN;
    return true;
}

// The tiles a CTA takes: tile t of the run (one CTA), or pair t (a cluster of two),
// starting at cmm_hopper_first and stepping by cmm_hopper_step.
template <class S>
__device__ __forceinline__ u32 cmm_hopper_first() {
    return S::CLUSTER == 1u ? blockIdx.x : blockIdx.x / 2u;
}

template <class S>
__device__ __forceinline__ u32 cmm_hopper_step() {
    return S::CLUSTER == 1u ? gridDim.x : gridDim.x / 2u;
}

template <class S>
__device__ __forceinline__ bool cmm_hopper_next(const CmmHopperArgs& p, const CmmHopperBlock* table, u32 t,
                                                CmmHopperCursor& at, u32& m0, u32& n0) {
    if constexpr (S::CLUSTER == 1u) {
        return cmm_hopper_locate<S::BN>(p, table, t, at, m0, n0);
    } else {
        return cmm_hopper_locate_pair<S::BN>(p, t, at, m0, n0);
    }
}

// The source of row `row` of a gathered A tile: the token-shard row of the token that
// perm gives C's row, or CMM_HOPPER_NONE (zeros) for a row past the segment, an unrouted
// row or a token outside the shard. Bounded like every table entry.
__device__ __forceinline__ u32 cmm_hopper_gathered_row(const CmmHopperArgs& p, const CmmHopperCursor& at, u32 m0,
                                                       u32 row) {
    if (m0 + row >= at.rows) return CMM_HOPPER_NONE;
    const u32 slot = ((const u32*)p.perm)[(u64)(at.row0 + m0 + row) * p.perm_stride];
    if (slot == CMM_HOPPER_NONE || p.slots == 0u) return CMM_HOPPER_NONE;
    const u32 token = slot / p.slots;
    if (token < p.gather_base || token - p.gather_base >= p.a_rows) return CMM_HOPPER_NONE;
    return token - p.gather_base;
}

// B's boxes of the tile at column n0, N-major: 64 columns of BK rows each; boxes wholly
// past N are not loaded (their columns of the tile are never stored).
template <class S>
__device__ __forceinline__ u32 cmm_hopper_b_boxes(const CmmHopperArgs& p, u32 n0) {
    return min(S::BN / 64u, (p.n - n0 + 63u) / 64u);
}

// The bytes of B's boxes in a stage.
template <class S>
__device__ __forceinline__ u32 cmm_hopper_b_box_bytes(const CmmHopperArgs& p, u32 n0) {
    return cmm_hopper_b_boxes<S>(p, n0) * CMM_HOPPER_BK * 128u;
}

// Loads B's boxes of a stage (of expert `expert`'s matrix, from the 3D map, in a grouped
// run).
template <class S>
__device__ __forceinline__ void cmm_hopper_load_b_boxes(const CmmHopperArgs& p, u32 sb, u32 n0, u32 k0, u32 expert,
                                                        u32 full) {
    const u32 boxes = cmm_hopper_b_boxes<S>(p, n0);
    for (u32 c = 0u; c < boxes; ++c) {
        const u32 box = sb + c * CMM_HOPPER_BK * 128u;
        if (p.flags & CMM_HOPPER_GROUPED) {
            cmm_tma_load_3d(box, &p.b, n0 + 64u * c, k0, expert, full);
        } else {
            cmm_tma_load_2d(box, &p.b, n0 + 64u * c, k0, full);
        }
    }
}

// The producer: one thread makes the block's waits and issues every TMA copy.
template <class S>
__device__ void cmm_hopper_produce(const CmmHopperArgs& p, const CmmHopperBlock* table, u32 smem, u64 limit_ns) {
    const u32 bars = smem + S::BARRIERS;
    const u32 ktiles = (p.k + CMM_HOPPER_BK - 1u) / CMM_HOPPER_BK;
    u32* control = (u32*)p.control;
    const CmmHopperSync* waits = (const CmmHopperSync*)p.waits;
    cmm_tma_prefetch(&p.b);
    u32 stage = 0u, phase = 0u, checked = 0u, m0, n0;
    CmmHopperCursor at = cmm_hopper_start(p, table);
    bool ok = true;
    u64 waited_ns = 0ull;
    for (u32 t = cmm_hopper_first<S>(); cmm_hopper_next<S>(p, table, t, at, m0, n0); t += cmm_hopper_step<S>()) {
        // The zero block's tiles load nothing.
        if (cmm_hopper_zero_block(p, at)) continue;
        // After a failed wait the run has failed: the tiles are still loaded and
        // multiplied (the consumers cannot leave a wgmma loop early without the compiler
        // serialising every wgmma), but no further wait is made and no block released.
        if (control != nullptr && ok) {
            ok = cmm_load_relaxed((u64)&control[2]) == 0u;
            const u32 end = table[at.block].waits_end;
            if (ok && checked < end) {
                const u64 before = cmm_globaltimer_ns();
                for (; checked < end && ok; ++checked) {
                    ok = cmm_spin_at_least(waits[checked].sem, waits[checked].value, p.abort, p.timeout_ns,
                                           p.status + 8ull * checked);
                }
                waited_ns += cmm_globaltimer_ns() - before;
                if (!ok) atomicExch(&control[2], 1u);
                // The data the waits acquired is read by TMA, another proxy.
                cmm_fence_proxy_async_global();
            }
        }
        const CmmTensorMap* amap = &table[cmm_hopper_entry(p, at)].a;
        const u32 a_row = at.row0 + m0;
        for (u32 kt = 0u; kt < ktiles; ++kt) {
            cmm_mbar_wait(bars + 8u * (S::STAGES + stage), phase ^ 1u, limit_ns);
            const u32 full = bars + 8u * stage;
            const u32 sa = smem + stage * CMM_HOPPER_A_BYTES;
            const u32 sb = smem + S::STAGES * CMM_HOPPER_A_BYTES + stage * S::B_BYTES;
            const u32 k0 = kt * CMM_HOPPER_BK;
            if (p.flags & CMM_HOPPER_B_N_MAJOR) {
                cmm_mbar_arrive_expect_tx(full, CMM_HOPPER_A_BYTES + cmm_hopper_b_box_bytes<S>(p, n0));
                cmm_tma_load_2d(sa, amap, k0, a_row, full);
                if constexpr (S::CLUSTER == 2u) {
                    // Every box of B lands in both CTAs: this one copies the boxes of its
                    // rank's parity, its peer the others (the host allows only B N-major).
                    const u32 boxes = cmm_hopper_b_boxes<S>(p, n0);
                    for (u32 c = cmm_cluster_ctarank(); c < boxes; c += 2u) {
                        cmm_tma_load_2d_multicast(sb + c * CMM_HOPPER_BK * 128u, &p.b, n0 + 64u * c, k0, full, 3u);
                    }
                } else {
                    cmm_hopper_load_b_boxes<S>(p, sb, n0, k0, at.block, full);
                }
            } else {
                cmm_mbar_arrive_expect_tx(full, CMM_HOPPER_A_BYTES + S::B_BYTES);
                cmm_tma_load_2d(sa, amap, k0, a_row, full);
                cmm_tma_load_2d(sb, &p.b, k0, n0, full);
            }
            if (++stage == S::STAGES) {
                stage = 0u;
                phase ^= 1u;
            }
        }
    }
    if (control != nullptr) {
        // The run's counts after the control words (8-byte aligned: FusedLayout): the
        // CTAs, and the time their producers spent in the blocks' waits.
        u64* stats = (u64*)(control + ((3u + p.count + 1u) & ~1u));
        atomicAdd((unsigned long long*)&stats[0], 1ull);
        atomicAdd((unsigned long long*)&stats[1], (unsigned long long)waited_ns);
    }
}

// Hands over the `held` stages before `stage` (held ≤ BACK) that a gathered producer
// thread still holds at its end, oldest first, each by its own arrive once its own copies
// have landed: the stage BACK before `stage` is the BACK-th latest cp.async group.
template <class S, u32 BACK>
__device__ __forceinline__ void cmm_hopper_hand_over_held(u32 bars, u32 stage, u32 held) {
    if constexpr (BACK > 0u) {
        if (held >= BACK) {
            cmm_hopper_cp_async_wait<BACK - 1u>();
            cmm_fence_proxy_async_shared();
            cmm_mbar_arrive(bars + 8u * ((stage + S::STAGES - BACK) % S::STAGES));
        }
        cmm_hopper_hand_over_held<S, BACK - 1u>(bars, stage, held);
    }
}

// The producer warpgroup of a grouped run whose rows are gathered: each warp loads 32 rows
// of every A tile with cp.async, eight lanes a row, so that one copy instruction reads
// four whole 128-byte rows (a lane a row would read 32 rows' half-sectors at once, each
// sector from L2 twice, since cp.async.cg passes L1 by). Lane l finds the source of row
// 32·warp + l once a tile and hands it to the lanes that copy that row. Thread 0 also
// issues B's TMA copies. (A grouped run makes no waits.)
//
// A stage's copies are handed over LAG stages after they were issued (see the file's
// head), so that LAG stages of copies are in flight while the consumers multiply. LAG
// is at most STAGES − 2: the stage handed over when the producer takes stage i is
// i − LAG, and the consumers, who have just given stage i − STAGES back, need stage
// i − STAGES + 2 next.
template <class S>
__device__ void cmm_hopper_produce_gathered(const CmmHopperArgs& p, const CmmHopperBlock* table, u32 smem,
                                            u64 limit_ns, u32 thread) {
    constexpr u32 CHUNKS = CMM_HOPPER_BK * 2u / 16u;  // 16-byte chunks of a stage's row
    constexpr u32 ROWS_A_COPY = 32u / CHUNKS;          // rows of one copy instruction of a warp
    const u32 bars = smem + S::BARRIERS;
    const u32 ktiles = (p.k + CMM_HOPPER_BK - 1u) / CMM_HOPPER_BK;
    constexpr u32 LAG = S::STAGES - 2u;
    const u32 lane = thread % 32u, rows = thread - lane;  // the warp's first row
    const u32 chunk = lane % CHUNKS;
    const bool reader_fence = (p.flags & CMM_HOPPER_READER_FENCE) != 0u;
    if (thread == 0u) cmm_tma_prefetch(&p.b);
    u32 stage = 0u, phase = 0u, issued = 0u, m0, n0;
    CmmHopperCursor at = cmm_hopper_start(p, table);
    for (u32 t = blockIdx.x; cmm_hopper_locate<S::BN>(p, table, t, at, m0, n0); t += gridDim.x) {
        if (cmm_hopper_zero_block(p, at)) continue;
        const u32 mine = cmm_hopper_gathered_row(p, at, m0, thread);
        for (u32 kt = 0u; kt < ktiles; ++kt) {
            cmm_mbar_wait(bars + 8u * (S::STAGES + stage), phase ^ 1u, limit_ns);
            const u32 full = bars + 8u * stage;
            const u32 k0 = kt * CMM_HOPPER_BK;
            if (thread == 0u) {
                const u32 sb = smem + S::STAGES * CMM_HOPPER_A_BYTES + stage * S::B_BYTES;
                cmm_mbar_arrive_expect_tx(full, cmm_hopper_b_box_bytes<S>(p, n0));
                cmm_hopper_load_b_boxes<S>(p, sb, n0, k0, at.block, full);
            }
            // Zeros past K and for rows with no source.
            const u32 kk = k0 + 8u * chunk;
            const u32 in_k = kk < p.k ? min(16u, 2u * (p.k - kk)) : 0u;
            const u32 a = smem + stage * CMM_HOPPER_A_BYTES;
            #pragma unroll 1
            for (u32 r = lane / CHUNKS; r < 32u; r += ROWS_A_COPY) {
                const u32 source = __shfl_sync(0xffffffffu, mine, r);
                const u32 row = rows + r;
                const u32 bytes = source != CMM_HOPPER_NONE ? in_k : 0u;
                const u64 src = bytes != 0u ? p.a + 2ull * ((u64)source * p.a_stride + kk) : p.a;
                // Chunk c of row r where the 128-byte swizzle puts it: at c ^ (r mod 8).
                cmm_hopper_cp_async16(a + row * 128u + ((chunk ^ (row & 7u)) << 4), src, bytes);
            }
            if (reader_fence) {
                cmm_hopper_cp_async_arrive(full);
            } else {
                cmm_hopper_cp_async_commit();
                if (++issued > LAG) {
                    cmm_hopper_cp_async_wait<LAG>();
                    cmm_fence_proxy_async_shared();
                    cmm_mbar_arrive(bars + 8u * ((stage + S::STAGES - LAG) % S::STAGES));
                }
            }
            if (++stage == S::STAGES) {
                stage = 0u;
                phase ^= 1u;
            }
        }
    }
    if (!reader_fence) cmm_hopper_hand_over_held<S, LAG>(bars, stage, min(issued, LAG));
}

// Two adjacent elements j and j + 1 of the row of C at byte address `row`, as far as
// they are inside it.
__device__ __forceinline__ void cmm_hopper_store(const CmmHopperArgs& p, u64 row, u32 j, float v0, float v1) {
    if (j >= p.n) return;
    const bool both = j + 1u < p.n;
    const bool paired = both && (p.flags & CMM_HOPPER_PAIRS) != 0u;
    if (p.flags & CMM_HOPPER_ACCUMULATE) {
        float* out = (float*)row + j;
        if (paired) {
            u64 old = *(const u64*)out;
            float x = __uint_as_float((u32)old) + v0, y = __uint_as_float((u32)(old >> 32)) + v1;
            *(u64*)out = (u64)__float_as_uint(x) | ((u64)__float_as_uint(y) << 32);
        } else {
            out[0] += v0;
            if (both) out[1] += v1;
        }
        return;
    }
    if (paired) {
        if (p.c_dtype == 0u) {
            *(u64*)((float*)row + j) = (u64)__float_as_uint(v0) | ((u64)__float_as_uint(v1) << 32);
        } else {
            *(u32*)((u16*)row + j) = p.c_dtype == 1u ? cmm_pack_f16x2(v0, v1) : cmm_pack_bf16x2(v0, v1);
        }
        return;
    }
    cmm_store_bits(row, j, p.c_dtype, cmm_encode(v0, p.c_dtype));
    if (both) cmm_store_bits(row, j + 1u, p.c_dtype, cmm_encode(v1, p.c_dtype));
}

// Whether a tile's C leaves through the staging and TMA stores (TMA_STORE kernels): the
// blocks' C maps are encoded (the host does so only where C is not added onto and TMA's
// rules hold) and the tile is wholly inside its block's rows (a grouped run's map spans
// every segment, so no edge would clip a tile that crosses into the next one).
template <class S>
__device__ __forceinline__ bool cmm_hopper_staged(const CmmHopperArgs& p, const CmmHopperCursor& at, u32 m0) {
    if constexpr (!S::TMA_STORE) {
        return false;
    } else {
        return (p.flags & CMM_HOPPER_STORE_TMA) != 0u && (p.flags & CMM_HOPPER_ACCUMULATE) == 0u &&
               m0 + CMM_HOPPER_BM <= at.rows;
    }
}

// A consumer warpgroup's epilogue through its staging (TMA_STORE kernels): its 64 rows
// of the tile from `row0`, columns from `n0`, rounded once to C's dtype into the staging
// as the 128-byte swizzle lays a box out, then stored by TMA box by box (columns past N
// clipped), in passes of as many of the tile's columns as 32 KiB hold (f32: 128, 16-bit:
// 256). The
// stores complete while the warpgroup goes on to its next tile; the staging is written
// again only once they have read it. Accumulator 4j + 2h + e: row 16·warp + lane/4 + 8h,
// column 8j + 2·(lane%4) + e.
template <class S>
__device__ __forceinline__ void cmm_hopper_store_staged(const CmmHopperArgs& p, const CmmTensorMap* c_map, u32 smem,
                                                        const float* acc, u32 wg, u32 row0, u32 n0) {
    const u32 lane = threadIdx.x % 32u, warp = (threadIdx.x % 128u) / 32u;
    const bool issuer = threadIdx.x % 128u == 0u;
    const u32 staging = smem + S::STAGING + wg * CMM_HOPPER_STAGING_BYTES;
    const u32 size = p.c_dtype == 0u ? 4u : 2u;
    const u32 box_cols = 128u / size;
    const u32 pass_cols = min(CMM_HOPPER_STAGING_BYTES / (64u * size), S::BN);
    for (u32 c0 = 0u; c0 < S::BN; c0 += pass_cols) {
        if (issuer) cmm_bulk_wait_read();
        cmm_bar_sync(3u + wg, 128u);
        #pragma unroll
        for (u32 j = 0u; j < S::BN / 8u; ++j) {
            const u32 col = 8u * j + 2u * (lane % 4u);
            if (col < c0 || col >= c0 + pass_cols) continue;
            const u32 box = (col - c0) / box_cols, in_box = (col - c0) % box_cols;
            #pragma unroll
            for (u32 h = 0u; h < 2u; ++h) {
                const u32 row = 16u * warp + lane / 4u + 8u * h;
                // Chunk c of row r where the 128-byte swizzle puts it: at c ^ (r mod 8).
                const u32 to = staging + box * 64u * 128u + row * 128u + ((in_box * size) ^ ((row & 7u) << 4));
                const float v0 = acc[4u * j + 2u * h], v1 = acc[4u * j + 2u * h + 1u];
                if (size == 4u) {
                    cmm_hopper_stage_f32x2(to, v0, v1);
                } else {
                    cmm_hopper_stage_b32(to, p.c_dtype == 1u ? cmm_pack_f16x2(v0, v1) : cmm_pack_bf16x2(v0, v1));
                }
            }
        }
        // Written through the generic proxy, read by TMA through the async one.
        cmm_fence_proxy_async_shared();
        cmm_bar_sync(3u + wg, 128u);
        if (issuer) {
            for (u32 b = 0u; b < pass_cols / box_cols; ++b) {
                const u32 x = n0 + c0 + b * box_cols;
                if (x < p.n) cmm_tma_store_2d(c_map, staging + b * 64u * 128u, x, row0);
            }
            cmm_bulk_commit();
        }
    }
}

// A consumer warpgroup (`wg` 0 or 1: rows 64·wg .. +63 of each tile; PINGPONG: every row
// of the CTA's tiles wg, wg + 2, …).
template <class S, bool BF16, int TRANS_B>
__device__ void cmm_hopper_consume(const CmmHopperArgs& p, const CmmHopperBlock* table, u32 smem, u64 limit_ns,
                                   u32 wg) {
    const u32 bars = smem + S::BARRIERS;
    const u32 ktiles = (p.k + CMM_HOPPER_BK - 1u) / CMM_HOPPER_BK;
    const bool leader = threadIdx.x % 128u == 0u;
    const u32 lane = threadIdx.x % 32u, warp = (threadIdx.x % 128u) / 32u;
    constexpr u32 ACC = S::BN / 2u;  // accumulators of a thread per m64 block of rows
    float acc[S::HALVES * ACC];
    #pragma unroll
    for (u32 i = 0u; i < S::HALVES * ACC; ++i) acc[i] = 0.0f;
    const bool reader_fence = (p.flags & (CMM_HOPPER_GATHER | CMM_HOPPER_READER_FENCE)) ==
                              (CMM_HOPPER_GATHER | CMM_HOPPER_READER_FENCE);
    u32 stage = 0u, phase = 0u, m0, n0;
    CmmHopperCursor at = cmm_hopper_start(p, table);
    // A stage goes back to this CTA's producer and, in a cluster, to its peer's, which
    // multicasts into it too.
    const auto give_back = [&](u32 empty) {
        cmm_mbar_arrive(empty);
        if constexpr (S::CLUSTER == 2u) cmm_mbar_arrive_cluster(empty, cmm_cluster_ctarank() ^ 1u);
    };
    // PINGPONG: each warpgroup's turn barrier, which the other's threads arrive on once
    // they have waited for every stage of their tile.
    const u32 turns = bars + 16u * S::STAGES;
    u32 index = 0u;  // of the tile among the CTA's
    for (u32 t = cmm_hopper_first<S>(); cmm_hopper_next<S>(p, table, t, at, m0, n0);
         t += cmm_hopper_step<S>(), ++index) {
        u32 previous = 0u;
        // The zero block's tiles: no K step, zeros stored.
        const u32 steps = cmm_hopper_zero_block(p, at) ? 0u : ktiles;
        if constexpr (S::PINGPONG) {
            if (index % 2u != wg) {
                // The other warpgroup's tile: its stages pass this one by, so that one
                // warpgroup's epilogue runs while the other's wgmma keeps the tensor cores.
                stage += steps;
                phase ^= (stage / S::STAGES) & 1u;
                stage %= S::STAGES;
                continue;
            }
            // A parity wait tells two phases apart, no more: this warpgroup waits for its
            // tile's stages only once the other has waited for every stage of the tile
            // before, so that each stage's previous phase has completed and the phase
            // waited for is the next one (the turns alternate: turn j of a warpgroup is
            // phase j of its barrier, its tile 2j + wg).
            if (index > 0u) cmm_mbar_wait(turns + 8u * wg, ((index - 1u) / 2u) & 1u, limit_ns);
        }
        if (steps == 0u) {
            #pragma unroll
            for (u32 i = 0u; i < S::HALVES * ACC; ++i) acc[i] = 0.0f;
        }
        for (u32 kt = 0u; kt < steps; ++kt) {
            cmm_mbar_wait(bars + 8u * stage, phase, limit_ns);
            // Gathered rows came through cp.async, the generic proxy; wgmma reads through
            // the async one (the producer threads fence, unless the reader-fence variant).
            if (reader_fence) cmm_fence_proxy_async_shared();
            const u32 sa = smem + stage * CMM_HOPPER_A_BYTES + (S::PINGPONG ? 0u : wg * 64u * 128u);
            const u32 sb = smem + S::STAGES * CMM_HOPPER_A_BYTES + stage * S::B_BYTES;
            #pragma unroll
            for (u32 i = 0u; i < S::HALVES * ACC; ++i) cmm_pin(acc[i]);
            cmm_wgmma_fence();
            #pragma unroll
            for (u32 kk = 0u; kk < CMM_HOPPER_BK / 16u; ++kk) {
                // K-major: the next 16 elements of a 128-byte row; N-major: 16 rows further.
                const u64 db = p.desc_b | cmm_desc_addr(TRANS_B ? sb + 2048u * kk : sb + 32u * kk);
                const u32 accumulate = (kt | kk) != 0u;
                #pragma unroll
                for (u32 h = 0u; h < S::HALVES; ++h) {
                    const u64 da = p.desc_a | cmm_desc_addr(sa + h * 64u * 128u + 32u * kk);
                    if constexpr (S::BN == 256u) {
                        cmm_wgmma_n256<BF16, TRANS_B>(acc + h * ACC, da, db, accumulate);
                    } else {
                        cmm_wgmma_n128<BF16, TRANS_B>(acc + h * ACC, da, db, accumulate);
                    }
                }
            }
            cmm_wgmma_commit();
            // The group before this one has finished reading its stage: give it back.
            cmm_wgmma_wait<1>();
            if (kt > 0u && leader) give_back(bars + 8u * (S::STAGES + previous));
            previous = stage;
            if (++stage == S::STAGES) {
                stage = 0u;
                phase ^= 1u;
            }
        }
        // The other warpgroup's turn: this one's epilogue runs beside its multiplies.
        if constexpr (S::PINGPONG) cmm_mbar_arrive(turns + 8u * (wg ^ 1u));
        cmm_wgmma_wait<0>();
        #pragma unroll
        for (u32 i = 0u; i < S::HALVES * ACC; ++i) cmm_pin(acc[i]);
        if (leader && steps > 0u) give_back(bars + 8u * (S::STAGES + previous));
        const u32 block = at.block;
        const CmmHopperBlock& blk = table[cmm_hopper_entry(p, at)];
        const bool staged = cmm_hopper_staged<S>(p, at, m0);
        if (staged) {
            cmm_hopper_store_staged<S>(p, &blk.c_map, smem, acc, wg, at.row0 + m0 + 64u * wg, n0);
            // A fused run releases what it has stored: the stores must have completed, and
            // their writes (the async proxy's) be ordered before the generic release.
            if (p.control != 0ull && threadIdx.x % 128u == 0u) {
                cmm_bulk_wait();
                cmm_fence_proxy_async_global();
            }
        }
        if (!staged) {
            // Accumulator 4j + 2h + e: row 16·warp + lane/4 + 8h, column 8j + 2·(lane%4) + e.
            const u32 rows_end = at.row0 + at.rows, c0 = n0 + 2u * (lane % 4u);
            const u64 row_bytes = blk.c_stride * (p.c_dtype == 0u ? 4ull : 2ull);
            #pragma unroll
            for (u32 half = 0u; half < S::HALVES; ++half) {
                const u32 r0 = at.row0 + m0 + 64u * (S::PINGPONG ? half : wg) + 16u * warp + lane / 4u;
                const float* d = acc + half * ACC;
                #pragma unroll
                for (u32 h = 0u; h < 2u; ++h) {
                    const u32 i = r0 + 8u * h;
                    u64 row = blk.c + (u64)i * row_bytes;
                    cmm_address_here(row);
                    if (i < rows_end) {
                        #pragma unroll
                        for (u32 j = 0u; j < S::BN / 8u; ++j) {
                            cmm_hopper_store(p, row, c0 + 8u * j, d[4u * j + 2u * h], d[4u * j + 2u * h + 1u]);
                        }
                    }
                }
            }
        }
        if (p.control != 0ull) {
            // Every consumer's stores of the tile are done: one thread counts the tile,
            // and the thread that counts a block's last tile releases the block once the
            // blocks before it are released (its release covers the stores of the tile's
            // warpgroups: the barrier, then a system-scope fence and release; TMA stores
            // completed before the barrier, by their issuers' wait). PINGPONG: the tile is
            // this warpgroup's alone, and so is its barrier.
            if constexpr (S::PINGPONG) {
                cmm_bar_sync(1u + wg, 128u);
            } else {
                cmm_bar_sync(1u, 256u);
            }
            if (threadIdx.x == (S::PINGPONG ? 128u * (1u + wg) : 128u)) {
                u32* control = (u32*)p.control;
                const CmmHopperSync* signals = (const CmmHopperSync*)p.signals;
                const u32 end = block + 1u < p.count ? table[block + 1u].first_tile : p.tiles;
                cmm_fence_acq_rel_sys();
                if (atomicAdd(&control[3u + block], 1u) + 1u == end - blk.first_tile) {
                    if (cmm_spin_at_least((u64)&control[1], block, p.abort, p.timeout_ns, 0ull) &&
                        cmm_load_relaxed((u64)&control[2]) == 0u) {
                        cmm_fence_acq_rel_sys();
                        for (u32 s = blk.signals_begin; s < blk.signals_end; ++s) {
                            cmm_red_release_add(signals[s].sem, signals[s].value);
                        }
                        cmm_store_release_gpu((u64)&control[1], block + 1u);
                    } else {
                        atomicExch(&control[2], 1u);
                    }
                }
            }
        }
    }
    // The staging stays the CTA's until the stores from it have completed.
    if constexpr (S::TMA_STORE) {
        if (threadIdx.x % 128u == 0u) cmm_bulk_wait();
    }
}

template <class S, bool BF16>
__device__ void cmm_hopper_gemm(const CmmHopperArgs& p) {
#if defined(CMM_HOST) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
    const u32 smem = (cmm_dynamic_smem() + 1023u) & ~1023u;
    const u32 bars = smem + S::BARRIERS;
    const CmmHopperBlock* table = p.blocks != 0ull ? (const CmmHopperBlock*)p.blocks : &p.first;
    // No barrier wait outlasts the producer's fused waits by much: past this, a bug.
    const u64 limit_ns = 2ull * p.timeout_ns + 1000000000ull;
    if (threadIdx.x == 0u) {
        for (u32 s = 0u; s < S::STAGES; ++s) {
            // The producer's arrive (and its bytes), and with gathered rows one arrival
            // per producer thread.
            cmm_mbar_init(bars + 8u * s, (p.flags & CMM_HOPPER_GATHER) ? 1u + 128u : 1u);
            // One arrive per consumer warpgroup of each CTA of the cluster (PINGPONG: a
            // stage has one consumer, the warpgroup whose tile it holds).
            cmm_mbar_init(bars + 8u * (S::STAGES + s), S::PINGPONG ? 1u : 2u * S::CLUSTER);
        }
        // PINGPONG: each warpgroup's turn, given by the other's 128 threads.
        if constexpr (S::PINGPONG) {
            cmm_mbar_init(bars + 16u * S::STAGES, 128u);
            cmm_mbar_init(bars + 16u * S::STAGES + 8u, 128u);
        }
        cmm_mbar_init_fence();
    }
    __syncthreads();
    // The peer's copies and arrives reach these barriers only once they are initialised.
    if constexpr (S::CLUSTER == 2u) cmm_cluster_sync();
    // The warpgroup's index, broadcast from lane 0 so that the compiler knows it is the
    // same across the warp (wgmma in a branch it cannot prove uniform is serialised).
    const u32 role = __shfl_sync(0xffffffffu, threadIdx.x / 128u, 0);
    if (role == 0u) {
        // A cluster's producer keeps its rank and the multicast loop's state besides.
        cmm_setmaxnreg_dec<S::CLUSTER == 1u ? 40u : 56u>();
        if (p.flags & CMM_HOPPER_GATHER) {
            cmm_hopper_produce_gathered<S>(p, table, smem, limit_ns, threadIdx.x);
        } else if (threadIdx.x == 0u) {
            cmm_hopper_produce<S>(p, table, smem, limit_ns);
        }
    } else {
        cmm_setmaxnreg_inc<S::CLUSTER == 1u ? 232u : 224u>();
        const u32 wg = role - 1u;
        if (p.flags & CMM_HOPPER_B_N_MAJOR) {
            cmm_hopper_consume<S, BF16, 1>(p, table, smem, limit_ns, wg);
        } else {
            cmm_hopper_consume<S, BF16, 0>(p, table, smem, limit_ns, wg);
        }
    }
    // No CTA leaves while its peer may still copy into its shared memory or arrive on its
    // barriers.
    if constexpr (S::CLUSTER == 2u) cmm_cluster_sync();
#else
    cmm_trap();
#endif
}

// 128×256 tiles, four stages (192 KiB); 128×128 tiles, six stages (192 KiB).
using CmmHopperWide = CmmHopperShape<256, 4>;
using CmmHopperNarrow = CmmHopperShape<128, 6>;
// Shallower pipelines, run only by the GEMM sweep (`cargo xtask gemm-sweep`): whether the
// stages' depth limits the engine. 128×256 with three stages (144 KiB), 128×128 with four
// (128 KiB).
using CmmHopperWideShallow = CmmHopperShape<256, 3>;
using CmmHopperNarrowShallow = CmmHopperShape<128, 4>;
// Clusters of two with B multicast, also only for the sweep: whether B's traffic from L2
// limits the engine.
using CmmHopperWidePair = CmmHopperShape<256, 4, 2>;
using CmmHopperNarrowPair = CmmHopperShape<128, 6, 2>;
// The two consumer warpgroups on alternate 128×128 tiles, each multiplying a whole tile
// (two m64n128 blocks of rows), also only for the sweep: whether an epilogue that stalls
// the tensor cores (short K, f32 C) limits the engine.
using CmmHopperNarrowPingPong = CmmHopperShape<128, 6, 1, true>;
// Each tile's C staged in shared memory and stored by TMA while the next tile's multiplies
// go on, also only for the sweep: whether an epilogue from registers, with the tensor
// cores idle, limits the engine where C is large against K (f32 rows, short K). The
// staging (64 KiB) takes a stage of 128×256 (3 stages) and one of 128×128 (5).
using CmmHopperWideStore = CmmHopperShape<256, 3, 1, false, true>;
using CmmHopperNarrowStore = CmmHopperShape<128, 5, 1, false, true>;

// One entry point per (shape, input dtype). Mirror: `Kernel::Hopper` in cuda/src/launch.rs.
#define CMM_HOPPER_ENTRY(name, shape, bf16)                                        \
    extern "C" __global__ void __launch_bounds__(CMM_HOPPER_THREADS, 1)            \
        name(const __grid_constant__ CmmHopperArgs p) {                            \
        cmm_hopper_gemm<shape, bf16>(p);                                           \
    }

CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n256, CmmHopperWide, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n256, CmmHopperWide, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n128, CmmHopperNarrow, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n128, CmmHopperNarrow, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n256_s3, CmmHopperWideShallow, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n256_s3, CmmHopperWideShallow, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n128_s4, CmmHopperNarrowShallow, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n128_s4, CmmHopperNarrowShallow, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n256_c2, CmmHopperWidePair, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n256_c2, CmmHopperWidePair, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n128_c2, CmmHopperNarrowPair, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n128_c2, CmmHopperNarrowPair, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n128_pp, CmmHopperNarrowPingPong, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n128_pp, CmmHopperNarrowPingPong, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n256_ts, CmmHopperWideStore, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n256_ts, CmmHopperWideStore, true)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_f16_n128_ts, CmmHopperNarrowStore, false)
CMM_HOPPER_ENTRY(cmm_hopper_gemm_bf16_n128_ts, CmmHopperNarrowStore, true)
