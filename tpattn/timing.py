"""Per-pass timers: CUDA events on a GPU, perf_counter on CPU; NVTX ranges around each pass.

A timer is not passed down through the layer and the backends: `with recording(timer): layer(x)`
makes it the current one, and every `with section("qk"):` inside the call times itself on it (and
costs nothing when no timer is recording)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch


class Timer:
    """Time named sections of one iteration; a name timed twice in an iteration is summed."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = torch.device(device)
        self._open: list[tuple[str, object, object]] = []

    @contextmanager
    def section(self, name: str):
        if _profiling():
            with torch.profiler.record_function(name):  # names the pass in --profile traces
                with self._timed(name):
                    yield
        else:  # record_function costs tens of microseconds of host time a call, for nothing unprofiled
            with self._timed(name):
                yield

    @contextmanager
    def _timed(self, name: str):
        if self.cuda:
            torch.cuda.nvtx.range_push(name)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                torch.cuda.nvtx.range_pop()
            self._open.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._open.append((name, t0, time.perf_counter()))

    def collect(self) -> dict[str, float]:
        """Milliseconds per section name since the last collect (waits for the GPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, float] = {}
        for name, a, b in self._open:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            out[name] = out.get(name, 0.0) + ms
        self._open.clear()
        return out


def _profiling() -> bool:
    """Whether a torch.profiler (--profile) is recording now."""
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", True))


_current: ContextVar["Timer | None"] = ContextVar("tpattn_timer", default=None)
# the timer of the innermost recording() on any thread: autograd runs a backward on threads of its
# own, which the context variable does not reach
_shared: list = [None]


@contextmanager
def recording(timer: "Timer | None"):
    """Make `timer` the one that section() times on, for the enclosed calls and for the backward
    passes they start (None: time nothing)."""
    token, prev = _current.set(timer), _shared[0]
    _shared[0] = timer
    try:
        yield timer
    finally:
        _current.reset(token)
        _shared[0] = prev


def section(name: str):
    """The current timer's section(name), or nothing when no timer is recording (nor inside a graph
    that torch.compile traces: its passes are not the eager ones)."""
    if torch.compiler.is_compiling():
        return nullcontext()
    timer = _current.get() or _shared[0]
    return nullcontext() if timer is None else timer.section(name)


def summarize(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def recorded(fn, x, timer: "Timer | None"):
    """fn(x) with `timer` recording its passes."""
    with recording(timer):
        return fn(x)
