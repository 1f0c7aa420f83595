// The input generator: element (r, c) of a buffer is element
// (row0 + r) * global_cols + col0 + c of global tensor `tensor`, a pure function of
// (seed, tensor, index). CPU twin: cmm-core `generator.rs` (`raw_value`, `mix32`,
// `tensor_key`). Integer operations only, so the bits match exactly.

struct GenerateParams {
    rows: u32,
    cols: u32,
    row_begin: u32,
    dst_off: u32,
    dtype: u32,
    family: u32, // 0 = exact, 1 = realistic
    seed: u32,
    tensor: u32,
    global_cols: u32,
    row0: u32,
    col0: u32,
    _pad: u32,
}

@group(0) @binding(1) var<uniform> P: GenerateParams;

fn mix32(v: u32) -> u32 {
    var x = v;
    x = x ^ (x >> 16u);
    x = x * 0x7feb352du;
    x = x ^ (x >> 15u);
    x = x * 0x846ca68bu;
    x = x ^ (x >> 16u);
    return x;
}

fn tensor_key(seed: u32, tensor: u32) -> u32 {
    return mix32(mix32(seed ^ 0x5bd1e995u) ^ (tensor * 0x9e3779b9u));
}

fn raw_value(key: u32, index: u32, family: u32) -> f32 {
    let h = mix32(key ^ index);
    if (family == 0u) {
        return f32(i32(h % 5u) - 2);
    }
    let h2 = mix32(h ^ 0x85ebca6bu);
    let sum = (h & 0xffffu) + (h >> 16u) + (h2 & 0xffffu) + (h2 >> 16u);
    return f32(i32(sum) - 131070) * (1.0 / 32768.0);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = P.row_begin + gid.y;
    if (c >= P.cols || r >= P.rows) {
        return;
    }
    let index = (P.row0 + r) * P.global_cols + P.col0 + c;
    let key = tensor_key(P.seed, P.tensor);
    st(P.dst_off + r * P.cols + c, encode(raw_value(key, index, P.family), P.dtype));
}
