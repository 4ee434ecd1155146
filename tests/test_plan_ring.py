"""The cost model's ring (--context-parallel C) on CPU: its steps counted by hand (every rank's
pieces add up to 1/C of the whole attention, what travels per pass, GQA sending only the K/V heads
in use), a transfer hidden under its step's compute until it outlasts it, the long causal pass
tending to the full pass's efficiency, the crossover against head parallelism alone, and the
plan CLI's table and refusals."""

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))

from test_plan import plan_cli, toy_machine  # noqa: E402
from tpattn.attention.ring import pieces  # noqa: E402
from tpattn.model import cli  # noqa: E402
from tpattn.model import costmodel as cm  # noqa: E402
from tpattn.model import machine as mc  # noqa: E402
from tpattn.model import steps as st  # noqa: E402


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy_machine()))
    return path


def shape(**kw):
    base = dict(seq_len=4096, heads=8, head_dim=64, kernel="fused", context_parallel=2)
    return st.Shape(**{**base, **kw})


def attention_flops(steps):
    return sum(s.flops for s in steps if s.key == "fused.fused")


@pytest.mark.parametrize("C", [2, 3, 4])
def test_non_causal_ring_does_one_cth_of_the_attention(C):
    s = shape(seq_len=2 * C * 512, context_parallel=C)
    whole = attention_flops(st.attention_steps("fused", 1, s.heads, s.seq_len, s.head_dim, "fp16", False))
    ring = [x for step in st.ring_plan(s, C) for x in step["compute"]]
    assert attention_flops(ring) == pytest.approx(whole / C, rel=1e-12)


@pytest.mark.parametrize("C", [2, 4])
def test_causal_pieces_give_every_rank_the_same_scores(C):
    """The zigzag's point: rank 0's pieces (which ring_plan prices) are every rank's work."""
    n = 2 * 64
    counts = []
    for c in range(C):
        total = 0
        for j in range(C):
            for q0, q1, k0, k1, diag in pieces(c, j, n, True):
                total += (q1 - q0) * (q1 - q0 + 1) // 2 if diag else (q1 - q0) * (k1 - k0)
        counts.append(total)
    assert len(set(counts)) == 1
    N = C * n
    assert sum(counts) == N * (N + 1) // 2  # and together every (query, key <= query) pair once


def test_what_travels_per_pass_and_gqa():
    s = shape(seq_len=8192, heads=8, kv_heads=2, head_dim=64, context_parallel=4)
    plan = st.ring_plan(s, 4)
    n = 8192 // 4
    assert [p["send_bytes"] for p in plan] == [2 * 2 * n * 64 * 2] * 3 + [0]  # K and V of 2 K/V heads, fp16
    # with the heads split over 2 rings' worth of ranks (W = 8, T = 2): one K/V head each travels
    plan8 = st.ring_plan(s, 8)
    assert plan8[0]["send_bytes"] == 2 * 1 * n * 64 * 2


def test_transfer_hidden_until_it_outlasts_the_compute(toy):
    m = mc.load_machine(str(toy))
    long = cm.predict(m, shape(seq_len=16384), 2)["collectives"]["ring"]
    assert long["ms"] == 0.0 and long["transfer_ms"] > 0
    slow = json.loads(toy.read_text())
    slow["links"]["nvlink"]["busbw_GBps"] = 0.01  # a link so slow that every pass outlasts its compute
    path = toy.parent / "slow.json"
    path.write_text(json.dumps(slow))
    r = cm.predict(mc.load_machine(str(path)), shape(seq_len=16384), 2)
    ring = r["collectives"]["ring"]
    comp = sum(cm.step_ms(mc.load_machine(str(path)), x)["ms"] for x in st.ring_plan(shape(seq_len=16384), 2)[0]["compute"])
    assert ring["ms"] == pytest.approx(ring["transfer_ms"] - comp, rel=1e-9)
    assert r["communication_ms"] >= ring["ms"]


def test_ring_layer_steps_project_n_over_c_rows():
    s = shape(seq_len=4096, context_parallel=4)
    steps, colls = st.layer_steps(s, 8)  # T = 2: heads over 2, rows over 4
    qkv = next(x for x in steps if x.name == "qkv_proj" and x.key == "qkv_proj")
    h = 8 // 2
    assert qkv.flops == 2.0 * (4096 // 4) * s.model_dim * 3 * h * 64
    assert colls and all(b <= (4096 // 4) * s.model_dim * 4 for b in colls.values())  # the heads' sums of n rows


def test_long_causal_pass_tends_to_the_full_efficiency():
    m = mc.load_machine("h200")
    def eff(n, causal):
        (x,) = st.attention_steps("fused", 1, 32, n, 128, "fp16", causal)
        return cm.step_ms(m, x)["efficiency"]
    assert eff(1 << 20, True) > eff(8192, True)
    assert eff(1 << 20, True) == pytest.approx(eff(1 << 20, False), rel=0.02)
    assert eff(4096, True) < eff(4096, False)  # where it is calibrated, the causal curve as measured


def test_crossover_rows_and_a_world_beyond_the_heads(toy):
    m = mc.load_machine(str(toy))
    res = cm.crossover(m, shape(heads=8, context_parallel=16), 16, lengths=(2048, 4096, 8192))
    assert res["heads_error"] and "larger than --heads 8" in res["heads_error"]
    assert [r["seq_len"] for r in res["rows"]] == [2048, 4096, 8192]
    assert all(r["heads_ms"] is None and r["ring_ms"] > 0 for r in res["rows"])
    two = cm.crossover(m, shape(), 2, lengths=(1024, 4096))
    assert two["heads_error"] is None and all(r["heads_ms"] > 0 for r in two["rows"])
    assert two["largest_n"]["ring"] > 0 and two["largest_n"]["heads"] > 0


def test_plan_cli_ring_table_and_crossover(toy):
    base = ["--machine", str(toy), "--kernel", "fused", "--heads", "8", "--head-dim", "64", "--causal"]
    out = plan_cli([*base, "--context-parallel", "2", "--seq-len", "8192"])
    assert out.returncode == 0, out.stderr
    assert "context-parallel (rings of 2 ranks" in out.stdout and "ring (exposed)" in out.stdout
    assert [ln.split()[0] for ln in out.stdout.splitlines() if ln.strip()[:2] in ("2 ", "4 ", "8 ")] == ["2", "4", "8"]
    assert "W=2: ring: 1 pass(es) of K/V" in out.stdout
    x = plan_cli([*base, "--context-parallel", "4", "--world-sizes", "4", "16", "--crossover"])
    assert x.returncode == 0, x.stderr
    lines = x.stdout.splitlines()
    assert any(ln.startswith("W=4: the ring is ") for ln in lines)
    assert any(ln.startswith("W=16: head parallelism alone cannot run") for ln in lines)


@pytest.mark.parametrize("argv,says", [
    (["--kernel", "fused", "--crossover"], "add --context-parallel C"),
    (["--kernel", "naive", "--context-parallel", "2"], "add --kernel fused"),
    (["--kernel", "fused", "--context-parallel", "0"], "at least 1"),
    (["--kernel", "fused", "--context-parallel", "3", "--world-sizes", "4", "--crossover"], "does not divide 4 ranks"),
    (["--kernel", "fused", "--context-parallel", "2", "--seq-len", "4098", "--world-sizes", "2", "--crossover"],
     "must divide by 4"),
    # what the CLI and the layer refuse beside a ring is refused here too, in the same words
    (["--kernel", "fused", "--context-parallel", "2", "--overlap", "2"], "--context-parallel with --overlap: the ring "
                                                                       "overlaps its own passes"),
    (["--kernel", "fused", "--context-parallel", "2", "--cuda-graph"], "--context-parallel with --cuda-graph"),
    (["--kernel", "fused", "--context-parallel", "2", "--output-collective", "p2p"], "--context-parallel with "
                                                                                     "--output-collective p2p"),
    (["--kernel", "fused", "--context-parallel", "2", "--sequence-parallel"], "--context-parallel with "
                                                                              "--sequence-parallel"),
])
def test_plan_cli_ring_refusals(toy, capsys, argv, says):
    assert cli.main(["--machine", str(toy), *argv]) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, (argv, err)


def test_crossover_skips_world_sizes_the_machine_cannot_hold():
    """A one-node machine file: the default world sizes past its GPUs are said, one line each, and
    the rest predicted."""
    out = plan_cli(["--machine", "h200x2", "--kernel", "fused", "--causal", "--context-parallel", "2", "--crossover"])
    assert out.returncode == 0, out.stderr
    assert any(ln.startswith("W=2: the ring is ") for ln in out.stdout.splitlines())
    assert any(ln.startswith("W=4: not predicted: machine h200x2 is 1 node") for ln in out.stdout.splitlines())
