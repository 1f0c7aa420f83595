// Host twins of gemm.cu's warp collectives and asynchronous copies, after common.cuh.
//
// `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}` (cmm_mma16816). The 32 lanes of a warp meet through staging in
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

// The calling thread's warp and lane; false (an error) in a block of more than 32 warps.
inline bool cmm_host_warp_lane(u32& warp, u32& lane) {
    const u32 tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    warp = tid / 32u;
    lane = tid % 32u;
    if (warp < 32u) return true;
    cmm_host::fail("a warp collective in a block of more than 1024 threads");
    return false;
}

// The warp's A (16×16) and B (16×8, as [col][k]) as floats: decoded once per mma by the
// first lane past the staging barrier, not once per lane.
struct CmmHostWarpOperands {
    bool decoded;
    float a[16][16];
    float b[8][16];
};

template <bool BF16>
inline void cmm_mma16816(float* d, const u32* a, const u32* b) {
    static thread_local CmmHostWarpFragments staged[32][32];  // [warp][lane]
    static thread_local CmmHostWarpOperands operands[32];    // [warp]
    u32 warp, lane;
    if (!cmm_host_warp_lane(warp, lane)) return;
    for (int j = 0; j < 4; ++j) staged[warp][lane].a[j] = a[j];
    for (int j = 0; j < 2; ++j) staged[warp][lane].b[j] = b[j];
    // Every lane stages before any passes the barrier, and every lane reads before any
    // restages (the second barrier): the first lane through decodes for all.
    operands[warp].decoded = false;
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
    const CmmHostWarpFragments* w = staged[warp];
    CmmHostWarpOperands& ops = operands[warp];
    if (!ops.decoded) {
        for (u32 k = 0; k < 16u; ++k) {
            // A(row, k) lives in lane (row % 8)·4 + (k % 8)/2, register (row / 8) + 2·(k / 8).
            for (u32 row = 0; row < 16u; ++row) {
                ops.a[row][k] = cmm_host_half<BF16>(w, (row % 8u) * 4u + (k % 8u) / 2u, row / 8u + 2u * (k / 8u), k & 1u, true);
            }
            // B(k, col) lives in lane col·4 + (k % 8)/2, register k / 8.
            for (u32 col = 0; col < 8u; ++col) {
                ops.b[col][k] = cmm_host_half<BF16>(w, col * 4u + (k % 8u) / 2u, k / 8u, k & 1u, false);
            }
        }
        ops.decoded = true;
    }
    const u32 g = lane / 4u, t = lane % 4u;
    for (u32 e = 0; e < 4u; ++e) {
        const u32 row = g + 8u * (e >> 1), col = 2u * t + (e & 1u);
        float sum = d[e];
        for (u32 k = 0; k < 16u; ++k) sum += ops.a[row][k] * ops.b[col][k];
        d[e] = sum;
    }
    // Nobody restages before every lane has read.
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
}

// The hazard checks of shared memory (runtime.h, SharedChunk). A read by warp `warp` of
// the 16 bytes at `at`: they must have been written by a copy of this block whose wait
// came before the last __syncthreads.
inline void cmm_host_shared_read(const void* at, u32 warp) {
    cmm_host::Block* block = cmm_host::running_block;
    if (block == nullptr) return;
    auto found = block->shared_chunks.find((uintptr_t)at);
    if (found == block->shared_chunks.end()) {
        cmm_host::fail("shared-memory hazard: ldmatrix reads 16 bytes that no cp.async of the block wrote");
        return;
    }
    cmm_host::SharedChunk& c = found->second;
    if (c.landed == cmm_host::SharedChunk::PENDING) {
        cmm_host::fail("shared-memory hazard: ldmatrix reads 16 bytes whose cp.async its thread has not waited for");
    } else if (c.landed >= block->epoch) {
        cmm_host::fail(
            "shared-memory hazard: ldmatrix reads 16 bytes that a cp.async landed in with no __syncthreads between "
            "the copy's wait and the read");
    }
    if (c.read_epoch != block->epoch) {
        c.read_epoch = block->epoch;
        c.readers = 0;
    }
    c.readers |= 1u << warp;
}

// A cp.async by thread `thread` to the 16 bytes at `at`.
inline void cmm_host_shared_write(void* at, u32 thread) {
    cmm_host::Block* block = cmm_host::running_block;
    cmm_host::SharedChunk& c = block->shared_chunks
                                   .try_emplace((uintptr_t)at, cmm_host::SharedChunk{thread, 0, 0, 0})
                                   .first->second;
    if (c.read_epoch == block->epoch && (c.readers & ~(1u << (thread / 32u))) != 0u) {
        cmm_host::fail(
            "shared-memory hazard: a cp.async overwrites 16 bytes that another warp read with no __syncthreads "
            "between the read and the copy");
    } else if (c.writer != thread && (c.landed == cmm_host::SharedChunk::PENDING || c.landed >= block->epoch)) {
        cmm_host::fail(
            "shared-memory hazard: two threads' cp.async copies to the same 16 bytes with no __syncthreads between "
            "the first one's wait and the second");
    }
    c.writer = thread;
    c.landed = cmm_host::SharedChunk::PENDING;
}

// `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16` (cmm_ldmatrix_x4[_trans]): lane l
// gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); register i
// of lane l receives from matrix i the elements (row l / 4, cols 2·(l % 4) + {0, 1}), or
// with .trans (rows 2·(l % 4) + {0, 1}, col l / 4); the first element in the low half.
inline void cmm_host_ldmatrix_x4(u32* r, const void* row, bool trans) {
    static thread_local const u16* staged[32][32];  // [warp][lane]
    u32 warp, lane;
    if (!cmm_host_warp_lane(warp, lane)) return;
    if ((uintptr_t)row % 16u != 0u) cmm_host::fail("ldmatrix: a row address that is not 16-byte aligned");
    cmm_host_shared_read(row, warp);
    staged[warp][lane] = static_cast<const u16*>(row);
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
    const u32 g = lane / 4u, t = lane % 4u;
    for (u32 i = 0; i < 4u; ++i) {
        const u16* const* rows = &staged[warp][8u * i];
        const u32 lo = trans ? rows[2u * t][g] : rows[g][2u * t];
        const u32 hi = trans ? rows[2u * t + 1u][g] : rows[g][2u * t + 1u];
        r[i] = lo | (hi << 16);
    }
    // Nobody restages before every lane has read.
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
}

inline void cmm_ldmatrix_x4(u32* r, const void* row) { cmm_host_ldmatrix_x4(r, row, false); }
inline void cmm_ldmatrix_x4_trans(u32* r, const void* row) { cmm_host_ldmatrix_x4(r, row, true); }

// `cp.async.cg.shared.global` of 16 bytes (zero-filled when src_bytes = 0),
// `cp.async.commit_group` and `cp.async.wait_group N`. A copy lands only when its thread
// waits for its group, so a kernel that reads a stage before waiting for it, or before
// the barrier after every thread's wait, reads the stage's old contents.
inline cmm_host::Fiber* cmm_host_async_thread() {
    if (cmm_host::running_block == nullptr) {
        cmm_host::fail("cp.async in a kernel launched without fibers (its Kernel entry says no barriers)");
        return nullptr;
    }
    return cmm_host::running_block->current;
}

inline void cmm_cp_async16(void* dst, u64 src, u32 src_bytes) {
    cmm_host::Fiber* me = cmm_host_async_thread();
    if (me == nullptr) return;
    if ((uintptr_t)dst % 16u != 0u || (src_bytes != 0u && src % 16u != 0u)) {
        cmm_host::fail("cp.async: a 16-byte copy from or to an address that is not 16-byte aligned");
        return;
    }
    if (src_bytes != 0u && src_bytes != 16u) {
        cmm_host::fail("cp.async: a partial copy (cmm copies 16 bytes or zero-fills)");
        return;
    }
    cmm_host_shared_write(dst, cmm_host::linear_thread());
    me->in_flight.push_back({dst, src_bytes == 0u ? nullptr : (const void*)src, me->committed});
}

inline void cmm_cp_async_commit() {
    if (cmm_host::Fiber* me = cmm_host_async_thread()) me->committed += 1;
}

template <int N>
inline void cmm_cp_async_wait() {
    cmm_host::Fiber* me = cmm_host_async_thread();
    if (me == nullptr) return;
    // Groups older than the newest N committed ones land, oldest first; uncommitted
    // copies stay in flight, as on the GPU.
    const u32 limit = me->committed >= (u32)N ? me->committed - (u32)N : 0u;
    size_t kept = 0;
    for (const cmm_host::AsyncCopy& c : me->in_flight) {
        if (c.group < limit) {
            if (c.src == nullptr) {
                std::memset(c.dst, 0, 16);
            } else {
                std::memcpy(c.dst, c.src, 16);
            }
            auto chunk = cmm_host::running_block->shared_chunks.find((uintptr_t)c.dst);
            if (chunk != cmm_host::running_block->shared_chunks.end()) chunk->second.landed = cmm_host::running_block->epoch;
        } else {
            me->in_flight[kept++] = c;
        }
    }
    me->in_flight.resize(kept);
}
