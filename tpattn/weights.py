"""Deterministic weights and input: any rank can build any head's slice, and the same seed gives
the same numbers whatever the world size.

Layout is "x @ W": W_q is [D, H*d] (head h owns columns h*d .. (h+1)*d), W_k and W_v are
[D, G*d] for G K/V heads (G = H: multi-head attention; fewer: grouped-query attention, K/V head
j owning columns j*d .. (j+1)*d), W_o is [H*d, D] (head h owns rows h*d .. (h+1)*d). Each head's
block comes from its own generator, so a rank generates only its own heads (and K/V heads); b_o and
x are shared by all ranks.
"""

from __future__ import annotations

import hashlib
import math

import torch

from .errors import FlagError
from .sharding import head_columns


def _generator(seed: int, tag: str, index: int = 0) -> torch.Generator:
    digest = hashlib.sha256(f"tpattn/{seed}/{tag}/{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _randn(shape, seed: int, tag: str, index: int = 0, std: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, tag, index), dtype=torch.float32) * std


def head_weights(heads: range, n_heads: int, head_dim: int, seed: int, dtype, device,
                 kv_heads: range | None = None) -> dict:
    """Q column blocks and W_o row blocks of the given query heads, K/V column blocks of the given
    K/V heads (default: the same heads, multi-head attention), their biases; plus b_o. Head h's
    block is the same numbers whichever heads are asked for, and K/V head j's too."""
    D = n_heads * head_dim
    kv_heads = heads if kv_heads is None else kv_heads
    parts = {name: [] for name in ("wq", "wk", "wv", "bq", "bk", "bv", "wo")}
    for names, idx in ((("q",), heads), (("k", "v"), kv_heads)):
        for h in idx:
            for n in names:
                parts["w" + n].append(_randn((D, head_dim), seed, "w" + n, h, std=1.0 / math.sqrt(D)))
                parts["b" + n].append(_randn((head_dim,), seed, "b" + n, h, std=0.1))
    for h in heads:
        parts["wo"].append(_randn((head_dim, D), seed, "wo", h, std=1.0 / math.sqrt(D)))
    out = {name: torch.cat(blocks, dim=0 if name == "wo" else -1) for name, blocks in parts.items()}
    out["bo"] = _randn((D,), seed, "bo", std=0.1)
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def layer_input(batch: int, seq_len: int, model_dim: int, seed: int, dtype, device) -> torch.Tensor:
    return _randn((batch, seq_len, model_dim), seed, "x").to(device=device, dtype=dtype)


LOAD_KEYS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "x")


def load_inputs(path: str, heads: int, head_dim: int, batch: int, seq_len: int, dtype,
                kv_heads: int | None = None) -> dict:
    """Full weights (and optionally x) from a torch.save'd dict, checked: shapes, and no NaN or Inf
    in the storage dtype. Keys: wq [D, H*d], wk, wv [D, G*d] and wo [H*d, D] ("x @ W" layout; G =
    kv_heads, default H), optional bq [H*d], bk, bv [G*d], bo [D], x [B, N, D]. Raises ConfigError
    with a one-line fix."""

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line answer
        why = (str(exc).splitlines() or [""])[0][:120]
        raise FlagError(f"--load {path}: cannot read it ({type(exc).__name__}{': ' + why if why else ''}); "
                        "give a file written by torch.save({'wq': ..., ...})") from None
    if not isinstance(obj, dict):
        raise FlagError(f"--load {path}: expected a dict of tensors, found {type(obj).__name__}")
    D = heads * head_dim
    G = heads if kv_heads is None else kv_heads
    kv = G * head_dim
    shapes = {"wq": (D, D), "wk": (D, kv), "wv": (D, kv), "wo": (D, D), "bq": (D,), "bk": (kv,), "bv": (kv,),
              "bo": (D,), "x": (batch, seq_len, D)}
    missing = [k for k in ("wq", "wk", "wv", "wo") if k not in obj]
    if missing:
        raise FlagError(f"--load {path}: missing {', '.join(missing)}; it needs wq, wk, wv, wo "
                          "(optional bq, bk, bv, bo, x)")
    out = {}
    for k in LOAD_KEYS:
        if k not in obj:
            continue
        t = obj[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[k]:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            kvh = f" --kv-heads {G}" if G != heads else ""
            raise FlagError(f"--load {path}: {k} has shape {got}, expected {shapes[k]} for --heads {heads}{kvh} "
                              f"--head-dim {head_dim} --batch {batch} --seq-len {seq_len}")
        if t.layout != torch.strided or t.is_meta or t.is_complex() or not (t.is_floating_point() or t.dtype in (
                torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
            kind = ("meta" if t.is_meta else str(t.layout).replace("torch.", "") if t.layout != torch.strided
                    else str(t.dtype).replace("torch.", ""))
            raise FlagError(f"--load {path}: {k} is a {kind} tensor; save dense real tensors (t.to_dense(), "
                            "t.real, or float values)")
        bad = (~torch.isfinite(t.float())).sum().item()
        if bad:
            raise FlagError(f"--load {path}: {k} has {bad} NaN/Inf value(s); fix the input before running")
        cast = t.to(dtype)
        bad = (~torch.isfinite(cast)).sum().item()
        if bad:
            raise FlagError(f"--load {path}: {k} has {bad} value(s) beyond the range of {dtype}; "
                              "scale them or use --dtype fp32 or bf16")
        out[k] = cast
    return out


def slice_heads(full: dict, heads: range, head_dim: int, kv_heads: range | None = None) -> dict:
    """This rank's Q columns and W_o rows (query heads `heads`), its K/V columns (K/V heads
    `kv_heads`, default the same heads) and their biases from full "x @ W" weights."""
    cols = head_columns(heads, head_dim)
    kv_cols = cols if kv_heads is None else head_columns(kv_heads, head_dim)
    out = {}
    for k, t in full.items():
        if k in ("wq", "bq"):
            out[k] = t[..., cols].contiguous()
        elif k in ("wk", "wv", "bk", "bv"):
            out[k] = t[..., kv_cols].contiguous()
        elif k == "wo":
            out[k] = t[cols].contiguous()
        elif k == "bo":
            out[k] = t
    return out
