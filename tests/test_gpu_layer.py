"""GPU tests of the layer around the kernels (`pytest -m gpu`): tensor-core projections against the
fp32 path they replace, sequence parallelism and overlap over NCCL (2+ GPUs) and over gloo
sharing one GPU, and the CUDA graph of the whole layer."""

import json

import pytest
import torch

from conftest import tpattn
from tpattn.layer import TensorParallelAttention, _mm
from tpattn.weights import head_weights, layer_input

pytestmark = pytest.mark.gpu
SMALL = ["--seq-len", "1024", "--heads", "8", "--head-dim", "64"]


def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL between ranks (this machine has {torch.cuda.device_count()})")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_core_projection_with_fp32_result_matches_fp32_gemm(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(512, 1024, device="cuda", generator=g).to(dtype)
    b = (torch.randn(1024, 768, device="cuda", generator=g) / 32).to(dtype)
    y = _mm(a, b, torch.float32)
    assert y.dtype == torch.float32
    ref = a.double() @ b.double()
    fp32 = a.float() @ b.float()
    err = (y.double() - ref).abs().max().item()
    err32 = (fp32.double() - ref).abs().max().item()
    assert err <= 4 * err32 + 1e-6, (err, err32)  # one fp32 rounding, as the fp32 GEMM


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
    assert set(colls) == ({"allgather", "reducescatter"} if style[:1] == ["--sequence-parallel"] else {"allreduce"})
    assert all(c["busbw_GBps"] > 0 for c in colls.values())


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
