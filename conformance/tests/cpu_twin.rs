//! The conformance checks on the CPU twin (fast, no GPU).

mod common;

use cmm_conformance::mutants::{run_mutants, MutantOptions, Sites};
use cmm_conformance::{Backend, BackendError, CpuTwin};
use cmm_core::cpu::Memory;
use cmm_core::schedule::Order;
use cmm_core::{Family, Plan};

#[test]
fn corpus_passes() {
    common::corpus_passes(&CpuTwin);
}

#[test]
fn baselines_pass_with_their_sums_beside() {
    common::baselines_pass_with_their_sums_beside(&CpuTwin);
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

/// The CPU twin, run one plan at a time (no [`Backend::concurrent`]).
struct OneAtATime;

impl Backend for OneAtATime {
    fn name(&self) -> String {
        CpuTwin.name()
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, order: Order) -> Result<Memory, BackendError> {
        CpuTwin.run(plan, seed, family, order)
    }
}

/// Mutants run on every core report exactly what they report one case at a time: the
/// same counts, and the same lines in case order.
#[test]
fn mutants_report_the_same_on_threads_as_one_at_a_time() {
    let corpus = common::corpus();
    let cases: Vec<_> = ["ag_gemm_ring_d3_", "mesh_ls_meshslice_s4b1_2x2_", "moe_rs_ring_d2_", "attn_"]
        .iter()
        .map(|prefix| corpus.iter().find(|c| c.name.starts_with(prefix)).expect("the corpus has such a case").clone())
        .collect();
    let report = |backend: &dyn Backend| {
        let (mut out, mut heard) = (Vec::new(), Vec::new());
        let options = MutantOptions { verbose: true, ..MutantOptions::default() };
        let report =
            run_mutants(&cases, backend, &mut out, options, &mut |i, _, name| heard.push((i, name.to_string())))
                .expect("the report is written");
        heard.sort();
        (report.kinds, report.excluded, String::from_utf8(out).expect("UTF-8"), heard)
    };
    assert!(CpuTwin.concurrent().is_some() && OneAtATime.concurrent().is_none());
    let (threaded, serial) = (report(&CpuTwin), report(&OneAtATime));
    assert!(serial.2.lines().filter(|l| l.starts_with("caught ")).count() > 100, "{}", serial.2);
    assert_eq!(threaded.0, serial.0);
    assert_eq!(threaded.1, serial.1);
    assert_eq!(threaded.2, serial.2);
    // Progress hears of every case once, whatever order they finish in.
    let indices = |heard: &[(usize, String)]| heard.iter().map(|(i, _)| *i).collect::<Vec<_>>();
    assert_eq!(indices(&threaded.3), (0..cases.len()).collect::<Vec<_>>());
    let mut names: Vec<_> = threaded.3.iter().map(|(_, n)| n.clone()).collect();
    names.sort();
    let mut want: Vec<_> = cases.iter().map(|c| c.name.clone()).collect();
    want.sort();
    assert_eq!(names, want);
}

/// `--every-device` mutates the ops of every device: on a 2×2 mesh the interior chips'
/// mutants come on top of the first and last chips', every one caught or excluded with its
/// proof.
#[test]
fn every_device_mutates_every_device() {
    let case = common::case_named("mesh_os_cannon_2x2_");
    let run = |sites| {
        let mut out = Vec::new();
        let options = MutantOptions { sites, ..MutantOptions::default() };
        run_mutants(std::slice::from_ref(&case), &CpuTwin, &mut out, options, &mut |_, _, _| {})
            .expect("the report is written")
    };
    let (sampled, every) = (run(Sites::FirstAndLast), run(Sites::Every));
    let total = |r: &cmm_conformance::mutants::MutantReport| r.kinds.values().map(|k| k.total).sum::<usize>();
    assert!(total(&sampled) > 40, "{}", total(&sampled));
    // Less than twice: a scratch buffer is shrunk once whichever chips are mutated.
    assert_eq!(total(&every), cmm_core::mutants::mutants(&case.plan().unwrap(), &[0, 1, 2, 3]).len());
    assert!(total(&every) > total(&sampled) * 3 / 2, "{} vs {}", total(&every), total(&sampled));
    assert!(every.survivors.is_empty(), "{:?}", every.survivors);
    assert_eq!(every.caught(), every.counted());
}
