"""An AG+GEMM "kernel" written in NumPy, checked the way a Triton-distributed or Flux test
checks its kernel against a torch reference — here against cmm's oracle and rules.

Each device d holds A_d (its M/D rows of A) and B_d (its N/D columns of B) and must end
with C_d = A · B_d, where A gathers every device's rows in device order."""

import ml_dtypes
import numpy as np
import pytest

import cmm
from cmm.testing import assert_conforms


def ag_gemm(inputs, gather_order=None):
    """Every device's output: all-gather A, then the local GEMM, rounded to bf16."""
    shards = [d["A"].astype(np.float32) for d in inputs]
    outputs = []
    for device, d in enumerate(inputs):
        order = gather_order(device) if gather_order else range(len(inputs))
        a = np.concatenate([shards[i] for i in order])
        outputs.append((a @ d["B"].astype(np.float32)).astype(ml_dtypes.bfloat16))
    return outputs


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_ag_gemm_conforms(devices):
    case = cmm.Case(op="ag_gemm", devices=devices, m=16 * devices, n=8 * devices, k=64,
                    input="bf16", output="bf16", family="realistic", algorithm="ring", seed=7)
    assert_conforms(case, ag_gemm(case.inputs()))


def test_a_shard_out_of_order_on_one_device_fails_and_names_it():
    case = cmm.Case(op="ag_gemm", devices=4, m=64, n=32, k=64,
                    input="bf16", output="bf16", family="realistic", algorithm="ring", seed=7)
    # Device 2 gathers shards 0 and 1 swapped.
    swapped = lambda device: [1, 0, 2, 3] if device == 2 else range(4)
    with pytest.raises(AssertionError, match=r"dev 2 \(row \d+, col \d+ of its output; global row"):
        assert_conforms(case, ag_gemm(case.inputs(), swapped))
    result = cmm.check(case, ag_gemm(case.inputs(), swapped))
    assert not result.ok and result.worst["device"] == 2 and result.worst["row"] < 32
