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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,h,g", [(1, 32, 32), (3, 32, 8), (2, 8, 1), (2, 40, 2)])
@pytest.mark.parametrize("length", [1, 17, 1000, 4097])
def test_decode_kernel_against_float64(b, h, g, length, d, dtype):
    gen = torch.Generator(device="cuda").manual_seed(length + h)
    q = torch.randn(b, h, 1, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(b, g, length + 5, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
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
