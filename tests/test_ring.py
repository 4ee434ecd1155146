"""Context parallelism (the ring): the layout and the block math on CPU, the refusals, and under
mpirun at C = 2, 3 and 4 (tests/mpi_ring_check.py) the layer against the single-process one."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run
from tpattn.attention.ring import block_forward, context_rows, merge
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention


def test_the_zigzag_layout_gives_every_rank_an_early_and_a_late_chunk():
    assert context_rows(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_rows(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    rows = torch.cat([context_rows(24, 3, r) for r in range(3)])
    assert sorted(rows.tolist()) == list(range(24))
    # causal work per rank (keys each rank's rows see): the same on every rank
    work = [sum(p + 1 for p in context_rows(24, 3, r).tolist()) for r in range(3)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("causal", [True, False])
def test_blocks_merged_by_logsumexp_are_the_whole_attention(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 12, 8, dtype=torch.float64), torch.randn(2, 2, 12, 8, dtype=torch.float64)
    pos_q, pos_k = torch.tensor([0, 1, 2, 9, 10, 11]), torch.arange(12)
    o, lse = block_forward(q, k, v, pos_q, pos_k, causal)
    part, plse = block_forward(q, k[:, :, :5], v[:, :, :5], pos_q, pos_k[:5], causal)
    o2, lse2 = block_forward(q, k[:, :, 5:], v[:, :, 5:], pos_q, pos_k[5:], causal)  # rows 0-2 see none of it
    if causal:
        assert torch.isinf(lse2[..., :3]).all()
    merge(part, plse, o2, lse2)
    assert torch.allclose(part, o, atol=1e-12) and torch.allclose(plse, lse, atol=1e-12)
    kk = k.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) / 8 ** 0.5
    if causal:
        s = s.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
    assert torch.allclose(o, torch.softmax(s, -1) @ v.repeat_interleave(2, 1), atol=1e-12)


def test_context_parallel_refusals():
    w = [torch.randn(16, 16) for _ in range(4)]
    with pytest.raises(ConfigError, match=r"context_parallel=2 does not divide the group's 1 ranks .* use context_parallel in \{1\}"):
        TensorParallelAttention(*w, heads=2, head_dim=8, group=None, context_parallel=2)
    with pytest.raises(ConfigError, match="context_parallel must be at least 1"):
        TensorParallelAttention(*w, heads=2, head_dim=8, group=None, context_parallel=0)
    layer = TensorParallelAttention(*w, heads=2, head_dim=8, group=None)
    assert layer.context_parallel == 1 and layer.ring is None
    with pytest.raises(AttributeError, match="layer.context_parallel is fixed"):
        layer.context_parallel = 2


@pytest.mark.mpi
def test_ring_against_the_single_process_layer_on_two_three_and_four_ranks():
    """At 2, 3 and 4 ranks one ring over all of them; at 4 also rings of 2 beside heads over 2."""
    for n in (2, 3, 4):
        r = run(mpirun_cmd(n) + [sys.executable, str(ROOT / "tests" / "mpi_ring_check.py")], timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("RING PASS") == n, r.stdout + r.stderr
