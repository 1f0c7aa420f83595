//! Inputs the fuzzer (`cargo xtask fuzz`) once found a panic or a hang on, kept under
//! `conformance/fuzz/<target>/`: each must now return quietly.

use cmm_conformance::fuzz::{replay_regressions, TARGETS};

#[test]
fn every_input_the_fuzzer_found_is_handled() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let inputs = replay_regressions(&root, &TARGETS).unwrap();
    assert!(inputs > 0, "no regression input under {}", root.display());
}
