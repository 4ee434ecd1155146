"""The layer as a module a model holds (one process, CPU): settings fixed at construction, one
forward for inference and training, a cache that refuses autograd, inputs refused in one line that
names the argument, biases the source did not have left out, copies and pickles, full_weights(),
and attend()'s blocks of query rows. The multi-rank half is tests/mpi_module_check.py."""

from __future__ import annotations

import copy
import io
import math
import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run
from tpattn import decode
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention


def _layer(e=16, h=4, seed=0, **kw):
    torch.manual_seed(seed)
    return TensorParallelAttention.from_multihead_attention(torch.nn.MultiheadAttention(e, h, batch_first=True), **kw)


@pytest.mark.mpi
def test_module_rules_on_two_and_four_ranks():
    """tests/mpi_module_check.py on 2 and 4 ranks: the same collectives whatever autograd state a
    rank has; a differentiable gather_sequence; train_nbytes equal to what a step runs; deepcopy,
    pickling and full_weights under a process group."""
    for n in (2, 4):
        r = run(mpirun_cmd(n) + [sys.executable, str(ROOT / "tests" / "mpi_module_check.py")], timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("MODULE PASS") == n, r.stdout + r.stderr


def test_settings_are_fixed_and_replace_builds_a_new_layer():
    layer = _layer(causal=True)
    for name, value in (("sequence_parallel", True), ("causal", False), ("overlap", 2), ("backend", "naive"),
                        ("output_collective", "split"), ("head_chunk", 1), ("shard", None), ("rope_theta", 1e4)):
        with pytest.raises(AttributeError, match=rf"layer\.{name} is fixed when the layer is built"):
            setattr(layer, name, value)
    x = torch.randn(2, 9, 16)
    other = layer.replace(causal=False)
    assert other.causal is False and layer.causal is True
    with torch.no_grad():
        want = _layer(causal=False)(x)
        assert torch.equal(other(x), want)
    with torch.no_grad():
        other.wo.add_(1.0)  # copies: the new layer's weights are its own
    assert not torch.equal(other.wo, layer.wo)
    with pytest.raises(ValueError, match="replace\\(\\) changes the settings .*; not heads"):
        layer.replace(heads=2)
    layer.training = False  # what a module's own state may still change
    layer.eval().train()


def test_one_forward_inference_and_training_give_the_same_bits():
    """The same GEMMs, partial precision and rounding in both: y under no_grad equals y under autograd,
    for head chunks too (head_chunk honoured in both), in fp32 and fp64 with rotary positions."""
    for dtype in (torch.float32, torch.float64):
        for kw in ({}, {"head_chunk": 1}, {"causal": True, "rope_theta": 500.0}):
            layer = _layer(**kw).to(dtype)
            x = torch.randn(2, 11, 16, dtype=dtype)
            with torch.no_grad():
                y0 = layer(x)
            y1 = layer(x.clone().requires_grad_())
            assert y1.requires_grad and torch.equal(y0, y1), (dtype, kw)


def test_fp64_layer_computes_in_fp64_everywhere():
    """Inference attention, rotary positions and decode of an fp64 layer run in fp64 (they ran in
    fp32: 2.6e-7 off at W = 1), so prefill + decode equal the training forward to 1e-12."""
    layer = _layer(causal=True, rope_theta=100.0).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    full = layer(x.requires_grad_())
    cache = layer.new_cache(1, 6)
    with torch.no_grad():
        parts = [layer(x[:, :3], cache=cache), layer(x[:, 3:4], cache=cache), layer(x[:, 4:], cache=cache)]
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-12
    assert cache.cos.dtype == torch.float64


def test_a_cached_call_under_autograd_is_refused():
    """It ran under no_grad inside: h = xg + layer(lin(xg), cache=c) backpropagated without a word
    and left the layer's and lin's gradients empty."""
    layer = _layer(causal=True)
    lin = torch.nn.Linear(16, 16)
    xg = torch.randn(1, 4, 16, requires_grad=True)
    cache = layer.new_cache(1, 8)
    with pytest.raises(ConfigError, match=r"a KV cache call records no gradients: run it under torch.no_grad\(\)"):
        xg + layer(lin(xg), cache=cache)
    with torch.no_grad():
        assert layer(lin(xg), cache=cache).shape == (1, 4, 16)


def test_inputs_are_checked_with_one_line_naming_the_fix():
    layer = _layer()
    for x, says in ((torch.randn(1, 3, 16, dtype=torch.float64), r"x is float64 but the layer is float32: cast x"),
                    (torch.ones(1, 3, 16, dtype=torch.int64), r"x is int64 but the layer is float32"),
                    (torch.randn(1, 3, 16, dtype=torch.bfloat16), r"x is bfloat16 but the layer is float32"),
                    (torch.empty(1, 3, 16, device="meta"), r"x is on the meta device, which holds no values"),
                    (torch.randn(1, 0, 16), r"x has no rows \(shape \(1, 0, 16\)\)")):
        with pytest.raises(ValueError, match=says):
            layer(x)
    with pytest.raises(ValueError, match=r"the weights differ in dtype or device \(wq float64 on cpu, wk float32"):
        TensorParallelAttention(torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8), torch.randn(8, 8),
                                torch.randn(8, 8), heads=2, head_dim=4)


def test_api_errors_name_the_apis_arguments():
    """The API's errors named CLI flags ("--kernel naive needs CUDA tensors"); one message table, two
    spellings: the CLI prints cli_message."""
    layer = _layer(backend="naive")
    with pytest.raises(ConfigError) as err:
        with torch.no_grad():
            layer(torch.randn(1, 4, 16))
    assert str(err.value) == "backend='naive' needs CUDA tensors; use backend='reference' on CPU"
    assert err.value.cli_message == "--kernel naive needs CUDA tensors; use --kernel reference on CPU"
    with pytest.raises(ConfigError, match=r"^overlap=0 must be|^overlap must be at least 1 chunk \(got 0\)"):
        _layer(overlap=0)
    with pytest.raises(ValueError, match=r"^kv_heads=3 but wk and wv have 4 heads"):
        _layer(kv_heads=3)


def test_a_cache_after_a_dtype_or_device_change_says_so():
    layer = _layer(causal=True)
    cache = layer.new_cache(1, 8)
    layer.double()
    with pytest.raises(ConfigError, match=r"this cache holds float32 K/V but the layer is now float64 \(.half\(\) "
                                          r"or .to\(\) after new_cache\)"):
        with torch.no_grad():
            layer(torch.randn(1, 2, 16, dtype=torch.float64), cache=cache)
    cache = layer.new_cache(1, 8)
    with pytest.raises(ConfigError, match=r"this cache is on cpu but the layer is now on meta"):
        cache.check(id(layer), decode.cache_owner(layer), 1, 1, layer.dtype, torch.device("meta"))


def test_missing_biases_are_not_parameters_and_do_not_train():
    """from_linears with a v_proj without bias made a zero part of bqkv that AdamW moved (5.2e-4
    after 3 steps)."""
    torch.manual_seed(0)
    q, k, o = (torch.nn.Linear(16, 16) for _ in range(3))
    v = torch.nn.Linear(16, 16, bias=False)
    layer = TensorParallelAttention.from_linears(q, k, v, o, heads=4)
    assert {n for n, _ in layer.named_parameters()} == {"wqkv", "wo", "bo", "biases.bq", "biases.bk"}
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(2, 5, 16)).square().sum().backward()
        opt.step()
    w = layer.full_weights()
    assert w["bv"] is None and w["bq"] is not None and not torch.equal(w["bq"], q.bias.detach())
    # the layer still computes what the four Linears compute (with no bias on v)
    fresh = TensorParallelAttention.from_linears(q, k, v, o, heads=4)
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        qq, kk, vv = (lin(x).view(1, 3, 4, 4).transpose(1, 2) for lin in (q, k, v))
        ref = o(torch.softmax(qq @ kk.transpose(-1, -2) / 2.0, -1).matmul(vv).transpose(1, 2).reshape(1, 3, 16))
        assert (fresh(x) - ref).abs().max().item() < 1e-5


def test_a_checkpoint_differing_only_in_the_uneven_flag_loads():
    even = _layer()
    uneven = _layer(seed=1, uneven_heads=True)
    uneven.load_state_dict(even.state_dict())
    assert torch.equal(uneven.wqkv, even.wqkv)
    other = TensorParallelAttention.from_multihead_attention(torch.nn.MultiheadAttention(16, 2, batch_first=True))
    with pytest.raises(ValueError, match="this checkpoint holds rank 0 of 1 \\(4 heads"):
        other.load_state_dict(even.state_dict())


def test_deepcopy_pickle_and_full_weights_round_trip():
    layer = _layer(causal=True, rope_theta=1e4)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        y = layer(x)
        twin = copy.deepcopy(layer)
        assert torch.equal(twin(x), y) and twin.wqkv.data_ptr() != layer.wqkv.data_ptr()
        assert twin.comm is not layer.comm and twin.peers is not layer.peers
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(loaded(x), y) and loaded.backend is layer.backend
        rebuilt = TensorParallelAttention.from_full(**layer.full_weights(), heads=4, causal=True, rope_theta=1e4)
        assert torch.equal(rebuilt(x), y)
    avg = torch.optim.swa_utils.AveragedModel(layer)  # deepcopy inside
    with torch.no_grad():
        assert torch.equal(avg(x), y)


def test_attend_materializes_a_block_of_query_rows_at_a_time(monkeypatch):
    """A prefill over a cache that holds rows attends a block of query rows at a time (its scores
    bounded by CHUNK_BYTES), with the same result as the whole causal attention."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 40, 8)
    k, v = torch.randn(2, 2, 64, 8), torch.randn(2, 2, 64, 8)
    whole = decode.attend(q, k[:, :, :60], v[:, :, :60], 20)
    seen = []
    real = torch.matmul

    def spy(a, b):
        seen.append(a.shape[-2] if a.dim() == 5 and a.shape[-1] == 8 and b.shape[-2] == 8 else None)
        return real(a, b)
    monkeypatch.setattr(decode, "CHUNK_BYTES", {"cpu": 3 * 2 * 4 * 60 * 4 * 7})  # 7 query rows a block
    monkeypatch.setattr(torch, "matmul", spy)
    blocks = decode.attend(q, k[:, :, :60], v[:, :, :60], 20)
    monkeypatch.undo()
    assert max(s for s in seen if s) == 7 and torch.equal(blocks, whole)
    # and the causal rule: query i at position 20 + i sees keys up to 20 + i
    s = torch.einsum("bgqd,bgkd->bgqk", q[:, :1], k[:, :1, :60]) / math.sqrt(8)
    s = s.masked_fill(torch.arange(60)[None, :] > 20 + torch.arange(40)[:, None], float("-inf"))
    want = torch.softmax(s, -1) @ v[:, :1, :60]
    assert (whole[:, :1] - want).abs().max().item() < 1e-5


class _Model(torch.nn.Module):
    """A block a model would hold: a Linear before the layer, a residual after it."""

    def __init__(self, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(32, 32)
        self.attn = _layer(32, 4, **kw)

    def forward(self, x):
        return x + self.attn(self.lin(x))


def test_the_traced_graph_has_no_break():
    """torch._dynamo.explain of a model holding the layer (CPU, reference backend): one graph, no
    break, in inference and in training (it broke 4 and 6 times: the timing sections' context
    variable, among others)."""
    import torch._dynamo as dynamo
    model = _Model(causal=True, rope_theta=1e4)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        inference = dynamo.explain(model)(x)
    dynamo.reset()
    training = dynamo.explain(model)(x.clone().requires_grad_())
    dynamo.reset()
    for e in (inference, training):
        assert (e.graph_count, e.graph_break_count) == (1, 0), [str(b.reason)[:200] for b in e.break_reasons]


def test_torch_compile_matches_eager_on_cpu():
    """torch.compile of the model: inductor's inference (no_grad) and aot_eager's training step
    (the forward and backward graphs autograd traces) give eager's output and gradients."""
    import torch._dynamo as dynamo
    model = _Model(causal=True)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model)(x)
    assert (got - want).abs().max().item() < 1e-5
    dynamo.reset()
    model(x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.compile(model, backend="aot_eager")(x).square().sum().backward()
    dynamo.reset()
    for n, p in model.named_parameters():
        assert (p.grad - grads[n]).abs().max().item() < 1e-5 * max(1.0, grads[n].abs().max().item()), n


def test_the_cuda_backends_are_custom_ops_with_fake_shapes():
    """tpattn::attention and tpattn::attention_backward give their outputs' shapes and dtypes
    without running a kernel (what torch.compile and torch.export trace with), GQA included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpattn.attention import get_backend
    for name in ("fused", "triton", "naive", "tiled"):
        get_backend(name)  # a layer built with it does this: the ops find it by name
    with FakeTensorMode():
        q = torch.empty(2, 8, 10, 64, dtype=torch.float16)
        k = torch.empty(2, 2, 10, 64, dtype=torch.float16)
        for backend, saved in (("fused", (2, 8, 10)), ("triton", (2, 8, 10)), ("naive", (0,)), ("tiled", (0,))):
            o, s = torch.ops.tpattn.attention(q, k, k, True, backend, False)
            assert o.shape == q.shape and o.dtype == q.dtype and tuple(s.shape) == saved and s.dtype == torch.float32
            dq, dk, dv = torch.ops.tpattn.attention_backward(q, k, k, o, s, o, True, backend, False)
            assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_the_decode_kernels_are_custom_ops_with_fake_shapes():
    """tpattn::decode_append, tpattn::decode_attention, tpattn::prefix_attention and tpattn::peer_sum
    give their outputs' shapes without running a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpattn.attention import get_backend
    get_backend("fused")
    with FakeTensorMode():
        cache_k = torch.empty(2, 2, 64, 32, dtype=torch.float16)
        pos = torch.zeros(1, dtype=torch.int64)
        q = torch.ops.tpattn.decode_append(torch.empty(2, 8 + 4, 32, dtype=torch.float16), cache_k, cache_k.clone(),
                                           pos, None, None, 8, False)
        assert q.shape == (2, 8, 1, 32) and q.dtype == torch.float16
        o = torch.ops.tpattn.decode_attention(q, cache_k, cache_k, pos, torch.zeros(4, dtype=torch.int32))
        assert o.shape == q.shape
        o = torch.ops.tpattn.prefix_attention(torch.empty(2, 8, 5, 32, dtype=torch.float16), cache_k[:, :, :25],
                                              cache_k[:, :, :25], 20, "fused")
        assert o.shape == (2, 5, 8, 32)
        out = torch.empty(6, 64, dtype=torch.float16)  # tpattn::peer_sum writes out and returns nothing
        assert torch.ops.tpattn.peer_sum(torch.empty(6, 32, dtype=torch.float16), torch.empty(32, 64, dtype=torch.float16),
                                         out, None, 1, "oneshot") is None


def test_compiled_decode_matches_eager_on_cpu():
    """torch.compile of a model that decodes through the layer (CPU: attend's torch math, rotary
    positions): a prefill, a prefill over the rows in the cache and twelve steps match eager, with
    no graph break and a handful of graphs, not one per step (the length becomes dynamic)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    layer = _layer(64, 4, causal=True, rope_theta=1e4)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = layer

        def forward(self, x, cache):
            return self.attn(x, cache=cache)
    model = Decoder()
    x = torch.randn(2, 30, 64)
    with torch.no_grad():
        e = dynamo.explain(model)(x[:, :1], layer.new_cache(2, 40))
        dynamo.reset()
        assert e.graph_break_count == 0, [str(b.reason)[:200] for b in e.break_reasons]
        eager, comp = layer.new_cache(2, 40), layer.new_cache(2, 40)
        compiled = torch.compile(model)
        counters.clear()
        pairs = [(model(x[:, :8], eager), compiled(x[:, :8], comp)), (model(x[:, 8:18], eager), compiled(x[:, 8:18], comp))]
        pairs += [(model(x[:, t:t + 1], eager), compiled(x[:, t:t + 1], comp)) for t in range(18, 30)]
        graphs = counters["stats"]["unique_graphs"]
        dynamo.reset()
    assert max((a - b).abs().max().item() for a, b in pairs) < 1e-5
    assert comp.length == eager.length == 30 and torch.allclose(comp.k, eager.k, atol=1e-6)
    assert graphs <= 5, graphs


@pytest.mark.parametrize("det", [False, True])
def test_deterministic_reaches_the_backends_backward(det, monkeypatch):
    """deterministic is a setting fixed at construction (replace() changes it) and every differentiable
    attention call of the layer passes it to the backend."""
    layer = _layer(deterministic=det)
    seen = []
    real = type(layer.backend).attention
    monkeypatch.setattr(type(layer.backend), "attention",
                        lambda self, q, k, v, causal, deterministic=False: seen.append(deterministic) or
                        real(self, q, k, v, causal, deterministic))
    x = torch.randn(2, 5, 16, requires_grad=True)
    layer(x).sum().backward()
    assert seen and all(s is det for s in seen)
    with pytest.raises(AttributeError, match="fixed when the layer is built"):
        layer.deterministic = not det
    assert layer.replace(deterministic=not det).deterministic is (not det)
