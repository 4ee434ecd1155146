"""Run under mpirun by tests/test_gpu_layer.py: the one-shot peer all-reduce (tpattn/peer.py,
kernels/peer_reduce.cu) over gloo, with the ranks sharing one GPU or on one GPU each.

    python tests/mpi_oneshot_check.py          the kernel, the layer's choice, decoding, a CUDA graph
    python tests/mpi_oneshot_check.py late     the last rank never calls: the others' kernels stop

The kernel against torch bit for bit (every dtype pair, rows whose width divides by 4 and not, with
and without b_o, many calls in a row on the same buffers); the layer with output_collective="auto"
choosing it for a decode step's partials and NCCL's/gloo's collectives for large ones, its prefill +
decode against the single-process layer, every rank's output the same bits; a graphed decode step
against the eager steps bit for bit; a compiled decode step (the output GEMM and the kernel as one
op, tpattn::peer_sum) without a graph break, against the eager steps; a rank that cannot map the others' buffers: auto falls back on
every rank, "oneshot" raises the same line on every rank. Prints 'ONESHOT PASS rank R' and exits 0,
or the failures and exit 1. Mode late prints 'ONESHOT STOPPED rank R after S s' on the waiting ranks
(a rank stuck for 30 s prints where and exits 1)."""

import faulthandler
import sys
import time

import torch

from tpattn import peer
from tpattn.comm import Comm
from tpattn.dist import exit_now, init_distributed
from tpattn.layer import TensorParallelAttention

proc = init_distributed(backend="gloo", timeout=120)
W, R, dev = proc.world, proc.rank, proc.device
comm = Comm(torch.distributed.group.WORLD, R, W)
bad: list[str] = []


def mapped(capacity: int, part_dtype: torch.dtype, out_dtype: torch.dtype) -> peer.OneShotBuffers:
    buf = peer.OneShotBuffers(capacity, part_dtype, out_dtype, dev, R, W)
    why = buf.open(comm.all_gather_object(buf.exported))
    whys = [w for w in comm.all_gather_object(why) if w]
    if whys:
        raise SystemExit(f"rank {R}: mapping failed: {whys[0]}")
    return buf


if sys.argv[1:] == ["late"]:
    buf = mapped(1024, torch.float32, torch.float32)
    peer.ONESHOT_TIMEOUT_S = 3  # rank r's kernel stops after 3 + 3 r s (peer.ONESHOT_STAGGER_S)
    faulthandler.dump_traceback_later(30, exit=True)  # a rank stuck after its kernel stopped: where, then exit
    if R < W - 1:  # the last rank never comes
        t0 = time.time()
        try:
            buf.all_reduce(torch.empty(4, 256, device=dev))
            torch.cuda.synchronize()
            print(f"ONESHOT RETURNED rank {R}: it should have stopped", flush=True)
        except Exception as exc:  # noqa: BLE001 - the trapped kernel's error
            print(f"ONESHOT STOPPED rank {R} after {time.time() - t0:.1f} s: {str(exc).splitlines()[0][:100]}",
                  flush=True)
    comm.all_gather_object(None)  # the last rank waits here until the others are done
    faulthandler.cancel_dump_traceback_later()
    exit_now(0)

# ---- the kernel against torch's sum in rank order, bit for bit -----------------------------------
for part_dtype, out_dtype in sorted(peer.PAIRS, key=str):
    buf = mapped(16 * 4096, part_dtype, out_dtype)
    for rows, dim, with_bias in ((1, 4096, True), (3, 1000, False), (5, 7, True), (16, 4096, False), (2, 33, False)):
        for call in range(8):
            gen = torch.Generator().manual_seed(1000 * call + 10 * rows + dim)
            parts = [torch.randn(rows, dim, generator=gen).to(part_dtype) for _ in range(W)]
            bias = torch.randn(dim, generator=gen).to(out_dtype) if with_bias else None
            buf.partial(rows, dim).copy_(parts[R])
            out = torch.empty(rows, dim, dtype=out_dtype, device=dev)
            buf.all_reduce(out, None if bias is None else bias.to(dev))
            want = parts[0].float()
            for p in parts[1:]:
                want = want + p.float()
            if bias is not None:
                want = want + bias.float()
            if not torch.equal(out.cpu(), want.to(out_dtype)):
                bad.append(f"{part_dtype}->{out_dtype} rows={rows} dim={dim} bias={with_bias} call {call}: "
                           f"max diff {(out.cpu().float() - want).abs().max().item():.3g}")
    buf.close()


def same_on_every_rank(name: str, t: torch.Tensor) -> None:
    got = comm.all_gather_object(t.cpu().float().numpy().tobytes())
    if len(set(got)) != 1:
        bad.append(f"{name}: the ranks' outputs differ")


# ---- the layer: auto chooses it for a decode step's partials, and decodes with it ----------------
torch.manual_seed(0)
heads, d, B, N, T = 8, 64, 2, 40, 6
mha = torch.nn.MultiheadAttention(heads * d, heads, batch_first=True).to(dev, torch.float16)
x = torch.randn(B, N + T, heads * d, device=dev, dtype=torch.float16)
single = TensorParallelAttention.from_multihead_attention(mha, causal=True, backend="fused", group=None)
layer = TensorParallelAttention.from_multihead_attention(mha, causal=True, backend="fused")
with torch.no_grad():
    want_full = single(x)
    cache = layer.new_cache(B, N + T)
    ys = [layer(x[:, :N], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(N, N + T)]
    y = torch.cat(ys, 1)
    big = layer(torch.randn(B, 512, heads * d, device=dev, dtype=torch.float16))  # 2 MiB of fp32 partials
for (b, n, decode), want in (((B, 1, True), "oneshot"), ((B, N, True), "oneshot"), ((B, 512, False), "split")):
    got = layer.plan(b, n, decode=decode).collective
    if got != want:
        bad.append(f"auto chose {got} for {b} x {n} rows (decode {decode}), expected {want}")
err = (y.float() - want_full.float()).abs().max().item()
if not err < 2e-2 * want_full.float().abs().max().item():
    bad.append(f"prefill + decode against the single-process layer: max err {err:.3g}")
same_on_every_rank("prefill + decode", y)
same_on_every_rank("a large forward", big)

# ---- a graphed decode step replays the eager steps bit for bit ----------------------------------
with torch.no_grad():
    g_cache = layer.new_cache(B, N + T)
    xs = x[:, N:N + 1].clone()
    step = layer.graphed(xs, g_cache)
    got = [layer(x[:, :N], cache=g_cache)]
    for t in range(N, N + T):
        xs.copy_(x[:, t:t + 1])
        got.append(step().clone())
if not torch.equal(torch.cat(got, 1), y):
    bad.append("the graphed steps differ from the eager ones")

# ---- torch.compile: the output GEMM and the one-shot kernel as one op (tpattn::peer_sum) ----------
import torch._dynamo as dynamo  # noqa: E402


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = layer

    def forward(self, t, c):
        return self.attn(t, cache=c)


with torch.no_grad():
    model = Decoder()
    e_cache = layer.new_cache(B, N + T)
    layer(x[:, :N], cache=e_cache)
    found = dynamo.explain(model)(x[:, N:N + 1], e_cache)
    dynamo.reset()
    e_cache.reset()
    c_cache = layer.new_cache(B, N + T)
    layer(x[:, :N], cache=e_cache)
    layer(x[:, :N], cache=c_cache)
    compiled = torch.compile(model)
    want = torch.cat([layer(x[:, t:t + 1], cache=e_cache) for t in range(N, N + T)], 1)
    got = torch.cat([compiled(x[:, t:t + 1], c_cache) for t in range(N, N + T)], 1)
    dynamo.reset()
if found.graph_break_count:
    bad.append(f"a compiled one-shot decode step breaks its graph: {[str(b.reason)[:120] for b in found.break_reasons]}")
if (got.float() - want.float()).abs().max().item() > 1e-2:
    bad.append(f"the compiled one-shot steps differ from eager by {(got.float() - want.float()).abs().max().item():.3g}")
same_on_every_rank("the compiled one-shot steps", got)

# ---- a rank that cannot map the others: auto falls back, "oneshot" refuses, on every rank --------
real_open = peer.OneShotBuffers.open
if R == W - 1:
    peer.OneShotBuffers.open = lambda self, exported: f"rank {R} cannot map rank 0's buffer (simulated)"
with torch.no_grad():
    fallback = TensorParallelAttention.from_multihead_attention(mha, causal=True, backend="fused")
    c2 = fallback.new_cache(B, N + T)
    y2 = torch.cat([fallback(x[:, :N], cache=c2)] + [fallback(x[:, t:t + 1], cache=c2) for t in range(N, N + T)], 1)
    how = fallback.plan(B, 1, decode=True).collective
    if how == "oneshot" or fallback.peers.said is None or fallback.peers.said[1]:
        bad.append(f"with a rank that cannot map, auto chose {how}")
    if (y2.float() - y.float()).abs().max().item() > 1e-2:
        bad.append("the fallback's decode differs from the one-shot decode")
    named = TensorParallelAttention.from_multihead_attention(mha, causal=True, backend="fused",
                                                             output_collective="oneshot")
    try:
        named(x[:, :1])
        said = "no error"
    except ValueError as exc:
        said = str(exc)
peer.OneShotBuffers.open = real_open
said_all = comm.all_gather_object(said)
if len(set(said_all)) != 1 or "cannot map rank 0's buffer (simulated)" not in said:
    bad.append(f"oneshot with a rank that cannot map: {said_all}")

print(f"ONESHOT {'FAIL' if bad else 'PASS'} rank {R} of {W} on {dev}: " + "; ".join(bad), flush=True)
comm.all_gather_object(None)
exit_now(1 if bad else 0)
