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
pub use kernels::{compile, nvrtc_available, KernelFile, KERNEL_FILES};
mod backend;

pub use backend::{probe, CudaBackend, CudaRunOptions, CudaRunOutput, GemmEngine, Placement};
