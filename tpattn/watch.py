"""A watch on the layer's collectives, so that a rank that stalls ends the job over NCCL as over gloo.

Over gloo a collective blocks the calling thread and raises when the process group's timeout
passes. Over NCCL it does not: the host only queues the collective and later blocks in a CUDA
synchronisation (the timer's, or a copy to the host) while the GPU waits for the missing rank, and
nothing in that wait looks at the clock. So each rank runs a thread beside its work that

  * publishes, on the control-plane store, how many collectives this rank has queued
    ("coll/<rank>"; a stalled rank's count stays behind, so the others can name it);
  * watches the collective in flight: once it has started on the GPU (a CUDA event queued just
    before it has completed) and not ended (the event after it) for longer than the timeout, the
    collective is stuck: the ranks whose count is lower never joined it. The thread prints one
    line naming them and ends the job;
  * reads the line another rank published ("fault") and prints it too, so every surviving rank
    says who stalled, then ends the job.

tpattn/comm.py (the only module that calls a collective) wraps each collective in collective(), and
the layer's graphed() each replay of a captured graph; the
watch itself never calls one. Without start() (the API used without the CLI) everything here is a
no-op.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext

import torch

from .errors import rank_ranges as _ranges
from .commplan import COLLECTIVES

POLL_S = 0.2
HOST_GRACE_S = 5.0  # gloo raises its own timeout first; the watch only backs it up
ACK_WAIT_S = 3.0    # how long the rank that ends the job waits for the others to print their line
NAMES = {**COLLECTIVES, "peersetup": "peer-to-peer setup (mapping the other ranks' memory)",
         "graph": "CUDA graph replay of the layer (its collectives inside)",
         "gradgather": "gathering the gradients (full_grads)"}


class _Watch:
    def __init__(self, proc, timeout: float, say):
        self.proc, self.timeout, self.say = proc, timeout, say
        self.count = 0                 # collectives this rank has queued
        self.pending: list[list] = []  # [number, name, world, before, after, host_start, cuda]
        self.spare: list[tuple] = []   # (before, after) event pairs of finished collectives, for reuse
        self.lock = threading.Lock()
        self.ending = threading.Event()
        self.stopped = threading.Event()
        # the thread queries CUDA events of this rank's GPU: it must use that device (a thread
        # starts on device 0, and a query there would open a second context on GPU 0)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        self.thread = threading.Thread(target=self._run, name="tpattn-watch", daemon=True)

    # ---- the main thread's side ---------------------------------------------------------------

    @contextmanager
    def collective(self, name: str, world: int, cuda: bool):
        """cuda: the collective is queued on the GPU (NCCL) and watched through CUDA events; else
        it blocks this thread (gloo) and is watched by the host clock."""
        # on the host path of every collective (python -m tpattn's eager calls): one look-up of the
        # stream, and an event pair the thread has finished with when there is one. The CUDA calls
        # stay outside the lock: a record can wait on a full launch queue, which is when the thread
        # must still be able to take the lock and end a stuck job
        before = after = stream = pair = None
        with self.lock:
            self.count += 1
            number = self.count
            if cuda and self.spare:
                pair = self.spare.pop()
        if cuda:
            stream = torch.cuda.current_stream()
            before, after = pair or (torch.cuda.Event(), torch.cuda.Event())
            before.record(stream)
        entry = [number, name, world, before, None, time.monotonic(), cuda]
        with self.lock:
            self.pending.append(entry)
        try:
            yield
        finally:
            if cuda:
                after.record(stream)
                entry[4] = after  # from now on the thread may find it done (and recycle the pair)
            else:
                with self.lock:
                    self.pending.remove(entry)

    # ---- the thread ---------------------------------------------------------------------------

    def claim(self) -> bool:
        """True for the first caller only (thread or main): that one says why the job ends."""
        with self.lock:
            if self.ending.is_set():
                return False
            self.ending.set()
            return True

    def _run(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        store, rank = self.proc.store, self.proc.rank
        published = -1
        started: dict[int, float] = {}
        while not self.stopped.is_set():
            try:
                if self.count != published:
                    published = self.count
                    store.set(f"coll/{rank}", str(published))
                if store.check(["fault"]):
                    self._echo(store.get("fault").decode())
                    return
                now = time.monotonic()
                with self.lock:
                    entries = list(self.pending)
                for e in entries:
                    number, name, world, before, after, host_start, cuda = e
                    if cuda:
                        if after is not None and after.query():
                            with self.lock:
                                if e in self.pending:
                                    self.pending.remove(e)
                                    self.spare.append((before, after))  # not looked at here again
                            started.pop(number, None)
                            continue
                        if not before.query():
                            continue  # still queued behind this rank's own work
                        t0 = started.setdefault(number, now)
                        limit = self.timeout
                    else:
                        t0, limit = host_start, self.timeout + HOST_GRACE_S
                    if now - t0 > limit:
                        self.end_job(stuck_message(self.proc, number, name, world, now - t0, self.timeout))
                        return
            except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
                if self.stopped.is_set() or self.ending.is_set():
                    return
            self.stopped.wait(POLL_S)

    def _echo(self, message: str) -> None:
        """Another rank decided the job is stuck: say so here too, and end."""
        if not self.claim():
            return
        self.say(f"ending the job: {message}")
        try:
            self.proc.store.set(f"fault_seen/{self.proc.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        time.sleep(ACK_WAIT_S)  # the rank that published it ends the job; if it is gone, end here
        self.proc.abort(1)

    def end_job(self, message: str, code: int = 1, say: bool = True, claimed: bool = False) -> None:
        """Print the line, publish it for the other ranks, give them a moment to print theirs,
        then end the whole job."""
        if not claimed and not self.claim():
            return
        if say:
            self.say(f"failed: {message}; ending the job")
        store = self.proc.store
        try:
            store.set("fault", f"rank {self.proc.rank} reports {message}")
            others = [f"fault_seen/{r}" for r in range(self.proc.world) if r != self.proc.rank]
            deadline = time.monotonic() + ACK_WAIT_S
            while others and time.monotonic() < deadline and not store.check(others):
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - no store: just end
            pass
        self.proc.abort(code)


def stuck_message(proc, number: int, name: str, world: int, waited: float, timeout: float) -> str:
    what = f"{NAMES.get(name, name)} #{number} over {world} ranks"
    behind = laggards(proc, number)
    if behind:
        who = f"rank(s) {_ranges(behind)} never joined it (stalled before it, or skipped it)"
    else:
        who = "every rank joined it, so the collective itself hangs (the network or NCCL: try NCCL_DEBUG=WARN)"
    return f"CollectiveError: {what} did not complete within {waited:.0f} s (--timeout {timeout:g}): {who}"


def laggards(proc, number: int) -> list[int]:
    """Ranks whose published count of queued collectives is below `number`."""
    out = []
    for r in range(proc.world):
        if r == proc.rank:
            continue
        try:
            n = int(proc.store.get(f"coll/{r}")) if proc.store.check([f"coll/{r}"]) else 0
        except Exception:  # noqa: BLE001
            continue
        if n < number:
            out.append(r)
    return out


_watch: _Watch | None = None


def start(proc, timeout: float, say) -> None:
    """Watch this rank's collectives (after the process group exists). say(msg) prints a line."""
    global _watch
    if not proc.distributed or os.environ.get("TPATTN_NO_WATCH"):
        return
    _watch = _Watch(proc, timeout, say)
    _watch.thread.start()


def stop() -> None:
    global _watch
    if _watch is not None:
        _watch.stopped.set()
        _watch.thread.join(timeout=2 * POLL_S + 1)
        _watch = None


def collective(name: str, world: int, cuda: bool):
    """Wrap one collective (the layer calls this; cuda: queued on the GPU, i.e. NCCL); a no-op
    unless start() ran, and while a CUDA graph is being captured."""
    if _watch is None or _watch.ending.is_set() or (cuda and torch.cuda.is_current_stream_capturing()):
        return nullcontext()
    return _watch.collective(name, world, cuda)


def explain(name: str, world: int, error: str) -> str:
    """The line for a collective that raised (gloo's timeout, a peer that closed the connection)."""
    what = f"{NAMES.get(name, name)} over {world} ranks failed ({error})"
    if "invalid usage" in error or "invalid argument" in error:  # NCCL refused the call itself: no peer is to blame
        return (f"{what}: NCCL refused the call on this rank; check NCCL_* settings in the environment "
                "(NCCL_ALGO, NCCL_PROTO) and rerun with NCCL_DEBUG=WARN for its reason")
    if _watch is None:
        return f"{what}: a rank died, hangs or never joined it"
    gone = _watch.proc.dead_peers()
    if gone:
        return f"{what}: {gone}"
    with _watch.lock:
        number = _watch.count
    behind = laggards(_watch.proc, number)
    if behind:
        return f"{what}: rank(s) {_ranges(behind)} never joined it (#{number}: stalled before it, or skipped it)"
    return f"{what}: a rank died, hangs or never joined it"


def blame(missing: list[int]) -> str | None:
    """While waiting on the store for ranks `missing`: if they wait in a collective this rank never
    joined, say so (the rank that skipped or stalled is this one, not them)."""
    if _watch is None:
        return None
    proc = _watch.proc
    try:
        if proc.store.check(["fault"]):
            return proc.store.get("fault").decode()
        ahead = [r for r in missing if proc.store.check([f"coll/{r}"]) and int(proc.store.get(f"coll/{r}")) > _watch.count]
    except Exception:  # noqa: BLE001
        return None
    if ahead:
        return (f"rank(s) {_ranges(ahead)} wait in the layer's collective #{_watch.count + 1}, which rank "
                f"{proc.rank} (this rank) never joined: it skipped or left it")
    return None


def claim() -> bool:
    """The main thread is about to say why the job ends: True if it should (no watch, or the watch
    has not said it yet); False if the watch already says it (then wait_for_end())."""
    return _watch is None or _watch.claim()


def wait_for_end() -> None:
    """The watch is printing another rank's reason and will end the job: let it."""
    time.sleep(ACK_WAIT_S + 2)


def end_job(message: str, code: int) -> bool:
    """After claim(): publish this rank's failure line for the others, give them a moment to print
    it, and end the job (does not return). False when there is no watch."""
    if _watch is None:
        return False
    _watch.end_job(message, code, say=False, claimed=True)
    return True

