"""GPU tests of the layer around the kernels (`pytest -m gpu`): tensor-core projections against the
fp32 path they replace, sequence parallelism and overlap over NCCL (2+ GPUs) and over gloo
sharing one GPU, and the CUDA graph of the whole layer; grouped-query attention (`-k gqa`): the
fused kernel reading grouped K/V in place, the layer with fewer K/V heads over NCCL on 2 GPUs;
uneven heads (`-k uneven`): 3 heads on 2 GPUs over NCCL, naive and fused."""

import json
import sys

import pytest
import torch

from conftest import mpirun_cmd, run, tpattn
from tpattn.layer import TensorParallelAttention
from tpattn.ops import add_bias as _add_bias
from tpattn.ops import mm as _mm
from tpattn.weights import head_weights, layer_input

pytestmark = pytest.mark.gpu
SMALL = ["--seq-len", "1024", "--heads", "8", "--head-dim", "64"]


def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL between ranks (this machine has {torch.cuda.device_count()})")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_core_projection_with_fp32_result_keeps_fp32_accuracy(dtype):
    """The output GEMM on tensor cores with an fp32 result: its error is far below the storage
    dtype's own rounding of the result (what --reduce-dtype fp32 exists to avoid before the sum)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(512, 1024, device="cuda", generator=g).to(dtype)
    b = (torch.randn(1024, 768, device="cuda", generator=g) / 32).to(dtype)
    y = _mm(a, b, torch.float32)
    assert y.dtype == torch.float32
    ref = a.double() @ b.double()
    err = (y.double() - ref).abs().max().item()
    rounding = (ref.to(dtype).double() - ref).abs().max().item()  # the storage dtype's rounding of y
    print(f"{dtype}: tensor-core fp32 result err {err:.3g}, storage rounding {rounding:.3g}")
    assert err < rounding / 50, (err, rounding)
    out = torch.empty_like(y)
    assert torch.equal(_mm(a, b, torch.float32, out=out), y) and torch.equal(out, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bias_pass_widens_the_bias_inside_the_add(dtype):
    """b_o added to an fp32 partial in one kernel (no cast kernel before it): bit for bit the sum of
    the cast-first pass it replaced, rounded once to the model dtype; a model-dtype partial as before."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator(device="cuda").manual_seed(2)
    part = torch.randn(4096, 1024, device="cuda", generator=g) * 50
    bias = torch.randn(1024, device="cuda", generator=g).to(dtype)
    out = torch.empty(4096, 1024, dtype=dtype, device="cuda")
    assert torch.equal(_add_bias(part, bias, out), torch.add(part, bias.float(), out=torch.empty_like(out)))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _add_bias(part, bias, out)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
    low = part.to(dtype)
    assert torch.equal(_add_bias(low, bias, torch.empty_like(out)), low + bias)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fused_reads_qkv_in_place_and_writes_token_major_rows(causal, d):
    """The layer hands the fused kernel strided views of its QKV GEMM output and of the output
    GEMM's rows: the same bits as contiguous copies."""
    from tpattn.attention import get_backend
    B, N, h = 2, 700, 3
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(B, N, 3, h, d, device="cuda", generator=g).half()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    rows = torch.full((B, N, h, d), float("nan"), device="cuda", dtype=torch.half)
    fused = get_backend("fused")
    fused.forward(q, k, v, causal, out=rows.permute(0, 2, 1, 3))
    whole = fused.forward(q.contiguous(), k.contiguous(), v.contiguous(), causal)
    assert torch.equal(rows.permute(0, 2, 1, 3), whole)


@pytest.mark.parametrize("kernel", ["naive", "fused"])
@pytest.mark.parametrize("style", [[], ["--sequence-parallel"], ["--overlap", "4"],
                                   ["--sequence-parallel", "--overlap", "2"]])
@pytest.mark.parametrize("causal", [[], ["--causal"]])
def test_styles_over_nccl_on_two_gpus(tmp_path, kernel, style, causal):
    two_gpus()
    out = tmp_path / "r.json"
    r = tpattn([*SMALL, "--kernel", kernel, *style, *causal, "--json", str(out)], ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["world"]["backend"] == "nccl"
    colls = rep["collectives"]
    # head-parallel with fp32 partials and 1024 rows (any chunking here divides by 2): split
    assert set(colls) == {"allgather", "reducescatter"}
    assert all(c["busbw_GBps"] > 0 for c in colls.values())


@pytest.mark.parametrize("how", ["allreduce", "split"])
@pytest.mark.parametrize("overlap", ["1", "4"])
def test_output_collectives_over_nccl(tmp_path, how, overlap):
    """Both ways of summing the partials over NCCL (the split's bias pass runs on the side stream
    when overlapping): the baseline's output."""
    two_gpus()
    out = tmp_path / "r.json"
    r = tpattn([*SMALL, "--kernel", "fused", "--output-collective", how, "--overlap", overlap, "--json", str(out)],
               ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["checks"]["vs_single_process"]["pass"]
    assert list(rep["collectives"]) == (["allreduce"] if how == "allreduce" else ["reducescatter", "allgather"])


@pytest.mark.parametrize("extra", [[], ["--causal"], ["--reduce-dtype", "model"], ["--dtype", "bf16"],
                                   ["--batch", "3", "--seq-len", "333"], ["--cuda-graph"], ["--kernel", "naive"]])
def test_peer_output_collective_on_two_gpus(tmp_path, extra):
    """--output-collective p2p: both collectives in one kernel over NVLink; the baseline's output
    (rows that do not split evenly: 3 x 333 rows over 2 ranks; bf16; fp16 partials with b_o after
    the sum; inside a CUDA graph)."""
    two_gpus()
    out = tmp_path / "r.json"
    args = [*SMALL, "--kernel", "fused", "--output-collective", "p2p", *extra, "--json", str(out)]
    r = tpattn(args, ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["checks"]["vs_single_process"]["pass"], rep["checks"]
    if "--cuda-graph" not in extra:
        assert list(rep["collectives"]) == ["peer"] and rep["collectives"]["peer"]["busbw_GBps"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_oneshot_allreduce_over_gloo(world):
    """The one-shot peer all-reduce (tests/mpi_oneshot_check.py): ranks sharing this GPU, or one
    GPU each where there are enough. The kernel bit for bit against torch (every dtype pair, widths
    that divide by 4 and not, b_o or not, many calls on the same buffers), auto's choice by size, the
    decode against the single-process layer, the same bits on every rank, a graphed decode step, a
    compiled one (tpattn::peer_sum, no graph break), and a rank that cannot map the others (auto
    falls back, "oneshot" refuses on every rank)."""
    r = run(mpirun_cmd(world) + [sys.executable, "tests/mpi_oneshot_check.py"], timeout=600)
    assert r.returncode == 0 and r.stdout.count("ONESHOT PASS") == world, r.stdout + r.stderr


def test_oneshot_allreduce_stops_when_a_rank_never_comes():
    """The last rank never calls the one-shot all-reduce: the others' kernels stop after the timeout
    (3 s here, rank r 3 r s later, so that the ranks sharing this GPU do not trap together) with one
    printed line each and an error, not a hang."""
    r = run(mpirun_cmd(3) + [sys.executable, "tests/mpi_oneshot_check.py", "late"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    stopped = [line for line in r.stdout.splitlines() if line.startswith("ONESHOT STOPPED")]
    assert len(stopped) == 2 and all(float(line.split(" after ")[1].split()[0]) < 60 for line in stopped), r.stdout
    assert "rank 0 waited 3 s for rank 2" in r.stdout and "rank 1 waited 6 s for rank 2" in r.stdout, r.stdout


def test_decode_cli_ends_the_job_when_a_rank_skips_the_oneshot_sum():
    """Rank 1 leaves the one-shot sum out (fault injection): the job ends with a line that names rank 1,
    long before the kernel's own 600 s stop. Whichever comes first says it: rank 0's collective watch
    (its kernel did not finish within --timeout) or rank 1, which finds rank 0 waiting in a
    collective it never joined."""
    r = tpattn(["--decode", "4", "--causal", "--seq-len", "64", "--heads", "8", "--head-dim", "64", "--kernel",
                "fused", "--device", "cuda", "--dist-backend", "gloo", "--timeout", "15"], ranks=2, timeout=200,
               TPATTN_DEBUG_INJECT_FAULT="1:allreduce:skip")
    assert r.returncode != 0
    watch = "one-shot peer all-reduce #" in r.stderr and "did not complete within 15 s (--timeout 15): rank(s) 1 " \
        "never joined it" in r.stderr
    skipper = "rank(s) 0 wait in the layer's collective #" in r.stderr and "which rank 1 (this rank) never joined: " \
        "it skipped or left it" in r.stderr
    assert watch or skipper, r.stderr


def test_decode_cli_over_gloo_takes_the_oneshot_allreduce(tmp_path):
    """python -m tpattn --decode with two ranks sharing this GPU: auto sums the steps' partials with
    the one-shot peer all-reduce, and every decoded row passes against the full recompute."""
    out = tmp_path / "r.json"
    r = tpattn(["--decode", "6", "--causal", "--seq-len", "64", "--heads", "8", "--head-dim", "64", "--kernel",
                "fused", "--device", "cuda", "--dist-backend", "gloo", "--json", str(out)], ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS", rep["checks"]
    assert "oneshot" in rep["collectives"], rep["collectives"]


def test_peer_reduce_gather_sums_every_rank_in_order(tmp_path):
    """The peer kernel against torch on the same data, several calls and sizes (buffers regrow),
    under mpirun: every rank's out equals the fp32 sum of every rank's partial (+ the bias, but
    for the second call), rounded once, bit for bit."""
    two_gpus()
    r = tpattn_script(tmp_path, PEER_CHECK, ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("peer ok") == 2, r.stdout


PEER_CHECK = """
import os, torch, torch.distributed as dist
from tpattn.peer import PeerBuffers
rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + os.environ["PEER_PORT"], rank=rank,
                        world_size=world, device_id=dev)
bufs = None
for rows, dim, pd, od in [(7, 12, torch.float32, torch.float16), (1000, 96, torch.float32, torch.bfloat16),
                          (513, 6, torch.float16, torch.float16), (4096, 256, torch.float32, torch.float16)]:
    if bufs is None or bufs.capacity < rows * dim or bufs.part_dtype != pd or bufs.out_dtype != od:
        bufs = PeerBuffers(rows * dim, pd, od, dev, dist.group.WORLD.group_name, rank, world)
    for call in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 * call + rank)
        mine = (torch.randn(rows, dim, device=dev, generator=g) * 10).to(pd)
        bufs.partial(rows, dim).copy_(mine)
        bias = torch.randn(dim, device=dev, generator=torch.Generator(device="cuda").manual_seed(9)).to(od)
        out = torch.full((rows, dim), float("nan"), device=dev, dtype=od)
        bufs.reduce_gather(out, bias if call != 1 else None)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        want = every[0].float()
        for t in every[1:]:
            want = want + t.float()
        if call != 1:
            want = want + bias.float()
        assert torch.equal(out, want.to(od)), (rows, dim, pd, od, (out.float() - want).abs().max().item())
torch.cuda.synchronize()
print("peer ok", rank, flush=True)
dist.destroy_process_group()
"""


def tpattn_script(tmp_path, code: str, ranks: int):
    """`python SCRIPT` under mpirun, with the source tree importable."""
    from tpattn.dist import _free_port
    path = tmp_path / "script.py"
    path.write_text(code)
    return run(mpirun_cmd(ranks) + [sys.executable, str(path)], timeout=300, PEER_PORT=str(_free_port()))


@pytest.mark.parametrize("style", [["--sequence-parallel", "--overlap", "2"], ["--overlap", "3"]])
def test_styles_over_gloo_sharing_one_gpu(tmp_path, style):
    out = tmp_path / "r.json"
    r = tpattn([*SMALL, "--kernel", "fused", "--dist-backend", "gloo", *style, "--json", str(out)], ranks=2,
               timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(out.read_text())["verdict"] == "PASS"


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("extra", [[], ["--overlap", "2"]])
def test_cuda_graph_of_the_layer(tmp_path, ranks, extra):
    if ranks > 1:
        two_gpus()
    out = tmp_path / "r.json"
    r = tpattn([*SMALL, "--kernel", "fused", "--cuda-graph", *extra, "--json", str(out)], ranks=ranks, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["config"]["cuda_graph"]


def test_graph_replay_follows_new_input_and_matches_eager():
    w = head_weights(range(4), 4, 64, 0, torch.float16, "cuda")
    layer = TensorParallelAttention(**w, heads=4, head_dim=64, backend="fused", group=None)
    x = layer_input(1, 512, 256, 0, torch.float16, "cuda")
    run = layer.graphed(x)
    x2 = layer_input(1, 512, 256, 7, torch.float16, "cuda")
    x.copy_(x2)
    y = run().clone()
    assert torch.equal(y, layer(x2))  # same kernels, same order: bit-identical


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", [(1000, 128), (640, 64)])
@pytest.mark.parametrize("cfg", [None, "fused2_{suf}_d{d}_w4_m1_c64", "fusedh_{suf}_d{d}", "fusedw_{suf}_d{d}"])
def test_fused_row_chunks_match_the_whole_call(monkeypatch, causal, n, d, cfg):
    """The layer's overlap computes query rows in chunks: the same bits as one call, any N."""
    from tpattn.attention import get_backend
    if cfg:
        monkeypatch.setenv("TPATTN_FUSED_CFG", cfg.format(suf="f16", d=d))
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, d, device="cuda", generator=g).half() for _ in range(3))
    fused = get_backend("fused")
    whole = fused.forward(q, k, v, causal)
    o = torch.full_like(q, float("nan"))
    for r0, r1 in ((0, 256), (256, 384), (384, n)):
        fused.forward(q, k, v, causal, out=o, rows=(r0, r1))
    assert torch.equal(o, whole)
    with pytest.raises(ValueError, match="multiple of 128"):
        fused.forward(q, k, v, causal, out=o, rows=(100, 300))


# ---- grouped-query attention -------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,g", [(4, 2), (4, 1)])
@pytest.mark.parametrize("cfg", [None, "fusedh_{suf}_d{d}", "fusedw_{suf}_d{d}"])
def test_fused_gqa_reads_packed_qkv_in_place(monkeypatch, causal, h, g, cfg):
    """The layer's QKV GEMM output with fewer K/V heads, [B, N, h + 2g, d]: the fused kernel reads
    q, k and v as strided views of it (K/V strides of their own) and writes O as the output GEMM's
    rows; the same bits as contiguous copies."""
    from tpattn.attention import get_backend
    if cfg:
        monkeypatch.setenv("TPATTN_FUSED_CFG", cfg)
    B, N, d = 2, 700, 128
    gen = torch.Generator(device="cuda").manual_seed(6)
    qkv = torch.randn(B, N, h + 2 * g, d, device="cuda", generator=gen).half()
    q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split([h, g, g], dim=2))
    rows = torch.full((B, N, h, d), float("nan"), device="cuda", dtype=torch.half)
    fused = get_backend("fused")
    fused.forward(q, k, v, causal, out=rows.permute(0, 2, 1, 3))
    whole = fused.forward(q.contiguous(), k.contiguous(), v.contiguous(), causal)
    assert torch.equal(rows.permute(0, 2, 1, 3), whole)


@pytest.mark.parametrize("kernel,kv_heads", [("naive", 8), ("tiled", 8), ("fused", 8), ("fused", 1)])
def test_gqa_layer_over_nccl_on_two_gpus(tmp_path, kernel, kv_heads):
    """32 query heads on 8 K/V heads (4 each per rank) and on 1 (replicated on both ranks), 2 GPUs."""
    two_gpus()
    out = tmp_path / "r.json"
    r = tpattn(["--seq-len", "2048", "--heads", "32", "--kv-heads", str(kv_heads), "--head-dim", "128", "--kernel",
                kernel, "--json", str(out)], ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["world"]["backend"] == "nccl" and rep["config"]["kv_heads"] == kv_heads
    assert rep["checks"]["vs_single_process"]["pass"] and rep["checks"]["vs_float64"]["pass"]
    want = ["0-3", "4-7"] if kv_heads == 8 else ["0-0", "0-0"]
    assert [x["kv_heads"] for x in rep["world"]["ranks"]] == want


@pytest.mark.parametrize("style", [[], ["--overlap", "2", "--causal"], ["--sequence-parallel"], ["--cuda-graph"]])
def test_gqa_layer_default_shape_styles_over_nccl(tmp_path, style):
    """The issue's shape: H = 32, G = 8, d = 128, N = 4096, --kernel fused, on 2 GPUs, each style."""
    two_gpus()
    out = tmp_path / "r.json"
    r = tpattn(["--kernel", "fused", "--kv-heads", "8", *style, "--json", str(out)], ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["config"]["heads"] == 32 and rep["config"]["kv_heads"] == 8


def test_gqa_graph_replay_matches_eager():
    """A grouped layer (4 query heads on 1 K/V head) captured in a CUDA graph: bit-identical."""
    w = head_weights(range(4), 4, 64, 0, torch.float16, "cuda", kv_heads=range(1))
    layer = TensorParallelAttention(**w, heads=4, kv_heads=1, head_dim=64, backend="fused", group=None)
    x = layer_input(1, 512, 256, 0, torch.float16, "cuda")
    run = layer.graphed(x)
    x2 = layer_input(1, 512, 256, 7, torch.float16, "cuda")
    x.copy_(x2)
    assert torch.equal(run().clone(), layer(x2))


@pytest.mark.parametrize("kernel", ["naive", "fused"])
@pytest.mark.parametrize("causal", [[], ["--causal"]])
def test_uneven_heads_over_nccl_on_two_gpus(tmp_path, kernel, causal):
    """3 heads on 2 GPUs (--uneven-heads, issue #17): rank 0 owns heads 0-1, rank 1 head 2; the
    collectives are unchanged ([B, N, D] partials on both ranks). d = 128 (the fused kernels take
    64 or 128), D = 384."""
    two_gpus()
    out = tmp_path / "r.json"
    r = tpattn(["--seq-len", "2048", "--heads", "3", "--head-dim", "128", "--uneven-heads", "--kernel", kernel,
                *causal, "--json", str(out)], ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["world"]["backend"] == "nccl" and rep["config"]["uneven_heads"]
    assert rep["checks"]["vs_single_process"]["pass"] and rep["checks"]["vs_float64"]["pass"]
    assert [x["heads"] for x in rep["world"]["ranks"]] == ["0-1", "2-2"]
    assert rep["config"]["heads_by_rank"] == [2, 1] and rep["balance"]["heads_max_over_mean"] == pytest.approx(4 / 3)
    assert "uneven heads: rank 0 owns 2 heads, rank 1 1" in r.stdout


@pytest.mark.parametrize("style", [["--sequence-parallel"], ["--cuda-graph"]])
def test_uneven_heads_styles_over_nccl(tmp_path, style):
    """3 heads on 2 GPUs with --kernel fused, sequence-parallel and in a CUDA graph."""
    two_gpus()
    out = tmp_path / "r.json"
    r = tpattn(["--seq-len", "2048", "--heads", "3", "--head-dim", "128", "--uneven-heads", "--kernel", "fused",
                *style, "--json", str(out)], ranks=2, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["config"]["heads_by_rank"] == [2, 1]
