//! The hardware-queue hang check on the whole corpus: the order in which the CUDA
//! executor enqueues ops (the schedule order) cannot hang on 8 or 32 hardware queues,
//! while the whole-lane order it used before hangs on most cases.

mod common;

use cmm_core::verify::queues::{
    check_enqueue_order, schedule_order, whole_lane_order, EnqueueError, DEFAULT_QUEUES, MAX_QUEUES,
};

#[test]
fn the_schedule_order_of_every_corpus_plan_cannot_hang() {
    for case in common::corpus() {
        let plan = case.plan().unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let order = schedule_order(&plan).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        // One queue is the strongest: it implies every mapping onto any number.
        for queues in [1, DEFAULT_QUEUES, MAX_QUEUES] {
            check_enqueue_order(&plan, &order, queues).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        }
    }
}

#[test]
fn the_whole_lane_order_hangs_on_the_corpus() {
    let mut hangs = [0usize; 2];
    let mut total = 0;
    let mut example = None;
    for case in common::corpus() {
        let plan = case.plan().unwrap();
        // A one-lane plan (a baseline) enqueues in program order whatever the executor does.
        if plan.lanes.len() < 2 {
            continue;
        }
        let order = whole_lane_order(&plan);
        total += 1;
        for (i, queues) in [DEFAULT_QUEUES, MAX_QUEUES].into_iter().enumerate() {
            match check_enqueue_order(&plan, &order, queues) {
                Ok(()) => {}
                Err(EnqueueError::Hang(hang)) => {
                    hangs[i] += 1;
                    if example.is_none() {
                        example = Some((case.name.clone(), hang.to_string()));
                    }
                }
                Err(e) => panic!("{}: {e}", case.name),
            }
        }
    }
    eprintln!("whole-lane order: {} of {total} multi-lane plans hang on 8 queues, {} on 32", hangs[0], hangs[1]);
    let (name, sentence) = example.expect("some case hangs");
    eprintln!("{name}: {sentence}");
    // A large part of the corpus, whatever its mix (142 of 291 with ring_accumulate, whose
    // compute lanes wait before their GEMMs; more than half before it).
    assert!(5 * hangs[0] > 2 * total, "{} of {total} hang on 8 queues", hangs[0]);
    // With 32 queues only plans with more than 32 streams (the 4×4 meshes) can hang.
    assert!(hangs[1] > 0 && hangs[1] < hangs[0], "{} hang on 32 queues", hangs[1]);
}

#[test]
fn a_ring_case_under_the_whole_lane_order_is_reported_in_one_sentence() {
    let case = common::case_named("ag_gemm_ring_d8_");
    let plan = case.plan().unwrap();
    let err = check_enqueue_order(&plan, &whole_lane_order(&plan), DEFAULT_QUEUES).unwrap_err();
    let EnqueueError::Hang(hang) = &err else { panic!("{}: {err}", case.name) };
    let text = err.to_string();
    assert!(text.contains(&plan.name) && text.contains("heads queue") && text.ends_with('.'), "{text}");
    for link in &hang.cycle {
        assert!(text.contains(&link.wait_text), "{text}");
        if let Some((_, signal, _)) = &link.signal {
            assert!(text.contains(signal.as_str()), "{text}");
        }
    }
}

#[test]
fn every_corpus_plan_lowers_for_the_cuda_executor() {
    use cmm_cuda::lower::{lower, Command, LowerOptions};
    use cmm_cuda::{GemmEngine, SyncMode};
    let mut memops_writes = 0;
    for case in common::corpus() {
        let plan = case.plan().unwrap();
        for (gemm, cublas_present) in
            [(GemmEngine::Auto, true), (GemmEngine::Auto, false), (GemmEngine::TileKernel, true)]
        {
            for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
                for queues in [DEFAULT_QUEUES, MAX_QUEUES] {
                    let options = LowerOptions { gemm, sync, cublas_present, queues, wide_tiles: false, hopper: None };
                    let lowered = lower(&plan, &options).unwrap_or_else(|e| panic!("{}: {e}", case.name));
                    assert_eq!(lowered.steps.len(), plan.op_count(), "{}", case.name);
                    if !cublas_present || gemm == GemmEngine::TileKernel {
                        assert_eq!(lowered.gemms().cublas, 0, "{}", case.name);
                    }
                    memops_writes +=
                        lowered.steps.iter().filter(|s| matches!(s.command, Some(Command::SignalWrite { .. }))).count();
                }
            }
        }
    }
    assert!(memops_writes > 0, "stream memory ops replace some signal kernels");
}

#[test]
fn a_fused_gemm_lowers_to_one_persistent_kernel_enqueued_after_what_it_waits_for() {
    use cmm_cuda::lower::{lower, Command};
    let mut kernels = 0;
    for case in common::corpus().into_iter().filter(|c| c.algorithm == "fused") {
        let plan = case.plan().unwrap();
        let runs = plan.fused_runs().unwrap();
        // One queue is the strongest: the kernel's waits never stand in front of their signals.
        for queues in [1, DEFAULT_QUEUES] {
            let lowered = lower(&plan, &kernel_waits(queues)).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let fused: Vec<_> = lowered
                .steps
                .iter()
                .filter_map(|s| match &s.command {
                    Some(Command::FusedGemm(f)) => Some(f),
                    _ => None,
                })
                .collect();
            assert_eq!(fused.len(), runs.len(), "{}", case.name);
            for (f, run) in fused.iter().zip(&runs) {
                assert_eq!(f.blocks.len(), run.blocks.len(), "{}", case.name);
                assert!(f.blocks.windows(2).all(|w| w[0].first_tile < w[1].first_tile), "{}", case.name);
            }
            // No op of a run is issued on its own: the kernel waits and signals inside.
            let inside = lowered.steps.iter().filter(|s| runs.iter().any(|r| r.inside(s.site)));
            assert!(inside.clone().all(|s| s.command.is_none()), "{}", case.name);
            assert_eq!(lowered.gemms().cublas, 0, "{}: cuBLAS cannot wait inside a GEMM", case.name);
            kernels += fused.len();
        }
    }
    assert!(kernels > 0);
}

/// fused_push's persistent kernels wait for each other's releases (device d's block s for
/// device d+1's block s−1): from D = 3 they form a cycle that only kernels running at
/// once can close. On queues enough for a stream each they lower; on one queue the
/// lowering refuses them with the hang it found, rather than launching a run that spins
/// to its timeout. At D = 2 the one wait is for a GEMM of its own, before the kernel.
#[test]
fn fused_push_kernels_need_a_queue_each_from_three_devices() {
    use cmm_cuda::lower::lower;
    use cmm_cuda::CudaError;
    let cases: Vec<_> = common::corpus().into_iter().filter(|c| c.algorithm == "fused_push").collect();
    assert!(cases.len() >= 10, "{} fused_push cases", cases.len());
    for case in cases {
        let plan = case.plan().unwrap();
        lower(&plan, &kernel_waits(MAX_QUEUES)).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        match lower(&plan, &kernel_waits(1)) {
            Ok(_) => assert!(plan.devices <= 2, "{}: lowered on one queue", case.name),
            Err(CudaError::Enqueue(EnqueueError::Hang(hang))) => {
                assert!(plan.devices >= 3, "{}: {hang}", case.name);
                assert!(hang.to_string().contains("wait added"), "{}: {hang}", case.name);
            }
            Err(e) => panic!("{}: {e}", case.name),
        }
    }
}

/// Lowering options with kernel waits, `Auto` GEMMs and `queues` hardware queues.
fn kernel_waits(queues: usize) -> cmm_cuda::lower::LowerOptions {
    cmm_cuda::lower::LowerOptions {
        gemm: cmm_cuda::GemmEngine::Auto,
        sync: cmm_cuda::SyncMode::Kernels,
        cublas_present: true,
        queues,
        wide_tiles: false,
        hopper: None,
    }
}
