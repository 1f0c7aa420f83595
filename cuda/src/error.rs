//! Errors of the CUDA backend.

use cmm_core::plan::PlanError;
use cmm_core::schedule::Deadlock;
use thiserror::Error;

/// Why the CUDA backend could not compile or run.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (libcuda) is not installed or cannot be loaded.
    #[error("no CUDA driver: libcuda could not be loaded (install the NVIDIA driver; this machine has no GPU driver)")]
    NoCudaDriver,
    /// The driver loaded but reports no usable GPU.
    #[error("no CUDA device: {reason}")]
    NoCudaDevice {
        /// What the driver said.
        reason: String,
    },
    /// The NVRTC library (libnvrtc) is not installed or cannot be loaded.
    #[error("NVRTC (libnvrtc.so.13) cannot be loaded: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc==13.0.88` and add its nvidia/cu13/lib to LD_LIBRARY_PATH")]
    NoNvrtc,
    /// NVRTC rejected a kernel file.
    #[error("NVRTC failed to compile kernel file {kernel} for {arch}: {message}\n{log}")]
    Compile {
        /// The kernel file.
        kernel: &'static str,
        /// The target architecture.
        arch: String,
        /// NVRTC's error.
        message: String,
        /// The compiler log.
        log: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error while {during}: {message}")]
    Driver {
        /// What the backend was doing.
        during: String,
        /// The driver's message.
        message: String,
    },
    /// The plan is malformed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The plan cannot finish (found by the scheduler before anything runs).
    #[error(transparent)]
    Deadlock(#[from] Deadlock),
    /// A wait did not complete before its deadline on the GPU.
    #[error("wait timed out after {timeout_ms} ms on device {device} lane {lane} op {index}: semaphore {semaphore} awaited >= {awaited}, current {current}")]
    WaitTimeout {
        /// Device.
        device: usize,
        /// Lane name.
        lane: String,
        /// Index of the wait in its lane.
        index: usize,
        /// Semaphore name.
        semaphore: String,
        /// The value awaited.
        awaited: u32,
        /// The value seen when the deadline passed.
        current: u32,
        /// The deadline.
        timeout_ms: u64,
    },
    /// The plan needs more device memory than the GPU has free.
    #[error("plan `{plan}` needs {needed} bytes of device memory, {free} are free")]
    OutOfMemory {
        /// Plan name.
        plan: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes free.
        free: u64,
    },
    /// An op the backend cannot run (sizes beyond a kernel's indexing).
    #[error("plan `{plan}`: {what}")]
    Unsupported {
        /// Plan name.
        plan: String,
        /// What, with the sizes.
        what: String,
    },
}

impl CudaError {
    /// Wraps a driver error with what was being done.
    pub(crate) fn driver(during: impl Into<String>, e: impl std::fmt::Display) -> CudaError {
        CudaError::Driver { during: during.into(), message: e.to_string() }
    }
}
