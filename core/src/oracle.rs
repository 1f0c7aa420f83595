//! The f64 CPU oracle: the global GEMM of the generated (dtype-rounded) inputs in f64,
//! cut into each device's expected output window. It also returns |A|·|B|, the scale
//! of the rounding error any f32 summation order may make (see [`crate::tolerance`]).
//!
//! It serves every sharded problem ([`ShardedGemm`]): the 1D ring family and the 2D
//! mesh dataflows, whose global GEMM may use A or B transposed (`C = A·Bᵀ`, `C = Aᵀ·B`).

use crate::generator::{element, mix32, Family};
use crate::problem::ShardedGemm;
use crate::tolerance::Tolerance;

/// Expected outputs of one run, per device.
#[derive(Clone, Debug, PartialEq)]
pub struct Expected {
    /// Rows of each device's output, per device (uneven shards make them differ).
    pub rows: Vec<usize>,
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
    let (a_rows, a_cols) = if g.trans_a { (1, m) } else { (k, 1) };
    let (b_rows, b_cols) = if g.trans_b { (1, k) } else { (n, 1) };
    let a_op = Strided { values: &a, row_stride: a_rows, col_stride: a_cols };
    let b_op = Strided { values: &b, row_stride: b_rows, col_stride: b_cols };
    let c = dgemm(m, n, k, a_op, b_op);
    let (a_abs, b_abs): (Vec<f64>, Vec<f64>) =
        (a.iter().map(|x| x.abs()).collect(), b.iter().map(|x| x.abs()).collect());
    let mag = dgemm(m, n, k, Strided { values: &a_abs, ..a_op }, Strided { values: &b_abs, ..b_op });
    let w0 = problem.output_window_of(0);
    let devices = problem.device_count();
    let cut = |src: &[f64], d: usize| {
        let w = problem.output_window_of(d);
        let mut out = Vec::with_capacity(w.rows * w.cols);
        for r in 0..w.rows {
            let start = (w.row0 + r) * n + w.col0;
            out.extend_from_slice(&src[start..start + w.cols]);
        }
        out
    };
    Expected {
        rows: (0..devices).map(|d| problem.output_window_of(d).rows).collect(),
        cols: w0.cols,
        values: (0..devices).map(|d| cut(&c, d)).collect(),
        magnitudes: (0..devices).map(|d| cut(&mag, d)).collect(),
    }
}

/// A matrix in a slice with arbitrary row and column strides.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    /// The elements.
    pub values: &'a [f64],
    /// Elements between one row and the next.
    pub row_stride: usize,
    /// Elements between one column and the next.
    pub col_stride: usize,
}

impl<'a> Strided<'a> {
    /// A row-major matrix of `cols` columns.
    pub fn row_major(values: &'a [f64], cols: usize) -> Self {
        Strided { values, row_stride: cols, col_stride: 1 }
    }

    /// Whether every element of a rows×cols matrix lies inside the slice.
    fn holds(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.row_stride + (cols - 1) * self.col_stride < self.values.len()
    }
}

/// `a · b` (m×k times k×n) in f64, row-major, through the blocked, threaded `dgemm` of
/// the `matrixmultiply` crate. Its summation order is its own: exact for the exact
/// family (small integers), within about 1e-16 relative of any other order otherwise,
/// far inside every tolerance.
#[allow(unsafe_code)]
pub fn dgemm(m: usize, n: usize, k: usize, a: Strided<'_>, b: Strided<'_>) -> Vec<f64> {
    assert!(a.holds(m, k) && b.holds(k, n), "dgemm operands smaller than {m}x{k} and {k}x{n}");
    let mut c = vec![0.0f64; m * n];
    // SAFETY: every element the strides address lies inside its slice (asserted above),
    // `c` is a fresh m×n row-major buffer, and the strides fit isize (slice indices do).
    unsafe {
        matrixmultiply::dgemm(
            m,
            k,
            n,
            1.0,
            a.values.as_ptr(),
            a.row_stride as isize,
            a.col_stride as isize,
            b.values.as_ptr(),
            b.row_stride as isize,
            b.col_stride as isize,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    c
}

/// The expected value and |A|·|B| of single elements of the devices' outputs, each
/// (device, row, column of its output window) computed alone in K products: the same
/// numbers [`expected_outputs`] gives, for shapes whose whole oracle would take minutes.
pub fn expected_at(
    problem: &dyn ShardedGemm,
    seed: u32,
    family: Family,
    at: &[(usize, usize, usize)],
) -> Vec<(f64, f64)> {
    let g = problem.global();
    let [a, b] = g.inputs();
    at.iter()
        .map(|&(device, row, col)| {
            let w = problem.output_window_of(device);
            let (i, j) = (w.row0 + row, w.col0 + col);
            (0..g.k).fold((0.0, 0.0), |(value, magnitude), p| {
                let x = element(seed, a.id, g.a_index(i, p) as u32, family, g.input) as f64
                    * element(seed, b.id, g.b_index(p, j) as u32, family, g.input) as f64;
                (value + x, magnitude + x.abs())
            })
        })
        .collect()
}

/// An element a spot check found wrong.
#[derive(Clone, Debug, PartialEq)]
pub struct SpotMiss {
    /// Device.
    pub device: usize,
    /// Row of its output.
    pub row: usize,
    /// Column of its output.
    pub col: usize,
    /// The value the run gave.
    pub got: f64,
    /// The oracle's.
    pub expected: f64,
    /// The error the tolerance allows there.
    pub allowed: f64,
}

/// What [`spot_check`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct SpotCheck {
    /// Elements checked over every device.
    pub checked: usize,
    /// The largest error as a fraction of what the tolerance allows (≤ 1 passes).
    pub worst: f64,
    /// The elements outside the tolerance, in checking order.
    pub misses: Vec<SpotMiss>,
}

/// Rows of each device's output that [`spot_check`] spreads evenly, after the corners.
const SPREAD_ROWS: usize = 16;

/// Checks `per_device` elements of every device's output against the oracle, within
/// `tolerance`: each window's four corners (the last row and column are where an index
/// overflows first), then one element in each of 16 evenly spread rows (every block of a
/// plan that works in up to 16 row blocks), then positions spread by a hash (each element
/// once).
/// `got(device, row, col)` reads the run's output. For runs too large for the whole
/// oracle (the CUDA bench's shapes).
pub fn spot_check(
    problem: &dyn ShardedGemm,
    seed: u32,
    family: Family,
    tolerance: &Tolerance,
    per_device: usize,
    got: &dyn Fn(usize, usize, usize) -> f64,
) -> SpotCheck {
    let mut at = Vec::new();
    for device in 0..problem.device_count() {
        let w = problem.output_window_of(device);
        if w.rows == 0 || w.cols == 0 {
            continue;
        }
        let (last_row, last_col) = (w.rows - 1, w.cols - 1);
        for i in 0..per_device {
            at.push(match i {
                0 => (device, 0, 0),
                1 => (device, 0, last_col),
                2 => (device, last_row, 0),
                3 => (device, last_row, last_col),
                _ => {
                    let h = mix32(mix32(device as u32 ^ 0x5bd1_e995).wrapping_add(i as u32));
                    // Then 16 rows spread evenly, so that every block of a plan that works
                    // in up to 16 row blocks (a shard, a slot) is checked; then anywhere.
                    let row = if i < 4 + SPREAD_ROWS { (i - 4) * w.rows / SPREAD_ROWS } else { h as usize % w.rows };
                    (device, row, mix32(h) as usize % w.cols)
                }
            });
        }
    }
    // A small window's hashed positions may repeat a corner or each other.
    let mut seen = std::collections::HashSet::new();
    at.retain(|p| seen.insert(*p));
    let mut check = SpotCheck { checked: at.len(), worst: 0.0, misses: Vec::new() };
    for (&(device, row, col), (expected, magnitude)) in at.iter().zip(expected_at(problem, seed, family, &at)) {
        let value = got(device, row, col);
        check.worst = check.worst.max(tolerance.error_ratio(value, expected, magnitude));
        if !tolerance.accepts(value, expected, magnitude) {
            let allowed = tolerance.allowed(expected, magnitude);
            check.misses.push(SpotMiss { device, row, col, got: value, expected, allowed });
        }
    }
    check
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
        assert_eq!((e.rows, e.cols), (vec![4, 4], 2));
        assert_eq!(e.values[1][2 * 2 + 1], want);
    }

    #[test]
    fn single_elements_are_the_whole_oracle_s_and_spot_checks_find_a_wrong_one() {
        use crate::mesh::{Dataflow, MeshProblem};
        use crate::workload::output_tolerance;
        let (f16, f32) = (DType::F16, DType::F32);
        let problems: Vec<Box<dyn ShardedGemm>> = vec![
            Box::new(Problem::new(OpKind::AgGemm, 3, 9, 6, 5, f16, f16).unwrap()),
            Box::new(Problem::new(OpKind::GemmRs, 3, 6, 4, 9, f16, f32).unwrap()),
            Box::new(Problem::new(OpKind::GemmAr, 2, 4, 6, 8, f32, f32).unwrap()),
            // Uneven shards: rows 3, 3, 2 (tensor_split's order).
            Box::new(Problem::new(OpKind::GemmRs, 3, 8, 4, 9, f16, f32).unwrap()),
            Box::new(Problem::new(OpKind::AgGemm, 3, 8, 6, 5, f16, f16).unwrap()),
            // Transposed A (RS) and B (LS).
            Box::new(MeshProblem::new(2, 2, Dataflow::Rs, 4, 6, 8, f16, f32).unwrap()),
            Box::new(MeshProblem::new(2, 2, Dataflow::Ls, 4, 6, 8, f16, f32).unwrap()),
        ];
        for problem in &problems {
            let e = expected_outputs(problem.as_ref(), 5, Family::Realistic);
            let mut at = Vec::new();
            for d in 0..problem.device_count() {
                at.extend((0..e.rows[d]).flat_map(|r| (0..e.cols).map(move |c| (d, r, c))));
            }
            let single = expected_at(problem.as_ref(), 5, Family::Realistic, &at);
            for (&(d, r, c), &(value, magnitude)) in at.iter().zip(&single) {
                assert_eq!((value, magnitude), (e.values[d][r * e.cols + c], e.magnitudes[d][r * e.cols + c]));
            }
            let tolerance = output_tolerance(problem.as_ref());
            let right = |d: usize, r: usize, c: usize| e.values[d][r * e.cols + c];
            let check = spot_check(problem.as_ref(), 5, Family::Realistic, &tolerance, 6, &right);
            let d = problem.device_count();
            assert!((4 * d..=6 * d).contains(&check.checked), "{check:?}");
            assert_eq!((check.worst, check.misses.len()), (0.0, 0));
            // Device 1's last element off by 1 %: its corner is among the checked.
            let (lr, lc) = (e.rows[1] - 1, e.cols - 1);
            let wrong =
                |d: usize, r: usize, c: usize| right(d, r, c) * if (d, r, c) == (1, lr, lc) { 1.01 } else { 1.0 };
            let check = spot_check(problem.as_ref(), 5, Family::Realistic, &tolerance, 6, &wrong);
            assert!(check.worst > 1.0, "{check:?}");
            assert!(
                matches!(check.misses[..], [SpotMiss { device: 1, row, col, .. }] if (row, col) == (lr, lc)),
                "{check:?}"
            );
        }
    }

    #[test]
    fn a_spot_check_meets_every_row_block_of_a_ring_s_output() {
        // ag_gemm on 16 devices: each output has 16 blocks of Ms = 3 rows, one per ring
        // step. Whichever block a plan gets wrong (a wrong slot), the check sees it, with
        // 20 elements per device (16 rows drawn at random would miss some block).
        let p = Problem::new(OpKind::AgGemm, 16, 48, 32, 24, DType::F32, DType::F32).unwrap();
        let e = expected_outputs(&p, 2, Family::Realistic);
        let tolerance = crate::workload::output_tolerance(&p);
        for block in 0..16 {
            let wrong = |d: usize, r: usize, c: usize| {
                let v = e.values[d][r * e.cols + c];
                if d == 5 && r / 3 == block {
                    v + 1.0
                } else {
                    v
                }
            };
            let check = spot_check(&p, 2, Family::Realistic, &tolerance, 20, &wrong);
            assert!(!check.misses.is_empty() && check.misses.iter().all(|m| m.device == 5), "block {block}: {check:?}");
        }
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
