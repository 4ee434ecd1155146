"""torch.compile and torch.export of a model holding the layer on the GPU (the fused kernels as the
custom ops tpattn::attention and tpattn::attention_backward; decoding's as tpattn::decode_append,
tpattn::decode_attention and tpattn::prefix_attention): no graph break, the compiled forward,
backward and decode steps match eager, the exported graph holds one attention op, the ops pass
opcheck."""

from __future__ import annotations

import pytest
import torch

from tpattn.errors import cupy_available
from tpattn.layer import TensorParallelAttention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not cupy_available(),
                                                  reason="needs a CUDA GPU and CuPy")]


class Block(torch.nn.Module):
    def __init__(self, backend="fused", H=8, d=64):
        super().__init__()
        torch.manual_seed(0)
        D = H * d
        self.lin = torch.nn.Linear(D, D, device="cuda", dtype=torch.float16)
        w = [torch.randn(D, D, device="cuda", dtype=torch.float16) / D ** 0.5 for _ in range(4)]
        self.attn = TensorParallelAttention(*w, heads=H, head_dim=d, backend=backend, causal=True, group=None,
                                            rope_theta=10000.0)

    def forward(self, x):
        return x + self.attn(self.lin(x))


@pytest.mark.parametrize("backend", ["fused", "naive"])
def test_compiled_model_matches_eager_without_a_graph_break(backend):
    import torch._dynamo as dynamo
    model = Block(backend)
    x = torch.randn(2, 200, 512, device="cuda", dtype=torch.float16)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            e = dynamo.explain(model)(x.clone().requires_grad_(grad))
        dynamo.reset()
        assert e.graph_break_count == 0, [str(b.reason)[:200] for b in e.break_reasons]
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model)(x)
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    dynamo.reset()
    model(x).float().square().mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.compile(model)(x).float().square().mean().backward()
    dynamo.reset()
    for n, p in model.named_parameters():
        err = (p.grad.float() - grads[n]).abs().max().item() / grads[n].abs().max().item()
        assert err < 2e-2, (n, err)


def test_export_sees_one_attention_op_and_the_ops_pass_opcheck():
    model = Block("fused")
    x = torch.randn(1, 256, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "tpattn" in str(n.target)]
    assert ops == ["tpattn.attention.default"], ops
    q = torch.randn(1, 8, 200, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(torch.ops.tpattn.attention.default, (q, k, v, True, "fused", False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


class Decoder(torch.nn.Module):
    """A model that decodes through the layer: x -> x + attn(lin(x), cache)."""

    def __init__(self, backend="fused", H=8, G=2, d=64):
        super().__init__()
        torch.manual_seed(0)
        D = H * d
        self.lin = torch.nn.Linear(D, D, device="cuda", dtype=torch.float16)
        w = [torch.randn(D, n, device="cuda", dtype=torch.float16) / D ** 0.5 for n in (D, G * d, G * d)]
        wo = torch.randn(D, D, device="cuda", dtype=torch.float16) / D ** 0.5
        self.attn = TensorParallelAttention(*w, wo, heads=H, head_dim=d, kv_heads=G, backend=backend, causal=True,
                                            group=None, rope_theta=10000.0)

    def forward(self, x, cache):
        return x + self.attn(self.lin(x), cache=cache)


@pytest.mark.parametrize("G", [8, 2])
def test_compiled_decode_matches_eager_without_a_graph_break(G):
    """A prefill into an empty cache, a prefill over the rows already there (tpattn::prefix_attention)
    and decode steps (tpattn::decode_append, tpattn::decode_attention): no graph break in any, the
    compiled outputs and caches match eager, and the steps compile once (the cache's length is
    read on the device), not once per step."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    model = Decoder(G=G)
    torch.manual_seed(1)
    x = torch.randn(2, 160, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        for rows in (x[:, :100], x[:, 100:101]):
            cache = model.attn.new_cache(2, 256)
            if rows.shape[1] == 1:
                model(x[:, :100], cache)
            e = dynamo.explain(model)(rows, cache)
            dynamo.reset()
            assert e.graph_break_count == 0, [str(b.reason)[:200] for b in e.break_reasons]
        eager, comp = model.attn.new_cache(2, 256), model.attn.new_cache(2, 256)
        compiled = torch.compile(model)
        counters.clear()
        pairs = [(model(x[:, :64], eager), compiled(x[:, :64], comp)),
                 (model(x[:, 64:150], eager), compiled(x[:, 64:150], comp))]
        for t in range(150, 160):
            pairs.append((model(x[:, t:t + 1], eager), compiled(x[:, t:t + 1], comp)))
        graphs = counters["stats"]["unique_graphs"]
        dynamo.reset()
    for i, (want, got) in enumerate(pairs):
        assert (got.float() - want.float()).abs().max().item() < 2e-2, i
    assert eager.length == comp.length == 160
    for a, b in ((eager.k, comp.k), (eager.v, comp.v)):  # (k's rotation in fp32: inductor may round it differently)
        assert (a[:, :, :160].float() - b[:, :, :160].float()).abs().max().item() < 1e-2
    assert graphs <= 4, graphs  # empty-cache prefill, prefill over rows, a step (and one recompile that makes L dynamic)


def test_decode_ops_pass_opcheck():
    from tpattn.attention import custom_ops  # noqa: F401  (registers the ops)
    model = Decoder(G=2)
    cache = model.attn.new_cache(2, 128)
    with torch.no_grad():
        model(torch.randn(2, 70, 512, device="cuda", dtype=torch.float16), cache)
    h, g, d = 8, 2, 64
    qkv = torch.randn(2, h + 2 * g, d, device="cuda", dtype=torch.float16)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.tpattn.decode_append.default,
                          (qkv, cache.k.clone(), cache.v.clone(), cache.pos, cache.cos, cache.sin, h, False), test_utils=tests)
    q = torch.randn(2, h, 1, d, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.tpattn.decode_attention.default, (q, cache.k, cache.v, cache.pos, cache.tickets),
                          test_utils=tests)
    q = torch.randn(2, h, 30, d, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.tpattn.prefix_attention.default,
                          (q, cache.k[:, :, :100], cache.v[:, :, :100], 70, "fused"), test_utils=tests)
