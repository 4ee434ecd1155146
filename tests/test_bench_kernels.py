"""scripts/bench_kernels.py on CPU: its named shape set, the ratio table it writes (fused against SDPA
cuDNN and flash, graph time), --help, and the one-line refusal without a GPU. The measurement itself
runs on a GPU machine only (`bash scripts/gpu_runs.sh shapes`)."""

import argparse
import sys

import pytest
import torch

from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "scripts"))
import bench_kernels  # noqa: E402


def args(**kw):
    base = dict(shapes=None, heads=[1, 32], seq_lens=[1024, 4096], batch=1, head_dim=128, kv_heads=None,
                dtype="fp16", causal=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_users_set_holds_the_issue_rows_and_the_default_shape():
    shapes = {(s["batch"], s["heads"], s["kv_heads"], s["seq_len"], s["head_dim"], s["dtype"], s["causal"])
              for s in bench_kernels.shapes_of(args(shapes="users"))}
    for row in [(256, 12, 12, 197, 64, "fp16", False), (1, 64, 64, 4096, 64, "fp16", False),
                (4, 32, 8, 2048, 128, "bf16", True), (1, 32, 32, 16384, 128, "fp16", True),
                (8, 16, 16, 1024, 128, "fp16", False), (1, 32, 32, 4096, 128, "fp16", False),
                (1, 32, 32, 4096, 128, "fp16", True), (1, 32, 32, 4096, 96, "fp16", False),
                (1, 32, 32, 4096, 96, "fp16", True), (1, 16, 8, 4096, 256, "bf16", True)]:
        assert row in shapes, row
    names = [s["name"] for s in bench_kernels.SHAPE_SETS["users"]]
    assert len(names) == len(set(names))  # the ratio table is keyed by name


def test_without_a_set_the_grid_of_heads_and_lengths():
    shapes = bench_kernels.shapes_of(args(kv_heads=8, causal=True, dtype="bf16"))
    assert [(s["heads"], s["seq_len"]) for s in shapes] == [(1, 1024), (1, 4096), (32, 1024), (32, 4096)]
    assert all(s["kv_heads"] == 8 and s["causal"] and s["dtype"] == "bf16" for s in shapes)


def row(kernel, shape, graph_ms):
    return {"kernel": kernel, "shape": shape["name"], "batch": shape["batch"], "heads": shape["heads"],
            "kv_heads": shape["kv_heads"], "seq_len": shape["seq_len"], "head_dim": shape["head_dim"],
            "dtype": shape["dtype"], "causal": shape["causal"], "ms": graph_ms * 1.2, "graph_ms": graph_ms,
            "graph_tflops": 1.0, "passes_ms": {}, "tflops": 1.0, "gbps": 1.0, "floor_ms": 1.0, "x_floor": 1.0,
            "peak_bytes": 0, "first_call_s": None}


def test_markdown_ratio_table_is_cudnn_over_fused_with_the_lowest_named():
    vit, default = bench_kernels.SHAPE_SETS["users"][2], bench_kernels.SHAPE_SETS["users"][0]
    rows = [row("fused", vit, 0.2), row("sdpa_cudnn", vit, 0.16), row("sdpa_flash", vit, 0.24),
            row("fused", default, 0.40), row("sdpa_cudnn", default, 0.42)]  # no flash row for this one
    md = bench_kernels.markdown({"gpu": "Test GPU", "command": "c", "versions": {}, "copy_GBps": 1.0, "rows": rows,
                                 "commit": "abc1234", "date_utc": "2026-12-01 00:00 UTC"}, 6.2)
    assert "commit: abc1234" in md and "2026-12-01 00:00 UTC" in md
    assert "| ViT-B/16 | 256 | 12 | 12 | 197 | 64 | fp16 | no | 0.200 | 0.160 | 0.240 | 0.80 | 1.20 |" in md
    assert "| default | 1 | 32 | 32 | 4096 | 128 | fp16 | no | 0.400 | 0.420 | - | 1.05 | - |" in md
    assert "Lowest cuDNN / fused ratio: 0.80" in md


def test_ratio_table_gets_steady_state_columns_where_the_run_has_them():
    vit = bench_kernels.SHAPE_SETS["users"][2]
    rows = [row("fused", vit, 0.2), row("sdpa_cudnn", vit, 0.16), row("sdpa_flash", vit, 0.24)]
    for r, ms in zip(rows, (0.18, 0.171, 0.25)):
        r["graph_ms_steady"] = ms
    md = bench_kernels.markdown({"gpu": "Test GPU", "command": "c", "versions": {}, "copy_GBps": 1.0, "rows": rows}, 6.2)
    assert ("| ViT-B/16 | 256 | 12 | 12 | 197 | 64 | fp16 | no | 0.200 | 0.160 | 0.240 | 0.80 | 1.20 | 0.1800 | 0.1710 "
            "| 0.2500 | 0.95 | 1.39 |") in md
    assert "Lowest cuDNN / fused ratio: 0.80 (graph time, same run)" in md
    assert "Lowest cuDNN / fused ratio in the steady state: 0.95" in md


def fused_and_cudnn_md(**timing) -> str:
    """The .md of a run of ViT-B/16, fused and cuDNN with graph and steady times, and `timing`'s fields."""
    vit = bench_kernels.SHAPE_SETS["users"][2]
    rows = [row("fused", vit, 0.2), row("sdpa_cudnn", vit, 0.21)]
    for r, ms in zip(rows, (0.18, 0.19)):
        r["graph_ms_steady"] = ms
    return bench_kernels.markdown({"gpu": "Test GPU", "command": "c", "versions": {}, "copy_GBps": 1.0, "rows": rows,
                                   **timing}, 6.2)


def test_ratio_table_says_how_its_lines_and_steady_columns_were_timed():
    md = fused_and_cudnn_md(pause_s=2.0, steady_s=2.0, steady_window_s=0.5)
    assert "Lowest cuDNN / fused ratio: 1.05 (graph time, same run, each kernel's replays timed after 2 s idle)" in md
    assert "replayed for 2 s before 0.5 s of timed replays" in md


@pytest.mark.parametrize("flag, value", [("--pause", "-1"), ("--steady-window", "inf"), ("--steady", "nan")])
def test_seconds_that_are_not_a_finite_number_are_refused_in_one_line(flag, value):
    res = run([sys.executable, "scripts/bench_kernels.py", "--shapes", "users", flag, value], timeout=120)
    assert res.returncode == 2
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert lines == [f"bench_kernels: {flag} {value}: seconds are a finite number, 0 or more"], lines


def test_a_run_without_the_timing_fields_still_renders():  # JSON files written before --pause and --steady-window
    md = fused_and_cudnn_md()
    assert "Lowest cuDNN / fused ratio: 1.05 (graph time, same run)." in md
    assert "replayed for --steady seconds before its timed replays" in md


def test_help_names_the_shape_set():
    res = run([sys.executable, "scripts/bench_kernels.py", "--help"], timeout=120)
    assert res.returncode == 0, res.stderr
    for word in ("--shapes", "users", "--kv-heads", "--name", "--commit", "w:static", "--steady", "--steady-window", "--pause"):
        assert word in res.stdout, word


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would measure")
def test_refuses_without_gpu_in_one_line(tmp_path):
    res = run([sys.executable, "scripts/bench_kernels.py", "--shapes", "users", "--out", str(tmp_path / "k")],
              timeout=120)
    assert res.returncode == 2
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "CUDA GPU" in lines[0], lines
    assert not (tmp_path / "k").exists()
