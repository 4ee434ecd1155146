"""Every kernels/*.cu compiles for sm_80 and sm_90 with nvcc (NVRTC compiles the same source on the GPU)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tpattn.config import ConfigError
from tpattn.cuda import ARCH_SPECIFIC, kernel_sources

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def test_there_are_kernels():
    names = [p.name for p in kernel_sources()]
    assert "naive_attention.cu" in names


def _targets():
    """(file, arch): every file for sm_80 and sm_90, an arch-specific one (wgmma) for its own arch only."""
    for src in kernel_sources():
        spec = ARCH_SPECIFIC.get(src.name)
        for arch in ([spec[1]] if spec else ["sm_80", "sm_90"]):
            yield pytest.param(src, arch, id=f"{src.name}-{arch}")


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler here (.ci/run installs one in CI)")
@pytest.mark.parametrize("src,arch", list(_targets()))
def test_kernel_compiles(src, arch, tmp_path):
    gencode = f"arch={arch.replace('sm_', 'compute_')},code={arch}"
    r = subprocess.run([NVCC, "-gencode", gencode, "-Werror", "all-warnings", "-Xptxas", "-v", "-c", str(src),
                        "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # ptxas says so when it has to serialize wgmma (a pipeline the kernel relies on, lost)
    assert "serialized" not in r.stderr, r.stderr
    syms = subprocess.run(["nm", str(tmp_path / "k.o")], capture_output=True, text=True).stdout
    if src.name == "naive_attention.cu":
        for k in ("qkKernel", "softmaxKernel", "pvKernel"):
            for suf in ("f16", "bf16", "f32"):
                assert f"{k}_{suf}" in syms


def test_hopper_kernels_exist_and_are_refused_elsewhere(monkeypatch):
    from tpattn.attention.fused import HOPPER_SOURCE, kernel_for
    assert HOPPER_SOURCE in ARCH_SPECIFIC and ARCH_SPECIFIC[HOPPER_SOURCE][0] == (9, 0)
    monkeypatch.delenv("TPATTN_FUSED_CFG", raising=False)
    assert kernel_for(128, "f16", (9, 0)).source == HOPPER_SOURCE
    assert kernel_for(128, "f16", (8, 0)).source != HOPPER_SOURCE
    monkeypatch.setenv("TPATTN_FUSED_CFG", "fusedh_{suf}_d{d}")
    with pytest.raises(ConfigError, match="compute capability 9.0"):
        kernel_for(64, "bf16", (8, 9))
