"""scripts/ab_fp8.py on CPU: its one-line refusals, and the builds' source (the knobs defined ahead of
the kernel, which keeps a define given first). The timing itself needs a GPU of compute capability 9.0."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "ab_fp8.py"


@pytest.mark.parametrize("argv,says", [
    (["--builds", "4:9"], "ab_fp8: --builds '4:9': LAZY is at most 8 (P up to 2^LAZY must stay under e4m3's 448)"),
    (["--builds", "17:0"], "ab_fp8: --builds '17:0': FMA counts pairs of a row's 16, at most 16"),
    (["--builds", "4"], "ab_fp8: --builds '4': give FMA:LAZY, FMA:LAZY:TREE or FMA:LAZY:TREE:TURN, such as 4:8, "
                        "0:0:4 or 0:0:1:1"),
    (["--builds", "0:0:1:3"], "ab_fp8: --builds '0:0:1:3': TURN is 0, 1 or 2 (no turns at the softmax, turns at all "
                              "of it, at its exponentials)"),
    (["--builds", "0:0", "0:0:1:0"], "ab_fp8: --builds names a build twice"),
    (["--builds", "0:0:3"], "ab_fp8: --builds '0:0:3': TREE is 1, 2, 4, 8 or 16 (it divides a row's 16 pairs)"),
    (["--builds", "0:0", "0:0:1"], "ab_fp8: --builds names a build twice"),
    (["--builds", "0:0", "0:0"], "ab_fp8: --builds names a build twice"),
    (["--seq-len", "0"], "ab_fp8: --seq-len must be at least 1 (got 0)"),
])
def test_bad_input_is_one_line(argv, says):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == says, r.stderr


def test_a_build_defines_its_knobs_ahead_of_the_kernels_defaults():
    sys.path.insert(0, str(ROOT / "scripts"))
    from ab_fp8 import build_source
    src = build_source(4, 8, 2, 1)
    assert src.startswith("#define TW_F8_FMA 4\n#define TW_F8_LAZY 8\n#define TW_F8_TREE 2\n#define TW_F8_TURN 1\n")
    # the kernel's own defaults only where nothing was defined before
    assert "#ifndef TW_F8_FMA\n#define TW_F8_FMA 0\n#endif" in src and "#ifndef TW_F8_LAZY\n#define TW_F8_LAZY 0" in src
    assert "#ifndef TW_F8_TREE\n#define TW_F8_TREE 1" in src and "#ifndef TW_F8_TURN\n#define TW_F8_TURN 0" in src
    assert "hw_softmax<W, TW_F8_FMA, TW_F8_LAZY, TW_F8_TREE>" in src


NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler here (.ci/run installs one in CI)")
@pytest.mark.parametrize("spec", ["4:8", "0:0:4", "4:8:4", "0:0:1:1", "0:0:1:2", "2:0:1:2", "4:0:1:2"])
def test_a_build_compiles_for_sm90a_without_spills(tmp_path, spec):
    """The knobs' builds that the A/B times: fusedw8 keeps its registers (a spill would time something else)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from ab_fp8 import build_source, parse_build
    src = tmp_path / "ab.cu"
    src.write_text(build_source(*parse_build(spec)))
    r = subprocess.run([NVCC, "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v",
                        str(src), "-o", str(tmp_path / "ab.cubin")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    spills = [line for line in r.stderr.splitlines() if "spill" in line]
    assert len(spills) == 2 and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), spills


def test_labels_name_a_build_as_it_is_given():
    sys.path.insert(0, str(ROOT / "scripts"))
    from ab_fp8 import label, parse_build
    assert [label(parse_build(t)) for t in ("0:0", "0:0:1", "0:0:1:0", "0:0:4", "0:0:1:1", "4:8:2:1")] == \
        ["0:0", "0:0", "0:0", "0:0:4", "0:0:1:1", "4:8:2:1"]
