//! The autotuner.
//!
//! 1D: every candidate plan (the two baselines, ring, ring_bidir, ring_chunked with several
//! chunk counts, …) is built with [`build_plan`] and simulated; the ranking is by simulated
//! time and a baseline wins every tie, so overlap is never chosen when it does not pay.
//!
//! Linear layers: the baseline, Megatron's order and the ring decomposition of a
//! [`LinearProblem`] simulated side by side, with the overlap verdict ([`tune_linear`]).
//!
//! 2D: (algorithm, dataflow, mesh shape, S) priced by seed 002's closed form, which is fast
//! over the whole space; the candidates it ranks highest are then replayed as cmm builds
//! them ([`mesh_plans`], simulated on the profile) and ranked by that ([`tune_mesh_gemm`],
//! [`replay_llm`]). The two differ: the closed form streams each collective, while cmm's
//! mesh plans move a whole block a hop, a copy and a signal each (they gather and
//! reduce-scatter both ways round, as the form does).

use std::collections::HashMap;
use std::fmt;

use rayon::prelude::*;

use thiserror::Error;

use super::analytic::{estimate_mesh, Dataflow, MeshEstimate, MeshFamily, MeshGemm, MeshShape};
use super::engine::{simulate, Engines, OpClass, SimError, SimOptions, SimReport};
use super::profile::Profile;
use cmm_core::algorithms::{build_plan, Algorithm};
use cmm_core::attention::{build_attention_plan, AttentionAlgorithm, AttentionProblem, Layout};
use cmm_core::dtype::DType;
use cmm_core::linear::{build_linear_plan, LinearAlgorithm, LinearProblem};
use cmm_core::mesh::{build_mesh_plan, MeshAlgorithm, MeshProblem, WangRing};
use cmm_core::moe::{build_moe_plan, MoeProblem};
use cmm_core::plan::Plan;
use cmm_core::problem::{OpKind, Problem};

/// Why tuning failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum TuneError {
    /// Simulating a candidate failed.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// No candidate could be built for the problem.
    #[error("no candidate algorithm builds a plan for {problem}: {reasons}")]
    NoCandidate {
        /// The problem.
        problem: String,
        /// Why each candidate was refused.
        reasons: String,
    },
    /// More chips than a problem may have devices.
    #[error("{chips} chips: more than the {} devices a problem may have", cmm_core::plan::MAX_DEVICES)]
    Chips {
        /// Chips.
        chips: usize,
    },
    /// More chips than the profile's system has.
    #[error("{chips} chips: profile {profile} describes at most {max} devices (a multi-node profile such as h100-ib, or tpuv4-torus, describes more)")]
    ProfileChips {
        /// Chips.
        chips: usize,
        /// Profile name.
        profile: String,
        /// The most devices it describes.
        max: usize,
    },
    /// A GEMM to tune cannot be modelled at all (before any mesh is tried).
    #[error("{what}: {source}")]
    Gemm {
        /// The GEMM or layer.
        what: String,
        /// Why.
        source: crate::analytic::MeshModelError,
    },
    /// No mesh shape and slice count fits the problem.
    #[error("no 2D configuration fits {what} on {chips} chips{why}")]
    NoMeshConfiguration {
        /// What was tuned.
        what: String,
        /// Chips.
        chips: usize,
        /// Why each mesh refused it, after a colon (empty where not known).
        why: String,
    },
}

/// The tuner's chips are a problem's devices: at most [`cmm_core::plan::MAX_DEVICES`].
fn check_chips(chips: usize) -> Result<(), TuneError> {
    cmm_core::plan::check_device_count(chips as u128).map_err(|_| TuneError::Chips { chips })
}

/// The profile's system has the chips: a 2D candidate on more devices than it describes
/// would be priced on links it does not have.
fn check_profile_chips(chips: usize, profile: &Profile) -> Result<(), TuneError> {
    if chips > profile.max_devices {
        return Err(TuneError::ProfileChips { chips, profile: profile.name.clone(), max: profile.max_devices });
    }
    Ok(())
}

/// Every GEMM of every layer of `llm` can be modelled: checked on the layers' sizes before
/// the products of [`choose_dataflows`] are taken, so that none overflows.
fn check_llm(llm: &LlmConfig) -> Result<(), TuneError> {
    for layer in &llm.layers {
        let (t, i, o) = (llm.tokens, layer.in_features, layer.out_features);
        let gemm = MeshGemm { m: t, n: o, k: i, dataflow: Dataflow::Os, dtype: llm.dtype, wire: llm.wire };
        gemm.check_size().map_err(|source| TuneError::Gemm {
            what: format!("{} layer {} ({t} tokens, {i} → {o} features)", llm.name, layer.name),
            source,
        })?;
    }
    Ok(())
}

/// Chunk counts tried for `ring_chunked`.
pub const CHUNK_CANDIDATES: [usize; 4] = [2, 4, 8, 16];

/// The 1D candidates for an operation over `devices` on `profile`: across the profile's
/// nodes, the hierarchical plan for its node size too.
pub fn candidates_1d(op: OpKind, devices: usize, profile: &Profile) -> Vec<Algorithm> {
    let mut v = vec![Algorithm::Baseline, Algorithm::BaselineDirect, Algorithm::Ring, Algorithm::RingBidir];
    v.extend(CHUNK_CANDIDATES.iter().map(|&chunks| Algorithm::RingChunked { chunks }));
    if matches!(op, OpKind::GemmRs | OpKind::GemmAr) {
        v.extend([1, 2, 4].map(|chunks| Algorithm::RingAccumulate { chunks }));
        v.push(Algorithm::RingPush);
        v.extend([1, 2, 4].map(|chunks| Algorithm::FusedPush { chunks }));
    }
    v.extend([1, 2, 4].map(|chunks| Algorithm::Fused { chunks }));
    if let Some(node) = nodes_of(profile, devices) {
        v.push(Algorithm::Hierarchical { node });
    }
    v
}

/// The profile's GPUs per node, where `devices` span more than one of its nodes, whole.
pub fn nodes_of(profile: &Profile, devices: usize) -> Option<usize> {
    let node = profile.network?.devices_per_node;
    (node > 0 && devices > node && devices % node == 0).then_some(node)
}

/// One simulated 1D candidate.
#[derive(Clone, Debug)]
pub struct Ranked1d {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The simulation.
    pub report: SimReport,
}

/// The ranking of a 1D problem, fastest first, with the reason the winner wins.
#[derive(Clone, Debug)]
pub struct Ranking1d {
    /// Candidates, fastest first (the baseline first among equals).
    pub ranked: Vec<Ranked1d>,
    /// Candidates that cannot run this problem, with the reason.
    pub skipped: Vec<(Algorithm, String)>,
    /// Why the winner wins, in words.
    pub reason: String,
}

impl Ranking1d {
    /// The winner.
    pub fn winner(&self) -> &Ranked1d {
        &self.ranked[0]
    }

    /// The faster of the baselines ([`is_baseline`]): what an overlapped plan has to beat.
    pub fn baseline(&self) -> Option<&Ranked1d> {
        self.ranked.iter().find(|c| is_baseline(c.algorithm))
    }
}

fn us(s: f64) -> String {
    format!("{:.1} µs", s * 1e6)
}

/// Time device 0's compute lane first waits for data (blocked time of its first Wait).
fn first_wait_s(r: &SimReport) -> f64 {
    r.records[0]
        .iter()
        .filter(|lane| lane.iter().any(|x| x.class == OpClass::Gemm))
        .flat_map(|lane| lane.iter().find(|x| x.class == OpClass::Wait))
        .map(|x| x.start_s - x.reached_s)
        .next()
        .unwrap_or(0.0)
}

/// The plans that overlap nothing: the whole collective, then the GEMM (or the reverse).
pub fn is_baseline(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::Baseline | Algorithm::BaselineDirect)
}

/// How a verdict names a baseline.
fn baseline_words(algorithm: Algorithm) -> &'static str {
    if algorithm == Algorithm::BaselineDirect {
        "the direct baseline"
    } else {
        "the baseline"
    }
}

fn explain(ranked: &[Ranked1d], op: OpKind) -> String {
    let win = &ranked[0];
    let r = &win.report;
    // The faster baseline (the ranking is fastest first): what overlap has to beat.
    let Some(base) = ranked.iter().find(|c| is_baseline(c.algorithm)) else {
        return format!("{} is fastest at {}", win.algorithm, us(r.makespan_s));
    };
    if is_baseline(win.algorithm) {
        let best_overlap = ranked.iter().find(|c| !is_baseline(c.algorithm));
        return match best_overlap {
            Some(o) => format!(
                "{} wins: it exposes {} of communication, but the best overlapped plan ({}) is {} slower — \
                 its {} GEMM launches and per-step synchronisations cost more than the communication it hides",
                baseline_words(base.algorithm),
                us(base.report.max_exposed_comm_s()),
                o.algorithm,
                us(o.report.makespan_s - base.report.makespan_s),
                o.report.ops().filter(|x| x.class == OpClass::Gemm && x.site.device == 0).count()
            ),
            None => format!("{} is the only candidate", baseline_words(base.algorithm)),
        };
    }
    let gemm = r.mean_duration_s(OpClass::Gemm);
    let copy = r.mean_duration_s(OpClass::RemoteCopy);
    let saved = base.report.makespan_s - r.makespan_s;
    let mut text = if let Algorithm::Hierarchical { node } = win.algorithm {
        let (what, pieces, collective) = match op {
            OpKind::AgGemm => ("each shard crosses between two nodes once and is forwarded inside the node", "shard", "a direct AllGather"),
            OpKind::GemmRs => ("a node sums each block inside it and sends the sum across once", "block", "a direct ReduceScatter"),
            OpKind::GemmAr => ("a node sums each block inside it and sends the sum across once, then gathers the blocks as AG+GEMM does", "block", "a direct ReduceScatter"),
        };
        let count = |n: usize| if n == 1 { format!("1 {pieces}") } else { format!("{n} {pieces}s") };
        format!(
            "{what}: a NIC carries {} each way where {collective} sends it {}; {} faster than {}, which exposes {}",
            count(r.devices / node - 1),
            count(r.devices - node),
            us(saved),
            baseline_words(base.algorithm),
            us(base.report.max_exposed_comm_s())
        )
    } else if matches!(win.algorithm, Algorithm::RingPush | Algorithm::FusedPush { .. }) {
        format!(
            "the reduction copies nothing: each GEMM adds its partial into the block's owner ({} GEMM per step, its traffic to the owner included); {} faster than {}, which exposes {}",
            us(gemm),
            us(saved),
            baseline_words(base.algorithm),
            us(base.report.max_exposed_comm_s())
        )
    } else if copy <= gemm {
        format!(
            "communication {} per step hidden under {} GEMM per step; {} faster than {}, which exposes {}",
            us(copy),
            us(gemm),
            us(saved),
            baseline_words(base.algorithm),
            us(base.report.max_exposed_comm_s())
        )
    } else {
        format!(
            "communication {} per step is longer than the {} GEMM per step, so only part of it hides; still {} faster than {}",
            us(copy),
            us(gemm),
            us(saved),
            baseline_words(base.algorithm)
        )
    };
    if let Algorithm::RingChunked { chunks } = win.algorithm {
        if let Some(ring) = ranked.iter().find(|c| c.algorithm == Algorithm::Ring) {
            text += &format!(
                "; chunking {chunks} saves the first step's wait ({} instead of {} with ring)",
                us(first_wait_s(r)),
                us(first_wait_s(&ring.report))
            );
        }
    }
    if win.algorithm == Algorithm::RingBidir {
        text += "; both link directions carry shards, so half as many rounds";
    }
    text
}

/// Ranks every 1D candidate for `problem` by simulated time on `profile`.
pub fn tune_1d(problem: &Problem, profile: &Profile) -> Result<Ranking1d, TuneError> {
    let mut ranked = Vec::new();
    let mut skipped = Vec::new();
    for algorithm in candidates_1d(problem.op, problem.devices, profile) {
        match build_plan(problem, algorithm) {
            Ok(plan) => {
                let report = simulate(&plan, profile, &SimOptions::default())?;
                ranked.push(Ranked1d { algorithm, report });
            }
            // e.g. a chunk count that does not divide M/D: not a candidate for this shape.
            Err(e) => skipped.push((algorithm, e.to_string())),
        }
    }
    if ranked.is_empty() {
        return Err(TuneError::NoCandidate {
            problem: format!("{} D={} {}", problem.op, problem.devices, problem.shape_string()),
            reasons: skipped.iter().map(|(a, r)| format!("{a}: {r}")).collect::<Vec<_>>().join("; "),
        });
    }
    // Stable sort with the baselines first: a tie never picks overlap.
    ranked.sort_by(|a, b| {
        a.report
            .makespan_s
            .total_cmp(&b.report.makespan_s)
            .then((!is_baseline(a.algorithm)).cmp(&!is_baseline(b.algorithm)))
    });
    let reason = explain(&ranked, problem.op);
    Ok(Ranking1d { ranked, skipped, reason })
}

/// cmm's own plans for a 2D candidate, as the reference checks them and the CUDA backend
/// runs them: one, or for Wang each of its four plans (`MeshAlgorithm::WANG`) whose ring
/// has more than one chip; none where the mesh module builds none (S not dividing the sliced
/// extents, a dimension the mesh does not divide). MeshSlice's block size B is the largest
/// that lets S·B divide both sliced extents (seed 002: S·B | K/Nr and S·B | K/Nc for OS).
pub fn mesh_plans(gemm: &MeshGemm, family: MeshFamily, shape: MeshShape, slices: usize) -> Vec<(MeshAlgorithm, Plan)> {
    let (rows, cols) = (shape.rows, shape.cols);
    let Ok(problem) =
        MeshProblem::for_simulation(rows, cols, gemm.dataflow, gemm.m, gemm.n, gemm.k, gemm.dtype, gemm.dtype)
    else {
        return Vec::new();
    };
    // OS sends no partial sums: a model's OS passes keep f32 (there is nothing to narrow).
    let problem = match gemm.dataflow {
        Dataflow::Os => problem,
        _ => match problem.with_wire(gemm.wire) {
            Ok(p) => p,
            Err(_) => return Vec::new(),
        },
    };
    let algorithms = match family {
        MeshFamily::Collective => vec![MeshAlgorithm::Collective],
        MeshFamily::Summa => vec![MeshAlgorithm::Summa],
        MeshFamily::Cannon => vec![MeshAlgorithm::Cannon],
        MeshFamily::Wang => {
            // A direction one chip wide has no ring to decompose (a 1 × 1 mesh has no ring
            // at all: one plan).
            let ring_of = |ring| if ring == WangRing::Rows { cols } else { rows };
            let variants: Vec<MeshAlgorithm> = MeshAlgorithm::WANG
                .into_iter()
                .filter(|a| matches!(*a, MeshAlgorithm::Wang { ring, .. } if ring_of(ring) > 1))
                .collect();
            if variants.is_empty() {
                vec![MeshAlgorithm::WANG[0]]
            } else {
                variants
            }
        }
        MeshFamily::MeshSlice => match problem.largest_block(slices) {
            Some(block) => vec![MeshAlgorithm::MeshSlice { slices, block }],
            None => Vec::new(),
        },
    };
    algorithms.into_iter().filter_map(|a| build_mesh_plan(&problem, a).ok().map(|plan| (a, plan))).collect()
}

/// [`mesh_plans`] simulated on `profile`, the mesh laid on the profile's torus as
/// `shape` (a torus profile; other topologies ignore it): the fastest plan's algorithm and
/// report (for Wang, the fastest of its plans, as seed 002's form takes the faster
/// direction). `None` where no
/// plan builds.
pub fn replay_mesh(
    gemm: &MeshGemm,
    family: MeshFamily,
    shape: MeshShape,
    slices: usize,
    profile: &Profile,
) -> Result<Option<(MeshAlgorithm, SimReport)>, TuneError> {
    let options = SimOptions { torus_dims: Some(vec![shape.rows, shape.cols]), ..SimOptions::default() };
    let mut best: Option<(MeshAlgorithm, SimReport)> = None;
    for (algorithm, plan) in mesh_plans(gemm, family, shape, slices) {
        let report = simulate(&plan, profile, &options)?;
        if best.as_ref().is_none_or(|(_, b)| report.makespan_s < b.makespan_s) {
            best = Some((algorithm, report));
        }
    }
    Ok(best)
}

/// Slice counts tried for MeshSlice.
pub fn slice_candidates() -> Vec<usize> {
    (1..=64).collect()
}

/// Slice counts a model's layers are replayed at ([`replay_llm`]): a layer's plans at
/// hundreds of chips hold up to ~10^6 ops each, too many to simulate at every S.
pub const REPLAY_SLICES: [usize; 8] = [1, 2, 4, 8, 12, 16, 24, 32];

/// A linear (fully connected) layer: `Y = X·W`, X is tokens × in, W is in × out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FcLayer {
    /// Name.
    pub name: &'static str,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

/// The FC layers of one transformer block and the tokens of one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlmConfig {
    /// Name.
    pub name: &'static str,
    /// Tokens per step (batch × sequence).
    pub tokens: usize,
    /// FC layers of one block, in order.
    pub layers: Vec<FcLayer>,
    /// Element type.
    pub dtype: DType,
    /// The dtype the LS/RS passes' partial sums travel in in cmm's plans ([`MeshGemm::wire`]).
    pub wire: DType,
}

impl LlmConfig {
    /// GPT-3 175B (hidden 12288, MLP 4×hidden, sequence 2048) at batch `batch` (seed 002's
    /// weak scaling uses batch = chips / 2, so 128 on 256 chips), bf16.
    pub fn gpt3_175b(batch: usize) -> LlmConfig {
        let h = 12_288;
        LlmConfig {
            name: "GPT-3 175B",
            // Saturating: a batch past what fits is refused by the tuner's size check.
            tokens: batch.saturating_mul(2048),
            layers: vec![
                FcLayer { name: "qkv", in_features: h, out_features: 3 * h },
                FcLayer { name: "attn_out", in_features: h, out_features: h },
                FcLayer { name: "mlp_up", in_features: h, out_features: 4 * h },
                FcLayer { name: "mlp_down", in_features: 4 * h, out_features: h },
            ],
            dtype: DType::Bf16,
            wire: DType::F32,
        }
    }
}

/// Which matrix of `Y = X·W` stays on its chip (seed 002 Table 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stationary {
    /// A-stn: the input X (forward LS).
    Input,
    /// B-stn: the weight W (forward RS, needs Xᵀ).
    Weight,
    /// C-stn: the output Y (forward OS).
    Output,
}

impl fmt::Display for Stationary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stationary::Input => "A-stn (X)",
            Stationary::Weight => "B-stn (W)",
            Stationary::Output => "C-stn (Y)",
        })
    }
}

/// One of a layer's three GEMMs with its dataflow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassGemm {
    /// "forward", "backward-data" or "backward-weight".
    pub pass: &'static str,
    /// The product in the dataflow's notation, e.g. `Y = OS(X, W)`.
    pub formula: &'static str,
    /// The GEMM.
    pub gemm: MeshGemm,
}

/// Phase 1's choice for one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerDataflows {
    /// The layer.
    pub layer: FcLayer,
    /// The stationary matrix (the largest).
    pub stationary: Stationary,
    /// Whether the transposed dataflow is used (mesh directions swapped) so that the
    /// layer's input needs no transpose.
    pub transposed: bool,
    /// Forward, backward-data, backward-weight.
    pub passes: [PassGemm; 3],
    /// Matrices stored transposed once (at initialisation), not per step.
    pub stored_transposed: &'static str,
}

/// MeshSlice phase 1 (seed 002 §3.2.1): per layer keep the largest of X, W, Y stationary in
/// forward, backward-data and backward-weight (Table 1's row), so that every matrix and its
/// gradient flow the same way and nothing is transposed between the passes. Ties go to the
/// output (C-stn). A B-stn row needs Xᵀ; the transposed row is used instead so that the
/// activations coming from the previous layer keep their layout.
pub fn choose_dataflows(llm: &LlmConfig) -> Vec<LayerDataflows> {
    let t = llm.tokens;
    let dt = llm.dtype;
    let g =
        |m: usize, n: usize, k: usize, dataflow: Dataflow| MeshGemm { m, n, k, dataflow, dtype: dt, wire: llm.wire };
    llm.layers
        .iter()
        .map(|layer| {
            let (i, o) = (layer.in_features, layer.out_features);
            let (x, w, y) = (t * i, i * o, t * o);
            let stationary = if y >= x && y >= w {
                Stationary::Output
            } else if x >= w {
                Stationary::Input
            } else {
                Stationary::Weight
            };
            // Table 1 (BRIEF §3.4 notation: OS(A,B)=A·B, LS(A,B)=A·Bᵀ, RS(A,B)=Aᵀ·B).
            let (passes, stored) = match stationary {
                Stationary::Output => (
                    [
                        PassGemm { pass: "forward", formula: "Y = OS(X, W)", gemm: g(t, o, i, Dataflow::Os) },
                        PassGemm { pass: "backward-data", formula: "dX = LS(dY, W)", gemm: g(t, i, o, Dataflow::Ls) },
                        PassGemm { pass: "backward-weight", formula: "dW = RS(X, dY)", gemm: g(i, o, t, Dataflow::Rs) },
                    ],
                    "none",
                ),
                Stationary::Input => (
                    [
                        PassGemm { pass: "forward", formula: "Y = LS(X, Wᵀ)", gemm: g(t, o, i, Dataflow::Ls) },
                        PassGemm {
                            pass: "backward-data", formula: "dX = OS(dY, Wᵀ)", gemm: g(t, i, o, Dataflow::Os)
                        },
                        PassGemm {
                            pass: "backward-weight",
                            formula: "dWᵀ = RS(dY, X)",
                            gemm: g(o, i, t, Dataflow::Rs),
                        },
                    ],
                    "Wᵀ",
                ),
                Stationary::Weight => (
                    [
                        PassGemm { pass: "forward", formula: "Y = RS(Xᵀ, W)", gemm: g(t, o, i, Dataflow::Rs) },
                        PassGemm {
                            pass: "backward-data", formula: "dXᵀ = LS(W, dY)", gemm: g(i, t, o, Dataflow::Ls)
                        },
                        PassGemm {
                            pass: "backward-weight",
                            formula: "dW = OS(Xᵀ, dY)",
                            gemm: g(i, o, t, Dataflow::Os),
                        },
                    ],
                    "none",
                ),
            };
            LayerDataflows {
                layer: layer.clone(),
                stationary,
                transposed: stationary == Stationary::Weight,
                passes,
                stored_transposed: stored,
            }
        })
        .collect()
}

/// One layer's best MeshSlice slice count and time on a mesh.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerChoice {
    /// Layer name.
    pub layer: &'static str,
    /// Slices (MeshSlice) or the algorithm's own iteration count.
    pub slices: usize,
    /// Forward + backward time of the layer, seconds.
    pub time_s: f64,
}

/// One (algorithm, mesh) configuration for a whole LLM block.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshConfig {
    /// Algorithm.
    pub algorithm: MeshFamily,
    /// Mesh.
    pub shape: MeshShape,
    /// Per layer.
    pub layers: Vec<LayerChoice>,
    /// Sum over layers and passes, seconds.
    pub total_s: f64,
    /// GEMM time alone (no communication), seconds.
    pub compute_s: f64,
}

/// MeshSlice phase 2 and the same search for every other algorithm, by seed 002's closed
/// form: for each mesh shape, each layer's best S (MeshSlice; one S per layer, shared by its
/// three GEMMs), summed. Returns every feasible (algorithm, shape), fastest first.
pub fn tune_llm(llm: &LlmConfig, chips: usize, profile: &Profile) -> Result<Vec<MeshConfig>, TuneError> {
    check_chips(chips)?;
    check_profile_chips(chips, profile)?;
    check_llm(llm)?;
    let flows = choose_dataflows(llm);
    let mut configs = Vec::new();
    for shape in MeshShape::all(chips) {
        for algorithm in MeshFamily::ALL {
            let slices = if algorithm == MeshFamily::MeshSlice { slice_candidates() } else { vec![1] };
            let form = |gemm: &MeshGemm, shape: MeshShape, s: usize| {
                estimate_mesh(algorithm, gemm, shape, s, profile).ok().map(|e| (e.total_s, e.compute_s))
            };
            if let Some(config) = best_layers(&flows, algorithm, shape, &slices, form) {
                configs.push(config);
            }
        }
    }
    if configs.is_empty() {
        let gemms: Vec<(String, MeshGemm, bool)> = flows
            .iter()
            .flat_map(|lf| {
                lf.passes.iter().map(move |p| (format!("{} {}", lf.layer.name, p.pass), p.gemm, lf.transposed))
            })
            .collect();
        return Err(TuneError::NoMeshConfiguration {
            what: llm.name.to_string(),
            chips,
            why: why_no_mesh(&gemms, chips, profile),
        });
    }
    configs.sort_by(|a, b| a.total_s.total_cmp(&b.total_s));
    Ok(configs)
}

/// cmm's own plans for `algorithm` on `shape` simulated for every pass of every layer of
/// `llm`: per layer the best S among `slices` (MeshSlice; the other algorithms take 1), its
/// compute the plans' compute floors. `None` where some layer builds no plan at any of them.
pub fn replay_llm(
    llm: &LlmConfig,
    algorithm: MeshFamily,
    shape: MeshShape,
    profile: &Profile,
    slices: &[usize],
) -> Result<Option<MeshConfig>, TuneError> {
    check_chips(shape.chips())?;
    check_profile_chips(shape.chips(), profile)?;
    check_llm(llm)?;
    let flows = choose_dataflows(llm);
    let slices = if algorithm == MeshFamily::MeshSlice { slices.to_vec() } else { vec![1] };
    // Every pass of every layer at every S, one simulation a core; then each layer's best.
    let mut jobs: Vec<(MeshGemm, MeshShape, usize)> = Vec::new();
    for lf in &flows {
        let on = if lf.transposed { shape.transposed() } else { shape };
        jobs.extend(lf.passes.iter().flat_map(|p| slices.iter().map(move |&s| (p.gemm, on, s))));
    }
    let times = jobs
        .par_iter()
        .map(|&(gemm, on, s)| {
            let report = replay_mesh(&gemm, algorithm, on, s, profile)?;
            Ok(((gemm, on, s), report.map(|(_, r)| (r.makespan_s, r.compute_floor_s))))
        })
        .collect::<Result<HashMap<_, _>, TuneError>>()?;
    Ok(best_layers(&flows, algorithm, shape, &slices, |gemm, on, s| times.get(&(*gemm, on, s)).copied().flatten()))
}

/// Each layer's best S on `shape` by `time` (seconds and compute seconds of one GEMM on a
/// mesh with S slices, `None` where it has none), summed over the layer's passes.
fn best_layers(
    flows: &[LayerDataflows],
    algorithm: MeshFamily,
    shape: MeshShape,
    slices: &[usize],
    mut time: impl FnMut(&MeshGemm, MeshShape, usize) -> Option<(f64, f64)>,
) -> Option<MeshConfig> {
    let mut layers = Vec::new();
    let mut compute_s = 0.0;
    for lf in flows {
        // Transposed dataflows swap the mesh directions.
        let on = if lf.transposed { shape.transposed() } else { shape };
        let mut best: Option<(usize, f64, f64)> = None;
        for &s in slices {
            let passes: Option<Vec<(f64, f64)>> = lf.passes.iter().map(|p| time(&p.gemm, on, s)).collect();
            if let Some(passes) = passes {
                let (t, c) = passes.iter().fold((0.0, 0.0), |acc, p| (acc.0 + p.0, acc.1 + p.1));
                if best.is_none_or(|b| t < b.1) {
                    best = Some((s, t, c));
                }
            }
        }
        let (s, t, c) = best?;
        compute_s += c;
        layers.push(LayerChoice { layer: lf.layer.name, slices: s, time_s: t });
    }
    let total_s = layers.iter().map(|l| l.time_s).sum();
    Some(MeshConfig { algorithm, shape, layers, total_s, compute_s })
}

/// Why no mesh of `chips` takes `gemms` (each named, or unnamed where there is one, and
/// whether it runs on the transposed mesh): per mesh, the first GEMM the collective
/// algorithm cannot lay out on it. Every algorithm needs that layout, so it is the reason
/// when none fits.
fn why_no_mesh(gemms: &[(String, MeshGemm, bool)], chips: usize, profile: &Profile) -> String {
    let reasons: Vec<String> = MeshShape::all(chips)
        .into_iter()
        .filter_map(|shape| {
            gemms.iter().find_map(|(name, g, transposed)| {
                let on = if *transposed { shape.transposed() } else { shape };
                estimate_mesh(MeshFamily::Collective, g, on, 1, profile).err().map(|e| match name.as_str() {
                    "" => format!("{e}"),
                    _ => format!("{name}: {e}"),
                })
            })
        })
        .collect();
    if reasons.is_empty() {
        String::new()
    } else {
        format!(": {}", reasons.join("; "))
    }
}

/// The fastest configuration of each algorithm, fastest first.
pub fn best_per_algorithm(configs: &[MeshConfig]) -> Vec<&MeshConfig> {
    let mut best: Vec<&MeshConfig> = Vec::new();
    for c in configs {
        if !best.iter().any(|b| b.algorithm == c.algorithm) {
            best.push(c);
        }
    }
    best
}

/// One 2D candidate for a GEMM: seed 002's closed form at the S it finds best, and, where
/// the tuner replayed it, cmm's own plan simulated at the S the replay finds best.
#[derive(Clone, Debug)]
pub struct MeshCandidate {
    /// Algorithm.
    pub algorithm: MeshFamily,
    /// Mesh.
    pub shape: MeshShape,
    /// Seed 002's closed form at `analytic_slices`.
    pub analytic: MeshEstimate,
    /// The closed form's best S (MeshSlice; 1 for the others).
    pub analytic_slices: usize,
    /// cmm's plan simulated at its best S; `None` where not replayed or no plan builds.
    pub replayed: Option<MeshReplay>,
}

/// cmm's own plan for a 2D candidate, simulated.
#[derive(Clone, Debug)]
pub struct MeshReplay {
    /// The plan's algorithm with its parameters (for Wang, the direction it decomposes).
    pub algorithm: MeshAlgorithm,
    /// Its best S over [`slice_candidates`] (1 for the algorithms without slices).
    pub slices: usize,
    /// The simulation.
    pub report: Box<SimReport>,
}

impl MeshCandidate {
    /// The time it ranks by: the replay's where there is one, else the closed form's.
    pub fn time_s(&self) -> f64 {
        self.replayed.as_ref().map_or(self.analytic.total_s, |r| r.report.makespan_s)
    }

    /// The S of [`Self::time_s`].
    pub fn slices(&self) -> usize {
        self.replayed.as_ref().map_or(self.analytic_slices, |r| r.slices)
    }
}

/// Ranks (algorithm, mesh) for one 2D GEMM with a given dataflow. Seed 002's closed form
/// prices every candidate (fast at hundreds of chips); then cmm's own plans for the
/// `replay` candidates it ranks highest are simulated at every S that builds. Those come
/// first, fastest replay first, then the rest by the closed form.
pub fn tune_mesh_gemm(
    gemm: &MeshGemm,
    chips: usize,
    profile: &Profile,
    replay: usize,
) -> Result<Vec<MeshCandidate>, TuneError> {
    check_chips(chips)?;
    check_profile_chips(chips, profile)?;
    gemm.check_size().map_err(|source| TuneError::Gemm {
        what: format!("{} GEMM M={} N={} K={}", gemm.dataflow, gemm.m, gemm.n, gemm.k),
        source,
    })?;
    let slices_of = |algorithm| if algorithm == MeshFamily::MeshSlice { slice_candidates() } else { vec![1] };
    let mut out = Vec::new();
    for shape in MeshShape::all(chips) {
        for algorithm in MeshFamily::ALL {
            let best = slices_of(algorithm)
                .into_iter()
                .filter_map(|s| estimate_mesh(algorithm, gemm, shape, s, profile).ok().map(|e| (s, e)))
                .min_by(|a, b| a.1.total_s.total_cmp(&b.1.total_s));
            if let Some((analytic_slices, analytic)) = best {
                out.push(MeshCandidate { algorithm, shape, analytic, analytic_slices, replayed: None });
            }
        }
    }
    if out.is_empty() {
        return Err(TuneError::NoMeshConfiguration {
            what: format!("{} GEMM M={} N={} K={}", gemm.dataflow, gemm.m, gemm.n, gemm.k),
            chips,
            why: why_no_mesh(&[(String::new(), *gemm, false)], chips, profile),
        });
    }
    out.sort_by(|a, b| a.analytic.total_s.total_cmp(&b.analytic.total_s));
    // The leaders at every S, one simulation a core, keeping times only (a report at
    // hundreds of chips holds every op's record); then each leader's fastest S again,
    // for its report.
    let leaders = replay.min(out.len());
    let jobs: Vec<(usize, usize)> =
        (0..leaders).flat_map(|i| slices_of(out[i].algorithm).into_iter().map(move |s| (i, s))).collect();
    let times = jobs
        .par_iter()
        .map(|&(i, s)| Ok(replay_mesh(gemm, out[i].algorithm, out[i].shape, s, profile)?.map(|(_, r)| r.makespan_s)))
        .collect::<Result<Vec<Option<f64>>, TuneError>>()?;
    let mut fastest: Vec<Option<(usize, f64)>> = vec![None; leaders];
    for (&(i, s), time) in jobs.iter().zip(times) {
        if let Some(t) = time {
            if fastest[i].is_none_or(|(_, best)| t < best) {
                fastest[i] = Some((s, t));
            }
        }
    }
    let reports = fastest
        .par_iter()
        .enumerate()
        .map(|(i, best)| match best {
            Some((s, _)) => Ok(replay_mesh(gemm, out[i].algorithm, out[i].shape, *s, profile)?
                .map(|(algorithm, r)| MeshReplay { algorithm, slices: *s, report: Box::new(r) })),
            None => Ok(None),
        })
        .collect::<Result<Vec<_>, TuneError>>()?;
    for (candidate, replayed) in out.iter_mut().zip(reports) {
        candidate.replayed = replayed;
    }
    out.sort_by(|a, b| a.replayed.is_none().cmp(&b.replayed.is_none()).then(a.time_s().total_cmp(&b.time_s())));
    Ok(out)
}

#[cfg(test)]
mod linear_tests {
    use super::*;
    use cmm_core::linear::{Layer, Pass};

    fn gpt3(layer: Layer, pass: Pass, hidden: usize, ffn: usize) -> LinearProblem {
        LinearProblem::new(layer, pass, true, 8, 1, 2048, hidden, ffn, DType::Bf16).unwrap()
    }

    #[test]
    fn megatrons_async_reduce_scatter_pays_for_a_gpt3_column_backward() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let r = tune_linear(&gpt3(Layer::Column, Pass::Backward, 12288, 49152), &profile, Engines::AsBuilt).unwrap();
        assert!(r.overlap_pays && r.ranked[0].algorithm == LinearAlgorithm::Megatron, "{}", r.reason);
        assert!(r.reason.contains("megatron wins") && r.reason.contains("exposes"), "{}", r.reason);
    }

    #[test]
    fn a_row_backward_has_nothing_for_megatron_to_hide() {
        // Megatron's row-parallel backward gathers dY before both GEMMs: the same work as
        // the baseline, so the verdict must not call a rounding difference a win.
        let profile = Profile::load("h100-nvlink").unwrap();
        let r = tune_linear(&gpt3(Layer::Row, Pass::Backward, 49152, 12288), &profile, Engines::AsBuilt).unwrap();
        let base = r.ranked.iter().find(|c| c.algorithm == LinearAlgorithm::Baseline).unwrap();
        let megatron = r.ranked.iter().find(|c| c.algorithm == LinearAlgorithm::Megatron).unwrap();
        assert!((megatron.report.makespan_s / base.report.makespan_s - 1.0).abs() < MEANINGFUL_GAIN);
        if r.ranked[0].algorithm != LinearAlgorithm::Ring {
            assert!(!r.overlap_pays, "{}", r.reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Across nodes the hierarchical plans are candidates, at the profile's node size, and
    /// win: a NIC carries a shard (or a node's sum of a block) per other node, not one per
    /// remote GPU. Inside one node, or where D does not fill whole nodes, they are not
    /// candidates.
    #[test]
    fn across_nodes_the_hierarchical_plan_is_tried_and_wins() {
        let ib = Profile::load("h100-ib").unwrap();
        let p = Problem::new(OpKind::AgGemm, 16, 16384, 4096, 4096, DType::Bf16, DType::Bf16).unwrap();
        let r = tune_1d(&p, &ib).unwrap();
        assert_eq!(r.winner().algorithm, Algorithm::Hierarchical { node: 8 }, "{}", r.reason);
        assert!(r.reason.starts_with("each shard crosses between two nodes once"), "{}", r.reason);
        assert!(
            r.reason.contains("a NIC carries 1 shard each way where a direct AllGather sends it 8 shards"),
            "{}",
            r.reason
        );
        let direct = r.ranked.iter().find(|c| c.algorithm == Algorithm::BaselineDirect).unwrap();
        assert!(r.winner().report.makespan_s < 0.5 * direct.report.makespan_s);
        for op in [OpKind::GemmRs, OpKind::GemmAr] {
            let p = Problem::new(op, 16, 4096, 12288, 98304, DType::Bf16, DType::Bf16).unwrap();
            let r = tune_1d(&p, &ib).unwrap();
            assert_eq!(r.winner().algorithm, Algorithm::Hierarchical { node: 8 }, "{op}: {}", r.reason);
            assert!(r.reason.starts_with("a node sums each block inside it"), "{}", r.reason);
            assert!(r.reason.contains("a NIC carries 1 block each way where a direct ReduceScatter sends it 8 blocks"));
        }
        let hierarchical = |op, devices, profile: &Profile| {
            candidates_1d(op, devices, profile).iter().any(|a| matches!(a, Algorithm::Hierarchical { .. }))
        };
        assert!(!hierarchical(OpKind::AgGemm, 8, &ib) && !hierarchical(OpKind::AgGemm, 12, &ib));
        assert!(hierarchical(OpKind::GemmRs, 16, &ib) && hierarchical(OpKind::GemmAr, 64, &ib));
        assert!(!hierarchical(OpKind::AgGemm, 16, &Profile::load("h100-nvlink").unwrap()));
    }

    #[test]
    fn the_tuner_picks_the_baseline_on_a_tiny_problem() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let p = Problem::new(OpKind::AgGemm, 4, 64, 64, 64, DType::F16, DType::F16).unwrap();
        let r = tune_1d(&p, &profile).unwrap();
        // Per-step GEMMs pay a launch and a synchronisation round per step: they lose. The
        // fused kernel (one launch, waits inside) beats the ring baseline, but not the
        // direct one, whose copies all start at once and end in one wait.
        let time = |a: Algorithm| r.ranked.iter().find(|c| c.algorithm == a).unwrap().report.makespan_s;
        for a in [Algorithm::Ring, Algorithm::RingBidir, Algorithm::RingChunked { chunks: 2 }] {
            assert!(time(a) > time(Algorithm::Baseline), "{a}");
        }
        assert!(time(Algorithm::Fused { chunks: 1 }) < time(Algorithm::Baseline));
        assert_eq!(r.winner().algorithm, Algorithm::BaselineDirect, "{}", r.reason);
        assert!(r.reason.starts_with("the direct baseline wins"), "{}", r.reason);
        // GEMM+RS and GEMM+AR: of the plans with copies, none beats the ring baseline; the
        // plans whose GEMMs add into the owners' sums (no copy launches, one reduce) do,
        // ring_push among them, and the direct baseline beats them all.
        for op in [OpKind::GemmRs, OpKind::GemmAr] {
            let p = Problem::new(op, 4, 64, 64, 64, DType::F16, DType::F16).unwrap();
            let r = tune_1d(&p, &profile).unwrap();
            let ranked: Vec<Algorithm> = r.ranked.iter().map(|c| c.algorithm).collect();
            let baseline = ranked.iter().position(|&a| a == Algorithm::Baseline).unwrap();
            let push = |a: Algorithm| matches!(a, Algorithm::RingPush | Algorithm::FusedPush { .. });
            assert_eq!(ranked[0], Algorithm::BaselineDirect, "{op}: {ranked:?}");
            assert!(baseline > 1 && ranked[1..baseline].iter().all(|&a| push(a)), "{op}: {ranked:?}");
            assert!(ranked[..baseline].contains(&Algorithm::RingPush), "{op}: {ranked:?}");
            assert!(r.reason.starts_with("the direct baseline wins"), "{}", r.reason);
        }
    }

    /// Across GPUs, ring_push's GEMMs carry their blocks over the link after computing
    /// them: at a large shape on NVLink it ranks below the plans that hide their copies.
    #[test]
    fn ring_push_loses_where_its_epilogue_crosses_a_link() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let p = Problem::new(OpKind::GemmRs, 8, 8192, 4096, 32768, DType::F16, DType::F16).unwrap();
        let r = tune_1d(&p, &profile).unwrap();
        let time = |a: Algorithm| r.ranked.iter().find(|c| c.algorithm == a).unwrap().report.makespan_s;
        assert!(time(Algorithm::RingPush) > time(Algorithm::Ring), "{}", r.reason);
        assert!(time(Algorithm::RingPush) > time(Algorithm::RingAccumulate { chunks: 2 }));
    }

    #[test]
    fn the_tuner_overlaps_a_large_problem_and_says_why() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let p = Problem::new(OpKind::AgGemm, 8, 8 * 1024, 8 * 4096, 4096, DType::F16, DType::F16).unwrap();
        let r = tune_1d(&p, &profile).unwrap();
        assert_ne!(r.winner().algorithm, Algorithm::Baseline);
        assert!(r.reason.contains("hidden under"), "{}", r.reason);
        // Ranked fastest first.
        assert!(r.ranked.windows(2).all(|w| w[0].report.makespan_s <= w[1].report.makespan_s));
    }

    #[test]
    fn phase_one_keeps_the_largest_matrix_stationary() {
        let flows = choose_dataflows(&LlmConfig::gpt3_175b(128));
        let by = |n: &str| flows.iter().find(|f| f.layer.name == n).unwrap();
        assert_eq!(by("mlp_up").stationary, Stationary::Output);
        assert_eq!(by("mlp_down").stationary, Stationary::Input);
        assert_eq!(by("mlp_down").stored_transposed, "Wᵀ");
        // Every pass of a layer does the same FLOPs.
        for f in &flows {
            let flops: Vec<usize> = f.passes.iter().map(|p| p.gemm.m * p.gemm.n * p.gemm.k).collect();
            assert!(flops.iter().all(|&x| x == flops[0]), "{}", f.layer.name);
        }
        // A tiny-batch layer with a huge weight keeps W stationary via the transposed row.
        let small = LlmConfig { tokens: 16, ..LlmConfig::gpt3_175b(1) };
        assert!(choose_dataflows(&small).iter().all(|f| f.stationary == Stationary::Weight && f.transposed));
    }

    /// The 2D tuner ranks the candidates it replays by cmm's own plans simulated, each at
    /// the S that simulates fastest, ahead of the rest, which keep the closed form's order.
    #[test]
    fn the_2d_tuner_ranks_the_leaders_by_cmms_own_plans_simulated() {
        let profile = Profile::load("tpuv4-torus").unwrap();
        let gemm = MeshGemm { m: 8192, n: 8192, k: 8192, dataflow: Dataflow::Os, dtype: DType::Bf16, wire: DType::F32 };
        let ranked = tune_mesh_gemm(&gemm, 16, &profile, 4).unwrap();
        let (replayed, rest) = ranked.split_at(4);
        assert!(replayed.iter().all(|c| c.replayed.is_some()) && rest.iter().all(|c| c.replayed.is_none()));
        assert!(replayed.windows(2).all(|w| w[0].time_s() <= w[1].time_s()));
        assert!(rest.windows(2).all(|w| w[0].analytic.total_s <= w[1].analytic.total_s));
        // The replayed are the closed form's first four, and none of the rest beats them by it.
        let worst_replayed_form = replayed.iter().map(|c| c.analytic.total_s).fold(0.0, f64::max);
        assert!(rest.iter().all(|c| c.analytic.total_s >= worst_replayed_form));
        for c in replayed {
            let MeshReplay { slices: s, report, algorithm } = c.replayed.as_ref().unwrap();
            let (again_algorithm, again) = replay_mesh(&gemm, c.algorithm, c.shape, *s, &profile).unwrap().unwrap();
            assert_eq!(again.makespan_s, report.makespan_s, "{} {}", c.algorithm, c.shape);
            assert_eq!(&again_algorithm, algorithm);
            // No S that builds simulates faster.
            for other in slice_candidates() {
                if let Some((_, r)) = replay_mesh(&gemm, c.algorithm, c.shape, other, &profile).unwrap() {
                    assert!(r.makespan_s >= report.makespan_s, "{} {} S={other}", c.algorithm, c.shape);
                }
            }
            let form = estimate_mesh(c.algorithm, &gemm, c.shape, c.analytic_slices, &profile).unwrap();
            assert_eq!(form.total_s, c.analytic.total_s);
        }
        // Nothing replayed: the closed form's order alone.
        let form_only = tune_mesh_gemm(&gemm, 16, &profile, 0).unwrap();
        assert!(form_only.iter().all(|c| c.replayed.is_none() && c.time_s() == c.analytic.total_s));
        assert!(form_only.windows(2).all(|w| w[0].time_s() <= w[1].time_s()));
    }

    /// A model's layers replayed: each layer's time is its passes' plans simulated at the S
    /// it reports, and no S of the set is faster.
    #[test]
    fn a_models_layers_are_replayed_at_their_fastest_slice_count() {
        let profile = Profile::load("tpuv4-torus").unwrap();
        let llm = LlmConfig {
            name: "small",
            tokens: 8192,
            layers: vec![
                FcLayer { name: "up", in_features: 1024, out_features: 4096 },
                FcLayer { name: "down", in_features: 4096, out_features: 1024 },
            ],
            dtype: DType::Bf16,
            wire: DType::F32,
        };
        let shape = MeshShape { rows: 4, cols: 4 };
        let slices = [1, 2, 4, 8];
        let config = replay_llm(&llm, MeshFamily::MeshSlice, shape, &profile, &slices).unwrap().unwrap();
        let flows = choose_dataflows(&llm);
        assert_eq!(config.layers.len(), 2);
        let layer_s = |lf: &LayerDataflows, s: usize| -> Option<f64> {
            let on = if lf.transposed { shape.transposed() } else { shape };
            lf.passes
                .iter()
                .map(|p| {
                    replay_mesh(&p.gemm, MeshFamily::MeshSlice, on, s, &profile).unwrap().map(|(_, r)| r.makespan_s)
                })
                .sum()
        };
        for (choice, lf) in config.layers.iter().zip(&flows) {
            assert_eq!(layer_s(lf, choice.slices), Some(choice.time_s), "{}", choice.layer);
            assert!(slices.iter().filter_map(|&s| layer_s(lf, s)).all(|t| t >= choice.time_s), "{}", choice.layer);
        }
        assert_eq!(config.total_s, config.layers.iter().map(|l| l.time_s).sum::<f64>());
        // The algorithms without slices run once, at 1, whatever the set.
        let wang = replay_llm(&llm, MeshFamily::Wang, shape, &profile, &slices).unwrap().unwrap();
        assert!(wang.layers.iter().all(|l| l.slices == 1));
    }

    /// A GEMM whose matrices no buffer holds (their element counts would wrap) or that has
    /// no elements is refused before any mesh is priced, naming the matrix.
    #[test]
    fn the_2d_tuner_refuses_matrices_past_a_buffers_size() {
        let profile = Profile::load("tpuv4-torus").unwrap();
        let gemm = |m: usize, n: usize, k: usize| MeshGemm {
            m,
            n,
            k,
            dataflow: Dataflow::Os,
            dtype: DType::Bf16,
            wire: DType::F32,
        };
        let e = tune_mesh_gemm(&gemm(1 << 40, 4096, 1 << 40), 256, &profile, 0).unwrap_err();
        assert!(
            matches!(e, TuneError::Gemm { .. }) && e.to_string().contains("A is 1099511627776×1099511627776"),
            "{e}"
        );
        let e = tune_mesh_gemm(&gemm(4096, 0, 4096), 256, &profile, 0).unwrap_err();
        assert!(e.to_string().contains("B is 4096×0"), "{e}");
        // Partial sums in an integer type: refused, not replayed into an empty ranking.
        let ls = MeshGemm { dataflow: Dataflow::Ls, wire: DType::U32, ..gemm(4096, 4096, 4096) };
        let e = tune_mesh_gemm(&ls, 16, &profile, 1).unwrap_err();
        assert!(e.to_string().contains("partial sums travel as f32, f16 or bf16 (got wire dtype u32)"), "{e}");
        let llm = LlmConfig { wire: DType::U32, ..LlmConfig::gpt3_175b(1) };
        let shape = MeshShape { rows: 16, cols: 16 };
        let e = replay_llm(&llm, MeshFamily::MeshSlice, shape, &profile, &[1]).unwrap_err();
        assert!(e.to_string().contains("got wire dtype u32"), "{e}");
        // No mesh lays it out: each mesh says why.
        let e = tune_mesh_gemm(&gemm(2752, 768, 3904), 3, &profile, 0).unwrap_err().to_string();
        assert!(
            e.contains("on 3 chips: M=2752 does not split over the 1x3 mesh; M=2752 does not split over the 3x1"),
            "{e}"
        );
        let e = tune_llm(&LlmConfig::gpt3_175b(1), 7, &profile).unwrap_err().to_string();
        assert!(e.contains("qkv forward: M=2048 does not split over the 7x1 mesh"), "{e}");
        // At batch 0 a layer has no tokens; at 2^40 sequences its activations no buffer holds.
        for batch in [0, 1 << 40] {
            let e = tune_llm(&LlmConfig::gpt3_175b(batch), 256, &profile).unwrap_err();
            assert!(e.to_string().contains("layer qkv") && e.to_string().contains("A is"), "{e}");
        }
        // GPT-3's activations at batch 128 (1.3·10^10 elements, past a 1D problem's 2^32) fit.
        assert!(tune_llm(&LlmConfig::gpt3_175b(128), 256, &profile).is_ok());
    }
}

/// One simulated candidate of a family's algorithms.
#[derive(Clone, Debug)]
pub struct Ranked<A> {
    /// The algorithm.
    pub algorithm: A,
    /// The simulation.
    pub report: SimReport,
}

/// Every algorithm of a family for one problem, fastest first, with the overlap verdict.
#[derive(Clone, Debug)]
pub struct Ranking<A> {
    /// Candidates, fastest first (the baseline first among equals).
    pub ranked: Vec<Ranked<A>>,
    /// Whether overlapping pays: the winner is not the baseline and at least
    /// [`MEANINGFUL_GAIN`] faster.
    pub overlap_pays: bool,
    /// Why, in words.
    pub reason: String,
}

/// The linear layers' ranking.
pub type RankingLinear = Ranking<LinearAlgorithm>;

/// The MoE ops' ranking.
pub type RankingMoe = Ranking<MoeAlgorithm>;

/// An MoE algorithm (the 1D ring family's names: baseline, ring, ring_chunked).
pub type MoeAlgorithm = Algorithm;

/// Simulates the plan of every candidate on `profile` and ranks them, fastest first and
/// the baseline first among equals, with the overlap verdict.
fn rank<A: Copy + PartialEq + fmt::Display>(
    problem: String,
    candidates: impl IntoIterator<Item = A>,
    baseline: A,
    build: impl Fn(A) -> Result<Plan, String>,
    profile: &Profile,
    engines: Engines,
    little_to_hide: &str,
) -> Result<Ranking<A>, TuneError> {
    let mut ranked = Vec::new();
    for algorithm in candidates {
        let plan = build(algorithm)
            .map_err(|e| TuneError::NoCandidate { problem: problem.clone(), reasons: format!("{algorithm}: {e}") })?;
        ranked.push(Ranked {
            algorithm,
            report: simulate(&plan, profile, &SimOptions { engines, ..SimOptions::default() })?,
        });
    }
    ranked.sort_by(|a, b| {
        a.report
            .makespan_s
            .total_cmp(&b.report.makespan_s)
            .then((a.algorithm != baseline).cmp(&(b.algorithm != baseline)))
    });
    let rows: Vec<_> = ranked.iter().map(|c| (c.algorithm.to_string(), c.algorithm == baseline, &c.report)).collect();
    let (overlap_pays, reason) = overlap_verdict(&rows, little_to_hide);
    Ok(Ranking { ranked, overlap_pays, reason })
}

/// The smallest gain (a fraction of the baseline's time) the verdict calls overlap paying:
/// below it, the difference is within what the profile's constants can tell apart.
pub const MEANINGFUL_GAIN: f64 = 0.02;

/// Simulates the baseline, Megatron's order and the ring decomposition of a linear
/// problem on `profile`, and says whether and why overlap pays.
pub fn tune_linear(problem: &LinearProblem, profile: &Profile, engines: Engines) -> Result<RankingLinear, TuneError> {
    rank(
        problem.describe(),
        LinearAlgorithm::ALL,
        LinearAlgorithm::Baseline,
        |a| build_linear_plan(problem, a).map_err(|e| e.to_string()),
        profile,
        engines,
        "the layer's collective (or its data dependencies) leaves little to hide it under",
    )
}

/// The overlap verdict over candidates ranked fastest first, each (name, whether it is
/// the baseline, its simulation): whether the winner beats the baseline by at least
/// [`MEANINGFUL_GAIN`], and why in words. `little_to_hide` says why a small gain is small.
fn overlap_verdict(ranked: &[(String, bool, &SimReport)], little_to_hide: &str) -> (bool, String) {
    let base = ranked.iter().find(|c| c.1).expect("the baseline is a candidate").2;
    let (win_name, win_is_base, win) = &ranked[0];
    let gain = 1.0 - win.makespan_s / base.makespan_s;
    let overlap_pays = !win_is_base && gain >= MEANINGFUL_GAIN;
    let reason = if overlap_pays {
        let exposed = |r: &SimReport| r.max_exposed_comm_s();
        format!(
            "{win_name} wins: {} against the baseline's {} ({:.2}×); the baseline exposes {} of communication beyond its \
             compute, {win_name} exposes {}; the compute floor is {} and the busiest link needs {}",
            us(win.makespan_s),
            us(base.makespan_s),
            base.makespan_s / win.makespan_s,
            us(exposed(base)),
            us(exposed(win)),
            us(win.compute_floor_s),
            us(win.comm_floor_s),
        )
    } else if !win_is_base {
        format!(
            "no overlap worth having: {win_name} is only {:.1} % faster than the baseline ({} vs {}); the baseline \
             exposes {} of communication, and {little_to_hide}",
            100.0 * gain,
            us(win.makespan_s),
            us(base.makespan_s),
            us(base.max_exposed_comm_s())
        )
    } else {
        let (best_name, _, best) = ranked.iter().find(|c| !c.1).expect("an overlapped candidate");
        format!(
            "the baseline wins: it exposes only {} of communication, and the best overlapped plan ({best_name}) is {} \
             slower (its extra launches and synchronisations cost more than they hide)",
            us(base.max_exposed_comm_s()),
            us(best.makespan_s - base.makespan_s)
        )
    };
    (overlap_pays, reason)
}

/// Simulates the baseline, the ring and the chunked ring (2, 4 and 8 chunks where they
/// divide a device's tokens) of an MoE problem on `profile`, grouped GEMMs priced from
/// the problem's routing ([`super::engine::SIM_ROUTING_SEED`]), and says whether and
/// why overlap pays.
pub fn tune_moe(problem: &MoeProblem, profile: &Profile, engines: Engines) -> Result<RankingMoe, TuneError> {
    let chunked = [2, 4, 8].into_iter().filter(|&c| c <= problem.token_split().min());
    rank(
        problem.describe(),
        [Algorithm::Baseline, Algorithm::Ring]
            .into_iter()
            .chain(chunked.map(|chunks| Algorithm::RingChunked { chunks })),
        Algorithm::Baseline,
        |a| build_moe_plan(problem, a).map_err(|e| e.to_string()),
        profile,
        engines,
        "the grouped GEMMs leave little to hide it under",
    )
}

/// One simulated attention plan.
#[derive(Clone, Debug)]
pub struct RankedAttention {
    /// The layout of the simulated problem.
    pub layout: Layout,
    /// The algorithm.
    pub algorithm: AttentionAlgorithm,
    /// The simulation.
    pub report: SimReport,
    /// Per device, the busy time of the lane that attends (its compute).
    pub compute_s: Vec<f64>,
}

impl RankedAttention {
    /// The busiest device's compute over the least busy one's.
    pub fn imbalance(&self) -> f64 {
        let max = self.compute_s.iter().copied().fold(0.0, f64::max);
        let min = self.compute_s.iter().copied().fold(f64::INFINITY, f64::min);
        max / min.max(1e-30)
    }
}

/// Every attention algorithm (and, for causal prefill, both layouts), fastest first,
/// with the verdicts on overlap and on the layout.
#[derive(Clone, Debug)]
pub struct RankingAttention {
    /// Candidates, fastest first (the baseline first among equals).
    pub ranked: Vec<RankedAttention>,
    /// Whether overlapping pays in the winner's layout.
    pub overlap_pays: bool,
    /// Why, in words: overlap, then the layout.
    pub reason: String,
}

/// Simulates every attention algorithm that plans `problem`'s mode on `profile`; a causal
/// prefill is also simulated in the other layout, to show the contiguous layout's
/// imbalance against the balanced one.
pub fn tune_attention(
    problem: &AttentionProblem,
    profile: &Profile,
    engines: Engines,
) -> Result<RankingAttention, TuneError> {
    let layouts = if problem.causal && problem.queries.is_none() {
        vec![Layout::Contiguous, Layout::Balanced]
    } else {
        vec![problem.layout]
    };
    let mut ranked = Vec::new();
    let mut reasons = Vec::new();
    for layout in layouts {
        let p = match AttentionProblem::new(
            problem.devices,
            problem.seq,
            problem.heads,
            problem.kv_heads,
            problem.head_dim,
            problem.causal,
            layout,
            problem.queries,
            problem.dtype,
        ) {
            Ok(p) => p,
            Err(e) => {
                reasons.push(format!("{layout}: {e}"));
                continue;
            }
        };
        for algorithm in AttentionAlgorithm::ALL.into_iter().filter(|a| a.plans(&p)) {
            let plan = build_attention_plan(&p, algorithm)
                .map_err(|e| TuneError::NoCandidate { problem: p.describe(), reasons: format!("{algorithm}: {e}") })?;
            let report = simulate(&plan, profile, &SimOptions { engines, ..SimOptions::default() })?;
            let lane = plan.lanes.iter().position(|l| l == "compute" || l == "main").unwrap_or(0);
            let compute_s = report.lane_busy_s.iter().map(|lanes| lanes[lane]).collect();
            ranked.push(RankedAttention { layout, algorithm, report, compute_s });
        }
    }
    if ranked.is_empty() {
        return Err(TuneError::NoCandidate { problem: problem.describe(), reasons: reasons.join("; ") });
    }
    ranked.sort_by(|a, b| {
        a.report
            .makespan_s
            .total_cmp(&b.report.makespan_s)
            .then((a.algorithm != AttentionAlgorithm::Baseline).cmp(&(b.algorithm != AttentionAlgorithm::Baseline)))
    });
    let win = &ranked[0];
    let base = ranked
        .iter()
        .find(|c| c.layout == win.layout && c.algorithm == AttentionAlgorithm::Baseline)
        .expect("the baseline plans every mode");
    let gain = 1.0 - win.report.makespan_s / base.report.makespan_s;
    let overlap_pays = win.algorithm != AttentionAlgorithm::Baseline && gain >= MEANINGFUL_GAIN;
    let mut reason = if overlap_pays {
        format!(
            "{} wins in the {} layout: {} against the baseline's {} ({:.2}×); the baseline exposes {} of K/V traffic, {} exposes {}",
            win.algorithm,
            win.layout,
            us(win.report.makespan_s),
            us(base.report.makespan_s),
            base.report.makespan_s / win.report.makespan_s,
            us(base.report.max_exposed_comm_s()),
            win.algorithm,
            us(win.report.max_exposed_comm_s())
        )
    } else {
        format!(
            "no overlap worth having in the {} layout: {} takes {} against the baseline's {}",
            win.layout,
            win.algorithm,
            us(win.report.makespan_s),
            us(base.report.makespan_s)
        )
    };
    let best_in = |layout| ranked.iter().find(|c| c.layout == layout);
    if let (Some(naive), Some(balanced)) = (best_in(Layout::Contiguous), best_in(Layout::Balanced)) {
        let compute = |c: &RankedAttention| c.compute_s.iter().copied().fold(0.0, f64::max);
        reason += &format!(
            "; with the causal mask the contiguous layout's busiest device attends {} against {} balanced \
             (compute max/min across devices {:.1} vs {:.2}), so the best balanced plan ({}) takes {} against {} \
             for the best contiguous one ({}), {:.2}×",
            us(compute(naive)),
            us(compute(balanced)),
            naive.imbalance(),
            balanced.imbalance(),
            balanced.algorithm,
            us(balanced.report.makespan_s),
            us(naive.report.makespan_s),
            naive.algorithm,
            naive.report.makespan_s / balanced.report.makespan_s
        );
    }
    Ok(RankingAttention { ranked, overlap_pays, reason })
}

#[cfg(test)]
mod attention_tests {
    use super::*;

    #[test]
    fn the_balanced_layout_beats_the_contiguous_one_on_a_long_causal_context() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let p = AttentionProblem::new(8, 128 * 1024, 32, 8, 128, true, Layout::Contiguous, None, DType::Bf16).unwrap();
        let r = tune_attention(&p, &profile, Engines::AsBuilt).unwrap();
        let best = |layout| r.ranked.iter().find(|c| c.layout == layout).unwrap();
        let (naive, balanced) = (best(Layout::Contiguous), best(Layout::Balanced));
        assert_eq!(r.ranked[0].layout, Layout::Balanced, "{}", r.reason);
        assert!(naive.report.makespan_s > 1.5 * balanced.report.makespan_s, "{}", r.reason);
        assert!(naive.imbalance() > 4.0 && balanced.imbalance() < 1.2, "{}", r.reason);
        assert!(r.reason.contains("balanced"), "{}", r.reason);
    }
}
