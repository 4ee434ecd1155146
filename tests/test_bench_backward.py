"""scripts/bench_backward.py on CPU: --help answers (exit 0, the flags named); without a GPU the
script refuses in one line with exit 2. The measurement itself runs on a GPU machine only."""

import sys

import pytest
import torch

from conftest import run


def bench(args, timeout=120):
    return run([sys.executable, "scripts/bench_backward.py", *args], timeout=timeout)


def test_help_names_the_flags():
    res = bench(["--help"])
    assert res.returncode == 0, res.stderr
    for flag in ("--seq-lens", "--heads", "--kv-heads", "--head-dim", "--batch", "--dtype", "--causal",
                 "--both-causal", "--warmup", "--iters", "--kernels", "--out", "--max-materialized-n"):
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
