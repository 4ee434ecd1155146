"""`python -m tpattn`: arguments -> config -> checks on every rank -> run -> report -> exit code.

Exit status: 0 PASS (or --no-check), 1 check FAIL or a fault during the run, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from . import dist as tpdist
from . import faults, watch
from .attention import backend_names
from .check import TOL_BASELINE, TOL_FLOAT64, TOL_FP8_RMS, compare, grads_float64, layer_float64, sample_rows
from .config import (DEVICES, DIST_BACKENDS, DTYPES, FP8, KV_DTYPES, OUTPUT_COLLECTIVES, REDUCE_DTYPES, Config,
                     ConfigError, check_writable, profile_path, resolve, validate)
from .layer import WORLD, TensorParallelAttention
from .paged import PAGE_SIZE, PagedKV
from .memory import heads_world, host_available, preflight
from .report import COLLECTIVES, build, text
from .sharding import head_range, heads_by_rank, kv_head_range
from .timing import Timer, recording, summarize
from .weights import head_weights, layer_input, load_inputs, slice_heads

EXIT_FAIL, EXIT_USAGE = 1, 2

EPILOG = """\
launch:
  python -m tpattn                              one process: the single-GPU baseline (or CPU)
  mpirun -n 8 python -m tpattn                  8 ranks, one per GPU, heads split 8 ways, NCCL
  mpirun -n 8 python -m tpattn --heads 28 --uneven-heads   28 heads: 4 on ranks 0-3, 3 on ranks 4-7
  mpirun -n 4 python -m tpattn --dist-backend gloo   4 ranks sharing one GPU (or CPU)
  srun / torchrun work too: rank, world size and local rank come from the launcher.
exit status: 0 PASS (or --no-check), 1 check FAIL or a fault during the run, 2 bad input.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + error
        raise ConfigError(f"{message} (see python -m tpattn --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tpattn", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="One multi-head attention layer, split by heads across ranks (tensor parallelism): "
                            "column-parallel Q/K/V, local attention (the seed's naive three-kernel CUDA "
                            "attention, the faster tiled or fused CUDA kernels, or a torch reference), row-parallel output projection, the partial outputs summed over ranks (one all-reduce, or a reduce-scatter and an all-gather). "
                            "Times every pass and checks the output against the single-process baseline "
                            "and a float64 reference.")
    s = p.add_argument_group("shape")
    s.add_argument("--seq-len", type=int, metavar="N", help="sequence length N (default 4096 on GPU, 1024 on CPU)")
    s.add_argument("--heads", type=int, metavar="H", help="attention heads H (default 32 on GPU, 8 on CPU)")
    s.add_argument("--head-dim", type=int, metavar="d", help="head dim d, 1..256; model dim D = H*d "
                   "(default 128 on GPU, 64 on CPU)")
    s.add_argument("--kv-heads", type=int, metavar="G", help="K/V heads G (grouped-query attention; default "
                   "--heads): G divides H and query head q uses K/V head q // (H/G); 1 is multi-query attention. "
                   "Over W ranks the K/V heads are split when W divides G (G/W per rank) and replicated when W is "
                   "a multiple of G (each rank holds the one its query heads use); other world sizes are refused, or with "
                   "--uneven-heads (W <= G) ranks own whole K/V groups, ceil or floor of G/W")
    s.add_argument("--batch", type=int, default=1, metavar="B", help="batch size (default 1)")
    s.add_argument("--causal", action="store_true", help="causal mask: key j > query i does not contribute")
    k = p.add_argument_group("compute")
    k.add_argument("--dtype", default="fp16", choices=[*DTYPES, FP8], help="storage dtype of weights, Q, K, V, S, "
                   "P, O (accumulation is always fp32; default fp16). fp8: the attention in e4m3 (scales per 128-row "
                   "block, Q and K rotated by a Hadamard matrix, P in e4m3 for the PV product; torch math, or with "
                   "--kernel triton the Triton FP8 kernel on compute capability 8.9+, with --kernel fused the CUDA one on 9.0 at "
                   "head dim 128; forward only), weights and projections in fp16; --check adds its error against the fp16 layer")
    k.add_argument("--kernel", choices=backend_names(), help="local attention backend: naive (the seed's three "
                   "CUDA kernels via CuPy), reference (torch, same passes and rounding, CPU or GPU), tiled (three "
                   "passes on tensor cores, wgmma on compute capability 9.0), fused (one online-softmax kernel, S and P never "
                   "stored; on compute capability 9.0 warp-specialized: TMA loads, wgmma, a persistent grid; head dim 64 "
                   "or 128, on 9.0 also 32, 80, 96, 160, 192, 256) or triton (the fused algorithm in Triton, every head dim that is a multiple of 8 up to 256; "
                   "needs triton on a GPU); default naive on a GPU with CuPy, else reference")
    k.add_argument("--device", default="auto", choices=list(DEVICES), help="auto picks cuda when a GPU (and CuPy "
                   "for naive) is there, else cpu, and says why (default auto)")
    k.add_argument("--seed", type=int, default=0, help="seed of the weights and input; the same seed gives the "
                   "same numbers for any world size (default 0)")
    k.add_argument("--load", metavar="PATH", help="use these weights instead: a torch.save'd dict with wq [D, D], "
                   "wk, wv [D, G*d] (G = --kv-heads, default H) and wo [D, D] in x @ W layout, optional bq, bo [D], "
                   "bk, bv [G*d] and x [B, N, D]; refused if any value is NaN or Inf")
    d = p.add_argument_group("parallel")
    d.add_argument("--dist-backend", default="auto", choices=list(DIST_BACKENDS), help="collective backend: "
                   "nccl on CUDA, gloo on CPU or with several ranks sharing one GPU (default auto)")
    d.add_argument("--reduce-dtype", default="fp32", choices=list(REDUCE_DTYPES), help="dtype of the partial "
                   "outputs and the all-reduce: fp32 (default; the article's full-precision sum, 2x the "
                   "bytes) or model (the storage dtype, half the bytes, one more rounding)")
    d.add_argument("--output-collective", default="auto", choices=list(OUTPUT_COLLECTIVES), help="how "
                   "head-parallel sums the partial outputs: allreduce (one all-reduce, then b_o and the cast), "
                   "split (a reduce-scatter of the partials; each rank adds b_o to and rounds its 1/W of the "
                   "rows; an all-gather of those: the same y, 3/4 of the bytes with fp32 partials), auto "
                   "(default: the one-shot peer all-reduce for partials of at most 512 KiB when every rank can map "
                   "the others' GPU memory, as on one node; else split when the partials are fp32 and the rows "
                   "divide by the world size; else allreduce), p2p "
                   "(one GPU per rank on one node: a kernel reads the other GPUs' partials over NVLink, sums its "
                   "1/W of the rows in fp32, rounds once and writes them into every GPU's output: both "
                   "collectives in one pass, without NCCL; torch symmetric memory), oneshot (every rank's kernel "
                   "reads all the partials through CUDA IPC, sums them in rank order, adds b_o and rounds once: "
                   "one kernel, no NCCL; the decode step's choice; ranks on one node, or sharing one GPU)")
    d.add_argument("--uneven-heads", action="store_true", help="allow a world size W that does not divide "
                   "--heads H: ranks own contiguous blocks of ceil(H/W) or floor(H/W) heads, the first H mod W ranks "
                   "one more (with --kv-heads G: blocks of whole K/V groups, ceil or floor of G/W, so W <= G). "
                   "The collectives are unchanged; the layer waits for the rank with the most heads (the report "
                   "shows the imbalance). Without it such a W is refused")
    d.add_argument("--sequence-parallel", action="store_true", help="second parallel style: input and "
                   "output sharded along the sequence ([B, N/W, D] per rank); an all-gather before the QKV "
                   "projection and a reduce-scatter after the output projection replace the all-reduce "
                   "(needs --seq-len divisible by the world size)")
    d.add_argument("--context-parallel", type=int, default=1, metavar="C", help="third parallel style, ring "
                   "attention: the sequence over rings of C ranks (each rank an early and a late chunk of N/(2C) "
                   "rows, so causal work is even), its K/V blocks passed peer to peer around the ring while it "
                   "attends to the block in hand, the partial outputs merged by their logsumexp; the heads split "
                   "over the W/C rings (rank r: ring rank r %% C, heads rank r // C). C divides the world size, 2C "
                   "divides --seq-len; for sequences whose K/V no rank holds whole; not with --decode, "
                   "--sequence-parallel, --cuda-graph, --overlap, --dtype fp8 or --output-collective p2p or oneshot "
                   "(default 1: off)")
    d.add_argument("--overlap", type=int, default=1, metavar="K", help="pipeline the output projection "
                   "(with --kernel fused the attention too) and the collective over K row chunks, the "
                   "collectives on a side CUDA stream (sequence parallel: the all-gather with the QKV "
                   "projection too); 1 = off (default; it lost on the H200s, see README)")
    d.add_argument("--cuda-graph", action="store_true", help="capture the whole layer (kernels, GEMMs, "
                   "collectives) in one CUDA graph and time its replays: no host launch cost, total time only (with "
                   "--backward: the whole training step, forward and backward, in one graph)")
    d.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds to wait for the "
                   "rendezvous and for any collective before the job fails (default 300)")
    m = p.add_argument_group("measure and report")
    m.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    m.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    m.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with the single-process baseline and a float64 reference; FAIL exits 1 "
                        "(default on)")
    m.add_argument("--backward", action="store_true", help="time and check a training step instead of the "
                   "forward alone: forward and backward per pass (the attention backward, the dX collective, the "
                   "weight-gradient GEMMs); checks x.grad and the full gradients against the single-process layer "
                   "and float64, as the forward check does (with --cuda-graph: forward and backward in one graph)")
    m.add_argument("--deterministic", action="store_true", help="with --backward: an attention backward that gives "
                   "the same bits every run (the fused kernel's seven-product pair instead of its faster five-product "
                   "kernel, whose dQ adds arrive in any order)")
    m.add_argument("--decode", type=int, default=0, metavar="T", help="decode instead: a prompt of --seq-len rows "
                   "through a KV cache of each rank's K/V heads, then T steps of one row each (causal); per-step "
                   "latency and tokens/s; every decoded row checked against the full forward and float64 "
                   "(with --cuda-graph: each step a replay of one graph; not with --sequence-parallel, --backward, "
                   "--load, --context-parallel, --profile or --dtype fp8)")
    m.add_argument("--kv-dtype", default="model", choices=list(KV_DTYPES), help="with --decode: the KV cache's "
                   "dtype, the layer's (model, default) or fp8: e4m3 pages with an fp32 scale per token and K/V head "
                   "(tpattn.paged.PagedKV; about half fp16's bytes), the error against the full forward and float64 "
                   "printed (not with --cuda-graph)")
    m.add_argument("--json", metavar="PATH", help="also write the report as JSON (rank 0)")
    m.add_argument("--profile", metavar="PATH", help="write a torch.profiler trace of one more forward call, "
                   "with --backward of one more training step (chrome trace JSON; rank r > 0 writes PATH.rank<r>; "
                   "not with --decode)")
    return p


def parse(argv: list[str]) -> Config:
    a = parser().parse_args(argv)
    return Config(seq_len=a.seq_len, heads=a.heads, head_dim=a.head_dim, kv_heads=a.kv_heads,
                  uneven_heads=a.uneven_heads, batch=a.batch,
                  dtype=a.dtype,
                  kernel=a.kernel, causal=a.causal, device=a.device, warmup=a.warmup, iters=a.iters, seed=a.seed,
                  check=a.check, json=a.json, dist_backend=a.dist_backend, reduce_dtype=a.reduce_dtype,
                  sequence_parallel=a.sequence_parallel, context_parallel=a.context_parallel, overlap=a.overlap,
                  output_collective=a.output_collective, cuda_graph=a.cuda_graph,
                  timeout=a.timeout, profile=a.profile, load=a.load, backward=a.backward, decode=a.decode,
                  kv_dtype=a.kv_dtype, deterministic=a.deterministic)


def _say(proc, msg: str, stream=sys.stderr) -> None:
    tag = f"tpattn: rank {proc.rank}" if proc.distributed else "tpattn"
    print(f"{tag}: {msg}", file=stream, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    proc = tpdist.Proc()
    try:
        proc = tpdist.discover()
        if {"-h", "--help"} & set(argv):
            if proc.rank == 0:
                parser().print_help()
            return 0
        return _main(argv, proc)
    except (ConfigError, tpdist.LaunchError) as exc:
        code = EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAIL
        if watch.claim():  # else the watch is printing another rank's reason and ends the job
            said = getattr(exc, "cli_message", exc)  # a ConfigError in the CLI's flags
            _say(proc, f"error: {said}")
            watch.end_job(f"{type(exc).__name__}: {said}", code)  # no watch before the process group
        else:
            watch.wait_for_end()
        proc.abort(code)
    except KeyboardInterrupt:
        _say(proc, "interrupted")
        proc.abort(130)
    except BaseException as exc:  # noqa: BLE001 - one line, then end the whole job
        if isinstance(exc, SystemExit):
            raise
        where = ""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            where = f" (at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})"
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        gone = proc.dead_peers()
        if gone and gone in msg:  # the collective's own line already says it
            gone = ""
        line = f"{type(exc).__name__}: {msg}{where}{'; ' + gone if gone else ''}"
        if not watch.claim():  # the watch is printing another rank's reason and ends the job
            watch.wait_for_end()
            proc.abort(EXIT_FAIL)
        _say(proc, f"failed: {line}; ending the job")
        if os.environ.get("TPATTN_TRACEBACK"):
            import traceback
            traceback.print_exc()
        watch.end_job(line, EXIT_FAIL)  # the other ranks print it too, then the job ends
        proc.abort(EXIT_FAIL)
    return EXIT_FAIL  # not reached


def _main(argv: list[str], proc) -> int:
    faults.maybe_fail(proc.rank, "start")
    cfg, local_error, device, loaded = None, None, torch.device("cpu"), None
    try:
        cfg = resolve(parse(argv))
        validate(cfg, proc.world, proc.local_world, check_json=proc.rank == 0)
        if cfg.profile and proc.rank:  # every rank writes its own trace: each checks its own path
            check_writable(profile_path(cfg.profile, proc.rank), "--profile")
        if cfg.load:  # every rank reads and checks the whole file, so all reach the same answer
            loaded = load_inputs(cfg.load, cfg.heads, cfg.head_dim, cfg.batch, cfg.seq_len, cfg.torch_dtype,
                                 cfg.kv_heads)
        device = tpdist.pick_device(proc, cfg.device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            sharing = tpdist.ranks_on_device(proc)
            if sharing > 1:  # ranks sharing one GPU (gloo): each holds to its share, as a GPU of its own would
                torch.cuda.set_per_process_memory_fraction(1.0 / sharing, device)
            preflight(cfg, proc.world, proc.rank, free // sharing, sharing)
        elif (avail := host_available()) is not None:  # a CPU run: the ranks of this node share its memory
            preflight(cfg, proc.world, proc.rank, avail // max(1, proc.local_world), max(1, proc.local_world), host=True)
    except ConfigError as exc:
        local_error = exc.cli_message
    timeout = cfg.timeout if cfg is not None and local_error is None else 300.0
    info = {"rank": proc.rank, "host": proc.hostname, "pid": os.getpid(), "local_rank": proc.local_rank,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    tpdist.rendezvous(proc, timeout)
    fp = cfg.fingerprint() if cfg else None
    if fp is not None and loaded is not None:  # the same path may name different files on different ranks
        fp["load_sha256"] = _sha256(cfg.load)
    error, infos = tpdist.agree(proc, fp, local_error, info, timeout)
    if error:
        _say(proc, f"error: {error}")
        tpdist.leave(proc, timeout, EXIT_USAGE)
        return EXIT_USAGE
    if proc.distributed:
        tpdist.init_process_group(proc, cfg.dist_backend, device, cfg.timeout)
        watch.start(proc, cfg.timeout, lambda m: _say(proc, m))
    with torch.no_grad():  # inference: the layer's forward builds no autograd graph
        code = _run(cfg, proc, device, infos, argv, loaded)
    if proc.distributed:
        watch.stop()
        torch.distributed.destroy_process_group()
    tpdist.leave(proc, cfg.timeout, code)
    return code


def _weights(cfg: Config, heads: range, kv_heads: range, device, loaded: dict | None) -> dict:
    """The given query heads' and K/V heads' weights: generated from --seed, or sliced from --load."""
    if loaded is None:
        return head_weights(heads, cfg.heads, cfg.head_dim, cfg.seed, cfg.torch_dtype, device, kv_heads)
    w = slice_heads({k: t for k, t in loaded.items() if k != "x"}, heads, cfg.head_dim, kv_heads)
    return {k: t.to(device) for k, t in w.items()}


def _run(cfg: Config, proc, device, infos, argv, loaded: dict | None) -> int:
    C = cfg.context_parallel
    T, hr = heads_world(cfg, proc.world, proc.rank)  # the heads' ranks (with --context-parallel: W / C of them)
    heads = head_range(cfg.heads, T, hr, cfg.uneven_heads, cfg.kv_heads)
    kv_heads = kv_head_range(cfg.heads, cfg.kv_heads, T, hr, cfg.uneven_heads)
    w = _weights(cfg, heads, kv_heads, device, loaded)
    if loaded is not None and "x" in loaded:
        x = loaded["x"].to(device)
    else:
        x = layer_input(cfg.batch, cfg.seq_len, cfg.model_dim, cfg.seed, cfg.torch_dtype, device)
    layer = TensorParallelAttention(**w, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                    backend=_backend(cfg), causal=cfg.causal, group=WORLD if proc.distributed else None,
                                    reduce_dtype=cfg.reduce_dtype, sequence_parallel=cfg.sequence_parallel,
                                    overlap=cfg.overlap, output_collective=cfg.output_collective,
                                    uneven_heads=cfg.uneven_heads, deterministic=cfg.deterministic,
                                    context_parallel=C)
    infos[proc.rank]["heads"] = f"{heads.start}-{heads.stop - 1}"
    infos[proc.rank]["kv_heads"] = f"{kv_heads.start}-{kv_heads.stop - 1}"
    if cfg.decode:
        return _run_decode(cfg, proc, device, infos, argv, layer, w, loaded)
    # sequence parallel: N/W rows each; context parallel: this rank's two chunks of N/(2C) rows
    shard = layer.shard_sequence if cfg.sequence_parallel else layer.shard_context if C > 1 else (lambda t: t)
    gather = layer.gather_sequence if cfg.sequence_parallel else layer.gather_context if C > 1 else (lambda t: t)
    x_in = shard(x)
    if not cfg.check and x_in is not x:
        x = None  # the whole input only for the checks: a rank holds its rows
    timer = Timer(device)
    if cfg.backward:  # a training step: forward and backward, dy the same for any world size
        dy = layer_input(cfg.batch, cfg.seq_len, cfg.model_dim, cfg.seed + 1, cfg.torch_dtype, device)
        step = _TrainStep(layer, x_in, shard(dy), cfg.cuda_graph)
    for _ in range(cfg.warmup):
        step() if cfg.backward else layer(x_in)
    call = step if cfg.backward else layer.graphed(x_in) if cfg.cuda_graph else (lambda: layer(x_in))
    samples: dict[str, list[float]] = {}
    for _ in range(cfg.iters):
        # "total" and "host": the layer as a user calls it, no per-pass timing inside; back to back,
        # each after the previous one's end (an instrumented call in between slowed the next one's
        # host side, up to 2x on the lent H200s: scripts/host_probe.py)
        with timer.section("total"):
            t0 = time.perf_counter()
            y = call()
            host = (time.perf_counter() - t0) * 1e3  # returns once everything is queued on the GPU
        for name, ms in {**timer.collect(), "host": host}.items():
            samples.setdefault(name, []).append(ms)
    for _ in range(0 if cfg.cuda_graph else cfg.iters):  # then the calls with an event pair around every pass
        with recording(timer):
            y = step() if cfg.backward else layer(x_in)
        for name, ms in timer.collect().items():
            samples.setdefault(name, []).append(ms)
    grads = None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None  # before any check's tensors
    if cfg.check and cfg.backward:  # every rank joins these collectives: the whole dX and the whole gradients
        grads = {"x": gather(step.x_grad), **layer.full_grads()}
    if cfg.check:
        y = gather(y)  # the whole output, for the checks (sequence or context parallel: every rank joins)
    if cfg.profile:  # one more call, eager (with --backward a training step: forward and backward)
        _profile(cfg, proc, (_TrainStep(layer, x_in, shard(dy)) if cfg.backward else lambda: layer(x_in)), x_in)

    def checks() -> dict:
        out = _checks(cfg, proc, layer, w, x, y, device, loaded)
        if grads is not None:
            out.update(_grad_checks(cfg, proc, w, x, dy, grads, device, loaded))
        return out
    nbytes = layer.train_nbytes if cfg.backward else layer.collective_nbytes
    infos[proc.rank]["peak_bytes"] = peak
    return _finish(cfg, proc, device, infos, argv, samples, checks, nbytes(cfg.batch, cfg.seq_len))


def _finish(cfg: Config, proc, device, infos, argv, samples: dict, checks, collective_bytes: dict,
            extra=None) -> int:
    """Every rank's timings to rank 0; there the checks (a function: rank 0 only), the report, the
    JSON and the verdict, which every other rank waits for. extra(rep): more of the report (a dict
    merged into it, and a line printed after it)."""
    mine = {"info": infos[proc.rank], "passes": {k: summarize(v) for k, v in samples.items()},
            "collective_samples": {k: v for k, v in samples.items() if k in COLLECTIVES}}  # report.last_rank_ms
    everyone = tpdist.exchange(proc, "report", mine, cfg.timeout, "report")
    if proc.rank != 0:
        verdict = tpdist.wait_for(proc, "verdict", max(cfg.timeout, 3600.0), "verdict")["verdict"]
        return 0 if verdict != "FAIL" else EXIT_FAIL
    found = checks() if cfg.check else {}
    verdict = "FAIL" if any(not c["pass"] for c in found.values()) else ("PASS" if found else "NOT CHECKED")
    rep = build(cfg, proc, device, everyone, collective_bytes, found, verdict, ["python", "-m", "tpattn", *argv])
    line = None
    if extra is not None:
        more, line = extra(rep)
        rep.update(more)
    print(text(rep), flush=True)
    if line:
        print(line, flush=True)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(rep, f, indent=2)
    if proc.distributed:  # last: on FAIL the others exit as soon as they read it
        proc.store.set("verdict", json.dumps({"verdict": verdict}))
    return 0 if verdict != "FAIL" else EXIT_FAIL


def _run_decode(cfg: Config, proc, device, infos, argv, layer, w, loaded) -> int:
    """--decode T: a prompt of N = --seq-len rows through a KV cache, then T decode steps of one
    row each (--cuda-graph: replays of one graph of a step); every iteration the same cache, emptied.
    Times the prefill and each step; checks every decoded
    row against the full forward over all N + T rows and float64 on sampled rows. --kv-dtype fp8:
    the cache is a pool of e4m3 pages (tpattn.paged.PagedKV) holding the B sequences, the prefill
    their N rows packed in one call, each step one row of each; the checks by FP8's RMS error."""
    B, N, T, D = cfg.batch, cfg.seq_len, cfg.decode, cfg.model_dim
    fp8 = cfg.kv_dtype == "fp8"  # e4m3 K and V: FP8's RMS error, against the 16-bit forward and float64
    xa = layer_input(B, N + T, D, cfg.seed, cfg.torch_dtype, device)
    timer = Timer(device)
    samples: dict[str, list[float]] = {}
    y_full = layer(xa)  # the full recompute (every rank joins its collective); first, as the largest call:
    # with --output-collective p2p the graph below fixes the peer buffers at the size they have then
    cache = _PagedCache(layer, B, N + T) if fp8 else layer.new_cache(B, N + T)
    prefill, step = (cache.prefill, cache.step) if fp8 else (lambda x: layer(x, cache=cache),) * 2
    x_step = xa[:, N:N + 1].clone()  # --cuda-graph: the graph's input row, each step's row copied in
    replay = layer.graphed(x_step, cache) if cfg.cuda_graph else None

    def session(record: bool) -> torch.Tensor:
        cache.reset()
        with timer.section("prefill"):
            ys = [prefill(xa[:, :N])]
        got = timer.collect()
        if record:
            samples.setdefault("prefill", []).append(got["prefill"])
        for t in range(N, N + T):
            if replay is not None:
                x_step.copy_(xa[:, t:t + 1])
            with timer.section("step"):
                y = replay() if replay is not None else step(xa[:, t:t + 1])
            ys.append(y.clone() if replay is not None else y)  # a replay writes the same buffer each step
            got = timer.collect()
            if record:
                samples.setdefault("step", []).append(got["step"])
        return torch.cat(ys, 1)
    for _ in range(cfg.warmup):
        session(False)
    for _ in range(cfg.iters):
        y = session(True)

    def checks() -> dict:
        base = dict(tol=TOL_FP8_RMS, rms_metric=True) if fp8 else \
            dict(tol=TOL_BASELINE[cfg.dtype], ulp_of=cfg.torch_dtype)
        out = {"vs_full_recompute": {**compare(y, y_full.double(), **base),
                                     "what": f"all {N + T} rows: prefill {N}, then {T} decode steps"
                                             + (", the cache in e4m3 against the layer's own forward" if fp8 else "")}}
        full = w if proc.world == 1 else _weights(cfg, range(cfg.heads), range(cfg.kv_heads), device, loaded)
        rows = sample_rows(N + T)
        out["vs_float64"] = {**compare(y[:, rows.to(y.device)], layer_float64(xa, full, cfg.heads, True, rows),
                                       TOL_FP8_RMS if fp8 else TOL_FLOAT64[cfg.dtype], rms_metric=fp8),
                             "what": f"{len(rows)} of {N + T} rows, all heads"}
        return out

    def extra(rep) -> tuple[dict, str]:
        step = rep["passes"]["step"]["max"]  # the slowest rank's median step
        tps = B * 1e3 / step
        cache_mib = B * (N + T) * PagedKV.bytes_per_token(layer, "fp8" if fp8 else None) / 2**20
        kind = "e4m3 pages with a scale per token and K/V head" if fp8 else cfg.storage
        return ({"decode": {"prompt": N, "steps": T, "step_ms": step, "tokens_per_s": tps,
                            "cache_MiB_per_rank": cache_mib, "kv_dtype": cfg.kv_dtype}},
                f"decode: {T} steps after a prompt of {N}: {step:.3f} ms a step (the slowest rank's median), "
                f"{tps:.0f} tokens/s for {B} sequence(s); KV cache {cache_mib:.3g} MiB per rank ({kind})")
    return _finish(cfg, proc, device, infos, argv, samples, checks, layer.collective_nbytes(B, 1), extra)


class _PagedCache:
    """--decode's cache with --kv-dtype fp8: B sequences of up to `rows` rows in a pool of e4m3 pages
    (tpattn.paged.PagedKV), emptied by reset(); prefill(x [B, N, D]) packs the N rows of each in one
    call, step(x [B, 1, D]) takes one row of each."""

    def __init__(self, layer, batch: int, rows: int):
        self.layer, self.batch, self.ids = layer, batch, []
        self.pool = PagedKV(layer, pages=batch * -(-rows // PAGE_SIZE), max_seqs=batch, kv_dtype="fp8")

    def reset(self) -> None:
        for sid in self.ids:
            self.pool.remove(sid)
        self.ids = [self.pool.add() for _ in range(self.batch)]

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        B, n, D = x.shape
        with self.pool.step(self.ids, [n] * B) as st:
            return self.layer(x.reshape(1, B * n, D), cache=st.view(0)).view(B, n, D)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        with self.pool.step(self.ids, [1] * x.shape[0]) as st:
            return self.layer(x, cache=st.view(0))


def _backend(cfg: Config):
    """The layer's attention backend: --kernel's, or with --dtype fp8 the FP8 arithmetic."""
    if cfg.dtype != FP8:
        return cfg.kernel
    return {"triton": "fp8_triton", "fused": "fp8_fused"}.get(cfg.kernel, "fp8")


def _checks(cfg: Config, proc, layer, w, x, y, device, loaded) -> dict:
    """Rank 0: the tensor-parallel output against the single-process baseline (same weights, same
    backend, all heads, no collective) and the layer against float64 on sampled rows; --dtype fp8:
    also against the fp16 layer (the same weights, --kernel's 16-bit attention, single process)."""
    checks = {}
    full = w
    fp8 = cfg.dtype == FP8
    if proc.world > 1 or fp8:
        full = _weights(cfg, range(cfg.heads), range(cfg.kv_heads), device, loaded)
    if fp8:
        fp16 = TensorParallelAttention(**full, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                       backend=cfg.kernel, causal=cfg.causal, group=None)
        checks["vs_fp16_layer"] = {**compare(y, fp16(x).double(), TOL_FP8_RMS, rms_metric=True),
                                   "what": f"all {cfg.seq_len} rows, the same weights with fp16 attention"}
        del fp16
    if proc.world > 1:
        base = TensorParallelAttention(**full, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                       backend=_backend(cfg), causal=cfg.causal, group=None, reduce_dtype=cfg.reduce_dtype,
                                       head_chunk=max(heads_by_rank(cfg.heads, heads_world(cfg, proc.world)[0],
                                                                    cfg.uneven_heads, cfg.kv_heads)))  # the largest rank's
        y_base = base(x)
        checks["vs_single_process"] = {**compare(y, y_base.double(), TOL_BASELINE[cfg.storage], ulp_of=cfg.torch_dtype),
                                       "what": f"all {cfg.seq_len} rows, world {proc.world} vs 1"}
        del base, y_base
    rows = sample_rows(cfg.seq_len)
    ref = layer_float64(x, full, cfg.heads, cfg.causal, rows)
    checks["vs_float64"] = {**compare(y[:, rows.to(y.device)], ref, TOL_FP8_RMS if fp8 else TOL_FLOAT64[cfg.dtype],
                                      rms_metric=fp8), "what": f"{len(rows)} of {cfg.seq_len} rows, all heads"}
    return checks


class _TrainStep:
    """One training step of the layer: a fresh leaf input, the forward under autograd, the
    backward with dy; the parameters' gradients set to None first (each step's own). graphed: the
    step captured in one CUDA graph on its first call (layer.graphed(x, dy=dy)), replayed after."""

    def __init__(self, layer, x, dy, graphed: bool = False):
        self.layer, self.x, self.dy, self.x_grad = layer, x, dy, None
        self.replay = None
        if graphed:  # captured here, before the warm-up and the timed calls
            self.leaf = x.detach().requires_grad_(True)
            self.replay = layer.graphed(self.leaf, dy=dy)

    def __call__(self):
        if self.replay is not None:
            y = self.replay()
            self.x_grad = self.leaf.grad
            return y
        for p in self.layer.parameters():
            p.grad = None
        x = self.x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = self.layer(x)
            y.backward(self.dy)
        self.x_grad = x.grad
        return y.detach()


def _grad_checks(cfg: Config, proc, w, x, dy, grads: dict, device, loaded) -> dict:
    """Rank 0: x.grad and the whole gradients against the single-process layer's (same weights,
    same backend, one rank) and against float64 autograd of the layer."""
    checks = {}
    full = w if proc.world == 1 else _weights(cfg, range(cfg.heads), range(cfg.kv_heads), device, loaded)
    names = ["x", *(k for k in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo") if k in full)]
    if proc.world > 1:
        base = TensorParallelAttention(**full, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                                       backend=cfg.kernel, causal=cfg.causal, group=None, reduce_dtype=cfg.reduce_dtype)
        step = _TrainStep(base, x, dy)
        step()
        want = {"x": step.x_grad, **base.full_grads()}
        # the ring sums each block's gradients from pieces computed (and rounded) apart, in another
        # order than the one kernel over the whole sequence: the two differ by up to both their
        # errors, so they are held to float64's tolerance here (and each to float64 below)
        ring = cfg.context_parallel > 1
        tol = TOL_FLOAT64[cfg.dtype] if ring else TOL_BASELINE[cfg.dtype]
        worst = _worst_grad(grads, {k: t.double() for k, t in want.items() if t is not None}, names, tol,
                            cfg.torch_dtype)
        checks["grads_vs_single_process"] = {**worst, "what": f"x.grad and {len(names) - 1} weight gradients, the "
                                             f"worst ({worst['name']}); world {proc.world} vs 1"
                                             + ("; the ring's pieces: float64's tolerance" if ring else "")}
        del base, step
    dx64, g64 = grads_float64(x, full, dy, cfg.heads, cfg.causal)
    g64["x"] = dx64
    # each element may also be off by an epsilon of its own size: causal, the first keys' dK and dV
    # (summed over every later query) reach tens of times the rms, and their rounding alone exceeds
    # tol x rms at N = 4096 (torch's own fp16 math included)
    worst = _worst_grad(grads, g64, names, TOL_FLOAT64[cfg.dtype], cfg.torch_dtype)
    checks["grads_vs_float64"] = {**worst, "what": f"x.grad and {len(names) - 1} weight gradients, the worst "
                                                  f"({worst['name']})"}
    return checks


def _worst_grad(got: dict, want: dict, names: list[str], tol: float, ulp_of=None) -> dict:
    """compare() of every gradient; the failing one, else the one with the largest error. b_k's
    gradient is 0 in exact arithmetic (the softmax does not change when every key's score moves by
    the same q . b_k), so its computed value is rounding noise: it is held to tol x rms(b_q's gradient)."""
    out = []
    for k in names:
        c = compare(got[k], want[k], tol, ulp_of=ulp_of)
        if k == "bk" and "bq" in want:
            scale = want["bq"].pow(2).mean().sqrt().item()
            c["pass"] = c["finite"] and c["max_abs_err"] <= tol * scale
            c["rel_err"] = c["max_abs_err"] / max(scale, 1e-30)
        out.append({**c, "name": k})
    return max(out, key=lambda c: (not c["pass"], c["rel_err"]))


def _sha256(path: str) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _profile(cfg: Config, proc, call, x) -> None:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=acts, record_shapes=True) as prof, recording(Timer(x.device)):
        call()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
    path = profile_path(cfg.profile, proc.rank)
    # torch's export replaces whatever is at its path (a symlink, a device such as /dev/null): it writes
    # a file of its own here, whose bytes then go to the path as an ordinary write would put them
    fd, tmp = tempfile.mkstemp(prefix="tpattn-trace-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    finally:
        os.remove(tmp)
    what = "training step (forward and backward)" if cfg.backward else "call"
    print(f"rank {proc.rank}: wrote the torch.profiler trace of one {what} to {os.path.abspath(path)} "
          "(open it in chrome://tracing or https://ui.perfetto.dev)", flush=True)


def run() -> None:
    """The `tpattn` console script: main(), then the exit without finalization (dist.exit_now)."""
    tpdist.exit_now(main())


if __name__ == "__main__":  # pragma: no cover
    run()
