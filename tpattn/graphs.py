"""CUDA graphs of the layer: the forward, a decode step (tpattn/decode.py), and a whole training step.

    replay = layer.graphed(x)                 # y = layer(x), one graph
    replay = layer.graphed(x_row, cache)      # one decode step a replay
    replay = layer.graphed(x, dy=dy)          # forward and backward, one graph

A graph replays the kernels, GEMMs and collectives of one call with no host work: for a training
step that is every launch of the forward and of the backward (the host cost that a small step pays
eagerly, docs/training.md). New inputs are copied into the captured tensors in place (x, dy).

A training step's graph writes each replay's gradients (not a sum over replays) into tensors it
owns, and puts them back in every parameter's `.grad` (and x's, when x requires a gradient) after
each replay, so `optimizer.zero_grad(set_to_none=True)` between replays is harmless; accumulating
over replays is the caller's sum.
"""

from __future__ import annotations

import torch

from .errors import ConfigError


def refusal(layer, x: torch.Tensor) -> str | None:
    """Why layer(x) cannot be captured at all, or None."""
    if getattr(layer, "context_parallel", 1) > 1:
        return (f"graphed() with context_parallel={layer.context_parallel}: the ring's passes are not captured in "
                "a graph; call the layer eagerly")
    if x.device.type != "cuda":
        return (f"graphed() captures CUDA work, and x is on {x.device.type}; call the layer eagerly there "
                "(or move the layer and x to a GPU)")
    return None


def capture(call, x: torch.Tensor, warmups: int, before_capture=None, grad: bool = False):
    """(graph, out): call() run `warmups` times on a side stream (every kernel compiled and loaded,
    NCCL's communicator made), then captured once. before_capture(): run between the two (on the
    host). grad: autograd on (a training step), else under no_grad."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream(device=x.device)
    side.wait_stream(current)
    with torch.set_grad_enabled(grad):
        with torch.cuda.stream(side):
            for _ in range(warmups):
                call()
        current.wait_stream(side)
        torch.cuda.synchronize()
        if before_capture is not None:
            before_capture()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the collective watchdog's thread polls CUDA events of earlier collectives; in
        # the default (global) mode such a query from any thread during the capture invalidates it
        # (seen once over NCCL: "operation failed due to a previous error during capture")
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = call()
    return graph, out


def replayer(world: int, graph, out, before=None, after=None):
    """The replay function: before(), the graph under the collective watch (a no-op unless the CLI's
    watch runs: a rank that stalls in a replay ends the job after --timeout), after(); returns out."""
    from . import watch

    def replay() -> torch.Tensor:
        if before is not None:
            before()
        with watch.collective("graph", world, True):
            graph.replay()
        if after is not None:
            after()
        return out
    replay.graph = graph
    return replay


def graphed_forward(layer, x: torch.Tensor):
    """layer(x) in one graph (inference: no gradients recorded)."""
    why = refusal(layer, x)
    if why:
        raise ConfigError(why)
    graph, y = capture(lambda: layer(x), x, 2)
    layer.peers.pin()
    return replayer(layer.world, graph, y)


def graphed_train(layer, x: torch.Tensor, dy: torch.Tensor):
    """y = layer(x); y.backward(dy) in one graph. Each replay fills every parameter's gradient (and
    x's, if x requires one) with that step's, and returns y (detached). x and dy are the captured
    inputs: copy a new step's into them in place. The step's collectives are the eager step's (the
    plan, the dX all-reduce, the copies' sums), captured once."""
    why = refusal(layer, x)
    if why:
        raise ConfigError(why)
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device:
        raise ValueError(f"graphed(x, dy=dy): dy must be like y, which is like x ({tuple(x.shape)}, {x.dtype}, "
                         f"{x.device}; got {tuple(dy.shape)}, {dy.dtype}, {dy.device})")
    replay = step_graph(layer, x, dy, layer.world)
    layer.peers.pin()
    return replay


def step_graph(module, x: torch.Tensor, dy: torch.Tensor, world: int = 1):
    """y = module(x); y.backward(dy) in one graph, for any module (the benchmark's plain PyTorch
    layer too): the replay function, putting each replay's gradients back in .grad."""
    leaves = [p for p in module.parameters() if p.requires_grad] + ([x] if x.requires_grad else [])
    if not leaves:
        raise ValueError("graphed(x, dy=dy) captures a training step, but neither x nor any parameter of the "
                         "layer requires a gradient; use graphed(x) for inference")

    def step() -> torch.Tensor:
        y = module(x)
        y.backward(dy)
        return y.detach()

    def forget():  # the capture's backward allocates the gradients it writes, from the graph's pool
        for t in leaves:
            t.grad = None
    forget()
    graph, y = capture(step, x, 2, before_capture=forget, grad=True)
    grads = [t.grad for t in leaves]

    def put_back():
        for t, g in zip(leaves, grads):
            t.grad = g
    return replayer(world, graph, y, after=put_back)
