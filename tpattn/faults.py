"""Fault injection for the fault tests: off unless TPATTN_DEBUG_INJECT_FAULT is set.

TPATTN_DEBUG_INJECT_FAULT="RANK:STEP:MODE", e.g. "1:forward:raise".
  STEP: start (before the rendezvous), forward (inside the layer, before attention),
        allreduce (in place of the layer's collective), backward (before a collective of the
        layer's backward, tpattn/comm.py)
  MODE: raise (an exception), kill (SIGKILL itself), hang (sleep forever), skip (allreduce and
        backward: leave the collective out, so the other ranks wait for it until --timeout)
The name is long on purpose: nobody sets it by accident. Never set it for a real run.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "TPATTN_DEBUG_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


def planned(rank: int, step: str) -> str | None:
    """The mode planned for this rank and step, or None."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    try:
        r, s, mode = spec.split(":")
        return mode if int(r) == rank and s == step else None
    except ValueError:
        raise InjectedFault(f"{ENV}={spec!r} is malformed; expected RANK:STEP:MODE") from None


def maybe_fail(rank: int, step: str) -> str | None:
    """Act on a planned fault; returns 'skip' for the caller to act on, else None."""
    mode = planned(rank, step)
    if mode is None:
        return None
    if mode == "raise":
        raise InjectedFault(f"injected fault at step {step} ({ENV})")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "skip":
        return "skip"
    raise InjectedFault(f"{ENV}: unknown mode {mode!r}; use raise, kill, hang or skip")
