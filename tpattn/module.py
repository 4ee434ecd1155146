"""What makes the layer (tpattn/layer.py) a module that a model can hold: its settings fixed at
construction (replace() builds another layer), its checkpoints (the shard in state_dict), its
copies and pickles (deepcopy keeps the process group, a pickle binds to the loading process's),
the conversions from and to full weights (tpattn/convert.py), and the process group it runs on."""

from __future__ import annotations

import copy

import torch

from . import convert
from .attention import get_backend
from .comm import WORLD, Comm, context_groups, resolve_group  # noqa: F401 (WORLD, re-exported)
from .peer import PeerLinks
from .sharding import Shard

# what replace() may change: the rest (heads, K/V heads, the shard) is the weights' layout
STYLE = ("backend", "causal", "reduce_dtype", "head_chunk", "sequence_parallel", "overlap", "output_collective",
         "rope_theta", "rope_interleaved", "deterministic", "context_parallel")
FIXED = frozenset(STYLE + ("heads", "head_dim", "shard", "group", "comm", "peers", "ring"))


def make_comms(group, shard, context_parallel: int):
    """(comm, ring): the head-parallel collectives' Comm over the shard's ranks, and with context
    parallelism the ring's (tpattn.comm.context_groups: rank r is ring rank r % C and heads rank
    r // C), else None."""
    copies = max(1, shard.world // shard.kv_heads)
    if context_parallel == 1:
        return Comm(group, shard.rank, shard.world, copies), None
    heads, ring = context_groups(group, context_parallel)
    _, rank, _ = resolve_group(group)
    return Comm(heads, shard.rank, shard.world, copies), Comm(ring, rank % context_parallel, context_parallel)


class LayerModule(torch.nn.Module):
    """The module side of TensorParallelAttention (its settings, shard, weights and group are the
    subclass's: see its constructor)."""

    def __setattr__(self, name, value):
        if name in FIXED and self.__dict__.get("_built"):
            hint = f"layer.replace({name}=...) returns one with the same weights" if name in STYLE else \
                "build it from the weights again (full_weights(), from_full())"
            raise AttributeError(f"layer.{name} is fixed when the layer is built (its plans, buffers and caches "
                                 f"depend on it); build a new layer: {hint}")
        super().__setattr__(name, value)

    def replace(self, **changes) -> "LayerModule":
        """A new layer with this one's weights (copies, on this rank) and these settings changed
        (any of STYLE); the same group and shard."""
        bad = sorted(set(changes) - set(STYLE))
        if bad:
            raise ValueError(f"replace() changes the settings {', '.join(STYLE)}; not {', '.join(bad)} (the "
                             "shard is the weights' layout: build from full_weights() instead)")
        kw = {n: getattr(self, n) for n in STYLE} | changes
        w = {n: (None if t is None else t.detach().clone()) for n, t in convert.local_slices(self).items()}
        return type(self)(**w, heads=self.heads, head_dim=self.head_dim, group=self.group, kv_heads=self.kv_heads,
                          uneven_heads=self.uneven_heads, **kw)

    def get_extra_state(self) -> dict:
        s = self.shard
        return {"rank": s.rank, "world": s.world, "heads": s.heads, "kv_heads": s.kv_heads, "uneven": s.uneven,
                "head_dim": self.head_dim}

    def set_extra_state(self, state: dict) -> None:
        """Refuses another shard's checkpoint. The uneven flag alone is not the shard: a checkpoint of
        the same heads on the same rank loads whatever flag built it."""
        mine = self.get_extra_state()
        try:
            same = Shard.of(state["heads"], state["kv_heads"], state["world"], state["rank"], state["uneven"])
            ok = state["head_dim"] == self.head_dim and (same.rank, same.world, same.head_range,
                                                         same.kv_head_range) == \
                (self.rank, self.world, self.head_range, self.shard.kv_head_range)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"this checkpoint holds {_describe(state)} but this layer is {_describe(mine)}: load "
                             "each rank's own checkpoint into a layer built with the same world size and heads")

    # ---- construction from full weights, and back (tpattn/convert.py) ----------------------------

    from_full = classmethod(convert.from_full)
    from_linears = classmethod(convert.from_linears)
    from_multihead_attention = classmethod(convert.from_multihead_attention)
    from_hf_llama = classmethod(convert.from_hf_llama)

    def full_weights(self) -> dict[str, torch.Tensor | None]:
        """The whole weights in from_full()'s layout (wq, wk, wv, wo, bq, bk, bv, bo; None for a bias
        the layer has not), gathered on every rank (a collective: call it on every rank):
        from_full(**layer.full_weights(), heads=...) rebuilds the layer, on any world size."""
        return convert.assemble(self, "data")

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The whole gradients in from_full()'s layout, fp32 (fp64 for an fp64 layer), assembled on
        every rank (a collective). K/V heads held by several ranks carry the sum of their copies'."""
        return convert.assemble(self, "grad")

    # ---- modules' life: copies and pickles -------------------------------------------------------

    def __deepcopy__(self, memo):
        """A copy on the same process group (its own peer buffers, made when it first needs them)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for keep in (self.group, self.backend):
            if keep is not None:
                memo[id(keep)] = keep
        comm, ring = make_comms(self.group, self.shard, self.context_parallel)
        memo[id(self.comm)] = comm
        if self.ring is not None:
            memo[id(self.ring)] = ring
        memo[id(self.peers)] = PeerLinks(comm, self.output_collective)
        for k, v in self.__dict__.items():
            object.__setattr__(new, k, copy.deepcopy(v, memo))
        return new

    def __getstate__(self):
        """Pickled without the process group (nor the peer buffers, the backend's kernels or the
        plans): unpickling binds to the group of the process that loads it (__setstate__)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("group", "comm", "ring", "peers", "_plans", "backend")}
        state["backend"] = self.backend.name
        return state

    def __setstate__(self, state):
        shard = state["shard"]
        group, rank, world = resolve_group(WORLD)
        C = state.get("context_parallel", 1)
        if (rank // C, world // C) != (shard.rank, shard.world) or world % C:
            raise ValueError(f"this layer was pickled as rank {shard.rank} of {shard.world} but this process is rank "
                             f"{rank} of {world}; save and load each rank's state_dict() instead")
        state = dict(state, group=group, backend=get_backend(state["backend"]), _plans={})
        state["comm"], state["ring"] = make_comms(group, shard, C)
        state["peers"] = PeerLinks(state["comm"], state["output_collective"])
        self.__dict__.update(state)

def _describe(state: dict) -> str:
    return (f"rank {state.get('rank')} of {state.get('world')} ({state.get('heads')} heads, "
            f"{state.get('kv_heads')} K/V heads, head dim {state.get('head_dim')}, uneven {state.get('uneven')})")
