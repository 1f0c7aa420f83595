// Tile GEMMs: C (+)= op(A)·op(B) with f32 accumulation, rounded once to C's dtype.
// Twin of shaders/gemm.wgsl and the `Op::Gemm` arm of cmm-core cpu.rs.
//
// - cmm_gemm_mma_f16 / cmm_gemm_mma_bf16: tensor cores (mma.sync m16n8k16, f32
//   accumulate) for f16 or bf16 A and B. 128 threads = 4 warps in 2×2, a 64×64 block
//   tile, K in steps of 16 staged through shared memory with zero padding at the edges.
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

template <bool BF16>
__device__ void cmm_gemm_mma(const CmmGemmArgs g) {
    __shared__ u16 As[CMM_TILE][CMM_KSTEP + CMM_APAD];
    __shared__ u16 Bs[CMM_KSTEP][CMM_TILE + CMM_BPAD];
    const u32 tid = threadIdx.x;
    const u32 warp = tid / 32, lane = tid % 32;
    const u32 gid = lane / 4, tig = lane % 4;
    const u32 row0 = blockIdx.y * CMM_TILE, col0 = blockIdx.x * CMM_TILE;
    const u32 wm = (warp / 2) * 32, wn = (warp % 2) * 32;

    // acc[mi][ni][e]: rows wm + 16 mi + gid (+8 for e >= 2), cols wn + 8 ni + 2 tig (+1 for odd e).
    float acc[2][4][4];
    #pragma unroll
    for (int mi = 0; mi < 2; ++mi)
        #pragma unroll
        for (int ni = 0; ni < 4; ++ni)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                u32 i = row0 + wm + 16 * mi + gid + (e >= 2 ? 8 : 0);
                u32 j = col0 + wn + 8 * ni + 2 * tig + (e & 1);
                acc[mi][ni][e] = cmm_c_initial(g, i, j);
            }

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
            for (int mi = 0; mi < 2; ++mi) cmm_mma16816<BF16>(acc[mi][ni], afrag[mi], bfrag);
        }
        __syncthreads();
    }

    #pragma unroll

    for (int mi = 0; mi < 2; ++mi)
        #pragma unroll
        for (int ni = 0; ni < 4; ++ni)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                u32 i = row0 + wm + 16 * mi + gid + (e >= 2 ? 8 : 0);
                u32 j = col0 + wn + 8 * ni + 2 * tig + (e & 1);
                cmm_c_store(g, i, j, acc[mi][ni][e]);
            }
}

extern "C" __global__ void __launch_bounds__(128) cmm_gemm_mma_f16(const CmmGemmArgs g) {
    cmm_gemm_mma<false>(g);
}

extern "C" __global__ void __launch_bounds__(128) cmm_gemm_mma_bf16(const CmmGemmArgs g) {
    cmm_gemm_mma<true>(g);
}

extern "C" __global__ void __launch_bounds__(256) cmm_gemm_simt(const CmmGemmArgs g) {
    __shared__ float As[CMM_KSTEP][CMM_TILE];
    __shared__ float Bs[CMM_KSTEP][CMM_TILE];
    const u32 tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const u32 row0 = blockIdx.y * CMM_TILE, col0 = blockIdx.x * CMM_TILE;
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
