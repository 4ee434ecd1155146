"""README.md and docs/*.md run as written: every fenced ```bash / ```python block that is not marked
`<!-- not run by tests/test_docs.py: REASON -->` (on the line right before its fence) runs here on
the CPU and exits 0; each quoted refusal line of docs/faults.md's table is what its command prints.

A bash block that runs may hold only lines this test knows how to run on a CPU machine (`python -m
tpattn...`, `python scripts/...`, `PYTHONPATH=. python scripts/...`, `mpirun ...`); anything else
(sbatch, srun, a GPU-only line) needs the marker and its reason. Blocks tagged ```text (or with no
tag) are output or diagrams, never commands."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- not run by tests/test_docs\.py: (.*?) -->")
FENCE = re.compile(r"^```(\S*)\s*$")
RUNNABLE = ("python -m tpattn", "python scripts/", "PYTHONPATH=. python scripts/", "mpirun ")
CODE_LANGS = ("bash", "sh", "shell", "console", "python")


def blocks():
    """(file, line number, language, marker reason or None, text) of every fenced block."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            prev = lines[i - 1].strip() if i else ""
            mark = MARK.fullmatch(prev)
            out.append((path.relative_to(ROOT).as_posix(), i + 1, m.group(1), mark.group(1).strip() if mark else None,
                        "\n".join(lines[i + 1:j])))
            i = j + 1
    return out


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b[2] in CODE_LANGS and b[3] is None]


def commands(text: str) -> list[str]:
    """A bash block's command lines: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for ln in joined.splitlines():
        ln = re.sub(r"\s+#.*$", "", ln).strip()
        if ln and not ln.startswith("#"):
            out.append(ln)
    return out


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_", "TPATTN_"))}
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    # Open MPI refuses root without these (CI runs as root); the docs say so once.
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    return e


def sh(cmd: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def workdir(tmp_path):
    """A scratch folder that sees the repository's scripts/ (outputs land here, not in the tree)."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    return tmp_path


def test_every_skipped_block_says_why():
    for path, line, lang, reason, _ in BLOCKS:
        if reason is not None:
            assert len(reason) > 10, f"{path}:{line}: the marker needs a reason"
            assert lang in CODE_LANGS, f"{path}:{line}: a marker on a ```{lang} block, which is never run"


def test_no_untagged_commands():
    """A block with no tag that holds commands would escape this test: tag it (```text: a synopsis or output)."""
    for path, line, lang, _, text in BLOCKS:
        if lang == "":
            for ln in text.splitlines():
                assert not ln.startswith(("python ", "mpirun ", "PYTHONPATH=")), \
                    f"{path}:{line}: commands in a ```{lang} block; tag it bash (and mark it if it cannot run here)"


def test_there_is_something_to_run():
    files = {b[0] for b in RUN}
    assert "README.md" in files and len(RUN) >= 5, RUN


@pytest.mark.parametrize("block", RUN, ids=[f"{b[0]}:{b[1]}" for b in RUN])
def test_block_runs(block, workdir):
    path, line, lang, _, text = block
    if lang == "python":
        f = workdir / "block.py"
        f.write_text(text + "\n")
        r = sh(f"python {f}", workdir)
        assert r.returncode == 0, f"{path}:{line}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return
    for cmd in commands(text):
        assert cmd.startswith(RUNNABLE), \
            f"{path}:{line}: `{cmd}` is not a CPU line this test runs; mark the block with its reason"
        r = sh(cmd, workdir)
        assert r.returncode == 0, f"{path}:{line}: `{cmd}` exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def refusal_rows():
    text = (ROOT / "docs" / "faults.md").read_text()
    table = text.split("<!-- test_docs: refusals -->\n", 1)[1].split("\n\n", 1)[0]
    rows = []
    for ln in table.splitlines()[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        cmd = re.search(r"`([^`]*)`", cells[0]).group(1)
        quoted = re.search(r"`([^`]*)`", cells[1]).group(1)
        rows.append((cmd, quoted, int(cells[2])))
    return rows


ROWS = refusal_rows()


@pytest.mark.parametrize("cmd,quoted,rc", ROWS, ids=[r[0][:60] for r in ROWS])
def test_quoted_refusal_is_what_the_command_prints(cmd, quoted, rc, workdir):
    r = sh(cmd, workdir, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == rc, f"`{cmd}` exit {r.returncode}, documented {rc}\n{out[-3000:]}"
    pattern = ".*?".join(re.escape(p) for p in quoted.split("…"))
    lines = [ln for ln in out.splitlines() if re.search(pattern, ln)]
    assert lines, f"`{cmd}` does not print the documented line\n  {quoted}\nbut:\n{out[-3000:]}"
    ranks = sum(int(n) for n in re.findall(r"-n (\d+)", cmd)) if cmd.startswith("mpirun") else 1
    assert len(lines) == ranks, f"`{cmd}`: {len(lines)} of {ranks} ranks print it\n{out[-3000:]}"
