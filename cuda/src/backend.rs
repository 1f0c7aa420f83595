//! The CUDA executor: a plan's (device, lane) pairs become streams, its ops kernel
//! launches and copies, its semaphores counters in device memory.
//!
//! Placement: `Placement::Virtual` puts D virtual devices on one GPU (separate
//! allocations); `Placement::Gpus` puts device d on GPU d with peer access enabled.
//! Either way a device reaches its peers only through the table of peer pointers
//! (`Memory::base`), so the op encoding is one code path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cmm_core::generator::Family;
use cmm_core::plan::{BufferRole, Engine, Op, Plan, Region};
use cmm_core::schedule::schedule;
use cmm_core::DType;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::error::CudaError;
use crate::kernels::{compile, nvrtc_available, KERNEL_FILES};

/// Where virtual devices live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// All devices on GPU 0, each with its own allocations and streams.
    Virtual,
    /// Device d on GPU d, peers reached over NVLink/PCIe with peer access.
    Gpus,
}

/// Which implementation runs `Gemm` ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmEngine {
    /// The NVRTC tile kernels (`gemm.cu`): tensor cores for f16/bf16, SIMT otherwise.
    TileKernel,
    /// cuBLAS `cublasGemmEx` with f32 compute, where the op's dtypes allow; the tile
    /// kernel otherwise.
    Cublas,
}

/// How to run a plan.
#[derive(Clone, Copy, Debug)]
pub struct CudaRunOptions {
    /// Device placement.
    pub placement: Placement,
    /// GEMM implementation.
    pub gemm: GemmEngine,
    /// Deadline of every wait.
    pub wait_timeout: Duration,
}

impl Default for CudaRunOptions {
    fn default() -> Self {
        CudaRunOptions {
            placement: Placement::Virtual,
            gemm: GemmEngine::Cublas,
            wait_timeout: Duration::from_secs(10),
        }
    }
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct CudaRunOutput {
    /// `[device][buffer]` words (the layout of `cmm_core::cpu::Memory`).
    pub buffers: Vec<Vec<Vec<u32>>>,
    /// GPU time of the plan's ops, from CUDA events around all streams.
    pub gpu_time: Duration,
    /// Wall time of the whole run.
    pub elapsed: Duration,
}

/// Mirror of `CmmGemmArgs` in `cuda/kernels/gemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GemmArgs {
    a: u64,
    b: u64,
    c: u64,
    a_stride: u64,
    b_stride: u64,
    c_stride: u64,
    m: u32,
    n: u32,
    k: u32,
    a_dtype: u32,
    b_dtype: u32,
    c_dtype: u32,
    flags: u32,
    pad: u32,
}

// SAFETY: `GemmArgs` is `#[repr(C)]`, plain old data, and matches `CmmGemmArgs` field for
// field (u64s first, then u32s), so passing it by value as a kernel parameter is sound.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for GemmArgs {}

/// Mirror of `CmmReduceInput` in `cuda/kernels/reduce.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ReduceInput {
    base: u64,
    stride: u64,
    dtype: u32,
    pad: u32,
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmReduceInput`.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for ReduceInput {}

struct Functions {
    generate: CudaFunction,
    fill: CudaFunction,
    gemm_mma_f16: CudaFunction,
    gemm_mma_bf16: CudaFunction,
    gemm_simt: CudaFunction,
    copy2d: CudaFunction,
    reduce: CudaFunction,
    signal: CudaFunction,
    wait: CudaFunction,
}

/// One GPU with its compiled kernels.
struct Gpu {
    ctx: Arc<CudaContext>,
    functions: Functions,
}

/// The CUDA backend.
pub struct CudaBackend {
    gpus: Vec<Gpu>,
    arch: String,
    name: String,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("gpus", &self.gpus.len()).field("arch", &self.arch).finish()
    }
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        _ => 2,
    }
}

fn driver_present() -> bool {
    // SAFETY: only probes the dynamic loader for libcuda; no CUDA call is made.
    #[allow(unsafe_code)]
    unsafe {
        sys::is_culib_present()
    }
}

/// Checks that the CUDA driver can be loaded and reports a GPU, without panicking.
pub fn probe() -> Result<String, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoCudaDriver);
    }
    let count = CudaContext::device_count().map_err(|e| CudaError::NoCudaDevice { reason: e.to_string() })?;
    if count < 1 {
        return Err(CudaError::NoCudaDevice { reason: "the driver reports 0 devices".into() });
    }
    Ok(format!("{count} CUDA device(s)"))
}

impl CudaBackend {
    /// Opens GPU 0 (and, with `gpus > 1`, GPUs 1.. with peer access) and compiles every
    /// kernel for the exact architecture of GPU 0.
    pub fn new(gpus: usize) -> Result<CudaBackend, CudaError> {
        probe()?;
        if !nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        let count = CudaContext::device_count().map_err(|e| CudaError::driver("counting devices", e))? as usize;
        if gpus.max(1) > count {
            return Err(CudaError::NoCudaDevice { reason: format!("{gpus} GPUs requested, {count} present") });
        }
        let first = CudaContext::new(0).map_err(|e| CudaError::NoCudaDevice { reason: e.to_string() })?;
        let (major, minor) =
            first.compute_capability().map_err(|e| CudaError::driver("reading the compute capability", e))?;
        // Hopper's wgmma/TMA features need the `a` variant; others use the plain arch.
        let arch = if major == 9 { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
        let name = first.name().map_err(|e| CudaError::driver("reading the device name", e))?;
        let ptx: Vec<(String, Ptx)> = KERNEL_FILES
            .iter()
            .map(|k| compile(k, &arch).map(|src| (k.name.to_string(), Ptx::from_src(src))))
            .collect::<Result<_, _>>()?;
        let mut contexts = vec![first];
        for ordinal in 1..gpus.max(1) {
            contexts
                .push(CudaContext::new(ordinal).map_err(|e| CudaError::driver(format!("opening GPU {ordinal}"), e))?);
        }
        let mut out = Vec::new();
        for ctx in contexts {
            // SAFETY: streams are ordered only by the plan's own semaphores; cudarc's
            // automatic cross-stream event tracking would add orderings the plan does
            // not ask for, so it is turned off before any allocation is made.
            #[allow(unsafe_code)]
            unsafe {
                ctx.disable_event_tracking();
            }
            let module = |file: &str| {
                let p =
                    ptx.iter().find(|(n, _)| n == file).map(|(_, p)| p.clone()).expect("every kernel file compiled");
                ctx.load_module(p).map_err(|e| CudaError::driver(format!("loading {file}"), e))
            };
            let (gen, gemm, copy, reduce, sync) = (
                module("generate.cu")?,
                module("gemm.cu")?,
                module("copy.cu")?,
                module("reduce.cu")?,
                module("sync.cu")?,
            );
            let f = |m: &Arc<cudarc::driver::CudaModule>, name: &str| {
                m.load_function(name).map_err(|e| CudaError::driver(format!("loading kernel {name}"), e))
            };
            let functions = Functions {
                generate: f(&gen, "cmm_generate")?,
                fill: f(&gen, "cmm_fill")?,
                gemm_mma_f16: f(&gemm, "cmm_gemm_mma_f16")?,
                gemm_mma_bf16: f(&gemm, "cmm_gemm_mma_bf16")?,
                gemm_simt: f(&gemm, "cmm_gemm_simt")?,
                copy2d: f(&copy, "cmm_copy2d")?,
                reduce: f(&reduce, "cmm_reduce")?,
                signal: f(&sync, "cmm_signal")?,
                wait: f(&sync, "cmm_wait")?,
            };
            out.push(Gpu { ctx, functions });
        }
        if out.len() > 1 {
            enable_peer_access(&out)?;
        }
        Ok(CudaBackend { gpus: out, arch, name })
    }

    /// One line naming the GPU and the architecture the kernels were compiled for.
    pub fn summary(&self) -> String {
        format!("{} x{} ({}, kernels compiled by NVRTC)", self.name, self.gpus.len(), self.arch)
    }

    /// The GPU's name and UUID, for stamps keyed by GPU.
    pub fn identity(&self) -> Result<String, CudaError> {
        let uuid = self.gpus[0].ctx.uuid().map_err(|e| CudaError::driver("reading the UUID", e))?;
        let bytes: Vec<String> = uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
        Ok(format!("{} {}", self.name, bytes.join("")))
    }

    /// Runs `plan`; see [`CudaRunOptions`].
    pub fn run(
        &self,
        plan: &Plan,
        seed: u32,
        family: Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        let start = Instant::now();
        plan.validate()?;
        plan.check_generator_range()?;
        // The scheduler proves the plan finishes before any stream spins on a wait.
        schedule(plan)?;
        let gpu_of = |d: usize| match options.placement {
            Placement::Virtual => 0,
            Placement::Gpus => d,
        };
        if options.placement == Placement::Gpus && plan.devices > self.gpus.len() {
            return Err(CudaError::NoCudaDevice {
                reason: format!("plan needs {} GPUs, the backend opened {}", plan.devices, self.gpus.len()),
            });
        }
        let memory = Memory::allocate(self, plan, gpu_of)?;
        let setup = self.gpus[0].ctx.default_stream();
        for d in 0..plan.devices {
            let g = &self.gpus[gpu_of(d)];
            let stream = g.ctx.default_stream();
            for (i, b) in plan.buffers.iter().enumerate() {
                let dst = memory.base[d][i];
                let dtype = dtype_code(b.dtype);
                match &b.role {
                    BufferRole::Input { tensor, global_cols, origins } => {
                        let (row0, col0) = (origins[d].0 as u32, origins[d].1 as u32);
                        let (rows, cols, global_cols, family) =
                            (b.rows as u32, b.cols as u32, *global_cols as u32, family.code());
                        if let Some(cfg) = elementwise(b.len()) {
                            let mut l = stream.launch_builder(&g.functions.generate);
                            l.arg(&dst).arg(&dtype).arg(&rows).arg(&cols).arg(&seed).arg(tensor).arg(&family);
                            l.arg(&global_cols).arg(&row0).arg(&col0);
                            launch(l, cfg, "generating an input")?;
                        }
                    }
                    _ => {
                        let (count, bits) = (b.len() as u64, b.dtype.poison_bits());
                        if let Some(cfg) = elementwise(b.len()) {
                            let mut l = stream.launch_builder(&g.functions.fill);
                            l.arg(&dst).arg(&dtype).arg(&count).arg(&bits);
                            launch(l, cfg, "poisoning a buffer")?;
                        }
                    }
                }
            }
            stream.synchronize().map_err(|e| CudaError::driver("generating inputs", e))?;
        }

        // One stream per (device, lane); all wait for a start event, the setup stream
        // then waits for every lane, so two events bracket the plan's GPU time.
        let waits: Vec<(usize, usize, usize, u32, usize)> = plan
            .ops()
            .filter_map(|(s, op)| match op {
                Op::Wait { sem, value } => Some((s.device, s.lane, s.index, *value, sem.0)),
                _ => None,
            })
            .collect();
        let status: CudaSlice<u32> =
            setup.alloc_zeros(2 * waits.len().max(1)).map_err(|e| CudaError::driver("allocating wait status", e))?;
        let status_base = raw(&status, &setup);
        // Lane streams are non-blocking: they see the zeroed status and semaphores only
        // through the start event, recorded after those writes on the setup stream.
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let begin = setup.record_event(timed).map_err(|e| CudaError::driver("recording the start event", e))?;
        let mut lane_streams = Vec::new();
        for d in 0..plan.devices {
            for _ in &plan.lanes {
                let s = self.gpus[gpu_of(d)]
                    .ctx
                    .new_stream()
                    .map_err(|e| CudaError::driver("creating a lane stream", e))?;
                s.wait(&begin).map_err(|e| CudaError::driver("ordering a lane after the start", e))?;
                lane_streams.push(s);
            }
        }
        let mut blas = BlasHandles::default();
        let mut wait_index = 0usize;
        for d in 0..plan.devices {
            let g = &self.gpus[gpu_of(d)];
            for (l, ops) in plan.programs[d].lanes.iter().enumerate() {
                let stream = &lane_streams[d * plan.lanes.len() + l];
                for op in ops {
                    let status_slot = status_base + 8 * wait_index as u64;
                    if matches!(op, Op::Wait { .. }) {
                        wait_index += 1;
                    }
                    self.encode(plan, &memory, g, stream, &mut blas, d, op, options, status_slot)?;
                }
            }
        }
        for s in &lane_streams {
            let done = s.record_event(None).map_err(|e| CudaError::driver("recording a lane's end", e))?;
            setup.wait(&done).map_err(|e| CudaError::driver("joining lanes", e))?;
        }
        let end = setup.record_event(timed).map_err(|e| CudaError::driver("recording the end event", e))?;
        for g in &self.gpus {
            g.ctx.synchronize().map_err(|e| CudaError::driver("running the plan", e))?;
        }
        blas.destroy()?;
        let gpu_ms = begin.elapsed_ms(&end).map_err(|e| CudaError::driver("reading the event timer", e))?;

        let flags: Vec<u32> = setup.clone_dtoh(&status).map_err(|e| CudaError::driver("reading wait status", e))?;
        for (i, &(device, lane, index, awaited, sem)) in waits.iter().enumerate() {
            if flags[2 * i] != 0 {
                return Err(CudaError::WaitTimeout {
                    device,
                    lane: plan.lanes[lane].clone(),
                    index,
                    semaphore: plan.semaphores[sem].clone(),
                    awaited,
                    current: flags[2 * i + 1],
                    timeout_ms: options.wait_timeout.as_millis() as u64,
                });
            }
        }
        let buffers = memory.read_back(self, plan, gpu_of)?;
        Ok(CudaRunOutput { buffers, gpu_time: Duration::from_secs_f64(gpu_ms as f64 / 1e3), elapsed: start.elapsed() })
    }

    #[allow(clippy::too_many_arguments)]
    fn encode(
        &self,
        plan: &Plan,
        memory: &Memory,
        g: &Gpu,
        stream: &Arc<CudaStream>,
        blas: &mut BlasHandles,
        d: usize,
        op: &Op,
        options: &CudaRunOptions,
        status_slot: u64,
    ) -> Result<(), CudaError> {
        let dt = |r: &Region| plan.buffer(r.buf).dtype;
        let addr = |dev: usize, r: &Region| memory.base[dev][r.buf.0] + (r.offset * dt(r).size_bytes()) as u64;
        let unsupported = |what: String| CudaError::Unsupported { plan: plan.name.clone(), what };
        match op {
            Op::Gemm { a, b, c, trans_a, trans_b, accumulate } => {
                let (m, n) = (c.rows, c.cols);
                let k = if *trans_a { a.rows } else { a.cols };
                if m.div_ceil(64) > 65_535 || n.div_ceil(64) > i32::MAX as usize || k > u32::MAX as usize {
                    return Err(unsupported(format!("gemm {m}x{n}x{k} exceeds the tile kernel's grid")));
                }
                let args = GemmArgs {
                    a: addr(d, a),
                    b: addr(d, b),
                    c: addr(d, c),
                    a_stride: a.stride as u64,
                    b_stride: b.stride as u64,
                    c_stride: c.stride as u64,
                    m: m as u32,
                    n: n as u32,
                    k: k as u32,
                    a_dtype: dtype_code(dt(a)),
                    b_dtype: dtype_code(dt(b)),
                    c_dtype: dtype_code(dt(c)),
                    flags: *trans_a as u32 | (*trans_b as u32) << 1 | (*accumulate as u32) << 2,
                    pad: 0,
                };
                if options.gemm == GemmEngine::Cublas && cublas_gemm(blas, stream, &args, dt(a), dt(b), dt(c))? {
                    return Ok(());
                }
                let (function, threads) = match (dt(a), dt(b)) {
                    (DType::F16, DType::F16) => (&g.functions.gemm_mma_f16, 128),
                    (DType::Bf16, DType::Bf16) => (&g.functions.gemm_mma_bf16, 128),
                    _ => (&g.functions.gemm_simt, 256),
                };
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut l = stream.launch_builder(function);
                l.arg(&args);
                launch(l, cfg, "launching a gemm")?;
            }
            Op::Copy { src, dst_device, dst, engine } => {
                let (s, t) = (addr(d, src), addr(*dst_device, dst));
                let es = dt(src).size_bytes();
                match engine {
                    Engine::CopyEngine => {
                        copy_engine_2d(stream, s, src.stride * es, t, dst.stride * es, src.cols * es, src.rows)?
                    }
                    Engine::Sm => {
                        let (ss, ds, rows, cols, eb) =
                            (src.stride as u64, dst.stride as u64, src.rows as u32, src.cols as u32, es as u32);
                        if let Some(cfg) = elementwise(src.len()) {
                            let mut l = stream.launch_builder(&g.functions.copy2d);
                            l.arg(&s).arg(&ss).arg(&t).arg(&ds).arg(&rows).arg(&cols).arg(&eb);
                            launch(l, cfg, "an SM copy")?;
                        }
                    }
                }
            }
            Op::Reduce { inputs, output } => {
                if inputs.len() > 4 {
                    return Err(unsupported(format!("reduce of {} inputs (at most 4)", inputs.len())));
                }
                let mut packed = [ReduceInput::default(); 4];
                for (slot, r) in packed.iter_mut().zip(inputs) {
                    *slot = ReduceInput { base: addr(d, r), stride: r.stride as u64, dtype: dtype_code(dt(r)), pad: 0 };
                }
                let (out, out_stride, out_dtype) = (addr(d, output), output.stride as u64, dtype_code(dt(output)));
                let (rows, cols, count) = (output.rows as u32, output.cols as u32, inputs.len() as u32);
                if let Some(cfg) = elementwise(output.len()) {
                    let mut l = stream.launch_builder(&g.functions.reduce);
                    l.arg(&out).arg(&out_stride).arg(&out_dtype).arg(&rows).arg(&cols).arg(&count);
                    l.arg(&packed[0]).arg(&packed[1]).arg(&packed[2]).arg(&packed[3]);
                    launch(l, cfg, "a reduce")?;
                }
            }
            Op::Signal { device, sem, add } => {
                let target = memory.sems[*device] + 4 * sem.0 as u64;
                let mut l = stream.launch_builder(&g.functions.signal);
                l.arg(&target).arg(add);
                launch(l, ONE_THREAD, "a signal")?;
            }
            Op::Wait { sem, value } => {
                let word = memory.sems[d] + 4 * sem.0 as u64;
                let timeout = options.wait_timeout.as_nanos() as u64;
                let mut l = stream.launch_builder(&g.functions.wait);
                l.arg(&word).arg(value).arg(&timeout).arg(&status_slot);
                launch(l, ONE_THREAD, "a wait")?;
            }
        }
        Ok(())
    }
}

/// The raw device address of a slice (event tracking is off, so no guard is needed).
fn raw<T>(slice: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (ptr, _guard) = slice.device_ptr(stream);
    ptr
}

const ONE_THREAD: LaunchConfig = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };

/// The launch shape of a grid-stride elementwise kernel over `count` elements.
fn elementwise(count: usize) -> Option<LaunchConfig> {
    (count > 0).then(|| LaunchConfig {
        grid_dim: (count.div_ceil(256).min(65_535 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launches a kernel whose arguments are already pushed.
fn launch(mut args: LaunchArgs<'_>, cfg: LaunchConfig, what: &str) -> Result<(), CudaError> {
    // SAFETY: every launch site passes addresses inside allocations of a validated plan
    // (regions checked against their buffers) or the run's own semaphore and status
    // arrays, with the element counts those regions hold; the kernels index within them.
    #[allow(unsafe_code)]
    unsafe { args.launch(cfg) }.map(|_| ()).map_err(|e| CudaError::driver(what, e))
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
    // by plan validation); with unified addressing a peer's address is valid here.
    #[allow(unsafe_code)]
    unsafe { sys::cuMemcpy2DAsync_v2(&desc, stream.cu_stream()).result() }
        .map_err(|e| CudaError::driver("a copy-engine copy", e))
}

/// Runs a GEMM through cuBLAS when its dtypes allow; `Ok(false)` means "use the tile kernel".
fn cublas_gemm(
    blas: &mut BlasHandles,
    stream: &Arc<CudaStream>,
    g: &GemmArgs,
    a: DType,
    b: DType,
    c: DType,
) -> Result<bool, CudaError> {
    // cudarc panics when a library is missing, so probe libcublas before using it.
    // SAFETY: only probes the dynamic loader.
    #[allow(unsafe_code)]
    let present = unsafe { blas_sys::is_culib_present() };
    if !present || a != b || g.m == 0 || g.n == 0 || g.k == 0 || [g.m, g.n, g.k].iter().any(|&x| x > i32::MAX as u32) {
        return Ok(false);
    }
    let ty = |d: DType| match d {
        DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        _ => blas_sys::cudaDataType::CUDA_R_16BF,
    };
    let handle = blas.for_stream(stream)?;
    // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
    let op =
        |t: bool| if t { blas_sys::cublasOperation_t::CUBLAS_OP_T } else { blas_sys::cublasOperation_t::CUBLAS_OP_N };
    let (alpha, beta) = (1.0f32, if g.flags & 4 != 0 { 1.0f32 } else { 0.0f32 });
    // SAFETY: the pointers address regions of the validated plan with the given leading
    // dimensions; alpha/beta live until the call returns (host pointer mode).
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
            ty(b),
            g.b_stride as i32,
            g.a as *const _,
            ty(a),
            g.a_stride as i32,
            (&beta as *const f32).cast(),
            g.c as *mut _,
            ty(c),
            g.c_stride as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| CudaError::driver("cublasGemmEx", e))?;
    Ok(true)
}

/// cuBLAS handles of one run, one per lane stream (a handle's workspace must not be
/// shared by concurrent streams), created on first use and destroyed after the run.
#[derive(Default)]
struct BlasHandles {
    handles: Vec<(sys::CUstream, blas_sys::cublasHandle_t)>,
}

impl BlasHandles {
    fn for_stream(&mut self, stream: &Arc<CudaStream>) -> Result<blas_sys::cublasHandle_t, CudaError> {
        if let Some(&(_, h)) = self.handles.iter().find(|(s, _)| *s == stream.cu_stream()) {
            return Ok(h);
        }
        let handle = blas::create_handle().map_err(|e| CudaError::driver("creating a cuBLAS handle", e))?;
        // SAFETY: `handle` was just created and `stream` is a live stream of this run.
        #[allow(unsafe_code)]
        unsafe { blas::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| CudaError::driver("binding cuBLAS to a stream", e))?;
        self.handles.push((stream.cu_stream(), handle));
        Ok(handle)
    }

    /// Destroys every handle; call after the streams have finished.
    fn destroy(self) -> Result<(), CudaError> {
        for (_, h) in self.handles {
            // SAFETY: each handle was created by `for_stream` and is destroyed once,
            // after the context synchronised, so no call on it is in flight.
            #[allow(unsafe_code)]
            unsafe { blas::destroy_handle(h) }.map_err(|e| CudaError::driver("destroying a cuBLAS handle", e))?;
        }
        Ok(())
    }
}

fn enable_peer_access(gpus: &[Gpu]) -> Result<(), CudaError> {
    for (i, a) in gpus.iter().enumerate() {
        for (j, b) in gpus.iter().enumerate() {
            if i == j {
                continue;
            }
            a.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
            // SAFETY: both contexts are live; enabling access twice is reported as an
            // error code, which we treat as success.
            #[allow(unsafe_code)]
            let r = unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                return Err(CudaError::driver(format!("enabling peer access {i} -> {j}"), format!("{r:?}")));
            }
        }
    }
    Ok(())
}

/// Device memory of a run: per device one allocation holding every buffer, and its
/// semaphore array. `base[d][b]` is the peer-pointer table.
struct Memory {
    allocations: Vec<CudaSlice<u8>>,
    _semaphores: Vec<CudaSlice<u32>>,
    base: Vec<Vec<u64>>,
    sems: Vec<u64>,
}

impl Memory {
    fn allocate(backend: &CudaBackend, plan: &Plan, gpu_of: impl Fn(usize) -> usize) -> Result<Memory, CudaError> {
        let align = |x: usize| x.div_ceil(256) * 256;
        let offsets: Vec<usize> = plan
            .buffers
            .iter()
            .scan(0usize, |at, b| {
                let here = *at;
                *at += align(b.len() * b.dtype.size_bytes());
                Some(here)
            })
            .collect();
        let total = plan.buffers.iter().map(|b| align(b.len() * b.dtype.size_bytes())).sum::<usize>().max(256);
        let (mut allocations, mut semaphores, mut base, mut sems) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for d in 0..plan.devices {
            let g = &backend.gpus[gpu_of(d)];
            let stream = g.ctx.default_stream();
            let (free, _) = g.ctx.mem_get_info().map_err(|e| CudaError::driver("reading free memory", e))?;
            if total > free {
                return Err(CudaError::OutOfMemory {
                    plan: plan.name.clone(),
                    needed: total as u64,
                    free: free as u64,
                });
            }
            let heap: CudaSlice<u8> =
                stream.alloc_zeros(total).map_err(|e| CudaError::driver("allocating buffers", e))?;
            let sem: CudaSlice<u32> = stream
                .alloc_zeros(plan.semaphores.len().max(1))
                .map_err(|e| CudaError::driver("allocating semaphores", e))?;
            let b0 = raw(&heap, &stream);
            base.push(offsets.iter().map(|&o| b0 + o as u64).collect());
            sems.push(raw(&sem, &stream));
            allocations.push(heap);
            semaphores.push(sem);
        }
        Ok(Memory { allocations, _semaphores: semaphores, base, sems })
    }

    fn read_back(
        &self,
        backend: &CudaBackend,
        plan: &Plan,
        gpu_of: impl Fn(usize) -> usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, CudaError> {
        let mut out = Vec::new();
        for (d, heap) in self.allocations.iter().enumerate() {
            let stream = backend.gpus[gpu_of(d)].ctx.default_stream();
            let bytes: Vec<u8> = stream.clone_dtoh(heap).map_err(|e| CudaError::driver("reading results back", e))?;
            let b0 = self.base[d][0];
            out.push(
                plan.buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        let at = (self.base[d][i] - b0) as usize;
                        let raw = &bytes[at..at + b.len() * b.dtype.size_bytes()];
                        (0..b.len()).map(|e| b.dtype.read_le_bits(raw, e)).collect()
                    })
                    .collect(),
            );
        }
        Ok(out)
    }
}
