"""Training through the tensor-parallel layer on the GPU (`pytest -m gpu`): tests/mpi_train_check.py under
a real mpirun with the GPU backends, x.grad and full_grads() against float64 autograd from the same
rounded weights, head-parallel and sequence-parallel, causal, GQA with split and replicated K/V heads,
uneven heads, overlap on and off, two backward calls accumulating. Over gloo the ranks share one GPU
(the collectives' logic); over NCCL each rank has its own GPU (2 GPUs or more)."""

import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run
from tpattn.attention.triton_fused import triton_available

pytestmark = pytest.mark.gpu
CHECK = str(ROOT / "tests" / "mpi_train_check.py")


def backend_ready(backend: str) -> None:
    if backend == "triton" and not triton_available():
        pytest.skip("--kernel triton needs the triton package")


@pytest.mark.parametrize("world,ran", [(1, 26), (2, 26), (3, 2), (4, 25)])
@pytest.mark.parametrize("backend,dtype", [("fused", "fp16"), ("fused", "bf16"), ("naive", "fp16"), ("triton", "fp16")])
def test_layer_gradients_over_gloo_sharing_one_gpu(world, ran, backend, dtype):
    backend_ready(backend)
    r = run(mpirun_cmd(world) + [sys.executable, CHECK, backend, dtype, "gloo"], timeout=600, CUDA_VISIBLE_DEVICES="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("TRAIN PASS") == world, r.stdout + r.stderr
    assert f"ran {ran} of 26 ({backend}, {dtype}, cuda)" in r.stdout


@pytest.mark.parametrize("world,ran", [(2, 26), (4, 25), (8, 24)])  # (8: the layers have 8 heads there)
@pytest.mark.parametrize("backend", ["fused", "naive"])
def test_layer_gradients_over_nccl_one_gpu_a_rank(backend, world, ran):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs for NCCL between {world} ranks (this machine has {torch.cuda.device_count()})")
    r = run(mpirun_cmd(world) + [sys.executable, CHECK, backend, "fp16", "nccl"], timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("TRAIN PASS") == world, r.stdout + r.stderr
    assert f"ran {ran} of 26 ({backend}, fp16, cuda)" in r.stdout


def _layer_and_step(deterministic: bool, causal: bool, kv_heads: int, sequence_parallel=False):
    from tpattn.layer import TensorParallelAttention
    from tpattn.weights import head_weights, layer_input
    H, G, d, N, B = 8, kv_heads, 64, 384, 2
    dev, dt = torch.device("cuda"), torch.float16
    w = head_weights(range(H), H, d, 3, dt, dev, kv_heads=range(G))
    layer = TensorParallelAttention(**w, heads=H, kv_heads=G, head_dim=d, backend="fused", causal=causal, group=None,
                                    deterministic=deterministic)
    return layer, layer_input(B, N, H * d, 3, dt, dev), layer_input(B, N, H * d, 4, dt, dev)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("causal,kv_heads", [(False, 8), (True, 2)])
def test_graphed_training_step_replays_the_eager_step(deterministic, causal, kv_heads):
    """layer.graphed(x, dy=dy): forward and backward in one CUDA graph. Each replay's y, x.grad and
    parameter gradients are the eager step's (the same bits with deterministic=True; the five-product
    dQ adds arrive in any order, so within rounding otherwise), on new inputs copied in place, and a
    gradient set to None between replays comes back."""
    layer, x0, dy0 = _layer_and_step(deterministic, causal, kv_heads)
    x1, dy1 = x0.flip(1).contiguous(), dy0.flip(1).contiguous()

    def eager(x, dy):
        for p in layer.parameters():
            p.grad = None
        xl = x.clone().requires_grad_(True)
        y = layer(xl)
        y.backward(dy)
        return y.detach(), xl.grad, [p.grad.clone() for p in layer.parameters()]
    want = [eager(x0, dy0), eager(x1, dy1)]
    xs, dys = x0.clone().requires_grad_(True), dy0.clone()
    replay = layer.graphed(xs, dy=dys)
    for i, (x, dy) in enumerate([(x0, dy0), (x1, dy1), (x0, dy0)]):
        with torch.no_grad():
            xs.copy_(x)
        dys.copy_(dy)
        if i == 2:
            for p in layer.parameters():
                p.grad = None
        y = replay()
        torch.cuda.synchronize()
        wy, wdx, wg = want[i % 2]
        got = [y, xs.grad, *(p.grad for p in layer.parameters())]
        for a, b in zip(got, [wy, wdx, *wg]):
            assert a is not None and a.shape == b.shape
            if deterministic:
                assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())
            else:
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


def test_cli_backward_with_cuda_graph_passes(tmp_path):
    """python -m tpattn --backward --cuda-graph: the step in one graph, its gradients checked."""
    import json
    out = tmp_path / "r.json"
    r = run([sys.executable, "-m", "tpattn", "--kernel", "fused", "--backward", "--cuda-graph", "--causal",
             "--seq-len", "512", "--heads", "8", "--head-dim", "64", "--json", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["checks"]["grads_vs_float64"]["pass"]
    assert rep["passes"]["total"]["median"] > 0
