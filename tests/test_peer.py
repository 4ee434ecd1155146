"""The one-shot all-reduce's launch on this CPU machine (the kernel itself runs in tests/test_gpu_layer.py):
the arguments that decide when a waiting kernel gives up."""

import torch

from tpattn import peer


def launched_timeouts(monkeypatch, world: int) -> list[int]:
    """The timeout_ns each rank's all_reduce passes to the kernel (launch captured, not run)."""
    got = []
    monkeypatch.setattr(peer, "launch", lambda source, name, device, grid, block, args: got.append(int(args[-1])))
    for rank in range(world):
        buf = peer.OneShotBuffers(64, torch.float32, torch.float32, torch.device("cpu"), rank, world)
        assert buf.exported[1] and "CUDA" in buf.exported[1]  # a CPU rank says why it cannot take part
        buf.table = torch.zeros(2 * world, dtype=torch.int64)  # as if open() had mapped every rank
        buf.all_reduce(torch.empty(4, 16))
    return got


def test_ranks_give_up_one_stagger_apart(monkeypatch):
    """Rank r's kernel stops waiting after ONESHOT_TIMEOUT_S + r * ONESHOT_STAGGER_S: ranks that share a
    GPU never trap at the same moment (two traps at once left a process's synchronize hanging)."""
    monkeypatch.setattr(peer, "ONESHOT_TIMEOUT_S", 5)
    got = launched_timeouts(monkeypatch, 4)
    assert got == [(5 + r * peer.ONESHOT_STAGGER_S) * 10**9 for r in range(4)]
    assert peer.ONESHOT_STAGGER_S > 0 and len(set(got)) == 4
