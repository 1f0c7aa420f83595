//! The conformance checks on the CPU twin (fast, no GPU).

mod common;

use cmm_conformance::CpuTwin;

#[test]
fn corpus_passes() {
    common::corpus_passes(&CpuTwin);
}

#[test]
fn ring_plan_passes() {
    common::ring_plan_passes(&CpuTwin);
}

#[test]
fn reversed_ring_fails() {
    common::reversed_ring_fails(&CpuTwin);
}

#[test]
fn wrong_slot_fails() {
    common::wrong_slot_fails(&CpuTwin);
}

#[test]
fn missing_signal_deadlocks() {
    common::missing_signal_deadlocks(&CpuTwin);
}

#[test]
fn schedule_dependent_output_is_found() {
    common::schedule_dependent_output_is_found(&CpuTwin);
}

#[test]
fn mutants_of_a_ring_plan_are_caught() {
    common::mutants_of_a_ring_plan_are_caught(&CpuTwin);
}

#[test]
fn mutants_of_a_mesh_plan_are_caught() {
    common::mutants_of_a_mesh_plan_are_caught(&CpuTwin);
}
