// Grouped GEMM by routing table: for each expert e in [group_begin, group_end) and each
// row r of segment (e, chunk), C[r] = A[r'] · B_e with f32 accumulation in increasing k,
// rounded once to C's dtype; r' = r, or with `gather` the token of perm[r] minus
// gather_base (a row outside A gives 0). With `zero_unrouted`, rows past the routed ones
// become 0; other rows are not written. Every table entry is bounded before use. One
// invocation per (row, column). CPU twin: `Op::GroupedGemm` in cmm-core `cpu/mod.rs`.
// Loops: a binary search over the groups (at most 32 steps), then k; the host keeps
// k under lavapipe's 65,535.

struct GroupedGemmParams {
    n: u32,
    k: u32,
    row_begin: u32,
    experts: u32,
    // Per operand: word offset, row stride, dtype, rows.
    a: vec4<u32>,
    b: vec4<u32>,
    c: vec4<u32>,
    seg_off: u32,
    perm_off: u32,
    perm_stride: u32,
    slots: u32,
    chunks: u32,
    chunk: u32,
    group_begin: u32,
    group_end: u32,
    gather: u32,
    gather_base: u32,
    zero_unrouted: u32,
    _pad: u32,
}

@group(0) @binding(1) var<uniform> P: GroupedGemmParams;

const NONE: u32 = 0xffffffffu;

fn seg(i: u32) -> u32 {
    return min(ld(P.seg_off + i), P.c.w);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let r = P.row_begin + gid.y;
    if (j >= P.n || r >= P.c.w) {
        return;
    }
    // The last group whose segment starts at or before r (starts never decrease with
    // the expert), by binary search; r is in it if it ends after r.
    var lo = P.group_begin;
    var hi = P.group_end;
    for (var step = 0u; step < 32u && lo < hi; step = step + 1u) {
        let mid = lo + (hi - lo) / 2u;
        if (seg(mid * P.chunks + P.chunk) <= r) {
            lo = mid + 1u;
        } else {
            hi = mid;
        }
    }
    var expert = NONE;
    if (lo > P.group_begin && r < seg((lo - 1u) * P.chunks + P.chunk + 1u)) {
        expert = lo - 1u;
    }
    let out = P.c.x + r * P.c.y + j;
    if (expert == NONE) {
        if (P.zero_unrouted != 0u && r >= seg(P.experts * P.chunks)) {
            st(out, encode(0.0, P.c.z));
        }
        return;
    }
    var src = r;
    if (P.gather != 0u) {
        let slot = ld(P.perm_off + r * P.perm_stride);
        src = NONE;
        if (slot != NONE) {
            let token = slot / P.slots;
            if (token >= P.gather_base && token - P.gather_base < P.a.w) {
                src = token - P.gather_base;
            }
        }
    }
    var acc = 0.0;
    if (src != NONE) {
        let b0 = P.b.x + expert * P.k * P.b.y + j;
        for (var p = 0u; p < P.k; p = p + 1u) {
            let x = decode(ld(P.a.x + src * P.a.y + p), P.a.z);
            let y = decode(ld(b0 + p * P.b.y), P.b.z);
            acc = acc + x * y;
        }
    }
    st(out, encode(acc, P.c.z));
}
