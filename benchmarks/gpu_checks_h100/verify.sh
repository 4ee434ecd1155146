#!/usr/bin/env bash
# GPU verification of host-side changes made without a GPU (ff9ffb1 and earlier)
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
T0=$(date +%s); LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
step() { # name budget cmd...
  local name=$1 need=$2; shift 2
  if (( $(left) < need )); then echo "SKIP $name (left $(left)s < $need)" | tee -a $OUT/summary.txt; return; fi
  local s=$(date +%s)
  timeout $(( $(left) - 10 )) "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s :: $(tail -1 $OUT/$name.log)" | tee -a $OUT/summary.txt
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
git rev-parse HEAD >> $OUT/gpu.txt 2>/dev/null
step pytest_main 60 python -m pytest -q -m gpu -x -p no:cacheprovider tests/test_gpu_decode.py tests/test_gpu_paged.py tests/test_gpu_layer.py tests/test_gpu_fp8.py tests/test_gpu_ring.py
step cli_fp8 30 python -m tpattn --decode 8 --causal --kv-dtype fp8 --device cuda --seq-len 1024 --heads 8 --head-dim 128 --batch 4
step cli_fp8_2 30 mpirun -n 2 python -m tpattn --dist-backend gloo --decode 8 --causal --kv-dtype fp8 --device cuda --seq-len 1024 --heads 8 --head-dim 128 --batch 4
step ring_prof 60 mpirun -n 2 python -m tpattn --dist-backend gloo --context-parallel 2 --kernel fused --causal --seq-len 4096 --heads 8 --head-dim 128 --backward --profile $OUT/ringtrace
step ring_read 20 bash -c "python scripts/ring_trace.py $OUT/ringtrace* "
step serve 60 python scripts/serve_llama.py --device cuda --prompts 8 --new-tokens 16 --check
step serve_fp8 60 python scripts/serve_llama.py --device cuda --prompts 8 --new-tokens 16 --check --kv-dtype fp8 --graphs
step pytest_more 60 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_headdims.py tests/test_gpu_prefill.py tests/test_gpu_train.py tests/test_gpu_compile.py tests/test_gpu_backward_fused.py
ls $OUT >> $OUT/summary.txt
