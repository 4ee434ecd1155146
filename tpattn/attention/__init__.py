"""Local attention backends, by name. Each takes q, k, v of shape [B, h, N, d] (contiguous, the
storage dtype) and returns o of the same shape, timing its passes (qk, softmax, pv; fused: one
pass, "fused") on a Timer.

Add a backend: subclass Backend in a module here and list it in _BACKENDS.
"""

from __future__ import annotations

import importlib

from ..config import ConfigError

_BACKENDS = {
    "reference": "tpattn.attention.reference:ReferenceBackend",
    "naive": "tpattn.attention.naive:NaiveBackend",
    "tiled": "tpattn.attention.tiled:TiledBackend",
    "fused": "tpattn.attention.fused:FusedBackend",
}


class Backend:
    name = "?"
    max_head_dim = 256
    dtypes = ("fp16", "bf16", "fp32")
    devices = ("cpu", "cuda")
    passes = ("qk", "softmax", "pv")
    materializes_scores = True  # S and P are written to device memory

    def check_supported(self, cfg) -> None:
        if cfg.device not in self.devices:
            hint = "use --kernel reference on CPU" if cfg.device == "cpu" else "choose another --kernel"
            raise ConfigError(f"--kernel {self.name} does not run on {cfg.device}; {hint}")
        if cfg.dtype not in self.dtypes:
            raise ConfigError(f"--kernel {self.name} does not support --dtype {cfg.dtype}; "
                              f"use one of {', '.join(self.dtypes)}")

    def forward(self, q, k, v, causal: bool, timer=None):
        raise NotImplementedError


def backend_names() -> list[str]:
    return list(_BACKENDS)


_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise ConfigError(f"unknown --kernel {name!r}; choose one of {', '.join(_BACKENDS)}")
    if name not in _instances:
        mod, cls = _BACKENDS[name].split(":")
        _instances[name] = getattr(importlib.import_module(mod), cls)()
    return _instances[name]
