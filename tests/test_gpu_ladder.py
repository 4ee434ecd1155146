"""GPU tests (`pytest -m gpu`) for the kernel ladder: the tiled three-pass kernels and the fused
online-softmax kernel, against float64 and against the torch reference, on odd shapes, causal and
not, with poisoned outputs (and poisoned S and P for the tiled kernels); N^2 > 2^31 for the tiled
kernels; a clear error for a head dim the fused kernel does not build; the layer under mpirun;
grouped-query attention (fewer K/V heads than query heads) for both kernels (`-k gqa`)."""

import json
import math

import pytest
import torch

from conftest import tpattn
from test_gpu import DT, TOL_F64, TOL_REF, attention64, check_gqa, gqa_qkv, qkv, rel_err
from tpattn.attention import get_backend
from tpattn.attention.tiled import scratch_shape
from tpattn.config import ConfigError

pytestmark = pytest.mark.gpu


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["default", "fused2", "fusedh", "fusedw", "fusedw-sms"])
def fused_impl(request, monkeypatch):
    """The kernel --kernel fused picks for the call (on compute capability 9.0: wgmma for calls that
    fill the GPU, fused2 for small ones such as these tests'), the portable mma.sync one (fused2) on
    every GPU, and the wgmma ones forced where they run: fusedh, and the warp-specialized fusedw with
    its grid both ways (a block per tile, and persistent: one per SM walking the tiles)."""
    if request.param.startswith("fused") and request.param != "fused2" and not HOPPER:
        pytest.skip("the wgmma kernels need compute capability 9.0")
    if request.param.startswith("fusedw"):
        monkeypatch.setenv("TPATTN_FUSED_GRID", "sms" if request.param == "fusedw-sms" else "tiles")
    else:
        monkeypatch.delenv("TPATTN_FUSED_GRID", raising=False)
    cfg = {"fused2": "fused2_{suf}_d{d}_w4_m1_c64", "fusedh": "fusedh_{suf}_d{d}", "fusedw": "fusedw_{suf}_d{d}",
           "fusedw-sms": "fusedw_{suf}_d{d}"}.get(request.param)
    if cfg:
        monkeypatch.setenv("TPATTN_FUSED_CFG", cfg)
    else:
        monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    return request.param


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [1, 17, 1000, 4097])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_matches_reference_and_float64(dtype, n, d, causal, fused_impl):
    b, h = 2, 3
    q, k, v = qkv(b, h, n, d, DT[dtype], seed=n * 1000 + d + 1)
    out = nan_like(q.shape, DT[dtype])
    o = get_backend("fused").forward(q, k, v, causal, out=out)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    assert torch.isfinite(o).all(), "the kernel left poisoned outputs"
    assert rel_err(o, get_backend("reference").forward(q, k, v, causal)) <= TOL_REF[dtype]
    assert rel_err(o, attention64(q, k, v, causal)) <= TOL_F64[dtype]


@pytest.fixture(params=["default", "mma"])
def tiled_impl(request, monkeypatch):
    """The passes --kernel tiled picks on this GPU (wgmma QK and PV on compute capability 9.0 for
    d = 64 and 128), and the mma.sync ones on every GPU."""
    monkeypatch.setenv("TPATTN_TILED_IMPL", "mma" if request.param == "mma" else "auto")
    return request.param


# d = 64 and 128 twice: the passes tiled picks on this GPU (wgmma on compute capability 9.0) and
# the mma.sync ones; other head dims always run the mma.sync passes
TILED_D_IMPL = [(32, "auto"), (64, "auto"), (64, "mma"), (80, "auto"), (128, "auto"), (128, "mma"), (256, "auto")]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,impl", TILED_D_IMPL)
@pytest.mark.parametrize("n", [1, 17, 1000, 4097])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_tiled_matches_reference_and_float64(dtype, n, d, impl, causal, monkeypatch):
    if n == 4097 and d in (32, 80, 256) and dtype == "bf16":
        pytest.skip("bf16 at N=4097 covered by d=64 and 128")
    monkeypatch.setenv("TPATTN_TILED_IMPL", impl)
    b, h = 2, 3
    q, k, v = qkv(b, h, n, d, DT[dtype], seed=n * 1000 + d + 2)
    s, p = nan_like(scratch_shape(b, h, n), DT[dtype]), nan_like(scratch_shape(b, h, n), DT[dtype])
    out = nan_like(q.shape, DT[dtype])
    o = get_backend("tiled").forward(q, k, v, causal, out=out, scratch=(s, p))
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    assert torch.isfinite(o).all(), "the kernels left poisoned outputs"
    assert rel_err(o, get_backend("reference").forward(q, k, v, causal)) <= TOL_REF[dtype]
    assert rel_err(o, attention64(q, k, v, causal)) <= TOL_F64[dtype]
    rows = p[0, 0, :, :n].float()
    if causal:
        rows = rows.tril()
    rows = rows.sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-2)


def _wrong(c, ref, what):
    """An assertion message that says which rows and columns of a probe's output are wrong."""
    bad = (c - ref).abs() > 1e-2 * (1 + ref.abs())
    rows = bad.any(1).nonzero().flatten().tolist()
    cols = bad.any(0).nonzero().flatten().tolist()
    return (f"{what}: {int(bad.sum())} of {bad.numel()} wrong, max |diff| {(c - ref).abs().max().item():.3g}; "
            f"rows {rows[:20]}{'...' if len(rows) > 20 else ''}; cols {cols[:20]}{'...' if len(cols) > 20 else ''}")


@pytest.mark.skipif(not HOPPER, reason="wgmma kernels need compute capability 9.0")
def test_wgmma_probes_match_matmul():
    """The building blocks of the wgmma kernel on their own: one S = A B^T and one O = P V product
    through the same descriptors and fragment layouts, against torch.matmul."""
    from tpattn.cuda import launch, ptr
    g = torch.Generator(device="cuda").manual_seed(3)
    a, b, p, v = (torch.randn(r, 128, device="cuda", generator=g).half() for r in (64, 128, 64, 128))
    c = torch.full((64, 128), float("nan"), device="cuda")
    launch("fused_hopper_attention.cu", "hw_probe_qk_f16", a.device, (1, 1, 1), (128, 1, 1),
           (ptr(a), ptr(b), ptr(c)), shared_mem=3 * 128 * 128 + 1024)
    torch.cuda.synchronize()
    ref = a.float() @ b.float().T
    assert torch.allclose(c, ref, rtol=1e-2, atol=1e-2), _wrong(c, ref, "S = A B^T")
    c2 = torch.full((64, 128), float("nan"), device="cuda")
    launch("fused_hopper_attention.cu", "hw_probe_pv_f16", a.device, (1, 1, 1), (128, 1, 1),
           (ptr(p), ptr(v), ptr(c2)), shared_mem=2 * 128 * 128 + 1024)
    torch.cuda.synchronize()
    ref2 = p.float() @ v.float()
    assert torch.allclose(c2, ref2, rtol=1e-2, atol=1e-2), _wrong(c2, ref2, "O = P V")


@pytest.mark.skipif(not HOPPER, reason="wgmma kernels need compute capability 9.0")
def test_fused_picks_the_warp_specialized_kernel_on_hopper(monkeypatch):
    from tpattn.attention.fused import kernel_for
    monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    assert kernel_for(128, "f16", torch.cuda.get_device_capability()).name == "fusedw_f16_d128"
    assert kernel_for(128, "f16", torch.cuda.get_device_capability(), wide=False).name.startswith("fused2_")
    assert kernel_for(64, "bf16", (8, 0)).name.startswith("fused2_bf16_d64")


@pytest.mark.skipif(not HOPPER, reason="fusedw needs compute capability 9.0")
@pytest.mark.parametrize("grid", ["sms", "static"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [17, 197, 1500, 4097])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_ws_tile_orders(dtype, d, n, causal, grid, monkeypatch):
    """fusedw's persistent grid with causal tiles handed out by the counter (sms) or every grid-th one
    (static); more tiles than SMs (B x H = 32; causal heads in groups, at N = 1500 the last group
    smaller than the others on 132 SMs); called three times into NaN-poisoned outputs: the counter is back at zero after each call (a tile skipped would
    stay NaN), and every call gives the same bits, as the other order does."""
    monkeypatch.setenv("TPATTN_FUSED_CFG", "fusedw_{suf}_d{d}")
    monkeypatch.setenv("TPATTN_FUSED_GRID", grid)
    b, h = 4, 8
    q, k, v = qkv(b, h, n, d, DT[dtype], seed=n + 7)
    outs = []
    for _ in range(3):
        outs.append(get_backend("fused").forward(q, k, v, causal, out=nan_like(q.shape, DT[dtype])))
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all(), "the kernel left poisoned outputs"
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert rel_err(outs[0], attention64(q, k, v, causal)) <= TOL_F64[dtype]
    monkeypatch.setenv("TPATTN_FUSED_GRID", "tiles")  # a block per tile: the hardware's order
    assert torch.equal(outs[0], get_backend("fused").forward(q, k, v, causal))


@pytest.mark.skipif(not HOPPER, reason="fusedw needs compute capability 9.0")
@pytest.mark.parametrize("grid", ["sms", "static"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 197, 300, 1000, 4097])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_ws3_gives_fusedws_bits(dtype, n, causal, grid, monkeypatch):
    """fusedw3 (d = 64, three consumer warpgroups, 192-row tiles) computes each row as fusedw does: the
    same bits, output and logsumexp, into NaN-poisoned outputs, over more tiles than SMs (B x H = 40,
    4 query heads a K/V head), with the counter or the static order, twice; row chunks starting at rows
    that are no multiple of 192 leave the rows outside them untouched."""
    monkeypatch.setenv("TPATTN_FUSED_GRID", grid)
    b, h, g, d = 4, 40, 10, 64
    q, k, v = gqa_qkv(b, h, g, n, d, DT[dtype], seed=n + 11)
    fused = get_backend("fused")
    outs, lses = {}, {}
    for cfg in ("fusedw_{suf}_d{d}", "fusedw3_{suf}_d{d}"):
        monkeypatch.setenv("TPATTN_FUSED_CFG", cfg)
        lses[cfg] = torch.full((b, h, n), float("nan"), dtype=torch.float32, device="cuda")
        outs[cfg] = fused.forward(q, k, v, causal, out=nan_like(q.shape, DT[dtype]), lse=lses[cfg])
    torch.cuda.synchronize()
    o3 = outs["fusedw3_{suf}_d{d}"]
    assert torch.isfinite(o3).all() and torch.isfinite(lses["fusedw3_{suf}_d{d}"]).all(), "poisoned outputs left"
    assert torch.equal(o3, outs["fusedw_{suf}_d{d}"])
    assert torch.equal(lses["fusedw3_{suf}_d{d}"], lses["fusedw_{suf}_d{d}"])
    ref = attention64(q, k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1), causal)
    assert rel_err(o3, ref) <= TOL_F64[dtype]
    # again, into a fresh NaN-poisoned output (a new launch and counter slot): the same bits, every tile
    # written (without causal, where the last tile leaves a warpgroup without rows, the counter hands the
    # tiles out too; its reset for the next replay is checked in the CUDA graph test below)
    assert torch.equal(fused.forward(q, k, v, causal, out=nan_like(q.shape, DT[dtype])), o3)
    if n > 384:
        chunks = nan_like(q.shape, DT[dtype])
        for r0, r1 in ((128, 384), (384, n)):
            fused.forward(q, k, v, causal, out=chunks, rows=(r0, r1))
        torch.cuda.synchronize()
        assert torch.isnan(chunks[:, :, :128]).all() and torch.equal(chunks[:, :, 128:], o3[:, :, 128:])


@pytest.mark.skipif(not HOPPER, reason="fusedw needs compute capability 9.0")
@pytest.mark.parametrize("cfg,d", [("fusedw_{suf}_d{d}", 64), ("fusedw_{suf}_d{d}", 128), ("fusedw3_{suf}_d{d}", 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [300, 1050])
def test_fused_ws_warpgroups_stop_at_their_own_rows(cfg, d, n, causal, monkeypatch):
    """fusedw3's consumer warpgroups compute the key tiles of their own 64 rows only: none where they
    start at or past the call's last row (the last 192-row tile of a head, N = 300 and 1050, or of a
    chunk ending at row 256), and with causal none past their last row's diagonal (tiles from row 128
    or 256: the first warpgroup's rows end a key tile before the last one's). fusedw beside it (its
    warpgroups compute every key tile of the tile). Row chunks give the full call's bits, output and
    logsumexp, and leave the rows outside untouched; the full call against float64."""
    monkeypatch.setenv("TPATTN_FUSED_CFG", cfg)
    b, h = 2, 6
    q, k, v = qkv(b, h, n, d, torch.float16, seed=n + d)
    fused = get_backend("fused")
    lse = torch.full((b, h, n), float("nan"), dtype=torch.float32, device="cuda")
    full = fused.forward(q, k, v, causal, out=nan_like(q.shape, torch.float16), lse=lse)
    chunks = nan_like(q.shape, torch.float16)
    clse = torch.full((b, h, n), float("nan"), dtype=torch.float32, device="cuda")
    bounds = (128, 256, 640, n) if n > 640 else (128, 256, n)
    for r0, r1 in zip(bounds, bounds[1:]):
        fused.forward(q, k, v, causal, out=chunks, lse=clse, rows=(r0, r1))
    torch.cuda.synchronize()
    assert torch.isfinite(full).all() and torch.isfinite(lse).all(), "the kernel left poisoned outputs"
    assert rel_err(full, attention64(q, k, v, causal)) <= TOL_F64["fp16"]
    assert torch.isnan(chunks[:, :, :128]).all() and torch.isnan(clse[:, :, :128]).all()
    assert torch.equal(chunks[:, :, 128:], full[:, :, 128:]) and torch.equal(clse[:, :, 128:], lse[:, :, 128:])


@pytest.mark.skipif(not HOPPER, reason="fusedw needs compute capability 9.0")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [80, 81, 129, 207, 208, 209, 257])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_ws_narrow_last_key_tile(dtype, n, causal, monkeypatch):
    """fusedw at d = 64 computes a last key tile of at most 80 keys as 80 (wgmma n80, a softmax over 80
    columns, 5 k16 steps of P V): lengths on both sides of 80 in the last tile (N = 80 and 208: a tile
    of 80; 81 and 209: of 128; 129 and 257: a tile of one key), the only tile (N = 80, 81) and after
    full ones; the output and each row's logsumexp against float64, into NaN-poisoned outputs."""
    monkeypatch.setenv("TPATTN_FUSED_CFG", "fusedw_{suf}_d{d}")
    b, h, d = 3, 5, 64
    q, k, v = qkv(b, h, n, d, DT[dtype], seed=n)
    lse = torch.full((b, h, n), float("nan"), dtype=torch.float32, device="cuda")
    out = get_backend("fused").forward(q, k, v, causal, out=nan_like(q.shape, DT[dtype]), lse=lse)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "the kernel left poisoned outputs"
    assert rel_err(out, attention64(q, k, v, causal)) <= TOL_F64[dtype]
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-3


@pytest.mark.skipif(not HOPPER, reason="fusedw needs compute capability 9.0")
@pytest.mark.parametrize("d", [64, 128])
def test_fused_ws_causal_in_a_cuda_graph(d, monkeypatch):
    """The causal counter in a CUDA graph: captured after an eager call, replayed five times, each
    replay the eager bits (the kernel puts the counter back to zero for the next replay)."""
    monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    monkeypatch.delenv("TPATTN_FUSED_GRID", raising=False)
    graph_replays_give_eager_bits(32, d, 5)


def graph_replays_give_eager_bits(h: int, d: int, replays: int) -> None:
    """A causal fused call (B = 2, N = 2048, bf16) captured in a CUDA graph after an eager one and a warm
    call on a side stream, replayed into NaN-poisoned output: each replay gives the eager bits."""
    q, k, v = qkv(2, h, 2048, d, torch.bfloat16, seed=3)
    fused = get_backend("fused")
    eager = fused.forward(q, k, v, True)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused.forward(q, k, v, True, out=out)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused.forward(q, k, v, True, out=out)
    for _ in range(replays):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [4100, 8191, 16384])
def test_tiled_softmax_long_rows(n, causal):
    """Rows past the register cache (4096 columns) and up to 16384 go through shared memory."""
    d = 64
    q, k, v = qkv(1, 2, n, d, torch.float16, seed=n + 3)
    s, p = nan_like(scratch_shape(1, 2, n), torch.float16), nan_like(scratch_shape(1, 2, n), torch.float16)
    o = get_backend("tiled").forward(q, k, v, causal, out=nan_like(q.shape, torch.float16), scratch=(s, p))
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device="cuda")
    assert rel_err(o[..., rows, :], attention64(q, k, v, causal, rows)) <= TOL_F64["fp16"]
    for r in rows.tolist():  # each row of P sums to 1 over the keys it may see
        total = p[0, 1, r, : (r + 1 if causal else n)].float().sum().item()
        assert abs(total - 1.0) < 1e-2, (r, total)


def test_tiled_scores_beyond_2_pow_31(tiled_impl):
    """One head at N = 50 000: N^2 = 2.5e9 > 2^31, so 32-bit offsets would wrap."""
    n, d = 50_000, 64
    assert n * n > 2**31
    q, k, v = qkv(1, 1, n, d, torch.float16, seed=7)
    s, p = nan_like(scratch_shape(1, 1, n), torch.float16), nan_like(scratch_shape(1, 1, n), torch.float16)
    out = nan_like(q.shape, torch.float16)
    o = get_backend("tiled").forward(q, k, v, False, out=out, scratch=(s, p))
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    rows = torch.tensor([0, 1, 12_345, 42_950, n - 2, n - 1], device="cuda")  # last rows: offsets > 2^31
    assert rel_err(o[..., rows, :], attention64(q, k, v, False, rows)) <= TOL_F64["fp16"]
    assert abs(p[0, 0, n - 1, :n].float().sum().item() - 1.0) < 0.05
    s_last = (q[0, 0, n - 1].float() @ k[0, 0, n - 1].float()) / math.sqrt(d)
    assert abs(s[0, 0, n - 1, n - 1].float().item() - s_last.item()) < 1e-2 * (1 + abs(s_last.item()))


def test_fused_long_sequence_causal(fused_impl):
    """N = 16 384, causal, a few heads: many tiles, the causal skip, and rows far from the start."""
    n, d = 16_384, 128
    q, k, v = qkv(1, 2, n, d, torch.float16, seed=11)
    o = get_backend("fused").forward(q, k, v, True, out=nan_like(q.shape, torch.float16))
    torch.cuda.synchronize()
    rows = torch.tensor([0, 5, 8191, 12_000, n - 1], device="cuda")
    assert rel_err(o[..., rows, :], attention64(q, k, v, True, rows)) <= TOL_F64["fp16"]


@pytest.mark.parametrize("causal", [False, True])
def test_fused_n_50000(fused_impl, causal):
    """N = 50 000 (a head's scores would be 2.5e9 > 2^31 entries; the fused kernels never hold them): a
    tail tile of 80 rows, rows far from the start, NaN-poisoned output, against float64."""
    n, d = 50_000, 128
    q, k, v = qkv(1, 2, n, d, torch.float16, seed=13)
    o = get_backend("fused").forward(q, k, v, causal, out=nan_like(q.shape, torch.float16))
    torch.cuda.synchronize()
    assert torch.isfinite(o).all(), "the kernel left poisoned outputs"
    rows = torch.tensor([0, 1, 12_345, 42_950, n - 2, n - 1], device="cuda")
    assert rel_err(o[..., rows, :], attention64(q, k, v, causal, rows)) <= TOL_F64["fp16"]


BIG_BH = [("fused", None), ("fused", "TPATTN_FUSED_CFG=fused2_{suf}_d{d}_w4_m1_c64"), ("tiled", None),
          ("tiled", "TPATTN_TILED_IMPL=mma")] + ([("fused", "TPATTN_FUSED_CFG=fusedh_{suf}_d{d}"),
                                               ("fused", "TPATTN_FUSED_CFG=fusedw_{suf}_d{d}")] if HOPPER else [])


@pytest.mark.parametrize("kernel,env", BIG_BH)
def test_more_heads_than_the_grid_holds(kernel, env, monkeypatch):
    """batch x heads = 65 600 > 65 535, the grid's y/z limit: the kernels stride over the rest."""
    if env:
        monkeypatch.setenv(*env.split("=", 1))
    b, h, n, d = 2, 32_800, 20, 64
    q, k, v = qkv(b, h, n, d, torch.float16, seed=5)
    o = get_backend(kernel).forward(q, k, v, False, out=nan_like(q.shape, torch.float16))
    torch.cuda.synchronize()
    assert torch.isfinite(o).all(), "heads past the grid's limit were left unwritten"
    ref = get_backend("reference").forward(q, k, v, False)
    assert rel_err(o[1, -8:], ref[1, -8:]) <= TOL_REF["fp16"]
    assert rel_err(o, ref) <= TOL_REF["fp16"]


@pytest.mark.parametrize("d", [40, 88, 120, 248])
def test_fused_unsupported_head_dim_is_a_clear_error(d):
    q, k, v = qkv(1, 2, 16, d, torch.float16)
    with pytest.raises(ConfigError, match="supports head dims 32, 64, 80, 96, 128, 160, 192 and 256"):
        get_backend("fused").forward(q, k, v, False)


def test_fused_unsupported_head_dim_through_the_cli():
    r = tpattn(["--kernel", "fused", "--seq-len", "64", "--heads", "2", "--head-dim", "88"], timeout=120)
    assert r.returncode == 2 and "supports head dims 32, 64, 80, 96, 128, 160, 192 and 256" in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("kernel", ["fused", "tiled"])
def test_tensor_parallel_layer(tmp_path, kernel):
    r = tpattn(["--kernel", kernel, "--dist-backend", "gloo", "--seq-len", "1024", "--heads", "8", "--causal",
                "--json", str(tmp_path / "r.json")], ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["verdict"] == "PASS" and rep["world"]["size"] == 2 and rep["config"]["kernel"] == kernel
    if kernel == "fused":
        assert "fused" in rep["passes"] and rep["memory"]["S_bytes_per_rank"] == 0


# ---- grouped-query attention -------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", [(6, 2), (6, 1)])
@pytest.mark.parametrize("d,impl", [(64, "auto"), (64, "mma"), (80, "auto"), (128, "auto"), (128, "mma")])
@pytest.mark.parametrize("n", [17, 1000])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_tiled_gqa(dtype, n, d, impl, h, g, causal, monkeypatch):
    monkeypatch.setenv("TPATTN_TILED_IMPL", impl)
    q, k, v = gqa_qkv(2, h, g, n, d, DT[dtype], seed=n + d + g + 2)
    check_gqa("tiled", q, k, v, causal, dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", [(8, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [17, 1000, 4097])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_gqa(dtype, n, d, h, g, causal, fused_impl):
    if n == 4097 and (dtype, h // g) != ("fp16", 4):
        pytest.skip("N = 4097 once per head dim and kernel: fp16, group 4")
    q, k, v = gqa_qkv(2, h, g, n, d, DT[dtype], seed=n + d + g + 3)
    check_gqa("fused", q, k, v, causal, dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_gqa_row_chunks(causal, fused_impl):
    """The layer's overlap: query-row chunks of a grouped call, the same bits as the whole call."""
    q, k, v = gqa_qkv(2, 8, 2, 1000, 128, torch.float16, seed=8)
    fused = get_backend("fused")
    whole = fused.forward(q, k, v, causal)
    o = torch.full_like(q, float("nan"))
    for r0, r1 in ((0, 256), (256, 384), (384, 1000)):
        fused.forward(q, k, v, causal, out=o, rows=(r0, r1))
    if fused_impl == "default":
        # the automatic choice goes by the call's tile count: the whole call (16 x 8 tiles) takes the
        # wgmma kernel on an H200, the one-tile chunk the mma.sync one; the two round differently
        torch.testing.assert_close(o, whole, rtol=4e-3, atol=4e-3)
    else:
        assert torch.equal(o, whole)


@pytest.mark.parametrize("kernel,env", [("naive", None)] + BIG_BH)
def test_gqa_more_heads_than_the_grid_holds(kernel, env, monkeypatch):
    """batch x heads = 65 600 > 65 535 with 4 query heads per K/V head: the heads past the grid's
    limit (the kernels stride over them) still read their own group's K/V head."""
    if env:
        monkeypatch.setenv(*env.split("=", 1))
    b, h, g, n, d = 2, 32_800, 8_200, 20, 64
    q, k, v = gqa_qkv(b, h, g, n, d, torch.float16, seed=6)
    o = get_backend(kernel).forward(q, k, v, False, out=nan_like(q.shape, torch.float16))
    torch.cuda.synchronize()
    assert torch.isfinite(o).all(), "heads past the grid's limit were left unwritten"
    ref = get_backend("reference").forward(q[1:, -16:], k[1:, -4:], v[1:, -4:], False)  # the last 4 groups
    assert rel_err(o[1:, -16:], ref) <= TOL_REF["fp16"]
    ref0 = get_backend("reference").forward(q[:1, :16], k[:1, :4], v[:1, :4], False)
    assert rel_err(o[:1, :16], ref0) <= TOL_REF["fp16"]


def test_fused_gqa_long_sequence_causal(fused_impl):
    """N = 16 384, causal, 4 query heads on 1 K/V head (the benchmark's shape, fewer heads)."""
    n, d = 16_384, 128
    q, k, v = gqa_qkv(1, 4, 1, n, d, torch.float16, seed=12)
    o = get_backend("fused").forward(q, k, v, True, out=nan_like(q.shape, torch.float16))
    torch.cuda.synchronize()
    rows = torch.tensor([0, 5, 8191, 12_000, n - 1], device="cuda")
    ke, ve = k.expand(1, 4, n, d), v.expand(1, 4, n, d)
    assert rel_err(o[..., rows, :], attention64(q, ke, ve, True, rows)) <= TOL_F64["fp16"]


@pytest.mark.parametrize("kernel,kv_heads,ranks", [("naive", 2, 4), ("tiled", 2, 2), ("tiled", 1, 4),
                                                    ("fused", 2, 2), ("fused", 1, 4)])
def test_gqa_tensor_parallel_layer_sharing_one_gpu(tmp_path, kernel, kv_heads, ranks):
    """The layer with K/V heads split (2 over 2 ranks) and replicated (2 and 1 over 4), gloo."""
    r = tpattn(["--kernel", kernel, "--dist-backend", "gloo", "--seq-len", "1024", "--heads", "8",
                "--kv-heads", str(kv_heads), "--head-dim", "64", "--causal", "--json", str(tmp_path / "r.json")],
               ranks=ranks, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["verdict"] == "PASS" and rep["config"]["kv_heads"] == kv_heads
    assert rep["checks"]["vs_single_process"]["pass"] and rep["checks"]["vs_float64"]["pass"]
