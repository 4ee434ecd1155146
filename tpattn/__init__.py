"""tpattn: one multi-head attention layer, split by heads across processes (tensor parallelism).

Each rank owns a contiguous block of heads, runs local attention on them (the seed's naive
three-kernel CUDA attention, or a torch reference on CPU), applies its rows of the output
projection, and the partial outputs are summed with one all-reduce.
"""

from .config import Config, ConfigError  # noqa: F401
from .errors import __version__  # noqa: F401
from .layer import TensorParallelAttention  # noqa: F401
