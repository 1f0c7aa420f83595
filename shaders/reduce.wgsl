// Elementwise sum of up to four regions, left to right in f32, rounded once to the
// output dtype (one input: a conversion). One invocation per element, no loop. CPU
// twin: `Op::Reduce` in cmm-core `cpu/mod.rs`.

struct ReduceParams {
    rows: u32,
    cols: u32,
    row_begin: u32,
    count: u32,
    out_off: u32,
    out_stride: u32,
    out_dtype: u32,
    _pad: u32,
    // Per input: offset, stride, dtype, unused.
    inputs: array<vec4<u32>, 4>,
}

@group(0) @binding(1) var<uniform> P: ReduceParams;

fn input_value(t: u32, r: u32, c: u32) -> f32 {
    let d = P.inputs[t];
    return decode(ld(d.x + r * d.y + c), d.z);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = P.row_begin + gid.y;
    if (c >= P.cols || r >= P.rows) {
        return;
    }
    var acc = input_value(0u, r, c);
    if (P.count > 1u) { acc = acc + input_value(1u, r, c); }
    if (P.count > 2u) { acc = acc + input_value(2u, r, c); }
    if (P.count > 3u) { acc = acc + input_value(3u, r, c); }
    st(P.out_off + r * P.out_stride + c, encode(acc, P.out_dtype));
}
