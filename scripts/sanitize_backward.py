#!/usr/bin/env python3
"""The fused backward's kernels on small shapes, for compute-sanitizer (memcheck, racecheck):
fp16 and bf16, d = 64 and 128, causal and not, N not a multiple of the tiles, GQA, the default
five-product kernels (both: the warp-specialized hbwd5w_kv and hbwd5_kv, TPATTN_FUSED_BWD5=ws and red)
and deterministic=True's seven-product ones; and the layer's packed training path (attention_packed:
strided q, k, v, o, dO and gradients). Exits non-zero if a gradient is not finite.

    compute-sanitizer --tool racecheck --error-exitcode 9 python scripts/sanitize_backward.py
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn.attention import attention, get_backend  # noqa: E402


def main() -> int:
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
    torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
