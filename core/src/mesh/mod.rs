//! The 2D mesh family (BRIEF §3.4, seed 002): `mesh_gemm` on an Nr×Nc mesh of chips,
//! chip (i, j) being device `i·Nc + j`, in three dataflows:
//!
//! | dataflow | global GEMM | chip (i, j) holds | flows within its mesh row | flows within its mesh column |
//! |---|---|---|---|---|
//! | OS (C stationary) | C = A·B, A M×K, B K×N | A_ij (M/Nr)×(K/Nc), B_ij (K/Nr)×(N/Nc) | A (AllGather) | B (AllGather) |
//! | LS (A stationary) | C = A·Bᵀ, A M×K, B N×K | A_ij (M/Nr)×(K/Nc), B_ij (N/Nr)×(K/Nc) | C partials (ReduceScatter along N) | B (AllGather) |
//! | RS (B stationary) | C = Aᵀ·B, A K×M, B K×N | A_ij (K/Nr)×(M/Nc), B_ij (K/Nr)×(N/Nc) | A (AllGather) | C partials (ReduceScatter along M) |
//!
//! In every dataflow chip (i, j) ends with block (i, j) of C, (M/Nr)×(N/Nc). Shards are
//! blocks of the global tensors A (generator id 0) and B (id 1).
//!
//! Algorithms ([`MeshAlgorithm`]) turn a [`MeshProblem`] into a [`Plan`] (module
//! `plans`); [`mesh_traffic`] measures what a plan sends in each mesh direction.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::dtype::DType;
use crate::plan::PlanError;
use crate::problem::{GlobalGemm, ShardedGemm, Window};

mod plans;
mod traffic;

pub use plans::build_mesh_plan;
pub use plans::{gcd, lcm};
pub use traffic::{mesh_traffic, MeshTraffic};

/// Which matrix stays on its chip (seed 002 §2.3.1, figure 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dataflow {
    /// Output stationary: C = A·B; A flows within mesh rows, B within mesh columns.
    Os,
    /// Left (A) stationary: C = A·Bᵀ; B flows within mesh columns, C partials within rows.
    Ls,
    /// Right (B) stationary: C = Aᵀ·B; A flows within mesh rows, C partials within columns.
    Rs,
}

names!(Dataflow, "dataflow", { Os => "os", Ls => "ls", Rs => "rs" });

/// A 2D algorithm with its parameters (seed 002 §2.3, §3.1). Exhaustive on purpose, as
/// [`crate::OpKind`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeshAlgorithm {
    /// One AllGather / ReduceScatter per mesh direction, both directions at once, and
    /// the GEMM before or after them: no overlap of communication with compute.
    Collective,
    /// K steps (panels) of ring broadcast and ring reduce to the panel's owner.
    Summa,
    /// Square meshes only: skew the moving operand(s), then shift by one chip per step.
    Cannon,
    /// One mesh direction (`ring`) as a ring of send/recv overlapped with partial GEMMs,
    /// the other direction as one collective.
    Wang {
        /// The direction decomposed into the ring.
        ring: WangRing,
        /// Whether the ring runs both ways round (BRIEF §4's bidirectional ring: two links
        /// of their own on a torus, half the ring's time) or one way (through a switch,
        /// where both ways share the chip's port, the first block arrives sooner).
        bidir: bool,
    },
    /// S slices of block size B, each a partial AllGather / ReduceScatter in both
    /// directions, software-pipelined with the partial GEMMs.
    MeshSlice {
        /// Slices S.
        slices: usize,
        /// Block size B (rows or columns per block of a slice).
        block: usize,
    },
}

/// Whether `dataflow`'s partial sums can travel in `wire`: a float type, and f32 for OS,
/// which sends none.
pub fn check_wire(dataflow: Dataflow, wire: DType) -> Result<(), MeshError> {
    if dataflow == Dataflow::Os && wire != DType::F32 || !wire.is_float() {
        return Err(MeshError::Wire { dataflow, wire });
    }
    Ok(())
}

/// The mesh direction Wang's algorithm decomposes into a ring of sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WangRing {
    /// Within each mesh row, over Nc chips.
    Rows,
    /// Within each mesh column, over Nr chips.
    Columns,
}

impl MeshAlgorithm {
    /// Algorithm names as used in case files.
    pub const NAMES: [&'static str; 8] =
        ["collective", "summa", "cannon", "wang", "wang_bidir", "wang_columns", "wang_columns_bidir", "meshslice"];

    /// Wang's four variants: each direction as the ring, one way and both ways round.
    pub const WANG: [MeshAlgorithm; 4] = [
        MeshAlgorithm::Wang { ring: WangRing::Rows, bidir: false },
        MeshAlgorithm::Wang { ring: WangRing::Rows, bidir: true },
        MeshAlgorithm::Wang { ring: WangRing::Columns, bidir: false },
        MeshAlgorithm::Wang { ring: WangRing::Columns, bidir: true },
    ];

    /// Name as used in case files (without parameters).
    pub fn name(self) -> &'static str {
        match self {
            MeshAlgorithm::Collective => "collective",
            MeshAlgorithm::Summa => "summa",
            MeshAlgorithm::Cannon => "cannon",
            MeshAlgorithm::Wang { ring: WangRing::Rows, bidir: false } => "wang",
            MeshAlgorithm::Wang { ring: WangRing::Rows, bidir: true } => "wang_bidir",
            MeshAlgorithm::Wang { ring: WangRing::Columns, bidir: false } => "wang_columns",
            MeshAlgorithm::Wang { ring: WangRing::Columns, bidir: true } => "wang_columns_bidir",
            MeshAlgorithm::MeshSlice { .. } => "meshslice",
        }
    }

    /// Parses a case file's algorithm name with its optional slice count and block size.
    pub fn parse(name: &str, slices: Option<usize>, block: Option<usize>) -> Result<Self, MeshError> {
        let algorithm = match name {
            "collective" => MeshAlgorithm::Collective,
            "summa" => MeshAlgorithm::Summa,
            "cannon" => MeshAlgorithm::Cannon,
            "meshslice" => {
                let missing = |parameter| MeshError::MissingParameter { algorithm: "meshslice", parameter };
                MeshAlgorithm::MeshSlice {
                    slices: slices.ok_or(missing("slices"))?,
                    block: block.ok_or(missing("block"))?,
                }
            }
            other => match MeshAlgorithm::WANG.into_iter().find(|a| a.name() == other) {
                Some(wang) => wang,
                None => return Err(MeshError::UnknownAlgorithm { name: other.to_string() }),
            },
        };
        if !matches!(algorithm, MeshAlgorithm::MeshSlice { .. }) {
            for (given, parameter) in [(slices, "slices"), (block, "block")] {
                if given.is_some() {
                    return Err(MeshError::UnexpectedParameter { algorithm: algorithm.name(), parameter });
                }
            }
        }
        Ok(algorithm)
    }
}

impl fmt::Display for MeshAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeshAlgorithm::MeshSlice { slices, block } => write!(f, "meshslice(S={slices},B={block})"),
            other => f.write_str(other.name()),
        }
    }
}

/// Why a mesh problem, algorithm or measurement is invalid.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MeshError {
    /// The mesh has too many chips.
    #[error("mesh {nr}x{nc}: {count}")]
    Devices {
        /// Rows.
        nr: usize,
        /// Columns.
        nc: usize,
        /// The count (not a `source`: the message already quotes it).
        count: crate::plan::TooManyDevices,
    },
    /// The mesh has no rows or no columns.
    #[error("mesh {nr}x{nc}: Nr and Nc must both be at least 1")]
    EmptyMesh {
        /// Mesh rows Nr.
        nr: usize,
        /// Mesh columns Nc.
        nc: usize,
    },
    /// A global dimension is zero.
    #[error("mesh_gemm {dataflow}: dimension {dim} is 0 (M={m}, N={n}, K={k})")]
    ZeroDimension {
        /// The dataflow.
        dataflow: Dataflow,
        /// Which dimension ("M", "N" or "K").
        dim: &'static str,
        /// Global M.
        m: usize,
        /// Global N.
        n: usize,
        /// Global K.
        k: usize,
    },
    /// A dimension the dataflow's sharding splits over the mesh rows or columns is not a
    /// multiple of their count.
    #[error("mesh_gemm {dataflow}: {dim}={size} is not divisible by {axis}={parts} (the {dataflow} sharding splits {dim} into {axis} equal blocks)")]
    Indivisible {
        /// The dataflow.
        dataflow: Dataflow,
        /// Which dimension.
        dim: &'static str,
        /// Its size.
        size: usize,
        /// "Nr" or "Nc".
        axis: &'static str,
        /// The mesh rows or columns.
        parts: usize,
    },
    /// The output dtype is neither f32 nor the input dtype.
    #[error("mesh_gemm: output dtype {output} with input dtype {input} is unsupported (the output is f32 or the input dtype)")]
    UnsupportedDtypes {
        /// Input dtype.
        input: DType,
        /// Requested output dtype.
        output: DType,
    },
    /// A narrower wire dtype for OS (no partial sums travel), or one that is not a float type.
    #[error("mesh_gemm {dataflow}: partial sums travel as f32, f16 or bf16, and only the LS and RS dataflows send partial sums (got wire dtype {wire})")]
    Wire {
        /// The dataflow.
        dataflow: Dataflow,
        /// The requested wire dtype.
        wire: DType,
    },
    /// A tensor has more elements than the generator can index (2^32).
    #[error("mesh_gemm: tensor {tensor} has {elements} elements, more than the 2^32 the input generator indexes")]
    TooLarge {
        /// Which tensor.
        tensor: &'static str,
        /// Its element count.
        elements: u128,
    },
    /// The algorithm name is not known.
    #[error("unknown mesh algorithm `{name}` (expected collective, summa, cannon, wang, wang_bidir, wang_columns, wang_columns_bidir or meshslice)")]
    UnknownAlgorithm {
        /// The name given.
        name: String,
    },
    /// A required parameter is missing.
    #[error("mesh algorithm {algorithm} needs the parameter `{parameter}`")]
    MissingParameter {
        /// Algorithm.
        algorithm: &'static str,
        /// Parameter.
        parameter: &'static str,
    },
    /// A parameter was given that the algorithm does not take.
    #[error("mesh algorithm {algorithm} takes no parameter `{parameter}`")]
    UnexpectedParameter {
        /// Algorithm.
        algorithm: &'static str,
        /// Parameter.
        parameter: &'static str,
    },
    /// Cannon's algorithm runs on square meshes only.
    #[error("cannon needs a square mesh (Nr = Nc); {nr}x{nc} is not square")]
    NotSquare {
        /// Mesh rows.
        nr: usize,
        /// Mesh columns.
        nc: usize,
    },
    /// MeshSlice with no slices or an empty block.
    #[error("meshslice: S={slices} and B={block} must both be at least 1")]
    ZeroSlicing {
        /// Slices S.
        slices: usize,
        /// Block size B.
        block: usize,
    },
    /// S·B does not divide a per-chip extent of the sliced dimension, so the slices of
    /// the two flowing matrices would not gather the same indices.
    #[error("meshslice {dataflow}: S·B = {slices}·{block} = {} does not divide {what}={size} (slice s = {{x : (x / B) mod S = s}} of the sliced dimension {dim} must cut every chip's extent into whole S·B groups)", *slices as u128 * *block as u128)]
    SliceIndivisible {
        /// The dataflow.
        dataflow: Dataflow,
        /// The sliced dimension (K for OS, N for LS, M for RS).
        dim: &'static str,
        /// The per-chip extent, e.g. "K/Nr".
        what: String,
        /// Its size.
        size: usize,
        /// Slices S.
        slices: usize,
        /// Block size B.
        block: usize,
    },
    /// A plan measured against a mesh of another size.
    #[error("plan `{plan}` has {devices} devices, the {nr}x{nc} mesh has {}", *nr as u128 * *nc as u128)]
    DeviceCount {
        /// Plan name.
        plan: String,
        /// Devices of the plan.
        devices: usize,
        /// Mesh rows.
        nr: usize,
        /// Mesh columns.
        nc: usize,
    },
    /// The produced plan failed validation (a bug in the algorithm). Boxed: it is
    /// large and rare.
    #[error(transparent)]
    Plan(Box<PlanError>),
}

impl From<PlanError> for MeshError {
    fn from(e: PlanError) -> Self {
        MeshError::Plan(Box::new(e))
    }
}

/// A validated `mesh_gemm` problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MeshProblem {
    /// Mesh rows Nr.
    pub nr: usize,
    /// Mesh columns Nc.
    pub nc: usize,
    /// The dataflow.
    pub dataflow: Dataflow,
    /// Global M (rows of C).
    pub m: usize,
    /// Global N (columns of C).
    pub n: usize,
    /// Global K (the contracted dimension).
    pub k: usize,
    /// Input dtype of A and B.
    pub input: DType,
    /// Output dtype of C.
    pub output: DType,
    /// The dtype LS/RS partial sums are stored and travel in (f32 unless
    /// [`MeshProblem::with_wire`] asks for a narrower one; OS has no partial sums).
    pub wire: DType,
}

impl MeshProblem {
    /// The same problem with LS/RS partial sums in `wire`: each chip's partial is rounded
    /// to it, and so is every running sum a hop adds up, halving the bytes the
    /// ReduceScatters move at f16 or bf16 (as seed 002's TPU runs send them).
    pub fn with_wire(self, wire: DType) -> Result<MeshProblem, MeshError> {
        check_wire(self.dataflow, wire)?;
        Ok(MeshProblem { wire, ..self })
    }

    /// Validates and builds a problem.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        nr: usize,
        nc: usize,
        dataflow: Dataflow,
        m: usize,
        n: usize,
        k: usize,
        input: DType,
        output: DType,
    ) -> Result<Self, MeshError> {
        if nr == 0 || nc == 0 {
            return Err(MeshError::EmptyMesh { nr, nc });
        }
        crate::plan::check_device_count(nr as u128 * nc as u128).map_err(|count| MeshError::Devices {
            nr,
            nc,
            count,
        })?;
        for (dim, size) in [("M", m), ("N", n), ("K", k)] {
            if size == 0 {
                return Err(MeshError::ZeroDimension { dataflow, dim, m, n, k });
            }
        }
        // What the sharding splits (see the module table); C is always split M by Nr
        // and N by Nc.
        let split: [(&'static str, usize, &'static str, usize); 4] = match dataflow {
            Dataflow::Os => [("M", m, "Nr", nr), ("K", k, "Nc", nc), ("K", k, "Nr", nr), ("N", n, "Nc", nc)],
            Dataflow::Ls => [("M", m, "Nr", nr), ("K", k, "Nc", nc), ("N", n, "Nr", nr), ("N", n, "Nc", nc)],
            Dataflow::Rs => [("K", k, "Nr", nr), ("M", m, "Nc", nc), ("N", n, "Nc", nc), ("M", m, "Nr", nr)],
        };
        for (dim, size, axis, parts) in split {
            if size % parts != 0 {
                return Err(MeshError::Indivisible { dataflow, dim, size, axis, parts });
            }
        }
        if output != DType::F32 && output != input {
            return Err(MeshError::UnsupportedDtypes { input, output });
        }
        for (tensor, elements) in
            [("A", m as u128 * k as u128), ("B", k as u128 * n as u128), ("C", m as u128 * n as u128)]
        {
            if elements > u32::MAX as u128 {
                return Err(MeshError::TooLarge { tensor, elements });
            }
        }
        Ok(MeshProblem { nr, nc, dataflow, m, n, k, input, output, wire: DType::F32 })
    }

    /// Like [`MeshProblem::new`] without the input generator's 2^32-element limit: for
    /// problems that are only simulated (whole-model shapes at hundreds of chips). Their
    /// plans cannot be executed: executors reject them with
    /// [`crate::plan::PlanError::GeneratorRange`].
    #[allow(clippy::too_many_arguments)]
    pub fn for_simulation(
        nr: usize,
        nc: usize,
        dataflow: Dataflow,
        m: usize,
        n: usize,
        k: usize,
        input: DType,
        output: DType,
    ) -> Result<Self, MeshError> {
        // `new` checks the generator's range last, so any other error (an empty mesh, a
        // zero or indivisible dimension, a dtype pair) still comes back as itself.
        match MeshProblem::new(nr, nc, dataflow, m, n, k, input, output) {
            Err(MeshError::TooLarge { .. }) => {
                Ok(MeshProblem { nr, nc, dataflow, m, n, k, input, output, wire: DType::F32 })
            }
            other => other,
        }
    }

    /// Number of chips, Nr·Nc.
    pub fn devices(&self) -> usize {
        self.nr * self.nc
    }

    /// The device id of chip (i, j).
    pub fn device(&self, i: usize, j: usize) -> usize {
        i * self.nc + j
    }

    /// The chip (i, j) of a device id.
    pub fn chip(&self, device: usize) -> (usize, usize) {
        (device / self.nc, device % self.nc)
    }

    /// The window of global tensor `tensor` (0 = A, 1 = B, as stored) that `device` holds.
    pub fn input_shard(&self, tensor: u32, device: usize) -> Window {
        let (i, j) = self.chip(device);
        let (nr, nc, m, n, k) = (self.nr, self.nc, self.m, self.n, self.k);
        let block = |rows: usize, cols: usize| Window { row0: i * rows, col0: j * cols, rows, cols };
        match (self.dataflow, tensor) {
            (Dataflow::Os, 0) | (Dataflow::Ls, 0) => block(m / nr, k / nc),
            (Dataflow::Os, _) => block(k / nr, n / nc),
            (Dataflow::Ls, _) => block(n / nr, k / nc),
            (Dataflow::Rs, 0) => block(k / nr, m / nc),
            (Dataflow::Rs, _) => block(k / nr, n / nc),
        }
    }

    /// The window of the global C that `device` produces: block (i, j).
    pub fn output_window(&self, device: usize) -> Window {
        let (i, j) = self.chip(device);
        let (rows, cols) = (self.m / self.nr, self.n / self.nc);
        Window { row0: i * rows, col0: j * cols, rows, cols }
    }

    /// The dimension MeshSlice slices, with its per-chip extents along the mesh rows and
    /// columns: the dimension both flowing matrices share (K for OS; N for LS, gathered
    /// from B and scattered over C; M for RS, gathered from A and scattered over C).
    pub fn sliced_dimension(&self) -> (&'static str, [(String, usize); 2]) {
        let (dim, size) = match self.dataflow {
            Dataflow::Os => ("K", self.k),
            Dataflow::Ls => ("N", self.n),
            Dataflow::Rs => ("M", self.m),
        };
        (dim, [(format!("{dim}/Nr"), size / self.nr), (format!("{dim}/Nc"), size / self.nc)])
    }

    /// MeshSlice's largest block size B for `slices` slices: S·B divides both sliced
    /// extents (seed 002: S·B | K/Nr and S·B | K/Nc for OS). `None` if S divides neither.
    pub fn largest_block(&self, slices: usize) -> Option<usize> {
        let (_, [(_, along_rows), (_, along_cols)]) = self.sliced_dimension();
        let common = gcd(along_rows, along_cols);
        (slices > 0 && common % slices == 0).then(|| common / slices)
    }

    /// The bytes each device sends by the traffic cost of seed 002 §2.3.1: within its
    /// mesh row (Nc−1)·size(M_c)/(Nr·Nc), within its mesh column (Nr−1)·size(M_r)/(Nr·Nc),
    /// where M_c and M_r are the matrices flowing horizontally and vertically (inputs in
    /// the input dtype, C partial sums in the wire dtype), as `(row, column)`.
    pub fn analytic_traffic(&self) -> (u64, u64) {
        let (input, partial) = (self.input.size_bytes() as u64, self.wire.size_bytes() as u64);
        let (a, b, c) =
            ((self.m * self.k) as u64 * input, (self.k * self.n) as u64 * input, (self.m * self.n) as u64 * partial);
        let (horizontal, vertical) = match self.dataflow {
            Dataflow::Os => (a, b),
            Dataflow::Ls => (c, b),
            Dataflow::Rs => (a, c),
        };
        let chips = self.devices() as u64;
        ((self.nc as u64 - 1) * horizontal / chips, (self.nr as u64 - 1) * vertical / chips)
    }

    /// Floating-point operations of the global GEMM.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// A short shape string, e.g. `2x4 os M=64 N=32 K=96`.
    pub fn shape_string(&self) -> String {
        let wire = if self.wire == DType::F32 { String::new() } else { format!(" wire={}", self.wire) };
        format!("{}x{} {} M={} N={} K={}{wire}", self.nr, self.nc, self.dataflow, self.m, self.n, self.k)
    }

    /// Chips along the axis the partial sums are reduced over: Nc for LS (a mesh row),
    /// Nr for RS (a mesh column), none for OS.
    fn reduce_ring(&self) -> usize {
        match self.dataflow {
            Dataflow::Os => 0,
            Dataflow::Ls => self.nc,
            Dataflow::Rs => self.nr,
        }
    }
}

impl ShardedGemm for MeshProblem {
    fn device_count(&self) -> usize {
        self.devices()
    }

    fn global(&self) -> GlobalGemm {
        GlobalGemm {
            m: self.m,
            n: self.n,
            k: self.k,
            trans_a: self.dataflow == Dataflow::Rs,
            trans_b: self.dataflow == Dataflow::Ls,
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

    /// Each chip's partial is rounded to the wire dtype once, then once more at each of
    /// the Nc − 1 (LS) or Nr − 1 (RS) hops whose sum is stored before it travels on.
    fn partial_rounding(&self) -> Option<(DType, usize)> {
        (self.wire != DType::F32).then_some((self.wire, self.reduce_ring()))
    }
}

#[cfg(test)]
mod tests;
