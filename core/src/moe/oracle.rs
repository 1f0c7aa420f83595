//! The f64 oracle of the MoE family.
//!
//! Values are computed from the generated inputs and the router's tables without any
//! rounding. Bounds follow the GEMM rule (Higham §3.1): an element that is a sum of
//! products reached through at most n f32 roundings on any path is within
//! γ(n)·Σ|terms| before its final rounding to the output dtype.
//! - ag_moe `Y`: one dot product of depth H: n = H + 1 (the GEMM preset for K = H).
//! - moe_rs `C`: per device a dot product of depth F/D, a product with the slot weight,
//!   a sum over ≤ k slots, then a sum over D devices' partials: n ≤ F/D + k + D + 1,
//!   relative to Σ_slot |w|·Σ_f |h·w2|.
//! - ag_moe `perm`: integers, compared bit for bit.

use super::{MoeOp, MoeProblem, TENSOR_H, TENSOR_W1, TENSOR_W2, TENSOR_X};
use crate::dtype::DType;
use crate::generator::{element, Family};
use crate::tolerance::Tolerance;
use crate::workload::{ExpectedOutput, Workload};

/// The row layout of Y and H from its definition — the routed (token, slot)s sorted by
/// expert, then token, then slot; an id past the experts is routed nowhere — stated
/// here rather than taken from the routing code the plans run, so that an error there
/// cannot move the oracle with the plan. Returns, per row, its `token·k + slot`
/// (`perm`), and per `token·k + slot`, its row (`inv`).
pub(crate) fn contract_rows(ids: &[u32], experts: usize) -> (Vec<u32>, Vec<Option<usize>>) {
    let mut routed: Vec<u32> = (0..ids.len() as u32).filter(|&i| (ids[i as usize] as usize) < experts).collect();
    routed.sort_by_key(|&i| (ids[i as usize], i));
    let mut inv = vec![None; ids.len()];
    for (row, &i) in routed.iter().enumerate() {
        inv[i as usize] = Some(row);
    }
    (routed, inv)
}

impl MoeProblem {
    /// Rows × cols of generated tensor `tensor` in the input dtype, as f64.
    fn tensor(&self, seed: u32, family: Family, tensor: u32, rows: usize, cols: usize) -> Vec<f64> {
        (0..rows * cols).map(|i| element(seed, tensor, i as u32, family, self.input) as f64).collect()
    }

    fn ag_moe_expected(&self, seed: u32, family: Family) -> Vec<ExpectedOutput> {
        let (h, f, k, cap) = (self.hidden, self.ffn, self.slots, self.capacity());
        let fd = self.ffn_per_device();
        let ids = self.router().ids(seed);
        let (routed, _) = contract_rows(&ids, self.experts);
        let x = self.tensor(seed, family, TENSOR_X, self.tokens, h);
        let w1 = self.tensor(seed, family, TENSOR_W1, self.experts * h, f);
        let mut values = vec![vec![0.0; cap * fd]; self.devices];
        let mut magnitudes = vec![vec![0.0; cap * fd]; self.devices];
        for (r, &slot) in routed.iter().enumerate() {
            let token = slot as usize / k;
            let e = ids[slot as usize] as usize;
            for d in 0..self.devices {
                for c in 0..fd {
                    let (mut sum, mut mag) = (0.0, 0.0);
                    for p in 0..h {
                        let term = x[token * h + p] * w1[(e * h + p) * f + d * fd + c];
                        sum += term;
                        mag += term.abs();
                    }
                    values[d][r * fd + c] = sum;
                    magnitudes[d][r * fd + c] = mag;
                }
            }
        }
        // Past the routed rows, perm holds ROUTE_NONE.
        let perm: Vec<f64> =
            (0..cap).map(|r| DType::U32.decode(routed.get(r).copied().unwrap_or(super::ROUTE_NONE)) as f64).collect();
        vec![
            ExpectedOutput {
                device_rows: None,
                windows: Vec::new(),
                layout: format!(
                    "one row per routed (token, slot) in expert, token, slot order (the routed rows first, zeros after), \
                     columns d·{fd}..(d+1)·{fd} of the {f} FFN columns on device d"
                ),
                buffer: "Y".into(),
                dtype: self.output,
                rows: cap,
                cols: fd,
                values,
                magnitudes,
                tolerance: Tolerance::gemm(self.output, h),
            },
            ExpectedOutput {
                device_rows: None,
                windows: Vec::new(),
                layout: format!("per row of Y, its token·{k} + slot (u32; 4294967295 past the routed rows), the same on every device"),
                buffer: "perm".into(),
                dtype: DType::U32,
                rows: cap,
                cols: 1,
                values: vec![perm; self.devices],
                magnitudes: vec![vec![0.0; cap]; self.devices],
                tolerance: Tolerance::EXACT,
            },
        ]
    }

    fn moe_rs_expected(&self, seed: u32, family: Family) -> Vec<ExpectedOutput> {
        let (h, f, k, e_count) = (self.hidden, self.ffn, self.slots, self.experts);
        let fd = self.ffn_per_device();
        // Device d's tokens, from the definition (tensor_split's order: ⌊T/D⌋ each, one
        // more for the first T mod D devices), apart from the planners' split helper.
        let (per, longer) = (self.tokens / self.devices, self.tokens % self.devices);
        let shard = |d: usize| (d * per + d.min(longer), per + usize::from(d < longer));
        let td = shard(0).1;
        let router = self.router();
        let ids = router.ids(seed);
        let weights: Vec<f64> = router.weights(seed, family).iter().map(|&w| f32::from_bits(w) as f64).collect();
        let (_, inv) = contract_rows(&ids, e_count);
        let act = self.tensor(seed, family, TENSOR_H, self.capacity(), f);
        let w2 = self.tensor(seed, family, TENSOR_W2, e_count * f, h);
        // Row f of W2_e in the stored layout (see TENSOR_W2).
        let w2_row = |e: usize, f_row: usize| (f_row / fd) * e_count * fd + e * fd + f_row % fd;
        let mut values = Vec::with_capacity(self.devices);
        let mut magnitudes = Vec::with_capacity(self.devices);
        for d in 0..self.devices {
            let (first, len) = shard(d);
            let (mut v, mut m) = (vec![0.0; len * h], vec![0.0; len * h]);
            for t in 0..len {
                let token = first + t;
                for j in 0..k {
                    let Some(row) = inv[token * k + j] else { continue };
                    let (e, w) = (ids[token * k + j] as usize, weights[token * k + j]);
                    for c in 0..h {
                        let (mut sum, mut mag) = (0.0, 0.0);
                        for p in 0..f {
                            let term = act[row * f + p] * w2[w2_row(e, p) * h + c];
                            sum += term;
                            mag += term.abs();
                        }
                        v[t * h + c] += w * sum;
                        m[t * h + c] += w.abs() * mag;
                    }
                }
            }
            values.push(v);
            magnitudes.push(m);
        }
        let (_, device_rows) = crate::plan::per_device_rows((0..self.devices).map(|d| shard(d).1).collect());
        let layout = if longer == 0 {
            format!("tokens d·{td}..(d+1)·{td} of the {} tokens on device d, all {h} columns", self.tokens)
        } else {
            let ranges: Vec<String> = (0..self.devices)
                .map(|d| format!("device {d}: tokens {}..{}", shard(d).0, shard(d).0 + shard(d).1))
                .collect();
            format!("{} of the {} tokens, all {h} columns", ranges.join("; "), self.tokens)
        };
        vec![ExpectedOutput {
            device_rows,
            windows: Vec::new(),
            layout,
            buffer: "C".into(),
            dtype: self.output,
            rows: td,
            cols: h,
            values,
            magnitudes,
            tolerance: Tolerance::gemm(self.output, fd + k + self.devices + 1),
        }]
    }
}

impl Workload for MoeProblem {
    fn device_count(&self) -> usize {
        self.devices
    }

    fn expected(&self, seed: u32, family: Family) -> Vec<ExpectedOutput> {
        match self.op {
            MoeOp::AgMoe => self.ag_moe_expected(seed, family),
            MoeOp::MoeRs => self.moe_rs_expected(seed, family),
        }
    }
}
