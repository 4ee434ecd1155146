"""The layer's local building blocks outside attention: a GEMM with one rounding, the bias pass and
a bias's gradient. Shared by the layer, its autograd pairs (tpattn/comm.py, tpattn/outputsum.py) and
the cost model's calibration (which times them bare)."""

from __future__ import annotations

import torch


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
       out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (+ bias), accumulated in fp32 and rounded once to out_dtype. On a GPU an fp16/bf16
    product runs on tensor cores, also for an fp32 result (torch.mm's out_dtype); the bias rides in
    the GEMM's epilogue when the result has the inputs' dtype. On CPU through fp32."""
    if a.is_cuda and a.dtype == b.dtype:
        if out_dtype == a.dtype:
            if bias is not None:
                return torch.addmm(bias, a, b, out=out) if out is not None else torch.addmm(bias, a, b)
            return torch.mm(a, b, out=out) if out is not None else torch.mm(a, b)
        if out_dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16) and bias is None:
            if out is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            try:
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            except (TypeError, RuntimeError):  # a torch without the out= form of it
                return out.copy_(torch.mm(a, b, out_dtype=torch.float32))
    acc = torch.promote_types(a.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    y = torch.mm(a.to(acc), b.to(acc))
    if bias is not None:
        y += bias.to(acc)
    y = y.to(out_dtype)
    return out.copy_(y) if out is not None else y


def add_bias(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = part (+ bias), cast to out's dtype, in one elementwise pass. An fp32 partial takes the
    model-dtype bias as it is (the add widens it inside the pass: the same sum as casting it first,
    without a cast kernel and its launch on every call)."""
    if bias is None:
        return out.copy_(part)
    widens = part.dtype == torch.float32 and bias.dtype in (torch.float16, torch.bfloat16)
    return torch.add(part, bias if widens or bias.dtype == part.dtype else bias.to(part.dtype), out=out)


def bias_grad(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias's gradient: dy summed over the rows, in fp32 (fp64 for fp64), in the bias's dtype. The sum
    widens as it reads (sum's dtype=): no widened copy of dy is written first."""
    if g.dtype == dtype:  # torch's sum accumulates 16-bit values in fp32 and rounds once: one kernel
        return g.sum(0)
    return g.sum(0, dtype=torch.promote_types(g.dtype, torch.float32)).to(dtype)
