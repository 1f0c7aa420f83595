//! The conformance checks on the CUDA backend, when this machine has a GPU and NVRTC;
//! otherwise each test prints why it skips (no GPU machine runs CI), or fails with
//! `CMM_REQUIRE_GPU=1`.

mod common;

use cmm_conformance::Cuda;
use cmm_cuda::{gpu_or_skip, CudaRunOptions, SyncMode};

fn cuda(sync: SyncMode) -> Option<Cuda> {
    gpu_or_skip().map(|backend| Cuda::new(backend, CudaRunOptions { sync, ..Default::default() }))
}

#[test]
fn corpus_passes() {
    if let Some(b) = cuda(SyncMode::Kernels) {
        common::corpus_passes(&b);
    }
}

#[test]
fn corpus_passes_with_stream_memory_ops() {
    if let Some(b) = cuda(SyncMode::StreamMemOps) {
        common::corpus_passes(&b);
    }
}

#[test]
fn baselines_pass_with_their_sums_beside() {
    for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
        if let Some(b) = cuda(sync) {
            common::baselines_pass_with_their_sums_beside(&b);
        }
    }
}

#[test]
fn reversed_ring_fails() {
    if let Some(b) = cuda(SyncMode::Kernels) {
        common::reversed_ring_fails(&b);
    }
}

#[test]
fn missing_signal_deadlocks() {
    if let Some(b) = cuda(SyncMode::Kernels) {
        common::missing_signal_deadlocks(&b);
    }
}
