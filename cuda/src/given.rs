//! Runs on the caller's buffers ([`crate::CudaBackend::run_given`]): a plan's inputs,
//! outputs, accumulators and routing tables bound by name to device pointers the caller
//! allocated (a torch tensor's `data_ptr()`, a [`crate::DeviceBuffer`]), checked against the
//! plan and the driver before anything runs. cmm allocates only the plan's working
//! memory (its scratch buffers), semaphores and the lowering's staging regions. The generated path
//! ([`crate::CudaExecutor::run`]) is the same run with cmm's own buffers bound.
//!
//! Also here: what a multi-GPU run asks of the hardware. Every pair of GPUs a plan
//! reaches across must have peer access, and the pairs it signals across native peer
//! atomics (a signal is an atomic add on the peer's semaphore); a missing capability is
//! an error naming the pair before anything runs, never a hang.

use std::sync::Arc;

use cmm_core::plan::{BufferDecl, BufferRole, Plan};
use cmm_core::DType;
use cudarc::driver::{result, sys, CudaContext};

use crate::error::CudaError;

/// Device buffers are bound at this alignment, the one cmm's own layout gives every
/// buffer (vector loads and TMA need at least 16 bytes; the lowering assumes 256).
pub const GIVEN_ALIGNMENT: u64 = 256;

/// One of the caller's device buffers, bound to buffer `name` of a plan on `device`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GivenBuffer {
    /// The plan's device (not the GPU ordinal: the placement maps one to the other).
    pub device: usize,
    /// The plan buffer's name (`plan.buffers[i].name`).
    pub name: String,
    /// Where it starts: a device pointer of the GPU that runs `device`, aligned to
    /// [`GIVEN_ALIGNMENT`].
    pub ptr: u64,
    /// Rows, as the plan declares them.
    pub rows: usize,
    /// Columns (row-major, densely packed), as the plan declares them.
    pub cols: usize,
    /// Element type, as the plan declares it.
    pub dtype: DType,
}

/// Per device, per plan buffer: the caller's pointer, or `None` where cmm allocates.
pub(crate) type Bound = Vec<Vec<Option<u64>>>;

/// Whether the caller provides buffer `b` (everything but the plan's working memory).
pub(crate) fn given_by_caller(b: &BufferDecl) -> bool {
    !matches!(b.role, BufferRole::Scratch)
}

fn binding_error(plan: &Plan, what: String) -> CudaError {
    CudaError::Binding { plan: plan.name.clone(), what }
}

/// Checks `given` against the plan (names, devices, shapes, dtypes, alignment, no
/// overlaps, every input and result of the `local` devices bound exactly once, none of
/// another device) and returns the binding.
pub(crate) fn bind(plan: &Plan, given: &[GivenBuffer], local: std::ops::Range<usize>) -> Result<Bound, CudaError> {
    let mut bound: Bound = vec![vec![None; plan.buffers.len()]; plan.devices];
    for g in given {
        let Some(index) = plan.buffers.iter().position(|b| b.name == g.name) else {
            let names: Vec<&str> =
                plan.buffers.iter().filter(|b| given_by_caller(b)).map(|b| b.name.as_str()).collect();
            return Err(binding_error(plan, format!("no buffer `{}` (the caller gives {})", g.name, names.join(", "))));
        };
        let decl = &plan.buffers[index];
        let at = format!("buffer `{}` of device {}", g.name, g.device);
        if g.device >= plan.devices {
            return Err(binding_error(plan, format!("{at}: the plan has {} devices", plan.devices)));
        }
        if !local.contains(&g.device) {
            return Err(binding_error(plan, format!("{at}: this process runs devices {local:?} only")));
        }
        if !given_by_caller(decl) {
            return Err(binding_error(plan, format!("{at} is the plan's working memory: cmm allocates it")));
        }
        // An uneven shard's buffer is the device's own rows (ops reach no further).
        let rows = decl.rows_on(g.device);
        if (g.rows, g.cols, g.dtype) != (rows, decl.cols, decl.dtype) {
            return Err(binding_error(
                plan,
                format!("{at} is {}x{} {}, the plan's is {rows}x{} {}", g.rows, g.cols, g.dtype, decl.cols, decl.dtype),
            ));
        }
        if !decl.is_empty() && (g.ptr == 0 || g.ptr % GIVEN_ALIGNMENT != 0) {
            return Err(binding_error(
                plan,
                format!("{at} is at {:#x}, not a non-null multiple of {GIVEN_ALIGNMENT} bytes", g.ptr),
            ));
        }
        if bound[g.device][index].replace(g.ptr).is_some() {
            return Err(binding_error(plan, format!("{at} is given twice")));
        }
    }
    let missing: Vec<String> = local
        .flat_map(|d| {
            let bound = &bound;
            plan.buffers
                .iter()
                .enumerate()
                .filter(move |(i, b)| given_by_caller(b) && bound[d][*i].is_none())
                .map(move |(_, b)| format!("`{}` of device {d}", b.name))
        })
        .collect();
    if !missing.is_empty() {
        return Err(binding_error(plan, format!("not given: {}", missing.join(", "))));
    }
    // Any two given buffers sharing a byte would be a race the verifier never saw.
    let mut ranges: Vec<(u64, u64, &GivenBuffer)> = given
        .iter()
        .map(|g| (g.ptr, g.ptr + (g.rows * g.cols * g.dtype.size_bytes()) as u64, g))
        .filter(|(start, end, _)| end > start)
        .collect();
    ranges.sort_by_key(|r| r.0);
    for pair in ranges.windows(2) {
        let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
        if start < end {
            return Err(binding_error(
                plan,
                format!(
                    "buffer `{}` of device {} overlaps buffer `{}` of device {}",
                    a.name, a.device, b.name, b.device
                ),
            ));
        }
    }
    Ok(bound)
}

/// One attribute of a device pointer (`cuPointerGetAttribute`), `T` its exact type.
fn pointer_attribute<T: Default>(attribute: sys::CUpointer_attribute, ptr: u64) -> Result<T, sys::CUresult> {
    let mut value = T::default();
    // SAFETY: `value` is a live out-parameter of the attribute's type (every caller
    // names an attribute of type `T`); the driver only reads `ptr`'s bookkeeping.
    #[allow(unsafe_code)]
    let r = unsafe { sys::cuPointerGetAttribute(&mut value as *mut T as *mut std::ffi::c_void, attribute, ptr) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(value),
        e => Err(e),
    }
}

/// What only the driver can tell of the caller's buffers, `ctx_of(d)` the context of the
/// GPU that runs device `d`: that each is device memory of that GPU, whole inside one
/// allocation ([`check_pointers`]), and that the routing tables among them are well formed
/// ([`check_given_routing`]).
pub(crate) fn check_with_driver(
    plan: &Plan,
    given: &[GivenBuffer],
    bound: &Bound,
    ctx_of: impl Fn(usize) -> Arc<CudaContext>,
) -> Result<(), CudaError> {
    check_pointers(plan, given, |d| ctx_of(d).ordinal())?;
    check_given_routing(plan, bound, ctx_of)
}

/// Checks with the driver that every given buffer is device memory of the GPU that runs
/// its device (`ordinal_of(d)`), lying whole inside one allocation.
fn check_pointers(plan: &Plan, given: &[GivenBuffer], ordinal_of: impl Fn(usize) -> usize) -> Result<(), CudaError> {
    use sys::CUpointer_attribute as A;
    for g in given {
        let bytes = (g.rows * g.cols * g.dtype.size_bytes()) as u64;
        if bytes == 0 {
            continue;
        }
        let at = format!("buffer `{}` of device {} at {:#x}", g.name, g.device, g.ptr);
        let not_device = |why: String| binding_error(plan, format!("{at}: {why}"));
        let kind: u32 = pointer_attribute(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, g.ptr)
            .map_err(|e| not_device(format!("not memory the CUDA driver knows ({e:?})")))?;
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(not_device(format!("memory type {kind}, not device memory")));
        }
        let ordinal: i32 = pointer_attribute(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, g.ptr)
            .map_err(|e| not_device(format!("no device ordinal ({e:?})")))?;
        let wanted = ordinal_of(g.device);
        if ordinal != wanted as i32 {
            return Err(not_device(format!("memory of GPU {ordinal}, but device {} runs on GPU {wanted}", g.device)));
        }
        let start: u64 = pointer_attribute(A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, g.ptr)
            .map_err(|e| not_device(format!("no allocation range ({e:?})")))?;
        let size: usize = pointer_attribute(A::CU_POINTER_ATTRIBUTE_RANGE_SIZE, g.ptr)
            .map_err(|e| not_device(format!("no allocation range ({e:?})")))?;
        if g.ptr + bytes > start + size as u64 {
            return Err(not_device(format!(
                "{bytes} bytes run past the end of its allocation ({size} bytes from {start:#x})"
            )));
        }
    }
    Ok(())
}

/// Reads `decl.len()` elements at `ptr` of the current context as words.
pub(crate) fn read_words(ctx: &Arc<CudaContext>, ptr: u64, decl: &BufferDecl) -> Result<Vec<u32>, CudaError> {
    ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
    let mut bytes = vec![0u8; decl.len() * decl.dtype.size_bytes()];
    if !bytes.is_empty() {
        // SAFETY: `ptr` was checked to hold this many bytes of device memory of this
        // context's GPU ([`check_pointers`]); nothing writes it during the copy.
        #[allow(unsafe_code)]
        unsafe { result::memcpy_dtoh_sync(&mut bytes, ptr) }
            .map_err(|e| CudaError::driver(format!("reading buffer `{}`", decl.name), e))?;
    }
    Ok(decl.dtype.words_from_le(&bytes, decl.len()))
}

/// Checks the routing tables the caller gave (read from each device) as the generated
/// ones are checked: ids in range, distinct per token, within the plan's capacity.
fn check_given_routing(
    plan: &Plan,
    bound: &Bound,
    ctx_of: impl Fn(usize) -> Arc<CudaContext>,
) -> Result<(), CudaError> {
    cmm_core::moe::check_routing_with(plan, |device, buffer, _| match bound[device][buffer] {
        Some(ptr) => read_words(&ctx_of(device), ptr, &plan.buffers[buffer]).map(Some),
        // Another process's device (rank mode): that rank checks its own.
        None => Ok(None),
    })
}

/// Checks that every pair of GPUs the plan reaches across can: peer access for data,
/// native peer atomics where a signal crosses. `device_of(g)` is GPU `g`'s handle.
pub(crate) fn check_peers(
    plan: &Plan,
    gpu_of: impl Fn(usize) -> usize,
    device_of: impl Fn(usize) -> sys::CUdevice,
) -> Result<(), CudaError> {
    for edge in cmm_core::verify::peer_edges(plan) {
        let (from, to) = (gpu_of(edge.from), gpu_of(edge.to));
        if from == to {
            continue;
        }
        let refused = |missing: &'static str| CudaError::PeerCapability {
            plan: plan.name.clone(),
            from: edge.from,
            to: edge.to,
            gpu_from: from,
            gpu_to: to,
            missing,
        };
        let mut can = 0;
        // SAFETY: `can` is a live out-parameter; both handles name GPUs the backend opened.
        #[allow(unsafe_code)]
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, device_of(from), device_of(to)) }
            .result()
            .map_err(|e| CudaError::driver(format!("asking whether GPU {from} can access GPU {to}"), e))?;
        if can == 0 {
            return Err(refused("peer access"));
        }
        if edge.atomic {
            let mut native = 0;
            // SAFETY: as above; the attribute's value is an int.
            #[allow(unsafe_code)]
            unsafe {
                sys::cuDeviceGetP2PAttribute(
                    &mut native,
                    sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                    device_of(from),
                    device_of(to),
                )
            }
            .result()
            .map_err(|e| CudaError::driver(format!("asking for native atomics from GPU {from} to GPU {to}"), e))?;
            if native == 0 {
                return Err(refused("native peer atomics (its signals are atomic adds on the peer's memory)"));
            }
        }
    }
    Ok(())
}
