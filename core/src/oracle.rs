//! The f64 CPU oracle: the global GEMM of the generated (dtype-rounded) inputs in f64,
//! cut into each device's expected output window. It also returns |A|·|B|, the scale
//! of the rounding error any f32 summation order may make (see [`crate::tolerance`]).
//!
//! It serves every sharded problem ([`ShardedGemm`]): the 1D ring family and the 2D
//! mesh dataflows, whose global GEMM may use A or B transposed (`C = A·Bᵀ`, `C = Aᵀ·B`).

use crate::generator::{element, Family};
use crate::problem::ShardedGemm;

/// Expected outputs of one run, per device.
#[derive(Clone, Debug, PartialEq)]
pub struct Expected {
    /// Rows of each device's output.
    pub rows: usize,
    /// Columns of each device's output.
    pub cols: usize,
    /// Per device, row-major f64 values of C.
    pub values: Vec<Vec<f64>>,
    /// Per device, row-major f64 values of |A|·|B| (the error scale).
    pub magnitudes: Vec<Vec<f64>>,
}

/// Generates a global input tensor of `problem` as stored (A then B), as f64 (exactly
/// the rounded inputs).
pub fn global_input(problem: &dyn ShardedGemm, tensor: u32, seed: u32, family: Family) -> Vec<f64> {
    let global = problem.global();
    let decl = global.inputs()[tensor as usize];
    (0..decl.rows * decl.cols).map(|i| element(seed, decl.id, i as u32, family, global.input) as f64).collect()
}

/// Computes every device's expected output of `problem` for `(seed, family)`.
pub fn expected_outputs(problem: &dyn ShardedGemm, seed: u32, family: Family) -> Expected {
    let g = problem.global();
    let (m, n, k) = (g.m, g.n, g.k);
    let a = global_input(problem, 0, seed, family);
    let b = global_input(problem, 1, seed, family);
    // op(A)[i][p] and op(B)[p][j] as index functions of the stored tensors.
    let a_at = |i: usize, p: usize| if g.trans_a { a[p * m + i] } else { a[i * k + p] };
    // B is walked row by row of op(B); transpose it once so the inner loop is contiguous.
    let b_rows: Vec<f64> = if g.trans_b { (0..k * n).map(|x| b[(x % n) * k + x / n]).collect() } else { b.clone() };
    let mut c = vec![0.0f64; m * n];
    let mut mag = vec![0.0f64; m * n];
    for i in 0..m {
        let (row, row_mag) = (&mut c[i * n..(i + 1) * n], &mut mag[i * n..(i + 1) * n]);
        for p in 0..k {
            let av = a_at(i, p);
            if av == 0.0 {
                continue;
            }
            let brow = &b_rows[p * n..(p + 1) * n];
            for j in 0..n {
                row[j] += av * brow[j];
                row_mag[j] += (av * brow[j]).abs();
            }
        }
    }
    let w0 = problem.output_window_of(0);
    let cut = |src: &[f64], d: usize| {
        let w = problem.output_window_of(d);
        let mut out = Vec::with_capacity(w.rows * w.cols);
        for r in 0..w.rows {
            let start = (w.row0 + r) * n + w.col0;
            out.extend_from_slice(&src[start..start + w.cols]);
        }
        out
    };
    let devices = problem.device_count();
    Expected {
        rows: w0.rows,
        cols: w0.cols,
        values: (0..devices).map(|d| cut(&c, d)).collect(),
        magnitudes: (0..devices).map(|d| cut(&mag, d)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::problem::{OpKind, Problem};

    #[test]
    fn ag_gemm_devices_get_column_blocks_of_the_global_product() {
        let p = Problem::new(OpKind::AgGemm, 2, 4, 4, 3, DType::F32, DType::F32).unwrap();
        let e = expected_outputs(&p, 3, Family::Exact);
        let a = global_input(&p, 0, 3, Family::Exact);
        let b = global_input(&p, 1, 3, Family::Exact);
        // Device 1, row 2, column 1 is global C[2][3].
        let want: f64 = (0..3).map(|q| a[2 * 3 + q] * b[q * 4 + 3]).sum();
        assert_eq!((e.rows, e.cols), (4, 2));
        assert_eq!(e.values[1][2 * 2 + 1], want);
    }

    #[test]
    fn all_reduce_gives_every_device_the_whole_product() {
        let p = Problem::new(OpKind::GemmAr, 3, 6, 2, 3, DType::Bf16, DType::F32).unwrap();
        let e = expected_outputs(&p, 1, Family::Realistic);
        assert_eq!(e.values[0], e.values[2]);
        assert_eq!(e.values[0].len(), 12);
        assert!(e.magnitudes[0].iter().zip(&e.values[0]).all(|(m, v)| *m >= v.abs()));
    }
}
