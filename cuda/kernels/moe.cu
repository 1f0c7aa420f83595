// The MoE ops: routing tables from the router's ids, the grouped GEMM by table and the
// top-k weighted combine. Twins of shaders/route.wgsl, grouped_gemm.wgsl and
// combine.wgsl (CPU twins in cmm-core `moe/route.rs` and `cpu/mod.rs`). Products and sums
// use __fmul_rn/__fadd_rn so that no multiply-add is contracted: the bits are the
// reference's. Table entries are bounded before every use.

#define CMM_NONE 0xffffffffu

// Mirror: `RouteArgs` in cuda/src/launch.rs.
struct CmmRouteArgs {
    u64 ids;
    u64 ids_stride;
    u64 seg;
    u64 perm;
    u64 perm_stride;
    u64 inv;
    u64 inv_stride;
    u32 pass;
    u32 tokens;
    u32 slots;
    u32 experts;
    u32 chunks;
    u32 capacity;
    u32 shards;
};

__device__ __forceinline__ u32 cmm_route_id(const CmmRouteArgs& a, u32 slot) {
    return ((const u32*)a.ids)[(u64)(slot / a.slots) * a.ids_stride + slot % a.slots];
}

// Chunk c's first (token, slot) and its tokens·slots: the tokens cut into `shards`
// shards, each into chunks/shards sub-chunks, both in tensor_split's order (the first
// n mod k pieces one longer). Twin of `chunk_tokens` in cmm-core `moe/route.rs`.
__device__ __forceinline__ void cmm_route_chunk(const CmmRouteArgs& a, u32 c, u32* first, u32* count) {
    u32 per_shard = a.chunks / a.shards > 0u ? a.chunks / a.shards : 1u;
    u32 s = c / per_shard, j = c % per_shard;
    u32 len = a.tokens / a.shards, longer = a.tokens % a.shards;
    u32 shard0 = s * len + (s < longer ? s : longer);
    u32 shard_len = len + (s < longer ? 1u : 0u);
    u32 sub = shard_len / per_shard, sub_longer = shard_len % per_shard;
    *first = (shard0 + j * sub + (j < sub_longer ? j : sub_longer)) * a.slots;
    *count = (sub + (j < sub_longer ? 1u : 0u)) * a.slots;
}

// Pass 0: clear perm and inv, count every (expert, chunk) segment; pass 1: scan the
// counts (one thread); pass 2: fill each segment in token then slot order.
extern "C" __global__ void cmm_route(CmmRouteArgs a) {
    u32* seg = (u32*)a.seg;
    u32* perm = (u32*)a.perm;
    u32* inv = (u32*)a.inv;
    u64 total = (u64)a.tokens * a.slots;
    u64 segments = (u64)a.experts * a.chunks;
    u64 n = total > a.capacity ? total : a.capacity;
    n = n > segments ? n : segments;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (a.pass == 0u) {
            if (i < total) inv[(i / a.slots) * a.inv_stride + i % a.slots] = CMM_NONE;
            if (i < a.capacity) perm[i * a.perm_stride] = CMM_NONE;
            if (i == 0) seg[0] = 0u;
            if (i < segments) {
                u32 e = (u32)(i / a.chunks);
                u32 first, per_chunk;
                cmm_route_chunk(a, (u32)(i % a.chunks), &first, &per_chunk);
                u32 count = 0u;
                for (u32 s = 0u; s < per_chunk; ++s) count += cmm_route_id(a, first + s) == e ? 1u : 0u;
                seg[i + 1] = count;
            }
        } else if (a.pass == 1u) {
            if (i == 0) {
                for (u64 s = 1; s <= segments; ++s) seg[s] += seg[s - 1];
            }
        } else if (i < segments) {
            u32 e = (u32)(i / a.chunks);
            u32 first, per_chunk;
            cmm_route_chunk(a, (u32)(i % a.chunks), &first, &per_chunk);
            u32 row = seg[i];
            for (u32 s = 0u; s < per_chunk; ++s) {
                u32 slot = first + s;
                if (cmm_route_id(a, slot) == e) {
                    if (row < a.capacity) {
                        perm[(u64)row * a.perm_stride] = slot;
                        inv[(u64)(slot / a.slots) * a.inv_stride + slot % a.slots] = row;
                    }
                    ++row;
                }
            }
        }
    }
}

// Mirror: `GroupedGemmArgs` in cuda/src/launch.rs.
struct CmmGroupedGemmArgs {
    u64 a;
    u64 a_stride;
    u64 b;
    u64 b_stride;
    u64 c;
    u64 c_stride;
    u64 seg;
    u64 perm;
    u64 perm_stride;
    u32 a_dtype;
    u32 b_dtype;
    u32 c_dtype;
    u32 a_rows;
    u32 rows;
    u32 n;
    u32 k;
    u32 chunks;
    u32 chunk;
    u32 group_begin;
    u32 group_end;
    u32 experts;
    u32 slots;
    u32 gather;
    u32 gather_base;
    u32 zero_unrouted;
};

__device__ __forceinline__ u32 cmm_seg(const CmmGroupedGemmArgs& a, u32 i) {
    u32 v = ((const u32*)a.seg)[i];
    return v < a.rows ? v : a.rows;
}

// The expert of row r among this chunk's segments (the last group whose segment starts
// at or before r, by binary search), or CMM_NONE for a row in none of them.
__device__ __forceinline__ u32 cmm_grouped_expert(const CmmGroupedGemmArgs& a, u32 r) {
    u32 lo = a.group_begin, hi = a.group_end;
    for (u32 step = 0u; step < 32u && lo < hi; ++step) {
        u32 mid = lo + (hi - lo) / 2u;
        if (cmm_seg(a, mid * a.chunks + a.chunk) <= r) lo = mid + 1u; else hi = mid;
    }
    if (lo > a.group_begin && r < cmm_seg(a, (lo - 1u) * a.chunks + a.chunk + 1u)) return lo - 1u;
    return CMM_NONE;
}

// The row of a that row r of C multiplies: r itself, or with `gather` the token-shard
// row of the token perm gives r, CMM_NONE (zeros) for an unrouted slot or a token
// outside the shard.
__device__ __forceinline__ u32 cmm_grouped_source(const CmmGroupedGemmArgs& a, u32 r) {
    if (a.gather == 0u) return r;
    u32 slot = ((const u32*)a.perm)[(u64)r * a.perm_stride];
    if (slot == CMM_NONE || a.slots == 0u) return CMM_NONE;
    u32 token = slot / a.slots;
    if (token >= a.gather_base && token - a.gather_base < a.a_rows) return token - a.gather_base;
    return CMM_NONE;
}

// One thread per (row, column) of C: find the row's expert among this chunk's
// segments, gather its A row, accumulate over k in order.
extern "C" __global__ void cmm_grouped_gemm(CmmGroupedGemmArgs a) {
    u64 total = (u64)a.rows * a.n;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u32 r = (u32)(i / a.n);
        u32 j = (u32)(i % a.n);
        u32 expert = cmm_grouped_expert(a, r);
        u64 out = (u64)r * a.c_stride + j;
        if (expert == CMM_NONE) {
            if (a.zero_unrouted != 0u && r >= cmm_seg(a, a.experts * a.chunks)) {
                cmm_store_bits(a.c, out, a.c_dtype, cmm_encode(0.0f, a.c_dtype));
            }
            continue;
        }
        u32 src = cmm_grouped_source(a, r);
        float acc = 0.0f;
        if (src != CMM_NONE) {
            u64 b0 = (u64)expert * a.k * a.b_stride + j;
            for (u32 p = 0u; p < a.k; ++p) {
                float x = cmm_load(a.a, (u64)src * a.a_stride + p, a.a_dtype);
                float y = cmm_load(a.b, b0 + (u64)p * a.b_stride, a.b_dtype);
                acc = __fadd_rn(acc, __fmul_rn(x, y));
            }
        }
        cmm_store_bits(a.c, out, a.c_dtype, cmm_encode(acc, a.c_dtype));
    }
}

// A grouped GEMM's gathered rows staged for the Hopper engine, whose TMA loads boxes of
// consecutive rows: for every row r of this chunk's segments, c[r] = a[source(r)] (k
// elements of a's dtype, zeros where r has no source); the other rows of c are left as
// they are (the engine loads them with a tile but never stores their results). One warp
// a row, 16 bytes a lane four at a time, then the row's last elements one a lane: the host launches it
// where a's and c's bases and row strides are multiples of 16 bytes
// (`gather_rows_launch` in cuda/src/launch.rs); n is unused.
extern "C" __global__ void cmm_gather_rows(CmmGroupedGemmArgs a) {
    const u32 lane = threadIdx.x % 32u;
    const u64 warps = (u64)gridDim.x * (blockDim.x / 32u);
    const u32 bytes = a.a_dtype == 0u ? 4u : 2u;
    const u32 pieces = a.k * bytes / 16u;   // whole 16-byte pieces of a row
    const u32 tail = pieces * 16u / bytes;  // the first element after them
    for (u64 r = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32u; r < a.rows; r += warps) {
        if (cmm_grouped_expert(a, (u32)r) == CMM_NONE) continue;
        const u32 src = cmm_grouped_source(a, (u32)r);
        const u64 from = a.a + (u64)bytes * (src == CMM_NONE ? 0u : src) * a.a_stride;
        const u64 to = a.c + (u64)bytes * r * a.c_stride;
        // Four loads of a lane in flight before its stores: a warp keeps 2 KiB of the
        // row on its way from HBM, as the copy's rate needs.
        for (u32 j = lane; j < pieces; j += 4u * 32u) {
            CmmBits128 v[4];
            #pragma unroll
            for (u32 u = 0u; u < 4u; ++u) {
                const u32 i = j + 32u * u;
                v[u] = CmmBits128{{0u, 0u, 0u, 0u}};
                if (src != CMM_NONE && i < pieces) v[u] = ((const CmmBits128*)from)[i];
            }
            #pragma unroll
            for (u32 u = 0u; u < 4u; ++u) {
                const u32 i = j + 32u * u;
                if (i < pieces) ((CmmBits128*)to)[i] = v[u];
            }
        }
        for (u32 j = tail + lane; j < a.k; j += 32u) {
            cmm_store_bits(to, j, a.a_dtype, src != CMM_NONE ? cmm_load_bits(from, j, a.a_dtype) : 0u);
        }
    }
}

// Mirror: `CombineArgs` in cuda/src/launch.rs.
struct CmmCombineArgs {
    u64 src;
    u64 src_stride;
    u64 w;
    u64 w_stride;
    u64 inv;
    u64 inv_stride;
    u64 out;
    u64 out_stride;
    u32 src_dtype;
    u32 src_rows;
    u32 out_dtype;
    u32 rows;
    u32 cols;
    u32 slots;
};

// One thread per (token, column): the weighted sum of the token's rows, slots in order.
extern "C" __global__ void cmm_combine(CmmCombineArgs a) {
    u64 total = (u64)a.rows * a.cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / a.cols;
        u64 c = i % a.cols;
        float acc = 0.0f;
        for (u32 s = 0u; s < a.slots; ++s) {
            u32 row = ((const u32*)a.inv)[t * a.inv_stride + s];
            if (row < a.src_rows) {
                float w = __uint_as_float(((const u32*)a.w)[t * a.w_stride + s]);
                float v = cmm_load(a.src, (u64)row * a.src_stride + c, a.src_dtype);
                acc = __fadd_rn(acc, __fmul_rn(w, v));
            }
        }
        cmm_store_bits(a.out, t * a.out_stride + c, a.out_dtype, cmm_encode(acc, a.out_dtype));
    }
}
