"""A transformers Llama model with tensor-parallel attention, serving a batch of prompts.

    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(...)).eval()
    tp = tpattn.hf.parallelize(model)            # every LlamaAttention -> TensorParallelAttention
    tokens = tp.generate([[1, 5, 9], [1, 7]], max_new_tokens=16)   # greedy, each prompt its own length

Every rank holds the whole model (embeddings, norms, MLPs, the head: replicated) except the
attention, whose heads (and K/V heads) are split over the ranks of `group` as the layer splits
them. generate() serves the prompts by continuous batching over one paged KV cache
(tpattn.paged.PagedKV) shared by the model's layers: at most max_batch sequences are live; a
prompt joins as soon as a slot is free (its prefill packed with the other newcomers'), every live
sequence takes one decode step together, and a sequence that reaches its token budget or the end
token leaves, its pages going back to the pool. The same calls happen on every rank (the prompts
must be the same everywhere), so the block tables agree.
"""

from __future__ import annotations

import math
import numbers

import torch

from .errors import ConfigError, is_count
from .layer import TensorParallelAttention
from .module import WORLD
from .paged import PAGE_SIZE, PagedKV


def parallelize(model, group=WORLD, backend: str = "reference", **kw) -> "ParallelLlama":
    """A ParallelLlama over `model` (a transformers LlamaForCausalLM): its attention layers as
    tensor-parallel layers on `group` (from_hf_llama: this rank's heads), the rest used as it is.
    Keyword arguments go to the layers' constructor (e.g. uneven_heads=True)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        raise ConfigError(f"parallelize takes a transformers LlamaForCausalLM (got {type(model).__name__})")
    attn = [TensorParallelAttention.from_hf_llama(layer.self_attn, group=group, backend=backend, **kw)
            for layer in inner.layers]
    return ParallelLlama(model, attn)


class ParallelLlama(torch.nn.Module):
    """A Llama model whose attention layers are tensor-parallel; generate() serves prompts."""

    def __init__(self, model, attention: list):
        super().__init__()
        # the model itself is held, not registered: its LlamaAttention layers are not this module's (their
        # full weights would count among its parameters, its state_dict and an optimizer's, and never get a
        # gradient); the parts generate() runs are registered instead, the same module objects
        object.__setattr__(self, "model", model)
        m = model.model
        self.attention = torch.nn.ModuleList(attention)
        self.parts = torch.nn.ModuleDict({
            "embed_tokens": m.embed_tokens, "norm": m.norm, "lm_head": model.lm_head,
            "blocks": torch.nn.ModuleList(torch.nn.ModuleDict({"input_layernorm": b.input_layernorm, "mlp": b.mlp,
                                                               "post_attention_layernorm": b.post_attention_layernorm})
                                          for b in m.layers)})

    def _hidden(self, ids: torch.Tensor, step) -> torch.Tensor:
        """The last hidden states [1, R, D] of the packed rows `ids` [R] of a paged step."""
        return self._blocks(self.model.model.embed_tokens(ids)[None], step)

    def _blocks(self, h: torch.Tensor, step) -> torch.Tensor:
        """The decoder blocks and the final norm over the embedded rows h [1, R, D] of a paged step."""
        m = self.model.model
        for i, (block, attn) in enumerate(zip(m.layers, self.attention)):
            h = h + attn(block.input_layernorm(h), cache=step.view(i))
            h = h + block.mlp(block.post_attention_layernorm(h))
        return m.norm(h)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens, max_batch: int = 8, pages: int | None = None,
                 page_size: int = PAGE_SIZE, eos_token_id: int | None = -1, graphs: bool = False,
                 kv_dtype: str | None = None, prefill_chunk: int | None = None) -> list[list[int]]:
        """Greedy tokens after each prompt (up to max_new_tokens, one number or one per prompt,
        ending early at the end token: eos_token_id, by default the model's), in the prompts' order.
        pages: the pool's size (by default enough for max_batch of the longest sequences).
        graphs: newcomers' prefills in steps of their own, and every decode step of the live
        sequences under a CUDA graph of its batch-size bucket (tpattn.paged.DecodeGraphs; on a GPU).
        kv_dtype: the pool's pages, "fp8" (e4m3, a scale per token and K/V head: about half the bytes of
        fp16, the attention read from dequantized pages) or None (the model's dtype).
        prefill_chunk: the most prompt rows a step takes (chunked prefill; None: a newcomer's whole
        prompt in its first step). Eagerly, a step packs every live sequence's next token with up to
        prefill_chunk rows of the prompts still being read, so a long prompt does not hold the others'
        decoding back for its whole prefill. With graphs, a newcomer's prompt goes in chunks of
        prefill_chunk rows, each a replay of one CUDA graph (tpattn.paged.ChunkGraphs: the fused
        backend's paged prefill kernel; eager steps where the layers do not take it:
        paged.chunk_graph_refusal), its last, shorter chunk eagerly."""
        prompts = _token_lists(prompts, self.model.get_input_embeddings().num_embeddings)
        budget = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        if (len(budget) != len(prompts) or not all(is_count(n) for n in budget + [max_batch])
                or (pages is not None and not is_count(pages))):
            raise ConfigError(f"generate needs max_new_tokens a positive int (one, or one per prompt), max_batch and "
                              f"pages positive ints (got {max_new_tokens}, {max_batch}, {pages})")
        if not is_count(page_size):
            raise ConfigError(f"generate takes page_size a positive int, the tokens a page holds (got {page_size!r})")
        if not isinstance(graphs, bool):
            raise ConfigError(f"generate takes graphs True or False (got {graphs!r})")
        if prefill_chunk is not None and (not is_count(prefill_chunk) or (graphs and prefill_chunk < 2)):
            what = ("2 or more with graphs=True, a chunk being a graph of several rows" if graphs
                    else "the most prompt rows a step takes")
            raise ConfigError(f"generate takes prefill_chunk a positive int ({what}) or None (got {prefill_chunk!r})")
        eos = getattr(self.model.generation_config, "eos_token_id", None) if eos_token_id == -1 else eos_token_id
        ends = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        longest = max(len(p) + n for p, n in zip(prompts, budget))
        if pages is None:
            pages = min(len(prompts), max_batch) * -(-longest // page_size)
        pool = PagedKV(list(self.attention), pages=pages, page_size=page_size, max_seqs=max_batch, kv_dtype=kv_dtype)
        device = self.attention[0].wqkv.device
        if graphs:
            return self._generate_graphed(pool, prompts, budget, ends, longest, max_batch, device, prefill_chunk)
        waiting = list(range(len(prompts)))
        out: list[list[int]] = [[] for _ in prompts]
        live: dict[int, int] = {}  # sequence id -> prompt index
        fed: dict[int, int] = {}   # sequence id -> its prompt's rows in the cache so far
        while waiting or live:
            for s, i in _admit(pool, waiting, live, max_batch, prompts, budget):  # newcomers
                live[s], fed[s] = i, 0
            ids, rows, toks = [], [], []
            room = prefill_chunk if prefill_chunk is not None else math.inf  # prompt rows this step may take
            for s, i in live.items():  # decoding sequences first: their last token
                if fed[s] == len(prompts[i]):
                    ids.append(s)
                    rows.append(1)
                    toks.append(out[i][-1])
            for s, i in live.items():  # then the prompts still being read, as much as the room allows
                n = min(len(prompts[i]) - fed[s], room)
                if fed[s] < len(prompts[i]) and n > 0:
                    ids.append(s)
                    rows.append(n)
                    toks.extend(prompts[i][fed[s]:fed[s] + n])
                    fed[s] += n
                    room -= n
            with pool.step(ids, rows) as step:
                h = self._hidden(torch.tensor(toks, dtype=torch.long, device=device), step)
            ready = [j for j, s in enumerate(ids) if fed[s] == len(prompts[live[s]])]  # (a prompt read to its end)
            last = torch.tensor([step.cu[j + 1] - 1 for j in ready], device=device)  # those sequences' last rows
            nxt = self.model.lm_head(h[0, last]).argmax(-1).tolist() if ready else []
            for j, t in zip(ready, nxt):
                s = ids[j]
                out[live[s]].append(t)
                if len(out[live[s]]) >= budget[live[s]] or t in ends:
                    del live[s], fed[s]
                    pool.remove(s)
        return out

    def _generate_graphed(self, pool, prompts, budget, ends, longest, max_batch, device, prefill_chunk):
        """generate(graphs=True): the same continuous batching, prefills apart (in graphed chunks of
        prefill_chunk rows, when given), decode steps replayed."""
        from . import paged

        def decode(tokens, st):  # the model's step: next token of each row
            return self.model.lm_head(self._hidden(tokens, st)[0]).argmax(-1)
        buckets = sorted({b for b in paged.BUCKETS if b < max_batch} | {max_batch})
        steps = paged.DecodeGraphs(pool, decode, torch.zeros(max_batch, dtype=torch.long, device=device),
                                   max_len=longest, buckets=buckets)
        embed = self.model.model.embed_tokens
        chunks = None  # whole chunks as graph replays where the layers take the paged prefill kernel, else eager
        if prefill_chunk is not None:
            why = next(filter(None, (paged.chunk_graph_refusal(a, pool) for a in pool.layers)), None)
            pool._agree("generate's graphed chunks", (why is None,))  # (the ranks choose alike, or all stop)
            if why is None:
                like = embed(torch.zeros(1, prefill_chunk, dtype=torch.long, device=device))
                chunks = paged.ChunkGraphs(pool, self._blocks, like, max_len=longest)
        waiting = list(range(len(prompts)))
        out: list[list[int]] = [[] for _ in prompts]
        live: dict[int, int] = {}

        def took(s: int, t: int) -> None:
            out[live[s]].append(t)
            if len(out[live[s]]) >= budget[live[s]] or t in ends:
                del live[s]
                pool.remove(s)
        while waiting or live:
            new = _admit(pool, waiting, live, max_batch, prompts, budget)
            if new:  # the newcomers' prefills: whole chunks replayed, then the rest packed together
                live.update(new)
                rest = []
                for s, i in new:
                    at = 0
                    while prefill_chunk is not None and len(prompts[i]) - at > prefill_chunk:  # (a last row stays
                        part = torch.tensor(prompts[i][at:at + prefill_chunk], device=device)  # for the step below)
                        if chunks is not None:
                            chunks.step(s, embed(part[None]))
                        else:
                            with pool.step([s], [prefill_chunk]) as step:
                                self._hidden(part, step)
                        at += prefill_chunk
                    rest.append((s, prompts[i][at:]))
                with pool.step([s for s, _ in rest], [len(r) for _, r in rest]) as step:
                    h = self._hidden(torch.tensor([t for _, r in rest for t in r], dtype=torch.long, device=device), step)
                last = torch.tensor(step.cu[1:], device=device) - 1
                for (s, _), t in zip(rest, self.model.lm_head(h[0, last]).argmax(-1).tolist()):
                    took(s, t)
                continue
            ids = list(live)
            nxt = steps.step(ids, torch.tensor([out[live[s]][-1] for s in ids], dtype=torch.long, device=device))
            for s, t in zip(ids, nxt.tolist()):
                took(s, t)
        return out


def _token_lists(prompts, vocab: int) -> list[list[int]]:
    """The prompts as lists of token ids (a list of lists, or a [B, T] tensor), each id in [0, vocab),
    or one line saying what is wrong."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()] if prompts.dim() == 1 else None
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, (list, tuple)) and p for p in prompts):
        raise ConfigError("generate takes prompts as a list of token-id lists (or a [B, T] tensor), at least one "
                          "prompt of at least one token")
    for i, p in enumerate(prompts):
        bad = [t for t in p if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt {i} holds {bad[0]!r}, not a token id of this model (0 .. {vocab - 1})")
    return [[int(t) for t in p] for p in prompts]


def _admit(pool, waiting: list[int], live: dict, max_batch: int, prompts, budget) -> list[tuple[int, int]]:
    """(sequence id, prompt index) of the waiting prompts that join now, in order: while fewer than
    max_batch are live and the pool's pages hold every live sequence's prompt and new tokens (each
    keeps its pages until it ends, so none runs out of pages mid-way: a prompt that does not fit yet
    waits for others to end); a prompt the pool could never hold is refused in one line."""
    need = (lambda i: -(-(len(prompts[i]) + budget[i]) // pool.page_size))  # noqa: E731
    held = sum(need(i) for i in live.values())
    new = []
    while waiting and len(live) + len(new) < max_batch:
        i = waiting[0]
        if need(i) > pool.pages:
            raise ConfigError(f"prompt {i} ({len(prompts[i])} tokens) and {budget[i]} new tokens need {need(i)} "
                              f"pages of {pool.page_size} tokens, more than the pool's {pool.pages}; pass "
                              f"generate(pages={need(i)}) or more")
        if held + need(i) > pool.pages:
            break
        held += need(i)
        new.append((pool.add(), waiting.pop(0)))
    return new
