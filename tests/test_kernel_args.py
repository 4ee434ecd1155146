"""Every CUDA launch passes the arguments its kernel takes (CPU, no GPU needed).

The kernels' parameter lists are read from kernels/*.cu after the C preprocessor (the kernels are
defined by macros); each backend's forward() runs on CPU tensors with `launch` replaced by a
recorder, and every recorded launch is checked against its kernel: the name exists in that file,
as many arguments as parameters, each of the numpy type the parameter needs (a pointer: uint64,
int: int32, long long: int64, float: float32). A launch that passes one argument too few or of the
wrong width would read garbage on the GPU; this catches it here. The values that say which K/V
head a query head reads (group, K/V strides) are checked too, for grouped-query shapes.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from tpattn.attention import CudaBackend, fused, naive, tiled
from tpattn.config import ConfigError
from tpattn.cuda import TensorMap, kernel_source

CPP = shutil.which("cpp")
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(CPP is None and NVCC is None, reason="no C preprocessor (cpp or nvcc) here")

_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^()]*\)\s*)?(\w+)\s*\(([^)]*)\)')
_NP = {"ptr": np.uint64, "int": np.int32, "long long": np.int64, "float": np.float32, "tmap": TensorMap}


def _param_kind(p: str) -> str:
    p = " ".join(p.replace("__restrict__", "").split())
    if "tw_tmap" in p:  # a TMA tensor map, by value
        return "tmap"
    if "*" in p:
        return "ptr"
    for kind in ("long long", "int", "float"):
        if p.startswith(kind + " ") or p.startswith("const " + kind + " "):
            return kind
    raise AssertionError(f"unknown parameter type: {p!r}")


_signatures: dict[str, dict[str, list[str]]] = {}


def signatures(filename: str) -> dict[str, list[str]]:
    """kernel name -> parameter kinds, for every extern "C" kernel of kernels/`filename`."""
    if filename not in _signatures:
        src = kernel_source(filename)
        cmd = [CPP, "-P"] if CPP else [NVCC, "-E", "-x", "cu", "-"]
        r = subprocess.run(cmd, input=src, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        _signatures[filename] = {m.group(1): [_param_kind(p) for p in m.group(2).split(",")]
                                 for m in _KERNEL.finditer(text)}
        assert _signatures[filename], f"no kernels found in {filename}"
    return _signatures[filename]


@pytest.fixture
def launches(monkeypatch):
    """Backends run on CPU tensors; every launch is recorded (source, name, grid, block, args)."""
    calls = []

    def record(source, name, device, grid, block, args, shared_mem=0):
        calls.append((source, name, grid, block, args))
    for mod in (naive, tiled, fused):
        monkeypatch.setattr(mod, "launch", record)

    class Prepared:  # fusedw's launches, packed once and then called
        def __init__(self, source, name, device, grid, block, args, shared_mem=0):
            record(source, name, device, grid, block, args, shared_mem)

        def __call__(self):
            pass
    monkeypatch.setattr(fused, "Prepared", Prepared)
    monkeypatch.setattr(fused, "_prepared", {})
    suffix = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
    monkeypatch.setattr(CudaBackend, "kernel_suffix", lambda self, q: suffix[q.dtype])
    monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    return calls


def check_launch(source, name, grid, block, args):
    sig = signatures(source)
    assert name in sig, f"{name} is not a kernel of kernels/{source}"
    kinds = sig[name]
    assert len(args) == len(kinds), f"{name}: {len(args)} arguments for {len(kinds)} parameters {kinds}"
    for i, (a, kind) in enumerate(zip(args, kinds)):
        assert type(a) is _NP[kind], f"{name} argument {i}: {type(a).__name__} for a {kind} parameter"
    assert all(1 <= g for g in grid) and all(1 <= b for b in block)


def qkv(b, h, g, n, d, dtype=torch.float16):
    return (torch.randn(b, h, n, d).to(dtype), torch.randn(b, g, n, d).to(dtype), torch.randn(b, g, n, d).to(dtype))


@pytest.mark.parametrize("h,g", [(6, 6), (6, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_naive_launches(launches, h, g, dtype):
    q, k, v = qkv(2, h, g, 20, 32, dtype)
    naive.NaiveBackend().forward(q, k, v, True)
    assert [c[1].split("_")[0] for c in launches] == ["qkKernel", "softmaxKernel", "pvKernel"]
    for c in launches:
        check_launch(*c)
    assert launches[0][4][-1] == h // g and launches[2][4][-1] == h // g  # group: query heads per K/V head


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("h,g,d", [(4, 4, 64), (4, 2, 128), (4, 1, 80)])
def test_tiled_launches(launches, monkeypatch, hopper, h, g, d):
    monkeypatch.setattr(tiled, "hopper_passes", lambda d, dev: hopper and d in tiled.HOPPER_HEAD_DIMS)
    q, k, v = qkv(2, h, g, 300, d)
    tiled.TiledBackend().forward(q, k, v, False)
    assert len(launches) == 3
    for c in launches:
        check_launch(*c)
    group = np.int32(h // g)
    assert launches[0][4][-1] == group and launches[2][4][-1] == group


@pytest.mark.parametrize("cc,wide,cfg", [((8, 0), True, None), ((9, 0), True, "fusedh_{suf}_d{d}"),
                                          ((9, 0), False, None)])
@pytest.mark.parametrize("h,g", [(4, 4), (4, 2), (4, 1)])
def test_fused_launches_contiguous(launches, monkeypatch, cc, wide, cfg, h, g):
    monkeypatch.setattr(fused, "_device_info", lambda dev: (1 if wide else 10**6, cc))
    if cfg:
        monkeypatch.setenv("TPATTN_FUSED_CFG", cfg)
    b, n, d = 2, 300, 128
    q, k, v = qkv(b, h, g, n, d)
    fused.FusedBackend().forward(q, k, v, True)
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    assert name.startswith("fusedh_" if cc == (9, 0) and wide else "fused2_")
    H, group = args[11], args[12]
    assert (H, group) == (h, h // g)
    assert tuple(args[13:16]) == (h * n * d, n * d, d)      # Q: batch, head, row strides
    assert tuple(args[16:19]) == (g * n * d, n * d, d)      # K and V: their own
    assert tuple(args[19:22]) == (h * n * d, n * d, d)      # O


@pytest.mark.parametrize("h,g", [(4, 4), (4, 2), (4, 1)])
def test_fused_launch_reads_the_packed_projection_in_place(launches, monkeypatch, h, g):
    """The layer's QKV GEMM output [B, N, h + 2g, d]: q, k and v are strided views of it, which the
    fused kernel reads in place (pointers into the one buffer, its strides)."""
    monkeypatch.setattr(fused, "_device_info", lambda dev: (1, (9, 0)))
    monkeypatch.setenv("TPATTN_FUSED_CFG", "fusedh_{suf}_d{d}")
    b, n, d = 2, 130, 64
    qkv_out = torch.randn(b, n, h + 2 * g, d).half()
    q, k, v = (t.permute(0, 2, 1, 3) for t in qkv_out.split([h, g, g], dim=2))
    o_rows = torch.empty(b, n, h, d).half()
    fused.FusedBackend().forward(q, k, v, False, out=o_rows.permute(0, 2, 1, 3))
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    base, el = qkv_out.data_ptr(), 2
    assert (int(args[0]), int(args[1]), int(args[2])) == (base, base + h * d * el, base + (h + g) * d * el)
    assert int(args[3]) == o_rows.data_ptr()
    row = (h + 2 * g) * d
    assert tuple(args[13:16]) == (n * row, d, row) and tuple(args[16:19]) == (n * row, d, row)
    assert tuple(args[19:22]) == (n * h * d, d, h * d)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", [(4, 4), (4, 1)])
def test_fused_ws_launch(launches, monkeypatch, causal, h, g):
    """fusedw (warp-specialized, TMA), the default on compute capability 9.0: tensor maps of Q, K and V
    over (D, N, heads, B) with their byte strides, one grid dimension over (query tile, head) pairs,
    persistent (one block per SM walking the tiles)."""
    monkeypatch.setattr(fused, "_device_info", lambda dev: (40, (9, 0)))  # the default there, for wide calls
    monkeypatch.delenv("TPATTN_FUSED_GRID", raising=False)
    b, n, d = 2, 1000, 128
    q, k, v = qkv(b, h, g, n, d)
    fused.FusedBackend().forward(q, k, v, causal)
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    assert name == "fusedw_f16_d128" and block == (384, 1, 1)
    tiles = 8 * b * h  # ceil(1000 / 128) query tiles per head
    assert grid == (40, 1, 1) and tiles > 40
    # causal: the blocks ask a counter (a pair of int32 zeros in device memory) for their tiles
    counter, hg = int(args[-1]), int(args[-2])
    assert (counter != 0) == causal
    assert hg == (min(b * h, 10) if causal else 1)  # causal: heads in groups of ceil(2 * 40 SMs / 8 tiles)
    if causal:
        pool = fused._counters[str(q.device)]
        # the counter and padding (16 bytes), then two 16-byte tile-number slots for each of the 40
        # blocks, inside the pool
        assert pool.data_ptr() <= counter and counter + 16 + 32 * 40 <= pool.data_ptr() + pool.numel() * 4
        assert (counter - pool.data_ptr()) % 256 == 0
    qm, km, vm = args[:3]
    assert (qm.address, km.address, vm.address) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert qm.dims == (d, n, h, b) and km.dims == (d, n, g, b) and qm.box == (64, 128)
    assert qm.strides == (d * 2, n * d * 2, h * n * d * 2)
    assert km.strides == (d * 2, n * d * 2 if g > 1 else 16, g * n * d * 2)  # one K/V head: never stepped over
    assert (args[11], args[12]) == (h, h // g)


@pytest.mark.parametrize("kernel", ["ws", "red"])
def test_five_product_backward_and_the_rings_dq_sum_launches(launches, monkeypatch, kernel):
    """The five-product backward (hbwd_pre, hbwd5w_kv or hbwd5_kv, hbwd_dq_out) reads its own rows' L and
    Dl (ldn = N, qoff = 0); the ring's sum over pieces runs hbwd_pre once, each piece's kernel at its
    (ldn, qoff) into the one dQ sum, and hbwd_dq_out once."""
    monkeypatch.setattr(fused, "_device_info", lambda dev: (40, (9, 0)))
    monkeypatch.setenv("TPATTN_FUSED_BWD5", kernel)
    monkeypatch.setattr(fused, "_prepared_bwd", {})
    b, h, g, n, d = 1, 4, 2, 256, 64
    q, k, v = qkv(b, h, g, n, d)
    o, do = torch.randn(b, h, n, d).half(), torch.randn(b, h, n, d).half()
    lse = torch.zeros(b, h, n)
    be = fused.FusedBackend()
    be.backward(q, k, v, o, lse, do, True)
    kv = "hbwd5w_kv_f16_d64" if kernel == "ws" else "hbwd5_kv_f16_d64"
    assert [c[1] for c in launches] == ["hbwd_pre_f16_d64", kv, "hbwd_dq_out_f16_d64"]
    for c in launches:
        check_launch(*c)
    assert tuple(int(x) for x in launches[1][4][-2:]) == (n, 0)
    assert int(launches[1][4][8]) == int(launches[0][4][3])  # (both kernels: q, k, v, do, L, Dl, dk, dv, dqa, ...)
    launches.clear()
    sums = be.dq_sum(q, o, lse, do)
    m = n // 2
    dk, dv = be.backward_summing(q[:, :, m:], k[:, :, :m], v[:, :, :m], do[:, :, m:], False, sums, n, m)
    be.backward_summing(q.reshape(b, 2 * h, m, d), k[:, :, :m], v[:, :, :m], do.reshape(b, 2 * h, m, d), False, sums, m, 0)
    dq = be.dq_of_sum(sums)
    assert [c[1] for c in launches] == ["hbwd_pre_f16_d64", kv, kv, "hbwd_dq_out_f16_d64"]
    for c in launches:
        check_launch(*c)
    assert tuple(int(x) for x in launches[1][4][-2:]) == (n, m) and tuple(int(x) for x in launches[2][4][-2:]) == (m, 0)
    assert {int(c[4][8]) for c in launches[1:3]} == {sums.dqa.data_ptr()} == {int(launches[0][4][3]), int(launches[3][4][0])}
    assert {int(c[4][4]) for c in launches[1:3]} == {sums.lse.data_ptr()}  # L, Dl: the sum's, not copies
    assert {int(c[4][5]) for c in launches[1:3]} == {sums.dl.data_ptr()} == {int(launches[0][4][2])}
    assert dk.shape == dv.shape == (b, g, m, d) and dq.shape == q.shape and dq.dtype == q.dtype
    with pytest.raises(ValueError, match="not tile-aligned"):
        be.backward_summing(q[:, :, 32:], k[:, :, 32:], v[:, :, 32:], do[:, :, 32:], False, sums, n, 32)


@pytest.mark.parametrize("d,keys", [(32, 128), (80, 128), (96, 128), (160, 64), (192, 64), (256, 64)])
def test_fused_ws_other_head_dims(launches, monkeypatch, d, keys):
    """The head dims other than 64 and 128: fusedw of fused_ws_dims.cu even for a call of few tiles
    (there is no fused2 for them), the tensor maps over the head dim itself (the kernel computing with
    the next of 64, 128, 192 reads zeros past it), K and V in boxes of the kernel's key tile (64 keys
    above 128 columns); refused on compute capability 8.x in one line."""
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    monkeypatch.delenv("TPATTN_FUSED_GRID", raising=False)
    q, k, v = qkv(1, 2, 1, 100, d)
    fused.FusedBackend().forward(q, k, v, True)
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    assert source == "fused_ws_dims.cu" and name == f"fusedw_f16_d{d}" and block == (384, 1, 1) and grid == (2, 1, 1)
    assert args[0].dims == (d, 100, 2, 1) and args[1].dims == (d, 100, 1, 1)
    assert args[0].box == (64, 128) and args[1].box == args[2].box == (64, keys)
    assert float(args[7]) == pytest.approx(math.log2(math.e) / math.sqrt(d))  # the scale of d, not of the tile
    monkeypatch.setattr(fused, "_device_info", lambda dev: (108, (8, 0)))
    with pytest.raises(ConfigError, match=f"head dim {d} runs on compute capability 9.0 only"):
        fused.FusedBackend().forward(q, k, v, True)


def test_fused_other_head_dims_refusals(launches, monkeypatch):
    """At the head dims fusedw alone is built for: a TPATTN_FUSED_CFG naming another kernel, a GPU of
    another compute capability (from the config, and in the prefill's choice, which takes the torch path
    there), and a backward's mismatched out= (checked before the Triton rung is handed the call) are each
    refused in one line or fall back."""
    from types import SimpleNamespace

    from tpattn import decode
    from tpattn.config import Config
    from tpattn.errors import FlagError
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    for cfg in ("fusedh_{suf}_d{d}", "fused2_{suf}_d{d}_w4_m1_c64"):
        monkeypatch.setenv("TPATTN_FUSED_CFG", cfg)
        with pytest.raises(ConfigError, match=r"at head dim 96 only fusedw_f16_d96 is built; unset it"):
            fused.kernel_for(96, "f16", (9, 0))
    monkeypatch.delenv("TPATTN_FUSED_CFG")
    monkeypatch.setattr(fused.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fused.torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr("tpattn.attention.cupy_available", lambda: True)
    with pytest.raises(FlagError, match=r"^--kernel fused at head dim 96 runs on compute capability 9.0 only "
                                        r"\(this GPU has 8.0\); use --kernel triton$"):
        fused.FusedBackend().check_supported(Config(device="cuda", kernel="fused", dtype="fp16", head_dim=96))
    fused.FusedBackend().check_supported(Config(device="cuda", kernel="fused", dtype="fp16", head_dim=128))
    monkeypatch.setattr(decode, "cupy_available", lambda: True)
    monkeypatch.setattr(fused, "_device_info", lambda dev: (108, (8, 0)))  # (what the prefill's choice asks)
    q = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.float16, shape=(1, 2, 8, 96))
    assert not decode.fused_prefix_fits(q)
    assert decode.fused_prefix_fits(SimpleNamespace(device=q.device, dtype=q.dtype, shape=(1, 2, 8, 128)))
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    monkeypatch.setattr(fused.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert decode.fused_prefix_fits(q)
    q, k, v = qkv(1, 2, 1, 64, 96)
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.zeros(1, 2, 64)
    bad = (torch.empty(1, 2, 64, 96, dtype=torch.float16), torch.empty(1, 2, 64, 96, dtype=torch.float16),
           torch.empty(1, 1, 64, 96, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out's dk must match its input \(\(1, 1, 64, 96\)"):
        fused.FusedBackend().backward(q, k, v, o, lse, do, True, out=bad)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_ws3_launch_over_a_row_range(launches, monkeypatch, causal):
    """fusedw3 (d = 64, N = 4096): 512 threads, Q's tensor map in boxes of 192 rows, and the query rows
    as a range (a chunk starting at row 128, which is no multiple of 192), tiles of 192 rows from it:
    on 132 SMs the grid is one block per tile, so it counts them."""
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    monkeypatch.delenv("TPATTN_FUSED_GRID", raising=False)
    b, h, n, d = 1, 8, 4096, 64
    q, k, v = qkv(b, h, h, n, d)
    fused.FusedBackend().forward(q, k, v, causal, rows=(128, 2048))
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    assert name == "fusedw3_f16_d64" and block == (512, 1, 1)
    assert args[0].box == (64, 192) and args[1].box == args[2].box == (64, 128)
    assert (int(args[9]), int(args[10])) == (128, 2048)  # row_begin, row_end
    assert grid == (10 * b * h, 1, 1)  # 1920 rows a head: 10 tiles of 192 (15 of 128 would be 120 blocks)
    assert int(args[-1]) == 0  # no more tiles than blocks: no counter, causal or not
    assert int(args[-2]) == (b * h if causal else 1)  # causal: heads in groups of ceil(2 * 132 / 10), at most 8


def test_fused_ws_reads_the_packed_projection_in_place(launches, monkeypatch):
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    monkeypatch.setenv("TPATTN_FUSED_CFG", "fusedw_{suf}_d{d}")
    b, n, h, g, d = 1, 130, 4, 2, 64
    qkv_out = torch.randn(b, n, h + 2 * g, d).half()
    q, k, v = (t.permute(0, 2, 1, 3) for t in qkv_out.split([h, g, g], dim=2))
    fused.FusedBackend().forward(q, k, v, False)
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    row = (h + 2 * g) * d * 2
    # B = 1: the batch stride is never stepped over, so any legal one (16) stands in
    assert args[0].strides == (row, d * 2, 16) and args[1].strides == (row, d * 2, 16)
    assert args[1].address == qkv_out.data_ptr() + h * d * 2 and args[1].dims == (d, n, g, b)


@pytest.mark.parametrize("cc", [(9, 0), (8, 0)])
@pytest.mark.parametrize("L0", [200, 256])
def test_prefill_after_a_cache_gives_the_kernel_only_its_rows(launches, monkeypatch, cc, L0):
    """decode.prefix_attention (a chunk of T rows after L0 in a cache): q and o buffers of the rows from
    r0 (L0 rounded down to 128) on only, q copied after L0 - r0 zero rows; the kernel is handed addresses
    r0 rows before them (fusedw: Q's tensor map and O's pointer; fused2: both pointers) and the rows
    [r0, L0 + T), so it indexes rows by their position as with a whole buffer."""
    from tpattn import decode
    monkeypatch.setattr(fused, "_device_info", lambda dev: (1, cc))  # (one SM: the wide kernels)
    b, h, g, T, d = 2, 4, 2, 77, 128
    N = L0 + T
    q = torch.randn(b, h, T, d).half()
    k, v = (torch.randn(b, g, N, d).half() for _ in range(2))
    qv, ov, o, r0 = decode.fused_prefix_buffers(q, L0, 128)
    rows = N - r0
    assert r0 == L0 // 128 * 128 and qv.shape == ov.shape == (b, h, rows, d)
    assert qv.untyped_storage().nbytes() == b * h * rows * d * 2  # no buffer for the rows before r0
    assert torch.equal(qv[:, :, L0 - r0:], q) and not qv[:, :, :L0 - r0].any()
    assert o.shape == (b, T, h, d) and o.data_ptr() == ov.data_ptr() + (L0 - r0) * h * d * 2
    fused.FusedBackend().forward(qv, k, v, True, out=ov, rows=(r0, N), row_base=r0)
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    before = r0 * h * d * 2  # r0 rows of h heads, fp16
    if cc == (9, 0):
        assert name == "fusedw_f16_d128"
        assert args[0].address == qv.data_ptr() - before and args[0].dims == (d, N, h, b)
        assert args[0].strides == (h * d * 2, d * 2, rows * h * d * 2)
        assert int(args[3]) == ov.data_ptr() - before and (int(args[9]), int(args[10])) == (r0, N)
    else:
        assert name.startswith("fused2_")
        assert (int(args[0]), int(args[3])) == (qv.data_ptr() - before, ov.data_ptr() - before)
        assert int(args[6]) == N and tuple(args[13:16]) == (rows * h * d, d, h * d)
    with pytest.raises(ValueError, match="row_base=128"):
        fused.FusedBackend().forward(qv, k, v, True, out=ov, rows=(0, N), row_base=128)


@pytest.mark.parametrize("page,d", [(16, 128), (256, 128), (64, 64)])
def test_prefill_reads_the_pool_through_the_block_table(launches, monkeypatch, page, d):
    """decode.paged_prefix_attention (a prefill's rows over a paged pool, K/V read in place): fusedw's _pg
    kernel of fused_ws_paged.cu; Q's map over the step's own T rows [T, h, d] seen heads first (row 0:
    position L0, which the kernel reads on the device), O's pointer the same; K and V maps over the whole
    pool [pages, g, page, d] with boxes of min(page, 128) keys; the sequence's table row, L0's address and
    log2 of the page size last. The launch is packed once for a set of tensors whatever L0 holds; a table
    too short for the keys, or a pool it does not take, refused."""
    from tpattn import decode
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    monkeypatch.setattr(fused, "paged_fits", lambda q, k: True)
    h, g, L0, T, pages = 8, 2, 300, 77, 40
    N = L0 + T
    rows = torch.randn(T + 5, h, d).half()  # a step's rows: this sequence's are 5 ..
    q = rows[5:]
    kp, vp = (torch.randn(pages, g, page, d).half() for _ in range(2))
    table = torch.arange(-(-N // page), dtype=torch.int32)
    start = torch.tensor([7, L0], dtype=torch.int32)[1:]
    out = torch.empty(T + 9, h, d).half()
    be = fused.FusedBackend()
    o = decode.paged_prefix_attention(be, q, kp, vp, table, start, L0, out=out[9:])
    assert o.data_ptr() == out[9:].data_ptr()
    (source, name, grid, block, args), = launches
    check_launch(source, name, grid, block, args)
    assert (source, name, block) == (fused.WS_PAGED_SOURCE, f"fusedw_f16_d{d}_pg", (384, 1, 1))
    row = h * d * 2  # bytes between a head's rows
    assert args[0].address == q.data_ptr() and args[0].dims == (d, T, h, 1) and args[0].strides[:2] == (row, d * 2)
    for m, pool in ((args[1], kp), (args[2], vp)):
        assert m.address == pool.data_ptr() and m.dims == (d, page, g, pages) and m.box == (64, min(page, 128))
    assert int(args[3]) == out[9:].data_ptr() and int(args[-6]) == row // 2  # o's rows, and their stride
    assert (int(args[4]), int(args[5]), int(args[7]), int(args[8])) == (h, T, h, h // g)
    assert (int(args[-3]), int(args[-2])) == (table.data_ptr(), start.data_ptr()) and 1 << int(args[-1]) == page
    assert grid == (min(132, -(-T // 128) * h), 1, 1)  # row tiles from L0: ceil(T / 128) a head
    start[0] = 900  # (another chunk's L0, the same tensors: the packed launch serves it)
    decode.paged_prefix_attention(be, q, kp, vp, table, start, out=out[9:])
    assert len(launches) == 1
    with pytest.raises(ValueError, match="not a call its kernels take"):
        decode.paged_prefix_attention(be, q, kp, vp, table[:-1], start, L0)
    monkeypatch.setattr(fused, "paged_fits", lambda q, k: False)
    with pytest.raises(ValueError, match="not a call its kernels take"):
        decode.paged_prefix_attention(be, q, kp, vp, table, start, L0)


def test_paged_fits_takes_what_the_paged_kernels_read(monkeypatch):
    """paged_fits: a GPU of compute capability 9.0, 16-bit, head dim 64 or 128, pages of a power of two of
    at least 16 tokens; anything else goes through the gather (CPU tensors never fit)."""
    q = torch.zeros(4, 8, 128).half()
    assert not fused.paged_fits(q, torch.zeros(3, 2, 16, 128).half())  # on the CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    assert fused.paged_fits(q, torch.zeros(3, 2, 16, 128).half())
    assert fused.paged_fits(q, torch.zeros(3, 2, 256, 128).half())
    for pool in (torch.zeros(3, 2, 8, 128).half(), torch.zeros(3, 2, 48, 128).half(),
                 torch.zeros(3, 2, 16, 128).bfloat16(), torch.zeros(3, 2, 32, 128).half()[:, :, :16]):
        assert not fused.paged_fits(q, pool), pool.shape
    assert not fused.paged_fits(torch.zeros(4, 8, 96).half(), torch.zeros(3, 2, 16, 96).half())
    monkeypatch.setattr(fused, "_device_info", lambda dev: (108, (8, 0)))
    assert not fused.paged_fits(q, torch.zeros(3, 2, 16, 128).half())


def test_tensor_map_refuses_what_tma_cannot_read():
    t = torch.zeros(1, 2, 8, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="16-bit"):
        TensorMap(t)
    odd = torch.zeros(1, 2, 8, 68, dtype=torch.float16)[..., :64]  # rows 136 bytes apart
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        TensorMap(odd)


def test_fused_ws_packs_a_launch_once_per_set_of_tensors(launches, monkeypatch):
    """The host cost of a call: the second call with the same tensors reuses the packed launch; new
    tensors, rows or the grid setting make a new one."""
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    q, k, v = qkv(1, 32, 32, 1024, 64)
    o = torch.empty_like(q)
    be = fused.FusedBackend()
    for _ in range(3):
        be.forward(q, k, v, False, out=o)
    assert len(launches) == 1
    be.forward(q, k, v, False, out=o, rows=(0, 512))
    be.forward(q, k, v, True, out=o)
    monkeypatch.setenv("TPATTN_FUSED_GRID", "tiles")
    be.forward(q, k, v, True, out=o)
    # d = 64, N = 1024: fusedw3, tiles of 192 rows (6 a head)
    assert len(launches) == 4 and launches[-1][2] == (6 * 32, 1, 1) and launches[-2][2] == (132, 1, 1)
    assert int(launches[-1][4][-1]) == 0 and int(launches[-2][4][-1]) != 0  # a block per tile: no counter
    monkeypatch.setenv("TPATTN_FUSED_GRID", "static")
    be.forward(q, k, v, True, out=o)
    assert len(launches) == 5 and launches[-1][2] == (132, 1, 1) and int(launches[-1][4][-1]) == 0
    monkeypatch.setenv("TPATTN_FUSED_GRID", "all")
    with pytest.raises(Exception, match="use sms, static or tiles"):
        be.forward(q, k, v, True, out=o)


def test_packed_launch_keeps_its_tensor_maps_alive(monkeypatch):
    """A packed launch points its parameters into the encoded tensor maps; it holds them itself, so the
    encoding cache dropping its entries (it is bounded) cannot leave the launch reading freed memory."""
    import ctypes
    import gc

    from tpattn import cuda

    def fake_encode(at, dtype, rank, address, dims, strides, box, estrides, interleave, swizzle, l2, oob):
        ctypes.memmove(at, (b"%032x" % address) * 4, 128)  # 128 bytes that name the tensor
        return 0
    monkeypatch.setattr(cuda, "_encode_tiled", fake_encode)
    monkeypatch.setattr(cuda, "_tmaps", {})
    q, k, v = qkv(1, 2, 2, 256, 64)
    keep, params = cuda.pack_params((TensorMap(q), TensorMap(k), np.int32(7), TensorMap(v)))
    cuda._tmaps.clear()
    gc.collect()
    for t in (torch.zeros(1, 2, 256, 64, dtype=torch.float16) for _ in range(50)):  # churn: new maps, new buffers
        cuda._encode(TensorMap(t))
    for i, t in ((0, q), (1, k), (3, v)):
        assert ctypes.string_at(params[i], 128) == (b"%032x" % t.data_ptr()) * 4
    assert ctypes.c_int32.from_address(params[2]).value == 7


def test_fused_refuses_mixed_dtypes_and_skips_empty_calls(launches, monkeypatch):
    monkeypatch.setattr(fused, "_device_info", lambda dev: (132, (9, 0)))
    q, k, v = qkv(1, 2, 2, 256, 64)
    with pytest.raises(ValueError, match="share a dtype and a device"):
        fused.FusedBackend().forward(q, k.bfloat16(), v.bfloat16(), False)
    empty = torch.zeros(0, 2, 256, 64, dtype=torch.float16)
    assert fused.FusedBackend().forward(empty, empty, empty, False).shape == empty.shape and not launches


@pytest.mark.parametrize("h,g", [(8, 8), (8, 2)])
def test_decode_launches_contiguous_and_paged(monkeypatch, h, g):
    """The split decode kernels, one length for the batch and paged (the _pg kernels: the block
    table, its row stride, the lengths and the page size after the contiguous ones' arguments)."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((source, name, grid, block, args)))
    monkeypatch.setattr(decode, "decode_kernel_fits", lambda q: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"multi_processor_count": 132, "major": 8}))
    B, d, L = 3, 128, 300
    table, lens = decode_both(decode, B, h, g, d, L)[2:]
    assert [c[1].endswith("_pg") for c in calls] == [False, True]
    for c in calls:
        check_launch(*c)
    contiguous, paged = calls[0][4], calls[1][4]
    assert contiguous[10] == L and contiguous[12] == 512 and contiguous[-2:] == (0, 0)  # length, LMAX; no pages
    assert paged[-4] == table.data_ptr() and paged[-3] == lens.data_ptr()
    assert (paged[-2], paged[-1]) == (12, 16)                # the table's row stride, tokens per page
    assert (paged[7], paged[8], paged[9]) == (B * g, g, h // g)  # (b, g) pairs, K/V heads, group


@pytest.mark.parametrize("major", [8, 9])
@pytest.mark.parametrize("h,g,d", [(8, 2, 128), (32, 2, 64), (8, 8, 128)])
@pytest.mark.parametrize("staged_pages", [False, True])
def test_staged_decode_split_on_hopper(monkeypatch, major, h, g, d, staged_pages):
    """On compute capability 9.0 the tensor-core split over the contiguous cache is the staged build
    (_b: K/V tiles by bulk copies through shared memory, 8 or 16 heads a pass), launched with its rings'
    dynamic shared memory; over pages of 16 tokens, with DEC_STAGED_PAGED (off by default), it is the
    staged build of equal-work chunks (_pgb, up to 8 heads a K/V head: the target count of blocks, one
    an SM, where the contiguous cache's LMAX goes); else, and for larger groups, other GPUs and the
    CUDA-core split (one head a K/V head), the pages' build (_pg). Each launch is a kernel of the file
    with the arguments it takes."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((source, name, grid, block, args, shared_mem)))
    monkeypatch.setattr(tcuda, "resident_blocks", lambda *a, **k: 0)
    monkeypatch.setattr(decode, "decode_kernel_fits", lambda q: True)
    monkeypatch.setattr(decode, "DEC_STAGED_PAGED", staged_pages)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: type("P", (), {"multi_processor_count": 132, "major": major}))
    decode_both(decode, 3, h, g, d, 300)
    (cs, cname, *c, csmem), (ps, pname, *p, psmem) = calls
    check_launch(cs, cname, *c)
    check_launch(ps, pname, *p)
    staged = major >= 9 and h > g
    want = f"dec_mma_f16_d{d}_r{16 if h // g > 8 else 8}_b" if staged else None
    assert (cname == want) if staged else not cname.endswith("_b"), cname
    assert csmem == (4 * decode.DEC_STAGES * 2 * 16 * d * 2 if staged else 0) == (decode.dec_ring_bytes(d) if staged else 0)
    if staged and staged_pages and h // g <= 8:
        assert pname == f"dec_mma_f16_d{d}_r8_pgb" and psmem == decode.dec_ring_bytes(d), pname
        grid, args = p[0], p[2]
        assert args[12] == 132 and grid[:2] == (3 * g, decode.equal_work_chunks(3 * g, 192, 132)) == (3 * g, 3)  # pairs first
    else:
        assert pname.endswith("_pg") and psmem == 0 and p[2][12] == 0


@pytest.mark.parametrize("page,suffix", [(16, "_pg"), (64, "_pg"), (8, "_pgk"), (24, "_pgk"), (48, "_pgk")])
@pytest.mark.parametrize("h,g", [(8, 8), (8, 2)])
def test_paged_decode_kernel_per_page_size(monkeypatch, page, suffix, h, g):
    """The tensor-core split (grouped heads) has a build for pages of a power of two of 16 tokens or
    more (_pg: a lookup a 16-key tile) and one for other pages (_pgk: a lookup a key); the CUDA-core
    split (one head a K/V head) takes every page size in its _pg build. Each is a kernel of the file,
    with the arguments it takes."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((source, name, grid, block, args)))
    monkeypatch.setattr(decode, "decode_kernel_fits", lambda q: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"multi_processor_count": 132, "major": 8}))
    q = torch.randn(2, h, 128).half()
    pool_k, pool_v = (torch.randn(40, g, page, 128).half() for _ in range(2))
    table = torch.arange(2 * 6, dtype=torch.int32).view(2, 6)
    lens = torch.tensor([5, 6 * page], dtype=torch.int32)
    decode.paged_decode_attention(q, pool_k, pool_v, table, lens, 6 * page, tickets=torch.zeros(2 * g, dtype=torch.int32))
    (source, name, grid, block, args), = calls
    check_launch(source, name, grid, block, args)
    assert name.startswith("dec_mma" if h > g else "dec_split")
    assert name.endswith(suffix if h > g else "_pg"), name
    assert args[-1] == page


@pytest.mark.parametrize("rope", [False, True])
def test_paged_append_and_prepare_launches(monkeypatch, rope):
    """A paged step's rotation and K/V writes (dec_append_pg: positions and pages per row, the page
    size) and a graphed paged step's preparation (pg_prepare) pass what their kernels take."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    from tpattn.paged import PagedKV, _StaticStep
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((source, name, grid, block, args)))
    R, h, g, d, P = 5, 8, 2, 128, 16
    qkv = torch.randn(R, h + 2 * g, d).half()
    pool_k, pool_v = (torch.zeros(9, g, P, d).half() for _ in range(2))
    pos, pages = torch.arange(R, dtype=torch.int64) * 7, torch.arange(R, dtype=torch.int64)
    cos, sin = decode.rope_tables(torch.arange(64), d, 10000.0) if rope else (None, None)
    q = decode.append_paged_kernel(qkv, pool_k, pool_v, pos, pages, cos, sin, h, False)
    assert q.shape == (R, h, d)
    from tpattn import TensorParallelAttention
    D = h * d
    layer = TensorParallelAttention(torch.zeros(D, D), torch.zeros(D, g * d), torch.zeros(D, g * d), torch.zeros(D, D),
                                    heads=h, kv_heads=g, head_dim=d, causal=True)
    pool = PagedKV(layer, pages=8, page_size=P, max_seqs=3)
    st = _StaticStep(pool, 4, torch.zeros(4, 6, dtype=torch.int32))
    st.prepare_kernel()
    assert [c[1] for c in calls] == ["dec_append_pg_f16", "pg_prepare"]
    for c in calls:
        check_launch(*c)
    app, prep = calls[0][4], calls[1][4]
    assert app[6] == pos.data_ptr() and app[7] == pages.data_ptr() and (app[4] != 0) == rope
    assert tuple(app[8:13]) == (R, h, g, d, P)
    assert tuple(prep[7:]) == (4, 6, P, 3)  # bucket rows, table width, page size, slots (the padding slot's index)
    assert calls[1][2][0] * 256 >= 4 * 6   # a thread per table entry


def decode_both(decode, B, h, g, d, L):
    """One contiguous and one paged decode launch (to a recorder) on CPU tensors: (q, k, table, lens)."""
    q = torch.randn(B, h, 1, d).half()
    k, v = (torch.randn(B, g, 512, d).half() for _ in range(2))
    tickets = torch.zeros(B * g, dtype=torch.int32)
    decode.decode_attention(q, k, v, L, tickets=tickets)
    pool_k, pool_v = (torch.randn(40, g, 16, d).half() for _ in range(2))
    table = torch.arange(B * 12, dtype=torch.int32).view(B, 12)
    lens = torch.tensor([5, 190, 17][:B], dtype=torch.int32)
    decode.paged_decode_attention(q[:, :, 0], pool_k, pool_v, table, lens, 12 * 16, tickets=tickets)
    return q, k, table, lens


@pytest.mark.parametrize("split", ["auto", "mma"])
@pytest.mark.parametrize("d", [32, 80, 96, 160, 192, 256, 128])
@pytest.mark.parametrize("h,g", [(8, 8), (8, 2)])
def test_decode_launches_at_every_head_dim(monkeypatch, d, h, g, split):
    """Head dims other than 64 and 128 launch the CUDA-core split (grouped heads too, and when the
    tensor-core split is asked for) from decode_attention_dims.cu, contiguous and paged, and the
    append kernels from there too; 128 keeps decode_attention.cu and its tensor-core split for grouped
    heads. Each launch names a kernel that the file builds, with its arguments."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    monkeypatch.setattr(decode, "SPLIT_KERNEL", split)
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((source, name, grid, block, args)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"multi_processor_count": 132, "major": 8}))
    # the kernels' test of the head dim, as on a GPU with CuPy
    monkeypatch.setattr(decode, "decode_kernel_fits", lambda q: decode.kernel_takes(torch.device("cuda"), q.dtype,
                                                                                   q.shape[-1]))
    monkeypatch.setattr(decode, "cupy_available", lambda: True)
    B, L = 2, 300
    k = decode_both(decode, B, h, g, d, L)[1]
    qkv = torch.randn(B, h + 2 * g, d).half()
    decode.append_kernel(qkv, k, k, torch.tensor([7]), None, None, h, False)
    pool = torch.zeros(40, g, 16, d).half()
    decode.append_paged_kernel(qkv, pool, pool, torch.tensor([3, 40]), torch.tensor([0, 2]), None, None, h, False)
    other = d not in decode.DEC_HEAD_DIMS
    assert [c[0] for c in calls] == ["decode_attention_dims.cu" if other else "decode_attention.cu"] * 4
    assert [c[1][:10] for c in calls[2:]] == ["dec_append", "dec_append"]
    calls, appends = calls[:2], calls[2:]
    assert all(c[1].startswith("dec_split" if other or (h == g and split == "auto") else "dec_mma")
               for c in calls), calls
    assert all(f"_d{d}_" in c[1] for c in calls)
    for c in calls + appends:
        check_launch(*c)


@pytest.mark.parametrize("tile", [False, True, "kt"])
@pytest.mark.parametrize("d,h,g", [(128, 8, 8), (128, 8, 2), (64, 32, 8), (96, 8, 2), (256, 4, 4), (32, 8, 8)])
def test_fp8_pool_launches(monkeypatch, d, h, g, tile):
    """An FP8 pool's kernels: dec_append_pg8 (a warp per row and head: both pools, both scale
    tensors, then the tables as dec_append_pg's) and the split's _pg8 (the tensor-core one for grouped
    heads at d = 64 and 128, else the CUDA-core one; no contiguous-cache arguments; the K and V
    scales last), each with its kernel's arguments; with DEC_F8_TILE_PAGES the tensor-core split's
    _pgt8 over these 16-token pages, and with DEC_F8_KT too _pgt8s, with the same arguments."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    monkeypatch.setattr(decode, "DEC_F8_TILE_PAGES", bool(tile))
    monkeypatch.setattr(decode, "DEC_F8_KT", tile == "kt")
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((source, name, grid, block, args)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"multi_processor_count": 132, "major": 8}))
    R, P = 3, 16
    qkv = torch.randn(R, h + 2 * g, d).half()
    pool_k, pool_v = (torch.zeros(9, g, P, d, dtype=torch.float8_e4m3fn) for _ in range(2))
    ks, vs = (torch.zeros(9, g, P) for _ in range(2))
    pos, pages = torch.tensor([3, 17, 40]), torch.tensor([0, 4, 2])
    q = decode.append_paged_kernel(qkv, pool_k, pool_v, pos, pages, None, None, h, False, scales=(ks, vs))
    table = torch.arange(R * 3, dtype=torch.int32).view(R, 3)
    lens = torch.tensor([4, 18, 41], dtype=torch.int32)
    decode.paged_decode_attention(q, pool_k, pool_v, table, lens, 48, tickets=torch.zeros(R * g, dtype=torch.int32),
                                  scales=(ks, vs))
    mma = h > g and d in decode.DEC_HEAD_DIMS
    split = "dec_mma_f16" if mma else "dec_split_f16"
    assert calls[0][1] == "dec_append_pg8_f16" and calls[1][1].startswith(f"{split}_d{d}_") \
        and calls[1][1].endswith(("_pgt8s" if tile == "kt" else "_pgt8") if tile and mma else "_pg8"), \
        [c[1] for c in calls]
    assert [c[0] for c in calls] == [decode.dec_source(d)] * 2  # both from the head dim's own module
    for c in calls:
        check_launch(*c)
    app, split = calls[0][4], calls[1][4]
    assert (app[2], app[3], app[4], app[5]) == (pool_k.data_ptr(), pool_v.data_ptr(), ks.data_ptr(), vs.data_ptr())
    assert tuple(app[10:15]) == (R, h, g, d, P)
    assert calls[0][2][0] * 8 >= R * (h + 2 * g)  # a warp per row and head, 8 warps a block
    assert (split[-2], split[-1]) == (ks.data_ptr(), vs.data_ptr()) and (split[-4], split[-3]) == (3, P)
    assert (split[7], split[8], split[9]) == (R * g, g, h // g)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_ws_launch(monkeypatch, causal, block_scales, dtype):
    """The CUDA FP8 forward (fp8_ws.launch): every argument of the kernel's signature with its type; byte
    tensor maps of Q and K over (128, N, heads, B) and of V^T over (N', 128, g, B), boxes of 128 x 128;
    the scales' blocks a head (and kvb) as given; persistent, the counter for causal tiles only."""
    from tpattn.attention import fp8_ws
    calls = []

    class Prepared:
        def __init__(self, source, name, device, grid, block, args, shared_mem=0):
            calls.append((source, name, grid, block, args, shared_mem))

        def __call__(self):
            pass
    monkeypatch.setattr(fp8_ws, "Prepared", Prepared)
    monkeypatch.setattr(fp8_ws, "_prepared", {})
    monkeypatch.setattr(fused, "_device_info", lambda dev: (40, (9, 0)))
    monkeypatch.delenv("TPATTN_FUSED_GRID", raising=False)
    b, h, g, n = 2, 8, 2, 1000
    f8 = torch.float8_e4m3fn
    q8, k8 = torch.zeros(b, h, n, 128, dtype=f8), torch.zeros(b, g, n, 128, dtype=f8)
    vtk8 = fp8_ws.vt_for_kernel(torch.zeros(b, g, 128, n, dtype=f8))
    nblk = 8 if block_scales else 1
    sq, sk, sv = torch.ones(b, h, nblk), torch.ones(b, g, nblk), torch.ones(b, g, nblk)
    o = torch.empty(b, h, n, 128, dtype=dtype)
    fp8_ws.launch(q8, k8, vtk8, sq, sk, sv, causal, o, block_scales)
    (source, name, grid, block, args, shared), = calls
    check_launch(source, name, grid, block, args)
    assert name == f"fusedw8_{'bf16' if dtype == torch.bfloat16 else 'f16'}_d128" and block == (384, 1, 1)
    assert grid == (40, 1, 1) and shared == fp8_ws.SHARED
    qm, km, vm = args[:3]
    assert qm.dims == (128, n, h, b) and km.dims == (128, n, g, b) and vm.dims == (1008, 128, g, b)
    assert qm.box == km.box == vm.box == (128, 128) and qm.strides[0] == 128 and vm.strides[0] == 1008
    assert int(args[5]) == n and int(args[8]) == h and int(args[9]) == h // g
    assert (int(args[-2]), int(args[-1])) == (nblk, int(block_scales))
    assert (int(args[14]) != 0) == causal  # the tile counter
    fp8_ws.launch(q8, k8, vtk8, sq, sk, sv, causal, o, block_scales)
    assert len(calls) == 1  # packed once per set of tensors


@pytest.mark.parametrize("page,suffix", [(16, "_pgt8"), (64, "_pgt8"), (8, "_pg8"), (24, "_pg8"), (1, "_pg8")])
def test_fp8_tile_build_only_over_whole_tile_pages(monkeypatch, page, suffix):
    """With DEC_F8_TILE_PAGES, an FP8 pool's tensor-core split runs _pgt8 (PG 2: whole 16-key tiles
    a page, no run-time addressing choice) only for pages of a power of two of 16 tokens or more;
    other page sizes keep _pg8, which takes any page. By default (DEC_F8_KT) the tile build is _pgt8s,
    the keys as the products' rows, where a pass takes 8 query heads or fewer."""
    from tpattn import decode
    assert decode.DEC_F8_TILE_PAGES and decode.DEC_F8_KT and decode.DEC_F8_PIPE  # the builds tpattn runs
    monkeypatch.setattr(decode, "DEC_F8_TILE_PAGES", True)
    monkeypatch.setattr(decode, "DEC_F8_KT", False)  # (A/B runs: _pgt8, the queries as the rows)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"multi_processor_count": 132, "major": 9}))
    monkeypatch.setattr("tpattn.cuda.resident_blocks", lambda *a, **k: 2)
    q = torch.zeros(4, 32, 128).half()
    _, name, S, _ = decode._split_kernel(q, 4, 32, 8, 128, 4096, page=page, fp8=True)
    assert S >= 3 and name == f"dec_mma_f16_d128_r8_p{suffix}", (S, name)
    monkeypatch.setattr(decode, "DEC_F8_PIPE", False)  # (A/B runs: the build that loads a tile at a time)
    _, name, S, _ = decode._split_kernel(q, 4, 32, 8, 128, 4096, page=page, fp8=True)
    assert S >= 3 and name == f"dec_mma_f16_d128_r8{suffix}", (S, name)
    _, name, _, _ = decode._split_kernel(q, 4, 32, 8, 128, 4096, page=page)  # 16-bit pages keep _p
    assert "_p_pg" in name, name
    monkeypatch.setattr(decode, "DEC_F8_PIPE", True)
    monkeypatch.setattr(decode, "DEC_F8_KT", True)  # the default: the keys as the products' rows, 8 heads a pass
    _, name, _, _ = decode._split_kernel(q, 4, 32, 8, 128, 4096, page=page, fp8=True)
    assert name == f"dec_mma_f16_d128_r8_p{suffix}{'s' if suffix == '_pgt8' else ''}", name
    _, name, _, _ = decode._split_kernel(q, 4, 64, 4, 128, 4096, page=page, fp8=True)  # 16 heads a pass: r16
    assert name.startswith("dec_mma_f16_d128_r16") and name.endswith(suffix), name


@pytest.mark.parametrize("kt16", [False, True])
@pytest.mark.parametrize("d,h,g,page,want", [(128, 32, 8, 16, "_pgs"), (64, 16, 2, 32, "_pgs"), (128, 32, 2, 16, "_pg"),
                                             (128, 32, 8, 24, "_pgk")])
def test_sixteen_bit_whole_tile_pages_through_pgs(monkeypatch, kt16, d, h, g, page, want):
    """With DEC_KT16, a pool of 16-bit pages of whole 16-key tiles takes the tensor-core split's _pgs (the
    keys as the rows of both products) where a pass takes the group (8 query heads or fewer), with _pg's
    arguments, pipelined (_p_pgs) from 3 chunks on; 16 heads a pass keep _pg (r16), pages of 24 keys
    _pgk. Off (the default, not yet measured), _pg as before."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    assert decode.DEC_KT16 is False
    monkeypatch.setattr(decode, "DEC_KT16", kt16)
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((source, name, grid, block, args)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"multi_processor_count": 132, "major": 9}))
    monkeypatch.setattr(tcuda, "resident_blocks", lambda *a, **k: 2)
    B, n = 2, 4096 // page + 1
    q = torch.randn(B, h, d).half()
    pool_k, pool_v = (torch.randn(B * n, g, page, d).half() for _ in range(2))
    table = torch.arange(B * n, dtype=torch.int32).view(B, n)
    lens = torch.tensor([4000, 1000], dtype=torch.int32)
    decode.paged_decode_attention(q, pool_k, pool_v, table, lens, n * page, tickets=torch.zeros(B * g, dtype=torch.int32))
    name = calls[0][1]
    expect = want if kt16 or want != "_pgs" else "_pg"
    assert name.startswith(f"dec_mma_f16_d{d}_r{16 if h // g > 8 else 8}") and name.endswith(expect), name
    assert ("_p_" in name) == (calls[0][2][0] >= 3), (name, calls[0][2])  # grid (S, pairs): _p from 3 chunks
    for c in calls:
        check_launch(*c)
