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


def test_host_table_counts_a_steps_python_functions():
    from bench_train import host_table
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def helper(t):
        return t * 2

    def step():
        helper(layer(x)).sum().backward()

    rows = host_table(step, list(layer.parameters()), steps=7)
    by_name = {r[0]: r for r in rows}
    mine = [r for name, r in by_name.items() if name.endswith("(helper)")]
    assert len(mine) == 1 and mine[0][1] == 1, "one call of helper per step"
    assert all(r[2] >= 0 and r[3] >= r[2] for r in rows)
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
