"""The split-K decode kernel (kernels/decode_attention.cu) on the GPU against float64, and the layer's
decode path on the GPU against its full recompute."""

from __future__ import annotations

import math

import pytest
import torch

from tpattn.decode import decode_attention

pytestmark = pytest.mark.gpu


def float64(q, k, v, length):
    g = q.shape[1] // k.shape[1]
    kk, vv = (t[:, :, :length].double().repeat_interleave(g, dim=1) for t in (k, v))
    p = torch.softmax(q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    return p @ vv


@pytest.fixture(params=["mma", "cores"])
def split_kernel(request, monkeypatch):
    """Both splits of kernels/decode_attention.cu: tensor cores (the default) and CUDA cores."""
    import tpattn.decode as dec
    monkeypatch.setattr(dec, "SPLIT_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,h,g", [(1, 32, 32), (3, 32, 8), (2, 8, 1), (2, 40, 2), (1, 16, 1), (2, 64, 1)])
@pytest.mark.parametrize("length", [1, 17, 1000, 4097])
def test_decode_kernel_against_float64(b, h, g, length, d, dtype, split_kernel):
    gen = torch.Generator(device="cuda").manual_seed(length + h)
    q = torch.randn(b, h, 1, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, g, length + 5, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    got = decode_attention(q, k, v, length)
    want = float64(q, k, v, length)
    err = (got.double() - want).abs().max().item()
    tol = (4e-3 if dtype == torch.float16 else 3e-2) * max(1.0, want.abs().max().item())
    assert torch.isfinite(got).all() and err <= tol, (err, tol)


@pytest.mark.parametrize("split,b,h,g,length", [("mma", 64, 32, 8, 300), ("cores", 160, 32, 32, 300),
                                                 ("mma", 2, 32, 8, 40), ("cores", 2, 32, 8, 40),
                                                 ("mma", 3, 8, 8, 64), ("cores", 3, 8, 8, 64)])
def test_one_chunk_writes_the_output_and_takes_no_ticket(split, b, h, g, length, monkeypatch):
    """Where the split is one chunk (a large batch, a short cache), each block writes its rows as the
    output (no partials, no ticket, no combine): the rows against float64, and counters that hold
    something else (a ticket taken would change them, and no block would combine) unchanged."""
    import tpattn.decode as dec
    monkeypatch.setattr(dec, "SPLIT_KERNEL", split)
    gen = torch.Generator(device="cuda").manual_seed(b + length)
    q = torch.randn(b, h, 1, 128, device="cuda", generator=gen).half()
    k, v = (torch.randn(b, g, length + 3, 128, device="cuda", generator=gen).half() for _ in range(2))
    assert dec._split_kernel(q, b, h, g, 128, length)[2] == 1
    tickets = torch.full((b * g,), 7, dtype=torch.int32, device="cuda")
    tickets_before = tickets.clone()
    got = decode_attention(q, k, v, length, tickets=tickets)
    want = float64(q, k, v, length)
    assert (got.double() - want).abs().max().item() <= 4e-3 * max(1.0, want.abs().max().item())
    assert torch.equal(tickets, tickets_before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 80, 96, 160, 192, 256])
@pytest.mark.parametrize("b,h,g", [(1, 16, 16), (3, 16, 4), (2, 8, 1), (2, 40, 2)])
@pytest.mark.parametrize("length", [1, 17, 1000, 4097])
def test_decode_kernel_at_other_head_dims(b, h, g, length, d, dtype):
    """The CUDA-core split at the other head dims (decode_attention_dims.cu; lanes past d / 8 idle where
    d / 8 is not a power of two), grouped heads too, against float64."""
    import tpattn.decode as dec
    gen = torch.Generator(device="cuda").manual_seed(length + h + d)
    q = torch.randn(b, h, 1, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, g, length + 5, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    assert dec.decode_kernel_fits(q[:, :, 0])
    got = decode_attention(q, k, v, length)
    want = float64(q, k, v, length)
    err = (got.double() - want).abs().max().item()
    tol = (4e-3 if dtype == torch.float16 else 3e-2) * max(1.0, want.abs().max().item())
    assert torch.isfinite(got).all() and err <= tol, (err, tol)


def test_layer_decode_on_the_gpu_matches_its_full_forward():
    from tpattn.layer import TensorParallelAttention
    from tpattn.weights import head_weights
    w = head_weights(range(8), 8, 64, 0, torch.float16, "cuda", kv_heads=range(2))
    layer = TensorParallelAttention(**w, heads=8, kv_heads=2, head_dim=64, backend="fused", causal=True, group=None,
                                    rope_theta=10000.0)
    x = torch.randn(2, 300, 512, device="cuda").half()
    with torch.no_grad():
        full = layer(x)
        cache = layer.new_cache(2, 320)
        ys = [layer(x[:, :290], cache=cache)] + [layer(x[:, i:i + 1], cache=cache) for i in range(290, 300)]
    y = torch.cat(ys, 1)
    assert (y.float() - full.float()).abs().max().item() < 2e-2 * full.float().abs().max().item()


@pytest.mark.parametrize("b,h,g,d", [(1, 32, 32, 128), (3, 16, 4, 64), (2, 8, 1, 128)])
@pytest.mark.parametrize("length,capacity", [(1, 1), (33, 4000), (1000, 1000), (4097, 9000)])
def test_decode_kernel_reads_the_length_on_the_device(b, h, g, d, length, capacity, split_kernel):
    """A CUDA graph's path: the length from the cache's device position, the splits from its capacity,
    one launch (the last block of each (b, g) combines); called twice, the counters start at zero."""
    gen = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(b, h, 1, d, device="cuda", generator=gen).half()
    k, v = (torch.randn(b, g, capacity, d, device="cuda", generator=gen).half() for _ in range(2))
    pos = torch.tensor([length - 1], device="cuda")
    want = float64(q, k, v, length)
    for _ in range(2):
        got = decode_attention(q, k, v, length, pos=pos)
        assert (got.double() - want).abs().max().item() <= 4e-3 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope", [None, "halves", "interleaved"])
def test_append_kernel_is_the_torch_ops_bit_for_bit(rope, dtype):
    """dec_append (rotary positions, q out, k and v into the cache at the device position) against the
    torch ops it replaces, the same cache and tables."""
    from tpattn.decode import KVCache, append_row, rope_tables
    B, h, g, d, cap, at = 3, 8, 2, 128, 50, 37
    gen = torch.Generator(device="cuda").manual_seed(7)
    qkv = (torch.randn(B, h + 2 * g, d, device="cuda", generator=gen) * 3).to(dtype)
    caches = []
    for _ in range(2):
        cos = sin = None
        if rope:
            cos, sin = rope_tables(torch.arange(cap, device="cuda"), d, 10000.0)
        kv = [torch.zeros(B, g, cap, d, dtype=dtype, device="cuda") for _ in range(2)]
        caches.append(KVCache(*kv, owner=(), length=at, cos=cos, sin=sin))
    got = append_row(qkv, caches[0], h, rope == "interleaved")
    import tpattn.decode as dec
    fits = dec.decode_kernel_fits
    try:
        dec.decode_kernel_fits = lambda t: False  # the torch ops
        want = append_row(qkv, caches[1], h, rope == "interleaved")
    finally:
        dec.decode_kernel_fits = fits
    assert torch.equal(got, want)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert caches[0].k[:, :, at].abs().sum() > 0 and caches[0].k[:, :, at + 1:].abs().sum() == 0


@pytest.mark.parametrize("rope,d,backend", [(None, 128, "fused"), (10000.0, 128, "fused"), (10000.0, 96, "tiled"),
                                             (None, 256, "tiled")])
def test_graphed_decode_step_replays_the_eager_steps(rope, d, backend):
    """layer.graphed(x, cache): one graph serves every step (the length read on the device); its
    outputs are the eager steps' bit for bit, the cache advances, and a full cache is refused; at head
    dims 96 and 256 too (the decode kernel's module for them; the prompt through the tiled kernels)."""
    from tpattn.errors import ConfigError
    from tpattn.layer import TensorParallelAttention
    from tpattn.weights import head_weights
    w = head_weights(range(8), 8, d, 0, torch.float16, "cuda", kv_heads=range(2))
    layer = TensorParallelAttention(**w, heads=8, kv_heads=2, head_dim=d, backend=backend, causal=True, group=None,
                                    rope_theta=rope)
    x = torch.randn(2, 140, 8 * d, device="cuda").half()
    with torch.no_grad():
        eager = layer.new_cache(2, 140)
        want = [layer(x[:, :128], cache=eager)] + [layer(x[:, t:t + 1], cache=eager) for t in range(128, 140)]
        cache = layer.new_cache(2, 140)
        xs = x[:, 128:129].clone()
        step = layer.graphed(xs, cache)
        assert cache.length == 0 and int(cache.pos) == 0
        got = [layer(x[:, :128], cache=cache)]
        for t in range(128, 140):
            xs.copy_(x[:, t:t + 1])
            got.append(step().clone())
        assert cache.length == 140 and int(cache.pos) == 140
        assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))
        with pytest.raises(ConfigError, match="max_len=140"):
            step()
        cache.reset()  # the same graph serves the emptied cache
        layer(x[:, :128], cache=cache)
        xs.copy_(x[:, 128:129])
        assert torch.equal(step(), want[1])


def test_the_split_count_reads_each_kernels_occupancy():
    """cuda.resident_blocks asks the driver (cuOccupancyMaxActiveBlocksPerMultiprocessor) for the blocks
    of a decode kernel one SM holds: between 1 and the SM's threads over the block's; and a launch that
    overflows one wave at the split it started from (B=64, 8 K/V heads) gets the count decode_splits
    gives for that occupancy."""
    from tpattn import decode
    from tpattn.cuda import resident_blocks
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    most = getattr(torch.cuda.get_device_properties(dev), "max_threads_per_multi_processor", 2048) // decode.DEC_THREADS
    for name in ("dec_mma_f16_d128_r8", "dec_mma_f16_d128_r8_p", "dec_split_f16_d128_g1", "dec_split_f16_d128_g1_pg"):
        assert 1 <= resident_blocks("decode_attention.cu", name, dev, decode.DEC_THREADS) <= most, name
    q = torch.zeros(64, 32, 128, device=dev, dtype=torch.float16)
    source, name, S, smem = decode._split_kernel(q, 64, 32, 8, 128, 4096)
    n = resident_blocks(source, name, dev, decode.DEC_THREADS, shared_mem=smem)
    # (or the split it started from, where the _p kernel's own occupancy would not keep _p)
    assert S in (decode.decode_splits(64 * 8, 4096, sms, 2, n), decode.decode_splits(64 * 8, 4096, sms, 2))
    assert name.startswith("dec_mma_f16_d128_r8")
