"""cmm.cuda.run on torch's own CUDA tensors, on a real GPU: one process, and one process
per device as torchrun launches it (all ranks on GPU 0, whose handles work across
processes). Skipped without torch or a CUDA GPU (CI has neither); the GPU bundle runs it
as a script (`python3 test_torch_gpu.py`, no pytest needed there) with the cmm wheel it
carries."""

import os
import subprocess
import sys
import tempfile

import numpy as np

try:
    import torch
except ImportError:
    torch = None

if __name__ != "__main__":
    import pytest

    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs torch with a CUDA GPU (the GPU bundle runs these)", allow_module_level=True)

import cmm  # noqa: E402


def _case(family="exact", devices=2, algorithm="ring"):
    return cmm.Case(op="ag_gemm", devices=devices, m=128 * devices, n=64 * devices, k=256, input="bf16",
                    output="f32", family=family, algorithm=algorithm, seed=5)


def _to_torch(array):
    """A host array (bf16 through its bits) as a CUDA tensor of GPU 0."""
    if array.dtype.name == "bfloat16":
        bits = torch.from_numpy(np.ascontiguousarray(array).view(np.int16))
        return bits.view(torch.bfloat16).to("cuda:0")
    return torch.from_numpy(np.ascontiguousarray(array)).to("cuda:0")


def _device_tensors(case, device):
    """One device's inputs (the case's) and zeroed f32 outputs, as torch CUDA tensors."""
    mine = {name: _to_torch(a) for name, a in case.inputs()[device].items()}
    for o in case.outputs:
        mine[o.buffer] = torch.zeros((o.rows_on(device), o.cols), dtype=torch.float32, device="cuda:0")
    return mine


def test_a_plan_runs_on_torch_tensors_in_one_process_and_conforms():
    for family in ["exact", "realistic"]:
        for algorithm in ["ring", "baseline"]:
            case = _case(family, algorithm=algorithm)
            tensors = [_device_tensors(case, d) for d in range(case.devices)]
            cmm.cuda.run(case, tensors)
            torch.cuda.synchronize()
            result = cmm.check(case, [t["C"].cpu().numpy() for t in tensors])
            assert result.ok, f"{family} {algorithm}: {result.reason}"


_RANK_SCRIPT = r"""
import os, sys, numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import test_torch_gpu as t
import cmm, torch
case = t._case()
mine = t._device_tensors(case, int(os.environ["RANK"]))
cmm.cuda.run(case, mine, timeout=60.0)
torch.cuda.synchronize()
np.save(sys.argv[2], mine["C"].cpu().numpy())
"""


def test_one_process_per_device_as_torchrun_launches_it():
    case = _case()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(_RANK_SCRIPT)
        env = dict(os.environ, WORLD_SIZE=str(case.devices), LOCAL_RANK="0",
                   CMM_RENDEZVOUS=os.path.join(tmp, "rendezvous"))
        env.pop("CMM_FAKE_CUDA", None)
        ranks = [
            subprocess.Popen([sys.executable, script, __file__, os.path.join(tmp, f"C{r}.npy")],
                             env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(case.devices)
        ]
        for r, p in enumerate(ranks):
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"rank {r}: {err}"
        outputs = [np.load(os.path.join(tmp, f"C{r}.npy")) for r in range(case.devices)]
    result = cmm.check(case, outputs)
    assert result.ok, result.reason


if __name__ == "__main__":
    failed = 0
    if torch is None or not torch.cuda.is_available():
        print("torch: no torch with a CUDA GPU here; nothing run")
        sys.exit(2)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; cmm from {os.path.dirname(cmm.__file__)}")
    tests = sorted((n, f) for n, f in globals().items() if n.startswith("test_"))
    for name, test in tests:
        try:
            test()
            print(f"ok {name}")
        except Exception as e:  # noqa: BLE001 (every failure is reported, then counted)
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
