"""The layer's graphed paged decode step with the pool's chunk count forced, against the count picked:
bench_paged.layer_steps at B=16 and 64 (G=8, L=4096), each variant in turn, twice.

    PYTHONPATH=. python benchmarks/decode_one_block_h100/ab_pool_counts.py   (on a GPU)"""
import sys
from pathlib import Path
root = next(p for p in Path(__file__).resolve().parents if (p / "tpattn").is_dir())
sys.path[:0] = [str(root), str(root / "scripts")]
import bench_paged as bp  # noqa: E402
from tpattn import decode  # noqa: E402

orig = decode.decode_splits
FORCE = {}


def forced(bg, length, sms, per_sm=4, resident=0, uniform=True):
    if not uniform and bg in FORCE:  # a pool's launch of B > 1 sequences (the only callers with uniform False)
        return FORCE[bg]
    return orig(bg, length, sms, per_sm, resident, uniform)


decode.decode_splits = forced
bp.LAYER_SHAPES = [(16, 8, 4096), (64, 8, 4096)]
variants = {"picked": {}, "S=2": {128: 2, 512: 2}, "S=3": {128: 3, 512: 3}, "B16 S=2, B64 S=1": {128: 2, 512: 1}}
res = {}
for rnd in range(2):
    for name, f in variants.items():
        FORCE.clear()
        FORCE.update(f)
        for r in bp.layer_steps(32, 128, 3, theta=None, plain=False):
            res.setdefault((name, r["B"], r["step"]), []).append(r["us"])
for (name, B, step), us in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    print(f"B={B:3d} {step:14s} {name:18s} " + " ".join(f"{u:7.1f}" for u in us), flush=True)
