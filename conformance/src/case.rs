//! The corpus: `cases/*.toml`, each a list of `[[case]]` tables.
//!
//! ```toml
//! [[case]]
//! name = "ag_gemm_ring_d4_bf16_f32_exact"
//! op = "ag_gemm"            # ag_gemm | gemm_rs | gemm_ar | mesh_gemm
//! algorithm = "ring"        # baseline | ring | ring_bidir | ring_chunked
//! chunks = 2                # only with ring_chunked
//! node = 2                  # only with hierarchical: GPUs per node
//! devices = 4               # 1D ops: the ring size D
//! m = 96                    # global GEMM C = A·B: A is M×K, B is K×N
//! n = 32
//! k = 256
//! input = "bf16"            # f32 | f16 | bf16
//! output = "f32"            # f32 or the input dtype
//! family = "exact"          # exact | realistic
//! seed = 7
//!
//! [[case]]
//! name = "mesh_os_meshslice_2x4_bf16_f32_exact"
//! op = "mesh_gemm"
//! dataflow = "os"           # os (C = A·B) | ls (C = A·Bᵀ) | rs (C = Aᵀ·B)
//! nr = 2                    # mesh rows and columns (instead of `devices`)
//! nc = 4
//! algorithm = "meshslice"   # collective | summa | cannon | wang[_columns][_bidir] | meshslice
//! slices = 2                # only with meshslice: S
//! block = 4                 # only with meshslice: B
//! m = 32
//! …                         # n, k, input, output, family, seed as above
//!
//! [[case]]
//! name = "linear_mlp_train_ring_d4_mb2_bf16_realistic"
//! op = "linear"
//! layer = "mlp"             # column | row | mlp
//! pass = "train"            # forward | backward (column, row) | train (mlp)
//! sp = true                 # sequence parallelism (the mlp block needs it)
//! devices = 4
//! microbatches = 2
//! algorithm = "ring"        # baseline | megatron | ring
//! m = 32                    # S tokens per micro-batch; n = F features out, k = H in
//! …                         # n, k, input, output (= input), family, seed as above
//!
//! [[case]]
//! name = "attn_causal_balanced_ring_d4_h4kv2_dh64_bf16"
//! op = "attention"
//! devices = 4
//! algorithm = "ring"        # baseline | ring | ring_bidir (prefill) | split_kv (decode)
//! m = 64                    # S, the sequence length; n = h query heads; k = dh
//! n = 4
//! k = 64
//! kv_heads = 2              # divides n; fewer than n is grouped-query attention
//! causal = true
//! layout = "balanced"       # contiguous (default) | balanced (prefill only)
//! queries = 2               # decode only: the last `queries` positions attend
//! …                         # input, output (= input), family (= realistic), seed
//! ```
//!
//! Loading checks the syntax, the field types, that the fields fit the op (`devices`
//! for the 1D ops; `nr`, `nc` and `dataflow` for `mesh_gemm`) and that names are unique
//! and usable as file names; whether a case describes a valid problem is checked when
//! it runs, so an invalid case is a failed row rather than a refusal to run the rest.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use cmm_core::attention::build_attention_plan;
use cmm_core::linear::build_linear_plan;
use cmm_core::mesh::build_mesh_plan;
use cmm_core::moe::build_moe_plan;
use cmm_core::{
    build_plan, Algorithm, AlgorithmError, AttentionAlgorithm, AttentionError, AttentionProblem, DType, Dataflow,
    Family, Layer, Layout, LinearAlgorithm, LinearError, LinearProblem, MeshAlgorithm, MeshError, MeshProblem,
    MoeError, MoeOp, MoeProblem, OpKind, Pass, Plan, PlanError, Problem, ProblemError, Routing, ShardedGemm, Workload,
};
use serde::Deserialize;
use thiserror::Error;

/// What a case computes and on which devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Topology {
    /// A 1D op on a ring of `devices` devices.
    Ring {
        /// The op.
        op: OpKind,
        /// Ring size D.
        devices: usize,
        /// The dtype partial sums travel in (gemm_rs, gemm_ar; `None`: f32).
        wire: Option<DType>,
    },
    /// `mesh_gemm` on an Nr×Nc mesh.
    Mesh {
        /// Mesh rows Nr.
        nr: usize,
        /// Mesh columns Nc.
        nc: usize,
        /// The dataflow.
        dataflow: Dataflow,
        /// The dtype LS/RS partial sums travel in (`None`: f32).
        wire: Option<DType>,
    },
    /// A tensor-parallel linear layer (`op = "linear"`, [`cmm_core::linear`]).
    Linear {
        /// The layer.
        layer: Layer,
        /// The pass.
        pass: Pass,
        /// Sequence parallelism.
        sp: bool,
        /// D.
        devices: usize,
        /// Micro-batches.
        microbatches: usize,
    },
    /// A mixture-of-experts op (`op = "ag_moe"` or `"moe_rs"`, [`cmm_core::moe`]).
    Moe {
        /// The op.
        op: MoeOp,
        /// D.
        devices: usize,
        /// Experts E.
        experts: usize,
        /// Slots per token k.
        topk: usize,
        /// The router's distribution.
        routing: Routing,
    },
    /// Sequence-parallel attention (`op = "attention"`, [`cmm_core::attention`]).
    Attention {
        /// D.
        devices: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// Causal mask.
        causal: bool,
        /// Prefill layout.
        layout: Layout,
        /// Decode query count.
        queries: Option<usize>,
    },
}

/// One conformance case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Case {
    /// Unique name; also the golden's file name (`golden/<name>.bin`).
    pub name: String,
    /// The op and its devices.
    pub topology: Topology,
    /// Algorithm name (`ring`, …, or `collective`, …, `meshslice`).
    pub algorithm: String,
    /// Chunks per shard, for `ring_chunked` only.
    pub chunks: Option<usize>,
    /// GPUs per node, for `hierarchical` only.
    pub node: Option<usize>,
    /// MeshSlice's slice count S.
    pub slices: Option<usize>,
    /// MeshSlice's block size B.
    pub block: Option<usize>,
    /// Global M.
    pub m: usize,
    /// Global N.
    pub n: usize,
    /// Global K.
    pub k: usize,
    /// Input dtype.
    pub input: DType,
    /// Output dtype.
    pub output: DType,
    /// Input family.
    pub family: Family,
    /// Generator seed.
    pub seed: u32,
}

/// The fields of a `[[case]]` table as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseTable {
    name: String,
    op: String,
    algorithm: String,
    #[serde(default)]
    chunks: Option<usize>,
    #[serde(default)]
    node: Option<usize>,
    #[serde(default)]
    devices: Option<usize>,
    #[serde(default)]
    nr: Option<usize>,
    #[serde(default)]
    nc: Option<usize>,
    #[serde(default)]
    dataflow: Option<Dataflow>,
    #[serde(default)]
    slices: Option<usize>,
    #[serde(default)]
    block: Option<usize>,
    #[serde(default)]
    layer: Option<Layer>,
    #[serde(default)]
    pass: Option<Pass>,
    #[serde(default)]
    sp: Option<bool>,
    #[serde(default)]
    microbatches: Option<usize>,
    #[serde(default)]
    kv_heads: Option<usize>,
    #[serde(default)]
    causal: Option<bool>,
    #[serde(default)]
    layout: Option<Layout>,
    #[serde(default)]
    queries: Option<usize>,
    #[serde(default)]
    wire: Option<DType>,
    #[serde(default)]
    experts: Option<usize>,
    #[serde(default)]
    topk: Option<usize>,
    #[serde(default)]
    routing: Option<String>,
    m: usize,
    n: usize,
    k: usize,
    input: DType,
    output: DType,
    family: Family,
    seed: u32,
}

/// The op name of the 2D family in case files.
pub const MESH_GEMM: &str = "mesh_gemm";

/// The op name of the linear-layer family in case files.
pub const LINEAR: &str = "linear";

/// The op name of the attention family in case files.
pub const ATTENTION: &str = "attention";

impl CaseTable {
    /// The case, if the fields fit the op.
    fn into_case(self) -> Result<Case, String> {
        let given = |present: bool, field: &str, list: &mut Vec<String>| {
            if present {
                list.push(format!("`{field}`"));
            }
        };
        for dtype in [self.input, self.output] {
            if !dtype.is_float() {
                return Err(format!("{dtype} is a routing-table type; a case's input and output are f32, f16 or bf16"));
            }
        }
        let mut foreign = Vec::new();
        let linear_fields = [
            (self.layer.is_some(), "layer"),
            (self.pass.is_some(), "pass"),
            (self.sp.is_some(), "sp"),
            (self.microbatches.is_some(), "microbatches"),
        ];
        let attention_fields = [
            (self.kv_heads.is_some(), "kv_heads"),
            (self.causal.is_some(), "causal"),
            (self.layout.is_some(), "layout"),
            (self.queries.is_some(), "queries"),
        ];
        let mesh_fields = [
            (self.nr.is_some(), "nr"),
            (self.nc.is_some(), "nc"),
            (self.dataflow.is_some(), "dataflow"),
            (self.slices.is_some(), "slices"),
            (self.block.is_some(), "block"),
        ];
        let moe_fields =
            [(self.experts.is_some(), "experts"), (self.topk.is_some(), "topk"), (self.routing.is_some(), "routing")];
        let chunks_field = [(self.chunks.is_some(), "chunks")];
        let node_field = [(self.node.is_some(), "node")];
        let wire_fields = [(self.wire.is_some(), "wire")];
        let devices_field = [(self.devices.is_some(), "devices")];
        // The fields of the other families are foreign to each op.
        let mut reject = |groups: &[&[(bool, &str)]]| {
            for (present, field) in groups.iter().flat_map(|g| g.iter()) {
                given(*present, field, &mut foreign);
            }
        };
        let moe_op = self.op.parse::<MoeOp>().ok();
        let topology = if let Some(op) = moe_op {
            reject(&[&mesh_fields, &linear_fields, &attention_fields, &wire_fields, &node_field]);
            let missing = |field: &str| format!("{op} needs the field `{field}`");
            let routing = self.routing.as_deref().ok_or_else(|| missing("routing"))?.parse()?;
            Topology::Moe {
                op,
                devices: self.devices.ok_or_else(|| missing("devices"))?,
                experts: self.experts.ok_or_else(|| missing("experts"))?,
                topk: self.topk.ok_or_else(|| missing("topk"))?,
                routing,
            }
        } else if self.op == ATTENTION {
            reject(&[&chunks_field, &node_field, &wire_fields, &mesh_fields, &linear_fields, &moe_fields]);
            if self.output != self.input {
                return Err(format!("{ATTENTION}: output must equal input ({}); the log-sum-exp is f32", self.input));
            }
            let missing = |field: &str| format!("{ATTENTION} needs the field `{field}`");
            Topology::Attention {
                devices: self.devices.ok_or_else(|| missing("devices"))?,
                kv_heads: self.kv_heads.ok_or_else(|| missing("kv_heads"))?,
                causal: self.causal.ok_or_else(|| missing("causal"))?,
                layout: self.layout.unwrap_or(Layout::Contiguous),
                queries: self.queries,
            }
        } else if self.op == MESH_GEMM {
            reject(&[&devices_field, &chunks_field, &node_field, &linear_fields, &attention_fields, &moe_fields]);
            let missing = |field: &str| format!("{MESH_GEMM} needs the field `{field}`");
            Topology::Mesh {
                nr: self.nr.ok_or_else(|| missing("nr"))?,
                nc: self.nc.ok_or_else(|| missing("nc"))?,
                dataflow: self.dataflow.ok_or_else(|| missing("dataflow"))?,
                wire: self.wire,
            }
        } else if self.op == LINEAR {
            reject(&[&chunks_field, &node_field, &wire_fields, &mesh_fields, &attention_fields, &moe_fields]);
            let missing = |field: &str| format!("{LINEAR} needs the field `{field}`");
            if self.output != self.input {
                return Err(format!(
                    "{LINEAR}: output must equal input ({}): activations and gradients keep the input dtype, main_grad is f32",
                    self.input
                ));
            }
            Topology::Linear {
                layer: self.layer.ok_or_else(|| missing("layer"))?,
                pass: self.pass.ok_or_else(|| missing("pass"))?,
                sp: self.sp.ok_or_else(|| missing("sp"))?,
                devices: self.devices.ok_or_else(|| missing("devices"))?,
                microbatches: self.microbatches.ok_or_else(|| missing("microbatches"))?,
            }
        } else {
            let op: OpKind = self.op.parse().map_err(|_| {
                format!(
                    "unknown op `{}` (expected ag_gemm, gemm_rs, gemm_ar, {MESH_GEMM}, {LINEAR}, {ATTENTION}, ag_moe or moe_rs)",
                    self.op
                )
            })?;
            reject(&[&mesh_fields, &linear_fields, &attention_fields, &moe_fields]);
            let devices = self.devices.ok_or_else(|| format!("{op} needs the field `devices`"))?;
            Topology::Ring { op, devices, wire: self.wire }
        };
        if !foreign.is_empty() {
            return Err(format!("{} does not take {}", self.op, foreign.join(", ")));
        }
        Ok(Case {
            name: self.name,
            topology,
            algorithm: self.algorithm,
            chunks: self.chunks,
            node: self.node,
            slices: self.slices,
            block: self.block,
            m: self.m,
            n: self.n,
            k: self.k,
            input: self.input,
            output: self.output,
            family: self.family,
            seed: self.seed,
        })
    }
}

/// The validated problem of a case, of any family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaseProblem {
    /// A 1D ring problem.
    Ring(Problem),
    /// A 2D mesh problem.
    Mesh(MeshProblem),
    /// A linear-layer problem.
    Linear(LinearProblem),
    /// An attention problem.
    Attention(AttentionProblem),
    /// An MoE problem.
    Moe(MoeProblem),
}

impl CaseProblem {
    /// The sharded GEMM of a 1D or mesh case (`None` for the linear family).
    pub fn sharded(&self) -> Option<&dyn ShardedGemm> {
        match self {
            CaseProblem::Ring(p) => Some(p),
            CaseProblem::Mesh(p) => Some(p),
            CaseProblem::Linear(_) | CaseProblem::Attention(_) | CaseProblem::Moe(_) => None,
        }
    }

    /// What the oracle and the check need, whatever the family.
    pub fn workload(&self) -> &dyn Workload {
        match self {
            CaseProblem::Ring(p) => p,
            CaseProblem::Mesh(p) => p,
            CaseProblem::Linear(p) => p,
            CaseProblem::Attention(p) => p,
            CaseProblem::Moe(p) => p,
        }
    }
}

/// Why a case has no problem or no plan.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CaseError {
    /// The 1D problem is invalid.
    #[error(transparent)]
    Problem(#[from] ProblemError),
    /// The 1D algorithm is unknown or cannot plan the problem.
    #[error(transparent)]
    Algorithm(#[from] AlgorithmError),
    /// The mesh problem is invalid, or the mesh algorithm unknown or unable to plan it.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// The linear problem is invalid.
    #[error(transparent)]
    Linear(#[from] LinearError),
    /// The linear algorithm is unknown, or its plan failed validation.
    #[error("{0}")]
    LinearPlan(String),
    /// The attention problem is invalid.
    #[error(transparent)]
    Attention(#[from] AttentionError),
    /// The attention algorithm is unknown, or cannot plan the problem.
    #[error("{0}")]
    AttentionPlan(String),
    /// The MoE problem is invalid, or the algorithm cannot plan it.
    #[error(transparent)]
    Moe(#[from] MoeError),
}

/// An algorithm of either family, with its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaseAlgorithm {
    /// A 1D algorithm.
    Ring(Algorithm),
    /// A 2D algorithm.
    Mesh(MeshAlgorithm),
    /// A linear-layer algorithm.
    Linear(LinearAlgorithm),
    /// An attention algorithm.
    Attention(AttentionAlgorithm),
}

impl fmt::Display for CaseAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaseAlgorithm::Ring(a) => a.fmt(f),
            CaseAlgorithm::Mesh(a) => a.fmt(f),
            CaseAlgorithm::Linear(a) => a.fmt(f),
            CaseAlgorithm::Attention(a) => a.fmt(f),
        }
    }
}

impl Case {
    /// Number of devices: D, or Nr·Nc.
    pub fn devices(&self) -> usize {
        match self.topology {
            Topology::Ring { devices, .. } => devices,
            // Saturating: a case is validated only when it runs, and absurd sizes must
            // not overflow before that.
            Topology::Mesh { nr, nc, .. } => nr.saturating_mul(nc),
            Topology::Linear { devices, .. } | Topology::Attention { devices, .. } | Topology::Moe { devices, .. } => {
                devices
            }
        }
    }

    /// The 1D op, or `None` for a mesh or linear case.
    pub fn ring_op(&self) -> Option<OpKind> {
        match self.topology {
            Topology::Ring { op, .. } => Some(op),
            Topology::Mesh { .. } | Topology::Linear { .. } | Topology::Attention { .. } | Topology::Moe { .. } => None,
        }
    }

    /// The op name as in case files.
    pub fn op_name(&self) -> &'static str {
        match self.topology {
            Topology::Ring { op, .. } => op.name(),
            Topology::Mesh { .. } => MESH_GEMM,
            Topology::Linear { .. } => LINEAR,
            Topology::Attention { .. } => ATTENTION,
            Topology::Moe { op, .. } => op.name(),
        }
    }

    /// The op as printed in reports: `ag_gemm`, `mesh_gemm os`, or `linear column bwd sp`.
    pub fn op_label(&self) -> String {
        match self.topology {
            Topology::Ring { op, wire: Some(wire), .. } => format!("{op} wire={wire}"),
            Topology::Ring { op, .. } => op.to_string(),
            Topology::Mesh { dataflow, wire: Some(wire), .. } => format!("{MESH_GEMM} {dataflow} wire={wire}"),
            Topology::Mesh { dataflow, .. } => format!("{MESH_GEMM} {dataflow}"),
            Topology::Linear { layer, pass, sp, .. } => {
                let pass = match pass {
                    Pass::Forward => "fwd",
                    Pass::Backward => "bwd",
                    Pass::Train => "train",
                };
                format!("{LINEAR} {layer} {pass}{}", if sp { " sp" } else { "" })
            }
            Topology::Attention { causal, layout, queries, .. } => {
                let mode = match queries {
                    Some(t) => format!("decode T={t}"),
                    None => layout.to_string(),
                };
                format!("attn {}{mode}", if causal { "causal " } else { "" })
            }
            Topology::Moe { op, experts, topk, routing, .. } => format!("{op} E{experts} k{topk} {routing}"),
        }
    }

    /// The devices as printed in reports: `4`, `2x4` for a mesh, `4·mb2` for a linear
    /// case over two micro-batches.
    pub fn devices_label(&self) -> String {
        match self.topology {
            Topology::Ring { devices, .. } => devices.to_string(),
            Topology::Mesh { nr, nc, .. } => format!("{nr}x{nc}"),
            Topology::Linear { devices, microbatches, .. } => format!("{devices}·mb{microbatches}"),
            Topology::Attention { devices, .. } | Topology::Moe { devices, .. } => devices.to_string(),
        }
    }

    /// The validated problem the case describes.
    pub fn problem(&self) -> Result<CaseProblem, CaseError> {
        let (m, n, k, input, output) = (self.m, self.n, self.k, self.input, self.output);
        Ok(match self.topology {
            Topology::Ring { op, devices, wire } => {
                let p = Problem::new(op, devices, m, n, k, input, output)?;
                CaseProblem::Ring(match wire {
                    Some(wire) => p.with_wire(wire)?,
                    None => p,
                })
            }
            Topology::Mesh { nr, nc, dataflow, wire } => {
                let p = MeshProblem::new(nr, nc, dataflow, m, n, k, input, output)?;
                CaseProblem::Mesh(match wire {
                    Some(wire) => p.with_wire(wire)?,
                    None => p,
                })
            }
            Topology::Linear { layer, pass, sp, devices, microbatches } => {
                CaseProblem::Linear(LinearProblem::new(layer, pass, sp, devices, microbatches, m, k, n, input)?)
            }
            Topology::Attention { devices, kv_heads, causal, layout, queries } => CaseProblem::Attention(
                AttentionProblem::new(devices, m, n, kv_heads, k, causal, layout, queries, input)?,
            ),
            Topology::Moe { op, devices, experts, topk, routing } => {
                CaseProblem::Moe(MoeProblem::new(op, devices, m, k, n, experts, topk, routing, input, output)?)
            }
        })
    }

    /// The algorithm the case names, with its parameters.
    pub fn algorithm(&self) -> Result<CaseAlgorithm, CaseError> {
        Ok(match self.topology {
            Topology::Ring { .. } => {
                CaseAlgorithm::Ring(Algorithm::parse_with(&self.algorithm, self.chunks, self.node)?)
            }
            Topology::Mesh { .. } => {
                CaseAlgorithm::Mesh(MeshAlgorithm::parse(&self.algorithm, self.slices, self.block)?)
            }
            Topology::Linear { .. } => CaseAlgorithm::Linear(self.algorithm.parse().map_err(CaseError::LinearPlan)?),
            Topology::Attention { .. } => {
                CaseAlgorithm::Attention(self.algorithm.parse().map_err(CaseError::AttentionPlan)?)
            }
            Topology::Moe { .. } => CaseAlgorithm::Ring(Algorithm::parse(&self.algorithm, self.chunks)?),
        })
    }

    /// The algorithm as printed in reports: `ring_chunked(c=2)`, `meshslice(S=2,B=4)`,
    /// or the name as written when it does not parse.
    pub fn algorithm_label(&self) -> String {
        self.algorithm().map_or_else(|_| self.algorithm.clone(), |a| a.to_string())
    }

    /// The plan of the case's algorithm for its problem.
    pub fn plan(&self) -> Result<Plan, CaseError> {
        Ok(match self.problem()? {
            CaseProblem::Ring(p) => build_plan(&p, Algorithm::parse_with(&self.algorithm, self.chunks, self.node)?)?,
            CaseProblem::Mesh(p) => {
                build_mesh_plan(&p, MeshAlgorithm::parse(&self.algorithm, self.slices, self.block)?)?
            }
            CaseProblem::Linear(p) => {
                let algorithm: LinearAlgorithm = self.algorithm.parse().map_err(CaseError::LinearPlan)?;
                build_linear_plan(&p, algorithm).map_err(|e: PlanError| CaseError::LinearPlan(e.to_string()))?
            }
            CaseProblem::Attention(p) => {
                let algorithm: AttentionAlgorithm = self.algorithm.parse().map_err(CaseError::AttentionPlan)?;
                build_attention_plan(&p, algorithm).map_err(|e| CaseError::AttentionPlan(e.to_string()))?
            }
            CaseProblem::Moe(p) => build_moe_plan(&p, Algorithm::parse(&self.algorithm, self.chunks)?)?,
        })
    }
}

/// Why the corpus cannot be loaded.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CorpusError {
    /// The corpus directory does not exist.
    #[error("corpus directory {} does not exist: pass `--cases DIR` or set {CASES_DIR_VAR} (a binary copied to another machine does not find the source tree it was built from)", dir.display())]
    MissingDir {
        /// The directory looked for.
        dir: PathBuf,
    },
    /// A directory or file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A case file is not valid TOML or has keys other than `case`.
    #[error("{}: {message}", path.display())]
    File {
        /// The case file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// One `[[case]]` table is malformed.
    #[error("{}: case #{index}{}: {message}", path.display(), name.as_ref().map(|n| format!(" `{n}`")).unwrap_or_default())]
    Case {
        /// The case file.
        path: PathBuf,
        /// Position of the case in its file, from 1.
        index: usize,
        /// The case's name, when it has one.
        name: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// Two cases share a name.
    #[error("case `{name}` is defined twice: in {} and in {}", first.display(), second.display())]
    DuplicateName {
        /// The name.
        name: String,
        /// File of the first definition.
        first: PathBuf,
        /// File of the second definition.
        second: PathBuf,
    },
    /// The directory holds no case at all.
    #[error("no case found in {} (a case file, or a directory of *.toml case files)", dir.display())]
    Empty {
        /// The corpus directory.
        dir: PathBuf,
    },
}

/// The environment variable that points the runner at a corpus directory.
pub const CASES_DIR_VAR: &str = "CMM_CASES_DIR";

/// The corpus directory: `$CMM_CASES_DIR` when set, else this crate's `cases/` in the
/// source tree it was built from (which a binary copied to another machine lacks:
/// [`load_corpus`] then says how to point it elsewhere).
pub fn cases_dir() -> PathBuf {
    std::env::var_os(CASES_DIR_VAR)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("cases"))
}

/// Loads every case of `dir/*.toml`, files in name order, cases in file order; `dir`
/// may also be one case file.
pub fn load_corpus(dir: &Path) -> Result<Vec<Case>, CorpusError> {
    if dir.is_file() {
        let text = fs::read_to_string(dir).map_err(|source| CorpusError::Io { path: dir.to_path_buf(), source })?;
        let cases = parse_cases(&text, dir)?;
        for (i, case) in cases.iter().enumerate() {
            if cases[..i].iter().any(|c| c.name == case.name) {
                return Err(CorpusError::DuplicateName {
                    name: case.name.clone(),
                    first: dir.to_path_buf(),
                    second: dir.to_path_buf(),
                });
            }
        }
        if cases.is_empty() {
            return Err(CorpusError::Empty { dir: dir.to_path_buf() });
        }
        return Ok(cases);
    }
    if !dir.is_dir() {
        return Err(CorpusError::MissingDir { dir: dir.to_path_buf() });
    }
    let io = |source| CorpusError::Io { path: dir.to_path_buf(), source };
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "toml") {
            files.push(path);
        }
    }
    files.sort();
    let mut cases: Vec<(Case, PathBuf)> = Vec::new();
    for path in files {
        let text = fs::read_to_string(&path).map_err(|source| CorpusError::Io { path: path.clone(), source })?;
        for case in parse_cases(&text, &path)? {
            if let Some((_, first)) = cases.iter().find(|(c, _)| c.name == case.name) {
                return Err(CorpusError::DuplicateName { name: case.name, first: first.clone(), second: path.clone() });
            }
            cases.push((case, path.clone()));
        }
    }
    if cases.is_empty() {
        return Err(CorpusError::Empty { dir: dir.to_path_buf() });
    }
    Ok(cases.into_iter().map(|(c, _)| c).collect())
}

/// Parses the text of one case file; `path` is only used in errors.
pub fn parse_cases(text: &str, path: &Path) -> Result<Vec<Case>, CorpusError> {
    let file_error = |message: String| CorpusError::File { path: path.to_path_buf(), message };
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| file_error(e.to_string()))?;
    if let Some(key) = table.keys().find(|k| *k != "case") {
        return Err(file_error(format!("unexpected top-level key `{key}` (a case file holds only [[case]] tables)")));
    }
    let Some(list) = table.get("case") else {
        return Ok(Vec::new());
    };
    let list = list.as_array().ok_or_else(|| file_error("`case` must be an array of tables ([[case]])".into()))?;
    let mut cases = Vec::with_capacity(list.len());
    for (i, value) in list.iter().enumerate() {
        let name = value.get("name").and_then(|v| v.as_str()).map(str::to_string);
        let case_error =
            |message: String| CorpusError::Case { path: path.to_path_buf(), index: i + 1, name: name.clone(), message };
        let table: CaseTable =
            value.clone().try_into().map_err(|e: toml::de::Error| case_error(e.message().trim().to_string()))?;
        let case = table.into_case().map_err(case_error)?;
        check_case_name(&case.name).map_err(case_error)?;
        cases.push(case);
    }
    Ok(cases)
}

/// Longest case name: it names a directory and a file (`<name>.bin`) on every platform.
pub const MAX_CASE_NAME: usize = 128;

/// Directory names an export holds beside its case directories.
const RESERVED_CASE_NAMES: [&str; 1] = ["golden"];

/// Whether `name` can name a case: an identifier of ASCII letters, digits, `_` and `-`,
/// starting with a letter or digit, at most [`MAX_CASE_NAME`] long, and none of the
/// names an export uses for itself (in any case, for case-insensitive file systems).
/// Every path cmm builds from a case name is `<dir>/<name>` or `<dir>/<name>.bin`, so
/// such a name never leads outside `<dir>`.
pub fn check_case_name(name: &str) -> Result<(), String> {
    let starts_well = name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    let body_ok = name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
    if !starts_well || !body_ok || name.len() > MAX_CASE_NAME {
        return Err(format!(
            "case name `{}`: a name is 1 to {MAX_CASE_NAME} ASCII letters, digits, `_` and `-`, starting with a \
             letter or digit (it names the case's directory and golden file)",
            name.escape_debug()
        ));
    }
    if let Some(reserved) = RESERVED_CASE_NAMES.iter().find(|r| r.eq_ignore_ascii_case(name)) {
        return Err(format!("case name `{name}`: `{reserved}` is the export's own directory"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cases of `text`, which must parse.
    fn parsed(text: &str) -> Vec<Case> {
        parse_cases(text, Path::new("x.toml")).unwrap()
    }

    /// What parsing `text` as the file `file` refuses, in words.
    fn refusal(text: &str, file: &str) -> String {
        parse_cases(text, Path::new(file)).unwrap_err().to_string()
    }

    const GOOD: &str = r#"
[[case]]
name = "a"
op = "ag_gemm"
algorithm = "ring_chunked"
chunks = 2
devices = 2
m = 8
n = 4
k = 3
input = "bf16"
output = "f32"
family = "exact"
seed = 1
"#;

    #[test]
    fn parses_a_case() {
        let cases = parsed(GOOD);
        assert_eq!(cases.len(), 1);
        let c = &cases[0];
        assert_eq!(
            (c.topology, c.input, c.family),
            (Topology::Ring { op: OpKind::AgGemm, devices: 2, wire: None }, DType::Bf16, Family::Exact)
        );
        assert_eq!(c.algorithm().unwrap(), CaseAlgorithm::Ring(Algorithm::RingChunked { chunks: 2 }));
        assert_eq!(c.algorithm_label(), "ring_chunked(c=2)");
        assert!(c.problem().is_ok());
        assert!(c.plan().is_ok());
    }

    const MESH: &str = r#"
[[case]]
name = "m"
op = "mesh_gemm"
dataflow = "ls"
nr = 2
nc = 4
algorithm = "meshslice"
slices = 2
block = 1
m = 8
n = 16
k = 4
input = "bf16"
output = "bf16"
family = "realistic"
seed = 3
"#;

    #[test]
    fn parses_a_mesh_case() {
        let cases = parsed(MESH);
        let c = &cases[0];
        assert_eq!(c.topology, Topology::Mesh { nr: 2, nc: 4, dataflow: Dataflow::Ls, wire: None });
        assert_eq!((c.devices(), c.devices_label(), c.op_label()), (8, "2x4".to_string(), "mesh_gemm ls".to_string()));
        assert_eq!(c.algorithm_label(), "meshslice(S=2,B=1)");
        let problem = c.problem().unwrap();
        assert_eq!(problem.workload().device_count(), 8);
        assert_eq!(c.plan().unwrap().devices, 8);
    }

    #[test]
    fn fields_must_fit_the_op() {
        let with_devices = MESH.replace("nr = 2", "nr = 2\ndevices = 8");
        let text = refusal(&with_devices, "x.toml");
        assert!(text.contains("mesh_gemm does not take `devices`"), "{text}");
        let text = refusal(&MESH.replace("dataflow = \"ls\"\n", ""), "x.toml");
        assert!(text.contains("mesh_gemm needs the field `dataflow`"), "{text}");
        let text = refusal(&MESH.replace("dataflow = \"ls\"", "dataflow = \"xs\""), "x.toml");
        assert!(text.contains("xs"), "{text}");
        let ring_with_mesh = GOOD.replace("devices = 2", "devices = 2\nnr = 1\nslices = 2");
        let text = refusal(&ring_with_mesh, "x.toml");
        assert!(text.contains("ag_gemm does not take `nr`, `slices`"), "{text}");
        let text = refusal(&GOOD.replace("devices = 2\n", ""), "x.toml");
        assert!(text.contains("ag_gemm needs the field `devices`"), "{text}");
        let text = refusal(&GOOD.replace("\"ag_gemm\"", "\"mesh_gem\""), "x.toml");
        assert!(text.contains("unknown op `mesh_gem`"), "{text}");
    }

    #[test]
    fn a_node_size_is_a_hierarchical_case_field() {
        let hierarchical = GOOD.replace("\"ring_chunked\"\nchunks = 2", "\"hierarchical\"\nnode = 2");
        let cases = parsed(&hierarchical);
        assert_eq!(cases[0].algorithm().unwrap(), CaseAlgorithm::Ring(Algorithm::Hierarchical { node: 2 }));
        assert_eq!(cases[0].algorithm_label(), "hierarchical(node=2)");
        assert!(cases[0].plan().is_ok());
        // Parsed, then refused by the algorithm: nodes that do not cut D, another algorithm.
        let cases = parsed(&hierarchical.replace("node = 2", "node = 3"));
        assert!(matches!(cases[0].plan(), Err(CaseError::Algorithm(AlgorithmError::NodeSize { devices: 2, node: 3 }))));
        let cases = parsed(&GOOD.replace("chunks = 2", "chunks = 2\nnode = 2"));
        assert!(cases[0].algorithm().is_err());
        let moe = GOOD
            .replace("\"ag_gemm\"", "\"moe_rs\"")
            .replace("chunks = 2", "node = 2\nexperts = 4\ntopk = 2\nrouting = \"uniform\"");
        assert!(refusal(&moe, "x.toml").contains("does not take `node`"));
    }

    #[test]
    fn mesh_problems_and_algorithms_fail_at_run_time_with_typed_errors() {
        let cases = parsed(&MESH.replace("n = 16", "n = 12"));
        assert!(cases[0].problem().is_ok());
        assert!(matches!(cases[0].plan(), Err(CaseError::Mesh(MeshError::SliceIndivisible { .. }))));
        let cases = parsed(&MESH.replace("n = 16", "n = 6"));
        assert!(matches!(cases[0].problem(), Err(CaseError::Mesh(MeshError::Indivisible { dim: "N", .. }))));
        let cases = parsed(&MESH.replace("\"meshslice\"", "\"cannon\""));
        assert!(matches!(cases[0].plan(), Err(CaseError::Mesh(MeshError::UnexpectedParameter { .. }))));
    }

    #[test]
    fn errors_name_the_file_and_the_case() {
        let bad = GOOD.replace("\"bf16\"", "\"bf17\"");
        let e = parse_cases(&bad, Path::new("dir/x.toml")).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, CorpusError::Case { index: 1, .. }), "{text}");
        assert!(text.contains("dir/x.toml") && text.contains("`a`") && text.contains("bf17"), "{text}");

        let unknown = GOOD.replace("seed = 1", "seed = 1\nsed = 2");
        let text = refusal(&unknown, "x.toml");
        assert!(text.contains("sed"), "{text}");

        let missing = GOOD.replace("m = 8\n", "");
        let text = refusal(&missing, "x.toml");
        assert!(text.contains("missing field `m`"), "{text}");

        let text = refusal("[[case]\n", "y.toml");
        assert!(text.starts_with("y.toml:"), "{text}");

        let text = refusal("cases = 1\n", "y.toml");
        assert!(text.contains("unexpected top-level key `cases`"), "{text}");

        let text = refusal(&GOOD.replace("name = \"a\"", "name = \"a/b\""), "y.toml");
        assert!(text.contains("golden file"), "{text}");
    }

    #[test]
    fn duplicate_names_across_files_are_rejected() {
        let dir = std::env::temp_dir().join(format!("cmm-corpus-dup-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("a.toml"), GOOD).unwrap();
        fs::write(dir.join("b.toml"), GOOD).unwrap();
        let e = load_corpus(&dir).unwrap_err();
        fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(&e, CorpusError::DuplicateName { name, .. } if name == "a"), "{e}");
    }

    #[test]
    fn an_invalid_problem_loads_and_fails_later() {
        // N splits into D equal blocks (M may split unevenly).
        let bad = GOOD.replace("n = 4", "n = 5");
        let cases = parsed(&bad);
        assert!(cases[0].problem().is_err());
    }
}
