//! Tidy checks of the corpus and the goldens: coverage, unique names, every case valid,
//! every golden present and used, sizes small enough for lavapipe.

mod common;

use std::collections::{BTreeSet, HashMap, HashSet};

use cmm_conformance::Goldens;
use cmm_core::algorithms::algorithms_for;
use cmm_core::{build_plan, DType, Family, OpKind};

const DEVICE_COUNTS: [usize; 5] = [1, 2, 3, 4, 8];

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
    assert!(cases.len() >= 60, "only {} cases", cases.len());
    let mut seen = HashSet::new();
    for c in &cases {
        assert!(seen.insert(c.name.as_str()), "duplicate case name {}", c.name);
    }
}

#[test]
fn every_algorithm_of_every_op_runs_at_every_device_count_and_family() {
    let cases = common::corpus();
    let mut devices: HashMap<(OpKind, String), BTreeSet<usize>> = HashMap::new();
    let mut families: HashMap<(OpKind, String), BTreeSet<&str>> = HashMap::new();
    for c in &cases {
        let key = (c.op, c.algorithm_label());
        devices.entry(key.clone()).or_default().insert(c.devices);
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

#[test]
fn every_dtype_pair_runs_in_both_families_and_shapes_are_not_all_square() {
    let cases = common::corpus();
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
    assert!(cases.iter().any(|c| c.devices % 2 == 1 && c.devices > 1), "no odd D > 1");
}

#[test]
fn every_case_builds_a_plan() {
    for c in common::corpus() {
        let problem = c.problem().unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let algorithm = c.algorithm().unwrap_or_else(|e| panic!("{}: {e}", c.name));
        build_plan(&problem, algorithm).unwrap_or_else(|e| panic!("{}: {e}", c.name));
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
