"""Deterministic weights and input: any rank can build any head's slice, and the same seed gives
the same numbers whatever the world size.

Layout is "x @ W": W_q, W_k, W_v are [D, H*d] (head h owns columns h*d .. (h+1)*d), W_o is
[H*d, D] (head h owns rows h*d .. (h+1)*d). Each head's block comes from its own generator, so
a rank generates only its own heads; b_o and x are shared by all ranks.
"""

from __future__ import annotations

import hashlib
import math

import torch


def _generator(seed: int, tag: str, index: int = 0) -> torch.Generator:
    digest = hashlib.sha256(f"tpattn/{seed}/{tag}/{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _randn(shape, seed: int, tag: str, index: int = 0, std: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, tag, index), dtype=torch.float32) * std


def head_weights(heads: range, n_heads: int, head_dim: int, seed: int, dtype, device) -> dict:
    """Q/K/V column blocks, their biases, and W_o row blocks for the given heads; plus b_o."""
    D = n_heads * head_dim
    parts = {name: [] for name in ("wq", "wk", "wv", "bq", "bk", "bv", "wo")}
    for h in heads:
        for name in ("wq", "wk", "wv"):
            parts[name].append(_randn((D, head_dim), seed, name, h, std=1.0 / math.sqrt(D)))
        for name in ("bq", "bk", "bv"):
            parts[name].append(_randn((head_dim,), seed, name, h, std=0.1))
        parts["wo"].append(_randn((head_dim, D), seed, "wo", h, std=1.0 / math.sqrt(D)))
    out = {name: torch.cat(blocks, dim=0 if name == "wo" else -1) for name, blocks in parts.items()}
    out["bo"] = _randn((D,), seed, "bo", std=0.1)
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def layer_input(batch: int, seq_len: int, model_dim: int, seed: int, dtype, device) -> torch.Tensor:
    return _randn((batch, seq_len, model_dim), seed, "x").to(device=device, dtype=dtype)
