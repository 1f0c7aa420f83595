//! The conformance checks on the wgpu reference, when an adapter exists (a GPU, or Mesa
//! lavapipe: `apt-get install mesa-vulkan-drivers`). Without one each test prints why
//! it skips, except under CI (the `CI` environment variable is set), where `.ci/run`
//! installs lavapipe and a missing adapter is a failure.

mod common;

use cmm_reference::Reference;

fn reference() -> Option<Reference> {
    match Reference::new() {
        Ok(r) => Some(r),
        Err(e) if std::env::var_os("CI").is_some() => panic!("CI is set but no wgpu adapter exists: {e}"),
        Err(e) => {
            eprintln!("skipped: no wgpu adapter: {e}");
            None
        }
    }
}

#[test]
fn corpus_passes() {
    if let Some(r) = reference() {
        common::corpus_passes(&r);
    }
}

#[test]
fn baselines_pass_with_their_sums_beside() {
    if let Some(r) = reference() {
        common::baselines_pass_with_their_sums_beside(&r);
    }
}

#[test]
fn ring_plan_passes() {
    if let Some(r) = reference() {
        common::ring_plan_passes(&r);
    }
}

#[test]
fn reversed_ring_fails() {
    if let Some(r) = reference() {
        common::reversed_ring_fails(&r);
    }
}

#[test]
fn wrong_slot_fails() {
    if let Some(r) = reference() {
        common::wrong_slot_fails(&r);
    }
}

#[test]
fn missing_signal_deadlocks() {
    if let Some(r) = reference() {
        common::missing_signal_deadlocks(&r);
    }
}

#[test]
fn schedule_dependent_output_is_found() {
    if let Some(r) = reference() {
        common::schedule_dependent_output_is_found(&r);
    }
}

#[test]
fn mutants_of_a_ring_plan_are_caught() {
    if let Some(r) = reference() {
        common::mutants_of_a_ring_plan_are_caught(&r);
    }
}

#[test]
fn mutants_of_a_mesh_plan_are_caught() {
    if let Some(r) = reference() {
        common::mutants_of_a_mesh_plan_are_caught(&r);
    }
}
