"""The staged tensor-core decode split (_b: K/V tiles by bulk copies through shared memory, compute
capability 9.0+) against the split it replaces (_p, or the plain split below 3 chunks), in one run on
one GPU: tpattn.decode.DEC_STAGED off and on, alternating, three rounds, the best of each; each
call's GPU time alone (bench_paged.graph_us: one call captured in a CUDA graph, replayed back to back).
The staged split also takes its own chunk count where its pairs fit on the SMs
(decode.one_block_an_sm), so "on" is that kernel at that count, against the other at its own.
The contiguous cache, and for reference the paged kernels (which keep their builds: the same kernel
either way), uniform and ragged lengths (0.4 L to 1.6 L). H = 32, d = 128, fp16, pages of 16.

    PYTHONPATH=. python scripts/ab_decode_staged.py
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_paged import graph_us, paged  # noqa: E402

from tpattn import decode  # noqa: E402

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
if not torch.cuda.is_available():
    print("ab_decode_staged.py times the decode kernels on a GPU: none is visible to torch; run it on a GPU machine",
          file=sys.stderr)
    sys.exit(2)
H, d = 32, 128
gen = torch.Generator(device="cuda").manual_seed(0)
print(torch.cuda.get_device_name(), "us per call (graph replays, the best of 3 rounds)", flush=True)
for B, G, L in ((1, 8, 32768), (16, 8, 4096), (64, 8, 4096), (8, 8, 4096), (4, 8, 8192)):
    q = torch.randn(B, H, 1, d, device="cuda").half()
    k = torch.randn(B, G, L, d, device="cuda").half()
    v = torch.randn_like(k)
    pk, pv, table, lens = paged([L] * B, G, d, 16, gen)
    ragged = torch.linspace(0.4 * L, 1.6 * L, B).round().int().tolist() if B > 1 else [L]
    rk, rv, rtable, rlens = paged(ragged, G, d, 16, gen)
    res = {}
    for rnd in range(3):
        for staged in (False, True):
            decode.DEC_STAGED = staged
            for lay, fn in (("contig", lambda: decode.decode_attention(q, k, v, L)),
                            ("paged", lambda: decode.paged_decode_attention(q[:, :, 0], pk, pv, table, lens, L)),
                            ("ragged", lambda: decode.paged_decode_attention(q[:, :, 0], rk, rv, rtable, rlens, max(ragged)))):
                res.setdefault((lay, staged), []).append(graph_us(fn))
    line = f"B={B} G={G} L={L}:"
    for lay in ("contig", "paged", "ragged"):
        a, b = min(res[(lay, False)]), min(res[(lay, True)])
        line += f"  {lay} old {a:.1f} staged {b:.1f} (x{b / a:.3f})"
    print(line, flush=True)
    del q, k, v, pk, pv, rk, rv
