//! `exp` and `ln` in f32 from +, −, ×, ÷ and bit operations only. Those operations are
//! correctly rounded on every adapter, so these functions give the same bits in the
//! CPU twin and in the WGSL stages (`shaders/numeric.wgsl`'s `exp_cmm` and `ln_cmm`
//! mirror them operation for operation), where WGSL's own `exp` and `log` are only
//! accurate to a few ULP and differ between drivers and from the host's libm.
//!
//! Results below the smallest normal f32 are 0 (`exp`) or −∞ (`ln` of such an
//! argument): adapters that flush subnormals would otherwise disagree. Elsewhere `exp`
//! stays within 2 ULP and `ln` within 3 of the exact value (tested against f64), inside
//! what the tolerances assume of WGSL's `exp` and `log`.
//!
//! Shader compilers rewrite float expressions (Mesa folds `1 + (1 − q)` into `2 − q`,
//! factors `2s + s·q` into `s·(2 + q)`, gathers constant factors): every expression here
//! and in the shaders is written in the form those rewrites reach, so that no rewrite
//! is left to change a rounding. `conformance/tests/bit_identity.rs` checks the result.

/// log2(e), rounded to f32.
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
/// ln 2 split as Cody and Waite do: a high part whose products with |n| ≤ 128 are exact,
/// and the rest.
const LN2_HI: f32 = f32::from_bits(0x3f31_8000);
const LN2_LO: f32 = f32::from_bits(0xb95e_8083);
/// 1/k! for k = 2..7, rounded to f32: e^r's Taylor series on |r| ≤ ln2/2 (its tail is
/// below 2⁻²⁷ there).
const EXP_COEFFICIENTS: [f32; 6] = [
    f32::from_bits(0x3f00_0000), // 1/2
    f32::from_bits(0x3e2a_aaab), // 1/6
    f32::from_bits(0x3d2a_aaab), // 1/24
    f32::from_bits(0x3c08_8889), // 1/120
    f32::from_bits(0x3ab6_0b61), // 1/720
    f32::from_bits(0x3950_0d01), // 1/5040
];
/// Below this, e^x is under the smallest normal f32 and `exp_f32` returns 0.
const EXP_LOW: f32 = -87.0;
/// Above this, e^x overflows f32.
const EXP_HIGH: f32 = f32::from_bits(0x42b1_7217); // 88.72283
/// √2: ln's mantissa is reduced to [√2/2, √2).
const SQRT2: f32 = f32::from_bits(0x3fb5_04f3);
/// 2/(2k+1) for k = 1..4: ln m = 2·atanh(s) = s·(2 + z·(2/3 + z·(2/5 + z·(2/7 + z·2/9))))
/// with z = s², |s| ≤ 0.172 (its tail is below 2⁻³⁰ there).
const LN_COEFFICIENTS: [f32; 4] = [
    f32::from_bits(0x3f2a_aaab), // 2/3
    f32::from_bits(0x3ecc_cccd), // 2/5
    f32::from_bits(0x3e92_4925), // 2/7
    f32::from_bits(0x3e63_8e39), // 2/9
];

/// e^x in f32, as `exp_cmm` in `shaders/numeric.wgsl` computes it.
pub fn exp_f32(x: f32) -> f32 {
    if x > EXP_HIGH {
        return f32::INFINITY;
    }
    if x < EXP_LOW {
        return 0.0;
    }
    // x = n·ln2 + r, |r| ≤ ln2/2 (a NaN falls through and stays NaN).
    let n = (x * LOG2E + 0.5).floor();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let c = EXP_COEFFICIENTS;
    let mut p = c[5];
    p = p * r + c[4];
    p = p * r + c[3];
    p = p * r + c[2];
    p = p * r + c[1];
    p = p * r + c[0];
    p = p * r + 1.0;
    p = p * r + 1.0;
    // × 2ⁿ, n ∈ [−125, 128]: 2¹²⁸ is not an f32, so the top step goes in two.
    let n = n as i32;
    if n > 127 {
        return (p * 2.0) * f32::from_bits(((127 + 127) as u32) << 23);
    }
    p * f32::from_bits(((n + 127) as u32) << 23)
}

/// ln x in f32, as `ln_cmm` in `shaders/numeric.wgsl` computes it.
pub fn ln_f32(x: f32) -> f32 {
    if x < 0.0 {
        return f32::NAN;
    }
    if x < f32::MIN_POSITIVE {
        return f32::NEG_INFINITY;
    }
    if x > f32::MAX {
        return x;
    }
    // x = m·2^e, m ∈ [√2/2, √2).
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if m > SQRT2 {
        m *= 0.5;
        e += 1;
    }
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let c = LN_COEFFICIENTS;
    let q = z * (c[0] + z * (c[1] + z * (c[2] + z * c[3])));
    // s·(2 + q), not 2s + s·q: Mesa's algebraic rewrites factor the latter into the
    // former, and every executor must round alike.
    let ln_m = s * (2.0 + q);
    let e = e as f32;
    e * LN2_HI + (e * LN2_LO + ln_m)
}

/// GeLU's constants and its evaluation in f32, as every executor runs
/// [`crate::plan::Pointwise`]; `crate::linear` bounds the evaluation's error.
/// √(2/π) in f32.
pub const GELU_C: f32 = 0.797_884_6;
/// The cubic coefficient.
pub const GELU_K: f32 = 0.044_715;

/// Where t has saturated to ±1 in f32 (from |x| ≈ 4.6 on).
pub const GELU_CLAMP: f32 = 30.0;

/// q = 2/(e + 1) = 1 − tanh(u) for the clamped x: t = 1 − q. The formulas below use
/// `2 − q` for 1 + t and `(k·x)·(x·x)` for k·x³, the forms a shader compiler's
/// algebraic rewrites reach anyway (Mesa folds 1 + (1 − q) into 2 − q, and its GL path
/// turns ((k·x)·x)·x into (k·x)·(x·x)), so that every executor rounds alike.
fn one_minus_tanh(xc: f32) -> f32 {
    let inner = GELU_C * (xc + (GELU_K * xc) * (xc * xc));
    let e = exp_f32(2.0 * inner);
    2.0 / (e + 1.0)
}

/// GeLU in f32, as every executor evaluates it (the CPU twin).
pub fn gelu(x: f32) -> f32 {
    let q = one_minus_tanh(x.clamp(-GELU_CLAMP, GELU_CLAMP));
    0.5 * x * (2.0 - q)
}

/// gelu'(x) in f32, as every executor evaluates it (the CPU twin).
pub fn gelu_grad(x: f32) -> f32 {
    let xc = x.clamp(-GELU_CLAMP, GELU_CLAMP);
    let q = one_minus_tanh(xc);
    let t = 1.0 - q;
    let s = 1.0 - t * t;
    // ½·x·c as x·(½c): the grouping Mesa's rewrites give the shader's constants.
    0.5 * (2.0 - q) + xc * (0.5 * GELU_C) * s * (1.0 + 3.0 * GELU_K * xc * xc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gelu_clamp_changes_nothing() {
        // Just inside it, t and 1 − t² are already saturated.
        assert_eq!(one_minus_tanh(GELU_CLAMP - 1.0), 0.0);
        assert_eq!(one_minus_tanh(1.0 - GELU_CLAMP), 2.0);
    }

    /// Distance in units of the last place of the f32 nearest `exact`.
    fn ulps(got: f32, exact: f64) -> f64 {
        let nearest = exact as f32;
        let ulp = (f32::from_bits(nearest.abs().to_bits() + 1) - nearest.abs()) as f64;
        (got as f64 - exact).abs() / ulp
    }

    #[test]
    fn the_constants_are_what_they_say() {
        assert_eq!(LOG2E, std::f64::consts::LOG2_E as f32);
        assert!(((LN2_HI as f64 + LN2_LO as f64) - std::f64::consts::LN_2).abs() < 1e-10);
        assert_eq!(LN2_HI.to_bits() & 0xfff, 0, "few enough bits that n·LN2_HI is exact");
        let factorials = [2.0, 6.0, 24.0, 120.0, 720.0, 5040.0];
        for (c, f) in EXP_COEFFICIENTS.iter().zip(factorials) {
            assert_eq!(*c, (1.0 / f) as f32);
        }
        for (k, c) in LN_COEFFICIENTS.iter().enumerate() {
            assert_eq!(*c, (2.0 / (2 * k + 3) as f64) as f32);
        }
        assert_eq!(SQRT2, std::f64::consts::SQRT_2 as f32);
        assert_eq!(EXP_HIGH, 88.72283);
    }

    #[test]
    fn exp_is_within_two_ulp_and_saturates_as_documented() {
        let mut worst: f64 = 0.0;
        for i in 0..=400_000 {
            let x = EXP_LOW + (EXP_HIGH - EXP_LOW) * i as f32 / 400_000.0;
            worst = worst.max(ulps(exp_f32(x), (x as f64).exp()));
        }
        for x in [0.0f32, -0.0, 1e-30, -1e-30, 1e-8, 0.5, -0.5, 1.0, -1.0, 10.0, -10.0] {
            worst = worst.max(ulps(exp_f32(x), (x as f64).exp()));
        }
        assert!(worst <= 2.0, "worst {worst} ULP");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(88.8), f32::INFINITY);
        assert_eq!(exp_f32(-87.5), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn ln_is_within_two_ulp_and_saturates_as_documented() {
        let mut worst: f64 = 0.0;
        let mut x = f32::MIN_POSITIVE;
        while x < f32::MAX / 1.001 {
            for y in [x, x * 1.37, x * SQRT2 * 0.9999, x * SQRT2 * 1.0001, x * 1.9] {
                let exact = (y as f64).ln();
                if exact.abs() > 1e-3 {
                    worst = worst.max(ulps(ln_f32(y), exact));
                }
            }
            x *= 1.001;
        }
        // Near 1, where ln is small: relative to its own size.
        for i in 1..10_000 {
            let y = 1.0 + i as f32 * 1e-5;
            worst = worst.max(ulps(ln_f32(y), (y as f64).ln()));
            let y = 1.0 - i as f32 * 1e-5;
            worst = worst.max(ulps(ln_f32(y), (y as f64).ln()));
        }
        assert!(worst <= 3.0, "worst {worst} ULP");
        assert_eq!(ln_f32(1.0), 0.0);
        assert_eq!(ln_f32(0.0), f32::NEG_INFINITY);
        assert_eq!(ln_f32(1e-40), f32::NEG_INFINITY);
        assert!(ln_f32(-1.0).is_nan());
        assert_eq!(ln_f32(f32::INFINITY), f32::INFINITY);
    }
}
