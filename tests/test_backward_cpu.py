"""The backward pass on CPU (no GPU needed; CI runs these).

- The reference backend's gradients pass torch.autograd.gradcheck in float64 (causal and not, GQA),
  and equal the closed-form math of tpattn/attention/autograd.py that the naive kernels implement
  (dV = Pᵀ dO, dP = dO Vᵀ, D = rowsum(dO∘O), dS = P∘(dP − D), dQ = dS K/√d, dK = dSᵀ Q/√d, K/V heads
  summed over their group).
- The naive backward's launches (launch replaced by a recorder): each kernel exists in its file with
  the arguments its parameters need, in order, with the group, the in-place dS, grids within y, z <=
  65 535 for more heads than that, and its "bwd_" timing sections.
- The naive backward's kernels themselves, compiled for the host with a few shims (blockIdx and friends
  as globals; every thread of every block run in turn) and driven by NaiveBackend.backward through the
  real launch arguments, with the grid limits lowered so the stride loops over heads and rows run:
  f32 and bf16 (the f16 conversions are PTX) against float64 autograd.
- Refusals in one line: CPU tensors, head dims out of range, a dtype the backend lacks, a backend
  without a backward.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest
import torch

from tpattn.attention import Backend, CudaBackend, attention, get_backend, naive, tiled
from tpattn.attention.reference import causal_mask
from tpattn.cuda import kernel_source
from tpattn.errors import ConfigError
from tpattn.timing import Timer, recording

HAS_CPP = shutil.which("cpp") is not None or shutil.which("nvcc") is not None
GXX = shutil.which("g++")


def qkv(b, h, g, n, d, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=gen).to(dtype), torch.randn(b, g, n, d, generator=gen).to(dtype),
            torch.randn(b, g, n, d, generator=gen).to(dtype))


def ref_grads(q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, causal, backend="reference")
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def formula_grads(q, k, v, o, do, causal):
    """The math of autograd.py, one line each, in float64, as the naive kernels compute it (D from O)."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # query head i reads K/V head i // group
    s = q @ kr.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(causal_mask(n, q.device), float("-inf"))
    p = torch.softmax(s, -1)
    dv = p.transpose(-1, -2) @ do                                  # dV = Pᵀ dO
    dp = do @ vr.transpose(-1, -2)                                 # dP = dO Vᵀ
    dsum = (do * o).sum(-1, keepdim=True)                          # D = rowsum(dO ∘ O)
    ds = p * (dp - dsum)                                           # dS = P ∘ (dP − D)
    dq = ds @ kr / math.sqrt(d)                                    # dQ = dS K / √d
    dk = ds.transpose(-1, -2) @ q / math.sqrt(d)                   # dK = dSᵀ Q / √d
    fold = lambda t: t.view(b, k.shape[1], group, n, d).sum(2)     # noqa: E731  a K/V head: its group's sum
    return dq, fold(dk), fold(dv)


GQA = [(2, 2), (4, 2), (4, 1)]  # (query heads, K/V heads)


# ---- the reference's gradients: gradcheck, and the math the kernels implement ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", GQA)
def test_reference_gradcheck_float64(h, g, causal):
    q, k, v = (t.requires_grad_(True) for t in qkv(2, h, g, 5, 3, seed=h + g))
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, causal, backend="reference"), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", GQA)
@pytest.mark.parametrize("n", [1, 7, 33])
def test_reference_gradients_are_the_math_the_kernels_implement(h, g, n, causal):
    q, k, v = qkv(2, h, g, n, 8, seed=n)
    do = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    o, *auto = ref_grads(q, k, v, do, causal)
    for name, a, f in zip(("dq", "dk", "dv"), auto, formula_grads(q, k, v, o, do, causal)):
        assert torch.allclose(a, f, rtol=1e-10, atol=1e-12), name


# ---- the naive backward's launches, recorded ----

@pytest.fixture
def launches(monkeypatch):
    """NaiveBackend (and tiled's backward through it) on CPU tensors; every launch recorded."""
    calls = []
    for mod in (naive, tiled):
        monkeypatch.setattr(mod, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                            calls.append((source, name, grid, block, args)))
    suffix = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
    monkeypatch.setattr(CudaBackend, "kernel_suffix", lambda self, q: suffix[q.dtype])
    return calls


def _run_backward(backend, q, k, v, causal):
    o, do = torch.zeros_like(q), torch.zeros_like(q)
    return get_backend(backend).backward(q, k, v, o, None, do, causal)


@pytest.mark.skipif(not HAS_CPP, reason="no C preprocessor (cpp or nvcc) here")
@pytest.mark.parametrize("backend", ["naive", "tiled"])
@pytest.mark.parametrize("h,g", [(6, 6), (6, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_backward_launches(launches, backend, h, g, dtype):
    from test_kernel_args import check_launch
    if backend == "tiled" and dtype == torch.float32:
        pytest.skip("tiled has no fp32")
    q, k, v = qkv(2, h, g, 20, 32, dtype)
    timer = Timer(torch.device("cpu"))
    with recording(timer):
        dq, dk, dv = _run_backward(backend, q, k, v, True)
    names = [c[1].rsplit("_", 1)[0] for c in launches]
    assert names == ["qkKernel", "softmaxKernel", *naive.BACKWARD_KERNELS]
    for c in launches:
        check_launch(*c)
        assert c[0] == (naive.SOURCE if c[1].startswith(("qk", "softmax")) else naive.BACKWARD_SOURCE)
    by = {c[1].rsplit("_", 1)[0]: c for c in launches}
    group = np.int32(h // g)
    for name in ("qkKernel", "dvKernel", "dpKernel", "dqKernel", "dkKernel"):
        assert by[name][4][-1] == group, name
    assert by["dvKernel"][4][3] == by["dkKernel"][4][3] == 2 * g      # K/V heads: B * g
    assert int(by["dsKernel"][4][1]) == int(by["dsKernel"][4][3])     # dS written over dP
    assert int(by["dsKernel"][4][1]) == int(by["dqKernel"][4][0]) == int(by["dkKernel"][4][0])
    assert int(by["dvKernel"][4][2]) == dv.data_ptr() and int(by["dqKernel"][4][2]) == dq.data_ptr()
    assert int(by["dkKernel"][4][2]) == dk.data_ptr()
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dq.dtype == dtype
    assert set(timer.collect()) == {"bwd_qk", "bwd_softmax", "bwd_dv", "bwd_dp", "bwd_rowdot", "bwd_ds",
                                    "bwd_dq", "bwd_dk"}


def test_backward_grids_stay_within_limits(launches):
    """70 000 heads of one row: every y and z within 65 535 (the kernels loop over the rest)."""
    q, k, v = qkv(1, 70_000, 35_000, 1, 8, torch.float16)
    _run_backward("naive", q, k, v, False)
    assert len(launches) == 8
    for source, name, grid, block, args in launches:
        assert all(1 <= x <= 65_535 for x in grid[1:]) and 1 <= grid[0] <= 2**31 - 1, (name, grid)
        assert block[0] * block[1] * block[2] <= 1024


def test_backward_refuses_mismatched_gradient(launches):
    q, k, v = qkv(1, 2, 1, 8, 16, torch.float16)
    with pytest.raises(ValueError, match="do ") as e:
        get_backend("naive").backward(q, k, v, torch.zeros_like(q), None, torch.zeros(1, 2, 8, 8).half(), False)
    assert "\n" not in str(e.value) and not launches


def test_forward_for_backward_saves_nothing(launches):
    q, k, v = qkv(1, 2, 1, 8, 16, torch.float16)
    for backend in ("naive", "tiled"):
        o, saved = get_backend(backend).forward_for_backward(q, k, v, False)
        assert saved is None and o.shape == q.shape


# ---- the kernels themselves, run on the host ----

_SHIM = r"""
#include <math.h>
#include <string.h>
struct tp_dim3 { unsigned int x, y, z; };
extern "C" { tp_dim3 blockIdx, threadIdx, blockDim, gridDim; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static  /* softmaxKernel compiles, but is never run here (it syncs threads) */
#define asm(...) (void)0
static inline void __syncthreads() {}
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
"""


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


_C = {"ptr": ctypes.c_void_p, "int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float}


class HostKernels:
    """kernels/`source` compiled for the host: launch() runs every thread of every block in turn (the
    kernels it runs have no __syncthreads and no shared memory)."""

    def __init__(self, source, tmp_path):
        from test_kernel_args import signatures
        src = tmp_path / ("host_" + source.replace(".cu", ".cpp"))
        src.write_text(_SHIM + kernel_source(source))
        lib = tmp_path / ("host_" + source.replace(".cu", ".so"))
        r = subprocess.run([GXX, "-O1", "-shared", "-fPIC", "-w", str(src), "-o", str(lib)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        self.lib = ctypes.CDLL(str(lib))
        self.sig = signatures(source)
        self.dims = {n: _Dim3.in_dll(self.lib, n) for n in ("blockIdx", "threadIdx", "blockDim", "gridDim")}

    def launch(self, name, grid, block, args):
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = [_C[k] for k in self.sig[name]], None
        cargs = [int(a) if isinstance(a, (np.uint64, np.int32, np.int64)) else float(a) for a in args]
        d = self.dims
        d["gridDim"].x, d["gridDim"].y, d["gridDim"].z = grid
        d["blockDim"].x, d["blockDim"].y, d["blockDim"].z = block
        for bz in range(grid[2]):
            for by in range(grid[1]):
                for bx in range(grid[0]):
                    d["blockIdx"].x, d["blockIdx"].y, d["blockIdx"].z = bx, by, bz
                    for tz in range(block[2]):
                        for ty in range(block[1]):
                            for tx in range(block[0]):
                                d["threadIdx"].x, d["threadIdx"].y, d["threadIdx"].z = tx, ty, tz
                                fn(*cargs)


def _view(addr, count, dtype):
    """count elements of dtype at host address addr, as a tensor sharing that memory."""
    nbytes = count * torch.tensor([], dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(int(addr)), dtype=dtype, count=count)


def _host_softmax(args):
    """softmaxKernel's result (it syncs threads, so it is not run here): the reference's rounding."""
    s_ptr, p_ptr, rows, n, causal = args
    rows, n = int(rows), int(n)
    dtype = _host_softmax.dtype
    s = _view(s_ptr, rows * n, dtype).view(rows, n).float()
    if causal:
        s = s.masked_fill(causal_mask(n, s.device).repeat(rows // n, 1), float("-inf"))
    _view(p_ptr, rows * n, dtype).view(rows, n).copy_(torch.softmax(s, -1).to(dtype))


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    if GXX is None or not HAS_CPP:
        pytest.skip("no host C++ compiler (g++) or C preprocessor here")
    tmp = tmp_path_factory.mktemp("host_kernels")
    return {s: HostKernels(s, tmp) for s in (naive.SOURCE, naive.BACKWARD_SOURCE)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_kernels_on_the_host(host, monkeypatch, dtype, h, g, causal):
    suffix = {torch.bfloat16: "bf16", torch.float32: "f32"}
    monkeypatch.setattr(CudaBackend, "kernel_suffix", lambda self, q: suffix[q.dtype])
    monkeypatch.setattr(naive, "GRID_YZ_MAX", 3)  # heads and rows beyond the grid: the stride loops run
    monkeypatch.setattr(naive, "GRID_X_MAX", 2)

    def run(source, name, device, grid, block, args, shared_mem=0):
        if name.startswith("softmaxKernel"):
            _host_softmax.dtype = dtype
            _host_softmax(args)
        else:
            host[source].launch(name, grid, block, args)
    monkeypatch.setattr(naive, "launch", run)
    b, n, d = 2, 13, 12
    q, k, v = qkv(b, h, g, n, d, dtype, seed=h * 10 + g + causal)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = attention(qq, kk, vv, causal, backend="naive")   # the forward's kernels too (pv on the host)
    o.backward(do)
    got = (qq.grad, kk.grad, vv.grad)
    o64, *exact = ref_grads(q.double(), k.double(), v.double(), do.double(), causal)
    if dtype == torch.float32:
        assert (o.double() - o64).abs().max() < 1e-5
        for name, a, r in zip(("dq", "dk", "dv"), got, exact):
            assert (a.double() - r).abs().max() < 1e-5 * (1 + r.abs().max()), name
    else:
        from backward_check import check_rule
        _, *low = ref_grads(q, k, v, do, causal)
        check_rule(got, low, exact, dtype, f"host bf16 h={h} g={g} causal={causal}")
    if causal:  # row 0 attends to key 0 only: O_0 = V_0, so dS_00 = 0 exactly and dQ_0 = 0 exactly
        assert (qq.grad[:, :, 0] == 0).all()


# ---- refusals, one line each ----

def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("backend", ["naive", "tiled"])
def test_cpu_tensors_refused(backend):
    q, k, v = qkv(1, 2, 1, 4, 16, torch.float16)
    with pytest.raises(ConfigError) as e:
        get_backend(backend).backward(q, k, v, q, None, q, False)
    assert _one_line(e) == f"backend='{backend}' needs CUDA tensors; use backend='reference' on CPU"  # the API's names
    assert e.value.cli_message == f"--kernel {backend} needs CUDA tensors; use --kernel reference on CPU"
    with pytest.raises(ConfigError) as e:
        attention(q.requires_grad_(True), k, v, False, backend=backend)
    assert "needs CUDA tensors" in _one_line(e)


class _OnCuda:
    """Stands for a CUDA tensor up to the checks (no GPU here): shape, dtype, device."""

    def __init__(self, shape, dtype=torch.float16):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cuda", 0)


@pytest.mark.parametrize("backend,d,match", [("naive", 300, r"supports head dims 1\.\.256 \(got 300\)"),
                                             ("naive", 0, r"supports head dims 1\.\.256 \(got 0\)"),
                                             ("tiled", 12, r"multiples of 8 up to 256 \(got 12\)"),
                                             ("tiled", 264, r"multiples of 8 up to 256 \(got 264\)")])
def test_head_dim_out_of_range_refused(backend, d, match):
    t = _OnCuda((1, 2, 4, d))
    with pytest.raises(ConfigError, match=match) as e:
        get_backend(backend).backward(t, t, t, t, None, t, False)
    _one_line(e)


def test_tiled_backward_refuses_fp32():
    t = _OnCuda((1, 2, 4, 64), torch.float32)
    with pytest.raises(ConfigError, match=r"backend='tiled' supports fp16, bf16 \(got torch.float32\)") as e:
        get_backend("tiled").backward(t, t, t, t, None, t, False)
    _one_line(e)


class _NoBackward(Backend):
    name = "nobackward"

    def forward(self, q, k, v, causal):
        return q.clone()


def test_backend_without_backward_refused():
    q, k, v = qkv(1, 2, 1, 4, 8)
    with pytest.raises(ConfigError) as e:
        attention(q.requires_grad_(True), k, v, False, backend=_NoBackward())
    assert _one_line(e).startswith("backend='nobackward' has no backward pass")
    with pytest.raises(ConfigError) as e:
        _NoBackward().backward(q, k, v, q, None, q, False)
    assert "has no backward pass" in _one_line(e)


def test_naive_and_tiled_have_a_backward():
    for name in ("naive", "tiled"):
        cls = type(get_backend(name))
        assert cls.backward is not Backend.backward and cls.forward_for_backward is not Backend.forward_for_backward
    assert "naive" in (tiled.TiledBackend.backward.__doc__ or "")
