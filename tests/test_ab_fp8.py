"""scripts/ab_fp8.py on CPU: its one-line refusals, and the builds' source (the knobs defined ahead of
the kernel, which keeps a define given first). The timing itself needs a GPU of compute capability 9.0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "ab_fp8.py"


@pytest.mark.parametrize("argv,says", [
    (["--builds", "4:9"], "ab_fp8: --builds '4:9': LAZY is at most 8 (P up to 2^LAZY must stay under e4m3's 448)"),
    (["--builds", "17:0"], "ab_fp8: --builds '17:0': FMA counts pairs of a row's 16, at most 16"),
    (["--builds", "4"], "ab_fp8: --builds '4': give FMA:LAZY pairs such as 4:8"),
    (["--builds", "0:0", "0:0"], "ab_fp8: --builds names a build twice"),
    (["--seq-len", "0"], "ab_fp8: --seq-len must be at least 1 (got 0)"),
])
def test_bad_input_is_one_line(argv, says):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == says, r.stderr


def test_a_build_defines_its_knobs_ahead_of_the_kernels_defaults():
    sys.path.insert(0, str(ROOT / "scripts"))
    from ab_fp8 import build_source
    src = build_source(4, 8)
    assert src.startswith("#define TW_F8_FMA 4\n#define TW_F8_LAZY 8\n")
    # the kernel's own defaults only where nothing was defined before
    assert "#ifndef TW_F8_FMA\n#define TW_F8_FMA 0\n#endif" in src and "#ifndef TW_F8_LAZY\n#define TW_F8_LAZY 0" in src
    assert "hw_softmax<W, TW_F8_FMA, TW_F8_LAZY>" in src
