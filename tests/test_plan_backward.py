"""The cost model's training step (`python -m tpattn.plan --kernel fused --backward`): the backward's
passes counted by hand, its collective (copy_to_ranks's dual), the refusals, the calibrated
"fused.bwd" pass of the shipped H200 machine, and the CLI."""

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
                                     (dict(sequence_parallel=True), "head parallelism only"),
                                     (dict(context_parallel=2), "head parallelism only")])
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
