// Tile GEMM: C (+)= op(A) · op(B) over k in [k_begin, k_end), f32 accumulation in
// increasing k, result rounded once to C's dtype. CPU twin: `Op::Gemm` in cmm-core
// `cpu.rs`. A workgroup of 16×16 invocations computes a 64×64 tile, each invocation
// a 4×4 block held in four vec4 accumulators. Loop trips per invocation are
// (k_end − k_begin) · 17/16; the host keeps that under lavapipe's 65,535 limit.

struct GemmParams {
    m: u32,
    n: u32,
    flags: u32, // bit 0: transpose A, bit 1: transpose B, bit 2: accumulate into C (f32)
    k_begin: u32,
    k_end: u32,
    a_off: u32,
    a_stride: u32,
    a_dtype: u32,
    b_off: u32,
    b_stride: u32,
    b_dtype: u32,
    c_off: u32,
    c_stride: u32,
    c_dtype: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(1) var<uniform> P: GemmParams;

// As[q * 16 + g] holds rows 4g..4g+3 of the tile at depth q; Bs[q * 16 + g] columns 4g..4g+3.
var<workgroup> As: array<vec4<f32>, 256>;
var<workgroup> Bs: array<vec4<f32>, 256>;

fn load_a(i: u32, p: u32) -> f32 {
    if (i >= P.m || p >= P.k_end) {
        return 0.0;
    }
    var idx = P.a_off + i * P.a_stride + p;
    if ((P.flags & 1u) != 0u) {
        idx = P.a_off + p * P.a_stride + i;
    }
    return decode(ld(idx), P.a_dtype);
}

fn load_b(p: u32, j: u32) -> f32 {
    if (j >= P.n || p >= P.k_end) {
        return 0.0;
    }
    var idx = P.b_off + p * P.b_stride + j;
    if ((P.flags & 2u) != 0u) {
        idx = P.b_off + j * P.b_stride + p;
    }
    return decode(ld(idx), P.b_dtype);
}

fn load_c(i: u32, j: u32) -> f32 {
    if (i >= P.m || j >= P.n) {
        return 0.0;
    }
    return bitcast<f32>(ld(P.c_off + i * P.c_stride + j));
}

fn load_c4(i: u32, j: u32) -> vec4<f32> {
    return vec4<f32>(load_c(i, j), load_c(i, j + 1u), load_c(i, j + 2u), load_c(i, j + 3u));
}

fn store_c4(i: u32, j: u32, v: vec4<f32>) {
    if (i >= P.m) {
        return;
    }
    let base = P.c_off + i * P.c_stride;
    if (j < P.n) { st(base + j, encode(v.x, P.c_dtype)); }
    if (j + 1u < P.n) { st(base + j + 1u, encode(v.y, P.c_dtype)); }
    if (j + 2u < P.n) { st(base + j + 2u, encode(v.z, P.c_dtype)); }
    if (j + 3u < P.n) { st(base + j + 3u, encode(v.w, P.c_dtype)); }
}

@compute @workgroup_size(16, 16, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let tx = lid.x;
    let ty = lid.y;
    let row0 = wid.y * 64u + ty * 4u;
    let col0 = wid.x * 64u + tx * 4u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    if ((P.flags & 4u) != 0u) {
        acc0 = load_c4(row0, col0);
        acc1 = load_c4(row0 + 1u, col0);
        acc2 = load_c4(row0 + 2u, col0);
        acc3 = load_c4(row0 + 3u, col0);
    }
    // This invocation's share of the tile loads: depth q, group g.
    let q = (ty * 16u + tx) % 16u;
    let g = (ty * 16u + tx) / 16u;
    let ar = wid.y * 64u + g * 4u;
    let bc = wid.x * 64u + g * 4u;
    let tiles = (P.k_end - P.k_begin + 15u) / 16u;
    for (var t = 0u; t < tiles; t = t + 1u) {
        let p = P.k_begin + t * 16u + q;
        As[q * 16u + g] = vec4<f32>(load_a(ar, p), load_a(ar + 1u, p), load_a(ar + 2u, p), load_a(ar + 3u, p));
        Bs[q * 16u + g] = vec4<f32>(load_b(p, bc), load_b(p, bc + 1u), load_b(p, bc + 2u), load_b(p, bc + 3u));
        workgroupBarrier();
        for (var s = 0u; s < 16u; s = s + 1u) {
            let a = As[s * 16u + ty];
            let b = Bs[s * 16u + tx];
            acc0 = acc0 + a.x * b;
            acc1 = acc1 + a.y * b;
            acc2 = acc2 + a.z * b;
            acc3 = acc3 + a.w * b;
        }
        workgroupBarrier();
    }
    store_c4(row0, col0, acc0);
    store_c4(row0 + 1u, col0, acc1);
    store_c4(row0 + 2u, col0, acc2);
    store_c4(row0 + 3u, col0, acc3);
}
