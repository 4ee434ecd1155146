#!/usr/bin/env python3
"""Serve a batch of prompts with a transformers Llama model whose attention is tensor-parallel
(tpattn.hf.parallelize), through the paged KV cache by continuous batching, and print the tokens
per second (on a GPU after an untimed pass of 2 tokens a prompt: the kernels compile on first use).
The model is built from a small LlamaConfig with random weights (nothing is
downloaded); the prompts are random, of lengths spread over --prompt-lens. With --check, the
tokens are compared with the unmodified model's greedy ones (transformers' generate, one prompt at
a time; in fp16/bf16 a near tie can round the other way); with --kv-dtype fp8 (e4m3 pages) every
token must be among the unmodified model's first five at its position, the model fed the same
tokens. One process, or every rank of mpirun / srun (the prompts are the same on every rank), on CPU
or (--device cuda) the GPU, over gloo. Bad arguments, ranks given different ones, a world size that
does not divide the heads (--uneven-heads lays them out anyway) and a pool too small for a prompt
(--pages) are refused in one line on every rank, exit 2.

    python scripts/serve_llama.py --prompts 6 --new-tokens 8 --check
    mpirun -n 2 python scripts/serve_llama.py --prompts 6 --new-tokens 8 --check
    mpirun --oversubscribe -n 3 python scripts/serve_llama.py --prompts 6 --new-tokens 8 --check --uneven-heads
    python scripts/serve_llama.py --prompts 6 --new-tokens 8 --check --kv-dtype fp8
    python scripts/serve_llama.py --prompts 6 --new-tokens 8 --check --prefill-chunk 16
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--hidden", type=int, default=128, help="model dim (default 128)")
    ap.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    ap.add_argument("--kv-heads", type=int, default=4, help="K/V heads (default 4; a divisor of --heads)")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    ap.add_argument("--prompts", type=int, default=8, help="how many prompts (default 8)")
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[4, 64], metavar=("MIN", "MAX"),
                    help="prompt lengths, uniform in [MIN, MAX] (default 4 64)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    ap.add_argument("--max-batch", type=int, default=4, help="sequences live at once (default 4)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens a page of the KV cache (default 16)")
    ap.add_argument("--pages", type=int, help="pages in each layer's pool (default: enough for --max-batch of the "
                    "longest sequences; fewer makes sequences wait for pages, too few is refused)")
    ap.add_argument("--uneven-heads", action="store_true", help="let the ranks hold different numbers of heads "
                    "(a world size that does not divide --kv-heads)")
    ap.add_argument("--dtype", choices=("fp32", "fp64", "fp16", "bf16"), default="fp32",
                    help="the model's dtype (default fp32)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model runs (cuda: ranks share this node's GPUs, one each where there are enough)")
    ap.add_argument("--kv-dtype", choices=("model", "fp8"), default="model",
                    help="the KV cache's pages: the model's dtype, or fp8 (e4m3 with a scale per token and K/V head)")
    ap.add_argument("--prefill-chunk", type=int, metavar="T", help="chunked prefill: at most T prompt rows a step "
                    "(with --graphs: a newcomer's prompt in chunks of T, each a CUDA graph replay; T >= 2)")
    ap.add_argument("--backend", default="reference", help="the attention layers' backend (default reference; "
                    "fused: the CUDA kernels, and with --graphs --prefill-chunk the prompts' chunks as graph replays)")
    ap.add_argument("--check", action="store_true", help="compare with the unmodified model's greedy tokens: "
                    "identical in fp32 and fp64; in fp16 or bf16, or with --kv-dtype fp8, every token among the "
                    "unmodified model's first 5 at its position (teacher-forced), since rounding moves near ties")
    ap.add_argument("--graphs", action="store_true", help="decode steps under CUDA graphs, one per batch-size bucket "
                    "(--device cuda; the first steps of each bucket capture it)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for the others (default 300)")
    return ap.parse_args(argv)


def refusal(args) -> str | None:
    """What is wrong with the arguments, in one line naming the fix, or None."""
    if args.graphs and args.device != "cuda":
        return "--graphs captures CUDA graphs: add --device cuda"
    counts = ("layers", "hidden", "heads", "kv_heads", "vocab", "prompts", "new_tokens", "max_batch", "page_size",
              "pages")
    small = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in counts
             if getattr(args, n) is not None and getattr(args, n) < 1]
    if args.prefill_chunk is not None and args.prefill_chunk < (2 if args.graphs else 1):
        small.append(f"--prefill-chunk {args.prefill_chunk}")
    from tpattn.attention import backend_names
    if args.backend not in backend_names():
        return f"--backend {args.backend}: choose one of {', '.join(backend_names())}"
    if small:
        return f"{', '.join(small)}: each must be a positive count (--prefill-chunk 2 or more with --graphs)"
    if args.hidden % args.heads or args.heads % args.kv_heads or args.prompt_lens[0] < 1 \
            or args.prompt_lens[0] > args.prompt_lens[1]:
        return "--hidden must divide by --heads, --heads by --kv-heads, and 1 <= MIN <= MAX in --prompt-lens"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout {args.timeout:g}: give a positive number of seconds"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda needs a CUDA GPU (none is visible to torch); use --device cpu"
    return memory_refusal(args)


def memory_refusal(args) -> str | None:
    """The model and its KV pools against the memory there is (the host's available memory, or the GPU's),
    before anything is allocated: one line naming what to make smaller, or None. The model: its weights
    built in fp32 and cast (the unmodified copy too, with --check); the pools: --pages of --page-size
    tokens, or by default --max-batch sequences of the longest prompt and --new-tokens; every K/V head
    on this rank (the most a rank holds), in every layer."""
    from tpattn.memory import HEADROOM, host_available, kv_token_bytes
    el = {"fp32": 4, "fp64": 8, "fp16": 2, "bf16": 2}[args.dtype]
    h, d = args.hidden, args.hidden // args.heads
    params = 2 * args.vocab * h + args.layers * (2 * h * h + 2 * h * args.kv_heads * d + 6 * h * h)
    weights = params * (4 + el) * (2 if args.check else 1)
    tokens = (args.pages * args.page_size if args.pages is not None
              else args.max_batch * (args.prompt_lens[1] + args.new_tokens + args.page_size))
    per_token = kv_token_bytes(args.kv_heads, d, el, args.kv_dtype == "fp8") * args.layers
    pools = tokens * per_token
    if args.device == "cuda":
        there = torch.cuda.get_device_properties(0).total_memory
    else:
        there = host_available()
        if there is None:
            return None
    if weights + pools <= there * HEADROOM:
        return None
    what = ("--pages / --page-size, or --max-batch / --new-tokens" if pools > weights
            else "--hidden, --layers or --vocab")
    return (f"the model and its KV pools need about {(weights + pools) / 2**30:.1f} GiB (weights "
            f"{weights / 2**30:.1f}, pools {pools / 2**30:.1f}) but {there / 2**30:.1f} GiB is available on "
            f"{'the GPU' if args.device == 'cuda' else 'this node'}; make {what} smaller")


def main(argv=None) -> int:
    """Every refusal is one line on every rank and exit 2: the arguments' (the same on every rank,
    checked together before any collective) and the layers' and the pool's (a world size that does
    not divide the heads, a pool too small for a prompt)."""
    args = parse_args(argv)
    from tpattn import dist as tdist
    from tpattn.errors import ConfigError
    try:
        proc = tdist.discover()
    except ConfigError as exc:  # (discover makes every rank print its line before any exits)
        print(f"serve_llama.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    who = f"serve_llama.py: rank {proc.rank}: " if proc.distributed else "serve_llama.py: "
    # the ranks meet within the default time when --timeout is not a time (refusal() says so, on every rank)
    wait = args.timeout if math.isfinite(args.timeout) and args.timeout > 0 else 300.0
    try:
        tdist.rendezvous(proc, wait)
    except tdist.LaunchError as exc:
        print(f"{who}error: {exc}", file=sys.stderr, flush=True)
        tdist.exit_now(1)
    error, _ = tdist.agree(proc, vars(args), refusal(args), {}, wait)
    code = 2
    if error is None:
        device = tdist.pick_device(proc, args.device)
        proc.device = device
        if proc.distributed:
            tdist.init_process_group(proc, "gloo", device, wait)
        try:
            code = serve(args, proc, device)
        except ConfigError as exc:  # the layers' and the pool's refusals, raised on every rank alike: in flags
            error = in_flags(getattr(exc, "cli_message", str(exc)))
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    if error is not None:
        print(f"{who}error: {error}", file=sys.stderr, flush=True)
    tdist.leave(proc, wait, code)  # no rank exits before every rank has printed its line
    tdist.exit_now(code)
    return code


def in_flags(message: str) -> str:
    """A refusal in tpattn's CLI flags or API arguments, in this script's flags: --kernel is --backend,
    the head dim is --hidden / --heads, generate(pages=N) is --pages N."""
    message = re.sub(r"generate\(pages=(\d+)\)", r"--pages \1", message)
    message = re.sub(r"--kernel (\w+)", r"--backend \1", message)
    return re.sub(r"--head-dim\b", "a head dim (--hidden / --heads) of", message)


def serve(args, proc, device) -> int:
    """Build the model, parallelize it, serve the prompts (timed), and --check. Returns the exit status."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpattn.paged import PagedKV

    import tpattn.hf as hf
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    dtype = {"fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    lo, hi = args.prompt_lens
    lens = torch.randint(lo, hi + 1, (args.prompts,)).tolist()
    prompts = [torch.randint(0, args.vocab, (n,)).tolist() for n in lens]
    tp = hf.parallelize(model, backend=args.backend, **({"uneven_heads": True} if args.uneven_heads else {}))
    kv_dtype = None if args.kv_dtype == "model" else args.kv_dtype

    def run(prompts, new_tokens):
        return tp.generate(prompts, new_tokens, max_batch=args.max_batch, pages=args.pages, page_size=args.page_size,
                           graphs=args.graphs, kv_dtype=kv_dtype, prefill_chunk=args.prefill_chunk)
    if device.type == "cuda":  # untimed: the first use of each kernel file compiles it (NVRTC, tens of
        t0 = time.perf_counter()  # seconds on a fresh cache), which is not serving
        run(prompts, 2)
        if proc.rank == 0:
            print(f"warm-up (the kernels compiled or loaded from CuPy's cache, 2 tokens a prompt): "
                  f"{time.perf_counter() - t0:.2f} s, not timed below", flush=True)
    t0 = time.perf_counter()
    tokens = run(prompts, args.new_tokens)
    dt = time.perf_counter() - t0
    n = sum(len(t) for t in tokens)
    if proc.rank == 0:
        print(f"{args.prompts} prompts of {min(lens)}-{max(lens)} tokens, {n} tokens generated in {dt:.2f} s: "
              f"{n / dt:.1f} tokens/s ({proc.world} rank(s), at most {args.max_batch} sequences live, pages of "
              f"{args.page_size}{'; decode steps CUDA-graphed' if args.graphs else ''}"
              f"{f'; prompts in chunks of {args.prefill_chunk}' if args.prefill_chunk else ''})", flush=True)
        per = PagedKV.bytes_per_token(list(tp.attention), kv_dtype)
        print(f"KV cache: {per:g} bytes a token on rank 0 ({args.kv_dtype if kv_dtype else args.dtype} pages of "
              f"{args.page_size}, {args.layers} layers)", flush=True)
    ok = True
    if args.check:
        with torch.no_grad():
            want = [model.generate(torch.tensor([p], device=device), max_new_tokens=args.new_tokens, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]
        same = sum(a == b for a, b in zip(tokens, want))
        ok = same == len(prompts)
        if kv_dtype == "fp8" or args.dtype in ("fp16", "bf16"):  # e4m3 K and V, and a 16-bit model's roundings
            # (other than the unmodified model's), move near ties: rank each token as the unmodified model does
            ranks = teacher_forced_ranks(model, prompts, tokens, device)
            ok = max(ranks) < TOP
            if proc.rank == 0:
                print(f"check: {same} of {len(prompts)} prompts' tokens identical to the unmodified model's; of "
                      f"{len(ranks)} tokens, {sum(r == 0 for r in ranks)} its first choice; every token within its "
                      f"top {TOP} (teacher-forced): {'PASS' if ok else 'FAIL'} (worst rank {max(ranks) + 1})", flush=True)
        elif proc.rank == 0:
            print(f"check: {same} of {len(prompts)} prompts' tokens identical to the unmodified model's "
                  f"{'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


TOP = 5  # --check with --kv-dtype fp8 or a 16-bit --dtype: every token among the unmodified model's first TOP


@torch.no_grad()
def teacher_forced_ranks(model, prompts, tokens, device) -> list[int]:
    """Each generated token's rank (0: first) in the unmodified model's logits at its position, the
    model fed the prompt and the tokens generated before it."""
    ranks = []
    for p, t in zip(prompts, tokens):
        logits = model(torch.tensor([p + t[:-1]], device=device)).logits[0, len(p) - 1:]
        ranks += (logits > logits.gather(1, torch.tensor(t, device=device)[:, None])).sum(1).tolist()
    return ranks


if __name__ == "__main__":
    sys.exit(main())
