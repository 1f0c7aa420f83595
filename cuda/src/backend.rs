//! The CUDA executor: a plan's (device, lane) pairs become streams, its ops kernel
//! launches, copies and stream memory operations, its semaphores counters in device
//! memory.
//!
//! A run, in order:
//! 1. lower the plan on the CPU ([`crate::lower`]): the enqueue order is the schedule
//!    order, proven unable to hang on `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues, and
//!    every launch is checked against its kernel's limits, so errors come before any
//!    GPU work;
//! 2. allocate (plain `cuMemAlloc`, so peer access covers it), generate the inputs,
//!    poison the rest, and wait for that;
//! 3. hold every lane stream behind `cmm_gate`, enqueue the whole plan, then open the
//!    gate: the timed region (two events around all lanes) starts with the first op;
//! 4. poll for the end with a deadline; past it, raise the abort word so every
//!    `cmm_wait` returns, drain, and report;
//! 5. on any error after the first launch, abort and drain the same way before memory is
//!    freed; a sticky error marks the context lost, and the next run starts a new one.
//!
//! Placement: `Placement::Virtual` puts D virtual devices on one GPU (separate
//! allocations); `Placement::Gpus` puts device d on GPU d with peer access enabled.
//! Either way a device reaches its peers only through the table of peer pointers
//! (`Memory::base`, in [`crate::memory`]), so the op encoding is one code path.
//!
//! What a run is asked and gives back is in [`crate::options`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cmm_core::generator::Family;
use cmm_core::plan::{BufferRole, Op, OpSite, Plan, PlanBuilder};
use cmm_core::DType;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::error::CudaError;
use crate::given::{Bound, GivenBuffer};
use crate::kernels::{compile, prebuilt_image, KERNEL_FILES, KERNEL_IMAGES_VAR};
use crate::launch::{
    fused_kernel, fused_launch, fused_table, gemm_submission, hopper_kernel, released_waits, submissions,
    timed_out_wait, ControlLayout, FusedLayout, FusedWaits, GemmArgs, Kernel, Launch, Param, RunWords, Submission,
    HOPPER_THREADS, ONE_THREAD,
};
use crate::lower::{
    hardware_queues, lower, Command, FusedGemmCommand, GemmCommand, GemmEngine, GemmImpl, HopperKernel, HopperTarget,
    HopperTile, HopperVariant, LowerOptions, Lowered, SyncMode,
};
use crate::memory::{DeviceAlloc, DeviceBuffer, HostControl, Memory};
use crate::options::{CopyIssue, CudaRunOptions, CudaRunOutput, GemmSpec, OpTimes, Placement, ReadBack};
use crate::rank::{Meeting, Rendezvous};
use crate::CudaExecutor;

/// Every kernel's function in one context, indexed by [`Kernel`].
pub(crate) struct Functions(Vec<CudaFunction>);

impl Functions {
    fn get(&self, kernel: Kernel) -> &CudaFunction {
        &self.0[kernel.index()]
    }
}

/// A cuBLAS handle, destroyed on drop (after its stream has finished).
struct BlasHandle(blas_sys::cublasHandle_t);

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `create_handle` and is destroyed once; the
        // owner drops it only after the stream it is bound to has been synchronised.
        // A failure here cannot be reported from a destructor and leaks the handle.
        #[allow(unsafe_code)]
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// A lane stream kept across runs (so its hardware queue stays put) with its cuBLAS
/// handle, created on first use under the stream's context.
struct LaneSlot {
    /// The stream's priority attribute as last set (0, the default, when created).
    priority: i32,
    blas: Option<BlasHandle>,
    /// The handle's own workspace (dropped after the handle).
    workspace: Option<DeviceAlloc>,
    stream: Arc<CudaStream>,
}

/// One GPU with its compiled kernels and lane streams.
pub(crate) struct Gpu {
    lanes: Vec<LaneSlot>,
    pub(crate) functions: Functions,
    pub(crate) ctx: Arc<CudaContext>,
    /// The greatest launch priority of the context, where a prioritised launch works
    /// here (probed when the context opens), or why not.
    priority: Result<i32, String>,
}

/// Whether the contexts can take work.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Health {
    Ready,
    /// A sticky error destroyed the contexts; rebuild before the next run.
    Lost,
    /// Work is stuck on the GPU; refuse everything.
    Hung(String),
}

struct State {
    gpus: Vec<Gpu>,
    health: Health,
    /// Whether the driver loads every kernel when its module loads
    /// (`CUDA_MODULE_LOADING=EAGER`); see [`CudaBackend::can_gate`].
    eager_loading: bool,
    /// cuBLAS GEMMs already run once on each `(gpu, lane)` ([`warm_cublas`]), their
    /// operand addresses reduced to alignments.
    warm_blas: std::collections::HashSet<(usize, usize, GemmArgs)>,
}

impl State {
    /// Records what a run's error says of the contexts (lost: rebuild before the next
    /// run; hung: refuse every run), and passes the result on.
    fn note_health(&mut self, result: Result<CudaRunOutput, CudaError>) -> Result<CudaRunOutput, CudaError> {
        match &result {
            Err(CudaError::ContextLost { .. }) => self.health = Health::Lost,
            Err(CudaError::Hung { plan, .. }) => self.health = Health::Hung(plan.clone()),
            _ => {}
        }
        result
    }
}

/// The CUDA backend.
pub struct CudaBackend {
    state: Mutex<State>,
    ptx: Vec<(String, Ptx)>,
    ordinals: usize,
    arch: String,
    name: String,
    cublas: bool,
    memops: Result<(), String>,
    /// Whether the driver has `cuMemcpyBatchAsync` ([`CopyIssue::PreferCopyEngines`]).
    batch_copies: Result<(), String>,
    priority: Result<i32, String>,
    /// GPU 0's SM count where it runs the Hopper engine.
    hopper_sms: Option<u32>,
    /// Clusters of two of each Hopper tile's pair kernel that GPU 0 holds at once
    /// ([`HopperTarget::pair_clusters`]); zeros without the engine.
    pair_clusters: [u32; 2],
    /// Why `pair_clusters` is the SM count's half, not the driver's answer: its occupancy
    /// query failed (only the sweep's cluster rows depend on it, so the backend still opens).
    pair_clusters_assumed: Option<String>,
    /// Where the kernels' code came from.
    kernel_origin: KernelOrigin,
}

/// Where a backend's kernel code came from ([`CudaBackend::summary`] says).
#[derive(Clone, Debug)]
enum KernelOrigin {
    /// Every file compiled by NVRTC in this process (or found in its PTX cache); `Some`:
    /// the folder of images asked for, which had none of these sources.
    Nvrtc(Option<PathBuf>),
    /// `prebuilt` files (at least one) loaded from images in `dir`, the rest compiled.
    Images { dir: PathBuf, prebuilt: usize },
    /// The driver (or the check before it) refused the images of `dir` (`why`), and NVRTC
    /// compiled every file.
    Refused { dir: PathBuf, why: String },
}

impl KernelOrigin {
    fn describe(&self, arch: &str) -> String {
        match self {
            KernelOrigin::Nvrtc(None) => "kernels compiled by NVRTC".into(),
            KernelOrigin::Nvrtc(Some(dir)) => {
                format!("kernels compiled by NVRTC (no {arch} image of these sources in {})", dir.display())
            }
            KernelOrigin::Images { dir, prebuilt } if *prebuilt == KERNEL_FILES.len() => {
                format!("kernels from prebuilt {arch} images in {}", dir.display())
            }
            KernelOrigin::Images { dir, prebuilt } => format!(
                "{prebuilt} of {} kernel files from prebuilt {arch} images in {}, the rest compiled by NVRTC",
                KERNEL_FILES.len(),
                dir.display()
            ),
            KernelOrigin::Refused { dir, why } => {
                format!("kernels compiled by NVRTC (the prebuilt images in {} were refused: {why})", dir.display())
            }
        }
    }
}

/// Every kernel file's code for `arch`: its prebuilt image where `images` has one, else
/// PTX from NVRTC. An image that is not whole is refused as the driver would refuse it:
/// every file is compiled.
fn kernel_code(arch: &str, images: Option<&Path>) -> Result<(Vec<(String, Ptx)>, KernelOrigin), CudaError> {
    let mut prebuilt = 0;
    let mut code = Vec::with_capacity(KERNEL_FILES.len());
    for kernel in &KERNEL_FILES {
        let image = match images.map(|dir| (dir, prebuilt_image(dir, kernel, arch))) {
            None | Some((_, Ok(None))) => None,
            Some((_, Ok(Some(image)))) => Some(image),
            Some((dir, Err(why))) => {
                let (compiled, _) = kernel_code(arch, None)?;
                return Ok((compiled, KernelOrigin::Refused { dir: dir.to_path_buf(), why }));
            }
        };
        let ptx = match image {
            Some(image) => {
                prebuilt += 1;
                Ptx::from_binary(image)
            }
            None => Ptx::from_src(compile(kernel, arch)?),
        };
        code.push((kernel.name.to_string(), ptx));
    }
    let origin = match images {
        Some(dir) if prebuilt > 0 => KernelOrigin::Images { dir: dir.to_path_buf(), prebuilt },
        dir => KernelOrigin::Nvrtc(dir.map(Path::to_path_buf)),
    };
    Ok((code, origin))
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("gpus", &self.ordinals).field("arch", &self.arch).finish()
    }
}

fn driver_present() -> bool {
    // SAFETY: only probes the dynamic loader for libcuda; no CUDA call is made.
    #[allow(unsafe_code)]
    unsafe {
        sys::is_culib_present()
    }
}

/// Whether libcublas can be loaded (cudarc panics on first use otherwise).
pub fn cublas_present() -> bool {
    if crate::fake::install_if_requested().is_err() {
        return false;
    }
    // SAFETY: only probes the dynamic loader for libcublas.
    #[allow(unsafe_code)]
    unsafe {
        blas_sys::is_culib_present()
    }
}

/// Checks that the CUDA driver can be loaded and reports a GPU, without panicking.
pub fn probe() -> Result<String, CudaError> {
    // With CMM_FAKE_CUDA=1 the fake driver must be in place before cudarc looks.
    crate::fake::install_if_requested()?;
    if !driver_present() {
        return Err(CudaError::NoCudaDriver);
    }
    let count = CudaContext::device_count().map_err(|e| CudaError::NoCudaDevice { reason: e.to_string() })?;
    if count < 1 {
        return Err(CudaError::NoCudaDevice { reason: "the driver reports 0 devices".into() });
    }
    Ok(format!("{count} CUDA device(s)"))
}

fn open_gpus(ptx: &[(String, Ptx)], ordinals: usize, hopper: bool) -> Result<Vec<Gpu>, CudaError> {
    let mut out = Vec::new();
    for ordinal in 0..ordinals {
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::driver(format!("opening GPU {ordinal}"), e))?;
        // SAFETY: streams are ordered only by the plan's own semaphores; cudarc's
        // automatic cross-stream event tracking would add orderings the plan does not
        // ask for, so it is turned off before any stream or allocation is made.
        #[allow(unsafe_code)]
        unsafe {
            ctx.disable_event_tracking();
        }
        let mut modules: Vec<(&str, Arc<cudarc::driver::CudaModule>)> = Vec::new();
        let mut functions = Vec::with_capacity(Kernel::ALL.len());
        for kernel in Kernel::ALL {
            let file = kernel.file();
            if !modules.iter().any(|(n, _)| *n == file) {
                let p =
                    ptx.iter().find(|(n, _)| n == file).map(|(_, p)| p.clone()).expect("every kernel file compiled");
                let module = ctx.load_module(p).map_err(|e| CudaError::driver(format!("loading {file}"), e))?;
                modules.push((file, module));
            }
            let module = &modules.iter().find(|(n, _)| *n == file).expect("loaded above").1;
            let f = module
                .load_function(kernel.entry())
                .map_err(|e| CudaError::driver(format!("loading kernel {}", kernel.entry()), e))?;
            // An SM's split of L1 and shared memory changes only when it is idle. A wait
            // kernel that spins on an SM split for little shared memory would keep a tile
            // kernel's CTA off that SM for as long as it spins, and a persistent kernel
            // short of a CTA holds its hardware queue. So every cmm kernel asks for the
            // greatest shared-memory split: any SM running them can take any of them.
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                .map_err(|e| CudaError::driver(format!("setting the shared-memory split of {}", kernel.entry()), e))?;
            // The Hopper engine's stages take more shared memory than a CTA gets unasked.
            if let (Some((tile, variant)), true) = (kernel.hopper(), hopper) {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    tile.shared_bytes(variant) as i32,
                )
                .map_err(|e| CudaError::driver(format!("giving {} its shared memory", kernel.entry()), e))?;
            }
            functions.push(f);
        }
        let functions = Functions(functions);
        let priority = probe_launch_priority(&ctx, &functions);
        out.push(Gpu { lanes: Vec::new(), functions, ctx, priority });
    }
    if out.len() > 1 {
        enable_peer_access(&out)?;
    }
    Ok(out)
}

/// The context's greatest launch priority, if a kernel launched at it runs here: one
/// `cmm_signal` at that priority must add 1 to a zeroed word. A GPU with a single
/// priority, or a driver that refuses the launch attribute, leaves every launch at the
/// default priority (the run says so: [`CudaRunOutput::comm_priority`]).
fn probe_launch_priority(ctx: &Arc<CudaContext>, functions: &Functions) -> Result<i32, String> {
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let (least, greatest) =
        result::stream::get_priority_range().map_err(|e| format!("cuCtxGetStreamPriorityRange: {e}"))?;
    if greatest >= least {
        return Err(format!("the context has a single stream priority ({least})"));
    }
    let word = DeviceAlloc::zeroed(ctx, 4).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let signal = Launch::new(Kernel::Signal, ONE_THREAD, vec![Param::U64(word.ptr), Param::U32(1)], "a probe signal");
    launch_on(&stream, functions, &signal, Some(greatest)).map_err(|e| e.to_string())?;
    stream.synchronize().map_err(|e| format!("a prioritised launch: {e}"))?;
    let mut seen = [0u32];
    // SAFETY: `word` is a live 4-byte allocation of the current context, and the only
    // work that wrote it has finished (the stream was synchronised).
    #[allow(unsafe_code)]
    unsafe { result::memcpy_dtoh_sync(&mut seen, word.ptr) }.map_err(|e| format!("reading the probe: {e}"))?;
    match seen[0] {
        1 => Ok(greatest),
        v => Err(format!("a signal launched at priority {greatest} left {v}, not 1")),
    }
}

/// The launch attribute of clusters of `x` CTAs along x (the Hopper engine's pairs).
fn cluster_attribute(x: u32) -> sys::CUlaunchAttribute {
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y: 1, z: 1 },
        },
    }
}

/// Clusters of two of each Hopper tile's pair kernel ([`HopperTile::ALL`]'s order) that
/// `gpu` holds at once, by the driver's occupancy query for the kernel as launched
/// (its threads, shared memory and cluster dimension).
fn co_resident_pairs(gpu: &Gpu) -> Result<[u32; 2], CudaError> {
    gpu.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding GPU 0's context", e))?;
    let mut out = [0u32; 2];
    for (fit, tile) in out.iter_mut().zip(HopperTile::ALL) {
        let kernel = hopper_kernel(tile, HopperVariant::Pair, DType::F16);
        let mut attribute = cluster_attribute(kernel.cluster());
        let config = sys::CUlaunchConfig {
            gridDimX: kernel.cluster(),
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: HOPPER_THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: tile.shared_bytes(HopperVariant::Pair),
            hStream: std::ptr::null_mut(),
            attrs: &mut attribute,
            numAttrs: 1,
        };
        let mut clusters: std::ffi::c_int = 0;
        // SAFETY: `clusters` and `config` (and the attribute it points at) outlive the
        // call; the function is a live kernel of the current context, whose shared-memory
        // limit was raised to what `config` asks when it was loaded; a null stream makes
        // the driver use the current context.
        #[allow(unsafe_code)]
        unsafe {
            sys::cuOccupancyMaxActiveClusters(&mut clusters, gpu.functions.get(kernel).cu_function(), &config).result()
        }
        .map_err(|e| CudaError::driver(format!("asking how many clusters of {} fit", kernel.entry()), e))?;
        *fit = clusters.max(0) as u32;
    }
    Ok(out)
}

/// The batched copy call of CUDA 13's driver API ([`CopyIssue::PreferCopyEngines`]).
const BATCH_COPY_SYMBOL: &[u8] = b"cuMemcpyBatchAsync_v2\0";

/// Whether the driver exports the batched copy call: cudarc panics on a missing symbol,
/// so the backend looks first.
fn probe_batch_copies() -> Result<(), String> {
    // SAFETY: the driver library is loaded (the backend opened a GPU through it); looking
    // a symbol up calls nothing.
    #[allow(unsafe_code)]
    let found = unsafe { sys::culib().get::<unsafe extern "C" fn()>(BATCH_COPY_SYMBOL) };
    found.map(|_| ()).map_err(|_| {
        let mut version = 0;
        // SAFETY: writes one integer.
        #[allow(unsafe_code)]
        let known = unsafe { sys::cuDriverGetVersion(&mut version) }.result().is_ok();
        let driver = if known {
            format!("a CUDA {}.{} driver", version / 1000, version % 1000 / 10)
        } else {
            "this driver".into()
        };
        format!("{driver} has no cuMemcpyBatchAsync_v2 (the batched copy as CUDA 13 declares it)")
    })
}

/// Whether `cuStreamWaitValue32` works here: one wait that is already satisfied.
fn probe_stream_memops(gpu: &Gpu) -> Result<(), String> {
    let word = DeviceAlloc::zeroed(&gpu.ctx, 4).map_err(|e| e.to_string())?;
    let stream = gpu.ctx.new_stream().map_err(|e| e.to_string())?;
    // SAFETY: `word` is a live 4-byte allocation of this context, and the stream is
    // synchronised before `word` is freed.
    #[allow(unsafe_code)]
    unsafe {
        sys::cuStreamWaitValue32_v2(
            stream.cu_stream(),
            word.ptr,
            0,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
        .result()
    }
    .map_err(|e| format!("cuStreamWaitValue32: {e}"))?;
    stream.synchronize().map_err(|e| format!("cuStreamWaitValue32: {e}"))
}

impl CudaBackend {
    /// Opens GPU 0 (and, with `gpus > 1`, GPUs 1.. with peer access) and compiles every
    /// kernel for the exact architecture of GPU 0.
    ///
    /// Kernel files with a prebuilt image in the folder that `CMM_KERNEL_IMAGES` names
    /// ([`crate::kernels::KERNEL_IMAGES_VAR`]) are loaded from it instead, as
    /// [`CudaBackend::with_kernel_images`] does.
    pub fn new(gpus: usize) -> Result<CudaBackend, CudaError> {
        let images = std::env::var_os(KERNEL_IMAGES_VAR).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self::with_kernel_images(gpus, images.as_deref())
    }

    /// As [`CudaBackend::new`], with the kernel files that have a prebuilt image for the
    /// GPU's architecture in `images` loaded from it ([`crate::kernels::image_file_name`]; `None`:
    /// NVRTC compiles every file), so that a fresh machine starts without compiling. If
    /// an image is not whole or the driver refuses it, every file is compiled with NVRTC
    /// instead, and [`CudaBackend::summary`] says why.
    pub fn with_kernel_images(gpus: usize, images: Option<&Path>) -> Result<CudaBackend, CudaError> {
        probe()?;
        let count = CudaContext::device_count().map_err(|e| CudaError::driver("counting devices", e))? as usize;
        let ordinals = gpus.max(1);
        if ordinals > count {
            return Err(CudaError::NoCudaDevice { reason: format!("{gpus} GPUs requested, {count} present") });
        }
        let first = CudaContext::new(0).map_err(|e| CudaError::NoCudaDevice { reason: e.to_string() })?;
        let (major, minor) =
            first.compute_capability().map_err(|e| CudaError::driver("reading the compute capability", e))?;
        // Hopper's wgmma/TMA features need the `a` variant; others use the plain arch.
        let arch = if major == 9 { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
        let name = first.name().map_err(|e| CudaError::driver("reading the device name", e))?;
        let sms = first
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::driver("reading the SM count", e))?;
        // (The fake driver runs the engine's kernels on the host twin.)
        let hopper_sms = (major == 9).then_some(sms.max(1) as u32);
        drop(first);
        let eager_loading = module_loading_is_eager()?;
        let (mut ptx, mut kernel_origin) = kernel_code(&arch, images)?;
        let gpus = match (open_gpus(&ptx, ordinals, hopper_sms.is_some()), &kernel_origin) {
            (Err(refused), KernelOrigin::Images { dir, .. }) => {
                let dir = dir.clone();
                (ptx, _) = kernel_code(&arch, None)?;
                kernel_origin = KernelOrigin::Refused { dir, why: refused.to_string() };
                open_gpus(&ptx, ordinals, hopper_sms.is_some())?
            }
            (opened, _) => opened?,
        };
        let (pair_clusters, pair_clusters_assumed) = match hopper_sms {
            None => ([0; 2], None),
            Some(sms) => match co_resident_pairs(&gpus[0]) {
                Ok(fit) => (fit, None),
                Err(e) => ([sms / 2; 2], Some(e.to_string())),
            },
        };
        let memops = probe_stream_memops(&gpus[0]);
        let batch_copies = probe_batch_copies();
        let priority = gpus[0].priority.clone();
        Ok(CudaBackend {
            state: Mutex::new(State { gpus, health: Health::Ready, eager_loading, warm_blas: Default::default() }),
            ptx,
            ordinals,
            arch,
            name,
            cublas: cublas_present(),
            memops,
            batch_copies,
            priority,
            hopper_sms,
            pair_clusters,
            pair_clusters_assumed,
            kernel_origin,
        })
    }

    /// How many kernel files were loaded from prebuilt images (0: all compiled by NVRTC).
    pub fn prebuilt_kernel_files(&self) -> usize {
        match self.kernel_origin {
            KernelOrigin::Images { prebuilt, .. } => prebuilt,
            KernelOrigin::Nvrtc(_) | KernelOrigin::Refused { .. } => 0,
        }
    }

    /// Whether runs can hold their lanes behind the gate ([`CudaRunOptions::gate`]).
    /// Not under lazy module loading (CUDA's default since 12.2): the first launch of one
    /// of cmm's kernels not yet loaded would wait for the context's running kernels, the
    /// gate among them, which only the host opens after that launch; the host would sit
    /// there until the gate's deadline. Ungated, every wait enqueued has its signal
    /// enqueued before it (schedule order), so a load's wait ends. (cuBLAS loads its
    /// kernels per shape in either mode: `warm_cublas` meets each shape first.)
    /// [`driver_environment_unless_chosen`] makes binaries load eagerly.
    pub fn can_gate(&self) -> bool {
        self.state.lock().is_ok_and(|s| s.eager_loading)
    }

    /// One line naming the GPU, the kernels' architecture and the GEMM library.
    pub fn summary(&self) -> String {
        let blas = if self.cublas { "cuBLAS found" } else { "no libcublas: GEMMs on the tile kernels" };
        let priority = match &self.priority {
            Ok(p) => format!("signals, waits and SM copies at priority {p}"),
            Err(_) => "every launch at the default priority".into(),
        };
        let loading = if self.can_gate() {
            "eager module loading"
        } else {
            "lazy module loading: lanes ungated (CUDA_MODULE_LOADING=EAGER gates them)"
        };
        let hopper = match (self.hopper_sms, self.pair_clusters) {
            (Some(sms), [wide, _]) if self.pair_clusters_assumed.is_some() => format!(
                "Hopper engine on {sms} SMs, clusters of two: {wide} assumed ({})",
                self.pair_clusters_assumed.as_deref().unwrap_or_default()
            ),
            (Some(sms), [wide, narrow]) if wide == narrow => {
                format!("Hopper engine on {sms} SMs, clusters of two: {wide}")
            }
            (Some(sms), [wide, narrow]) => format!(
                "Hopper engine on {sms} SMs, clusters of two: {wide} of {}, {narrow} of {}",
                HopperTile::Wide.name(),
                HopperTile::Narrow.name()
            ),
            (None, _) => "no Hopper engine".into(),
        };
        let queues = match hardware_queues() {
            Ok(n) => format!("{n} hardware queues"),
            Err(e) => e.to_string(),
        };
        let copies = match &self.batch_copies {
            Ok(()) => "copies may ask for the copy engines".to_string(),
            Err(why) => why.clone(),
        };
        format!(
            "{} x{} ({}, {}; {blas}; {hopper}; {priority}; {loading}; {queues}; {copies})",
            self.name,
            self.ordinals,
            self.arch,
            self.kernel_origin.describe(&self.arch)
        )
    }

    /// The SMs the Hopper engine's persistent grids span on GPU 0 (`None`: the GPU does
    /// not run the engine): what its tile rule is asked with.
    pub fn hopper_sms(&self) -> Option<u32> {
        self.hopper_sms
    }

    /// Whether libcublas was found when the backend started.
    pub fn has_cublas(&self) -> bool {
        self.cublas
    }

    /// Whether stream memory operations work here ([`SyncMode::StreamMemOps`]), or why not.
    pub fn stream_memops(&self) -> Result<(), String> {
        self.memops.clone()
    }

    /// The greatest launch priority of GPU 0, at which signals, waits and SM copies are
    /// launched ([`CudaRunOptions::comm_priority`]), or why launches keep the default
    /// priority here (probed when the backend started).
    pub fn comm_priority(&self) -> Result<i32, String> {
        self.priority.clone()
    }

    /// The GPU's name and UUID, for stamps keyed by GPU.
    pub fn identity(&self) -> Result<String, CudaError> {
        let state = self.ready()?;
        let uuid = state.gpus[0].ctx.uuid().map_err(|e| CudaError::driver("reading the UUID", e))?;
        let bytes: Vec<String> = uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
        Ok(format!("{} {}", self.name, bytes.join("")))
    }

    /// The state, with lost contexts rebuilt; an error if the GPU is stuck.
    fn ready(&self) -> Result<MutexGuard<'_, State>, CudaError> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match state.health.clone() {
            Health::Ready => {}
            Health::Hung(plan) => {
                return Err(CudaError::Hung { plan, reason: "an earlier run could not be stopped".into() })
            }
            Health::Lost => {
                // Drop every stream, handle, module and context, reset the primary
                // contexts (freeing whatever a faulted run left), and start again.
                state.gpus.clear();
                for ordinal in 0..self.ordinals {
                    let device = result::device::get(ordinal as i32)
                        .map_err(|e| CudaError::driver("finding the GPU to reset", e))?;
                    // SAFETY: no object of this backend refers to the context any more
                    // (all were dropped above), so resetting it invalidates nothing in use.
                    #[allow(unsafe_code)]
                    unsafe { sys::cuDevicePrimaryCtxReset_v2(device).result() }.map_err(|e| CudaError::Driver {
                        during: "resetting a lost context".into(),
                        message: e.to_string(),
                    })?;
                }
                state.gpus = open_gpus(&self.ptx, self.ordinals, self.hopper_sms.is_some())?;
                state.health = Health::Ready;
            }
        }
        Ok(state)
    }

    /// Median GPU time in µs of `reps` back-to-back runs of one GEMM on GPU 0 (events
    /// around each; inputs from the generator's realistic family, never zeros), and the
    /// engine that ran it (`engine` must be [`GemmEngine::Cublas`] or
    /// [`GemmEngine::TileKernel`]). The runs rotate among copies of the operands that
    /// together are at least twice the L2 (at most 64 copies), so that no run finds its
    /// operands in the cache, as a GEMM of a plan seldom does.
    pub fn time_gemm(&self, spec: &GemmSpec, engine: GemmEngine, reps: usize) -> Result<f64, CudaError> {
        self.time_gemm_tiles(spec, engine, false, reps)
    }

    /// [`Self::time_gemm`], with the tile kernel's 128×128 tiles where `wide_tiles`
    /// ([`CudaRunOptions::wide_tiles`]).
    pub fn time_gemm_tiles(
        &self,
        spec: &GemmSpec,
        engine: GemmEngine,
        wide_tiles: bool,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let choice =
            GemmChoice { engine, wide_tiles, hopper: false, hopper_tile: None, hopper_variant: HopperVariant::Engine };
        self.time_gemm_as(spec, &choice, reps).map(|(us, _)| us)
    }

    /// [`Self::time_gemm`] on the kernel `choice` picks (any engine), with the kernel
    /// that ran.
    pub fn time_gemm_as(
        &self,
        spec: &GemmSpec,
        choice: &GemmChoice,
        reps: usize,
    ) -> Result<(f64, GemmImpl), CudaError> {
        let plan = gemm_plan(spec)?;
        let options = LowerOptions {
            gemm: choice.engine,
            sync: SyncMode::Kernels,
            cublas_present: self.cublas,
            queues: 1,
            wide_tiles: choice.wide_tiles,
            hopper: self.hopper_target(
                choice.hopper || choice.engine == GemmEngine::Hopper,
                choice.hopper_tile,
                choice.hopper_variant,
            ),
        };
        let lowered = lower(&plan, &options)?;
        let Some(step) = lowered.steps.first() else {
            return Err(CudaError::Unsupported { plan: plan.name, what: "an empty GEMM has no time".into() });
        };
        let Some(Command::Gemm(command)) = step.command.clone() else { unreachable!("a one-GEMM plan") };
        let mut state = self.ready()?;
        let result = time_gemm_on(&mut state, &plan, &command, reps.max(1));
        if let Err(CudaError::ContextLost { .. }) = &result {
            state.health = Health::Lost;
        }
        result.map(|us| (us, command.imp))
    }

    /// The Hopper engine as a run with `options` may use it.
    fn hopper_for(&self, options: &CudaRunOptions) -> Option<HopperTarget> {
        self.hopper_target(options.asks_hopper(), options.hopper_tile, options.hopper_variant)
    }

    /// The Hopper engine as lowering may use it, where `wanted` and the GPU runs it.
    fn hopper_target(&self, wanted: bool, tile: Option<HopperTile>, variant: HopperVariant) -> Option<HopperTarget> {
        self.hopper_sms.filter(|_| wanted).map(|sms| HopperTarget {
            sms,
            pair_clusters: self.pair_clusters,
            tile,
            variant,
        })
    }
}

/// Which kernel [`CudaBackend::time_gemm_as`] times: the engine policy, the tile
/// kernels' tile and the Hopper engine's tile (`None`: its rule's choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmChoice {
    /// Engine policy ([`GemmEngine::TileKernel`] takes the Hopper engine where it can).
    pub engine: GemmEngine,
    /// The tile kernels' 128×128 tiles.
    pub wide_tiles: bool,
    /// GEMMs on cmm's own kernels take the Hopper engine where they can
    /// ([`CudaRunOptions::hopper`]).
    pub hopper: bool,
    /// The Hopper engine's tile.
    pub hopper_tile: Option<HopperTile>,
    /// Which of the Hopper engine's kernels (the engine's own but in the GEMM sweep).
    pub hopper_variant: HopperVariant,
}

impl CudaExecutor for CudaBackend {
    fn describe(&self) -> String {
        format!("cuda on {}", self.summary())
    }

    /// GPU 0 runs the Hopper engine (compute capability 9.0).
    fn has_hopper_engine(&self) -> bool {
        self.hopper_sms.is_some()
    }

    fn run(
        &self,
        plan: &Plan,
        seed: u32,
        family: Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        self.run_from(plan, Source::Generated { seed, family }, options)
    }
}

/// Where a run's inputs come from.
#[derive(Clone, Copy, Debug)]
enum Source<'a> {
    /// Generated from `(seed, family)` into buffers cmm allocates.
    Generated { seed: u32, family: Family },
    /// The caller's buffers.
    Given(&'a [GivenBuffer]),
}

impl CudaBackend {
    /// Runs `plan` on the caller's device buffers: every input, output, accumulator and
    /// routing table of every device bound by name ([`GivenBuffer`]); cmm allocates only
    /// the plan's scratch buffers, semaphores and the Hopper engine's staging of gathered
    /// rows ([`crate::lower::Lowered::staging`]). The buffers are checked before anything
    /// runs: names, shapes and dtypes against the plan, alignment
    /// ([`crate::GIVEN_ALIGNMENT`]), no two overlapping, and with the driver that each is
    /// device memory of the GPU that runs its device, whole inside one allocation; given
    /// routing tables are read and checked as generated ones are. The results are left in
    /// the caller's buffers (and, per `options.read_back`, copied back as well).
    pub fn run_given(
        &self,
        plan: &Plan,
        given: &[GivenBuffer],
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        self.run_from(plan, Source::Given(given), options)
    }

    fn allocate_and_execute(
        &self,
        state: &mut State,
        plan: &Plan,
        lowered: &Lowered,
        source: Source<'_>,
        bound: Option<&Bound>,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        let on = |d| gpu_of(options.placement, d);
        if let (Source::Given(given), Some(bound)) = (source, bound) {
            crate::given::check_with_driver(plan, given, bound, |d| state.gpus[on(d)].ctx.clone())?;
        }
        let mut memory = Memory::allocate(&state.gpus, plan, bound, on)?;
        memory.stage(plan, lowered, |d| state.gpus[on(d)].ctx.clone())?;
        // The caller's buffers hold what they hold; cmm's own are generated or poisoned.
        let (seed, family) = match source {
            Source::Generated { seed, family } => (seed, family),
            Source::Given(_) => (0, Family::Exact),
        };
        memory.initialise(&state.gpus, plan, seed, family, bound, on)?;
        execute(state, plan, lowered, memory, options, None)
    }

    /// Runs device `rendezvous.rank`'s lanes of `plan` in this process, one process per
    /// device (see [`Rendezvous`]): on GPU 0 of this backend, with inputs generated from
    /// `(seed, family)` as [`CudaExecutor::run`] generates device `rank`'s, in a symmetric
    /// heap whose parts the ranks exchange at the rendezvous. The output holds this
    /// rank's buffers (the other devices' come back empty). `options.placement`,
    /// `stagger` and `offset_starts` do not apply (each rank is one device on its GPU).
    pub fn run_rank(
        &self,
        plan: &Plan,
        rendezvous: &Rendezvous,
        seed: u32,
        family: Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        self.rank_from(plan, rendezvous, Source::Generated { seed, family }, options)
    }

    /// [`CudaBackend::run_rank`] on this rank's own device buffers: `given` binds every
    /// input, output, accumulator and routing table of device `rendezvous.rank` (checked
    /// as [`CudaBackend::run_given`] checks them). The inputs are copied into this rank's
    /// part of the symmetric heap before the ranks meet, and the results out of it once
    /// every rank is done (peers reach only the heap, never the caller's buffers).
    pub fn run_rank_given(
        &self,
        plan: &Plan,
        rendezvous: &Rendezvous,
        given: &[GivenBuffer],
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        self.rank_from(plan, rendezvous, Source::Given(given), options)
    }

    fn rank_from(
        &self,
        plan: &Plan,
        rendezvous: &Rendezvous,
        source: Source<'_>,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        let start = Instant::now();
        let rank = rendezvous.rank;
        let refused = if rendezvous.world != plan.devices {
            Some(format!("{} ranks for a plan of {} devices", rendezvous.world, plan.devices))
        } else if rank >= rendezvous.world {
            Some(format!("no such rank: the ranks of {} are 0 to {}", rendezvous.world, rendezvous.world - 1))
        } else {
            None
        };
        if let Some(what) = refused {
            return Err(CudaError::Rendezvous {
                rank,
                world: rendezvous.world,
                socket: rendezvous.socket.clone(),
                what,
            });
        }
        self.check_driver_calls(plan, options)?;
        let options = &CudaRunOptions {
            placement: Placement::Virtual,
            stagger: false,
            offset_starts: false,
            ..self.copies_resolved(options)
        };
        let hopper = self.hopper_for(options);
        let (seed, family, bound) = match source {
            Source::Generated { seed, family } => (Some(seed), family, None),
            Source::Given(given) => (None, Family::Exact, Some(crate::given::bind(plan, given, rank..rank + 1)?)),
        };
        let mut lowered = prepare_in_order(plan, seed, options, self.cublas, hopper, None)?;
        // Every rank lowers the whole plan (the same proof, the same wait slots) and keeps
        // its own steps, in the schedule's order.
        let lanes = plan.lanes.len().max(1);
        lowered.steps.retain(|step| step.stream / lanes == rank);
        let mut state = self.ready()?;
        let ctx = state.gpus[0].ctx.clone();
        if let (Source::Given(given), Some(bound)) = (source, &bound) {
            crate::given::check_with_driver(plan, given, bound, |_| ctx.clone())?;
        }
        let (mut memory, meeting) = Memory::symmetric(&ctx, plan, rendezvous)?;
        memory.stage(plan, &lowered, |_| ctx.clone())?;
        // The caller's buffers and their places in the heap: inputs in, results out.
        let mut copy_in = Vec::new();
        let mut copy_out = Vec::new();
        for (b, decl) in plan.buffers.iter().enumerate() {
            let Some(theirs) = bound.as_ref().and_then(|bound| bound[rank][b]) else { continue };
            // An uneven shard's own rows: the caller's buffer holds no padding.
            let (heap, bytes) = (memory.base[rank][b], decl.len_on(rank) * decl.dtype.size_bytes());
            if decl.role.initialized() {
                copy_in.push((theirs, heap, bytes));
            }
            if decl.role.is_result() {
                copy_out.push((heap, theirs, bytes));
            }
        }
        let result = memory
            .initialise(&state.gpus, plan, seed.unwrap_or(0), family, bound.as_ref(), |_| 0)
            .and_then(|()| copy_device(&ctx, &copy_in))
            .and_then(|()| execute(&mut state, plan, &lowered, memory, options, Some((&meeting, &copy_out))));
        let mut out = state.note_health(result)?;
        out.elapsed = start.elapsed();
        Ok(out)
    }

    /// A zeroed device allocation of `bytes` on GPU `gpu` of this backend, for callers
    /// without an allocator of their own ([`CudaBackend::run_given`]).
    pub fn device_buffer(&self, gpu: usize, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        let state = self.ready()?;
        let g = state.gpus.get(gpu).ok_or_else(|| CudaError::NoCudaDevice {
            reason: format!("GPU {gpu} asked for, the backend opened {}", state.gpus.len()),
        })?;
        Ok(DeviceBuffer { alloc: DeviceAlloc::zeroed(&g.ctx, bytes)?, bytes })
    }

    /// One fresh device buffer per input, result and routing table of every device of
    /// `plan`, holding what the generated path puts there for `(seed, family)` (outputs:
    /// its poison), on the GPU `placement` gives each device, bound by name: the caller's
    /// side of [`CudaBackend::run_given`] for tests and examples.
    pub fn generated_buffers(
        &self,
        plan: &Plan,
        seed: u32,
        family: Family,
        placement: Placement,
    ) -> Result<Vec<(GivenBuffer, DeviceBuffer)>, CudaError> {
        let initial = cmm_core::cpu::initial_memory(plan, seed, family);
        let mut out = Vec::new();
        for (d, memory) in initial.iter().enumerate() {
            for (b, decl) in plan.buffers.iter().enumerate() {
                if !crate::given::given_by_caller(decl) {
                    continue;
                }
                // An uneven shard: the device's own rows, as a caller's tensor holds them.
                let bytes = decl.dtype.le_bytes(&memory[b][..decl.len_on(d)]);
                let buffer = self.device_buffer(gpu_of(placement, d), bytes.len())?;
                buffer.upload(&bytes)?;
                let (name, ptr, rows, cols, dtype) =
                    (decl.name.clone(), buffer.ptr(), decl.rows_on(d), decl.cols, decl.dtype);
                out.push((GivenBuffer { device: d, name, ptr, rows, cols, dtype }, buffer));
            }
        }
        Ok(out)
    }

    /// Refuses stream memory operations, and copies asked of the copy engines, where
    /// this GPU's driver has no call for them.
    fn check_driver_calls(&self, plan: &Plan, options: &CudaRunOptions) -> Result<(), CudaError> {
        let unsupported = |what: String| CudaError::Unsupported { plan: plan.name.clone(), what };
        if options.sync == SyncMode::StreamMemOps {
            self.memops.clone().map_err(|why| {
                unsupported(format!("stream memory operations are not available on this GPU ({why})"))
            })?;
        }
        if options.copies == CopyIssue::PreferCopyEngines {
            self.batch_copies
                .clone()
                .map_err(|why| unsupported(format!("copies cannot be asked of the copy engines: {why}")))?;
        }
        Ok(())
    }

    /// `options` with [`CopyIssue::Auto`] made what it is on this driver (every run takes
    /// its copies' way from here: `submit` asks the batched call only where it is).
    fn copies_resolved(&self, options: &CudaRunOptions) -> CudaRunOptions {
        CudaRunOptions { copies: options.copies.on_driver(self.batch_copies.is_ok()), ..*options }
    }

    /// Whether copies can be asked of the copy engines ([`CopyIssue::PreferCopyEngines`]):
    /// the driver has `cuMemcpyBatchAsync`, or why not.
    pub fn batch_copies(&self) -> Result<(), String> {
        self.batch_copies.clone()
    }

    fn run_from(&self, plan: &Plan, source: Source<'_>, options: &CudaRunOptions) -> Result<CudaRunOutput, CudaError> {
        let start = Instant::now();
        let options = &self.copies_resolved(options);
        let offset = emulated(plan, options)?;
        let plan = offset.as_ref().unwrap_or(plan);
        self.check_driver_calls(plan, options)?;
        let hopper = self.hopper_for(options);
        let (seed, bound) = match source {
            Source::Generated { seed, .. } => (Some(seed), None),
            Source::Given(given) => (None, Some(crate::given::bind(plan, given, 0..plan.devices)?)),
        };
        let lowered = prepare_in_order(plan, seed, options, self.cublas, hopper, None)?;
        if options.placement == Placement::Gpus && plan.devices > self.ordinals {
            return Err(CudaError::NoCudaDevice {
                reason: format!("plan needs {} GPUs, the backend opened {}", plan.devices, self.ordinals),
            });
        }
        let mut state = self.ready()?;
        if options.placement == Placement::Gpus {
            let gpus = &state.gpus;
            crate::given::check_peers(plan, |d| gpu_of(options.placement, d), |g| gpus[g].ctx.cu_device())?;
        }
        let result = self.allocate_and_execute(&mut state, plan, &lowered, source, bound.as_ref(), options);
        let mut out = state.note_health(result)?;
        out.elapsed = start.elapsed();
        out.offset_starts = offset.is_some();
        Ok(out)
    }
}

/// The plan a run of `plan` under `options` executes in its place, if any: with
/// [`CudaRunOptions::offset_starts`] and virtual devices, its starts offset. A plan with
/// tile-granular GEMMs runs as it is (the run says so); one that would deadlock is an
/// error.
pub(crate) fn emulated(plan: &Plan, options: &CudaRunOptions) -> Result<Option<Plan>, CudaError> {
    use cmm_core::emulate::{offset_starts, OffsetError};
    if !(options.offset_starts && options.placement == Placement::Virtual) {
        return Ok(None);
    }
    match offset_starts(plan) {
        Ok(offset) => Ok(Some(offset)),
        Err(OffsetError::Fused { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Checks `plan` and its routing for `seed`, and lowers it for `options`: everything a
/// run decides before it touches memory (shared by the GPU and the host twin).
pub(crate) fn prepare(
    plan: &Plan,
    seed: u32,
    options: &CudaRunOptions,
    cublas_present: bool,
    hopper: Option<HopperTarget>,
) -> Result<Lowered, CudaError> {
    prepare_in_order(plan, Some(seed), options, cublas_present, hopper, None)
}

/// [`prepare`] with a given enqueue order, proven safe for `queues` hardware queues
/// (`None`: the schedule order, for this process's queue count). Without a seed the
/// inputs are the caller's: their routing tables are checked once they are bound.
pub(crate) fn prepare_in_order(
    plan: &Plan,
    seed: Option<u32>,
    options: &CudaRunOptions,
    cublas_present: bool,
    hopper: Option<HopperTarget>,
    order: Option<(&[cmm_core::plan::OpSite], usize)>,
) -> Result<Lowered, CudaError> {
    plan.validate()?;
    if let Some(what) = options.deadlines_refused() {
        return Err(CudaError::Unsupported { plan: plan.name.clone(), what });
    }
    if let Some(seed) = seed {
        plan.check_generator_range()?;
        cmm_core::moe::check_routing(plan, seed)?;
    }
    let lowering = |queues| LowerOptions {
        gemm: options.gemm,
        sync: options.sync,
        cublas_present,
        queues,
        wide_tiles: options.wide_tiles,
        hopper,
    };
    match order {
        None => lower(plan, &lowering(hardware_queues()?)),
        Some((order, queues)) => crate::lower::lower_in_order(plan, order, &lowering(queues)),
    }
}

/// A one-device plan holding one GEMM of `spec`.
pub fn gemm_plan(spec: &GemmSpec) -> Result<Plan, CudaError> {
    let (ar, ac) = if spec.trans_a { (spec.k, spec.m) } else { (spec.m, spec.k) };
    let (br, bc) = if spec.trans_b { (spec.n, spec.k) } else { (spec.k, spec.n) };
    let mut b = PlanBuilder::new(format!("gemm {}x{}x{} {}", spec.m, spec.n, spec.k, spec.input), 1);
    let input = BufferRole::whole_tensor;
    let x = b.buffer("A", spec.input, ar, ac, input(0, ac));
    let y = b.buffer("B", spec.input, br, bc, input(1, bc));
    let role = if spec.accumulate { input(2, spec.n) } else { BufferRole::Output };
    let c = b.buffer("C", spec.output, spec.m, spec.n, role);
    let lane = b.lane("main");
    let (a, bb, cc) = (b.whole(x), b.whole(y), b.whole(c));
    b.push(
        0,
        lane,
        Op::Gemm {
            a,
            b: bb,
            c: cc,
            trans_a: spec.trans_a,
            trans_b: spec.trans_b,
            accumulate: spec.accumulate,
            fused: None,
            c_device: None,
        },
    );
    let plan = b.finish()?;
    plan.check_generator_range()?;
    Ok(plan)
}

/// At most this many copies of one GEMM's operands rotate in [`CudaBackend::time_gemm`].
const MAX_GEMM_INPUT_SETS: usize = 64;

fn time_gemm_on(state: &mut State, plan: &Plan, command: &GemmCommand, reps: usize) -> Result<f64, CudaError> {
    // Operands that stay in L2 from one repetition to the next time the cache, not the
    // GEMM a plan runs on data it has not touched lately: rotate among enough copies
    // (each with its own inputs) that together they are twice the L2.
    let l2 = l2_bytes(&state.gpus[0].ctx)?;
    let sets = (2 * l2).div_ceil(plan_bytes(plan).max(1)).clamp(1, MAX_GEMM_INPUT_SETS);
    let memories = (0..sets)
        .map(|set| {
            let memory = Memory::allocate(&state.gpus, plan, None, |_| 0)?;
            memory.initialise(&state.gpus, plan, 7 + set as u32, Family::Realistic, None, |_| 0)?;
            Ok(memory)
        })
        .collect::<Result<Vec<Memory>, CudaError>>()?;
    ensure_lanes(state, 0, 1, command.imp == GemmImpl::Cublas)?;
    let gpu = &state.gpus[0];
    let stream = gpu.lanes[0].stream.clone();
    let blas = gpu.lanes[0].blas.as_ref().map(|h| h.0);
    let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(reps);
    let submissions =
        memories.iter().map(|memory| gemm_submission(memory, command)).collect::<Result<Vec<_>, CudaError>>()?;
    let issue = |set: usize| submit(&gpu.functions, &stream, blas, &submissions[set], None, CopyIssue::Driver);
    issue(0)?; // warm-up: cuBLAS picks and loads its kernel here
    for rep in 0..reps {
        // Set 0 was just warmed: the first timed run takes the next one.
        let begin = stream.record_event(timed).map_err(|e| CudaError::driver("recording an event", e))?;
        issue((rep + 1) % sets)?;
        let end = stream.record_event(timed).map_err(|e| CudaError::driver("recording an event", e))?;
        end.synchronize().map_err(|e| CudaError::driver("running a GEMM", e))?;
        times.push(begin.elapsed_ms(&end).map_err(|e| CudaError::driver("reading an event", e))? as f64 * 1e3);
    }
    stream.synchronize().map_err(|e| CudaError::driver("running a GEMM", e))?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The L2 size of `ctx`'s GPU in bytes.
fn l2_bytes(ctx: &Arc<CudaContext>) -> Result<usize, CudaError> {
    let bytes = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        .map_err(|e| CudaError::driver("reading the L2 size", e))?;
    Ok(bytes.max(0) as usize)
}

/// Writes twice the L2 of `ctx`'s GPU and waits, so that what was there is gone.
fn evict_l2(ctx: &Arc<CudaContext>) -> Result<(), CudaError> {
    let bytes = 2 * l2_bytes(ctx)?;
    if bytes == 0 {
        return Ok(());
    }
    let scratch = DeviceAlloc::uninit(ctx, bytes)?;
    // SAFETY: `scratch` is a live allocation of `bytes` bytes in the current context
    // (`uninit` made it current), freed only after the context is synchronised below.
    #[allow(unsafe_code)]
    unsafe { result::memset_d8_sync(scratch.ptr, 0x5a, bytes) }.map_err(|e| CudaError::driver("evicting the L2", e))?;
    // A device memset may return before it is done: wait, so it does not overlap the run.
    ctx.synchronize().map_err(|e| CudaError::driver("evicting the L2", e))
}

/// Bytes of one device's buffers.
fn plan_bytes(plan: &Plan) -> usize {
    plan.buffers.iter().map(|b| b.len() * b.dtype.size_bytes()).sum()
}

/// The GPU of device `d`.
fn gpu_of(placement: Placement, d: usize) -> usize {
    match placement {
        Placement::Virtual => 0,
        Placement::Gpus => d,
    }
}

/// Bytes of each cuBLAS handle's own workspace (cuBLAS asks 32 MiB on Hopper).
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Makes sure GPU `g` has `count` lane streams (created in order, so stream i keeps
/// its hardware queue across runs) and, with `blas`, a cuBLAS handle on each.
fn ensure_lanes(state: &mut State, g: usize, count: usize, blas: bool) -> Result<(), CudaError> {
    let gpu = &mut state.gpus[g];
    while gpu.lanes.len() < count {
        let stream = gpu.ctx.new_stream().map_err(|e| CudaError::driver("creating a lane stream", e))?;
        gpu.lanes.push(LaneSlot { priority: 0, blas: None, workspace: None, stream });
    }
    if blas {
        gpu.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding the context for cuBLAS", e))?;
        for slot in gpu.lanes.iter_mut().take(count) {
            if slot.blas.is_some() {
                continue;
            }
            let handle = blas::create_handle().map_err(|e| CudaError::driver("creating a cuBLAS handle", e))?;
            let handle = BlasHandle(handle);
            // SAFETY: the handle was just created under this stream's context, which is
            // current, and the stream lives as long as the slot that owns both.
            #[allow(unsafe_code)]
            unsafe { blas::set_stream(handle.0, slot.stream.cu_stream() as _) }
                .map_err(|e| CudaError::driver("binding cuBLAS to a stream", e))?;
            // A workspace of the handle's own, fixed before any run, so that cuBLAS has
            // no memory of its own to find while a run holds its lanes behind the gate.
            let workspace = DeviceAlloc::uninit(&gpu.ctx, CUBLAS_WORKSPACE_BYTES)?;
            // SAFETY: the handle is live and the workspace outlives it (the slot drops the
            // handle first); nothing else uses this memory.
            #[allow(unsafe_code)]
            unsafe { blas_sys::cublasSetWorkspace_v2(handle.0, workspace.ptr as _, CUBLAS_WORKSPACE_BYTES).result() }
                .map_err(|e| CudaError::driver("giving cuBLAS its workspace", e))?;
            slot.workspace = Some(workspace);
            slot.blas = Some(handle);
        }
    }
    Ok(())
}

/// Runs every cuBLAS GEMM shape of the plan not yet seen on its lane once, alone, on
/// scratch operands. cuBLAS loads a shape's kernels (`cuLibraryLoadData`) the first
/// time it meets it, whatever `CUDA_MODULE_LOADING` says, and a load waits for the
/// context's running kernels: in a gated run the host would wait there for lanes held
/// until it opens the gate (seen on an H100: every gated case stopped until the gate's
/// deadline). After this, a run's GEMMs find their kernels loaded.
fn warm_cublas(
    state: &mut State,
    lowered: &Lowered,
    streams: &[(usize, usize)],
    memory: &Memory,
) -> Result<(), CudaError> {
    const ALIGN: u64 = 256;
    for step in &lowered.steps {
        let Some(Command::Gemm(command)) = &step.command else { continue };
        let Submission::Cublas { args, dtypes } = gemm_submission(memory, command)? else { continue };
        let (g, slot) = streams[step.stream];
        // What makes cuBLAS choose (and load) a kernel: everything but where the
        // operands are, of which only the alignment counts.
        let shape = GemmArgs { a: args.a % ALIGN, b: args.b % ALIGN, c: args.c % ALIGN, ..args };
        if !state.warm_blas.insert((g, slot, shape)) {
            continue;
        }
        let gpu = &state.gpus[g];
        let lane = &gpu.lanes[slot];
        let handle = lane.blas.as_ref().expect("lanes running cuBLAS GEMMs have handles").0;
        // Operands as large as any layout of these dimensions and strides needs, at the
        // real operands' alignments; zeroed, so the GEMM reads defined values.
        let (m, n, k) = (u64::from(args.m), u64::from(args.n), u64::from(args.k));
        let bytes = |stride: u64, rows: u64| (stride.max(1) * rows.max(1) * 4 + ALIGN) as usize;
        let a = DeviceAlloc::zeroed(&gpu.ctx, bytes(args.a_stride, m.max(k)))?;
        let b = DeviceAlloc::zeroed(&gpu.ctx, bytes(args.b_stride, k.max(n)))?;
        let c = DeviceAlloc::zeroed(&gpu.ctx, bytes(args.c_stride, m.max(n)))?;
        let scratch = GemmArgs { a: a.ptr + shape.a, b: b.ptr + shape.b, c: c.ptr + shape.c, ..args };
        lane.stream.context().bind_to_thread().map_err(|e| CudaError::driver("binding a lane's context", e))?;
        cublas_gemm(handle, &scratch, dtypes)?;
        lane.stream.synchronize().map_err(|e| CudaError::driver("warming cuBLAS up", e))?;
    }
    Ok(())
}

/// Everything one run enqueues, kept together so that an error anywhere can stop and
/// drain the GPU before any of it is freed.
struct Run<'s> {
    state: &'s State,
    plan: &'s Plan,
    options: &'s CudaRunOptions,
    control: HostControl,
    /// `(gpu, slot)` of each stream of the lowered plan.
    streams: Vec<(usize, usize)>,
    enqueued: bool,
    /// Per fused GEMM command, in step order: its tables and control words.
    fused: Vec<DeviceAlloc>,
}

/// Runs the lowered plan on `memory`, already initialised. In rank mode (`rank`: the
/// meeting, and the results' copies out to the caller's buffers), `lowered` holds this
/// rank's steps only, its lanes run on GPU 0, and the ranks meet once every rank's lanes
/// are done, before the results are copied out and read back.
fn execute(
    state: &mut State,
    plan: &Plan,
    lowered: &Lowered,
    memory: Memory,
    options: &CudaRunOptions,
    rank: Option<(&Meeting, &[DeviceCopy])>,
) -> Result<CudaRunOutput, CudaError> {
    let meeting = rank.map(|(meeting, _)| meeting);
    let lanes = plan.lanes.len();
    let streams: Vec<(usize, usize)> = (0..lowered.streams)
        .map(|s| {
            let d = s / lanes.max(1);
            match (options.placement, meeting) {
                (_, Some(_)) => (0, s % lanes.max(1)),
                (Placement::Virtual, None) => (0, s),
                (Placement::Gpus, None) => (d, s % lanes.max(1)),
            }
        })
        .collect();
    let blas = lowered.gemms().cublas > 0;
    for g in 0..state.gpus.len() {
        let count = streams.iter().filter(|(gpu, _)| *gpu == g).map(|(_, slot)| slot + 1).max().unwrap_or(0);
        ensure_lanes(state, g, count, blas)?;
    }
    if blas {
        warm_cublas(state, lowered, &streams, &memory)?;
    }
    let staggered = set_lane_priorities(state, plan.devices, lanes, &streams, options)?;
    if options.cold_l2 {
        for gpu in &state.gpus {
            evict_l2(&gpu.ctx)?;
        }
    }
    let state: &State = state;
    let control = HostControl::new(&state.gpus[0].ctx, lowered.wait_slots.len())?;
    let fused = fused_tables(state, lowered, &memory, &streams)?;
    // Ranks meet only once each is ready to enqueue: its lanes, cuBLAS handles and
    // kernels loaded. A rank's first cuBLAS use can take seconds (its kernels loaded
    // eagerly), and past the meeting that would count against its peers' wait deadline.
    if let Some(meeting) = meeting {
        meeting.barrier(MEETING_READY, "ready")?;
    }
    let mut run = Run { state, plan, options, control, streams, enqueued: false, fused };
    let (gpu_ms, gated, op_times) = match run.go(lowered, &memory) {
        Ok(timing) => timing,
        Err(e) => {
            let e = if run.enqueued { run.stop(e, lowered) } else { e };
            if matches!(e, CudaError::Hung { .. }) {
                // Streams may still read the memory and the control words: never free
                // them under running work.
                std::mem::forget(memory);
                std::mem::forget(run);
            }
            return Err(e);
        }
    };
    let fused_waits = fused_waits(&run.fused, lowered)?;
    if let Some((meeting, copy_out)) = rank {
        meeting.barrier(MEETING_DONE, "done")?;
        copy_device(&state.gpus[0].ctx, copy_out)?;
    }
    let buffers = if options.read_back == ReadBack::Nothing {
        Vec::new()
    } else {
        memory.read_back(&state.gpus, plan, |d| gpu_of(options.placement, d), options.read_back)?
    };
    Ok(CudaRunOutput {
        buffers,
        gpu_time: Duration::from_secs_f64(gpu_ms / 1e3),
        gated,
        gemms: lowered.gemms(),
        comm_priority: comm_priority(options, &state.gpus[0]),
        staggered,
        offset_starts: false,
        op_times,
        fused_waits,
        elapsed: Duration::ZERO,
    })
}

/// What each fused GEMM's CTAs counted of their waits ([`FusedLayout::stats`]), read back
/// from its table once the run has finished.
fn fused_waits(tables: &[DeviceAlloc], lowered: &Lowered) -> Result<Vec<FusedWaits>, CudaError> {
    let mut waits = Vec::new();
    for (table, f) in tables.iter().zip(lowered.fused_gemms()) {
        let mut words = [0u64; 2];
        table.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        // SAFETY: the two words lie inside the live table (its layout sized it to hold
        // them); every stream that wrote them has finished.
        #[allow(unsafe_code)]
        unsafe { result::memcpy_dtoh_sync(&mut words, table.ptr + FusedLayout::of(f).stats) }
            .map_err(|e| CudaError::driver("reading a fused gemm's counts", e))?;
        waits.push(FusedWaits::from_words(words));
    }
    Ok(waits)
}

/// Each device's lane priority under [`CudaRunOptions::stagger`] on a GPU whose greatest
/// priority is `greatest` (the least is 0): the levels between the communicating kernels'
/// and 0, device d at ⌊d·levels / D⌋ of them. Empty where staggering does not apply.
fn stagger_priorities(options: &CudaRunOptions, greatest: &Result<i32, String>, devices: usize) -> Vec<i32> {
    match greatest {
        // Communication keeps the greatest priority; at least two levels stay below it.
        Ok(g) if options.stagger && options.placement == Placement::Virtual && *g <= -2 => {
            let levels = g.unsigned_abs() as usize;
            cmm_core::emulate::staggered_priorities(devices, levels).into_iter().map(|p| g + 1 + p).collect()
        }
        _ => Vec::new(),
    }
}

/// Sets every lane stream of the run to its device's staggered priority, or back to the
/// default (streams are kept across runs); returns the priorities that apply.
fn set_lane_priorities(
    state: &mut State,
    devices: usize,
    lanes: usize,
    streams: &[(usize, usize)],
    options: &CudaRunOptions,
) -> Result<Vec<i32>, CudaError> {
    let staggered = stagger_priorities(options, &state.gpus[0].priority, devices);
    for (s, &(g, slot)) in streams.iter().enumerate() {
        let wanted = staggered.get(s / lanes.max(1)).copied().unwrap_or(0);
        let lane = &mut state.gpus[g].lanes[slot];
        if lane.priority == wanted {
            continue;
        }
        lane.stream.context().bind_to_thread().map_err(|e| CudaError::driver("binding a lane's context", e))?;
        let value = sys::CUstreamAttrValue { priority: wanted };
        // SAFETY: the stream is live (its slot owns it), `value` outlives the call, and the
        // priority attribute reads the union's `priority` field.
        #[allow(unsafe_code)]
        unsafe {
            sys::cuStreamSetAttribute(
                lane.stream.cu_stream(),
                sys::CUstreamAttrID::CU_LAUNCH_ATTRIBUTE_PRIORITY,
                &value,
            )
        }
        .result()
        .map_err(|e| CudaError::driver("setting a lane's stream priority", e))?;
        lane.priority = wanted;
    }
    Ok(staggered)
}

/// `(from, to, bytes)`: a copy between device buffers of one GPU.
type DeviceCopy = (u64, u64, usize);

/// Copies between device buffers of `ctx`'s GPU, synchronously.
fn copy_device(ctx: &Arc<CudaContext>, copies: &[DeviceCopy]) -> Result<(), CudaError> {
    ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
    for &(from, to, bytes) in copies.iter().filter(|c| c.2 > 0) {
        // SAFETY: both ranges were checked to lie whole in device memory of this GPU (the
        // caller's by `given::check_with_driver`, the heap's by its layout), they do not overlap,
        // and no kernel touches them during the copy (before the `ready` meeting, or
        // after `done`).
        #[allow(unsafe_code)]
        unsafe { result::memcpy_dtod_sync(to, from, bytes) }
            .map_err(|e| CudaError::driver("copying between the caller's buffers and the heap", e))?;
    }
    Ok(())
}

/// The meetings of a rank-mode run after the hello ([`crate::rank`]).
const MEETING_READY: u8 = 1;
const MEETING_DONE: u8 = 2;

/// Plans with more driver calls on one stream than this run ungated: a held stream whose
/// launch queue fills would block the host before it opens the gate.
const GATE_MAX_OPS_PER_STREAM: usize = 256;

/// `CMM_CUDA_GATE=0` makes [`CudaRunOptions::default`] hold no lanes behind the gate.
pub const GATE_VAR: &str = "CMM_CUDA_GATE";

/// The variable that chooses CUDA's module loading, read once when the driver starts.
pub const MODULE_LOADING_VAR: &str = "CUDA_MODULE_LOADING";

/// The variable that sets how many hardware queues the driver spreads streams over, read
/// once when the driver starts.
pub const HARDWARE_QUEUES_VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// Sets what cmm's binaries want of the driver, each unless the user chose it: eager
/// module loading (`CUDA_MODULE_LOADING=EAGER`), so that runs can be gated
/// ([`CudaBackend::can_gate`]); and the most hardware queues
/// (`CUDA_DEVICE_MAX_CONNECTIONS=32`, 8 unset), so that a plan's lanes (three per virtual
/// device) seldom share one. Streams that share a queue run its items in one FIFO order:
/// on one H100 (2026-11-26, 8 queues) a fused gemm_rs at D = 4 started device 3's
/// persistent GEMM 600 µs late, 3 µs after another device's spinning wait ended, as a
/// queue shared with it would, and one-thread signal kernels took up to 700 µs. The
/// schedule order is proven hang-free for whatever count is set
/// (`cmm_core::verify::queues`). Call it first thing in `main`, before any thread exists
/// and before any CUDA call: the driver reads both at `cuInit`.
pub fn driver_environment_unless_chosen() {
    if std::env::var_os(MODULE_LOADING_VAR).is_none() {
        std::env::set_var(MODULE_LOADING_VAR, "EAGER");
    }
    if std::env::var_os(HARDWARE_QUEUES_VAR).is_none() {
        std::env::set_var(HARDWARE_QUEUES_VAR, cmm_core::verify::queues::MAX_QUEUES.to_string());
    }
}

/// Whether the driver loads modules eagerly (asked after `cuInit`).
fn module_loading_is_eager() -> Result<bool, CudaError> {
    let mut mode = sys::CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING;
    // SAFETY: `mode` is a live out-parameter; the driver was initialised by the context
    // opened before this call.
    #[allow(unsafe_code)]
    unsafe { sys::cuModuleGetLoadingMode(&mut mode) }
        .result()
        .map_err(|e| CudaError::driver("reading the module loading mode", e))?;
    Ok(mode == sys::CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING)
}

/// Whether `CUDA_LAUNCH_BLOCKING=1` makes every launch wait for its kernel: then the
/// gate's launch would wait for the gate, which only the host opens, after launching.
fn launches_block() -> bool {
    std::env::var("CUDA_LAUNCH_BLOCKING").is_ok_and(|v| v.trim() == "1")
}

impl Run<'_> {
    fn stream(&self, s: usize) -> &Arc<CudaStream> {
        let (g, slot) = self.streams[s];
        &self.state.gpus[g].lanes[slot].stream
    }

    /// Enqueues and runs the plan; returns (GPU ms, gated, the ops' times where asked).
    fn go(&mut self, lowered: &Lowered, memory: &Memory) -> Result<(f64, bool, OpTimes), CudaError> {
        let gpu0 = &self.state.gpus[0];
        let setup = gpu0.ctx.default_stream();
        let per_stream = lowered.most_calls_on_a_stream(self.options.copies);
        let gated =
            self.options.gate && self.state.eager_loading && !launches_block() && per_stream <= GATE_MAX_OPS_PER_STREAM;
        if !gated {
            self.control.open_gate();
        }
        let timeout_ns = (2 * self.options.run_timeout + self.options.wait_timeout).as_nanos() as u64;
        let (go, gate_status) =
            (self.control.device_word(ControlLayout::GO), self.control.device_word(ControlLayout::GATE));
        self.enqueued = true;
        let gate = Launch::new(
            Kernel::Gate,
            ONE_THREAD,
            vec![Param::U64(go), Param::U64(timeout_ns), Param::U64(gate_status)],
            "the gate",
        );
        launch_on(&setup, &gpu0.functions, &gate, None)?;
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let begin = setup.record_event(timed).map_err(|e| CudaError::driver("recording the start event", e))?;
        for s in 0..lowered.streams {
            self.stream(s).wait(&begin).map_err(|e| CudaError::driver("ordering a lane after the start", e))?;
        }
        let mut fused = self.fused.iter();
        let mut marks: Vec<(OpSite, CudaEvent, CudaEvent)> = Vec::new();
        let mark = |stream: &Arc<CudaStream>| {
            stream.record_event(timed).map_err(|e| CudaError::driver("recording an op's event", e))
        };
        for step in &lowered.steps {
            let Some(command) = &step.command else { continue };
            let (g, slot) = self.streams[step.stream];
            let lane = &self.state.gpus[g].lanes[slot];
            let before = if self.options.time_ops { Some(mark(&lane.stream)?) } else { None };
            if let Command::FusedGemm(f) = command {
                let table = fused.next().expect("one table per fused gemm");
                self.issue_fused(g, &lane.stream, memory, f, table)?;
            } else {
                self.issue(&self.state.gpus[g], lane, memory, command)?;
            }
            if let Some(before) = before {
                marks.push((step.site, before, mark(&lane.stream)?));
            }
        }
        let mut ends: Vec<CudaEvent> = Vec::new();
        for s in 0..lowered.streams {
            let done = self.stream(s).record_event(None).map_err(|e| CudaError::driver("recording a lane's end", e))?;
            setup.wait(&done).map_err(|e| CudaError::driver("joining lanes", e))?;
            ends.push(done);
        }
        let end = setup.record_event(timed).map_err(|e| CudaError::driver("recording the end event", e))?;
        self.control.open_gate();
        self.await_event(&end, self.options.run_timeout)?;
        self.sync_all()?;
        if self.control.read(ControlLayout::GATE) != 0 {
            return Err(CudaError::RunTimeout {
                plan: self.plan.name.clone(),
                limit_ms: timeout_ns / 1_000_000,
                pending: format!(
                    "the gate was never opened: the host was held enqueueing the plan's work behind it (at most \
                     {per_stream} driver calls on one lane); {GATE_VAR}=0 runs without the gate"
                ),
            });
        }
        if let Some(e) = timed_out_wait(self.plan, lowered, |slot| self.control.status(slot), self.options.wait_timeout)
        {
            return Err(e);
        }
        let ms = begin.elapsed_ms(&end).map_err(|e| CudaError::driver("reading the event timer", e))?;
        let since = |event: &CudaEvent| {
            begin.elapsed_ms(event).map(|ms| ms as f64 * 1e3).map_err(|e| CudaError::driver("reading an op's event", e))
        };
        let mut op_times = Vec::with_capacity(marks.len());
        for (site, before, after) in &marks {
            let start = since(before)?;
            op_times.push((*site, start, since(after)? - start));
        }
        Ok((ms as f64, gated, op_times))
    }

    /// Launches a tile-granular GEMM with the grid [`fused_grid`] gives it: every CTA
    /// resident, and room left for the kernels its waits depend on.
    fn issue_fused(
        &self,
        gpu: usize,
        stream: &Arc<CudaStream>,
        memory: &Memory,
        f: &FusedGemmCommand,
        table: &DeviceAlloc,
    ) -> Result<(), CudaError> {
        let ctx = &self.state.gpus[gpu].ctx;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::driver("reading the SM count", e))?
            .max(1) as u32;
        let sharing = match self.options.placement {
            Placement::Virtual => self.plan.devices as u32,
            Placement::Gpus => 1,
        };
        let per_sm = self.options.fused_ctas_per_sm;
        let (kernel, threads) = fused_kernel(f);
        let shared = match f.gemm.imp {
            GemmImpl::Hopper { tile, variant, .. } => tile.shared_bytes(variant) as usize,
            _ => 0,
        };
        let fits = self.state.gpus[gpu]
            .functions
            .get(kernel)
            .occupancy_max_active_blocks_per_multiprocessor(threads, shared, None)
            .map_err(|e| CudaError::driver("reading the fused kernel's occupancy", e))?;
        let ctas = fused_grid(sms, sharing, per_sm, fits, self.options.fused_free_sms).map_err(|why| {
            CudaError::Unsupported {
                plan: self.plan.name.clone(),
                what: format!("{per_sm} CTAs per SM of {}: {why}", kernel.entry()),
            }
        })?;
        let launch = fused_launch(memory, f, table.ptr, ctas, &self.words())?;
        launch_on(stream, &self.state.gpus[gpu].functions, &launch, None)
    }

    fn issue(&self, gpu: &Gpu, lane: &LaneSlot, memory: &Memory, command: &Command) -> Result<(), CudaError> {
        let stream = &lane.stream;
        // Driver and cuBLAS calls act in the current context: make it the stream's.
        stream.context().bind_to_thread().map_err(|e| CudaError::driver("binding a lane's context", e))?;
        let blas = lane.blas.as_ref().map(|h| h.0);
        let comm_priority = comm_priority(self.options, gpu);
        for submission in submissions(command, memory, &self.words())? {
            submit(&gpu.functions, stream, blas, &submission, comm_priority, self.options.copies)?;
        }
        Ok(())
    }

    /// The control words as kernels see them.
    fn words(&self) -> RunWords {
        RunWords::at(self.control.device_word(0), self.options.wait_timeout)
    }

    /// Polls `event` until it completes, fails, or `limit` passes.
    fn await_event(&self, event: &CudaEvent, limit: Duration) -> Result<(), CudaError> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(20);
        loop {
            // SAFETY: the event is live for the duration of the call.
            #[allow(unsafe_code)]
            match unsafe { result::event::query(event.cu_event()) } {
                Ok(()) => return Ok(()),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {}
                Err(e) => return Err(CudaError::driver("running the plan", e)),
            }
            if start.elapsed() > limit {
                return Err(CudaError::RunTimeout {
                    plan: self.plan.name.clone(),
                    limit_ms: limit.as_millis() as u64,
                    pending: "the run's end event never completed".into(),
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }

    fn sync_all(&self) -> Result<(), CudaError> {
        for g in &self.state.gpus {
            g.ctx.synchronize().map_err(|e| CudaError::driver("running the plan", e))?;
        }
        Ok(())
    }

    /// After an error with work enqueued: abort every kernel wait, open the gate, and
    /// wait (bounded) for the streams to drain. Returns the error to report.
    fn stop(&self, error: CudaError, lowered: &Lowered) -> CudaError {
        if matches!(error, CudaError::ContextLost { .. }) {
            return error;
        }
        self.control.raise_abort();
        self.control.open_gate();
        let limit = self.options.wait_timeout + Duration::from_secs(5);
        let start = Instant::now();
        for s in 0..self.streams.len() {
            loop {
                // SAFETY: the stream is live (owned by the backend's lane slots).
                #[allow(unsafe_code)]
                match unsafe { sys::cuStreamQuery(self.stream(s).cu_stream()) } {
                    sys::CUresult::CUDA_SUCCESS => break,
                    sys::CUresult::CUDA_ERROR_NOT_READY if start.elapsed() < limit => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    sys::CUresult::CUDA_ERROR_NOT_READY => {
                        let why = match self.options.sync {
                            SyncMode::StreamMemOps => "a stream-memory-op wait cannot be aborted",
                            SyncMode::Kernels => "the aborted waits did not drain",
                        };
                        return CudaError::Hung {
                            plan: self.plan.name.clone(),
                            reason: format!("{why}; after: {error}"),
                        };
                    }
                    other => return CudaError::driver("draining after an error", format!("{other:?}; after: {error}")),
                }
            }
        }
        match error {
            CudaError::RunTimeout { plan, limit_ms, pending } => {
                let pending = released_waits(self.plan, lowered, |slot| self.control.status(slot)).unwrap_or(pending);
                CudaError::RunTimeout { plan, limit_ms, pending }
            }
            other => other,
        }
    }
}

/// Every fused GEMM's table, in step order, on the GPU of its stream.
fn fused_tables(
    state: &State,
    lowered: &Lowered,
    memory: &Memory,
    streams: &[(usize, usize)],
) -> Result<Vec<DeviceAlloc>, CudaError> {
    let mut tables = Vec::new();
    for step in &lowered.steps {
        let Some(Command::FusedGemm(f)) = &step.command else { continue };
        let bytes = fused_table(memory, f)?;
        let table = DeviceAlloc::uninit(&state.gpus[streams[step.stream].0].ctx, bytes.len())?;
        // SAFETY: the allocation holds `bytes.len()` bytes and its context is current
        // (bound by `uninit`).
        #[allow(unsafe_code)]
        unsafe { result::memcpy_htod_sync(table.ptr, &bytes) }
            .map_err(|e| CudaError::driver("uploading a fused gemm's table", e))?;
        tables.push(table);
    }
    Ok(tables)
}

/// The priority of communicating kernels on `gpu` under `options` (`None`: the default).
fn comm_priority(options: &CudaRunOptions, gpu: &Gpu) -> Option<i32> {
    gpu.priority.as_ref().ok().copied().filter(|_| options.comm_priority)
}

/// Puts one submission on `stream` (whose context is current); communicating kernels
/// at `comm_priority` where that is given.
fn submit(
    functions: &Functions,
    stream: &Arc<CudaStream>,
    blas: Option<blas_sys::cublasHandle_t>,
    submission: &Submission,
    comm_priority: Option<i32>,
    copies: CopyIssue,
) -> Result<(), CudaError> {
    match submission {
        Submission::Launch(l) => launch_on(stream, functions, l, comm_priority),
        Submission::Cublas { args, dtypes } => {
            let handle = blas.expect("lanes running cuBLAS GEMMs have handles");
            cublas_gemm(handle, args, *dtypes)
        }
        Submission::CopyEngine { src, src_pitch, dst, dst_pitch, width, rows } => {
            match copies.batch_entries(*width, *rows, *src_pitch, *dst_pitch) {
                None => copy_engine_2d(stream, *src, *src_pitch, *dst, *dst_pitch, *width, *rows),
                Some(_) => copy_engine_batch(stream, [*src, *dst], [*src_pitch, *dst_pitch], *width, *rows),
            }
        }
        Submission::StreamWrite { addr, value } => {
            // SAFETY: the address is a semaphore word of a live allocation of this
            // run; flag 0 keeps the memory barrier before the write (release).
            #[allow(unsafe_code)]
            unsafe { sys::cuStreamWriteValue32_v2(stream.cu_stream(), *addr, *value, 0).result() }
                .map_err(|e| CudaError::driver("a stream write (signal)", e))
        }
        Submission::StreamWait { addr, value } => {
            // SAFETY: the address is a semaphore word of a live allocation of this run.
            #[allow(unsafe_code)]
            unsafe {
                sys::cuStreamWaitValue32_v2(
                    stream.cu_stream(),
                    *addr,
                    *value,
                    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                )
                .result()
            }
            .map_err(|e| CudaError::driver("a stream wait", e))
        }
    }
}

/// CTAs of one device's persistent (fused) GEMM kernel on a GPU of `sms` SMs shared by
/// `sharing` devices, at `per_sm` CTAs per SM where an SM holds `fits` of them.
///
/// A fused kernel's CTAs spin on waits, and so do the other devices' kernels on the same
/// GPU. A kernel whose CTAs cannot all become resident holds its hardware queue, and
/// with it whatever signal waits behind it there, so every CTA must fit with room to
/// spare: one more CTA of the kernel beside `per_sm` of them on every SM, or, where one
/// CTA fills an SM (`fits == 1`, the 128×128 tiles), at least one SM that no fused
/// kernel takes. A 4-device ag_gemm on 128×128 tiles that took all 132 SMs of an H100
/// (33 CTAs each) timed out on its waits in the kernel-wait mode (2026-11-25). `free`
/// ([`CudaRunOptions::fused_free_sms`]) leaves that many SMs of the GPU without a fused
/// CTA instead (at least one where a CTA fills an SM).
pub(crate) fn fused_grid(sms: u32, sharing: u32, per_sm: u32, fits: u32, free: Option<u32>) -> Result<u32, String> {
    let sharing = sharing.max(1);
    if fits == 0 {
        return Err("the kernel cannot run on this GPU's SMs (occupancy 0)".into());
    }
    if per_sm == 0 {
        return Err("at least 1 CTA per SM is needed".into());
    }
    let spread = |free: u32| {
        let ctas = sms.saturating_sub(free) / sharing;
        if ctas == 0 {
            Err(format!("{sharing} devices on {sms} SMs with {free} left free get none each"))
        } else {
            Ok(ctas * per_sm)
        }
    };
    if per_sm < fits {
        // Every SM keeps room beside its CTAs (more devices than SMs share them).
        return free.map_or(Ok((sms / sharing).max(1) * per_sm), spread);
    }
    if per_sm == 1 {
        // One CTA fills an SM: keep at least one SM free of fused kernels.
        return match free {
            Some(0) => Err("one CTA fills an SM, so at least one SM must be left free of them".into()),
            free => spread(free.unwrap_or(1)).map_err(|why| format!("one CTA fills an SM, and {why}")),
        };
    }
    Err(format!("an SM holds {fits} of them, and one more must fit beside them (at most {})", (fits - 1).max(1)))
}

/// Launches `l` on `stream`, in the stream's context; a communicating kernel
/// ([`Kernel::communicates`]) at `comm_priority` where that is given.
pub(crate) fn launch_on(
    stream: &Arc<CudaStream>,
    functions: &Functions,
    l: &Launch,
    comm_priority: Option<i32>,
) -> Result<(), CudaError> {
    // A launch acts in the current context: make it the stream's (a no-op when it is).
    stream.context().bind_to_thread().map_err(|e| CudaError::driver("binding a lane's context", e))?;
    let mut params: Vec<*mut std::ffi::c_void> = l.params.iter().map(Param::as_ptr).collect();
    let mut attrs = Vec::with_capacity(2);
    if comm_priority.is_some() && l.kernel.communicates() {
        attrs.push(sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { priority: comm_priority.unwrap_or(0) },
        });
    }
    if l.kernel.cluster() > 1 {
        attrs.push(cluster_attribute(l.kernel.cluster()));
    }
    let config = sys::CUlaunchConfig {
        gridDimX: l.cfg.grid_dim.0,
        gridDimY: l.cfg.grid_dim.1,
        gridDimZ: l.cfg.grid_dim.2,
        blockDimX: l.cfg.block_dim.0,
        blockDimY: l.cfg.block_dim.1,
        blockDimZ: l.cfg.block_dim.2,
        sharedMemBytes: l.cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: if attrs.is_empty() { std::ptr::null_mut() } else { attrs.as_mut_ptr() },
        numAttrs: attrs.len() as u32,
    };
    // SAFETY: `params` points at `l.params`' values, the exact #[repr(C)] mirrors of the
    // kernel's parameters (the driver copies them during the call); every address among
    // them lies inside allocations of a validated and lowered plan (regions checked
    // against their buffers) or the run's own semaphore and control words, with the
    // element counts those regions hold, and the kernels index within them. `config`
    // and its attributes outlive the call.
    #[allow(unsafe_code)]
    unsafe {
        sys::cuLaunchKernelEx(&config, functions.get(l.kernel).cu_function(), params.as_mut_ptr(), std::ptr::null_mut())
            .result()
    }
    .map_err(|e| CudaError::driver(l.what, e))
}

/// A strided 2D copy by the copy engine (`cuMemcpy2DAsync`).
fn copy_engine_2d(
    stream: &Arc<CudaStream>,
    src: u64,
    src_pitch: usize,
    dst: u64,
    dst_pitch: usize,
    width_bytes: usize,
    rows: usize,
) -> Result<(), CudaError> {
    if rows == 0 || width_bytes == 0 {
        return Ok(());
    }
    let desc = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width_bytes,
        Height: rows,
    };
    // SAFETY: both regions lie inside allocations of the validated plan (pitch ≥ width
    // by lowering); with unified addressing a peer's address is valid here.
    #[allow(unsafe_code)]
    unsafe { sys::cuMemcpy2DAsync_v2(&desc, stream.cu_stream()).result() }
        .map_err(|e| CudaError::driver("a copy-engine copy", e))
}

/// The same strided copy through `cuMemcpyBatchAsync`, asking the driver to keep it off
/// the SMs ([`CopyIssue::PreferCopyEngines`]): one copy where both sides are contiguous,
/// else one a row. `[src, dst]` addresses and their pitches, as [`copy_engine_2d`] takes.
fn copy_engine_batch(
    stream: &Arc<CudaStream>,
    [src, dst]: [u64; 2],
    [src_pitch, dst_pitch]: [usize; 2],
    width_bytes: usize,
    rows: usize,
) -> Result<(), CudaError> {
    if rows == 0 || width_bytes == 0 {
        return Ok(());
    }
    let whole = cmm_core::engines::contiguous_copy(width_bytes, rows, src_pitch, dst_pitch);
    let (mut srcs, mut dsts, mut sizes): (Vec<u64>, Vec<u64>, Vec<usize>) = if whole {
        (vec![src], vec![dst], vec![width_bytes * rows])
    } else {
        let at = |base: u64, pitch: usize| (0..rows).map(move |r| base + (r * pitch) as u64);
        (at(src, src_pitch).collect(), at(dst, dst_pitch).collect(), vec![width_bytes; rows])
    };
    // The location hints are read for managed memory only; cmm's buffers are plain
    // allocations, so the stream's own device stands for both.
    let device = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: stream.context().ordinal() as i32,
    };
    let mut attributes = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: device,
        dstLocHint: device,
        flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
    }];
    let mut applies_from = [0usize];
    // SAFETY: the backend checked that the driver has the call (`probe_batch_copies`);
    // the arrays hold `count` entries and live across the call, which reads them before
    // returning; every region lies inside allocations of the validated plan, as for
    // `copy_engine_2d`; stream order makes the copy read its source when it runs.
    #[allow(unsafe_code)]
    unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            sizes.len(),
            attributes.as_mut_ptr(),
            applies_from.as_mut_ptr(),
            attributes.len(),
            stream.cu_stream(),
        )
        .result()
    }
    .map_err(|e| CudaError::driver("a copy asked of the copy engines (cuMemcpyBatchAsync)", e))
}

/// Runs one GEMM through cuBLAS (the handle is bound to the lane's stream).
fn cublas_gemm(handle: blas_sys::cublasHandle_t, g: &GemmArgs, dtypes: [DType; 3]) -> Result<(), CudaError> {
    let ty = |d: DType| match d {
        DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        _ => blas_sys::cudaDataType::CUDA_R_16BF,
    };
    // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
    let op =
        |t: bool| if t { blas_sys::cublasOperation_t::CUBLAS_OP_T } else { blas_sys::cublasOperation_t::CUBLAS_OP_N };
    let (alpha, beta) = (1.0f32, if g.flags & 4 != 0 { 1.0f32 } else { 0.0f32 });
    // SAFETY: the pointers address regions of the validated plan with leading
    // dimensions that lowering made valid; alpha/beta live until the call returns (host
    // pointer mode); the handle is bound to the stream the GEMM belongs to.
    #[allow(unsafe_code)]
    unsafe {
        blas::gemm_ex(
            handle,
            op(g.flags & 2 != 0),
            op(g.flags & 1 != 0),
            g.n as i32,
            g.m as i32,
            g.k as i32,
            (&alpha as *const f32).cast(),
            g.b as *const _,
            ty(dtypes[1]),
            g.b_stride as i32,
            g.a as *const _,
            ty(dtypes[0]),
            g.a_stride as i32,
            (&beta as *const f32).cast(),
            g.c as *mut _,
            ty(dtypes[2]),
            g.c_stride as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| CudaError::driver("cublasGemmEx", e))
}

fn enable_peer_access(gpus: &[Gpu]) -> Result<(), CudaError> {
    for (i, a) in gpus.iter().enumerate() {
        for (j, b) in gpus.iter().enumerate() {
            if i == j {
                continue;
            }
            let mut can = 0;
            // SAFETY: `can` is a live out-parameter; both devices were opened.
            #[allow(unsafe_code)]
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device()) }
                .result()
                .map_err(|e| CudaError::driver(format!("asking whether GPU {i} can access GPU {j}"), e))?;
            if can == 0 {
                // Plans that reach across this pair are refused before they run
                // (`given::check_peers`); the others need no access here.
                continue;
            }
            a.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
            // SAFETY: both contexts are live; enabling access twice is reported as an
            // error code, which we treat as success. Allocations are plain `cuMemAlloc`
            // (not the stream-ordered pool), which peer access covers.
            #[allow(unsafe_code)]
            let r = unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                return Err(CudaError::driver(format!("enabling peer access {i} -> {j}"), format!("{r:?}")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staggered_priorities_stay_below_communication_in_device_order() {
        let on = CudaRunOptions { stagger: true, ..Default::default() };
        assert_eq!(stagger_priorities(&on, &Ok(-5), 4), vec![-4, -3, -2, -1]);
        // Eight devices share the five levels below communication, in device order.
        assert_eq!(stagger_priorities(&on, &Ok(-5), 8), vec![-4, -4, -3, -3, -2, -1, -1, 0]);
        assert_eq!(stagger_priorities(&on, &Ok(-2), 2), vec![-1, 0]);
        // Nothing to stagger: off, one GPU per device, or no level left below communication.
        assert!(stagger_priorities(&CudaRunOptions::default(), &Ok(-5), 4).is_empty());
        assert!(stagger_priorities(&CudaRunOptions { placement: Placement::Gpus, ..on }, &Ok(-5), 4).is_empty());
        assert!(stagger_priorities(&on, &Ok(-1), 4).is_empty());
        assert!(stagger_priorities(&on, &Err("a single priority".into()), 4).is_empty());
    }

    /// An H100's 132 SMs: the 64×64 kernel (3 fit) takes every SM; the 128×128 kernel (1
    /// fits) leaves at least one SM free of fused kernels; more CTAs per SM only with room
    /// for one more beside them.
    #[test]
    fn fused_grids_keep_room_for_the_kernels_their_waits_depend_on() {
        assert_eq!(fused_grid(132, 4, 1, 3, None), Ok(33));
        assert_eq!(fused_grid(132, 4, 2, 3, None), Ok(66));
        assert_eq!(fused_grid(132, 1, 1, 3, None), Ok(132));
        // One CTA fills an SM: 4 × 33 would take all 132; 4 × 32 leave 4 free.
        assert_eq!(fused_grid(132, 4, 1, 1, None), Ok(32));
        assert_eq!(fused_grid(132, 2, 1, 1, None), Ok(65));
        assert_eq!(fused_grid(132, 8, 1, 1, None), Ok(16));
        assert_eq!(fused_grid(132, 1, 1, 1, None), Ok(131));
        for (sms, sharing) in [(132, 1), (132, 2), (132, 3), (132, 4), (132, 8), (8, 4), (9, 8), (114, 8)] {
            let ctas = fused_grid(sms, sharing, 1, 1, None).unwrap();
            assert!(ctas >= 1 && ctas * sharing < sms, "{sms} SMs, {sharing} devices: {ctas} each");
        }
        let full = fused_grid(4, 4, 1, 1, None).unwrap_err();
        assert!(full.contains("with 1 left free get none"), "{full}");
        let e = fused_grid(132, 4, 2, 2, None).unwrap_err();
        assert!(e.contains("an SM holds 2 of them") && e.contains("at most 1"), "{e}");
        assert!(fused_grid(132, 4, 2, 1, None).is_err() && fused_grid(132, 4, 0, 3, None).is_err());
        assert!(fused_grid(132, 4, 1, 0, None).unwrap_err().contains("occupancy 0"));
        // More free SMs on request: 16 of 132 leave 29 each to 4 devices; 4 leave 16 SMs
        // each to 8 devices, at 2 CTAs per SM 32; none is refused where a CTA fills an SM.
        assert_eq!(fused_grid(132, 4, 1, 1, Some(16)), Ok(29));
        assert_eq!(fused_grid(132, 8, 2, 3, Some(4)), Ok(32));
        assert!(fused_grid(132, 4, 1, 1, Some(0)).unwrap_err().contains("at least one SM"));
        assert!(fused_grid(132, 4, 1, 1, Some(130)).unwrap_err().contains("get none each"));
    }
}
