"""Property-based GPU test of every backend's backward (`pytest -m gpu tests/test_gpu_backward_props.py`):
random batch, heads, K/V heads dividing them, sequence length (the tile edges 127/128/129 drawn often),
head dim (64, 128; 80 too for naive and tiled), causal, fp16/bf16, for naive, tiled and fused, checked
against float64 autograd of the reference by FlashAttention's rule (tests/backward_check.py).

A backend that has no backward yet refuses in one line ("... has no backward pass ...") at the forward;
that example is then rejected (not counted), any other error fails. A failure prints its
@reproduce_failure blob; no example database is written (database=None), so a run leaves nothing behind.
"""

import pytest
import torch

from backward_check import DT, check_against_reference, inputs
from tpattn.errors import ConfigError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, reject, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu
BACKENDS = ("naive", "tiled", "fused")


@st.composite
def cases(draw):
    backend = draw(st.sampled_from(BACKENDS))
    g = draw(st.sampled_from([1, 2, 4]))                 # K/V heads
    h = g * draw(st.sampled_from([1, 2, 3, 4]))          # query heads: a multiple of them
    b = draw(st.integers(1, 3))
    n = draw(st.one_of(st.sampled_from([1, 2, 127, 128, 129, 255, 257]), st.integers(1, 600)))
    d = draw(st.sampled_from([64, 128] + ([80] if backend in ("naive", "tiled") else [])))
    causal = draw(st.booleans())
    dtype = draw(st.sampled_from(["fp16", "bf16"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return backend, b, h, g, n, d, causal, dtype, seed


@settings(max_examples=25, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=cases())
def test_backward_matches_float64(case):
    backend, b, h, g, n, d, causal, dtype, seed = case
    q, k, v, do = inputs(b, h, g, n, d, DT[dtype], seed=seed)
    try:
        check_against_reference(q, k, v, do, causal, backend,
                                f"{backend} B={b} H={h} G={g} N={n} d={d} causal={causal} {dtype}")
    except ConfigError as e:
        msg = str(e)
        if "has no backward pass" not in msg:
            raise
        assert "\n" not in msg, msg
        reject()
    finally:
        torch.cuda.synchronize()
