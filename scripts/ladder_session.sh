#!/usr/bin/env bash
# The kernel ladder on a GPU machine, in one go: GPU tests of the tiled and fused kernels, the kernel
# benchmark (N = 4096 and 16 384, causal and not) and the layer with --kernel fused at the default
# shape. Logs and JSON in $OUT (default results/). Usage: bash scripts/ladder_session.sh [STEP]...
# (steps: tests bench bench16k layer; default all)
set -u -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=${*:-all}
status=0
want() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
note() { echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if want bench; then
  note "bench N=4096 (non-causal, causal)"
  python3 scripts/bench_kernels.py --seq-lens 4096 --heads 32 --out "$OUT" ${FUSED_CONFIGS:+--fused-configs $FUSED_CONFIGS} 2>&1 | grep -v '^|' || status=1
  python3 scripts/bench_kernels.py --seq-lens 4096 --heads 32 --causal --out "$OUT" ${FUSED_CONFIGS:+--fused-configs $FUSED_CONFIGS} 2>&1 | grep -v '^|' || status=1
fi
if want tests; then
  note "pytest tests/test_gpu_ladder.py"
  python3 -m pytest -m gpu -q -p no:warnings --tb=line tests/test_gpu_ladder.py 2>&1 | tee "$OUT/pytest_ladder.log" | tail -25 || status=1
fi
if want bench16k; then
  note "bench N=16384 (non-causal, causal), without the naive kernels"
  for c in "" "--causal"; do
    python3 scripts/bench_kernels.py --seq-lens 16384 --heads 32 $c --out "$OUT/n16k" \
      --kernels tiled fused torch_materialized sdpa_flash sdpa_cudnn sdpa_efficient 2>&1 | grep -v '^|' || status=1
  done
fi
if want layer; then
  note "mpirun -n 2 python -m tpattn --dist-backend gloo --kernel fused (default shape)"
  mpirun --oversubscribe -n 2 python3 -m tpattn --dist-backend gloo --kernel fused --json "$OUT/layer_fused_np2.json" 2>&1 | tail -14 || status=1
fi
exit $status
