"""The FP8 attention forward in Triton (tpattn/attention/triton_fp8.py) in Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1 for the whole run, triton installed, numpy < 2.4, as
tests/test_triton_cpu.py; its fp32-to-e4m3 casts through torch, as the GPU rounds: nearest even,
saturating): against float64 beside the torch emulation of the same rounding points
(tpattn/attention/fp8.py). The kernel's softmax is online (P relative to the running row max, not
the final one), so the two agree to FP8's error, not bit for bit: the kernel's error must stay
within 10 % of the emulation's and the two outputs a third of that error apart (measured: 1.00x and
0.04-0.21x); a wrong scale, block or mask moves them far outside. tests/test_gpu_fp8.py runs the same on the GPU."""

from __future__ import annotations

import pytest
import torch

from test_triton_cpu import _patch_interpreter_bf16_dot, _patch_interpreter_fp8_casts, interp
from tpattn.attention import fp8


def errors(B, h, g, N, d, causal, scaling, rotate, dtype=torch.float16, outliers=1e-3, seed=0, tiles=(64, 64, 4, 2),
           spread=False):
    """(kernel's RMSE against float64, the emulation's, the kernel's against the emulation's output)."""
    from tpattn.attention import triton_fp8
    _patch_interpreter_fp8_casts()
    q, k, v = fp8.inputs(B, h, g, N, d, outliers=outliers, seed=seed)
    if spread:  # each 128-row block of K and V at its own size: per-block scales must follow the blocks
        blocks = 2.0 ** (torch.arange(N) // 128 * 3 - 3).double()
        k, v = k * blocks[:, None], v * blocks[:, None]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    o = triton_fp8.attention(q, k, v, causal, scaling, rotate, tiles=tiles)
    qd, kd, vd = q.double(), k.double(), v.double()
    ref = fp8.attention_float64(qd, kd, vd, causal)
    emu = fp8.attention_fp8(qd, kd, vd, causal, scaling, rotate)
    assert o.dtype == dtype and o.shape == q.shape and torch.isfinite(o).all()
    return fp8.rmse(o, ref), fp8.rmse(emu, ref), fp8.rmse(o, emu)


@interp
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scaling,rotate", [("tensor", False), ("head", False), ("block", True)])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_forward_is_as_accurate_as_its_emulation(d, scaling, rotate, causal):
    """GQA (4 query heads on 2 K/V heads), N = 200 (not a multiple of the tiles), 0.1 % outliers."""
    kernel, emulated, apart = errors(1, 4, 2, 200, d, causal, scaling, rotate)
    assert kernel < 1.1 * emulated and apart < 0.35 * emulated, (kernel, emulated, apart)


@interp
@pytest.mark.parametrize("tiles", [(64, 64, 4, 2), (128, 128, 8, 3), (64, 128, 4, 3), None])
def test_fp8_forward_blocks_follow_their_scales(tiles):
    """K and V whose 128-row blocks differ 8x in size, per-block scales: every tile reads its own block's
    scale (a tile of 64 rows or keys and one of 128, against N = 300's three blocks; None: the head
    dim's first autotune config, what the interpreter runs); bf16 out."""
    _patch_interpreter_bf16_dot()
    kernel, emulated, apart = errors(1, 2, 1, 300, 64, True, "block", False, torch.bfloat16, tiles=tiles, spread=True)
    assert kernel < 1.1 * emulated and apart < 0.1 * emulated, (kernel, emulated, apart)


@interp
def test_fp8_forward_of_tiny_queries_and_keys_is_finite():
    """bf16 Q and K near 1e-22: their scales' product (the scores' factor) underflows fp32, and a
    factor of 0 made the masked tiles' -inf scores NaN (-inf * 0). The scores are ~1e-38: attention
    is the mean of the visible V rows, as float64 says."""
    from tpattn.attention import triton_fp8
    _patch_interpreter_fp8_casts()
    _patch_interpreter_bf16_dot()
    q, k, v = fp8.inputs(1, 2, 1, 150, 64, seed=3)
    q, k, v = (q * 1e-22).bfloat16(), (k * 1e-22).bfloat16(), v.bfloat16()
    o = triton_fp8.attention(q, k, v, True, "head", False, tiles=(64, 64, 4, 2))
    ref = fp8.attention_float64(q.double(), k.double(), v.double(), True)
    emulated = fp8.attention_fp8(q.double(), k.double(), v.double(), True, "head", False)
    assert torch.isfinite(o).all()
    assert fp8.rmse(o, ref) < 1.1 * fp8.rmse(emulated, ref), (fp8.rmse(o, ref), fp8.rmse(emulated, ref))


@interp
def test_fp8_forward_refuses_what_it_does_not_take():
    from tpattn.attention import triton_fp8
    q = torch.zeros(1, 3, 16, 96, dtype=torch.float16)
    with pytest.raises(ValueError, match="head dims 64, 128 and 256"):
        triton_fp8.attention(q, q, q)
    q = torch.zeros(1, 3, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="3 query heads do not divide into 2 K/V heads"):
        triton_fp8.attention(q, q[:, :2], q[:, :2])


@interp
def test_layer_fp8_backend_through_the_triton_kernel():
    """Fp8TritonBackend (python -m tpattn --dtype fp8 --kernel triton): the layer's scaling and
    rotation through the kernel, against the torch arithmetic (Fp8Backend) and float64."""
    from tpattn.attention.fp8 import Fp8Backend
    from tpattn.attention.triton_fp8 import Fp8TritonBackend
    q, k, v = (t.half() for t in fp8.inputs(1, 4, 2, 260, 64, outliers=1e-3, seed=7))
    ref = fp8.attention_float64(q.double(), k.double(), v.double(), True)
    _patch_interpreter_fp8_casts()
    kernel = Fp8TritonBackend().forward(q, k, v, True)
    torch_math = Fp8Backend().forward(q, k, v, True)
    assert kernel.dtype == torch.float16
    assert fp8.rmse(kernel, ref) < 1.1 * fp8.rmse(torch_math, ref) and fp8.rmse(kernel, torch_math) < 0.35 * fp8.rmse(
        torch_math, ref)


@interp
@pytest.mark.parametrize("scaling", ["block", "head", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_quantization_kernel_gives_torchs_bytes(d, dtype, scaling):
    """fp8_quant (triton_fp8.quantize: one launch a tensor for block scales, two for a head's or the
    tensor's) against prepare_torch, N = 300 (a partial last block), blocks of different sizes (so
    that a head's scale is not its first block's), 0.1 % outliers, two batches and GQA: without the
    rotation the same scales and e4m3 bytes, rows and transposed (V^T); with it (fp32 products summed
    in another order than torch's matmul) the scales within 1e-6 and at most 1 % of the bytes one e4m3
    step apart. A wrong scale or a missing rotation fails it (the cast's rounding is torch's here:
    tests/test_gpu_fp8.py checks the GPU's)."""
    from tpattn.attention import triton_fp8
    _patch_interpreter_fp8_casts()
    _patch_interpreter_bf16_dot()
    q, k, v = fp8.inputs(2, 2, 1, 300, d, outliers=1e-3, seed=5)
    blocks = 2.0 ** (torch.arange(300) // 128 * 3 - 3).double()
    q, k, v = (t.to(dtype) for t in (q * blocks[:, None], k, v * blocks[:, None]))
    q[1] *= 4  # the second batch's heads larger: a tensor's scale is not its first head's
    for rotate in (False, True):
        want = triton_fp8.prepare_torch(q, k, v, scaling, rotate)
        got = triton_fp8.prepare(q, k, v, scaling, rotate)
        for name, a, b in zip(("q8", "k8", "vt8", "sq", "sk", "sv"), got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            if not rotate or name in ("vt8", "sv"):  # V is never rotated
                assert torch.equal(a.float(), b.float()), (name, rotate)
            elif a.dtype == torch.float32:
                assert torch.allclose(a, b, rtol=1e-6, atol=0), name
            else:
                x, y = a.float(), b.float()
                assert (x != y).float().mean().item() <= 0.01, name
                assert ((x - y).abs() <= torch.maximum(x.abs(), y.abs()) / 8 + 2.0 ** -9).all(), name


@interp
@pytest.mark.parametrize("N", [1, 16, 300])
@pytest.mark.parametrize("scaling", ["block", "head"])
def test_quantization_kernel_writes_the_cuda_kernels_v_layout(scaling, N):
    """key_order=True (fp8_ws.prepare's V^T): fp8_quant stores each 16 keys in fp8_ws.KEY_ORDER and
    zeros up to the next multiple of 16, the bytes fp8_ws.vt_for_kernel makes from the plain V^T."""
    from tpattn.attention import fp8_ws, triton_fp8
    _patch_interpreter_fp8_casts()
    q, k, v = (t.to(torch.float16) for t in fp8.inputs(1, 2, 2, N, 128, outliers=1e-3, seed=7))
    plain = triton_fp8.prepare(q, k, v, scaling)
    ordered = triton_fp8.prepare(q, k, v, scaling, key_order=True)
    want = fp8_ws.vt_for_kernel(plain[2])
    assert ordered[2].shape == want.shape == (1, 2, 128, -(-N // 16) * 16)
    assert torch.equal(ordered[2].view(torch.uint8), want.view(torch.uint8))
    for a, b in zip(plain[3:], ordered[3:]):
        assert torch.equal(a, b)
