"""The packed prefill steps the triton paged prefill's layer tests run (tests/test_gpu_paged.py on the
GPU, tests/test_triton_paged_cpu.py in Triton's interpreter): the same steps on a fresh PagedKV
twice, with paged.triton_prefill_fits as it is and with it answering False (torch math); and the
prompts in chunks that ChunkGraphs' tests run (tests/test_paged.py, tests/test_gpu_paged.py)."""
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


def prompts_in_chunks(layer, pool, ids, xs, lens, T: int, chunks=None) -> list[list[torch.Tensor]]:
    """Sequence ids[i]'s prompt xs[i][:, :lens[i]] in chunks of T rows, the sequences taking turns: the
    full chunks through chunks.step (a ChunkGraphs) where chunks is given, every other chunk eagerly
    (pool.step and the layer). Returns each sequence's chunks' outputs, in order (call under no_grad)."""
    got = [[] for _ in ids]
    for at in range(0, max(lens), T):
        for i, sid in enumerate(ids):
            n = min(T, lens[i] - at)
            if n <= 0:
                continue
            x = xs[i][:, at:at + n]
            if n == T and chunks is not None:
                got[i].append(chunks.step(sid, x))
            else:
                with pool.step([sid], [n]) as st:
                    got[i].append(layer(x, cache=st.view(0)))
    return got
