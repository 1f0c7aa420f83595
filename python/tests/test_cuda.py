"""cmm.cuda.run on CUDA tensors, on cmm's fake CUDA driver (CMM_FAKE_CUDA=1: the CUDA
backend itself on the CPU), in one process and one process per device.

No torch here: `CudaTensor` is a CUDA tensor as DLPack shows one (a `DLManagedTensor` in a
"dltensor" capsule, device type kDLCUDA), written with ctypes over a cmm.cuda.DeviceBuffer,
so the consumer is checked against the DLPack ABI rather than against itself."""

import ctypes
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import pytest

# Before the CUDA backend starts (it opens on first use, in this process).
os.environ["CMM_FAKE_CUDA"] = "1"

import cmm  # noqa: E402


def _backend_or_skip():
    try:
        cmm.cuda.DeviceBuffer(256)
    except RuntimeError as e:
        if "NVRTC" in str(e) and not os.environ.get("CMM_REQUIRE_NVRTC"):
            pytest.skip(f"needs libnvrtc (see `cargo xtask cuda-check`): {e}")
        raise


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_CAPSULE_NEW = ctypes.pythonapi.PyCapsule_New
_CAPSULE_NEW.restype = ctypes.py_object
_CAPSULE_NEW.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = ctypes.create_string_buffer(b"dltensor")
_CODES = {"float32": (2, 32), "float16": (2, 16), "bfloat16": (4, 16), "uint32": (1, 32)}
_KDLCUDA = 2


class CudaTensor:
    """A row-major CUDA tensor on the fake GPU, offered through DLPack."""

    def __init__(self, array, strides=None, device_type=_KDLCUDA):
        array = np.ascontiguousarray(array)
        self.dtype, self.shape = array.dtype, array.shape
        self.buffer = cmm.cuda.DeviceBuffer(max(array.nbytes, 1))
        self.buffer.upload(array.tobytes())
        self._device_type = device_type
        self._shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self._strides = None if strides is None else (ctypes.c_int64 * array.ndim)(*strides)
        code, bits = _CODES[str(array.dtype)]
        self._managed = _DLManagedTensor(
            _DLTensor(
                self.buffer.ptr, _DLDevice(device_type, 0), array.ndim, _DLDataType(code, bits, 1),
                self._shape, self._strides, 0,
            ),
            None,
            None,
        )

    def __dlpack_device__(self):
        return (self._device_type, 0)

    def __dlpack__(self, stream=None):
        assert stream == 1, "cmm asks for the legacy default stream"
        return _CAPSULE_NEW(ctypes.addressof(self._managed), _DLTENSOR, None)

    def numpy(self):
        return np.frombuffer(self.buffer.download()[: int(np.prod(self.shape)) * self.dtype.itemsize],
                             dtype=self.dtype).reshape(self.shape).copy()


def _case(devices=2, family="exact"):
    return cmm.Case(op="ag_gemm", devices=devices, m=16 * devices, n=8 * devices, k=24, input="bf16",
                    output="f32", family=family, algorithm="ring", seed=5)


def _device_tensors(case):
    """Each device's inputs (the case's) and zeroed outputs, on the fake GPU."""
    tensors = []
    for device, inputs in enumerate(case.inputs()):
        mine = {name: CudaTensor(a) for name, a in inputs.items()}
        for o in case.outputs:
            mine[o.buffer] = CudaTensor(np.zeros((o.rows_on(device), o.cols), dtype=np.float32))
        tensors.append(mine)
    return tensors


def test_uneven_shards_run_on_tensors_of_each_device_s_rows():
    """M = 51 on 2 devices: 26 and 25 rows, as torch.tensor_split gives them."""
    _backend_or_skip()
    case = cmm.Case(op="gemm_rs", devices=2, m=51, n=16, k=24, input="bf16", output="f32",
                    family="exact", algorithm="ring_accumulate", chunks=2, seed=5)
    tensors = _device_tensors(case)
    assert [t["C"].shape[0] for t in tensors] == [26, 25]
    cmm.cuda.run(case, tensors)
    result = cmm.check(case, [t["C"].numpy() for t in tensors])
    assert result.ok, result.reason


def test_the_backend_describes_its_gpu_and_hardware_queues():
    _backend_or_skip()
    line = cmm.cuda.describe()
    assert "fake CUDA driver" in line and "hardware queues" in line, line


def test_a_plan_runs_on_cuda_tensors_in_one_process_and_conforms():
    _backend_or_skip()
    for family in ["exact", "realistic"]:
        case = _case(family=family)
        tensors = _device_tensors(case)
        cmm.cuda.run(case, tensors)
        outputs = [t["C"].numpy() for t in tensors]
        assert not np.isnan(outputs[0]).any()
        result = cmm.check(case, outputs)
        assert result.ok, result.reason


def test_copies_asked_of_the_copy_engines_conform_and_a_bad_name_is_refused():
    _backend_or_skip()
    assert "copies may ask for the copy engines" in cmm.cuda.describe()
    case = _case(family="exact")
    tensors = _device_tensors(case)
    cmm.cuda.run(case, tensors, copies="copy-engines")
    result = cmm.check(case, [t["C"].numpy() for t in tensors])
    assert result.ok, result.reason
    with pytest.raises(ValueError, match="copies `engines` is not one of driver, copy-engines, auto"):
        cmm.cuda.run(case, _device_tensors(case), copies="engines")


def test_wrong_tensors_are_errors_naming_the_buffer():
    _backend_or_skip()
    case = _case()
    tensors = _device_tensors(case)
    with pytest.raises(TypeError, match=r"buffer `A` of device 0 is not on a CUDA device"):
        cmm.cuda.run(case, [{**tensors[0], "A": np.zeros((16, 24), dtype=ml_dtypes.bfloat16)}, tensors[1]])
    with pytest.raises(TypeError, match=r"buffer `A` of device 0 is not on a CUDA device \(DLPack device type 1\)"):
        cmm.cuda.run(case, [{**tensors[0], "A": CudaTensor(case.inputs()[0]["A"], device_type=1)}, tensors[1]])
    wrong_shape = CudaTensor(np.zeros((8, 24), dtype=ml_dtypes.bfloat16))
    with pytest.raises(RuntimeError, match=r"buffer `A` of device 0 is 8x24 bf16, the plan's is 16x24 bf16"):
        cmm.cuda.run(case, [{**tensors[0], "A": wrong_shape}, tensors[1]])
    transposed = CudaTensor(case.inputs()[0]["A"], strides=(1, 16))
    with pytest.raises(ValueError, match=r"buffer `A` of device 0: not contiguous"):
        cmm.cuda.run(case, [{**tensors[0], "A": transposed}, tensors[1]])
    with pytest.raises(RuntimeError, match=r"not given: `C` of device 1"):
        cmm.cuda.run(case, [tensors[0], {k: v for k, v in tensors[1].items() if k != "C"}])
    with pytest.raises(ValueError, match=r"the plan has no such buffer"):
        cmm.cuda.run(case, [{**tensors[0], "Z": tensors[0]["A"]}, tensors[1]])
    with pytest.raises(ValueError, match=r"run one process per device"):
        cmm.cuda.run(case, tensors[0])
    # After every refusal, the same tensors run right.
    cmm.cuda.run(case, tensors)
    assert cmm.check(case, [t["C"].numpy() for t in tensors]).ok


_RANK_SCRIPT = r"""
import os, sys, numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import test_cuda as t
import cmm
case = t._case()
rank = int(os.environ["RANK"])
mine = t._device_tensors(case)[rank]
cmm.cuda.run(case, mine, timeout=20.0)
np.save(sys.argv[2], mine["C"].numpy())
"""


def test_one_process_per_device_as_torchrun_launches_it():
    _backend_or_skip()
    case = _case()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(_RANK_SCRIPT)
        env = dict(os.environ, WORLD_SIZE="2", CMM_RENDEZVOUS=os.path.join(tmp, "rendezvous"))
        ranks = [
            subprocess.Popen([sys.executable, script, __file__, os.path.join(tmp, f"C{r}.npy")],
                             env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)
        ]
        for r, p in enumerate(ranks):
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, f"rank {r}: {err}"
        outputs = [np.load(os.path.join(tmp, f"C{r}.npy")) for r in range(2)]
    result = cmm.check(case, outputs)
    assert result.ok, result.reason


@pytest.mark.parametrize("rank, said", [
    (0, r"rank 0 of 2 .*ranks 1 did not come"),  # alone: its peer never comes
    (5, r"rank 5 of 2 .*no such rank: the ranks of 2 are 0 to 1"),  # refused before anything runs
])
def test_a_rank_that_cannot_run_is_told_why(rank, said):
    _backend_or_skip()
    case = _case()
    with tempfile.TemporaryDirectory() as tmp:
        mine = _device_tensors(case)[0]
        with pytest.raises(RuntimeError, match=said):
            cmm.cuda.run(case, mine, rank=rank, world=2, rendezvous=os.path.join(tmp, "s"), timeout=1.0)


def test_deadlines_past_a_day_are_refused_naming_them():
    _backend_or_skip()
    case = _case()
    tensors = _device_tensors(case)
    for bad in (1e300, 86401.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match=r"wait_timeout .*: a positive number of seconds, at most 86400"):
            cmm.cuda.run(case, tensors, wait_timeout=bad)
    with pytest.raises(ValueError, match=r"timeout 1e300: a positive number of seconds"):
        cmm.cuda.run(case, tensors[0], rank=0, world=2, rendezvous="/nonexistent/s", timeout=1e300)
