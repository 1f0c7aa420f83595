//! The f64 oracle of the attention family, with an error bound derived per element.
//!
//! Values are exact softmax attention in f64 with the contract's scale σ (the f32 value
//! of 1/√dh). The bound covers every rounding the contract of
//! [`Op::Attend`](crate::plan::Op::Attend), [`Op::AttnMerge`](crate::plan::Op::AttnMerge)
//! and [`Op::AttnFinish`](crate::plan::Op::AttnFinish) allows, whatever the algorithm's
//! block order, with the accuracies of the loosest backend (WGSL: `exp` within
//! 3 + 2|x| ULP, `log` within 2⁻²¹ absolute on [0.5, 2] and 3 ULP elsewhere, `/` within
//! 2.5 ULP; a fused multiply-add only removes roundings). For one (query row, head)
//! with n visible keys, D devices, u = 2⁻²⁴, γ(k) = k·u/(1 − k·u), u_o the output
//! dtype's unit roundoff:
//!
//! - a score s_j = σ·q·k_j is computed with error E_j ≤ γ(dh+1)·σ·Σ_c|q_c·k_jc|; E = max E_j;
//! - each key's weight exp(ŝ_j − m) is perturbed relatively by at most
//!   η = E + 6u·(n + D + 1) + 10u·R, where R = max s − min s + 2E: the subtraction
//!   (u·|x|) and `exp` (2u·(3 + 2|x|)) of its own evaluation, and of every rescale or
//!   merge factor applied to it afterwards (at most n tiles and D − 1 merges, whose
//!   exponents add up to at most R). Errors of the running max cancel: every weight is
//!   divided by the same exp(m), and its telescoping rescales restore it;
//! - the f32 sums of l and acc have at most 2n + D + 2 roundings on any path:
//!   γ₁ = γ(2n + D + 2) relative to Σ w_j·|v_j| (acc) and to |O| (l);
//! - O_c = Σ w_j v_jc: |Ô − O| ≤ [η·Σ w_j|v_jc − O_c| + γ₁·(Σ w_j|v_jc| + |O_c|) + 5u·|O_c|]
//!   ·(1 + 2η + 2γ₁) before its rounding to the output dtype, which adds u_o·|Ô|;
//! - LSE = max + ln Σ exp(s − max): |error| ≤ (η + γ₁ + λ)·(1 + 2η) + u·|LSE|·(1 + 2u),
//!   with λ = max(2⁻²¹, 6u·(ln n + 1)) for the logarithm of l ∈ [1 − η, n·(1 + η)].
//!
//! The conformance check accepts |got − value| ≤ bound (plus the dtype's underflow
//! floor). There is no exact family: exponentials of integers are not representable.

use super::{AttentionProblem, Layout, TENSOR_K, TENSOR_Q, TENSOR_V};
use crate::dtype::DType;
use crate::generator::{element, Family};
use crate::plan::attention_scale;
use crate::tolerance::Tolerance;
use crate::workload::{ExpectedOutput, Workload};

/// Why attention has no exact family.
pub const ORACLE_CHECK: &str =
    "attention has no exact family: softmax's exponentials of small integers are not representable, \
     so no backend can match bit for bit; realistic cases are judged against the derived bound";

/// The value and bound of one (query row, head) of the oracle.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionBound {
    /// O's dh values.
    pub out: Vec<f64>,
    /// Their absolute error bounds.
    pub out_bound: Vec<f64>,
    /// The log-sum-exp.
    pub lse: f64,
    /// Its absolute error bound.
    pub lse_bound: f64,
}

fn gamma(k: usize) -> f64 {
    let u = DType::F32.unit_roundoff();
    let ku = k as f64 * u;
    ku / (1.0 - ku)
}

impl AttentionProblem {
    fn value(&self, seed: u32, family: Family, tensor: u32, row: usize, col: usize, cols: usize) -> f64 {
        element(seed, tensor, (row * cols + col) as u32, family, self.dtype) as f64
    }

    /// The oracle of global query row `row` (position `pos`), head `h`.
    pub fn row_bound(&self, seed: u32, family: Family, row: usize, pos: usize, h: usize) -> AttentionBound {
        let (dh, qc, kc) = (self.head_dim, self.q_cols(), self.kv_cols());
        let g = h / (self.heads / self.kv_heads);
        let sigma = attention_scale(dh) as f64;
        let u = DType::F32.unit_roundoff();
        let q: Vec<f64> = (0..dh).map(|c| self.value(seed, family, TENSOR_Q, row, h * dh + c, qc)).collect();
        let keys = if self.causal { pos + 1 } else { self.seq };
        let mut scores = Vec::with_capacity(keys);
        let mut e_max = 0.0f64;
        for j in 0..keys {
            let (mut dot, mut mag) = (0.0, 0.0);
            for (c, &qv) in q.iter().enumerate() {
                let kv = self.value(seed, family, TENSOR_K, j, g * dh + c, kc);
                dot += qv * kv;
                mag += (qv * kv).abs();
            }
            scores.push(sigma * dot);
            e_max = e_max.max(gamma(dh + 1) * sigma * mag);
        }
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let min = scores.iter().copied().fold(f64::INFINITY, f64::min);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let z: f64 = weights.iter().sum();
        let weights: Vec<f64> = weights.iter().map(|w| w / z).collect();
        let n = keys;
        let range = max - min + 2.0 * e_max;
        let eta = e_max + 6.0 * u * (n + self.devices + 1) as f64 + 10.0 * u * range;
        let g1 = gamma(2 * n + self.devices + 2);
        let u_o = self.dtype.unit_roundoff();
        let mut out = vec![0.0; dh];
        let mut out_bound = vec![0.0; dh];
        for c in 0..dh {
            let v: Vec<f64> = (0..n).map(|j| self.value(seed, family, TENSOR_V, j, g * dh + c, kc)).collect();
            let o: f64 = weights.iter().zip(&v).map(|(w, x)| w * x).sum();
            let spread: f64 = weights.iter().zip(&v).map(|(w, x)| w * (x - o).abs()).sum();
            let size: f64 = weights.iter().zip(&v).map(|(w, x)| w * x.abs()).sum();
            let before = (eta * spread + g1 * (size + o.abs()) + 5.0 * u * o.abs()) * (1.0 + 2.0 * eta + 2.0 * g1);
            out[c] = o;
            out_bound[c] = before * (1.0 + u_o) + u_o * o.abs();
        }
        let lse = max + z.ln();
        let log_err = (2f64).powi(-21).max(6.0 * u * ((n as f64).ln() + 1.0));
        let lse_bound = (eta + g1 + log_err) * (1.0 + 2.0 * eta) + u * lse.abs() * (1.0 + 2.0 * u);
        AttentionBound { out, out_bound, lse, lse_bound }
    }

    /// The global query positions of device `d`'s output rows, in order, stated from
    /// the layouts' definitions (docs/attention.md) rather than taken from the chunk
    /// helpers the plans are built with, so that an error there cannot move the oracle
    /// with the plan. Chunk i of c cuts S as `torch.tensor_split` does: ⌊S/c⌋ positions,
    /// one more for the first S mod c chunks. Contiguous: chunk d of D; balanced, chunks d
    /// and 2D−1−d of 2D; decode, the last T positions on every device.
    pub(crate) fn contract_positions(&self, d: usize) -> Vec<usize> {
        let (s, n) = (self.seq, self.devices);
        let chunk = |i: usize, c: usize| {
            let (len, longer) = (s / c, s % c);
            let start = i * len + i.min(longer);
            start..start + len + usize::from(i < longer)
        };
        match (self.queries, self.layout) {
            (Some(t), _) => (s - t..s).collect(),
            (None, Layout::Contiguous) => chunk(d, n).collect(),
            (None, Layout::Balanced) => chunk(d, 2 * n).chain(chunk(2 * n - 1 - d, 2 * n)).collect(),
        }
    }

    /// Which query positions each device's rows of `what` hold.
    fn row_layout(&self, what: &str) -> String {
        let per_device: Vec<String> = (0..self.devices)
            .map(|d| {
                let positions = self.contract_positions(d);
                let mut runs: Vec<(usize, usize)> = Vec::new();
                for p in positions {
                    match runs.last_mut() {
                        Some((_, end)) if *end == p => *end += 1,
                        _ => runs.push((p, p + 1)),
                    }
                }
                let runs: Vec<String> = runs.iter().map(|(a, b)| format!("{a}..{b}")).collect();
                format!("device {d}: positions {}", runs.join(" then "))
            })
            .collect();
        format!("rows of {what} for query positions, in order; {}", per_device.join("; "))
    }

    /// Global Q row and position of every output row of device `d`.
    fn output_rows(&self, d: usize) -> Vec<(usize, usize)> {
        // Decode's queries are the last positions: Q's row r is position S − T + r.
        let pos0 = self.seq - self.query_rows();
        self.contract_positions(d).into_iter().map(|p| (p - pos0, p)).collect()
    }
}

impl Workload for AttentionProblem {
    fn device_count(&self) -> usize {
        self.devices
    }

    fn expected(&self, seed: u32, family: Family) -> Vec<ExpectedOutput> {
        let (h, dh) = (self.heads, self.head_dim);
        let (rows, device_rows) =
            crate::plan::per_device_rows((0..self.devices).map(|d| self.contract_positions(d).len()).collect());
        let mut o_values = Vec::new();
        let mut o_bounds = Vec::new();
        let mut l_values = Vec::new();
        let mut l_bounds = Vec::new();
        // Decode replicates the output: compute it once.
        let per_device: Vec<Vec<AttentionBound>> = (0..self.devices)
            .map(|d| {
                if d > 0 && self.queries.is_some() {
                    return Vec::new();
                }
                self.output_rows(d)
                    .into_iter()
                    .flat_map(|(row, pos)| (0..h).map(move |hh| (row, pos, hh)))
                    .map(|(row, pos, hh)| self.row_bound(seed, family, row, pos, hh))
                    .collect()
            })
            .collect();
        for d in 0..self.devices {
            let cells = if per_device[d].is_empty() { &per_device[0] } else { &per_device[d] };
            let (mut ov, mut ob, mut lv, mut lb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for cell in cells {
                ov.extend(&cell.out);
                ob.extend(&cell.out_bound);
                lv.push(cell.lse);
                lb.push(cell.lse_bound);
            }
            debug_assert_eq!(ov.len(), self.contract_positions(d).len() * h * dh);
            o_values.push(ov);
            o_bounds.push(ob);
            l_values.push(lv);
            l_bounds.push(lb);
        }
        let tolerance =
            |dtype: DType| Tolerance { rounding: 0.0, accumulation: 1.0, floor: Tolerance::for_output(dtype).floor };
        vec![
            ExpectedOutput {
                device_rows: device_rows.clone(),
                windows: Vec::new(),
                layout: self.row_layout("O (query rows × heads·dh)"),
                buffer: "O".into(),
                dtype: self.dtype,
                rows,
                cols: h * dh,
                values: o_values,
                magnitudes: o_bounds,
                tolerance: tolerance(self.dtype),
            },
            ExpectedOutput {
                device_rows,
                windows: Vec::new(),
                layout: self.row_layout("LSE (query rows × heads, f32)"),
                buffer: "LSE".into(),
                dtype: DType::F32,
                rows,
                cols: h,
                values: l_values,
                magnitudes: l_bounds,
                tolerance: tolerance(DType::F32),
            },
        ]
    }

    fn unsupported_family(&self, family: Family) -> Option<String> {
        (family == Family::Exact).then(|| ORACLE_CHECK.to_string())
    }
}
