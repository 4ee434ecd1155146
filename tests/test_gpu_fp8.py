"""The FP8 attention forward (tpattn/attention/triton_fp8.py) on the GPU (compute capability 8.9+):
against float64 beside the torch emulation of the same rounding points (tpattn/attention/fp8.py),
at head dims 64, 128 and 256, N from 1 to 4097, causal and not, GQA, every scaling, with and without
the rotation, fp16 and bf16 outputs, through the autotuner. The kernel's softmax is online, so it
agrees with the emulation to FP8's error: its error must stay within a small factor of the
emulation's. tests/test_triton_fp8_cpu.py runs the same logic in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tpattn.attention import fp8

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="FP8 tensor cores need a GPU of compute capability 8.9 or later")]


@pytest.mark.parametrize("N", [1, 100, 1000, 4097])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scaling,rotate", [("tensor", False), ("head", False), ("block", True)])
def test_fp8_forward_against_float64(N, d, causal, scaling, rotate):
    pytest.importorskip("triton")
    from tpattn.attention import triton_fp8
    q, k, v = fp8.inputs(1, 4, 2, N, d, outliers=1e-3, seed=N + d)
    q16, k16, v16 = (t.half().cuda() for t in (q, k, v))
    o = triton_fp8.attention(q16, k16, v16, causal, scaling, rotate)
    ref = fp8.attention_float64(q, k, v, causal)
    emu = fp8.attention_fp8(q16.double().cpu(), k16.double().cpu(), v16.double().cpu(), causal, scaling, rotate)
    kernel, emulated = fp8.rmse(o.cpu(), ref), fp8.rmse(emu, ref)
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    assert kernel < 1.15 * emulated, (kernel, emulated)


@pytest.mark.parametrize("scaling", ["block", "head"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantization_kernel_gives_torchs_bytes(d, dtype, scaling):
    """fp8_quant (one launch a tensor for block scales, two for a head's) against the same in torch on
    the GPU, N = 1000 (a partial last block): V's bytes (rows transposed, no rotation) and scales
    equal bit for bit, so the kernel's division and e4m3 rounding are torch's (nearest even); Q and K
    after the rotation (fp32 products summed in another order, on the tensor cores) within 4e-6 and one
    e4m3 step; at d = 128 V^T in the CUDA kernel's key order (key_order=True) is vt_for_kernel's bytes."""
    pytest.importorskip("triton")
    from tpattn.attention import fp8_ws, triton_fp8
    q, k, v = (t.to(dtype).cuda() for t in fp8.inputs(1, 4, 2, 1000, d, outliers=1e-3, seed=d))
    got = triton_fp8.prepare(q, k, v, scaling, True)
    want = triton_fp8.prepare_torch(q, k, v, scaling, True)
    if d == 128:
        vtk = triton_fp8.prepare(q, k, v, scaling, True, key_order=True)[2]
        assert torch.equal(vtk.view(torch.uint8), fp8_ws.vt_for_kernel(want[2]).view(torch.uint8))
    for name, a, b in zip(("q8", "k8", "vt8", "sq", "sk", "sv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        x, y = a.float(), b.float()
        if name in ("vt8", "sv"):
            assert torch.equal(x, y), name
        elif name in ("sq", "sk"):
            assert torch.allclose(x, y, rtol=4e-6, atol=0), name
        else:
            assert (x != y).float().mean().item() <= 0.01, name
            assert ((x - y).abs() <= torch.maximum(x.abs(), y.abs()) / 8 + 2.0 ** -9).all(), name


@pytest.mark.parametrize("tiles", [None, (64, 64, 4, 3), (128, 64, 8, 3)])
def test_fp8_forward_bf16_and_spread_blocks(tiles):
    """bf16 in and out; K and V whose 128-row blocks differ 8x in size, per-block scales."""
    pytest.importorskip("triton")
    from tpattn.attention import triton_fp8
    q, k, v = fp8.inputs(2, 8, 8, 700, 128, seed=3)
    blocks = 2.0 ** (torch.arange(700) // 128 * 3 - 3).double()
    k, v = k * blocks[:, None], v * blocks[:, None]
    qb, kb, vb = (t.bfloat16().cuda() for t in (q, k, v))
    o = triton_fp8.attention(qb, kb, vb, True, "block", False, tiles=tiles)
    ref = fp8.attention_float64(qb.double().cpu(), kb.double().cpu(), vb.double().cpu(), True)
    emu = fp8.attention_fp8(qb.double().cpu(), kb.double().cpu(), vb.double().cpu(), True, "block", False)
    assert o.dtype == torch.bfloat16
    assert fp8.rmse(o.cpu(), ref) < 1.15 * fp8.rmse(emu, ref)


@pytest.mark.parametrize("args", [[], ["--causal", "--kv-heads", "8"]])
def test_cli_fp8_through_the_triton_kernel(args):
    """python -m tpattn --dtype fp8 --kernel triton --check on the GPU: both RMS checks pass."""
    pytest.importorskip("triton")
    from conftest import tpattn
    r = tpattn(["--dtype", "fp8", "--kernel", "triton", "--check", "--device", "cuda", *args], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(tol 0.1) PASS") == 2 and "RESULT: PASS" in r.stdout, r.stdout


def test_cli_fp8_torch_math_on_the_gpu():
    """python -m tpattn --dtype fp8 --check --device cuda (--kernel reference: the torch arithmetic on
    the GPU, its rotation on the GPU too): both RMS checks pass."""
    from conftest import tpattn
    r = tpattn(["--dtype", "fp8", "--check", "--device", "cuda", "--kernel", "reference", "--seq-len", "1024",
                "--heads", "8", "--head-dim", "64", "--causal"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(tol 0.1) PASS") == 2 and "RESULT: PASS" in r.stdout, r.stdout
