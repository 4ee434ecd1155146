"""Read the torch.profiler traces of a context-parallel call and show, per rank and ring step, that
each K/V pass was posted before the compute of the block in hand started, and how long the rank then
waited for it.

    mpirun -n 2 python -m tpattn --context-parallel 2 --kernel fused --causal --profile ring.json
    python scripts/ring_trace.py ring.json ring.json.rank1

The layer names its passes in the trace (record_function): "ring" around each pass's posting
(batch_isend_irecv) and around its wait, "attention" around a step's pieces and merges. A pass
counts as posted before its compute when the posting range ended on the host before the step's
"attention" range began there, i.e. before any of the step's kernels was launched, so the transfer
is in flight under them; on a GPU the line also gives when the step's compute began on the GPU's
timeline (the profiler's gpu_user_annotation). Exit status 1 when a pass was not posted first, 2
for a trace that is not one of a context-parallel call.
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
