//! GeLU, tanh form (what Megatron-LM's fused bias-GeLU computes), as every executor
//! evaluates it, and the bound on that evaluation's error the oracle allows.
//!
//! ```text
//! gelu(x)  = ½·x·(1 + t),   t = tanh(u),   u = c·(x + k·x³),   c = √(2/π), k = 0.044715
//! gelu'(x) = ½·(1 + t) + ½·x·(1 − t²)·c·(1 + 3k·x²)
//! ```
//!
//! Every backend evaluates it in f32 with the same operations: x is clamped to ±30
//! for t and for gelu' (beyond, t is ±1 and 1 − t² is 0 exactly in f32, so the clamp
//! changes no value and keeps x³ and 3k·x² finite), `u = c·(x + (k·x)·(x·x))`,
//! `e = exp(2u)` ([`crate::numeric::exp_f32`]), `q = 2/(e + 1)` (no tanh builtin: WGSL
//! leaves its accuracy loose), `t = 1 − q`, then the two formulas above with 1 + t
//! written `2 − q`. The CPU twin is [`gelu`] and [`gelu_grad`]; the shader
//! `shaders/pointwise.wgsl` and the kernel `cuda/kernels/pointwise.cu` mirror it.
//!
//! [`eval_error`] bounds |f32 evaluation − exact value| at an f32 input x, to first
//! order in the unit roundoff u = 2⁻²⁴, from the accuracy WGSL guarantees for `exp`
//! ((3 + 2|y|) ULP at y, the loosest of the backends: CUDA's `expf` is within 2 ULP,
//! Rust's within 1) and one rounding per arithmetic operation:
//!
//! - u's five operations and the f32 constants: |δu| ≤ 7u·|u|;
//! - e: relative error ≤ (6 + 8|u|)·u from `exp` plus 2|δu| from its argument;
//! - t = 1 − 2/(e + 1): dt/de·e = (1 − t²)/2, so |δt| ≤ (1 − t²)/2 · rel(e) + 5u;
//! - gelu: |δg| ≤ ½|x|·(|δt| + 2u) + 2u·|g|;
//! - gelu': with s = 1 − t² (|δs| ≤ 2|t||δt| + 2u) and p = 1 + 3k·x² (|δp| ≤ 4u·p),
//!   |δg'| ≤ ½|δt| + u + ½|x|c·(p|δs| + s|δp|) + 5u·|½x·s·c·p| + 2u·|g'|.
//!
//! The result is scaled by 1.01 to cover the second-order terms dropped above.

pub use crate::numeric::{gelu, gelu_grad};

/// sup |gelu'(x)| over all x (1.1290 at x ≈ 1.77), rounded up: the Lipschitz constant
/// that carries an input error through GeLU.
pub const GELU_LIPSCHITZ: f64 = 1.13;

/// sup |gelu''(x)| over all x (√(2/π) = 0.7979 at x = 0), rounded up: carries an input
/// error through gelu'.
pub const GELU_GRAD_LIPSCHITZ: f64 = 0.80;

const C64: f64 = 0.797_884_560_802_865_4; // √(2/π)
const K64: f64 = 0.044_715;

/// The exact tanh-form GeLU, in f64.
pub fn gelu_exact(x: f64) -> f64 {
    0.5 * x * (1.0 + (C64 * (x + K64 * x * x * x)).tanh())
}

/// The exact derivative of [`gelu_exact`], in f64.
pub fn gelu_grad_exact(x: f64) -> f64 {
    let t = (C64 * (x + K64 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C64 * (1.0 + 3.0 * K64 * x * x)
}

/// Bounds on |[`gelu`]`(x) − gelu(x)|` and |[`gelu_grad`]`(x) − gelu'(x)|` at an f32 input
/// (see the module comment for the derivation).
pub fn eval_error(x: f64) -> (f64, f64) {
    let u = f32::EPSILON as f64 / 2.0;
    let inner = C64 * (x + K64 * x * x * x);
    let t = inner.tanh();
    let d_inner = 7.0 * u * inner.abs();
    let rel_e = (6.0 + 8.0 * inner.abs()) * u + 2.0 * d_inner;
    let dt = (1.0 - t * t) / 2.0 * rel_e + 5.0 * u;
    let g = gelu_exact(x);
    let dg = 0.5 * x.abs() * (dt + 2.0 * u) + 2.0 * u * g.abs();
    let s = 1.0 - t * t;
    let p = 1.0 + 3.0 * K64 * x * x;
    let ds = 2.0 * t.abs() * dt + 2.0 * u;
    let dp = 4.0 * u * p;
    let q = 0.5 * x * s * C64 * p;
    let dq = 0.5 * x.abs() * C64 * (p * ds + s * dp) + 5.0 * u * q.abs();
    let dgrad = 0.5 * dt + u + dq + 2.0 * u * gelu_grad_exact(x).abs();
    (1.01 * dg, 1.01 * dgrad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lipschitz_constants_bound_the_derivatives() {
        let (mut d1, mut d2) = (0.0f64, 0.0f64);
        for i in -400_000..=400_000 {
            let x = i as f64 / 10_000.0;
            d1 = d1.max(gelu_grad_exact(x).abs());
            let h = 1e-5;
            d2 = d2.max(((gelu_grad_exact(x + h) - gelu_grad_exact(x - h)) / (2.0 * h)).abs());
        }
        assert!(d1 <= GELU_LIPSCHITZ && d1 > GELU_LIPSCHITZ - 0.01, "sup|gelu'| = {d1}");
        assert!(d2 <= GELU_GRAD_LIPSCHITZ && d2 > GELU_GRAD_LIPSCHITZ - 0.01, "sup|gelu''| = {d2}");
    }

    #[test]
    fn the_f32_evaluation_is_within_its_bound_everywhere() {
        // Every f32 in [-16, 16] that is a multiple of 2^-12, and a few far out.
        let far = [-1.0e4f32, -300.0, -40.0, 40.0, 300.0, 1.0e4];
        let xs = (-65_536..=65_536).map(|i| i as f32 / 4096.0).chain(far);
        let (mut worst_g, mut worst_d) = (0.0f64, 0.0f64);
        for x in xs {
            let (bg, bd) = eval_error(x as f64);
            let eg = (gelu(x) as f64 - gelu_exact(x as f64)).abs();
            let ed = (gelu_grad(x) as f64 - gelu_grad_exact(x as f64)).abs();
            assert!(eg <= bg, "gelu({x}): error {eg:e} > bound {bg:e}");
            assert!(ed <= bd, "gelu'({x}): error {ed:e} > bound {bd:e}");
            worst_g = worst_g.max(eg / bg);
            worst_d = worst_d.max(ed / bd);
        }
        // The bound is not vacuous: the worst element uses a visible part of it.
        assert!(worst_g > 0.01 && worst_d > 0.01, "{worst_g} {worst_d}");
    }

    #[test]
    fn gelu_saturates_without_nan() {
        assert_eq!(gelu(100.0), 100.0);
        assert_eq!(gelu(-100.0), 0.0);
        assert_eq!(gelu_grad(100.0), 1.0);
        assert_eq!(gelu_grad(-100.0), 0.0);
        assert!(gelu(1e30).is_finite() && gelu_grad(-1e30) == 0.0 && gelu_grad(1e30) == 1.0);
        assert!(gelu(f32::MAX).is_finite() && gelu(-f32::MAX) == 0.0);
    }
}
