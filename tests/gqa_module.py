"""A grouped-query attention module with separate q, k, v, o projections (k and v: G*d outputs),
evaluated by repeating each K/V head for its query heads: the oracle of the mpirun API checks
(tests/mpi_gqa_check.py, tests/mpi_uneven_check.py), which import it from their own folder."""

import torch
import torch.nn.functional as F


class GQAModule(torch.nn.Module):
    def __init__(self, D, H, G):
        super().__init__()
        self.H, self.G, self.d = H, G, D // H
        self.q_proj, self.o_proj = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.k_proj, self.v_proj = torch.nn.Linear(D, G * self.d), torch.nn.Linear(D, G * self.d)

    def forward(self, x, causal):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.H, self.d).transpose(1, 2)
        k, v = (p(x).view(b, n, self.G, self.d).transpose(1, 2).repeat_interleave(self.H // self.G, 1)
                for p in (self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(b, n, -1))
