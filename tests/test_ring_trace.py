"""scripts/ring_trace.py on CPU: the profile of a context-parallel call under mpirun shows every
K/V pass posted before its step's compute, and the profile of a training step (--backward) the
backward's passes too (the K/V blocks and the dK, dV sums); a trace where one is not fails with
exit 1; a trace of a call without a ring is refused with exit 2."""

import json
import sys

from conftest import ROOT, mpirun_cmd, run

SCRIPT = str(ROOT / "scripts" / "ring_trace.py")


def test_profile_of_a_ring_call_shows_each_pass_posted_first(tmp_path):
    trace = tmp_path / "ring.json"
    r = run(mpirun_cmd(3) + [sys.executable, "-m", "tpattn", "--context-parallel", "3", "--causal", "--seq-len", "192",
                             "--heads", "2", "--head-dim", "16", "--iters", "1", "--warmup", "0", "--no-check",
                             "--profile", str(trace)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = run([sys.executable, SCRIPT, str(trace), f"{trace}.rank1", f"{trace}.rank2"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("3 ring steps") == 3
    assert out.stdout.count("(ok)") == 3 * 2 and out.stdout.count("no pass (the last block)") == 3
    assert out.stdout.rstrip().endswith("every pass posted before its step's compute")


def test_profile_of_a_ring_training_step_shows_both_directions_posted_first(tmp_path):
    trace = tmp_path / "step.json"
    r = run(mpirun_cmd(3) + [sys.executable, "-m", "tpattn", "--context-parallel", "3", "--causal", "--seq-len", "192",
                             "--heads", "2", "--head-dim", "16", "--iters", "1", "--warmup", "0", "--no-check",
                             "--backward", "--profile", str(trace)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("wrote the torch.profiler trace of one training step (forward and backward)") == 3
    out = run([sys.executable, SCRIPT, str(trace), f"{trace}.rank1", f"{trace}.rank2"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("backward: 2 K/V passes") == 3 and out.stdout.count("backward: 3 dK, dV sums passes") == 3
    # per rank: 2 forward passes, 2 backward K/V passes and 2 of the sums' 3 posted before compute; the third home
    assert out.stdout.count("(ok)") == 3 * 6 and out.stdout.count("the sums' last hop home") == 3, out.stdout
    assert out.stdout.rstrip().endswith("every pass posted before its step's compute")


def test_a_backward_pass_posted_after_its_compute_started_fails(tmp_path):
    # the forward's one pass in time; the backward's K/V pass still posting (until 108) when its compute began (105)
    events = [_event("ring", 0, 2), _event("attention", 3, 5), _event("ring", 9, 1), _event("attention", 11, 5),
              _event("attention_bwd", 99, 1), _event("bwd_ring", 100, 8), _event("attention_bwd", 105, 10),
              _event("bwd_ring_grads", 116, 2), _event("bwd_ring", 119, 1), _event("attention_bwd", 121, 5),
              _event("bwd_ring_grads", 127, 1), _event("bwd_ring_grads", 129, 2), _event("bwd_ring_grads", 132, 3),
              _event("attention_bwd", 136, 1)]
    path = tmp_path / "late.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = run([sys.executable, SCRIPT, str(path)])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "K/V pass 0: posted -3 us before the compute it travels under was launched (AFTER: not overlapped)" \
        in out.stdout, out.stdout
    assert "dK, dV sums pass 0: posted 3 us before" in out.stdout and "the sums' last hop home" in out.stdout
    assert out.stdout.rstrip().endswith("SOME PASS POSTED AFTER ITS STEP'S COMPUTE")


def _event(name, ts, dur, cat="user_annotation"):
    return {"name": name, "ts": ts, "dur": dur, "cat": cat, "ph": "X"}


def test_a_pass_posted_after_the_compute_started_fails(tmp_path):
    # the step's compute was launched (ts 3) before the host finished posting its pass (ts 8)
    events = [_event("ring", 0, 8), _event("attention", 3, 10), _event("ring", 14, 2), _event("attention", 17, 5),
              _event("attention", 5, 9, "gpu_user_annotation"), _event("attention", 18, 4, "gpu_user_annotation")]
    path = tmp_path / "late.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = run([sys.executable, SCRIPT, str(path)])
    assert out.returncode == 1 and "AFTER: not overlapped" in out.stdout, out.stdout + out.stderr
    assert "the compute started on the GPU -3 us after the posting" in out.stdout


def test_a_trace_without_a_ring_is_refused(tmp_path):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"traceEvents": [_event("qkv_proj", 0, 3), _event("attention", 3, 10)]}))
    out = run([sys.executable, SCRIPT, str(path)])
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--context-parallel C" in out.stderr, out.stderr
