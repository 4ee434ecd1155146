"""The report's communication line and the --profile line say what happened, not more."""

from __future__ import annotations

import os
import subprocess
import sys

from tpattn.report import exposure_line


def test_no_overlap_hides_nothing():
    line = exposure_line({"collectives_ms": 53.381, "exposed_ms": 85.453, "hidden_share": 0.17}, overlap=1)
    assert "none hidden" in line and "% of the collectives hidden" not in line
    assert "32.072 ms of it launches and waits" in line


def test_the_ring_says_its_passes_travel_behind_the_attention():
    """--context-parallel posts each ring pass before its block's attention: the line must not say
    that nothing is hidden."""
    e = {"collectives_ms": 18.1, "exposed_ms": 21.9, "hidden_share": 0.0}
    line = exposure_line(e, overlap=1, context_parallel=2)
    assert "the ring's passes travel behind the blocks' attention" in line and "none hidden" not in line, line
    assert "3.800 ms of it launches and waits" in line


def test_overlap_reports_the_hidden_share():
    e = {"collectives_ms": 10.0, "exposed_ms": 4.0, "hidden_share": 0.6}
    assert "about 60% of the collectives hidden" in exposure_line(e, overlap=4)
    e = {"collectives_ms": 10.0, "exposed_ms": 12.0, "hidden_share": 0.0}
    assert "none of the collectives hidden" in exposure_line(e, overlap=4)


def test_profile_says_where_the_trace_went(tmp_path):
    path = tmp_path / "trace.json"
    out = subprocess.run([sys.executable, "-m", "tpattn", "--seq-len", "64", "--heads", "2", "--head-dim", "16",
                          "--iters", "1", "--warmup", "0", "--profile", str(path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert path.is_file()
    assert f"wrote the torch.profiler trace of one call to {path}" in out.stdout


def test_profile_writes_through_a_link_and_leaves_it_a_link(tmp_path):
    """torch's trace export replaces what is at its path; --profile writes the bytes to the path instead, so
    a symlink stays a symlink (its target holds the trace) and a device such as /dev/null stays a device."""
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    link.symlink_to(target)  # dangling until the trace is written
    out = subprocess.run([sys.executable, "-m", "tpattn", "--seq-len", "64", "--heads", "2", "--head-dim", "16",
                          "--iters", "1", "--warmup", "0", "--profile", str(link)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert link.is_symlink() and target.is_file() and target.read_text().lstrip().startswith("{")
