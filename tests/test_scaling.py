"""The scaling sweep on CPU (gloo, real mpirun): table, JSON and plots produced and consistent;
the PyTorch tensor-parallel peers (DTensor and plain) and the bare all-reduce beside it; the peers
on their own at world sizes 1 and 2; failures and hangs recorded, not hidden; the kernel plot; and
--profile's chrome trace."""

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, mpirun_cmd, run, tpattn

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--seq-len", "256", "--heads", "4", "--head-dim", "32"]


def scaling(args, timeout=240, **env):
    return run([sys.executable, "scripts/scaling.py", *args], timeout=timeout, **env)


def table_rows(md: str) -> dict[int, list[str]]:
    """The first markdown table's rows, by world size."""
    block = md.split("\n\n")[2]
    rows = {}
    for line in block.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[int(cells[0])] = cells
    return rows


def assert_png(path):
    assert path.is_file(), f"{path} missing"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, f"{path} is not a real PNG"
    import matplotlib.image
    h, w = matplotlib.image.imread(str(path)).shape[:2]
    assert w >= 600 and h >= 400


@pytest.mark.mpi
def test_sweep_on_cpu_world_1_2_4(tmp_path):
    r = scaling(["--world-sizes", "1", "2", "4", *SMALL, "--out", str(tmp_path)])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    # progress: which shape, which world size, elapsed time
    for w in (1, 2, 4):
        assert re.search(rf"\[scaling \+\d+:\d\d\] \[\d/3\] tpattn, world {w} \(gloo, CPU, {w} ranks? x \d+ "
                         rf"threads?[^)]*\), B=1 N=256 H=4 d=32", r.stdout), r.stdout
        assert re.search(rf"peer world {w}: PASS in [\d.]+ s", r.stdout)
    md = (tmp_path / "scaling.md").read_text()
    sweep = json.loads((tmp_path / "scaling.json").read_text())
    for name in ("scaling_passes.png", "scaling_speedup.png"):
        assert_png(tmp_path / name)
        assert f"]({name})" in md
    assert sweep["ok"] is True and sweep["images"] == {"per pass": "scaling_passes.png",
                                                         "speedup": "scaling_speedup.png"}
    assert sweep["versions"]["torch"] and sweep["command"].startswith("python scripts/scaling.py --world-sizes 1 2 4")
    assert sweep["machine"]["gpus"] == 0 and sweep["config"]["heads"] == 4

    rows = {row["world"]: row for row in sweep["rows"]}
    assert sorted(rows) == [1, 2, 4]
    assert rows[1]["speedup"] == 1.0 and rows[1]["efficiency"] == 1.0
    for w, row in rows.items():
        assert row["verify"] == "PASS" and row["report"]["verdict"] == "PASS"
        assert row["heads_per_rank"] == 4 // w == row["report"]["config"]["heads_per_rank"]
        assert row["report"]["world"]["size"] == w and row["backend"] == "gloo"
        assert row["speedup"] == pytest.approx(rows[1]["e2e_ms"] / row["e2e_ms"])
        assert row["efficiency"] == pytest.approx(row["speedup"] / w)
        assert row["e2e_ms"] == row["report"]["passes"]["total"]["max"]
        compute = ("qkv_proj", "qk", "softmax", "pv", "out_proj")
        per_rank = row["report"]["per_rank_passes"]
        assert len(per_rank) == w
        assert row["compute_ms"] == pytest.approx(max(sum(rp[p]["median"] for p in compute) for rp in per_rank))
        assert row["compute_ms"] <= sum(row["report"]["passes"][p]["max"] for p in compute) + 1e-9
        assert (row["busbw_GBps"] is None) == (w == 1)
        if w > 1:
            assert row["busbw_GBps"] > 0
        peer = row["peer"]
        assert peer["verify"] == "PASS" and peer["pass"] is True
        assert peer["peer_ms"] > 0 and peer["ours_ms"] > 0 and peer["rel_err"] <= peer["tol"]
        assert peer["report"]["world"]["size"] == w
        assert "ColwiseParallel" in peer["report"]["peer"] and "RowwiseParallel" in peer["report"]["peer"]
        assert peer["plain_ms"] > 0 and peer["peers"]["plain_default"] == peer["plain_ms"]
        assert peer["plain_rel_err"] <= peer["tol"] and peer["rel_err_max"] <= peer["tol"]
        assert peer["peers"]["plain_flash"] is None and "not available" in peer["peers_unavailable"]["plain_flash"]
        bare = peer["bare_allreduce"]
        assert bare["ours"]["bytes"] == row["allreduce_bytes"] and bare["ours"]["ms"] > 0
        assert (bare["ours"]["busbw_GBps"] is None) == (w == 1)
        if w > 1:
            assert bare["ours"]["busbw_GBps"] > 0 and bare["peer"]["busbw_GBps"] > 0

    # the markdown says what the JSON says
    assert "| ranks | setup | heads/rank | slowest compute ms | all-reduce ms | end to end ms | speedup |" in md
    assert ("| all-reduce busbw GB/s | bare busbw GB/s | verify | PyTorch TP (DTensor) + SDPA ms "
            "| plain TP + SDPA ms | peer check |") in md
    cells = table_rows(md)
    assert sorted(cells) == [1, 2, 4]
    for w, c in cells.items():
        row = rows[w]
        assert c[1] == row["setup"] and c[2] == str(4 // w)
        assert c[5] == f"{row['e2e_ms']:.3f}" and c[6] == f"{row['speedup']:.2f}"
        assert c[10] == "PASS" and c[11] == f"{row['peer']['peer_ms']:.3f}" and c[13].startswith("PASS (")
        assert c[12] == f"{row['peer']['plain_ms']:.3f}"
        if w > 1:
            bare = row["peer"]["bare_allreduce"]["ours"]["busbw_GBps"]
            assert c[8] == f"{row['busbw_GBps']:.2f}" and c[9] == f"{bare:.2f}"
    assert cells[1][6] == "1.00" and cells[1][7] == "100%" and cells[1][8] == "-" and cells[1][9] == "-"
    assert rows[2]["plain_speedup"] == pytest.approx(rows[1]["peer"]["plain_ms"] / rows[2]["peer"]["plain_ms"])
    for heading in ("## Peers in the same processes", "## All-reduce: in the layer and bare", "## One forward",
                    "## Commands"):
        assert heading in md
    assert "mpirun --oversubscribe --bind-to none -n 4 python -m tpattn --seq-len 256 --heads 4" in md


def peer_tp(args, ranks, timeout=180):
    return run(mpirun_cmd(ranks) + [sys.executable, "scripts/peer_tp.py", *args], timeout=timeout)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_peers_match_ours_and_time_a_bare_allreduce(tmp_path, ranks):
    """Both peers (DTensor and plain) run beside tpattn and match it and float64; the bare all-reduce of
    tpattn's bytes and of the peers' is timed; one forward's collectives are what the layers promise."""
    out = tmp_path / "peer.json"
    r = peer_tp(["--device", "cpu", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--warmup", "1",
                 "--iters", "3", "--json", str(out)], ranks)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "RESULT: PASS" in r.stdout
    assert re.search(r"plain TP \+ SDPA flash +not available on cpu", r.stdout), r.stdout
    rep = json.loads(out.read_text())
    assert rep["pass"] is True and rep["world"]["size"] == ranks
    for key in ("peer_ms", "ours_ms", "plain_ms"):  # scaling.py reads these
        assert rep[key] > 0
    assert rep["peers"]["dtensor"] == rep["peer_ms"] and rep["peers"]["plain_default"] == rep["plain_ms"]
    assert rep["peers"]["plain_flash"] is None and rep["peers"]["plain_cudnn"] is None
    assert set(rep["peers_unavailable"]) == {"plain_flash", "plain_cudnn"}
    for name in ("peer_vs_ours", "peer_vs_float64", "plain_default_vs_ours", "plain_default_vs_float64"):
        assert rep["checks"][name]["pass"] is True and rep["checks"][name]["rel_err"] <= rep["tol"], name
    assert all(rep["host_ms"][k] > 0 for k in ("dtensor", "plain_default", "ours"))

    D = 4 * 16
    bare = rep["bare_allreduce"]
    assert bare["ours"]["bytes"] == 64 * D * 4 and bare["ours"]["dtype"] == "float32"  # fp32 partials by default
    assert bare["peer"]["bytes"] == 64 * D * 2 and bare["peer"]["dtype"] == "float16"
    for b in (bare["ours"], bare["peer"]):
        assert b["ms"] > 0
        if ranks == 1:
            assert b["busbw_GBps"] is None
        else:
            assert b["algbw_GBps"] > 0 and b["busbw_GBps"] == pytest.approx(b["algbw_GBps"])  # 2(n-1)/n = 1 at n=2
            assert b["algbw_GBps"] == pytest.approx(b["bytes"] / (b["ms"] * 1e-3) / 1e9)

    fwd = rep["per_forward"]
    coll = {k: [(c["dtype"], c["bytes"]) for c in v["collectives"]] for k, v in fwd.items()}
    # tpattn's fp32 partials, split (64 rows divide by 2): a reduce-scatter (seen by its first tensor,
    # this rank's half of the rows) and an all-gather of the fp16 output; a group of one rank has
    # nothing to sum and calls none
    assert coll["ours"] == ([] if ranks == 1 else [("float32", 64 * D * 4 // 2), ("float16", 64 * D * 2)])
    ops = [c["op"] for c in fwd["ours"]["collectives"]]
    assert len(ops) == (0 if ranks == 1 else 2)
    assert all(a in op for a, op in zip(("reduce_scatter", "allgather"), ops)), ops
    if ranks == 1:
        assert coll["dtensor"] == [] and coll["plain_default"] == []
    else:  # one all-reduce in the model dtype for each peer, nothing else (no all-gather, no input redistribute)
        assert coll["dtensor"] == [("float16", 64 * D * 2)] and coll["plain_default"] == [("float16", 64 * D * 2)]
    assert fwd["dtensor"]["dtensor_dispatches"] > 0 and fwd["plain_default"]["dtensor_dispatches"] == 0
    # SDPA runs on plain local tensors in both peers: the same kernel
    assert fwd["dtensor"]["sdpa_kernels"] == fwd["plain_default"]["sdpa_kernels"] != []


@pytest.mark.mpi
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_peer_training_step_beside_ours(tmp_path, ranks):
    """--backward: the plain peer's training step (its dX summed over the ranks by Megatron's pair of maps)
    beside tpattn's, timed in turns; the peer's x.grad matches tpattn's."""
    out = tmp_path / "train.json"
    r = peer_tp(["--device", "cpu", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--warmup", "1",
                 "--iters", "2", "--backward", "--json", str(out)], ranks)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "RESULT: PASS" in r.stdout and "training step ms" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["pass"] is True and rep["world"]["size"] == ranks
    assert rep["train_ms"]["ours"] > 0 and rep["train_ms"]["plain_default"] > 0
    assert rep["train_ms"]["plain_flash"] is None and set(rep["peers_unavailable"]) == {"plain_flash", "plain_cudnn"}
    c = rep["checks"]["plain_default_x.grad_vs_ours"]
    assert c["pass"] is True and c["rel_err"] <= rep["tol"]


def test_sweep_records_failures_and_skips(tmp_path):
    """A rank that raises: FAIL in the table with the rank's own message, exit 1. A world size
    that does not divide the heads: skipped, not run."""
    r = scaling(["--world-sizes", "2", "3", "--seq-len", "64", "--heads", "2", "--head-dim", "16",
                 "--out", str(tmp_path), "--tag", "bad"], timeout=120,
                TPATTN_DEBUG_INJECT_FAULT="1:forward:raise")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "world 3: skipped, --heads 2 does not split over 3 ranks" in r.stdout
    sweep = json.loads((tmp_path / "scaling_bad.json").read_text())
    rows = {row["world"]: row for row in sweep["rows"]}
    assert rows[3]["status"] == "SKIP" and "commands" not in rows[3]
    assert rows[2]["verify"].startswith("FAIL") and rows[2]["peer"]["verify"].startswith("FAIL")
    assert "InjectedFault" in rows[2]["log_tail"] and "InjectedFault" in rows[2]["peer"]["log_tail"]
    assert sweep["ok"] is False
    md = (tmp_path / "scaling_bad.md").read_text()
    assert re.search(r"\| 2 \| gloo, CPU, 2 ranks x \d+ threads?[^|]* \| 1 \| - \| - \| - \|", md), md
    assert "## Failed runs" in md
    assert "| 3 | skipped: --heads 2 does not split over 3 ranks |" in md


@pytest.mark.mpi
def test_sweep_ends_a_hung_run(tmp_path):
    """A rank that hangs: the run is ended at --timeout, TIMEOUT in the table, nothing left running."""
    r = scaling(["--world-sizes", "2", "--seq-len", "64", "--heads", "2", "--head-dim", "16", "--no-peer",
                 "--timeout", "8", "--heartbeat", "3", "--out", str(tmp_path)], timeout=90,
                TPATTN_DEBUG_INJECT_FAULT="1:forward:hang")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "tpattn world 2: still running" in r.stdout and "tpattn world 2: TIMEOUT (8 s)" in r.stdout
    row = json.loads((tmp_path / "scaling.json").read_text())["rows"][0]
    assert row["verify"] == "TIMEOUT (8 s)" and row["peer"] is None
    ps = run(["ps", "-eo", "args"]).stdout
    assert not re.search(r"tpattn_scaling_\w+/tpattn_w2\.json", ps), ps


@pytest.mark.mpi
def test_a_terminated_sweep_ends_its_run(tmp_path):
    """SIGTERM to the sweep (a batch limit, `timeout`) while a run hangs: it exits 143, the run's mpirun and
    ranks are ended and its scratch folder is gone."""
    import signal
    import subprocess
    import time
    env = {**os.environ, "TPATTN_DEBUG_INJECT_FAULT": "1:forward:hang"}
    p = subprocess.Popen([sys.executable, "scripts/scaling.py", "--world-sizes", "2", "--seq-len", "64", "--heads", "2",
                          "--head-dim", "16", "--no-peer", "--timeout", "120", "--heartbeat", "2",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    out = ""
    deadline = time.monotonic() + 90
    while "still running" not in out and time.monotonic() < deadline:  # the hung run is under way
        out += p.stdout.readline()
    assert "still running" in out, out
    ps = run(["ps", "-eo", "args"]).stdout
    scratch = re.search(r"(tpattn_scaling_\w+)", ps)
    assert scratch, ps  # the run's command line names its scratch folder
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    ps = run(["ps", "-eo", "args"]).stdout
    assert not re.search(r"tpattn_scaling_\w+/tpattn_w2\.json", ps), ps
    assert not (Path(tempfile.gettempdir()) / scratch.group(1)).exists()


def test_bad_arguments_exit_2(tmp_path):
    r = scaling(["--kernel", "nope", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "scaling: error:" in r.stderr


def test_kernel_plot(tmp_path):
    rows = []
    for kernel, scale in (("naive", 30.0), ("torch_materialized", 3.0), ("sdpa_flash", 1.0)):
        for h in (1, 32):
            for n in (1024, 2048, 4096):
                ms = scale * h * (n / 1024) ** 2 * 0.01
                rows.append({"kernel": kernel, "batch": 1, "heads": h, "seq_len": n, "head_dim": 128, "dtype": "fp16",
                             "causal": False, "ms": ms, "passes_ms": {}, "tflops": 1.0, "gbps": 1.0,
                             "floor_ms": h * (n / 1024) ** 2 * 0.002, "x_floor": 1.0})
    src = tmp_path / "kernels.json"
    src.write_text(json.dumps({"gpu": "Test GPU", "copy_GBps": 4000.0, "versions": {"torch": "x"},
                               "command": "python scripts/bench_kernels.py", "rows": rows}))
    r = run([sys.executable, "scripts/plots.py", "kernels", str(src)], timeout=60)
    assert r.returncode == 0, r.stderr
    assert_png(tmp_path / "kernels.png")


def test_profile_writes_a_chrome_trace(tmp_path):
    trace = tmp_path / "trace.json"
    r = tpattn(["--profile", str(trace), "--seq-len", "64", "--heads", "2", "--head-dim", "16"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    assert events and any(str(e.get("name", "")).startswith("aten::") for e in events)
    assert all("ph" in e for e in events)
    names = {e.get("name") for e in events}
    assert {"qkv_proj", "qk", "softmax", "pv", "out_proj"} <= names  # every pass is a named range



@pytest.mark.mpi
def test_sweep_uneven_heads_runs_world_sizes_that_do_not_divide(tmp_path):
    """--uneven-heads (#17): 4 heads over 3 ranks runs (2, 1, 1 heads; the peers, which split heads
    evenly, are not run there); without it world 3 is skipped with the flag named."""
    small = ["--seq-len", "48", "--heads", "4", "--head-dim", "8", "--warmup", "0", "--iters", "1", "--device", "cpu"]
    r = scaling(["--world-sizes", "1", "3", *small, "--uneven-heads", "--out", str(tmp_path)], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    sweep = json.loads((tmp_path / "scaling.json").read_text())
    rows = {row["world"]: row for row in sweep["rows"]}
    assert rows[3]["verify"] == "PASS" and rows[3]["heads_by_rank"] == [2, 1, 1] and rows[3]["peer"] is None
    assert "--uneven-heads" in rows[3]["commands"]["tpattn"]
    assert rows[3]["report"]["config"]["heads_by_rank"] == [2, 1, 1]
    assert table_rows((tmp_path / "scaling.md").read_text())[3][2] == "2 or 1"
    assert "peers not run at world 3" in r.stdout
    r = scaling(["--world-sizes", "1", "3", *small, "--no-peer", "--out", str(tmp_path / "even")], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "world 3: skipped, --heads 4 does not split over 3 ranks (--uneven-heads would run it)" in r.stdout
