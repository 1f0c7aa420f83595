// Host twin of `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}` (gemm.cu's
// cmm_mma16816), after common.cuh. The 32 lanes of a warp meet through staging in
// shared memory; each then computes its four outputs from the whole warp's fragments,
// laid out as the PTX ISA specifies for this shape (g = lane / 4, t = lane % 4):
// - A (16×16, row): register j holds (row g + 8·(j & 1), cols 2t + 8·(j >> 1) + {0, 1});
// - B (16×8, col): register j holds (rows 2t + 8j + {0, 1}, col g);
// - C/D (16×8): element e is (row g + 8·(e >> 1), col 2t + (e & 1)).
// The low half of a register is the lower column (A) or row (B). Products of f16 or
// bf16 values are exact in f32; they are summed in k order onto d.

struct CmmHostWarpFragments {
    u32 a[4];
    u32 b[2];
};

template <bool BF16>
inline float cmm_host_half(const CmmHostWarpFragments* warp, u32 lane, u32 reg, u32 half, bool is_a) {
    const u32 bits = ((is_a ? warp[lane].a[reg] : warp[lane].b[reg]) >> (16u * half)) & 0xffffu;
    return BF16 ? __uint_as_float(bits << 16) : cmm_f16_bits_to_f32(bits);
}

template <bool BF16>
inline void cmm_mma16816(float* d, const u32* a, const u32* b) {
    static thread_local CmmHostWarpFragments staged[32][32];  // [warp][lane]
    const u32 tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const u32 warp = tid / 32u, lane = tid % 32u;
    if (warp >= 32u) {
        cmm_host::fail("a warp collective in a block of more than 1024 threads");
        return;
    }
    for (int j = 0; j < 4; ++j) staged[warp][lane].a[j] = a[j];
    for (int j = 0; j < 2; ++j) staged[warp][lane].b[j] = b[j];
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
    const CmmHostWarpFragments* w = staged[warp];
    const u32 g = lane / 4u, t = lane % 4u;
    for (u32 e = 0; e < 4u; ++e) {
        const u32 row = g + 8u * (e >> 1), col = 2u * t + (e & 1u);
        float sum = d[e];
        for (u32 k = 0; k < 16u; ++k) {
            // A(row, k) lives in lane (row % 8)·4 + (k % 8)/2, register (row / 8) + 2·(k / 8).
            const float x = cmm_host_half<BF16>(w, (row % 8u) * 4u + (k % 8u) / 2u, row / 8u + 2u * (k / 8u), k & 1u, true);
            // B(k, col) lives in lane col·4 + (k % 8)/2, register k / 8.
            const float y = cmm_host_half<BF16>(w, col * 4u + (k % 8u) / 2u, k / 8u, k & 1u, false);
            sum += x * y;
        }
        d[e] = sum;
    }
    // Nobody restages before every lane has read.
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
}
