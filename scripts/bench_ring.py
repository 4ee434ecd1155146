"""The ring's compute per rank against 1/C of the whole attention, on one GPU, no communication.

    python scripts/bench_ring.py [--seq-len 16384] [--heads 32] [--head-dim 128] [--contexts 2 4 8] [--causal]

For each ring size C and each rank c of it: rank c's query rows (the zigzag layout,
tpattn.attention.ring.context_rows) against every block of K/V in the order the ring brings them,
each step's pieces through the fused kernel and merged into the fp32 output, exactly as the
context-parallel layer computes (tpattn/comm.py's _RingAttention), and the backward's pieces; the
whole attention over all N rows through the same kernels (forward_for_backward and backward). The
ring keeps its promise when every rank's compute is within 1.1x of the whole's / C. CUDA events,
the median of --rounds rounds, the contenders alternating in each round; each contender's
launches captured in a CUDA graph and replayed (the GPU's compute, without the host's gaps
between launches; --eager times the launches as made).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tpattn.attention import get_backend  # noqa: E402
from tpattn.attention.ring import RowsDq, block_sums, context_rows, merge, piece_forward, pieces, step_backward  # noqa: E402


def rank_forward(backend, q, k, v, C, c, causal):
    """Rank c's ring forward: (o fp32, lse), the blocks taken in the ring's order."""
    rows = [context_rows(q.shape[2], C, j).to(q.device) for j in range(C)]
    qc = q[:, :, rows[c]]
    n = qc.shape[2]
    o = torch.zeros(qc.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(qc.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    blocks = [(k[:, :, rows[j]].contiguous(), v[:, :, rows[j]].contiguous()) for j in range(C)]
    qc = qc.contiguous()

    def run():
        o.zero_()
        lse.fill_(float("-inf"))
        for s in range(C):
            j = (c - s) % C
            kb, vb = blocks[j]
            for q0, q1, k0, k1, diag in pieces(c, j, n, causal):
                merge(o[:, :, q0:q1], lse[:, :, q0:q1],
                      *piece_forward(backend, qc[:, :, q0:q1], kb[:, :, k0:k1], vb[:, :, k0:k1], diag))
        return o.to(q.dtype)
    return run, (qc, blocks, o, lse)


def rank_backward(backend, C, c, causal, state, do):
    qc, blocks, o, lse = state
    out = o.to(qc.dtype)

    # the earlier ranks' dK, dV sums of a block, as they arrive with it from step 1 on (their values do
    # not matter here: the step adds this rank's share into them, as the layer does)
    arrived = tuple(torch.zeros(blocks[0][0].shape, dtype=torch.float32, device=qc.device) for _ in range(2))

    def run():  # as the layer's backward: dQ's sum begun, the steps, dQ out
        dq = RowsDq(backend, qc, out, lse, do, causal, False)
        for s in range(C):
            j = (c - s) % C
            kb, vb = blocks[j]
            parts = step_backward(backend, qc, kb, vb, out, lse, do, c, j, causal, False, dq)
            block_sums(parts, kb, None if s == 0 else arrived)
        return dq.result()
    return run


def timed(fn, reps: int = 3) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream): its replay, the GPU's time
    without the host's launches in between."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_ring.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=16384, help="the whole sequence N (default 16384)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, help="K/V heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"], help="default fp16")
    p.add_argument("--contexts", type=int, nargs="+", default=[2, 4, 8], metavar="C",
                   help="ring sizes C to time, every rank of each on this one GPU (default 2 4 8)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the contenders alternating in each (default 5)")
    p.add_argument("--eager", action="store_true", help="time the launches as they are made (host gaps included) "
                   "instead of CUDA graphs' replays (the GPU's compute alone, the default)")
    p.add_argument("--json", metavar="PATH", help="also write the results there as JSON")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ring: error: needs a CUDA GPU (the fused kernels); run it on a GPU machine", file=sys.stderr)
        return 2
    bad = [C for C in a.contexts if C < 2 or a.seq_len % (2 * C)]
    if bad:
        print(f"bench_ring: error: --contexts {bad[0]}: each C must be at least 2 and 2C must divide --seq-len "
              f"{a.seq_len}", file=sys.stderr)
        return 2
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    backend = get_backend("fused")
    B, H, G, N, d = a.batch, a.heads, a.kv_heads or a.heads, a.seq_len, a.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, N, d, device="cuda", dtype=dt, generator=gen)
    k, v = (torch.randn(B, G, N, d, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    do = torch.randn(B, H, N, d, device="cuda", dtype=dt, generator=gen)
    o, lse = backend.forward_for_backward(q, k, v, a.causal)
    whole_f = lambda: backend.forward_for_backward(q, k, v, a.causal)  # noqa: E731
    whole_b = lambda: backend.backward(q, k, v, o, lse, do, a.causal)  # noqa: E731
    contenders = {"whole forward": whole_f, "whole backward": whole_b}
    for C in a.contexts:
        for c in range(C):
            fwd, state = rank_forward(backend, q, k, v, C, c, a.causal)
            fwd()
            rows = context_rows(N, C, c).to(q.device)
            contenders[f"C={C} rank {c} forward"] = fwd
            contenders[f"C={C} rank {c} backward"] = rank_backward(backend, C, c, a.causal, state,
                                                                   do[:, :, rows].contiguous())
    if not a.eager:
        contenders = {k: graphed(fn) for k, fn in contenders.items()}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(a.rounds):
        for name, fn in contenders.items():
            times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{torch.cuda.get_device_name()}: B={B} H={H} G={G} N={N} d={d} {a.dtype}{' causal' if a.causal else ''}; "
          f"ms, median of {a.rounds} rounds, {'eager' if a.eager else 'CUDA graph replays'}")
    print(f"whole attention: forward {med['whole forward']:.3f}, backward {med['whole backward']:.3f}")
    rows_out = []
    for C in a.contexts:
        for way in ("forward", "backward"):
            share = med[f"whole {way}"] / C
            per = [med[f"C={C} rank {c} {way}"] for c in range(C)]
            worst = max(per) / share
            rows_out.append({"C": C, "pass": way, "whole_over_C_ms": share, "rank_ms": per, "worst_ratio": worst})
            print(f"C={C} {way:<8}: whole/C {share:.3f}; ranks {' '.join(f'{t:.3f}' for t in per)}; slowest / "
                  f"(whole/C) = {worst:.3f} {'(within 1.1x)' if worst <= 1.1 else '(ABOVE 1.1x)'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": sys.argv, "gpu": torch.cuda.get_device_name(), "eager": a.eager,
                                            "median_ms": med,
                                            "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
