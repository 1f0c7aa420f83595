//! The f64 oracle of the linear family, with a derived error bound per element.
//!
//! Values are computed without any intermediate rounding. Each output carries, per
//! element, the absolute error a correct run may make, propagated to first order from
//! every rounding the contract allows (u = f32 unit roundoff, u_a that of the activation
//! dtype, γ(n) = n·u/(1 − n·u)):
//!
//! - a GEMM of depth K accumulated in f32 and stored in the activation dtype:
//!   γ(K+1)·(|A|·|B|)·(1 + u_a) + u_a·|C|, plus the input errors carried through it
//!   (E_A·|B| + |A|·E_B);
//! - a main_grad (f32) after m micro-batches of S tokens: γ(m·S + 1)·(|init| + Σ|Xᵀ|·|dY|)
//!   plus the carried errors of its operands;
//! - GeLU and its derivative: the evaluation bound of [`super::gelu::eval_error`], plus
//!   the input error times [`GELU_LIPSCHITZ`] (or [`GELU_GRAD_LIPSCHITZ`] for gelu'),
//!   plus the rounding of the stored result;
//! - everything scaled by (1 + 8·u_a) for the second-order terms dropped.
//!
//! The conformance check accepts |got − value| ≤ bound (plus the dtype's underflow floor).

use super::gelu::{eval_error, gelu_exact, gelu_grad_exact, GELU_GRAD_LIPSCHITZ, GELU_LIPSCHITZ};
use super::{Layer, LinearProblem, Pass, Tensor};
use crate::dtype::DType;
use crate::generator::{element, Family};
use crate::problem::Window;
use crate::tolerance::Tolerance;
use crate::workload::{ExpectedOutput, Workload};

/// A dense row-major f64 matrix.
#[derive(Clone, Debug, PartialEq)]
struct Mat {
    rows: usize,
    cols: usize,
    v: Vec<f64>,
}

impl Mat {
    fn zeros(rows: usize, cols: usize) -> Mat {
        Mat { rows, cols, v: vec![0.0; rows * cols] }
    }

    /// `self · other`.
    fn mul(&self, other: &Mat) -> Mat {
        assert_eq!(self.cols, other.rows);
        let v = crate::oracle::dgemm(self.rows, other.cols, self.cols, self.strided(), other.strided());
        Mat { rows: self.rows, cols: other.cols, v }
    }

    fn strided(&self) -> crate::oracle::Strided<'_> {
        crate::oracle::Strided::row_major(&self.v, self.cols)
    }

    fn t(&self) -> Mat {
        let mut out = Mat::zeros(self.cols, self.rows);
        for i in 0..self.rows {
            for j in 0..self.cols {
                out.v[j * self.rows + i] = self.v[i * self.cols + j];
            }
        }
        out
    }

    fn map(&self, f: impl Fn(f64) -> f64) -> Mat {
        Mat { v: self.v.iter().map(|&x| f(x)).collect(), ..*self }
    }

    fn zip(&self, other: &Mat, f: impl Fn(f64, f64) -> f64) -> Mat {
        assert_eq!((self.rows, self.cols), (other.rows, other.cols));
        Mat { v: self.v.iter().zip(&other.v).map(|(&a, &b)| f(a, b)).collect(), ..*self }
    }

    fn abs(&self) -> Mat {
        self.map(f64::abs)
    }

    fn add(&self, other: &Mat) -> Mat {
        self.zip(other, |a, b| a + b)
    }

    fn window(&self, w: Window) -> Mat {
        let mut v = Vec::with_capacity(w.rows * w.cols);
        for r in 0..w.rows {
            let start = (w.row0 + r) * self.cols + w.col0;
            v.extend_from_slice(&self.v[start..start + w.cols]);
        }
        Mat { rows: w.rows, cols: w.cols, v }
    }

    fn vstack(parts: &[Mat]) -> Mat {
        let cols = parts.first().map_or(0, |m| m.cols);
        Mat { rows: parts.iter().map(|m| m.rows).sum(), cols, v: parts.iter().flat_map(|m| m.v.clone()).collect() }
    }
}

fn gamma(n: usize) -> f64 {
    let nu = n as f64 * DType::F32.unit_roundoff();
    nu / (1.0 - nu)
}

/// A value and its error bound.
#[derive(Clone, Debug)]
struct Bounded {
    value: Mat,
    error: Mat,
}

impl Bounded {
    fn exact(value: Mat) -> Bounded {
        let error = Mat::zeros(value.rows, value.cols);
        Bounded { value, error }
    }

    fn t(&self) -> Bounded {
        Bounded { value: self.value.t(), error: self.error.t() }
    }

    fn window(&self, w: Window) -> Bounded {
        Bounded { value: self.value.window(w), error: self.error.window(w) }
    }
}

/// `a · b` accumulated in f32 over K and rounded to `out` (f32 adds nothing): the input
/// errors carried through, the accumulation and the rounding.
fn gemm(a: &Bounded, b: &Bounded, out: DType) -> Bounded {
    let ua = out.unit_roundoff();
    let k = a.value.cols;
    let value = a.value.mul(&b.value);
    let mag = a.value.abs().mul(&b.value.abs());
    let carried = a.error.mul(&b.value.abs()).add(&a.value.abs().mul(&b.error));
    let g = gamma(k + 1);
    let rounding = if out == DType::F32 { 0.0 } else { ua };
    let error = carried.add(&mag.zip(&value, |m, v| g * m * (1.0 + rounding) + rounding * v.abs()));
    Bounded { value, error }
}

/// `init + Σ_j a_jᵀ·b_j` accumulated in f32 in any order.
fn accumulate(init: &Mat, terms: &[(Bounded, Bounded)]) -> Bounded {
    let mut value = init.clone();
    let mut mag = init.abs();
    let mut carried = Mat::zeros(init.rows, init.cols);
    let mut count = 1;
    for (a, b) in terms {
        let at = a.t();
        value = value.add(&at.value.mul(&b.value));
        mag = mag.add(&at.value.abs().mul(&b.value.abs()));
        carried = carried.add(&at.error.mul(&b.value.abs())).add(&at.value.abs().mul(&b.error));
        count += a.value.rows;
    }
    let g = gamma(count + 1);
    Bounded { error: carried.add(&mag.map(|m| g * m)), value }
}

/// A = GeLU(Z), stored in `dtype`.
fn gelu_of(z: &Bounded, dtype: DType) -> Bounded {
    let ua = dtype.unit_roundoff();
    let value = z.value.map(gelu_exact);
    let eval = z.value.map(|x| eval_error(x).0);
    let error = z.error.map(|e| GELU_LIPSCHITZ * e).add(&eval).add(&value.map(|a| ua * a.abs()));
    Bounded { value, error }
}

/// dZ = dA ⊙ gelu'(Z), the product in f32 and stored in `dtype`.
fn gelu_grad_of(da: &Bounded, z: &Bounded, dtype: DType) -> Bounded {
    let u = DType::F32.unit_roundoff();
    let ua = dtype.unit_roundoff();
    let g = z.value.map(gelu_grad_exact);
    let value = da.value.zip(&g, |a, b| a * b);
    // |gelu'| carries dA's error; |dA| carries the error of gelu'(Ẑ).
    let grad_error = z.error.map(|e| GELU_GRAD_LIPSCHITZ * e).add(&z.value.map(|x| eval_error(x).1));
    let error = da
        .error
        .zip(&g, |e, g| e * g.abs())
        .add(&da.value.zip(&grad_error, |a, e| a.abs() * e))
        .add(&value.map(|v| (u + ua) * v.abs()));
    Bounded { value, error }
}

impl LinearProblem {
    fn generate(&self, t: Tensor, seed: u32, family: Family) -> Mat {
        let decl = self.tensor(t);
        let v =
            (0..decl.rows * decl.cols).map(|i| element(seed, decl.id, i as u32, family, decl.dtype) as f64).collect();
        Mat { rows: decl.rows, cols: decl.cols, v }
    }

    /// Per output (in [`LinearProblem::outputs`] order), the global value and bound of
    /// each micro-batch (`main_grad`s: one entry, after all micro-batches).
    fn global_results(&self, seed: u32, family: Family) -> Vec<Vec<Bounded>> {
        let dt = self.dtype;
        let mb = self.microbatches;
        let input = |t| Bounded::exact(self.generate(t, seed, family));
        let w1 = input(Tensor::W1);
        let xs: Vec<Bounded> = (0..mb).map(|j| input(Tensor::X(j))).collect();
        let dys: Vec<Bounded> = if self.backward() { (0..mb).map(|j| input(Tensor::DY(j))).collect() } else { vec![] };
        match (self.layer, self.pass) {
            (Layer::Column | Layer::Row, Pass::Forward) => vec![xs.iter().map(|x| gemm(x, &w1, dt)).collect()],
            (Layer::Column | Layer::Row, _) => {
                let dx = dys.iter().map(|dy| gemm(dy, &w1.t(), dt)).collect();
                let init = self.generate(Tensor::Grad1, seed, family);
                let terms: Vec<(Bounded, Bounded)> = xs.iter().cloned().zip(dys.iter().cloned()).collect();
                vec![dx, vec![accumulate(&init, &terms)]]
            }
            (Layer::Mlp, _) => {
                let w2 = input(Tensor::W2);
                let (mut y, mut dx, mut t1, mut t2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for (x, dy) in xs.iter().zip(&dys) {
                    let z = gemm(x, &w1, dt);
                    let a = gelu_of(&z, dt);
                    y.push(gemm(&a, &w2, dt));
                    let da = gemm(dy, &w2.t(), dt);
                    let dz = gelu_grad_of(&da, &z, dt);
                    dx.push(gemm(&dz, &w1.t(), dt));
                    t1.push((x.clone(), dz));
                    t2.push((a, dy.clone()));
                }
                let g1 = accumulate(&self.generate(Tensor::Grad1, seed, family), &t1);
                let g2 = accumulate(&self.generate(Tensor::Grad2, seed, family), &t2);
                vec![y, dx, vec![g1], vec![g2]]
            }
        }
    }

    /// The window of output `index`'s global (one micro-batch) result device d keeps.
    fn output_window(&self, index: usize, rows: usize, cols: usize, d: usize) -> Window {
        let n = self.devices;
        let all = Window { row0: 0, col0: 0, rows, cols };
        let row_block = Window { row0: d * rows / n, col0: 0, rows: rows / n, cols };
        let col_block = Window { row0: 0, col0: d * cols / n, rows, cols: cols / n };
        match (self.layer, self.pass, index) {
            (Layer::Column, Pass::Forward, _) => col_block,
            (Layer::Column, _, 0) => {
                if self.sp {
                    row_block
                } else {
                    all
                }
            }
            (Layer::Column, _, _) => col_block,
            (Layer::Row, Pass::Forward, _) => {
                if self.sp {
                    row_block
                } else {
                    all
                }
            }
            (Layer::Row, _, 0) => col_block,
            (Layer::Row, _, _) => row_block,
            (Layer::Mlp, _, 0 | 1) => row_block,
            (Layer::Mlp, _, 2) => col_block,
            (Layer::Mlp, _, _) => row_block,
        }
    }
}

impl Workload for LinearProblem {
    fn device_count(&self) -> usize {
        self.devices
    }

    fn expected(&self, seed: u32, family: Family) -> Vec<ExpectedOutput> {
        let globals = self.global_results(seed, family);
        self.outputs()
            .into_iter()
            .zip(globals)
            .enumerate()
            .map(|(index, ((name, dtype, rows, cols), parts))| {
                let margin = 1.0 + 8.0 * self.dtype.unit_roundoff();
                let (mut values, mut magnitudes) = (Vec::new(), Vec::new());
                for d in 0..self.devices {
                    let cut: Vec<Bounded> = parts
                        .iter()
                        .map(|g| g.window(self.output_window(index, g.value.rows, g.value.cols, d)))
                        .collect();
                    let value = Mat::vstack(&cut.iter().map(|b| b.value.clone()).collect::<Vec<_>>());
                    let error = Mat::vstack(&cut.iter().map(|b| b.error.clone()).collect::<Vec<_>>());
                    assert_eq!((value.rows, value.cols), (rows, cols), "{} output {name}", self.describe());
                    values.push(value.v);
                    magnitudes.push(error.v.iter().map(|e| e * margin).collect());
                }
                let windows: Vec<_> = (0..self.devices)
                    .map(|d| {
                        parts.first().map_or(crate::problem::Window { row0: 0, col0: 0, rows, cols }, |g| {
                            self.output_window(index, g.value.rows, g.value.cols, d)
                        })
                    })
                    .collect();
                let global = format!(
                    "the global {name} of each micro-batch ({}×{}; micro-batches stacked by rows)",
                    parts.first().map_or(rows, |g| g.value.rows),
                    parts.first().map_or(cols, |g| g.value.cols)
                );
                ExpectedOutput {
                    device_rows: None,
                    windows: Vec::new(),
                    layout: crate::workload::window_layout(&global, &windows),
                    buffer: name.to_string(),
                    dtype,
                    rows,
                    cols,
                    values,
                    magnitudes,
                    tolerance: Tolerance {
                        rounding: 0.0,
                        accumulation: 1.0,
                        floor: Tolerance::for_output(dtype).floor,
                    },
                }
            })
            .collect()
    }

    fn unsupported_family(&self, family: Family) -> Option<String> {
        (self.layer == Layer::Mlp && family == Family::Exact).then(|| {
            "linear mlp has no exact family: GeLU of an integer is not representable, so the result \
             depends on rounding (use family = \"realistic\")"
                .to_string()
        })
    }
}
