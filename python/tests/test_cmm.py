"""The package against the command: the same inputs, goldens, verdicts and JSON; wrong
outputs caught with the right device named in three families; bad arguments as Python
exceptions."""

import json
import subprocess

import ml_dtypes
import numpy as np
import pytest

import cmm

AG = dict(op="ag_gemm", devices=4, m=64, n=32, k=48, input="bf16", output="bf16",
          family="realistic", algorithm="ring", seed=7)
MOE = dict(op="moe_rs", devices=2, algorithm="ring", experts=8, topk=2, routing="skewed",
           m=16, n=8, k=12, input="f16", output="f16", family="exact", seed=9)
RS_NODES = dict(op="gemm_rs", devices=4, algorithm="hierarchical", node=2, m=64, n=32, k=64, input="bf16",
                output="f32", family="realistic", seed=5)
ATTN = dict(op="attention", devices=4, algorithm="ring", m=64, n=4, k=16, kv_heads=2,
            causal=True, layout="balanced", input="bf16", output="bf16", family="realistic", seed=3)


def toml_of(name, fields):
    lines = ["[[case]]", f'name = "{name}"']
    for k, v in fields.items():
        v = ("true" if v else "false") if isinstance(v, bool) else json.dumps(v) if isinstance(v, str) else v
        lines.append(f"{k} = {v}")
    return "\n".join(lines) + "\n"


def test_inputs_equal_what_cmm_golden_exports_bit_for_bit(cmm_bin, tmp_path):
    (tmp_path / "c.toml").write_text(toml_of("c", AG) + "\n" + toml_of("m", MOE))
    subprocess.run([cmm_bin, "golden", "--backend", "cpu", "--cases", "c.toml", "--out", "g"],
                   cwd=tmp_path, check=True, capture_output=True)
    for name, fields in (("c", AG), ("m", MOE)):
        case = cmm.Case(name=name, **fields)
        for d, arrays in enumerate(case.inputs()):
            for buffer, a in arrays.items():
                exported = np.load(tmp_path / "g" / name / f"d{d}_{buffer}.npy")
                mine = a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a
                assert mine.shape == exported.shape and mine.dtype == exported.dtype, (name, d, buffer)
                assert mine.tobytes() == exported.tobytes(), (name, d, buffer)
        # And the goldens the package computes are the command's outputs.
        for buffer, arrays in case.golden("cpu").items():
            for d, a in enumerate(arrays):
                exported = np.load(tmp_path / "g" / name / f"d{d}_{buffer}.npy")
                mine = a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a
                assert mine.tobytes() == exported.tobytes(), (name, d, buffer)


@pytest.mark.parametrize("fields,output,device", [
    (AG, "C", 3), (dict(AG, algorithm="hierarchical", node=2), "C", 2), (RS_NODES, "C", 1), (MOE, "C", 1), (ATTN, "O", 2),
])
def test_a_wrong_output_fails_naming_its_device(fields, output, device):
    case = cmm.Case(**fields)
    golden = case.golden("cpu")
    assert cmm.check(case, golden).ok
    wrong = {k: [a.copy() for a in v] for k, v in golden.items()}
    a = wrong[output][device]
    a[1, 2] = a.dtype.type(float(a[1, 2]) * 2 + 3)
    result = cmm.check(case, wrong)
    assert not result.ok
    assert result.worst["device"] == device and result.worst["output"] in (None, output), result
    assert (result.worst["row"], result.worst["col"]) == (1, 2), result
    with pytest.raises(AssertionError, match=f"dev {device} "):
        cmm.testing.assert_conforms(case, wrong)


def test_the_reference_and_the_cpu_twin_give_the_same_goldens():
    case = cmm.Case(**ATTN)
    try:
        on_reference = case.golden("reference")
    except RuntimeError as e:  # no wgpu adapter here
        pytest.skip(str(e))
    on_cpu = case.golden("cpu")
    for buffer in on_cpu:
        assert all(x.tobytes() == y.tobytes() for x, y in zip(on_reference[buffer], on_cpu[buffer])), buffer


def test_a_plan_with_a_dropped_wait_fails_verification():
    case = cmm.Case(**AG)
    plan = case.plan()
    assert cmm.verify(plan, schedules=2)["findings"] == []
    lanes = plan["plan"]["programs"][0]["lanes"]
    for lane in lanes:
        waits = [i for i, op in enumerate(lane) if op.get("op") == "wait"]
        if waits:
            del lane[waits[0]]
            break
    found = cmm.verify(plan, schedules=2)["findings"]
    assert found and any("race" in f or "unwritten" in f for f in found), found


def test_simulate_and_tune_equal_the_commands_json(cmm_bin):
    def command(*args):
        out = subprocess.run([cmm_bin, *args, "--json"], check=True, capture_output=True, text=True).stdout
        return json.loads(out)

    assert cmm.simulate(op="ag_gemm", devices=4, m=256, n=256, k=256) == command(
        "simulate", "--op", "ag_gemm", "--devices", "4", "--m", "256", "--n", "256", "--k", "256")
    assert cmm.simulate(op="gemm_rs", devices=4, m=256, n=256, k=256, compare=True, profile="h100-one-gpu") == command(
        "simulate", "--op", "gemm_rs", "--devices", "4", "--m", "256", "--n", "256", "--k", "256", "--compare",
        "--profile", "h100-one-gpu")
    assert cmm.tune(op="ag_gemm", devices=8, m=8192, n=32768, k=4096) == command(
        "tune", "--op", "ag_gemm", "--devices", "8", "--m", "8192", "--n", "32768", "--k", "4096")
    assert cmm.simulate(op="gemm_ar", devices=16, m=4096, n=4096, k=16384, algorithm="hierarchical", node=8,
                        profile="h100-ib") == command(
        "simulate", "--op", "gemm_ar", "--devices", "16", "--m", "4096", "--n", "4096", "--k", "16384",
        "--algorithm", "hierarchical", "--node", "8", "--profile", "h100-ib")
    plan = cmm.Case(**AG).plan()
    simulated = cmm.simulate(plan, profile="h100-nvlink")
    assert simulated["plan"] == plan["plan"]["name"] and simulated["makespan_us"] > 0


def test_a_vector_stands_for_a_one_column_or_one_row_output():
    # ag_moe's `perm` is a column per device; a decode step's attention output one row.
    moe = cmm.Case(op="ag_moe", devices=2, algorithm="ring", experts=4, topk=2, routing="uniform",
                   m=32, n=32, k=32, input="f32", output="f32", family="exact", seed=5)
    golden = moe.golden("cpu")
    assert golden["perm"][0].shape[1] == 1
    vectors = {**golden, "perm": [a.reshape(-1) for a in golden["perm"]]}
    assert cmm.check(moe, vectors).ok
    short = {**golden, "perm": [a.reshape(-1)[:-1] for a in golden["perm"]]}
    with pytest.raises(ValueError, match=r"output `perm` of device 0 has shape \(\d+,\); the case's is \(\d+, 1\)"):
        cmm.check(moe, short)
    decode = cmm.Case(**{**ATTN, "op": "attention", "m": 1, "devices": 1, "causal": False, "layout": "contiguous"})
    rows = decode.golden("cpu")
    assert rows["O"][0].shape[0] == 1
    assert cmm.check(decode, {**rows, "O": [a.reshape(-1) for a in rows["O"]]}).ok


def test_bad_arguments_raise_the_right_exception():
    with pytest.raises(TypeError, match="unknown field"):
        cmm.Case(opp="ag_gemm")
    with pytest.raises(ValueError, match="unknown op `nope`"):
        cmm.Case(**{**AG, "op": "nope"})
    with pytest.raises(ValueError, match="N=30 is not divisible by D=4"):
        cmm.Case(**{**AG, "n": 30})
    with pytest.raises(ValueError, match="M=3 rows cannot give each of D=4 devices a row"):
        cmm.Case(**{**AG, "m": 3})
    with pytest.raises(TypeError, match="must be an int, a bool or a str"):
        cmm.Case(**{**AG, "m": 6.5})
    with pytest.raises(ValueError, match="nodes of 3 GPUs do not divide the D=4 devices"):
        cmm.Case(**{**AG, "algorithm": "hierarchical", "node": 3}).plan()
    with pytest.raises(ValueError, match="ring takes no parameter `node`"):
        cmm.Case(**{**AG, "node": 2})
    case = cmm.Case(**AG)
    golden = case.golden("cpu")["C"]
    with pytest.raises(ValueError, match="4 devices"):
        cmm.check(case, golden[:3])
    with pytest.raises(ValueError, match=r"shape \(64, 4\)"):
        cmm.check(case, [g[:, :4] for g in golden])
    with pytest.raises(TypeError, match="float64"):
        cmm.check(case, [g.astype(np.float64) for g in golden])
    with pytest.raises(ValueError, match="not a bf16 value"):
        cmm.check(case, [g.astype(np.float32) + np.float32(1e-3) for g in golden])
    with pytest.raises(ValueError, match="no output `X`"):
        cmm.check(case, {"X": golden})
    with pytest.raises(ValueError, match="backend `gpu`"):
        case.golden("gpu")
    with pytest.raises(ValueError, match="schedules"):
        cmm.verify(case.plan(), schedules=0)
    with pytest.raises(ValueError, match="schedules: 1 to 100000"):
        cmm.verify(case.plan(), schedules=10**9)
    with pytest.raises(ValueError, match="schedules: 1 to 100000, not -3"):
        cmm.verify(case.plan(), schedules=-3)
    with pytest.raises(TypeError, match="schedules must be an int, not float"):
        cmm.verify(case.plan(), schedules=2.7)
    # The command's options as keywords, and their errors in those words.
    with pytest.raises(ValueError, match="simulate: invalid value 'nope' for `op`: unknown op `nope`"):
        cmm.simulate(op="nope", devices=2, m=8, n=8, k=8)
    with pytest.raises(ValueError, match="tune: invalid value '-1' for `m`") as raised:
        cmm.tune(op="ag_gemm", devices=2, m=-1, n=8, k=8)
    assert "--help" not in str(raised.value) and "Usage" not in str(raised.value)
    with pytest.raises(ValueError, match="tune takes no keyword `foo`"):
        cmm.tune(op="ag_gemm", devices=2, m=8, n=8, k=8, foo=3)
    with pytest.raises(ValueError, match="tune: invalid value 'x' for `devices`"):
        cmm.tune(op="ag_gemm", devices="x", m=8, n=8, k=8)
    with pytest.raises(ValueError, match="--batch 0: a step needs at least one sequence"):
        cmm.tune(llm="gpt3-175b", chips=256, batch=0)


def test_the_corpus_and_case_files_load():
    corpus = cmm.corpus()
    assert len(corpus) >= 366 and any(c.op == "attention" for c in corpus)
    assert all(isinstance(c, cmm.Case) for c in corpus[:5])


class DlpackOnly:
    """An array that offers only DLPack, as a torch tensor or a JAX array does."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_outputs_are_read_through_dlpack():
    case = cmm.Case(**{**AG, "input": "f16", "output": "f16"})
    golden = case.golden("cpu")["C"]
    assert cmm.check(case, [DlpackOnly(g) for g in golden]).ok
    wrong = [g.copy() for g in golden]
    wrong[1][0, 0] += np.float16(8)
    assert cmm.check(case, [DlpackOnly(g) for g in wrong]).worst["device"] == 1
