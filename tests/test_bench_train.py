"""scripts/bench_train.py's plain PyTorch layer (QKV Linear, SDPA, output Linear; GQA by enable_gqa) is
the same function as tpattn's layer with the same weights, so the benchmark compares like with like;
checked on the CPU with SDPA's math backend. Without a GPU the script says so in one line."""

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend

from conftest import ROOT
from tpattn.layer import TensorParallelAttention
from tpattn.weights import head_weights, layer_input

sys.path.insert(0, str(ROOT / "scripts"))
from bench_train import Plain  # noqa: E402


@pytest.mark.parametrize("g", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_the_plain_layer_is_the_same_function(g, causal):
    H, d, B, N = 4, 16, 2, 9
    w = head_weights(range(H), H, d, 0, torch.float64, torch.device("cpu"), kv_heads=range(g))
    x = layer_input(B, N, H * d, 0, torch.float64, torch.device("cpu"))
    ours = TensorParallelAttention(**w, heads=H, kv_heads=g, head_dim=d, causal=causal, group=None)
    plain = Plain(w, H, causal, SDPBackend.MATH)
    assert plain.g == g
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ours(x), rtol=1e-10, atol=1e-10)


def test_without_a_gpu_it_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_train.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
