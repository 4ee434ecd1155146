"""Faults and bad input under a real mpirun (gloo, CPU): one line naming the rank and the cause,
a non-zero exit well within 60 s, and no process of the job left behind."""

import itertools
import subprocess
import time

import pytest
import torch

from conftest import rank_lines as conftest_rank_lines, tpattn

pytestmark = pytest.mark.mpi
_seeds = itertools.count(424200)


def job(args, ranks, fault=None, timeout=90):
    """Run a job whose processes carry a unique --seed, so leftovers can be found."""
    seed = next(_seeds)
    extra = {"TPATTN_DEBUG_INJECT_FAULT": fault} if fault else {}
    t0 = time.monotonic()
    r = tpattn(["--seq-len", "64", "--heads", "12", "--head-dim", "16", "--device", "cpu", "--seed", str(seed),
                *args], ranks=ranks, timeout=timeout, **extra)
    r.elapsed = time.monotonic() - t0
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-f", f"tpattn.*--seed {seed}"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"
    return r


def rank_lines(r):
    """The ranks' `tpattn: rank N: ...` lines, wherever the launcher's interleaving put them."""
    return conftest_rank_lines(r.stderr)


def test_exception_on_one_rank_mid_run():
    r = job([], 3, fault="2:forward:raise")
    assert r.returncode != 0 and r.elapsed < 60
    assert "tpattn: rank 2: failed: InjectedFault: injected fault at step forward" in r.stderr


def test_rank_killed_by_a_signal():
    r = job([], 3, fault="1:forward:kill")
    assert r.returncode != 0 and r.elapsed < 60
    # whichever sees it first names rank 1: a survivor ("rank(s) 1 on HOST exited") or OpenMPI
    # ("process rank 1 ... exited on signal 9")
    assert "rank(s) 1 on" in r.stderr or ("rank 1" in r.stderr and "signal 9" in r.stderr), r.stderr


def test_rank_that_never_starts():
    r = job(["--timeout", "8"], 3, fault="1:start:hang")
    assert r.returncode != 0 and r.elapsed < 60
    assert "the MPI rendezvous did not complete within 8 s" in r.stderr


def test_collective_that_times_out():
    """Rank 1 leaves the all-reduce out: rank 0 waits in it until --timeout, and the line names
    rank 1 (the rank that never joined), not rank 0 (the one waiting); the others say it too."""
    r = job(["--timeout", "8"], 3, fault="1:allreduce:skip")
    assert r.returncode != 0 and r.elapsed < 60
    lines = rank_lines(r)
    assert_names_the_skipper(lines, "all-reduce over 3 ranks", waiting=(0, 2), r=r)


def assert_names_the_skipper(lines, collective, waiting, r):
    """Rank 1 skipped the collective. Whoever speaks first names it: a waiting rank's collective
    fails and it says rank 1 never joined (the others echo it), or rank 1 itself, already at the
    result exchange, sees the others still in the collective and says it never joined it (the
    others echo that). Either way every waiting rank's line names rank 1 and none blames rank 0."""
    waiter_first = any(ln.startswith(f"tpattn: rank {waiting[0]}: failed: CollectiveError: {collective} failed")
                       and "rank(s) 1 never joined it" in ln for ln in lines)
    skipper_first = any(ln.startswith("tpattn: rank 1: error:") and "which rank 1 (this rank) never joined" in ln
                        for ln in lines)
    assert waiter_first or skipper_first, r.stderr
    for w in waiting:
        assert any(ln.startswith(f"tpattn: rank {w}:") and ("rank(s) 1 never joined it" in ln or
                   "which rank 1 (this rank) never joined" in ln) for ln in lines), r.stderr
    assert not any("rank(s) 0 did not reach" in ln or "rank(s) 0 never joined" in ln for ln in lines), r.stderr


def test_split_output_collective_that_times_out():
    """The same with the partials reduce-scattered (64 rows over 2 ranks): rank 1 leaves both of
    its collectives out, rank 0 waits in the reduce-scatter and names rank 1."""
    r = job(["--timeout", "8"], 2, fault="1:allreduce:skip")
    assert r.returncode != 0 and r.elapsed < 60
    assert_names_the_skipper(rank_lines(r), "reduce-scatter over 2 ranks", waiting=(0,), r=r)


@pytest.mark.parametrize("fault,stalled", [("1:forward:hang", 1), ("0:forward:hang", 0)])
def test_rank_that_stalls_before_the_collective(fault, stalled):
    """A rank that hangs before the all-reduce: every other rank names it, the job ends."""
    r = job(["--timeout", "6"], 3, fault=fault)
    assert r.returncode != 0 and r.elapsed < 6 + 30
    lines = rank_lines(r)
    for rank in {0, 1, 2} - {stalled}:
        assert any(ln.startswith(f"tpattn: rank {rank}:") and f"rank(s) {stalled} never joined it" in ln
                   for ln in lines), r.stderr


def test_nan_in_loaded_weight_refused_on_every_rank(tmp_path):
    D = 12 * 16
    w = {k: torch.randn(D, D) / 8 for k in ("wq", "wk", "wv", "wo")}
    w["wv"][5, 6] = float("inf")
    torch.save(w, tmp_path / "w.pt")
    r = job(["--load", str(tmp_path / "w.pt")], 2)
    assert r.returncode == 2
    lines = rank_lines(r)
    assert len(lines) == 2 and all("wv has 1 NaN/Inf value(s)" in ln for ln in lines)


def test_loaded_input_beyond_fp16_range(tmp_path):
    D = 12 * 16
    w = {k: torch.randn(D, D) / 8 for k in ("wq", "wk", "wv", "wo")}
    w["x"] = torch.full((1, 64, D), 1e6)
    torch.save(w, tmp_path / "w.pt")
    r = job(["--load", str(tmp_path / "w.pt")], 2)
    assert r.returncode == 2 and "x has 12288 value(s) beyond the range of torch.float16" in r.stderr


def test_unwritable_json_checked_before_the_run(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    r = job(["--json", str(ro / "r.json")], 2)
    if r.returncode == 0:  # root can write anywhere: fall back to a path whose folder is missing
        r = job(["--json", str(tmp_path / "missing" / "r.json")], 2)
    assert r.returncode == 2 and r.elapsed < 60
    assert len(rank_lines(r)) == 2 and "--json" in r.stderr
    assert "per pass" not in r.stdout  # refused before running


def test_nccl_usage_error_blames_no_peer():
    """NCCL refusing a call (seen with NCCL_ALGO=Tree on a reduce-scatter) is this rank's settings,
    not a peer that never joined: the line says so and names the fix."""
    from tpattn import watch
    line = watch.explain("reducescatter", 2, "NCCL error in: ProcessGroupNCCL.cpp:3780, invalid usage (run with "
                         "NCCL_DEBUG=WARN for details), NCCL version 2.28.9")
    assert line.startswith("reduce-scatter over 2 ranks failed (NCCL error")
    assert "NCCL refused the call on this rank" in line and "NCCL_ALGO" in line and "never joined" not in line
