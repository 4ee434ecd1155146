#!/usr/bin/env python3
"""The fused backward's kernels on small shapes, for compute-sanitizer (memcheck, racecheck):
fp16 and bf16, d = 64 and 128, causal and not, N not a multiple of the tiles, GQA, the default
five-product kernels (both: the warp-specialized hbwd5w_kv and hbwd5_kv, TPATTN_FUSED_BWD5=ws and red)
and deterministic=True's seven-product ones; the layer's packed training path (attention_packed:
strided q, k, v, o, dO and gradients); and a ring rank's backward at C = 4 (every kind of piece adding
into the one dQ sum at its rows: ring.RowsDq). Exits non-zero if a gradient is not finite.

    compute-sanitizer --tool racecheck --error-exitcode 9 python scripts/sanitize_backward.py
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn.attention import attention, get_backend  # noqa: E402


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        print("sanitize_backward.py: needs a CUDA GPU (none is visible to torch); run it on a GPU machine", file=sys.stderr)
        return 2
    bad = 0
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for causal in (False, True):
                for det, five in ((False, "ws"), (False, "red"), (True, "")):
                    os.environ["TPATTN_FUSED_BWD5"] = five
                    g = torch.Generator(device="cuda").manual_seed(0)
                    q = torch.randn(1, 4, 200, d, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
                    k, v = (torch.randn(1, 2, 200, d, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
                            for _ in range(2))
                    o = attention(q, k, v, causal, backend="fused", deterministic=det)
                    o.backward(torch.randn_like(o))
                    ok = all(torch.isfinite(t.grad).all().item() for t in (q, k, v))
                    bad += not ok
                    print(f"{dtype} d={d} causal={causal} deterministic={det} {five}: {'ok' if ok else 'NOT FINITE'}")
                # the layer's training path: q, k, v read in place from one packed tensor, o in rows of
                # every head, dq, dk, dv written into one gradient (strided, hbwd5w_kv)
                os.environ["TPATTN_FUSED_BWD5"] = ""
                qkv = torch.randn(1, 200, 8, d, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
                o = get_backend("fused").attention_packed(qkv, 4, 2, causal)
                o.backward(torch.randn_like(o))
                ok = bool(torch.isfinite(qkv.grad).all().item())
                bad += not ok
                print(f"{dtype} d={d} causal={causal} packed: {'ok' if ok else 'NOT FINITE'}")
    bad += ring_ranks()
    torch.cuda.synchronize()
    return 1 if bad else 0


def ring_ranks() -> int:
    """Every rank of a causal ring of 4 (rank rows 256: the kernels' dQ sum) and of a full one, one
    process: the pieces' backward into each rank's dQ sum, d = 64 and 128, the pieces through
    hbwd5w_kv (their operands are strided views: the default) and through hbwd5_kv."""
    from tpattn.attention.ring import RowsDq, block_sums, context_rows, merge, piece_forward, pieces, step_backward
    be = get_backend("fused")
    bad, C, n = 0, 4, 256
    for d, causal, five in ((64, True, ""), (128, True, ""), (64, False, ""), (64, True, "red"), (128, True, "red")):
        os.environ["TPATTN_FUSED_BWD5"] = five
        g = torch.Generator(device="cuda").manual_seed(d)
        q, do = (torch.randn(1, 4, C * n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
        k, v = (torch.randn(1, 2, C * n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
        rows = [context_rows(C * n, C, r).to("cuda") for r in range(C)]
        blocks = [(k[:, :, r].contiguous(), v[:, :, r].contiguous()) for r in rows]
        for c in range(C):
            qc, doc = q[:, :, rows[c]].contiguous(), do[:, :, rows[c]].contiguous()
            o = torch.zeros(1, 4, n, d, device="cuda")
            lse = torch.full((1, 4, n), float("-inf"), device="cuda")
            for j in range(C):
                for q0, q1, k0, k1, diag in pieces(c, j, n, causal):
                    merge(o[:, :, q0:q1], lse[:, :, q0:q1], *piece_forward(
                        be, qc[:, :, q0:q1], blocks[j][0][:, :, k0:k1], blocks[j][1][:, :, k0:k1], diag))
            out = o.half()
            acc = RowsDq(be, qc, out, lse, doc, causal, False)
            grads = [block_sums(step_backward(be, qc, *blocks[j], out, lse, doc, c, j, causal, False, acc),
                                blocks[j][0]) for j in range(C)]
            dq = acc.result()
            ok = acc.sums is not None and bool(torch.isfinite(dq).all().item()) and all(
                torch.isfinite(t).all().item() for pair in grads for t in pair)
            bad += not ok
            print(f"ring C={C} rank {c} d={d} causal={causal} {five or 'ws'} (dQ summed by the kernels): "
                  f"{'ok' if ok else 'NOT FINITE or not summed'}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
