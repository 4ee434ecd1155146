"""The Triton paged prefill (tpattn/attention/triton_paged.py) in Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1 for the whole run, triton installed, numpy < 2.4, as
tests/test_triton_cpu.py): ragged sequences of a step, rows continuing earlier positions (a chunk)
beside new prompts, pages shuffled and partly filled, GQA, padded head dims, against float64 torch
math over the same keys; and the layer's paged steps through it against the same steps in torch
math. tests/test_gpu_paged.py runs the same on the GPU."""

from __future__ import annotations

import pytest
import torch

from test_triton_cpu import _patch_interpreter_bf16_dot, _patch_interpreter_fp8_casts, interp


def pool_of(lens, g, page, d, dtype, gen):
    """K, V pools with each sequence's lens[i] positions in shuffled pages; (k_pool, v_pool, table)."""
    counts = [-(-n // page) for n in lens]
    total = sum(counts) + 2
    kp, vp = (torch.randn(total, g, page, d, generator=gen).to(dtype) for _ in range(2))
    order = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lens), max(counts) + 1, dtype=torch.int32)
    at = 0
    for i, c in enumerate(counts):
        table[i, :c] = order[at:at + c].to(torch.int32)
        at += c
    return kp, vp, table


def reference(q, kp, vp, table, rows, starts):
    """float64 torch math: each sequence's rows over its own first start + rows positions, causal."""
    page, g = kp.shape[2], kp.shape[1]
    h, d = q.shape[1], q.shape[2]
    out, r0 = [], 0
    for i, (T, L0) in enumerate(zip(rows, starts)):
        n = L0 + T
        idx = table[i, :-(-n // page)].long()
        k = kp[idx].permute(1, 0, 2, 3).reshape(g, -1, d)[:, :n].double()
        v = vp[idx].permute(1, 0, 2, 3).reshape(g, -1, d)[:, :n].double()
        qs = q[r0:r0 + T].transpose(0, 1).double()  # [h, T, d]
        k, v = (t.repeat_interleave(h // g, 0) for t in (k, v))
        s = qs @ k.transpose(1, 2) / d ** 0.5
        mask = torch.arange(n)[None, :] > (L0 + torch.arange(T))[:, None]
        p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        out.append((p @ v).transpose(0, 1))
        r0 += T
    return torch.cat(out)


@interp
@pytest.mark.parametrize("d,g", [(64, 2), (128, 4), (40, 1), (96, 2), (160, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_prefill_matches_float64(d, g, dtype):
    """Every tile width's default config (160: the 256 one), GQA, fp16 and bf16, against float64."""
    _patch_interpreter_bf16_dot()
    from tpattn.attention.triton_paged import paged_prefill
    gen = torch.Generator().manual_seed(d + g)
    h, page = 4, 16
    rows, starts = [37, 1, 130, 5], [0, 70, 140, 0]  # a prompt, a decode row, a chunk past a row tile, a short prompt
    kp, vp, table = pool_of([T + L0 for T, L0 in zip(rows, starts)], g, page, d, dtype, gen)
    q = torch.randn(sum(rows), h, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    o = paged_prefill(q, kp, vp, table, cu, torch.tensor(starts, dtype=torch.int32), max(rows))
    want = reference(q, kp, vp, table, rows, starts)
    assert o.shape == q.shape and o.dtype == dtype and torch.isfinite(o).all()
    err = (o.double() - want).abs().max().item()
    tol = (4e-3 if dtype == torch.float16 else 3e-2) * max(1.0, want.abs().max().item())  # the GPU tests' bounds
    assert err <= tol, (err, tol)


@interp
@pytest.mark.parametrize("d,g,page", [(64, 2, 16), (128, 4, 1), (96, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_prefill_reads_fp8_pages(d, g, page, dtype):
    """An FP8 pool's pages (e4m3, a scale a row): the prefill against float64 over the dequantized
    pages, with the 16-bit pages' bound; scales that differ between rows by 2^10 change nothing."""
    _patch_interpreter_bf16_dot()
    _patch_interpreter_fp8_casts()
    from tpattn.attention import fp8
    from tpattn.attention.triton_paged import paged_prefill
    gen = torch.Generator().manual_seed(d + page)
    h = 4
    rows, starts = [37, 1, 130, 5], [0, 70, 140, 0]
    kp, vp, table = pool_of([T + L0 for T, L0 in zip(rows, starts)], g, page, d, torch.float32, gen)
    kp = kp * 2.0 ** torch.randint(-5, 6, kp.shape[:3] + (1,), generator=gen)  # rows of very different sizes
    (k8, ks), (v8, vs) = fp8.quantize_rows(kp), fp8.quantize_rows(vp)
    k8, v8, ks, vs = k8.to(torch.float8_e4m3fn), v8.to(torch.float8_e4m3fn), ks.squeeze(-1), vs.squeeze(-1)
    q = (torch.randn(sum(rows), h, d, generator=gen) * 0.1).to(dtype)
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    o = paged_prefill(q, k8, v8, table, cu, torch.tensor(starts, dtype=torch.int32), max(rows), scales=(ks, vs))
    want = reference(q, fp8.dequantize(k8, ks), fp8.dequantize(v8, vs), table, rows, starts)
    assert o.dtype == dtype and torch.isfinite(o).all()
    err = (o.double() - want).abs().max().item()
    tol = (4e-3 if dtype == torch.float16 else 3e-2) * max(1.0, want.abs().max().item())
    assert err <= tol, (err, tol)
    plain = paged_prefill(q, k8, v8, table, cu, torch.tensor(starts, dtype=torch.int32), max(rows),
                          scales=(torch.ones_like(ks), torch.ones_like(vs)))
    assert (plain.double() - want).abs().max().item() > 10 * tol  # the scales are read


@interp
def test_paged_prefill_takes_every_tile_config_and_page_size():
    from tpattn.attention.triton_paged import paged_prefill
    gen = torch.Generator().manual_seed(5)
    h, g, d = 2, 1, 64
    rows, starts = [70, 33], [50, 0]
    for page in (1, 4, 64):
        kp, vp, table = pool_of([T + L0 for T, L0 in zip(rows, starts)], g, page, d, torch.float16, gen)
        q = torch.randn(sum(rows), h, d, generator=gen).half()
        cu = torch.tensor([0, rows[0], sum(rows)], dtype=torch.int32)
        want = reference(q, kp, vp, table, rows, starts)
        for config in ((128, 64, 8, 3), (64, 32, 4, 2), (16, 16, 4, 1)):
            o = paged_prefill(q, kp, vp, table, cu, torch.tensor(starts, dtype=torch.int32), max(rows), tiles=config)
            assert (o.double() - want).abs().max().item() < 4e-3, (page, config)


def small_triton_layer():
    """A causal layer with the triton backend, 4 heads over 2 K/V heads of 64, rotary positions,
    weights from torch's global generator."""
    from tpattn import TensorParallelAttention
    H, G, d = 4, 2, 64
    D = H * d
    w = {k: (torch.randn(*s) * 0.05).half() for k, s in
         (("wq", (D, D)), ("wk", (D, G * d)), ("wv", (D, G * d)), ("wo", (D, D)))}
    return TensorParallelAttention(**w, heads=H, kv_heads=G, head_dim=d, causal=True, backend="triton",
                                   rope_theta=10000.0, group=None)


@interp
@torch.no_grad()
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_layer_paged_steps_through_the_triton_prefill(monkeypatch, kv_dtype):
    """A layer with the triton backend on a paged cache (16-bit pages, and an FP8 pool): ragged
    prompts in one step, chunks that continue two of them beside a new prompt and a decode row, each
    prefill step one launch of the paged prefill; the same steps with it turned off (torch math over
    gathered K/V) give the same rows."""
    from paged_prefill_steps import prefill_steps_both_ways
    torch.manual_seed(0)
    layer = small_triton_layer()
    steps = [((0, 1, 2), (37, 5, 20)), ((0, 2, 3), (40, 17, 9)), ((1, 3), (1, 30))]
    calls, outs = prefill_steps_both_ways(layer, steps, 64, kv_dtype, "cpu", monkeypatch)
    assert calls == [True] * len(steps)
    for a, b in zip(outs[True], outs[False]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-3


@interp
@torch.no_grad()
def test_contiguous_cache_chunks_through_the_paged_prefill(monkeypatch):
    """A contiguous KV cache's chunked prefill with the triton backend (rows after earlier ones: the
    paged prefill's kernel, the cache seen as one page per sequence): two sequences, a prompt then two
    chunks and a decode row, against the same steps in torch math and against the whole forward."""
    import tpattn.decode as dec
    B, D = 2, 4 * 64
    torch.manual_seed(2)
    layer = small_triton_layer()
    x = torch.randn(B, 80, D).half()
    cuts = [(0, 30), (30, 47), (47, 79), (79, 80)]
    ran, real = [], dec._triton_prefix_fits
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(dec, "_triton_prefix_fits", (lambda *a: ran.append(real(*a)) or ran[-1]) if on
                            else (lambda *a: False))
        cache = layer.new_cache(B, 96)
        outs[on] = torch.cat([layer(x[:, a:b], cache=cache) for a, b in cuts], 1)
    assert ran == [True, True]  # the two chunks after the prompt (the prompt: the backend's forward)
    assert (outs[True].float() - outs[False].float()).abs().max().item() <= 2e-3
    assert (outs[True].float() - layer(x).float()).abs().max().item() <= 4e-3


@interp
def test_paged_prefill_keeps_small_fp8_values_out_of_fp16_subnormals():
    """V rows of size 1e-4 (scales near 2e-7), every 16th row zeros: p times the V scale is normalized
    by the tile's largest before the fp16 PV product, so the output keeps the 16-bit pages' relative
    bound (without it, about 10 % off; with a zero row's scale 1 as the tile's largest, as before)."""
    _patch_interpreter_fp8_casts()
    from tpattn.attention import fp8
    from tpattn.attention.triton_paged import paged_prefill
    gen = torch.Generator().manual_seed(3)
    rows, starts = [37, 130], [0, 40]
    kp, vp, table = pool_of([T + L0 for T, L0 in zip(rows, starts)], 2, 16, 64, torch.float32, gen)
    vp = vp * 1e-4
    vp[:, :, ::16] = 0  # a zero V row in every tile
    (k8, ks), (v8, vs) = fp8.quantize_rows(kp), fp8.quantize_rows(vp)
    k8, v8, ks, vs = k8.to(torch.float8_e4m3fn), v8.to(torch.float8_e4m3fn), ks.squeeze(-1), vs.squeeze(-1)
    q = (torch.randn(sum(rows), 4, 64, generator=gen) * 0.1).half()
    cu = torch.tensor([0, rows[0], sum(rows)], dtype=torch.int32)
    o = paged_prefill(q, k8, v8, table, cu, torch.tensor(starts, dtype=torch.int32), max(rows), scales=(ks, vs))
    want = reference(q, fp8.dequantize(k8, ks), fp8.dequantize(v8, vs), table, rows, starts)
    assert (o.double() - want).abs().max().item() <= 4e-3 * want.abs().max().item()
