"""scripts/bench_backward.py on CPU: --help answers (exit 0, the flags named); without a GPU the
script refuses in one line with exit 2; the later rounds' bookkeeping on fake timers. The measurement
itself runs on a GPU machine only."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import run


def bench(args, timeout=120):
    return run([sys.executable, "scripts/bench_backward.py", *args], timeout=timeout)


def test_help_names_the_flags():
    res = bench(["--help"])
    assert res.returncode == 0, res.stderr
    for flag in ("--seq-lens", "--heads", "--kv-heads", "--head-dim", "--batch", "--dtype", "--causal",
                 "--both-causal", "--warmup", "--iters", "--kernels", "--out", "--max-materialized-n", "--rounds"):
        assert flag in res.stdout, flag
    for word in ("backward", "TFLOP/s", "median", "sdpa_flash", "sdpa_cudnn", "4096 16384", "fp16"):
        assert word in res.stdout, word


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would measure")
def test_refuses_without_gpu_in_one_line(tmp_path):
    res = bench(["--out", str(tmp_path / "b")])
    assert res.returncode == 2
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "CUDA GPU" in lines[0], lines
    assert not list(tmp_path.iterdir())



@pytest.mark.parametrize("flag", [["--rounds", "0"], ["--iters", "0"], ["--warmup", "-1"]])
def test_refuses_a_count_below_one_in_one_line(flag, tmp_path):
    res = bench([*flag, "--out", str(tmp_path / "b")])
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "--rounds and --iters must be at least 1" in lines[0], lines
    assert not list(tmp_path.iterdir())


def test_later_rounds_take_turns_and_report_the_median(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_backward as bb

    order = []

    def timer(name, bwd):
        it = iter(bwd)

        def again():
            order.append(name)
            b = next(it)
            return {"fwd": 1.0, "bwd": b, "fwd+bwd": 1.0 + b}
        return again

    rows = [bb.with_times({"kernel": n, "status": "ok", "rounds_ms": {"fwd": [1.0], "bwd": [b0], "fwd+bwd": [1 + b0]}},
                          {"fwd": 1.0, "bwd": b0, "fwd+bwd": 1 + b0}, 1e12)
            for n, b0 in (("fused", 9.0), ("sdpa_cudnn", 2.0))]
    rows.append({"kernel": "naive", "status": "skipped"})
    timers = {"fused": timer("fused", [3.0, 4.0]), "sdpa_cudnn": timer("sdpa_cudnn", [2.5, 1.0])}
    bb.later_rounds(rows, timers, SimpleNamespace(rounds=3), 1e12)
    assert order == ["fused", "sdpa_cudnn", "fused", "sdpa_cudnn"]  # the kernels alternate within each round
    fused, cudnn, naive = rows
    assert fused["rounds_ms"]["bwd"] == [9.0, 3.0, 4.0] and fused["bwd_ms"] == 4.0
    assert cudnn["bwd_ms"] == 2.0 and cudnn["fwdbwd_ms"] == 3.0
    assert fused["bwd_tflops"] == pytest.approx(bb.BWD_FLOPS * 1e12 / 4e-3 / 1e12)
    assert "bwd_ms" not in naive
