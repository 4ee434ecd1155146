"""The CUDA FP8 kernel's host side, on CPU: V^T's key order against the two register layouts it
bridges, vt_for_kernel's padding and order, and the refusals (tests/test_gpu_fp8_ws.py runs the kernel)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tpattn.attention import fp8_ws


def test_key_order_maps_the_accumulators_onto_the_e4m3_fragments():
    """Lane t of a quad holds, in the QK product's fp32 accumulators (m64nNk16 layout), the scores of keys
    8 j + 2 t + {0, 1} of n8 block j; hw_pack_p8 packs blocks 4 kk .. 4 kk + 3 into register 2 h + i
    (row i, keys 16 h ..) in the order b[0], b[1], b[4], b[5]; an m64k32 e4m3 A fragment reads byte e of
    register 2 h + i of lane t as position 16 h + 4 t + e of the step. V^T's position p must hold the key
    whose score lands there."""
    assert sorted(fp8_ws.KEY_ORDER) == list(range(16))
    for t in range(4):
        for h in range(2):
            held = [16 * h + 2 * t, 16 * h + 2 * t + 1, 16 * h + 8 + 2 * t, 16 * h + 8 + 2 * t + 1]
            for e in range(4):
                pos = 16 * h + 4 * t + e
                assert 16 * h + fp8_ws.KEY_ORDER[pos % 16] == held[e]


@pytest.mark.parametrize("N", [1, 16, 100, 4097])
def test_vt_for_kernel_pads_and_orders_each_16_keys(N):
    vt = (torch.arange(2 * 3 * 8 * N) % 251).reshape(2, 3, 8, N).to(torch.uint8).view(torch.float8_e4m3fn)
    out = fp8_ws.vt_for_kernel(vt)
    n16 = -(-N // 16) * 16
    assert out.shape == (2, 3, 8, n16) and out.dtype == torch.float8_e4m3fn and out.is_contiguous()
    raw, src = out.view(torch.uint8), vt.view(torch.uint8)
    for p in range(n16):
        key = p // 16 * 16 + fp8_ws.KEY_ORDER[p % 16]
        want = src[..., key] if key < N else torch.zeros_like(src[..., 0])
        assert torch.equal(raw[..., p], want), p


def test_the_cuda_fp8_kernel_refuses_cpu_tensors_in_one_line():
    q = torch.zeros(1, 2, 16, 128)
    assert "GPU" in fp8_ws.supported(q)
    with pytest.raises(ValueError, match="runs on a GPU"):
        fp8_ws.attention(q, q, q)


def _exp2_fma_numpy(x: np.ndarray) -> np.ndarray:
    """hopper_common.cuh's hw_exp2_fma step by step in float32, its constants read from the header."""
    from tpattn.cuda import kernel_dir
    src = (kernel_dir() / "hopper_common.cuh").read_text()
    body = src.split("float hw_exp2_fma(float x) {")[1].split("\n}")[0]
    c = [np.float32(float(v)) for v in re.findall(r"fmaf\([^;]*?([0-9.]+)f\)", body)]
    c3 = np.float32(float(re.search(r"fmaf\(([0-9.]+)f, f,", body).group(1)))
    assert len(c) == 3 and "12582912.0f" in body and "<< 23" in body
    x = np.maximum(x.astype(np.float32), np.float32(-126.0))
    y = (x + np.float32(12582912.0)).astype(np.float32)
    f = (x - (y - np.float32(12582912.0))).astype(np.float32)
    p = (c3 * f + c[0]).astype(np.float32)
    p = (p * f + c[1]).astype(np.float32)
    p = (p * f + c[2]).astype(np.float32)
    bits = p.view(np.int32).astype(np.int64) + ((y.view(np.int32).astype(np.int64) << 23) & 0xFFFFFFFF)
    bits = ((bits + 2**31) % 2**32 - 2**31).astype(np.int32)
    return bits.view(np.float32)


def test_the_fma_pipe_exp2_is_within_1e4_of_2_to_the_x():
    # the FP8 kernel's exponentials off the MUFU (hw_exp2_fma): relative error under 1e-4 wherever the
    # result is a normal float (up to 2^8: P under TW_F8_LAZY), and a masked -inf (or anything under -126) at most 2^-125, never negative
    x = np.concatenate([np.linspace(-125.0, 8.0, 400001, dtype=np.float32), np.float32([-0.5, 0.5 - 1e-7, 0.0, 8.0])])
    got = _exp2_fma_numpy(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.abs(got / want - 1).max() < 1e-4
    low = _exp2_fma_numpy(np.float32([-126.0, -126.5, -200.0, -np.inf]))
    assert np.all(low >= 0) and np.all(low <= 2.0**-125)
