"""cmm in Python: goldens, checks, plans and simulations of tensor-parallel collective
matmuls, on NumPy arrays and torch tensors.

    import cmm
    case = cmm.Case(op="ag_gemm", devices=4, m=64, n=32, k=48, input="bf16",
                    output="bf16", family="realistic", algorithm="ring", seed=7)
    inputs = case.inputs()                 # per device: {"A": array, "B": array}
    outputs = [my_kernel(d["A"], d["B"]) for d in inputs]   # your kernel, per device
    cmm.testing.assert_conforms(case, outputs)

The native module (`cmm._cmm`) runs the same library code as the `cmm` command; this
module turns its bytes into arrays and back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import ml_dtypes
import numpy as np

from . import _cmm
from . import cuda  # noqa: F401  (cmm.cuda.run)
from . import testing  # noqa: F401  (cmm.testing.assert_conforms)

__all__ = [
    "Case",
    "CheckResult",
    "Output",
    "check",
    "cuda",
    "corpus",
    "load_cases",
    "simulate",
    "tune",
    "verify",
    "testing",
]

# The fields a case file's [[case]] table takes, in its order.
_FIELDS = (
    "name", "op", "devices", "nr", "nc", "dataflow", "algorithm", "chunks", "node", "slices", "block",
    "layer", "pass_", "sp", "microbatches", "kv_heads", "causal", "layout", "queries",
    "experts", "topk", "routing", "m", "n", "k", "input", "output", "wire", "family", "seed",
)

_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "uint32": np.uint32}


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"Case field `{key}` must be an int, a bool or a str, not {type(value).__name__}")


def _array(dtype: str, rows: int, cols: int, data: bytes) -> np.ndarray:
    # rows = -1: as many as the bytes hold (a device's own rows of an uneven shard).
    return np.frombuffer(data, dtype=_NUMPY[dtype]).reshape(rows, cols).copy()


@dataclass(frozen=True)
class Output:
    """An output a case's plan leaves on every device, as `index.json` states it."""

    buffer: str
    dtype: str
    rows: int  # the largest device's, when device_rows is set
    cols: int
    layout: str
    rule: str  # "bits" (exact family) or "within" (the tolerance)
    tolerance: Dict[str, float]
    # Uneven shards (M not a multiple of D): each device's rows, in tensor_split's order.
    device_rows: Optional[List[int]] = None

    def rows_on(self, device: int) -> int:
        """Rows of device `device`'s array."""
        return self.rows if self.device_rows is None else self.device_rows[device]


class Case:
    """One conformance case. Keywords are the case format's fields (docs/conformance.md):
    op, devices (or nr and nc for mesh_gemm), algorithm, m, n, k, input, output,
    family, seed, and per family chunks, node, wire, dataflow, slices, block, layer, pass_
    (`pass` is a Python keyword), sp, microbatches, kv_heads, causal, layout, queries,
    experts, topk, routing. `name` defaults to "case".
    """

    def __init__(self, **fields: Any) -> None:
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise TypeError(f"Case got unknown field(s) {', '.join(unknown)} (known: {', '.join(_FIELDS)})")
        fields.setdefault("name", "case")
        lines = ["[[case]]"]
        for key in _FIELDS:
            if key in fields and fields[key] is not None:
                lines.append(f"{key.rstrip('_')} = {_toml_value(key, fields[key])}")
        cases = _cmm.parse_case_text("\n".join(lines) + "\n", "Case(...)")
        cases[0].validate()
        self._native = cases[0]

    @classmethod
    def _wrap(cls, native: Any) -> "Case":
        case = cls.__new__(cls)
        case._native = native
        return case

    name = property(lambda self: self._native.name)
    op = property(lambda self: self._native.op)
    algorithm = property(lambda self: self._native.algorithm)
    devices = property(lambda self: self._native.devices)
    seed = property(lambda self: self._native.seed)
    family = property(lambda self: self._native.family)

    def __repr__(self) -> str:
        return repr(self._native)

    def inputs(self) -> List[Dict[str, np.ndarray]]:
        """Each device's input arrays by buffer name (bf16 as ml_dtypes.bfloat16), the
        values `cmm golden` exports."""
        return [
            {name: _array(dtype, rows, cols, data) for name, dtype, rows, cols, data in device}
            for device in self._native.inputs()
        ]

    @property
    def outputs(self) -> List[Output]:
        """The outputs the case checks, with their layout, rule and tolerance."""
        return [
            Output(buffer, dtype, rows, cols, layout, rule, dict(zip(("rounding", "accumulation", "floor"), tol)), each)
            for buffer, dtype, rows, cols, layout, rule, tol, each in self._native.expected()
        ]

    @property
    def layout(self) -> Dict[str, str]:
        """Where each device's part of each output sits in the global result."""
        return {o.buffer: o.layout for o in self.outputs}

    @property
    def tolerance(self) -> Dict[str, Dict[str, float]]:
        """How each output is judged (rule "within"; rule "bits" ignores it)."""
        return {o.buffer: o.tolerance for o in self.outputs}

    def golden(self, backend: str = "reference") -> Dict[str, List[np.ndarray]]:
        """Runs the case on the wgpu reference (or its CPU twin, backend="cpu": the same
        bits), checks it against the f64 oracle as `cmm golden` does, and returns each
        output's per-device arrays."""
        return {
            buffer: [_array(dtype, -1, cols, data) for data in per_device]
            for buffer, dtype, rows, cols, per_device in self._native.golden(backend)
        }

    def plan(self) -> Dict[str, Any]:
        """The case's plan as a plan file (format cmm-plan version 1), as a dict."""
        return json.loads(self._native.plan_json())


def load_cases(path: str) -> List[Case]:
    """The cases of a case file, or of every *.toml file in a directory."""
    return [Case._wrap(c) for c in _cmm.load_cases(str(path))]


def corpus() -> List[Case]:
    """The conformance corpus of the source tree this package was built from."""
    return [Case._wrap(c) for c in _cmm.corpus()]


def _host_array(x: Any) -> np.ndarray:
    """A NumPy view or copy of an array-like: NumPy arrays as they are, torch tensors
    (CPU or CUDA) through DLPack or __array__, never through a file."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch: a CUDA tensor comes to the host first
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: its bits, as ml_dtypes'
            import torch

            return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass
    return np.asarray(x)


def _outputs(case: Case, outputs: Any) -> Dict[str, List[tuple]]:
    names = [o.buffer for o in case.outputs]
    if isinstance(outputs, Mapping):
        given = dict(outputs)
    elif len(names) == 1:
        given = {names[0]: outputs}
    else:
        raise TypeError(f"case `{case.name}` has several outputs ({', '.join(names)}): pass a dict of them")
    declared = {o.buffer: o for o in case.outputs}
    packed = {}
    for name, arrays in given.items():
        if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Sequence):
            raise TypeError(f"output `{name}`: pass one array per device (a list), not {type(arrays).__name__}")
        per_device = []
        for device, a in enumerate(arrays):
            a = _host_array(a)
            if a.ndim == 1 and name in declared and device < case.devices:
                # A vector stands for the output's one row or one column (ag_moe's `perm` is
                # a column, a decode step's attention output a row), whichever it declares.
                want = (declared[name].rows_on(device), declared[name].cols)
                if 1 not in want or a.size != want[0] * want[1]:
                    raise ValueError(f"output `{name}` of device {device} has shape {a.shape}; the case's is {want}")
                a = a.reshape(want)
            if a.ndim != 2:
                raise ValueError(f"output `{name}` of device {device} has shape {a.shape}; expected a matrix")
            dtype = str(a.dtype)
            if dtype not in _NUMPY:
                raise TypeError(f"output `{name}` of device {device} is {dtype}; give float32, float16, bfloat16 or uint32")
            per_device.append((dtype, np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes(), a.shape[0], a.shape[1]))
        packed[name] = per_device
    return packed


@dataclass(frozen=True)
class CheckResult:
    """What a check found: `ok`, the worst element (device, row, col of its output, the
    global position where the output is a window of a global matrix, got, expected,
    allowed), how many elements are off of how many, the rule, and the reason in words."""

    ok: bool
    reason: str
    rule: str
    worst: Optional[Dict[str, Any]]
    failures: List[str]
    max_error: Optional[float]

    def __bool__(self) -> bool:
        return self.ok


def check(case: Case, outputs: Any) -> CheckResult:
    """Judges outputs computed elsewhere (per-device NumPy arrays or torch tensors; a
    dict by buffer name when the case has several outputs) against the f64 oracle by
    the project's rules: bit for bit in the exact family, within the derived tolerance
    otherwise."""
    if not isinstance(case, Case):
        raise TypeError(f"check() takes a cmm.Case, not {type(case).__name__}")
    r = case._native.check(_outputs(case, outputs))
    return CheckResult(r["ok"], r["reason"], r["rule"], r["worst"], r["failures"], r["max_error"])


def verify(plan: Union[Dict[str, Any], str], schedules: int = 4) -> Dict[str, Any]:
    """Verifies a plan (a plan file as a dict or as JSON text) under `schedules`
    interleavings: {"findings": [...], "lines": [what `cmm verify` prints]}."""
    if isinstance(schedules, bool) or not isinstance(schedules, int):
        raise TypeError(f"schedules must be an int, not {type(schedules).__name__}")
    text = plan if isinstance(plan, str) else json.dumps(plan)
    lines, findings = _cmm.verify(text, schedules)
    return {"findings": findings, "lines": lines}


def _argv(options: Dict[str, Any]) -> List[str]:
    argv = []
    for key, value in options.items():
        flag = "--" + key.rstrip("_").replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        else:
            # One word, so that a value that starts with `-` stays the flag's value.
            argv.append(f"{flag}={value}")
    return argv + ["--json"]


def simulate(plan: Optional[Union[Dict[str, Any], str]] = None, **options: Any) -> Dict[str, Any]:
    """`cmm simulate --json`: a plan (a plan file as a dict or JSON text), or a problem
    given as the command's options (op="ag_gemm", devices=8, m=…, n=…, k=…,
    profile="h100-nvlink", compare=True, …), simulated; the object the command prints."""
    if plan is None:
        return json.loads(_cmm.simulate(_argv(options)))
    text = plan if isinstance(plan, str) else json.dumps(plan)
    return json.loads(_cmm.simulate_plan(text, _argv(options)))


def tune(**options: Any) -> Dict[str, Any]:
    """`cmm tune --json` with these options (op="ag_gemm", devices=8, m=…, …)."""
    return json.loads(_cmm.tune(_argv(options)))
