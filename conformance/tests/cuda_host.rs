//! The conformance checks on the host twin of the CUDA backend: its lowering and the
//! kernels of `cuda/kernels/*.cu`, compiled by the system C++ compiler and run on the
//! CPU with a thread per stream (`cmm_cuda::host`). No GPU needed; the same test bodies
//! as the reference and the GPU.

mod common;

use cmm_conformance::Cuda;
use cmm_cuda::{CudaRunOptions, HostTwin, SyncMode};

fn host(sync: SyncMode) -> Cuda<HostTwin> {
    let backend = HostTwin::new().unwrap_or_else(|e| panic!("{e}"));
    Cuda { backend, options: CudaRunOptions { sync, ..Default::default() } }
}

#[test]
fn corpus_passes() {
    common::corpus_passes(&host(SyncMode::Kernels));
}

#[test]
fn corpus_passes_with_stream_memory_ops() {
    common::corpus_passes(&host(SyncMode::StreamMemOps));
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
