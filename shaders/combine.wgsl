// Top-k weighted combine: out[t] = Σ_slot w[t, slot] · rows[inv[t, slot]] over the
// slots in order whose row exists (inv below the row count), f32, rounded once to
// out's dtype. One invocation per (token, column), a loop over the slots. CPU twin:
// `Op::Combine` in cmm-core `cpu.rs`.

struct CombineParams {
    rows: u32,
    cols: u32,
    row_begin: u32,
    slots: u32,
    src_off: u32,
    src_stride: u32,
    src_dtype: u32,
    src_rows: u32,
    w_off: u32,
    w_stride: u32,
    inv_off: u32,
    inv_stride: u32,
    out_off: u32,
    out_stride: u32,
    out_dtype: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read_write> mem: array<u32>;
@group(0) @binding(1) var<uniform> P: CombineParams;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = P.row_begin + gid.y;
    if (c >= P.cols || t >= P.rows) {
        return;
    }
    var acc = 0.0;
    for (var s = 0u; s < P.slots; s = s + 1u) {
        let row = mem[P.inv_off + t * P.inv_stride + s];
        if (row < P.src_rows) {
            let w = bitcast<f32>(mem[P.w_off + t * P.w_stride + s]);
            acc = acc + w * decode(mem[P.src_off + row * P.src_stride + c], P.src_dtype);
        }
    }
    mem[P.out_off + t * P.out_stride + c] = encode(acc, P.out_dtype);
}
