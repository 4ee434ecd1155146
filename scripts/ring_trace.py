"""Read the torch.profiler traces of a context-parallel call and show, per rank and ring step, that
each K/V pass was posted before the compute of the block in hand started, and how long the rank then
waited for it; for a training step's trace (--backward) the backward's passes too, both directions:
the K/V blocks passed on and the dK, dV sums travelling with their block.

    mpirun -n 2 python -m tpattn --context-parallel 2 --kernel fused --causal --profile ring.json
    python scripts/ring_trace.py ring.json ring.json.rank1
    mpirun -n 2 python -m tpattn --context-parallel 2 --kernel fused --causal --backward --profile step.json
    python scripts/ring_trace.py step.json step.json.rank1

The layer names its passes in the trace (record_function): "ring" around each pass's posting
(batch_isend_irecv) and around its wait, "attention" around a step's pieces and merges. A pass
counts as posted before its compute when the posting range ended on the host before the step's
"attention" range began there, i.e. before any of the step's kernels was launched, so the transfer
is in flight under them; on a GPU the line also gives when the step's compute began on the GPU's
timeline (the profiler's gpu_user_annotation). Exit status 1 when a pass was not posted first, 2
for a trace that is not one of a context-parallel call.

The backward's passes ("bwd_ring": the next K/V block; "bwd_ring_grads": the block's dK, dV sums
going on to the next rank) are read the same way against its compute ("attention_bwd"): each of
the K/V passes is posted before the step's compute is launched, each of the sums' passes before the
next step's; the sums' last pass (their hop home) has no compute after it to travel under, and the
line says so with its wait.
"""

from __future__ import annotations

import argparse
import json
import sys


def steps(events: list[dict]) -> list[dict]:
    """[{"post_end", "start", "wait_us"}] of one rank's trace: the ring steps of the call, in order
    (the last step has no pass, so no post and no wait). Times in the trace's microseconds."""
    host = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") in ("ring", "attention")),
                  key=lambda e: e["ts"])
    gpu = sorted((e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name") == "attention"),
                 key=lambda e: e["ts"])
    out, post = [], None
    for e in host:
        if e["name"] == "ring":
            if out and out[-1]["wait_us"] is None and out[-1]["post_end"] is not None and post is None:
                out[-1]["wait_us"] = float(e.get("dur", 0.0))  # the wait after the step's compute
            else:
                post = e
            continue
        i = len(out)
        out.append({"post_end": None if post is None else post["ts"] + post.get("dur", 0.0), "start": e["ts"],
                    "gpu_start": gpu[i]["ts"] if i < len(gpu) else None, "wait_us": None})
        post = None
    return out


def top_level(events: list[dict], names: tuple[str, ...]) -> list[dict]:
    """The host's ranges named in `names`, in time order, without those inside another of them."""
    host = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") in names),
                  key=lambda e: e["ts"])
    def inside(a, b) -> bool:
        return b["ts"] <= a["ts"] and a["ts"] + a.get("dur", 0.0) <= b["ts"] + b.get("dur", 0.0)
    return [e for i, e in enumerate(host) if not any(j != i and inside(e, o) and (o["ts"], -o.get("dur", 0.0)) <
                                                    (e["ts"], -e.get("dur", 0.0)) for j, o in enumerate(host))]


def passes(events: list[dict], name: str, compute: str) -> list[dict]:
    """[{"post_end", "start", "wait_us"}]: each pass named `name` (its posting, then its wait: the
    ranges alternate) and the first `compute` range that began after the posting began (None: no
    compute before the wait, the pass travels alone)."""
    ranges = top_level(events, (name, compute))
    mine = [e for e in ranges if e["name"] == name]
    out = []
    for post, wait in zip(mine[::2], mine[1::2]):
        under = next((e for e in ranges if e["name"] == compute and e["ts"] >= post["ts"]), None)
        if under is not None and under["ts"] > wait["ts"]:
            under = None
        out.append({"post_end": post["ts"] + post.get("dur", 0.0), "start": None if under is None else under["ts"],
                    "wait_us": float(wait.get("dur", 0.0))})
    return out


def check_backward(events: list[dict]) -> tuple[list[str], bool]:
    """The backward's lines: its K/V passes and its sums' passes, each against the compute it
    travels under."""
    lines, ok = [], True
    for name, what in (("bwd_ring", "K/V pass"), ("bwd_ring_grads", "dK, dV sums pass")):
        found = passes(events, name, "attention_bwd")
        lines.append(f"  backward: {len(found)} {what}es")
        for i, st in enumerate(found):
            if st["start"] is None:
                home = name == "bwd_ring_grads" and i == len(found) - 1
                ok &= home
                why = ("(the sums' last hop home)" if home else
                       "(AFTER: not overlapped, no compute between its posting and its wait)")
                lines.append(f"    {what} {i}: no compute after it to travel under {why}; waited {st['wait_us']:.0f} "
                             "us for it on the host")
                continue
            lead = st["start"] - st["post_end"]
            ok &= lead >= 0
            lines.append(f"    {what} {i}: posted {lead:.0f} us before the compute it travels under was launched "
                         f"({'ok' if lead >= 0 else 'AFTER: not overlapped'}); then waited {st['wait_us']:.0f} us "
                         "for it on the host")
    return lines, ok


def check(path: str) -> tuple[list[str], bool]:
    try:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"ring_trace: error: {path}: not a torch.profiler trace ({exc}); write one with "
                         "python -m tpattn --context-parallel C --profile PATH")
    found = steps(events)
    if len(found) < 2 or found[0]["post_end"] is None:
        print(f"ring_trace: error: {path}: no ring passes in this trace; profile a call with --context-parallel C "
              "(C > 1)", file=sys.stderr)
        sys.exit(2)
    lines, ok = [f"{path}: {len(found)} ring steps"], True
    for s, st in enumerate(found):
        if st["post_end"] is None:
            lines.append(f"  step {s}: no pass (the last block)")
            continue
        lead = st["start"] - st["post_end"]
        ok &= lead >= 0
        gpu = "" if st["gpu_start"] is None else \
            f"; the compute started on the GPU {st['gpu_start'] - st['post_end']:.0f} us after the posting"
        wait = "" if st["wait_us"] is None else f"; then waited {st['wait_us']:.0f} us for it on the host"
        lines.append(f"  step {s}: pass posted {lead:.0f} us before the step's compute was launched "
                     f"({'ok' if lead >= 0 else 'AFTER: not overlapped'}){gpu}{wait}")
    if any(e.get("name") == "bwd_ring" for e in events):  # a training step's trace: the backward's passes too
        more, fine = check_backward(events)
        lines += more
        ok &= fine
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ring_trace.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", metavar="TRACE", help="one trace per rank (--profile PATH writes PATH on "
                   "rank 0 and PATH.rankR on the others)")
    a = p.parse_args(argv)
    every = True
    for path in a.traces:
        lines, ok = check(path)
        print("\n".join(lines))
        every &= ok
    print("every pass posted before its step's compute" if every else "SOME PASS POSTED AFTER ITS STEP'S COMPUTE")
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())
