"""Grouped-query attention on CPU: the K/V-head layout rules, the reference against torch's SDPA with
the K/V heads expanded (the oracle), weights and the float64 check with G K/V heads, the layer and
its API with fewer K/V heads, the memory pre-flight and the report's K/V accounting."""

import math

import pytest
import torch
import torch.nn.functional as F

from tpattn.attention import get_backend, head_chunks, kv_group
from tpattn.attention import reference as ref_mod
from tpattn.check import TOL_FLOAT64, compare, layer_float64, sample_rows
from tpattn.config import Config, ConfigError, resolve, validate
from tpattn.layer import TensorParallelAttention
from tpattn.memory import coefficients, kv_bytes, kv_heads_per_rank
from tpattn.sharding import check_kv_heads, head_range, kv_head_range, kv_replicated, kv_world_sizes
from tpattn.weights import head_weights, layer_input, load_inputs, slice_heads

# ---- the layout rules ---------------------------------------------------------------------------


@pytest.mark.parametrize("H,G", [(8, 8), (8, 4), (8, 2), (8, 1), (12, 4), (32, 8)])
def test_every_rank_holds_the_kv_heads_its_query_heads_use(H, G):
    for W in kv_world_sizes(H, G):
        owners = {}
        for r in range(W):
            kv = kv_head_range(H, G, W, r)
            used = {q // (H // G) for q in head_range(H, W, r)}
            assert set(kv) == used, (H, G, W, r)  # exactly the K/V heads its query heads use
            for j in kv:
                owners.setdefault(j, []).append(r)
        assert sorted(owners) == list(range(G))  # every K/V head is held somewhere
        copies = {len(rs) for rs in owners.values()}
        assert copies == ({W // G} if W > G else {1})  # split: once; replicated: W/G copies each
        assert kv_replicated(H, G, W) == (W > G)


def test_world_sizes_that_work():
    assert kv_world_sizes(8, 2) == [1, 2, 4, 8]
    assert kv_world_sizes(12, 4) == [1, 2, 4, 12]
    assert kv_world_sizes(32, 8) == [1, 2, 4, 8, 16, 32]


def test_refusals_list_the_world_sizes_that_work():
    msg = check_kv_heads(12, 4, 3)
    assert "world size 3 neither divides --kv-heads 4" in msg and "{1, 2, 4, 12}" in msg
    assert "{1, 2, 4, 12}" in check_kv_heads(12, 4, 6)
    msg = check_kv_heads(8, 2, 3)
    assert "--heads 8 is not divisible by world size 3" in msg and "{1, 2, 4, 8}" in msg
    assert "larger than --heads 8" in check_kv_heads(8, 1, 16)
    assert "--kv-heads 3 is not a divisor of --heads 8" in check_kv_heads(8, 3, 1)
    assert "not a divisor" in check_kv_heads(8, 0, 1) and "not a divisor" in check_kv_heads(8, 16, 1)
    assert check_kv_heads(8, 8, 4) is None and check_kv_heads(8, 2, 4) is None and check_kv_heads(8, 1, 8) is None
    assert check_kv_heads(30, 30, 4).startswith("--heads 30 is not divisible by world size 4")  # G = H: as before
    with pytest.raises(ValueError, match="neither divides"):
        kv_head_range(12, 4, 3, 0)


def test_config_refuses_bad_kv_heads():
    for world, kv, needle in ((3, 4, "neither divides --kv-heads 4"), (1, 5, "not a divisor of --heads 12")):
        cfg = resolve(Config(seq_len=16, heads=12, head_dim=8, kv_heads=kv, device="cpu"))
        with pytest.raises(ConfigError, match=needle):
            validate(cfg, world=world)
    cfg = resolve(Config(seq_len=16, heads=12, head_dim=8, device="cpu"))
    assert cfg.kv_heads == 12 and "kv_heads" in cfg.fingerprint()


# ---- the reference against the oracle -----------------------------------------------------------


def sdpa_expanded(q, k, v, causal):
    """The oracle: torch's SDPA in float64 with each K/V head repeated for its query heads."""
    r = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(r, 1),
                                          v.double().repeat_interleave(r, 1), is_causal=causal)


def max_rel(a, ref):
    ref = ref.double()
    return ((a.double() - ref).abs() / (ref.abs() + ref.pow(2).mean().sqrt())).max().item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", [(8, 4), (8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("n,d", [(1, 64), (17, 80), (128, 64), (200, 128)])
def test_reference_matches_sdpa_with_kv_expanded(n, d, h, g, causal):
    gen = torch.Generator().manual_seed(n + d + h + g)
    q = torch.randn(2, h, n, d, generator=gen).half()
    k, v = (torch.randn(2, g, n, d, generator=gen).half() for _ in range(2))
    o = get_backend("reference").forward(q, k, v, causal)
    assert o.shape == q.shape and o.dtype == torch.float16
    assert max_rel(o, sdpa_expanded(q, k, v, causal)) <= 1e-2
    try:  # torch's own grouped-query path, where this torch has one
        gq = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
    except TypeError:
        return
    assert max_rel(o, gq) <= 1e-2


@pytest.mark.parametrize("chunk_heads", [1, 3, 5, 8])
def test_reference_in_head_chunks_gives_the_same_bits(monkeypatch, chunk_heads):
    """Chunks of whole groups, or of part of one group: the same numbers as one chunk."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 33, 16, generator=gen)
    k, v = (torch.randn(2, 2, 33, 16, generator=gen) for _ in range(2))
    whole = get_backend("reference").forward(q, k, v, True)
    monkeypatch.setitem(ref_mod.CHUNK_BYTES, "cpu", 2 * 33 * 33 * 4 * chunk_heads)
    assert torch.equal(get_backend("reference").forward(q, k, v, True), whole)


def test_head_chunks_never_split_a_kv_head_unevenly():
    for h, group in ((8, 4), (8, 1), (8, 8), (12, 6)):
        for chunk in range(1, h + 1):
            chunks = head_chunks(h, group, chunk)
            assert [x for a, b in chunks for x in range(a, b)] == list(range(h))
            for a, b in chunks:
                whole_groups = a % group == 0 and (b - a) % group == 0
                assert b - a <= chunk and (whole_groups or a // group == (b - 1) // group)


def test_kv_group_checks_the_shapes():
    q = torch.zeros(2, 8, 5, 4)
    assert kv_group(q, torch.zeros(2, 2, 5, 4), torch.zeros(2, 2, 5, 4)) == 4
    for bad in ((2, 3, 5, 4), (2, 2, 6, 4), (1, 2, 5, 4), (2, 2, 5, 8)):
        with pytest.raises(ValueError, match="do not fit q"):
            kv_group(q, torch.zeros(bad), torch.zeros(bad))
    with pytest.raises(ValueError, match="one shape"):
        kv_group(q, torch.zeros(2, 2, 5, 4), torch.zeros(2, 4, 5, 4))


# ---- weights, the float64 check ----------------------------------------------------------------


def test_weights_with_fewer_kv_heads_are_per_head_and_world_independent():
    full = head_weights(range(8), 8, 4, seed=2, dtype=torch.float32, device="cpu", kv_heads=range(2))
    assert full["wq"].shape == (32, 32) and full["wk"].shape == (32, 8) and full["bv"].shape == (8,)
    part = head_weights(range(4, 6), 8, 4, seed=2, dtype=torch.float32, device="cpu", kv_heads=range(1, 2))
    assert torch.equal(part["wq"], full["wq"][:, 16:24]) and torch.equal(part["wk"], full["wk"][:, 4:8])
    assert torch.equal(part["wo"], full["wo"][16:24])
    mha = head_weights(range(8), 8, 4, seed=2, dtype=torch.float32, device="cpu")
    assert torch.equal(mha["wk"][:, :8], full["wk"])  # K/V head j is the same numbers either way
    sliced = slice_heads(full, range(4, 6), 4, range(1, 2))
    assert all(torch.equal(sliced[k], part[k]) for k in ("wq", "wk", "wv", "bq", "bk", "bv", "wo"))


def test_float64_check_repeats_each_kv_head_for_its_query_heads():
    """layer_float64 with G K/V heads equals it with the K/V columns repeated to H heads."""
    H, G, d = 6, 2, 4
    w = head_weights(range(H), H, d, seed=3, dtype=torch.float64, device="cpu", kv_heads=range(G))
    x = layer_input(2, 9, H * d, seed=3, dtype=torch.float64, device="cpu")
    rep = dict(w)
    for k in ("wk", "wv"):
        rep[k] = w[k].view(H * d, G, d).repeat_interleave(H // G, dim=1).reshape(H * d, H * d)
    for k in ("bk", "bv"):
        rep[k] = w[k].view(G, d).repeat_interleave(H // G, dim=0).reshape(H * d)
    rows = sample_rows(9)
    assert torch.allclose(layer_float64(x, w, H, True, rows), layer_float64(x, rep, H, True, rows), atol=1e-12)


def test_load_checks_kv_shapes(tmp_path):
    D, G, d = 32, 2, 4
    path = tmp_path / "w.pt"
    torch.save({"wq": torch.randn(D, D), "wk": torch.randn(D, G * d), "wv": torch.randn(D, G * d),
                "wo": torch.randn(D, D), "bk": torch.randn(G * d)}, path)
    got = load_inputs(str(path), 8, d, 1, 5, torch.float16, kv_heads=G)
    assert got["wk"].shape == (D, G * d)
    with pytest.raises(ConfigError, match=r"wk has shape \(32, 8\), expected \(32, 32\) for --heads 8 --head-dim"):
        load_inputs(str(path), 8, d, 1, 5, torch.float16)
    with pytest.raises(ConfigError, match="--kv-heads 4"):
        load_inputs(str(path), 8, d, 1, 5, torch.float16, kv_heads=4)


# ---- the layer and its API ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_with_fewer_kv_heads_matches_float64(dtype, G, causal):
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    H, d, N = 8, 16, 70
    w = head_weights(range(H), H, d, seed=4, dtype=dt, device="cpu", kv_heads=range(G))
    x = layer_input(2, N, H * d, seed=4, dtype=dt, device="cpu")
    layer = TensorParallelAttention(**w, heads=H, kv_heads=G, head_dim=d, causal=causal, group=None)
    assert (layer.local_kv_heads, layer.local_group) == (G, H // G)
    rows = sample_rows(N, limit=N)
    assert compare(layer(x), layer_float64(x, w, H, causal, rows), TOL_FLOAT64[dtype])["pass"]


class GQAModule(torch.nn.Module):
    """A grouped-query attention layer as models write it: separate q/k/v/o projections (k and v
    with G*d outputs), SDPA with enable_gqa (or the K/V heads repeated)."""

    def __init__(self, D, H, G, bias=True):
        super().__init__()
        self.H, self.G, self.d = H, G, D // H
        self.q_proj = torch.nn.Linear(D, D, bias=bias)
        self.k_proj = torch.nn.Linear(D, G * self.d, bias=bias)
        self.v_proj = torch.nn.Linear(D, G * self.d, bias=bias)
        self.o_proj = torch.nn.Linear(D, D, bias=bias)

    def forward(self, x, causal):
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.H, self.d).transpose(1, 2)
        k, v = (p(x).view(B, N, self.G, self.d).transpose(1, 2).repeat_interleave(self.H // self.G, 1)
                for p in (self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(o.transpose(1, 2).reshape(B, N, -1))


@pytest.mark.parametrize("G", [8, 4, 2, 1])
def test_from_linears_with_grouped_kv_projections(G):
    torch.manual_seed(G)
    D, H = 64, 8
    m = GQAModule(D, H, G)
    x = torch.randn(2, 23, D)
    for causal in (False, True):
        layer = TensorParallelAttention.from_linears(m.q_proj, m.k_proj, m.v_proj, m.o_proj, heads=H, causal=causal,
                                                     group=None)
        assert layer.kv_heads == G and layer.wqkv.shape == (D, D + 2 * G * D // H)
        with torch.no_grad():
            assert (layer(x) - m(x, causal)).abs().max().item() < 1e-5


def test_from_full_refuses_mismatched_kv_heads():
    w = head_weights(range(8), 8, 4, seed=0, dtype=torch.float32, device="cpu", kv_heads=range(2))
    with pytest.raises(ValueError, match="kv_heads=4 but wk and wv have 2 heads"):
        TensorParallelAttention.from_full(w["wq"], w["wk"], w["wv"], w["wo"], heads=8, kv_heads=4, group=None)
    with pytest.raises(ValueError, match=r"wk has shape \(32, 6\), expected \[32, G\*4\] for G K/V heads of dim 4"):
        TensorParallelAttention.from_full(w["wq"], w["wk"][:, :6], w["wv"][:, :6], w["wo"], heads=8, group=None)
    with pytest.raises(ValueError, match="expected"):  # the constructor checks this rank's slices
        TensorParallelAttention(w["wq"], w["wk"][:, :4], w["wv"][:, :4], w["wo"], heads=8, kv_heads=2, head_dim=4,
                                group=None)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 6, 8])
def test_layer_head_chunks_with_groups(chunk):
    """head_chunk smaller or larger than a group, or not a multiple of it: the same output."""
    H, G, d = 8, 2, 8
    w = head_weights(range(H), H, d, seed=5, dtype=torch.float32, device="cpu", kv_heads=range(G))
    x = layer_input(1, 30, H * d, seed=5, dtype=torch.float32, device="cpu")
    whole = TensorParallelAttention(**w, heads=H, kv_heads=G, head_dim=d, causal=True, group=None)(x)
    part = TensorParallelAttention(**w, heads=H, kv_heads=G, head_dim=d, causal=True, group=None, head_chunk=chunk)
    assert part.head_chunk == chunk  # its chunks: attention.head_chunks (whole groups or part of one)
    assert (part(x) - whole).abs().max().item() < 1e-6


# ---- memory pre-flight and report ----------------------------------------------------------------


def test_memory_counts_kv_per_rank():
    def cfg(G, **kw):
        return resolve(Config(seq_len=4096, heads=32, head_dim=128, kv_heads=G, device="cpu", check=False,
                              kernel="reference", **kw))
    assert [kv_heads_per_rank(cfg(8), w) for w in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    assert kv_heads_per_rank(cfg(32), 4) == 8
    assert kv_bytes(cfg(8), 2) == 2 * 4096 * 4 * 128 * 2
    a32, b32, c32 = coefficients(cfg(32), 2, 0)
    a8, b8, c8 = coefficients(cfg(8), 2, 0)
    assert a8 == a32  # S and P are per query head
    assert b32 - b8 == 4 * (16 - 4) * 128 * 2  # the GEMM output's K/V columns and their copies: 4 g d el
    assert c32 - c8 == 2 * 4096 * (16 - 4) * 128 * 2  # W_k and W_v
    # replicated (16 ranks, 8 K/V heads): one K/V head each, never less
    assert coefficients(cfg(8), 16, 0)[2] == 2 * 4096 * (2 + 1) * 128 * 2


def test_report_shows_kv_heads(tmp_path):
    import json
    import subprocess
    import sys
    from conftest import ROOT, run_env
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "tpattn", "--seq-len", "40", "--heads", "8", "--kv-heads", "2",
                        "--head-dim", "8", "--device", "cpu", "--warmup", "0", "--iters", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env=run_env(), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["config"]["kv_heads"] == 2 and rep["config"]["kv_heads_per_rank"] == 2
    assert rep["world"]["ranks"][0]["kv_heads"] == "0-1"
    assert rep["memory"]["K_V_bytes_per_rank"] == 2 * 40 * 2 * 8 * 2
    assert "H=8 G=2" in r.stdout and "K/V heads: 2 for 8 query heads (4 each)" in r.stdout
    assert "heads 0-7, K/V heads 0-1" in r.stdout
    assert math.isclose(rep["checks"]["vs_float64"]["tol"], TOL_FLOAT64["fp16"])
