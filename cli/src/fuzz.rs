//! Fuzz entry points for the files users hand the simulator: a hardware profile (TOML,
//! `--profile FILE`) and a CUDA bench report (JSON, `--validate-bench FILE`). As
//! `cmm_conformance::fuzz`'s targets: any bytes in, an error or a result out, never a
//! panic or a hang; and a profile that passes its checks predicts a finite time for every
//! plan it can simulate. `cargo xtask fuzz` drives them beside those.

use std::sync::OnceLock;

use cmm_conformance::fuzz::Target;
use cmm_core::{build_plan, Algorithm, DType, OpKind, Plan, Problem};
use cmm_sim::{simulate, Profile, SimOptions};

/// Every target of this crate, by name.
pub const TARGETS: [Target; 2] = [("profile", profile), ("bench_report", bench_report)];

/// Bench rows past this many devices are read but not simulated: their plans (D² ops for
/// a ring) are bounded work, only slower, and a fuzzer wants many inputs a second.
const MAX_SIMULATED_DEVICES: u64 = 16;

/// Small plans of the kinds a profile prices differently: a ring of cuBLAS GEMMs and
/// copies, a ring that accumulates reduced partials, and a fused plan on the Hopper
/// engine (two devices, so that every topology holds them).
fn small_plans() -> &'static [Plan] {
    static PLANS: OnceLock<Vec<Plan>> = OnceLock::new();
    PLANS.get_or_init(|| {
        [
            (OpKind::AgGemm, Algorithm::Ring),
            (OpKind::GemmRs, Algorithm::RingAccumulate { chunks: 2 }),
            (OpKind::AgGemm, Algorithm::Fused { chunks: 1 }),
        ]
        .into_iter()
        .map(|(op, algorithm)| {
            let problem = Problem::new(op, 2, 256, 512, 384, DType::Bf16, DType::Bf16).expect("a valid problem");
            build_plan(&problem, algorithm).expect("a plan of a valid problem")
        })
        .collect()
    })
}

/// A profile file: parsed and checked, and where it passes, the small plans simulated on
/// it; a time that is not finite (a profile whose numbers overflow) is a finding.
pub fn profile(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(profile) = Profile::parse(text, "fuzz.toml") else { return };
    for plan in small_plans() {
        if let Ok(report) = simulate(plan, &profile, &SimOptions::default()) {
            let time = report.makespan_s;
            assert!(time.is_finite() && time >= 0.0, "{}: {time} s on a profile that passed its checks", plan.name);
        }
    }
}

/// A bench report: read, checked, set against the one-GPU profile as it stands and as
/// the report's calibration sets it, its tables written nowhere.
pub fn bench_report(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else { return };
    let rows = value.get("rows").and_then(|r| r.as_array()).map_or(&[][..], |r| r.as_slice());
    if rows.iter().any(|row| row.get("devices").and_then(|d| d.as_u64()).is_some_and(|d| d > MAX_SIMULATED_DEVICES)) {
        return;
    }
    let _ = crate::bench_file::validate_bench_to(&mut std::io::sink(), text, "fuzz.json");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every built-in profile passes the target (finite times for the small plans), and
    /// bytes that are no profile return quietly.
    #[test]
    fn every_builtin_profile_passes_and_a_profile_refused_returns_quietly() {
        for name in Profile::builtin_names() {
            let text = std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../sim/profiles/{name}.toml")),
            )
            .unwrap();
            profile(text.as_bytes());
        }
        profile(b"name = 3");
        profile(&[0xff, 0xfe]);
    }

    /// Inputs the fuzzer (`cargo xtask fuzz`) found a finding on, kept under
    /// `cli/fuzz/<target>/`: each must now return quietly.
    #[test]
    fn every_input_the_fuzzer_found_is_handled() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
        let inputs = cmm_conformance::fuzz::replay_regressions(&root, &TARGETS).unwrap();
        assert!(inputs > 0, "no regression input under {}", root.display());
    }
}
