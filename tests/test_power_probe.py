"""scripts/power_probe.py on CPU: --help names its options; a bad shape or count is refused with one
line and exit 2 before any GPU is looked for."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv):
    return subprocess.run([sys.executable, "scripts/power_probe.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_help_names_the_shape_and_the_replays():
    r = _run("--help")
    assert r.returncode == 0 and "--shape B H N D" in r.stdout and "--replays" in r.stdout


@pytest.mark.parametrize("argv", [("--shape", "8", "0", "1024", "128"), ("--replays", "0")])
def test_bad_arguments_are_refused_in_one_line(argv):
    r = _run(*argv)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("power_probe.py: error: --shape takes four positive numbers and "
                                                  "--replays a positive count")
