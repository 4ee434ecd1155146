"""Every kernels/*.cu compiles for sm_80 and sm_90 with nvcc (NVRTC compiles the same source on the GPU)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tpattn.cuda import kernel_sources

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def test_there_are_kernels():
    names = [p.name for p in kernel_sources()]
    assert "naive_attention.cu" in names


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler here (.ci/run installs one in CI)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("src", kernel_sources(), ids=lambda p: p.name)
def test_kernel_compiles(src, arch, tmp_path):
    r = subprocess.run([NVCC, f"-arch={arch}", "-Werror", "all-warnings", "-c", str(src), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    syms = subprocess.run(["nm", str(tmp_path / "k.o")], capture_output=True, text=True).stdout
    if src.name == "naive_attention.cu":
        for k in ("qkKernel", "softmaxKernel", "pvKernel"):
            for suf in ("f16", "bf16", "f32"):
                assert f"{k}_{suf}" in syms
