//! Errors of the reference executor.

use cmm_core::plan::PlanError;
use cmm_core::schedule::Deadlock;
use thiserror::Error;

/// Why the reference could not run.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// No wgpu adapter exists on this machine.
    #[error("no GPU adapter found (tried {tried}). On Linux without a GPU install Mesa's CPU Vulkan driver: `sudo apt-get install mesa-vulkan-drivers libvulkan1` (lavapipe); on other platforms install a Vulkan, Metal or DX12 driver")]
    NoAdapter {
        /// The backends that were tried.
        tried: String,
    },
    /// `WGPU_BACKEND` names a backend wgpu does not know.
    #[error("WGPU_BACKEND={value:?}: {name:?} is not a backend; name one or more of vulkan, gl, metal, dx12 (comma-separated), or unset it to try Vulkan, then GL, then any")]
    UnknownBackend {
        /// The variable's value.
        value: String,
        /// The name in it that is not a backend.
        name: String,
    },
    /// The adapter refused to create a device.
    #[error("adapter {adapter} refused to create a device: {reason}")]
    RequestDevice {
        /// Adapter summary.
        adapter: String,
        /// wgpu's reason.
        reason: String,
    },
    /// The plan is malformed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A routing table of the run is malformed or overflows the plan's tables.
    #[error(transparent)]
    Routing(#[from] cmm_core::moe::RoutingError),
    /// The plan cannot finish.
    #[error(transparent)]
    Deadlock(#[from] Deadlock),
    /// The plan's memory does not fit what the adapter can bind.
    #[error("plan `{plan}` needs {needed} bytes of device memory for {devices} virtual devices; this adapter binds at most {limit} bytes (four storage buffers of its largest binding) (the CPU twin has no such limit and gives the same bits: `--backend cpu`)")]
    TooLarge {
        /// Plan name.
        plan: String,
        /// Bytes needed.
        needed: u64,
        /// Virtual devices.
        devices: usize,
        /// The adapter's limit.
        limit: u64,
    },
    /// An op's shape exceeds what one dispatch can cover.
    #[error("plan `{plan}`: {what}")]
    Unsupported {
        /// Plan name.
        plan: String,
        /// What is unsupported, with the sizes.
        what: String,
    },
    /// wgpu reported a validation or device error.
    #[error("wgpu error while {during}: {message}")]
    Wgpu {
        /// What the executor was doing.
        during: &'static str,
        /// wgpu's message.
        message: String,
    },
    /// The GPU mirror of a semaphore disagrees with the host scheduler.
    #[error("plan `{plan}`: semaphore {semaphore} of device {device} is {gpu} on the GPU but {host} on the host")]
    SemaphoreMirror {
        /// Plan name.
        plan: String,
        /// Device.
        device: usize,
        /// Semaphore name.
        semaphore: String,
        /// GPU-side value.
        gpu: u32,
        /// Host-side value.
        host: u32,
    },
}
