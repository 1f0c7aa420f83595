// One key block of attention as an online-softmax update (`Op::Attend`). One
// invocation per (query row, head); the dispatch covers keys [key_begin, key_end) of
// the op, a whole number of 16-key tiles counted from the op's first key, so a long
// block split across dispatches rounds exactly as one pass. CPU twin:
// `cmm_core::attention::online::attend`, whose operation order this follows: per tile,
// scores (sum over c in increasing order, then × scale), tile max over visible keys,
// m' = max(m, tile max), α = exp(m − m') (0 for an empty state), l·α then + p_j in key
// order, acc_c·α then + p_j·v_jc in key order.
//
// Loop trips per invocation: 2·dh for the state, and per tile 16·dh + 32 + 17·dh;
// the host sizes dispatches to stay below lavapipe's 65,535 (BRIEF §7).

struct AttendParams {
    rows: u32,
    heads: u32,
    group: u32,
    head_dim: u32,
    key_begin: u32,
    key_end: u32,
    fresh: u32,
    causal: u32,
    q_pos: u32,
    k_pos: u32,
    scale_bits: u32,
    row_begin: u32,
    // Offset, stride, dtype of q, k, v.
    q: vec4<u32>,
    k: vec4<u32>,
    v: vec4<u32>,
    // Offset, stride of the state's max, sum and acc (f32).
    m: vec4<u32>,
    l: vec4<u32>,
    acc: vec4<u32>,
}

@group(0) @binding(1) var<uniform> P: AttendParams;

const TILE: u32 = 16u;
const EMPTY_MAX: f32 = -3.40282347e+38;

fn load(t: vec4<u32>, r: u32, c: u32) -> f32 {
    return decode(ld(t.x + r * t.y + c), t.z);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = P.row_begin + gid.x / P.heads;
    let h = gid.x % P.heads;
    if (r >= P.rows) {
        return;
    }
    let dh = P.head_dim;
    let qc = h * dh;
    let kc = (h / P.group) * dh;
    let scale = bitcast<f32>(P.scale_bits);
    let mw = P.m.x + r * P.m.y + h;
    let lw = P.l.x + r * P.l.y + h;
    let aw = P.acc.x + r * P.acc.y + qc;
    var m = EMPTY_MAX;
    var l = 0.0;
    if (P.fresh == 1u) {
        for (var c = 0u; c < dh; c = c + 1u) {
            st(aw + c, 0u);
        }
    } else {
        m = bitcast<f32>(ld(mw));
        l = bitcast<f32>(ld(lw));
    }
    var s: array<f32, 16>;
    var p: array<f32, 16>;
    var vis: array<u32, 16>;
    for (var t0 = P.key_begin; t0 < P.key_end; t0 = t0 + TILE) {
        let n = min(TILE, P.key_end - t0);
        var tile_max = EMPTY_MAX;
        var any = false;
        for (var t = 0u; t < n; t = t + 1u) {
            let j = t0 + t;
            vis[t] = select(0u, 1u, P.causal == 0u || P.k_pos + j <= P.q_pos + r);
            if (vis[t] == 1u) {
                var dot = 0.0;
                for (var c = 0u; c < dh; c = c + 1u) {
                    dot = dot + load(P.q, r, qc + c) * load(P.k, j, kc + c);
                }
                s[t] = dot * scale;
                if (any) {
                    tile_max = max(tile_max, s[t]);
                } else {
                    tile_max = s[t];
                }
                any = true;
            }
        }
        if (any) {
            let new_max = max(m, tile_max);
            var alpha = 0.0;
            if (l != 0.0) {
                alpha = exp_cmm(m - new_max);
            }
            var sum = l * alpha;
            for (var t = 0u; t < n; t = t + 1u) {
                p[t] = 0.0;
                if (vis[t] == 1u) {
                    p[t] = exp_cmm(s[t] - new_max);
                    sum = sum + p[t];
                }
            }
            for (var c = 0u; c < dh; c = c + 1u) {
                var a = bitcast<f32>(ld(aw + c)) * alpha;
                for (var t = 0u; t < n; t = t + 1u) {
                    if (vis[t] == 1u) {
                        a = a + p[t] * load(P.v, t0 + t, kc + c);
                    }
                }
                st(aw + c, bitcast<u32>(a));
            }
            m = new_max;
            l = sum;
        }
    }
    st(mw, bitcast<u32>(m));
    st(lw, bitcast<u32>(l));
}
