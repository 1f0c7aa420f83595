//! cmm-cuda: the CUDA backend. Plans run on GPUs with semaphores in device memory:
//! D virtual devices on one GPU (separate allocations, each lane on its own stream) or
//! D real GPUs with peer access; a device sees its peers only through a table of
//! peer pointers. Kernels (`cuda/kernels/*.cu`) are compiled at run time with NVRTC for
//! the GPU's exact architecture.
//!
//! Every entry point first checks that libcuda / libnvrtc can be loaded (cudarc panics
//! otherwise) and returns [`CudaError::NoCudaDriver`] / [`CudaError::NoNvrtc`].

mod error;
pub mod kernels;

pub use error::CudaError;
pub use kernels::{
    compile, compile_fresh, image_file_name, nvrtc_available, KernelFile, KERNEL_FILES, KERNEL_IMAGES_VAR,
};
mod backend;
mod cpp;
pub mod fake;
mod given;
pub mod host;
mod launch;
pub mod lower;
mod memory;
mod options;
mod pool;
mod rank;

pub use host::HostTwin;
pub use launch::{FusedWaits, Kernel};

pub use backend::{cublas_present, driver_environment_unless_chosen, gemm_plan, probe, CudaBackend, GemmChoice};
pub use given::{GivenBuffer, GIVEN_ALIGNMENT};
pub use lower::{
    hopper_rule, GemmCounts, GemmEngine, GemmFacts, GemmImpl, HopperKernel, HopperTile, HopperVariant, SyncMode,
};
pub use memory::DeviceBuffer;
pub use options::{
    CopyIssue, CudaRunOptions, CudaRunOutput, GemmSpec, OpTimes, Placement, ReadBack, EMULATED_WAIT_TIMEOUT,
    MAX_DEADLINE,
};
pub use pool::{serve_rank_worker, RankPool, WorkerCommand};
pub use rank::{Rendezvous, MAX_RANKS, RENDEZVOUS_VAR};

/// What runs a plan the CUDA way: the GPU backend ([`CudaBackend`]) or its host twin
/// ([`HostTwin`]), which share the lowering and the kernels.
pub trait CudaExecutor {
    /// One line naming what runs the plans, for reports.
    fn describe(&self) -> String;

    /// Runs `plan` with inputs generated from `(seed, family)`; see [`CudaRunOptions`].
    fn run(
        &self,
        plan: &cmm_core::Plan,
        seed: u32,
        family: cmm_core::Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError>;

    /// Whether GEMMs can run on the Hopper engine here ([`CudaRunOptions::hopper`]).
    fn has_hopper_engine(&self) -> bool {
        false
    }
}

/// The variable that turns every "no GPU here" skip of a GPU test into a failure.
pub const REQUIRE_GPU_VAR: &str = "CMM_REQUIRE_GPU";

/// For tests that need a GPU: the backend on GPU 0, or `None` after printing why the
/// test skips. With `CMM_REQUIRE_GPU=1` a missing GPU, driver or NVRTC is a panic with
/// the reason instead, so a GPU machine cannot pass by skipping. With `CMM_FAKE_CUDA=1`
/// the GPU is the fake driver's ([`fake`]), on the CPU.
pub fn gpu_or_skip() -> Option<CudaBackend> {
    match CudaBackend::new(1) {
        Ok(backend) => Some(backend),
        Err(e) => {
            let required = std::env::var(REQUIRE_GPU_VAR).is_ok_and(|v| v == "1");
            assert!(!required, "{REQUIRE_GPU_VAR}=1 but the CUDA backend cannot start: {e}");
            eprintln!("SKIPPED (GPU test; set {REQUIRE_GPU_VAR}=1 to make this a failure): {e}");
            None
        }
    }
}
