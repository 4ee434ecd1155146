"""The tensor-parallel attention layer: the only module that calls a collective.

    x [B, N, D]                      replicated on every rank
    column-parallel Q/K/V projection rank r owns the columns of heads [r*h, (r+1)*h)
    local attention                  a backend from tpattn.attention (naive CUDA, reference, ...)
    row-parallel output projection   rank r owns the rows of W_o for its heads
    all_reduce(SUM)                  partial [B, N, D] summed over ranks; b_o added once, after it
    y [B, N, D]                      identical on every rank
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from . import faults
from .attention import Backend, get_backend
from .sharding import check_divisible, head_range
from .timing import section
from .weights import slice_heads

WORLD = "world"  # group=WORLD: the default process group if one is initialized, else none


def _linear(x2d: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """x2d @ w (+ b), accumulated in float32 and rounded once to out_dtype."""
    if x2d.is_cuda and x2d.dtype == w.dtype == out_dtype:
        return torch.addmm(b, x2d, w) if b is not None else torch.mm(x2d, w)
    y = torch.mm(x2d.float(), w.float())  # CPU half matmuls, and float32 partials
    if b is not None:
        y += b.float()
    return y.to(out_dtype)


class TensorParallelAttention(torch.nn.Module):
    """Multi-head attention whose heads are split over the ranks of `group`.

    Weights are this rank's slices in "x @ W" layout: wq/wk/wv [D, h*d], wo [h*d, D], biases
    bq/bk/bv [h*d] and bo [D] (b_o is added once, after the all-reduce). Build it from full
    matrices with from_full(), from_multihead_attention() or from_linears().
    """

    def __init__(self, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None, *, heads: int, head_dim: int,
                 backend: str | Backend = "reference", causal: bool = False, group=WORLD,
                 reduce_dtype: str = "fp32", head_chunk: int | None = None):
        super().__init__()
        self.group, self.rank, self.world = _resolve_group(group)
        err = check_divisible(heads, self.world)
        if err:
            raise ValueError(err)
        self.heads, self.head_dim = heads, head_dim
        self.local_heads = heads // self.world
        self.model_dim = wq.shape[0]
        hd = self.local_heads * head_dim
        for name, t, shape in (("wq", wq, (self.model_dim, hd)), ("wk", wk, (self.model_dim, hd)),
                               ("wv", wv, (self.model_dim, hd)), ("wo", wo, (hd, self.model_dim))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for rank {self.rank} "
                                 f"of {self.world} ({self.local_heads} heads of dim {head_dim})")
        if reduce_dtype not in ("fp32", "model"):
            raise ValueError(f"reduce_dtype must be 'fp32' or 'model' (got {reduce_dtype!r})")
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.causal = causal
        self.reduce_dtype = reduce_dtype
        self.head_chunk = head_chunk or self.local_heads
        self.dtype = wq.dtype
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.bq, self.bk, self.bv, self.bo = bq, bk, bv, bo
        # float32 partials (the article's choice) multiply by a float32 copy of W_o, made once.
        self.wo_reduce = wo.float() if reduce_dtype == "fp32" else wo

    # ---- construction from full weights -------------------------------------------------------

    @classmethod
    def from_full(cls, wq, wk, wv, wo, bq=None, bk=None, bv=None, bo=None, *, heads: int, group=WORLD,
                  **kw) -> "TensorParallelAttention":
        """Keep this rank's slice of full weights in "x @ W" layout (wq: [D, H*d], wo: [H*d, D])."""
        _, rank, world = _resolve_group(group)
        head_dim = wq.shape[1] // heads
        full = {k: t for k, t in dict(wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, bo=bo).items()
                if t is not None}
        mine = slice_heads(full, head_range(heads, world, rank), head_dim)
        return cls(**mine, heads=heads, head_dim=head_dim, group=group, **kw)

    @classmethod
    def from_linears(cls, q_proj, k_proj, v_proj, o_proj, *, heads: int, **kw) -> "TensorParallelAttention":
        """From four torch.nn.Linear layers (weights [out, in], y = x W^T + b)."""
        b = (lambda lin: None if lin.bias is None else lin.bias.detach())
        return cls.from_full(q_proj.weight.detach().T, k_proj.weight.detach().T, v_proj.weight.detach().T,
                             o_proj.weight.detach().T, b(q_proj), b(k_proj), b(v_proj), b(o_proj),
                             heads=heads, **kw)

    @classmethod
    def from_multihead_attention(cls, mha: torch.nn.MultiheadAttention, **kw) -> "TensorParallelAttention":
        """From a torch.nn.MultiheadAttention (same embed dim for q, k and v; inputs batch-first)."""
        if not mha._qkv_same_embed_dim:
            raise ValueError("from_multihead_attention needs kdim == vdim == embed_dim")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        w = mha.in_proj_weight.detach()
        e = mha.embed_dim
        bias = mha.in_proj_bias.detach() if mha.in_proj_bias is not None else None
        bq, bk, bv = (None, None, None) if bias is None else (bias[:e], bias[e:2 * e], bias[2 * e:])
        ob = mha.out_proj.bias.detach() if mha.out_proj.bias is not None else None
        return cls.from_full(w[:e].T, w[e:2 * e].T, w[2 * e:].T, mha.out_proj.weight.detach().T,
                             bq, bk, bv, ob, heads=mha.num_heads, **kw)

    # ---- forward -----------------------------------------------------------------------------

    def partial_nbytes(self, batch: int, seq_len: int) -> int:
        """Bytes of the partial output that the all-reduce sums."""
        size = 4 if self.reduce_dtype == "fp32" else torch.empty((), dtype=self.dtype).element_size()
        return batch * seq_len * self.model_dim * size

    def forward(self, x: torch.Tensor, timer=None) -> torch.Tensor:
        B, N, D = x.shape
        if D != self.model_dim:
            raise ValueError(f"input has model dim {D}, the layer expects {self.model_dim}")
        h, d = self.local_heads, self.head_dim
        x2d = x.reshape(B * N, D)
        faults.maybe_fail(self.rank, "forward")
        with section(timer, "qkv_proj"):
            q, k, v = (_linear(x2d, w, b, self.dtype).view(B, N, h, d).transpose(1, 2).contiguous()
                       for w, b in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
        o = torch.empty_like(q)
        for h0 in range(0, h, self.head_chunk):
            sl = slice(h0, min(h, h0 + self.head_chunk))
            o[:, sl] = self.backend.forward(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(),
                                            self.causal, timer)
        part_dtype = torch.float32 if self.reduce_dtype == "fp32" else self.dtype
        with section(timer, "out_proj"):
            partial = _linear(o.transpose(1, 2).reshape(B * N, h * d), self.wo_reduce, None, part_dtype)
        if self.group is not None:
            with section(timer, "allreduce"):
                if faults.maybe_fail(self.rank, "allreduce") != "skip":
                    try:
                        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
                    except RuntimeError as exc:
                        raise CollectiveError(f"all-reduce over {self.world} ranks failed ({_first_line(exc)}): "
                                              "a rank died, hangs or never joined it") from None
        if self.bo is not None:
            partial += self.bo.to(part_dtype)
        return partial.to(self.dtype).view(B, N, D)


class CollectiveError(RuntimeError):
    pass


def _first_line(exc: BaseException) -> str:
    """The useful part of a backend's error: no source paths, one line, bounded."""
    msg = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", str(exc)).strip().splitlines()
    first = msg[0].split(". ")[0] if msg else type(exc).__name__
    return first[:160]


def _resolve_group(group):
    """(group, rank, world): WORLD means the default group if torch.distributed is initialized."""
    if group == WORLD:
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if group is None:
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)
