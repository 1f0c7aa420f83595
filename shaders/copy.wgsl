// Strided 2D copy of 32-bit words between two regions of the heap (local or across
// virtual devices). One invocation per element, no loop. CPU twin: `Op::Copy` in
// cmm-core `cpu/mod.rs`. Rows beyond the 65,535 workgroups of one dimension are split
// into several dispatches by the host through `row_begin`.

struct CopyParams {
    rows: u32,
    cols: u32,
    row_begin: u32,
    src_off: u32,
    src_stride: u32,
    dst_off: u32,
    dst_stride: u32,
    _pad: u32,
}

@group(0) @binding(1) var<uniform> P: CopyParams;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = P.row_begin + gid.y;
    if (c >= P.cols || r >= P.rows) {
        return;
    }
    st(P.dst_off + r * P.dst_stride + c, ld(P.src_off + r * P.src_stride + c));
}
