#!/usr/bin/env python3
"""The decode kernels on small shapes, for compute-sanitizer (memcheck, racecheck): the split at
every head dim it is built for (contiguous and paged with pages of 16 and 24, multi-head and grouped, a length that ends
inside a chunk), the paged append kernel (rows at their own positions and pages), an FP8 pool's
append (dec_append_pg8) and split (_pg8) at every head dim, 16-bit whole-tile pages through _pgs
(tpattn.decode.DEC_KT16), the fused kernel's prefill over rows already
in a cache (its q and o buffers hold only the rows from the last row tile before the cache's end on) at
every head dim it takes here, and over a paged pool through the block table (fused_ws_paged.cu), and a graphed paged step's preparation (pg_prepare, padding rows included). Exits non-zero if an output is not finite.

    compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/sanitize_decode.py
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpattn import decode  # noqa: E402


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        print("sanitize_decode.py: needs a CUDA GPU (none is visible to torch); run it on a GPU machine", file=sys.stderr)
        return 2
    bad = 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for d in sorted(decode.DEC_HEAD_DIMS + decode.DEC_SPLIT_HEAD_DIMS):
            for h, kv in ((4, 4), (8, 2)):
                q = torch.randn(2, h, 1, d, device="cuda", dtype=dtype, generator=g)
                k, v = (torch.randn(2, kv, 300, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
                o = decode.decode_attention(q, k, v, 277)
                ok = bool(torch.isfinite(o).all())
                for page in (16, 24):  # whole tiles of a page (16) and one page per key (24)
                    n = -(-300 // page)
                    pk, pv = (torch.randn(2 * n + 2, kv, page, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
                    table = torch.randperm(2 * n + 2, device="cuda")[:2 * n].to(torch.int32).view(2, n)
                    lens = torch.tensor([5, 290], dtype=torch.int32, device="cuda")
                    op = decode.paged_decode_attention(q[:, :, 0], pk, pv, table, lens, n * page)
                    ok = ok and bool(torch.isfinite(op).all())
                bad += not ok
                print(f"{dtype} d={d} h={h} g={kv} split, contiguous and paged: {'ok' if ok else 'NOT FINITE'}")
            qkv = torch.randn(5, 4 + 2 * 2, d, device="cuda", dtype=dtype, generator=g)
            pk, pv = (torch.zeros(9, 2, 16, d, device="cuda", dtype=dtype) for _ in range(2))
            pos = torch.tensor([0, 15, 16, 100, 127], device="cuda")
            pages = torch.tensor([0, 0, 1, 6, 7], device="cuda")
            cos, sin = decode.rope_tables(torch.arange(128, device="cuda"), d, 10000.0)
            qa = decode.append_paged_kernel(qkv, pk, pv, pos, pages, cos, sin, 4, False)
            ok = bool(torch.isfinite(qa).all())
            bad += not ok
            print(f"{dtype} d={d} paged append: {'ok' if ok else 'NOT FINITE'}")
            if d in decode.FP8_PAGE_HEAD_DIMS:  # an FP8 pool: the append quantizes, the split reads e4m3
                k8, v8 = (torch.zeros(9, 2, 16, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2))
                sc = tuple(torch.zeros(9, 2, 16, device="cuda") for _ in range(2))
                qa = decode.append_paged_kernel(qkv, k8, v8, pos, pages, cos, sin, 4, False, scales=sc)
                table = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32, device="cuda").expand(5, 8).contiguous()
                o8 = decode.paged_decode_attention(qa, k8, v8, table, (pos + 1).to(torch.int32), 128, scales=sc)
                ok = bool(torch.isfinite(qa).all() and torch.isfinite(o8).all() and (sc[0][pages, :, pos % 16] > 0).all())
                bad += not ok
                print(f"{dtype} d={d} FP8 pool append and split: {'ok' if ok else 'NOT FINITE'}")
    decode.DEC_KT16 = True  # 16-bit whole-tile pages through _pgs (the keys as the products' rows), one chunk and many
    for dtype in (torch.float16, torch.bfloat16):
        for d in decode.DEC_HEAD_DIMS:
            q = torch.randn(2, 8, d, device="cuda", dtype=dtype, generator=g)
            pk, pv = (torch.randn(44, 2, 16, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
            table = torch.randperm(44, device="cuda")[:40].to(torch.int32).view(2, 20)
            for lens in ([5, 60], [300, 290]):
                L, longest = torch.tensor(lens, dtype=torch.int32, device="cuda"), 320 if max(lens) > 64 else 64
                name = decode._split_kernel(q, 2, 8, 2, d, longest, page=16)[1]
                o = decode.paged_decode_attention(q, pk, pv, table, L, longest)
                ok = bool(torch.isfinite(o).all())
                bad += not ok
                print(f"{dtype} d={d} _pgs, lengths {lens} {name}: {'ok' if ok else 'NOT FINITE'}")
    decode.DEC_KT16 = False
    from tpattn.attention import get_backend
    from tpattn.attention.fused import HEAD_DIMS, hopper_only
    cc = torch.cuda.get_device_capability()
    for d in [d for d in HEAD_DIMS if not hopper_only(d, cc)]:  # a prefill over rows already in a cache:
        for L0, T in ((0, 40), (200, 77), (256, 300)):      # q and o buffers of rows [L0 // 128 * 128, N) only
            q = torch.randn(2, 4, T, d, device="cuda", dtype=torch.float16, generator=g)
            k, v = (torch.randn(2, 2, L0 + T, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
            o = decode.prefix_attention(get_backend("fused"), q, k, v, L0)
            ok = bool(torch.isfinite(o).all())
            bad += not ok
            print(f"d={d} fused prefill of {T} rows after {L0}: {'ok' if ok else 'NOT FINITE'}")
    from tpattn.attention.fused import PAGED_HEAD_DIMS, paged_fits
    for d in PAGED_HEAD_DIMS:  # the same over a paged pool, K/V read through the block table (pages of 16 and
        for page in (16, 256):  # 256), L0 on the device; keys past the sequence inside its last page
            pk, pv = (torch.randn(40, 2, page, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
            if not paged_fits(pk[0, :, 0], pk):
                continue
            for L0, T in ((0, 40), (200, 77), (256, 300)):
                table = torch.randperm(40, device="cuda")[:-(-(L0 + T) // page)].to(torch.int32)
                start = torch.tensor([L0], dtype=torch.int32, device="cuda")
                rows = torch.randn(T, 4, d, device="cuda", dtype=torch.float16, generator=g)
                o = decode.paged_prefix_attention(get_backend("fused"), rows, pk, pv, table, start, L0)
                ok = bool(torch.isfinite(o).all())
                bad += not ok
                print(f"d={d} paged fused prefill of {T} rows after {L0}, pages of {page}: {'ok' if ok else 'NOT FINITE'}")
    from tpattn import TensorParallelAttention
    from tpattn.paged import PagedKV, _StaticStep
    D = 4 * 128
    layer = TensorParallelAttention(*(torch.zeros(D, D, device="cuda", dtype=torch.float16) for _ in range(4)),
                                    heads=4, head_dim=128, causal=True)
    pool = PagedKV(layer, pages=20, page_size=16, max_seqs=3)
    mirror = torch.randint(0, 20, (4, 6), dtype=torch.int32, device="cuda")
    st = _StaticStep(pool, 8, mirror)
    st.inputs.copy_(torch.tensor([[2, 0, 1, 3, 3, 3, 3, 3], [40, 15, 0, 0, 0, 0, 0, 0],  # slots, lengths,
                                  [-1, -1, 0, -1, -1, -1, -1, -1], [0, 0, 11, 0, 0, 0, 0, 0]]))  # a page taken
    st.prepare()
    torch.cuda.synchronize()
    print(f"pg_prepare: lens {st.lens.tolist()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
