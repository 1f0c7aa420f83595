// The attention ops: `cmm_attend` (`Op::Attend`, one key block as an online-softmax
// update) and `cmm_attn_state` (`Op::AttnMerge` and `Op::AttnFinish`). One thread per
// (query row, head), grid-stride. Twins of shaders/attend.wgsl, shaders/attn_state.wgsl
// and `cmm_core::attention::online`, whose operation order they follow: per 16-key
// tile, scores summed over c in increasing order then × scale, the tile max over
// visible keys, m' = max(m, tile max), α = expf(m − m') (0 for an empty state, l = 0),
// l·α then + p_j in key order, acc_c·α then + p_j·v_jc in key order. expf, logf and
// the division are CUDA's accurate versions (no fast math); NVRTC may contract a
// multiply and an add into an FMA, which the oracle's bound covers (it removes a
// rounding). No infinities: an empty state's max is −FLT_MAX.

#define CMM_ATTN_TILE 16u
#define CMM_ATTN_EMPTY_MAX (-3.40282347e+38f)

// Mirror: `AttendArgs` in cuda/src/launch.rs.
struct CmmAttendArgs {
    CmmTensor q, k, v, m, l, acc;
    u32 rows, keys, heads, group, head_dim, causal, q_pos, k_pos, fresh, scale_bits;
};

// Mirror: `AttnStateArgs` in cuda/src/launch.rs. function 0: merge `from` into
// `into`; 1: finish `into` into `out` and `lse`.
struct CmmAttnStateArgs {
    CmmTensor from_m, from_l, from_acc, into_m, into_l, into_acc, out, lse;
    u32 function, rows, heads, head_dim;
};

__device__ __forceinline__ float cmm_attn_at(const CmmTensor& t, u64 r, u64 c) {
    return cmm_load(t.base, r * t.stride + c, t.dtype);
}

__device__ __forceinline__ float* cmm_attn_f32(const CmmTensor& t, u64 r, u64 c) {
    return ((float*)t.base) + r * t.stride + c;
}

extern "C" __global__ void cmm_attend(CmmAttendArgs a) {
    u64 total = (u64)a.rows * a.heads;
    float scale = __uint_as_float(a.scale_bits);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u32 r = (u32)(i / a.heads);
        u32 h = (u32)(i % a.heads);
        u32 dh = a.head_dim;
        u32 qc = h * dh;
        u32 kc = (h / a.group) * dh;
        float* acc = cmm_attn_f32(a.acc, r, qc);
        float m = CMM_ATTN_EMPTY_MAX;
        float l = 0.0f;
        if (a.fresh) {
            for (u32 c = 0; c < dh; ++c) acc[c] = 0.0f;
        } else {
            m = *cmm_attn_f32(a.m, r, h);
            l = *cmm_attn_f32(a.l, r, h);
        }
        float s[CMM_ATTN_TILE];
        float p[CMM_ATTN_TILE];
        bool vis[CMM_ATTN_TILE];
        for (u32 t0 = 0; t0 < a.keys; t0 += CMM_ATTN_TILE) {
            u32 n = min(CMM_ATTN_TILE, a.keys - t0);
            float tile_max = CMM_ATTN_EMPTY_MAX;
            bool any = false;
            for (u32 t = 0; t < n; ++t) {
                u32 j = t0 + t;
                vis[t] = !a.causal || a.k_pos + j <= a.q_pos + r;
                if (vis[t]) {
                    float dot = 0.0f;
                    for (u32 c = 0; c < dh; ++c) dot = dot + cmm_attn_at(a.q, r, qc + c) * cmm_attn_at(a.k, j, kc + c);
                    s[t] = dot * scale;
                    tile_max = any ? fmaxf(tile_max, s[t]) : s[t];
                    any = true;
                }
            }
            if (!any) continue;
            float new_max = fmaxf(m, tile_max);
            float alpha = l != 0.0f ? expf(m - new_max) : 0.0f;
            float sum = l * alpha;
            for (u32 t = 0; t < n; ++t) {
                p[t] = 0.0f;
                if (vis[t]) {
                    p[t] = expf(s[t] - new_max);
                    sum = sum + p[t];
                }
            }
            for (u32 c = 0; c < dh; ++c) {
                float x = acc[c] * alpha;
                for (u32 t = 0; t < n; ++t) {
                    if (vis[t]) x = x + p[t] * cmm_attn_at(a.v, t0 + t, kc + c);
                }
                acc[c] = x;
            }
            m = new_max;
            l = sum;
        }
        *cmm_attn_f32(a.m, r, h) = m;
        *cmm_attn_f32(a.l, r, h) = l;
    }
}

extern "C" __global__ void cmm_attn_state(CmmAttnStateArgs a) {
    u64 total = (u64)a.rows * a.heads;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u32 r = (u32)(i / a.heads);
        u32 h = (u32)(i % a.heads);
        u32 dh = a.head_dim;
        float* m1 = cmm_attn_f32(a.into_m, r, h);
        float* l1 = cmm_attn_f32(a.into_l, r, h);
        float* acc1 = cmm_attn_f32(a.into_acc, r, h * dh);
        if (a.function == 1u) {
            for (u32 c = 0; c < dh; ++c) {
                float o = *l1 == 0.0f ? 0.0f : acc1[c] / *l1;
                cmm_store_bits(a.out.base, (u64)r * a.out.stride + h * dh + c, a.out.dtype, cmm_encode(o, a.out.dtype));
            }
            *cmm_attn_f32(a.lse, r, h) = *l1 == 0.0f ? CMM_ATTN_EMPTY_MAX : *m1 + logf(*l1);
            continue;
        }
        float m2 = *cmm_attn_f32(a.from_m, r, h);
        float l2 = *cmm_attn_f32(a.from_l, r, h);
        const float* acc2 = cmm_attn_f32(a.from_acc, r, h * dh);
        if (l2 == 0.0f) continue;
        if (*l1 == 0.0f) {
            *m1 = m2;
            *l1 = l2;
            for (u32 c = 0; c < dh; ++c) acc1[c] = acc2[c];
            continue;
        }
        float m = fmaxf(*m1, m2);
        float a1 = expf(*m1 - m);
        float a2 = expf(m2 - m);
        *l1 = *l1 * a1 + l2 * a2;
        for (u32 c = 0; c < dh; ++c) acc1[c] = acc1[c] * a1 + acc2[c] * a2;
        *m1 = m;
    }
}
