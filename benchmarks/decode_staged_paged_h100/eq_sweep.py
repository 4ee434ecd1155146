"""The staged paged build's (_pgb) target blocks (eq_blocks) and grid spread (EQ_SPREAD), the kernel alone in
graph replays, us, beside the paged build _p_pg ("plain"). PYTHONPATH=. python benchmarks/decode_staged_paged_h100/eq_sweep.py"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import torch
from tpattn import decode
from tpattn.decode import paged_decode_attention
from bench_paged import graph_us, paged

H, d = 32, 128
for B, G, L in ((16, 8, 4096), (8, 8, 4096), (1, 8, 32768), (4, 8, 8192), (32, 4, 4096)):
    gen = torch.Generator(device="cuda").manual_seed(B + G + L)
    q = torch.randn(B, H, d, device="cuda", generator=gen).half()
    for kind, lens in (("one", [L] * B), ("ragged", torch.linspace(0.4 * L, 1.6 * L, B).round().int().tolist() if B > 1 else None)):
        if lens is None:
            continue
        pk, pv, t, n = paged(lens, G, d, 16, gen)
        cap = 16 * t.shape[1]
        row = []
        decode.DEC_STAGED_PAGED = False
        row.append(("plain", graph_us(lambda: paged_decode_attention(q, pk, pv, t, n, cap))))
        decode.DEC_STAGED_PAGED = True
        for want in (132, 198, 264, 396):
            for spread in (4, 8):
                decode.eq_blocks = lambda sms, w=want: w
                decode.EQ_SPREAD = spread
                row.append((f"{want}/{spread}", graph_us(lambda: paged_decode_attention(q, pk, pv, t, n, cap))))
        print(f"B={B} G={G} L={L} {kind}: " + "  ".join(f"{k} {v:.1f}" for k, v in row), flush=True)
