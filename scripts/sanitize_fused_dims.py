"""The fused forward at the head dims other than 64 and 128 (kernels/fused_ws_dims.cu), for
compute-sanitizer: every one of them, fp16 and bf16, causal and not, N = 1, 130 and 333 (a partial
last tile of 64 and of 128 keys), grouped K/V (4 query heads on 2), the logsumexp written.

    PYTHONPATH=. compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/sanitize_fused_dims.py
"""

import argparse
import sys

import torch

from tpattn.attention import get_backend
from tpattn.attention.fused import OTHER_HEAD_DIMS


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        print("sanitize_fused_dims.py: needs a CUDA GPU (none is visible to torch); run it on a GPU machine",
              file=sys.stderr)
        return 2
    fused = get_backend("fused")
    for d in OTHER_HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                for n in (1, 130, 333):
                    q = torch.randn(1, 4, n, d, device="cuda", dtype=dtype)
                    k, v = (torch.randn(1, 2, n, d, device="cuda", dtype=dtype) for _ in range(2))
                    lse = torch.empty(1, 4, n, device="cuda")
                    fused.forward(q, k, v, causal, lse=lse)
    torch.cuda.synchronize()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
