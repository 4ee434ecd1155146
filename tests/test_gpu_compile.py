"""torch.compile and torch.export of a model holding the layer on the GPU (the fused kernels as the
custom ops tpattn::attention and tpattn::attention_backward): no graph break, the compiled forward
and backward match eager, the exported graph holds one attention op, the ops pass opcheck."""

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
