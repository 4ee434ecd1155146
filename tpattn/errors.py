"""What every other module may need and nothing here imports back: the bad-input error, the
version, and the one-line texts shared by several checks. It imports nothing from tpattn, so any
module can use it without an import circle (tests/test_imports.py checks there is none)."""

from __future__ import annotations

import importlib.util
import numbers
import re

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A bad input: the message is one line that names the fix. Written once, in the CLI's flags
    (`cli_message`, what `python -m tpattn` prints); str() says it in the Python API's argument
    names (spell()), which is what a caller of the layer or the attention functions reads."""

    def __init__(self, message: str):
        super().__init__(spell(message))
        self.cli_message = message


class FlagError(ConfigError):
    """A bad input of the CLI's own (its config, --load, a kernel's check of the config): said in its
    flags only, str() too."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.cli_message = message


# The one table of names: each CLI flag (with its value, when it has one) as the Python API says it.
_SPELLINGS = (
    (r"the (\d+) rows of --seq-len", r"the \1 rows of x (x.shape[1])"),
    (r"--kernel (\w+)", r"backend='\1'"), (r"--kernel\b", "backend"),
    (r"--overlap (\d+)", r"overlap=\1"), (r"--overlap\b", "overlap"),
    (r"--output-collective (\w+)", r"output_collective='\1'"), (r"--output-collective\b", "output_collective"),
    (r"--sequence-parallel\b", "sequence_parallel=True"), (r"--uneven-heads\b", "uneven_heads=True"),
    (r"--seq-len (\d+)", r"\1 rows (x.shape[1])"), (r"--seq-len\b", "the rows of x (x.shape[1])"),
    (r"--batch\b", "the batch (x.shape[0])"), (r"--dtype (\w+)", r"dtype \1"), (r"--dtype\b", "dtype"),
    (r"--heads (\d+)", r"heads=\1"), (r"--heads\b", "heads"), (r"--kv-heads (\d+)", r"kv_heads=\1"),
    (r"--kv-heads\b", "kv_heads"), (r"--head-dim (\d+)", r"head_dim=\1"), (r"--head-dim\b", "head_dim"),
    (r"--causal\b", "causal=True"),
)


def spell(message: str) -> str:
    """A one-line error written in the CLI's flags, in the Python API's argument names."""
    for flag, name in _SPELLINGS:
        message = re.sub(flag, name, message)
    return message


_CUPY = importlib.util.find_spec("cupy") is not None  # looked up once: a traced graph (torch.compile) reads a flag


def cupy_available() -> bool:
    return _CUPY


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


def is_count(v) -> bool:
    """v is a positive int (a Python or numpy integer; not a bool)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1


def check_flags(**given) -> None:
    """Each given switch a real bool (or numpy bool), or one line naming it: a string such as "False" is
    truthy, and would silently turn the switch on."""
    for name, v in given.items():
        if not isinstance(v, bool) and type(v).__name__ != "bool_":
            raise TypeError(f"{name} must be True or False (got {v!r})")


def check_counts(**given) -> None:
    """Each given count a positive int (None: not given), or one line naming it."""
    for name, v in given.items():
        if v is not None and not is_count(v):
            raise ValueError(f"{name} must be a positive int (got {v!r})")
