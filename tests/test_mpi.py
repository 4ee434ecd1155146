"""Several ranks under a real mpirun (gloo on CPU): the tensor-parallel output equals the
single-process baseline, through the CLI and through the API; errors end every rank quickly."""

import json
import sys
import time

import pytest

from conftest import ROOT, mpirun_cmd, run, tpattn
from tpattn.sharding import row_chunks

pytestmark = pytest.mark.mpi
SHAPE = ["--seq-len", "96", "--heads", "12", "--head-dim", "16", "--warmup", "1", "--iters", "2", "--device", "cpu"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cli_matches_baseline(world, tmp_path):
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--causal", "--json", str(out)], ranks=world, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["world"]["size"] == world and rep["world"]["launcher"] == "mpi"
    assert rep["world"]["backend"] == "gloo"
    assert [x["heads"] for x in rep["world"]["ranks"]] == [f"{r * 12 // world}-{(r + 1) * 12 // world - 1}"
                                                         for r in range(world)]
    assert rep["verdict"] == "PASS" and rep["checks"]["vs_float64"]["pass"]
    if world > 1:
        base = rep["checks"]["vs_single_process"]
        assert base["pass"] and base["rel_err"] <= base["tol"]
        assert rep["allreduce"]["bytes"] == 96 * 12 * 16 * 4  # fp32 partials [1, N, D]
        assert "reduce-scatter:" in r.stdout and "all-gather:" in r.stdout and "busbw" in r.stdout
    assert r.stdout.count("RESULT: PASS") == 1  # only rank 0 reports


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("style", [["--sequence-parallel"], ["--overlap", "3", "--causal"],
                                   ["--sequence-parallel", "--overlap", "2", "--causal"]])
def test_sequence_parallel_and_overlap_match_baseline(world, style, tmp_path):
    """The second parallel style and the overlapped collectives: the same output as one process."""
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + style + ["--json", str(out)], ranks=world, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["world"]["size"] == world
    sp = "--sequence-parallel" in style
    assert rep["config"]["style"].startswith("sequence-parallel" if sp else "head-parallel")
    if world > 1:
        assert rep["checks"]["vs_single_process"]["pass"]
        colls = rep["collectives"]
        if sp:  # the same bytes as the all-reduce, in two collectives: x gathered (fp16), partials scattered (fp32)
            assert colls["allgather"]["bytes"] == 96 * 12 * 16 * 2 and colls["reducescatter"]["bytes"] == 96 * 12 * 16 * 4
            assert "all-gather:" in r.stdout and "reduce-scatter:" in r.stdout
        elif all((r1 - r0) % world == 0 for r0, r1 in row_chunks(96, int(style[1]) if len(style) > 1 else 1)):
            # fp32 partials: reduce-scattered in fp32, the rounded rows all-gathered (3/4 of the bytes)
            assert list(colls) == ["reducescatter", "allgather"]
            assert colls["reducescatter"]["bytes"] == 96 * 12 * 16 * 4 and colls["allgather"]["bytes"] == 96 * 12 * 16 * 2
            assert "(reduce-scatter + all-gather)" in r.stdout
        else:  # a chunk's rows do not divide by the world size (32 rows, 3 ranks): the all-reduce
            assert list(colls) == ["allreduce"]
        assert all(c["busbw_GBps"] > 0 for c in colls.values())
        assert "communication:" in r.stdout and "ms outside its compute passes" in r.stdout


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("how,colls", [("allreduce", ["allreduce"]), ("split", ["reducescatter", "allgather"])])
def test_output_collective_choice(world, how, colls, tmp_path):
    """Both ways of summing the partials give the baseline's output; the report names what ran."""
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--output-collective", how, "--overlap", "2", "--json", str(out)], ranks=world, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["checks"]["vs_single_process"]["pass"]
    assert list(rep["collectives"]) == colls
    for name, c in rep["collectives"].items():  # every rank's per-call samples reached the report
        assert c["last_rank_from"] == "calls" and c["last_rank_ms"] <= rep["passes"][name]["min"] + 1e-9


def test_auto_keeps_the_all_reduce_when_rows_do_not_split(tmp_path):
    """97 rows over 2 ranks: no reduce-scatter of equal blocks, so auto runs the all-reduce."""
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--seq-len", "97", "--json", str(out)], ranks=2, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(json.loads(out.read_text())["collectives"]) == ["allreduce"]


@pytest.mark.parametrize("args,needle", [
    (["--sequence-parallel", "--seq-len", "97"], "--sequence-parallel needs --seq-len divisible by the world size 2"),
    (["--sequence-parallel", "--overlap", "5"], "--overlap 5 with --sequence-parallel needs the 48 rows"),
    (["--output-collective", "split", "--seq-len", "97"], "--output-collective split needs --batch x the rows"),
    (["--output-collective", "allreduce", "--sequence-parallel"], "is for the head-parallel style"),
    (["--output-collective", "p2p"], "--output-collective p2p needs one GPU per rank"),
    (["--output-collective", "oneshot"], "--output-collective oneshot needs --device cuda"),
    (["--output-collective", "p2p", "--sequence-parallel"], "is for the head-parallel style"),
])
def test_sequence_parallel_refusals_on_every_rank(args, needle):
    r = tpattn(SHAPE + args, ranks=2, timeout=60)
    assert r.returncode == 2
    lines = [ln for ln in error_lines(r) if needle in ln]
    assert sorted(ln.split(":")[1] for ln in lines) == [" rank 0", " rank 1"], r.stderr


def test_model_dtype_reduce_passes(tmp_path):
    out = tmp_path / "r.json"
    r = tpattn(SHAPE + ["--reduce-dtype", "model", "--json", str(out)], ranks=2, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["allreduce"]["bytes"] == 96 * 12 * 16 * 2


@pytest.mark.parametrize("world", [2, 3])
def test_api_matches_multihead_attention(world):
    r = run(mpirun_cmd(world) + [sys.executable, str(ROOT / "tests" / "mpi_api_check.py")], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("API PASS") == world


def test_api_single_process_matches_multihead_attention():
    r = run([sys.executable, str(ROOT / "tests" / "mpi_api_check.py")], timeout=60)
    assert r.returncode == 0 and "API PASS rank 0 of 1" in r.stdout, r.stderr


def error_lines(r):
    from conftest import rank_lines
    return rank_lines(r.stderr)


def test_heads_not_divisible_errors_on_every_rank():
    t0 = time.monotonic()
    r = tpattn(SHAPE[:2] + ["--heads", "10", "--device", "cpu"], ranks=4, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 2
    lines = error_lines(r)
    assert sorted(int(ln.split()[2].rstrip(":")) for ln in lines) == [0, 1, 2, 3]
    assert all("--heads 10 is not divisible by world size 4" in ln and "{1, 2, 5, 10}" in ln for ln in lines)


def test_more_ranks_than_heads():
    r = tpattn(["--seq-len", "32", "--heads", "2", "--device", "cpu"], ranks=3, timeout=60)
    assert r.returncode == 2
    assert len(error_lines(r)) == 3 and "larger than --heads 2" in r.stderr


def test_arguments_that_differ_between_ranks():
    """MPMD launch: rank 1 gets another --seq-len; every rank refuses before any collective."""
    base = [sys.executable, "-m", "tpattn", "--heads", "4", "--device", "cpu"]
    cmd = mpirun_cmd(1) + base + ["--seq-len", "64"] + [":", "-n", "1"] + base + ["--seq-len", "128"]
    t0 = time.monotonic()
    r = run(cmd, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 2
    lines = error_lines(r)
    assert len(lines) == 2
    assert all("arguments differ between ranks (seq_len: rank 0 has 64, rank 1 has 128)" in ln for ln in lines)


def test_error_on_one_rank_ends_the_job():
    t0 = time.monotonic()
    r = tpattn(SHAPE, ranks=3, timeout=60, TPATTN_DEBUG_INJECT_FAULT="1:forward:raise")
    assert time.monotonic() - t0 < 30
    assert r.returncode != 0
    assert "tpattn: rank 1: failed: InjectedFault: injected fault at step forward" in r.stderr
