"""The paged decode kernel (kernels/decode_attention.cu, _pg) on the GPU: ragged lengths read
through a shuffled block table against float64 per sequence, both splits, pages of 1 to 64 tokens,
GQA; the paged cache's decode steps through the kernel against the same steps in torch math; a
zero-length row is zero; and graph replays with new lengths and tables on the device."""

from __future__ import annotations

import math

import pytest
import torch

from tpattn.decode import paged_decode_attention

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["mma", "cores"])
def split_kernel(request, monkeypatch):
    import tpattn.decode as dec
    monkeypatch.setattr(dec, "SPLIT_KERNEL", request.param)
    return request.param


def paged_inputs(lens, h, g, d, page, dtype, seed=0, spare=3):
    """q [B, h, d], a pool with its pages handed out in a shuffled order, the block table, lens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    total = sum(pages) + spare
    pool_k, pool_v = (torch.randn(total, g, page, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    order = torch.randperm(total, device="cuda", generator=gen).tolist()
    most = max(max(pages), 1)
    table = torch.zeros(len(lens), most + 2, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
        at += n
    q = torch.randn(len(lens), h, d, device="cuda", generator=gen).to(dtype)
    return q, pool_k, pool_v, table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def fused_layer(H: int, g: int, d: int, rope_theta: float | None = 10000.0, backend: str = "fused"):
    """A causal fp16 layer of H heads (g K/V heads, head dim d) on the GPU through the fused backend (or
    `backend`), its weights drawn from torch's generator (seed it first)."""
    from tpattn import TensorParallelAttention
    D = H * d
    w = {k: (torch.randn(*s) * 0.02).half().cuda() for k, s in
         (("wq", (D, D)), ("wk", (D, g * d)), ("wv", (D, g * d)), ("wo", (D, D)))}
    return TensorParallelAttention(**w, heads=H, kv_heads=g, head_dim=d, causal=True, backend=backend,
                                   rope_theta=rope_theta)


def float64_rows(q, pool_k, pool_v, table, lens):
    out = []
    g = pool_k.shape[1]
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            out.append(torch.zeros(q.shape[1], q.shape[2], dtype=torch.float64, device=q.device))
            continue
        pg = table[b, :-(-n // pool_k.shape[2])].long()
        k, v = (t[pg].transpose(0, 1).reshape(g, -1, q.shape[2])[:, :n].double() for t in (pool_k, pool_v))
        r = q.shape[1] // g
        k, v = k.repeat_interleave(r, 0), v.repeat_interleave(r, 0)
        p = torch.softmax(q[b].double().unsqueeze(1) @ k.transpose(-1, -2) / math.sqrt(q.shape[2]), -1)
        out.append((p @ v)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,g", [(32, 32), (32, 8), (16, 1)])
@pytest.mark.parametrize("page", [1, 16, 24, 64])
def test_paged_kernel_against_float64(h, g, d, dtype, page, split_kernel):
    check_paged([1, 17, page, 1000, 4097, 64 * 3 + 1], h, g, d, dtype, page)


@pytest.mark.parametrize("page", [1, 16, 24])
@pytest.mark.parametrize("h,g", [(32, 32), (32, 8)])
def test_paged_kernel_of_one_chunk(h, g, page, split_kernel):
    """Every sequence of 64 keys or fewer: the split is one chunk, and each block writes its rows as
    the output (no partials, no ticket, no combine) through every paged build: against float64,
    zero-length rows zero, and counters that hold something else unchanged."""
    from tpattn import decode as dec
    lens = [0, 1, 17, 64, 40]
    q, pk, pv, table, L = paged_inputs(lens, h, g, 128, page, torch.float16, seed=page + h)
    assert dec._split_kernel(q, len(lens), h, g, 128, max(lens), page=page)[2] == 1
    tickets = torch.full((len(lens) * g,), 7, dtype=torch.int32, device="cuda")
    got = paged_decode_attention(q, pk, pv, table, L, max(lens), tickets=tickets)
    want = float64_rows(q, pk, pv, table, L)
    assert (got[0] == 0).all() and (got.double() - want).abs().max().item() <= 4e-3
    assert (tickets == 7).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,g", [(32, 8), (32, 4), (16, 2)])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("lens", [[1, 17, 1000, 4097, 193], [0, 5, 64, 40]])
def test_pgs_keys_as_rows_against_float64_and_past_lengths(h, g, d, dtype, page, lens, monkeypatch):
    """_pgs (DEC_KT16: 16-bit pages of whole tiles, the keys as the rows of both products; pipelined with
    many chunks, plain with one) against float64 over ragged lengths through a shuffled table, close to
    _pg's output, and the same bits with NaN in every page row past a length (keys past a length are
    never read)."""
    import tpattn.decode as dec
    monkeypatch.setattr(dec, "DEC_KT16", True)
    q, pk, pv, table, L = paged_inputs(lens, h, g, d, page, dtype, seed=page + h + d)
    name = dec._split_kernel(q, len(lens), h, g, d, max(lens), page=page)[1]
    assert name.endswith("_pgs") and ("_p_" in name) == (max(lens) > 1000), name
    got = paged_decode_attention(q, pk, pv, table, L, max(lens))
    want = float64_rows(q, pk, pv, table, L)
    tol = (4e-3 if dtype == torch.float16 else 3e-2) * max(1.0, want.abs().max().item())
    assert torch.isfinite(got).all() and (got.double() - want).abs().max().item() <= tol
    monkeypatch.setattr(dec, "DEC_KT16", False)
    pg = paged_decode_attention(q, pk, pv, table, L, max(lens))
    assert (got.double() - pg.double()).abs().max().item() <= tol
    monkeypatch.setattr(dec, "DEC_KT16", True)
    used = set()
    for b, n in enumerate(L.tolist()):  # NaN in the rows of a sequence's last page past its length
        mine = table[b, :-(-n // page)].tolist()
        used |= set(mine)
        if n % page:
            pk[mine[-1], :, n % page:] = float("nan")
            pv[mine[-1], :, n % page:] = float("nan")
    spare = sorted(set(range(pk.shape[0])) - used)  # and in every page no sequence holds (page 0 among them
    pk[spare], pv[spare] = float("nan"), float("nan")  # where free: what a table's padding names)
    again = paged_decode_attention(q, pk, pv, table, L, max(lens))
    assert torch.equal(again, got)


def check_paged(lens, h, g, d, dtype, page):
    """The paged kernel over ragged lengths through a shuffled table, against float64."""
    q, pk, pv, table, L = paged_inputs(lens, h, g, d, page, dtype, seed=page + h + d)
    got = paged_decode_attention(q, pk, pv, table, L, max(lens))
    want = float64_rows(q, pk, pv, table, L)
    err = (got.double() - want).abs().max().item()
    tol = (4e-3 if dtype == torch.float16 else 3e-2) * max(1.0, want.abs().max().item())
    assert torch.isfinite(got).all() and err <= tol, (err, tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 80, 96, 160, 192, 256])
@pytest.mark.parametrize("h,g", [(16, 16), (16, 4)])
@pytest.mark.parametrize("page", [1, 16])
def test_paged_kernel_at_other_head_dims(h, g, d, dtype, page):
    """The paged CUDA-core split at head dims other than 64 and 128, ragged lengths through a shuffled
    table, against float64."""
    check_paged([1, 17, page, 1000, 4097], h, g, d, dtype, page)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[32768], [0, 5000, 1, 64, 12288], [8000] + [1] * 15, [4096] * 16,
                                  [2048, 8192, 3000, 5100] * 4])
def test_staged_pages_in_equal_work_chunks(lens, dtype, monkeypatch):
    """On compute capability 9.0, with DEC_STAGED_PAGED, a pool of 16-token pages with grouped heads runs
    the staged split of equal-work chunks (_pgb): one sequence split 16 ways, ragged batches, a sequence longer than
    EQ_SPREAD times the mean (the chunks grow), zero-length rows, 128 pairs on the SMs; against
    float64, and every ticket back at zero (each combine waited for its own sequence's partials)."""
    from tpattn import decode as dec
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the staged builds need compute capability 9.0")
    monkeypatch.setattr(dec, "DEC_STAGED_PAGED", True)
    h, g = 32, 8
    q, pk, pv, table, L = paged_inputs(lens, h, g, 128, 16, dtype, seed=len(lens))
    cap = 16 * table.shape[1]
    name = dec._split_kernel(q, len(lens), h, g, 128, cap, page=16)[1]
    assert name.endswith("_r8_pgb"), name
    tickets = torch.zeros(len(lens) * g, dtype=torch.int32, device="cuda")
    for _ in range(2):  # a second launch reads the tickets the first one left
        got = paged_decode_attention(q, pk, pv, table, L, cap, tickets=tickets)
    want = float64_rows(q, pk, pv, table, L)
    tol = (4e-3 if dtype == torch.float16 else 3e-2) * max(1.0, want.abs().max().item())
    assert torch.isfinite(got).all() and (got.double() - want).abs().max().item() <= tol
    assert (tickets == 0).all()
    assert all((got[b] == 0).all() for b, n in enumerate(lens) if n == 0)


def test_zero_length_rows_are_zero_and_the_split_follows_longest(split_kernel):
    q, pk, pv, table, L = paged_inputs([0, 300, 0, 5], 8, 2, 128, 16, torch.float16)
    got = paged_decode_attention(q, pk, pv, table, L, 16 * table.shape[1])  # split for the table's capacity
    assert (got[0] == 0).all() and (got[2] == 0).all()
    want = float64_rows(q, pk, pv, table, L)
    assert (got.double() - want).abs().max().item() <= 4e-3


def test_graph_replays_with_new_lengths_and_tables():
    """One CUDA graph of a paged step serves steps whose lengths and block tables change on the device."""
    lens = [40, 900, 7]
    q, pk, pv, table, L = paged_inputs(lens, 32, 8, 128, 16, torch.float16, spare=80)
    cap = 16 * table.shape[1]
    paged_decode_attention(q, pk, pv, table, L, cap)  # compile, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, pk, pv, table, L, cap)
    for new in ([41, 901, 8], [200, 3, 33]):
        L.copy_(torch.tensor(new, dtype=torch.int32))
        table.copy_(torch.roll(table, 1, dims=1))  # other pages (every page id is within the pool)
        graph.replay()
        torch.cuda.synchronize()
        want = float64_rows(q, pk, pv, table, L)
        assert (out.double() - want).abs().max().item() <= 4e-3, new


@pytest.mark.parametrize("g", [8, 2])
@torch.no_grad()
def test_paged_cache_decode_steps_through_the_kernel_match_torch_math(g, monkeypatch):
    """PagedKV on the GPU: prompts of different lengths, then decode steps with sequences joining and
    leaving; the decode steps through the paged kernel against the same steps in torch math."""
    import tpattn.paged as paged
    from tpattn.decode import decode_kernel_fits
    torch.manual_seed(0)
    layer = fused_layer(8, g, 128)
    outs = {}
    for kernel in (True, False):
        import tpattn.decode as dec
        monkeypatch.setattr(dec, "decode_kernel_fits", decode_kernel_fits if kernel else (lambda q: False))
        outs[kernel] = serve_steps(layer, paged.PagedKV(layer, pages=256, page_size=16, max_seqs=8))
    for a, b in zip(outs[True], outs[False]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-3


def serve_steps(layer, pool) -> list:
    """Prompts of 37, 5 and 130 rows, then six decode steps of every live sequence: the second leaves
    at step 2, a prompt of 20 joins at step 3; each step's rows."""
    D = layer.wqkv.shape[0]
    gen = torch.Generator().manual_seed(1)
    ids = [pool.add() for _ in range(3)]
    got = []
    for sid, n in zip(ids, (37, 5, 130)):
        with pool.step([sid], [n]) as st:
            layer(torch.randn(1, n, D, generator=gen).half().cuda(), cache=st.view(0))
    for t in range(6):
        if t == 2:
            pool.remove(ids.pop(1))
        if t == 3:
            sid = pool.add()
            with pool.step([sid], [20]) as st:
                layer(torch.randn(1, 20, D, generator=gen).half().cuda(), cache=st.view(0))
            ids.append(sid)
        with pool.step(ids, [1] * len(ids)) as st:
            got.append(layer(torch.randn(len(ids), 1, D, generator=gen).half().cuda(), cache=st.view(0)))
    return got


@torch.no_grad()
def test_decode_graphs_replay_the_eager_steps():
    """DecodeGraphs on the GPU: the captured buckets' replays give the same rows as the same fixed-
    tensor steps run eagerly, through a live set that shrinks and grows (buckets 4 and 2), and
    within fp16 rounding of the pool's plain steps (another chunk count); every sequence takes a
    page in a steady step (the page goes with the step's inputs into the device's table mirror),
    and two steps continue that one (the graph writes the carried pages again)."""
    from tpattn.paged import DecodeGraphs, PagedKV
    torch.manual_seed(0)
    H, G, d = 8, 2, 128
    D = H * d
    layer = fused_layer(H, G, d)
    rows = {}
    for mode in ("graphs", "fixed", "plain"):
        gen = torch.Generator().manual_seed(3)
        pool = PagedKV(layer, pages=64, page_size=16, max_seqs=4)
        ids = [pool.add() for _ in range(3)]
        for sid, n in zip(ids, (46, 14, 126)):  # each takes a page at its third step (positions 48, 16, 128)
            with pool.step([sid], [n]) as st:
                layer(torch.randn(1, n, D, generator=gen).half().cuda(), cache=st.view(0))
        graphs = DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(4, 1, D).half().cuda(),
                              max_len=256, buckets=(2, 4), capture=mode == "graphs")
        got = []
        for t in range(8):  # (steps 3 and 4 continue the one that carried the pages)
            if t == 5:
                pool.remove(ids.pop(0))
            x = torch.randn(len(ids), 1, D, generator=gen).half().cuda()
            if mode == "plain":
                with pool.step(ids, [1] * len(ids)) as st:
                    got.append(layer(x, cache=st.view(0)))
            else:
                got.append(graphs.step(ids, x))
        rows[mode] = got
        if mode == "plain":
            continue
        assert sorted(graphs._made) == [2, 4]
        for sid in ids:  # the device's mirror holds each table
            slot = pool.slots[sid]
            assert graphs.table[slot, :len(pool.tables[slot])].tolist() == pool.tables[slot]
    for a, b, c in zip(rows["graphs"], rows["fixed"], rows["plain"]):
        assert torch.equal(a, b)
        assert (a.float() - c.float()).abs().max().item() <= 2e-3


@pytest.mark.parametrize("g", [8, 2])
@torch.no_grad()
def test_paged_prefill_runs_the_fused_kernel_and_matches_torch_math(g, monkeypatch):
    """Prefills on a paged cache through the fused forward kernel, once reading K/V in place through
    the block table (decode.paged_prefix_attention) and once over K/V gathered first
    (decode.prefix_attention, paged_fits refused): ragged prompts packed in one step, then chunks that
    continue two of them (rows starting past a row tile, and not at one) beside a new prompt. The two
    give the same bits (the gathered calls through fusedw too, TPATTN_FUSED_CFG: small calls take fused2,
    whose rounding differs), the same steps in torch math (decode.attend) the same rows, and the kernel
    ran once per sequence of each step."""
    import tpattn.attention.fused as fz
    import tpattn.decode as dec
    from tpattn.paged import PagedKV
    torch.manual_seed(0)
    H, d = 8, 128
    D = H * d
    layer = fused_layer(H, g, d)
    calls = {"in place": [], "gathered": []}
    real, real_paged, real_fits = dec.prefix_attention, dec.paged_prefix_attention, fz.paged_fits
    monkeypatch.setattr(dec, "prefix_attention", lambda *a: calls["gathered"].append(a[-1]) or real(*a))
    monkeypatch.setattr(dec, "paged_prefix_attention",
                        lambda *a, **kw: calls["in place"].append(a[6]) or real_paged(*a, **kw))
    steps = [((0, 1, 2), (37, 5, 130)), ((0, 2, 3), (100, 64, 9)), ((1, 3), (300, 1))]
    outs = {}
    monkeypatch.setenv("TPATTN_FUSED_CFG", f"fusedw_f16_d{d}")  # (the gathered calls as well: small, they took fused2)
    for way in ("in place", "gathered", "torch"):
        monkeypatch.setattr(dec, "fused_prefix_fits", lambda q, way=way: way != "torch")
        monkeypatch.setattr(fz, "paged_fits", lambda q, k, way=way: way == "in place" and real_fits(q, k))
        pool = PagedKV(layer, pages=128, page_size=16, max_seqs=4)
        ids = [pool.add() for _ in range(4)]
        gen = torch.Generator().manual_seed(1)
        got = []
        for which, rows in steps:
            with pool.step([ids[i] for i in which], list(rows)) as st:
                got.append(layer(torch.randn(1, sum(rows), D, generator=gen).half().cuda(), cache=st.view(0)))
        outs[way] = got
        if way != "torch":
            assert calls[way] == [0, 0, 0, 37, 130, 0, 5, 9], calls  # each sequence's L0, step by step
        else:
            assert len(calls["in place"]) == len(calls["gathered"]) == 8, "torch math ran a fused kernel"
    for a, b, c in zip(outs["in place"], outs["gathered"], outs["torch"]):
        assert torch.equal(a, b)
        assert (a.float() - c.float()).abs().max().item() <= 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [16, 32, 128, 256])
@pytest.mark.parametrize("h, g", [(4, 4), (8, 2)])
@torch.no_grad()
def test_fused_kernel_reads_pages_through_the_table(dtype, d, page, h, g):
    """decode.paged_prefix_attention (fusedw's _pg kernels): a sequence's rows after L0 cached positions,
    read in place, over its K/V in a pool whose pages are handed out shuffled, read through its
    block-table row, give the bits of fusedw over the pages gathered first (prefix_attention, row tiles
    from L0 rounded down to 128; a row's extra key tile there is all masked: alpha 1, nothing added), and
    float64's rows within fp16's rounding: prompts shorter
    than a page, a key tile and a row tile, chunks starting inside a page and a row tile, sequences
    ending inside a page (the keys past them masked)."""
    from tpattn.attention import get_backend
    from tpattn.decode import paged_prefix_attention, prefix_attention
    be = get_backend("fused")
    gen = torch.Generator(device="cuda").manual_seed(page + d + h)
    for L0, T in ((0, 5), (0, 300), (37, 1), (128, 130), (300, 77), (1000, 1100)):
        n = L0 + T
        npages = -(-n // page)
        total = npages + 3
        pool_k, pool_v = (torch.randn(total, g, page, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
        order = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
        table = order[:npages].contiguous()
        rows = torch.randn(T, h, d, device="cuda", generator=gen).to(dtype)  # a step's rows [T, h, d]
        start = torch.tensor([L0], dtype=torch.int32, device="cuda")
        got = paged_prefix_attention(be, rows, pool_k, pool_v, table, start, L0).unsqueeze(0)  # [1, T, h, d]
        q = rows.transpose(0, 1).unsqueeze(0)
        k, v = (t[table.long()].transpose(0, 1).reshape(1, g, -1, d)[:, :, :n] for t in (pool_k, pool_v))
        with pytest.MonkeyPatch.context() as mp:  # fusedw, as the paged kernel (a small call would take fused2)
            mp.setenv("TPATTN_FUSED_CFG", f"fusedw_{'f16' if dtype == torch.float16 else 'bf16'}_d{d}")
            ref = prefix_attention(be, q, k, v, L0)  # (row tiles from L0 rounded down to 128: the same bits)
        assert torch.equal(got, ref), (L0, T)
        kk, vv = (t.double().repeat_interleave(h // g, 1) for t in (k, v))
        s = q.double() @ kk.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(torch.arange(n, device="cuda")[None, :] > L0 + torch.arange(T, device="cuda")[:, None],
                          float("-inf"))
        want = (torch.softmax(s, -1) @ vv).transpose(1, 2)  # [1, T, h, d]
        tol = 2e-3 if dtype == torch.float16 else 1.6e-2  # (P rounded to the dtype, then O once)
        assert ((got.double() - want).abs() <= tol * (1 + want.abs())).all(), (L0, T)


@pytest.mark.parametrize("page", [16, 128])
@torch.no_grad()
def test_chunk_graphs_replay_the_eager_chunks(page):
    """ChunkGraphs: two prompts in chunks of 192 rows, interleaved, every full chunk one replay of the
    graph captured on the first (its L0, rows' pages and table row sent to fixed tensors; the kernel
    reads L0 on the device), each prompt's shorter last chunk eager, then a decode step: the same rows as
    the same chunks run eagerly on a second pool (within fp16 rounding: the one kernel, a captured GEMM),
    and the same K and V in both pools (the replays wrote each chunk's rows where its pages are)."""
    from paged_prefill_steps import prompts_in_chunks
    from tpattn.paged import ChunkGraphs, PagedKV
    torch.manual_seed(0)
    H, g, d, T = 8, 2, 128, 192
    layer = fused_layer(H, g, d)
    lens = (700, 450)
    xs = [torch.randn(1, n + 1, H * d, device="cuda").half() for n in lens]
    outs, pools = {}, {}
    for graphed in (True, False):
        pool = PagedKV(layer, pages=2048 // page + 4, page_size=page, max_seqs=2)
        ids = [pool.add(), pool.add()]
        pools[graphed] = (pool, ids)
        chunks = ChunkGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), xs[0][:, :T], max_len=1024)
        got = prompts_in_chunks(layer, pool, ids, xs, lens, T, chunks if graphed else None)
        with pool.step(ids, [1, 1]) as st:
            y = layer(torch.cat([xs[0][:, -1:], xs[1][:, -1:]], 0), cache=st.view(0))
        for i in range(2):
            got[i].append(y[i:i + 1])
        outs[graphed] = [torch.cat(r, 1) for r in got]
        if graphed:
            assert chunks.run is not None and chunks.static.starts == [384]  # captured once, replayed since
    for a, b in zip(outs[True], outs[False]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-3
    kv = {}
    for graphed, (pool, ids) in pools.items():  # each sequence's K and V, through its pages
        pages = [torch.tensor(pool.tables[pool.slots[s]], device="cuda") for s in ids]
        kv[graphed] = [w[0][p].transpose(0, 1).reshape(g, -1, d)[:, :n + 1].float()
                       for w in (pool.k, pool.v) for p, n in zip(pages, lens)]
    for a, b in zip(kv[True], kv[False]):
        assert (a - b).abs().max().item() <= 2e-3


@pytest.mark.parametrize("g", [8, 2])
@torch.no_grad()
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_paged_prefill_through_triton_is_one_launch_and_matches_torch_math(g, kv_dtype, monkeypatch):
    """The triton backend's paged prefill (tpattn/attention/triton_paged.py): every sequence of a step in
    one launch, K/V read through the block table (16-bit pages, and an FP8 pool's e4m3 pages and row
    scales); ragged prompts, then chunks continuing two of them beside a new prompt, then a chunk
    beside a decode row; the same steps in torch math give the same rows."""
    pytest.importorskip("triton")
    from paged_prefill_steps import prefill_steps_both_ways
    torch.manual_seed(0)
    layer = fused_layer(8, g, 128, backend="triton")
    steps = [((0, 1, 2), (37, 5, 130)), ((0, 2, 3), (100, 64, 9)), ((1, 3), (300, 1))]
    calls, outs = prefill_steps_both_ways(layer, steps, 128, kv_dtype, "cuda", monkeypatch)
    assert calls == [True] * 3
    for a, b in zip(outs[True], outs[False]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-3


@pytest.mark.parametrize("backend", ["fused", "triton"])
@torch.no_grad()
def test_paged_chunked_prefill_holds_no_scores(backend):
    """A chunk of 2048 rows after 6144 in the cache (8 heads): its scores would be 512 MiB in fp32; the
    peak beyond the pool, weights and input stays at what q, o and the projections need (rows x d
    each): K and V are read in place."""
    from tpattn.paged import PagedKV
    torch.manual_seed(0)
    H, g, d = 8, 8, 128
    D = H * d
    if backend == "triton":
        pytest.importorskip("triton")
    layer = fused_layer(H, g, d, rope_theta=None, backend=backend)
    pool = PagedKV(layer, pages=8192 // 16, page_size=16, max_seqs=1)
    sid = pool.add()
    for n in (6144, 2048):
        x = torch.randn(1, n, D, device="cuda").half()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with pool.step([sid], [n]) as st:
            layer(x, cache=st.view(0))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    # the chunk's own tensors, fp16: the kernel's q and o buffers over the chunk's 2048 rows (2 x 4 MiB:
    # none for the 6144 before), QKV, q and y rows (20 MiB): ~28 MiB. Its fp32 scores would be 512 MiB
    # (attend's blocks: up to 1 GiB). Both read K/V in place, through the block table (fused:
    # FusedBackend.forward_paged; triton: its paged prefill); a gather of them would add 2 x 16 MiB
    assert peak < 48 * 2**20, peak / 2**20


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope", ["none", "halves", "interleaved"])
@pytest.mark.parametrize("d", [64, 128])
@torch.no_grad()
def test_paged_append_kernel_is_the_torch_rotation_and_writes(dtype, rope, d):
    """dec_append_pg (one launch: each row rotated at its own position, its K and V written at its
    page and offset) gives the bits of the torch path it replaces (rope_tables at the rows'
    positions, apply_rope, indexed writes): ragged positions across pages, GQA, q out."""
    from tpattn.decode import append_paged_kernel, apply_rope, rope_tables
    torch.manual_seed(1)
    R, h, g, P = 11, 8, 2, 16
    qkv = torch.randn(R, h + 2 * g, d, device="cuda").to(dtype)
    pos = torch.tensor([0, 1, 15, 16, 17, 300, 301, 4095, 5, 6, 7], device="cuda")
    pages = torch.randperm(30, device="cuda")[:R]
    pools = [torch.zeros(31, g, P, d, device="cuda", dtype=dtype) for _ in range(4)]
    cos = sin = None
    if rope != "none":
        cos, sin = rope_tables(torch.arange(4096, device="cuda"), d, 10000.0)
    q = append_paged_kernel(qkv, pools[0], pools[1], pos, pages, cos, sin, h, rope == "interleaved")
    qt, kt, vt = qkv.split([h, g, g], dim=1)
    if rope != "none":
        c, s = rope_tables(pos, d, 10000.0)
        qt = apply_rope(qt.transpose(0, 1).unsqueeze(0), c, s, rope == "interleaved")[0].transpose(0, 1)
        kt = apply_rope(kt.transpose(0, 1).unsqueeze(0), c, s, rope == "interleaved")[0].transpose(0, 1)
    pools[2][pages, :, pos % P] = kt
    pools[3][pages, :, pos % P] = vt
    assert torch.equal(q, qt)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@pytest.mark.parametrize("side", [False, True])
@torch.no_grad()
def test_graphed_paged_step_prepares_on_the_device_and_advances(side):
    """pg_prepare: each row's position, page, offset, block-table row and length after the step from
    (slots, lengths, the page a row takes) and the device's table mirror; a page taken in the row's
    table and written into the mirror; padding rows (the extra slot) at length 0 and the scratch
    pages; the inputs' lengths of live rows one more afterwards, the padding rows' unchanged, the
    pages taken left in place (a step that continues this one writes them again). side: on a side
    stream held back by a sleep, read through the properties (which join it) with no synchronize."""
    from tpattn.paged import PagedKV, _StaticStep
    layer = fused_layer(8, 2, 128)
    P, S, W = 16, 3, 6
    pool = PagedKV(layer, pages=20, page_size=P, max_seqs=S)
    mirror = torch.randint(0, 20, (S + 1, W), dtype=torch.int32, device="cuda")
    mirror[S] = pool.scratch_page
    st = _StaticStep(pool, 4, mirror)
    took = [[2, -1, -1, -1], [19, 0, 0, 0]]  # row 0 takes page 19 at column 2 (position 40 is its first)
    mirror[2, 2] = 5
    before = mirror.clone()
    st.inputs.copy_(torch.tensor([[2, 0, S, S], [40, 15, 0, 0], *took]))
    if side:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # (~0.1 s: a read that did not wait would see zeros)
        st.prepare(stream)
        assert st._ready is not None
        st.positions  # the join: the current stream waits for the side stream from here on
        assert st._ready is None
    else:
        st.prepare()
        torch.cuda.synchronize()
    slots, pos = [2, 0, S, S], [40, 15, 0, 0]
    after = before.clone()
    after[2, 2] = 19
    assert torch.equal(mirror, after)
    assert st.positions.tolist() == pos and st.page_offset.tolist() == [p % P for p in pos]
    assert st.page_index.tolist() == [19] + [after[s, p // P].item() for s, p in zip(slots[1:], pos[1:])]
    assert torch.equal(st.table, after[torch.tensor(slots, device="cuda")])
    assert st.lens.tolist() == [41, 16, 0, 0]
    assert st.inputs.tolist() == [slots, [41, 16, 0, 0], *took]


# ---- an FP8 pool (PagedKV(kv_dtype="fp8")): dec_append_pg8 and the split's _pg8 -------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope", ["none", "halves", "interleaved"])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@torch.no_grad()
def test_fp8_append_kernel_gives_quantize_rows_bits(dtype, rope, d):
    """dec_append_pg8: q as dec_append_pg writes it; each K and V row, rotated and rounded to the
    storage dtype, in e4m3 with its own scale: the bits of fp8.quantize_rows of the torch path's
    rows (a row of zeros: scale 0), at ragged positions across pages, GQA."""
    from tpattn.attention import fp8
    from tpattn.decode import append_paged_kernel, apply_rope, rope_tables
    torch.manual_seed(1)
    R, h, g, P = 11, 8, 2, 16
    qkv = torch.randn(R, h + 2 * g, d, device="cuda").to(dtype) * 3
    qkv[4, h + g] = 0  # a V row of zeros
    pos = torch.tensor([0, 1, 15, 16, 17, 300, 301, 4095, 5, 6, 7], device="cuda")
    pages = torch.randperm(30, device="cuda")[:R]
    pk, pv = (torch.zeros(31, g, P, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2))
    ks, vs = (torch.zeros(31, g, P, device="cuda") for _ in range(2))
    cos = sin = None
    if rope != "none":
        cos, sin = rope_tables(torch.arange(4096, device="cuda"), d, 10000.0)
    q = append_paged_kernel(qkv, pk, pv, pos, pages, cos, sin, h, rope == "interleaved", scales=(ks, vs))
    qt, kt, vt = qkv.split([h, g, g], dim=1)
    if rope != "none":
        c, s = rope_tables(pos, d, 10000.0)
        qt = apply_rope(qt.transpose(0, 1).unsqueeze(0), c, s, rope == "interleaved")[0].transpose(0, 1)
        kt = apply_rope(kt.transpose(0, 1).unsqueeze(0), c, s, rope == "interleaved")[0].transpose(0, 1)
    assert torch.equal(q, qt)
    for pool, sc, t in ((pk, ks, kt), (pv, vs, vt)):
        t8, s = fp8.quantize_rows(t)
        assert torch.equal(pool[pages, :, pos % P].float(), t8), "e4m3 bytes"
        assert torch.equal(sc[pages, :, pos % P], s.squeeze(-1)), "row scales"
    assert vs[pages[4], 0, pos[4] % P] == 0  # a row of zeros keeps scale 0


@pytest.fixture(params=["pg8", "pgt8", "pgt8s"])
def f8_tile(request, monkeypatch):
    """The builds of the tensor-core split over FP8 pages: _pg8 (any page) and, over whole-tile
    pages, _pgt8 (DEC_F8_TILE_PAGES) and _pgt8s (DEC_F8_KT too: the keys as the products' rows, up
    to 8 query heads a pass)."""
    import tpattn.decode as dec
    monkeypatch.setattr(dec, "DEC_F8_TILE_PAGES", request.param != "pg8")
    monkeypatch.setattr(dec, "DEC_F8_KT", request.param == "pgt8s")
    return request.param


def fp8_pool(pool_k, pool_v, k_gain=1.0):
    """An FP8 pool of 16-bit pages: e4m3 pages and their row scales [pages, g, page]."""
    from tpattn.attention import fp8
    pk8, ks = fp8.quantize_rows(pool_k.float() * k_gain)
    pv8, vs = fp8.quantize_rows(pool_v.float())
    return pk8.to(torch.float8_e4m3fn), pv8.to(torch.float8_e4m3fn), ks.squeeze(-1), vs.squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("h,g", [(32, 32), (32, 8), (16, 1)])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_fp8_paged_kernel_against_float64(h, g, d, dtype, page, f8_tile):
    """The split's _pg8 (and _pgt8) over e4m3 pages with row scales, ragged lengths (0 to 1100) through a
    shuffled block table: against float64 over the dequantized pages (the kernel's only roundings
    are fp32 sums and the output's), and a zero-length row is zero."""
    from tpattn.attention import fp8
    lens = [0, 1, 37, 300, 1100, 16]
    q, pool_k, pool_v, table, lens_t = paged_inputs(lens, h, g, d, page, dtype, seed=4)
    pk8, ks = fp8.quantize_rows(pool_k.float() * 2)
    pv8, vs = fp8.quantize_rows(pool_v.float())
    pk8, pv8 = pk8.to(torch.float8_e4m3fn), pv8.to(torch.float8_e4m3fn)
    ks, vs = ks.squeeze(-1), vs.squeeze(-1)
    o = paged_decode_attention(q, pk8, pv8, table, lens_t, max(lens), scales=(ks, vs))
    want = float64_rows(q, fp8.dequantize(pk8, ks), fp8.dequantize(pv8, vs), table, lens_t)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    assert (o.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    assert not o[0].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_paged_kernel_keeps_small_rows_beside_zero_rows(d, dtype, f8_tile):
    """The tensor-core split over e4m3 pages scales P by each key's V scale over the tile's largest
    before its fp16 product: V rows of size 1e-3 with a zero row in every 16-key tile (whose scale is
    0, not 1: a 1 would push the other keys' P into fp16 subnormals, 8 % off), grouped heads, against
    float64 over the dequantized pages."""
    from tpattn.attention import fp8
    lens = [1, 37, 300, 1100]
    q, pool_k, pool_v, table, lens_t = paged_inputs(lens, 32, 8, d, 16, dtype, seed=6)
    pool_v = pool_v.float() * 1e-3
    pool_v[:, :, ::16] = 0
    pk8, ks = fp8.quantize_rows(pool_k.float())
    pv8, vs = fp8.quantize_rows(pool_v)
    pk8, pv8 = pk8.to(torch.float8_e4m3fn), pv8.to(torch.float8_e4m3fn)
    ks, vs = ks.squeeze(-1), vs.squeeze(-1)
    o = paged_decode_attention(q, pk8, pv8, table, lens_t, max(lens), scales=(ks, vs))
    want = float64_rows(q, fp8.dequantize(pk8, ks), fp8.dequantize(pv8, vs), table, lens_t)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    assert (o.double() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,g", [(32, 8), (32, 2)])
@pytest.mark.parametrize("page", [16, 64])
def test_fp8_tile_build_gives_the_any_page_builds_bits_and_reads_nothing_past_a_length(h, g, d, dtype, page,
                                                                                        monkeypatch):
    """Over whole-tile pages, _pgt8 (paired scale loads, no run-time addressing) writes _pg8's bits,
    lengths ending inside a tile. Every page row past a sequence's length (its last page's rest, and the
    spare pages) holds NaN bytes and NaN scales: no build reads them into the output (_pgt8s, whose sums
    run in another order, within the float64 tolerance)."""
    import tpattn.decode as dec
    from tpattn.attention import fp8
    lens = [1, 37, 300, 1100, 16, 15]
    q, pool_k, pool_v, table, lens_t = paged_inputs(lens, h, g, d, page, dtype, seed=8)
    pk8, pv8, ks, vs = fp8_pool(pool_k, pool_v)
    want = float64_rows(q, fp8.dequantize(pk8, ks), fp8.dequantize(pv8, vs), table, lens_t)
    live = torch.zeros(pk8.shape[0], page, dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens):
        for i in range(-(-n // page)):
            live[table[b, i].long(), :min(page, n - i * page)] = True
    dead = ~live[:, None, :].expand(-1, g, -1)
    for t in (pk8, pv8):
        t.view(torch.uint8)[dead] = 0x7F  # e4m3 NaN
    ks[dead], vs[dead] = float("nan"), float("nan")
    outs = {}
    for build in ("pg8", "pgt8", "pgt8s"):
        monkeypatch.setattr(dec, "DEC_F8_TILE_PAGES", build != "pg8")
        monkeypatch.setattr(dec, "DEC_F8_KT", build == "pgt8s")
        outs[build] = paged_decode_attention(q, pk8, pv8, table, lens_t, max(lens), scales=(ks, vs))
    assert torch.isfinite(outs["pgt8"]).all() and torch.equal(outs["pgt8"], outs["pg8"])
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    for build in ("pgt8", "pgt8s"):
        assert torch.isfinite(outs[build]).all(), build
        assert (outs[build].double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()), build


@pytest.mark.parametrize("g", [8, 2])
@torch.no_grad()
def test_fp8_pool_steps_through_the_kernels_match_torch_math(g, monkeypatch):
    """An FP8 pool on the GPU: prompts of different lengths (torch math over dequantized pages; the
    kernel quantizes their K and V), decode steps through dec_append_pg8 and _pg8, sequences
    joining and leaving, against the same steps in torch math; the pages and scales equal bit for
    bit; the graphed steps (DecodeGraphs) give the eager kernel steps' rows."""
    import tpattn.decode as dec
    import tpattn.paged as paged
    torch.manual_seed(0)
    H, d = 8, 128
    D = H * d
    layer = fused_layer(H, g, d)
    outs, pools = {}, {}
    fits = dec.fp8_pages_fit
    for kernel in (True, False):
        monkeypatch.setattr(dec, "fp8_pages_fit", fits if kernel else (lambda q: False))
        pools[kernel] = paged.PagedKV(layer, pages=256, page_size=16, max_seqs=8, kv_dtype="fp8")
        outs[kernel] = serve_steps(layer, pools[kernel])
    monkeypatch.undo()
    for a, b in zip(outs[True], outs[False]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-3
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(getattr(pools[True], name)[0].float(), getattr(pools[False], name)[0].float()), name
    rows = {}
    for capture in (True, False):
        gen = torch.Generator().manual_seed(3)
        pool = paged.PagedKV(layer, pages=64, page_size=16, max_seqs=4, kv_dtype="fp8")
        ids = [pool.add() for _ in range(3)]
        for sid, n in zip(ids, (50, 7, 130)):
            with pool.step([sid], [n]) as st:
                layer(torch.randn(1, n, D, generator=gen).half().cuda(), cache=st.view(0))
        graphs = paged.DecodeGraphs(pool, lambda x, st: layer(x, cache=st.view(0)), torch.zeros(4, 1, D).half().cuda(),
                                    max_len=256, buckets=(2, 4), capture=capture)
        rows[capture] = [graphs.step(ids, torch.randn(len(ids), 1, D, generator=gen).half().cuda()) for _ in range(4)]
    for a, b in zip(rows[True], rows[False]):
        assert torch.equal(a, b)
