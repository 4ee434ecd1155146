#!/usr/bin/env python3
"""The FP8 (e4m3) forward's accuracy against float64, beside 16-bit storage's, on the CPU, from the
numerics an FP8 kernel is to follow (tpattn/attention/fp8.py): per scaling (one scale per tensor, per
(batch, head), per block of 128 rows), with and without the Hadamard rotation of Q and K, on N(0, 1)
inputs and on inputs with a fraction of large outliers (FlashAttention-3's test: 0.1 % of entries with
N(0, 10^2) added). Also the decode step over an FP8 paged KV cache against float64, beside an fp16
cache's: the cache's scale per token and K/V head (tpattn.paged.PagedKV(kv_dtype="fp8")), and the
scales per page and K/V head it was chosen over (a page quantized at once, which a cache written a
step at a time cannot hold; its rows arriving one at a time, the scale raised and the rows already
there rounded again; a power-of-two scale, raised exactly).

    python scripts/fp8_accuracy.py [--seq-len 2048] [--heads 8] [--head-dim 128] [--causal] [--out PREFIX]

RMSE = sqrt(mean((o - o_float64)^2)) over the whole output. Writes PREFIX.json and PREFIX.md (default
benchmarks/fp8_accuracy_cpu) with the command, date and commit.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_kernels import git_commit  # noqa: E402
from tpattn.attention import fp8  # noqa: E402


def forward_rows(B: int, H: int, G: int, N: int, d: int, causal: bool, outliers: float) -> list[dict]:
    q, k, v = fp8.inputs(B, H, G, N, d, outliers=outliers)
    ref = fp8.attention_float64(q, k, v, causal)
    rows = [{"format": name, "scaling": "-", "rotate": False,
             "rmse": fp8.rmse(fp8.attention_16bit(q, k, v, causal, dt), ref)}
            for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16))]
    for scaling in fp8.SCALINGS:
        for rotate in (False, True):
            rows.append({"format": "e4m3", "scaling": scaling, "rotate": rotate,
                         "rmse": fp8.rmse(fp8.attention_fp8(q, k, v, causal, scaling, rotate), ref)})
    return rows


def page_rows_arriving(pages: torch.Tensor, pow2: bool) -> torch.Tensor:
    """Pages [n, g, P, d] written a row at a time with one scale per (page, K/V head): amax / 448 of
    the rows so far (pow2: the least power of two >= that), raised when a row needs it, the rows
    already there requantized at the new scale; returns the dequantized pages."""
    held = torch.zeros_like(pages, dtype=torch.float32)
    s = torch.zeros(pages.shape[0], pages.shape[1], 1, 1)
    amax = torch.zeros_like(s)
    for r in range(pages.shape[2]):
        amax = torch.maximum(amax, pages[:, :, r:r + 1].abs().float().amax(-1, keepdim=True))
        new = amax / fp8.E4M3_MAX
        if pow2:
            m, e = torch.frexp(new)
            new = torch.where(new > 0, torch.ldexp(torch.ones_like(new), e - (m == 0.5).to(e.dtype)), new)
        safe = torch.where(new > 0, new, torch.ones_like(new))
        held[:, :, :r] = fp8.e4m3(held[:, :, :r] * (s / safe))
        held[:, :, r:r + 1] = fp8.e4m3(pages[:, :, r:r + 1].float() / safe)
        s = new
    return held * s


def decode_rows(B: int, H: int, G: int, L: int, d: int, page: int, outliers: float) -> list[dict]:
    """One query row per sequence over L positions of a paged cache: the K/V pages in fp16, and in
    e4m3 with the scales above, read back dequantized; q and the softmax in fp32."""
    q, k, v = fp8.inputs(B, H, G, L, d, outliers=outliers, seed=1)
    q = q[:, :, -1:]  # the step's row, at the last position: it sees every key
    pages = lambda t: t.view(B, G, L // page, page, d).transpose(1, 2).reshape(B * L // page, G, page, d)  # noqa: E731
    unpages = lambda t: t.view(B, L // page, G, page, d).transpose(1, 2).reshape(B, G, L, d)  # noqa: E731
    whole = lambda t: torch.mul(*fp8._scaled(t, t.abs().float().amax(dim=(2, 3), keepdim=True)))  # noqa: E731
    ref = fp8.attention_float64(q, k, v)
    rows = []
    for name, conv in (("fp16", lambda t: t.half().double()),
                       ("e4m3, a scale per token and K/V head (the cache)", lambda t: torch.mul(*fp8.quantize_rows(t))),
                       ("per page and K/V head, the page at once", lambda t: unpages(whole(pages(t)))),
                       ("per page, rows arriving", lambda t: unpages(page_rows_arriving(pages(t), False))),
                       ("per page, power of two, rows arriving", lambda t: unpages(page_rows_arriving(pages(t), True)))):
        rows.append({"cache": name, "rmse": fp8.rmse(fp8.attention_float64(q, conv(k), conv(v)).half(), ref)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/fp8_accuracy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048, help="rows N (default 2048)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: the heads)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--decode-len", type=int, default=4096, help="the paged cache's length for the decode rows")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "fp8_accuracy_cpu"),
                   help="file stem of the .json and .md written")
    a = p.parse_args(argv)
    B, H, N, d = 1, a.heads, a.seq_len, a.head_dim
    G = a.kv_heads or H
    for flag, v in (("--seq-len", N), ("--heads", H), ("--kv-heads", G), ("--head-dim", d), ("--decode-len", a.decode_len)):
        if v < 1:
            p.error(f"{flag} must be at least 1 (got {v})")
    if H % G:
        p.error(f"--kv-heads {G} must divide --heads {H}")
    if d & (d - 1):
        p.error(f"--head-dim {d}: the Hadamard rotation needs a power of two (64, 128, 256)")
    if not Path(a.out).resolve().parent.is_dir():
        p.error(f"--out {a.out}: its folder does not exist; create it or choose another path")
    res = {"command": shlex.join(["python", *sys.argv]), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(None), "torch": torch.__version__,
           "shape": {"B": B, "H": H, "G": G, "N": N, "d": d, "causal": a.causal}, "forward": {}, "decode": {}}
    for label, frac in (("N(0, 1)", 0.0), ("0.1 % outliers, std 10", 1e-3)):
        res["forward"][label] = forward_rows(B, H, G, N, d, a.causal, frac)
        res["decode"][label] = decode_rows(4, 32, 8, a.decode_len, d, 16, frac)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    md = ["# FP8 (e4m3) attention: accuracy against float64, CPU emulation", "",
          f"{res['date']}, commit {res['commit']}, torch {res['torch']}. Command: `{res['command']}`.", "",
          f"Forward: B={B} H={H} G={G} N={N} d={d}{' causal' if a.causal else ''}; RMSE of the output against "
          "float64 (tpattn/attention/fp8.py's rounding points: Q, K, V in e4m3 with scales, S and the softmax in "
          "fp32, P in e4m3, O accumulated in fp32 and rounded to fp16; 16-bit rows: storage in that dtype, P rounded "
          "to it, as the fused kernels do).", "",
          "| inputs | fp16 | bf16 | e4m3 per tensor | + rotation | per head | + rotation | per 128-row block | + rotation |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, rows in res["forward"].items():
        md.append(f"| {label} | " + " | ".join(f"{r['rmse']:.2e}" for r in rows) + " |")
    md += ["", f"Decode over a paged cache: B=4 H=32 G=8 L={a.decode_len} d={d}, pages of 16, one query row at the last "
           "position; RMSE of the fp16 output against float64.", "", "| inputs | " +
           " | ".join(r["cache"] for r in next(iter(res["decode"].values()))) + " |",
           "|---|" + "---:|" * len(next(iter(res["decode"].values())))]
    for label, rows in res["decode"].items():
        md.append(f"| {label} | " + " | ".join(f"{r['rmse']:.2e}" for r in rows) + " |")
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
