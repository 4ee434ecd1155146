"""The paged KV cache (tpattn/paged.py) and the Llama model served through it (tpattn/hf.py), on
CPU: ragged prefill and decode steps against the whole forward of each sequence (float64), pages
freed and reused, the one-line refusals, and greedy tokens identical to the unmodified transformers
model's, with sequences joining and leaving between steps. The multi-rank half is
tests/mpi_paged_check.py."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, mpirun_cmd, rank_lines, run
from tpattn.errors import ConfigError
from tpattn.layer import TensorParallelAttention
from tpattn.paged import PagedKV, _StaticStep


def _layer(kv_heads=4, rope=True, dtype=torch.float64):
    torch.manual_seed(0)
    E, H, d = 32, 4, 8
    w = {n: torch.randn(E, c * d, dtype=dtype) / E ** 0.5 for n, c in (("wq", H), ("wk", kv_heads), ("wv", kv_heads))}
    return TensorParallelAttention.from_full(**w, wo=torch.randn(H * d, E, dtype=dtype) / E ** 0.5,
                                             bo=torch.randn(E, dtype=dtype), heads=H, kv_heads=kv_heads, causal=True,
                                             group=None, rope_theta=1e4 if rope else None)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kv_heads,rope", [(4, True), (2, False), (1, True)])
def test_ragged_prefill_and_steps_match_each_sequences_whole_forward(page_size, kv_heads, rope):
    layer = _layer(kv_heads, rope)
    lens, steps = [7, 3, 18], 6
    xs = [torch.randn(1, n + steps, 32, dtype=torch.float64) for n in lens]
    pool = PagedKV(layer, pages=64, page_size=page_size, max_seqs=4)
    ids = [pool.add() for _ in lens]
    with torch.no_grad():
        with pool.step(ids, lens) as step:
            y = layer(torch.cat([x[:, :n] for x, n in zip(xs, lens)], 1), cache=step.view())
        outs = [[y[:, step.cu[i]:step.cu[i + 1]]] for i in range(3)]
        for t in range(steps):
            with pool.step(ids, [1, 1, 1]) as step:
                y = layer(torch.cat([x[:, n + t:n + t + 1] for x, n in zip(xs, lens)], 0), cache=step.view())
            for i in range(3):
                outs[i].append(y[i:i + 1])
        for i, x in enumerate(xs):
            assert (torch.cat(outs[i], 1) - layer(x)).abs().max().item() < 1e-12, i
    assert [pool.length(s) for s in ids] == [n + steps for n in lens]
    assert pool.free_page_count() == 64 - sum(-(-(n + steps) // page_size) for n in lens)


def test_pages_of_a_removed_sequence_are_reused_and_others_are_untouched():
    layer = _layer()
    pool = PagedKV(layer, pages=6, page_size=4, max_seqs=2)
    a, b = pool.add(), pool.add()
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    with torch.no_grad():
        with pool.step([a, b], [12, 8]) as step:  # 3 + 2 pages
            layer(torch.cat([x[:, :12], x[:, :8]], 1), cache=step.view())
        assert pool.free_page_count() == 1
        pool.remove(a)
        assert pool.free_page_count() == 4 and pool.live == [b]
        c = pool.add()
        with pool.step([c, b], [10, 1]) as step:  # c takes a's pages; b goes on from its own
            y = layer(torch.cat([x[:, 5:15], x[:, 8:9]], 1), cache=step.view())
        assert (y[:, :10] - layer(x[:, 5:15])).abs().max().item() < 1e-12
        assert (y[:, 10:] - layer(x[:, :9])[:, 8:]).abs().max().item() < 1e-12


def test_refusals_name_the_fix():
    layer = _layer()
    pool = PagedKV(layer, pages=3, page_size=4, max_seqs=2)
    a = pool.add()
    with pytest.raises(ConfigError, match=r"no sequence 7 in this pool \(live: \[0\]\); add it with pool.add\(\)"):
        pool.step([7], [1])
    with pytest.raises(ConfigError, match=r"the pool has 3 free pages of 4 tokens and this step needs 4 more; .*"
                                          r"PagedKV\(\.\.\., pages=4 or more\)"):
        pool.step([a], [13])
    pool.add()
    with pytest.raises(ConfigError, match="at most max_seqs=2 sequences, all in use"):
        pool.add()
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        with pool.step([a], [3]) as step:
            with pytest.raises(ConfigError, match=r"x must be \[1, 3, 32\] \(packed\)"):
                layer(x[:, :2], cache=step.view())
            with pytest.raises(ConfigError, match="a step of this pool is still open"):
                pool.step([a], [1])
            layer(x, cache=step.view())
        with pytest.raises(ConfigError, match="this step has ended"):
            layer(x, cache=step.view())
    assert pool.length(a) == 3
    with pytest.raises(ConfigError, match="a KV cache call records no gradients"):
        with pool.step([a], [1]) as step:
            layer(x[:, :1].clone().requires_grad_(), cache=step.view())
    assert pool.length(a) == 3  # the step that failed appended nothing
    other = _layer()
    with torch.no_grad(), pool.step([a], [1]) as step:
        with pytest.raises(ConfigError, match="this view is of the pool's layer 0, not this layer"):
            other(x[:, :1], cache=step.view())


def _llama(layers=2, heads=4, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).double().eval()


PROMPTS = [[3, 5, 7, 11, 2, 9], [4, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [8], [50, 60, 70]]
BUDGET = [9, 4, 6, 12, 5]


def test_llama_generate_gives_the_unmodified_models_tokens():
    """Five prompts of 1-11 tokens with budgets of 4-12 tokens, at most 2 live at once: sequences
    join as others leave (continuous batching); every token is the unmodified model's greedy one."""
    import tpattn.hf as hf
    model = _llama()
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p, n in zip(PROMPTS, BUDGET)]
    tp = hf.parallelize(model, group=None)
    assert tp.generate(PROMPTS, BUDGET, max_batch=2, page_size=4) == want
    assert tp.generate(PROMPTS, BUDGET, max_batch=8) == want
    with pytest.raises(ConfigError, match="parallelize takes a transformers LlamaForCausalLM"):
        hf.parallelize(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"prompt 0 \(6 tokens\) and 9 new tokens need 4 pages of 4 tokens, more than "
                                          r"the pool's 2; pass generate\(pages=4\) or more"):
        tp.generate(PROMPTS, BUDGET, pages=2, page_size=4)
    # a pool that holds the longest sequence but not every live one at once: later prompts wait for
    # pages (none runs out mid-way), and the tokens are the same
    assert tp.generate(PROMPTS, BUDGET, max_batch=4, pages=5, page_size=4) == want
    assert tp.generate(torch.tensor([PROMPTS[4]]), BUDGET[4]) == [want[4]]  # a [B, T] tensor of prompts
    # its parameters: the attention shards and the parts generate() runs, not the original attention's
    # full weights (they would go to an optimizer and never get a gradient); the model is left as it was
    names = [n for n, _ in tp.named_parameters()]
    assert not any("self_attn" in n for n in names) and any(n.startswith("attention.0.") for n in names)
    assert {id(p) for p in tp.parameters()} >= {id(p) for n, p in model.named_parameters() if "self_attn" not in n}
    assert all(hasattr(b, "self_attn") for b in model.model.layers)
    for bad in (0, -1, 2.5):  # (0 was a ZeroDivisionError, -1 and 2.5 blamed pages)
        with pytest.raises(ConfigError, match=rf"generate takes page_size a positive int.*\(got {bad}\)"):
            tp.generate(PROMPTS, BUDGET, page_size=bad)
    for bad, says in (([[3, 97]], r"prompt 0 holds 97, not a token id of this model \(0 \.\. 96\)"),
                      ([[-1]], "prompt 0 holds -1"), ([[2.5]], "prompt 0 holds 2.5"), ([], "a list of token-id lists"),
                      ([[1], []], "at least one prompt of at least one token")):
        with pytest.raises(ConfigError, match=says):
            tp.generate(bad, 3)
    with pytest.raises(ConfigError, match="max_new_tokens a positive int"):
        tp.generate(PROMPTS, 2.5)


@pytest.mark.mpi
def test_paged_serving_on_two_three_and_four_ranks():
    """tests/mpi_paged_check.py on 2, 3 (heads split unevenly) and 4 ranks: every ragged, paged row
    against one process's float64 forward, the tokens of the unmodified model, and calls that differ
    between ranks refused in one line on every rank."""
    for n in (2, 3, 4):
        r = run(mpirun_cmd(n) + [sys.executable, str(ROOT / "tests" / "mpi_paged_check.py")], timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("PAGED PASS") == n, r.stdout + r.stderr


@pytest.mark.mpi
def test_serve_llama_on_three_ranks_and_its_refusals_on_every_rank():
    """scripts/serve_llama.py under mpirun -n 3: 8 heads on 3 ranks refused in one line on every
    rank naming --uneven-heads (exit 2, no traceback); with --uneven-heads, the unmodified model's
    tokens; ranks given different arguments, and a pool too small for a prompt (naming --pages),
    refused the same way."""
    script = [sys.executable, str(ROOT / "scripts" / "serve_llama.py"), "--prompts", "3", "--new-tokens", "4"]
    tag = re.compile(r"serve_llama\.py: rank \d: error: ")
    cases = [(mpirun_cmd(3) + script, "--heads 8 is not divisible by world size 3; with --kv-heads 4 run with a "
              "world size in {1, 2, 4, 8} or change --kv-heads, or pass --uneven-heads", 3),
             (mpirun_cmd(1) + script + [":", "-n", "1"] + script + ["--max-batch", "1"],
              "arguments differ between ranks (max_batch: rank 0 has 4, rank 1 has 1)", 2),
             (mpirun_cmd(2) + script + ["--pages", "2"], "need 3 pages of 16 tokens, more than the pool's 2; pass --pages 3 or more", 2),
             # more memory than there is (it ended in an allocator's traceback on every rank, and SIGABRT)
             (mpirun_cmd(2) + script + ["--pages", "100000000000"], "make --pages / --page-size, or --max-batch / "
              "--new-tokens smaller", 2),
             (mpirun_cmd(2) + script + ["--hidden", "1000000"], "make --hidden, --layers or --vocab smaller", 2)]
    for cmd, needle, n in cases:
        r = run(cmd, timeout=240)
        lines = rank_lines(r.stderr, tag)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert len(lines) == n and all(needle in ln for ln in lines), r.stderr
    r = run(mpirun_cmd(3) + script + ["--uneven-heads", "--check"], timeout=240)
    assert r.returncode == 0 and "(3 rank(s)" in r.stdout and "check: 3 of 3 prompts' tokens identical" in r.stdout \
        and "PASS" in r.stdout, r.stdout + r.stderr


def test_decode_graphs_buckets_pad_and_follow_the_live_set():
    """DecodeGraphs' fixed-tensor steps (run eagerly here: capture=False; tests/test_gpu_paged.py
    replays them as CUDA graphs): the live sequences padded to their bucket, padding rows reading
    nothing and writing only the scratch page, a sequence leaving and one joining between steps;
    every row against each sequence's whole forward."""
    from tpattn.paged import DecodeGraphs
    layer = _layer(2, True)
    lens, T = [5, 9, 3], 7
    xs = [torch.randn(1, n + T, 32, dtype=torch.float64) for n in lens + [4]]
    pool = PagedKV(layer, pages=40, page_size=4, max_seqs=4)
    seqs = {pool.add(): i for i in range(3)}
    graphs = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(4, 1, 32, dtype=torch.float64),
                          max_len=32, buckets=(2, 4), capture=False)
    outs = {i: [] for i in range(4)}
    with torch.no_grad():
        with pool.step(list(seqs), lens) as step:
            y = layer(torch.cat([xs[i][:, :lens[i]] for i in seqs.values()], 1), cache=step.view())
        for j, i in enumerate(seqs.values()):
            outs[i].append(y[:, step.cu[j]:step.cu[j + 1]])
        done = {i: lens[i] for i in range(3)}
        for t in range(T):
            if t == 2:  # the second sequence leaves: 2 live, bucket 2
                sid = next(s for s, i in seqs.items() if i == 1)
                pool.remove(sid)
                del seqs[sid]
            if t == 4:  # a fourth joins with its prompt: 3 live, bucket 4 again
                sid = pool.add()
                seqs[sid] = 3
                with pool.step([sid], [4]) as step:
                    outs[3].append(layer(xs[3][:, :4], cache=step.view()))
                done[3] = 4
            ids = list(seqs)
            rows = torch.cat([xs[seqs[s]][:, done[seqs[s]]:done[seqs[s]] + 1] for s in ids], 0)
            y = graphs.step(ids, rows)
            assert y.shape == (len(ids), 1, 32)
            for s, row in zip(ids, y):
                outs[seqs[s]].append(row[None])
                done[seqs[s]] += 1
        for i in (0, 2, 3):
            n = done[i]
            assert (torch.cat(outs[i], 1) - layer(xs[i][:, :n])).abs().max().item() < 1e-12, i
        assert [b for b in graphs._made] == [4, 2]
        assert (pool.k[0][:pool.pages].abs().sum() > 0) and pool.scratch_page == 40
        # a step's input that is not one row a sequence of x_like's shape and dtype: refused before the step
        # (a [1, 1, D] row was broadcast to every sequence, an fp32 one cast), the lengths left as they were
        ids = list(seqs)
        before = [pool.length(s) for s in ids]
        for bad in (torch.zeros(1, 1, 32, dtype=torch.float64), torch.zeros(len(ids), 1, 32),
                    torch.zeros(len(ids), 1, 31, dtype=torch.float64)):
            with pytest.raises(ConfigError, match="DecodeGraphs.step takes x of one row per sequence"):
                graphs.step(ids, bad)
        assert [pool.length(s) for s in ids] == before
        with pytest.raises(ConfigError, match="needs at least one sequence id"):
            graphs.step([], torch.zeros(0, 1, 32, dtype=torch.float64))
        with pytest.raises(ValueError, match="max_len must be a positive int"):
            DecodeGraphs(pool, lambda x, st: x, torch.zeros(1, 1, 32), max_len=-5, capture=False)


def test_decode_graphs_step_in_place(monkeypatch):
    """DecodeGraphs' in-place step, as layer.graphed's: rows written into input(n) are stepped without
    a copy in (no copy_ into the fixed input), copy=False gives fn's output rows themselves, and the
    rows match the copying step's on a twin pool and each sequence's whole forward."""
    from tpattn.paged import DecodeGraphs
    layer = _layer(2, True)
    lens, T = [5, 2], 6
    xs = [torch.randn(1, n + T, 32, dtype=torch.float64) for n in lens]
    runs = []
    for in_place in (False, True):
        pool = PagedKV(layer, pages=20, page_size=4, max_seqs=2)
        ids = [pool.add() for _ in lens]
        made = []  # fn's outputs

        def fn(x, st):
            made.append(layer(x, cache=st.view(0)))
            return made[-1]
        graphs = DecodeGraphs(pool, fn, torch.zeros(2, 1, 32, dtype=torch.float64), max_len=16, buckets=(2,),
                              capture=False)
        outs = []
        with torch.no_grad():
            with pool.step(ids, lens) as st:
                layer(torch.cat([x[:, :n] for x, n in zip(xs, lens)], 1), cache=st.view())
            for t in range(T):
                rows = torch.cat([x[:, n + t:n + t + 1] for x, n in zip(xs, lens)], 0)
                if in_place:
                    fixed = graphs.input(2)
                    assert fixed.data_ptr() == graphs.input(2).data_ptr() and fixed.shape == (2, 1, 32)
                    fixed.copy_(rows)
                    copied = []
                    real = torch.Tensor.copy_

                    def spy(dst, src, *a, **k):
                        copied.append(dst.data_ptr() == fixed.data_ptr())
                        return real(dst, src, *a, **k)
                    monkeypatch.setattr(torch.Tensor, "copy_", spy)
                    y = graphs.step(ids, fixed, copy=False)
                    monkeypatch.setattr(torch.Tensor, "copy_", real)
                    assert not any(copied) and y.data_ptr() == made[-1].data_ptr()  # fn's rows, not a copy
                else:
                    y = graphs.step(ids, rows)
                    assert y.data_ptr() != made[-1].data_ptr()
                outs.append(y.clone())
        runs.append(torch.cat(outs, 1))
    assert torch.equal(runs[0], runs[1])
    for j, (x, n) in enumerate(zip(xs, lens)):
        assert (runs[1][j] - layer(x)[0, n:]).abs().max().item() < 1e-12


def test_decode_graphs_mirror_only_what_changed(monkeypatch):
    """DecodeGraphs keeps the block tables' device mirror by the pool's version: a steady step sends
    no table (a page it takes goes with its inputs, and its graph writes it into the mirror), and
    pages taken outside its steps (an eager step of several rows of a live sequence) are mirrored at
    the next step; the mirror holds each table after every step, and every row matches each
    sequence's whole forward."""
    from tpattn.paged import DecodeGraphs
    layer = _layer(2, True)
    lens, T = [5, 2], 9
    xs = [torch.randn(1, n + T + 6, 32, dtype=torch.float64) for n in lens]
    pool = PagedKV(layer, pages=40, page_size=4, max_seqs=2)
    ids = [pool.add() for _ in lens]
    graphs = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(2, 1, 32, dtype=torch.float64),
                          max_len=40, buckets=(2,), capture=False)
    synced, real = [], graphs._sync_tables
    graphs._sync_tables = lambda slots: (synced.append(sorted(slots)), real(slots))
    filled, fill = [], _StaticStep.fill
    monkeypatch.setattr(_StaticStep, "fill", lambda st, step, carry=None: (filled.append(dict(carry or {})),
                                                                          fill(st, step, carry)))
    carried = 0
    outs = [[], []]
    with torch.no_grad():
        with pool.step(ids, lens) as step:
            y = layer(torch.cat([xs[i][:, :n] for i, n in enumerate(lens)], 1), cache=step.view())
        outs[0].append(y[:, :5]), outs[1].append(y[:, 5:])
        done = list(lens)
        for t in range(T):
            if t == 4:  # sequence 1 takes 6 rows eagerly (two new pages) between two graphed steps
                with pool.step([ids[1]], [6]) as step:
                    outs[1].append(layer(xs[1][:, done[1]:done[1] + 6], cache=step.view()))
                done[1] += 6
            before, n, f = [len(pool.tables[pool.slots[sid]]) for sid in ids], len(synced), len(filled)
            y = graphs.step(ids, torch.cat([xs[i][:, done[i]:done[i] + 1] for i in range(2)], 0))
            grew = sorted(pool.slots[sid] for sid, k in zip(ids, before) if len(pool.tables[pool.slots[sid]]) > k)
            if t in (0, 4):  # the first step, and the one after the eager step: every slot
                assert synced[n:] == [[0, 1]], (t, synced[n:])
            else:  # a steady step: no table sent; the pages it took go with its inputs, else nothing is sent
                assert synced[n:] == [], (t, grew, synced[n:])
                got = {s: pool.tables[s][-1] for s in grew}
                assert [{s: p for s, (_, p) in c.items()} for c in filled[f:]] == ([got] if grew else []), (t, filled[f:])
                carried += len(grew)
            for sid in ids:  # the device's mirror holds each table
                pages = pool.tables[pool.slots[sid]]
                assert graphs.table[pool.slots[sid], :len(pages)].tolist() == pages, (t, sid)
            for i in range(2):
                outs[i].append(y[i:i + 1])
                done[i] += 1
        for i in range(2):
            assert (torch.cat(outs[i], 1) - layer(xs[i][:, :done[i]])).abs().max().item() < 1e-12, i
    assert len(synced) == 2 and carried >= 2  # steps that lengthened no table sent nothing


def _reuse_a_slot_whose_bucket_carried_a_page(layer, pool, graphs, P, xa, xb, xc):
    """Sequence a takes its second page in a steady step of bucket 1 (carried by that bucket's
    inputs), then leaves; c takes a's pages, and b takes a's slot and new pages, prefilled to the
    length bucket 1 would continue from. Returns (the slot, c, b, b's prefill rows)."""
    a = pool.add()
    with pool.step([a], [P - 1]) as step:
        layer(xa[:, :P - 1], cache=step.view())
    graphs.step([a], xa[:, P - 1:P])
    graphs.step([a], xa[:, P:P + 1])  # a steady step that takes a's second page: carried by the inputs
    assert graphs._made[1]["step"].inputs[2:].flatten().tolist() == [1, pool.tables[pool.slots[a]][1]]
    slot = pool.slots[a]
    c = pool.add()
    pool.remove(a)
    with pool.step([c], [2 * P]) as step:  # c takes a's two pages
        layer(xc[:, :2 * P], cache=step.view())
    b = pool.add()
    assert pool.slots[b] == slot
    with pool.step([b], [P + 1]) as step:  # b: new pages, at the length a's bucket continues from
        first = layer(xb[:, :P + 1], cache=step.view())
    return slot, c, b, first


def test_decode_graphs_a_reused_slot_takes_no_page_an_earlier_sequence_carried():
    """A graphed step that took a page leaves it in its bucket's inputs (the steps that continue it
    write it again). When that sequence is removed and a new one takes its slot at the very length
    the bucket would continue from, the step sends its inputs anyway: the old page (now another
    sequence's) does not overwrite the new sequence's block table."""
    from tpattn.paged import DecodeGraphs
    layer = _layer(2, True)
    P = 4
    xa, xb, xc = (torch.randn(1, 12, 32, dtype=torch.float64) for _ in range(3))
    pool = PagedKV(layer, pages=8, page_size=P, max_seqs=2)
    graphs = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(1, 1, 32, dtype=torch.float64),
                          max_len=12, buckets=(1,), capture=False)
    with torch.no_grad():
        slot, _, b, first = _reuse_a_slot_whose_bucket_carried_a_page(layer, pool, graphs, P, xa, xb, xc)
        y = graphs.step([b], xb[:, P + 1:P + 2])
        assert graphs.table[slot, :2].tolist() == pool.tables[slot][:2]
        whole = layer(xb[:, :P + 2])
    assert (torch.cat([first, y], 1) - whole).abs().max().item() < 1e-12


def test_decode_graphs_a_step_after_a_change_sends_what_other_sequences_and_buckets_lack():
    """A step after a change of the live set brings every live sequence's table up to date, not
    only its own, and makes every bucket send its inputs again. (1) A sequence prefilled while others
    step in a graph, then joining them in a steady step, reads its own pages. (2) A slot reused
    while another bucket's step takes in the change: the reused slot's next step in its old bucket
    does not write the page that bucket's inputs carried (now another sequence's) into its table."""
    from tpattn.paged import DecodeGraphs
    layer = _layer(2, True)
    P = 4
    with torch.no_grad():
        pool = PagedKV(layer, pages=32, page_size=P, max_seqs=4)
        graphs = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(1, 1, 32, dtype=torch.float64),
                              max_len=32, buckets=(1, 2, 4), capture=False)
        xs = [torch.randn(1, 20, 32, dtype=torch.float64) for _ in range(3)]
        z, w = pool.add(), pool.add()
        with pool.step([z, w], [5, 5]) as step:
            layer(torch.cat([xs[0][:, :5], xs[1][:, :5]], 1), cache=step.view())
        y = pool.add()
        with pool.step([y], [6]) as step:  # prefilled eagerly
            layer(xs[2][:, :6], cache=step.view())
        graphs.step([z, w], torch.cat([xs[0][:, 5:6], xs[1][:, 5:6]], 0))  # takes in the change
        out = graphs.step([z, w, y], torch.cat([x[:, 6:7] for x in xs], 0))  # steady: y joins
        slot = pool.slots[y]
        assert graphs.table[slot, :2].tolist() == pool.tables[slot]
        assert (out[2:3] - layer(xs[2][:, :7])[:, 6:7]).abs().max().item() < 1e-12

        pool = PagedKV(layer, pages=16, page_size=P, max_seqs=3)
        graphs = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(1, 1, 32, dtype=torch.float64),
                              max_len=12, buckets=(1, 2), capture=False)
        xa, xb, xc, xz = (torch.randn(1, 12, 32, dtype=torch.float64) for _ in range(4))
        slot, c, b, first = _reuse_a_slot_whose_bucket_carried_a_page(layer, pool, graphs, P, xa, xb, xc)
        zz = pool.add()
        with pool.step([zz], [2]) as step:
            layer(xz[:, :2], cache=step.view())
        graphs.step([c, zz], torch.cat([xc[:, 2 * P:2 * P + 1], xz[:, 2:3]], 0))  # bucket 2 takes in the change
        y = graphs.step([b], xb[:, P + 1:P + 2])  # bucket 1 again: its inputs are sent
        assert graphs.table[slot, :2].tolist() == pool.tables[slot][:2]
        assert (torch.cat([first, y], 1) - layer(xb[:, :P + 2])).abs().max().item() < 1e-12


def test_decode_graphs_refusals():
    from tpattn.paged import DecodeGraphs
    layer = _layer()
    pool = PagedKV(layer, pages=8, page_size=4, max_seqs=2)
    x = torch.zeros(2, 1, 32, dtype=torch.float64)
    with pytest.raises(ConfigError, match="the pool must be on a GPU"):
        DecodeGraphs(pool, lambda x, st: x, x, max_len=8)
    with pytest.raises(ConfigError, match="buckets must be 1..max_seqs=2"):
        DecodeGraphs(pool, lambda x, st: x, x, max_len=8, buckets=(1, 4), capture=False)
    g = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), x, max_len=8, buckets=(1,), capture=False)
    a, b = pool.add(), pool.add()
    with pytest.raises(ConfigError, match="the largest bucket is 1"):
        g.step([a, b], x)
    with torch.no_grad():
        with pool.step([a], [8]) as st:
            layer(torch.zeros(1, 8, 32, dtype=torch.float64), cache=st.view())
    with pytest.raises(ConfigError, match="past max_len=8"):
        g.step([a], x[:1])


def test_chunk_graphs_fixed_steps_match_the_whole_forward():
    """ChunkGraphs' fixed-tensor chunk steps (run eagerly here: capture=False; tests/test_gpu_paged.py
    replays them as CUDA graphs): two sequences' prompts in chunks of 6 rows through the one set of
    fixed tensors, interleaved, each ending with a shorter chunk run eagerly; a decode step after; every
    row against each sequence's whole forward. The fixed tensors hold the last chunk's positions, pages
    (a table row padded with the scratch page) and L0."""
    from paged_prefill_steps import prompts_in_chunks
    from tpattn.paged import ChunkGraphs
    layer = _layer(2, True)
    T, lens = 6, (15, 20)
    xs = [torch.randn(1, n + 1, 32, dtype=torch.float64) for n in lens]
    pool = PagedKV(layer, pages=40, page_size=4, max_seqs=2)
    ids = [pool.add(), pool.add()]
    chunks = ChunkGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(1, T, 32, dtype=torch.float64),
                         max_len=32, capture=False)
    with torch.no_grad():
        outs = prompts_in_chunks(layer, pool, ids, xs, lens, T, chunks)  # (the last, shorter chunks: eagerly)
        with pool.step(ids, [1, 1]) as st:
            y = layer(torch.cat([xs[0][:, -1:], xs[1][:, -1:]], 0), cache=st.view())
        for i in range(2):
            outs[i].append(y[i:i + 1])
            assert (torch.cat(outs[i], 1) - layer(xs[i])).abs().max().item() < 1e-12, i
    st = chunks.static
    sid = ids[1]
    assert st.starts == [12] and st.start.tolist() == [12]  # sequence 1's last full chunk: rows 12 .. 17
    assert st.positions.tolist() == list(range(12, 18))
    want = [pool.tables[pool.slots[sid]][p // 4] for p in range(12, 18)]
    assert st.page_index.tolist() == want
    row = st.table[0].tolist()
    assert row[:5] == pool.tables[pool.slots[sid]][:5] and set(row[5:]) == {pool.scratch_page}


def test_chunk_graphs_refusals():
    """ChunkGraphs: a capture on CPU (and, anywhere, a layer the paged prefill kernel does not take: one
    line naming what it needs), a chunk of one row, x of another chunk size, a sequence past max_len."""
    from tpattn.paged import ChunkGraphs, chunk_graph_refusal
    layer = _layer(2, True)
    pool = PagedKV(layer, pages=8, page_size=4, max_seqs=2)
    x = torch.zeros(1, 4, 32, dtype=torch.float64)
    with pytest.raises(ConfigError, match="the pool must be on a GPU"):
        ChunkGraphs(pool, lambda x, st: x, x, max_len=8)
    why = chunk_graph_refusal(layer, pool)
    assert "compute capability 9.0" in why and "pages of 4 tokens" in why and "run the chunks eagerly" in why
    with pytest.raises(ConfigError, match="T >= 2 rows"):
        ChunkGraphs(pool, lambda x, st: x, x[:, :1], max_len=8, capture=False)
    g = ChunkGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), x, max_len=8, capture=False)
    a = pool.add()
    with pytest.raises(ConfigError, match="a chunk of 4 rows"):
        g.step(a, x[:, :3])
    with torch.no_grad():
        g.step(a, x)
        g.step(a, x)
        with pytest.raises(ConfigError, match="past max_len=8"):
            g.step(a, x)
    assert pool.length(a) == 8


def test_llama_generate_with_decode_graphs_gives_the_same_tokens(monkeypatch):
    """generate(graphs=True): prefills in steps of their own, decode steps through DecodeGraphs'
    fixed tensors (run eagerly on CPU; captured on a GPU): the unmodified model's tokens; on CPU
    the capture itself is refused in one line."""
    import tpattn.hf as hf
    import tpattn.paged as paged
    model = _llama()
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p, n in zip(PROMPTS, BUDGET)]
    tp = hf.parallelize(model, group=None)
    with pytest.raises(ConfigError, match="the pool must be on a GPU"):
        tp.generate(PROMPTS, BUDGET, max_batch=2, graphs=True)

    class Eager(paged.DecodeGraphs):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "capture": False})
    monkeypatch.setattr(paged, "DecodeGraphs", Eager)
    assert tp.generate(PROMPTS, BUDGET, max_batch=2, page_size=4, graphs=True) == want
    assert tp.generate(PROMPTS, BUDGET, max_batch=3, graphs=True) == want


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_llama_generate_in_prefill_chunks_gives_the_same_tokens(monkeypatch, chunk):
    """generate(prefill_chunk=T): a step takes at most T prompt rows beside the live sequences' next
    tokens (a long prompt read over several steps, mixed with others' decoding); with graphs, a
    newcomer's whole chunks through ChunkGraphs (its fixed tensors run eagerly on CPU), the rest packed.
    Either way the unmodified model's tokens; a chunk that is not a positive int (or, with graphs, of
    one row) is refused in one line."""
    import tpattn.hf as hf
    import tpattn.paged as paged
    model = _llama()
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p, n in zip(PROMPTS, BUDGET)]
    tp = hf.parallelize(model, group=None)
    assert tp.generate(PROMPTS, BUDGET, max_batch=2, page_size=4, prefill_chunk=chunk) == want
    assert tp.generate(PROMPTS, BUDGET, max_batch=4, prefill_chunk=chunk) == want
    steps = []
    real = paged.PagedKV.step

    def counted(pool, ids, rows):
        steps.append(list(rows))
        return real(pool, ids, rows)
    monkeypatch.setattr(paged.PagedKV, "step", counted)
    tp.generate(PROMPTS, BUDGET, max_batch=3, prefill_chunk=chunk)
    # every row fed once (each prompt, then each token but the last), a step's rows within the chunk
    # and the other sequences' one row each, and the longest prompt over several steps
    assert sum(map(sum, steps)) == sum(map(len, PROMPTS)) + sum(BUDGET) - len(PROMPTS)
    assert max(map(sum, steps)) <= chunk + 2 and len(steps) > max(BUDGET)
    monkeypatch.setattr(paged.PagedKV, "step", real)
    for T in ([2, 4] if chunk == 2 else []):
        # graphs: whole chunks eager where ChunkGraphs would be refused (here: CPU, reference backend) ...
        class Eager(paged.DecodeGraphs):
            def __init__(self, *a, **kw):
                super().__init__(*a, **{**kw, "capture": False})

        made = []

        class EagerChunks(paged.ChunkGraphs):
            def __init__(self, *a, **kw):
                made.append(self)
                super().__init__(*a, **{**kw, "capture": False})
        monkeypatch.setattr(paged, "DecodeGraphs", Eager)
        monkeypatch.setattr(paged, "ChunkGraphs", EagerChunks)
        assert tp.generate(PROMPTS, BUDGET, max_batch=2, page_size=4, graphs=True, prefill_chunk=T) == want
        assert not made
        # ... and through ChunkGraphs' fixed tensors where the layers take the kernel
        monkeypatch.setattr(paged, "chunk_graph_refusal", lambda layer, pool: None)
        assert tp.generate(PROMPTS, BUDGET, max_batch=2, page_size=4, graphs=True, prefill_chunk=T) == want
        assert len(made) == 1 and made[0].T == T
        monkeypatch.undo()
    for bad in (0, 2.5, True):
        with pytest.raises(ConfigError, match="prefill_chunk a positive int"):
            tp.generate(PROMPTS, BUDGET, prefill_chunk=bad)
    with pytest.raises(ConfigError, match="2 or more with graphs=True"):
        tp.generate(PROMPTS, BUDGET, graphs=True, prefill_chunk=1)


def test_a_steps_rows_and_tables_are_its_sequences_pages():
    """PagedStep's device metadata (one buffer, one copy): every packed row's position, page and offset,
    and per sequence its pages up to its length after the step (zero-padded), the row offsets, the
    lengths before and after; for sequences of several pages, one row, and starts inside a page."""
    layer = _layer(2, True)
    pool = PagedKV(layer, pages=40, page_size=4, max_seqs=4)
    a, b, c = pool.add(), pool.add(), pool.add()
    with pool.step([a, b], [6, 3]):
        pass
    st = pool.step([b, c, a], [9, 1, 2])
    P = 4
    want_pos, want_page = [], []
    for sid, r, L0 in zip([b, c, a], [9, 1, 2], [3, 0, 6]):
        pages = pool.tables[pool.slots[sid]]
        want_pos += list(range(L0, L0 + r))
        want_page += [pages[p // P] for p in range(L0, L0 + r)]
    assert st.positions.tolist() == want_pos and st.page_index.tolist() == want_page
    assert st.page_offset.tolist() == [p % P for p in want_pos] and st.positions.dtype == torch.int64
    table, lens, longest = st.decode_tables()
    assert lens.tolist() == [12, 1, 8] and longest == 12 and table.dtype == torch.int32
    assert table.tolist() == [pool.tables[pool.slots[b]][:3], pool.tables[pool.slots[c]][:1] + [0, 0],
                              pool.tables[pool.slots[a]][:2] + [0]]
    t2, cu, starts = st.prefill_tables()
    assert t2 is table and cu.tolist() == [0, 9, 10, 12] and starts.tolist() == [3, 0, 6]
    st.__exit__(None, None, None)


def test_rotary_tables_grow_and_keep_what_a_graph_reads(monkeypatch):
    """decode.rope_rows (what PagedKV.rope and, laid over the head's columns, the layer's forward read):
    rope_tables at 0, 1, ... bit for bit, made once per (device, head dim, theta, dtype), grown by doubling
    past the positions asked for; an outgrown table stays referenced. The layer's rotation at an offset
    equals rope_tables' there."""
    from tpattn import decode
    from tpattn.decode import rope_tables
    monkeypatch.setattr(decode, "_rope_rows", {})
    monkeypatch.setattr(decode, "_rope_kept", [])
    layer = _layer(1, True)
    pool = PagedKV(layer, pages=4, page_size=4, max_seqs=2)
    cos, sin = pool.rope(layer, 10)
    assert cos.shape[0] == 1024 and pool.rope(layer, 1024)[0] is cos
    want = rope_tables(torch.arange(1024), layer.head_dim, layer.rope_theta, torch.float64)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    bigger = pool.rope(layer, 1025)[0]
    assert bigger.shape[0] == 2048 and torch.equal(bigger[:1024], cos)
    assert decode._rope_kept[0][0] is cos
    q, k = (torch.randn(1, layer.local_heads, 5, layer.head_dim, dtype=layer.dtype) for _ in range(2))
    c, s_ = rope_tables(torch.arange(2040, 2045), layer.head_dim, layer.rope_theta, torch.float64)
    got = layer._rope(q, k, 2040)
    assert all(torch.equal(a, decode.apply_rope(t, c, s_)) for a, t in zip(got, (q, k)))
    full = decode._rope_rows[(torch.device("cpu"), layer.head_dim, layer.rope_theta, torch.float64, False)]
    assert full[0].shape == (2045, layer.head_dim) and torch.equal(full[0][:1024, :layer.head_dim // 2], cos)


def _serve(layer, pool, xs, lens, steps, reuse=False):
    """A ragged prefill of len(xs) sequences then `steps` decode steps of all; each sequence's
    outputs [1, lens[i] + steps, E]. reuse: a sequence of 9 rows of values 1e5 larger comes and goes
    first, so the others' pages held its rows."""
    with torch.no_grad():
        if reuse:
            gone = pool.add()
            with pool.step([gone], [9]) as step:
                layer(torch.randn(1, 9, xs[0].shape[-1], dtype=xs[0].dtype) * 1e5, cache=step.view())
            pool.remove(gone)
        ids = [pool.add() for _ in lens]
        with pool.step(ids, lens) as step:
            y = layer(torch.cat([x[:, :n] for x, n in zip(xs, lens)], 1), cache=step.view())
        outs = [[y[:, step.cu[i]:step.cu[i + 1]]] for i in range(len(lens))]
        for t in range(steps):
            with pool.step(ids, [1] * len(lens)) as step:
                y = layer(torch.cat([x[:, n + t:n + t + 1] for x, n in zip(xs, lens)], 0), cache=step.view())
            for i in range(len(lens)):
                outs[i].append(y[i:i + 1])
    return [torch.cat(o, 1) for o in outs]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_fp8_pool_holds_each_row_quantized_with_its_own_scale(page_size):
    """kv_dtype="fp8": after a ragged prefill and decode steps, the pages hold what
    fp8.quantize_rows gives for the same K and V held exactly (each row in e4m3 with its own scale);
    the outputs are off the exact ones by e4m3's rounding, not more; the pool holds a byte a value
    and a scale a row."""
    from tpattn.attention import fp8
    layer = _layer(2, True)
    lens, steps = [7, 3, 18], 6
    torch.manual_seed(1)
    xs = [torch.randn(1, n + steps, 32, dtype=torch.float64) for n in lens]
    exact, eight = (PagedKV(layer, pages=64, page_size=page_size, max_seqs=4, kv_dtype=kv) for kv in (None, "fp8"))
    want = _serve(layer, exact, xs, lens, steps)
    got = _serve(layer, eight, xs, lens, steps)
    for pages, p8, sc in ((exact.k[0], eight.k[0], eight.k_scale[0]), (exact.v[0], eight.v[0], eight.v_scale[0])):
        q8, s = fp8.quantize_rows(pages)
        assert p8.dtype == torch.float8_e4m3fn and pages.abs().sum() > 0
        assert torch.equal(fp8.dequantize(p8, sc), q8 * s), "the pages differ from quantizing each row"
    err = max((g - w).abs().max().item() for g, w in zip(got, want))
    scale = max(w.abs().max().item() for w in want)
    assert 1e-4 * scale < err < 0.1 * scale, (err, scale)
    assert eight.nbytes() == 2 * 65 * 2 * page_size * (8 + 4)
    assert PagedKV.bytes_per_token(layer, "fp8") == 2 * 2 * (8 + 4)
    assert PagedKV.bytes_per_token(layer) == 2 * 2 * 8 * 8


def test_fp8_pool_ignores_a_reused_pages_old_rows_and_graphs_match_eager_steps():
    """Pages freed by a sequence of values 1e5 larger and taken by others: their outputs equal those
    in a fresh pool (the old rows past a sequence's length are never read). DecodeGraphs'
    fixed-tensor steps write the eager steps' bits into the pages."""
    from tpattn.paged import DecodeGraphs
    layer = _layer(2, True)
    lens, steps = [5, 11], 5
    torch.manual_seed(2)
    xs = [torch.randn(1, n + steps, 32, dtype=torch.float64) for n in lens]
    fresh_pool = PagedKV(layer, pages=16, page_size=4, max_seqs=3, kv_dtype="fp8")
    fresh = _serve(layer, fresh_pool, xs, lens, steps)
    reused = _serve(layer, PagedKV(layer, pages=16, page_size=4, max_seqs=3, kv_dtype="fp8"), xs, lens, steps, reuse=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused))
    pool = PagedKV(layer, pages=16, page_size=4, max_seqs=3, kv_dtype="fp8")
    graphs = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(2, 1, 32, dtype=torch.float64),
                          max_len=32, buckets=(2,), capture=False)
    with torch.no_grad():
        ids = [pool.add() for _ in lens]
        with pool.step(ids, lens) as step:
            layer(torch.cat([x[:, :n] for x, n in zip(xs, lens)], 1), cache=step.view())
        for t in range(steps):
            y = graphs.step(ids, torch.cat([x[:, n + t:n + t + 1] for x, n in zip(xs, lens)], 0))
            for i, n in enumerate(lens):
                assert (y[i] - fresh[i][0, n + t:n + t + 1]).abs().max().item() < 1e-12, (t, i)
    for mine, theirs in ((pool.k[0], fresh_pool.k[0]), (pool.k_scale[0], fresh_pool.k_scale[0]),
                         (pool.v[0], fresh_pool.v[0]), (pool.v_scale[0], fresh_pool.v_scale[0])):
        assert torch.equal(mine[:7].float(), theirs[:7].float())  # the same pages and scales, bit for bit


def test_fp8_generate_and_refusals():
    """generate(kv_dtype="fp8"): every token among the unmodified model's first three at its position
    (teacher-forced), most of them its first; an unknown kv_dtype refused in one line."""
    import tpattn.hf as hf
    model = _llama()
    tp = hf.parallelize(model, group=None)
    got = tp.generate(PROMPTS, BUDGET, max_batch=2, page_size=4, kv_dtype="fp8")
    sys.path.insert(0, str(ROOT / "scripts"))
    from serve_llama import teacher_forced_ranks
    ranks = teacher_forced_ranks(model, PROMPTS, got, torch.device("cpu"))
    assert len(ranks) == sum(BUDGET) and max(ranks) < 3 and sum(r == 0 for r in ranks) >= 0.8 * len(ranks), ranks
    with pytest.raises(ConfigError, match=r"PagedKV kv_dtype='int8': use 'fp8' \(e4m3 pages"):
        PagedKV(_layer(), pages=4, kv_dtype="int8")


@pytest.mark.parametrize("kv", ["fp16", "fp8", "bf16 model"])
def test_serve_llama_checks_the_fp8_cache(kv):
    """scripts/serve_llama.py --check: the bytes a token, and the check: identical tokens for the fp32
    model's own pages, each token teacher-forced among the unmodified model's first five for an FP8
    cache or a 16-bit model (whose roundings move near ties)."""
    args = ["--prompts", "4", "--new-tokens", "6", "--check"] + {"fp16": [], "fp8": ["--kv-dtype", "fp8"],
                                                               "bf16 model": ["--dtype", "bf16"]}[kv]
    r = run([sys.executable, str(ROOT / "scripts" / "serve_llama.py"), *args], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    per = {"fp16": "1024 bytes a token on rank 0 (fp32 pages", "fp8": "320 bytes a token on rank 0 (fp8 pages",
           "bf16 model": "512 bytes a token on rank 0 (bf16 pages"}[kv]
    assert per in r.stdout and "PASS" in r.stdout, r.stdout
    assert ("every token within its top 5 (teacher-forced): PASS" in r.stdout) == (kv != "fp16"), r.stdout


def test_serve_llama_in_prefill_chunks_and_its_refusals():
    """scripts/serve_llama.py --prefill-chunk 8 --check: the unmodified model's tokens with prompts read
    over several steps; counts that are not positive refused in one line, exit 2."""
    script = [sys.executable, str(ROOT / "scripts" / "serve_llama.py")]
    r = run(script + ["--prompts", "4", "--new-tokens", "5", "--prompt-lens", "9", "30", "--prefill-chunk", "8",
                      "--check"], timeout=240)
    assert r.returncode == 0 and "prompts in chunks of 8" in r.stdout and "PASS" in r.stdout, r.stdout + r.stderr
    for bad in (["--page-size", "0"], ["--prefill-chunk", "0"], ["--max-batch", "-1"], ["--backend", "flash"]):
        r = run(script + bad, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and f"{bad[0]} {bad[1]}" in r.stderr, r.stderr


def test_sizes_and_ids_are_ints():
    """new_cache's sizes and a step's ids and row counts: ints (Python, numpy or integer tensors); a float
    (2.7 rows were truncated to 2), a bool or a string is refused in one line naming the call."""
    layer = _layer(1, True)
    for bad in ((2.0, 16), (True, 16), ("2", 16)):
        with pytest.raises(ConfigError, match="new_cache needs batch and max_len positive ints"):
            layer.new_cache(*bad)
    pool = PagedKV(layer, pages=8, page_size=4, max_seqs=2)
    a = pool.add()
    with pytest.raises(ConfigError, match="step takes a list of sequence ids and a list of row counts"):
        pool.step(a, 3)
    for rows in ([2.7], [True]):
        with pytest.raises(ConfigError, match="step takes int sequence ids and row counts"):
            pool.step([a], rows)
    assert pool.length(a) == 0
    with torch.no_grad(), pool.step(torch.tensor([a]), np.array([3])) as st:
        layer(torch.randn(1, 3, 32, dtype=torch.float64), cache=st.view())
    assert pool.length(a) == 3
