"""The scripts that read files or take sizes, given a bad one: a line that says what is wrong and exit 2,
never a traceback (and no work done first)."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT, run


@pytest.mark.parametrize("argv,says", [
    (["layer_table.py", "/nonexistent/r.json"], "layer_table: error: /nonexistent/r.json: No such file"),
    (["layer_table.py", "README.md"], "README.md is not JSON"),
    (["layer_table.py", "pyproject.toml", "--md", "/nonexistent/t.md"], "--md /nonexistent/t.md: its folder does not exist"),
    (["fp8_accuracy.py", "--seq-len", "0"], "--seq-len must be at least 1 (got 0)"),
    (["fp8_accuracy.py", "--heads", "4", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
    (["fp8_accuracy.py", "--out", "/nonexistent/d/f8"], "--out /nonexistent/d/f8: its folder does not exist"),
    (["model/refresh_predictions.py", "--file", "/nonexistent.md"], "--file /nonexistent.md: No such file"),
    (["ncu_backward.py", "--report", "README.md"], "no kernels in README.md"),
    (["plots.py", "kernels", "pyproject.toml"], "plots: cannot read"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path):
    r = run([sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]], timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-800:])
    assert says in r.stderr.strip().splitlines()[-1], r.stderr


def test_plots_refuses_a_layer_report(tmp_path):
    """A python -m tpattn --json report is one run, not the table plots.py draws: said in one line."""
    rep = tmp_path / "r.json"
    rep.write_text('{"config": {}, "passes": {}, "world": {"size": 1}}')
    r = run([sys.executable, str(ROOT / "scripts" / "plots.py"), "kernels", str(rep)], timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "is not scripts/bench_kernels.py's JSON" in r.stderr
