"""What the backward GPU tests share (tests/test_gpu_backward_naive.py, test_gpu_backward_props.py,
test_gpu_backward_fused.py, test_gpu_triton.py):
gradients through tpattn.attention.attention, and FlashAttention's accuracy rule.

The rule: a backend's gradient in a low dtype is as good as torch's own in that dtype. For each of dq,
dk, dv, against float64 autograd of the reference backend (q, k, v, do upcast: the exact gradient of
the low-precision inputs),

    max|g_backend - g64|  <=  3 * max|g_torch - g64|  +  atol

where g_torch is the reference backend run through torch autograd in the same dtype (its S, P and O
rounded to the dtype at the seed's points, and autograd rounding dP, dS and the gradients to it), and

    atol = eps(dtype) * max|g64|  +  1e-5 * max(max|dq64|, max|dk64|, max|dv64|)

The first term is one unit in the last place of the dtype at the gradient's own scale: storing the
gradient in the dtype costs up to half of that by itself, and in small cases torch's rounding can land
on the exact value (err_torch = 0) where an equally good kernel's sum, in another order, rounds one step
the other way. The second is float32's share (sums of d or N float32 terms, ~1e-7 relative each): where
a gradient is exactly zero in float64 (N = 1: dq = dk = 0) torch gets 0 too, and a kernel whose dP and
D are summed in different orders (the fused one) may leave ~1e-6 there; it is far below any error
the rule is meant to catch (an index off by one, a missed head, a wrong mask: O(|g|)).
"""

from __future__ import annotations

import math

import torch

from tpattn.attention import attention

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # the dtype's spacing at 1.0


def inputs(b, h, g, n, d, dtype, seed=0):
    """q [b, h, n, d], k and v [b, g, n, d], do like q; standard normal, rounded to dtype."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, n, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, g, n, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(b, g, n, d, device="cuda", generator=gen).to(dtype)
    do = torch.randn(b, h, n, d, device="cuda", generator=gen).to(dtype)
    return q, k, v, do


def grads(q, k, v, do, causal, backend, deterministic=False):
    """(o, dq, dk, dv): attention(...) on fresh leaves, then o.backward(do)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, causal, backend=backend, deterministic=deterministic)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def atol(g64: torch.Tensor, scale: float, dtype) -> float:
    return EPS[dtype] * g64.abs().max().item() + 1e-5 * scale


def check_rule(got, torch_low, exact, dtype, what: str = "") -> None:
    """FlashAttention's rule (module docstring) for (dq, dk, dv) triples: the backend's, torch's in the
    same low dtype, and the exact one (float64, or float32 standing in for it)."""
    scale = max(x.abs().max().item() for x in exact)
    for name, a, t, r in zip(("dq", "dk", "dv"), got, torch_low, exact):
        assert a.shape == r.shape, f"{what} {name}: shape {tuple(a.shape)}, expected {tuple(r.shape)}"
        assert a.dtype == dtype, f"{what} {name}: dtype {a.dtype}, expected {dtype}"
        assert torch.isfinite(a).all(), f"{what} {name}: not finite"
        r = r.double()
        err = (a.double() - r).abs().max().item()
        err_t = (t.double() - r).abs().max().item()
        tol = 3 * err_t + atol(r, scale, dtype)
        assert err <= tol, (f"{what} {name}: max error {err:.3e} > 3 x torch's {err_t:.3e} + atol "
                            f"= {tol:.3e} (max|{name}| {r.abs().max().item():.3e})")


def check_output_and_grads(q, k, v, do, causal, got) -> None:
    """got = grads(q, k, v, do, causal, backend) (o, dq, dk, dv) against float64 autograd of the
    reference, each by the rule's form with the output and a floor of 1e-3 of its largest value
    (the fused and Triton kernels' tests): max error <= 3 x torch's own in q's dtype + that floor."""
    want = grads(q.double(), k.double(), v.double(), do.double(), causal, "reference")
    torch_low = grads(q, k, v, do, causal, "reference")
    for name, w, t, x in zip(("o", "dq", "dk", "dv"), want, torch_low, got):
        assert x.dtype == q.dtype and x.shape == w.shape, name
        assert torch.isfinite(x).all(), name
        err = (x.double() - w).abs().max().item()
        ref_err = (t.double() - w).abs().max().item()
        floor = 1e-3 * w.abs().max().item() + 1e-5
        assert err <= 3 * ref_err + floor, f"{name}: {err:.3g} > 3 x {ref_err:.3g} + {floor:.2g}"


def check_against_reference(q, k, v, do, causal, backend, what: str = "") -> None:
    """The backend's dq, dk, dv against float64 autograd of the reference, by the rule."""
    _, *got = grads(q, k, v, do, causal, backend)
    _, *low = grads(q, k, v, do, causal, "reference")
    _, *exact = grads(q.double(), k.double(), v.double(), do.double(), causal, "reference")
    check_rule(got, low, exact, q.dtype, what or f"{backend} {tuple(q.shape)} g={k.shape[1]} causal={causal}")


def chunked_grads(q, k, v, do, causal: bool = False, rows: int = 1024):
    """(exact, torch_low): dq, dk, dv of one head (q, k, v, do of shape [1, 1, N, d]) over blocks of
    `rows` query rows, so no N x N tensor is ever held (N = 50 000 fits).
    exact: float32 from the low-precision inputs (float32's error, ~1e-6 relative, stands in for
    float64's: the low dtype's is ~1e-3). torch_low: the reference backend's own computation in the low
    dtype, at its rounding points: S rounded, P = softmax(S) rounded, O rounded; its autograd rounds dP,
    dS and (at the end) dq, dk, dv to the dtype, and uses the unrounded float32 softmax in dS."""
    dt = q.dtype
    q, k, v, do = (t[0, 0].float() for t in (q, k, v, do))
    n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    dq_e, dq_t = torch.empty_like(q), torch.empty_like(q)
    dk_e, dv_e, dk_t, dv_t = (torch.zeros_like(k) for _ in range(4))
    cols = torch.arange(n, device=q.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        qr, dor = q[r0:r1], do[r0:r1]
        s = (qr @ k.T) * scale
        if causal:
            s.masked_fill_(cols[None, :] > torch.arange(r0, r1, device=q.device)[:, None], float("-inf"))
        # exact
        p = torch.softmax(s, -1)
        dp = dor @ v.T
        ds = p * (dp - (dor * (p @ v)).sum(-1, keepdim=True))
        dq_e[r0:r1] = (ds @ k) * scale
        dk_e += (ds.T @ qr) * scale
        dv_e += p.T @ dor
        del p, dp, ds
        # torch in the low dtype (ReferenceBackend.attention under autograd)
        y = torch.softmax(s.to(dt).float(), -1)
        dp = (dor @ v.T).to(dt).float()
        ds = (y * (dp - (y * dp).sum(-1, keepdim=True))).to(dt).float() * scale
        dq_t[r0:r1] = ds @ k
        dk_t += ds.T @ qr
        dv_t += y.to(dt).float().T @ dor
        del s, y, dp, ds
    low = tuple(x.to(dt)[None, None] for x in (dq_t, dk_t, dv_t))
    return tuple(x[None, None] for x in (dq_e, dk_e, dv_e)), low


def dq_from_sum(dq: torch.Tensor, dqa: torch.Tensor) -> None:
    """The layout of hbwd5_kv's fp32 dQ sum, written as the copy that undoes it (the oracle of
    hbwd_dq_out's GPU test; tests/test_dq_layout.py checks it against the kernel's thread map): dQ
    [B, H, N, d] from the sum, laid out as its accumulators are held
    (kernels/fused_hopper_backward.cu): [bh][query tile][panel][g][warp][lane / 4][lane % 4][e >> 1][e & 1]
    holds row 16 warp + 8 (e >> 1) + lane / 4 and column 64 panel + 8 g + 2 (lane % 4) + (e & 1) of the
    tile. One permuted copy (rounding to dq's dtype) when N is a multiple of 64, else two."""
    b, h, n, d = dq.shape
    qt = -(-n // 64)
    out = dq if n % 64 == 0 else torch.empty(b, h, qt * 64, d, dtype=dq.dtype, device=dq.device)
    out.view(b * h, qt, 4, 2, 8, d // 64, 8, 4, 2).permute(0, 1, 5, 6, 2, 4, 7, 3, 8).copy_(
        dqa.view(b * h, qt, d // 64, 8, 4, 8, 4, 2, 2))
    if out is not dq:
        dq.copy_(out[:, :, :n])
