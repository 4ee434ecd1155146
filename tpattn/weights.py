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

from .sharding import head_columns


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


LOAD_KEYS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "x")


def load_inputs(path: str, heads: int, head_dim: int, batch: int, seq_len: int, dtype) -> dict:
    """Full weights (and optionally x) from a torch.save'd dict, checked: shapes, and no NaN or Inf
    in the storage dtype. Keys: wq, wk, wv [D, H*d] and wo [H*d, D] ("x @ W" layout), optional
    bq, bk, bv [H*d], bo [D], x [B, N, D]. Raises ConfigError with a one-line fix."""
    from .config import ConfigError

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line answer
        raise ConfigError(f"--load {path}: cannot read it ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
                          "give a file written by torch.save({'wq': ..., ...})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"--load {path}: expected a dict of tensors, found {type(obj).__name__}")
    D = heads * head_dim
    shapes = {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D), "bq": (D,), "bk": (D,), "bv": (D,),
              "bo": (D,), "x": (batch, seq_len, D)}
    missing = [k for k in ("wq", "wk", "wv", "wo") if k not in obj]
    if missing:
        raise ConfigError(f"--load {path}: missing {', '.join(missing)}; it needs wq, wk, wv, wo "
                          "(optional bq, bk, bv, bo, x)")
    out = {}
    for k in LOAD_KEYS:
        if k not in obj:
            continue
        t = obj[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[k]:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConfigError(f"--load {path}: {k} has shape {got}, expected {shapes[k]} for --heads {heads} "
                              f"--head-dim {head_dim} --batch {batch} --seq-len {seq_len}")
        bad = (~torch.isfinite(t.float())).sum().item()
        if bad:
            raise ConfigError(f"--load {path}: {k} has {bad} NaN/Inf value(s); fix the input before running")
        cast = t.to(dtype)
        bad = (~torch.isfinite(cast)).sum().item()
        if bad:
            raise ConfigError(f"--load {path}: {k} has {bad} value(s) beyond the range of {dtype}; "
                              "scale them or use --dtype fp32 or bf16")
        out[k] = cast
    return out


def slice_heads(full: dict, heads: range, head_dim: int) -> dict:
    """This rank's Q/K/V columns, their biases and W_o rows from full "x @ W" weights."""
    cols = head_columns(heads, head_dim)
    out = {}
    for k, t in full.items():
        if k in ("wq", "wk", "wv", "bq", "bk", "bv"):
            out[k] = t[..., cols].contiguous()
        elif k == "wo":
            out[k] = t[cols].contiguous()
        elif k == "bo":
            out[k] = t
    return out
