"""The run's configuration and every check on it.

Checks are pure functions of the config, the world size and this node's devices, so every rank
runs them before the first collective and (with the same arguments) reaches the same answer.
Each failed check is one line that says what to change.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

from .commplan import OUTPUT_COLLECTIVES, make_plan  # noqa: F401 (OUTPUT_COLLECTIVES re-exported)
from .errors import ConfigError, FlagError, cupy_available, cupy_missing_message  # noqa: F401 (re-exported)
from .sharding import context_conflict  # noqa: F401 (the CLI's and tpattn.plan's, re-exported)

INT_MAX = 2**31 - 1
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FP8 = "fp8"  # --dtype fp8: attention in e4m3 (tpattn.attention.fp8.Fp8Backend), weights and projections in fp16
REDUCE_DTYPES = ("fp32", "model")
KV_DTYPES = ("model", "fp8")  # --kv-dtype: --decode's cache in the layer's dtype, or e4m3 pages (tpattn.paged)
DIST_BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cuda", "cpu")

# The seed's shape; on a machine without a GPU the default run uses CPU_DEFAULTS instead.
GPU_DEFAULTS = {"seq_len": 4096, "heads": 32, "head_dim": 128}
CPU_DEFAULTS = {"seq_len": 1024, "heads": 8, "head_dim": 64}


@dataclass
class Config:
    seq_len: int | None = None
    heads: int | None = None
    head_dim: int | None = None
    kv_heads: int | None = None        # K/V heads (grouped-query attention); None: as many as --heads
    uneven_heads: bool = False         # world size need not divide the heads: ceil/floor(H/W) per rank
    batch: int = 1
    dtype: str = "fp16"
    kernel: str | None = None          # None: chosen with the device
    causal: bool = False
    device: str = "auto"
    warmup: int = 2
    iters: int = 5
    seed: int = 0
    check: bool = True
    json: str | None = None
    dist_backend: str = "auto"
    reduce_dtype: str = "fp32"
    sequence_parallel: bool = False    # x and y sharded along the sequence: all-gather + reduce-scatter
    context_parallel: int = 1          # C > 1: the sequence over rings of C ranks (ring attention), heads over W/C
    overlap: int = 1                   # row chunks that pipeline the output projection and the collective
    output_collective: str = "auto"    # head-parallel: all-reduce, or reduce-scatter + all-gather ("split")
    cuda_graph: bool = False           # capture the whole layer in a CUDA graph and replay it
    backward: bool = False             # time and check a training step (forward + backward) instead
    deterministic: bool = False        # with backward: the attention backward gives the same bits every run
    decode: int = 0                    # T > 0: a prompt of seq_len rows through a KV cache, then T decode steps
    kv_dtype: str = "model"            # with decode: the cache's dtype, the layer's or fp8 (an e4m3 paged pool)
    timeout: float = 300.0
    profile: str | None = None
    load: str | None = None            # full weights (and optionally x) from a torch.save'd dict
    # Filled by resolve(): what was chosen and why, shown in the report's first lines.
    notes: list[str] = field(default_factory=list)

    @property
    def model_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def storage(self) -> str:
        """The weights', input's and projections' dtype by name (--dtype fp8: fp16; the attention is e4m3)."""
        return "fp16" if self.dtype == FP8 else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.storage]

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def fingerprint(self) -> dict:
        """What must be identical on every rank (the --json path only matters on rank 0)."""
        d = dataclasses.asdict(self)
        for k in ("notes", "json", "profile"):
            d.pop(k)
        return d


def resolve(cfg: Config) -> Config:
    """Pick device, kernel and shape where the user left them open, saying why."""
    from .attention import backend_names

    if cfg.device not in DEVICES:
        raise FlagError(f"unknown --device {cfg.device!r}; choose one of {', '.join(DEVICES)}")
    if cfg.kernel is not None and cfg.kernel not in backend_names():
        raise FlagError(f"unknown --kernel {cfg.kernel!r}; choose one of {', '.join(backend_names())}")
    if cfg.dtype not in DTYPES and cfg.dtype != FP8:
        raise FlagError(f"unknown --dtype {cfg.dtype!r}; choose one of {', '.join(DTYPES)}, {FP8}")
    if cfg.dtype == FP8 and cfg.kernel is None:
        cfg.kernel = "reference"
        cfg.notes.append("--dtype fp8: the attention in e4m3 through torch math (--kernel reference), the "
                         "projections in fp16")
    has_gpu = torch.cuda.is_available()
    if cfg.device == "cuda" and not has_gpu:
        raise FlagError("--device cuda but no CUDA GPU is visible to torch "
                          f"(torch {torch.__version__}); use --device cpu or auto")
    if cfg.device == "auto":
        if cfg.kernel in (None, "naive"):
            if has_gpu and cupy_available():
                cfg.device = "cuda"
                cfg.notes.append("device auto: CUDA GPU and CuPy found, running the naive CUDA kernels")
            elif cfg.kernel == "naive" and has_gpu:
                cfg.device = "cuda"  # validate() names the missing CuPy
            elif cfg.kernel == "naive":
                raise FlagError("--kernel naive needs a CUDA GPU and none is visible to torch; "
                                  "use --kernel reference (runs on CPU)")
            else:
                cfg.device = "cpu"
                why = "CuPy is not installed" if has_gpu else "no CUDA GPU is visible to torch"
                cfg.notes.append(f"device auto: {why}, running the torch reference on CPU")
        else:
            cfg.device = "cuda" if has_gpu else "cpu"
            cfg.notes.append(f"device auto: {'CUDA GPU found' if has_gpu else 'no CUDA GPU'}, "
                             f"running --kernel {cfg.kernel} on {cfg.device}")
    if cfg.kernel is None:
        cfg.kernel = "naive" if cfg.device == "cuda" and cupy_available() else "reference"
    defaults = GPU_DEFAULTS if cfg.device == "cuda" else CPU_DEFAULTS
    shrunk = [f"{k.replace('_', '-')} {v}" for k, v in defaults.items() if getattr(cfg, k) is None]
    for k, v in defaults.items():
        if getattr(cfg, k) is None:
            setattr(cfg, k, v)
    if cfg.device == "cpu" and shrunk:
        cfg.notes.append("CPU run: using the smaller default shape " + ", ".join(shrunk)
                         + " (the GPU default is N 4096, 32 heads, d 128; pass them to override)")
    if cfg.kv_heads is None:
        cfg.kv_heads = cfg.heads
    if cfg.dist_backend == "auto":
        cfg.dist_backend = "nccl" if cfg.device == "cuda" else "gloo"
    return cfg


def validate(cfg: Config, world: int = 1, local_world: int = 1, gpus_on_node: int | None = None,
             check_json: bool = True) -> None:
    """Raise ConfigError for the first bad input. Call after resolve()."""
    from .attention import get_backend
    from .sharding import check_kv_heads

    for name, value, least in (("--seq-len", cfg.seq_len, 1), ("--heads", cfg.heads, 1),
                               ("--batch", cfg.batch, 1), ("--iters", cfg.iters, 1),
                               ("--warmup", cfg.warmup, 0)):
        if value < least:
            raise FlagError(f"{name} must be at least {least} (got {value})")
        if value > INT_MAX:  # the kernels index rows, heads and batches with 32-bit ints
            raise FlagError(f"{name} {value} is past {INT_MAX}, the most any kernel here indexes")
    if not 0 < cfg.timeout <= 86400 * 365:  # (NaN fails it too; the collectives' timedelta takes no infinity)
        raise FlagError(f"--timeout must be a finite, positive number of seconds (got {cfg.timeout})")
    if cfg.timeout < 1:  # the ranks' rendezvous alone takes longer: a healthy run would be reported as a hang
        raise FlagError(f"--timeout {cfg.timeout:g} is under a second, less than the ranks take to meet; give at least 1")
    if cfg.reduce_dtype not in REDUCE_DTYPES:
        raise FlagError(f"unknown --reduce-dtype {cfg.reduce_dtype!r}; choose fp32 or model")
    if cfg.dtype == FP8:
        check_fp8(cfg)
    check_parallel_style(cfg, world)
    if cfg.dist_backend not in ("nccl", "gloo"):
        raise FlagError(f"unknown --dist-backend {cfg.dist_backend!r}; choose one of {', '.join(DIST_BACKENDS)}")
    backend = get_backend(cfg.kernel)
    if not 1 <= cfg.head_dim <= backend.max_head_dim:
        raise FlagError(f"--head-dim must be between 1 and {backend.max_head_dim} for --kernel {cfg.kernel} "
                          f"(got {cfg.head_dim})")
    backend.check_supported(dataclasses.replace(cfg, dtype="fp16") if cfg.dtype == FP8 else cfg)  # dtype, device, CuPy
    kv_heads = cfg.heads if cfg.kv_heads is None else cfg.kv_heads
    # query and K/V heads over the ranks (with --context-parallel C: over the W/C ranks of a heads' group)
    err = check_kv_heads(cfg.heads, kv_heads, world // cfg.context_parallel, cfg.uneven_heads)
    if err:
        raise FlagError(err)
    if cfg.dist_backend == "nccl":
        if cfg.device != "cuda":
            raise FlagError("--dist-backend nccl needs --device cuda; use --dist-backend gloo on CPU")
        n = torch.cuda.device_count() if gpus_on_node is None else gpus_on_node
        if world > 1 and local_world > n:
            raise FlagError(f"{local_world} ranks on this node but {n} GPU(s): NCCL needs one GPU per rank; "
                              f"launch at most {n} ranks per node, or use --dist-backend gloo to share GPUs")
    for flag, path in (("--json", cfg.json), ("--profile", cfg.profile)):
        if path is not None and not path.strip():
            raise FlagError(f"{flag} needs a file path (got an empty one)")
    if check_json and cfg.json:
        check_writable(cfg.json, "--json")
    if check_json and cfg.profile:  # rank 0's path; the others' in the CLI (profile_path)
        check_writable(cfg.profile, "--profile")


def check_fp8(cfg: Config) -> None:
    """--dtype fp8: what the FP8 attention (tpattn.attention.fp8.Fp8Backend) takes: torch math
    (--kernel reference), the Triton kernel (--kernel triton: a GPU of compute capability 8.9+,
    head dims 64, 128, 256) or the CUDA one (--kernel fused: compute capability 9.0, head dim 128)."""
    from .attention import fp8
    if cfg.kernel not in ("reference", "triton", "fused"):
        raise FlagError(f"--dtype fp8 runs the FP8 arithmetic in torch (--kernel reference), in Triton's FP8 kernel "
                        f"(--kernel triton) or in the CUDA one (--kernel fused); --kernel {cfg.kernel} has no FP8 "
                        "kernel: use one of those")
    if cfg.kernel == "fused":
        fits = cfg.device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        if not fits or cfg.head_dim != 128:
            raise FlagError("--dtype fp8 --kernel fused is the CUDA FP8 kernel: --head-dim 128 on a GPU of compute "
                            f"capability 9.0 (H100, H200), --device cuda (got --head-dim {cfg.head_dim}"
                            f"{'' if fits else ', no such GPU'}); use --kernel triton or reference")
    if cfg.kernel == "triton":
        from .attention.triton_fused import interpreting
        fits = cfg.device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() >= fp8.CC
        if not (fits or (interpreting() and cfg.device == "cpu")):
            raise FlagError("--dtype fp8 --kernel triton needs FP8 tensor cores (a GPU of compute capability 8.9 or "
                            "later, --device cuda); use --kernel reference (torch math) here")
        why = fp8.kernel_head_dim_error(cfg.head_dim)
        if why:
            raise FlagError(why)
    for flag, on, why in (("--backward", cfg.backward, "FP8 attention is forward only (as FlashAttention-3's): "
                                                       "train with --dtype fp16 or bf16"),
                          ("--decode", cfg.decode, "the KV cache decodes in 16-bit here; for an FP8 cache use "
                                                   "--dtype fp16 or bf16 with --kv-dtype fp8"),
                          ("--context-parallel", cfg.context_parallel > 1, "the ring merges 16-bit pieces with "
                                                                           "their logsumexp; use --dtype fp16 or bf16"),
                          ("--cuda-graph", cfg.cuda_graph, "the FP8 path is not captured in a graph (its rotation "
                                                           "and scales are made as it runs); drop --cuda-graph")):
        if on:
            raise FlagError(f"--dtype fp8 with {flag}: {why}")
    why = fp8.head_dim_error(cfg.head_dim)
    if why:
        raise FlagError(why)


def check_parallel_style(cfg: Config, world: int) -> None:
    """--sequence-parallel, --overlap, --output-collective and --cuda-graph: what each needs of the
    shape and device. The shape's rules are the communication plan's own (tpattn.commplan), the
    same that the layer applies through the API."""
    C = check_context_flag(cfg, world)
    make_plan(cfg.batch, cfg.seq_len // C, cfg.model_dim, world // C, elem=cfg.elem_size,
              part_elem=4 if cfg.reduce_dtype == "fp32" else cfg.elem_size, sequence_parallel=cfg.sequence_parallel,
              output_collective=cfg.output_collective, overlap=cfg.overlap)
    if cfg.output_collective == "p2p" and world > 1:
        if cfg.device != "cuda" or cfg.dist_backend != "nccl":
            raise FlagError("--output-collective p2p needs one GPU per rank (--device cuda, --dist-backend nccl: "
                              "it maps the other GPUs' memory); use auto, allreduce or split here")
    if cfg.output_collective == "oneshot" and world > 1 and cfg.device != "cuda":
        raise FlagError("--output-collective oneshot needs --device cuda (every rank maps the others' GPU memory); "
                          "use auto, allreduce or split here")
    if cfg.decode < 0:
        raise FlagError(f"--decode must be at least 1 step (got {cfg.decode}); 0 turns it off")
    if cfg.kv_dtype not in KV_DTYPES:
        raise FlagError(f"--kv-dtype {cfg.kv_dtype}: choose one of {', '.join(KV_DTYPES)}")
    if cfg.kv_dtype == "fp8" and not cfg.decode:
        raise FlagError("--kv-dtype fp8 is the KV cache's dtype: add --decode T (a prompt, then T steps through the "
                        "cache)")
    if cfg.kv_dtype == "fp8" and cfg.cuda_graph:
        raise FlagError("--kv-dtype fp8 with --cuda-graph: the CLI graphs the contiguous cache's step only (an FP8 "
                        "pool's steps graph through tpattn.paged.DecodeGraphs); drop --cuda-graph")
    if cfg.decode:
        other = next((flag for flag, on in (("--sequence-parallel", cfg.sequence_parallel),
                                           ("--backward", cfg.backward), ("--load", cfg.load)) if on), None)
        if other:
            raise FlagError(f"--decode with {other}: the decode path is head-parallel, inference and "
                              f"generated inputs for now; drop one of them")
        if not cfg.causal:
            raise FlagError("--decode decodes causally: add --causal")
        if cfg.overlap > 1:
            raise FlagError(f"--decode with --overlap {cfg.overlap}: a decode step is one row a sequence, which cannot be "
                            "cut into row chunks; drop --overlap")
        if cfg.profile:
            raise FlagError("--profile traces one call of the layer (or one training step); --decode times its "
                            "prefill and steps itself: drop one of them")
        from .decode import DEC_HEAD_DIMS, DEC_SPLIT_HEAD_DIMS
        dims = sorted(DEC_HEAD_DIMS + DEC_SPLIT_HEAD_DIMS)
        if cfg.cuda_graph and (cfg.dtype == "fp32" or cfg.head_dim not in dims):
            raise FlagError(f"--decode with --cuda-graph needs the decode kernel (--dtype fp16 or bf16, --head-dim "
                            f"{', '.join(map(str, dims))}; got {cfg.dtype}, {cfg.head_dim}); drop --cuda-graph")
    if cfg.deterministic and not cfg.backward:
        if cfg.dtype == FP8:
            raise FlagError("--deterministic changes the backward only, and --dtype fp8 runs the forward only: drop "
                            "--deterministic")
        raise FlagError("--deterministic changes the backward only: add --backward (or drop --deterministic)")
    if cfg.cuda_graph:
        if cfg.device != "cuda":
            raise FlagError("--cuda-graph needs --device cuda; drop it on CPU")
        if world > 1 and cfg.dist_backend != "nccl":
            raise FlagError("--cuda-graph needs --dist-backend nccl (gloo collectives cannot be captured); "
                              "drop --cuda-graph or use one GPU per rank with nccl")


def check_context_flag(cfg: Config, world: int) -> int:
    """--context-parallel C: what it needs of the world, the shape and the other flags; returns C."""
    C = cfg.context_parallel
    if C < 1:
        raise FlagError(f"--context-parallel must be at least 1 (got {C}); 1 turns it off")
    if C == 1:
        return 1
    if world % C:
        ok = ", ".join(str(c) for c in range(1, world + 1) if world % c == 0)
        raise FlagError(f"--context-parallel {C} does not divide the world size {world} (rings of {C} ranks, the "
                        f"heads split over world / {C}); use --context-parallel in {{{ok}}}")
    conflict = context_conflict(sequence_parallel=cfg.sequence_parallel, decode=bool(cfg.decode),
                                cuda_graph=cfg.cuda_graph, overlap=cfg.overlap, output_collective=cfg.output_collective)
    if conflict:
        raise FlagError(conflict)
    if cfg.seq_len % (2 * C):
        lo = cfg.seq_len // (2 * C) * 2 * C
        raise FlagError(f"--context-parallel {C} gives each rank two chunks of the sequence (an early and a late "
                        f"one): --seq-len must divide by 2 x {C} = {2 * C} (got {cfg.seq_len}); use "
                        + (f"{lo} or " if lo else "") + f"{lo + 2 * C}")
    return C


def profile_path(path: str, rank: int) -> str:
    """Where rank `rank` writes --profile's trace: the path on rank 0, PATH.rank<r> on the others."""
    return path if rank == 0 else f"{path}.rank{rank}"


def check_writable(path: str, flag: str) -> None:
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise FlagError(f"{flag} {path} is a directory; give a file path")
    if not os.path.isdir(parent):
        raise FlagError(f"{flag} {path}: directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise FlagError(f"{flag} {path}: directory {parent} is not writable; choose another path")
    existed = os.path.lexists(path)  # a dangling symlink too: the link stays, its target is written
    try:  # the file itself (a path the directory's mode allows can still refuse it: /proc, a read-only file)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise FlagError(f"{flag} {path} cannot be written ({exc.strerror or exc}); choose another path") from None
    if not existed:
        try:
            os.remove(path)
        except OSError:
            pass
