//! The fake CUDA driver: with `CMM_FAKE_CUDA=1`, [`crate::CudaBackend`] runs on the CPU
//! through a stand-in for libcuda and libcublas (`cuda/host/driver.cpp`,
//! `cuda/host/cublas.cpp`), so that the backend's own driver calls, not only its
//! lowering and kernels (the [`crate::HostTwin`]), run and are checked without a GPU.
//!
//! Both libraries are compiled with the system C++ compiler (the driver together with
//! the host twin of the kernels, whose launchers it runs) and loaded by absolute path,
//! globally, before cudarc looks for a driver; their sonames are `libcuda.so` and
//! `libcublas.so`, the first names cudarc asks the dynamic loader for, so cudarc binds
//! to them even on a machine with a real driver. The fake GPU says what it is in its
//! name, so no figure measured on it can pass for a GPU's.
//!
//! The model, and what it checks, is written at the top of `driver.cpp`: guarded
//! allocations (a write past one is a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`), PTX modules
//! whose `.entry` names decide what `cuModuleGetFunction` finds, parameter values copied
//! at `cuLaunchKernelEx`, streams on FIFO hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`),
//! events, stream memory operations, and cuBLAS's column-major `cublasGemmEx`.
//! Environment: `CMM_FAKE_CUDA_GPUS` (devices, default 2), `CMM_FAKE_CUDA_SMS` (SMs per
//! device, default 132, an H100's), `CMM_FAKE_CUDA_CLUSTERS` (clusters the occupancy query
//! says fit; default the SMs over the cluster size; `fail` fails the query), `CUDA_LAUNCH_BLOCKING=1` (launches return once their kernel has
//! run) and `CMM_FAKE_CUDA_BLOCKING_LAUNCHES=1` (the same, unknown to the backend: a tool
//! that serialises GPU work).

use std::sync::OnceLock;

use crate::cpp::{build, cache_dir, compiler, host_source, COMMON, RUNTIME};
use crate::error::CudaError;

/// The variable that selects the fake driver.
pub const FAKE_CUDA_VAR: &str = "CMM_FAKE_CUDA";

const DRIVER: &str = include_str!("../host/driver.cpp");
const CUBLAS: &str = include_str!("../host/cublas.cpp");

/// Whether `CMM_FAKE_CUDA=1`.
pub fn requested() -> bool {
    std::env::var(FAKE_CUDA_VAR).is_ok_and(|v| v == "1")
}

/// The fake driver's and fake cuBLAS's sources, each one translation unit.
pub fn sources() -> (String, String) {
    let driver = format!("{}\n// ---- host/driver.cpp ----\n{DRIVER}", host_source());
    let cublas = format!("{RUNTIME}\n// ---- common.cuh ----\n{COMMON}\n// ---- host/cublas.cpp ----\n{CUBLAS}");
    (driver, cublas)
}

/// With `CMM_FAKE_CUDA=1`, builds (once, cached on disk) and loads the fake libcuda and
/// libcublas into this process, before any driver call; otherwise does nothing.
/// Returns whether the fake is in place.
pub fn install_if_requested() -> Result<bool, CudaError> {
    if !requested() {
        return Ok(false);
    }
    install().map(|()| true)
}

/// A failure the fake driver injects at the `nth` matching call ([`inject`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Injection {
    /// A launch of this kernel faults, as one that touches unmapped memory does: a sticky
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` of its context.
    Fault(crate::Kernel),
    /// A launch of this kernel is silently dropped (a lost signal, say).
    DropLaunch(crate::Kernel),
    /// A `cuStreamWriteValue32` is silently dropped (a lost stream-memory-op signal).
    DropStreamWrite,
}

/// Makes the `nth` (from 1) call matching `injection`, from now on, fail as it says (for
/// tests of the backend's recovery; `nth` = 0 cancels). The fake driver must be
/// installed.
pub fn inject(injection: Injection, nth: u32) -> Result<(), CudaError> {
    type Inject = unsafe extern "C" fn(*const std::ffi::c_char, i32, u32);
    let (target, kind) = match injection {
        Injection::Fault(kernel) => (kernel.entry(), 1),
        Injection::DropLaunch(kernel) => (kernel.entry(), 2),
        Injection::DropStreamWrite => ("cuStreamWriteValue32", 2),
    };
    let target = std::ffi::CString::new(target).map_err(|e| fake_error(e.to_string()))?;
    let inject: Inject = control(b"cmm_fake_inject\0")?;
    // SAFETY: `target` is a NUL-terminated string alive for the call.
    #[allow(unsafe_code)]
    unsafe {
        inject(target.as_ptr(), kind, nth)
    };
    Ok(())
}

/// What a pair of the fake GPUs lacks ([`deny_peer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerDenial {
    /// Both capabilities, as by default.
    Nothing,
    /// Peer access (`cuDeviceCanAccessPeer` says no; native atomics go with it).
    Access,
    /// Native peer atomics only (`CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED` is 0).
    NativeAtomics,
}

/// From now on GPU `gpu` lacks `what` towards GPU `peer` (one direction), as GPUs under
/// different PCIe roots do; `deny_peer(.., PeerDenial::Nothing)` gives it back. Backends
/// opened afterwards enable peer access only where it is offered. The fake driver must
/// be installed.
pub fn deny_peer(gpu: usize, peer: usize, what: PeerDenial) -> Result<(), CudaError> {
    type Deny = unsafe extern "C" fn(i32, i32, i32);
    let deny: Deny = control(b"cmm_fake_deny_peer\0")?;
    let what = match what {
        PeerDenial::Nothing => 0,
        PeerDenial::Access => 1,
        PeerDenial::NativeAtomics => 2,
    };
    // SAFETY: the control takes three plain integers.
    #[allow(unsafe_code)]
    unsafe {
        deny(gpu as i32, peer as i32, what)
    };
    Ok(())
}

/// How many VMM handles (`cuMemCreate`, `cuMemImportFromShareableHandle`) are not yet
/// released and address reservations not yet freed: 0 once a rank-mode run has torn
/// down. The fake driver must be installed.
pub fn vmm_live() -> Result<u64, CudaError> {
    count(b"cmm_fake_vmm_live\0")
}

/// Calls the fake driver's control `name` (NUL-terminated), a `u64 (void)` count.
fn count(name: &[u8]) -> Result<u64, CudaError> {
    type Count = unsafe extern "C" fn() -> u64;
    let count: Count = control(name)?;
    // SAFETY: the control takes nothing and returns a count; the driver guards its
    // tables with its own lock.
    #[allow(unsafe_code)]
    let value = unsafe { count() };
    Ok(value)
}

/// Makes every kernel launch block until its kernel has run (`Some(true)`), not
/// (`Some(false)`), or follow `CUDA_LAUNCH_BLOCKING` (`None`), as the driver does for
/// debugging and as tools that serialise GPU work behave. The fake driver must be
/// installed.
pub fn set_launch_blocking(blocking: Option<bool>) -> Result<(), CudaError> {
    set_integer(b"cmm_fake_set_launch_blocking\0", blocking.map_or(-1, i32::from))
}

/// How many launches of `kernel` so far carried a priority attribute
/// (`cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_PRIORITY`). The fake driver must be
/// installed.
pub fn prioritised_launches(kernel: crate::Kernel) -> Result<u64, CudaError> {
    type Count = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;
    let name = std::ffi::CString::new(kernel.entry()).map_err(|e| fake_error(e.to_string()))?;
    let count: Count = control(b"cmm_fake_prioritised_launches\0")?;
    // SAFETY: `name` is a NUL-terminated string alive for the call.
    #[allow(unsafe_code)]
    let launches = unsafe { count(name.as_ptr()) };
    Ok(launches)
}

/// How many items (launches, copies, memory operations, cuBLAS GEMMs) were enqueued so
/// far on streams whose priority attribute (`cuStreamSetAttribute`) was `priority`. The
/// fake driver must be installed.
pub fn enqueued_at_stream_priority(priority: i32) -> Result<u64, CudaError> {
    type Count = unsafe extern "C" fn(i32) -> u64;
    let count: Count = control(b"cmm_fake_enqueued_at_stream_priority\0")?;
    // SAFETY: the control takes one plain integer and returns a count.
    #[allow(unsafe_code)]
    let items = unsafe { count(priority) };
    Ok(items)
}

/// How many copies were asked of the copy engines so far (`cuMemcpyBatchAsync` with
/// `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`). The fake driver must be installed.
pub fn copy_engine_copies() -> Result<u64, CudaError> {
    count(b"cmm_fake_copy_engine_copies\0")
}

/// Makes contexts report `greatest` as their greatest stream priority from now on (the
/// least is 0, so 0 means a single priority, as on a GPU without stream priorities; the
/// default is -5, as on an H100). Backends created afterwards probe it. The fake driver
/// must be installed.
pub fn set_greatest_priority(greatest: i32) -> Result<(), CudaError> {
    set_integer(b"cmm_fake_set_greatest_priority\0", greatest)
}

/// Makes module loading eager (`Some(true)`), lazy (`Some(false)`), or follow
/// `CUDA_MODULE_LOADING` (`None`) from now on, for backends created afterwards (a GPU
/// reads the variable once, at `cuInit`). The fake driver must be installed.
pub fn set_module_loading(eager: Option<bool>) -> Result<(), CudaError> {
    set_integer(b"cmm_fake_set_module_loading\0", eager.map_or(-1, i32::from))
}

/// Calls the fake driver's control `name` (NUL-terminated), a `void (int)`.
fn set_integer(name: &[u8], value: i32) -> Result<(), CudaError> {
    type Set = unsafe extern "C" fn(i32);
    let set: Set = control(name)?;
    // SAFETY: every caller names a control that takes one plain integer.
    #[allow(unsafe_code)]
    unsafe {
        set(value)
    };
    Ok(())
}

/// Makes the fake cuBLAS forget every GEMM shape it has loaded kernels for, as a fresh
/// process's cuBLAS has: its next GEMM of each shape loads them again, and a load waits
/// for the context's running work (see `cublas.cpp`). The fake driver must be installed.
pub fn forget_loaded_cublas_kernels() -> Result<(), CudaError> {
    type Forget = unsafe extern "C" fn();
    let forget: Forget = control(b"cmm_fake_blas_forget_loaded\0")?;
    // SAFETY: takes nothing; the fake cuBLAS guards its table with its own lock.
    #[allow(unsafe_code)]
    unsafe {
        forget()
    };
    Ok(())
}

/// One of the fake driver's test controls (`cmm_fake_*` in driver.cpp), by its
/// NUL-terminated name; `F` must be its exact signature.
fn control<F: Copy>(name: &[u8]) -> Result<F, CudaError> {
    let this = libloading::os::unix::Library::this();
    // SAFETY: every caller names a control driver.cpp defines with the signature `F`;
    // the fake driver, once installed, stays loaded for the process, so the pointer
    // stays valid.
    #[allow(unsafe_code)]
    let symbol = unsafe { this.get::<F>(name) };
    symbol.map(|f| *f).map_err(|e| fake_error(format!("the fake CUDA driver is not installed: {e}")))
}

fn fake_error(message: String) -> CudaError {
    CudaError::HostBuild { compiler: compiler(), message, log: String::new() }
}

/// Builds (once per process, cached on disk) and loads the fake libcuda and libcublas,
/// whatever the environment says: for tests that need the fake driver. Must run before
/// anything in the process calls into cudarc's driver or cuBLAS bindings.
pub fn install() -> Result<(), CudaError> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| load().map_err(|e| e.to_string()))
        .clone()
        .map_err(|message| fake_error(format!("the fake CUDA driver: {message}")))
}

fn load() -> Result<(), CudaError> {
    let (driver_src, cublas_src) = sources();
    let dir = cache_dir();
    let driver = build(&compiler(), &driver_src, &dir, "cmm-fake-cuda", &["-Wl,-soname,libcuda.so", "-ldl"])?;
    let cublas = build(&compiler(), &cublas_src, &dir, "cmm-fake-cublas", &["-Wl,-soname,libcublas.so"])?;
    for path in [driver, cublas] {
        // SAFETY: the libraries were just built from the project's own sources; loading
        // runs only the C++ runtime's static initialisers. RTLD_GLOBAL lets the fake
        // cuBLAS bind to the fake driver's exports. They stay loaded for the process.
        #[allow(unsafe_code)]
        let library = unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map_err(|e| fake_error(format!("loading {}: {e}", path.display())))?;
        std::mem::forget(library);
    }
    Ok(())
}
