"""Where a decode split launch's time goes, block by block: kernels/decode_attention.cu compiled with
DEC_TRACE defined (each block of the tensor-core split records, by the GPU's global timer, when it
started, when its first tile landed (the staged build), when its partial rows were written and when
it was done, after the combine if it was its head's last block), launched with the arguments
tpattn.decode.decode_attention gives the kernel it picks, on the contiguous cache. Prints, per
shape and build: the launch's span; how far apart the blocks started; the first tile's wait; each
block's loop (start to partial rows); the combine of the last blocks; the tail from the median
block's end to the last one's; and the share of the SMs' block slots busy over the span. The
kernels tpattn launches are built without DEC_TRACE (the same code otherwise). The traced build may
take more registers and so hold fewer blocks an SM than the launched one (the `_p` kernel does);
the staged build's blocks an SM are set by its shared memory, so its trace stands for the launch.

    PYTHONPATH=. python scripts/trace_decode_blocks.py [--shapes B,G,L ...] [--reps 20]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tpattn import cuda as tcuda  # noqa: E402
from tpattn import decode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged import decode_shape  # noqa: E402

FIELDS = 8  # dec_trace's values a block: start, first tile, rows written, done, SM, combined


def traced(module, source: str, name: str, grid, block, args, shared_mem: int, reps: int):
    """The traced build of kernel `name` launched `reps` times with the real launch's arguments (its
    temporaries are alive: this runs inside the call); returns (median us by events, the last
    launch's trace [blocks, FIELDS])."""
    import cupy
    fn = module.get_function(name)
    if shared_mem:
        fn.max_dynamic_shared_size_bytes = shared_mem
    blocks = grid[0] * grid[1] * grid[2]
    if blocks > 65536:  # (dec_trace's room)
        raise SystemExit(f"trace_decode_blocks.py traces at most 65536 blocks (this launch has {blocks}); "
                         "pass a smaller --shapes")
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
    ptr = module.get_global("dec_trace")
    trace = cupy.ndarray((blocks * FIELDS,), dtype=cupy.uint64, memptr=ptr).get().reshape(blocks, FIELDS)
    return statistics.median(times), trace


def summary(trace: np.ndarray, resident: int, sms: int) -> dict:
    t = trace.astype(np.int64)
    start, first, rows, done = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    t0, t1 = start.min(), done.max()
    span = t1 - t0
    loop = rows - start
    last = t[:, 5] == 1
    busy = (done - start).sum() / (resident * sms * span) if resident else float("nan")
    us = 1e-3
    return {
        "span": span * us,
        "start spread": (start.max() - t0) * us,
        "first tile": statistics.median((first - start)[first > 0]) * us if (first > 0).any() else float("nan"),
        "loop min/med/max": (loop.min() * us, statistics.median(loop) * us, loop.max() * us),
        "combine med/max": ((statistics.median((done - rows)[last]) * us, (done - rows)[last].max() * us)
                            if last.any() else (float("nan"),) * 2),
        "tail": (t1 - np.median(done)) * us,
        "busy slots": busy,
        "SMs used": len(set(t[:, 4].tolist())),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=decode_shape("B,G,L", "16,8,4096"),
                   default=[(1, 8, 32768), (16, 8, 4096), (64, 8, 4096)], metavar="B,G,L",
                   help="batch, K/V heads, cache length (H = 32 query heads, d = 128, fp16)")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("trace_decode_blocks.py traces the decode kernel on a GPU: run it where torch sees one", file=sys.stderr)
        return 2
    import cupy
    module = cupy.RawModule(code="#define DEC_TRACE 1\n" + tcuda.kernel_source("decode_attention.cu"),
                            options=("--std=c++17",))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), f"({sms} SMs); H=32 d=128 fp16, the contiguous cache; times in us", flush=True)
    H, d = 32, 128
    for B, G, L in a.shapes:
        q = torch.randn(B, H, 1, d, device="cuda").half()
        k = torch.randn(B, G, L, d, device="cuda").half()
        v = torch.randn_like(k)
        mb = 2 * k.numel() * 2 / 1e6
        for staged in (False, True):
            decode.DEC_STAGED = staged
            got = {}
            real = tcuda.launch

            def launch(source, name, device, grid, block, args, shared_mem=0):
                got["name"] = name
                got["resident"] = tcuda.resident_blocks(source, name, device, block[0], shared_mem=shared_mem)
                got["run"] = traced(module, source, name, grid, block, args, shared_mem, a.reps)
                got["grid"] = grid
            tcuda.launch = launch
            try:
                decode.decode_attention(q, k, v, L)
            finally:
                tcuda.launch = real
            us, trace = got["run"]
            s = summary(trace, got["resident"], sms)
            print(f"B={B} G={G} L={L} {got['name']} grid {tuple(got['grid'][:2])}, {got['resident']} blocks an SM: "
                  f"{us:.1f} us by events; span {s['span']:.1f} ({mb * 1e3 / s['span']:.0f} GB/s of K and V), starts spread over "
                  f"{s['start spread']:.1f}, first tile after {s['first tile']:.1f}, loop "
                  f"{'/'.join(f'{x:.1f}' for x in s['loop min/med/max'])}, combine "
                  f"{'/'.join(f'{x:.1f}' for x in s['combine med/max'])}, tail {s['tail']:.1f} after the median "
                  f"block's end, slots busy {100 * s['busy slots']:.0f} %, {s['SMs used']} SMs", flush=True)
        decode.DEC_STAGED = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
