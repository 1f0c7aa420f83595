//! Inputs the fuzzer (`cargo xtask fuzz`) once found a panic or a hang on, kept under
//! `conformance/fuzz/<target>/`: each must now return quietly.

use cmm_conformance::fuzz::TARGETS;

#[test]
fn every_input_the_fuzzer_found_is_handled() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut inputs = 0;
    for (name, target) in TARGETS {
        let Ok(entries) = std::fs::read_dir(root.join(name)) else { continue };
        for entry in entries {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| target(&bytes));
            assert!(outcome.is_ok(), "{name}: {} panics", path.display());
            inputs += 1;
        }
    }
    assert!(inputs > 0, "no regression input under {}", root.display());
}
