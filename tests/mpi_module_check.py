"""Run under mpirun -n 2 or 4 by tests/test_module.py (CPU, gloo): the layer's module rules that need
several ranks. Prints 'MODULE PASS rank R' and exits 0, or prints what failed and exits 1.

- The collectives a call runs never depend on state that can differ between ranks: with a frozen
  layer, rank 0's x requiring grad and the others' not, every rank runs the same collectives (one
  rank took the training all-reduce, another the inference split, and waited out the timeout).
- A setting changed after a sequence-parallel call is refused; replace() gives the head-parallel layer.
- gather_sequence of a training output is differentiable (one rank raised "a rank died", the other
  went on to its next collective).
- A collective's local error is said to be local, on every rank.
- train_nbytes names exactly the collectives a training step runs (GQA copies and sequence parallel
  under-counted).
- (4 ranks) K/V heads held by 2 ranks each: their gradients are summed over those 2 ranks, one
  slot (the world's groups), or over a layer group that is not the world as G slots; the bytes are
  what train_nbytes counts and the gradients the single-process ones.
- deepcopy and torch.save/load under a process group; full_weights() rebuilds the layer in one process.
- torch.compile of a model holding the layer (head- and sequence-parallel): one graph, no break (the
  collectives trace as torch's functional collectives), eager's output and gradients.
"""

import copy
import io

import torch

from tpattn.comm import CollectiveError
from tpattn.dist import exit_now, init_distributed
from tpattn.layer import TensorParallelAttention

proc = init_distributed(backend="gloo", timeout=60)
W, R = proc.world, proc.rank
E, H, d = 16, 4, 4
torch.manual_seed(0)
full = {"wq": torch.randn(E, H * d) / 4, "wk": torch.randn(E, H * d) / 4, "wv": torch.randn(E, H * d) / 4,
        "wo": torch.randn(H * d, E) / 4, "bq": torch.randn(H * d) / 4, "bk": torch.randn(H * d) / 4,
        "bv": torch.randn(H * d) / 4, "bo": torch.randn(E) / 4}
x = torch.randn(2, 8, E)
dy = torch.randn(2, 8, E)
bad = []


def spy(layer) -> list:
    """The labels of every collective the layer's Comm runs, in order."""
    seen, run = [], layer.comm._run

    def recorded(name, *args, **kw):
        seen.append(name)
        return run(name, *args, **kw)
    layer.comm._run = recorded
    return seen


def build(**kw):
    return TensorParallelAttention.from_full(**full, heads=H, **kw)


# ---- the same collectives whatever a rank's autograd state ---------------------------------------
frozen = build(causal=True).requires_grad_(False)
labels = spy(frozen)
with torch.no_grad():
    y_inf = frozen(x)
inference = list(labels)
labels.clear()
y_mixed = frozen(x.clone().requires_grad_(R == 0))  # differentiable on rank 0 only
if list(labels) != inference:
    bad.append(f"rank {R}: a call with x.requires_grad={R == 0} ran {labels}, inference ran {inference}")
if not torch.equal(y_mixed.detach(), y_inf):
    bad.append("the differentiable call's y differs from the inference call's")
if frozen.plan(2, 8).collective not in ("allreduce", "split"):
    bad.append(f"plan: {frozen.plan(2, 8)}")

# ---- settings fixed; replace() builds the other style -------------------------------------------
sp = build(sequence_parallel=True)
n = 8 // W
mine = x[:, R * n:(R + 1) * n]
with torch.no_grad():
    y_block = sp(mine)
try:
    sp.sequence_parallel = False
    bad.append("sequence_parallel could be assigned after construction")
except AttributeError as exc:
    if "is fixed when the layer is built" not in str(exc):
        bad.append(f"assignment refused with {exc}")
heads = sp.replace(sequence_parallel=False)
with torch.no_grad():
    y_heads = heads(x)
if not torch.allclose(y_heads[:, R * n:(R + 1) * n], y_block, atol=1e-6):
    bad.append("replace(sequence_parallel=False) differs from the sequence-parallel rows")

# ---- gather_sequence under autograd: differentiable, its backward the reduce-scatter -------------
xb = mine.clone().requires_grad_()
whole = sp.gather_sequence(sp(xb))
(whole * dy).sum().backward()
single = TensorParallelAttention.from_full(**full, heads=H, group=None)
xf = x.clone().requires_grad_()
(single(xf) * dy).sum().backward()
if not torch.allclose(whole.detach(), single(x).detach(), atol=1e-6):
    bad.append("gather_sequence's whole sequence differs from the single-process y")
if not torch.allclose(xb.grad, xf.grad[:, R * n:(R + 1) * n], atol=1e-6):
    bad.append(f"x.grad through gather_sequence differs by {(xb.grad - xf.grad[:, R * n:(R + 1) * n]).abs().max()}")
if not torch.allclose(sp.wo.grad, single.wo.grad[sp.head_range.start * d:sp.head_range.stop * d], atol=1e-5):
    bad.append("W_o's gradient through gather_sequence differs from the single-process one")

# ---- a local error inside a collective is not "a rank died" --------------------------------------
try:
    sp.comm._run("allreduce", lambda t, group=None: (_ for _ in ()).throw(RuntimeError("a tensor of this rank is "
                                                                                        "not what the op takes")),
                 1, torch.zeros(3))
    bad.append("the local error was swallowed")
except CollectiveError as exc:
    if "failed on this rank (no other rank caused it)" not in str(exc) or "died" in str(exc):
        bad.append(f"a local error reported as {exc}")

# ---- train_nbytes: exactly the collectives of a training step ------------------------------------
for kw in ({}, {"sequence_parallel": True}, {"kv_heads": 1}, {"kv_heads": 2, "overlap": 2}):
    g = kw.get("kv_heads", H)
    w = dict(full, wk=full["wk"][:, :g * d], wv=full["wv"][:, :g * d], bk=full["bk"][:g * d], bv=full["bv"][:g * d])
    kw2 = {k: v for k, v in kw.items() if k != "kv_heads"}
    layer = TensorParallelAttention.from_full(**w, heads=H, **kw2)
    seen = spy(layer)
    xin = (mine if kw.get("sequence_parallel") else x).clone().requires_grad_()
    y = layer(xin)
    y.backward(torch.ones_like(y))
    counted = layer.train_nbytes(2, 8)
    if sorted(set(seen)) != sorted(counted) or any(seen.count(k) != (layer.overlap if k in ("allreduce", "reducescatter",
                                                                                              "allgather") else 1)
                                                   for k in counted if k in seen):
        bad.append(f"{kw}: a step ran {seen}, train_nbytes counts {sorted(counted)}")

# ---- the K/V copies' gradient sum: over the ranks holding the head (their own group), one slot ----
def gqa(g, **kw):
    w = dict(full, wk=full["wk"][:, :g * d], wv=full["wv"][:, :g * d], bk=full["bk"][:g * d], bv=full["bv"][:g * d])
    return w, TensorParallelAttention.from_full(**w, heads=H, **kw)


if W == 4:
    import torch.distributed as dist
    w2, single = gqa(2, group=None)
    xs = x.clone().requires_grad_()
    single(xs).backward(dy)
    for name, group in (("world", "world"), ("a group of the same ranks", dist.new_group(list(range(W))))):
        _, layer = gqa(2, group=group)  # each K/V head on 2 ranks
        sizes = []
        run = layer.comm._run

        def recorded(label, op, overlap, *tensors, over=None, _run=run):
            if label.startswith("bwd_copies"):
                sizes.append((label, tensors[0].numel() * tensors[0].element_size(),
                              over[1] if over is not None else layer.world))
            return _run(label, op, overlap, *tensors, over=over)
        layer.comm._run = recorded
        xl = x.clone().requires_grad_()
        layer(xl).backward(dy)
        counted = layer.train_nbytes(2, 8)
        ranks = 2 if group == "world" else W  # the world has the copies' groups; another group: G slots over it
        if sorted(sizes) != sorted((k, counted[k], ranks) for k in ("bwd_copies", "bwd_copies_bias")) \
                or layer.copies_world() != ranks:
            bad.append(f"copies on {name}: ran {sizes}, train_nbytes {counted}, copies_world {layer.copies_world()}")
        got = layer.full_grads()
        for k, v in single.full_grads().items():
            if v is not None and not torch.allclose(got[k], v, atol=1e-5):
                bad.append(f"copies on {name}: the gradient of {k} differs by {(got[k] - v).abs().max():.2e}")
        if not torch.allclose(xl.grad, xs.grad, atol=1e-5):
            bad.append(f"copies on {name}: x.grad differs")

# ---- torch.compile over several ranks: the collectives trace as functional collectives -----------
import torch._dynamo as dynamo  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.lin = torch.nn.Linear(E, E)
        self.attn = build(causal=True, **kw)

    def forward(self, t):
        return t + self.attn(self.lin(t))


torch.manual_seed(1)
for kw, xin in (({}, x), ({"sequence_parallel": True}, mine)):
    model = Block(**kw)
    with torch.no_grad():
        found = dynamo.explain(model)(xin)
    dynamo.reset()
    found_train = dynamo.explain(model)(xin.clone().requires_grad_())
    dynamo.reset()
    for what, e in (("inference", found), ("training", found_train)):
        if (e.graph_count, e.graph_break_count) != (1, 0):
            bad.append(f"compile {kw} {what}: {e.graph_count} graphs, breaks {[str(b.reason)[:120] for b in e.break_reasons]}")
    with torch.no_grad():
        if not torch.allclose(torch.compile(model)(xin), model(xin), atol=1e-5):
            bad.append(f"compile {kw}: the compiled output differs from eager")
    dynamo.reset()
    model(xin).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.compile(model, backend="aot_eager")(xin).square().sum().backward()
    dynamo.reset()
    if any(not torch.allclose(p.grad, want[n], atol=1e-5) for n, p in model.named_parameters()):
        bad.append(f"compile {kw}: the compiled training step's gradients differ from eager")

# ---- deepcopy, pickling, full_weights under a process group --------------------------------------
layer = build(causal=True)
with torch.no_grad():
    y = layer(x)
    twin = copy.deepcopy(layer)
    if twin.group is not layer.group or not torch.equal(twin(x), y):
        bad.append("deepcopy: another group or another output")
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    if loaded.group is not layer.group or not torch.equal(loaded(x), y):
        bad.append("torch.save/load: another group or another output")
    weights = layer.full_weights()
    alone = TensorParallelAttention.from_full(**weights, heads=H, causal=True, group=None)
    if any(not torch.equal(weights[k], full[k]) for k in full) or not torch.allclose(alone(x), y, atol=1e-6):
        bad.append("full_weights() does not give back the weights the layer was built from")

for b in bad:
    print(f"rank {R}: FAIL {b}", flush=True)
if not bad:
    print(f"MODULE PASS rank {R}", flush=True)
exit_now(1 if bad else 0)
