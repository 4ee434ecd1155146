"""GPU tests of the naive backward (`pytest -m gpu tests/test_gpu_backward_naive.py`), for the naive
backend and the tiled one (whose backward is the naive one after its own forward).

- dq, dk, dv through tpattn.attention.attention(...) and o.backward(do) against float64 autograd of
  the reference backend, by FlashAttention's rule (tests/backward_check.py): max error <= 3 x torch's
  own error in the same dtype + one unit in the last place at the gradient's scale (+ float32's share).
  Causal and not; GQA with G = H, H/4, 1 K/V heads; d = 64, 80, 128; N = 1, 17, 127, 128, 129, 1000;
  B = 2; fp16 and bf16.
- N = 50 000 for one head (N^2 = 2.5e9 > 2^31: 32-bit offsets would wrap): against a float32
  computation over blocks of query rows, and torch's own fp16 computation at the same rounding points
  done the same way (no N x N float64 tensor).
- Determinism: two backward calls give bitwise-equal gradients (deterministic=True and False alike: the
  naive kernels use no atomics).
- Buffers full of NaN beforehand (the caching allocator hands out freed memory) change nothing: every
  entry of S, P, dP, dS, D the backward reads, it wrote first; masked entries included.
- Another stream: the backward's kernels run on torch's current stream (autograd runs the backward on
  the forward's stream), so a side-stream call gives the default stream's gradients.
- The backward's timing sections (bwd_qk ... bwd_dk) are recorded (NaiveBackend.backward called directly).
"""

import pytest
import torch

from backward_check import DT, check_against_reference, check_rule, chunked_grads, grads, inputs
from tpattn.timing import Timer, recording

pytestmark = pytest.mark.gpu
BACKENDS = ["naive", "tiled"]
B, H = 2, 8


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 matmuls in full float32 (the float32 references here stand in for float64)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("g", [H, H // 4, 1])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("n", [1, 17, 127, 128, 129, 1000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_float64(backend, dtype, causal, n, d, g):
    q, k, v, do = inputs(B, H, g, n, d, DT[dtype], seed=n * 1000 + d * 10 + g)
    check_against_reference(q, k, v, do, causal, backend)


def test_naive_backward_beyond_2_pow_31():
    """One head at N = 50 000: S, P, dP, dS hold N^2 = 2.5e9 > 2^31 entries each."""
    n, d = 50_000, 64
    assert n * n > 2**31
    q, k, v, do = inputs(1, 1, 1, n, d, torch.float16, seed=7)
    _, *got = grads(q, k, v, do, False, "naive")
    torch.cuda.synchronize()
    exact, low = chunked_grads(q, k, v, do, causal=False)
    check_rule(got, low, exact, torch.float16, "naive N=50000")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_deterministic(backend):
    q, k, v, do = inputs(B, H, 2, 300, 64, torch.float16, seed=11)
    first = grads(q, k, v, do, True, backend, deterministic=True)[1:]
    for det in (True, False):
        again = grads(q, k, v, do, True, backend, deterministic=det)[1:]
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{backend} {name} differs between two calls (deterministic={det})"


@pytest.mark.parametrize("causal", [False, True])
def test_backward_ignores_garbage_in_its_buffers(causal):
    q, k, v, do = inputs(B, H, 2, 300, 80, torch.bfloat16, seed=13)
    clean = grads(q, k, v, do, causal, "naive")[1:]
    torch.cuda.synchronize()
    junk = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB of NaN, freed: the next buffers
    del junk
    dirty = grads(q, k, v, do, causal, "naive")[1:]
    for name, a, b in zip(("dq", "dk", "dv"), clean, dirty):
        assert torch.equal(a, b), name


def test_backward_on_another_stream():
    q, k, v, do = inputs(B, H, 4, 513, 128, torch.float16, seed=17)
    expect = grads(q, k, v, do, True, "naive")[1:]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = grads(q, k, v, do, True, "naive")[1:]
        total = [t.float().sum() for t in got]  # consumed on the side stream, right after the kernels
    torch.cuda.current_stream().wait_stream(side)
    for name, a, b, s in zip(("dq", "dk", "dv"), expect, got, total):
        assert torch.equal(a, b), name
        assert s.item() == b.float().sum().item(), name


def test_backward_timing_sections():
    """NaiveBackend.backward times its passes on the recording timer. (Called directly: autograd runs a
    CUDA node's backward on its own device thread, which a ContextVar set here does not reach.)"""
    from tpattn.attention import get_backend
    q, k, v, do = inputs(1, 2, 1, 64, 64, torch.float16)
    be = get_backend("naive")
    o, saved = be.forward_for_backward(q, k, v, False)
    timer = Timer(q.device)
    with recording(timer):
        be.backward(q, k, v, o, saved, do, False)
    ms = timer.collect()
    assert set(ms) == {"bwd_qk", "bwd_softmax", "bwd_dv", "bwd_dp", "bwd_rowdot", "bwd_ds", "bwd_dq", "bwd_dk"}
    assert all(t >= 0 for t in ms.values())
