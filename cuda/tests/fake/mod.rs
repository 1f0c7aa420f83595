//! Shared by the fake-driver tests (`fake_driver.rs`, `fake_driver_hang.rs`,
//! `given_buffers.rs`).
#![allow(dead_code)] // each test binary that includes this module uses a part of it

use cmm_cuda::{fake, nvrtc_available, CudaBackend, CudaError, CudaRunOutput};

/// The backend on the fake driver's first `gpus` GPUs (it has two), or `None` after
/// saying why (no NVRTC here).
pub fn backend_on(gpus: usize) -> Option<CudaBackend> {
    fake::install().unwrap_or_else(|e| panic!("{e}"));
    if !nvrtc_available() {
        let required = std::env::var_os("CMM_REQUIRE_NVRTC").is_some();
        assert!(!required, "CMM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded");
        eprintln!("SKIPPED (needs libnvrtc; see `cargo xtask cuda-check`): the backend compiles its kernels with it");
        return None;
    }
    Some(CudaBackend::new(gpus).unwrap_or_else(|e| panic!("{e}")))
}

/// A run's outcome in one line (a successful run's buffers would flood the message).
pub fn outcome(result: &Result<CudaRunOutput, CudaError>) -> String {
    match result {
        Ok(out) => format!("a finished run ({:?} of GPU time)", out.gpu_time),
        Err(e) => e.to_string(),
    }
}
