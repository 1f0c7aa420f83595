//! Errors of the CUDA backend.

use cmm_core::plan::PlanError;
use cmm_core::schedule::Deadlock;
use cmm_core::verify::queues::EnqueueError;
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
    /// A routing table of the run is malformed or overflows the plan's tables.
    #[error(transparent)]
    Routing(#[from] cmm_core::moe::RoutingError),
    /// The plan cannot finish (found by the scheduler before anything runs).
    #[error(transparent)]
    Deadlock(#[from] Deadlock),
    /// The starts of the plan's devices cannot be offset ([`crate::CudaRunOptions::offset_starts`]).
    #[error(transparent)]
    Offset(#[from] cmm_core::emulate::OffsetError),
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
    /// A caller's buffer does not fit the plan or is not where it should be
    /// ([`crate::CudaBackend::run_given`]).
    #[error("plan `{plan}`: {what}")]
    Binding {
        /// Plan name.
        plan: String,
        /// Which buffer and what is wrong with it.
        what: String,
    },
    /// Two GPUs the plan reaches across lack a capability it needs (checked before a
    /// multi-GPU run, so that a missing one is never a hang).
    #[error("plan `{plan}`: device {from} (GPU {gpu_from}) reaches device {to} (GPU {gpu_to}), but the GPUs have no {missing}")]
    PeerCapability {
        /// Plan name.
        plan: String,
        /// The device whose ops reach across.
        from: usize,
        /// The device they reach.
        to: usize,
        /// The GPU running `from`.
        gpu_from: usize,
        /// The GPU running `to`.
        gpu_to: usize,
        /// What is missing.
        missing: &'static str,
    },
    /// The ranks of a one-process-per-device run could not meet
    /// ([`crate::CudaBackend::run_rank`]): one did not come, left, or runs another job.
    #[error("rank {rank} of {world} (rendezvous {}): {what}", socket.display())]
    Rendezvous {
        /// This process's rank.
        rank: usize,
        /// The ranks.
        world: usize,
        /// The rendezvous socket.
        socket: std::path::PathBuf,
        /// What went wrong, naming the rank at fault where one is.
        what: String,
    },
    /// Ranks of a run one process per device failed ([`crate::RankPool`]): each with its
    /// rank (`None`: the pool itself) and its error in words.
    #[error("{}", describe_failures(failures))]
    Ranks {
        /// Rank and message of each failure, in rank order.
        failures: Vec<(Option<usize>, String)>,
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
    /// An op the backend cannot run (sizes beyond a kernel's indexing, a GEMM cuBLAS
    /// cannot take under [`crate::GemmEngine::Cublas`]).
    #[error("plan `{plan}`: {what}")]
    Unsupported {
        /// Plan name.
        plan: String,
        /// What, with the sizes.
        what: String,
    },
    /// The enqueue order could hang on the hardware queues (or is malformed); found
    /// before anything is launched.
    #[error(transparent)]
    Enqueue(#[from] EnqueueError),
    /// cuBLAS was required ([`crate::GemmEngine::Cublas`]) but libcublas cannot be loaded.
    #[error("cuBLAS was asked for but libcublas.so.13 cannot be loaded (install the CUDA toolkit or `pip install nvidia-cublas`, add its lib directory to LD_LIBRARY_PATH, or use GemmEngine::Auto / TileKernel)")]
    NoCublas,
    /// An environment variable the backend reads holds a value it cannot use.
    #[error("{variable}={value}: expected {expected}")]
    Environment {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
    /// The run did not finish within its time limit; the waits were aborted and the
    /// streams drained, so the backend stays usable.
    #[error("plan `{plan}` did not finish within {limit_ms} ms (aborted; {pending})")]
    RunTimeout {
        /// Plan name.
        plan: String,
        /// The limit.
        limit_ms: u64,
        /// What was still waiting.
        pending: String,
    },
    /// Work on the GPU could not be stopped (a stream-memory-op wait that nothing will
    /// satisfy); the backend refuses every later run, and only a new process recovers.
    #[error("the GPU is stuck in plan `{plan}` ({reason}); this backend refuses further runs: restart the process")]
    Hung {
        /// The plan that hung.
        plan: String,
        /// Why.
        reason: String,
    },
    /// A kernel fault (illegal address, launch failure, …) destroyed the CUDA context.
    /// The backend creates a fresh context at its next run.
    #[error("the CUDA context was lost while {during}: {message} (the next run starts a fresh context)")]
    ContextLost {
        /// What the backend was doing.
        during: String,
        /// The driver's message.
        message: String,
    },
    /// The host twin of the kernels ([`crate::host`]) could not be built or loaded.
    #[error("the host twin of the CUDA kernels could not be built: {message} (compiler `{compiler}`; set CXX to another C++17 compiler){log}")]
    HostBuild {
        /// The C++ compiler.
        compiler: String,
        /// What failed.
        message: String,
        /// The compiler's output, if it ran.
        log: String,
    },
    /// The host twin found a kernel's write outside every buffer: in the guard bytes
    /// after `buffer` (or before it, for the first).
    #[error("plan `{plan}`: a kernel wrote outside buffer {buffer} of device {device} ({detail}), found by the host twin's guard bytes")]
    OutOfBounds {
        /// Plan name.
        plan: String,
        /// Device.
        device: usize,
        /// The buffer the write overran.
        buffer: String,
        /// Where.
        detail: String,
    },
    /// A kernel run by the host twin reported an error (a barrier divergence, an empty grid).
    #[error("host twin: kernel {kernel} ({what}) failed: {message}")]
    HostKernel {
        /// The entry point.
        kernel: &'static str,
        /// What the launch was for.
        what: &'static str,
        /// The kernel runtime's message.
        message: String,
    },
}

impl CudaError {
    /// Wraps a driver error with what was being done; errors that leave the context
    /// unusable (CUDA's "sticky" errors) become [`CudaError::ContextLost`].
    pub(crate) fn driver(during: impl Into<String>, e: impl std::fmt::Display) -> CudaError {
        let message = e.to_string();
        if is_sticky(&message) {
            CudaError::ContextLost { during: during.into(), message }
        } else {
            CudaError::Driver { during: during.into(), message }
        }
    }
}

/// Whether a driver error message names one of CUDA's sticky errors, after which every
/// call on the context fails until it is destroyed.
fn is_sticky(message: &str) -> bool {
    const STICKY: [&str; 12] = [
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
    ];
    STICKY.iter().any(|s| message.contains(s))
}

fn describe_failures(failures: &[(Option<usize>, String)]) -> String {
    let each: Vec<String> = failures
        .iter()
        .map(|(rank, message)| match rank {
            Some(rank) => format!("rank {rank}: {message}"),
            None => format!("the rank pool: {message}"),
        })
        .collect();
    each.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_driver_errors_mean_the_context_is_lost() {
        let e = CudaError::driver(
            "running the plan",
            "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access was encountered\")",
        );
        assert!(matches!(e, CudaError::ContextLost { .. }), "{e}");
        assert!(e.to_string().contains("next run starts a fresh context"), "{e}");
        let e = CudaError::driver("allocating", "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
        assert!(matches!(e, CudaError::Driver { .. }), "{e}");
    }
}
