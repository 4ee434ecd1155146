"""--kernel triton without a GPU: the module imports where triton is missing (CPU builds of torch),
and the refusals are one line each (triton missing, head dim, device). The rest of this file runs
the kernels in Triton's interpreter on CPU tensors, only when TRITON_INTERPRET=1 is set for the
whole run and triton is installed (small shapes: the interpreter is slow), e.g.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_triton_cpu.py

The GPU tests (tests/test_gpu_triton.py) are the real ones; these check the kernels' index and
mask logic, for every autotune config, on any machine."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import tpattn
from tpattn.errors import ConfigError


MODULES = ("tpattn.attention.triton_fused", "tpattn.attention.triton_kernels")


@pytest.fixture
def fresh(monkeypatch):
    """fresh(triton_missing): tpattn.attention.triton_fused imported anew (with `import triton` made
    to fail if asked); the modules that were imported before are put back afterwards."""
    saved = {name: sys.modules.get(name) for name in MODULES}

    def load(triton_missing: bool):
        if triton_missing:
            monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
        for name in MODULES:
            sys.modules.pop(name, None)
        return importlib.import_module(MODULES[0])
    yield load
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


def _cfg(**kw):
    base = dict(device="cuda", dtype="fp16", head_dim=128)
    base.update(kw)
    return SimpleNamespace(**base)


def test_refuses_in_one_line_without_triton(fresh):
    mod = fresh(triton_missing=True)  # the import itself must not need triton
    with pytest.raises(ConfigError) as exc:
        mod.TritonBackend().check_supported(_cfg())
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("--kernel triton needs the triton package") and "use --kernel fused" in msg


def test_refuses_other_head_dims_in_one_line(fresh):
    """Every multiple of 8 up to 256 passes the head-dim check (then triton's absence is what is refused);
    others are refused in one line that names the nearest ones taken, or the kernels for d > 256."""
    mod = fresh(triton_missing=True)
    for d in (8, 32, 80, 96, 160, 192, 256):
        with pytest.raises(ConfigError, match="needs the triton package"):
            mod.TritonBackend().check_supported(_cfg(head_dim=d))
    for d, near in ((100, "96 or 104"), (4, "8"), (12, "8 or 16"), (250, "248 or 256")):
        with pytest.raises(ConfigError, match=rf"^--kernel triton supports head dims that are multiples of 8 up to "
                                              rf"256 \(got {d}\); use --head-dim {near}, or --kernel naive$"):
            mod.TritonBackend().check_supported(_cfg(head_dim=d))
    with pytest.raises(ConfigError, match=r"^--kernel triton supports head dims up to 256 \(got 264\), as every "
                                          r"kernel here does; use --head-dim 256 or less$"):
        mod.TritonBackend().check_supported(_cfg(head_dim=264))


def test_refuses_cpu_and_fp32(fresh, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mod = fresh(triton_missing=True)
    with pytest.raises(ConfigError, match="does not run on cpu"):
        mod.TritonBackend().check_supported(_cfg(device="cpu"))
    with pytest.raises(ConfigError, match="does not support --dtype fp32"):
        mod.TritonBackend().check_supported(_cfg(dtype="fp32"))
    with pytest.raises(ConfigError, match="needs CUDA tensors"):
        mod.TritonBackend().forward(*(torch.zeros(1, 1, 4, 64, dtype=torch.float16),) * 3, False)


def test_cli_refusals_exit_2_in_one_line():
    res = tpattn(["--kernel", "triton", "--device", "cpu"], TRITON_INTERPRET="0")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == ["tpattn: error: --kernel triton does not run on cpu; "
                                               "use --kernel reference on CPU"]
    # under the interpreter the device passes and the head dim is refused (before triton is looked for)
    res = tpattn(["--kernel", "triton", "--device", "cpu", "--head-dim", "100"], TRITON_INTERPRET="1")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == ["tpattn: error: --kernel triton supports head dims that are multiples "
                                               "of 8 up to 256 (got 100); use --head-dim 96 or 104, or --kernel naive"]


# ---- the kernels in Triton's interpreter (TRITON_INTERPRET=1 and triton installed) ----

def _numpy_below_2_4() -> bool:
    import numpy as np
    return tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4)


_INTERP_OK = (os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
              and _numpy_below_2_4())


def interp(test):
    """Run only under Triton's interpreter: TRITON_INTERPRET=1 for the whole run, triton installed,
    and numpy < 2.4 (Triton 3.6's interpreter turns 1-element arrays into loop bounds, which numpy
    2.4 refuses)."""
    test = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")(test)
    return pytest.mark.skipif(not _INTERP_OK, reason="needs TRITON_INTERPRET=1 for the whole run, the triton "
                                                     "package and numpy < 2.4")(test)


@pytest.fixture(scope="module")
def tf():
    mod = importlib.import_module("tpattn.attention.triton_fused")
    _patch_interpreter_bf16_dot()
    return mod


def _patch_interpreter_bf16_dot():
    """Triton 3.6's interpreter multiplies bf16 tiles as their raw uint16 bits in tl.dot; widen them
    to float32 first (exact) so that the bf16 kernels can be checked here. The GPU is unaffected."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it
    if getattr(it.InterpreterBuilder.create_dot, "_bf16_widened", False):
        return
    orig = it.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        def wide(x):
            if x.dtype != tl.bfloat16:
                return x
            return it.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return orig(self, wide(a), wide(b), d, *args)
    create_dot._bf16_widened = True
    it.InterpreterBuilder.create_dot = create_dot


def _patch_interpreter_fp8_casts():
    """Triton 3.6's interpreter converts fp32 to e4m3 by hand and gets it wrong (a rounding carry into
    the exponent is lost: 0.4967 becomes 0.25; ties away from zero; no saturation); convert to and from
    float8e4nv through torch instead (nearest even, saturating at +-448, as cvt.rn.satfinite does on
    the GPU). The GPU is unaffected."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it
    if getattr(it.InterpreterBuilder.create_fp_to_fp, "_fp8_by_torch", False):
        return
    orig = it.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, t = src.dtype.scalar, dst_type.scalar
        if t == tl.float8e4nv and s != tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32) if s != tl.bfloat16 else
                                 (np.ascontiguousarray(src.data).astype(np.uint32) << 16).view(np.float32))
            return it.TensorHandle(x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy(), t)
        if s == tl.float8e4nv and t in (tl.float32, tl.float16):
            x = torch.from_numpy(np.ascontiguousarray(src.data).view(np.uint8)).view(torch.float8_e4m3fn)
            return it.TensorHandle(x.to(torch.float32 if t == tl.float32 else torch.float16).numpy(), t)
        return orig(self, src, dst_type, rounding_mode)
    create_fp_to_fp._fp8_by_torch = True
    it.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def _inputs(b, h, g, n, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(b, heads, n, d, generator=gen).to(dtype)  # noqa: E731
    return mk(h), mk(g), mk(g), mk(h)


def _grads(q, k, v, do, causal, backend):
    """o and the gradients; backend: a name, or a backend object (the triton one of the fixture's
    module, whose forced_configs() and GRID_YZ_MAX it then sees)."""
    from tpattn.attention import attention
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, causal, backend=backend)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def check(tf, b, h, g, n, d, causal, dtype=torch.float16, config=None):
    """o, dq, dk, dv against float64 with tests/test_gpu_backward_fused.py's rule: at most 3x the
    torch reference's own error in the same dtype, plus a small absolute term."""
    q, k, v, do = _inputs(b, h, g, n, d, dtype)
    want = _grads(q.double(), k.double(), v.double(), do.double(), causal, "reference")
    low = _grads(q, k, v, do, causal, "reference")
    if config is None:
        got = _grads(q, k, v, do, causal, tf.TritonBackend())
    else:
        with tf.forced_configs(*config):
            got = _grads(q, k, v, do, causal, tf.TritonBackend())
    for name, w, t, x in zip(("o", "dq", "dk", "dv"), want, low, got):
        assert x.dtype == dtype and x.shape == w.shape, name
        assert torch.isfinite(x).all(), name
        err = (x.double() - w).abs().max().item()
        ref_err = (t.double() - w).abs().max().item()
        floor = 1e-3 * w.abs().max().item() + 1e-5
        assert err <= 3 * ref_err + floor, f"{name}: {err:.3g} > 3 x {ref_err:.3g} + {floor:.2g}"


@interp
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("i", range(6))
def test_every_autotune_config(tf, i, d):
    """Each config of the autotune sets (forward, dK/dV, dQ; a set of fewer than 6 from its start
    again), so that every tile size's masks are checked: N = 1 (one row), 129 and 300 (partial last
    tiles of 64 and 128), GQA, B = 2."""
    K = tf.kernels()
    assert all(len(K.TUNE[w][d]) <= 6 for w in ("fwd", "kv", "q"))
    config = [K.TUNE[w][d][i % len(K.TUNE[w][d])] for w in ("fwd", "kv", "q")]
    for n in (1, 129, 300):
        for causal in (False, True):
            check(tf, 2, 4, 2, n, d, causal, config=config)


@interp
@pytest.mark.parametrize("d", [8, 32, 40, 80, 96, 160, 192, 256])
def test_head_dims(tf, d):
    """Head dims other than 64 and 128: tiles BLOCK_D wide (the next power of two), the columns past
    d loaded as zeros and never stored, against float64; causal and not, GQA, a partial last tile;
    o written into a view whose neighbouring head's columns stay untouched."""
    K = tf.kernels()
    assert K.block_d(d) >= max(16, d) and K.block_d(d) & (K.block_d(d) - 1) == 0
    for causal in (False, True):
        check(tf, 1, 4, 2, 70, d, causal)
    # o written into a view of a wider buffer: the columns of the next head stay untouched
    q, k, v, _ = _inputs(1, 2, 2, 33, d, torch.float16)
    buf = torch.full((1, 33, 2, d + 8), 7.0, dtype=torch.float16)
    out = buf[..., :d].permute(0, 2, 1, 3)
    tf.TritonBackend().forward(q, k, v, True, out=out)
    assert torch.equal(buf[..., d:], torch.full_like(buf[..., d:], 7.0))


@interp
@pytest.mark.parametrize("d,n", [(40, 129), (136, 129), (8, 37)])
def test_padded_head_dims_never_read_past_d(tf, d, n):
    """q, k, v and dO as views of wider rows whose next 8 columns hold NaN and inf (a layer's QKV
    GEMM output, with the next head beside each): with the column masks, every tile (whole ones too)
    reads d columns only, so o, the logsumexp and the gradients are finite and match float64; the
    gradients' views leave those columns zero."""
    from tpattn.attention import attention
    b, h, g = 1, 4, 2
    q, k, v, do = _inputs(b, h, g, n, d, torch.float16)

    def wide(t):
        buf = torch.full((*t.shape[:-1], d + 8), float("nan"), dtype=t.dtype)
        buf[..., d + 4:] = float("inf")
        buf[..., :d] = t
        return buf
    want = _grads(q.double(), k.double(), v.double(), do.double(), True, "reference")
    low = _grads(q, k, v, do, True, "reference")
    bufs = [wide(t).requires_grad_(True) for t in (q, k, v)]
    views = [t[..., :d] for t in bufs]
    assert views[0].stride(-2) == d + 8
    o = attention(*views, True, backend=tf.TritonBackend())
    o.backward(wide(do)[..., :d])
    got = [o.detach()] + [t.grad[..., :d] for t in bufs]
    for t in bufs:
        assert torch.equal(t.grad[..., d:], torch.zeros_like(t.grad[..., d:]))
    _, lse = tf.TritonBackend().forward_for_backward(*(t.detach() for t in views), True)
    assert torch.isfinite(lse).all()
    for name, w, t, x in zip(("o", "dq", "dk", "dv"), want, low, got):
        assert torch.isfinite(x).all(), name
        err, ref_err = (x.double() - w).abs().max().item(), (t.double() - w).abs().max().item()
        assert err <= 3 * ref_err + 1e-3 * w.abs().max().item() + 1e-5, (name, err, ref_err)


@interp
@pytest.mark.parametrize("n", [17, 127, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_shapes(tf, n, causal):
    check(tf, 1, 2, 2, n, 64, causal)


@interp
@pytest.mark.parametrize("h,g", [(8, 8), (8, 2), (8, 1)])
def test_gqa(tf, h, g):
    check(tf, 1, h, g, 70, 64, True)


@interp
def test_bf16(tf):
    check(tf, 2, 4, 2, 130, 64, True, torch.bfloat16)
    check(tf, 1, 2, 1, 100, 128, False, torch.bfloat16)


@interp
@pytest.mark.parametrize("causal", [False, True])
def test_logsumexp_and_output_unchanged(tf, causal):
    q, k, v, _ = _inputs(2, 4, 2, 150, 64, torch.float16)
    b = tf.TritonBackend()
    plain = b.forward(q, k, v, causal)
    o, lse = b.forward_for_backward(q, k, v, causal)
    assert torch.equal(o, plain)
    s = torch.matmul(q.float(), k.float().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(64)
    if causal:
        s = s.masked_fill(torch.ones(150, 150, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-3, rtol=1e-4)


@interp
def test_strided_views_read_in_place(tf):
    """q, k, v as the layer makes them (views of one [B, N, h + 2g, d] tensor), o a strided view:
    the same bits as contiguous copies, forward and backward."""
    b_, n, h, g, d = 2, 90, 4, 2, 64
    qkv = torch.randn(b_, n, h + 2 * g, d).half()
    q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split([h, g, g], dim=2))
    assert not q.is_contiguous()
    be = tf.TritonBackend()
    want = be.forward(q.contiguous(), k.contiguous(), v.contiguous(), True)
    o_rows = torch.empty(b_, n, h, d, dtype=torch.float16)
    out = o_rows.permute(0, 2, 1, 3)
    be.forward(q, k, v, True, out=out)
    assert torch.equal(out, want)
    do = torch.randn(b_, h, n, d).half()
    got = _grads(q, k, v, do, True, be)
    ref = _grads(q.contiguous(), k.contiguous(), v.contiguous(), do, True, be)
    assert all(torch.equal(x, y) for x, y in zip(got, ref))


@interp
def test_batches_split_over_the_grid_limit(tf, monkeypatch):
    """More batch * heads than the grid's y dimension takes: the calls split by batch."""
    q, k, v, do = _inputs(3, 2, 1, 40, 64, torch.float16)
    want = _grads(q, k, v, do, True, tf.TritonBackend())
    monkeypatch.setattr(tf, "GRID_YZ_MAX", 2)  # one batch (2 heads) per launch
    got = _grads(q, k, v, do, True, tf.TritonBackend())
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@interp
def test_deterministic_bits(tf):
    q, k, v, do = _inputs(1, 4, 1, 100, 64, torch.float16)
    a = _grads(q, k, v, do, True, tf.TritonBackend())
    b = _grads(q, k, v, do, True, tf.TritonBackend())
    assert all(torch.equal(x, y) for x, y in zip(a, b))
