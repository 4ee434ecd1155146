#!/usr/bin/env bash
# Everything that needs the GPU, in one go: GPU tests, kernel benchmark, the default layer over
# NCCL (1 rank) and over gloo (4 ranks sharing the GPU). Logs and JSON go to $OUT (default results/).
# Usage: PYTHONPATH=. bash scripts/gpu_session.sh [tests|bench|layer|all]...
set -u -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=${*:-all}
status=0
want() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
note() { echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if want tests; then
  note "pytest -m gpu"
  python3 -m pytest -m gpu -q -x tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log" || status=1
fi
if want bench; then
  note "bench_kernels"
  python3 scripts/bench_kernels.py --out "$OUT" 2>&1 || status=1
fi
if want layer; then
  note "mpirun -n 1 python -m tpattn (NCCL)"
  mpirun -n 1 python3 -m tpattn --json "$OUT/layer_np1_nccl.json" 2>&1 | tee "$OUT/layer_np1_nccl.log" || status=1
  note "mpirun -n 4 python -m tpattn --dist-backend gloo (4 ranks, one GPU)"
  mpirun --oversubscribe -n 4 python3 -m tpattn --dist-backend gloo --json "$OUT/layer_np4_gloo.json" 2>&1 \
    | tee "$OUT/layer_np4_gloo.log" || status=1
fi
exit $status
