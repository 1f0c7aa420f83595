//! Tolerances for comparing a backend's output with the f64 oracle, built on `approx`.
//!
//! A GEMM output element is a sum of K products accumulated in f32 (in an order the
//! algorithm chooses) and rounded once to the output dtype. Whatever the order, its
//! error is at most `γ(K+1)·Σ|a·b| + u_out·|c|` (Higham, *Accuracy and Stability of
//! Numerical Algorithms*, §3.1), where γ(n) = n·u/(1 − n·u) with u the f32 unit
//! roundoff and u_out that of the output dtype. The presets encode that bound: it
//! scales with K and can never fail a correct reduction, while a wrong block, a wrong
//! slot or a lost partial sum is off by O(|c|) and fails.

use crate::dtype::DType;

/// A tolerance: `|got − want| ≤ accumulation·magnitude + floor`, or relatively within
/// `rounding` (checked with `approx::relative_eq!`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Relative error allowed for the final rounding to the output dtype.
    pub rounding: f64,
    /// Error allowed per unit of Σ|a·b| for the f32 accumulation.
    pub accumulation: f64,
    /// An absolute floor (for results that underflow).
    pub floor: f64,
}

/// The worst element of a comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Worst {
    /// Index of the element in the compared slice.
    pub index: usize,
    /// The backend's value.
    pub got: f64,
    /// The oracle's value.
    pub expected: f64,
    /// Absolute error.
    pub error: f64,
    /// The allowed error at that element.
    pub allowed: f64,
}

impl Tolerance {
    /// Bit-exact: no error allowed at all.
    pub const EXACT: Tolerance = Tolerance { rounding: 0.0, accumulation: 0.0, floor: 0.0 };

    /// Output rounding to f32, before scaling with K.
    pub const F32: Tolerance = Tolerance { rounding: f32::EPSILON as f64 / 2.0, accumulation: 0.0, floor: 1e-30 };

    /// Output rounding to f16, before scaling with K.
    pub const F16: Tolerance = Tolerance { rounding: 1.0 / 2048.0, accumulation: 0.0, floor: 6e-8 };

    /// Output rounding to bf16, before scaling with K.
    pub const BF16: Tolerance = Tolerance { rounding: 1.0 / 256.0, accumulation: 0.0, floor: 1e-30 };

    /// The preset for an output dtype.
    pub fn for_output(dtype: DType) -> Tolerance {
        match dtype {
            DType::F32 => Tolerance::F32,
            DType::F16 => Tolerance::F16,
            DType::Bf16 => Tolerance::BF16,
            DType::U32 => Tolerance::EXACT,
        }
    }

    /// Adds the f32 accumulation error of a K-term dot product: γ(K+1).
    pub fn with_k(self, k: usize) -> Tolerance {
        let u = DType::F32.unit_roundoff();
        let nu = (k + 1) as f64 * u;
        Tolerance { accumulation: nu / (1.0 - nu), ..self }
    }

    /// The preset for a GEMM of depth `k` rounded to `output`.
    pub fn gemm(output: DType, k: usize) -> Tolerance {
        Tolerance::for_output(output).with_k(k)
    }

    /// Whether one element is within tolerance; `magnitude` is Σ|a·b| for it.
    pub fn accepts(&self, got: f64, expected: f64, magnitude: f64) -> bool {
        if got.is_nan() || expected.is_nan() {
            return false;
        }
        // The rounding of the accumulated value can add `rounding` relative to the
        // accumulated value, which is itself within the accumulation bound.
        let epsilon = self.accumulation * magnitude * (1.0 + self.rounding) + self.floor;
        approx::relative_eq!(got, expected, epsilon = epsilon, max_relative = self.rounding)
            || (got - expected).abs() <= epsilon + self.rounding * expected.abs()
    }

    /// The largest error [`Tolerance::accepts`] allows for an element.
    pub fn allowed(&self, expected: f64, magnitude: f64) -> f64 {
        self.accumulation * magnitude * (1.0 + self.rounding) + self.floor + self.rounding * expected.abs()
    }

    /// An element's error as a fraction of [`Tolerance::allowed`] (infinite for NaN).
    pub fn error_ratio(&self, got: f64, expected: f64, magnitude: f64) -> f64 {
        if got.is_nan() || expected.is_nan() {
            return f64::INFINITY;
        }
        (got - expected).abs() / self.allowed(expected, magnitude).max(f64::MIN_POSITIVE)
    }

    /// Compares `got` with `expected`, returning the element with the largest error
    /// relative to its allowance, and whether every element passed.
    pub fn compare(&self, got: &[f64], expected: &[f64], magnitudes: &[f64]) -> (bool, Option<Worst>) {
        let mut ok = got.len() == expected.len();
        let mut worst: Option<(f64, Worst)> = None;
        for (index, ((&g, &e), &m)) in got.iter().zip(expected).zip(magnitudes).enumerate() {
            let allowed = self.allowed(e, m);
            let error = if g.is_nan() || e.is_nan() { f64::INFINITY } else { (g - e).abs() };
            let pass = self.accepts(g, e, m);
            ok &= pass;
            let score = if pass { self.error_ratio(g, e, m) } else { f64::INFINITY };
            let better = match &worst {
                None => true,
                Some((s, w)) => score > *s || (score == *s && !pass && error > w.error),
            };
            if better {
                worst = Some((score, Worst { index, got: g, expected: e, error, allowed }));
            }
        }
        (ok, worst.map(|(_, w)| w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_scale_with_k() {
        let small = Tolerance::gemm(DType::F32, 16);
        let large = Tolerance::gemm(DType::F32, 4096);
        assert!(large.accumulation > 200.0 * small.accumulation);
        let rounding: Vec<f64> = DType::ALL.iter().map(|&d| Tolerance::for_output(d).rounding).collect();
        assert!(rounding[2] > rounding[1] && rounding[1] > rounding[0], "{rounding:?}");
    }

    #[test]
    fn accepts_rounding_and_rejects_a_wrong_value() {
        let t = Tolerance::gemm(DType::Bf16, 64);
        let exact = 1.234_567;
        let rounded = DType::Bf16.round(exact as f32) as f64;
        assert!(t.accepts(rounded, exact, 10.0));
        assert!(!t.accepts(rounded + 0.1, exact, 10.0));
        assert!(!t.accepts(f64::NAN, exact, 10.0));
        assert!(!Tolerance::EXACT.accepts(1.0 + 1e-12, 1.0, 1.0));
    }

    #[test]
    fn compare_reports_the_worst_element() {
        let t = Tolerance::gemm(DType::F32, 8);
        let (ok, worst) = t.compare(&[1.0, 2.5, 3.0], &[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]);
        assert!(!ok);
        let w = worst.unwrap();
        assert_eq!((w.index, w.got, w.expected), (1, 2.5, 2.0));
    }
}
