//! The GPU backend itself ([`CudaBackend`], its cudarc and cuBLAS calls included) on the
//! fake CUDA driver (`cmm_cuda::fake`), which runs on the CPU: what only a driver can
//! show, without a GPU. The GPU tests of `device.rs` and `conformance/tests/cuda.rs` run
//! on it too, in the GPU bundle's rehearsal (`cargo xtask gpu-bundle --check`).
//!
//! NVRTC compiles the kernels here as on a GPU machine: without libnvrtc these tests
//! say why they skip, or fail with `CMM_REQUIRE_NVRTC=1` (set by CI).

use std::sync::Mutex;
use std::time::Duration;

use cmm_core::generator::Family;
use cmm_core::plan::Plan;
use cmm_core::{build_plan, Algorithm, DType, OpKind, Problem};
use cmm_cuda::fake::Injection;
use cmm_cuda::{
    CopyIssue, CudaBackend, CudaError, CudaExecutor, CudaRunOptions, GemmChoice, GemmEngine, GemmImpl, GemmSpec,
    HopperKernel, HopperTile, HopperVariant, Kernel, Placement, Rendezvous, SyncMode, MAX_DEADLINE,
};

mod fake;

/// The fake GPU's primary context is one per process, as a real one is, and an injected
/// fault is global: the tests take turns.
static TURN: Mutex<()> = Mutex::new(());

fn fake_backend() -> Option<CudaBackend> {
    fake::backend_on(1)
}

fn ring_plan() -> cmm_core::Plan {
    let p = Problem::new(OpKind::AgGemm, 4, 64, 48, 32, DType::Bf16, DType::F32).unwrap();
    build_plan(&p, Algorithm::Ring).unwrap()
}

/// Runs `plan` on the exact family and compares the output with the CPU twin's.
fn assert_right(b: &CudaBackend, plan: &cmm_core::Plan, options: &CudaRunOptions) {
    let out = b.run(plan, 5, Family::Exact, options).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
    assert_output_right(plan, &out);
}

/// Compares the output of a run of `plan` (seed 5, exact family) with the CPU twin's.
fn assert_output_right(plan: &cmm_core::Plan, out: &cmm_cuda::CudaRunOutput) {
    let twin = cmm_core::cpu::run(plan, 5, Family::Exact).unwrap();
    let c = plan.output().unwrap().0;
    for (d, (got, want)) in out.buffers.iter().zip(&twin).enumerate() {
        assert_eq!(got[c], want[c], "{} device {d}", plan.name);
    }
}

#[test]
fn the_fake_gpu_names_itself() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    assert!(b.summary().contains("fake CUDA driver"), "{}", b.summary());
    assert!(b.has_cublas(), "the fake cuBLAS is loaded with the fake driver");
}

/// A kernel fault is sticky: the run reports the context lost, and the next run starts
/// a fresh context (reset, modules loaded again, lanes and cuBLAS handles made again)
/// and is right.
#[test]
fn a_faulting_kernel_loses_the_context_and_the_next_run_is_right() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let plan = ring_plan();
    for (sync, kernel) in [(SyncMode::Kernels, Kernel::Signal), (SyncMode::StreamMemOps, Kernel::Generate)] {
        let options = CudaRunOptions { sync, ..Default::default() };
        assert_right(&b, &plan, &options);
        cmm_cuda::fake::inject(Injection::Fault(kernel), 2).unwrap();
        match b.run(&plan, 5, Family::Exact, &options) {
            Err(CudaError::ContextLost { message, .. }) => {
                assert!(message.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{message}")
            }
            other => {
                panic!("{sync:?}: a faulting {} must lose the context, got {}", kernel.entry(), fake::outcome(&other))
            }
        }
        assert_right(&b, &plan, &options);
    }
}

/// A store past the end of a device allocation (made here by the host: the fake GPU's
/// memory is this process's) breaks the allocation's guard. The next free names it as a
/// sticky `CUDA_ERROR_ILLEGAL_ADDRESS`, as a GPU reports a stray store, and the backend's
/// next run loses the context and the one after is right. A store inside the allocation
/// breaks nothing.
#[test]
fn a_store_past_an_allocation_is_an_illegal_address() {
    use cudarc::driver::{result, sys};
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let plan = ring_plan();
    assert_right(&b, &plan, &CudaRunOptions::default());
    let bytes = 1000;
    // SAFETY: the fake driver is installed (fake_backend), so these are its calls, on its
    // device 0's primary context; its device pointers are host addresses of blocks with
    // 256 guard bytes on each side, so both stores land in memory the driver owns.
    #[allow(unsafe_code)]
    let freed = unsafe {
        let device = result::device::get(0).unwrap();
        result::ctx::set_current(result::primary_ctx::retain(device).unwrap()).unwrap();
        let inside = result::malloc_sync(bytes).unwrap();
        *((inside + bytes as u64 - 1) as *mut u8) = 7;
        result::free_sync(inside).unwrap();
        let past = result::malloc_sync(bytes).unwrap();
        *((past + bytes as u64 + 3) as *mut u8) = 7;
        let freed = result::free_sync(past);
        result::primary_ctx::release(device).unwrap();
        freed
    };
    assert_eq!(freed.map_err(|e| e.0), Err(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
    match b.run(&plan, 5, Family::Exact, &CudaRunOptions::default()) {
        Err(CudaError::ContextLost { message, .. }) => {
            assert!(message.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{message}")
        }
        other => panic!("the run after a broken guard must lose the context, got {}", fake::outcome(&other)),
    }
    assert_right(&b, &plan, &CudaRunOptions::default());
}

/// A fault on one GPU context does not leak into the next backend's results: every run
/// after recovery matches the twin, in both sync modes, many times over.
#[test]
fn runs_after_a_recovery_stay_right_under_repetition() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let p = Problem::new(OpKind::GemmRs, 4, 32, 40, 64, DType::F16, DType::F32).unwrap();
    let plan = build_plan(&p, Algorithm::RingBidir).unwrap_or_else(|_| build_plan(&p, Algorithm::Ring).unwrap());
    cmm_cuda::fake::inject(Injection::Fault(Kernel::Generate), 1).unwrap();
    assert!(matches!(b.run(&plan, 5, Family::Exact, &CudaRunOptions::default()), Err(CudaError::ContextLost { .. })));
    for _ in 0..10 {
        for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
            assert_right(&b, &plan, &CudaRunOptions { sync, ..Default::default() });
        }
    }
}

/// Device d on GPU d: the peer-access path (`Placement::Gpus`), which one GPU never
/// takes, runs with two fake GPUs, in both sync modes: copies to a peer, and GEMMs on a
/// peer's c (`ring_push`, cuBLAS checking that peer access covers it).
#[test]
fn a_plan_across_two_gpus_is_right() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake::backend_on(2) else { return };
    for (op, rows, algorithm) in [
        (OpKind::AgGemm, 32, Algorithm::Ring),
        (OpKind::GemmRs, 64, Algorithm::Ring),
        (OpKind::GemmRs, 64, Algorithm::RingPush),
    ] {
        let p = Problem::new(op, 2, rows, 48, 64, DType::F16, DType::F32).unwrap();
        let plan = build_plan(&p, algorithm).unwrap();
        for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
            assert_right(&b, &plan, &CudaRunOptions { sync, placement: Placement::Gpus, ..Default::default() });
        }
    }
}

/// Deadlines the kernels and the host cannot keep are refused before anything runs, naming
/// them: "never" written as `Duration::MAX` (which the host's sums of deadlines overflowed,
/// and the kernels' nanosecond count truncated), and a wait deadline of zero.
#[test]
fn deadlines_past_a_day_or_a_zero_wait_are_refused_naming_them() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let plan = ring_plan();
    for (options, said) in [
        (CudaRunOptions { run_timeout: Duration::MAX, ..Default::default() }, "at most 86400 s each (a day)"),
        (CudaRunOptions { wait_timeout: Duration::MAX, ..Default::default() }, "at most 86400 s each (a day)"),
        (CudaRunOptions { wait_timeout: Duration::ZERO, ..Default::default() }, "a wait deadline of 0 s"),
    ] {
        let e = b.run(&plan, 5, Family::Exact, &options).map(|o| o.elapsed).expect_err("refused deadlines ran");
        assert!(matches!(e, CudaError::Unsupported { .. }) && e.to_string().contains(said), "{e}");
    }
    assert_right(
        &b,
        &plan,
        &CudaRunOptions { run_timeout: MAX_DEADLINE, wait_timeout: MAX_DEADLINE, ..Default::default() },
    );
}

/// A rank outside its world, or a world that is not the plan's devices, is refused before
/// anything runs, naming the rank, on generated inputs and on the caller's buffers (a
/// caller builds its `Rendezvous` as it likes: rank 4 of 4 once indexed past the plan's
/// devices and panicked). No socket is made.
#[test]
fn a_rank_outside_its_world_is_refused_naming_it() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let plan = ring_plan();
    let socket = std::env::temp_dir().join(format!("cmm-no-such-rank-{}", std::process::id()));
    for (rank, world, what) in
        [(4, 4, "no such rank: the ranks of 4 are 0 to 3"), (0, 2, "2 ranks for a plan of 4 devices")]
    {
        let rendezvous = Rendezvous { rank, world, socket: socket.clone(), timeout: Duration::from_secs(1) };
        let options = CudaRunOptions::default();
        let generated = b.run_rank(&plan, &rendezvous, 5, Family::Exact, &options).map(|o| o.elapsed);
        let given = b.run_rank_given(&plan, &rendezvous, &[], &options).map(|o| o.elapsed);
        for result in [generated, given] {
            let e = result.expect_err("a rank outside its world ran");
            let text = e.to_string();
            assert!(matches!(e, CudaError::Rendezvous { .. }), "{text}");
            assert!(text.starts_with(&format!("rank {rank} of {world} ")) && text.ends_with(what), "{text}");
        }
    }
    assert!(!socket.exists(), "a refused rank made its socket");
}

/// Launches that block until their kernel has run (`CUDA_LAUNCH_BLOCKING=1`, and tools
/// that serialise GPU work) hold the host at the gate's launch, so a gated run can only
/// end at the gate's deadline, as an error naming the gate; ungated, the schedule order
/// runs one launch after another to the right result, in both sync modes.
#[test]
fn with_blocking_launches_an_ungated_run_is_right_and_a_gated_one_names_the_gate() {
    struct Unblock;
    impl Drop for Unblock {
        fn drop(&mut self) {
            let _ = cmm_cuda::fake::set_launch_blocking(None);
        }
    }
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    // Eager loading: the backend gates only then.
    let Some((b, _restore)) = fake_backend_loading(true) else { return };
    let plan = ring_plan();
    cmm_cuda::fake::set_launch_blocking(Some(true)).unwrap();
    let _unblock = Unblock;
    for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
        assert_right(&b, &plan, &CudaRunOptions { sync, gate: false, ..Default::default() });
    }
    let second = Duration::from_secs(1);
    let gated = CudaRunOptions { run_timeout: second, wait_timeout: second, ..Default::default() };
    match b.run(&plan, 5, Family::Exact, &gated) {
        Err(CudaError::RunTimeout { pending, .. }) => assert!(pending.contains("gate"), "{pending}"),
        other => panic!("a gated run with blocking launches must time out at the gate, got {}", fake::outcome(&other)),
    }
}

/// Restores the fake driver's module loading to what `CUDA_MODULE_LOADING` says.
struct LoadingAsTheEnvironmentSays;

impl Drop for LoadingAsTheEnvironmentSays {
    fn drop(&mut self) {
        let _ = cmm_cuda::fake::set_module_loading(None);
    }
}

/// The backend on one fake GPU whose module loading is eager (`true`) or lazy.
fn fake_backend_loading(eager: bool) -> Option<(CudaBackend, LoadingAsTheEnvironmentSays)> {
    cmm_cuda::fake::install().unwrap();
    cmm_cuda::fake::set_module_loading(Some(eager)).unwrap();
    let restore = LoadingAsTheEnvironmentSays;
    fake_backend().map(|b| (b, restore))
}

/// cuBLAS loads a GEMM shape's kernels the first time it meets the shape, and the load
/// waits for the running kernels, the gate among them (found on an H100). The backend
/// runs each shape once before a gated run. If cuBLAS has forgotten a shape the backend
/// warmed, the gated run's GEMM waits for the gate: the run fails at the gate's deadline,
/// naming the gate, rather than hanging; the load is done by then, and the next run is
/// right.
#[test]
fn a_cublas_shape_met_first_behind_the_gate_holds_the_host_until_the_gate_deadline() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some((b, _restore)) = fake_backend_loading(true) else { return };
    assert!(b.can_gate());
    let plan = ring_plan();
    let second = Duration::from_secs(1);
    let cublas =
        CudaRunOptions { gemm: GemmEngine::Cublas, run_timeout: second, wait_timeout: second, ..Default::default() };
    let out = b.run(&plan, 5, Family::Exact, &cublas).unwrap();
    assert!(out.gated && out.gemms.cublas > 0, "gated {}, cuBLAS GEMMs {}", out.gated, out.gemms.cublas);
    assert_right(&b, &plan, &cublas);
    cmm_cuda::fake::forget_loaded_cublas_kernels().unwrap();
    match b.run(&plan, 5, Family::Exact, &cublas) {
        Err(CudaError::RunTimeout { pending, .. }) => assert!(pending.contains("gate"), "{pending}"),
        other => panic!("a cuBLAS load behind the gate must end at the gate's deadline, got {}", fake::outcome(&other)),
    }
    assert_right(&b, &plan, &cublas);
}

/// Under lazy module loading (CUDA's default) a kernel's first launch waits for the
/// running work, the gate among them: the backend then holds no lanes behind the gate,
/// and says so; the run is right. Under eager loading it gates.
#[test]
fn under_lazy_module_loading_runs_are_ungated_and_right() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    for eager in [false, true] {
        let Some((b, _restore)) = fake_backend_loading(eager) else { return };
        assert_eq!(b.can_gate(), eager);
        assert!(b.summary().contains(if eager { "; eager module loading" } else { "; lazy module loading" }));
        let out = b.run(&ring_plan(), 5, Family::Exact, &CudaRunOptions::default()).unwrap();
        assert_eq!(out.gated, eager);
        assert_right(&b, &ring_plan(), &CudaRunOptions::default());
    }
}

/// A signal that never arrives (a dropped `cmm_signal` launch) ends the wait at its
/// deadline: the run fails naming the device, lane, semaphore and values of that wait,
/// and the next run is right.
#[test]
fn a_lost_signal_ends_at_the_wait_deadline_naming_the_wait() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let plan = ring_plan();
    let second = Duration::from_secs(1);
    let options = CudaRunOptions { wait_timeout: second, run_timeout: 10 * second, ..Default::default() };
    cmm_cuda::fake::inject(Injection::DropLaunch(Kernel::Signal), 1).unwrap();
    match b.run(&plan, 5, Family::Exact, &options) {
        Err(e @ CudaError::WaitTimeout { .. }) => {
            let text = e.to_string();
            assert!(text.contains("recv") && text.contains("device"), "{text}");
        }
        other => panic!("a lost signal must end at the wait's deadline, got {}", fake::outcome(&other)),
    }
    assert_right(&b, &plan, &CudaRunOptions::default());
}

/// Puts the fake GPU's priority range back to an H100's (greatest −5) when dropped, after a
/// test that narrowed it.
struct RestorePriorities;

impl Drop for RestorePriorities {
    fn drop(&mut self) {
        let _ = cmm_cuda::fake::set_greatest_priority(-5);
    }
}

/// Signals, waits and SM copies launch at the context's greatest priority, and nothing
/// else does; with `comm_priority` off, or on a GPU with a single priority, no launch
/// carries one. Every run is right.
#[test]
fn communicating_kernels_and_only_they_launch_at_the_greatest_priority() {
    use cmm_core::plan::{Engine, Op};
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    assert_eq!(b.comm_priority(), Ok(-5));
    assert!(b.summary().contains("at priority -5"), "{}", b.summary());
    // The ring's copies as SM copies, so that all three communicating kernels run.
    let mut plan = ring_plan();
    for op in plan.programs.iter_mut().flat_map(|p| p.lanes.iter_mut()).flatten() {
        if let Op::Copy { engine, .. } = op {
            *engine = Engine::Sm;
        }
    }
    let counts = || Kernel::ALL.map(|k| cmm_cuda::fake::prioritised_launches(k).unwrap());
    let tile = CudaRunOptions { gemm: cmm_cuda::GemmEngine::TileKernel, ..Default::default() };
    let launched = |b: &CudaBackend, options: &CudaRunOptions| {
        let before = counts();
        let out = b.run(&plan, 5, Family::Exact, options).unwrap_or_else(|e| panic!("{e}"));
        assert_right(b, &plan, options);
        let after = counts();
        let added: Vec<(Kernel, u64)> =
            Kernel::ALL.iter().zip(after.iter().zip(before)).map(|(k, (a, b))| (*k, a - b)).collect();
        (out.comm_priority, added)
    };

    // With kernel waits, every Signal, Wait and Copy op of the plan is one launch.
    let ops = |is: fn(&Op) -> bool| plan.ops().filter(|(_, op)| is(op)).count() as u64;
    let (priority, added) = launched(&b, &tile);
    assert_eq!(priority, Some(-5));
    for (kernel, n) in added {
        let per_run = match kernel {
            Kernel::Signal => ops(|op| matches!(op, Op::Signal { .. })),
            Kernel::Wait => ops(|op| matches!(op, Op::Wait { .. })),
            Kernel::Copy2d => ops(|op| matches!(op, Op::Copy { .. })),
            _ => 0,
        };
        assert!(per_run > 0 || !kernel.communicates());
        // The run and assert_right's.
        assert_eq!(n, 2 * per_run, "{} launches at a priority", kernel.entry());
    }

    let (priority, added) = launched(&b, &CudaRunOptions { comm_priority: false, ..tile });
    assert_eq!(priority, None);
    assert!(added.iter().all(|(_, n)| *n == 0), "comm_priority off: {added:?}");

    let _restore = RestorePriorities;
    cmm_cuda::fake::set_greatest_priority(0).unwrap();
    let single = CudaBackend::new(1).unwrap_or_else(|e| panic!("{e}"));
    let reason = single.comm_priority().unwrap_err();
    assert!(reason.contains("single stream priority"), "{reason}");
    assert!(single.summary().contains("every launch at the default priority"), "{}", single.summary());
    let (priority, added) = launched(&single, &tile);
    assert_eq!(priority, None);
    assert!(added.iter().all(|(_, n)| *n == 0), "a single priority: {added:?}");
}

/// With `stagger`, device d's lanes run at its staggered priority, below the
/// communicating kernels' and in device order (−4, −3, −2, −1 for four devices on a GPU
/// whose greatest priority is −5), every item of the run is enqueued at one of them, and
/// the output is right; the next run without it puts every lane back at the default.
/// On a GPU with two priorities (nothing left below communication) it does not apply,
/// and the run says so.
#[test]
fn staggered_lanes_run_at_their_devices_priorities_and_return_to_the_default() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let p = Problem::new(OpKind::GemmRs, 4, 32, 40, 64, DType::F16, DType::F32).unwrap();
    let plan = build_plan(&p, Algorithm::RingAccumulate { chunks: 1 }).unwrap();
    let levels = [0, -1, -2, -3, -4, -5];
    let counts = || levels.map(|p| cmm_cuda::fake::enqueued_at_stream_priority(p).unwrap());
    let staggered = CudaRunOptions { stagger: true, ..Default::default() };
    let run = |b: &CudaBackend, options: &CudaRunOptions| {
        let before = counts();
        let out = b.run(&plan, 5, Family::Exact, options).unwrap_or_else(|e| panic!("{e}"));
        let after = counts();
        assert_output_right(&plan, &out);
        let added: Vec<(i32, u64)> =
            levels.iter().zip(after.iter().zip(before)).map(|(p, (a, b))| (*p, a - b)).collect();
        (out.staggered, added)
    };

    // The run's setup stream (inputs, the gate, events, the read-back) stays at 0.
    let (priorities, added) = run(&b, &staggered);
    assert_eq!(priorities, vec![-4, -3, -2, -1]);
    let lanes: Vec<u64> = added.iter().filter(|(p, _)| (-4..=-1).contains(p)).map(|(_, n)| *n).collect();
    assert!(lanes.iter().all(|&n| n > 0 && n == lanes[0]), "the four devices' lanes, alike: {added:?}");
    assert_eq!(added.iter().find(|(p, _)| *p == -5), Some(&(-5, 0)), "{added:?}");
    let (priorities, added) = run(&b, &CudaRunOptions::default());
    assert!(priorities.is_empty());
    for (priority, n) in &added {
        assert_eq!(*n > 0, *priority == 0, "after staggering, items at stream priority {priority}: {added:?}");
    }

    let _restore = RestorePriorities;
    cmm_cuda::fake::set_greatest_priority(-1).unwrap();
    let narrow = CudaBackend::new(1).unwrap_or_else(|e| panic!("{e}"));
    let (priorities, added) = run(&narrow, &staggered);
    assert!(priorities.is_empty(), "two priorities leave none below communication: {priorities:?}");
    assert!(added.iter().all(|(p, n)| *n == 0 || *p == 0), "{added:?}");
}

/// With `offset_starts`, a ring runs with its devices' first GEMMs in device order (the
/// plan gains waits only) and is right; a fused plan runs as it is and says so; one GPU
/// per device is not offset.
#[test]
fn offset_starts_run_right_and_say_where_they_applied() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let offset = CudaRunOptions { offset_starts: true, ..Default::default() };
    let p = Problem::new(OpKind::GemmRs, 4, 32, 40, 64, DType::F16, DType::F32).unwrap();
    let ring = build_plan(&p, Algorithm::RingAccumulate { chunks: 1 }).unwrap();
    for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
        let options = CudaRunOptions { sync, ..offset };
        let out = b.run(&ring, 5, Family::Exact, &options).unwrap();
        assert_output_right(&ring, &out);
        assert!(out.offset_starts, "{sync:?}");
    }
    let fused = build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap();
    let out = b.run(&fused, 5, Family::Exact, &offset).unwrap();
    assert_output_right(&fused, &out);
    assert!(!out.offset_starts, "a fused plan runs as it is");
    let two = Problem::new(OpKind::AgGemm, 2, 32, 40, 64, DType::F16, DType::F32).unwrap();
    let apart = build_plan(&two, Algorithm::Ring).unwrap();
    let gpus = fake::backend_on(2).unwrap();
    let out = gpus.run(&apart, 5, Family::Exact, &CudaRunOptions { placement: Placement::Gpus, ..offset }).unwrap();
    assert!(!out.offset_starts, "one GPU per device: nothing to offset");
}

/// A fused plan's persistent kernel may run several CTAs per SM where every SM keeps room
/// for one more (the fake gives the H100's occupancies: the 64×64 tile 3, so 2 run and 3
/// are refused with the limit; the SIMT tile 2 and the 128×128 tile 1, so 2 are refused),
/// and the results do not change; the backend stays usable after a refusal.
#[test]
fn fused_kernels_take_more_ctas_per_sm_only_where_one_more_fits() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let p = Problem::new(OpKind::GemmRs, 4, 32, 40, 64, DType::F16, DType::F32).unwrap();
    let fused = build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap();
    // The tile kernels' CTAs (the Hopper engine off); the engine's own fill an SM.
    let tiles = CudaRunOptions { hopper: false, ..Default::default() };
    assert_right(&b, &fused, &CudaRunOptions { fused_ctas_per_sm: 2, ..tiles });
    let refused = |options: &CudaRunOptions, plan: &Plan, held: u32| {
        let e = b.run(plan, 5, Family::Exact, options).unwrap_err();
        assert!(matches!(e, CudaError::Unsupported { .. }), "{e}");
        let limit = format!("an SM holds {held} of them");
        assert!(
            e.to_string().contains(&limit) && e.to_string().contains(&format!("at most {}", (held - 1).max(1))),
            "{e}"
        );
    };
    refused(&CudaRunOptions { fused_ctas_per_sm: 3, ..tiles }, &fused, 3);
    refused(&CudaRunOptions { fused_ctas_per_sm: 2, wide_tiles: true, ..tiles }, &fused, 1);
    let f32_problem = Problem::new(OpKind::GemmRs, 4, 32, 40, 64, DType::F32, DType::F32).unwrap();
    let simt = build_plan(&f32_problem, Algorithm::Fused { chunks: 1 }).unwrap();
    refused(&CudaRunOptions { fused_ctas_per_sm: 2, ..tiles }, &simt, 2);
    // One 128×128 CTA fills an SM: one per SM, with SMs left free, runs.
    assert_right(&b, &fused, &CudaRunOptions { wide_tiles: true, ..tiles });
    refused(&CudaRunOptions { fused_ctas_per_sm: 2, ..Default::default() }, &fused, 1);
    assert_right(&b, &fused, &CudaRunOptions::default());
    // More SMs left free of the persistent kernels (the bench's variant): the same
    // results on fewer CTAs; none free where a CTA fills an SM, or all of them, refused.
    assert_right(&b, &fused, &CudaRunOptions { fused_free_sms: Some(16), ..Default::default() });
    assert_right(&b, &fused, &CudaRunOptions { fused_free_sms: Some(16), ..tiles });
    for free in [0, 132] {
        let e = b.run(&fused, 5, Family::Exact, &CudaRunOptions { fused_free_sms: Some(free), ..Default::default() });
        let e = e.unwrap_err();
        assert!(matches!(e, CudaError::Unsupported { .. }) && e.to_string().contains("free"), "{e}");
    }
    assert_right(&b, &fused, &CudaRunOptions::default());
}

/// A grid of clusters holds no more of them than the driver's occupancy query says the GPU
/// holds at once (one that found no room would run after the others, a tail the GEMM
/// sweep would read as the kernel's speed); the backend says how many; where none fits,
/// the GEMM is refused, naming the kernel's shared memory.
#[test]
fn cluster_grids_hold_only_the_clusters_the_gpu_holds_at_once() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    // Three row tiles (a phantom fourth in the second cluster) and K over two stages.
    let spec = GemmSpec {
        m: 384,
        n: 256,
        k: 128,
        input: DType::Bf16,
        output: DType::F32,
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    let plan = cmm_cuda::gemm_plan(&spec).unwrap();
    let pair = |tile| CudaRunOptions {
        gemm: GemmEngine::Hopper,
        hopper_tile: Some(tile),
        hopper_variant: HopperVariant::Pair,
        ..Default::default()
    };
    let choice = |tile| GemmChoice {
        engine: GemmEngine::Hopper,
        wide_tiles: false,
        hopper: true,
        hopper_tile: Some(tile),
        hopper_variant: HopperVariant::Pair,
    };
    const VAR: &str = "CMM_FAKE_CUDA_CLUSTERS";
    // The fake's 132 SMs hold 66 clusters; then as if only one fitted.
    for (fit, ctas) in [(None, 132), (Some(1), 2)] {
        match fit {
            Some(n) => std::env::set_var(VAR, n.to_string()),
            None => std::env::remove_var(VAR),
        }
        let Some(b) = fake_backend() else { return };
        let fit = fit.unwrap_or(66);
        assert!(b.summary().contains(&format!("clusters of two: {fit};")), "{}", b.summary());
        for tile in HopperTile::ALL {
            assert_right(&b, &plan, &pair(tile));
            match b.time_gemm_as(&spec, &choice(tile), 1) {
                Ok((_, GemmImpl::Hopper { ctas: got, variant: HopperVariant::Pair, .. })) => assert_eq!(got, ctas),
                other => panic!("{tile:?}: {other:?}"),
            }
        }
    }
    std::env::set_var(VAR, "0");
    let b = fake_backend();
    std::env::remove_var(VAR);
    let Some(b) = b else { return };
    for tile in HopperTile::ALL {
        let e = b.run(&plan, 5, Family::Exact, &pair(tile)).unwrap_err();
        let bytes = format!("{} bytes of shared memory", tile.shared_bytes(HopperVariant::Pair));
        assert!(matches!(e, CudaError::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("no cluster of two") && e.to_string().contains(&bytes), "{e}");
    }
    // The plain engine takes no clusters and runs.
    assert_right(&b, &plan, &CudaRunOptions { gemm: GemmEngine::Hopper, ..Default::default() });
    drop(b);
    // A failed query costs only its answer: the backend opens, assumes half the SMs, and
    // says so.
    std::env::set_var(VAR, "fail");
    let b = fake_backend();
    std::env::remove_var(VAR);
    let Some(b) = b else { return };
    assert!(b.summary().contains("clusters of two: 66 assumed ("), "{}", b.summary());
    assert_right(&b, &plan, &pair(HopperTile::Narrow));
}

/// With `time_ops`, every op of the run has a start and a duration inside the run, in its
/// lane's order; without it, none.
#[test]
fn timed_ops_cover_every_op_in_lane_order_inside_the_run() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    let plan = ring_plan();
    let out = b.run(&plan, 5, Family::Exact, &CudaRunOptions { time_ops: true, ..Default::default() }).unwrap();
    assert_eq!(out.op_times.len(), plan.op_count(), "every op of this ring moves something");
    let run_us = out.gpu_time.as_secs_f64() * 1e6;
    let mut last_end = std::collections::HashMap::new();
    let mut times = out.op_times.clone();
    times.sort_by_key(|(site, _, _)| (site.device, site.lane, site.index));
    for (site, start, duration) in times {
        assert!(start >= 0.0 && duration >= 0.0 && start + duration <= run_us + 1.0, "{site:?} {start} {duration}");
        let previous = last_end.insert((site.device, site.lane), start + duration).unwrap_or(0.0);
        assert!(start + 1e-3 >= previous, "{site:?} starts at {start} before its lane's previous op ends ({previous})");
    }
    assert!(b.run(&plan, 5, Family::Exact, &CudaRunOptions::default()).unwrap().op_times.is_empty());
}

/// The copies a plan asks of the copy engines under [`CopyIssue::PreferCopyEngines`]:
/// one batched copy per copy whose two sides are contiguous, one a row otherwise.
/// And how many of those copies are contiguous.
fn copy_engine_pieces(plan: &Plan) -> (u64, bool, u64) {
    let mut pieces = 0;
    let mut strided = false;
    let mut contiguous = 0;
    for (_, op) in plan.ops() {
        let cmm_core::plan::Op::Copy { src, dst, engine: cmm_core::plan::Engine::CopyEngine, .. } = op else {
            continue;
        };
        if src.is_empty() {
            continue;
        }
        let whole = src.rows == 1 || (src.stride == src.cols && dst.stride == dst.cols);
        strided |= !whole;
        contiguous += u64::from(whole);
        pieces += if whole { 1 } else { src.rows as u64 };
    }
    (pieces, strided, contiguous)
}

#[test]
fn copies_asked_of_the_copy_engines_take_the_batched_call_and_stay_right() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = fake_backend() else { return };
    assert!(b.batch_copies().is_ok(), "the fake driver has cuMemcpyBatchAsync");
    assert!(b.summary().contains("copies may ask for the copy engines"), "{}", b.summary());
    let mesh =
        cmm_core::mesh::MeshProblem::new(2, 2, cmm_core::mesh::Dataflow::Os, 64, 64, 64, DType::Bf16, DType::F32)
            .unwrap();
    let meshslice =
        cmm_core::mesh::build_mesh_plan(&mesh, cmm_core::mesh::MeshAlgorithm::MeshSlice { slices: 2, block: 16 })
            .unwrap();
    let plans = [ring_plan(), meshslice];
    assert!(plans.iter().any(|p| copy_engine_pieces(p).1), "one plan copies strided regions");
    assert_eq!(CudaRunOptions::default().copies, CopyIssue::Auto, "the default");
    let asked_with = |plan: &Plan, copies: CopyIssue| {
        let before = cmm_cuda::fake::copy_engine_copies().unwrap();
        assert_right(&b, plan, &CudaRunOptions { copies, ..Default::default() });
        cmm_cuda::fake::copy_engine_copies().unwrap() - before
    };
    for plan in &plans {
        let (pieces, _, contiguous) = copy_engine_pieces(plan);
        assert!(pieces > 0 && contiguous > 0, "{} copies through the copy engines", plan.name);
        assert_eq!(asked_with(plan, CopyIssue::PreferCopyEngines), pieces, "{}: every copy, a row each", plan.name);
        // The default asks the engines for the contiguous copies only; strided ones are
        // the driver's 2D copies, as every copy is when left to the driver.
        assert_eq!(asked_with(plan, CopyIssue::Auto), contiguous, "{}: the contiguous copies", plan.name);
        assert_eq!(asked_with(plan, CopyIssue::Driver), 0, "{}: none", plan.name);
    }
}

/// A held lane whose queue fills blocks the host before it opens the gate (an H200 held
/// it until the gate's deadline with 1,280 row copies on one lane behind it, 2026-11-27).
/// A strided copy asked of the copy engines is one driver call a row, and counts as that
/// many toward the gate's limit: that plan runs ungated, right; by default (one 2D copy
/// each) it runs gated.
#[test]
fn strided_copies_asked_of_the_copy_engines_count_a_call_a_row_toward_the_gate() {
    use cmm_cuda::lower::{lower, LowerOptions};
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some((b, _restore)) = fake_backend_loading(true) else { return };
    let mesh = cmm_core::mesh::MeshProblem::new(1, 4, cmm_core::mesh::Dataflow::Rs, 32, 48, 64, DType::F16, DType::F16)
        .unwrap();
    let plan = cmm_core::mesh::build_mesh_plan(&mesh, cmm_core::mesh::MeshAlgorithm::MeshSlice { slices: 4, block: 1 })
        .unwrap();
    let options = LowerOptions {
        gemm: GemmEngine::Auto,
        sync: SyncMode::Kernels,
        cublas_present: true,
        queues: 32,
        wide_tiles: false,
        hopper: None,
    };
    let lowered = lower(&plan, &options).unwrap();
    let most_calls = |copies: CopyIssue| lowered.most_calls_on_a_stream(copies);
    assert!(most_calls(CopyIssue::PreferCopyEngines) > 256, "{}", most_calls(CopyIssue::PreferCopyEngines));
    assert!(most_calls(CopyIssue::Auto) <= 256, "{}", most_calls(CopyIssue::Auto));
    for (copies, gated) in [(CopyIssue::PreferCopyEngines, false), (CopyIssue::Auto, true)] {
        let options = CudaRunOptions { copies, ..Default::default() };
        let out = b.run(&plan, 5, Family::Exact, &options).unwrap();
        assert_eq!(out.gated, gated, "{}", copies.key());
        assert_right(&b, &plan, &options);
    }
}

/// A scratch folder for kernel images, empty.
fn image_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cmm-kernel-images-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// ptxas (`CMM_PTXAS`, else on the PATH), or `None` after saying why the test skips (a
/// failure with `CMM_REQUIRE_NVRTC`: CI installs ptxas beside NVRTC).
fn ptxas_or_skip() -> Option<std::path::PathBuf> {
    let ptxas = std::env::var_os("CMM_PTXAS").map(std::path::PathBuf::from).unwrap_or_else(|| "ptxas".into());
    if std::process::Command::new(&ptxas).arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some(ptxas);
    }
    assert!(std::env::var_os("CMM_REQUIRE_NVRTC").is_none(), "CMM_REQUIRE_NVRTC is set but ptxas does not run");
    eprintln!("SKIPPED (needs ptxas; see `cargo xtask cuda-check`): the images are cubins");
    None
}

/// Prebuilt cubins (as `cargo xtask cuda-check` writes them for the GPU bundle) load in
/// place of NVRTC's PTX: here the small kernel files' images (ptxas takes seconds on
/// gemm.cu and half a minute on hopper.cu, which NVRTC compiles as before), and every
/// family's plan is right with them. An image the driver refuses sends every file back
/// to NVRTC, and the backend says which image and why.
#[test]
fn prebuilt_kernel_images_load_in_place_of_nvrtc_and_a_refused_one_falls_back() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    cmm_cuda::fake::install().unwrap();
    if !fake::nvrtc_or_skip() {
        return;
    }
    let small: Vec<_> = cmm_cuda::KERNEL_FILES.iter().filter(|k| !["gemm.cu", "hopper.cu"].contains(&k.name)).collect();
    // Refused, and compiled instead: a whole ELF64 image for no GPU (by the driver), and
    // a file that only starts as one (before the driver sees it).
    let refused = image_dir("refused");
    let mut header = vec![0u8; 64];
    header[..6].copy_from_slice(b"\x7fELF\x02\x01");
    for (bytes, why) in
        [(header, "CUDA_ERROR_INVALID_IMAGE"), (b"\x7fELF not a cubin".to_vec(), "not a little-endian ELF64")]
    {
        std::fs::write(refused.join(cmm_cuda::image_file_name(small[0], "sm_90a")), bytes).unwrap();
        let b = CudaBackend::with_kernel_images(1, Some(&refused)).unwrap();
        assert_eq!(b.prebuilt_kernel_files(), 0, "{}", b.summary());
        assert!(b.summary().contains("were refused") && b.summary().contains(why), "{}", b.summary());
        assert_right(&b, &ring_plan(), &CudaRunOptions::default());
    }
    // A folder without an image of these sources: compiled, and said so.
    let empty = image_dir("empty");
    let b = CudaBackend::with_kernel_images(1, Some(&empty)).unwrap();
    assert_eq!(b.prebuilt_kernel_files(), 0, "{}", b.summary());
    assert!(b.summary().contains("kernels compiled by NVRTC (no sm_90a image of these sources in"), "{}", b.summary());
    drop(b);
    let _ = std::fs::remove_dir_all(&empty);
    let Some(ptxas) = ptxas_or_skip() else { return };
    let images = image_dir("small");
    for kernel in &small {
        let ptx = images.join(format!("{}.ptx", kernel.name));
        std::fs::write(&ptx, cmm_cuda::compile(kernel, "sm_90a").unwrap()).unwrap();
        let out = std::process::Command::new(&ptxas)
            .arg("-arch=sm_90a")
            .arg(&ptx)
            .arg("-o")
            .arg(images.join(cmm_cuda::image_file_name(kernel, "sm_90a")))
            .output()
            .unwrap();
        assert!(out.status.success(), "ptxas on {}: {}", kernel.name, String::from_utf8_lossy(&out.stderr));
    }
    let b = CudaBackend::with_kernel_images(1, Some(&images)).unwrap();
    assert_eq!(b.prebuilt_kernel_files(), small.len(), "{}", b.summary());
    let said = format!("{} of {} kernel files from prebuilt sm_90a images", small.len(), cmm_cuda::KERNEL_FILES.len());
    assert!(b.summary().contains(&said), "{}", b.summary());
    for plan in fake::family_plans() {
        assert_right(&b, &plan, &CudaRunOptions::default());
    }
    drop(b);
    // A truncated image (a copy cut short) is refused before the driver reads past it.
    let file = images.join(cmm_cuda::image_file_name(small[0], "sm_90a"));
    let whole = std::fs::read(&file).unwrap();
    std::fs::write(&file, &whole[..whole.len() / 2]).unwrap();
    let b = CudaBackend::with_kernel_images(1, Some(&images)).unwrap();
    assert_eq!(b.prebuilt_kernel_files(), 0, "{}", b.summary());
    assert!(b.summary().contains("truncated?"), "{}", b.summary());
    let _ = std::fs::remove_dir_all(&refused);
    let _ = std::fs::remove_dir_all(&images);
}
