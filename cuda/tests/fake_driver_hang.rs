//! The one fake-driver test that leaves the fake GPU stuck, alone in its process: a
//! stream-memory-op wait whose signal was lost can neither finish nor be aborted, so
//! the run must end as `CudaError::Hung` within its limits (never a hang of the host),
//! and the backend must refuse every later run rather than run beside stuck work.

use std::time::{Duration, Instant};

use cmm_core::generator::Family;
use cmm_core::{build_plan, Algorithm, DType, OpKind, Problem};
use cmm_cuda::fake::Injection;
use cmm_cuda::{CudaError, CudaExecutor, CudaRunOptions, SyncMode};

mod fake;

#[test]
fn a_lost_stream_write_is_reported_hung_and_later_runs_are_refused() {
    let Some(b) = fake::backend_on(1) else { return };
    let p = Problem::new(OpKind::AgGemm, 2, 32, 48, 32, DType::Bf16, DType::F32).unwrap();
    let plan = build_plan(&p, Algorithm::Ring).unwrap();
    let second = Duration::from_secs(1);
    let options = CudaRunOptions {
        sync: SyncMode::StreamMemOps,
        wait_timeout: second,
        run_timeout: second,
        ..Default::default()
    };
    b.run(&plan, 5, Family::Exact, &options).unwrap_or_else(|e| panic!("before the injection: {e}"));
    // At D = 2 each device's receive semaphore gets one write: dropping the first leaves
    // its wait unsatisfiable (at larger D a later write of the running total covers it).
    cmm_cuda::fake::inject(Injection::DropStreamWrite, 1).unwrap();
    let start = Instant::now();
    match b.run(&plan, 5, Family::Exact, &options) {
        Err(CudaError::Hung { reason, .. }) => {
            assert!(reason.contains("stream-memory-op wait cannot be aborted"), "{reason}")
        }
        other => panic!("a lost stream write must leave the run hung, got {}", fake::outcome(&other)),
    }
    // The run's limit, then the drain's (wait timeout + 5 s), and no more.
    assert!(start.elapsed() < Duration::from_secs(15), "{:?}", start.elapsed());
    match b.run(&plan, 5, Family::Exact, &CudaRunOptions::default()) {
        Err(CudaError::Hung { .. }) => {}
        other => panic!("a hung backend must refuse later runs, got {}", fake::outcome(&other)),
    }
}
