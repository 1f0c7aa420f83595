//! `cmm._cmm`'s CUDA half: a verified plan run on the caller's CUDA tensors, read through
//! DLPack (`__dlpack__` / `__dlpack_device__`, as torch, CuPy and JAX tensors offer them),
//! in one process (D virtual devices on GPU 0, `CudaBackend::run_given`) or one process
//! per device as torchrun launches jobs (`CudaBackend::run_rank_given`). The CUDA backend
//! opens once per process, on GPU 0 (`CUDA_VISIBLE_DEVICES` chooses it); with
//! `CMM_FAKE_CUDA=1` it is cmm's fake driver on the CPU.

use std::cell::OnceCell;
use std::ffi::c_void;
use std::path::PathBuf;
use std::time::Duration;

use cmm_core::{DType, Plan};
use cmm_cuda::{CopyIssue, CudaBackend, CudaRunOptions, DeviceBuffer, GivenBuffer, ReadBack, Rendezvous, SyncMode};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyDict};

/// Runs `f` with the CUDA backend of this thread (opened on first use; the backend is not
/// shared between threads), or fails with why it cannot start.
fn with_backend<R>(f: impl FnOnce(&CudaBackend) -> PyResult<R>) -> PyResult<R> {
    thread_local! {
        static BACKEND: OnceCell<Result<CudaBackend, String>> = const { OnceCell::new() };
    }
    BACKEND.with(|cell| match cell.get_or_init(|| CudaBackend::new(1).map_err(|e| e.to_string())) {
        Ok(backend) => f(backend),
        Err(e) => Err(PyRuntimeError::new_err(format!("the CUDA backend cannot start: {e}"))),
    })
}

/// Mirrors of DLPack's C structs (`dlpack.h`, unversioned `DLManagedTensor`).
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const DL_CUDA: i32 = 2;

/// What DLPack says of one CUDA tensor: where it starts, its shape, its dtype.
struct CudaView {
    ptr: u64,
    device_id: i32,
    shape: Vec<i64>,
    dtype: Option<DType>,
    compact: bool,
}

/// Reads `tensor`'s DLPack view. The capsule is returned with it and must outlive every
/// use of the pointer (unconsumed, it keeps the tensor's memory alive and releases it when
/// Python drops it).
fn cuda_view<'py>(py: Python<'py>, tensor: &Bound<'py, PyAny>, what: &str) -> PyResult<(CudaView, Bound<'py, PyAny>)> {
    let not_dlpack = |e: PyErr| PyTypeError::new_err(format!("{what}: not a DLPack tensor ({e})"));
    let (device_type, _): (i32, i32) =
        tensor.call_method0("__dlpack_device__").and_then(|d| d.extract()).map_err(not_dlpack)?;
    if device_type != DL_CUDA {
        return Err(PyTypeError::new_err(format!(
            "{what} is not on a CUDA device (DLPack device type {device_type}): cmm.cuda runs on CUDA tensors"
        )));
    }
    // Stream 1, CUDA's legacy default stream: the producer makes the data ready on it, and
    // cmm's copies and waits are ordered after it.
    let kwargs = PyDict::new(py);
    kwargs.set_item("stream", 1)?;
    let capsule = tensor.call_method("__dlpack__", (), Some(&kwargs)).map_err(not_dlpack)?;
    let managed = capsule
        .cast::<PyCapsule>()
        .map_err(|e| PyTypeError::new_err(format!("{what}: __dlpack__ gave no capsule ({e})")))?
        .pointer_checked(Some(c"dltensor"))
        .map_err(|e| PyTypeError::new_err(format!("{what}: not an unconsumed DLPack capsule ({e})")))?;
    // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor` (the DLPack ABI) whose
    // memory lives as long as the capsule, which the caller keeps; `shape` and `strides`
    // (when not null) hold `ndim` entries each.
    #[allow(unsafe_code)]
    let view = unsafe {
        let t = &(*(managed.as_ptr() as *const DlManagedTensor)).dl_tensor;
        let ndim = t.ndim.max(0) as usize;
        let shape = if ndim == 0 { Vec::new() } else { std::slice::from_raw_parts(t.shape, ndim).to_vec() };
        let compact = t.strides.is_null() || {
            let strides = std::slice::from_raw_parts(t.strides, ndim);
            let mut expected = 1i64;
            (0..ndim).rev().all(|i| {
                let ok = shape[i] == 1 || strides[i] == expected;
                expected *= shape[i];
                ok
            })
        };
        let dtype = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
            (2, 32, 1) => Some(DType::F32),
            (2, 16, 1) => Some(DType::F16),
            (4, 16, 1) => Some(DType::Bf16),
            (1, 32, 1) => Some(DType::U32),
            _ => None,
        };
        CudaView { ptr: t.data as u64 + t.byte_offset, device_id: t.device.device_id, shape, dtype, compact }
    };
    Ok((view, capsule))
}

/// Binds `(device, buffer name, tensor)` to the plan's buffers, checking what DLPack tells
/// (the backend checks the rest against the plan and the driver).
fn bindings<'py>(
    py: Python<'py>,
    plan: &Plan,
    tensors: &[(usize, String, Bound<'py, PyAny>)],
) -> PyResult<(Vec<GivenBuffer>, Vec<Bound<'py, PyAny>>)> {
    let mut given = Vec::with_capacity(tensors.len());
    let mut keep = Vec::with_capacity(tensors.len());
    for (device, name, tensor) in tensors {
        let what = format!("buffer `{name}` of device {device}");
        let decl = plan.buffers.iter().find(|b| &b.name == name).ok_or_else(|| {
            let names: Vec<&str> = plan.buffers.iter().map(|b| b.name.as_str()).collect();
            PyValueError::new_err(format!("{what}: the plan has no such buffer (it has {})", names.join(", ")))
        })?;
        let (view, capsule) = cuda_view(py, tensor, &what)?;
        let dtype = view.dtype.ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{what}: a dtype cmm does not take (f32, f16, bf16 or u32), plan: {}",
                decl.dtype
            ))
        })?;
        let (rows, cols) = match view.shape.as_slice() {
            [rows, cols] if *rows >= 0 && *cols >= 0 => (*rows as usize, *cols as usize),
            other => {
                return Err(PyValueError::new_err(format!(
                    "{what}: shape {other:?}, the plan's is [{}, {}]",
                    decl.rows_on(*device),
                    decl.cols
                )))
            }
        };
        if !view.compact {
            return Err(PyValueError::new_err(format!("{what}: not contiguous (row-major): pass .contiguous()")));
        }
        if view.device_id != 0 {
            return Err(PyValueError::new_err(format!(
                "{what}: on CUDA device {}, cmm runs on device 0 of this process (set CUDA_VISIBLE_DEVICES)",
                view.device_id
            )));
        }
        given.push(GivenBuffer { device: *device, name: name.clone(), ptr: view.ptr, rows, cols, dtype });
        keep.push(capsule);
    }
    Ok((given, keep))
}

/// `value` seconds as a deadline: positive, and at most a day ([`cmm_cuda::MAX_DEADLINE`]).
fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    let most = cmm_cuda::MAX_DEADLINE.as_secs_f64();
    if value.is_finite() && value > 0.0 && value <= most {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(PyValueError::new_err(format!("{name} {value:?}: a positive number of seconds, at most {most} (a day)")))
    }
}

/// Runs a plan file's text on the caller's CUDA tensors, `(device, buffer, tensor)` for
/// every input, output, accumulator and routing table: of every device in one process, or
/// with `rank = (rank, world, socket, timeout s)` (or `RANK`/`WORLD_SIZE` in the
/// environment, `from_env`) of this rank's device. The results are left in the tensors.
// One argument per keyword of `cmm.cuda.run`, which builds the call.
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (plan_json, tensors, rank, from_env, sync, wait_timeout, copies))]
pub fn cuda_run<'py>(
    py: Python<'py>,
    plan_json: &str,
    tensors: Vec<(usize, String, Bound<'py, PyAny>)>,
    rank: Option<(usize, usize, String, f64)>,
    from_env: bool,
    sync: &str,
    wait_timeout: f64,
    copies: &str,
) -> PyResult<()> {
    let plan = Plan::from_file_json(plan_json).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let sync = match sync {
        "kernels" => SyncMode::Kernels,
        "memops" => SyncMode::StreamMemOps,
        other => return Err(PyValueError::new_err(format!("sync `{other}`: kernels or memops"))),
    };
    let copies = CopyIssue::parse(copies).map_err(|why| PyValueError::new_err(format!("copies {why}")))?;
    let wait_timeout = seconds("wait_timeout", wait_timeout)?;
    let rendezvous = match (rank, from_env) {
        (Some((rank, world, socket, timeout)), _) => {
            Some(Rendezvous { rank, world, socket: PathBuf::from(socket), timeout: seconds("timeout", timeout)? })
        }
        (None, true) => Some(Rendezvous::from_env().map_err(|e| PyValueError::new_err(e.to_string()))?),
        (None, false) => None,
    };
    let (given, _capsules) = bindings(py, &plan, &tensors)?;
    let options =
        CudaRunOptions { sync, wait_timeout, read_back: ReadBack::Nothing, copies, ..CudaRunOptions::default() };
    // The GIL stays held: the backend belongs to this thread.
    with_backend(|backend| {
        let run = match &rendezvous {
            Some(rv) => backend.run_rank_given(&plan, rv, &given, &options),
            None => backend.run_given(&plan, &given, &options),
        };
        run.map(|_| ()).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    })
}

/// One line on this thread's CUDA backend: the GPU, the GEMM libraries and engines, launch
/// priorities, module loading and hardware queues (`CudaBackend::summary`).
#[pyfunction]
pub fn cuda_describe() -> PyResult<String> {
    with_backend(|backend| Ok(backend.summary()))
}

/// Device memory of this process's CUDA backend (GPU 0), for callers without a tensor
/// library: bytes in and out, and a DLPack view (`__dlpack__`) is left to the caller.
#[pyclass(name = "DeviceBuffer", module = "cmm._cmm", unsendable)]
#[derive(Debug)]
pub struct PyDeviceBuffer {
    buffer: DeviceBuffer,
}

#[pymethods]
impl PyDeviceBuffer {
    /// A zeroed allocation of `nbytes` bytes.
    #[new]
    fn new(nbytes: usize) -> PyResult<Self> {
        if nbytes == 0 {
            return Err(PyValueError::new_err("nbytes: at least 1"));
        }
        let buffer = with_backend(|b| b.device_buffer(0, nbytes).map_err(|e| PyRuntimeError::new_err(e.to_string())))?;
        Ok(PyDeviceBuffer { buffer })
    }

    /// Its device address.
    #[getter]
    fn ptr(&self) -> u64 {
        self.buffer.ptr()
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buffer.len()
    }

    /// Copies `data` to its start.
    fn upload(&self, data: &[u8]) -> PyResult<()> {
        self.buffer.upload(data).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Its contents.
    fn download<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.buffer.download().map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }
}
