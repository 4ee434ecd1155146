"""Context parallelism (the ring): the layout and the block math on CPU, the refusals, and under
mpirun at C = 2, 3 and 4 (tests/mpi_ring_check.py) the layer against the single-process one."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import ROOT, mpirun_cmd, run
from tpattn.attention.ring import (RowsDq, block_sums, context_rows, merge, piece_backward, piece_forward, pieces,
                                  step_backward)
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


@pytest.mark.parametrize("C", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_the_pieces_are_exactly_what_each_query_row_sees(C, causal):
    """Over every pair of ring ranks, the pieces cover each (query, key) pair a query sees once, and
    no other (causal: key position <= query position)."""
    N = 4 * C
    n = N // C
    for c in range(C):
        pq = context_rows(N, C, c)
        seen = torch.zeros(n, N, dtype=torch.int64)
        for j in range(C):
            pk = context_rows(N, C, j)
            for q0, q1, k0, k1, diag in pieces(c, j, n, causal):
                block = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
                if diag:
                    assert q1 - q0 == k1 - k0
                    block = block.tril()
                seen[q0:q1, pk[k0:k1]] += block
        want = (torch.arange(N)[None, :] <= pq[:, None]) if causal else torch.ones(n, N, dtype=torch.bool)
        assert torch.equal(seen, want.long())


class EqualLengths:
    """A backend as the fused kernels are to the ring: it saves the logsumexp and takes only as many
    query rows as keys (asserted), with torch math inside."""
    saves_lse = True

    def forward_for_backward(self, q, k, v, causal):
        assert q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0
        return piece_forward(None, q, k, v, causal)

    def backward(self, q, k, v, o, lse, do, causal, deterministic=False):
        assert q.shape[2] == k.shape[2] and lse.is_contiguous()
        return piece_backward(None, q, k, v, o, lse, do, causal)


class SummingLikeTheKernels(EqualLengths):
    """EqualLengths with the fused backend's dQ sum over the ring's pieces (dq_sum, backward_summing,
    dq_of_sum), addressed as kernels/fused_hopper_backward.cu's hb_kv does: call head i's row r reads L
    and Dl at flat row i ldn + qoff + r of the sum's rows, and adds its dQ into 64-row tile
    i ceil(ldn / 64) + (qoff + r) / 64 of a sum that holds ceil(n / 64) tiles a head (each tile's
    inner order is the kernels' and does not matter here). Refuses what the fused backend refuses."""

    def __init__(self):
        self.calls = []

    def dq_sum(self, q, o, lse, do, deterministic=False):
        from tpattn.attention.fused import DqSum
        b, h, n, d = q.shape
        dl = (do * o).sum(-1)  # once, for all the rows
        tiles = torch.zeros(b * h * -(-n // 64), 64, d, dtype=q.dtype)
        return DqSum(lse.contiguous(), dl, tiles, tuple(q.shape), q.dtype)

    def backward_summing(self, q, k, v, do, causal, sums, ldn, qoff):
        from tpattn.attention.fused import summing_refusal
        b, h, n, d = q.shape
        self.calls.append((h, n, ldn, qoff))
        bad = summing_refusal(sums.shape, q.shape, ldn, qoff)  # what fused.backward_summing refuses
        if bad:
            raise ValueError(bad)
        heads = torch.arange(b * h)
        at = (heads[:, None] * ldn + qoff + torch.arange(n)[None]).view(b, h, n)
        lse, dl = sums.lse.reshape(-1)[at], sums.dl.reshape(-1)[at]
        g = k.shape[1]
        s = q.view(b, g, h // g, n, d) @ k.unsqueeze(2).transpose(-1, -2) / d ** 0.5
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - lse.view(b, g, h // g, n, 1))
        dof = do.view(b, g, h // g, n, d)
        dv = (p.transpose(-1, -2) @ dof).sum(2)
        ds = p * (dof @ v.unsqueeze(2).transpose(-1, -2) - dl.view(b, g, h // g, n, 1)) / d ** 0.5
        dk = (ds.transpose(-1, -2) @ q.view(b, g, h // g, n, d)).sum(2)
        dq = (ds @ k.unsqueeze(2)).reshape(b * h, n, d)
        ld_qt = -(-ldn // 64)
        for t in range(-(-n // 64)):
            rows = dq[:, 64 * t:64 * t + 64]
            sums.dqa[heads * ld_qt + qoff // 64 + t, :rows.shape[1]] += rows
        return dk, dv

    def dq_of_sum(self, sums):
        b, h, n, d = sums.shape
        return sums.dqa.view(b, h, -1, d)[:, :, :n].clone()


def _ring_in_one_process(q, k, v, do, C, causal, backend=None):
    """Every rank's rows of the ring's forward and backward, computed in one process from the pieces
    (tpattn/comm.py's loop without the passes): (o, dq, dk, dv) in sequence order."""
    B, h, N, d = q.shape
    n = N // C
    rows = [context_rows(N, C, r) for r in range(C)]
    outs = []
    for c in range(C):
        o = torch.zeros(B, h, n, d, dtype=q.dtype)
        lse = torch.full((B, h, n), float("-inf"), dtype=q.dtype)
        for j in range(C):
            for q0, q1, k0, k1, diag in pieces(c, j, n, causal):
                kj, vj = k[:, :, rows[j][k0:k1]], v[:, :, rows[j][k0:k1]]
                merge(o[:, :, q0:q1], lse[:, :, q0:q1], *piece_forward(backend, q[:, :, rows[c][q0:q1]], kj, vj, diag))
        outs.append((o, lse))
    o_all = torch.zeros_like(q)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    sums = [None] * C  # block j's dK, dV sums as they travel: made by the first rank, added to by the rest
    for c in range(C):
        o, lse = outs[c]
        o_all[:, :, rows[c]] = o
        dq_c = RowsDq(backend, q[:, :, rows[c]], o, lse, do[:, :, rows[c]], causal, False)
        for j in range(C):
            parts = step_backward(backend, q[:, :, rows[c]], k[:, :, rows[j]], v[:, :, rows[j]], o, lse,
                                  do[:, :, rows[c]], c, j, causal, False, dq_c)
            sums[j] = block_sums(parts, k[:, :, rows[j]], sums[j])
        dq[:, :, rows[c]] = dq_c.result()
    for j in range(C):
        dk[:, :, rows[j]], dv[:, :, rows[j]] = sums[j]
    return o_all, dq, dk, dv


def test_block_sums_are_new_with_zeros_past_the_parts_or_added_in_place():
    like = torch.zeros(1, 2, 6, 3, dtype=torch.float16)
    a, b = torch.randn(1, 2, 2, 3).half(), torch.randn(1, 2, 2, 3).half()
    dk, dv = block_sums([(2, 4, a, b)], like)
    assert dk.dtype == torch.float32 and dk.shape == like.shape
    assert torch.equal(dk[:, :, 2:4], a.float()) and torch.equal(dv[:, :, 2:4], b.float())
    assert not dk[:, :, :2].any() and not dk[:, :, 4:].any() and not dv[:, :, :2].any() and not dv[:, :, 4:].any()
    arrived = (torch.ones(1, 2, 6, 3), torch.ones(1, 2, 6, 3))
    got = block_sums([(0, 2, a, b), (4, 6, b, a)], like, arrived)
    assert got[0] is arrived[0] and torch.equal(got[0][:, :, :2], 1 + a.float()) and torch.equal(got[0][:, :, 4:], 1 + b.float())
    assert torch.equal(got[0][:, :, 2:4], torch.ones(1, 2, 2, 3))


@pytest.mark.parametrize("backend", [None, EqualLengths()], ids=["torch", "kernel-like"])
@pytest.mark.parametrize("C", [2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_pieces_merged_by_logsumexp_are_the_whole_attention_and_its_gradients(C, causal, backend):
    torch.manual_seed(0)
    B, h, g, N, d = 2, 4, 2, 12 * C, 8
    q = torch.randn(B, h, N, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, g, N, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    do = torch.randn(B, h, N, d, dtype=torch.float64)
    o, dq, dk, dv = _ring_in_one_process(q.detach(), k.detach(), v.detach(), do, C, causal, backend)
    s = q @ k.repeat_interleave(h // g, 1).transpose(-1, -2) / d ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(s, -1) @ v.repeat_interleave(h // g, 1)
    want.backward(do)
    assert torch.allclose(o, want.detach(), atol=1e-12)
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, ref, atol=1e-11)


@pytest.mark.parametrize("C", [2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_pieces_summing_dq_in_the_kernels_tiles_give_the_whole_gradients(C, causal):
    """The fused backend's way (Dl once, each piece's dQ added into the kernels' tiles at (ldn, qoff),
    dQ out once), emulated with the kernels' addressing: the ring's pieces land on their own rows."""
    torch.manual_seed(1)
    B, h, g, d = 1, 4, 2, 64
    N = 256 * C  # rank rows n = 256: the causal pieces start at row 128 and fold 2 heads of 128 rows
    q = torch.randn(B, h, N, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, g, N, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    do = torch.randn(B, h, N, d, dtype=torch.float64)
    backend = SummingLikeTheKernels()
    _, dq, dk, dv = _ring_in_one_process(q.detach(), k.detach(), v.detach(), do, C, causal, backend)
    s = q @ k.repeat_interleave(h // g, 1).transpose(-1, -2) / d ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(s, -1) @ v.repeat_interleave(h // g, 1)).backward(do)
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, ref, atol=1e-11)
    n = N // C
    want = {(h, n, n, 0)} | ({(2 * h, n // 2, n // 2, 0), (h, n // 2, n, n // 2)} if causal and C > 1 else set())
    assert set(backend.calls) == want  # every kind of piece went through the sum


def test_rows_not_on_the_kernels_tiles_add_each_pieces_dq_instead():
    """A causal ring whose rank rows are not a multiple of 128 does not use the kernels' sum (its pieces
    would start inside a 64-row tile): RowsDq adds each piece's dQ in fp32, and the gradients hold."""
    torch.manual_seed(2)
    C, B, h, g, d = 2, 1, 2, 1, 64
    N = 2 * 96
    q = torch.randn(B, h, N, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, g, N, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    do = torch.randn(B, h, N, d, dtype=torch.float64)
    backend = SummingLikeTheKernels()
    _, dq, _, _ = _ring_in_one_process(q.detach(), k.detach(), v.detach(), do, C, True, backend)
    assert backend.calls == []
    s = (q @ k.repeat_interleave(h // g, 1).transpose(-1, -2) / d ** 0.5).masked_fill(
        torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(s, -1) @ v.repeat_interleave(h // g, 1)).backward(do)
    assert torch.allclose(dq, q.grad, atol=1e-11)
    sums = backend.dq_sum(q[:, :, :96].detach(), q[:, :, :96].detach(), torch.zeros(B, h, 96, dtype=torch.float64),
                          q[:, :, :96].detach())
    with pytest.raises(ValueError, match="not tile-aligned"):  # rows 48.. of 96: inside a tile
        backend.backward_summing(q[:, :, 48:96].detach(), k[:, :, :48].detach(), v[:, :, :48].detach(),
                                 do[:, :, 48:96], False, sums, 96, 48)
    # 2 heads of 96 rows seen as 3 of 64: the sum pads each head to 2 tiles, so call head 1's rows would
    # straddle head 0's pad and head 1's first tile
    sums = backend.dq_sum(q[:, :, :96].detach(), q[:, :, :96].detach(), torch.zeros(B, h, 96, dtype=torch.float64),
                          q[:, :, :96].detach())
    with pytest.raises(ValueError, match="not tile-aligned"):
        backend.backward_summing(q[:, :, :96].detach().reshape(B, 3, 64, d), k[:, :, :64].detach(), v[:, :, :64].detach(),
                                 do[:, :, :96].reshape(B, 3, 64, d), False, sums, 64, 0)


def test_a_piece_of_more_query_rows_than_keys_is_seen_as_more_heads():
    """The kernels take equal lengths: 2m query rows against m keys run as 2h heads of m rows, each
    head's rows still reading its K/V head."""
    from tpattn.attention.ring import _by_rows
    q = torch.arange(2 * 3 * 8 * 4.0).view(2, 3, 8, 4)
    t = _by_rows(q, 4)
    assert t.shape == (2, 6, 4, 4) and torch.equal(t[:, 1], q[:, 0, 4:]) and torch.equal(t[:, 2], q[:, 1, :4])


def test_context_parallel_refusals():
    w = [torch.randn(16, 16) for _ in range(4)]
    with pytest.raises(ConfigError, match=r"context_parallel=2 does not divide the group's 1 ranks .* use context_parallel in \{1\}"):
        TensorParallelAttention(*w, heads=2, head_dim=8, group=None, context_parallel=2)
    for bad in (0, True, None, 1.5, "2"):  # a count, not something int() would round or turn into one
        with pytest.raises(ConfigError, match=rf"context_parallel must be a positive int \(got {bad!r}\); 1 turns"):
            TensorParallelAttention(*w, heads=2, head_dim=8, group=None, context_parallel=bad)
        with pytest.raises(ConfigError, match=rf"context_parallel must be a positive int \(got {bad!r}\)"):
            TensorParallelAttention.from_full(*w, heads=2, group=None, context_parallel=bad)
    with pytest.raises(ConfigError, match=r"overlap must be at least 1 chunk \(got 1.5\), a whole number"):
        TensorParallelAttention(*w, heads=2, head_dim=8, group=None, overlap=1.5)
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


CLI = ["--seq-len", "96", "--heads", "4", "--head-dim", "16", "--iters", "2", "--warmup", "1"]


@pytest.mark.parametrize("ranks,extra,says", [
    (3, ["--context-parallel", "2"], "--context-parallel 2 does not divide the world size 3 (rings of 2 ranks, the "
                                     "heads split over world / 2); use --context-parallel in {1, 3}"),
    (2, ["--context-parallel", "2", "--seq-len", "90"], "--seq-len must divide by 2 x 2 = 4 (got 90); use 88 or 92"),
    (2, ["--context-parallel", "2", "--sequence-parallel"], "--context-parallel with --sequence-parallel: both split"),
    (2, ["--context-parallel", "2", "--decode", "2", "--causal"], "--context-parallel with --decode: decoding is not a "
                                                                  "ring workload"),
    (2, ["--context-parallel", "2", "--overlap", "2"], "--context-parallel with --overlap"),
    (1, ["--context-parallel", "0"], "--context-parallel must be at least 1 (got 0)"),
])
def test_cli_context_parallel_refusals_are_one_line_on_every_rank(ranks, extra, says):
    from conftest import rank_lines, tpattn
    r = tpattn([*CLI, *extra], ranks=ranks if ranks > 1 else None, timeout=120)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    lines = rank_lines(r.stderr) if ranks > 1 else r.stderr.strip().splitlines()
    assert len(lines) == ranks and all(says in line for line in lines), r.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,C", [(2, 2), (4, 2)])
def test_cli_context_parallel_training_step_passes_and_reports_the_ring(ranks, C, tmp_path):
    """python -m tpattn --context-parallel C --backward: x.grad and the weights' gradients against the
    single-process layer and float64; the report's style, the ring's passes and their bytes (what one
    rank sends in a call), and K/V per rank at N / C."""
    import json
    from conftest import tpattn
    out = tmp_path / "r.json"
    r = tpattn([*CLI, "--context-parallel", str(C), "--causal", "--backward", "--kv-heads", "2", "--json", str(out)],
               ranks=ranks, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "PASS" and rep["checks"]["grads_vs_float64"]["pass"]
    assert rep["config"]["style"].startswith(f"context-parallel (rings of {C} ranks, heads over {ranks // C})")
    colls = rep["collectives"]
    n, g, d = 96 // C, 2 // (ranks // C), 16
    assert colls["ring"]["bytes"] == (C - 1) * 2 * n * g * d * 2 and colls["ring"]["ranks"] == C
    assert colls["bwd_ring_grads"]["bytes"] == C * 2 * n * g * d * 4
    assert rep["memory"]["K_V_bytes_per_rank"] == 2 * g * n * d * 2
    assert rep["passes"]["ring"]["median"] > 0 and rep["passes"]["attention"]["median"] > 0
    # the text: the ring's passes are no transfer times, and they are not said to run in line
    assert "ring pass (K/V blocks)" in r.stdout and "no bandwidth from it" in r.stdout, r.stdout
    assert "the ring's passes travel behind the blocks' attention" in r.stdout and "none hidden" not in r.stdout
    # K/V heads over the heads' ranks (W / C), each ring rank holding N / C of their rows
    assert (f"K/V heads: 2 for 4 query heads (2 each), split over {ranks // C} rank(s) (each of the {C} ranks of a "
            f"ring holds {96 // C} of its 96 rows)") in r.stdout, r.stdout
