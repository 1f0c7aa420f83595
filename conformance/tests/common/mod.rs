//! Test bodies shared by the CPU-twin and the reference test files: each takes the
//! backend to check, so both executors face the same broken plans.

#![allow(dead_code)]

use cmm_conformance::{
    cases_dir, check_case, load_corpus, run_case, Backend, BackendError, Case, CaseAlgorithm, CaseProblem, Failure,
    GoldenStatus, Goldens,
};
use cmm_core::schedule::schedule;
use cmm_core::{build_plan_with, Algorithm, BaselineSums, Family, Op, OpKind, Plan};

pub fn corpus() -> Vec<Case> {
    load_corpus(&cases_dir()).unwrap_or_else(|e| panic!("{e}"))
}

/// The first corpus case whose name starts with `prefix`.
pub fn case_named(prefix: &str) -> Case {
    corpus()
        .into_iter()
        .find(|c| c.name.starts_with(prefix))
        .unwrap_or_else(|| panic!("the corpus has no case named {prefix}…"))
}

pub fn goldens() -> Goldens {
    Goldens { dir: Goldens::default_dir(), bless: false }
}

fn left(d: usize, n: usize) -> usize {
    (d + n - 1) % n
}

fn right(d: usize, n: usize) -> usize {
    (d + 1) % n
}

/// The exact-family ag_gemm ring case of the corpus with the most devices (at least 3,
/// so that the left and right neighbours differ), and its plan.
pub fn ring_case() -> (Case, Plan) {
    let case = corpus()
        .into_iter()
        .filter(|c| {
            c.ring_op() == Some(OpKind::AgGemm)
                && c.algorithm == "ring"
                && c.family == Family::Exact
                && c.devices() >= 3
        })
        .max_by_key(|c| c.devices())
        .expect("the corpus has an exact ag_gemm ring case with D >= 3");
    let plan = case.plan().unwrap();
    (case, plan)
}

/// The ring reversed: every copy and signal to the left neighbour goes to the right one.
pub fn reverse_ring(plan: &Plan) -> Plan {
    let mut p = plan.clone();
    let n = p.devices;
    let mut changed = 0;
    for (d, program) in p.programs.iter_mut().enumerate() {
        for op in program.lanes.iter_mut().flatten() {
            match op {
                Op::Copy { dst_device, .. } | Op::Signal { device: dst_device, .. } if *dst_device == left(d, n) => {
                    *dst_device = right(d, n);
                    changed += 1;
                }
                _ => {}
            }
        }
    }
    assert!(changed > 0, "the ring plan sends nothing to the left");
    p
}

/// Device 0's first copy into the scratch buffer lands one slot too far.
pub fn wrong_slot(plan: &Plan) -> Plan {
    let mut p = plan.clone();
    let n = p.devices;
    let scratch = p.buffer_id("S").expect("the ring plan has a scratch buffer S");
    let decl = p.buffer(scratch).clone();
    let slot = decl.rows / (n - 1) * decl.cols;
    let copy = p.programs[0]
        .lanes
        .iter_mut()
        .flatten()
        .find_map(|op| match op {
            Op::Copy { dst, .. } if dst.buf == scratch && dst.offset == 0 => Some(dst),
            _ => None,
        })
        .expect("device 0 copies into slot 0 of S");
    copy.offset += slot;
    p
}

/// The plan without device 0's first signal; returns the plan and the signalled device.
pub fn drop_first_signal(plan: &Plan) -> (Plan, usize) {
    let mut p = plan.clone();
    for lane in &mut p.programs[0].lanes {
        if let Some(i) = lane.iter().position(|op| matches!(op, Op::Signal { .. })) {
            let Op::Signal { device, .. } = lane.remove(i) else { unreachable!() };
            return (p, device);
        }
    }
    panic!("device 0 signals nothing");
}

/// The unmodified ring plan passes (so the failures below come from the mutations).
pub fn ring_plan_passes(backend: &dyn Backend) {
    let (case, plan) = ring_case();
    let result = check_case(&case, &plan, backend, &goldens());
    assert!(result.passed(), "{}: {}", case.name, result.reason());
    assert_eq!(result.golden, GoldenStatus::Compared);
}

/// A ring running the wrong way round computes wrong blocks: the oracle and the golden
/// comparisons both fail, and nothing panics.
pub fn reversed_ring_fails(backend: &dyn Backend) {
    let (case, plan) = ring_case();
    let broken = reverse_ring(&plan);
    let result = check_case(&case, &broken, backend, &goldens());
    assert!(!result.passed(), "a reversed ring passed {}", case.name);
    assert!(result.failures.iter().any(|f| matches!(f, Failure::Oracle(_))), "{}", result.reason());
    assert!(result.failures.iter().any(|f| matches!(f, Failure::Golden { .. })), "{}", result.reason());
    assert!(result.reason().contains("bit-exact"), "{}", result.reason());
}

/// A compute lane that does not wait for the shard it multiplies reads scratch before
/// the copy lands in some interleavings and after it in others: the verifier names
/// the race and the runs under different schedules differ.
pub fn schedule_dependent_output_is_found(backend: &dyn Backend) {
    let (case, plan) = ring_case();
    let mut racy = plan.clone();
    let compute = &mut racy.programs[0].lanes[0];
    let at = compute.iter().position(|op| matches!(op, Op::Wait { .. })).expect("device 0 waits");
    let Op::Wait { sem, .. } = compute[at] else { unreachable!() };
    compute[at] = Op::Wait { sem, value: 0 };
    let result = cmm_conformance::check_case_with(&case, &racy, backend, None, 4);
    let reason = result.reason();
    assert!(
        result.failures.iter().any(|f| matches!(f, Failure::ScheduleDependent { .. })),
        "no schedule dependence found: {reason}"
    );
    assert!(reason.contains("schedule-dependent output: default and"), "{reason}");
    assert!(
        result.failures.iter().any(|f| matches!(f, Failure::Verifier { .. })) && reason.contains("gemm"),
        "the verifier should name the unsynchronised gemm: {reason}"
    );
}

/// Runs every mutant of `case` on `backend`: none may survive, and more than `at_least`
/// count. Returns how many counted and the printed report.
fn every_mutant_caught(case: cmm_conformance::Case, backend: &dyn Backend, at_least: usize) -> (usize, String) {
    let mut out = Vec::new();
    let report =
        cmm_conformance::mutants::run_mutants(&[case], backend, &mut out, Default::default(), &mut |_, _, _| {})
            .unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(report.survivors.is_empty(), "{text}");
    assert!(report.counted() > at_least, "{text}");
    (report.counted(), text)
}

/// Every mutant of one corpus plan is caught or provably equivalent.
pub fn mutants_of_a_ring_plan_are_caught(backend: &dyn Backend) {
    let (case, _) = ring_case();
    let (counted, text) = every_mutant_caught(case, backend, 20);
    assert!(text.contains(&format!("{counted} of {counted} mutants caught")), "{text}");
}

/// Every mutant of an exact MeshSlice plan (both mesh directions pipelined, a reduce
/// ring and a gather ring) is caught or provably equivalent.
pub fn mutants_of_a_mesh_plan_are_caught(backend: &dyn Backend) {
    let case = corpus()
        .into_iter()
        .find(|c| c.name.starts_with("mesh_ls_meshslice_s4b1_2x2_") && c.family == Family::Exact)
        .expect("the corpus has an exact LS MeshSlice case on 2x2");
    every_mutant_caught(case, backend, 50);
}

/// A shard written into the wrong scratch slot leaves a slot unwritten: the check fails
/// (a wrong output, or the backend's report of the bad access), and nothing panics.
pub fn wrong_slot_fails(backend: &dyn Backend) {
    let (case, plan) = ring_case();
    let broken = wrong_slot(&plan);
    assert!(broken.validate().is_ok(), "the mutation keeps the plan well-formed");
    let result = check_case(&case, &broken, backend, &goldens());
    assert!(!result.passed(), "a wrong scratch slot passed {}", case.name);
    assert!(
        result.failures.iter().all(|f| matches!(
            f,
            Failure::Oracle(_)
                | Failure::Golden { .. }
                | Failure::Verifier { .. }
                | Failure::Poison { .. }
                | Failure::Backend(BackendError::Failed { .. })
        )),
        "{}",
        result.reason()
    );
}

/// A missing signal is a deadlock naming device, lane, semaphore, awaited and reached
/// values, from the scheduler and through the backend, never a hang.
pub fn missing_signal_deadlocks(backend: &dyn Backend) {
    let (case, plan) = ring_case();
    let (broken, starved) = drop_first_signal(&plan);
    let deadlock = schedule(&broken).expect_err("a plan missing a signal deadlocks");
    let blocked = deadlock
        .blocked
        .iter()
        .find(|b| b.device == starved)
        .unwrap_or_else(|| panic!("device {starved} is not reported blocked: {deadlock}"));
    // One signal is missing, so the counting semaphore stops one short.
    assert_eq!(blocked.semaphore, "recv", "{deadlock}");
    assert_eq!(blocked.awaited, blocked.reached + 1, "{deadlock}");
    let text = deadlock.to_string();
    let expected = format!(
        "device {starved} lane {} op {}: waits for recv >= {}, reached {}",
        blocked.lane, blocked.index, blocked.awaited, blocked.reached
    );
    assert!(text.contains(&expected), "{text}");

    match backend.run(&broken, case.seed, case.family, cmm_core::schedule::Order::Default) {
        Err(BackendError::Deadlock(d)) => assert_eq!(d, deadlock),
        Err(other) => panic!("expected the deadlock, got: {other}"),
        Ok(_) => panic!("a plan missing a signal ran to completion"),
    }
    let result = check_case(&case, &broken, backend, &goldens());
    assert!(!result.passed());
    assert!(
        result.reason().contains("deadlocks") && result.reason().contains(&blocked.to_string()),
        "{}",
        result.reason()
    );
}

/// The GEMM+RS / GEMM+AR baselines with their sums beside their copies (`BaselineSums::Beside`),
/// the form cmm builds only on blocks of 2 MiB or more, which the corpus's small blocks
/// never reach: on every exact-family baseline case where that plan differs from the
/// case's (the ring baseline from D = 2, the direct one from D = 5), the oracle's bits and
/// the committed golden, since the exact family's sums come out the same in any order.
pub fn baselines_pass_with_their_sums_beside(backend: &dyn Backend) {
    let (mut ran, mut failed) = (Vec::new(), Vec::new());
    for case in corpus().iter().filter(|c| c.family == Family::Exact) {
        let (
            Ok(CaseProblem::Ring(p)),
            Ok(CaseAlgorithm::Ring(algorithm @ (Algorithm::Baseline | Algorithm::BaselineDirect))),
        ) = (case.problem(), case.algorithm())
        else {
            continue;
        };
        let plan =
            build_plan_with(&p, algorithm, BaselineSums::Beside).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        if p.op == OpKind::AgGemm || case.plan().is_ok_and(|own| own == plan) {
            continue;
        }
        let result = check_case(case, &plan, backend, &goldens());
        if !result.passed() || result.golden != GoldenStatus::Compared {
            failed.push(format!("{}: {}", case.name, result.reason()));
        }
        ran.push(format!("{algorithm} D={}", p.devices));
    }
    assert!(failed.is_empty(), "{} case(s) failed:\n{}", failed.len(), failed.join("\n"));
    let direct = ran.iter().filter(|r| r.starts_with("baseline_direct")).count();
    assert!(direct >= 2 && ran.len() >= direct + 4, "too few cases: {ran:?}");
}

/// Every case of the corpus passes on `backend`.
pub fn corpus_passes(backend: &dyn Backend) {
    cases_pass(backend, |_| true);
}

/// Every case of the corpus that `select` picks passes on `backend`.
pub fn cases_pass(backend: &dyn Backend, select: impl Fn(&Case) -> bool) {
    let failed: Vec<String> = corpus()
        .iter()
        .filter(|case| select(case))
        .map(|case| run_case(case, backend, &goldens()))
        .filter(|r| !r.passed() || r.golden != GoldenStatus::Compared)
        .map(|r| format!("{}: {}", r.case.name, r.reason()))
        .collect();
    assert!(failed.is_empty(), "{} case(s) failed:\n{}", failed.len(), failed.join("\n"));
}
