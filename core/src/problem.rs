//! Problems: an operation, a device count, global shapes and dtypes, validated.
//!
//! Every 1D operation is the global GEMM `C = A·B` (A is M×K, B is K×N) sharded in a
//! different way (BRIEF §3.1–3.3):
//!
//! | op | device d holds | device d produces |
//! |---|---|---|
//! | `ag_gemm` | rows block d of A (M/D × K), columns block d of B (K × N/D) | columns block d of C (M × N/D) |
//! | `gemm_rs` | columns block d of A (M × K/D), rows block d of B (K/D × N) | rows block d of C (M/D × N) |
//! | `gemm_ar` | as `gemm_rs` | all of C (M × N) |

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::dtype::DType;

/// The collective matmul operations of the 1D family. Exhaustive on purpose: every
/// executor and model, in whichever crate, must say what it does with a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// AllGather of A's rows, then GEMM with the local columns of B.
    AgGemm,
    /// GEMM of local K-slices, then ReduceScatter of C's rows.
    GemmRs,
    /// GEMM of local K-slices, then AllReduce.
    GemmAr,
}

names!(OpKind, "op", { AgGemm => "ag_gemm", GemmRs => "gemm_rs", GemmAr => "gemm_ar" });

/// Why a problem is invalid.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProblemError {
    /// Too many devices.
    #[error("{op}: {count}")]
    Devices {
        /// The operation.
        op: OpKind,
        /// The count (not a `source`: the message already quotes it).
        count: crate::plan::TooManyDevices,
    },
    /// The device count is zero.
    #[error("{op}: the device count D must be at least 1")]
    NoDevices {
        /// The operation.
        op: OpKind,
    },
    /// A global dimension is zero.
    #[error("{op}: dimension {dim} is 0 (M={m}, N={n}, K={k})")]
    ZeroDimension {
        /// The operation.
        op: OpKind,
        /// Which dimension ("M", "N" or "K").
        dim: &'static str,
        /// Global M.
        m: usize,
        /// Global N.
        n: usize,
        /// Global K.
        k: usize,
    },
    /// A weight dimension the sharding splits is not a multiple of the device count.
    #[error("{op}: {dim}={size} is not divisible by D={devices} (the sharding splits the weights' {dim} into D equal blocks; only M, the rows, may split unevenly)")]
    Indivisible {
        /// The operation.
        op: OpKind,
        /// Which dimension.
        dim: &'static str,
        /// Its size.
        size: usize,
        /// The device count.
        devices: usize,
    },
    /// Fewer rows than devices: some device would hold no row at all.
    #[error("{op}: M={m} rows cannot give each of D={devices} devices a row (uneven shards need M >= D)")]
    TooFewRows {
        /// The operation.
        op: OpKind,
        /// Global M.
        m: usize,
        /// The device count.
        devices: usize,
    },
    /// The output dtype is neither f32 nor the input dtype.
    #[error(
        "{op}: output dtype {output} with input dtype {input} is unsupported (the output is f32 or the input dtype)"
    )]
    UnsupportedDtypes {
        /// The operation.
        op: OpKind,
        /// Input dtype.
        input: DType,
        /// Requested output dtype.
        output: DType,
    },
    /// A wire dtype for an op without partial sums, or not a float type.
    #[error("{op}: partial sums travel as f32, f16 or bf16, and only gemm_rs and gemm_ar send partial sums (got wire dtype {wire})")]
    Wire {
        /// The operation.
        op: OpKind,
        /// The requested wire dtype.
        wire: DType,
    },
    /// A tensor has more elements than the generator can index (2^32).
    #[error("{op}: tensor {tensor} has {elements} elements, more than the 2^32 the input generator indexes")]
    TooLarge {
        /// The operation.
        op: OpKind,
        /// Which tensor.
        tensor: &'static str,
        /// Its element count.
        elements: u128,
    },
}

/// `total` items cut into `parts` contiguous blocks in `torch.tensor_split`'s order: the
/// first `total % parts` blocks hold one item more than the rest. An even split is the
/// plain `total / parts` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Split {
    /// Items in all.
    pub total: usize,
    /// Blocks (at least 1).
    pub parts: usize,
}

impl Split {
    /// `total` cut into `parts` blocks.
    pub fn new(total: usize, parts: usize) -> Split {
        Split { total, parts: parts.max(1) }
    }

    /// Items in block `i`.
    pub fn len(&self, i: usize) -> usize {
        self.total / self.parts + usize::from(i < self.total % self.parts)
    }

    /// Index of block `i`'s first item.
    pub fn start(&self, i: usize) -> usize {
        i * (self.total / self.parts) + i.min(self.total % self.parts)
    }

    /// Items in the largest block (the first).
    pub fn max(&self) -> usize {
        self.total.div_ceil(self.parts)
    }

    /// Items in the smallest block (the last).
    pub fn min(&self) -> usize {
        self.total / self.parts
    }

    /// Whether every block holds as many items.
    pub fn is_even(&self) -> bool {
        self.total % self.parts == 0
    }

    /// Items per block, in order.
    pub fn lens(&self) -> Vec<usize> {
        (0..self.parts).map(|i| self.len(i)).collect()
    }

    /// Blocks `first..end` together, as (start, items).
    pub fn span(&self, first: usize, end: usize) -> (usize, usize) {
        (self.start(first), self.start(end) - self.start(first))
    }

    /// Block `i` cut in turn into `pieces` blocks, as (start within block `i`, items).
    pub fn piece(&self, i: usize, pieces: usize, j: usize) -> (usize, usize) {
        let inner = Split::new(self.len(i), pieces);
        (inner.start(j), inner.len(j))
    }
}

/// A window of a global row-major matrix: `rows × cols` starting at `(row0, col0)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    /// First row.
    pub row0: usize,
    /// First column.
    pub col0: usize,
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
}

/// A global input tensor of a problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    /// Name ("A", "B").
    pub name: &'static str,
    /// Generator tensor id.
    pub id: u32,
    /// Global rows.
    pub rows: usize,
    /// Global columns.
    pub cols: usize,
}

/// The global GEMM behind a sharded problem: `C (m×n) = op(A) · op(B)` over `k`, where
/// `op(A)` is A (m×k) or, with `trans_a`, the transpose of A stored k×m (likewise B).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GlobalGemm {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// A is stored k×m and used transposed.
    pub trans_a: bool,
    /// B is stored n×k and used transposed.
    pub trans_b: bool,
    /// Input dtype of A and B.
    pub input: DType,
    /// Output dtype of C.
    pub output: DType,
}

impl GlobalGemm {
    /// Where op(A)[i][p] is stored in A (stored k×m when transposed).
    pub fn a_index(&self, i: usize, p: usize) -> usize {
        if self.trans_a {
            p * self.m + i
        } else {
            i * self.k + p
        }
    }

    /// Where op(B)[p][j] is stored in B (stored n×k when transposed).
    pub fn b_index(&self, p: usize, j: usize) -> usize {
        if self.trans_b {
            j * self.k + p
        } else {
            p * self.n + j
        }
    }

    /// The global input tensors as stored, A (id 0) then B (id 1).
    pub fn inputs(&self) -> [TensorDecl; 2] {
        let (m, n, k) = (self.m, self.n, self.k);
        let a = if self.trans_a { (k, m) } else { (m, k) };
        let b = if self.trans_b { (n, k) } else { (k, n) };
        [TensorDecl { name: "A", id: 0, rows: a.0, cols: a.1 }, TensorDecl { name: "B", id: 1, rows: b.0, cols: b.1 }]
    }
}

/// What the oracle and the conformance checks need from any sharded problem (the 1D
/// ring family here, the 2D mesh family in [`crate::mesh`]): the global GEMM, and which
/// window of each global tensor every device holds or produces.
pub trait ShardedGemm {
    /// Number of devices.
    fn device_count(&self) -> usize;
    /// The global GEMM.
    fn global(&self) -> GlobalGemm;
    /// The window of global input tensor `tensor` (0 = A, 1 = B) that `device` holds.
    fn input_window(&self, tensor: u32, device: usize) -> Window;
    /// The window of the global C that `device` produces.
    fn output_window_of(&self, device: usize) -> Window;
    /// If partial sums travel rounded to a narrower type than f32: that type and the most
    /// roundings of one running sum on its way (the partial's own and one per reduction).
    fn partial_rounding(&self) -> Option<(DType, usize)> {
        None
    }
}

/// A validated 1D collective matmul problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Problem {
    /// The operation.
    pub op: OpKind,
    /// Number of devices D in the ring.
    pub devices: usize,
    /// Global M (rows of A and C).
    pub m: usize,
    /// Global N (columns of B and C).
    pub n: usize,
    /// Global K (the contracted dimension).
    pub k: usize,
    /// Input dtype of A and B.
    pub input: DType,
    /// Output dtype of C.
    pub output: DType,
    /// The dtype partial sums travel and are reduced in (gemm_rs, gemm_ar): f32 by
    /// default; the input dtype halves the bytes, as NCCL users run it, and rounds each
    /// hop's running sum once ([`Problem::with_wire`]).
    pub wire: DType,
}

impl Problem {
    /// The same problem with partial sums in `wire` (gemm_rs and gemm_ar only).
    pub fn with_wire(self, wire: DType) -> Result<Problem, ProblemError> {
        if self.op == OpKind::AgGemm && wire != DType::F32 || !wire.is_float() {
            return Err(ProblemError::Wire { op: self.op, wire });
        }
        Ok(Problem { wire, ..self })
    }

    /// Validates and builds a problem.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        op: OpKind,
        devices: usize,
        m: usize,
        n: usize,
        k: usize,
        input: DType,
        output: DType,
    ) -> Result<Self, ProblemError> {
        if devices == 0 {
            return Err(ProblemError::NoDevices { op });
        }
        crate::plan::check_device_count(devices as u128).map_err(|count| ProblemError::Devices { op, count })?;
        for (dim, size) in [("M", m), ("N", n), ("K", k)] {
            if size == 0 {
                return Err(ProblemError::ZeroDimension { op, dim, m, n, k });
            }
        }
        // The weights' dimension splits evenly, as tensor parallelism shards them; the
        // rows (tokens) in `tensor_split`'s order, unevenly when M is not a multiple of D.
        let (dim, size) = match op {
            OpKind::AgGemm => ("N", n),
            OpKind::GemmRs | OpKind::GemmAr => ("K", k),
        };
        if size % devices != 0 {
            return Err(ProblemError::Indivisible { op, dim, size, devices });
        }
        if m < devices {
            return Err(ProblemError::TooFewRows { op, m, devices });
        }
        if output != DType::F32 && output != input {
            return Err(ProblemError::UnsupportedDtypes { op, input, output });
        }
        for dtype in [input, output] {
            if !dtype.is_float() {
                return Err(ProblemError::UnsupportedDtypes { op, input, output });
            }
        }
        // Last: a problem that is only simulated may exceed the generator's range, and
        // whoever lifts this check (the `simulate` command) still sees every other error.
        for (tensor, elements) in
            [("A", m as u128 * k as u128), ("B", k as u128 * n as u128), ("C", m as u128 * n as u128)]
        {
            if elements > u32::MAX as u128 {
                return Err(ProblemError::TooLarge { op, tensor, elements });
            }
        }
        Ok(Problem { op, devices, m, n, k, input, output, wire: DType::F32 })
    }

    /// The global input tensors, A then B.
    pub fn inputs(&self) -> [TensorDecl; 2] {
        self.global().inputs()
    }

    /// How M's rows are cut among the devices: `tensor_split`'s order, so when M is not a
    /// multiple of D the first M mod D devices hold one row more.
    pub fn row_split(&self) -> Split {
        Split::new(self.m, self.devices)
    }

    /// The window of global tensor `tensor` (0 = A, 1 = B) that device `device` holds.
    pub fn input_shard(&self, tensor: u32, device: usize) -> Window {
        let d = self.devices;
        let (n, k) = (self.n, self.k);
        let rows = self.row_split();
        match (self.op, tensor) {
            (OpKind::AgGemm, 0) => Window { row0: rows.start(device), col0: 0, rows: rows.len(device), cols: k },
            (OpKind::AgGemm, _) => Window { row0: 0, col0: device * n / d, rows: k, cols: n / d },
            (OpKind::GemmRs | OpKind::GemmAr, 0) => Window { row0: 0, col0: device * k / d, rows: self.m, cols: k / d },
            (OpKind::GemmRs | OpKind::GemmAr, _) => Window { row0: device * k / d, col0: 0, rows: k / d, cols: n },
        }
    }

    /// The window of the global C that device `device` produces.
    pub fn output_window(&self, device: usize) -> Window {
        let d = self.devices;
        match self.op {
            OpKind::AgGemm => Window { row0: 0, col0: device * self.n / d, rows: self.m, cols: self.n / d },
            OpKind::GemmRs => {
                let rows = self.row_split();
                Window { row0: rows.start(device), col0: 0, rows: rows.len(device), cols: self.n }
            }
            OpKind::GemmAr => Window { row0: 0, col0: 0, rows: self.m, cols: self.n },
        }
    }

    /// Floating-point operations of the global GEMM.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// `op D=.. M=.. N=.. K=.. input->output`, for reports.
    pub fn describe(&self) -> String {
        format!("{} D={} {} {}->{}", self.op, self.devices, self.shape_string(), self.input, self.output)
    }

    /// A short shape string, e.g. `M=64 N=32 K=96` (and ` wire=bf16` when partial sums do
    /// not travel in f32).
    pub fn shape_string(&self) -> String {
        let wire = if self.wire == DType::F32 { String::new() } else { format!(" wire={}", self.wire) };
        format!("M={} N={} K={}{wire}", self.m, self.n, self.k)
    }
}

impl ShardedGemm for Problem {
    fn device_count(&self) -> usize {
        self.devices
    }

    fn partial_rounding(&self) -> Option<(DType, usize)> {
        (self.wire != DType::F32).then_some((self.wire, self.devices))
    }

    fn global(&self) -> GlobalGemm {
        GlobalGemm {
            m: self.m,
            n: self.n,
            k: self.k,
            trans_a: false,
            trans_b: false,
            input: self.input,
            output: self.output,
        }
    }

    fn input_window(&self, tensor: u32, device: usize) -> Window {
        self.input_shard(tensor, device)
    }

    fn output_window_of(&self, device: usize) -> Window {
        self.output_window(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DType::*;

    /// Where each device's output sits, pinned in numbers: the oracle cuts the global C
    /// by these windows, so they are checked against their definitions here rather
    /// than trusted from the code the plans also use.
    #[test]
    fn output_windows_are_the_documented_shards() {
        let w = |op, d| Problem::new(op, 4, 8, 16, 4, F32, F32).unwrap().output_window(d);
        // ag_gemm: device d holds columns d·N/D.. of all M rows.
        assert_eq!(w(OpKind::AgGemm, 2), Window { row0: 0, col0: 8, rows: 8, cols: 4 });
        // gemm_rs: device d holds rows d·M/D.. of all N columns.
        assert_eq!(w(OpKind::GemmRs, 3), Window { row0: 6, col0: 0, rows: 2, cols: 16 });
        // gemm_ar: every device holds all of C.
        assert_eq!(w(OpKind::GemmAr, 1), Window { row0: 0, col0: 0, rows: 8, cols: 16 });
        // A mesh of 2×3 chips, device d = chip (d / 3, d % 3), holds C's block there.
        let mesh = crate::MeshProblem::new(2, 3, crate::Dataflow::Os, 12, 18, 6, F32, F32).unwrap();
        assert_eq!(mesh.output_window(4), Window { row0: 6, col0: 6, rows: 6, cols: 6 });
        assert_eq!(mesh.output_window(2), Window { row0: 0, col0: 12, rows: 6, cols: 6 });
    }

    #[test]
    fn zero_devices_is_an_error() {
        assert_eq!(
            Problem::new(OpKind::AgGemm, 0, 8, 8, 8, F32, F32),
            Err(ProblemError::NoDevices { op: OpKind::AgGemm })
        );
    }

    #[test]
    fn zero_dimension_names_it() {
        let e = Problem::new(OpKind::GemmRs, 2, 8, 0, 8, F32, F32).unwrap_err();
        assert!(matches!(e, ProblemError::ZeroDimension { dim: "N", .. }), "{e}");
        assert!(e.to_string().contains("N=0"));
    }

    #[test]
    fn indivisible_weight_dimensions_name_size_and_devices() {
        let e = Problem::new(OpKind::AgGemm, 3, 9, 8, 4, F32, F32).unwrap_err();
        assert_eq!(e, ProblemError::Indivisible { op: OpKind::AgGemm, dim: "N", size: 8, devices: 3 });
        let e = Problem::new(OpKind::GemmRs, 4, 8, 8, 6, F32, F32).unwrap_err();
        assert_eq!(e, ProblemError::Indivisible { op: OpKind::GemmRs, dim: "K", size: 6, devices: 4 });
        assert!(e.to_string().contains("K=6 is not divisible by D=4"), "{e}");
        // Fewer rows than devices: a device would hold nothing.
        let e = Problem::new(OpKind::GemmAr, 4, 3, 8, 8, F32, F32).unwrap_err();
        assert_eq!(e, ProblemError::TooFewRows { op: OpKind::GemmAr, m: 3, devices: 4 });
    }

    /// M that D does not divide splits as `torch.tensor_split` does: the first M mod D
    /// devices hold one row more, and the shards tile the rows in device order.
    #[test]
    fn rows_split_unevenly_in_tensor_split_order() {
        let split = Split::new(102, 4);
        assert_eq!(split.lens(), vec![26, 26, 25, 25]);
        assert_eq!((0..4).map(|i| split.start(i)).collect::<Vec<_>>(), vec![0, 26, 52, 77]);
        assert_eq!((split.max(), split.min(), split.is_even()), (26, 25, false));
        assert_eq!(Split::new(8, 4).lens(), vec![2; 4]);
        // A block cut again into chunks, the same way: 7 rows in 3 chunks.
        let rows = Split::new(7 + 6, 2);
        assert_eq!((0..3).map(|j| rows.piece(0, 3, j)).collect::<Vec<_>>(), vec![(0, 3), (3, 2), (5, 2)]);
        let p = Problem::new(OpKind::GemmRs, 4, 102, 8, 8, F32, F32).unwrap();
        let windows: Vec<Window> = (0..4).map(|d| p.output_window(d)).collect();
        assert_eq!(windows[2], Window { row0: 52, col0: 0, rows: 25, cols: 8 });
        assert_eq!(windows[3].row0 + windows[3].rows, 102);
        let p = Problem::new(OpKind::AgGemm, 3, 8, 9, 4, F32, F32).unwrap();
        assert_eq!(p.input_shard(0, 1), Window { row0: 3, col0: 0, rows: 3, cols: 4 });
        assert_eq!(p.input_shard(0, 2), Window { row0: 6, col0: 0, rows: 2, cols: 4 });
        assert_eq!(p.output_window(2), Window { row0: 0, col0: 6, rows: 8, cols: 3 });
    }

    #[test]
    fn output_dtype_must_be_f32_or_input() {
        let e = Problem::new(OpKind::GemmAr, 2, 8, 8, 8, Bf16, F16).unwrap_err();
        assert_eq!(e, ProblemError::UnsupportedDtypes { op: OpKind::GemmAr, input: Bf16, output: F16 });
        assert!(Problem::new(OpKind::GemmAr, 2, 8, 8, 8, F16, F32).is_ok());
        assert!(Problem::new(OpKind::GemmAr, 2, 8, 8, 8, F16, F16).is_ok());
    }

    #[test]
    fn tensors_beyond_the_generator_index_are_rejected() {
        let e = Problem::new(OpKind::AgGemm, 1, 1 << 17, 4, 1 << 16, F32, F32).unwrap_err();
        assert!(matches!(e, ProblemError::TooLarge { tensor: "A", .. }), "{e}");
        // The range is checked last: every other error is still itself.
        let e = Problem::new(OpKind::AgGemm, 3, 1 << 17, 4, 1 << 16, F32, F32).unwrap_err();
        assert!(matches!(e, ProblemError::Indivisible { .. }), "{e}");
        // A problem past the range (built only by the `simulate` command) plans, and
        // executors refuse the plan.
        let p = Problem {
            devices: 2,
            m: 1 << 17,
            k: 1 << 16,
            ..Problem::new(OpKind::AgGemm, 2, 8, 4, 8, F32, F32).unwrap()
        };
        let plan = crate::algorithms::build_plan(&p, crate::Algorithm::Ring).unwrap();
        let e = plan.check_generator_range().unwrap_err();
        assert!(matches!(e, crate::plan::PlanError::GeneratorRange { .. }), "{e}");
    }

    #[test]
    fn shards_tile_the_global_tensors() {
        let p = Problem::new(OpKind::AgGemm, 4, 8, 12, 5, F32, F32).unwrap();
        assert_eq!(p.input_shard(0, 2), Window { row0: 4, col0: 0, rows: 2, cols: 5 });
        assert_eq!(p.input_shard(1, 3), Window { row0: 0, col0: 9, rows: 5, cols: 3 });
        assert_eq!(p.output_window(1), Window { row0: 0, col0: 3, rows: 8, cols: 3 });
        let p = Problem::new(OpKind::GemmRs, 2, 8, 6, 4, F32, F32).unwrap();
        assert_eq!(p.input_shard(0, 1), Window { row0: 0, col0: 2, rows: 8, cols: 2 });
        assert_eq!(p.input_shard(1, 1), Window { row0: 2, col0: 0, rows: 2, cols: 6 });
        assert_eq!(p.output_window(1), Window { row0: 4, col0: 0, rows: 4, cols: 6 });
    }
}
