"""--kernel triton on the GPU (tpattn/attention/triton_fused.py, triton_kernels.py): o, dQ, dK, dV
against float64 autograd of the reference with tests/test_gpu_backward_fused.py's rule (the
kernel's error at most 3x torch's own in the same dtype, plus a small absolute term); odd N, head
dims 64 and 128 and the padded ones (every multiple of 8 up to 256), causal and not, grouped-query attention, bf16, B > 1, strided views read in place, every
autotune config forced, the logsumexp, determinism, memory linear in N, and N with N^2 > 2^31.

The first run compiles every config (Triton caches them on disk, ~/.triton/cache)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from backward_check import check_output_and_grads, grads, inputs
from tpattn.attention import attention, get_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None or not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU and the triton package")]


def check(b, h, g, n, d, causal, dtype=torch.float16, config=None):
    q, k, v, do = inputs(b, h, g, n, d, dtype)
    if config is None:
        got = grads(q, k, v, do, causal, "triton")
    else:
        from tpattn.attention.triton_fused import forced_configs
        with forced_configs(*config):
            got = grads(q, k, v, do, causal, "triton")
    check_output_and_grads(q, k, v, do, causal, got)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 127, 128, 129, 1000])
def test_triton_shapes(n, causal, d):
    check(2, 4, 4, n, d, causal)


@pytest.mark.parametrize("h,g", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_gqa(h, g, causal):
    check(1, h, g, 300, 128, causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_bf16_and_batches(d, causal):
    check(3, 4, 2, 257, d, causal, torch.bfloat16)


def _tune():
    from tpattn.attention import triton_kernels as K
    return K.TUNE


@pytest.mark.parametrize("d", [8, 32, 80, 96, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_head_dims(d, causal):
    """Head dims other than 64 and 128 (tiles the next power of two wide, the columns past d zero):
    N from 1 to 4097, GQA, fp16; bf16 once."""
    for n in (1, 129, 1000, 4097):
        check(1, 4, 2, n, d, causal)
    check(2, 4, 1, 300, d, causal, torch.bfloat16)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("i", range(6))
def test_every_autotune_config(i, d):
    """The autotuner keeps one config per shape; each of the sets is checked here (tile sizes 16 to
    128: masks on partial last tiles and on the diagonal; a set of fewer than 6 from its start again)."""
    tune = _tune()
    config = [tune[w][d][i % len(tune[w][d])] for w in ("fwd", "kv", "q")]
    for n in (200, 1000):
        for causal in (False, True):
            check(2, 4, 2, n, d, causal, config=config)


@pytest.mark.parametrize("d", [40, 96, 136])
def test_padded_head_dims_read_and_write_d_columns_only(d):
    """q, k, v and dO as views of rows 8 columns wider holding NaN and inf past d (the next head of a
    QKV GEMM output): o, the logsumexp and the gradients finite and within the float64 rule, the
    gradients' views zero past d."""
    b, h, g, n = 2, 4, 2, 1000
    q, k, v, do = inputs(b, h, g, n, d, torch.float16)

    def wide(t):
        buf = torch.full((*t.shape[:-1], d + 8), float("nan"), dtype=t.dtype, device=t.device)
        buf[..., d + 4:] = float("inf")
        buf[..., :d] = t
        return buf
    bufs = [wide(t).requires_grad_(True) for t in (q, k, v)]
    views = [t[..., :d] for t in bufs]
    o = attention(*views, True, backend="triton")
    o.backward(wide(do)[..., :d])
    for t in bufs:
        assert torch.equal(t.grad[..., d:], torch.zeros_like(t.grad[..., d:]))
    check_output_and_grads(q, k, v, do, True, (o.detach(), *(t.grad[..., :d] for t in bufs)))


@pytest.mark.parametrize("causal", [False, True])
def test_strided_views_read_in_place(causal):
    """q, k, v as the layer makes them (views of one [B, N, h + 2g, d] tensor) and o a strided view:
    the same bits as contiguous copies, forward and backward."""
    b, n, h, g, d = 2, 777, 8, 2, 128
    qkv = torch.randn(b, n, h + 2 * g, d, device="cuda").half()
    q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split([h, g, g], dim=2))
    tri = get_backend("triton")
    want = tri.forward(q.contiguous(), k.contiguous(), v.contiguous(), causal)
    o_rows = torch.empty(b, n, h, d, dtype=torch.float16, device="cuda")
    out = o_rows.permute(0, 2, 1, 3)
    tri.forward(q, k, v, causal, out=out)
    assert torch.equal(out, want)
    do = torch.randn(b, h, n, d, device="cuda").half()
    got = grads(q, k, v, do, causal, "triton")
    ref = grads(q.contiguous(), k.contiguous(), v.contiguous(), do, causal, "triton")
    assert all(torch.equal(x, y) for x, y in zip(got, ref))


def test_deterministic_gives_the_same_bits():
    q, k, v, do = inputs(1, 8, 2, 1000, 128, torch.float16)
    a = grads(q, k, v, do, True, "triton")
    b = grads(q, k, v, do, True, "triton")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("n", [100, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_writes_the_logsumexp_and_the_same_output(n, causal):
    h = 32 if n == 4096 else 2
    q, k, v, _ = inputs(1, h, h, n, 128, torch.float16)
    tri = get_backend("triton")
    plain = tri.forward(q, k, v, causal)
    o, lse = tri.forward_for_backward(q, k, v, causal)
    assert torch.equal(o, plain)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) / 128 ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-3, rtol=1e-4)


def test_backward_memory_is_linear_in_n():
    """Beyond its inputs and outputs the backward allocates O(N) (D) and the gradients: no N x N
    tensor (at N = 8192 with 8 heads an N x N fp16 tensor alone would be 1 GiB)."""
    q, k, v, do = inputs(1, 8, 8, 8192, 128, torch.float16)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, True, backend="triton")
    o.backward(do)  # the first backward autotunes (its timing runs allocate): measure the second
    q.grad = k.grad = v.grad = None
    o = attention(q, k, v, True, backend="triton")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o.backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 4 * q.numel() * 4, extra


def test_long_sequence_past_32_bit_scores():
    """N = 46 341 (N^2 > 2^31), one head, causal: the last query rows' o and dq against float64
    computed for those rows only (all keys), and every gradient finite."""
    n, d, rows = 46341, 64, 64
    q, k, v, do = inputs(1, 1, 1, n, d, torch.float16)
    o, dq, dk, dv = grads(q, k, v, do, True, "triton")
    assert all(torch.isfinite(t).all() for t in (o, dq, dk, dv))
    r0 = n - rows
    qd, kd, vd, dod = (t[0, 0].double() for t in (q, k, v, do))
    s = qd[r0:] @ kd.T / math.sqrt(d)
    s = s.masked_fill(torch.arange(n, device="cuda")[None, :] > torch.arange(r0, n, device="cuda")[:, None],
                      float("-inf"))
    p = torch.softmax(s, -1)
    o_ref = p @ vd
    dp = dod[r0:] @ vd.T
    ds = p * (dp - (dod[r0:] * o_ref).sum(-1, keepdim=True))
    dq_ref = ds @ kd / math.sqrt(d)
    for name, got, ref in (("o", o[0, 0, r0:], o_ref), ("dq", dq[0, 0, r0:], dq_ref)):
        err = (got.double() - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item() + 1e-5, f"{name}: {err:.3g}"


@pytest.mark.parametrize("backend", ["triton", "fused"])
@pytest.mark.parametrize("d", [96, 256])
@torch.no_grad()
def test_llama_attention_at_head_dims_past_128(d, backend):
    """A transformers LlamaAttention with head dim 96 or 256 (random weights, nothing downloaded) as the
    layer with the triton backend, and with the fused one (fusedw of fused_ws_dims.cu, compute capability
    9.0), fp16: the whole forward, and a prefill then decode steps through a KV cache (the decode kernel's
    CUDA-core split at that head dim), against the module in float64."""
    import copy
    if backend == "fused" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("--kernel fused at head dims 96 and 256 needs compute capability 9.0")

    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    import tpattn.decode as dec
    from tpattn import TensorParallelAttention
    heads, kv, B, N, T = 8, 2, 2, 300, 5
    torch.manual_seed(d)
    cfg = LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv, head_dim=d,
                      rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    attn = LlamaAttention(cfg, 0).double().cuda()
    x = torch.randn(B, N + T, heads * d, dtype=torch.float64, device="cuda")
    cos, sin = LlamaRotaryEmbedding(cfg).cuda()(x, torch.arange(N + T, device="cuda")[None].expand(B, -1))
    ref, _ = attn(x, position_embeddings=(cos.double(), sin.double()), attention_mask=None)
    layer = TensorParallelAttention.from_hf_llama(copy.deepcopy(attn).half(), backend=backend)
    assert dec.decode_kernel_fits(torch.zeros(1, heads, d, dtype=torch.float16, device="cuda"))
    xh = x.half()
    full = layer(xh)
    cache = layer.new_cache(B, N + T)
    steps = torch.cat([layer(xh[:, :N], cache=cache)] + [layer(xh[:, N + t:N + t + 1], cache=cache) for t in range(T)], 1)
    tol = 2e-2 * ref.abs().max().item()
    for name, y in (("forward", full), ("prefill + decode", steps)):
        err = (y.double() - ref).abs().max().item()
        assert torch.isfinite(y).all() and err <= tol, (name, err, tol)


@pytest.mark.parametrize("d", [64, 128, 96])
@torch.no_grad()
def test_contiguous_cache_chunks_through_the_paged_prefill(d, monkeypatch):
    """The triton backend's chunked prefill into a contiguous KV cache (the paged prefill's kernel, one
    page per sequence): a prompt, three chunks (one past a 128-row tile, the last of two rows) and a
    decode row, against the same steps in torch math and the whole forward."""
    import tpattn.decode as dec
    from tpattn import TensorParallelAttention
    H, G, B = 8, 2, 2
    D = H * d
    torch.manual_seed(d)
    w = {k: (torch.randn(*s) * 0.02).half().cuda() for k, s in
         (("wq", (D, D)), ("wk", (D, G * d)), ("wv", (D, G * d)), ("wo", (D, D)))}
    layer = TensorParallelAttention(**w, heads=H, kv_heads=G, head_dim=d, causal=True, backend="triton",
                                    rope_theta=10000.0)
    x = torch.randn(B, 500, D, device="cuda").half()
    cuts = [(0, 100), (100, 300), (300, 497), (497, 498), (498, 500)]
    ran, real, outs = [], dec._triton_prefix_fits, {}
    for on in (True, False):
        monkeypatch.setattr(dec, "_triton_prefix_fits", (lambda *a: ran.append(real(*a)) or ran[-1]) if on
                            else (lambda *a: False))
        cache = layer.new_cache(B, 512)
        outs[on] = torch.cat([layer(x[:, a:b], cache=cache) for a, b in cuts], 1)
    assert ran == [True, True, True]  # the chunks of 200, 197 and 2 rows; the one-row step decodes
    assert (outs[True].float() - outs[False].float()).abs().max().item() <= 2e-3
    assert (outs[True].float() - layer(x).float()).abs().max().item() <= 4e-3
