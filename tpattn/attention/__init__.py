"""Local attention backends, by name. Each takes q of shape [B, h, N, d] and k, v of shape
[B, g, N, d] (contiguous, the storage dtype) with g dividing h, and returns o of q's shape, timing
its passes (qk, softmax, pv; fused: one pass, "fused") on the recording Timer (tpattn.timing). g < h is grouped-query
attention (g = 1: multi-query): query head i attends with K/V head i // (h / g), which every
backend reads in place (K and V are never repeated h / g times in memory).

Add a backend: subclass Backend in a module here and list it in _BACKENDS.
"""

from __future__ import annotations

import importlib

import torch

from ..errors import ConfigError, FlagError, check_flags, cupy_available, cupy_missing_message
from . import custom_ops
from .autograd import _Attention, _AttentionPacked, split_packed

_BACKENDS = {
    "reference": "tpattn.attention.reference:ReferenceBackend",
    "naive": "tpattn.attention.naive:NaiveBackend",
    "tiled": "tpattn.attention.tiled:TiledBackend",
    "fused": "tpattn.attention.fused:FusedBackend",
    "triton": "tpattn.attention.triton_fused:TritonBackend",
}
# the FP8 forwards (--dtype fp8 with --kernel reference, triton or fused), by name for the API and for
# unpickling a layer; not --kernel choices
_FP8_BACKENDS = {
    "fp8": "tpattn.attention.fp8:Fp8Backend",
    "fp8_triton": "tpattn.attention.triton_fp8:Fp8TritonBackend",
    "fp8_fused": "tpattn.attention.fp8_ws:Fp8FusedBackend",
}


class Backend:
    name = "?"
    max_head_dim = 256
    dtypes = ("fp16", "bf16", "fp32")
    devices = ("cpu", "cuda")
    materializes_scores = True  # S and P are written to device memory
    row_chunks = None           # a backend that computes a chunk of query rows (forward(rows=(r0, r1)))
                                # sets the multiple r0 must be; the layer then overlaps per chunk
    strided = False             # True: q, k, v and out= may be strided [B, h, N, d] views (rows contiguous)
    packed_grads = False        # True: forward_for_backward takes out= (o's memory), backward takes any do
                                # with contiguous rows and out= (dq, dk, dv to write, strided views)
    saves_lse = False           # forward_for_backward's `saved` is the rows' logsumexp, fp32 [B, h, N]

    def check_supported(self, cfg) -> None:
        if cfg.device not in self.devices:
            hint = "use --kernel reference on CPU" if cfg.device == "cpu" else "choose another --kernel"
            raise FlagError(f"--kernel {self.name} does not run on {cfg.device}; {hint}")
        if cfg.dtype not in self.dtypes:
            raise FlagError(f"--kernel {self.name} does not support --dtype {cfg.dtype}; "
                              f"use one of {', '.join(self.dtypes)}")

    def forward(self, q, k, v, causal: bool):
        raise NotImplementedError

    # ---- the backward (tpattn/attention/autograd.py has the math and the interface) ----

    def attention(self, q, k, v, causal: bool, deterministic: bool = False):
        """o, differentiable: its backward is this backend's backward(). Inside a graph that
        torch.compile or torch.export traces: the same through the custom op tpattn::attention."""
        if torch.compiler.is_compiling():  # (get_backend put this backend in the ops' table, outside the trace)
            return custom_ops.attention(q, k, v, causal, self.name, deterministic)
        return _Attention.apply(q, k, v, self, causal, deterministic)

    def attention_packed(self, qkv, h: int, g: int, causal: bool, deterministic: bool = False):
        """attention(q, k, v) of the heads of qkv [B, N, h + 2g, d] (q the first h, k the next g, v the
        last g), differentiable: a packed_grads backend writes qkv's gradient whole (no concatenation
        of dq, dk and dv); any other, and inside a traced graph, through attention() of the heads
        (contiguous copies for a backend that is not strided)."""
        if self.packed_grads and not torch.compiler.is_compiling():
            return _AttentionPacked.apply(qkv, h, g, self, causal, deterministic)
        q, k, v = split_packed(qkv, h, g)
        if not self.strided:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return self.attention(q, k, v, causal, deterministic)

    def forward_for_backward(self, q, k, v, causal: bool):
        """(o, saved): the forward, and what backward() needs beyond q, k, v and o (or None)."""
        raise ConfigError(f"--kernel {self.name} has no backward pass; use --kernel fused, naive or reference")

    def backward(self, q, k, v, o, saved, do, causal: bool, deterministic: bool = False):
        """(dq, dk, dv) for the upstream gradient do."""
        raise ConfigError(f"--kernel {self.name} has no backward pass; use --kernel fused, naive or reference")


class CudaBackend(Backend):
    """CUDA kernels of kernels/*.cu launched through CuPy: GPU only, CuPy needed."""
    devices = ("cuda",)
    suffix = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}  # kernel name suffix by dtype

    def head_dim_error(self, d: int) -> str | None:
        """None when the kernels handle head dim d, else the one-line fix."""
        if not 1 <= d <= self.max_head_dim:
            return f"--kernel {self.name} supports head dims 1..{self.max_head_dim} (got {d})"
        return None

    def check_supported(self, cfg) -> None:
        super().check_supported(cfg)
        err = self.head_dim_error(cfg.head_dim)
        if err:
            raise FlagError(err)
        if not cupy_available():
            raise FlagError(cupy_missing_message(self.name))

    def kernel_suffix(self, q) -> str:
        """Check q is a CUDA tensor of a supported dtype and head dim; the kernels' name suffix."""
        if q.device.type != "cuda":
            raise ConfigError(f"--kernel {self.name} needs CUDA tensors; use --kernel reference on CPU")
        err = self.head_dim_error(q.shape[-1])
        if err:
            raise ConfigError(err)
        name = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}.get(str(q.dtype))
        if name not in self.dtypes:
            raise ConfigError(f"--kernel {self.name} supports {', '.join(self.dtypes)} (got {q.dtype})")
        return self.suffix[name]


def kv_group(q, k, v, rows_before: int = 0) -> int:
    """Query heads per K/V head (1 for multi-head attention), after checking that k and v have q's
    batch, sequence and head dim and a head count that divides q's (rows_before: q holds the rows of
    the sequence from there on)."""
    if k.shape != v.shape or k.dim() != 4 or q.dim() != 4:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape [B, g, N, d] "
                         f"(q is {tuple(q.shape)})")
    b, h, n, d = q.shape
    n += rows_before
    g = k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, n, d) or g < 1 or h % g:
        raise ValueError(f"k and v {tuple(k.shape)} do not fit q {tuple(q.shape)}: they need q's batch, "
                         f"sequence and head dim and a head count that divides its {h} heads")
    return h // g


def head_chunks(h: int, group: int, chunk: int) -> list[tuple[int, int]]:
    """Query-head ranges [h0, h1) of about `chunk` heads, each either whole groups (a multiple of
    `group` heads, starting at a group's first head) or heads of one group only, so that the K/V
    heads of a chunk are one contiguous range and every query head of it maps onto them evenly."""
    if chunk >= group:
        step = chunk // group * group
        return [(h0, min(h, h0 + step)) for h0 in range(0, h, step)]
    return [(h0, min(g0 + group, h0 + chunk)) for g0 in range(0, h, group) for h0 in range(g0, g0 + group, chunk)]


def backend_names() -> list[str]:
    return list(_BACKENDS)


_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    where = _BACKENDS.get(name) or _FP8_BACKENDS.get(name)
    if where is None:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(_BACKENDS)} (or, FP8 forwards, "
                          f"{', '.join(_FP8_BACKENDS)})")
    if name not in _instances:
        mod, cls = where.split(":")
        register(getattr(importlib.import_module(mod), cls)())
        _instances[name] = custom_ops.BACKENDS[name]
    return _instances[name]


def register(backend: Backend) -> Backend:
    """backend where the custom ops find it, by its name (they are handed the name, not the object). A
    name taken by a backend of another class is refused in one line: the ops would run that one."""
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or name in ("", "?"):
        raise ConfigError(f"backend {type(backend).__name__} needs a name of its own (a `name` class attribute): "
                          "the custom ops find a backend by its name")
    have = custom_ops.BACKENDS.setdefault(name, backend)
    if type(have) is not type(backend):
        raise ConfigError(f"backend {type(backend).__name__} is named {name!r}, the name of {type(have).__name__} "
                          f"already in use: give {type(backend).__name__} a name of its own (its `name` attribute)")
    return have


def attention(q, k, v, causal: bool = False, backend: str | Backend = "reference", deterministic: bool = False):
    """softmax(q kᵀ/√d) v for q [B, h, N, d] and k, v [B, g, N, d] (g divides h), differentiable:
    o.backward(do) fills q.grad, k.grad and v.grad through the backend's backward (the math and the
    interface: tpattn/attention/autograd.py). deterministic: bitwise-identical gradients from run
    to run (the fused kernel then sums dQ in a fixed order instead of with atomics). With the fused
    backend, a q whose rows hold every head ([B, N, h, d] seen as [B, h, N, d]) gives an o laid out
    the same way (o.transpose(1, 2) is contiguous), as SDPA's kernels do: call .contiguous() for a
    contiguous [B, h, N, d]."""
    check_flags(causal=causal, deterministic=deterministic)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if not q.is_floating_point() or {k.dtype, v.dtype} != {q.dtype}:
        raise TypeError(f"q, k and v must share one floating-point dtype (got {q.dtype}, {k.dtype}, {v.dtype}); "
                        "convert them with .to(dtype)")
    if q.dim() == 4 and q.shape[-1] < 1:
        raise ValueError(f"q {tuple(q.shape)}: the head dim must be at least 1")
    if not isinstance(backend, (str, Backend)) and not callable(getattr(backend, "attention", None)):
        raise TypeError(f"backend must be a backend's name or a Backend instance (got {type(backend).__name__})")
    b = get_backend(backend) if isinstance(backend, str) else backend
    return b.attention(q, k, v, causal, deterministic)
