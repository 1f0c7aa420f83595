//! The conformance checks on the CUDA backend, when this machine has a GPU and NVRTC;
//! otherwise each test prints why it skips (no GPU machine runs CI).

mod common;

use cmm_cuda::CudaBackend;

fn cuda() -> Option<CudaBackend> {
    match CudaBackend::new(1) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED (GPU test): {e}");
            None
        }
    }
}

#[test]
fn corpus_passes() {
    if let Some(b) = cuda() {
        common::corpus_passes(&b);
    }
}

#[test]
fn reversed_ring_fails() {
    if let Some(b) = cuda() {
        common::reversed_ring_fails(&b);
    }
}

#[test]
fn missing_signal_deadlocks() {
    if let Some(b) = cuda() {
        common::missing_signal_deadlocks(&b);
    }
}
