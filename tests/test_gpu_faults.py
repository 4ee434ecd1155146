"""Faults over NCCL (`pytest -m gpu`, 2+ GPUs): a rank that stalls, skips the collective, raises or
is killed ends the whole job within --timeout + 30 s, rc != 0, with a line on each surviving rank
that names the stalled rank, and no process left. Each job has a hard outer timeout, so a
regression fails here instead of hanging the run."""

import subprocess
import time

import pytest
import torch

from conftest import tpattn

pytestmark = pytest.mark.gpu
TIMEOUT = 15


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL between ranks (this machine has {torch.cuda.device_count()})")


def job(fault, seed):
    t0 = time.monotonic()
    try:
        r = tpattn(["--kernel", "fused", "--seq-len", "2048", "--timeout", str(TIMEOUT), "--seed", str(seed)],
                   ranks=2, timeout=TIMEOUT + 60, TPATTN_DEBUG_INJECT_FAULT=fault)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-9", "-f", f"tpattn.*--seed {seed}"])
        pytest.fail(f"{fault}: the job hung past --timeout {TIMEOUT} + 60 s")
    r.elapsed = time.monotonic() - t0
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-f", f"tpattn.*--seed {seed}"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"
    print(f"{fault}: rc {r.returncode} in {r.elapsed:.1f} s\n{r.stderr}")
    return r


def lines_of(r, rank):
    return [ln.strip() for ln in r.stderr.splitlines() if f"tpattn: rank {rank}:" in ln]


@pytest.mark.parametrize("fault,stalled,seed", [("1:forward:hang", 1, 515001), ("0:forward:hang", 0, 515002),
                                                ("1:allreduce:skip", 1, 515003)])
def test_stalled_rank_ends_the_job_and_is_named(fault, stalled, seed):
    r = job(fault, seed)
    assert r.returncode != 0 and r.elapsed < TIMEOUT + 30
    survivor = 1 - stalled
    said = lines_of(r, survivor)
    assert said, r.stderr
    assert any(f"rank(s) {stalled} never joined it" in ln or f"rank {stalled} (this rank) never joined" in ln
               for ln in said), r.stderr


def test_exception_on_one_rank():
    r = job("1:forward:raise", 515004)
    assert r.returncode != 0 and r.elapsed < TIMEOUT + 30
    assert any("InjectedFault" in ln for ln in lines_of(r, 1)), r.stderr


def test_killed_rank():
    r = job("1:forward:kill", 515005)
    assert r.returncode != 0 and r.elapsed < TIMEOUT + 30
    assert "rank 1" in r.stderr
