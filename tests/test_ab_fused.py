"""scripts/ab_fused.py on CPU: the kernel source at a git revision (headers inlined from the same
revision, as the launcher inlines the working tree's), --help, and the one-line refusals (an unknown
revision or shape; no Hopper GPU). The timing itself runs on an H200 only."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import ab_fused  # noqa: E402
from tpattn.cuda import kernel_source  # noqa: E402


def run(args, timeout=120):
    return subprocess.run([sys.executable, "scripts/ab_fused.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_source_at_head_inlines_the_headers_of_that_revision():
    src = ab_fused.source_at("HEAD")
    assert '#include "hopper_common.cuh"' not in src and '#include "tc_common.cuh"' not in src
    assert "hw_smem_base" in src and "tw_fused" in src and "#pragma once" not in src
    clean = not subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "kernels"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    if clean:  # the working tree's kernels are HEAD's: the same text the launcher compiles
        assert src == kernel_source(ab_fused.KERNEL)


def test_help_names_the_builds_and_shapes():
    res = run(["--help"])
    assert res.returncode == 0, res.stderr
    for word in ("--against", "--configs", "fusedw3_{suf}_d{d}", "--only", "--rounds", "ViT-B/16", "working tree"):
        assert word in res.stdout, word


@pytest.mark.parametrize("argv,says", [(["--against", "no-such-revision-x"], "git has no kernels/fused_ws_attention.cu"),
                                       (["--against", "HEAD", "--only", "ViT-Z"], "no shape 'ViT-Z'"),
                                       (["--configs", "fusedw4_{suf}_d{d}"], "is not a fusedw kernel name"),
                                       (["--against", "no/such/file.cu"], "no file 'no/such/file.cu'; write one with"),
                                       (["--save-source", "HEAD", "x.txt"], "--save-source writes a .cu file"),
                                       ([], "nothing to compare")])
def test_bad_input_is_one_line(argv, says, tmp_path):
    res = run([*argv, "--out", str(tmp_path / "o")])
    assert res.returncode == 2
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would measure")
@pytest.mark.parametrize("saved", [False, True])
def test_refuses_without_a_hopper_gpu_in_one_line(tmp_path, saved):
    """--against HEAD, or a file --save-source wrote (read and accepted before the GPU check): the
    only refusal left is the missing GPU."""
    against = "HEAD"
    if saved:
        against = str(tmp_path / "head.cu")
        assert run(["--save-source", "HEAD", against]).returncode == 0
    res = run(["--against", against, "--out", str(tmp_path / "o")])
    assert res.returncode == 2
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "compute capability 9.0" in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_save_source_writes_the_revision_that_against_reads_back(tmp_path):
    f = tmp_path / "head.cu"
    res = run(["--save-source", "HEAD", str(f)])
    assert res.returncode == 0, res.stderr
    assert f.read_text() == ab_fused.source_at("HEAD")
    assert ab_fused.label_of(str(f)) == "head" and ab_fused.label_of("4b8845f") == "4b8845f"
    res = run(["--save-source", "no-such-revision-x", str(tmp_path / "x.cu")])
    assert res.returncode == 2 and "git has no kernels/fused_ws_attention.cu" in res.stderr
    assert not (tmp_path / "x.cu").exists()
