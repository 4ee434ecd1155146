"""Grouped-query attention under a real mpirun (gloo on CPU): world sizes 1-4 with H = 8 query heads
and G in 8, 4, 2, 1 K/V heads, the K/V heads split (W divides G) and replicated (W a multiple of G),
through the CLI (against the single-process baseline and float64) and the API (one mpirun per world
size loops over every G: tests/mpi_gqa_check.py); a world size that fits neither is refused on
every rank with the world sizes that work."""

import json
import sys

import pytest

from conftest import ROOT, mpirun_cmd, rank_lines, run, tpattn

pytestmark = pytest.mark.mpi
SHAPE = ["--seq-len", "48", "--head-dim", "8", "--warmup", "0", "--iters", "1", "--device", "cpu"]


@pytest.mark.parametrize("world,heads,kv,style", [
    (1, 8, 2, ["--causal"]),
    (2, 8, 4, []),                                 # split: 2 K/V heads per rank
    (2, 8, 1, ["--causal", "--overlap", "2"]),     # replicated: the one K/V head on both ranks
    (3, 12, 3, ["--causal"]),                      # split: 1 each
    (3, 12, 1, ["--sequence-parallel"]),           # replicated on 3 ranks
    (4, 8, 4, ["--causal", "--output-collective", "allreduce"]),  # split: 1 each
    (4, 8, 2, ["--causal"]),                       # replicated: each K/V head on 2 ranks
    (4, 8, 1, ["--sequence-parallel", "--overlap", "2"]),         # replicated: on all 4
])
def test_cli_gqa_matches_baseline(world, heads, kv, style, tmp_path):
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--heads", str(heads), "--kv-heads", str(kv), *style, "--json", str(out)], ranks=world,
               timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["world"]["size"] == world and rep["config"]["kv_heads"] == kv
    assert rep["checks"]["vs_float64"]["pass"]
    if world > 1:
        assert rep["checks"]["vs_single_process"]["pass"]
    h = heads // world
    group = heads // kv
    want = [f"{r * h // group}-{(r + 1) * h // group - 1}" if kv % world == 0 else f"{r * h // group}-{r * h // group}"
            for r in range(world)]
    assert [x["kv_heads"] for x in rep["world"]["ranks"]] == want
    assert [x["heads"] for x in rep["world"]["ranks"]] == [f"{r * h}-{(r + 1) * h - 1}" for r in range(world)]
    assert rep["config"]["kv_layout"] == ("split" if kv % world == 0 else "replicated")
    g = kv // world if kv % world == 0 else 1  # K/V heads a rank holds
    assert rep["config"]["kv_heads_per_rank"] == g and rep["memory"]["K_V_bytes_per_rank"] == 2 * 48 * g * 8 * 2
    assert f"G={kv}" in r.stdout and r.stdout.count("K/V head") >= world


@pytest.mark.parametrize("world,heads,kv,needle", [
    (3, 8, 2, "--heads 8 is not divisible by world size 3; with --kv-heads 2 run with a world size in {1, 2, 4, 8}"),
    (3, 12, 4, "world size 3 neither divides --kv-heads 4"),
    (2, 8, 3, "--kv-heads 3 is not a divisor of --heads 8"),
])
def test_gqa_refusals_on_every_rank(world, heads, kv, needle):
    r = tpattn(SHAPE + ["--heads", str(heads), "--kv-heads", str(kv)], ranks=world, timeout=60)
    assert r.returncode == 2
    lines = [ln for ln in rank_lines(r.stderr) if needle in ln]
    assert sorted(int(ln.split()[2].rstrip(":")) for ln in lines) == list(range(world)), r.stderr
    if "neither" in needle:
        assert "{1, 2, 4, 12}" in lines[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_api_gqa_matches_module_for_every_kv_head_count(world):
    r = run(mpirun_cmd(world) + [sys.executable, str(ROOT / "tests" / "mpi_gqa_check.py")], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("GQA API PASS") == world
    assert f"20 configs, {2 if world == 3 else 0} refused" in r.stdout
