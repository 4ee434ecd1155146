# The code that wrote accuracy_n4097_causal_96c2dc6.txt (run from the repository root with PYTHONPATH=.):
# rel_err (tests/test_gpu.py) of the fused kernel, the Triton rung and the reference against float64 and
# against each other, B=2 H=3 N=4097 causal, the inputs of test_gpu_headdims's forward test.
import sys

import torch

sys.path.insert(0, "tests")
from test_gpu import attention64, qkv, rel_err  # noqa: E402

from tpattn.attention import get_backend  # noqa: E402

for d in (64, 80, 96, 128, 160):
    for dt in (torch.bfloat16, torch.float16):
        q, k, v = qkv(2, 3, 4097, d, dt, seed=4097 * 1000 + d + 5)
        f64 = attention64(q, k, v, True)
        ref = get_backend("reference").forward(q, k, v, True)
        o = get_backend("fused").forward(q, k, v, True)
        t = get_backend("triton").forward(q, k, v, True)
        print(d, dt, "fused f64 %.4f ref %.4f | triton f64 %.4f ref %.4f | ref-f64 %.4f"
              % (rel_err(o, f64), rel_err(o, ref), rel_err(t, f64), rel_err(t, ref), rel_err(ref, f64)))
