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


def test_uneven_shards_split_as_tensor_split_does_and_conform():
    """M = 102 rows on 4 devices: devices 0 and 1 hold 26 rows, 2 and 3 hold 25, as
    torch.tensor_split (and np.array_split) cut them."""
    case = cmm.Case(op="ag_gemm", devices=4, m=102, n=32, k=64,
                    input="bf16", output="bf16", family="realistic", algorithm="fused", chunks=2, seed=7)
    inputs = case.inputs()
    assert [d["A"].shape[0] for d in inputs] == [26, 26, 25, 25]
    assert_conforms(case, ag_gemm(inputs))

    # GEMM+RS: each device's partial product of all M rows, summed, cut the same way.
    case = cmm.Case(op="gemm_rs", devices=4, m=102, n=16, k=64,
                    input="bf16", output="bf16", family="realistic", algorithm="ring_push", seed=3)
    inputs = case.inputs()
    total = sum(d["A"].astype(np.float32) @ d["B"].astype(np.float32) for d in inputs)
    outputs = [block.astype(ml_dtypes.bfloat16) for block in np.array_split(total, 4)]
    assert [o.rows_on(d) for o in case.outputs for d in range(4)] == [26, 26, 25, 25]
    assert_conforms(case, outputs)
    # The blocks in torch.chunk's order instead (26, 26, 26, 24) are refused by shape.
    with pytest.raises((AssertionError, ValueError), match="shape"):
        assert_conforms(case, [block.astype(ml_dtypes.bfloat16) for block in np.split(total, [26, 52, 78])])
