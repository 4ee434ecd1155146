"""Decoding through the layer: a KV cache of this rank's K/V heads, rotary positions, a Llama
attention from transformers tensor-parallel (prefill then token-by-token decode against the
module's own output, W = 1, 2, 4 under a real mpirun on CPU), and the one-line refusals."""

import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run
from tpattn.decode import apply_rope, rope_tables
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention

pytest.importorskip("transformers", reason="the decode tests need transformers (the test extra installs it)")


@pytest.mark.mpi
@pytest.mark.parametrize("world,ran", [(1, 4), (2, 4), (4, 4)])
def test_llama_attention_prefill_and_decode_match_transformers(world, ran):
    r = run(mpirun_cmd(world) + [sys.executable, str(ROOT / "tests" / "mpi_decode_check.py")], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("DECODE PASS") == world and f"ran {ran}:" in r.stdout, r.stdout + r.stderr


def test_rope_conventions():
    """Halves (Hugging Face) and interleaved (Meta) rotate the same pairs, laid out differently; a
    rotation keeps each pair's norm; position 0 is the identity."""
    t = torch.randn(1, 2, 5, 8)
    cos, sin = rope_tables(torch.arange(5), 8, 100.0)
    halves = apply_rope(t, cos, sin)
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # halves layout -> interleaved layout
    inter = apply_rope(t[..., perm], cos, sin, interleaved=True)
    assert torch.allclose(inter, halves[..., perm], atol=1e-6)
    assert torch.allclose(halves[:, :, 0], t[:, :, 0]) and torch.allclose(halves.norm(dim=-1), t.norm(dim=-1), atol=1e-5)


def _layer(**kw):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    return TensorParallelAttention.from_multihead_attention(mha, causal=True, rope_theta=10000.0, **kw)


def test_decode_matches_the_full_forward_and_says_what_it_holds():
    layer = _layer()
    x = torch.randn(3, 12, 32)
    with torch.no_grad():
        full = layer(x)
        cache = layer.new_cache(3, 16)
        y = torch.cat([layer(x[:, :8], cache=cache), *(layer(x[:, i:i + 1], cache=cache) for i in range(8, 12))], 1)
    assert torch.allclose(y, full, atol=1e-5)
    assert cache.length == 12 and cache.nbytes() == 2 * 3 * 4 * 16 * 8 * 4


def test_decode_refusals():
    layer = _layer()
    cache = layer.new_cache(2, 4)
    with torch.no_grad():
        layer(torch.randn(2, 3, 32), cache=cache)
        with pytest.raises(ConfigError, match=r"max_len=4 positions, 3 filled: this call appends 2 more"):
            layer(torch.randn(2, 2, 32), cache=cache)
        with pytest.raises(ConfigError, match="the cache holds 2 sequences but the input has 1"):
            layer(torch.randn(1, 1, 32), cache=cache)
        with pytest.raises(ConfigError, match="this cache belongs to another layer"):
            _layer()(torch.randn(2, 1, 32), cache=cache)
        with pytest.raises(ConfigError, match="decodes causally"):
            TensorParallelAttention.from_multihead_attention(torch.nn.MultiheadAttention(32, 4, batch_first=True))(
                torch.randn(2, 1, 32), cache=layer.new_cache(2, 4))
    with pytest.raises(ValueError, match="rotary positions need a positive, finite theta and an even head dim"):
        TensorParallelAttention.from_multihead_attention(torch.nn.MultiheadAttention(12, 4, batch_first=True),
                                                         rope_theta=10000.0)


def test_cli_decode_matches_the_full_recompute(tmp_path):
    import json

    from conftest import tpattn
    out = tmp_path / "r.json"
    r = tpattn(["--decode", "6", "--causal", "--seq-len", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                "--device", "cpu", "--iters", "2", "--warmup", "1", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["checks"]["vs_full_recompute"]["pass"] and rep["checks"]["vs_float64"]["pass"]
    assert rep["decode"]["steps"] == 6 and rep["decode"]["tokens_per_s"] > 0 and "prefill" in rep["passes"]
    assert "decode: 6 steps after a prompt of 40" in r.stdout


@pytest.mark.parametrize("ranks", [None, pytest.param(2, marks=pytest.mark.mpi)])
def test_cli_decode_with_an_fp8_cache(ranks, tmp_path):
    """--kv-dtype fp8: the cache in e4m3 pages (tpattn.paged.PagedKV), B sequences packed in the
    prefill; every decoded row within FP8's RMS error of the full 16-bit forward and of float64 (and
    more than fp16's: the pages are e4m3), the cache's MiB that of a byte a value plus a scale."""
    import json

    from conftest import tpattn
    out = tmp_path / "r.json"
    r = tpattn(["--decode", "4", "--causal", "--kv-dtype", "fp8", "--seq-len", "64", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "16", "--batch", "3", "--device", "cpu", "--iters", "1", "--warmup", "1", "--json",
                str(out)], ranks=ranks, timeout=240)
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    full, f64 = rep["checks"]["vs_full_recompute"], rep["checks"]["vs_float64"]
    assert full["pass"] and f64["pass"] and 5e-3 < full["rel_err"] < 0.1 and 5e-3 < f64["rel_err"] < 0.1, rep["checks"]
    g = 2 // (ranks or 1)
    assert rep["decode"]["kv_dtype"] == "fp8"
    assert rep["decode"]["cache_MiB_per_rank"] == pytest.approx(3 * 68 * 2 * g * (16 + 4) / 2**20)
    assert "(e4m3 pages with a scale per token and K/V head)" in r.stdout


@pytest.mark.mpi
def test_cli_decode_over_two_ranks():
    from conftest import tpattn
    r = tpattn(["--decode", "4", "--causal", "--seq-len", "32", "--heads", "4", "--kv-heads", "1", "--head-dim", "16",
                "--device", "cpu", "--iters", "1", "--warmup", "0"], ranks=2, timeout=200)
    assert r.returncode == 0 and "RESULT: PASS" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("extra,says", [([], "--decode decodes causally: add --causal"),
                                        (["--causal", "--sequence-parallel"], "--decode with --sequence-parallel"),
                                        (["--causal", "--cuda-graph"], "--decode with --cuda-graph needs the decode "
                                         "kernel (--dtype fp16 or bf16, --head-dim 32, 64, 80, 96, 128, 160, 192, 256; "
                                         "got fp16, 16)"),
                                        (["--causal", "--kv-dtype", "fp8", "--cuda-graph"], "--kv-dtype fp8 with "
                                         "--cuda-graph: the CLI graphs the contiguous cache's step only")])
def test_cli_decode_refusals(extra, says):
    from conftest import tpattn
    r = tpattn(["--decode", "4", "--seq-len", "32", "--heads", "4", "--head-dim", "16", "--device", "cpu", *extra])
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_fp8_cache_without_decode_is_refused():
    from conftest import tpattn
    r = tpattn(["--kv-dtype", "fp8", "--seq-len", "32", "--heads", "4", "--head-dim", "16", "--device", "cpu"])
    assert r.returncode == 2 and r.stderr.strip() == ("tpattn: error: --kv-dtype fp8 is the KV cache's dtype: add "
                                                      "--decode T (a prompt, then T steps through the cache)"), r.stderr


@pytest.mark.parametrize("d", [32, 96, 256])
def test_cli_graphed_decode_takes_the_decode_kernels_head_dims(d):
    """--decode --cuda-graph at a head dim the decode kernel takes passes the configuration's checks."""
    from tpattn.config import Config, validate
    cfg = Config(device="cuda", kernel="reference", dtype="bf16", dist_backend="nccl", seq_len=64, heads=4, head_dim=d,
                 causal=True, decode=4, cuda_graph=True)
    validate(cfg, gpus_on_node=1)


def test_a_cache_brings_its_own_position_and_counters_and_a_graph_needs_the_kernel():
    """The device copy of the length (what a CUDA graph of a step reads) follows every call; the
    decode kernel's counters come with the cache; graphed(x, cache) refuses, in one line and before
    touching a GPU, where the step would run torch's fallback (it slices at the host's length)."""
    layer = _layer()
    cache = layer.new_cache(3, 16)
    assert cache.tickets.shape == (3 * layer.local_kv_heads,) and not cache.tickets.any()
    with torch.no_grad():
        layer(torch.randn(3, 5, 32), cache=cache)
        layer(torch.randn(3, 1, 32), cache=cache)
        assert cache.length == 6 and int(cache.pos) == 6
        cache.reset()
        assert cache.length == 0 and int(cache.pos) == 0
        with pytest.raises(ConfigError, match=r"^a graphed decode step needs the decode kernel \(a CUDA device, fp16 "
                                              r"or bf16, head dim 32, 64, 80, 96, 128, 160, 192, 256, CuPy; here cpu, "
                                              r"float32, head dim 8\); "
                                              r"call the layer eagerly instead$"):
            layer.graphed(torch.randn(3, 1, 32), cache)
    assert cache.length == 0 and int(cache.pos) == 0



# (bg, length, per_sm, resident, uniform) -> chunks, on 132 SMs: the shapes of
# scripts/sweep_decode_splits.py (an H100: the tensor-core split's blocks 3 an SM, the CUDA-core
# split's 6 contiguous and 4 paged)
SPLITS = [((512, 4096, 2, 3, True), 3),    # B=64 G=8: 512 blocks overflow 396 slots; 1536 fill 4 waves
          ((512, 4096, 2, 3, False), 3),
          ((256, 2048, 2, 3, True), 1),    # B=32 G=8: 1 chunk fits one wave, half the split of 2
          ((256, 2048, 2, 3, False), 3),   # ragged: never fewer chunks than the split
          ((32, 4096, 4, 4, True), 16),    # B=1 G=32 paged: 544 blocks, 528 slots
          ((128, 4096, 4, 4, False), 8),   # B=4 G=32 ragged: 640 blocks -> 1024 of 1056 slots
          ((512, 4096, 4, 4, False), 2),   # B=16 G=32 ragged: 1024 blocks of 1056 slots already
          ((8, 32768, 2, 3, True), 33),    # B=1 G=8 L=32768: 264 blocks fit: the split as before
          ((128, 4096, 2, 3, True), 3)]


@pytest.mark.parametrize("args,chunks", SPLITS)
def test_decode_splits_fill_the_last_wave(args, chunks):
    from tpattn.decode import decode_splits
    bg, length, per_sm, resident, uniform = args
    assert decode_splits(bg, length, 132, per_sm, resident, uniform) == chunks


def test_decode_splits_stay_in_bounds():
    """Whatever the occupancy: at least one chunk, chunks of at least 64 keys (or one), at most the
    combine's 1024; without an occupancy the split per_sm gives, and so for a launch of more waves than
    measured; ragged lengths never fewer chunks."""
    from tpattn.decode import DEC_COMBINE_W, WAVES_MEASURED, decode_splits
    for bg in (1, 3, 8, 32, 100, 128, 512, 2048, 4096):
        for length in (0, 1, 63, 64, 65, 2048, 4096, 32768, 10**6):
            for per_sm in (2, 4):
                S0 = decode_splits(bg, length, 132, per_sm)
                assert S0 == max(1, min(-(-per_sm * 132 // bg), -(-length // 64), DEC_COMBINE_W))
                assert decode_splits(bg, length, 132, per_sm, 1) == S0 or bg * S0 <= WAVES_MEASURED * 132
                for resident in (1, 2, 3, 4, 6, 8):
                    for uniform in (True, False):
                        S = decode_splits(bg, length, 132, per_sm, resident, uniform)
                        assert 1 <= S <= max(1, min(-(-length // 64), DEC_COMBINE_W))
                        assert uniform or S >= S0
                        if bg * S0 <= resident * 132:  # every block resident already: unchanged
                            assert S == S0


def test_split_kernel_takes_the_kernels_occupancy(monkeypatch):
    """_split_kernel asks how many of the kernel's blocks an SM holds and splits by it: B=64 sequences
    of 8 K/V heads overflow 3 blocks an SM at the split of 1 and launch 3 chunks; with no occupancy
    known (0: CuPy or the driver cannot say) the split is the one per_sm gives."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    calls = []
    monkeypatch.setattr(tcuda, "launch", lambda source, name, device, grid, block, args, shared_mem=0:
                        calls.append((name, grid, block)))
    monkeypatch.setattr(decode, "decode_kernel_fits", lambda q: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("P", (), {"multi_processor_count": 132, "major": 8}))
    q = torch.randn(64, 32, 1, 128).half()
    k, v = (torch.randn(64, 8, 4096, 128).half() for _ in range(2))
    tickets = torch.zeros(64 * 8, dtype=torch.int32)
    plain, piped = "dec_mma_f16_d128_r8", "dec_mma_f16_d128_r8_p"
    # blocks an SM of the kernel without and with _p (3 or more chunks) -> the chunks launched
    for resident, chunks in (((3, 3), 3), ((0, 0), 1), ((3, 2), 1)):
        asked = []
        monkeypatch.setattr(tcuda, "resident_blocks", lambda source, name, device, threads, shared_mem=0, r=resident:
                            asked.append((name, threads)) or r[name == piped])
        calls.clear()
        decode.decode_attention(q, k, v, 4096, tickets=tickets)
        (name, grid, block), = calls
        assert grid[:2] == (chunks, 64 * 8) and name == (piped if chunks >= 3 else plain) and block[0] == decode.DEC_THREADS
        # the split of 1 names the plain kernel; 3 chunks for its occupancy name _p, whose own occupancy
        # is asked: 3 keeps 3 chunks; 2 gives 1 chunk (512 blocks fill 1.94 waves of 264), not the _p
        # kernel, and the split stays as it was
        assert asked == [(plain, decode.DEC_THREADS)] + ([(piped, decode.DEC_THREADS)] if resident[0] else [])


@pytest.mark.parametrize("B,G,L,chunks", [(1, 8, 32768, 16), (4, 8, 8192, 4), (16, 8, 4096, 1), (8, 8, 4096, 2),
                                          (2, 8, 100, 2), (33, 4, 4096, 1), (17, 8, 4096, None),
                                          (64, 8, 4096, None), (1, 1, 32768, None), (4, 2, 4096, None)])
def test_staged_split_takes_one_block_an_sm(monkeypatch, B, G, L, chunks):
    """On compute capability 9.0 the staged split over the contiguous cache (_b) takes as many chunks as
    give each (sequence, K/V head) pair's chunks an SM each, where the pairs fit on the SMs (no more
    chunks than 64-key pieces of the cache) and a K/V head serves up to 8 query heads (H = 32 here: G
    of 4 or more); a larger batch, or a larger group (G = 1 or 2, the r16 build), keeps decode_splits'
    count for the kernel's occupancy; so does compute capability 8. A pool's launch (B = 16 here) keeps
    decode_splits' ragged count by default; with DEC_STAGED_PAGED it runs the staged build of
    equal-work chunks (_pgb) where the pairs fit and the group is up to 8 heads, with EQ_SPREAD times
    the one-block count as its grid's chunks a pair (the kernel picks the chunks from the lengths)."""
    from tpattn import cuda as tcuda
    from tpattn import decode
    major = {"v": 9}
    monkeypatch.setattr(tcuda, "resident_blocks", lambda *a, **k: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: type("P", (), {"multi_processor_count": 132, "major": major["v"]}))
    q = torch.zeros(B, 32, 128).half()
    _, name, S, smem = decode._split_kernel(q, B, 32, G, 128, L)
    assert name == f"dec_mma_f16_d128_r{8 if 32 // G <= 8 else 16}_b" and smem == decode.dec_ring_bytes(128)
    if chunks is None:
        assert (B * G > 132 or 32 // G > 8) and S == decode.decode_splits(B * G, L, 132, 2, 2)
    else:
        assert S == chunks and B * G * S <= 132 and S <= -(-L // 64)
    assert decode._split_kernel(q, B, 32, G, 128, L, page=16)[1].endswith("_pg")  # (DEC_STAGED_PAGED off)
    monkeypatch.setattr(decode, "DEC_STAGED_PAGED", True)
    _, pname, pS, psmem = decode._split_kernel(q, B, 32, G, 128, L, page=16)
    if B * G <= 132 and 32 // G <= 8:
        assert pname == "dec_mma_f16_d128_r8_pgb" and psmem == decode.dec_ring_bytes(128)
        assert pS == min(decode.EQ_SPREAD * (132 // (B * G)), -(-L // 64)) == decode.equal_work_chunks(B * G, L, 132)
    else:
        assert pname.endswith("_pg") and pS == decode.decode_splits(B * G, L, 132, 2, 2, False)
    if B == 16:
        major["v"] = 8
        _, name, S, _ = decode._split_kernel(q, B, 32, G, 128, L)
        assert not name.endswith("_b") and S == decode.decode_splits(B * G, L, 132, 2, 2) > 1


def test_resident_blocks_is_zero_without_cupy(monkeypatch):
    import sys

    from tpattn import cuda as tcuda
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    monkeypatch.setattr(tcuda, "_resident", {})
    # (no device index: a lookup of the current device before CuPy's check would raise on CPU torch)
    assert tcuda.resident_blocks("decode_attention.cu", "dec_split_f16_d128_g1", torch.device("cuda"), 128) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
@pytest.mark.parametrize("script", ["ab_decode_staged.py", "profile_decode_steps.py", "sweep_decode_splits.py",
                                    "trace_decode_blocks.py", "time_decode_splits.py"])
def test_decode_gpu_scripts_refuse_without_a_gpu(script):
    """The decode scripts that time or profile kernels say in one line that they need a GPU, and exit
    non-zero, instead of a traceback."""
    r = run([sys.executable, str(ROOT / "scripts" / script)], timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "on a GPU" in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("script,bad", [("trace_decode_blocks.py", "16,8"), ("profile_decode_steps.py", "16,3,4096"),
                                        ("time_decode_splits.py", "1,32,8,x"), ("bench_paged.py", "16,8,0")])
def test_decode_scripts_refuse_a_bad_shape(script, bad):
    """The decode scripts' --shapes (bench_paged.decode_shape): a malformed shape, or K/V heads that do
    not divide the query heads, is argparse's error naming the shape and the form, exit 2, no traceback."""
    r = run([sys.executable, str(ROOT / "scripts" / script), "--shapes", bad], timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"'{bad}'" in r.stderr and ("a shape is" in r.stderr or "a divisor of H" in r.stderr), r.stderr


def test_block_trace_summary():
    """scripts/trace_decode_blocks.py's reading of a trace (ns): the launch's span, the starts' spread,
    the first tile's wait, each block's loop, the last blocks' combine, the tail after the median
    block's end, and the share of the SMs' block slots busy."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("trace_decode_blocks", ROOT / "scripts" / "trace_decode_blocks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import numpy as np
    # start, first tile, rows written, done, SM, combined: 4 blocks on 2 SMs of 2 slots
    trace = np.array([[1000, 3000, 11000, 11000, 0, 0],
                      [1000, 3000, 13000, 13000, 0, 0],
                      [2000, 4000, 12000, 17000, 1, 1],
                      [3000, 5000, 20000, 21000, 1, 1]], dtype=np.uint64)
    trace = np.concatenate([trace, np.zeros((4, 2), dtype=np.uint64)], axis=1)
    s = mod.summary(trace, resident=2, sms=2)
    assert s["span"] == 20.0 and s["start spread"] == 2.0 and s["first tile"] == 2.0
    assert s["loop min/med/max"] == (10.0, 11.0, 17.0)
    assert s["combine med/max"] == (3.0, 5.0) and s["tail"] == 6.0
    assert s["busy slots"] == (10 + 12 + 15 + 18) / 80 and s["SMs used"] == 2


def test_the_preflight_counts_the_decode_cache_and_its_fp8_pages():
    """--decode T: the estimate holds the cache of N + T rows of this rank's K/V heads, d values a
    row each of K and V in the model's dtype, or with --kv-dtype fp8 d bytes and an fp32 scale."""
    from tpattn.config import Config
    from tpattn.memory import estimate
    base = dict(seq_len=256, heads=8, kv_heads=4, head_dim=64, batch=3, kernel="reference", causal=True, check=False)
    none = estimate(Config(**base), 2, 0)
    fp16 = estimate(Config(**base, decode=16), 2, 0)
    fp8 = estimate(Config(**base, decode=16, kv_dtype="fp8"), 2, 0)
    rows, g = 3 * (256 + 16), 2  # B (N + T) rows, 4 K/V heads over 2 ranks
    assert fp16 - none == rows * 2 * g * 64 * 2 and fp8 - none == rows * 2 * g * (64 + 4)
