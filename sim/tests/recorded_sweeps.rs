//! The one-GPU profiles' Hopper-engine rates against every GEMM sweep recorded under
//! docs/gpu-runs: each plain GEMM the engine timed on either tile, priced by the profile of
//! the GPU that timed it. The rates were fitted to some of these rows and must keep
//! predicting all of them, so that a profile's constants move only with measurements (the
//! H100 profiles carried the H200's rates until 2026-11-28, and ran 6 % fast on average
//! against the H100's own sweep).

use cmm_core::engines::{Engine, HopperTile};
use cmm_core::DType;
use serde::Deserialize;

#[derive(Deserialize)]
struct Sweep {
    gpu: String,
    rows: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    shape: String,
    input: String,
    engine: String,
    us: Option<f64>,
}

/// The profile that prices a recorded GPU's runs.
fn profile_of(gpu: &str) -> Option<&'static str> {
    if gpu.contains("H100") {
        Some("h100-one-gpu")
    } else if gpu.contains("H200") {
        Some("h200-one-gpu")
    } else {
        None
    }
}

/// (file, profile, model ÷ measured − 1) of every plain engine row of every recorded sweep.
fn errors() -> Vec<(String, &'static str, f64)> {
    let runs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/gpu-runs");
    let mut out = Vec::new();
    for day in std::fs::read_dir(&runs).unwrap() {
        let day = day.unwrap().path();
        if !day.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(day).unwrap() {
            let path = file.unwrap().path();
            if !path.to_string_lossy().ends_with("gemm-sweep.json") {
                continue;
            }
            let sweep: Sweep = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let name =
                profile_of(&sweep.gpu).unwrap_or_else(|| panic!("{}: no profile for {}", path.display(), sweep.gpu));
            let profile = cmm_sim::Profile::load(name).unwrap();
            for r in &sweep.rows {
                let tile = match r.engine.as_str() {
                    "hopper 128x256" => HopperTile::Wide,
                    "hopper 128x128" => HopperTile::Narrow,
                    _ => continue,
                };
                let dims: Vec<usize> = r.shape.split('x').map(|d| d.parse().unwrap()).collect();
                let (Some(us), &[m, n, k]) = (r.us, &dims[..]) else { continue };
                let input: DType = r.input.parse().unwrap();
                let cost = profile.gemm_cost_on(Engine::Hopper(tile), m, n, k, input, input, false);
                let at = format!("{}: {} {} {}", path.display(), r.shape, r.input, r.engine);
                out.push((at, name, cost.work_s * 1e6 / us - 1.0));
            }
        }
    }
    out
}

#[test]
fn every_hopper_profile_prices_its_gpus_recorded_engine_gemms_within_12_percent_and_unbiased() {
    let errors = errors();
    for name in ["h100-one-gpu", "h200-one-gpu"] {
        let of: Vec<&(String, &str, f64)> = errors.iter().filter(|e| e.1 == name).collect();
        // The H100's sweep (12 rows) and four H200 ones (48): none may be missing.
        assert!(of.len() >= 12, "{name}: {} rows", of.len());
        for (at, _, e) in &of {
            assert!(e.abs() <= 0.12, "{name} {at}: model {:+.1} %", 100.0 * e);
        }
        let mean = of.iter().map(|e| e.2).sum::<f64>() / of.len() as f64;
        assert!(mean.abs() <= 0.03, "{name}: the model is {:+.1} % off on average", 100.0 * mean);
    }
}
