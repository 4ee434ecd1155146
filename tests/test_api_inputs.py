"""The API's entry points that take settings by keyword, given a bad one: an exception at the
boundary that names the argument and the fix (not an AttributeError or an assertion from inside
torch)."""

from __future__ import annotations

import pytest
import torch

from tpattn.dist import init_distributed


@pytest.mark.parametrize("kw,says", [
    (dict(backend="glo"), "backend must be 'auto', 'nccl' or 'gloo' (got 'glo')"),
    (dict(timeout=0), "timeout must be a positive number of seconds"),
    (dict(timeout="300"), "timeout must be a positive number of seconds"),
])
def test_init_distributed_refuses_a_bad_setting(kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        init_distributed(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case: torch sees no GPU")
def test_init_distributed_nccl_without_a_gpu():
    with pytest.raises(ValueError, match="backend 'nccl' needs a CUDA GPU"):
        init_distributed(backend="nccl")
