//! Algorithms: functions from a validated problem to a [`Plan`]. They never touch an
//! executor; executors never know which algorithm made a plan.

use std::fmt;

use thiserror::Error;

use crate::dtype::DType;
use crate::plan::{BufId, BufferRole, Plan, PlanBuilder, PlanError};
use crate::problem::{OpKind, Problem, ShardedGemm, Window};

mod direct;
pub use direct::{direct_peer, direct_sum_runs};
mod hierarchical;
pub(crate) mod ring;

/// A 1D algorithm with its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// The non-overlapped baseline: the whole collective, then one GEMM (or the GEMM,
    /// then the whole collective). Every benchmark compares against it.
    Baseline,
    /// The non-overlapped baseline with a direct collective: every device copies its
    /// shard (each block of its partial) straight to the peers that need it, one wait,
    /// then one GEMM (or the GEMM first, then one sum per device). What a collective
    /// library followed by cuBLAS does on a fully connected switch; the CUDA bench's
    /// baseline.
    BaselineDirect,
    /// Unidirectional ring, one message per shard.
    Ring,
    /// Bidirectional ring: both link directions carry shards (ag_gemm) or half of the
    /// columns each (gemm_rs, gemm_ar).
    RingBidir,
    /// Unidirectional ring, each shard (ag_gemm) or each block's running sum (gemm_rs,
    /// gemm_ar) sent as `chunks` row chunks with one signal each.
    RingChunked {
        /// Chunks per shard.
        chunks: usize,
    },
    /// GEMM+RS and GEMM+AR only: the ring (in `chunks` row chunks) whose GEMMs add each
    /// step's partial onto the running sum received from the neighbour, in place in the
    /// receive slot (β = 1), rather than into scratch that a reduce then adds. One pass
    /// over the running sum and the reduce launches fewer; each GEMM waits for its sum,
    /// so with `chunks` ≥ 2 a chunk's sum travels while the next chunk's GEMM runs.
    RingAccumulate {
        /// Chunks per block.
        chunks: usize,
    },
    /// GEMM+RS and GEMM+AR only: the ring's contributors in the ring's order, but the
    /// running sums stay on their blocks' owners and each GEMM adds its partial into
    /// the owner's sum where it lies (a peer's c, β = 1), so no sum is ever copied.
    /// Seed 001's push mode with the GEMM as the producer: its epilogue writes into the
    /// consumer's memory, then notifies it. On one GPU the peer's memory is the same
    /// HBM; across GPUs each GEMM's epilogue reads and writes its block over the link.
    RingPush,
    /// The ring with its GEMMs fused into one tile-granular GEMM (seed 000's persistent
    /// kernel): every block of output rows waits only for its own operand rows and is
    /// released as soon as it is written; shards (or sums) travel in `chunks` row chunks.
    Fused {
        /// Chunks per shard.
        chunks: usize,
    },
    /// GEMM+RS and GEMM+AR only: `ring_push` with its GEMMs after the first fused into one
    /// tile-granular GEMM: each block (in `chunks` row chunks) waits inside the kernel for
    /// the previous contributor to its owner's sum, adds its partial there (a peer's c,
    /// β = 1) and releases the next one. No copy and no reduce beside the persistent
    /// kernels; the first contribution, which overwrites, is a GEMM of its own before them.
    FusedPush {
        /// Chunks per block.
        chunks: usize,
    },
    /// For devices in nodes of `node` GPUs: AG+GEMM sends each shard to the other GPUs of
    /// its node, and over the network once to the same GPU of every other node, which
    /// forwards it inside its node; GEMM+RS sums each block over a node inside it and
    /// sends the node sum across once (GEMM+AR then gathers as AG+GEMM does). The GEMMs
    /// overlap, a node's rows at a time; a NIC carries `node` times fewer bytes than
    /// under a direct collective.
    Hierarchical {
        /// GPUs per node (devices d and e share a node when d / node = e / node).
        node: usize,
    },
}

impl Algorithm {
    /// Name as used in case files (without parameters).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Baseline => "baseline",
            Algorithm::BaselineDirect => "baseline_direct",
            Algorithm::Ring => "ring",
            Algorithm::RingBidir => "ring_bidir",
            Algorithm::RingChunked { .. } => "ring_chunked",
            Algorithm::RingAccumulate { .. } => "ring_accumulate",
            Algorithm::RingPush => "ring_push",
            Algorithm::Fused { .. } => "fused",
            Algorithm::FusedPush { .. } => "fused_push",
            Algorithm::Hierarchical { .. } => "hierarchical",
        }
    }

    /// Whether its plans run GEMMs as tile-granular persistent kernels (waits inside).
    pub fn is_fused(self) -> bool {
        matches!(self, Algorithm::Fused { .. } | Algorithm::FusedPush { .. })
    }

    /// Parses a case file's algorithm name and optional chunk count.
    pub fn parse(name: &str, chunks: Option<usize>) -> Result<Self, AlgorithmError> {
        Algorithm::parse_with(name, chunks, None)
    }

    /// Parses an algorithm name with its optional chunk count and node size (GPUs per
    /// node, `hierarchical` only).
    pub fn parse_with(name: &str, chunks: Option<usize>, node: Option<usize>) -> Result<Self, AlgorithmError> {
        let algorithm = match name {
            "baseline" => Algorithm::Baseline,
            "baseline_direct" => Algorithm::BaselineDirect,
            "ring" => Algorithm::Ring,
            "ring_bidir" => Algorithm::RingBidir,
            "ring_chunked" => Algorithm::RingChunked {
                chunks: chunks
                    .ok_or(AlgorithmError::MissingParameter { algorithm: "ring_chunked", parameter: "chunks" })?,
            },
            // One chunk per shard (or block) unless told otherwise.
            "ring_accumulate" => Algorithm::RingAccumulate { chunks: chunks.unwrap_or(1) },
            "ring_push" => Algorithm::RingPush,
            "fused" => Algorithm::Fused { chunks: chunks.unwrap_or(1) },
            "fused_push" => Algorithm::FusedPush { chunks: chunks.unwrap_or(1) },
            "hierarchical" => Algorithm::Hierarchical {
                node: node.ok_or(AlgorithmError::MissingParameter { algorithm: "hierarchical", parameter: "node" })?,
            },
            other => return Err(AlgorithmError::Unknown { name: other.to_string() }),
        };
        if node.is_some() && !matches!(algorithm, Algorithm::Hierarchical { .. }) {
            return Err(AlgorithmError::UnexpectedParameter { algorithm: algorithm.name(), parameter: "node" });
        }
        if chunks.is_some()
            && !matches!(
                algorithm,
                Algorithm::RingChunked { .. }
                    | Algorithm::RingAccumulate { .. }
                    | Algorithm::Fused { .. }
                    | Algorithm::FusedPush { .. }
            )
        {
            return Err(AlgorithmError::UnexpectedParameter { algorithm: algorithm.name(), parameter: "chunks" });
        }
        Ok(algorithm)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::RingChunked { chunks } => write!(f, "ring_chunked(c={chunks})"),
            Algorithm::RingAccumulate { chunks: 1 } => f.write_str("ring_accumulate"),
            Algorithm::RingAccumulate { chunks } => write!(f, "ring_accumulate(c={chunks})"),
            Algorithm::Fused { chunks: 1 } => f.write_str("fused"),
            Algorithm::Fused { chunks } => write!(f, "fused(c={chunks})"),
            Algorithm::FusedPush { chunks: 1 } => f.write_str("fused_push"),
            Algorithm::FusedPush { chunks } => write!(f, "fused_push(c={chunks})"),
            Algorithm::Hierarchical { node } => write!(f, "hierarchical(node={node})"),
            other => f.write_str(other.name()),
        }
    }
}

/// Parses the form [`Display`](fmt::Display) prints: `ring`, `ring_chunked(c=4)`,
/// `hierarchical(node=8)`.
impl std::str::FromStr for Algorithm {
    type Err = AlgorithmError;

    fn from_str(text: &str) -> Result<Self, AlgorithmError> {
        let Some((name, parameter)) = text.strip_suffix(')').and_then(|t| t.split_once('(')) else {
            return Algorithm::parse(text, None);
        };
        let malformed = || AlgorithmError::Unknown { name: text.to_string() };
        let (key, value) = parameter.split_once('=').ok_or_else(malformed)?;
        let value = value.parse::<usize>().map_err(|_| malformed())?;
        match key {
            "c" => Algorithm::parse(name, Some(value)),
            "node" => Algorithm::parse_with(name, None, Some(value)),
            _ => Err(malformed()),
        }
    }
}

/// Why an algorithm cannot produce a plan for a problem.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum AlgorithmError {
    /// The algorithm name is not known.
    #[error(
        "unknown algorithm `{name}` (expected baseline, baseline_direct, ring, ring_bidir, ring_chunked, ring_accumulate, ring_push, fused, fused_push or hierarchical)"
    )]
    Unknown {
        /// The name given.
        name: String,
    },
    /// A required parameter is missing.
    #[error("algorithm {algorithm} needs the parameter `{parameter}`")]
    MissingParameter {
        /// Algorithm.
        algorithm: &'static str,
        /// Parameter.
        parameter: &'static str,
    },
    /// A parameter was given that the algorithm does not take.
    #[error("algorithm {algorithm} takes no parameter `{parameter}`")]
    UnexpectedParameter {
        /// Algorithm.
        algorithm: &'static str,
        /// Parameter.
        parameter: &'static str,
    },
    /// More chunks than a block has rows (or none): a chunk would be empty.
    #[error(
        "{algorithm}: {chunks} chunks of {what}={rows} would leave a chunk without rows (chunks must be 1 to {rows})"
    )]
    TooManyChunks {
        /// Algorithm.
        algorithm: Algorithm,
        /// The rows being split.
        what: &'static str,
        /// How many.
        rows: usize,
        /// The chunk count.
        chunks: usize,
    },
    /// Nodes of `node` GPUs do not cut the devices into whole nodes.
    #[error("hierarchical: nodes of {node} GPUs do not divide the D={devices} devices (node must be at least 1 and divide D)")]
    NodeSize {
        /// Devices D.
        devices: usize,
        /// GPUs per node.
        node: usize,
    },
    /// The algorithm has no plan for this op.
    #[error("algorithm {algorithm} is not defined for {op}")]
    NotDefined {
        /// Algorithm.
        algorithm: Algorithm,
        /// The op.
        op: &'static str,
    },
    /// The algorithm adds onto the running sum inside its GEMM, which rounds once only
    /// into f32 partial sums.
    #[error("{algorithm} adds each partial onto the running sum in its GEMM, which needs f32 partial sums (the wire dtype is {wire})")]
    NeedsF32Wire {
        /// Algorithm.
        algorithm: Algorithm,
        /// The problem's partial-sum dtype.
        wire: DType,
    },
    /// The produced plan failed validation (a bug in the algorithm).
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// Builds the plan of `algorithm` for `problem`.
pub fn build_plan(problem: &Problem, algorithm: Algorithm) -> Result<Plan, AlgorithmError> {
    build_plan_with(problem, algorithm, BaselineSums::BySize)
}

/// Where a whole ReduceScatter adds its sums up: the ring one of the GEMM+RS / GEMM+AR
/// `baseline` and of the MoE and linear baselines, and the direct one of
/// `baseline_direct`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BaselineSums {
    /// On the copy lane: a ring's between the copy that brings a running sum and the
    /// one that sends it on, so the link idles while each sum runs; the direct one's
    /// after the last block has arrived. The plans every bench before 2026-11-29 timed.
    InSeries,
    /// On a lane of their own, beside the copies, as a collective library does. A ring
    /// sums in pieces, a piece's sum beside the copy of the piece before (each piece
    /// costs a copy launch and a signal of its own); the direct ReduceScatter adds its
    /// blocks as they arrive, where its sum is more than one `Reduce` (D > 4).
    Beside,
    /// Beside where a device's block of the partial is at least
    /// [`SUMS_BESIDE_FROM_BYTES`], in series below it (cmm's plans).
    #[default]
    BySize,
}

/// The block size from which a whole ReduceScatter sums beside its copies. Below it a
/// ring's extra launch and signal a piece cost more than the overlap saves: simulated
/// (`gemm_rs` baseline, bf16, D = 8; D = 16 across nodes), beside ÷ in series is 1.13 at
/// 512 KiB blocks and 0.85 at 2 MiB on h100-nvlink, 0.94 and 0.87 on h100-one-gpu,
/// 1.13 and 1.03 on h100-ib, and 0.83–0.97 everywhere from 4 MiB up (h100-ib 1.00).
/// The direct baseline's sums beside cost up to 9 % at 64 KiB blocks and 4 % at 512 KiB
/// (D = 5, h100-nvlink); from 2 MiB they take 0.78–0.99 of the time in series at D = 5
/// to 64 on every profile (8192³ at D = 8: 0.89 on h100-nvlink, 0.89 on h100-one-gpu).
pub const SUMS_BESIDE_FROM_BYTES: usize = 2 << 20;

impl BaselineSums {
    /// The name a bench report gives it (`baseline_sums`).
    pub fn key(self) -> &'static str {
        match self {
            BaselineSums::InSeries => "in_series",
            BaselineSums::Beside => "beside",
            BaselineSums::BySize => "by_block_size",
        }
    }

    /// The form a report's `baseline_sums` names, if any.
    pub fn from_key(key: &str) -> Option<BaselineSums> {
        [BaselineSums::InSeries, BaselineSums::Beside, BaselineSums::BySize].into_iter().find(|s| s.key() == key)
    }

    /// Whether a ReduceScatter over `devices` of `block_bytes` blocks (a device's share
    /// of the partial, in the dtype that travels) sums beside its copies. A ring of one
    /// passes nothing: its one sum is a conversion, in series.
    pub fn beside(self, devices: usize, block_bytes: usize) -> bool {
        devices > 1
            && match self {
                BaselineSums::InSeries => false,
                BaselineSums::Beside => true,
                BaselineSums::BySize => block_bytes >= SUMS_BESIDE_FROM_BYTES,
            }
    }

    /// Whether the direct ReduceScatter over `devices` of `block_bytes` blocks adds them up
    /// as they arrive: where [`BaselineSums::beside`] says so and its sum is more than one
    /// `Reduce` ([`direct_sum_runs`]); with one, nothing can be added before the last block.
    pub fn direct_beside(self, devices: usize, block_bytes: usize) -> bool {
        direct_sum_runs(devices).len() > 1 && self.beside(devices, block_bytes)
    }
}

/// [`build_plan`], with the baseline's sums where `sums` says (other plans have one form).
pub fn build_plan_with(problem: &Problem, algorithm: Algorithm, sums: BaselineSums) -> Result<Plan, AlgorithmError> {
    let name = || format!("{}/{algorithm} D={}", problem.op, problem.devices);
    crate::plan::check_op_bound(name, min_ops(problem, algorithm))?;
    match (problem.op, algorithm) {
        (OpKind::AgGemm, Algorithm::Baseline) => ring::ag_gemm_baseline(problem),
        (OpKind::AgGemm, Algorithm::BaselineDirect) => direct::ag_gemm(problem),
        (OpKind::GemmRs | OpKind::GemmAr, Algorithm::BaselineDirect) => direct::gemm_reduce(problem, sums),
        (OpKind::AgGemm, Algorithm::Ring) => ring::ag_gemm_ring(problem, algorithm, 1),
        (OpKind::AgGemm, Algorithm::RingChunked { chunks } | Algorithm::Fused { chunks }) => {
            ring::ag_gemm_ring(problem, algorithm, chunks)
        }
        (OpKind::AgGemm, Algorithm::RingBidir) => ring::ag_gemm_bidir(problem),
        (OpKind::AgGemm, Algorithm::RingAccumulate { .. } | Algorithm::RingPush | Algorithm::FusedPush { .. }) => {
            Err(AlgorithmError::NotDefined { algorithm, op: problem.op.name() })
        }
        (OpKind::AgGemm, Algorithm::Hierarchical { node }) => hierarchical::ag_gemm(problem, node),
        (OpKind::GemmRs | OpKind::GemmAr, Algorithm::Hierarchical { node }) => hierarchical::gemm_reduce(problem, node),
        (OpKind::GemmRs | OpKind::GemmAr, Algorithm::RingPush) => ring::gemm_reduce_push(problem),
        (OpKind::GemmRs | OpKind::GemmAr, Algorithm::Baseline) => ring::gemm_reduce_baseline(problem, sums),
        (
            OpKind::GemmRs | OpKind::GemmAr,
            Algorithm::Ring | Algorithm::RingBidir | Algorithm::RingChunked { .. } | Algorithm::RingAccumulate { .. },
        ) => ring::gemm_reduce_ring(problem, algorithm),
        (OpKind::GemmRs | OpKind::GemmAr, Algorithm::Fused { chunks }) => ring::gemm_reduce_fused(problem, chunks),
        (OpKind::GemmRs | OpKind::GemmAr, Algorithm::FusedPush { chunks }) => {
            ring::gemm_reduce_fused_push(problem, chunks)
        }
    }
}

/// A lower bound of the ops of `algorithm`'s plan of `p` ([`crate::plan::check_op_bound`]):
/// every algorithm moves each device's shard or partial to every other device, a
/// chunked one in `chunks` pieces.
pub(crate) fn min_ops(p: &Problem, algorithm: Algorithm) -> u128 {
    let d = p.devices as u128;
    let chunks = match algorithm {
        Algorithm::RingChunked { chunks }
        | Algorithm::Fused { chunks }
        | Algorithm::RingAccumulate { chunks }
        | Algorithm::FusedPush { chunks } => chunks as u128,
        _ => 1,
    };
    d * (d - 1) * chunks
}

/// Every algorithm variant defined for `op` (with a representative chunk count): seven
/// for every 1D op, and the five that add in the GEMM for GEMM+RS and GEMM+AR.
pub fn algorithms_for(op: OpKind) -> Vec<Algorithm> {
    let mut all = vec![
        Algorithm::Baseline,
        Algorithm::BaselineDirect,
        Algorithm::Ring,
        Algorithm::RingBidir,
        Algorithm::RingChunked { chunks: 2 },
        Algorithm::Fused { chunks: 1 },
        Algorithm::Fused { chunks: 2 },
    ];
    if matches!(op, OpKind::GemmRs | OpKind::GemmAr) {
        all.extend([
            Algorithm::RingAccumulate { chunks: 1 },
            Algorithm::RingAccumulate { chunks: 2 },
            Algorithm::RingPush,
            Algorithm::FusedPush { chunks: 1 },
            Algorithm::FusedPush { chunks: 2 },
        ]);
    }
    all
}

/// Declares the input buffer of global tensor `tensor` with each device's shard origin.
/// A plan builder for `algorithm` on `p` with the problem's operands declared: A and B
/// (inputs 0 and 1) and the output C.
fn start_plan(p: &Problem, algorithm: Algorithm) -> (PlanBuilder, BufId, BufId, BufId) {
    let mut b = PlanBuilder::new(ring::plan_name(p, algorithm), p.devices);
    let a = input_buffer(&mut b, p, 0);
    let bm = input_buffer(&mut b, p, 1);
    let c = output_buffer(&mut b, p);
    (b, a, bm, c)
}

/// Refuses `chunks` chunks of blocks whose smallest has `rows` rows (`what`) when a
/// chunk would be empty. Chunks of a block split its rows in `tensor_split`'s order, so
/// they need not divide it.
pub(crate) fn check_chunks(
    algorithm: Algorithm,
    what: &'static str,
    rows: usize,
    chunks: usize,
) -> Result<(), AlgorithmError> {
    if chunks == 0 || chunks > rows {
        return Err(AlgorithmError::TooManyChunks { algorithm, what, rows, chunks });
    }
    Ok(())
}

pub(crate) fn input_buffer(b: &mut PlanBuilder, p: &impl ShardedGemm, tensor: u32) -> BufId {
    let global = p.global();
    let decl = global.inputs()[tensor as usize];
    let windows: Vec<Window> = (0..p.device_count()).map(|d| p.input_window(tensor, d)).collect();
    let origins = windows.iter().map(|w| (w.row0, w.col0)).collect();
    let role = BufferRole::Input { tensor, global_cols: decl.cols, origins };
    b.sharded_buffer(decl.name, global.input, windows.iter().map(|w| w.rows).collect(), windows[0].cols, role)
}

/// Declares the output buffer `C` with the devices' output window shape.
pub(crate) fn output_buffer(b: &mut PlanBuilder, p: &impl ShardedGemm) -> BufId {
    let windows: Vec<Window> = (0..p.device_count()).map(|d| p.output_window_of(d)).collect();
    let rows = windows.iter().map(|w| w.rows).collect();
    b.sharded_buffer("C", p.global().output, rows, windows[0].cols, BufferRole::Output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::Family;
    use crate::plan::Op;

    /// The bound that refuses a plan before planning it never exceeds the plan's ops, so
    /// it refuses only what the builder would refuse after minutes.
    #[test]
    fn the_op_bound_is_a_lower_bound_of_every_plan() {
        for op in OpKind::ALL {
            for d in [1, 2, 3, 4, 6] {
                let p = Problem::new(op, d, 24 * d, 12 * d, 12 * d, DType::F32, DType::F32).unwrap();
                let mut algorithms = algorithms_for(op);
                algorithms.extend([Algorithm::RingChunked { chunks: 3 }, Algorithm::Fused { chunks: 4 }]);
                for alg in algorithms {
                    let Ok(plan) = build_plan(&p, alg) else { continue };
                    assert!(plan.op_count() as u128 >= min_ops(&p, alg), "{}: {} ops", plan.name, plan.op_count());
                }
            }
        }
        // A ring of 1000 devices in 2^24 chunks is refused at once, not after minutes.
        // (Past the generator's range, as only the `simulate` command builds it.)
        let small = Problem::new(OpKind::AgGemm, 2, 8, 8, 8, DType::F32, DType::F32).unwrap();
        let p = Problem { devices: 1000, m: 1000 << 24, n: 1000, k: 1000, ..small };
        let refused = build_plan(&p, Algorithm::RingChunked { chunks: 1 << 24 });
        assert!(
            matches!(refused, Err(AlgorithmError::Plan(PlanError::TooManyOps { at_least: true, .. }))),
            "{refused:?}"
        );
    }

    /// The GEMM+RS / GEMM+AR baselines add their sums up beside their copies, on a lane of
    /// their own, from [`SUMS_BESIDE_FROM_BYTES`] blocks up, and on their copy lane below:
    /// the ring baseline at any D > 1, the direct one where its sum is more than one
    /// `Reduce` (D > [`crate::plan::MAX_REDUCE_INPUTS`]). Either way each gives the
    /// oracle's bits (the exact family, whose sums are exact in any order) and the
    /// tolerance (the realistic one), and verifies clean.
    #[test]
    fn the_reduce_baselines_sum_beside_their_copies_on_large_blocks() {
        let reduces_on = |plan: &Plan, name: &str| {
            let Some(lane) = plan.lanes.iter().position(|l| l == name) else { return false };
            plan.programs.iter().all(|p| p.lanes[lane].iter().any(|op| matches!(op, Op::Reduce { .. })))
        };
        let fan_in = crate::plan::MAX_REDUCE_INPUTS;
        // f32 partials: 512 rows of 1024 columns make a 2 MiB block (D = 4), as do 64 rows
        // of 8192 (D = 8).
        for (algorithm, d, m, wide) in [(Algorithm::Baseline, 4, 2048, 1024), (Algorithm::BaselineDirect, 8, 512, 8192)]
        {
            for (n, beside) in [(wide, true), (wide - 8, false)] {
                let p = Problem::new(OpKind::GemmAr, d, m, n, 16, DType::F32, DType::F32).unwrap();
                let plan = build_plan(&p, algorithm).unwrap();
                assert_eq!(
                    (reduces_on(&plan, "sum"), reduces_on(&plan, "main")),
                    (beside, !beside),
                    "{algorithm} N = {n}"
                );
            }
        }
        let seed = 4242;
        for op in [OpKind::GemmRs, OpKind::GemmAr] {
            for (algorithm, most) in [(Algorithm::Baseline, 5), (Algorithm::BaselineDirect, 2 * fan_in + 1)] {
                for d in 1..=most {
                    for dtype in [DType::F32, DType::F16, DType::Bf16] {
                        // Uneven rows: the last device's block is the short one.
                        let p = Problem::new(op, d, 6 * d + 1, 12, 4 * d, dtype, dtype).unwrap();
                        for sums in [BaselineSums::InSeries, BaselineSums::Beside] {
                            let plan = build_plan_with(&p, algorithm, sums).unwrap();
                            let summing = sums == BaselineSums::Beside
                                && if algorithm == Algorithm::Baseline { d > 1 } else { d > fan_in };
                            assert_eq!(reduces_on(&plan, "sum"), summing, "{}", plan.name);
                            crate::testing::assert_matches_oracle(&plan, &p, seed, Family::Exact);
                            crate::testing::assert_matches_oracle(&plan, &p, seed, Family::Realistic);
                            crate::testing::assert_sound(&plan);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn ring_accumulate_parses_prints_and_is_refused_for_ag_gemm() {
        assert_eq!(Algorithm::parse("ring_accumulate", None), Ok(Algorithm::RingAccumulate { chunks: 1 }));
        assert_eq!(Algorithm::parse("ring_accumulate", Some(2)), Ok(Algorithm::RingAccumulate { chunks: 2 }));
        assert_eq!(Algorithm::RingAccumulate { chunks: 1 }.to_string(), "ring_accumulate");
        assert_eq!(Algorithm::RingAccumulate { chunks: 2 }.to_string(), "ring_accumulate(c=2)");
        let ag = Problem::new(OpKind::AgGemm, 4, 32, 32, 32, DType::F16, DType::F16).unwrap();
        let refused = build_plan(&ag, Algorithm::RingAccumulate { chunks: 1 });
        assert!(matches!(refused, Err(AlgorithmError::NotDefined { op: "ag_gemm", .. })), "{refused:?}");
        assert!(!algorithms_for(OpKind::AgGemm).iter().any(|a| matches!(a, Algorithm::RingAccumulate { .. })));
    }

    /// Per device and chunk: D−2 GEMMs add onto a received sum in `recv`, one reduce
    /// (the final step's) instead of D−1, and one send slot.
    #[test]
    fn ring_accumulate_adds_in_its_gemms_and_reduces_once_per_chunk() {
        for chunks in [1, 2] {
            let p = Problem::new(OpKind::GemmRs, 4, 64, 16, 32, DType::F16, DType::F16).unwrap();
            let plan = build_plan(&p, Algorithm::RingAccumulate { chunks }).unwrap();
            let recv = plan.buffer_id("recv").unwrap();
            for d in 0..4 {
                let ops: Vec<&Op> = plan.programs[d].lanes.iter().flatten().collect();
                let adding =
                    ops.iter().filter(|op| matches!(op, Op::Gemm { accumulate: true, c, .. } if c.buf == recv));
                assert_eq!(adding.count(), 2 * chunks, "device {d}, {chunks} chunks");
                assert_eq!(ops.iter().filter(|op| matches!(op, Op::Reduce { .. })).count(), chunks);
            }
            assert_eq!(plan.buffer(plan.buffer_id("send").unwrap()).rows, 16);
        }
    }

    #[test]
    fn every_printed_algorithm_parses_back() {
        let mut all = algorithms_for(OpKind::GemmRs);
        all.extend([Algorithm::RingChunked { chunks: 16 }, Algorithm::Hierarchical { node: 8 }]);
        for algorithm in all {
            assert_eq!(algorithm.to_string().parse::<Algorithm>(), Ok(algorithm), "{algorithm}");
        }
        for text in ["hierarchical", "hierarchical(c=2)", "ring(node=2)", "fused(c=x)", "fused(n=2)", "fused(c2)"] {
            assert!(text.parse::<Algorithm>().is_err(), "{text}");
        }
        assert_eq!(
            Algorithm::parse("hierarchical", None),
            Err(AlgorithmError::MissingParameter { algorithm: "hierarchical", parameter: "node" })
        );
    }

    #[test]
    fn ring_push_parses_prints_and_is_refused_for_ag_gemm_and_chunks() {
        assert_eq!(Algorithm::parse("ring_push", None), Ok(Algorithm::RingPush));
        assert_eq!(Algorithm::RingPush.to_string(), "ring_push");
        let chunked = Algorithm::parse("ring_push", Some(2));
        assert!(matches!(chunked, Err(AlgorithmError::UnexpectedParameter { parameter: "chunks", .. })), "{chunked:?}");
        let ag = Problem::new(OpKind::AgGemm, 4, 32, 32, 32, DType::F16, DType::F16).unwrap();
        let refused = build_plan(&ag, Algorithm::RingPush);
        assert!(matches!(refused, Err(AlgorithmError::NotDefined { op: "ag_gemm", .. })), "{refused:?}");
        assert!(!algorithms_for(OpKind::AgGemm).contains(&Algorithm::RingPush));
    }

    /// Per device: no copy in GEMM+RS; D−1 GEMMs into the peers' sums, each on the
    /// block's owner, every peer once, the first overwriting and the rest adding; one
    /// local GEMM and one reduce for the own block.
    #[test]
    fn ring_push_adds_into_each_owner_sum_once_and_copies_nothing() {
        for d_count in [1, 2, 4] {
            let p =
                Problem::new(OpKind::GemmRs, d_count, 16 * d_count, 16, 8 * d_count, DType::F16, DType::F16).unwrap();
            let plan = build_plan(&p, Algorithm::RingPush).unwrap();
            let sum = plan.buffer_id("S").unwrap();
            for d in 0..d_count {
                let ops: Vec<&Op> = plan.programs[d].lanes.iter().flatten().collect();
                assert!(!ops.iter().any(|op| matches!(op, Op::Copy { .. })), "device {d}");
                let remote: Vec<(usize, bool)> = ops
                    .iter()
                    .filter_map(|op| match op {
                        Op::Gemm { c, c_device: Some(owner), accumulate, .. } if c.buf == sum => {
                            Some((*owner, *accumulate))
                        }
                        _ => None,
                    })
                    .collect();
                let want: Vec<(usize, bool)> = (0..d_count - 1).map(|s| ((d + s + 1) % d_count, s > 0)).collect();
                assert_eq!(remote, want, "device {d} of {d_count}");
                let reduces = ops.iter().filter(|op| matches!(op, Op::Reduce { .. })).count();
                assert_eq!(reduces, usize::from(d_count > 1), "device {d} of {d_count}");
            }
        }
    }
}
