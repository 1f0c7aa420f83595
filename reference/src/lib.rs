//! cmm-reference: the deterministic wgpu executor. D virtual devices are D sets of a
//! plan's symmetric buffers on one adapter (a GPU, or the CPU through Mesa lavapipe);
//! semaphores live in the host scheduler and are mirrored on the GPU for checks.
//!
//! "Get a device" ([`Gpu::new`], [`Gpu::from_device`]) is separate from "run on this
//! device" ([`Reference::run`]) so that tests and tools can pass their own device.

mod context;
mod error;
mod executor;
pub mod params;

use std::time::Duration;

use cmm_core::generator::Family;
use cmm_core::plan::{BufferRole, Plan, PlanBuilder};
use cmm_core::DType;

pub use context::{stage_sources, Gpu, BACKEND_VAR, MESA_BACKENDS};
pub use error::ReferenceError;
pub use executor::{OpTiming, RunOptions, RunOutput, GEMM_K_PER_DISPATCH};

/// The reference executor on one device.
#[derive(Debug)]
pub struct Reference {
    gpu: Gpu,
}

impl Reference {
    /// Selects an adapter (Vulkan, then GL, then any) and builds the pipelines.
    pub fn new() -> Result<Reference, ReferenceError> {
        Ok(Reference { gpu: Gpu::new()? })
    }

    /// A reference on each of the backends in `names` (as [`BACKEND_VAR`] names them)
    /// that this machine has, for tests that hold every backend to one claim (each
    /// reaches the driver through its own shader compiler). A missing one is skipped
    /// with a line on stderr, unless `CI` is set: CI installs Mesa's Vulkan and GL
    /// drivers, so there a missing one is the error.
    pub fn on_each_backend(names: &[&str]) -> Result<Vec<Reference>, ReferenceError> {
        let mut found = Vec::new();
        for name in names {
            match Gpu::on_backends(name) {
                Ok(gpu) => found.push(Reference { gpu }),
                Err(e) if std::env::var_os("CI").is_some() => return Err(e),
                Err(e) => eprintln!("{name}: skipped: {e}"),
            }
        }
        Ok(found)
    }

    /// Uses a device the caller already has.
    pub fn with_gpu(gpu: Gpu) -> Reference {
        Reference { gpu }
    }

    /// The device in use.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// One line naming the adapter that runs the work.
    pub fn adapter_summary(&self) -> String {
        self.gpu.summary()
    }

    /// Runs `plan` with inputs from `(seed, family)`.
    pub fn run(&self, plan: &Plan, seed: u32, family: Family) -> Result<RunOutput, ReferenceError> {
        self.gpu.run(plan, seed, family)
    }

    /// Runs `plan` with explicit options (interleaving, fault injection).
    pub fn run_with(
        &self,
        plan: &Plan,
        seed: u32,
        family: Family,
        options: &RunOptions,
    ) -> Result<RunOutput, ReferenceError> {
        self.gpu.run_with(plan, seed, family, options)
    }

    /// Generates `rows × cols` elements of tensor `tensor` on the device (the WGSL
    /// generator), returning their bits; used to prove the WGSL and Rust generators agree.
    pub fn generate(
        &self,
        rows: usize,
        cols: usize,
        tensor: u32,
        dtype: DType,
        seed: u32,
        family: Family,
    ) -> Result<Vec<u32>, ReferenceError> {
        let mut b = PlanBuilder::new("generate", 1);
        b.buffer("X", dtype, rows, cols, BufferRole::whole_tensor(tensor, cols));
        let plan = b.finish()?;
        Ok(self.run(&plan, seed, family)?.buffers.remove(0).remove(0))
    }

    /// Throughput of the GEMM shader in GFLOP/s: `reps` back-to-back `m×k · k×n` GEMMs
    /// with `dtype` inputs and f32 output, timed from submission to completion.
    pub fn gemm_gflops(&self, m: usize, n: usize, k: usize, dtype: DType, reps: usize) -> Result<f64, ReferenceError> {
        let plan = cmm_core::plan::gemm_benchmark(m, n, k, dtype, reps)?;
        let out = self.run(&plan, 1, Family::Realistic)?;
        let secs = out.execute.max(Duration::from_nanos(1)).as_secs_f64();
        Ok(2.0 * (m * n * k) as f64 * reps.max(1) as f64 / secs / 1e9)
    }
}
