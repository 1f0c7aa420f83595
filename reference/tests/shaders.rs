//! Every WGSL stage parses and validates on its own, so that a shader error is reported
//! with its message and line here rather than as an invalid pipeline at run time.

use wgpu::naga;

#[test]
fn every_stage_parses_and_validates() {
    let mut failures = Vec::new();
    for (name, source) in cmm_reference::stage_sources() {
        let module = match naga::front::wgsl::parse_str(&source) {
            Ok(module) => module,
            Err(e) => {
                failures.push(format!("{name}: {}", e.emit_to_string(&source)));
                continue;
            }
        };
        let mut validator =
            naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all());
        if let Err(e) = validator.validate(&module) {
            failures.push(format!("{name}: {}", e.emit_to_string(&source)));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
