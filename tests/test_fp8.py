"""The FP8 (e4m3) forward's numerics in torch (tpattn/attention/fp8.py), what an FP8 kernel is to match:
e4m3 rounding (nearest even, saturating, subnormals), the scale groups, the Hadamard rotation, the
forward against a scalar re-derivation of its rounding points, grouped heads, the paged cache's
scales, and the accuracy ordering the tables rest on."""

from __future__ import annotations

import math

import pytest
import torch

from tpattn.attention import fp8


def test_e4m3_rounds_to_nearest_even_saturates_and_keeps_subnormals():
    x = torch.tensor([0.3, 1.7, -3.14159, 500.0, -1e6, 2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -9, 1.0625, 1.1875])
    want = [0.3125, 1.75, -3.25, 448.0, -448.0, 2.0 ** -9, 0.0, 2.0 ** -8, 1.0, 1.25]
    assert fp8.e4m3(x).tolist() == want  # 1.0625: a tie, to the even 1.0; 1.1875: a tie, to the even 1.25


def test_every_e4m3_value_is_kept_and_others_land_within_half_a_step():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)]
    assert torch.equal(fp8.e4m3(values), values)
    x = torch.linspace(-448, 448, 100001, dtype=torch.float64)
    err = (fp8.e4m3(x).double() - x).abs()
    normal = x.abs() >= 2.0 ** -6
    assert (err[normal] <= x.abs()[normal] * 2.0 ** -4 + 1e-12).all()  # 3 mantissa bits: half a step


@pytest.mark.parametrize("scaling", fp8.SCALINGS)
def test_quantize_scales_each_group_to_the_e4m3_range(scaling):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 300, 16, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.01]).view(1, 3, 1, 1)
    x8, s = fp8.quantize(x, scaling, block=128)
    assert x8.abs().max() <= 448 and torch.equal(fp8.e4m3(x8), x8)
    rel = ((x8 * s).double() - x).abs() / s.expand_as(x).double()
    assert rel.max() <= 448 * 2.0 ** -4 * 1.0001  # within half a step of the group's largest value
    groups = {"tensor": 1, "head": 6, "block": 6 * 3}[scaling]  # 300 rows: blocks of 128, 128, 44
    assert torch.unique(s.expand_as(x)).numel() == groups
    # each group's largest magnitude lands on 448
    assert torch.isclose(x8.abs().amax(), torch.tensor(448.0))


def test_quantize_a_group_of_zeros_gets_scale_one():
    x8, s = fp8.quantize(torch.zeros(1, 2, 4, 8), "head")
    assert not x8.any() and torch.equal(s, torch.ones_like(s))


def test_hadamard_is_orthonormal_and_needs_a_power_of_two():
    for d in (1, 2, 64, 128, 256):
        h = fp8.hadamard(d)
        assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        fp8.hadamard(96)


def _scalar_fp8_row(q, k, v, i, causal):
    """Row i of one head's FP8 forward, step by step in Python floats, per-head scales: the rounding
    points the module's docstring lists, derived again without its tensor code."""
    def q8(x):
        return fp8.e4m3(torch.tensor(x, dtype=torch.float64)).item()
    sq, sk, sv = (max(abs(x) for row in t for x in row) / 448 for t in (q, k, v))
    d, n = len(q[0]), len(k)
    keys = range(i + 1) if causal else range(n)
    s = {j: sum(q8(q[i][c] / sq) * q8(k[j][c] / sk) for c in range(d)) * sq * sk / math.sqrt(d) for j in keys}
    m = max(s.values())
    p = {j: math.exp(s[j] - m) for j in keys}
    lsum = sum(p.values())
    return [sum(q8(p[j]) * q8(v[j][c] / sv) * sv for j in keys) / lsum for c in range(d)]


@pytest.mark.parametrize("causal", [False, True])
def test_the_forward_follows_its_rounding_points(causal):
    q, k, v = fp8.inputs(1, 1, 1, 5, 8, outliers=0.1, seed=3)
    got = fp8.attention_fp8(q, k, v, causal, "head", out_dtype=torch.float32)[0, 0]
    for i in range(5):
        want = _scalar_fp8_row(q[0, 0].tolist(), k[0, 0].tolist(), v[0, 0].tolist(), i, causal)
        assert torch.allclose(got[i].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaling", fp8.SCALINGS)
def test_grouped_heads_read_their_kv_head_as_if_repeated(scaling):
    q, k, v = fp8.inputs(2, 4, 2, 40, 16, seed=1)
    grouped = fp8.attention_fp8(q, k, v, True, scaling, block=16, out_dtype=torch.float32)
    # repeated K/V heads keep each K/V head's values, hence its scale groups ("tensor": one group)
    rep = fp8.attention_fp8(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), True, scaling, block=16,
                            out_dtype=torch.float32)
    assert torch.equal(grouped, rep)


def test_rotation_leaves_exact_scores_unchanged():
    q, k, v = fp8.inputs(1, 2, 2, 16, 64, seed=2)
    h = fp8.hadamard(64)
    assert torch.allclose((q @ h) @ (k @ h).transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-10)
    with pytest.raises(ValueError, match="power-of-two"):
        fp8.attention_fp8(*fp8.inputs(1, 1, 1, 4, 24), rotate=True)


def test_accuracy_ordering_the_tables_rest_on():
    """N(0, 1) inputs: FP8 far from fp16 but within a few 1e-3; 0.1 % outliers of std 10: per-tensor
    scaling worst, the Hadamard rotation of Q and K better (as FlashAttention-3 reports)."""
    clean = fp8.inputs(1, 4, 4, 512, 128, seed=0)
    ref = fp8.attention_float64(*clean, causal=True)
    e16 = fp8.rmse(fp8.attention_16bit(*clean, causal=True), ref)
    e8 = fp8.rmse(fp8.attention_fp8(*clean, causal=True, scaling="head"), ref)
    assert e16 < 2e-4 and 20 * e16 < e8 < 2e-2
    noisy = fp8.inputs(1, 4, 4, 512, 128, outliers=1e-3, seed=0)
    ref = fp8.attention_float64(*noisy, causal=True)
    tensor = fp8.rmse(fp8.attention_fp8(*noisy, causal=True, scaling="tensor"), ref)
    rotated = fp8.rmse(fp8.attention_fp8(*noisy, causal=True, scaling="block", rotate=True), ref)
    assert rotated < 0.9 * tensor


def test_cache_rows_scale_each_row_alone():
    torch.manual_seed(0)
    rows = torch.randn(6, 2, 16, 32, dtype=torch.float64) * torch.arange(1, 7, dtype=torch.float64).view(6, 1, 1, 1)
    rows[0, 0, 3] = 0
    r8, s = fp8.quantize_rows(rows)
    assert s.shape == (6, 2, 16, 1) and torch.equal(fp8.e4m3(r8), r8) and s[0, 0, 3] == 0 and not r8[0, 0, 3].any()
    amax = rows.abs().amax(-1)
    assert torch.allclose(s.squeeze(-1).double(), amax / 448)  # a zero row's scale 0 (not 1: see quantize_rows)
    assert (r8.abs().amax(-1)[amax > 0] == 448).all()  # each row's largest value is exact
    assert ((r8 * s).double() - rows).abs().le(rows.abs() * 2.0 ** -4 + s.double() * 2.0 ** -10).all()
    assert torch.equal(fp8.dequantize(r8.to(torch.float8_e4m3fn), s.squeeze(-1)), r8 * s)


def test_unknown_scaling_and_uneven_groups_are_refused():
    with pytest.raises(ValueError, match="use one of tensor, head, block"):
        fp8.quantize(torch.ones(1, 1, 2, 2), "row")
    q, k, v = fp8.inputs(1, 3, 2, 4, 8)
    with pytest.raises(ValueError, match="3 query heads do not divide into 2 K/V heads"):
        fp8.attention_fp8(q, k, v)


def test_the_accuracy_script_writes_its_table(tmp_path):
    import json
    import sys

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "scripts"))
    from fp8_accuracy import main
    out = tmp_path / "acc"
    assert main(["--seq-len", "64", "--heads", "2", "--head-dim", "64", "--decode-len", "64", "--causal",
                 "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    rows = res["forward"]["0.1 % outliers, std 10"]
    assert [(r["format"], r["scaling"], r["rotate"]) for r in rows][:4] == [
        ("fp16", "-", False), ("bf16", "-", False), ("e4m3", "tensor", False), ("e4m3", "tensor", True)]
    assert all(0 < r["rmse"] < 0.1 for r in rows) and res["commit"] and res["date"]
    md = out.with_suffix(".md").read_text()
    assert md.count("| N(0, 1) |") == 2 and "per 128-row block" in md


def test_the_caches_per_token_scales_beat_the_per_page_scales_a_cache_can_hold():
    """The FP8 cache's choice (scripts/fp8_accuracy.py's decode rows): a scale per token and K/V head
    against scales per page written a row at a time, raised as the rows come (rounded again) or in
    powers of two (no exact largest value): clearly less error on N(0, 1) and with outliers."""
    import sys

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "scripts"))
    from fp8_accuracy import decode_rows
    for outliers, against, margin in ((0.0, 3, 0.8), (1e-3, 4, 0.6)):
        rows = decode_rows(2, 8, 4, 1024, 128, 16, outliers)
        assert "per token" in rows[1]["cache"] and "rows arriving" in rows[against]["cache"]
        assert rows[0]["rmse"] < 0.1 * rows[1]["rmse"] and rows[1]["rmse"] < margin * rows[against]["rmse"], rows


# ---- --dtype fp8: the layer's attention in this arithmetic (Fp8Backend) ----------------------------

def test_fp8_backend_is_the_emulation_a_head_group_at_a_time(monkeypatch):
    """Fp8Backend.forward: attention_fp8 with the layer's scaling (per 128-row block, rotated), in
    chunks of whole head groups when the scores would be large: the same output as one call."""
    from tpattn.attention import reference
    q, k, v = (t.half() for t in fp8.inputs(2, 8, 2, 300, 64, outliers=1e-3))
    want = fp8.attention_fp8(q, k, v, True, fp8.SCALING, fp8.ROTATE, out_dtype=torch.float16)
    assert torch.equal(fp8.Fp8Backend().forward(q, k, v, True), want)
    monkeypatch.setitem(reference.CHUNK_BYTES, "cpu", 1)  # one head group per chunk
    monkeypatch.setattr(fp8, "CHUNK_BYTES", reference.CHUNK_BYTES)
    assert torch.equal(fp8.Fp8Backend().forward(q, k, v, True), want)
    # the public attention(): the forward where no gradient is asked for, else one line saying how
    from tpattn.attention import attention
    assert torch.equal(attention(q, k, v, True, backend="fp8"), want)
    with torch.no_grad():
        assert torch.equal(attention(q.clone().requires_grad_(), k, v, True, backend="fp8"), want)
    with pytest.raises(Exception, match=r"FP8 attention is forward only .*under torch.no_grad\(\)"):
        fp8.Fp8Backend().attention(q.requires_grad_(), k, v, True)


@pytest.mark.parametrize("args", [[], ["--causal", "--kv-heads", "2"]])
def test_cli_fp8_checks_against_the_fp16_layer_and_float64(args):
    """python -m tpattn --dtype fp8 --check: both checks, by RMS error, PASS; the report names fp8."""
    from conftest import tpattn
    r = tpattn(["--dtype", "fp8", "--check", "--seq-len", "300", "--heads", "4", "--head-dim", "64", *args])
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("vs_fp16_layer", "vs_float64"):
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"check {name}: rms err"))
        rel = float(line.split(" = ")[1].split(" x rms")[0])
        assert 5e-3 < rel < 0.1 and "(tol 0.1) PASS" in line, line  # FP8's error, not fp16's
    assert "dtype=fp8" in r.stdout and "RESULT: PASS" in r.stdout


@pytest.mark.parametrize("args,says", [
    (["--backward"], "--dtype fp8 with --backward: FP8 attention is forward only"),
    (["--decode", "2", "--causal"], "--dtype fp8 with --decode: the KV cache decodes in 16-bit here; for an FP8 "
                                    "cache use --dtype fp16 or bf16 with --kv-dtype fp8"),
    (["--kernel", "tiled", "--device", "cpu"], "--dtype fp8 runs the FP8 arithmetic in torch (--kernel reference)"),
    (["--kernel", "fused", "--device", "cpu"], "--dtype fp8 --kernel fused is the CUDA FP8 kernel: --head-dim 128 on "
                                               "a GPU of compute capability 9.0"),
    (["--head-dim", "96"], "--head-dim must be a power of two, at least 8 (got 96); use 64 or 128"),
    (["--head-dim", "4"], "--head-dim must be a power of two, at least 8 (got 4); use 8"),
    (["--context-parallel", "2"], "--dtype fp8 with --context-parallel"),
])
def test_cli_fp8_refusals_name_the_fix(args, says):
    from conftest import tpattn
    r = tpattn(["--dtype", "fp8", *args])
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.mpi
def test_cli_fp8_on_two_ranks_matches_one():
    from conftest import tpattn
    r = tpattn(["--dtype", "fp8", "--check", "--seq-len", "256", "--heads", "4", "--head-dim", "64", "--causal"], ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check vs_single_process" in r.stdout and "RESULT: PASS" in r.stdout


def test_a_layer_refuses_a_head_dim_its_backend_cannot_run_at_construction():
    """The backend's head dims checked when the layer is built, in the CLI's line (API names), not at
    its first call: FP8's rotation needs a power of two; tiled takes multiples of 8."""
    from tpattn.errors import ConfigError
    from tpattn.layer import TensorParallelAttention
    w = [torch.randn(96, 96).half() for _ in range(4)]
    with pytest.raises(ConfigError, match=r"^dtype fp8 rotates Q and K by a Hadamard matrix: head_dim must be a "
                                          r"power of two, at least 8 \(got 48\); use 32 or 64$"):
        TensorParallelAttention.from_full(*w, heads=2, group=None, backend=fp8.Fp8Backend())
    with pytest.raises(ConfigError, match=r"^backend='tiled' supports head dims that are multiples of 8 up to 256 "
                                          r"\(got 12\)"):
        TensorParallelAttention.from_full(*w, heads=8, group=None, backend="tiled")
    assert fp8.kernel_head_dim_error(128) is None and "takes --head-dim 64, 128 or 256 (got 96)" in \
        fp8.kernel_head_dim_error(96)
    assert TensorParallelAttention.from_full(*w, heads=3, group=None, backend=fp8.Fp8Backend()).head_dim == 32


def test_fp8_backends_by_name_each_its_own_and_a_pickled_layer_keeps_its_backend():
    """The FP8 forwards have names of their own ('fp8', 'fp8_triton', 'fp8_fused'): the API takes them
    as backend= strings (not --kernel choices: --dtype fp8 picks them), the custom ops find each by its
    name (one name each, so one layer's FP8 kernel is never another's), and a pickled FP8 layer comes
    back with its backend. A backend whose name another class already holds is refused in one line."""
    import copy
    import io

    from tpattn.attention import Backend, backend_names, get_backend, register
    from tpattn.attention.reference import ReferenceBackend
    from tpattn.errors import ConfigError
    from tpattn.layer import TensorParallelAttention
    names = {get_backend(n).name for n in ("fp8", "fp8_fused")}
    assert names == {"fp8", "fp8_fused"} and not {"fp8", "fp8_triton", "fp8_fused"} & set(backend_names())
    torch.manual_seed(0)
    w = [torch.randn(64, 64) / 8 for _ in range(4)]
    layer = TensorParallelAttention.from_full(*w, heads=4, group=None, backend="fp8", causal=True).half()
    x = torch.randn(1, 40, 64).half()
    with torch.no_grad():
        y = layer(x)
        twin = copy.deepcopy(layer)
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.backend.name == twin.backend.name == "fp8"
        assert torch.equal(loaded(x), y) and torch.equal(twin(x), y)

    class Clash(ReferenceBackend):
        name = "fused"  # the fused backend's name

    class Nameless(Backend):
        pass

    get_backend("fused")  # the name taken by its class
    with pytest.raises(ConfigError, match=r"^backend Clash is named 'fused', the name of FusedBackend already in "
                                          r"use: give Clash a name of its own \(its `name` attribute\)$"):
        TensorParallelAttention.from_full(*w, heads=4, group=None, backend=Clash())
    with pytest.raises(ConfigError, match="^backend Nameless needs a name of its own"):
        register(Nameless())
    with pytest.raises(ConfigError, match="^unknown backend 'fp9'; choose one of reference, naive, tiled, fused, triton "
                                          r"\(or, FP8 forwards, fp8, fp8_triton, fp8_fused\)$"):
        get_backend("fp9")
