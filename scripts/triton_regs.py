"""The Triton rung's kernels compiled for a GPU without one: registers, spills and shared memory of
every autotune config at every tile width, from ptxas (the one that ships with triton), so that the
configs can be chosen (and checked) on any machine.

    python scripts/triton_regs.py [--arch 90] [--head-dims 64 96 128 256] [--dtype fp16]

For each kernel (forward, dK/dV, dQ; the paged prefill at its one config, over 16-bit and FP8 pages;
the FP8 forward, f8, at 64, 128 and 256, and its block quantization, q8, without and with the
rotation), head dim and config: (BLOCK_M, BLOCK_N, warps, stages), registers
a thread, spill stores and loads (bytes), shared memory. Exit status 1 if any config spills.
Compiles with pointers aligned to 16 and, where 16 divides d (contiguous rows), the strides too, as a
real launch specializes them (for d = 40, 136, ... the row stride is not a multiple of 16)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNELS = {"fwd": "attn_fwd", "kv": "attn_bwd_kv", "q": "attn_bwd_q", "pg": "paged_prefill_fwd",
           "pg8": "paged_prefill_fwd",  # pg8: the paged prefill over an FP8 pool
           "f8": "fp8_fwd",  # f8: the FP8 forward (triton_fp8.py), over its configs
           "q8": "fp8_quant"}  # q8: its block quantization (one config; the causal column: with the rotation)
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def compile_one(K, which: str, d: int, causal: bool, cfg, dtype: str, arch: int, fp8: bool = False) -> dict:
    """One kernel, head dim, causal flag and config: ptxas's numbers for it (pg: the paged prefill of
    tpattn/attention/triton_paged.py, causal by construction; fp8: over an FP8 pool's pages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if which == "pg":
        from tpattn.attention import triton_paged
        fn = triton_paged.paged_prefill_fwd
    elif which in ("f8", "q8"):
        from tpattn.attention import triton_fp8
        fn = triton_fp8.fp8_fwd.fn if which == "f8" else triton_fp8.fp8_quant
    else:
        fn = getattr(K, KERNELS[which]).fn
    names = fn.arg_names
    bm, bn, warps, stages = cfg
    const = {"HEAD_DIM": d, "CAUSAL": causal, "BLOCK_D": K.block_d(d), "PAD_D": K.block_d(d) != d,
             "BLOCK_M": bm, "BLOCK_N": bn, "STORE_LSE": True, "F8": fp8, "D_TUNED": d,
             "BLOCK": 128, "SUB": bm, "BJ": bn, "ROTATE": causal, "MODE": 0, "KEY_ORDER": False}
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ("L", "DELTA", "KS", "VS", "SQ", "SK", "SV", "S"):
            sig[name] = "*fp32"
        elif (name in ("KP", "VP") and fp8) or (which == "f8" and name in ("Q", "K", "VT")) or name == "X8":
            sig[name] = "*fp8e4nv"
        elif name in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ", "KP", "VP", "X", "R"):
            sig[name] = "*" + dtype
        elif name in ("TABLE", "CU", "START"):
            sig[name] = "*i32"
        elif name in ("qk_scale", "sm_scale", "rscale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        stride = name.startswith("s") and sig[name] == "i32"
        if sig[name].startswith("*") or (stride and d % 16 == 0):  # a row stride of d elements: 16 | d
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items() if k in names},
                    attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(c.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        out = subprocess.run([str(ptxas), f"-arch=sm_{arch}{suffix}", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True).stderr
    spills, regs = _SPILLS.search(out), _REGS.search(out)
    if spills is None or regs is None:
        raise RuntimeError(f"ptxas -v printed no register count: {out}")
    return {"kernel": which, "d": d, "causal": causal, "config": cfg, "regs": int(regs.group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)), "shared": c.metadata.shared}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/triton_regs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100, H200)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 96, 128, 160, 256])
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    a = p.parse_args(argv)
    try:
        from tpattn.attention import triton_kernels as K
    except ImportError:
        print("triton_regs: error: needs the triton package (pip install triton)", file=sys.stderr)
        return 2
    bad = 0
    print(f"sm_{a.arch}, {a.dtype}: kernel, head dim (tile width), causal, (BLOCK_M, BLOCK_N, warps, stages): "
          "registers, spill stores/loads (bytes), shared memory (bytes)")
    from tpattn.attention import triton_paged
    for d in a.head_dims:
        for which in KERNELS:
            paged = which.startswith("pg")
            if which in ("f8", "q8"):
                from tpattn.attention import fp8, triton_fp8
                if d not in fp8.KERNEL_HEAD_DIMS:
                    continue
                cfgs = triton_fp8.TUNE[d] if which == "f8" else [(triton_fp8.QUANT_SUB, triton_fp8.QUANT_BJ, 4, 1)]
            else:
                cfgs = [triton_paged.config(d)] if paged else K.tune_set(which, K.block_d(d))
            for cfg in cfgs:
                for causal in (False, True) if not paged else (True,):
                    r = compile_one(K, "pg" if paged else which, d, causal, cfg, a.dtype, a.arch, which == "pg8")
                    spills = r["spill_stores"] + r["spill_loads"]
                    bad += spills > 0
                    print(f"  {which:<3} d={d:<3} ({K.block_d(d):>3}) {'causal' if causal else 'full  '} {cfg}: "
                          f"{r['regs']:>3} regs, spills {r['spill_stores']}/{r['spill_loads']}, "
                          f"shared {r['shared']}{'  SPILLS' if spills else ''}")
    print(f"{bad} config(s) spill" if bad else "no config spills")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
