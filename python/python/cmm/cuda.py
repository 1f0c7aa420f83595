"""cmm.cuda: a verified plan run on your own CUDA tensors.

In one process, every device's tensors (D virtual devices on this process's GPU 0):

    cmm.cuda.run(case, [{"A": a0, "B": b0, "C": c0}, {"A": a1, "B": b1, "C": c1}])

Or one process per device, as torchrun launches a job (`RANK`, `WORLD_SIZE` and
`MASTER_PORT` from the environment; each process's GPU 0 is its own, so give each its
GPU with `CUDA_VISIBLE_DEVICES`):

    cmm.cuda.run(case, {"A": a, "B": b, "C": c})   # this rank's device

Tensors are read through DLPack (`__dlpack__`, as torch, CuPy and JAX CUDA tensors offer
it): contiguous, row-major, on a CUDA device, with the plan's shapes and dtypes. Every
input, output, accumulator and routing table of the device(s) must be given; the results
are written into the output tensors. The plan was proven free of races, deadlocks and
hardware-queue hangs before it runs; a rank that does not come, or dies, is an error at
its peers, never a hang.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from . import _cmm

__all__ = ["run", "describe", "DeviceBuffer"]

DeviceBuffer = _cmm.DeviceBuffer


def describe() -> str:
    """One line on this thread's CUDA backend: the GPU, cuBLAS and the Hopper engine, launch
    priorities, module loading and the hardware queues the driver spreads streams over."""
    return _cmm.cuda_describe()


def _plan_json(plan: Any) -> str:
    if hasattr(plan, "plan") and callable(plan.plan):  # a cmm.Case
        plan = plan.plan()
    if isinstance(plan, Mapping):
        return json.dumps(plan)
    if isinstance(plan, str):
        return plan
    raise TypeError(f"run() takes a cmm.Case, a plan file as a dict, or its JSON text, not {type(plan).__name__}")


def _rendezvous_path(path: Optional[str]) -> str:
    if path:
        return path
    if os.environ.get("CMM_RENDEZVOUS"):
        return os.environ["CMM_RENDEZVOUS"]
    if os.environ.get("MASTER_PORT"):
        return os.path.join(tempfile.gettempdir(), f"cmm-rendezvous-{os.environ['MASTER_PORT']}")
    raise ValueError("rank= needs rendezvous= (a socket path every rank sees), CMM_RENDEZVOUS or MASTER_PORT")


def run(
    plan: Any,
    tensors: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]],
    *,
    rank: Optional[int] = None,
    world: Optional[int] = None,
    rendezvous: Optional[str] = None,
    timeout: float = 60.0,
    sync: str = "kernels",
    wait_timeout: float = 10.0,
    copies: str = "auto",
) -> None:
    """Runs `plan` (a cmm.Case, a plan file dict or its JSON) on CUDA tensors.

    `tensors` is one mapping of buffer name to tensor per device (one process), or one
    mapping for this rank's device (one process per device: `rank` and `world` given, or
    RANK and WORLD_SIZE in the environment). `timeout` bounds each meeting of the ranks,
    `wait_timeout` each wait of the plan (seconds, more than 0 and at most a day); `sync`
    is "kernels" or "memops". `copies` is
    "auto" (contiguous copies asked of the copy engines where the driver can be asked,
    strided ones left to it), "driver" (the driver picks the hardware; within one GPU it
    may copy on the SMs) or "copy-engines" (every copy asked of the copy engines, a strided
    one a row at a time)."""
    plan_json = _plan_json(plan)
    if isinstance(tensors, Mapping):
        if rank is not None:
            if world is None:
                raise ValueError("rank= needs world= (the number of ranks)")
            device, native_rank, from_env = rank, (rank, world, _rendezvous_path(rendezvous), timeout), False
        elif "RANK" in os.environ:
            device, native_rank, from_env = int(os.environ["RANK"]), None, True
        else:
            raise ValueError(
                "one device's tensors (a mapping) run one process per device: give rank= and world=, or run "
                "under torchrun (RANK, WORLD_SIZE); for every device in this process pass a list of mappings"
            )
        bound = [(device, name, t) for name, t in tensors.items()]
    elif isinstance(tensors, Sequence) and not isinstance(tensors, (str, bytes)):
        if rank is not None:
            raise ValueError("rank= takes this rank's tensors as one mapping, not a list per device")
        native_rank, from_env = None, False
        bound = []
        for device, mapping in enumerate(tensors):
            if not isinstance(mapping, Mapping):
                raise TypeError(f"device {device}: a mapping of buffer name to tensor, not {type(mapping).__name__}")
            bound.extend((device, name, t) for name, t in mapping.items())
    else:
        raise TypeError(f"tensors: a mapping (one rank) or a list of mappings (every device), not {type(tensors).__name__}")
    _cmm.cuda_run(plan_json, bound, native_rank, from_env, sync, wait_timeout, copies)
