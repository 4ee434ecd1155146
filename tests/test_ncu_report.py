"""scripts/ncu_backward.py --report on a details-page CSV as Nsight Compute exports it (no GPU):
kernels in launch order, the chosen metrics with their units, the largest warp stalls first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(kid, name, section, metric, unit, value):
    return (f'"{kid}","1","python3","localhost","{name}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"{section}","{metric}","{unit}","{value}"')


def test_report_lists_kernels_metrics_and_top_stalls(tmp_path):
    lines = ["==PROF== Disconnected from process 1", HEAD,
             row(0, "hbwd_pre_f16_d128", "GPU Speed Of Light Throughput", "Duration", "us", "61.28"),
             row(1, "hbwd5w_kv_f16_d128", "GPU Speed Of Light Throughput", "Duration", "us", "1,436.10"),
             row(1, "hbwd5w_kv_f16_d128", "GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", "71.2"),
             row(1, "hbwd5w_kv_f16_d128", "Launch Statistics", "Registers Per Thread", "register/thread", "168"),
             row(1, "hbwd5w_kv_f16_d128", "Warp State Statistics", "Stall Barrier", "cycle", "0.9"),
             row(1, "hbwd5w_kv_f16_d128", "Warp State Statistics", "Stall Long Scoreboard", "cycle", "3.25"),
             row(1, "hbwd5w_kv_f16_d128", "Warp State Statistics", "Stall Wait", "cycle", "1.5")]
    csv = tmp_path / "bwd_default_tpattn.csv"
    csv.write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "scripts/ncu_backward.py", "--report", str(csv)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "bwd_default_tpattn.csv: 2 kernel(s)" in out
    assert out.index("[0] hbwd_pre_f16_d128") < out.index("[1] hbwd5w_kv_f16_d128")
    assert "duration                     61.28 us" in out and "1,436.10 us" in out
    assert "SM throughput %              71.2" in out and "registers / thread           168 register/thread" in out
    assert "Stall Long Scoreboard 3.25; Stall Wait 1.50; Stall Barrier 0.90" in out


def test_report_refuses_a_missing_file_or_an_empty_export(tmp_path):
    r = subprocess.run([sys.executable, "scripts/ncu_backward.py", "--report", str(tmp_path / "none.csv")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"ncu_backward: error: no file {tmp_path / 'none.csv'}"]
    empty = tmp_path / "empty.csv"
    empty.write_text(HEAD + "\n")
    r = subprocess.run([sys.executable, "scripts/ncu_backward.py", "--report", str(empty)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no kernels in" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_workload_needs_a_gpu_and_says_so_in_one_line():
    r = subprocess.run([sys.executable, "scripts/ncu_backward.py", "--contender", "cudnn"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["ncu_backward: error: the workload needs a CUDA GPU (--report reads a "
                                             "CSV anywhere)"]
