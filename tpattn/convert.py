"""The layer to and from full weights: from_full (and from torch.nn.Linear, MultiheadAttention and a
transformers LlamaAttention), and back: full_weights() and full_grads() assemble every rank's
slices into from_full's layout ("x @ W": wq [D, H*d], wk and wv [D, G*d], wo [H*d, D], biases).
tpattn/layer.py exposes them as the layer's classmethods and methods."""

from __future__ import annotations

import torch

from .comm import agree_build, resolve_group
from .errors import check_counts
from .sharding import Shard, check_context
from .weights import slice_heads

NAMES = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")


def from_full(cls, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None, *, heads: int, group="world", **kw):
    """Keep this rank's slice of full weights in "x @ W" layout (wq: [D, H*d], wk and wv: [D, G*d]
    for G K/V heads (G = H unless grouped-query), wo: [H*d, D]). Keyword arguments go to the
    constructor (uneven_heads=True: a world size that does not divide the heads). A bias given as
    None is not a parameter of the layer (nothing trains it)."""
    grp, rank, world = resolve_group(group)
    full = dict(wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo)
    try:  # every refusal before the constructor's: said on every rank, in the exchange it would join
        head_dim, kv_heads = check_full(full, heads)
        # rank r: heads as rank r // C of W / C, rows of ring rank r % C
        C = check_context(kw.get("context_parallel", 1), world, kw.get("sequence_parallel", False),
                          kw.get("output_collective", "auto"), kw.get("overlap", 1))
        rank, world = rank // C, max(1, world // C)
        if kw.get("kv_heads") not in (None, kv_heads):
            raise ValueError(f"kv_heads={kw['kv_heads']} but wk and wv have {kv_heads} heads of dim {head_dim}")
        shard = Shard.of(heads, kv_heads, world, rank, kw.get("uneven_heads", False))
        mine = slice_heads({k: t for k, t in full.items() if t is not None}, shard.head_range, head_dim,
                           shard.kv_head_range)
    except Exception as exc:  # noqa: BLE001
        agree_build(grp, None, exc)  # (raises exc)
        raise
    kw["kv_heads"] = kv_heads
    return cls(**mine, heads=heads, head_dim=head_dim, group=group, **kw)


def check_full(w: dict, heads) -> tuple[int, int]:
    """(head_dim, kv_heads) of full weights in from_full's layout, or one line naming the weight whose
    shape does not fit the others (a weight too large would otherwise be cut to the heads' slice and
    give wrong outputs silently)."""
    check_counts(heads=heads)
    for name, t in w.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None (got {type(t).__name__})")
    wq, wk = w["wq"], w["wk"]
    for name in ("wq", "wk", "wv", "wo"):
        if w[name] is None or w[name].dim() != 2:
            got = "None" if w[name] is None else f"shape {tuple(w[name].shape)}"
            raise ValueError(f"{name} must be a 2-D weight in \"x @ W\" layout (got {got}); wq [D, H*d], wk and wv "
                             "[D, G*d], wo [H*d, D]")
    D, hd = wq.shape
    if hd % heads or not hd:
        raise ValueError(f"wq has shape {tuple(wq.shape)}: its {hd} columns are not {heads} heads of a whole head dim; "
                         "give wq as [D, heads * head_dim] (x @ W layout: a torch Linear's weight.T)")
    d = hd // heads
    if wk.shape[0] != D or wk.shape[1] % d or not wk.shape[1]:
        raise ValueError(f"wk has shape {tuple(wk.shape)}, expected [{D}, G*{d}] for G K/V heads of dim {d} "
                         f"(wq {tuple(wq.shape)}: D = {D}, {heads} heads of dim {d})")
    g = wk.shape[1] // d
    want = dict(wv=(D, g * d), wo=(hd, D), bq=(hd,), bk=(g * d,), bv=(g * d,), bo=(D,))
    for name, shape in want.items():
        t = w[name]
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} (wq {tuple(wq.shape)}, wk "
                             f"{tuple(wk.shape)}: D = {D}, {heads} heads and {g} K/V heads of dim {d})")
    return d, g


def from_linears(cls, q_proj, k_proj, v_proj, o_proj, *, heads: int, **kw):
    """From four torch.nn.Linear layers (weights [out, in], y = x W^T + b); k_proj and v_proj
    may have fewer output features (G*d for G K/V heads: grouped-query attention)."""
    for name, lin in (("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj), ("o_proj", o_proj)):
        if not isinstance(lin, torch.nn.Linear):
            raise TypeError(f"{name} must be a torch.nn.Linear (got {type(lin).__name__})")
    b = (lambda lin: None if lin.bias is None else lin.bias.detach())
    return from_full(cls, q_proj.weight.detach().T, k_proj.weight.detach().T, v_proj.weight.detach().T,
                     o_proj.weight.detach().T, b(q_proj), b(k_proj), b(v_proj), b(o_proj), heads=heads, **kw)


def from_multihead_attention(cls, mha: torch.nn.MultiheadAttention, **kw):
    """From a torch.nn.MultiheadAttention (same embed dim for q, k and v; inputs batch-first)."""
    if not isinstance(mha, torch.nn.MultiheadAttention):
        raise TypeError(f"from_multihead_attention takes a torch.nn.MultiheadAttention (got {type(mha).__name__})")
    if not mha._qkv_same_embed_dim:
        raise ValueError("from_multihead_attention needs kdim == vdim == embed_dim")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn are not supported")
    if not mha.batch_first:  # the layer reads [B, N, D]; an MHA of the default layout is fed [N, B, D]
        raise ValueError("from_multihead_attention: the MultiheadAttention has batch_first=False (inputs [N, B, D]); "
                         "the layer reads [B, N, D]: build it with batch_first=True (the same weights) and give the "
                         "layer batch-first inputs")
    if mha.dropout:
        raise ValueError(f"from_multihead_attention: the MultiheadAttention has dropout={mha.dropout}, and the layer "
                         "has no attention dropout; set its dropout to 0 first (mha.dropout = 0.0)")
    w = mha.in_proj_weight.detach()
    e = mha.embed_dim
    bias = mha.in_proj_bias.detach() if mha.in_proj_bias is not None else None
    bq, bk, bv = (None, None, None) if bias is None else (bias[:e], bias[e:2 * e], bias[2 * e:])
    ob = mha.out_proj.bias.detach() if mha.out_proj.bias is not None else None
    return from_full(cls, w[:e].T, w[e:2 * e].T, w[2 * e:].T, mha.out_proj.weight.detach().T,
                     bq, bk, bv, ob, heads=mha.num_heads, **kw)


def from_hf_llama(cls, attn, **kw):
    """From a transformers LlamaAttention: its q/k/v/o projections, heads, K/V heads, head dim
    and rope theta (from its config), causal. Keyword arguments go to the constructor."""
    cfg = attn.config
    rp = getattr(cfg, "rope_parameters", None) or {}
    kind = rp.get("rope_type", getattr(cfg, "rope_scaling", None) and cfg.rope_scaling.get("rope_type"))
    if kind not in (None, "default"):
        raise ValueError(f"rope_type {kind!r} (scaled rotary positions) is not supported; only the default one")
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return from_linears(cls, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, heads=cfg.num_attention_heads,
                        kv_heads=cfg.num_key_value_heads, causal=True, rope_theta=theta, **kw)


def local_slices(layer, of: str = "data") -> dict[str, torch.Tensor | None]:
    """This rank's slices by from_full's names (wq, wk, wv, wo, bq, bk, bv, bo; None where the
    layer has no such bias): the parameters themselves (of="data") or their gradients (of="grad")."""
    h, g, d = layer.local_heads, layer.local_kv_heads, layer.head_dim
    bounds = (0, h * d, (h + g) * d, (h + 2 * g) * d)
    get = (lambda p: None if p is None else (p.detach() if of == "data" else p.grad))  # noqa: E731
    w = get(layer.wqkv)
    out = {n: (None if w is None else w[:, bounds[i]:bounds[i + 1]]) for i, n in enumerate(("wq", "wk", "wv"))}
    out["wo"], out["bo"] = get(layer.wo), get(layer.bo)
    packed = get(layer.bqkv)
    for i, n in enumerate(("bq", "bk", "bv")):
        if layer.bqkv is not None:
            out[n] = None if packed is None else packed[bounds[i]:bounds[i + 1]]
        else:
            out[n] = get(layer.biases.get(n))
    return out


def assemble(layer, of: str) -> dict[str, torch.Tensor | None]:
    """Every rank's slices (local_slices) gathered into the whole tensors of from_full's layout, on
    every rank (a collective: call it on every rank), in the layer's dtype for the weights and in
    fp32 (fp64 for an fp64 layer) for the gradients. A bias the layer does not have is None; so is a
    gradient nothing filled. K/V heads held by several ranks are copies: any one gives the whole."""
    d = layer.head_dim
    dt = layer.dtype if of == "data" else torch.promote_types(layer.dtype, torch.float32)
    mine = {n: (None if t is None else t.detach().to(dt).cpu()) for n, t in local_slices(layer, of).items()}
    everyone = layer.comm.all_gather_object((layer.shard, mine), label="gradgather" if of == "grad" else "gather")
    D, H, G = layer.model_dim, layer.heads, layer.kv_heads
    shapes = {"wq": (D, H * d), "wk": (D, G * d), "wv": (D, G * d), "wo": (H * d, D), "bq": (H * d,),
              "bk": (G * d,), "bv": (G * d,), "bo": (D,)}
    out: dict[str, torch.Tensor | None] = {n: None for n in NAMES}
    for shard, parts in everyone:
        hr, kr = shard.head_range, shard.kv_head_range
        span = {"wq": slice(hr.start * d, hr.stop * d), "bq": slice(hr.start * d, hr.stop * d),
                "wo": slice(hr.start * d, hr.stop * d), "bo": slice(None)}
        for n, t in parts.items():
            if t is None:
                continue
            if out[n] is None:
                out[n] = torch.zeros(shapes[n], dtype=dt)
            cols = span.get(n, slice(kr.start * d, kr.stop * d))
            if n == "wo":
                out[n][cols] = t
            else:
                out[n][..., cols] = t
    dev = layer.wqkv.device
    return {k: None if t is None else t.to(dev) for k, t in out.items()}
