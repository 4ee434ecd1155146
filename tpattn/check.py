"""Verification: a float64 reference of the whole layer (on sampled rows where the whole is too
big), and the comparison metric with its stated tolerances."""

from __future__ import annotations

import math

import torch

# max |y - ref| / rms(ref). Against float64 the error is the storage dtype's rounding of q, k, v,
# S, P, O and y; against the single-process baseline only the order of sums differs (and each
# element may differ by an epsilon relative to its size, see compare()).
TOL_FLOAT64 = {"fp16": 2e-2, "bf16": 1e-1, "fp32": 1e-4}
TOL_BASELINE = {"fp16": 1e-2, "bf16": 5e-2, "fp32": 1e-5}
# --dtype fp8 against float64 and against the fp16 layer: the RMS error over rms(ref), FP8's own metric
# (e4m3's three mantissa bits give 2-5 % at the CLI's shapes; a causal layer's first rows, which
# average few values, stand out in a max-error metric)
TOL_FP8_RMS = 1e-1
MAX_ROWS = 64


def sample_rows(n: int, limit: int = MAX_ROWS) -> torch.Tensor:
    """All rows when n <= limit, else `limit` rows evenly spread, first and last included."""
    if n <= limit:
        return torch.arange(n)
    return torch.linspace(0, n - 1, limit).round().long().unique()


def layer_float64(x, w: dict, heads: int, causal: bool, rows: torch.Tensor) -> torch.Tensor:
    """y[:, rows] of the full layer in float64 from the (already rounded) weights and input. W_k
    and W_v may have fewer heads (grouped-query attention): each is repeated for its query heads."""
    dev = x.device
    x64 = x.to(dev, torch.float64)
    w64 = {k: v.to(dev, torch.float64) for k, v in w.items()}
    B, N, D = x64.shape
    d = w64["wq"].shape[1] // heads
    rows = rows.to(dev)

    kv_heads = w64["wk"].shape[1] // d

    def proj(t, name, n_heads):
        y = t @ w64["w" + name]
        if "b" + name in w64:
            y = y + w64["b" + name]
        return y.view(t.shape[0], t.shape[1], n_heads, d).transpose(1, 2)

    q = proj(x64[:, rows], "q", heads)               # [B, H, r, d]
    k, v = proj(x64, "k", kv_heads), proj(x64, "v", kv_heads)         # [B, G, N, d]
    if kv_heads != heads:                                               # each K/V head for its H/G query heads
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(d)       # [B, H, r, N]
    if causal:
        s.masked_fill_(torch.arange(N, device=dev)[None, :] > rows[:, None], float("-inf"))
    o = torch.softmax(s, dim=-1) @ v                 # [B, H, r, d]
    y = o.transpose(1, 2).reshape(B, len(rows), heads * d) @ w64["wo"]
    return y + w64["bo"] if "bo" in w64 else y


def compare(y: torch.Tensor, ref: torch.Tensor, tol: float, ulp_of=None, rms_metric: bool = False) -> dict:
    """max |y - ref| / rms(ref) <= tol. ulp_of (a dtype): each element may also differ by that
    dtype's epsilon relative to its own size (one to two units in its last place): the same sums
    computed in another order (GEMMs of other shapes, tensor cores, a split over ranks) round to
    neighbouring values now and then, and at the layer's largest outputs such steps alone can
    exceed tol * rms. rms_metric: sqrt(mean |y - ref|^2) / rms(ref) <= tol instead (FP8's)."""
    y = y.to(ref.device, torch.float64)
    err = (y - ref).abs()
    rms = ref.pow(2).mean().sqrt().item()
    finite = bool(torch.isfinite(y).all())
    max_err = err.max().item() if finite else float("inf")
    rel = (err.pow(2).mean().sqrt().item() if finite else float("inf")) if rms_metric else max_err
    rel = rel / max(rms, 1e-30)
    ok = rel <= tol
    if ulp_of is not None and finite and not ok:
        ok = bool((err <= tol * rms + torch.finfo(ulp_of).eps * ref.abs()).all())
    out = {"max_abs_err": max_err, "rms_ref": rms, "rel_err": rel, "tol": tol, "finite": finite, "pass": finite and ok}
    if rms_metric:
        out["metric"] = "rms"
    if ulp_of is not None:
        out["ulp_allowed"] = True
    return out


def grads_float64(x, w: dict, dy, heads: int, causal: bool) -> tuple[torch.Tensor, dict]:
    """(dX, {name: gradient}) of the whole layer in float64 (torch autograd over layer_float64 with
    every row), from the (already rounded) weights, input and upstream gradient dy."""
    dev = x.device
    leaves = {k: v.to(dev, torch.float64).requires_grad_(True) for k, v in w.items()}
    x64 = x.to(dev, torch.float64).requires_grad_(True)
    with torch.enable_grad():
        y = layer_float64(x64, leaves, heads, causal, torch.arange(x.shape[1]))
        y.backward(dy.to(dev, torch.float64))
    return x64.grad, {k: t.grad for k, t in leaves.items()}
