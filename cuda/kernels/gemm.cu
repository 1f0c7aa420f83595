// Tile GEMMs: C (+)= op(A)·op(B) with f32 accumulation, rounded once to C's dtype.
// Twin of shaders/gemm.wgsl and the `Op::Gemm` arm of cmm-core cpu/mod.rs.
//
// - cmm_gemm_mma_f16 / cmm_gemm_mma_bf16: tensor cores (mma.sync m16n8k16, f32
//   accumulate) for f16 or bf16 A and B. 128 threads = 4 warps in 2×2, a 64×64 block
//   tile. Where A and B are untransposed and 16-byte aligned (rows too) and K is a
//   multiple of 8, the tile is pipelined: K in steps of 32, three stages of cp.async
//   16-byte copies in flight, fragments by ldmatrix (cmm_gemm_mma_async). Otherwise K
//   goes in steps of 16 staged element by element (any strides, transposes, edges).
// - cmm_gemm_mma_wide_f16 / cmm_gemm_mma_wide_bf16: the same pipeline on a 128×128 block
//   tile, 256 threads = 8 warps in 2×4 (a 64×32 share each), K in steps of 16, four
//   stages: twice the arithmetic per byte staged, and twice the warps per SM for the
//   persistent kernel, which runs one CTA per SM by default. Where the pipeline does not
//   apply, each thread computes its elements straight from global memory (correct, slow;
//   lowering picks these kernels only on request: `CudaRunOptions::wide_tiles`).
// - cmm_gemm_simt: any dtypes (f32 included), 256 threads, 64×64 tile, 4×4 per thread.

struct CmmGemmArgs {
    u64 a;        // byte address of op(A)'s storage element (0, 0)
    u64 b;
    u64 c;
    u64 a_stride; // row stride of the stored matrix, in elements
    u64 b_stride;
    u64 c_stride;
    u32 m;
    u32 n;
    u32 k;
    u32 a_dtype;
    u32 b_dtype;
    u32 c_dtype;
    u32 flags;    // 1: transpose A, 2: transpose B, 4: accumulate into C (f32)
    u32 pad;
};

__device__ __forceinline__ u64 cmm_a_index(const CmmGemmArgs& g, u32 i, u32 p) {
    return (g.flags & 1u) ? (u64)p * g.a_stride + i : (u64)i * g.a_stride + p;
}

__device__ __forceinline__ u64 cmm_b_index(const CmmGemmArgs& g, u32 p, u32 j) {
    return (g.flags & 2u) ? (u64)j * g.b_stride + p : (u64)p * g.b_stride + j;
}

__device__ __forceinline__ float cmm_c_initial(const CmmGemmArgs& g, u32 i, u32 j) {
    if ((g.flags & 4u) == 0u || i >= g.m || j >= g.n) return 0.0f;
    return ((const float*)g.c)[(u64)i * g.c_stride + j];
}

__device__ __forceinline__ void cmm_c_store(const CmmGemmArgs& g, u32 i, u32 j, float v) {
    if (i < g.m && j < g.n) cmm_store_bits(g.c, (u64)i * g.c_stride + j, g.c_dtype, cmm_encode(v, g.c_dtype));
}

#define CMM_TILE 64
#define CMM_KSTEP 16
#define CMM_APAD 8
#define CMM_BPAD 8

// d += a·b for one warp's m16n8k16 fragments (the host twin has its own: CMM_HOST).
#ifndef CMM_HOST
template <bool BF16>
__device__ __forceinline__ void cmm_mma16816(float* d, const u32* a, const u32* b) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}
#endif

// A warp's share of a block tile as mma m16n8k16 accumulators: MI×4 blocks of 16×8,
// 16·MI rows by 32 columns, with the block's warps WARPS_N across.
// acc[mi][ni][e] is row wm + 16 mi + gid (+8 for e >= 2), col wn + 8 ni + 2 tig (+1 for odd e),
// where warp w sits at wm = (w / WARPS_N)·16·MI, wn = (w % WARPS_N)·32, gid = lane / 4,
// tig = lane % 4. The 64×64 tile: MI = 2, 2×2 warps; the 128×128 one: MI = 4, 2×4 warps.
template <int MI, u32 WARPS_N>
struct CmmWarpTile {
    u32 row0, col0;  // of the tile
    u32 wm, wn, gid, tig;
    float acc[MI][4][4];
};

// Calls f(mi, ni, e, row, col) for each accumulator of the warp and its place in C.
template <int MI, u32 WARPS_N, class F>
__device__ __forceinline__ void cmm_warp_tile_each(const CmmWarpTile<MI, WARPS_N>& w, F f) {
    #pragma unroll
    for (int mi = 0; mi < MI; ++mi)
        #pragma unroll
        for (int ni = 0; ni < 4; ++ni)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                f(mi, ni, e, w.row0 + w.wm + 16 * mi + w.gid + (e >= 2 ? 8 : 0),
                  w.col0 + w.wn + 8 * ni + 2 * w.tig + (e & 1));
            }
}

template <int MI, u32 WARPS_N>
__device__ __forceinline__ void cmm_warp_tile_start(CmmWarpTile<MI, WARPS_N>& w, const CmmGemmArgs& g, u32 row0,
                                                    u32 col0) {
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    w.row0 = row0;
    w.col0 = col0;
    w.gid = lane / 4;
    w.tig = lane % 4;
    w.wm = (warp / WARPS_N) * 16 * MI;
    w.wn = (warp % WARPS_N) * 32;
    cmm_warp_tile_each(w, [&](int mi, int ni, int e, u32 i, u32 j) { w.acc[mi][ni][e] = cmm_c_initial(g, i, j); });
}

template <int MI, u32 WARPS_N>
__device__ __forceinline__ void cmm_warp_tile_store(const CmmWarpTile<MI, WARPS_N>& w, const CmmGemmArgs& g) {
    cmm_warp_tile_each(w, [&](int mi, int ni, int e, u32 i, u32 j) { cmm_c_store(g, i, j, w.acc[mi][ni][e]); });
}

// One 64×64 output tile at (row0, col0), 128 threads, any strides and transposes.
template <bool BF16>
__device__ void cmm_gemm_mma_staged(const CmmGemmArgs& g, u32 row0, u32 col0) {
    CMM_SHARED(u16, As, [CMM_TILE][CMM_KSTEP + CMM_APAD]);
    CMM_SHARED(u16, Bs, [CMM_KSTEP][CMM_TILE + CMM_BPAD]);
    const u32 tid = threadIdx.x;
    CmmWarpTile<2, 2> w;
    cmm_warp_tile_start(w, g, row0, col0);
    const u32 gid = w.gid, tig = w.tig, wm = w.wm, wn = w.wn;

    for (u32 k0 = 0; k0 < g.k; k0 += CMM_KSTEP) {
        #pragma unroll
        for (u32 e = 0; e < 8; ++e) {
            u32 idx = tid + 128 * e; // 0..1023
            u32 r = idx / CMM_KSTEP, q = idx % CMM_KSTEP;
            u32 i = row0 + r, p = k0 + q;
            As[r][q] = (i < g.m && p < g.k) ? (u16)cmm_load_bits(g.a, cmm_a_index(g, i, p), g.a_dtype) : (u16)0;
            u32 bq = idx / CMM_TILE, bc = idx % CMM_TILE;
            u32 bp = k0 + bq, j = col0 + bc;
            Bs[bq][bc] = (bp < g.k && j < g.n) ? (u16)cmm_load_bits(g.b, cmm_b_index(g, bp, j), g.b_dtype) : (u16)0;
        }
        __syncthreads();
        u32 afrag[2][4];
        #pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
            u32 r = wm + 16 * mi + gid;
            afrag[mi][0] = (u32)As[r][2 * tig] | ((u32)As[r][2 * tig + 1] << 16);
            afrag[mi][1] = (u32)As[r + 8][2 * tig] | ((u32)As[r + 8][2 * tig + 1] << 16);
            afrag[mi][2] = (u32)As[r][2 * tig + 8] | ((u32)As[r][2 * tig + 9] << 16);
            afrag[mi][3] = (u32)As[r + 8][2 * tig + 8] | ((u32)As[r + 8][2 * tig + 9] << 16);
        }
        #pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            u32 c = wn + 8 * ni + gid;
            u32 bfrag[2];
            bfrag[0] = (u32)Bs[2 * tig][c] | ((u32)Bs[2 * tig + 1][c] << 16);
            bfrag[1] = (u32)Bs[2 * tig + 8][c] | ((u32)Bs[2 * tig + 9][c] << 16);
            #pragma unroll
            for (int mi = 0; mi < 2; ++mi) cmm_mma16816<BF16>(w.acc[mi][ni], afrag[mi], bfrag);
        }
        __syncthreads();
    }
    cmm_warp_tile_store(w, g);
}

// ---- The pipelined tiles ----

// A pipelined tile's shape: a TILE×TILE output tile of THREADS threads (warps of
// CmmWarpTile<MI, WARPS_N>), K in steps of KSTEP with STAGES stages of cp.async copies.
// Row pitches in halves, padded by 16 bytes: the 8 rows one ldmatrix reads start in 8
// different 16-byte bank groups (an odd number of groups apart), and every row stays
// 16-byte aligned.
template <u32 TILE_, u32 KSTEP_, u32 STAGES_, u32 THREADS_, int MI_, u32 WARPS_N_>
struct CmmTileShape {
    static constexpr u32 TILE = TILE_, KSTEP = KSTEP_, STAGES = STAGES_, THREADS = THREADS_, WARPS_N = WARPS_N_;
    static constexpr int MI = MI_;
    static constexpr u32 ALD = KSTEP + 8, BLD = TILE + 8;
    // 16-byte chunks of A's TILE×KSTEP and of B's KSTEP×TILE stage, per thread.
    static constexpr u32 CHUNKS = TILE * KSTEP / 8 / THREADS;
    static_assert(TILE * KSTEP / 8 == CHUNKS * THREADS, "every thread copies as many chunks");
    static_assert(TILE == 16 * MI * (THREADS / 32 / WARPS_N) && TILE == 32 * WARPS_N, "the warps cover the tile");
    static_assert(KSTEP % 16 == 0 && STAGES >= 2, "whole mma K steps, and a stage in flight");
};
// 64×64, 4 warps, K steps of 32, three stages: 29 KiB of shared memory.
using CmmTileNarrow = CmmTileShape<64, 32, 3, 128, 2, 2>;
// 128×128, 8 warps, K steps of 16, four stages: 41 KiB.
using CmmTileWide = CmmTileShape<128, 16, 4, 256, 4, 4>;

// Whether the pipelined tile applies (to the f16/bf16 kernels: A and B are 16-bit):
// untransposed A and B whose base addresses and row strides are 16-byte aligned, with K
// a multiple of 8, so that every 16-byte chunk along K is wholly inside or wholly outside
// (one straddling K would multiply A's elements past K, possibly NaN poison, by B's
// zero-filled rows). A chunk straddling N reads B's row up to the next multiple of 8,
// which alignment keeps inside the row's stride; those columns only reach C's columns
// past N, which are never stored.
__device__ __forceinline__ bool cmm_gemm_async_ok(const CmmGemmArgs& g) {
    return (g.flags & 3u) == 0u && (g.a % 16ull) == 0ull && (g.b % 16ull) == 0ull && (g.a_stride % 8ull) == 0ull &&
           (g.b_stride % 8ull) == 0ull && (g.k % 8u) == 0u;
}

#ifndef CMM_HOST
// Copies 16 bytes from global `src` to shared `dst` asynchronously; with src_bytes = 0
// it writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cmm_cp_async16(void* dst, u64 src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(cmm_smem_addr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cmm_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cmm_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8×8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void cmm_ldmatrix_x4(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(cmm_smem_addr(row)));
}

__device__ __forceinline__ void cmm_ldmatrix_x4_trans(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(cmm_smem_addr(row)));
}
#endif

// Starts the copies of K step `k0` into stage buffers As/Bs: S::CHUNKS 16-byte chunks of
// A's and of B's stage per thread; chunks outside the matrices are zero-filled.
template <class S>
__device__ __forceinline__ void cmm_async_load(const CmmGemmArgs& g, u32 row0, u32 col0, u32 k0, u16 (*As)[S::ALD],
                                               u16 (*Bs)[S::BLD]) {
    #pragma unroll
    for (u32 e = 0; e < S::CHUNKS; ++e) {
        const u32 c = threadIdx.x + S::THREADS * e;
        const u32 r = c / (S::KSTEP / 8u), kc = (c % (S::KSTEP / 8u)) * 8u;
        const bool a_in = row0 + r < g.m && k0 + kc < g.k;
        const u64 a_src = a_in ? g.a + 2ull * ((u64)(row0 + r) * g.a_stride + k0 + kc) : g.a;
        cmm_cp_async16(&As[r][kc], a_src, a_in ? 16u : 0u);
        const u32 kr = c / (S::TILE / 8u), nc = (c % (S::TILE / 8u)) * 8u;
        const bool b_in = k0 + kr < g.k && col0 + nc < g.n;
        const u64 b_src = b_in ? g.b + 2ull * ((u64)(k0 + kr) * g.b_stride + col0 + nc) : g.b;
        cmm_cp_async16(&Bs[kr][nc], b_src, b_in ? 16u : 0u);
    }
}

// One S::TILE-square output tile at (row0, col0), S::THREADS threads, when
// cmm_gemm_async_ok(g): while the warps multiply K step i, the copies of steps i+1 ..
// i+STAGES-1 are in flight.
template <bool BF16, class S>
__device__ void cmm_gemm_mma_async(const CmmGemmArgs& g, u32 row0, u32 col0) {
    __shared__ __align__(16) u16 As[S::STAGES][S::TILE][S::ALD];
    __shared__ __align__(16) u16 Bs[S::STAGES][S::KSTEP][S::BLD];
    CmmWarpTile<S::MI, S::WARPS_N> w;
    cmm_warp_tile_start(w, g, row0, col0);
    const u32 lane = threadIdx.x % 32;
    const u32 steps = (g.k + S::KSTEP - 1) / S::KSTEP;
    // Every thread commits one group per stage, empty or not, so that "all but the
    // newest STAGES - 2 groups" is always the step about to be multiplied.
    #pragma unroll
    for (u32 s = 0; s + 1 < S::STAGES; ++s) {
        if (s < steps) cmm_async_load<S>(g, row0, col0, s * S::KSTEP, As[s], Bs[s]);
        cmm_cp_async_commit();
    }
    for (u32 step = 0; step < steps; ++step) {
        cmm_cp_async_wait<S::STAGES - 2>();
        // Step `step` has landed for every thread, and every warp is done with the stage
        // the next copies overwrite (the one multiplied in the previous step).
        __syncthreads();
        const u32 next = step + S::STAGES - 1;
        if (next < steps) {
            cmm_async_load<S>(g, row0, col0, next * S::KSTEP, As[next % S::STAGES], Bs[next % S::STAGES]);
        }
        cmm_cp_async_commit();
        const u32 st = step % S::STAGES;
        #pragma unroll
        for (u32 kk = 0; kk < S::KSTEP; kk += 16) {
            // A: matrices (rows 0-7 | 8-15) × (k 0-7 | 8-15) of each 16×16 block give the
            // fragment registers 0..3 in mma's order.
            u32 afrag[S::MI][4];
            #pragma unroll
            for (int mi = 0; mi < S::MI; ++mi) {
                cmm_ldmatrix_x4(afrag[mi], &As[st][w.wm + 16 * mi + lane % 16][kk + (lane / 16) * 8]);
            }
            // B, transposed on load: matrix i holds k rows kk + 8·(i % 2) .. +7 of columns
            // wn + 16 nj + 8·(i / 2) .. +7, i.e. registers 0 and 1 of two 8-column blocks.
            u32 bfrag[4][2];
            #pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                u32 r[4];
                const u32 i = lane / 8;
                cmm_ldmatrix_x4_trans(r, &Bs[st][kk + (i % 2) * 8 + lane % 8][w.wn + 16 * nj + (i / 2) * 8]);
                bfrag[2 * nj][0] = r[0];
                bfrag[2 * nj][1] = r[1];
                bfrag[2 * nj + 1][0] = r[2];
                bfrag[2 * nj + 1][1] = r[3];
            }
            #pragma unroll
            for (int ni = 0; ni < 4; ++ni)
                #pragma unroll
                for (int mi = 0; mi < S::MI; ++mi) cmm_mma16816<BF16>(w.acc[mi][ni], afrag[mi], bfrag[ni]);
        }
    }
    // No copy may still land, and no warp may still read, when the next tile (of a
    // persistent kernel) fills the buffers again.
    cmm_cp_async_wait<0>();
    __syncthreads();
    cmm_warp_tile_store(w, g);
}

// One 64×64 output tile at (row0, col0), 128 threads: pipelined where it applies.
template <bool BF16>
__device__ void cmm_gemm_mma(const CmmGemmArgs& g, u32 row0, u32 col0) {
    if (cmm_gemm_async_ok(g)) {
        cmm_gemm_mma_async<BF16, CmmTileNarrow>(g, row0, col0);
    } else {
        cmm_gemm_mma_staged<BF16>(g, row0, col0);
    }
}

extern "C" __global__ void __launch_bounds__(128) cmm_gemm_mma_f16(const CmmGemmArgs g) {
    cmm_gemm_mma<false>(g, blockIdx.y * CMM_TILE, blockIdx.x * CMM_TILE);
}

extern "C" __global__ void __launch_bounds__(128) cmm_gemm_mma_bf16(const CmmGemmArgs g) {
    cmm_gemm_mma<true>(g, blockIdx.y * CMM_TILE, blockIdx.x * CMM_TILE);
}

// Each thread's elements of an S::TILE-square tile straight from global memory, in
// increasing k: any strides, transposes and edges, no shared memory. The wide kernels'
// path where the pipeline does not apply (lowering does not look at alignment).
template <class S>
__device__ void cmm_gemm_direct(const CmmGemmArgs& g, u32 row0, u32 col0) {
    for (u32 e = threadIdx.x; e < S::TILE * S::TILE; e += S::THREADS) {
        const u32 i = row0 + e / S::TILE, j = col0 + e % S::TILE;
        if (i >= g.m || j >= g.n) continue;
        float acc = cmm_c_initial(g, i, j);
        for (u32 p = 0; p < g.k; ++p) {
            acc += cmm_load(g.a, cmm_a_index(g, i, p), g.a_dtype) * cmm_load(g.b, cmm_b_index(g, p, j), g.b_dtype);
        }
        cmm_c_store(g, i, j, acc);
    }
}

// One 128×128 output tile at (row0, col0), 256 threads: pipelined where it applies.
template <bool BF16>
__device__ void cmm_gemm_mma_wide(const CmmGemmArgs& g, u32 row0, u32 col0) {
    if (cmm_gemm_async_ok(g)) {
        cmm_gemm_mma_async<BF16, CmmTileWide>(g, row0, col0);
    } else {
        cmm_gemm_direct<CmmTileWide>(g, row0, col0);
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) cmm_gemm_mma_wide_f16(const CmmGemmArgs g) {
    cmm_gemm_mma_wide<false>(g, blockIdx.y * CmmTileWide::TILE, blockIdx.x * CmmTileWide::TILE);
}

extern "C" __global__ void __launch_bounds__(256, 2) cmm_gemm_mma_wide_bf16(const CmmGemmArgs g) {
    cmm_gemm_mma_wide<true>(g, blockIdx.y * CmmTileWide::TILE, blockIdx.x * CmmTileWide::TILE);
}

// One 64×64 output tile at (row0, col0), 256 threads, any dtypes.
__device__ void cmm_gemm_simt_tile(const CmmGemmArgs& g, u32 row0, u32 col0) {
    CMM_SHARED(float, As, [CMM_KSTEP][CMM_TILE]);
    CMM_SHARED(float, Bs, [CMM_KSTEP][CMM_TILE]);
    const u32 tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
    #pragma unroll
    for (int r = 0; r < 4; ++r)
        #pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = cmm_c_initial(g, row0 + ty * 4 + r, col0 + tx * 4 + c);
    for (u32 k0 = 0; k0 < g.k; k0 += CMM_KSTEP) {
        #pragma unroll
        for (u32 e = 0; e < 4; ++e) {
            u32 idx = threadIdx.x + 256 * e; // 0..1023
            u32 q = idx % CMM_KSTEP, r = idx / CMM_KSTEP;
            u32 i = row0 + r, p = k0 + q;
            As[q][r] = (i < g.m && p < g.k) ? cmm_load(g.a, cmm_a_index(g, i, p), g.a_dtype) : 0.0f;
            u32 bq = idx / CMM_TILE, bc = idx % CMM_TILE;
            u32 bp = k0 + bq, j = col0 + bc;
            Bs[bq][bc] = (bp < g.k && j < g.n) ? cmm_load(g.b, cmm_b_index(g, bp, j), g.b_dtype) : 0.0f;
        }
        __syncthreads();
        #pragma unroll
        for (int s = 0; s < CMM_KSTEP; ++s) {
            float a[4], b[4];
            #pragma unroll
            for (int r = 0; r < 4; ++r) a[r] = As[s][ty * 4 + r];
            #pragma unroll
            for (int c = 0; c < 4; ++c) b[c] = Bs[s][tx * 4 + c];
            #pragma unroll
            for (int r = 0; r < 4; ++r)
                #pragma unroll
                for (int c = 0; c < 4; ++c) acc[r][c] += a[r] * b[c];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 4; ++r)
        #pragma unroll
        for (int c = 0; c < 4; ++c) cmm_c_store(g, row0 + ty * 4 + r, col0 + tx * 4 + c, acc[r][c]);
}

extern "C" __global__ void __launch_bounds__(256) cmm_gemm_simt(const CmmGemmArgs g) {
    cmm_gemm_simt_tile(g, blockIdx.y * CMM_TILE, blockIdx.x * CMM_TILE);
}

// ---- The tile-granular GEMM (a fused run of the plan: `FusedRun` in cmm-core plan.rs) ----
//
// One persistent kernel over the output tiles (64×64, or 128×128 for the wide kernels) of
// every block, block after block.
// Its CTAs take tiles in order from a counter (a tile scheduler), so every tile of block i
// is taken before any tile of block i+1. Before its first tile of block i a CTA checks
// every wait of the run up to block i (acquire, with the deadline and abort word of
// cmm_wait). When the last tile of block i is written, the CTA that wrote it performs the
// block's signals (release), but only after block i−1's: the signals happen in block
// order, each covering every block before it, which is what the plan's lane says. The
// host launches one CTA per SM it gives the kernel (more only where every SM holds one
// more: `CudaRunOptions::fused_ctas_per_sm`), so all of them are resident; a CTA waits
// only for work enqueued before the kernel or released by earlier blocks.

struct CmmFusedBlock {
    u64 a;              // byte address of the block's op(A) storage element (0, 0)
    u64 c;              // byte address of the block's C element (0, 0)
    u64 a_stride;       // row strides of the stored matrices, in elements
    u64 c_stride;
    u32 rows;           // rows of op(A) and C
    u32 first_tile;     // tiles of the blocks before it
    u32 waits_end;      // waits [0, waits_end) gate it
    u32 signals_begin;  // signals [signals_begin, signals_end) release it
    u32 signals_end;
    u32 pad;
};

struct CmmFusedSync {
    u64 sem;    // semaphore word (any device's)
    u32 value;  // a wait's value to reach, a signal's increment
    u32 pad;
};

struct CmmFusedArgs {
    CmmGemmArgs g;   // b, strides, n, k, dtypes and flags; a, c and m come per block
    u64 blocks;      // CmmFusedBlock[count]
    u64 waits;       // CmmFusedSync[]
    u64 signals;     // CmmFusedSync[]
    u64 control;     // u32[3 + count], zero at launch: next tile, blocks released, failed, per-block tiles done
    u64 status;      // per wait u32[2]: why it gave up (1: deadline, 2: aborted), the last value seen
    u64 abort;       // the run's abort word (host-mapped)
    u64 timeout_ns;  // deadline of one wait
    u32 count;       // blocks
    u32 tiles;       // tiles of all blocks
    u32 tiles_n;     // column tiles of a row of tiles
    u32 pad;
};

template <int KIND>  // 0: f16 tensor cores, 1: bf16 tensor cores, 2: SIMT, 3 and 4: wide f16, bf16
__device__ void cmm_fused_gemm(const CmmFusedArgs& f) {
    constexpr u32 edge = KIND >= 3 ? CmmTileWide::TILE : CMM_TILE;
    CMM_SHARED(u32, shared_tile, );
    CMM_SHARED(u32, shared_block, );
    CMM_SHARED(u32, shared_ok, );
    u32* control = (u32*)f.control;
    const CmmFusedBlock* blocks = (const CmmFusedBlock*)f.blocks;
    const CmmFusedSync* waits = (const CmmFusedSync*)f.waits;
    const CmmFusedSync* signals = (const CmmFusedSync*)f.signals;
    u32 block = 0u, checked = 0u;  // thread 0's: tiles are taken in order, so both only grow
    for (u32 round = 0u; round < f.tiles; ++round) {
        if (threadIdx.x == 0u) {
            u32 t = atomicAdd(&control[0], 1u);
            u32 ok = cmm_load_acquire((u64)&control[2]) == 0u;
            if (t < f.tiles && ok) {
                while (block + 1u < f.count && blocks[block + 1u].first_tile <= t) ++block;
                for (; checked < blocks[block].waits_end && ok; ++checked) {
                    ok = cmm_spin_at_least(waits[checked].sem, waits[checked].value, f.abort, f.timeout_ns, f.status + 8ull * checked);
                }
                if (!ok) atomicExch(&control[2], 1u);
            }
            shared_tile = t;
            shared_block = block;
            shared_ok = ok;
        }
        __syncthreads();
        const u32 t = shared_tile, b = shared_block;
        const bool go = t < f.tiles && shared_ok != 0u;
        __syncthreads();
        if (!go) return;
        const CmmFusedBlock blk = blocks[b];
        CmmGemmArgs g = f.g;
        g.a = blk.a;
        g.c = blk.c;
        g.a_stride = blk.a_stride;
        g.c_stride = blk.c_stride;
        g.m = blk.rows;
        const u32 local = t - blk.first_tile;
        const u32 row0 = (local / f.tiles_n) * edge, col0 = (local % f.tiles_n) * edge;
        if (KIND == 0) cmm_gemm_mma<false>(g, row0, col0);
        if (KIND == 1) cmm_gemm_mma<true>(g, row0, col0);
        if (KIND == 2) cmm_gemm_simt_tile(g, row0, col0);
        if (KIND == 3) cmm_gemm_mma_wide<false>(g, row0, col0);
        if (KIND == 4) cmm_gemm_mma_wide<true>(g, row0, col0);
        // Every thread's stores are visible device- and system-wide before the tile counts.
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0u) {
            const u32 end = b + 1u < f.count ? blocks[b + 1u].first_tile : f.tiles;
            if (atomicAdd(&control[3u + b], 1u) + 1u == end - blk.first_tile) {
                // The block's last tile: release it once the blocks before it are released.
                // A failure here leaves the run to its timeout or abort.
                if (cmm_spin_at_least((u64)&control[1], b, f.abort, f.timeout_ns, 0ull)) {
                    __threadfence_system();
                    for (u32 s = blk.signals_begin; s < blk.signals_end; ++s) {
                        cmm_red_release_add(signals[s].sem, signals[s].value);
                    }
                    cmm_store_release_gpu((u64)&control[1], b + 1u);
                } else {
                    atomicExch(&control[2], 1u);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128, 1) cmm_fused_gemm_mma_f16(const CmmFusedArgs f) {
    cmm_fused_gemm<0>(f);
}

extern "C" __global__ void __launch_bounds__(128, 1) cmm_fused_gemm_mma_bf16(const CmmFusedArgs f) {
    cmm_fused_gemm<1>(f);
}

extern "C" __global__ void __launch_bounds__(256, 1) cmm_fused_gemm_simt(const CmmFusedArgs f) {
    cmm_fused_gemm<2>(f);
}

extern "C" __global__ void __launch_bounds__(256, 1) cmm_fused_gemm_mma_wide_f16(const CmmFusedArgs f) {
    cmm_fused_gemm<3>(f);
}

extern "C" __global__ void __launch_bounds__(256, 1) cmm_fused_gemm_mma_wide_bf16(const CmmFusedArgs f) {
    cmm_fused_gemm<4>(f);
}
