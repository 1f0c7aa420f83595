//! A run's device memory: the plan's buffers and semaphores on each device (one heap per
//! device, or in rank mode the symmetric heap every rank maps), the page-locked control
//! words the kernels poll, the caller's own allocations ([`DeviceBuffer`]), and the TMA
//! tensor maps the Hopper engine's kernels load through.

use std::sync::Arc;

use cmm_core::generator::Family;
use cmm_core::plan::Plan;
use cmm_core::DType;
use cudarc::driver::{result, sys, CudaContext};

use crate::backend::{launch_on, Gpu};
use crate::error::CudaError;
use crate::given::Bound;
use crate::launch::{buffer_fill, Addressing, ControlLayout, Fill, TensorMap, TensorMapSpec};
use crate::lower::{Loc, Lowered};
use crate::options::ReadBack;
use crate::rank::{Meeting, Rendezvous, SymmetricHeap};

/// A zeroed device allocation of the caller's ([`crate::CudaBackend::device_buffer`]), freed on
/// drop: for binding to a plan's buffers ([`crate::CudaBackend::run_given`]).
pub struct DeviceBuffer {
    pub(crate) alloc: DeviceAlloc,
    pub(crate) bytes: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.alloc.ptr))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl DeviceBuffer {
    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.alloc.ptr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `bytes` to its start (at most [`DeviceBuffer::len`] of them).
    pub fn upload(&self, bytes: &[u8]) -> Result<(), CudaError> {
        if bytes.len() > self.bytes {
            return Err(CudaError::Binding {
                plan: String::new(),
                what: format!("{} bytes do not fit a device buffer of {}", bytes.len(), self.bytes),
            });
        }
        self.alloc.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        // SAFETY: the destination is this live allocation of at least `bytes.len()` bytes
        // in the current context; the copy is synchronous.
        #[allow(unsafe_code)]
        unsafe { result::memcpy_htod_sync(self.alloc.ptr, bytes) }
            .map_err(|e| CudaError::driver("uploading to a device buffer", e))
    }

    /// Its whole contents.
    pub fn download(&self) -> Result<Vec<u8>, CudaError> {
        let mut bytes = vec![0u8; self.bytes];
        self.alloc.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        if !bytes.is_empty() {
            // SAFETY: the source is this live allocation of `self.bytes` bytes in the
            // current context; the copy is synchronous.
            #[allow(unsafe_code)]
            unsafe { result::memcpy_dtoh_sync(&mut bytes, self.alloc.ptr) }
                .map_err(|e| CudaError::driver("reading a device buffer", e))?;
        }
        Ok(bytes)
    }
}

/// A plain device allocation (`cuMemAlloc`), freed on drop. Freed only after every
/// stream that used it has finished (the run drains first, or leaks it when it cannot).
pub(crate) struct DeviceAlloc {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) ptr: u64,
}

impl DeviceAlloc {
    /// An allocation of `bytes` whose contents the caller overwrites before any read.
    pub(crate) fn uninit(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceAlloc, CudaError> {
        ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        // SAFETY: the context is current; the pointer is owned by the returned value.
        #[allow(unsafe_code)]
        let ptr = unsafe { result::malloc_sync(bytes.max(4)) }
            .map_err(|e| CudaError::driver("allocating device memory", e))?;
        Ok(DeviceAlloc { ctx: ctx.clone(), ptr })
    }

    pub(crate) fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceAlloc, CudaError> {
        ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        let bytes = bytes.max(4);
        // SAFETY: the context is current; the pointer is owned by the returned value.
        #[allow(unsafe_code)]
        let ptr =
            unsafe { result::malloc_sync(bytes) }.map_err(|e| CudaError::driver("allocating device memory", e))?;
        let alloc = DeviceAlloc { ctx: ctx.clone(), ptr };
        // SAFETY: `ptr` addresses `bytes` bytes just allocated in the current context.
        #[allow(unsafe_code)]
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(|e| CudaError::driver("zeroing device memory", e))?;
        Ok(alloc)
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_sync` in this context and is freed once, after
        // the streams using it finished (see the type's comment). Errors cannot be
        // reported from a destructor; the context records them.
        #[allow(unsafe_code)]
        unsafe {
            self.ctx.record_err(self.ctx.bind_to_thread());
            self.ctx.record_err(result::free_sync(self.ptr));
        }
    }
}

/// The run's control words in page-locked host memory mapped into every context:
/// the gate, the abort word, the gate's status, then two words per kernel wait.
pub(crate) struct HostControl {
    host: *mut u32,
    device: u64,
    words: usize,
}

impl HostControl {
    pub(crate) fn new(ctx: &Arc<CudaContext>, waits: usize) -> Result<HostControl, CudaError> {
        ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        let words = ControlLayout::words(waits);
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocates `4 · words` page-locked bytes owned by the returned value.
        #[allow(unsafe_code)]
        let host = unsafe { result::malloc_host(4 * words, flags) }
            .map_err(|e| CudaError::driver("allocating the control words", e))? as *mut u32;
        let mut control = HostControl { host, device: 0, words };
        for i in 0..words {
            control.write(i, 0);
        }
        let mut device = 0u64;
        // SAFETY: `host` is a mapped page-locked allocation; the call writes the device
        // address of it into `device`.
        #[allow(unsafe_code)]
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0).result() }
            .map_err(|e| CudaError::driver("mapping the control words", e))?;
        control.device = device;
        Ok(control)
    }

    pub(crate) fn write(&self, word: usize, value: u32) {
        assert!(word < self.words);
        // SAFETY: `word` is within the allocation (checked); the GPU reads it with
        // acquire loads, so a volatile store followed by a fence publishes it.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::write_volatile(self.host.add(word), value)
        };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn read(&self, word: usize) -> u32 {
        assert!(word < self.words);
        // SAFETY: within the allocation (checked); the GPU may write it concurrently,
        // hence the volatile read.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::read_volatile(self.host.add(word))
        }
    }

    pub(crate) fn device_word(&self, word: usize) -> u64 {
        self.device + 4 * word as u64
    }

    /// (why, value seen) of a kernel wait: why = 0 reached, 1 deadline, 2 aborted.
    pub(crate) fn status(&self, slot: usize) -> (u32, u32) {
        (self.read(ControlLayout::status(slot)), self.read(ControlLayout::status(slot) + 1))
    }

    pub(crate) fn open_gate(&self) {
        self.write(ControlLayout::GO, 1);
    }

    pub(crate) fn raise_abort(&self) {
        self.write(ControlLayout::ABORT, 1);
    }
}

impl Drop for HostControl {
    fn drop(&mut self) {
        // SAFETY: `host` came from `malloc_host` and is freed once; by now every kernel
        // that reads it has finished (the run drained), or the run leaked its memory
        // and so never reaches here with work pending (see `execute`).
        #[allow(unsafe_code)]
        let _ = unsafe { result::free_host(self.host.cast()) };
    }
}

impl Addressing for Memory {
    fn addr(&self, l: &Loc) -> u64 {
        self.base[l.device][l.buffer] + l.offset
    }

    fn sem(&self, device: usize, sem: usize) -> u64 {
        self.sems[device] + 4 * sem as u64
    }

    fn tensor_map(&self, spec: &TensorMapSpec) -> Result<TensorMap, CudaError> {
        encode_tensor_map(spec)
    }
}

/// A tensor map encoded by the driver (`cuTensorMapEncodeTiled`): two dimensions (three
/// with layers, the box one layer deep), the 128-byte swizzle, 256-byte L2 promotion,
/// zeros past the edges.
fn encode_tensor_map(spec: &TensorMapSpec) -> Result<TensorMap, CudaError> {
    use sys::{CUtensorMapDataType as T, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion};
    let dtype = match spec.dtype {
        DType::F16 => T::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::Bf16 => T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        // C's map of the TMA-store kernels.
        DType::F32 => T::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        other => {
            return Err(CudaError::Unsupported {
                plan: String::new(),
                what: format!("a {other} tensor map (the Hopper engine loads f16 and bf16, and stores f32 too)"),
            })
        }
    };
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let (layers, layer_stride) = spec.layers.unwrap_or((1, 0));
    let rank: u32 = if spec.layers.is_some() { 3 } else { 2 };
    let dims = [spec.dims[0], spec.dims[1], layers];
    let strides = [spec.stride, layer_stride];
    let boxed = [spec.boxed[0], spec.boxed[1], 1];
    let element_strides = [1u32, 1, 1];
    // SAFETY: every pointer is to a live local array of at least the length the call
    // reads (rank 2 or 3: that many dims, box and element-stride entries, one stride
    // fewer); `map` is written by the driver; `base` is only recorded, not dereferenced.
    #[allow(unsafe_code)]
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            rank,
            spec.base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxed.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
    }
    .map_err(|e| CudaError::driver(format!("encoding a tensor map ({spec:?})"), e))?;
    Ok(TensorMap(map.opaque))
}

/// Refuses a run whose memory on `ctx`'s GPU would not fit what is free there.
fn check_free(ctx: &Arc<CudaContext>, plan: &Plan, bytes: usize) -> Result<(), CudaError> {
    ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
    let (free, _) = result::mem_get_info().map_err(|e| CudaError::driver("reading free memory", e))?;
    if bytes > free {
        return Err(CudaError::OutOfMemory { plan: plan.name.clone(), needed: bytes as u64, free: free as u64 });
    }
    Ok(())
}

/// Device memory of a run: per device one allocation holding every buffer, and its
/// semaphore array; in rank mode, every rank's part of the symmetric heap mapped here.
/// `base[d][b]` is the peer-pointer table, `sems[d]` device d's semaphores.
pub(crate) struct Memory {
    /// cmm's own allocations, held to be freed on drop.
    #[allow(dead_code)]
    pub(crate) owned: Vec<DeviceAlloc>,
    /// Rank mode: the mappings of every rank's part, unmapped on drop.
    pub(crate) symmetric: Option<SymmetricHeap>,
    pub(crate) base: Vec<Vec<u64>>,
    pub(crate) sems: Vec<u64>,
    /// The devices whose memory this process initialises and reads back: every device, or
    /// in rank mode its own.
    pub(crate) local: std::ops::Range<usize>,
}

/// Offsets of a plan's buffers (those `ours` says cmm allocates) at 256 bytes, and the
/// bytes they take.
fn buffer_layout(plan: &Plan, ours: impl Fn(usize) -> bool) -> (Vec<usize>, usize) {
    let align = |x: usize| x.div_ceil(256) * 256;
    let bytes = |i: usize| if ours(i) { align(plan.buffers[i].len() * plan.buffers[i].dtype.size_bytes()) } else { 0 };
    let offsets: Vec<usize> = (0..plan.buffers.len())
        .scan(0usize, |at, i| {
            let here = *at;
            *at += bytes(i);
            Some(here)
        })
        .collect();
    let total = (0..plan.buffers.len()).map(bytes).sum::<usize>();
    (offsets, total)
}

impl Memory {
    /// Per device, one heap holding every buffer `bound` does not give (all of them
    /// without a binding) at 256-byte offsets, and the semaphores.
    pub(crate) fn allocate(
        gpus: &[Gpu],
        plan: &Plan,
        bound: Option<&Bound>,
        gpu_of: impl Fn(usize) -> usize,
    ) -> Result<Memory, CudaError> {
        // Every device binds the same buffers (all but the scratch ones).
        let ours = |i: usize| bound.is_none_or(|bound| bound.iter().all(|d| d[i].is_none()));
        let (offsets, total) = buffer_layout(plan, ours);
        let total = total.max(256);
        let (mut owned, mut sems, mut base) = (Vec::new(), Vec::new(), Vec::new());
        for d in 0..plan.devices {
            let ctx = &gpus[gpu_of(d)].ctx;
            check_free(ctx, plan, total)?;
            // Every buffer is generated or poisoned before the run (`initialise`).
            let heap = DeviceAlloc::uninit(ctx, total)?;
            let semaphores = DeviceAlloc::zeroed(ctx, 4 * plan.semaphores.len())?;
            let given = |i: usize| bound.and_then(|bound| bound[d][i]);
            base.push(offsets.iter().enumerate().map(|(i, &o)| given(i).unwrap_or(heap.ptr + o as u64)).collect());
            sems.push(semaphores.ptr);
            owned.push(heap);
            owned.push(semaphores);
        }
        Ok(Memory { owned, symmetric: None, base, sems, local: 0..plan.devices })
    }

    /// Allocates the lowering's staging regions ([`Lowered::staging`]) on the devices this
    /// process runs (`ctx_of` their contexts), each after the plan's buffers in `base`: a
    /// [`Loc`] names region j as buffer `plan.buffers.len() + j` (0 on another process's
    /// device, whose steps this process never issues). Left uninitialised: `cmm_gather_rows`
    /// writes every row whose result a GEMM stores before that GEMM reads it; the rows a
    /// tile loads past its segment are never stored, so what they hold does not matter.
    pub(crate) fn stage(
        &mut self,
        plan: &Plan,
        lowered: &Lowered,
        ctx_of: impl Fn(usize) -> Arc<CudaContext>,
    ) -> Result<(), CudaError> {
        for d in 0..self.base.len() {
            debug_assert_eq!(self.base[d].len(), plan.buffers.len());
            for bytes in lowered.staging_bytes(d) {
                let ptr = if bytes > 0 && self.local.contains(&d) {
                    let ctx = ctx_of(d);
                    check_free(&ctx, plan, bytes as usize)?;
                    let alloc = DeviceAlloc::uninit(&ctx, bytes as usize)?;
                    let ptr = alloc.ptr;
                    self.owned.push(alloc);
                    ptr
                } else {
                    0
                };
                self.base[d].push(ptr);
            }
        }
        Ok(())
    }

    /// Rank mode: this rank's part of the symmetric heap (every buffer, then the
    /// semaphores) on `ctx`'s GPU, exchanged with every rank at the rendezvous and their
    /// parts mapped. Returns the meeting for the later barriers.
    pub(crate) fn symmetric(
        ctx: &Arc<CudaContext>,
        plan: &Plan,
        rendezvous: &Rendezvous,
    ) -> Result<(Memory, Meeting), CudaError> {
        let (offsets, total) = buffer_layout(plan, |_| true);
        let sem_offset = total;
        let bytes = (sem_offset + 4 * plan.semaphores.len()).max(256);
        check_free(ctx, plan, bytes)?;
        let (mut heap, own) = SymmetricHeap::create(ctx, bytes)?;
        let (meeting, parts) = Meeting::hello(rendezvous, crate::rank::plan_digest(plan), own)?;
        let bases = heap.map_all(rendezvous.rank, &parts)?;
        let base = bases.iter().map(|&b| offsets.iter().map(|&o| b + o as u64).collect()).collect();
        let sems = bases.iter().map(|&b| b + sem_offset as u64).collect();
        let local = rendezvous.rank..rendezvous.rank + 1;
        Ok((Memory { owned: Vec::new(), symmetric: Some(heap), base, sems, local }, meeting))
    }

    /// Generates the inputs and poisons every other buffer, then waits for it; the
    /// buffers `bound` gives are left as they are (in a heap, their inputs' places too:
    /// the caller's data is copied there).
    pub(crate) fn initialise(
        &self,
        gpus: &[Gpu],
        plan: &Plan,
        seed: u32,
        family: Family,
        bound: Option<&Bound>,
        gpu_of: impl Fn(usize) -> usize,
    ) -> Result<(), CudaError> {
        for d in self.local.clone() {
            let g = &gpus[gpu_of(d)];
            let stream = g.ctx.default_stream();
            if self.symmetric.is_some() && !plan.semaphores.is_empty() {
                g.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
                // SAFETY: the semaphores lie at the end of this rank's own part of the
                // symmetric heap, mapped and opened to this GPU; no peer touches them
                // before the `ready` meeting.
                #[allow(unsafe_code)]
                unsafe { result::memset_d8_sync(self.sems[d], 0, 4 * plan.semaphores.len()) }
                    .map_err(|e| CudaError::driver("zeroing the semaphores", e))?;
            }
            for i in 0..plan.buffers.len() {
                // The caller's own buffer, or the heap's place of a given input (copied
                // in): nothing to generate. A given output's place in a heap is poisoned
                // as any other.
                let given = bound.and_then(|bound| bound[d][i]);
                if given.is_some_and(|ptr| ptr == self.base[d][i] || plan.buffers[i].role.initialized()) {
                    continue;
                }
                let dst = self.base[d][i];
                for fill in buffer_fill(plan, d, i, dst, seed, family) {
                    match fill {
                        Fill::Upload(bytes) => {
                            // SAFETY: the destination lies inside this device's heap (offset and
                            // length from the layout that sized it); the source is a host buffer
                            // of exactly that length; nothing else uses the heap yet.
                            #[allow(unsafe_code)]
                            unsafe { result::memcpy_htod_sync(dst, &bytes) }
                                .map_err(|e| CudaError::driver("uploading a routing table", e))?;
                        }
                        Fill::Launch(l) => launch_on(&stream, &g.functions, &l, None)?,
                    }
                }
            }
            stream.synchronize().map_err(|e| CudaError::driver("generating inputs", e))?;
        }
        Ok(())
    }

    pub(crate) fn read_back(
        &self,
        gpus: &[Gpu],
        plan: &Plan,
        gpu_of: impl Fn(usize) -> usize,
        which: ReadBack,
    ) -> Result<Vec<Vec<Vec<u32>>>, CudaError> {
        let mut out = Vec::new();
        for d in 0..plan.devices {
            if !self.local.contains(&d) {
                out.push(vec![Vec::new(); plan.buffers.len()]);
                continue;
            }
            let ctx = &gpus[gpu_of(d)].ctx;
            ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
            let mut buffers = Vec::new();
            for (i, b) in plan.buffers.iter().enumerate() {
                if !which.wants(b) {
                    buffers.push(Vec::new());
                    continue;
                }
                let mut bytes = vec![0u8; b.len() * b.dtype.size_bytes()];
                if !bytes.is_empty() {
                    // SAFETY: the source is the buffer's place in this device's heap
                    // (offset and length from the layout that sized it) or the caller's
                    // buffer checked to hold that length; the destination is a host
                    // buffer of exactly that length; every stream has finished.
                    #[allow(unsafe_code)]
                    unsafe { result::memcpy_dtoh_sync(&mut bytes, self.base[d][i]) }
                        .map_err(|e| CudaError::driver("reading results back", e))?;
                }
                buffers.push(b.dtype.words_from_le(&bytes, b.len()));
            }
            out.push(buffers);
        }
        Ok(out)
    }
}
