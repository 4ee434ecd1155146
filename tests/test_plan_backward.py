"""The cost model's training step (`python -m tpattn.plan --kernel fused --backward`): the backward's
passes counted by hand, its collective (copy_to_ranks's dual), the ring's backward (its pieces, what
travels, what of it is exposed), the refusals, the calibrated "fused.bwd" pass of the shipped H200
machine, and the CLI."""

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests"))
from test_plan import plan_cli  # noqa: E402
from tpattn.model import costmodel as cm  # noqa: E402
from tpattn.model import machine as mc  # noqa: E402
from tpattn.model import steps as st  # noqa: E402
from tpattn.model.errors import ModelError  # noqa: E402


def shape(**kw):
    base = dict(seq_len=4096, heads=32, head_dim=128, kernel="fused")
    return st.Shape(**{**base, **kw})


@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_is_five_products(causal):
    fwd = next(s for s in st.attention_steps("fused", 2, 8, 1000, 64, "bf16", causal, 2) if s.key == "fused.fused")
    bwd = st.attention_backward_step("fused", 2, 8, 1000, 64, "bf16", causal, 2)
    assert bwd.key == "fused.bwd" and bwd.causal == causal and (bwd.bh, bwd.n) == (16, 1000)
    assert bwd.flops == pytest.approx(2.5 * fwd.flops)  # five N x N products against the forward's two
    q, kv = 16 * 1000 * 64 * 2, 2 * 2 * 1000 * 64 * 2
    assert bwd.bytes == 5 * q + 4 * kv + 2 * 16 * 1000 * 64 * 4  # Q, O, dO, dQ (+ dq_out's) ; K, V, dK, dV; fp32 sum


def test_backward_steps_gemms_and_collective():
    s = shape(batch=2, kv_heads=8)
    steps, colls = st.backward_steps(s, 4)
    rows, D, h, g, d = 2 * 4096, 4096, 8, 2, 128
    gemms = [x for x in steps if x.unit == "tensor" and x.key != "fused.bwd"]
    assert sorted(x.flops for x in gemms) == sorted([2.0 * rows * D * h * d] * 2 + [2.0 * rows * (h + 2 * g) * d * D] * 2)
    assert colls == {"allreduce": rows * D * 2}  # dX summed over the ranks
    # the attention backward writes dq, dk, dv into the QKV gradient's rows itself: no relayout pass
    assert [x.key for x in steps if x.unit != "tensor"] == []
    assert st.backward_steps(s, 1)[1] == {}


@pytest.mark.parametrize("kw,what", [(dict(kernel="naive"), "--kernel fused only"),
                                     (dict(sequence_parallel=True), "not --sequence-parallel")])
def test_backward_refusals(kw, what):
    with pytest.raises(ModelError, match=what):
        st.backward_steps(shape(**kw), 2)


def test_shipped_machine_calibrates_the_backward():
    m = mc.load_machine("h200")
    r = cm.predict_training(m, shape(), 1)
    # the pass the calibration measured (B=1 h=32 N=4096 d=128): its own point, within interpolation
    pt = next(p for p in json.loads((ROOT / "tpattn/model/machines/h200x2.json").read_text())["passes"]["fused.bwd"]
              if p["h"] == 32 and p["N"] == 4096)
    assert r["backward_passes"]["attn_bwd"] == pytest.approx(pt["ms"], rel=1e-6)
    assert r["gpu_ms"] == pytest.approx(r["forward_ms"] + r["backward_ms"])
    two = cm.predict_training(m, shape(), 2)
    assert two["backward_collectives"]["bwd_allreduce"] > 0 and two["backward_passes"]["attn_bwd"] < r["backward_passes"]["attn_bwd"]


def test_cli_backward_table_and_refusal(tmp_path):
    out = plan_cli(["--kernel", "fused", "--backward", "--world-sizes", "1", "2", "--json", str(tmp_path / "t.json")])
    assert out.returncode == 0, out.stderr
    assert "step (GPU)" in out.stdout and "attn_bwd" in out.stdout
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [r["world"] for r in doc["training"]] == [1, 2]
    bad = plan_cli(["--kernel", "naive", "--backward"])
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--kernel fused" in bad.stderr


@pytest.mark.parametrize("C,causal", [(2, False), (4, False), (2, True), (4, True)])
def test_ring_backward_is_the_ring_forwards_pieces_five_products_each(C, causal):
    """The ring's backward runs, step by step, the backward of the forward's pieces (2.5x their FLOPs);
    non-causal, together 1/C of the whole backward; each step adds this rank's dK, dV into the block's
    fp32 sums; C - 1 K/V passes and C passes of the sums travel (GQA: the rank's K/V heads only)."""
    s = shape(seq_len=2 * C * 512, heads=8, kv_heads=2, head_dim=64, context_parallel=C, causal=causal)
    fwd, bwd = st.ring_plan(s, C), st.ring_backward_plan(s, C)
    assert len(bwd) == C
    for f, b in zip(fwd, bwd):
        fl = sum(x.flops for x in f["compute"] if x.key == "fused.fused")
        assert sum(x.flops for x in b["compute"] if x.key == "fused.bwd") == pytest.approx(2.5 * fl, rel=1e-12)
        (sums,) = [x for x in b["compute"] if x.key == "epilogue"]
        n = s.seq_len // C
        assert b["sums_bytes"] == 2 * 2 * n * 64 * 4 and sums.bytes == st.SUM_PASSES * b["sums_bytes"]
        assert b["send_bytes"] == f["send_bytes"]  # the same K/V blocks travel again
    if not causal:
        whole = st.attention_backward_step("fused", 1, 8, s.seq_len, 64, "fp16", False, 2).flops
        assert sum(x.flops for b in bwd for x in b["compute"] if x.key == "fused.bwd") == pytest.approx(whole / C)
    steps, colls = st.backward_steps(s, 2 * C)  # T = 2: heads over 2 rings' worth of ranks, rows over C
    gemm = next(x for x in steps if x.name == "bwd_qkv_proj")
    assert gemm.flops == 2.0 * (s.seq_len // C) * (4 + 2 * 1) * 64 * s.model_dim
    assert colls == {"allreduce": (s.seq_len // C) * s.model_dim * 2}


def test_ring_backward_exposes_the_sums_last_hop_and_what_outlasts_its_step(tmp_path):
    import test_plan as tp
    toy = tp.toy_machine()
    pt = {"B": 1, "h": 2, "N": 128, "d": 64, "dtype": "fp16", "causal": False}  # the backward at half its roofline too
    bare = mc.Machine("toy", {"peaks": tp.PEAKS}, "-")
    toy["passes"]["fused.bwd"] = [{**pt, "ms": mc.roofline_ms(bare, mc._point_step("fused.bwd", {**pt, "ms": 1}))[0] / 0.5}]
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy))
    m = mc.load_machine(str(path))
    s = shape(seq_len=16384, heads=8, head_dim=64, context_parallel=2)
    r = cm.ring_backward_ms(m, s, 2)
    plan = st.ring_backward_plan(s, 2)
    hop = cm.ring_pass_ms(m, plan[-1]["sums_bytes"], 2)["ms"]
    kv = cm.ring_pass_ms(m, plan[0]["send_bytes"], 2)["ms"]
    assert r["passes"] == 3 and r["transfer_ms"] == pytest.approx(kv + 2 * hop)
    assert r["ms"] == pytest.approx(hop)  # a fast link: everything hidden but the last hop home
    toy["links"]["nvlink"]["busbw_GBps"] = 0.01  # so slow that every pass outlasts its step's compute
    path.write_text(json.dumps(toy))
    slow = mc.load_machine(str(path))
    r = cm.ring_backward_ms(slow, s, 2)
    comp = [sum(cm.step_ms(slow, x)["ms"] for x in p["compute"]) for p in plan]
    assert r["ms"] == pytest.approx(r["transfer_ms"] - sum(comp), rel=1e-9)
    t = cm.predict_training(m, s, 4)
    assert set(t["backward_collectives"]) == {"bwd_ring", "bwd_allreduce"}
    assert t["backward_ms"] == pytest.approx(sum(t["backward_passes"].values()) + sum(t["backward_collectives"].values()))


def test_cli_backward_with_the_ring():
    out = plan_cli(["--kernel", "fused", "--causal", "--backward", "--context-parallel", "2", "--seq-len", "65536",
                    "--world-sizes", "2", "4"])
    assert out.returncode == 0, out.stderr
    assert "bwd_ring" in out.stdout and "attn_bwd" in out.stdout and "step (GPU)" in out.stdout


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_is_seven_products(causal):
    """--deterministic prices the seven-product pair: 3.5x the forward's FLOPs, no fp32 dQ sum, and its
    own calibrated pass; a ring's deterministic piece adds its dQ into the rank's fp32 sum by a pass."""
    fwd = next(s for s in st.attention_steps("fused", 2, 8, 1000, 64, "bf16", causal, 2) if s.key == "fused.fused")
    det = st.attention_backward_step("fused", 2, 8, 1000, 64, "bf16", causal, 2, deterministic=True)
    assert det.key == "fused.bwd_det" and det.causal == causal and (det.bh, det.n) == (16, 1000)
    assert det.flops == pytest.approx(3.5 * fwd.flops)
    q, kv = 16 * 1000 * 64 * 2, 2 * 2 * 1000 * 64 * 2
    assert det.bytes == 7 * q + 6 * kv
    steps, _ = st.backward_steps(shape(deterministic=True), 1)
    assert [x.key for x in steps if x.name == "attn_bwd"] == ["fused.bwd_det"]
    s = shape(seq_len=4096, heads=8, kv_heads=2, head_dim=64, context_parallel=2, causal=causal, deterministic=True)
    for b in st.ring_backward_plan(s, 2):
        keys = [x.key for x in b["compute"]]
        assert "fused.bwd" not in keys and keys.count("epilogue") == keys.count("fused.bwd_det") + 1


def test_deterministic_needs_its_calibration_and_costs_more(tmp_path):
    import test_plan as tp
    m = mc.load_machine("h200")
    with pytest.raises(ModelError, match="calibrate_backward.py --deterministic"):
        cm.predict_training(m, shape(deterministic=True), 1)
    toy = tp.toy_machine()
    pt = {"B": 1, "h": 2, "N": 128, "d": 64, "dtype": "fp16", "causal": False}
    bare = mc.Machine("toy", {"peaks": tp.PEAKS}, "-")
    for key in ("fused.bwd", "fused.bwd_det"):  # both at half their roofline
        toy["passes"][key] = [{**pt, "ms": mc.roofline_ms(bare, mc._point_step(key, {**pt, "ms": 1}))[0] / 0.5}]
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy))
    m = mc.load_machine(str(path))
    five, seven = (cm.predict_training(m, shape(deterministic=d), 1)["backward_passes"]["attn_bwd"] for d in (False, True))
    assert seven == pytest.approx(1.4 * five, rel=0.02)  # compute-bound: 7 products against 5
    out = plan_cli(["--kernel", "fused", "--backward", "--deterministic", "--machine", str(path), "--world-sizes", "1"])
    assert out.returncode == 0, out.stderr
    assert "attn_bwd" in out.stdout


@pytest.mark.parametrize("args,what", [(["--deterministic"], "add --backward"),
                                       (["--backward", "--deterministic"], "calibrate_backward.py --deterministic")])
def test_cli_deterministic_refusals(args, what):
    out = plan_cli(["--kernel", "fused", "--world-sizes", "1", *args])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and what in out.stderr, out.stderr
