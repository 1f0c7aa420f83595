//! Tidy checks of the corpus and the goldens: coverage (1D, mesh, attention), unique names,
//! every case valid, every golden present and used, sizes small enough for lavapipe.

mod common;

use std::collections::{BTreeSet, HashMap, HashSet};

use cmm_conformance::{Case, CaseAlgorithm, CaseProblem, Goldens, Topology};
use cmm_core::algorithms::algorithms_for;
use cmm_core::{
    AttentionAlgorithm, AttentionProblem, DType, Dataflow, Family, Layout, MeshAlgorithm, MoeOp, MoeProblem, OpKind,
    Routing,
};

const DEVICE_COUNTS: [usize; 5] = [1, 2, 3, 4, 8];

/// The meshes every mesh algorithm must run on (Cannon on the square ones).
const MESHES: [(usize, usize); 7] = [(1, 4), (4, 1), (2, 2), (2, 4), (4, 2), (3, 3), (4, 4)];

/// The 1D cases.
fn ring_cases() -> Vec<Case> {
    common::corpus().into_iter().filter(|c| c.ring_op().is_some()).collect()
}

/// The mesh cases.
fn mesh_cases() -> Vec<Case> {
    common::corpus().into_iter().filter(|c| matches!(c.topology, Topology::Mesh { .. })).collect()
}

/// Every algorithm variant each op must be tested with, as printed in reports.
fn required_algorithms(op: OpKind) -> Vec<String> {
    let mut names: Vec<String> = algorithms_for(op).iter().map(ToString::to_string).collect();
    if op == OpKind::AgGemm {
        names.push("ring_chunked(c=4)".into());
    }
    names
}

#[test]
fn corpus_is_large_and_names_are_unique() {
    let cases = common::corpus();
    assert!(ring_cases().len() >= 60, "only {} 1D cases", ring_cases().len());
    assert!(mesh_cases().len() >= 40, "only {} mesh cases", mesh_cases().len());
    let mut seen = HashSet::new();
    for c in &cases {
        assert!(seen.insert(c.name.as_str()), "duplicate case name {}", c.name);
    }
}

#[test]
fn every_algorithm_of_every_op_runs_at_every_device_count_and_family() {
    let cases = ring_cases();
    let mut devices: HashMap<(OpKind, String), BTreeSet<usize>> = HashMap::new();
    let mut families: HashMap<(OpKind, String), BTreeSet<&str>> = HashMap::new();
    for c in &cases {
        let Topology::Ring { op, devices: d, .. } = c.topology else { continue };
        let key = (op, c.algorithm_label());
        devices.entry(key.clone()).or_default().insert(d);
        families.entry(key).or_default().insert(c.family.name());
    }
    for op in OpKind::ALL {
        for algorithm in required_algorithms(op) {
            let key = (op, algorithm);
            let got = devices.get(&key).cloned().unwrap_or_default();
            for d in DEVICE_COUNTS {
                assert!(got.contains(&d), "{} {} has no case with D={d} (has {got:?})", key.0, key.1);
            }
            let fams = families.get(&key).cloned().unwrap_or_default();
            assert_eq!(fams.len(), 2, "{} {} covers only the families {fams:?}", key.0, key.1);
        }
    }
}

/// The hierarchical plans (whose node size must divide D, so they cannot run at every
/// device count), for each op: one node and several, nodes of one GPU and of several,
/// uneven shards, both families; for the reductions, sums of more than four terms (nodes
/// of 5) and partial sums in the input dtype.
#[test]
fn the_hierarchical_plans_run_at_several_node_sizes() {
    for op in OpKind::ALL {
        let mut shapes = BTreeSet::new();
        let (mut families, mut uneven, mut wires) = (BTreeSet::new(), false, BTreeSet::new());
        for c in ring_cases() {
            let Topology::Ring { op: case_op, devices, wire } = c.topology else { continue };
            if case_op != op || c.algorithm != "hierarchical" {
                continue;
            }
            let node = c.node.expect("hierarchical cases name their node size");
            shapes.insert((devices / node, node));
            families.insert(c.family.name());
            uneven |= c.m % devices != 0;
            wires.insert(wire.is_some());
        }
        let nodes: BTreeSet<usize> = shapes.iter().map(|s| s.0).collect();
        let sizes: BTreeSet<usize> = shapes.iter().map(|s| s.1).collect();
        assert!(nodes.contains(&1) && nodes.iter().filter(|&&n| n > 1).count() >= 2, "{op}: nodes {nodes:?}");
        assert!(sizes.contains(&1) && sizes.iter().filter(|&&n| n > 2).count() >= 2, "{op}: node sizes {sizes:?}");
        assert!(uneven && families.len() == 2, "{op}: uneven {uneven}, families {families:?}");
        if op != OpKind::AgGemm {
            assert!(sizes.iter().any(|&n| n > 4) && wires.len() == 2, "{op}: node sizes {sizes:?}, wires {wires:?}");
        }
    }
}

/// Uneven shards (M not a multiple of D): every algorithm of every 1D op has a case, in
/// both families, and a chunked algorithm one whose chunks do not divide every block.
#[test]
fn every_algorithm_of_every_op_runs_on_uneven_shards() {
    let mut families: HashMap<(OpKind, &str), BTreeSet<&str>> = HashMap::new();
    let mut ragged_chunks: HashSet<(OpKind, &str)> = HashSet::new();
    let cases = ring_cases();
    for c in &cases {
        let Topology::Ring { op, devices: d, .. } = c.topology else { continue };
        if c.m % d == 0 {
            continue;
        }
        let Ok(CaseAlgorithm::Ring(algorithm)) = c.algorithm() else { panic!("{}: not a valid 1D case", c.name) };
        families.entry((op, algorithm.name())).or_default().insert(c.family.name());
        let chunks = c.chunks.unwrap_or(1);
        if (0..d).any(|r| (c.m / d + usize::from(r < c.m % d)) % chunks != 0) {
            ragged_chunks.insert((op, algorithm.name()));
        }
    }
    for op in OpKind::ALL {
        for algorithm in algorithms_for(op) {
            let got = families.get(&(op, algorithm.name())).cloned().unwrap_or_default();
            assert!(!got.is_empty(), "{op} {} has no case with M not a multiple of D", algorithm.name());
            if matches!(algorithm.name(), "ring_chunked" | "fused" | "ring_accumulate" | "fused_push") {
                assert!(ragged_chunks.contains(&(op, algorithm.name())), "{op} {}: no ragged chunks", algorithm.name());
            }
        }
        let all: BTreeSet<&str> = families.iter().filter(|(k, _)| k.0 == op).flat_map(|(_, f)| f.clone()).collect();
        assert_eq!(all.len(), 2, "{op}'s uneven cases cover only the families {all:?}");
    }
}

#[test]
fn every_dtype_pair_runs_in_both_families_and_shapes_are_not_all_square() {
    let cases = ring_cases();
    let combos: HashSet<(DType, DType, Family)> = cases.iter().map(|c| (c.input, c.output, c.family)).collect();
    for input in [DType::F32, DType::F16, DType::Bf16] {
        for output in [DType::F32, input] {
            for family in [Family::Exact, Family::Realistic] {
                assert!(combos.contains(&(input, output, family)), "no {input}->{output} {family} case");
            }
        }
    }
    assert!(cases.iter().filter(|c| c.m != c.n || c.n != c.k).count() > cases.len() / 2);
    assert!(cases.iter().any(|c| c.k >= 512), "no case exercises a long K");
    assert!(cases.iter().any(|c| c.devices() % 2 == 1 && c.devices() > 1), "no odd D > 1");
}

/// Whether `algorithm` can run on an nr×nc mesh at all (Cannon needs a square one).
fn valid_on(algorithm: &str, (nr, nc): (usize, usize)) -> bool {
    algorithm != "cannon" || nr == nc
}

#[test]
fn every_valid_mesh_algorithm_dataflow_and_mesh_combination_runs() {
    let present: HashSet<(String, Dataflow, (usize, usize))> = mesh_cases()
        .iter()
        .filter_map(|c| match c.topology {
            Topology::Mesh { nr, nc, dataflow, .. } => Some((c.algorithm.clone(), dataflow, (nr, nc))),
            _ => None,
        })
        .collect();
    let mut missing = Vec::new();
    for algorithm in MeshAlgorithm::NAMES {
        for dataflow in Dataflow::ALL {
            for mesh in MESHES {
                if valid_on(algorithm, mesh) && !present.contains(&(algorithm.to_string(), dataflow, mesh)) {
                    missing.push(format!("{algorithm} {dataflow} {}x{}", mesh.0, mesh.1));
                }
            }
        }
    }
    assert!(missing.is_empty(), "mesh combinations without a case: {missing:?}");
    // And every mesh case is on a valid combination (an invalid one could never pass).
    for (algorithm, _, mesh) in &present {
        assert!(valid_on(algorithm, *mesh), "{algorithm} on {mesh:?}");
    }
}

#[test]
fn mesh_cases_cover_families_dtypes_slicings_and_non_square_shapes() {
    let cases = mesh_cases();
    for algorithm in MeshAlgorithm::NAMES {
        let families: BTreeSet<&str> =
            cases.iter().filter(|c| c.algorithm == algorithm).map(|c| c.family.name()).collect();
        assert_eq!(families.len(), 2, "{algorithm} covers only the families {families:?}");
    }
    for dataflow in Dataflow::ALL {
        let of = |c: &&Case| matches!(c.topology, Topology::Mesh { dataflow: d, .. } if d == dataflow);
        let inputs: HashSet<DType> = cases.iter().filter(of).map(|c| c.input).collect();
        assert!(inputs.contains(&DType::F32) && inputs.contains(&DType::Bf16), "{dataflow}: inputs {inputs:?}");
        assert!(cases.iter().filter(of).any(|c| c.output != DType::F32), "{dataflow}: no rounded output");
    }
    let slicings: BTreeSet<(usize, usize)> = cases
        .iter()
        .filter_map(|c| match c.algorithm() {
            Ok(CaseAlgorithm::Mesh(MeshAlgorithm::MeshSlice { slices, block })) => Some((slices, block)),
            _ => None,
        })
        .collect();
    // Every LS and RS algorithm once with its partial sums on a narrow wire.
    for dataflow in [Dataflow::Ls, Dataflow::Rs] {
        for algorithm in MeshAlgorithm::NAMES {
            let narrow = |c: &&Case| {
                c.algorithm == algorithm
                    && matches!(c.topology, Topology::Mesh { dataflow: d, wire: Some(w), .. } if d == dataflow && w != DType::F32)
            };
            assert!(cases.iter().any(|c| narrow(&c)), "{algorithm} {dataflow}: no case with a narrow wire");
        }
    }
    assert!(slicings.len() >= 5, "only the slicings {slicings:?}");
    assert!(slicings.iter().any(|&(s, _)| s >= 3), "no MeshSlice with S >= 3: {slicings:?}");
    assert!(slicings.iter().any(|&(_, b)| b >= 2), "no MeshSlice with B >= 2: {slicings:?}");
    assert!(cases.iter().all(|c| c.m != c.n || c.n != c.k), "a mesh case is square");
}

/// The attention cases, as the problems they describe.
fn attention_cases() -> Vec<(Case, AttentionProblem)> {
    common::corpus()
        .into_iter()
        .filter_map(|c| match c.problem() {
            Ok(CaseProblem::Attention(p)) => Some((c, p)),
            _ => None,
        })
        .collect()
}

#[test]
fn attention_cases_cover_masks_layouts_algorithms_heads_and_dtypes() {
    let cases = attention_cases();
    assert!(cases.len() >= 24, "only {} attention cases", cases.len());
    assert!(cases.iter().all(|(c, _)| c.name.starts_with("attn_")));
    let has = |f: &dyn Fn(&AttentionProblem) -> bool| cases.iter().any(|(_, p)| f(p));
    for causal in [false, true] {
        assert!(has(&|p| p.causal == causal && p.queries.is_none()), "no prefill with causal = {causal}");
        assert!(has(&|p| p.causal == causal && p.queries.is_some()), "no decode with causal = {causal}");
    }
    assert!(has(&|p| p.causal && p.layout == Layout::Balanced), "no balanced causal prefill");
    for d in [2, 4, 8] {
        assert!(has(&|p| p.devices == d), "no attention case with D={d}");
    }
    assert!(has(&|p| p.kv_heads == p.heads) && has(&|p| p.kv_heads < p.heads), "MHA and GQA");
    for dh in [64, 128] {
        assert!(has(&|p| p.head_dim == dh), "no head dimension {dh}");
    }
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        assert!(has(&|p| p.dtype == dtype), "no {dtype} attention case");
    }
    assert!(has(&|p| p.queries.is_some() && p.seq % p.devices != 0), "no ragged split-KV decode");
    assert!(has(&|p| p.queries.is_none() && (p.seq / p.devices) % 16 != 0), "every shard a whole number of key tiles");
    // Uneven prefill: every prefill algorithm in each layout, and a balanced case whose
    // later devices hold more rows than device 0.
    for layout in [Layout::Contiguous, Layout::Balanced] {
        let chunks = |p: &AttentionProblem| if p.layout == Layout::Balanced { 2 * p.devices } else { p.devices };
        for a in [AttentionAlgorithm::Baseline, AttentionAlgorithm::Ring, AttentionAlgorithm::RingBidir] {
            let uneven = cases.iter().any(|(c, p)| {
                p.queries.is_none() && p.layout == layout && p.seq % chunks(p) != 0 && c.algorithm == a.name()
            });
            assert!(uneven, "no {a} prefill case with uneven {layout} chunks");
        }
    }
    assert!(has(&|p| p.queries.is_none() && p.out_rows_on(p.devices - 1) > p.out_rows_on(0)), "no later device longer");
    let algorithms: BTreeSet<String> = cases.iter().map(|(c, _)| c.algorithm.clone()).collect();
    for a in AttentionAlgorithm::ALL {
        assert!(algorithms.contains(a.name()), "no {a} case");
    }
}

/// The MoE cases, as the problems they describe.
fn moe_cases() -> Vec<(Case, MoeProblem)> {
    common::corpus()
        .into_iter()
        .filter_map(|c| match c.problem() {
            Ok(CaseProblem::Moe(p)) => Some((c, p)),
            _ => None,
        })
        .collect()
}

#[test]
fn moe_cases_cover_ops_algorithms_devices_experts_slots_routings_dtypes_and_families() {
    let cases = moe_cases();
    assert!(cases.len() >= 30, "only {} MoE cases", cases.len());
    assert!(cases.iter().all(|(c, _)| c.name.starts_with("moe_")));
    let has = |f: &dyn Fn(&Case, &MoeProblem) -> bool| cases.iter().any(|(c, p)| f(c, p));
    for op in [MoeOp::AgMoe, MoeOp::MoeRs] {
        for algorithm in ["baseline", "ring", "ring_chunked"] {
            assert!(has(&|c, p| p.op == op && c.algorithm == algorithm), "no {op} {algorithm} case");
        }
        for routing in Routing::ALL {
            assert!(has(&|_, p| p.op == op && p.routing == routing), "no {op} case with {routing} routing");
        }
        for family in [Family::Exact, Family::Realistic] {
            assert!(has(&|c, p| p.op == op && c.family == family), "no {op} case in the {family} family");
        }
    }
    for d in [2, 4, 8] {
        assert!(has(&|_, p| p.devices == d), "no MoE case with D={d}");
    }
    for k in [1, 2, 4, 8] {
        assert!(has(&|_, p| p.slots == k), "no MoE case with k={k}");
    }
    assert!(has(&|_, p| p.experts == 4) && has(&|_, p| p.experts == 64), "E from 4 to 64");
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        assert!(has(&|_, p| p.input == dtype), "no {dtype} MoE case");
    }
    // Uneven token shards under every algorithm of both ops, one with ragged chunks.
    for op in [MoeOp::AgMoe, MoeOp::MoeRs] {
        for algorithm in ["baseline", "ring", "ring_chunked"] {
            let uneven = |c: &Case, p: &MoeProblem| p.op == op && c.algorithm == algorithm && p.tokens % p.devices != 0;
            assert!(has(&uneven), "no {op} {algorithm} case with T not a multiple of D");
        }
    }
    let ragged = |c: &Case, p: &MoeProblem| {
        let chunks = c.chunks.unwrap_or(1);
        p.token_split().lens().iter().any(|t| t % chunks != 0)
    };
    assert!(has(&ragged), "no MoE case whose chunks do not divide a device's tokens");
    // Per-expert row counts that are not multiples of any tile size.
    assert!(
        has(&|c, p| p.tables(c.seed, 1).seg.windows(2).any(|w| (w[1] - w[0]) % 8 != 0)),
        "every expert's rows are a multiple of 8"
    );
}

#[test]
fn every_case_builds_a_plan() {
    for c in common::corpus() {
        c.plan().unwrap_or_else(|e| panic!("{}: {e}", c.name));
    }
}

/// Sizes stay small: lavapipe runs WGSL at a few GFLOP/s, and the whole corpus must run
/// in well under three minutes there.
#[test]
fn cases_are_small() {
    let cases = common::corpus();
    let mut flops = 0.0;
    for c in &cases {
        assert!(c.m <= 256 && c.n <= 256 && c.k <= 1024, "{} is too large", c.name);
        flops += 2.0 * (c.m * c.n * c.k) as f64;
    }
    assert!(flops < 0.5e9, "the corpus does {flops:.3e} flops");
}

#[test]
fn every_case_has_a_golden_and_every_golden_a_case() {
    let dir = Goldens::default_dir();
    let names: BTreeSet<String> = common::corpus().into_iter().map(|c| c.name).collect();
    let mut files = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        assert_eq!(path.extension().and_then(|e| e.to_str()), Some("bin"), "stray file {}", path.display());
        assert!(names.contains(&stem), "golden {} belongs to no case: delete it", path.display());
        files.insert(stem);
    }
    let missing: Vec<&String> = names.difference(&files).collect();
    assert!(missing.is_empty(), "cases without a golden (run `cargo xtask conformance --bless`): {missing:?}");
}
