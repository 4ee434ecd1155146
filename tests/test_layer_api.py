"""The layer's Python API as a module people build on: its weights are parameters, it refuses what
the CLI refuses (with the CLI's line, on every rank), its communication is decided by one plan that
no attention backend changes, and every collective in tpattn/ is in tpattn/comm.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run
from tpattn.commplan import ROW_ALIGN, make_plan
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention
from tpattn.model import steps
from tpattn.model.errors import ModelError


@pytest.mark.mpi
def test_api_refusals_parameters_and_plan_under_mpirun():
    """3 ranks (tests/mpi_layer_api_check.py): shard_sequence of N = 10 refused (it dropped row 9),
    sequence_parallel with output_collective='allreduce' refused (it was accepted and ignored), the
    same plan for the reference and fused backends, parameters and state_dict with the shard."""
    r = run(mpirun_cmd(3) + [sys.executable, str(ROOT / "tests" / "mpi_layer_api_check.py")], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("LAYER-API PASS") == 3, r.stdout + r.stderr


def _mha(e=16, h=4, seed=0):
    torch.manual_seed(seed)
    return torch.nn.MultiheadAttention(e, h, batch_first=True)


def test_weights_are_parameters_and_follow_the_module():
    mha = _mha()
    layer = TensorParallelAttention.from_multihead_attention(mha)
    assert {n for n, _ in layer.named_parameters()} == {"wqkv", "bqkv", "wo", "bo"}
    assert all(p.requires_grad and p.is_leaf for p in layer.parameters())
    # copies: changing the layer's weights never writes into the module it was built from
    before = mha.out_proj.weight.detach().clone()
    with torch.no_grad():
        layer.wo.add_(1.0)
    assert torch.equal(mha.out_proj.weight, before)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        y32 = layer(x)
        layer.double()
        assert layer.dtype == torch.float64 and layer.wq.dtype == torch.float64
        y64 = layer(x.double())
    assert y64.dtype == torch.float64 and torch.allclose(y64.float(), y32, atol=1e-5)
    assert layer.wq.shape == (16, 16) and layer.wk.shape == (16, 16) and layer.wv.shape == (16, 16)


def test_optimizer_sees_the_weights_and_trains_them():
    layer = TensorParallelAttention.from_multihead_attention(_mha())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == 4 * 16 * 16 + 3 * 16 + 16
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    y = layer(torch.randn(1, 5, 16, requires_grad=True))
    assert y.requires_grad
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in layer.named_parameters())


def test_state_dict_round_trip_and_shard_mismatch():
    layer = TensorParallelAttention.from_multihead_attention(_mha())
    state = layer.state_dict()
    assert state["_extra_state"] == {"rank": 0, "world": 1, "heads": 4, "kv_heads": 4, "uneven": False, "head_dim": 4}
    other = TensorParallelAttention.from_multihead_attention(_mha(seed=1))
    other.load_state_dict(state)
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        assert torch.equal(other(x), layer(x))
    state["_extra_state"] = {**state["_extra_state"], "rank": 1, "world": 2}
    with pytest.raises(ValueError, match="this checkpoint holds rank 1 of 2 .* but this layer is rank 0 of 1"):
        other.load_state_dict(state)


def test_the_api_refuses_what_the_cli_refuses_in_its_own_names():
    """The CLI's rule and line, the API's argument names (the CLI prints cli_message)."""
    mha = _mha()
    with pytest.raises(ConfigError, match=r"^output_collective='split' is for the head-parallel style; "
                                          r"sequence_parallel=True always reduce-scatters") as e:
        TensorParallelAttention.from_multihead_attention(mha, sequence_parallel=True, output_collective="split")
    assert e.value.cli_message.startswith("--output-collective split is for the head-parallel style")
    with pytest.raises(ConfigError, match="^overlap must be at least 1"):
        TensorParallelAttention.from_multihead_attention(mha, overlap=0)
    layer = TensorParallelAttention.from_multihead_attention(mha, overlap=8)
    with pytest.raises(ConfigError, match=r"^overlap=8 is more chunks than the 5 rows of x \(x.shape\[1\]\); use fewer"):
        layer(torch.randn(1, 5, 16))


def test_plan_rule_is_one_and_backend_free():
    """The split needs every chunk's rows divisible by W; chunks are cut at ROW_ALIGN for every backend
    once N allows it, so N = 1000 over 3 ranks with overlap 4 all-reduces whoever computes attention."""
    p = make_plan(1, 1000, 64, 3, elem=2, part_elem=4, overlap=4)
    assert p.chunks == ((0, 256), (256, 512), (512, 768), (768, 1000)) and ROW_ALIGN == 128
    assert p.collective == "allreduce" and p.nbytes == {"allreduce": 1000 * 64 * 4}
    p = make_plan(1, 1024, 64, 2, elem=2, part_elem=4)
    assert p.collective == "split" and p.nbytes == {"reducescatter": 1024 * 64 * 4, "allgather": 1024 * 64 * 2}
    assert make_plan(1, 1024, 64, 2, elem=2, part_elem=2).collective == "allreduce"  # nothing to save
    p = make_plan(2, 1024, 64, 2, elem=2, part_elem=4, output_collective="p2p")
    assert p.collective == "p2p" and p.peer_elements == 2 * 1024 * 64
    assert make_plan(1, 96, 8, 4, elem=2, part_elem=4, sequence_parallel=True, overlap=2).chunks == ((0, 12), (12, 24))
    with pytest.raises(ConfigError, match=r"output_collective='split' needs the batch \(x.shape\[0\]\) x the rows"):
        make_plan(1, 1000, 64, 3, elem=2, part_elem=4, overlap=4, output_collective="split")


def test_auto_takes_the_oneshot_allreduce_for_small_partials_when_peers_map():
    """auto: the one-shot peer all-reduce for head-parallel partials of at most ONESHOT_MAX_BYTES, in
    one chunk, once the ranks agreed that they can map each other's memory (peers=True); NCCL's
    collectives otherwise. Named, "oneshot" is taken at any size."""
    from tpattn.commplan import ONESHOT_MAX_BYTES, oneshot_candidate
    rows = ONESHOT_MAX_BYTES // (4096 * 4)  # fp32 partials of D = 4096: 32 rows fit
    p = make_plan(rows, 1, 4096, 2, elem=2, part_elem=4, peers=True)
    assert p.collective == "oneshot" and p.nbytes == {"oneshot": ONESHOT_MAX_BYTES}
    assert p.peer_elements == rows * 4096
    assert make_plan(rows + 2, 1, 4096, 2, elem=2, part_elem=4, peers=True).collective == "split"
    assert make_plan(rows, 1, 4096, 2, elem=2, part_elem=4).collective == "split"  # no agreement: NCCL
    assert make_plan(2 * rows, 1, 4096, 2, elem=2, part_elem=2, peers=True).collective == "oneshot"  # model dtype
    assert make_plan(1, 256, 64, 2, elem=2, part_elem=4, peers=True, overlap=2).collective == "split"  # chunks
    assert make_plan(1, 256, 64, 2, elem=2, part_elem=4, peers=True, sequence_parallel=True).collective == "sequence"
    assert make_plan(1, 256, 64, 1, elem=2, part_elem=4, peers=True).collective == "none"
    big = make_plan(1, 4096, 4096, 2, elem=2, part_elem=4, output_collective="oneshot")
    assert big.collective == "oneshot" and big.peer_elements == 4096 * 4096
    assert not oneshot_candidate(1, 1, 4096, 2, part_elem=4, output_collective="allreduce")
    assert oneshot_candidate(1, 1, 4096, 2, part_elem=4)
    with pytest.raises(ConfigError, match="output_collective='oneshot' sums all rows in one pass"):
        make_plan(1, 256, 64, 2, elem=2, part_elem=4, output_collective="oneshot", overlap=2)


def test_training_takes_the_plan_inference_takes():
    """One plan for inference and training (a choice from autograd state could differ between ranks):
    once the ranks agreed on the one-shot buffers, a call under autograd plans them too (its backward,
    the identity, is the same for every sum)."""
    layer = TensorParallelAttention.from_multihead_attention(_mha())
    object.__setattr__(layer, "shard", layer.shard.__class__.of(layer.heads, layer.kv_heads, 2, 0, False))  # rank 0 of 2
    assert layer.plan(1, 8).collective == "allreduce"  # fp32 model: nothing for the split to save
    layer.peers.said = ((torch.device("cpu"), layer.part_dtype, layer.dtype), True)  # as PeerLinks.ask leaves it
    assert layer.plan(1, 8).collective == "oneshot"
    with pytest.raises(TypeError):
        layer.plan(1, 8, training=True)  # there is no separate training plan


def test_oneshot_mapping_is_all_ranks_or_none(monkeypatch):
    """The layer's agreement on the one-shot buffers (two gathers: the handles, then whether each rank
    mapped all), with rank 1's answer simulated: one rank that cannot map makes every rank fall back
    (auto) or raise the same line (named); a graph's pinned buffers are never replaced."""
    from types import SimpleNamespace

    from tpattn import peer
    made = []

    class Buffers:  # stands in for peer.OneShotBuffers (CUDA IPC) on this CPU
        def __init__(self, capacity, part_dtype, out_dtype, device, rank, world):
            self.capacity, self.closed, self.exported = capacity, False, ("host", None, b"handle", 0)
            made.append(self)

        def open(self, exported):
            assert len(exported) == 2 and exported[0] == exported[1] == self.exported
            return None

        def close(self):
            self.closed = True

    monkeypatch.setattr(peer, "OneShotBuffers", Buffers)
    links = TensorParallelAttention.from_multihead_attention(_mha()).peers
    cpu, f32 = torch.device("cpu"), torch.float32
    for rank1 in ("rank 1 cannot map rank 0's buffer (simulated)", None):
        links.comm = SimpleNamespace(rank=0, world=2, all_gather_object=lambda obj, r1=rank1: [
            obj, obj if isinstance(obj, tuple) else r1])
        got = links._map_oneshot(64, cpu, f32, f32, required=False)
        if rank1:
            assert got is None and made[-1].closed and links.oneshot is None
            with pytest.raises(ValueError, match=r"output_collective='oneshot': rank 1 cannot map rank 0's buffer "
                                                 r"\(simulated\); use 'auto'"):
                links._map_oneshot(64, cpu, f32, f32, required=True)
        else:
            assert got is made[-1] and links.oneshot is got and not got.closed
    links.pinned = True
    with pytest.raises(ValueError, match="a CUDA graph captured by graphed\\(\\) replays the current ones"):
        links._map_oneshot(128, cpu, f32, f32, required=True)
    assert links.oneshot is made[-1] and not made[-1].closed


def test_the_cost_model_prices_the_plan_or_says_it_cannot():
    shape = steps.Shape(seq_len=4096, heads=32, head_dim=128, output_collective="p2p")
    with pytest.raises(ModelError, match="no price for --output-collective p2p"):
        steps.layer_collectives(shape, 2)
    shape = steps.Shape(seq_len=1000, heads=32, head_dim=128, overlap=4)
    assert steps.layer_collectives(shape, 3) == make_plan(1, 1000, 4096, 3, elem=2, part_elem=4, overlap=4).nbytes


def test_every_collective_call_in_tpattn_is_in_comm():
    """layer.py holds no collective call of its own; nothing in tpattn/ calls torch.distributed's
    collectives but tpattn/comm.py (the process-group set-up in dist.py is not a collective)."""
    calls = re.compile(r"\b(dist|torch\.distributed)\.(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|"
                       r"barrier|all_to_all\w*|send|recv|isend|irecv|reduce|gather|scatter)\(")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "tpattn").rglob("*.py")) if p.name != "comm.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if calls.search(line)]
    assert not found, found
    assert calls.search(Path(ROOT / "tpattn" / "comm.py").read_text())  # the pattern finds them where they are


def test_peer_buffers_under_a_captured_graph_never_move():
    """A graph captured with the peer buffers replays their addresses: a later, larger call must not
    re-allocate them (the graph would read and write freed memory across GPUs). Every rank refuses
    alike: the need comes from the plan. (The 2-GPU run of it is tests/test_gpu_layer.py.)"""
    from types import SimpleNamespace
    layer = TensorParallelAttention.from_multihead_attention(_mha(), output_collective="p2p")
    plan = make_plan(1, 64, 16, 2, elem=4, part_elem=4, output_collective="p2p")
    held = SimpleNamespace(capacity=32 * 16, part_dtype=torch.float32, out_dtype=torch.float32,
                           device=torch.device("cpu"))
    layer.peers.p2p, layer.peers.pinned = held, True
    cpu, f32 = torch.device("cpu"), torch.float32
    with pytest.raises(ValueError, match=r"needs peer buffers of 1024 elements but a CUDA graph captured by "
                                         r"graphed\(\) replays the current ones \(512\)"):
        layer.peers.buffers(plan, cpu, f32, f32)
    small = make_plan(1, 32, 16, 2, elem=4, part_elem=4, output_collective="p2p")
    assert layer.peers.buffers(small, cpu, f32, f32) is held  # what fits keeps the same buffers


def test_graphed_training_step_refuses_in_one_line(monkeypatch):
    """layer.graphed(x, dy=dy) captures CUDA work: on CPU one line saying so; dy unlike y, a cache with
    dy, or nothing to train are refused before anything is captured."""
    from tpattn.weights import head_weights
    w = head_weights(range(2), 2, 8, 0, torch.float32, torch.device("cpu"))
    layer = TensorParallelAttention(**w, heads=2, head_dim=8, group=None)
    x = torch.randn(1, 4, 16)
    with pytest.raises(ConfigError, match=r"^graphed\(\) captures CUDA work, and x is on cpu; call the layer eagerly"):
        layer.graphed(x, dy=torch.randn(1, 4, 16))
    with pytest.raises(ConfigError, match=r"^graphed\(\) captures CUDA work"):
        layer.graphed(x)
    with pytest.raises(ValueError, match=r"a decode step has no backward; pass a cache or dy, not both"):
        layer.graphed(x[:, :1], layer.new_cache(1, 8), dy=torch.randn(1, 1, 16))
    from tpattn import graphs
    meta = torch.empty(1, 4, 16, device="meta")
    monkeypatch.setattr(graphs, "refusal", lambda layer, x: None)  # past the device check, to the argument checks
    with pytest.raises(ValueError, match=r"dy must be like y, which is like x \(\(1, 4, 16\)"):
        graphs.graphed_train(layer, meta, torch.empty(1, 4, 8, device="meta"))
    for p in layer.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"neither x nor any parameter of the layer requires a gradient"):
        graphs.graphed_train(layer, meta, meta)


def _four(E=32):
    torch.manual_seed(0)
    return [torch.randn(E, E) for _ in range(4)]


@pytest.mark.parametrize("call,kind,says", [
    (lambda w: TensorParallelAttention.from_full(*w, torch.randn(33), heads=4, group=None), ValueError,
     r"bq has shape \(33,\), expected \(32,\)"),
    (lambda w: TensorParallelAttention.from_full(*w[:3], torch.randn(40, 32), heads=4, group=None), ValueError,
     r"wo has shape \(40, 32\), expected \(32, 32\)"),
    (lambda w: TensorParallelAttention.from_linears(*(torch.nn.Linear(32, 32) for _ in range(3)), torch.nn.Linear(33, 32),
                                                    heads=4, group=None), ValueError, r"wo has shape \(33, 32\)"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=0, group=None), ValueError, "heads must be a positive int"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None, causal="False"), TypeError,
     "causal must be True or False"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None, rope_theta=1e4, rope_interleaved="no"),
     TypeError, "rope_interleaved must be True or False"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None, rope_theta="1e4"), TypeError,
     "rope_theta must be a number or None"),
    (lambda w: TensorParallelAttention.from_multihead_attention(torch.nn.MultiheadAttention(32, 4), group=None),
     ValueError, "batch_first=False"),
    (lambda w: TensorParallelAttention.from_multihead_attention(torch.nn.MultiheadAttention(32, 4, dropout=0.5,
                                                                                            batch_first=True),
                                                                group=None), ValueError, "dropout=0.5"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None, context_parallel=0), ValueError,
     "context_parallel must be a positive int"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None, backend=None), TypeError,
     "backend must be a name"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None, head_chunk=-1), ValueError,
     "head_chunk must be a positive int"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None)(torch.randn(0, 4, 32)), ValueError,
     "x has no rows"),
    (lambda w: TensorParallelAttention(*w, heads=-4, head_dim=8, group=None), ValueError, "heads must be a positive int"),
    (lambda w: TensorParallelAttention.from_multihead_attention(torch.nn.Linear(32, 32), group=None), TypeError,
     "takes a torch.nn.MultiheadAttention"),
    (lambda w: TensorParallelAttention.from_full(*w, heads=4, group=None, rope_theta=float("nan")), ValueError,
     "positive, finite theta"),
])
def test_api_misuse_is_one_line_naming_the_argument(call, kind, says):
    """What the API is given wrongly is refused in one line naming the argument: never cut to fit (a
    weight too large), nor an error from deep inside."""
    with pytest.raises(kind, match=says):
        call(_four())


def test_paged_cache_misuse_is_one_line():
    from tpattn.paged import PagedKV
    layer = TensorParallelAttention.from_full(*_four(), heads=4, group=None, causal=True)
    for bad, says in ((None, "PagedKV takes a tpattn TensorParallelAttention layer"),
                      (torch.nn.Linear(4, 4), "PagedKV takes a tpattn TensorParallelAttention layer")):
        with pytest.raises(ConfigError, match=says):
            PagedKV(bad, pages=4)
    with pytest.raises(ConfigError, match=r"PagedKV pages must be an int \(got 2.5\)"):
        PagedKV(layer, pages=2.5)
    pool = PagedKV(torch.nn.ModuleList([layer]), pages=8, page_size=4)  # a ModuleList is a list of layers
    a = pool.add()
    with torch.no_grad():
        with pool.step([a], [3]) as st:
            with pytest.raises(ConfigError, match=r"pass step.view\(i\)"):
                layer(torch.randn(1, 3, 32), cache=st)
            with pytest.raises(TypeError, match="cache must be a KVCache"):
                layer(torch.randn(1, 3, 32), cache="abc")
        layer.half()
        with pool.step([a], [3]) as st:
            with pytest.raises(ConfigError, match=r"this pool holds float32 pages on cpu, made before the layer became "
                                                  "float16"):
                layer(torch.randn(1, 3, 32).half(), cache=st.view(0))


@pytest.mark.parametrize("args,kind,says", [
    ((torch.ones(1, 2, 4, 8, dtype=torch.int64),) * 3, TypeError, "one floating-point dtype"),
    ((torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8, dtype=torch.float64), torch.ones(1, 2, 4, 8)), TypeError,
     "one floating-point dtype"),
    ((torch.ones(1, 2, 4, 8),) * 3 + ("False",), TypeError, "causal must be True or False"),
])
def test_attention_refuses_at_its_boundary(args, kind, says):
    """tpattn.attention.attention: integer or mixed dtypes (int64 gave zeros), a string for causal."""
    from tpattn.attention import attention
    with pytest.raises(kind, match=says):
        attention(*args)
    with pytest.raises(TypeError, match="backend must be"):
        attention(*(torch.ones(1, 2, 4, 8),) * 3, backend=None)
