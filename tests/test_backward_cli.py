"""python -m tpattn --backward: a training step timed per pass and checked (x.grad and the whole
gradients against the single-process layer and float64), under a real mpirun on CPU (gloo); the
combinations it refuses; a rank that stalls before a backward collective ends the job."""

import json

import pytest

from conftest import rank_lines, tpattn
from test_faults import job

SMALL = ["--seq-len", "96", "--heads", "4", "--head-dim", "16", "--device", "cpu", "--iters", "2", "--warmup", "1"]


def test_single_process_backward_passes_and_reports_the_backward_passes(tmp_path):
    out = tmp_path / "r.json"
    r = tpattn([*SMALL, "--backward", "--causal", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["config"]["backward"]
    assert {"qkv_proj", "out_proj", "bwd_out_proj", "bwd_dx_proj", "bwd_dw_proj", "attention"} <= set(rep["passes"])
    assert rep["checks"]["grads_vs_float64"]["pass"] and "weight gradients" in rep["checks"]["grads_vs_float64"]["what"]


@pytest.mark.mpi
@pytest.mark.parametrize("world,extra,colls", [  # the forward's are the plan's, as in inference (fp16: the split)
    (2, [], {"reducescatter", "allgather", "bwd_allreduce"}),
    (2, ["--reduce-dtype", "model"], {"allreduce", "bwd_allreduce"}),
    (2, ["--sequence-parallel"], {"allgather", "reducescatter", "bwd_allgather", "bwd_reducescatter"}),
    (2, ["--kv-heads", "1"], {"reducescatter", "allgather", "bwd_allreduce", "bwd_copies", "bwd_copies_bias"}),
    (3, ["--uneven-heads", "--overlap", "2", "--dtype", "bf16"], {"reducescatter", "allgather", "bwd_allreduce"}),
])
def test_backward_over_ranks_matches_single_process_and_float64(world, extra, colls, tmp_path):
    out = tmp_path / "r.json"
    r = tpattn([*SMALL, "--backward", "--causal", *extra, "--json", str(out)], ranks=world, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS"
    assert rep["checks"]["grads_vs_single_process"]["pass"] and rep["checks"]["grads_vs_float64"]["pass"]
    assert set(rep["collectives"]) == colls
    assert all(c["bytes"] > 0 and c["median_ms"] > 0 for c in rep["collectives"].values())


@pytest.mark.parametrize("extra,says", [
    (["--cuda-graph"], "--cuda-graph needs --device cuda; drop it on CPU"),  # (on a GPU: the step in one graph)
])
def test_backward_refuses_what_it_cannot_do(extra, says):
    r = tpattn([*SMALL, "--backward", *extra])
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_deterministic_is_a_backward_flag(tmp_path):
    r = tpattn([*SMALL, "--deterministic"])
    assert r.returncode == 2 and "--deterministic changes the backward only: add --backward" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    out = tmp_path / "r.json"
    r = tpattn([*SMALL, "--backward", "--deterministic", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["config"]["deterministic"]


@pytest.mark.mpi
def test_a_rank_that_hangs_before_a_backward_collective_ends_the_job():
    """Rank 1 stalls before the backward's all-reduce of dX: rank 0 waits in it until --timeout, says
    rank 1 never joined it, and the job ends (rank 1 echoes the line)."""
    r = job(["--timeout", "8", "--backward", "--no-check"], 2, fault="1:backward:hang")
    assert r.returncode != 0 and r.elapsed < 8 + 30
    lines = rank_lines(r.stderr)
    assert any(ln.startswith("tpattn: rank 0: failed: CollectiveError: all-reduce (backward: dX) over 2 ranks failed")
               and "rank(s) 1 never joined it" in ln for ln in lines), r.stderr
