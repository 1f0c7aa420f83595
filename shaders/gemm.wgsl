// Tile GEMM: C (+)= op(A) · op(B) over k in [k_begin, k_end), f32 accumulation in
// increasing k — for each element, one rounded product then one rounded add per k —
// the result rounded once to C's dtype. CPU twin: `Op::Gemm` in cmm-core `cpu/`.
// A workgroup of 16×16 invocations computes a 256×256 tile; each invocation a 16×16
// block held in sixteen 4×4 accumulators, so that every value it reads from workgroup
// memory feeds 16 multiply-adds (on a CPU adapter each such read is a loop over the
// lanes; the arithmetic is cheap beside it). Loop trips per invocation are
// (k_end − k_begin) · 11/8; the host keeps that under lavapipe's 65,535 limit.

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

// Depth of one tile step; As and Bs take 16 KiB together, WebGPU's default limit.
const DEPTH: u32 = 8u;

// As[q * 64 + g] holds rows 4g..4g+3 of the tile at depth q; Bs[q * 64 + g] columns 4g..4g+3.
var<workgroup> As: array<vec4<f32>, 512>;
var<workgroup> Bs: array<vec4<f32>, 512>;

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
    if (i >= P.m || j >= P.n) {
        return vec4<f32>(0.0);
    }
    let base = P.c_off + i * P.c_stride + j;
    // Columns past n read as 0 (never stored back).
    var v = vec4<f32>(bitcast<f32>(ld(base)), 0.0, 0.0, 0.0);
    if (j + 1u < P.n) { v.y = bitcast<f32>(ld(base + 1u)); }
    if (j + 2u < P.n) { v.z = bitcast<f32>(ld(base + 2u)); }
    if (j + 3u < P.n) { v.w = bitcast<f32>(ld(base + 3u)); }
    return v;
}

fn store_c4(i: u32, j: u32, v: vec4<f32>) {
    if (i >= P.m) {
        return;
    }
    let base = P.c_off + i * P.c_stride + j;
    if (j < P.n) { st(base, encode(v.x, P.c_dtype)); }
    if (j + 1u < P.n) { st(base + 1u, encode(v.y, P.c_dtype)); }
    if (j + 2u < P.n) { st(base + 2u, encode(v.z, P.c_dtype)); }
    if (j + 3u < P.n) { st(base + 3u, encode(v.w, P.c_dtype)); }
}

// The 4×4 block of C at rows i..i+3, columns j..j+3: column r of the matrix is row i + r.
fn load_block(i: u32, j: u32) -> mat4x4<f32> {
    return mat4x4<f32>(load_c4(i, j), load_c4(i + 1u, j), load_c4(i + 2u, j), load_c4(i + 3u, j));
}

fn store_block(i: u32, j: u32, c: mat4x4<f32>) {
    store_c4(i, j, c[0]);
    store_c4(i + 1u, j, c[1]);
    store_c4(i + 2u, j, c[2]);
    store_c4(i + 3u, j, c[3]);
}

// a ⊗ b in the block layout above: the products alone, added by the caller, so that
// each element sees a rounded product and then a rounded add.
fn outer(a: vec4<f32>, b: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(a.x * b, a.y * b, a.z * b, a.w * b);
}

@compute @workgroup_size(16, 16, 1)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let tx = lid.x;
    let ty = lid.y;
    let row0 = wid.y * 256u + ty * 16u;
    let col0 = wid.x * 256u + tx * 16u;
    // c<r><c>: the 4×4 block at rows row0 + 4r, columns col0 + 4c. Named, not an array:
    // a CPU adapter keeps an indexed array in memory.
    var c00 = mat4x4<f32>();
    var c01 = mat4x4<f32>();
    var c02 = mat4x4<f32>();
    var c03 = mat4x4<f32>();
    var c10 = mat4x4<f32>();
    var c11 = mat4x4<f32>();
    var c12 = mat4x4<f32>();
    var c13 = mat4x4<f32>();
    var c20 = mat4x4<f32>();
    var c21 = mat4x4<f32>();
    var c22 = mat4x4<f32>();
    var c23 = mat4x4<f32>();
    var c30 = mat4x4<f32>();
    var c31 = mat4x4<f32>();
    var c32 = mat4x4<f32>();
    var c33 = mat4x4<f32>();
    if ((P.flags & 4u) != 0u) {
        c00 = load_block(row0, col0);
        c01 = load_block(row0, col0 + 4u);
        c02 = load_block(row0, col0 + 8u);
        c03 = load_block(row0, col0 + 12u);
        c10 = load_block(row0 + 4u, col0);
        c11 = load_block(row0 + 4u, col0 + 4u);
        c12 = load_block(row0 + 4u, col0 + 8u);
        c13 = load_block(row0 + 4u, col0 + 12u);
        c20 = load_block(row0 + 8u, col0);
        c21 = load_block(row0 + 8u, col0 + 4u);
        c22 = load_block(row0 + 8u, col0 + 8u);
        c23 = load_block(row0 + 8u, col0 + 12u);
        c30 = load_block(row0 + 12u, col0);
        c31 = load_block(row0 + 12u, col0 + 4u);
        c32 = load_block(row0 + 12u, col0 + 8u);
        c33 = load_block(row0 + 12u, col0 + 12u);
    }
    // Each tile step loads 512 vec4s of A and of B: two of each per invocation.
    let lin = ty * 16u + tx;
    let tiles = (P.k_end - P.k_begin + DEPTH - 1u) / DEPTH;
    for (var t = 0u; t < tiles; t = t + 1u) {
        for (var h = 0u; h < 2u; h = h + 1u) {
            let slot = lin + h * 256u;
            let q = slot % DEPTH;
            let g = slot / DEPTH;
            let p = P.k_begin + t * DEPTH + q;
            let ar = wid.y * 256u + g * 4u;
            let bc = wid.x * 256u + g * 4u;
            As[q * 64u + g] = vec4<f32>(load_a(ar, p), load_a(ar + 1u, p), load_a(ar + 2u, p), load_a(ar + 3u, p));
            Bs[q * 64u + g] = vec4<f32>(load_b(p, bc), load_b(p, bc + 1u), load_b(p, bc + 2u), load_b(p, bc + 3u));
        }
        workgroupBarrier();
        for (var s = 0u; s < DEPTH; s = s + 1u) {
            let a0 = As[s * 64u + ty * 4u];
            let a1 = As[s * 64u + ty * 4u + 1u];
            let a2 = As[s * 64u + ty * 4u + 2u];
            let a3 = As[s * 64u + ty * 4u + 3u];
            let b0 = Bs[s * 64u + tx * 4u];
            let b1 = Bs[s * 64u + tx * 4u + 1u];
            let b2 = Bs[s * 64u + tx * 4u + 2u];
            let b3 = Bs[s * 64u + tx * 4u + 3u];
            c00 = c00 + outer(a0, b0);
            c01 = c01 + outer(a0, b1);
            c02 = c02 + outer(a0, b2);
            c03 = c03 + outer(a0, b3);
            c10 = c10 + outer(a1, b0);
            c11 = c11 + outer(a1, b1);
            c12 = c12 + outer(a1, b2);
            c13 = c13 + outer(a1, b3);
            c20 = c20 + outer(a2, b0);
            c21 = c21 + outer(a2, b1);
            c22 = c22 + outer(a2, b2);
            c23 = c23 + outer(a2, b3);
            c30 = c30 + outer(a3, b0);
            c31 = c31 + outer(a3, b1);
            c32 = c32 + outer(a3, b2);
            c33 = c33 + outer(a3, b3);
        }
        workgroupBarrier();
    }
    store_block(row0, col0, c00);
    store_block(row0, col0 + 4u, c01);
    store_block(row0, col0 + 8u, c02);
    store_block(row0, col0 + 12u, c03);
    store_block(row0 + 4u, col0, c10);
    store_block(row0 + 4u, col0 + 4u, c11);
    store_block(row0 + 4u, col0 + 8u, c12);
    store_block(row0 + 4u, col0 + 12u, c13);
    store_block(row0 + 8u, col0, c20);
    store_block(row0 + 8u, col0 + 4u, c21);
    store_block(row0 + 8u, col0 + 8u, c22);
    store_block(row0 + 8u, col0 + 12u, c23);
    store_block(row0 + 12u, col0, c30);
    store_block(row0 + 12u, col0 + 4u, c31);
    store_block(row0 + 12u, col0 + 8u, c32);
    store_block(row0 + 12u, col0 + 12u, c33);
}
