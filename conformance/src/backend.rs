//! Executors the corpus runs on: the wgpu reference, and the CPU twin for fast tests.

use cmm_core::cpu::{self, Memory};
use cmm_core::schedule::{Deadlock, Order};
use cmm_core::{Family, Plan};
use cmm_reference::{Reference, ReferenceError, RunOptions};
use thiserror::Error;

/// Why a backend could not run a plan.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The plan deadlocks (found by the shared scheduler before any data moves).
    #[error(transparent)]
    Deadlock(#[from] Deadlock),
    /// The backend reported an error (its text is kept as is).
    #[error("{backend}: {message}")]
    Failed {
        /// The backend's name.
        backend: String,
        /// Its error message.
        message: String,
    },
}

/// An executor of plans.
pub trait Backend {
    /// Short name for reports.
    fn name(&self) -> String;

    /// Runs `plan` with inputs generated from `(seed, family)`, its lanes interleaved in
    /// `order`, and returns every device's memory, `[device][buffer]` words as in
    /// [`cmm_core::cpu::Memory`].
    fn run(&self, plan: &Plan, seed: u32, family: Family, order: Order) -> Result<Memory, BackendError>;
}

/// The CPU twin of the reference ([`cmm_core::cpu::run`]): same schedule, same
/// per-op arithmetic, no GPU. Used by the unit tests.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuTwin;

impl Backend for CpuTwin {
    fn name(&self) -> String {
        "cpu-twin".into()
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, order: Order) -> Result<Memory, BackendError> {
        match cpu::run_with(plan, seed, family, order) {
            Ok(memory) => Ok(memory),
            Err(cpu::CpuError::Deadlock(deadlock)) => Err(BackendError::Deadlock(deadlock)),
            Err(e) => Err(BackendError::Failed { backend: "cpu-twin".into(), message: e.to_string() }),
        }
    }
}

impl Backend for Reference {
    fn name(&self) -> String {
        format!("reference on {}", self.adapter_summary())
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, order: Order) -> Result<Memory, BackendError> {
        match Reference::run_with(self, plan, seed, family, &RunOptions { order, ..RunOptions::default() }) {
            Ok(out) => Ok(out.buffers),
            Err(ReferenceError::Deadlock(deadlock)) => Err(BackendError::Deadlock(deadlock)),
            Err(e) => Err(BackendError::Failed { backend: "reference".into(), message: e.to_string() }),
        }
    }
}

/// The CUDA backend with the options of its runs. Its streams really run
/// concurrently, so `order` does not apply: every run is one hardware interleaving, and
/// `--schedules N` compares N runs.
#[derive(Debug)]
pub struct Cuda {
    /// The backend.
    pub backend: cmm_cuda::CudaBackend,
    /// How each case runs (GEMM engine, sync mode, time limits).
    pub options: cmm_cuda::CudaRunOptions,
}

impl Backend for Cuda {
    fn name(&self) -> String {
        let sync = match self.options.sync {
            cmm_cuda::SyncMode::Kernels => "kernel waits",
            cmm_cuda::SyncMode::StreamMemOps => "stream memory ops",
        };
        format!("cuda on {}; sync: {sync}", self.backend.summary())
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, _order: Order) -> Result<Memory, BackendError> {
        match self.backend.run(plan, seed, family, &self.options) {
            Ok(out) => Ok(out.buffers),
            Err(cmm_cuda::CudaError::Deadlock(deadlock)) => Err(BackendError::Deadlock(deadlock)),
            Err(e) => Err(BackendError::Failed { backend: "cuda".into(), message: e.to_string() }),
        }
    }
}
