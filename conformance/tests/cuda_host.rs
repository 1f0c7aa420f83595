//! The conformance checks on the host twin of the CUDA backend: its lowering and the
//! kernels of `cuda/kernels/*.cu`, compiled by the system C++ compiler and run on the
//! CPU with a thread per stream (`cmm_cuda::host`). No GPU needed; the same test bodies
//! as the reference and the GPU.

mod common;

use std::time::Duration;

use cmm_conformance::Cuda;
use cmm_core::verify::queues::{
    check_enqueue_order, schedule_order, whole_lane_order, with_fused_runs_whole, EnqueueError, MAX_QUEUES,
};
use cmm_cuda::host::{FiberOrder, HostFeed};
use cmm_cuda::{CudaError, CudaExecutor, CudaRunOptions, HopperVariant, HostTwin, SyncMode};

/// How long a run that should hang gets: far more than the corpus plans need (they
/// finish in milliseconds), so that a timeout is a hang and not a slow machine.
const HANG_LIMIT: Duration = Duration::from_secs(2);

fn host(sync: SyncMode) -> Cuda<HostTwin> {
    let backend = HostTwin::new().unwrap_or_else(|e| panic!("{e}"));
    Cuda::new(backend, CudaRunOptions { sync, ..CudaRunOptions::emulated() })
}

#[test]
fn corpus_passes() {
    common::corpus_passes(&host(SyncMode::Kernels));
}

/// The same corpus with every plain GEMM whose B is N-major on the Hopper engine's
/// clusters of two (multicast B, remote arrives, cluster barriers), which plans never take
/// but the GEMM sweep times: their results stand on every shape the corpus has (phantom
/// second tiles, K tails, odd N), not only on the sweep's spot checks. Each block's threads
/// are resumed last to first, so that the fused and grouped GEMMs on the engine's own
/// kernels (and every other kernel) also run with their consumers ahead of their producers.
#[test]
fn corpus_passes_with_the_hopper_engines_clusters_of_two() {
    let mut cuda = host(SyncMode::Kernels);
    cuda.backend = cuda.backend.with_fiber_order(FiberOrder::LastToFirst);
    cuda.options.hopper_variant = HopperVariant::Pair;
    common::corpus_passes(&cuda);
    let engines = cuda.engines();
    assert!(engines.clusters > 100 && engines.clusters < engines.hopper, "{}", engines.describe());
}

/// The same corpus with every GEMM that the Hopper engine's rules let it take on its
/// 128×128 ping-pong kernels (the consumer warpgroups on alternate tiles), which only the
/// GEMM sweep times: plain, fused (blocks released by each warpgroup's own barrier) and
/// grouped GEMMs, on the twin's three CTAs, so that each CTA's warpgroups share its stages
/// over many tiles; each block's threads resumed last to first, so that the consumers look
/// at their stages before the producer has filled any (the other corpus runs resume them
/// first to last).
#[test]
fn corpus_passes_with_the_hopper_engines_ping_pong_kernels() {
    let mut cuda = host(SyncMode::Kernels);
    cuda.backend = cuda.backend.with_fiber_order(FiberOrder::LastToFirst);
    cuda.options.gemm = cmm_cuda::GemmEngine::TileKernel;
    cuda.options.hopper_tile = Some(cmm_cuda::HopperTile::Narrow);
    cuda.options.hopper_variant = HopperVariant::PingPong;
    common::corpus_passes(&cuda);
    let engines = cuda.engines();
    assert!(engines.hopper > 1000 && engines.clusters == 0, "{}", engines.describe());
}

/// The corpus with stream memory ops, each block's threads resumed in an order shuffled
/// afresh each round, so that threads overtake each other in every kernel (the other
/// corpus runs resume them first to last or last to first), and every ag_moe grouped
/// GEMM on the Hopper engine with its gathered rows staged first (`cmm_gather_rows`, then
/// TMA), which the engine does only from 512 columns, more than the corpus's have.
#[test]
fn corpus_passes_with_stream_memory_ops() {
    let mut cuda = host(SyncMode::StreamMemOps);
    cuda.backend = cuda.backend.with_fiber_order(FiberOrder::Shuffled(7));
    cuda.options.hopper_variant = HopperVariant::StagedGather;
    common::corpus_passes(&cuda);
    let engines = cuda.engines();
    assert!(engines.staged > 100, "{}", engines.describe());
}

/// In both sync modes: the direct baseline's sum lane waits on a semaphore a step.
#[test]
fn baselines_pass_with_their_sums_beside() {
    for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
        common::baselines_pass_with_their_sums_beside(&host(sync));
    }
}

#[test]
fn ring_plan_passes() {
    common::ring_plan_passes(&host(SyncMode::Kernels));
}

#[test]
fn reversed_ring_fails() {
    common::reversed_ring_fails(&host(SyncMode::Kernels));
}

#[test]
fn wrong_slot_fails() {
    common::wrong_slot_fails(&host(SyncMode::Kernels));
}

#[test]
fn missing_signal_deadlocks() {
    common::missing_signal_deadlocks(&host(SyncMode::Kernels));
}

#[test]
fn mutants_of_a_ring_plan_are_caught() {
    common::mutants_of_a_ring_plan_are_caught(&host(SyncMode::Kernels));
}

/// The execution side of the hang check (`cmm_core::verify::queues`): the corpus, in the
/// schedule order the check proves safe, runs to the end on emulated FIFO hardware queues,
/// with stream-memory-op waits holding their queue (one queue: the strictest case); and
/// with kernel waits on 8 queues, the cases whose streams share them. On one queue the
/// plans whose persistent kernels wait for each other (fused_push from D = 3) are refused
/// by the check before anything runs, naming the hang.
#[test]
fn corpus_passes_on_emulated_hardware_queues() {
    let mut memops = host(SyncMode::StreamMemOps);
    memops.backend = memops.backend.with_feed(HostFeed::Queues { queues: 1, offset: 0 });
    // Those whose persistent kernels enqueued whole cannot drain through one queue.
    let concurrent = |case: &cmm_conformance::Case| {
        let plan = case.plan().unwrap();
        let whole = with_fused_runs_whole(&schedule_order(&plan).unwrap(), &plan.fused_runs().unwrap());
        check_enqueue_order(&plan, &whole, 1).is_err()
    };
    common::cases_pass(&memops, |case| !concurrent(case));
    let refused = common::corpus().into_iter().filter(concurrent).collect::<Vec<_>>();
    assert!(!refused.is_empty() && refused.iter().all(|c| c.algorithm == "fused_push"), "{} cases", refused.len());
    for case in refused {
        let plan = case.plan().unwrap();
        let options = CudaRunOptions { sync: SyncMode::StreamMemOps, ..CudaRunOptions::emulated() };
        let one = HostTwin::new().unwrap().with_feed(HostFeed::Queues { queues: 1, offset: 0 });
        match one.run(&plan, case.seed, case.family, &options) {
            Err(CudaError::Enqueue(EnqueueError::Hang(_))) => {}
            other => panic!("{}: expected the hang check's refusal, got {:?}", case.name, other.map(|o| o.elapsed)),
        }
    }
    let mut kernels = host(SyncMode::Kernels);
    kernels.backend = kernels.backend.with_feed(HostFeed::Queues { queues: 8, offset: 3 });
    common::cases_pass(&kernels, |case| case.plan().is_ok_and(|p| p.devices * p.lanes.len() > 8));
}

/// The order the executor used before the hang check (each lane whole, device by
/// device) hangs on one emulated queue, as the check predicts, and the run ends in a
/// timeout error naming the waits the abort released; the schedule order does not.
#[test]
fn the_whole_lane_order_hangs_on_one_emulated_queue_as_the_check_predicts() {
    let (case, plan) = common::ring_case();
    let whole_lane = whole_lane_order(&plan);
    let predicted = check_enqueue_order(&plan, &whole_lane, 1).expect_err("the check predicts a hang");
    check_enqueue_order(&plan, &whole_lane, MAX_QUEUES).expect("a queue per stream cannot hang");
    let twin = HostTwin::new().unwrap();
    let options = CudaRunOptions { sync: SyncMode::StreamMemOps, ..CudaRunOptions::emulated() };
    let hurried = CudaRunOptions { run_timeout: HANG_LIMIT, wait_timeout: HANG_LIMIT, ..options };
    let one = twin.with_feed(HostFeed::Queues { queues: 1, offset: 0 });
    match one.run_in_order(&plan, &whole_lane, MAX_QUEUES, case.seed, case.family, &hurried) {
        Err(CudaError::RunTimeout { .. }) => {}
        other => panic!("expected a hang ({predicted}), got {:?}", other.map(|o| o.elapsed)),
    }
    let own = twin.with_feed(HostFeed::Queues { queues: MAX_QUEUES, offset: 0 });
    own.run_in_order(&plan, &whole_lane, MAX_QUEUES, case.seed, case.family, &options).unwrap();
    let scheduled = schedule_order(&plan).unwrap();
    one.run_in_order(&plan, &scheduled, 1, case.seed, case.family, &options).unwrap();
}

/// The check is sound for an order other than the schedule's: every corpus case with more
/// streams than queues (so that streams share them) whose whole-lane order the check
/// accepts at 8 queues runs that order to the end on 8 emulated queues, at every
/// round-robin offset, with stream-memory-op waits (which hold their queue, as the check
/// assumes of every wait).
#[test]
fn orders_the_check_accepts_do_not_hang_on_emulated_queues() {
    let twin = HostTwin::new().unwrap();
    let options = CudaRunOptions { sync: SyncMode::StreamMemOps, ..CudaRunOptions::emulated() };
    let mut accepted = 0;
    for case in common::corpus() {
        let plan = case.plan().unwrap();
        let order = whole_lane_order(&plan);
        let streams = plan.devices * plan.lanes.len();
        if streams <= 8 || check_enqueue_order(&plan, &order, 8).is_err() {
            continue;
        }
        accepted += 1;
        for offset in 0..8 {
            let queued = twin.with_feed(HostFeed::Queues { queues: 8, offset });
            queued
                .run_in_order(&plan, &order, 8, case.seed, case.family, &options)
                .unwrap_or_else(|e| panic!("{} at offset {offset}: {e}", case.name));
        }
    }
    assert!(accepted >= 10, "only {accepted} cases share queues and have a whole-lane order the check accepts");
    eprintln!("{accepted} whole-lane orders accepted and run at every offset");
}

/// And where it rejects an order, the order hangs: for one in sixteen of the corpus cases
/// whose whole-lane order the check rejects at 8 queues (and accepts at 32, so that it can
/// be lowered), the emulation at the offset the check names does not finish within 2 s
/// (the plans are tiny: they finish in milliseconds), while the schedule order of the same
/// plan on the same queues does. The cases run at once: a hung emulation mostly sleeps
/// until its deadline.
#[test]
fn orders_the_check_rejects_hang_on_emulated_queues() {
    let twin = HostTwin::new().unwrap();
    let options = CudaRunOptions { sync: SyncMode::StreamMemOps, ..CudaRunOptions::emulated() };
    let hurried = CudaRunOptions { run_timeout: HANG_LIMIT, wait_timeout: HANG_LIMIT, ..options };
    let rejected: Vec<_> = common::corpus()
        .into_iter()
        .filter_map(|case| {
            let plan = case.plan().unwrap();
            let order = whole_lane_order(&plan);
            let Err(EnqueueError::Hang(hang)) = check_enqueue_order(&plan, &order, 8) else { return None };
            check_enqueue_order(&plan, &order, MAX_QUEUES).ok()?;
            Some((case, plan, order, hang.offset))
        })
        .step_by(16)
        .collect();
    assert!(rejected.len() >= 5, "only {} rejected cases tried", rejected.len());
    std::thread::scope(|scope| {
        for (case, plan, order, offset) in &rejected {
            let (twin, options, hurried) = (&twin, &options, &hurried);
            scope.spawn(move || {
                let queued = twin.with_feed(HostFeed::Queues { queues: 8, offset: *offset });
                match queued.run_in_order(plan, order, MAX_QUEUES, case.seed, case.family, hurried) {
                    Err(CudaError::RunTimeout { .. }) => {}
                    other => {
                        panic!("{}: the check predicts a hang at offset {offset}, the run gave {other:?}", case.name)
                    }
                }
                let scheduled = schedule_order(plan).unwrap();
                queued
                    .run_in_order(plan, &scheduled, 8, case.seed, case.family, options)
                    .unwrap_or_else(|e| panic!("{}: the schedule order on the same queues: {e}", case.name));
            });
        }
    });
}
