// Attention states per (row, head), one invocation each: function 0 merges the state
// `from` into `into` (`Op::AttnMerge`), function 1 normalises `into` into the output
// and the log-sum-exp (`Op::AttnFinish`). CPU twins: `cmm_core::attention::online`'s
// `merge` and `finish`, whose operation order this follows. An empty state has l = 0
// (its max is −f32::MAX: no infinities, which WGSL lets implementations assume away).

struct AttnStateParams {
    function: u32,
    rows: u32,
    heads: u32,
    head_dim: u32,
    row_begin: u32,
    out_dtype: u32,
    _pad0: u32,
    _pad1: u32,
    // Offset, stride of max, sum, acc of `from` and of `into` (f32).
    from_m: vec4<u32>,
    from_l: vec4<u32>,
    from_acc: vec4<u32>,
    into_m: vec4<u32>,
    into_l: vec4<u32>,
    into_acc: vec4<u32>,
    // Offset, stride of the output (function 1) and of the log-sum-exp (f32).
    out: vec4<u32>,
    lse: vec4<u32>,
}

@group(0) @binding(1) var<uniform> P: AttnStateParams;

const EMPTY_MAX: f32 = -3.40282347e+38;

fn word(t: vec4<u32>, r: u32, c: u32) -> u32 {
    return t.x + r * t.y + c;
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = P.row_begin + gid.x / P.heads;
    let h = gid.x % P.heads;
    if (r >= P.rows) {
        return;
    }
    let dh = P.head_dim;
    let m1 = bitcast<f32>(ld(word(P.into_m, r, h)));
    let l1 = bitcast<f32>(ld(word(P.into_l, r, h)));
    if (P.function == 1u) {
        if (l1 == 0.0) {
            for (var c = 0u; c < dh; c = c + 1u) {
                st(word(P.out, r, h * dh + c), encode(0.0, P.out_dtype));
            }
            st(word(P.lse, r, h), bitcast<u32>(EMPTY_MAX));
            return;
        }
        for (var c = 0u; c < dh; c = c + 1u) {
            let a = bitcast<f32>(ld(word(P.into_acc, r, h * dh + c)));
            st(word(P.out, r, h * dh + c), encode(a / l1, P.out_dtype));
        }
        st(word(P.lse, r, h), bitcast<u32>(m1 + ln_cmm(l1)));
        return;
    }
    let m2 = bitcast<f32>(ld(word(P.from_m, r, h)));
    let l2 = bitcast<f32>(ld(word(P.from_l, r, h)));
    if (l2 == 0.0) {
        return;
    }
    if (l1 == 0.0) {
        st(word(P.into_m, r, h), bitcast<u32>(m2));
        st(word(P.into_l, r, h), bitcast<u32>(l2));
        for (var c = 0u; c < dh; c = c + 1u) {
            st(word(P.into_acc, r, h * dh + c), ld(word(P.from_acc, r, h * dh + c)));
        }
        return;
    }
    let m = max(m1, m2);
    let a1 = exp_cmm(m1 - m);
    let a2 = exp_cmm(m2 - m);
    st(word(P.into_m, r, h), bitcast<u32>(m));
    st(word(P.into_l, r, h), bitcast<u32>(l1 * a1 + l2 * a2));
    for (var c = 0u; c < dh; c = c + 1u) {
        let x = bitcast<f32>(ld(word(P.into_acc, r, h * dh + c)));
        let y = bitcast<f32>(ld(word(P.from_acc, r, h * dh + c)));
        st(word(P.into_acc, r, h * dh + c), bitcast<u32>(x * a1 + y * a2));
    }
}
