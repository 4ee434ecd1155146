"""What every other module may need and nothing here imports back: the bad-input error, the
version, and the one-line texts shared by several checks. It imports nothing from tpattn, so any
module can use it without an import circle (tests/test_imports.py checks there is none)."""

from __future__ import annotations

import importlib.util

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A bad input: the message is one line that names the fix."""


def cupy_available() -> bool:
    return importlib.util.find_spec("cupy") is not None


def cupy_missing_message(kernel: str = "naive") -> str:
    return (f"--kernel {kernel} needs CuPy, which is not installed: pip install 'tpattn[cuda13]' "
            "(CUDA 13) or 'tpattn[cuda12]' (CUDA 12), or use --kernel reference")


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)
