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

    /// Whether the backend can hold `plan` at all, checked before the oracle and the
    /// run (an adapter's binding limit); the default says yes.
    fn check_fits(&self, plan: &Plan) -> Result<(), BackendError> {
        let _ = plan;
        Ok(())
    }

    /// This backend as one that several threads may run plans on at once, where that
    /// makes a batch of independent runs faster (the CPU twin: a small plan's run uses
    /// one core); `None` (the default) where runs go one at a time: an adapter already
    /// spreads one run over the machine, and the CUDA executor owns its streams.
    fn concurrent(&self) -> Option<&(dyn Backend + Sync)> {
        None
    }

    /// Whether the outputs are given (a user's files) rather than computed by running
    /// the plan: a golden mismatch then means the user's kernel, not an executor.
    fn given_outputs(&self) -> bool {
        false
    }
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

    fn concurrent(&self) -> Option<&(dyn Backend + Sync)> {
        Some(self)
    }
}

impl Backend for Reference {
    fn name(&self) -> String {
        format!("reference on {}", self.adapter_summary())
    }

    fn check_fits(&self, plan: &Plan) -> Result<(), BackendError> {
        self.gpu()
            .check_fits(plan)
            .map_err(|e| BackendError::Failed { backend: "reference".into(), message: e.to_string() })
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, order: Order) -> Result<Memory, BackendError> {
        match Reference::run_with(self, plan, seed, family, &RunOptions { order, ..RunOptions::default() }) {
            Ok(out) => Ok(out.buffers),
            Err(ReferenceError::Deadlock(deadlock)) => Err(BackendError::Deadlock(deadlock)),
            Err(e) => Err(BackendError::Failed { backend: "reference".into(), message: e.to_string() }),
        }
    }
}

/// The CUDA backend (or its host twin, [`cmm_cuda::HostTwin`]: the same lowering and
/// kernel sources compiled by the system C++ compiler, one OS thread per stream) with
/// the options of its runs. Its streams really run concurrently, so `order` does not
/// apply: every run is one interleaving, and `--schedules N` compares N runs.
#[derive(Debug)]
pub struct Cuda<E = cmm_cuda::CudaBackend> {
    /// The backend.
    pub backend: E,
    /// How each case runs (GEMM engine, sync mode, time limits).
    pub options: cmm_cuda::CudaRunOptions,
    /// How many GEMMs each engine ran, over every run so far.
    engines: std::sync::Mutex<cmm_cuda::GemmCounts>,
}

impl<E> Cuda<E> {
    /// `backend` running every case with `options`.
    pub fn new(backend: E, options: cmm_cuda::CudaRunOptions) -> Self {
        Cuda { backend, options, engines: Default::default() }
    }

    /// How many GEMMs each engine ran, over every run so far.
    pub fn engines(&self) -> cmm_cuda::GemmCounts {
        *self.engines.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<E: cmm_cuda::CudaExecutor> Backend for Cuda<E> {
    fn name(&self) -> String {
        let sync = match self.options.sync {
            cmm_cuda::SyncMode::Kernels => "kernel waits",
            cmm_cuda::SyncMode::StreamMemOps => "stream memory ops",
        };
        let copies = match self.options.copies {
            cmm_cuda::CopyIssue::PreferCopyEngines => "; copies asked of the copy engines",
            cmm_cuda::CopyIssue::Driver => "; copies left to the driver",
            _ => "",
        };
        format!("{}; sync: {sync}{copies}", self.backend.describe())
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, _order: Order) -> Result<Memory, BackendError> {
        match self.backend.run(plan, seed, family, &self.options) {
            Ok(out) => {
                let mut tally = self.engines.lock().unwrap_or_else(|p| p.into_inner());
                *tally += out.gemms;
                Ok(out.buffers)
            }
            Err(cmm_cuda::CudaError::Deadlock(deadlock)) => Err(BackendError::Deadlock(deadlock)),
            Err(e) => Err(BackendError::Failed { backend: "cuda".into(), message: e.to_string() }),
        }
    }
}

/// A user's own outputs, read from `.npy` files instead of running the plan: device d's
/// result buffer `B` of case `C` is `DIR/C/dd_B.npy`, the layout `cmm golden` and
/// `--export` write (see `index.json`). Every other buffer is poison. With it the
/// conformance runner judges a kernel written elsewhere by the project's rules
/// (`cmm check`).
#[derive(Clone, Debug)]
pub struct OutputFiles {
    dir: std::path::PathBuf,
    /// Plan name → case name (a backend sees plans, the files are named by case).
    cases: std::collections::BTreeMap<String, String>,
}

impl OutputFiles {
    /// Outputs of `cases` under `dir`.
    pub fn new(dir: &std::path::Path, cases: &[crate::case::Case]) -> Self {
        let cases = cases.iter().filter_map(|c| Some((c.plan().ok()?.name, c.name.clone()))).collect();
        OutputFiles { dir: dir.to_path_buf(), cases }
    }
}

impl Backend for OutputFiles {
    fn name(&self) -> String {
        format!("outputs read from {}", self.dir.display())
    }

    fn given_outputs(&self) -> bool {
        true
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, _order: Order) -> Result<Memory, BackendError> {
        let _ = (seed, family);
        let failed = |message: String| BackendError::Failed { backend: "outputs".into(), message };
        let case = self.cases.get(&plan.name).ok_or_else(|| failed(format!("no case has plan `{}`", plan.name)))?;
        (0..plan.devices)
            .map(|d| {
                plan.buffers
                    .iter()
                    .map(|b| {
                        if !b.role.is_result() {
                            return Ok(vec![b.dtype.poison_bits(); b.len()]);
                        }
                        let path = self.dir.join(case).join(format!("d{d}_{}.npy", b.name));
                        crate::npy::read_npy_file(&path, b.dtype, b.rows_on(d), b.cols)
                            .map_err(|e| failed(format!("{}: {e}", path.display())))
                    })
                    .collect()
            })
            .collect()
    }
}

/// A user's outputs handed over in memory rather than in files (the Python package):
/// each result buffer's words per device, by buffer name. Every other buffer is poison,
/// and a result buffer not given is poison too, so it fails as unwritten.
#[derive(Clone, Debug, Default)]
pub struct GivenOutputs {
    /// Buffer name → per device, its words (as executor memory holds them).
    pub buffers: std::collections::BTreeMap<String, Vec<Vec<u32>>>,
}

impl Backend for GivenOutputs {
    fn name(&self) -> String {
        "outputs given in memory".into()
    }

    fn given_outputs(&self) -> bool {
        true
    }

    fn run(&self, plan: &Plan, seed: u32, family: Family, _order: Order) -> Result<Memory, BackendError> {
        let _ = (seed, family);
        let failed = |message: String| BackendError::Failed { backend: "outputs".into(), message };
        (0..plan.devices)
            .map(|d| {
                plan.buffers
                    .iter()
                    .map(|b| match self.buffers.get(&b.name).filter(|_| b.role.is_result()) {
                        None => Ok(vec![b.dtype.poison_bits(); b.len()]),
                        Some(devices) => {
                            let words = devices.get(d).ok_or_else(|| {
                                failed(format!(
                                    "`{}`: {} device(s) given, the plan has {}",
                                    b.name,
                                    devices.len(),
                                    plan.devices
                                ))
                            })?;
                            if words.len() != b.len_on(d) {
                                return Err(failed(format!(
                                    "`{}` on device {d}: {} elements given, the output is {}×{}",
                                    b.name,
                                    words.len(),
                                    b.rows_on(d),
                                    b.cols
                                )));
                            }
                            Ok(words.clone())
                        }
                    })
                    .collect()
            })
            .collect()
    }
}
