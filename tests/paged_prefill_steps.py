"""The packed prefill steps the triton paged prefill's layer tests run (tests/test_gpu_paged.py on the
GPU, tests/test_triton_paged_cpu.py in Triton's interpreter): the same steps on a fresh PagedKV
twice, with paged.triton_prefill_fits as it is and with it answering False (torch math)."""
from __future__ import annotations

import torch


def prefill_steps_both_ways(layer, steps, pages: int, kv_dtype, device: str, monkeypatch):
    """steps: [(sequence indices, rows of each)] over 4 sequences of a PagedKV(pages, page_size=16).
    Returns (the kernel test's answers, {True: rows with the kernel, False: rows in torch math})."""
    import tpattn.paged as paged
    from tpattn.paged import PagedKV
    D = layer.heads * layer.head_dim
    real, calls, outs = paged.triton_prefill_fits, [], {}
    for on in (True, False):
        monkeypatch.setattr(paged, "triton_prefill_fits", (lambda *a: calls.append(real(*a)) or calls[-1]) if on
                            else (lambda *a: False))
        pool = PagedKV(layer, pages=pages, page_size=16, max_seqs=4, kv_dtype=kv_dtype)
        ids = [pool.add() for _ in range(4)]
        gen = torch.Generator().manual_seed(1)
        got = []
        for seqs, rows in steps:
            with pool.step([ids[s] for s in seqs], rows) as st:
                got.append(layer(torch.randn(1, sum(rows), D, generator=gen).half().to(device), cache=st.view(0)))
        outs[on] = got
    monkeypatch.setattr(paged, "triton_prefill_fits", real)
    return calls, outs
