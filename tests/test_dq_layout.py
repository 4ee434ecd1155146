"""The five-product backward's dQ sum (kernels/fused_hopper_backward.cu) is laid out as the wgmma
accumulators are held; backward_check.dq_from_sum describes the layout (as the copy that undoes it).
Checked here on the CPU against the kernel's own description of where accumulator i of thread t lands,
element by element."""

import pytest
import torch

from backward_check import dq_from_sum


def kernel_layout(b, h, n, d):
    """dqa as the kernel writes it, for a known dQ: the value of (bh, row, col) is a unique number."""
    qt = -(-n // 64)
    want = torch.arange(b * h * qt * 64 * d, dtype=torch.float32).view(b * h, qt * 64, d)
    dqa = torch.empty(b * h, qt, d // 64, 8, 128, 4)
    for t in range(128):
        warp, lane = divmod(t, 32)
        for i in range(32):
            g, e = divmod(i, 4)
            row = 16 * warp + lane // 4 + 8 * (e >> 1)
            for p in range(d // 64):
                col = 64 * p + 8 * g + 2 * (lane % 4) + (e & 1)
                dqa[:, :, p, g, t, e] = want.view(b * h, qt, 64, d)[:, :, row, col]
    return dqa.reshape(-1), want.view(b, h, qt * 64, d)[:, :, :n]


@pytest.mark.parametrize("n,d", [(64, 128), (100, 64), (130, 128), (1, 64)])
def test_dq_from_sum_undoes_the_kernels_layout(n, d):
    dqa, want = kernel_layout(2, 3, n, d)
    dq = torch.empty(2, 3, n, d, dtype=torch.float64)
    dq_from_sum(dq, dqa)
    assert torch.equal(dq, want.double())
