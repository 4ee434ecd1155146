"""The cluster launch scripts in launch/, proven by running them.

Every script: `bash -n`, shellcheck, a header. Without SLURM: torchrun, the plain-node mpirun
wrapper, and the batch scripts' GPU command lines (a stand-in srun/mpirun records them). With the
local SLURM cluster (.ci/slurm_up.sh; the tests skip when it does not answer): the single-node
script submitted with `sbatch --wait` in CPU mode (srun without MPI, srun with PMIx, mpirun), its
exit status for bad input and for a killed rank, and the multi-node script's srun line on one node,
plain and as a sweep.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

from conftest import ROOT, run_env

LAUNCH = ROOT / "launch"
SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))
SINGLE = LAUNCH / "slurm_single_node.sbatch"
MULTI = LAUNCH / "slurm_multi_node.sbatch"
MPIRUN_NODE = LAUNCH / "mpirun_node.sh"
VENV_BIN = Path(sys.executable).parent  # not resolved: the venv's bin, with its mpirun and torchrun
QUICK = ["--warmup", "1", "--iters", "2", "--timeout", "120"]
CPU_ONE_NODE = ["--nodes=1", "--cpus-per-task=1", "--gpus-per-node=0"]  # CPU mode on the CI node
JOB_TIMEOUT = 170  # seconds for one sbatch --wait (a queued job waits for the node first)


def clean_env(**extra) -> dict:
    """The tests' environment for a launch: the venv first on PATH, nothing inherited that would
    change the launch (an enclosing SLURM job or MPI or torchrun rank, sbatch defaults)."""
    env = run_env()
    for k in list(env):
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_COMM_", "PMI_", "PMIX_", "TPATTN_",
                         "MPI_LOCAL", "MV2_", "HYDRA_", "MPI4PY_")) or \
                k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            del env[k]
    env["PATH"] = str(VENV_BIN) + os.pathsep + env.get("PATH", "")
    env["TPATTN_PYTHON"] = sys.executable
    env.update(extra)
    return env


def load_report(folder: Path) -> dict:
    path = folder / "report.json"
    assert path.is_file(), f"no {path}; the folder has {sorted(p.name for p in folder.iterdir())}"
    return json.loads(path.read_text())


def assert_pass(rep: dict, size: int, launcher: str) -> None:
    assert rep["verdict"] == "PASS", rep["checks"]
    assert rep["world"]["size"] == size
    assert rep["world"]["launcher"] == launcher
    assert rep["world"]["backend"] == "gloo" and rep["world"]["device"] == "cpu"
    assert [r["rank"] for r in rep["world"]["ranks"]] == list(range(size))
    c = rep["config"]
    assert (c["seq_len"], c["heads"], c["head_dim"]) == (256, 4, 32), "the scripts' CPU-mode shape"
    assert all(c["pass"] for c in rep["checks"].values()) and "vs_single_process" in rep["checks"]


# ---------------------------------------------------------------------------------------------
# every script: syntax, shellcheck, header
# ---------------------------------------------------------------------------------------------

def test_the_three_scripts_are_there():
    names = {p.name for p in SCRIPTS}
    assert {"slurm_single_node.sbatch", "slurm_multi_node.sbatch", "mpirun_node.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_n(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (.ci/slurm_up.sh installs it)")
    r = subprocess.run([exe, "--shell=bash", "--severity=style", str(script)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_header_says_what_it_runs_and_what_to_edit(script):
    text = script.read_text()
    lines = text.splitlines()
    assert lines[0] in ("#!/bin/bash", "#!/usr/bin/env bash")
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    header = "\n".join(ln for ln in lines[1:60] if ln.startswith("#"))
    for word in ("What it runs", "Variables", "TPATTN_PYTHON", "TPATTN_VENV", "TPATTN_CPU", "TPATTN_RESULTS",
                 "Examples"):
        assert word in header, f"{script.name}: the header does not mention {word}"
    if script.suffix == ".sbatch":
        assert "Edit for your site" in header and "sbatch " in header
        for opt in ("--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task", "--time", "--output"):
            assert f"#SBATCH {opt}=" in text, f"{script.name}: no #SBATCH {opt}"
        assert "--kill-on-bad-exit=1" in text
    if script == MULTI:
        for var in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "module load", "--sweep", "SLOW"):
            assert var in text, f"{script.name} does not document {var}"


@pytest.mark.parametrize("script", [SINGLE, MULTI], ids=lambda p: p.name)
def test_batch_script_outside_slurm_says_so(script):
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env=clean_env(), cwd=ROOT)
    assert r.returncode == 2
    assert "not inside a SLURM job" in r.stderr and "sbatch" in r.stderr


# ---------------------------------------------------------------------------------------------
# GPU-mode command lines, recorded by a stand-in srun / mpirun (no cluster, no GPU needed)
# ---------------------------------------------------------------------------------------------

def fake_launchers(tmp_path: Path) -> Path:
    """srun and mpirun that record their arguments (one line per call) and exit 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "mpirun"):
        f = bin_dir / name
        f.write_text(f'#!/bin/bash\nprintf "%s\\n" "{name} $*" >> "{tmp_path}/calls"\necho "RESULT: PASS"\n')
        f.chmod(0o755)
    return bin_dir


def fake_job_env(tmp_path: Path, nodes: int, per_node: int, **extra) -> dict:
    env = clean_env(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"gpu[01-{nodes:02d}]",
                    SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_NTASKS=str(nodes * per_node),
                    SLURM_NTASKS_PER_NODE=str(per_node), SLURM_CPUS_PER_TASK="8", SLURM_GPUS_PER_NODE="8",
                    TPATTN_RESULTS=str(tmp_path / "results"), **extra)
    env["PATH"] = str(fake_launchers(tmp_path)) + os.pathsep + env["PATH"]
    return env


def test_single_node_gpu_command_line(tmp_path):
    env = fake_job_env(tmp_path, 1, 8)
    r = subprocess.run(["bash", str(SINGLE), "--seq-len", "8192"], capture_output=True, text=True, timeout=60,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    call = (tmp_path / "calls").read_text().strip()
    out = tmp_path / "results" / "4242"
    assert call == (f"srun --ntasks=8 --cpus-per-task=8 --kill-on-bad-exit=1 --mpi=none --gpu-bind=none "
                    f"{sys.executable} -m tpattn --device cuda --seq-len 8192 --json {out}/report.json")
    assert (out / "exit_code").read_text().strip() == "0"
    assert "RESULT: PASS" in (out / "report.txt").read_text()


def test_single_node_gpu_mpirun_command_line(tmp_path):
    env = fake_job_env(tmp_path, 1, 8, TPATTN_LAUNCHER="mpirun")
    r = subprocess.run(["bash", str(SINGLE)], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    call = (tmp_path / "calls").read_text().strip()
    assert call.startswith(f"mpirun -np 8 --map-by ppr:8:node:PE=8 --bind-to core {sys.executable} -m tpattn "
                           "--device cuda --json "), call


def test_multi_node_gpu_sweep_command_lines(tmp_path):
    env = fake_job_env(tmp_path, 4, 8, NCCL_SOCKET_IFNAME="ib0")
    r = subprocess.run(["bash", str(MULTI), "--sweep", "--heads", "64"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls").read_text().strip().splitlines()
    out = tmp_path / "results" / "4242"
    assert len(calls) == 3, calls  # 1, 2 and 4 nodes
    for k, call in zip((1, 2, 4), calls):
        assert call == (f"srun --nodes={k} --ntasks={8 * k} --ntasks-per-node=8 --cpus-per-task=8 "
                        f"--kill-on-bad-exit=1 --mpi=none --gpu-bind=none {sys.executable} -m tpattn "
                        f"--device cuda --heads 64 --json {out}/nodes{k}/report.json")
    assert "NCCL_SOCKET_IFNAME=ib0" in r.stdout and "NCCL_DEBUG=WARN" in r.stdout
    sweep = (out / "sweep.txt").read_text().splitlines()
    assert sweep[0].split() == ["nodes", "ranks", "exit", "verdict", "allreduce_ms", "total_ms"]
    assert [ln.split()[:3] for ln in sweep[1:]] == [["1", "8", "0"], ["2", "16", "0"], ["4", "32", "0"]]


def test_multi_node_gpu_says_cross_node_is_slow(tmp_path):
    env = fake_job_env(tmp_path, 2, 8)
    r = subprocess.run(["bash", str(MULTI)], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the all-reduce crosses the network" in r.stdout and "--sweep" in r.stdout
    call = (tmp_path / "calls").read_text().strip()
    assert call.startswith("srun --nodes=2 --ntasks=16 --ntasks-per-node=8 "), call


# ---------------------------------------------------------------------------------------------
# torchrun and the plain-node mpirun wrapper (no SLURM)
# ---------------------------------------------------------------------------------------------

def test_torchrun_cpu(tmp_path):
    exe = VENV_BIN / "torchrun"
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    out = tmp_path / "report.json"
    cmd = [*launcher, "--standalone", "--nproc-per-node", "2", "-m", "tpattn", "--device", "cpu",
           "--dist-backend", "gloo", "--seq-len", "256", "--heads", "4", "--head-dim", "32", *QUICK,
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RESULT: PASS" in r.stdout
    assert_pass(json.loads(out.read_text()), 2, "torchrun")


def test_mpirun_node_cpu(tmp_path):
    env = clean_env(TPATTN_CPU="1", TPATTN_NP="2", TPATTN_RESULTS=str(tmp_path), TPATTN_RUN_ID="run")
    r = subprocess.run(["bash", str(MPIRUN_NODE), *QUICK], capture_output=True, text=True, timeout=120, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RESULT: PASS" in r.stdout
    run = tmp_path / "run"
    assert "RESULT: PASS" in (run / "report.txt").read_text()
    assert (run / "exit_code").read_text().strip() == "0"
    assert "--bind-to" in (run / "job.txt").read_text()
    assert_pass(load_report(run), 2, "mpi")


def test_mpirun_node_bad_input_exits_2(tmp_path):
    env = clean_env(TPATTN_CPU="1", TPATTN_NP="2", TPATTN_RESULTS=str(tmp_path), TPATTN_RUN_ID="run")
    r = subprocess.run(["bash", str(MPIRUN_NODE), "--heads", "3"], capture_output=True, text=True, timeout=120,
                       env=env, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not divisible" in r.stderr
    assert (tmp_path / "run" / "exit_code").read_text().strip() == "2"


# ---------------------------------------------------------------------------------------------
# the real local SLURM cluster
# ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def slurm_problem() -> str | None:
    """None when the local SLURM answers and has a usable node, else why not."""
    for exe in ("sinfo", "sbatch", "srun", "scontrol", "scancel"):
        if shutil.which(exe) is None:
            return f"{exe} not found: SLURM is not installed here (.ci/run installs and starts it)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
        if "is UP" not in ping.stdout:
            return (f"slurmctld does not answer ({(ping.stdout + ping.stderr).strip()[:200]}); "
                    "`bash .ci/slurm_up.sh` starts the local cluster")
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                timeout=20).stdout.split()
    except subprocess.TimeoutExpired:
        return "the SLURM commands time out: slurmctld does not answer"
    if not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states):
        return f"no usable SLURM node (states: {', '.join(states) or 'none'})"
    return None


@pytest.fixture
def slurm():
    why = slurm_problem()
    if why:
        pytest.skip(why)


@lru_cache(maxsize=1)
def node_cpus() -> int:
    out = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, timeout=20).stdout.split()
    return int(out[0].rstrip("+")) if out and out[0].rstrip("+").isdigit() else 2


def pmix_available() -> bool:
    r = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=20)
    return "pmix" in r.stdout + r.stderr


@dataclass
class Job:
    rc: int
    id: str
    output: str       # the job's output file (#SBATCH --output)
    results: Path     # TPATTN_RESULTS/<job id>
    seconds: float
    sbatch: str       # sbatch's own stdout and stderr

    def why(self) -> str:
        return f"job {self.id} exit {self.rc} after {self.seconds:.0f} s\n{self.sbatch}\n--- job output ---\n{self.output}"


def submit(tmp_path: Path, script: Path, sbatch_args: list[str], args: list[str], **env) -> Job:
    """sbatch --wait SCRIPT in CPU mode with the results under tmp_path; cancels it on a timeout."""
    name = f"tpattn-test-{uuid.uuid4().hex[:10]}"
    cmd = ["sbatch", "--wait", "--parsable", f"--job-name={name}", "--time=5",
           f"--output={tmp_path}/job-%j.out", *sbatch_args, str(script), *args]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=ROOT,
                           env=clean_env(TPATTN_CPU="1", TPATTN_RESULTS=str(tmp_path), **env))
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=30)
        pytest.fail(f"sbatch --wait did not return within {JOB_TIMEOUT} s (job {name} cancelled); squeue:\n"
                    + subprocess.run(["squeue"], capture_output=True, text=True, timeout=20).stdout)
    secs = time.monotonic() - t0
    first = r.stdout.strip().splitlines()[0] if r.stdout.strip() else ""
    job = first.split(";")[0]
    assert job.isdigit(), f"sbatch did not submit: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    out_file = tmp_path / f"job-{job}.out"
    output = out_file.read_text(errors="replace") if out_file.exists() else "(no job output file)"
    return Job(r.returncode, job, output, tmp_path / job, secs, r.stdout + r.stderr)


def assert_job_passed(job: Job, size: int, launcher: str) -> dict:
    assert job.rc == 0, job.why()
    assert "RESULT: PASS" in job.output, job.why()
    assert f"tpattn job {job.id}: exit 0: PASS" in job.output, job.why()
    assert "RESULT: PASS" in (job.results / "report.txt").read_text()
    assert (job.results / "exit_code").read_text().strip() == "0"
    rep = load_report(job.results)
    assert_pass(rep, size, launcher)
    return rep


@pytest.mark.slurm
def test_single_node_srun_without_mpi(slurm, tmp_path):
    """The default: srun --mpi=none, rank and size from SLURM_* variables alone."""
    job = submit(tmp_path, SINGLE, [*CPU_ONE_NODE, "--ntasks-per-node=2"], QUICK)
    assert_job_passed(job, 2, "srun")
    assert "--mpi=none" in (job.results / "job.txt").read_text()


@pytest.mark.slurm
def test_single_node_srun_with_pmix(slurm, tmp_path):
    """srun --mpi=pmix: the same job, tpattn finds MPI (mpi4py) and uses it."""
    if not pmix_available():
        pytest.skip("this SLURM has no pmix plugin (srun --mpi=list)")
    job = submit(tmp_path, SINGLE, [*CPU_ONE_NODE, "--ntasks-per-node=2"], QUICK, TPATTN_SRUN_MPI="pmix")
    assert_job_passed(job, 2, "mpi")


@pytest.mark.slurm
def test_single_node_mpirun_alternative(slurm, tmp_path):
    """TPATTN_LAUNCHER=mpirun: Open MPI's mpirun inside the allocation."""
    job = submit(tmp_path, SINGLE, [*CPU_ONE_NODE, "--ntasks-per-node=2"], QUICK, TPATTN_LAUNCHER="mpirun")
    assert_job_passed(job, 2, "mpi")
    assert "mpirun -np 2" in job.output


@pytest.mark.slurm
def test_single_node_bad_input_job_exits_2(slurm, tmp_path):
    job = submit(tmp_path, SINGLE, [*CPU_ONE_NODE, "--ntasks-per-node=2"], ["--heads", "3"])
    assert job.rc == 2, job.why()
    assert "not divisible" in job.output and "exit 2: bad input" in job.output, job.why()
    assert (job.results / "exit_code").read_text().strip() == "2"


@pytest.mark.slurm
def test_single_node_killed_rank_ends_the_job(slurm, tmp_path):
    """A rank that dies mid-run: --kill-on-bad-exit ends the step at once (rank 0 would otherwise
    wait in the all-reduce until --timeout) and the job fails."""
    job = submit(tmp_path, SINGLE, [*CPU_ONE_NODE, "--ntasks-per-node=2"], ["--timeout", "150"],
                 TPATTN_DEBUG_INJECT_FAULT="1:forward:kill")
    assert job.rc != 0, job.why()
    assert "RESULT: PASS" not in job.output
    assert job.seconds < 100, job.why()
    assert (job.results / "exit_code").read_text().strip() == str(job.rc)


@pytest.mark.slurm
def test_multi_node_script_srun_line_on_one_node(slurm, tmp_path):
    """The multi-node script's srun line, here with -N 1 and as many tasks as the node has cores
    (2 in CI; 4 where there are 4 or more)."""
    n = 4 if node_cpus() >= 4 else 2
    job = submit(tmp_path, MULTI, [*CPU_ONE_NODE, f"--ntasks-per-node={n}"], QUICK)
    assert_job_passed(job, n, "srun")
    assert f"srun --nodes=1 --ntasks={n} --ntasks-per-node={n} " in job.output


@pytest.mark.slurm
def test_multi_node_script_sweep_on_one_node(slurm, tmp_path):
    job = submit(tmp_path, MULTI, [*CPU_ONE_NODE, "--ntasks-per-node=2"], ["--sweep", *QUICK])
    assert job.rc == 0, job.why()
    rep = load_report(job.results / "nodes1")
    assert_pass(rep, 2, "srun")
    rows = (job.results / "sweep.txt").read_text().splitlines()
    assert rows[1].split()[:4] == ["1", "2", "0", "PASS"], rows
    assert "=== sweep (median ms over ranks)" in job.output

