"""Run under mpirun -n 2, 3 or 4 by tests/test_paged.py (CPU, gloo): serving through the paged KV
cache over several ranks (at 3, the heads split unevenly: uneven_heads=True). Prints 'PAGED PASS
rank R' and exits 0, or what failed and exits 1.

- Every row of a ragged prefill (three prompts of their own lengths in one packed call) and of the
  decode steps after it (sequences leaving as their budgets end), through pages of 4 tokens, against
  each sequence's whole forward in one process, float64, with rotary positions and without, for
  G = H, a grouped G and G = 1.

- A transformers Llama model (random weights, float64) with its attention split over the ranks
  (tpattn.hf.parallelize): greedy tokens for prompts of different lengths and budgets, at most 2
  live at once, identical to the unmodified model's, with K/V heads split (G = 4) and held as
  copies (G = 1); with the FP8 cache (kv_dtype="fp8"), the tokens of one process's FP8 cache.
- A prompt in chunks through ChunkGraphs' fixed tensors (capture=False) gives the rows of the same
  chunks run eagerly, the output sum of each over the ranks.
- A paged step whose row counts differ between ranks is refused with the same line on every rank,
  before any rank attends (no rank waits in a collective); so is a pool whose pages or kv_dtype
  differ between ranks, when it is built.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tpattn.hf as hf
from tpattn.dist import exit_now, init_distributed
from tpattn.errors import ConfigError
from tpattn.paged import PagedKV

proc = init_distributed(backend="gloo", timeout=60)
W, R = proc.world, proc.rank
bad = []
prompts = [[3, 5, 7, 11, 2, 9], [4, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [8], [50, 60, 70]]
budget = [9, 4, 6, 12, 5]

UNEVEN = W == 3  # 4 query heads over 3 ranks: whole K/V groups per rank (G = 4 only: one group can't be split)

# ---- every row, ragged and paged, against one process's whole forward (float64) --------------------
from tpattn.layer import TensorParallelAttention  # noqa: E402

# query heads on ranks 0, 1, ...: W = 2: 3, 3 (G = 6 and 1) and 4, 2 (G = 3: whole groups); W = 3: 3, 3, 2 and
# 4, 2, 2 (whole groups); W = 4: 2 each, the K/V heads split (G = 8, 4) or held as copies (G = 2)
E, H = (48, 6) if W == 2 else (64, 8)
for G in {2: (6, 3, 1), 3: (8, 4), 4: (8, 4, 2)}[W]:
    for theta in (1e4, None):
        torch.manual_seed(0)
        d = E // H
        full = {k: (torch.randn(E, n * d) / E ** 0.5).double() for k, n in (("wq", H), ("wk", G), ("wv", G))}
        full["wo"] = (torch.randn(H * d, E) / E ** 0.5).double()
        kw = dict(heads=H, kv_heads=G, causal=True, rope_theta=theta)
        layer = TensorParallelAttention.from_full(**full, uneven_heads=UNEVEN or G % W != 0, **kw)
        if W == 3 and layer.local_heads != [4 if G == 4 else 3, 2 if G == 4 else 3, 2][R]:
            bad.append(f"H={H} G={G}: rank {R} holds {layer.local_heads} query heads, not the uneven split")
        one = TensorParallelAttention.from_full(**full, group=None, **kw)
        pool = PagedKV(layer, pages=32, page_size=4, max_seqs=4)
        lens, extra = [5, 9, 2], [3, 1, 4]  # prompt lengths, then decode steps each
        xs = [torch.randn(1, n + e, E, dtype=torch.float64) for n, e in zip(lens, extra)]
        ids = [pool.add() for _ in lens]
        out = [[] for _ in lens]
        with torch.no_grad():
            with pool.step(ids, lens) as st:
                y = layer(torch.cat([x[:, :n] for x, n in zip(xs, lens)], 1), cache=st.view(0))
            for i, c in enumerate([0, 5, 14]):
                out[i].append(y[:, c:c + lens[i]])
            pos = list(lens)
            for t in range(max(extra)):
                live = [i for i in range(3) if t < extra[i]]
                with pool.step([ids[i] for i in live], [1] * len(live)) as st:
                    y = layer(torch.cat([xs[i][:, pos[i]:pos[i] + 1] for i in live], 0), cache=st.view(0))
                for j, i in enumerate(live):
                    out[i].append(y[j:j + 1])
                    pos[i] += 1
            err = max((torch.cat(o, 1) - one(x)).abs().max().item() for o, x in zip(out, xs))
        if not err < 1e-12:
            bad.append(f"H={H} G={G} rope={theta}: paged rows off the whole forward by {err:.3g}")

for G in ((4,) if UNEVEN else (4, 1)):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=G, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).double().eval()
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p, n in zip(prompts, budget)]
    tp = hf.parallelize(model, **({"uneven_heads": True} if UNEVEN else {}))
    got = tp.generate(prompts, budget, max_batch=2, page_size=4)
    if got != want:
        bad.append(f"G={G}: tokens {got} differ from the unmodified model's {want}")
    chunked = tp.generate(prompts, budget, max_batch=3, page_size=4, prefill_chunk=3)  # prompts over several steps
    if chunked != want:
        bad.append(f"G={G}: tokens in prefill chunks of 3 {chunked} differ from the unmodified model's {want}")
    # the FP8 cache: each token's row quantized alone, per K/V head, so splitting the heads over the
    # ranks changes nothing: the same tokens as one process's FP8 cache
    one = hf.parallelize(model, group=None).generate(prompts, budget, max_batch=2, page_size=4, kv_dtype="fp8")
    split = tp.generate(prompts, budget, max_batch=2, page_size=4, kv_dtype="fp8")
    if split != one:
        bad.append(f"G={G}: FP8-cache tokens {split} differ from one process's {one}")
    if tp.attention[0].local_heads != (2 if UNEVEN and R == 0 else 4 // W if not UNEVEN else 1):
        bad.append(f"G={G}: rank {R} holds {tp.attention[0].local_heads} query heads")

# ---- a prompt in chunks through ChunkGraphs' fixed tensors (run eagerly: capture=False) ------------
from tpattn.paged import ChunkGraphs  # noqa: E402

layer = tp.attention[0]
torch.manual_seed(1)
x = torch.randn(1, 13, 64, dtype=torch.float64)
rows = {}
for graphed in (True, False):
    pool = PagedKV([layer], pages=8, page_size=4, max_seqs=1)
    sid = pool.add()
    chunks = ChunkGraphs(pool, lambda xs, st: layer(xs, cache=st.view(0)), x[:, :4], max_len=16, capture=False)
    out = []
    with torch.no_grad():
        for c0 in range(0, 13, 4):
            n = min(4, 13 - c0)
            if graphed and n == 4:
                out.append(chunks.step(sid, x[:, c0:c0 + 4]))
            else:
                with pool.step([sid], [n]) as st:
                    out.append(layer(x[:, c0:c0 + n], cache=st.view(0)))
    rows[graphed] = torch.cat(out, 1)
if (rows[True] - rows[False]).abs().max().item() > 1e-12:
    bad.append("ChunkGraphs' fixed-tensor chunks differ from the same chunks run eagerly")

# ---- a step that differs between ranks: one line on every rank, nobody waits ----------------------
pool = PagedKV(list(tp.attention), pages=8, page_size=4, max_seqs=2)
a = pool.add()
try:
    pool.step([a], [2 + (R == W - 1)])
    said = "no error"
except ConfigError as exc:
    said = str(exc)
if "the ranks' paged-cache calls differ" not in said or "every rank must add, step and remove" not in said:
    bad.append(f"a step that differs between ranks: {said}")

# ---- generate's graphed chunks: a rank whose layers would take ChunkGraphs and one whose would not ----
# (decided alike on every rank, or refused in one line on every rank: no rank left in ChunkGraphs' gather)
import tpattn.paged as paged_mod  # noqa: E402


class _EagerDecode(paged_mod.DecodeGraphs):
    def __init__(self, *a, **kw):
        super().__init__(*a, **{**kw, "capture": False})


real_refusal, real_decode = paged_mod.chunk_graph_refusal, paged_mod.DecodeGraphs
paged_mod.DecodeGraphs = _EagerDecode
paged_mod.chunk_graph_refusal = (lambda layer, pool: None) if R == 0 else real_refusal
try:
    tp.generate(prompts, budget, max_batch=2, page_size=4, graphs=True, prefill_chunk=3)
    said = "no error"
except ConfigError as exc:
    said = str(exc)
paged_mod.chunk_graph_refusal, paged_mod.DecodeGraphs = real_refusal, real_decode
if "the ranks' paged-cache calls differ" not in said or "generate's graphed chunks" not in said:
    bad.append(f"graphed chunks chosen differently on the ranks: {said}")

# ---- pools built differently on the ranks: refused at construction, on every rank ------------------
for kw in ({"pages": 8 + (R == W - 1)}, {"kv_dtype": "fp8" if R == 0 else None}):
    try:
        PagedKV(list(tp.attention), page_size=4, max_seqs=2, **{"pages": 8, **kw})
        said = "no error"
    except ConfigError as exc:
        said = str(exc)
    if "the ranks' paged-cache calls differ (rank 0: PagedKV(" not in said or "in a pool built alike" not in said:
        bad.append(f"a pool built differently ({kw}): {said}")

# ---- a pool that one rank refuses (its own check): the same refusal on every rank, none left waiting -----
try:
    PagedKV(list(tp.attention), pages=0 if R == W - 1 else 8, page_size=4, max_seqs=2)
    said = "no error"
except ConfigError as exc:
    said = str(exc)
if "needs pages, page_size and max_seqs >= 1 (got 0, 4, 2)" not in said or \
        (R != W - 1 and f"rank {W - 1} refused this paged cache" not in said):
    bad.append(f"a pool one rank refuses: {said}")

for b in bad:
    print(f"rank {R}: FAIL {b}", flush=True)
if not bad:
    print(f"PAGED PASS rank {R}", flush=True)
exit_now(1 if bad else 0)
