// Elementwise functions of `Op::Pointwise` (the MLP block's GeLU and its backward),
// evaluated in f32 and rounded once to the output dtype. One invocation per element,
// no loop. CPU twin: `Pointwise::apply` in cmm-core (`core/src/linear/gelu.rs`), whose
// operation order this follows exactly: clamp, u = c·(x + (k·x)·(x·x)), e = exp_cmm(2u),
// q = 2/(e + 1), t = 1 − q, 1 + t written 2 − q.
//
// function 0: out = gelu(in0); function 1: out = in0 · gelu'(in1).

struct PointwiseParams {
    rows: u32,
    cols: u32,
    row_begin: u32,
    function: u32,
    out_off: u32,
    out_stride: u32,
    out_dtype: u32,
    _pad: u32,
    // Per input: offset, stride, dtype, unused.
    inputs: array<vec4<u32>, 2>,
}

@group(0) @binding(1) var<uniform> P: PointwiseParams;

const GELU_C: f32 = 0.7978846;
const GELU_K: f32 = 0.044715;
const GELU_CLAMP: f32 = 30.0;

fn input_value(t: u32, r: u32, c: u32) -> f32 {
    let d = P.inputs[t];
    return decode(ld(d.x + r * d.y + c), d.z);
}

// q = 2/(e + 1) = 1 − tanh(u); 1 + t is written 2 − q and k·x³ as (k·x)·(x·x), the
// forms Mesa's algebraic rewrites reach anyway (its GL path turns ((k·x)·x)·x into
// the latter), so that this stage and its twin round alike on every backend.
fn one_minus_tanh(xc: f32) -> f32 {
    let inner = GELU_C * (xc + (GELU_K * xc) * (xc * xc));
    let e = exp_cmm(2.0 * inner);
    return 2.0 / (e + 1.0);
}

fn gelu(x: f32) -> f32 {
    let q = one_minus_tanh(clamp(x, -GELU_CLAMP, GELU_CLAMP));
    return 0.5 * x * (2.0 - q);
}

fn gelu_grad(x: f32) -> f32 {
    let xc = clamp(x, -GELU_CLAMP, GELU_CLAMP);
    let q = one_minus_tanh(xc);
    let t = 1.0 - q;
    let s = 1.0 - t * t;
    // ½·x·c as x·(½c): the grouping Mesa's rewrites give these constants anyway.
    return 0.5 * (2.0 - q) + xc * (0.5 * GELU_C) * s * (1.0 + 3.0 * GELU_K * xc * xc);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let r = P.row_begin + gid.y;
    if (c >= P.cols || r >= P.rows) {
        return;
    }
    var v: f32;
    if (P.function == 0u) {
        v = gelu(input_value(0u, r, c));
    } else {
        v = input_value(0u, r, c) * gelu_grad(input_value(1u, r, c));
    }
    st(P.out_off + r * P.out_stride + c, encode(v, P.out_dtype));
}
