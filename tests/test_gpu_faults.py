"""Faults over NCCL (`pytest -m gpu`, 2+ GPUs): a rank that stalls, skips the collective, raises or
is killed ends the whole job within --timeout + 30 s, rc != 0, with a line on each surviving rank
that names the stalled rank, and no process left. Each job has a hard outer timeout, so a
regression fails here instead of hanging the run."""

import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import tpattn

pytestmark = pytest.mark.gpu
TIMEOUT = 15


@pytest.fixture
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


@pytest.mark.usefixtures("two_gpus")
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


@pytest.mark.usefixtures("two_gpus")
def test_exception_on_one_rank():
    r = job("1:forward:raise", 515004)
    assert r.returncode != 0 and r.elapsed < TIMEOUT + 30
    assert any("InjectedFault" in ln for ln in lines_of(r, 1)), r.stderr


@pytest.mark.usefixtures("two_gpus")
def test_killed_rank():
    r = job("1:forward:kill", 515005)
    assert r.returncode != 0 and r.elapsed < TIMEOUT + 30
    assert "rank 1" in r.stderr


def _one_gpu_watch(monkeypatch):
    """(proc, ended, said) for a collective watch on one GPU without NCCL: rank 0 of 2 whose peer,
    rank 1, never publishes a count; proc.abort records the exit code instead of exiting."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import torch.distributed as dist

    from tpattn import watch
    monkeypatch.setattr(watch, "ACK_WAIT_S", 0.1)
    ended, said = [], []
    proc = SimpleNamespace(rank=0, world=2, store=dist.HashStore(), distributed=True,
                           abort=ended.append, dead_peers=lambda: "")
    torch.cuda.init()
    return proc, ended, said


def test_watch_reuses_finished_event_pairs_and_still_sees_a_stuck_collective(monkeypatch):
    """The collective watch on one GPU, without NCCL (a spin kernel stands in for the collective):
    once its thread has seen a collective end, the next one reuses that event pair instead of making
    two CUDA events; and a 'collective' that then runs past the timeout on a reused pair still ends
    the job, naming the rank that never joined (rank 1 of 2: it never published a count)."""
    from tpattn import watch
    from tpattn.model import measure
    proc, ended, said = _one_gpu_watch(monkeypatch)
    w = watch._Watch(proc, 1.0, said.append)
    w.thread.start()
    try:
        seen = []
        for i in range(6):
            with w.collective("allreduce", 2, True):
                entry = w.pending[-1]  # [number, name, world, before, after, ...]: after is set on the way out
                torch.cuda._sleep(measure._SLEEP_CYCLES_PER_CALL // 10)  # ~10 us
            seen.append((id(entry[3]), id(entry[4])))
            torch.cuda.synchronize()
            time.sleep(2.5 * watch.POLL_S)  # the thread polls, finds it done, keeps the pair
        assert w.count == 6 and not w.pending
        assert len(set(seen)) == 1, seen   # one pair made, then reused
        assert len(w.spare) == 1
        with w.collective("reducescatter", 2, True):
            torch.cuda._sleep(int(3.0 * measure._SLEEP_CYCLES_PER_MS * 1000))  # ~3 s: past the 1 s timeout
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        w.stopped.set()
        w.thread.join(timeout=5)
        torch.cuda.synchronize()
    assert ended == [1], said
    assert any("reduce-scatter #7 over 2 ranks" in m and "rank(s) 1 never joined it" in m for m in said), said


def test_a_stalled_graph_replay_ends_the_job(monkeypatch):
    """layer.graphed(): each replay is one entry of the collective watch, so a replay that never ends
    (here a 3 s spin captured inside the graph, standing in for a collective whose peer stalled)
    ends the job after the timeout, naming the replay and the rank that never joined (rank 1 of 2:
    it never published a count). One GPU, no NCCL: the watch's fake rank stands in for the peer."""
    from tpattn import watch
    from tpattn.layer import TensorParallelAttention
    from tpattn.model import measure
    from tpattn.weights import head_weights, layer_input
    proc, ended, said = _one_gpu_watch(monkeypatch)
    dev = torch.device("cuda")
    w = head_weights(range(4), 4, 64, seed=0, dtype=torch.float16, device=dev)
    layer = TensorParallelAttention(**w, heads=4, head_dim=64, backend="reference", group=None)
    x = layer_input(1, 256, 256, 0, torch.float16, dev)
    plain = layer.backend.forward

    def stalls_in_the_graph(*a, **kw):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda._sleep(int(3.0 * measure._SLEEP_CYCLES_PER_MS * 1000))  # ~3 s, inside the graph
        return plain(*a, **kw)
    monkeypatch.setattr(layer.backend, "forward", stalls_in_the_graph)
    replay = layer.graphed(x)
    monkeypatch.setattr(watch, "_watch", watch._Watch(proc, 1.0, said.append))
    watch._watch.thread.start()
    try:
        replay()
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch._watch.stopped.set()
        watch._watch.thread.join(timeout=5)
        torch.cuda.synchronize()
    assert ended == [1], said
    assert any("CUDA graph replay of the layer" in s and "rank(s) 1 never joined it" in s for s in said), said
