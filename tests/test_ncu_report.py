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


def test_report_reads_rows_that_end_after_their_value(tmp_path):
    """Nsight Compute 2025's export: the header names the rule columns after "Metric Value", and a metric's
    row without a rule stops after its value (with a trailing comma); such rows count (the H100 export's
    every metric row is one)."""
    head = HEAD + ',"Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"'
    lines = [head, row(0, "fusedw8_f16_d128", "GPU Speed Of Light Throughput", "Duration", "ms", "20.49") + ",",
             row(0, "fusedw8_f16_d128", "Compute Workload Analysis", "Issue Slots Busy", "%", "42.75") + ",",
             row(0, "fusedw8_f16_d128", "GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%",
                 "45.71") + ',"SOLBottleneck","WRN","Compute is more heavily utilized","global","0"']
    csv = tmp_path / "fwd_fp8.csv"
    csv.write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "scripts/ncu_backward.py", "--report", str(csv)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "duration                     20.49 ms" in r.stdout and "issue slots busy %           42.75" in r.stdout
    assert "SM throughput %              45.71" in r.stdout


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


SOURCE_HEAD = ('"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
               '"Instructions Executed","stall_wait","stall_math","stall_barrier"')


def test_fp8_opcodes_sum_the_hot_instructions_samples_by_opcode_and_reason(tmp_path):
    """scripts/ncu_fp8.py --opcodes on a source-page CSV (SASS): the samples of the loop body's
    instructions (within --min-share of the count that makes up the most executed instructions), by opcode (predicates
    and modifiers dropped) and by stall reason; a rarely executed instruction (the producer, the prologue)
    and a wait's polling loop, executed far more often, are left out (as in a real export of fusedw8)."""
    lines = [SOURCE_HEAD,
             '"0x100","MUFU.EX2 R4, R4","60","50","1000","40","20","0"',
             '"0x110","@!P0 MUFU.EX2 R5, R5","20","10","1000","0","20","0"',
             '"0x120","FMNMX R6, R6, R7, !PT","20","15","1000","5","0","15"',
             '"0x130","SYNCS.PHASECHK.TRANS64 P0, [UR4], R2","500","500","10","0","0","500"',
             '"0x150","@!P1 BRA 0x140","800","800","2500","0","0","800"',
             '"0x160","IMAD R2, R2, R3, RZ","5","5","10","5","0","0"',
             '"0x170","LDC R2, c[0x0][0x28]","5","5","10","5","0","0"']
    src = tmp_path / "fwd_fp8_sass.csv"
    src.write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "scripts/ncu_fp8.py", "--opcodes", str(src), "--top", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert ("3 instructions executed within a factor 0.5 of the loop body's 1e+03 times (3 instructions executed "
            "that often); 100 warp-stall samples") in out
    assert "MUFU            80.0 %  n=2" in out and "FMNMX           20.0 %  n=1" in out and "SYNCS" not in out
    assert out.index("stall_math") > out.index("stall_wait")  # 45 % then 40 %
    assert "stall_wait                    45.0 %" in out and "stall_barrier                 15.0 %" in out
    top = out.split("the 2 instructions with the most samples:")[1].strip().splitlines()
    assert len(top) == 2 and "60.0 %  stall_wait" in top[0] and "MUFU.EX2 R4, R4" in top[0]


def test_fp8_opcodes_refuse_another_page_and_bad_options_in_one_line(tmp_path):
    details = tmp_path / "fwd_fp8.csv"
    details.write_text(HEAD + "\n")
    r = subprocess.run([sys.executable, "scripts/ncu_fp8.py", "--opcodes", str(details)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--page source --print-source sass" in r.stderr
    r = subprocess.run([sys.executable, "scripts/ncu_fp8.py", "--opcodes", str(details), "--min-share", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--min-share is a share" in r.stderr
    r = subprocess.run([sys.executable, "scripts/ncu_fp8.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "ncu_fp8: error: the workload needs a GPU of compute capability 9.0 (--report and --opcodes read CSV files "
        "anywhere)"]
