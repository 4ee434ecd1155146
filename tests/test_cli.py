"""The CLI end to end on CPU: --help, a small run and its JSON, and every refused input."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run, tpattn

SMALL = ["--seq-len", "64", "--heads", "4", "--head-dim", "16", "--warmup", "0", "--iters", "2"]


def one_error_line(r, code=2):
    assert r.returncode == code, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_help_answers():
    r = tpattn(["--help"])
    assert r.returncode == 0
    for flag in ("--seq-len", "--heads", "--head-dim", "--batch", "--dtype", "--kernel", "--causal", "--device",
                 "--warmup", "--iters", "--seed", "--check", "--no-check", "--json", "--dist-backend",
                 "--reduce-dtype", "--timeout", "--profile", "mpirun -n 8 python -m tpattn", "exit status",
                 "--uneven-heads"):
        assert flag in r.stdout, flag


def test_default_cpu_run_says_it_shrank_and_passes(tmp_path):
    r = tpattn(["--json", str(tmp_path / "r.json")], timeout=60)
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[:4]
    if not torch.cuda.is_available():
        assert any("CPU run: using the smaller default shape" in ln for ln in head)
        assert any("no CUDA GPU" in ln for ln in head)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["verdict"] == "PASS" and "RESULT: PASS" in r.stdout


def test_small_run_json_is_complete(tmp_path):
    out = tmp_path / "r.json"
    r = tpattn(SMALL + ["--causal", "--dtype", "bf16", "--batch", "2", "--device", "cpu", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    c = rep["config"]
    assert (c["seq_len"], c["heads"], c["head_dim"], c["batch"], c["dtype"], c["causal"]) == (64, 4, 16, 2, "bf16", True)
    assert rep["memory"]["S_bytes_per_rank"] == 2 * 4 * 64 * 64 * 2
    for p in ("qkv_proj", "qk", "softmax", "pv", "out_proj", "total"):
        s = rep["rank0_passes"][p]
        assert 0 <= s["min"] <= s["median"] <= s["max"]
    assert rep["checks"]["vs_float64"]["pass"] and rep["verdict"] == "PASS"
    assert rep["world"]["size"] == 1 and rep["world"]["launcher"] == "single"
    assert "S and P: 0.1 MiB each per rank" in r.stdout and "per pass, ms over 2 iterations" in r.stdout


def test_no_check_is_not_a_pass():
    r = tpattn(SMALL + ["--no-check"])
    assert r.returncode == 0 and "RESULT: NOT CHECKED" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--seq-len", "0"], "--seq-len must be at least 1"),
    (["--seq-len", "-5"], "--seq-len must be at least 1"),
    (["--heads", "0"], "--heads must be at least 1"),
    (["--head-dim", "0"], "--head-dim must be between 1 and 256"),
    (["--head-dim", "257"], "--head-dim must be between 1 and 256"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--kernel", "flash9"], "invalid choice: 'flash9'"),
    (["--dist-backend", "mpi"], "invalid choice: 'mpi'"),
    (["--seq-len", "abc"], "invalid int value: 'abc'"),
    (["--iters", "0"], "--iters must be at least 1"),
    (["--timeout", "0"], "--timeout must be a finite, positive number of seconds"),
    (["--timeout", "nan"], "--timeout must be a finite, positive number of seconds"),
    (["--seq-len", "10000000"], "(S and P alone) but"),  # the CPU run's pre-flight: not the allocator's error
    (["--seq-len", "99999999999999999999"], "is past 2147483647, the most any kernel here indexes"),
    (["--heads", "4096", "--head-dim", "256", "--seq-len", "1"], "GiB of weights on rank 0"),  # (was killed for memory)
    (["--decode", "3000000000", "--causal"], "the largest --decode that fits is about"),  # (was a failed allocation)
    (["--decode", "50000000", "--causal", "--no-check"], "the largest --decode that fits is about"),
    (["--timeout", "inf"], "--timeout must be a finite, positive number of seconds"),
    (["--timeout", "0.001"], "--timeout 0.001 is under a second"),
    (["--json", ""], "--json needs a file path (got an empty one)"),
    (["--decode", "2", "--causal", "--overlap", "2"], "--decode with --overlap 2: a decode step is one row a sequence"),
    (["--batch", "1000000"], "the largest --batch that fits is about"),
    (["--dtype", "fp8", "--deterministic"], "--dtype fp8 runs the forward only: drop --deterministic"),
    (["--decode", "2", "--causal", "--profile", "p.json"], "--profile traces one call of the layer (or one training step)"),
    (["--json", "/nonexistent-dir/r.json"], "does not exist"),
    (["--json", "/proc/tpattn-r.json"], "--json /proc/tpattn-r.json"),  # refused before the run (root may write /proc)
    (["--profile", "/proc/tpattn-p.json"], "--profile /proc/tpattn-p.json"),
    (["--device", "cpu", "--kernel", "naive"], "does not run on cpu"),
    (["--device", "cpu", "--dist-backend", "nccl"], "needs --device cuda"),
    (["--overlap", "0"], "--overlap must be at least 1 chunk"),
    (["--device", "cpu", "--cuda-graph"], "--cuda-graph needs --device cuda"),
])
def test_bad_input_is_one_line(args, needle):
    line = one_error_line(tpattn(SMALL + args))
    assert needle in line and line.startswith("tpattn: error:")


@pytest.mark.parametrize("env,needle", [
    ({"WORLD_SIZE": "0", "RANK": "0"}, "RANK='0' of WORLD_SIZE='0': the world needs at least one rank"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK='5' of WORLD_SIZE='2'"),
    ({"WORLD_SIZE": "abc", "RANK": "0"}, "WORLD_SIZE='abc' is not an integer"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
])
def test_a_launchers_bad_environment_is_one_line(env, needle):
    line = one_error_line(tpattn(SMALL, **env))
    assert needle in line and line.startswith("tpattn: error:")


def test_load_of_an_empty_file_is_one_line(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    line = one_error_line(tpattn(SMALL + ["--load", str(tmp_path / "empty.pt")]))
    assert "cannot read it (EOFError); give a file written by torch.save" in line


@pytest.mark.parametrize("kind", ["complex", "sparse"])
def test_load_of_tensors_that_are_not_dense_and_real_is_one_line(tmp_path, kind):
    """(A complex wq ran with its imaginary part dropped; a sparse one failed inside torch.)"""
    r = tpattn(SMALL + ["--no-check"])
    D = int(re.search(r"D=(\d+)", r.stdout).group(1))
    w = {k: torch.randn(D, D) for k in ("wq", "wk", "wv", "wo")}
    w["wq"] = torch.randn(D, D, dtype=torch.complex64) if kind == "complex" else w["wq"].to_sparse()
    torch.save(w, tmp_path / "w.pt")
    line = one_error_line(tpattn(SMALL + ["--load", str(tmp_path / "w.pt")]))
    assert "wq is a" in line and "save dense real tensors" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_gpu():
    line = one_error_line(tpattn(SMALL + ["--device", "cuda"]))
    assert "no CUDA GPU" in line and "--device cpu" in line


def test_naive_without_cupy_names_the_extra():
    r = tpattn(SMALL + ["--kernel", "naive"])
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = one_error_line(r)
    # without a GPU the device check comes first; both name the fix
    assert "needs a CUDA GPU" in line or "tpattn[cuda13]" in line


def test_cupy_missing_message_names_extras(monkeypatch):
    from tpattn import config
    from tpattn.attention import get_backend
    import tpattn.attention as attention
    monkeypatch.setattr(attention, "cupy_available", lambda: False)
    for kernel in ("naive", "tiled", "fused"):
        cfg = config.Config(device="cuda", kernel=kernel, seq_len=8, heads=1, head_dim=64)
        with pytest.raises(config.ConfigError, match=rf"--kernel {kernel} needs CuPy.*pip install 'tpattn\[cuda13\]'"):
            get_backend(kernel).check_supported(cfg)


def test_installed_package_ships_kernels(tmp_path):
    """`pip install .` (not editable) must carry kernels/*.cu and the header the Hopper ones include."""
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "setuptools" in r.stderr and "No module named" in r.stderr:
        pytest.fail("setuptools is needed to build tpattn: " + r.stderr[-300:])
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.rmtree(tmp_path / "site" / "bin", ignore_errors=True)
    code = ("import tpattn.cuda as c; p = c.kernel_dir(); print(p); "
            "assert 'site' in str(p), p; print([f.name for f in c.kernel_sources()]); "
            "print([f.name for f in p.glob('*.cuh')])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("naive_attention.cu", "fused_hopper_attention.cu", "tiled_hopper_attention.cu", "hopper_common.cuh"):
        assert name in r.stdout, r.stdout


def test_mpi4py_missing_under_mpi_names_the_extra():
    code = ("import sys; sys.modules['mpi4py'] = None; from tpattn.cli import main; "
            "sys.exit(main(['--seq-len', '8', '--heads', '1']))")
    r = run([sys.executable, "-c", code], timeout=60, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    line = one_error_line(r)
    assert "mpi4py is not installed: pip install 'tpattn[mpi]'" in line


def test_more_ranks_than_gpus_with_nccl_is_refused_before_nccl():
    from tpattn.config import Config, ConfigError, validate
    cfg = Config(device="cuda", kernel="reference", dist_backend="nccl", seq_len=8, heads=8, head_dim=8)
    with pytest.raises(ConfigError, match=r"4 ranks on this node but 2 GPU\(s\): NCCL needs one GPU per rank"):
        validate(cfg, world=4, local_world=4, gpus_on_node=2)
    validate(cfg, world=4, local_world=2, gpus_on_node=2)  # one rank per GPU is fine
    cfg.dist_backend = "gloo"
    validate(cfg, world=4, local_world=4, gpus_on_node=1)  # gloo may share a GPU


def test_kernel_head_dim_limit_comes_from_the_backend(monkeypatch):
    from tpattn.attention import get_backend
    from tpattn.config import Config, ConfigError, validate
    monkeypatch.setattr(get_backend("reference"), "max_head_dim", 128)
    cfg = Config(device="cpu", kernel="reference", dist_backend="gloo", seq_len=8, heads=2, head_dim=160)
    with pytest.raises(ConfigError, match="--head-dim must be between 1 and 128 for --kernel reference"):
        validate(cfg)


@pytest.mark.parametrize("kernel,dtype,d,needle", [
    ("fused", "fp32", 64, "--kernel fused does not support --dtype fp32; use one of fp16, bf16"),
    ("fused", "fp16", 88, "--kernel fused supports head dims 32, 64, 80, 96, 128, 160, 192 and 256 (got 88; all but "
                          "64 and 128 need compute capability 9.0); use --head-dim 80 or 96, or --kernel triton "
                          "(every multiple of 8 up to 256), tiled or naive"),
    ("fused", "fp16", 100, "--kernel fused supports head dims 32, 64, 80, 96, 128, 160, 192 and 256 (got 100; all "
                           "but 64 and 128 need compute capability 9.0); use --head-dim 96 or 128, or --kernel naive"),
    ("triton", "fp16", 100, "--kernel triton supports head dims that are multiples of 8 up to 256 (got 100); use "
                            "--head-dim 96 or 104"),
    ("triton", "bf16", 264, "--head-dim must be between 1 and 256 for --kernel triton (got 264)"),
    ("tiled", "fp16", 12, "--kernel tiled supports head dims that are multiples of 8 up to 256 (got 12)"),
    ("tiled", "fp32", 64, "--kernel tiled does not support --dtype fp32"),
])
def test_kernel_that_does_not_support_dtype_or_head_dim(kernel, dtype, d, needle):
    """Refused from the config alone, before any GPU work (so the same on every rank)."""
    from tpattn.config import Config, ConfigError, validate
    cfg = Config(device="cuda", kernel=kernel, dtype=dtype, dist_backend="nccl", seq_len=8, heads=2, head_dim=d)
    with pytest.raises(ConfigError) as err:
        validate(cfg, gpus_on_node=1)
    assert needle in str(err.value)


def test_report_last_rank_is_call_by_call():
    """The report's last_rank_ms: in each call the fastest rank (the last to arrive: the others waited
    for it), then the median over calls; not the smaller of the ranks' medians, which holds waits
    when the waiting rank changes from call to call."""
    from tpattn import report
    r0, r1 = [0.36, 0.28, 0.16], [0.16, 0.26, 0.62]   # the naive reduce-scatter's samples on 2 H200s
    assert report.last_rank_ms([r0, r1]) == pytest.approx(0.16)
    stats = {"reducescatter": {"median": 0.27, "min": 0.26, "max": 0.28}}
    got = report.collective_stats(stats, {"reducescatter": 64 << 20}, 2, {"reducescatter": "fp32"},
                                  {"reducescatter": [r0, r1]})["reducescatter"]
    assert got["last_rank_ms"] == pytest.approx(0.16) and got["median_ms"] == 0.27 and got["last_rank_from"] == "calls"
    assert got["busbw_last_rank_GBps"] == pytest.approx((64 << 20) / 0.16e-3 / 1e9 / 2)
    old = report.collective_stats(stats, {"reducescatter": 64 << 20}, 2, {"reducescatter": "fp32"})
    assert old["reducescatter"]["last_rank_ms"] == 0.26   # no samples: the smallest median, as before
    assert old["reducescatter"]["last_rank_from"] == "rank medians"


def test_report_copies_bandwidth_counts_their_own_ranks():
    """The K/V copies' all-reduce runs among the ranks that hold one K/V head (W/G of them): its bus
    bandwidth uses that many ranks, not the world's."""
    from tpattn import report
    stats = {"bwd_copies": {"median": 1.0, "min": 1.0, "max": 1.0}}
    got = report.collective_stats(stats, {"bwd_copies": 1 << 20}, 8, {"bwd_copies": "fp32"}, None,
                                  {"bwd_copies": 2})["bwd_copies"]
    assert got["ranks"] == 2 and got["busbw_GBps"] == pytest.approx((1 << 20) / 1e-3 / 1e9 * 2 * 1 / 2)


def test_versions_carry_no_nul_byte(monkeypatch):
    """Open MPI's library version string holds a NUL byte; the versions every report and benchmark
    file records must not (it made the .md files "binary" to grep and the JSON carry \\u0000)."""
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    from tpattn import report
    monkeypatch.setattr(MPI, "Get_library_version",
                        lambda: "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, Sep 30, 2023\x00\n")
    v = report.versions()
    assert v["mpi"] == "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, Sep 30, 2023"
    assert not any("\x00" in str(x) for x in v.values())
