//! The runner end to end on the CPU twin: the report, the filter, bless, golden errors
//! and the export.

mod common;

use std::fs;
use std::path::PathBuf;

use cmm_conformance::golden::GoldenError;
use cmm_conformance::{
    run_case, run_corpus_to, ConformanceError, CpuTwin, Failure, GoldenStatus, Goldens, Options, MAX_CASE_ELEMENTS,
};
use cmm_core::DType;

/// A fresh directory under the system temp dir.
fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cmm-conformance-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(options: &Options) -> (cmm_conformance::Summary, String) {
    let mut out = Vec::new();
    let summary = run_corpus_to(&CpuTwin, options, &mut out).unwrap();
    (summary, String::from_utf8(out).unwrap())
}

#[test]
fn report_has_a_header_one_row_per_case_and_a_total() {
    let (summary, text) = run(&Options { filter: Some("_d3_".into()), ..Options::default() });
    let lines: Vec<&str> = text.lines().collect();
    let selected = common::corpus().iter().filter(|c| c.name.contains("_d3_")).count();
    assert!(selected > 3);
    assert_eq!((summary.passed, summary.failed), (selected, 0));
    assert_eq!(lines.len(), selected + 2, "{text}");
    assert!(lines[0].starts_with("case ") && lines[0].contains("max err"), "{text}");
    assert_eq!(*lines.last().unwrap(), format!("{selected} passed, 0 failed"));
    // Aligned: the op column starts at the same place on every row.
    let at = lines[0].find("op").unwrap();
    for row in &lines[1..=selected] {
        assert!(["ag_gemm", "gemm_", "attn", "ag_moe", "moe_rs"].iter().any(|op| row[at..].starts_with(op)), "{row}");
        assert!(row.contains(" ok "), "{row}");
    }
}

#[test]
fn a_filter_of_comma_separated_parts_runs_the_cases_of_each() {
    let (summary, text) = run(&Options { filter: Some("ring_d2_,ring_push_d2_".into()), ..Options::default() });
    let selected =
        common::corpus().iter().filter(|c| c.name.contains("ring_d2_") || c.name.contains("ring_push_d2_")).count();
    assert_eq!((summary.passed, summary.failed), (selected, 0));
    assert!(text.contains("gemm_rs_ring_push_d2_") && text.contains("ag_gemm_ring_d2_"), "{text}");
    assert!(!cmm_conformance::name_matches("ring_d3_,ring_push_d3_", "ag_gemm_ring_d2_f16_f16_exact"));
    // `!part` leaves out what it names, from the parts or (alone) from the whole corpus.
    let matches = cmm_conformance::name_matches;
    assert!(matches("ring_push,!_d3_", "gemm_rs_ring_push_d2_bf16_bf16_realistic"));
    assert!(!matches("ring_push,!_d3_", "gemm_rs_ring_push_d3_f32_f32_exact"));
    assert!(matches("!fused_push", "ag_gemm_ring_d2_f16_f16_exact"));
    assert!(!matches("!fused_push", "gemm_rs_fused_push_d3_f32_f32_exact"));
}

#[test]
fn input_dtypes_select_cases_beside_the_filter() {
    let options =
        Options { filter: Some("fused_d".into()), inputs: vec![DType::F16, DType::Bf16], ..Options::default() };
    let (summary, text) = run(&options);
    let selected: Vec<_> = common::corpus()
        .into_iter()
        .filter(|c| c.name.contains("fused_d") && matches!(c.input, DType::F16 | DType::Bf16))
        .collect();
    assert!(
        !selected.is_empty() && selected.len() < common::corpus().iter().filter(|c| c.name.contains("fused_d")).count()
    );
    assert_eq!((summary.passed, summary.failed), (selected.len(), 0));
    assert!(!text.contains("f32->"), "an f32-input case ran: {text}");
    let mut out = Vec::new();
    let none = Options { filter: Some("fused_d1_".into()), inputs: vec![DType::Bf16], ..Options::default() };
    let e = run_corpus_to(&CpuTwin, &none, &mut out).unwrap_err();
    assert!(matches!(e, ConformanceError::NoCases { .. }), "{e}");
    assert!(e.to_string().contains("with an input of bf16"), "{e}");
}

#[test]
fn a_filter_matching_nothing_is_an_error() {
    let mut out = Vec::new();
    let e = run_corpus_to(&CpuTwin, &Options { filter: Some("no such case".into()), ..Options::default() }, &mut out);
    assert!(matches!(e, Err(ConformanceError::NoCases { .. })));
}

#[test]
fn bless_writes_then_checks_and_bad_goldens_fail() {
    let case = common::corpus().into_iter().find(|c| c.name.contains("gemm_rs_ring_d3")).unwrap();
    let dir = temp_dir("bless");
    let check = Goldens { dir: dir.clone(), bless: false };
    let bless = Goldens { dir: dir.clone(), bless: true };

    let r = run_case(&case, &CpuTwin, &check);
    assert!(!r.passed());
    assert!(matches!(r.failures[..], [Failure::GoldenMissing { .. }]), "{}", r.reason());
    assert!(r.reason().contains("cargo xtask conformance --bless"), "{}", r.reason());

    assert_eq!(run_case(&case, &CpuTwin, &bless).golden, GoldenStatus::Created);
    assert_eq!(run_case(&case, &CpuTwin, &bless).golden, GoldenStatus::Unchanged);
    let r = run_case(&case, &CpuTwin, &check);
    assert!(r.passed(), "{}", r.reason());
    // The blessed golden is the committed one, byte for byte.
    let path = check.path(&case);
    assert_eq!(fs::read(&path).unwrap(), fs::read(common::goldens().path(&case)).unwrap());

    // A flipped payload bit breaks the digest.
    let mut bytes = fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 0x10;
    fs::write(&path, &bytes).unwrap();
    let r = run_case(&case, &CpuTwin, &check);
    assert!(
        matches!(&r.failures[..], [Failure::GoldenInvalid { source: GoldenError::Digest { .. }, .. }]),
        "{}",
        r.reason()
    );

    // A golden of another seed is stale.
    let mut other = case.clone();
    other.seed += 1;
    assert_eq!(run_case(&other, &CpuTwin, &bless).golden, GoldenStatus::Updated);
    let r = run_case(&case, &CpuTwin, &check);
    assert!(
        matches!(&r.failures[..], [Failure::GoldenInvalid { source: GoldenError::Stale { key: "seed", .. }, .. }]),
        "{}",
        r.reason()
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_invalid_case_is_a_failed_row_not_a_panic() {
    let mut case = common::corpus().into_iter().find(|c| c.devices() == 3 && c.op_name() == "gemm_rs").unwrap();
    case.k += 1;
    let r = run_case(&case, &CpuTwin, &common::goldens());
    assert!(matches!(r.failures[..], [Failure::Problem(_)]), "{}", r.reason());
    assert!(r.reason().contains("not divisible by D=3"), "{}", r.reason());
    case.k -= 1;
    case.algorithm = "ring_sideways".into();
    let r = run_case(&case, &CpuTwin, &common::goldens());
    assert!(matches!(r.failures[..], [Failure::Algorithm(_)]), "{}", r.reason());
}

#[test]
fn a_case_too_large_for_the_host_fails_before_the_oracle_runs() {
    // 2 × (A 32768×64 + B 64×16384 + C 65536×16384) ≈ 2^31 elements: within the generator's
    // range, past what a check holds. The oracle alone would need 16 GiB.
    let mut case = common::case_named("ag_gemm_ring_d2_");
    (case.m, case.n, case.k) = (65536, 32768, 64);
    let r = run_case(&case, &CpuTwin, &common::goldens());
    let plan = case.plan().unwrap();
    let elements = plan.elements();
    assert!(elements > 1 << 31, "{elements}");
    assert!(
        matches!(r.failures[..], [Failure::TooLarge { elements: e, limit: MAX_CASE_ELEMENTS }] if e == elements),
        "{}",
        r.reason()
    );
    assert!(r.reason().contains(&format!("more than the {MAX_CASE_ELEMENTS}")), "{}", r.reason());
}

#[test]
fn export_writes_npy_files_and_an_index() {
    let dir = temp_dir("export");
    let (summary, text) =
        run(&Options { filter: Some("gemm_ar_ring_d2_".into()), export: Some(dir.clone()), ..Options::default() });
    assert_eq!(summary.passed, 1, "{text}");
    let case = common::case_named("gemm_ar_ring_d2_");
    let index: serde_json::Value = serde_json::from_str(&fs::read_to_string(dir.join("index.json")).unwrap()).unwrap();
    let entry = &index["cases"][0];
    assert_eq!((entry["case"].as_str(), entry["passed"].as_bool()), (Some(case.name.as_str()), Some(true)), "{index}");
    for d in 0..2 {
        let files = entry["devices"][d]["files"].as_array().unwrap();
        for (buffer, rows, cols, dtype) in [
            ("A", case.m, case.k / 2, case.input),
            ("B", case.k / 2, case.n, case.input),
            ("C", case.m, case.n, case.output),
        ] {
            let rel = format!("{}/d{d}_{buffer}.npy", case.name);
            let file = files.iter().find(|f| f["path"] == rel.as_str()).unwrap_or_else(|| panic!("{rel}\n{index}"));
            assert_eq!(file["shape"], serde_json::json!([rows, cols]), "{rel}");
            assert_eq!(file["dtype"], dtype.to_string(), "{rel}");
            let bytes = fs::read(dir.join(&rel)).unwrap();
            let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
            let width = if dtype == cmm_core::DType::F16 { 2 } else { 4 };
            assert_eq!(bytes.len(), 10 + header_len + rows * cols * width, "{rel}");
        }
        // Scratch buffers are not exported.
        assert!(files.iter().all(|f| f["role"] != "scratch" && f["buffer"] != "send"), "{index}");
    }
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stats_print_each_devices_traffic_beside_the_seed_formula() {
    let case = common::case_named("mesh_ls_collective_2x4_");
    let Ok(cmm_conformance::CaseProblem::Mesh(p)) = case.problem() else { panic!("{} is not a mesh case", case.name) };
    let (row, col) = p.analytic_traffic();
    let (summary, text) = run(&Options { filter: Some(case.name.clone()), stats: true, ..Options::default() });
    assert_eq!(summary.passed, 1, "{text}");
    let expected = format!(
        "  traffic sent, within mesh rows: {row} B on every device; within mesh columns: {col} B on every device; \
         seed 002 §2.3.1 (Nc−1)·size/(Nr·Nc): rows {row} B, columns {col} B"
    );
    assert!(text.lines().any(|l| l == expected), "{expected}\n{text}");
    // Cannon's skew makes the traffic uneven and larger: per-device lists.
    let (_, text) = run(&Options { filter: Some("mesh_os_cannon_3x3_".into()), stats: true, ..Options::default() });
    assert!(text.contains("within mesh rows: [") && text.contains("] B; within mesh columns: ["), "{text}");
    // 1D cases report one direction.
    let (_, text) = run(&Options { filter: Some("gemm_ar_ring_d2_".into()), stats: true, ..Options::default() });
    assert!(text.lines().any(|l| l.starts_with("  traffic sent: ") && l.ends_with("B on every device")), "{text}");
    // Without --stats there is no traffic line.
    let (_, text) = run(&Options { filter: Some(case.name.clone()), ..Options::default() });
    assert!(!text.contains("traffic"), "{text}");
}

#[test]
fn invalid_mesh_cases_are_failed_rows_with_typed_reasons() {
    use cmm_core::MeshError;
    let mut case = common::case_named("mesh_os_collective_2x4_");
    case.algorithm = "cannon".into();
    let r = run_case(&case, &CpuTwin, &common::goldens());
    assert!(matches!(r.failures[..], [Failure::Mesh(MeshError::NotSquare { nr: 2, nc: 4 })]), "{}", r.reason());
    assert!(r.reason().contains("2x4 is not square"), "{}", r.reason());
    case.algorithm = "meshslice".into();
    (case.slices, case.block) = (Some(5), Some(1));
    let r = run_case(&case, &CpuTwin, &common::goldens());
    assert!(matches!(r.failures[..], [Failure::Mesh(MeshError::SliceIndivisible { .. })]), "{}", r.reason());
    case.m += 1;
    let r = run_case(&case, &CpuTwin, &common::goldens());
    assert!(r.reason().contains("M=33 is not divisible by Nr=2"), "{}", r.reason());
}

#[test]
fn export_names_the_mesh_of_a_mesh_case() {
    let dir = temp_dir("export-mesh");
    let filter = "mesh_rs_wang_2x4_";
    let (summary, text) =
        run(&Options { filter: Some(filter.into()), export: Some(dir.clone()), ..Options::default() });
    assert_eq!(summary.passed, 1, "{text}");
    let index: serde_json::Value = serde_json::from_str(&fs::read_to_string(dir.join("index.json")).unwrap()).unwrap();
    let entry = &index["cases"][0];
    for (key, want) in [
        ("op", serde_json::json!("mesh_gemm")),
        ("algorithm", serde_json::json!("wang")),
        ("dataflow", serde_json::json!("rs")),
        ("nr", serde_json::json!(2)),
        ("nc", serde_json::json!(4)),
        ("slices", serde_json::Value::Null),
        ("block", serde_json::Value::Null),
        ("D", serde_json::json!(8)),
    ] {
        assert_eq!(entry[key], want, "{key} in {index}");
    }
    let case = common::case_named(filter);
    // RS: A is K×M, chip (i, j) holds (K/Nr)×(M/Nc) of it.
    let rel = format!("{}/d7_A.npy", case.name);
    let file = entry["devices"][7]["files"].as_array().unwrap().iter().find(|f| f["path"] == rel.as_str()).unwrap();
    assert_eq!(file["shape"], serde_json::json!([case.k / 2, case.m / 4]), "{index}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_data_directories_say_how_to_point_at_them() {
    let nowhere = std::env::temp_dir().join(format!("cmm-nowhere-{}", std::process::id()));
    let mut out = Vec::new();
    let e =
        run_corpus_to(&CpuTwin, &Options { cases_dir: nowhere.clone(), ..Options::default() }, &mut out).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("does not exist") && text.contains("--cases") && text.contains("CMM_CASES_DIR"), "{text}");
    let e =
        run_corpus_to(&CpuTwin, &Options { golden_dir: nowhere.clone(), ..Options::default() }, &mut out).unwrap_err();
    assert!(matches!(e, ConformanceError::MissingGoldens { .. }), "{e}");
    assert!(e.to_string().contains("--goldens") && e.to_string().contains("CMM_GOLDEN_DIR"), "{e}");
    // Blessing into a new directory is how goldens start, so it is not refused.
    let dir = temp_dir("fresh-goldens");
    let fresh = dir.join("golden");
    let options = Options {
        golden_dir: fresh.clone(),
        bless: true,
        filter: Some("ag_gemm_ring_d2".into()),
        ..Options::default()
    };
    let summary = run_corpus_to(&CpuTwin, &options, &mut out).unwrap();
    assert!(summary.passed > 0 && fresh.is_dir());
    let _ = fs::remove_dir_all(&dir);
}
