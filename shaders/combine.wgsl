// Top-k weighted combine: out[t] = Σ_slot w[t, slot] · rows[inv[t, slot]] over the
// slots in order whose row exists (inv below the row count), f32, rounded once to
// out's dtype. One invocation per (token, column), a loop over the slots. CPU twin:
// `Op::Combine` in cmm-core `cpu/mod.rs`.

struct CombineParams {
    cols: u32,
    slots: u32,
    row_begin: u32,
    _pad: u32,
    // Per operand: word offset, row stride, dtype, rows.
    src: vec4<u32>,
    weights: vec4<u32>,
    inv: vec4<u32>,
    out: vec4<u32>,
}

@group(0) @binding(1) var<uniform> P: CombineParams;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = P.row_begin + gid.y;
    if (c >= P.cols || t >= P.out.w) {
        return;
    }
    var acc = 0.0;
    for (var s = 0u; s < P.slots; s = s + 1u) {
        let row = ld(P.inv.x + t * P.inv.y + s);
        if (row < P.src.w) {
            let w = bitcast<f32>(ld(P.weights.x + t * P.weights.y + s));
            acc = acc + w * decode(ld(P.src.x + row * P.src.y + c), P.src.z);
        }
    }
    st(P.out.x + t * P.out.y + c, encode(acc, P.out.z));
}
