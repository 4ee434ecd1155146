"""The CUDA FP8 forward (kernels/fused_ws_fp8.cu through tpattn/attention/fp8_ws.py) on a GPU of
compute capability 9.0: against float64 beside the torch emulation of the same rounding points
(tpattn/attention/fp8.py), N from 1 to 4097, causal and not, GQA, every scaling, with and without the
rotation, fp16 and bf16 outputs, more tiles than SMs (the persistent grid; causal: tiles handed out by
the counter). The kernel's softmax is online, so it agrees with the emulation to FP8's error: its error
must stay within a small factor of the emulation's."""

from __future__ import annotations

import pytest
import torch

from tpattn.attention import fp8

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="the CUDA FP8 kernel is sm_90a: a GPU of compute capability 9.0")]


def _errors(q, k, v, causal, scaling, rotate, dtype=torch.float16):
    from tpattn.attention import fp8_ws
    qg, kg, vg = (t.to(dtype).cuda() for t in (q, k, v))
    o = fp8_ws.attention(qg, kg, vg, causal, scaling, rotate)
    assert o.dtype == dtype and o.shape == qg.shape and torch.isfinite(o).all()
    ref = fp8.attention_float64(q, k, v, causal)
    emu = fp8.attention_fp8(qg.double().cpu(), kg.double().cpu(), vg.double().cpu(), causal, scaling, rotate)
    return fp8.rmse(o.float().cpu(), ref), fp8.rmse(emu, ref)


@pytest.mark.parametrize("N", [1, 100, 1000, 4097])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scaling,rotate", [("tensor", False), ("head", False), ("block", True), ("block", False)])
def test_fp8_cuda_forward_against_float64(N, causal, scaling, rotate):
    q, k, v = fp8.inputs(1, 4, 2, N, 128, outliers=1e-3, seed=N)
    kernel, emulated = _errors(q, k, v, causal, scaling, rotate)
    assert kernel < 1.15 * emulated, (kernel, emulated)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_cuda_forward_bf16_spread_blocks_and_more_tiles_than_sms(causal):
    """bf16 in and out; K and V whose 128-row blocks differ 8x in size each (per-block scales: O's units
    change from tile to tile); 2 x 16 heads x 9 query tiles, more than any GPU's SMs."""
    q, k, v = fp8.inputs(2, 16, 8, 1100, 128, seed=3)
    blocks = 2.0 ** (torch.arange(1100) // 128 * 3 - 12).double()
    k, v = k * blocks[:, None], v * blocks[:, None]
    kernel, emulated = _errors(q, k, v, causal, "block", False, torch.bfloat16)
    assert kernel < 1.15 * emulated, (kernel, emulated)


def test_fp8_cuda_kernel_agrees_with_the_triton_one():
    """The same prepared operands through both kernels: the same arithmetic up to where the online
    softmax rounds P, so the outputs are far closer to each other than either is to float64."""
    pytest.importorskip("triton")
    from tpattn.attention import fp8_ws, triton_fp8
    q, k, v = (t.half().cuda() for t in fp8.inputs(2, 8, 8, 2048, 128, seed=5))
    a = fp8_ws.attention(q, k, v, True, "head", False).float()
    b = triton_fp8.attention(q, k, v, True, "head", False).float()
    ref = fp8.attention_float64(q.double().cpu(), k.double().cpu(), v.double().cpu(), True).cuda()
    assert fp8.rmse(a, b) < 0.5 * fp8.rmse(b, ref), (fp8.rmse(a, b), fp8.rmse(b, ref))


def test_fp8_cuda_graph_replay_is_the_eager_output():
    """Captured in a CUDA graph (causal: the tile counter back at zero after every launch) and replayed:
    the eager call's bits."""
    from tpattn.attention import fp8_ws
    q, k, v = (t.half().cuda() for t in fp8.inputs(1, 32, 8, 3000, 128, seed=7))
    ops = fp8_ws.prepare(q, k, v, "head", False)
    o1, o2 = torch.empty_like(q), torch.empty_like(q)
    fp8_ws.launch(*ops, True, o1, False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fp8_ws.launch(*ops, True, o2, False)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("args", [[], ["--causal", "--kv-heads", "8"]])
def test_cli_fp8_through_the_cuda_kernel(args):
    """python -m tpattn --dtype fp8 --kernel fused --check on the GPU: both RMS checks pass."""
    from conftest import tpattn
    r = tpattn(["--dtype", "fp8", "--kernel", "fused", "--check", "--device", "cuda", "--head-dim", "128", *args],
               timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("(tol 0.1) PASS") == 2 and "RESULT: PASS" in r.stdout, r.stdout
