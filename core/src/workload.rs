//! Workloads: what a plan must compute, as its oracle states it.
//!
//! A workload names the output buffers a plan leaves on every device and, for a seed
//! and an input family, the f64 value each of their elements must approximate together
//! with the scale of the error a correct run may make there. The conformance runner
//! judges every output of every case this way, whatever the family of problem: the 1D
//! and mesh GEMMs (one output, C), the linear layers (activations, input gradients and
//! fp32 main_grads), and whatever comes next.

use crate::dtype::DType;
use crate::generator::Family;
use crate::oracle::expected_outputs;
use crate::problem::ShardedGemm;
use crate::tolerance::Tolerance;

/// One output a plan must produce, per device, with its oracle.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpectedOutput {
    /// The plan's buffer (role `Output`) holding it.
    pub buffer: String,
    /// Its element type.
    pub dtype: DType,
    /// Rows per device (the largest device's, when they differ).
    pub rows: usize,
    /// Uneven shards: each device's rows, when not all `rows`.
    pub device_rows: Option<Vec<usize>>,
    /// Columns per device.
    pub cols: usize,
    /// Per device, row-major f64 values (computed without intermediate rounding).
    pub values: Vec<Vec<f64>>,
    /// Per device and element, the error scale the tolerance multiplies: Σ|a·b| for a
    /// single GEMM, a derived absolute bound for a chain of ops.
    pub magnitudes: Vec<Vec<f64>>,
    /// How far a correct run may be from `values` in the realistic family.
    pub tolerance: Tolerance,
    /// Where each device's output sits in the global result, in words with the sizes
    /// (exported in `index.json` for users checking their own kernels).
    pub layout: String,
    /// Where each device's output sits in the global matrix, when it is one window of
    /// it (the 1D and mesh GEMMs); empty otherwise. Messages give global positions
    /// from it.
    pub windows: Vec<crate::problem::Window>,
}

/// The layout of an output that is a window of a global matrix on every device:
/// `global` names it (with its shape), then each device's rows and columns.
pub fn window_layout(global: &str, windows: &[crate::problem::Window]) -> String {
    let per_device: Vec<String> = windows
        .iter()
        .enumerate()
        .map(|(d, w)| {
            format!("device {d}: rows {}..{}, columns {}..{}", w.row0, w.row0 + w.rows, w.col0, w.col0 + w.cols)
        })
        .collect();
    format!("a window of {global}; {}", per_device.join("; "))
}

impl ExpectedOutput {
    /// Elements per device (the largest device's, when they differ).
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Rows of device `device`'s output.
    pub fn rows_on(&self, device: usize) -> usize {
        crate::plan::rows_on(self.rows, self.device_rows.as_deref(), device)
    }

    /// Elements of device `device`'s output.
    pub fn len_on(&self, device: usize) -> usize {
        self.rows_on(device) * self.cols
    }

    /// Each device's rows as one text: `26` when even, `7/7/6/6` when not.
    pub fn rows_text(&self) -> String {
        crate::plan::rows_text(self.rows, self.device_rows.as_deref())
    }

    /// Whether the output has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Something plans compute, with its oracle.
pub trait Workload {
    /// Devices every plan of it runs on.
    fn device_count(&self) -> usize;

    /// Every output, in the order goldens store them.
    fn expected(&self, seed: u32, family: Family) -> Vec<ExpectedOutput>;

    /// Why the workload has no exact answer in `family`, if so (the exact family needs
    /// every intermediate value exactly representable, which e.g. GeLU breaks).
    fn unsupported_family(&self, family: Family) -> Option<String> {
        let _ = family;
        None
    }
}

/// The tolerance of a sharded GEMM's output in the realistic family: the GEMM's, widened
/// by the roundings of partial sums that travel in a narrower dtype.
pub fn output_tolerance(problem: &(impl ShardedGemm + ?Sized)) -> Tolerance {
    let global = problem.global();
    let g = Tolerance::gemm(global.output, global.k);
    match problem.partial_rounding() {
        None => g,
        // Each of the `hops` roundings of a running sum to `wire` adds at most u_wire
        // times its magnitude, itself at most Σ|a·b| (up to second order).
        Some((wire, hops)) => {
            let rounded = hops as f64 * wire.unit_roundoff();
            Tolerance { accumulation: (g.accumulation + rounded) * (1.0 + rounded), ..g }
        }
    }
}

impl<T: ShardedGemm> Workload for T {
    fn device_count(&self) -> usize {
        ShardedGemm::device_count(self)
    }

    fn expected(&self, seed: u32, family: Family) -> Vec<ExpectedOutput> {
        let global = self.global();
        let e = expected_outputs(self, seed, family);
        let windows: Vec<_> = (0..self.device_count()).map(|d| self.output_window_of(d)).collect();
        let (rows, device_rows) = crate::plan::per_device_rows(e.rows);
        vec![ExpectedOutput {
            layout: window_layout(&format!("the global C = A·B ({}×{})", global.m, global.n), &windows),
            windows,
            buffer: "C".into(),
            dtype: global.output,
            rows,
            device_rows,
            cols: e.cols,
            values: e.values,
            magnitudes: e.magnitudes,
            tolerance: output_tolerance(self),
        }]
    }

    fn unsupported_family(&self, family: Family) -> Option<String> {
        let (wire, _) = self.partial_rounding()?;
        (family == Family::Exact).then(|| {
            format!(
                "partial sums travelling as {wire} are rounded at every hop, so integer inputs have no exact answer; \
                 run this case in the realistic family"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{OpKind, Problem};

    #[test]
    fn a_sharded_gemm_has_one_output_c_with_the_gemm_tolerance() {
        let p = Problem::new(OpKind::GemmRs, 2, 8, 6, 4, DType::Bf16, DType::Bf16).unwrap();
        let outputs = Workload::expected(&p, 1, Family::Realistic);
        assert_eq!(outputs.len(), 1);
        let c = &outputs[0];
        assert_eq!((c.buffer.as_str(), c.dtype, c.rows, c.cols, c.values.len()), ("C", DType::Bf16, 4, 6, 2));
        assert_eq!(c.tolerance, Tolerance::gemm(DType::Bf16, 4));
        assert!(p.unsupported_family(Family::Exact).is_none());
    }
}
