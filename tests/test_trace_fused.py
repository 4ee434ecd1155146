"""scripts/trace_fused.py on CPU: the events the TW_TRACE build writes are decoded and summed as they
should be, --help answers, and the kernel still compiles with TW_TRACE defined (the GPU runs it)."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
trace_fused = pytest.importorskip("trace_fused")
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _raw(rows: dict) -> np.ndarray:
    """A trace buffer: rows[(block, role)] = [(code, clock), ...]."""
    raw = np.zeros(trace_fused.BLOCKS * trace_fused.ROLES * trace_fused.LEN, dtype=np.uint64)
    for (b, r), events in rows.items():
        base = (b * trace_fused.ROLES + r) * trace_fused.LEN
        for i, (code, clk) in enumerate(events):
            raw[base + i] = (code << 48) | clk
    return raw


def test_decode_splits_by_block_and_role_and_stops_at_zero():
    raw = _raw({(0, 0): [(20, 5), (21, 9)], (1, 2): [(1, 100), (2, 130)]})
    tr = trace_fused.decode(raw)
    assert tr[0][0] == [(20, 5), (21, 9)]
    assert tr[1][2] == [(1, 100), (2, 130)]
    assert tr[0][1] == [] and tr[3][3] == []


def test_summary_leaves_out_each_blocks_first_tile():
    # consumer 0 of block 0: three tiles of 1000, 400 and (last, no next start) cycles; tile n's Q in after
    # 10 * (n + 1) cycles; the producer freed tile n's Q stage at 0, 500 and 900
    c0 = [(1, 0), (2, 10), (1, 1000), (2, 1020), (1, 1400), (2, 1430)]
    raw = _raw({(0, 1): c0, (0, 0): [(21, 0), (21, 500), (21, 900)]})
    sm = trace_fused.summary(trace_fused.decode(raw))
    assert sm["tiles"] == 1 and sm["tile_cycles"] == 400  # only the second tile has a next start
    assert sm["steps"]["tile start -> Q in"] == {"mean": 25, "count": 2}  # tiles 1 and 2: 20 and 30
    assert sm["q_stage_free_before_q_in"] == (1020 - 500 + 1430 - 900) / 2


def test_help_answers():
    r = subprocess.run([sys.executable, "scripts/trace_fused.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--events" in r.stdout and "TW_TRACE" in r.stdout and "--fp8-build" in r.stdout


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler here (.ci/run installs one in CI)")
@pytest.mark.parametrize("kernel", ["fused_ws_attention.cu", "fused_ws_fp8.cu"])
def test_the_traced_kernel_compiles(tmp_path, kernel):
    from tpattn.cuda import kernel_source
    src = tmp_path / "traced.cu"
    src.write_text("#define TW_TRACE\n" + kernel_source(kernel))
    r = subprocess.run([NVCC, "-gencode", "arch=compute_90a,code=sm_90a", "-Werror", "all-warnings", "-Xptxas", "-v",
                        "-c", str(src), "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tw_trace" in subprocess.run(["nm", str(tmp_path / "k.o")], capture_output=True, text=True).stdout


def test_softmax_overlap_is_the_share_of_consumer_0s_softmax_cycles_with_consumer_1_in_one_too():
    # consumer 0: softmaxes [100, 200) (first) and [500, 700) (a step); consumer 1: [150, 250) and [650, 660)
    c0 = [(1, 0), (5, 100), (6, 200), (10, 500), (11, 700)]
    c1 = [(1, 0), (5, 150), (6, 250), (10, 650), (11, 660)]
    sm = trace_fused.summary(trace_fused.decode(_raw({(0, 1): c0, (0, 2): c1})))
    assert sm["softmax_overlap"] == pytest.approx((50 + 10) / 300)
    assert trace_fused.summary(trace_fused.decode(_raw({(0, 1): c0})))["softmax_overlap"] == 0
