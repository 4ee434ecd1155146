"""Uneven heads (--uneven-heads, issue #17) under a real mpirun (gloo on CPU): 28 heads on 8 ranks,
6 on 4 and 5 on 2, causal and not, through the CLI (against the single-process baseline and
float64) and through the API (tests/mpi_uneven_check.py: from nn.MultiheadAttention, every style,
one mpirun per world size); with --kv-heads whole K/V groups per rank; --load sliced by the uneven
blocks; the refusals on every rank, with the flag named where it would help."""

import json
import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, rank_lines, run, tpattn
from tpattn.sharding import head_counts

pytestmark = pytest.mark.mpi
SHAPE = ["--seq-len", "48", "--head-dim", "8", "--warmup", "0", "--iters", "1", "--device", "cpu"]


def spans(counts):
    starts = [sum(counts[:r]) for r in range(len(counts))]
    return [f"{a}-{a + c - 1}" for a, c in zip(starts, counts)]


def check_report(rep, world, heads, counts):
    assert rep["verdict"] == "PASS" and rep["world"]["size"] == world and rep["config"]["uneven_heads"]
    assert rep["checks"]["vs_single_process"]["pass"] and rep["checks"]["vs_float64"]["pass"]
    assert [x["heads"] for x in rep["world"]["ranks"]] == spans(counts)
    assert rep["config"]["heads_by_rank"] == counts and rep["config"]["heads_per_rank"] == max(counts)
    assert rep["config"]["uneven"] is True
    bal = rep["balance"]
    assert len(bal["compute_ms_by_rank"]) == world and 0 <= bal["slowest_rank"] < world
    assert bal["max_ms"] == max(bal["compute_ms_by_rank"]) and bal["max_over_mean"] >= 1
    assert bal["slowest_heads"] == counts[bal["slowest_rank"]]
    assert bal["heads_max_over_mean"] == pytest.approx(max(counts) * world / sum(counts))


@pytest.mark.parametrize("world,heads,style", [
    (8, 28, []),
    (8, 28, ["--causal"]),
    (4, 6, []),
    (4, 6, ["--causal", "--sequence-parallel"]),
    (2, 5, ["--causal"]),
    (2, 5, ["--overlap", "2", "--output-collective", "allreduce"]),
])
def test_cli_uneven_heads_match_baseline(world, heads, style, tmp_path):
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--heads", str(heads), "--uneven-heads", *style, "--json", str(out)], ranks=world,
               timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    counts = head_counts(heads, world)
    check_report(rep, world, heads, counts)
    big = counts.count(counts[0])
    who = "rank 0 owns" if big == 1 else f"ranks 0-{big - 1} own"
    assert f"heads/rank={counts[0]} or {counts[-1]} (uneven)" in r.stdout
    assert f"uneven heads: {who} {counts[0]} heads" in r.stdout
    assert "balance: compute per rank" in r.stdout and "imbalance max/mean" in r.stdout
    assert r.stdout.count("RESULT: PASS") == 1


def test_cli_uneven_gqa_whole_groups(tmp_path):
    """12 query heads on 4 K/V heads (groups of 3) over 3 ranks: 2 groups, 1, 1."""
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--heads", "12", "--kv-heads", "4", "--uneven-heads", "--causal", "--sequence-parallel",
                        "--json", str(out)], ranks=3, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    check_report(rep, 3, 12, [6, 3, 3])
    assert [x["kv_heads"] for x in rep["world"]["ranks"]] == ["0-1", "2-2", "3-3"]
    assert rep["config"]["kv_layout"] == "split" and rep["config"]["kv_heads_per_rank"] == 2
    assert "rank 0 owns 2 K/V groups (6 query heads), ranks 1-2 1 (3)" in r.stdout


def test_cli_uneven_load(tmp_path):
    """--load's full weights sliced by the uneven blocks: the same output as one process."""
    torch.manual_seed(3)
    H, d, D = 5, 8, 40
    path = tmp_path / "w.pt"
    torch.save({"wq": torch.randn(D, D) / 7, "wk": torch.randn(D, D) / 7, "wv": torch.randn(D, D) / 7,
                "wo": torch.randn(D, D) / 7, "bq": torch.randn(D) / 10, "bo": torch.randn(D) / 10}, path)
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--heads", str(H), "--uneven-heads", "--load", str(path), "--json", str(out)], ranks=2,
               timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    check_report(json.loads(out.read_text()), 2, H, [3, 2])


@pytest.mark.parametrize("world,args,needle", [
    (2, ["--heads", "5"], "--heads 5 is not divisible by world size 2; run with a world size in {1, 5}, change "
                          "--heads, or pass --uneven-heads (rank 0 owns 3 heads, rank 1 2)"),
    (3, ["--heads", "8", "--kv-heads", "2", "--uneven-heads"],
     "--uneven-heads splits whole K/V groups (4 query heads and their K/V head) over the ranks, and world size 3 "
     "is more than the 2 groups of --kv-heads 2"),
    (3, ["--heads", "2", "--uneven-heads"], "world size 3 is larger than --heads 2"),
])
def test_uneven_refusals_on_every_rank(world, args, needle):
    r = tpattn(SHAPE + args, ranks=world, timeout=60)
    assert r.returncode == 2
    lines = [ln for ln in rank_lines(r.stderr) if needle in ln]
    assert sorted(int(ln.split()[2].rstrip(":")) for ln in lines) == list(range(world)), r.stderr


@pytest.mark.parametrize("world", [2, 4, 8])
def test_api_uneven_heads_match_multihead_attention(world):
    r = run(mpirun_cmd(world) + [sys.executable, str(ROOT / "tests" / "mpi_uneven_check.py")], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("UNEVEN API PASS") == world and "8 configs" in r.stdout
