#!/usr/bin/env bash
# Every GPU run of the project, step by step (one GPU; the 2-GPU steps need two on one node):
#   tests   pytest -m gpu (naive, tiled and fused kernels; the CLI over NCCL and gloo)
#   bench   scripts/bench_kernels.py, non-causal and causal (every rung beside torch and SDPA;
#           the portable mma.sync fused2 and, on compute capability 9.0, tiled[mma] beside the
#           wgmma kernels there)
#   bench16k  the same at N = 16 384, 32 heads, without the naive kernels
#   layer   the default layer: mpirun -n 1 over NCCL (naive, fused, tiled), mpirun -n 4 over gloo
#           sharing the GPU, and mpirun -n 2 over gloo with --kernel fused
#   speed   the layer at the default shape on 1 and 2 GPUs, each style (overlap, sequence parallel,
#           CUDA graph), a table of them (scripts/layer_table.py)
#   nccltune  the layer on 2 GPUs (CUDA graph) under NCCL channel/protocol/algorithm settings
#   sweep   scripts/scaling.py at world sizes 1 and 2 (fused, naive) with the PyTorch peers
#   faults  every fault of the README's table over NCCL (scripts/nccl_faults.sh), the GPU fault tests
#   layertests  pytest -m gpu for the layer's styles and for faults over NCCL (2 GPUs)
#   checks  the refusals that need a GPU: NaN in --load, the memory pre-flight, N^2 > 2^31 run
#   model   the cost model: python -m tpattn.plan --calibrate on 1 GPU and (mpirun) on 2, then
#           scripts/model/validate_model.py (the layer and the bare NCCL collectives against the predictions),
#           then scripts/model/host_probe.py (where the 2-rank layer's host time goes, and how it drifts) and
#           scripts/model/collective_probe.py (the naive layer's reduce-scatter beside bare ones, clocks sampled;
#           bare ones after an idle link and with one rank late)
#   gqa     grouped-query attention, both of:
#     gqatests  pytest -m gpu -k gqa (naive, tiled, fused; the layer over gloo on one GPU and, with 2
#               GPUs, over NCCL)
#     gqabench  scripts/bench_gqa.py (fused with H = 32, G = 32, 8, 1, d = 128, N = 4096 and 16384
#               beside SDPA flash/cuDNN given the same grouped K/V, causal and not), and the layer
#               with --kv-heads 8 and 1 under mpirun (1 GPU; 2 GPUs where there are 2)
#   uneven  --uneven-heads: pytest -m gpu -k uneven (3 heads on 2 GPUs over NCCL, naive and fused), and
#           mpirun -n 2 python -m tpattn --kernel fused --heads 3 --head-dim 128 --uneven-heads
#   ws      the warp-specialized fused kernel (fusedw, TMA): the fused kernels' GPU tests, then
#           bench_kernels at N = 4096 and 16384, causal and not: fusedh and fusedw (both grids)
#           beside SDPA cuDNN and flash
#   wsbench fusedw (the default there) against SDPA with graph (kernel-only) times: N = 4096 and 16384,
#           causal and not, fp16, bf16, d = 64; compute-sanitizer memcheck and racecheck on it
#   shapes  fusedw on the shapes users run (bench_kernels --shapes users: ViT, d = 64, GQA bf16, long
#           causal, short sequences in large batches, the default) beside SDPA cuDNN and flash, its GPU
#           tests, then the wsbench sanitizer runs
#   p2p     --output-collective p2p (the peer reduce-gather over NVLink, 2 GPUs): pytest -m gpu -k
#           "peer or output_collectives", scripts/model/bench_comm.py (NCCL, a registered pool, peer loads;
#           the reduce-scatter after busy GEMMs), scripts/nccl_faults.sh with p2p (hang, skip, kill),
#           the layer's rows beside the NCCL ones
#   speedshort  the main rows of speed (fused, 1 and 2 GPUs, eager and graph, fp16 partials, causal,
#           sequence-parallel, fusedh for comparison)
#   decode  decoding: pytest -m gpu tests/test_gpu_decode.py, scripts/bench_decode.py (the split-K kernel and
#           the whole step beside SDPA and a plain PyTorch step), scripts/sweep_decode_splits.py (each chunk
#           count's time beside the one picked), scripts/ab_decode_staged.py (the staged split against the one it
#           replaces), the layer's graphed step beside the plain PyTorch step (bench_paged.py --layer
#           --rope-theta 0), scripts/profile_decode_steps.py (each kernel's time in a contiguous, a paged
#           and a plain cuDNN step, at the layer rows), scripts/trace_decode_blocks.py (each block of a split launch by the global timer),
#           scripts/time_decode_splits.py (launches of one chunk or a few), the CLI's --decode eager and with
#           --cuda-graph
#   oneshot  the one-shot peer all-reduce: pytest -m gpu -k oneshot (ranks sharing the GPU over gloo), and with
#           2 GPUs scripts/bench_allreduce.py (beside NCCL, 8 KiB - 1 MiB) and the decode step (--cuda-graph) on 1 and 2
#           GPUs with auto (the one-shot sum) and allreduce (NCCL's)
#   triton  the Triton rung: pytest -m gpu tests/test_gpu_triton.py, then bench_kernels (forward) and
#           bench_backward beside the CUDA fused kernel and SDPA at N = 4096 and 16384, causal and not;
#           the first call (compile + autotune) with an empty Triton cache
#   tritondims  the Triton rung at the head dims the CUDA kernels do not take: the users' shapes (d = 96 and 256
#           among them) beside the fused kernel and SDPA, then 32, 80, 96, 160, 192, 256 forward and backward
#           beside SDPA flash and cuDNN at N = 4096, H = 4096 / d, causal and not
#   backward5  the five-product backward: its GPU tests (the backward, training and compile files),
#           compute-sanitizer memcheck and racecheck over scripts/sanitize_backward.py, bench_backward on
#           the issue's shapes (five products, deterministic=True's seven, SDPA flash and cuDNN) and
#           bench_train's training step beside the plain layer on the same shapes
#   multigpu  everything between GPUs, one GPU a rank over NCCL, at W = 1 and 2, 4, 8 (as many as the node
#           has; nothing with one GPU): the forward layer (the naive layer's scaling table, the fused layer with
#           every output collective, eager beside the plain PyTorch TP layer and the DTensor one, and graphed), the
#           training step (gradients against float64 at 2, 4, 8 GPUs; the step eager and graphed; beside the
#           plain TP layer's step), the decode step (the one-shot sum against NCCL's, the graphed step with auto
#           and allreduce), context parallelism (C = 2, 4, 8; T x C = 2 x 2, 2 x 4; forward and backward checked;
#           each pass's posting from the traces), faults over NCCL at the smallest and largest W (forward,
#           backward, a killed rank; a stalled graph replay), the cost model calibrated here and validated at
#           every W
#   paged   the paged cache: pytest -m gpu tests/test_gpu_paged.py and tests/test_gpu_decode.py (the append
#           kernel, contiguous and paged, and the graphed step's preparation), scripts/bench_paged.py --layer
#           --prefill (the graphed paged decode step beside the contiguous one; prefills beside the layer's
#           forward, fused and triton backends; the chunks eager and, fused, one graph replay each) with one
#           profiled call of each prefill, the chunked prefill's host time at chunks of 1024 and 2048
#           (--host-profile), the decode kernels alone (--graph: graph replays), the serving example's tokens
#           per second (decode steps graphed, and the prompts in graphed chunks too), and compute-sanitizer
#           over scripts/sanitize_decode.py (the decode split at every head dim, the paged append, the fused
#           prefill after a cache and over a paged pool, the graphed step's preparation)
#   fp8     the FP8 forward: pytest -m gpu tests/test_gpu_fp8.py, scripts/bench_fp8.py (beside tpattn's fp16
#           fused forward and SDPA, d = 128 N = 4096 and 16384, causal and not, and d = 256); the FP8 pool:
#           pytest -m gpu -k fp8 tests/test_gpu_paged.py (its kernels' bits, float64, the pool's steps and
#           graphs), scripts/bench_paged.py --fp8 --layer (the decode kernel on e4m3 pages beside fp16
#           pages, and the graphed step), the serving example with --kv-dtype fp8, compute-sanitizer over
#           scripts/sanitize_decode.py
#   fp8tune  where the FP8 kernels' time goes: scripts/sweep_decode_splits.py --fp8 (an FP8 pool's chunk counts, the
#           pipelined build and the one without), bench_paged.py --fp8 --fp8-other-build --other-16bit-build --graph
#           (_pgt8s beside _pgt8 and _pg8; 16-bit pages' _pgs beside _pg), scripts/ab_fp8.py and trace_fused.py --fp8 (the forward's softmax turns against the default build,
#           and per-step cycles of both, with how much the two consumers' softmaxes overlap), and
#           Nsight Compute (--set full, the source page in SASS) over one FP8 forward and one fp16 forward, with
#           scripts/ncu_fp8.py's table and the FP8 kernel's warp-stall samples by opcode
#   ring    context parallelism on one GPU: pytest -m gpu tests/test_gpu_ring.py (the ranks sharing it over
#           gloo, the kernels' dQ sum against each piece's dQ added), compute-sanitizer memcheck and racecheck
#           over scripts/sanitize_backward.py (its ring ranks among the rest), scripts/bench_ring.py causal at
#           N = 65536 (a rank's compute against the whole attention's / C)
#   ncubwd  Nsight Compute (--set full) over one attention backward of tpattn's fused backend and one of SDPA's
#           cuDNN backend, at B=1 H=32 N=4096 d=128 fp16 and at B=2 H=32 G=8 N=8192 bf16 causal; the details
#           pages as CSV under $OUT/ncu, and scripts/ncu_backward.py's table of them
#   headdims  the fused forward at the other head dims (kernels/fused_ws_dims.cu, compute capability 9.0):
#           pytest -m gpu tests/test_gpu_headdims.py, compute-sanitizer memcheck and racecheck over
#           scripts/sanitize_fused_dims.py, bench_kernels at d = 96, 192 and 256 (B=1 H=32 N=4096, causal and
#           not) beside SDPA and the Triton rung, and bench_backward there (their backward is the Triton rung's)
#   gputests  the whole pytest -m gpu
# Logs and JSON go to $OUT (default results/); COMMIT=<hash> records the commit where the copy's .git differs.
# Usage: bash scripts/gpu_runs.sh [STEP]... (default all)
set -u -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=${*:-all}
status=0
want() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
note() { echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
sanitize_fusedw() {
  note "compute-sanitizer memcheck and racecheck on fusedw (N=300, d=128 and 64, causal and not; B=1 H=2, and B=4 H=40: more tiles than SMs, causal ones from the counter) and fusedw3 (d=64)"
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 300 "$san" --tool $tool --error-exitcode 9 python3 -c "
import os, torch
from tpattn.attention import get_backend
for cfg, ds in (('fusedw_{suf}_d{d}', (128, 64)), ('fusedw3_{suf}_d{d}', (64,))):
    os.environ['TPATTN_FUSED_CFG'] = cfg
    for b, h in ((1, 2), (4, 40)):
        for d in ds:
            for causal in (False, True):
                q, k, v = (torch.randn(b, h, 300, d, device='cuda', dtype=torch.float16) for _ in range(3))
                get_backend('fused').forward(q, k, v, causal)
torch.cuda.synchronize()
print('fusedw ran under $tool')" > "$OUT/sanitizer_$tool.log" 2>&1; echo "$tool exit $?"
    grep -E "ran under|SUMMARY|reported between|Access at|access at" "$OUT/sanitizer_$tool.log" | sort | uniq -c | head -20
  done
}
if want shapes; then
  note "fusedw on the shapes users run, beside SDPA cuDNN and flash (graph time); its GPU tests"
  timeout 500 python3 scripts/bench_kernels.py --shapes users --kernels fused sdpa_cudnn sdpa_flash --iters 60 \
    --pause 2 --steady 2 --steady-window 0.5 --out "$OUT" --name fused_shapes_h200 ${COMMIT:+--commit "$COMMIT"} 2>&1 | grep -E "^  |Lowest" || status=1
  timeout 400 python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_ladder.py 2>&1 | tail -5 || status=1
  sanitize_fusedw
fi
if want tests; then
  note "pytest -m gpu"
  python3 -m pytest -m gpu -q -p no:warnings --tb=line tests/test_gpu.py tests/test_gpu_ladder.py 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25 || status=1
fi
if want bench; then
  note "bench_kernels (non-causal, then causal)"
  python3 scripts/bench_kernels.py --fused-configs 2:w4_m1_c64 --out "$OUT" 2>&1 || status=1
  python3 scripts/bench_kernels.py --causal --seq-lens 4096 8192 --heads 32 --fused-configs 2:w4_m1_c64 \
    --out "$OUT" 2>&1 || status=1
fi
if want bench16k; then
  note "bench_kernels at N = 16384 (non-causal, causal), without the naive kernels"
  for c in "" "--causal"; do
    python3 scripts/bench_kernels.py --seq-lens 16384 --heads 32 $c --out "$OUT/n16k" --fused-configs 2:w4_m1_c64 \
      --kernels tiled fused torch_materialized sdpa_flash sdpa_cudnn sdpa_efficient 2>&1 || status=1
  done
fi
if want ws; then
  note "the fused kernels' GPU tests (fusedw among them)"
  timeout 900 python3 -m pytest -m gpu -q -p no:warnings --tb=line -k "fused or probes" tests/test_gpu_ladder.py 2>&1 \
    | tee "$OUT/pytest_ws.log" | tail -25 || status=1
  for n in 4096 16384; do
    for c in "" "--causal"; do
      note "bench_kernels N=$n $c: fusedh, fusedw"
      timeout 300 python3 scripts/bench_kernels.py --seq-lens $n --heads 32 $c --kernels fused sdpa_flash sdpa_cudnn \
        --fused-configs h w:sms w:tiles --out "$OUT/ws_n$n${c:+_causal}" 2>&1 | grep -v "^copy" || status=1
    done
  done
fi
if want wsbench; then
  note "fusedw against cuDNN, graph time (kernels only) beside call time: N = 4096, 16384, causal and not; bf16; d = 64"
  for n in 4096 16384; do
    for c in "" "--causal"; do
      timeout 300 python3 scripts/bench_kernels.py --seq-lens $n --heads 32 $c --kernels fused sdpa_flash sdpa_cudnn \
        --fused-configs h --out "$OUT/wsb_n$n${c:+_causal}" 2>&1 | grep -E "^  " || status=1
    done
  done
  timeout 300 python3 scripts/bench_kernels.py --seq-lens 4096 16384 --heads 32 --dtype bf16 --kernels fused sdpa_cudnn \
    --out "$OUT/wsb_bf16" 2>&1 | grep -E "^  " || status=1
  for c in "" "--causal"; do
    timeout 300 python3 scripts/bench_kernels.py --seq-lens 4096 16384 --heads 32 --head-dim 64 $c \
      --kernels fused sdpa_flash sdpa_cudnn --out "$OUT/wsb_d64${c:+_causal}" 2>&1 | grep -E "^  " || status=1
  done
  sanitize_fusedw
fi
if want layer; then
  note "mpirun -n 1 python -m tpattn (NCCL)"
  mpirun -n 1 python3 -m tpattn --json "$OUT/layer_np1_nccl.json" 2>&1 | tee -a "$OUT/layer.log" || status=1
  for k in fused tiled; do
    note "mpirun -n 1 python -m tpattn --kernel $k (NCCL)"
    mpirun -n 1 python3 -m tpattn --kernel $k --json "$OUT/layer_np1_$k.json" 2>&1 | tee -a "$OUT/layer.log" || status=1
  done
  note "mpirun -n 4 python -m tpattn --dist-backend gloo (4 ranks, one GPU)"
  mpirun --oversubscribe -n 4 python3 -m tpattn --dist-backend gloo --json "$OUT/layer_np4_gloo.json" 2>&1 \
    | tee -a "$OUT/layer.log" || status=1
  note "mpirun -n 2 python -m tpattn --dist-backend gloo --kernel fused"
  mpirun --oversubscribe -n 2 python3 -m tpattn --dist-backend gloo --kernel fused \
    --json "$OUT/layer_np2_fused.json" 2>&1 | tee -a "$OUT/layer.log" || status=1
fi
# The layer at the default shape (NCCL), one mpirun per line of stdin "W [NAME=value ...] ARGS", one JSON
# per run under $OUT/$1, then a table of them (scripts/layer_table.py)
layer_runs() {
  local dir="$OUT/$1" gpus i=0 w args envs
  mkdir -p "$dir"
  gpus=$(nvidia-smi -L | wc -l)
  while read -r w args; do
    [ "$w" -gt "$gpus" ] && continue
    envs=()  # leading NAME=value words go to every rank (mpirun -x)
    while [[ $args =~ ^([A-Z_]+=[^ ]*)\ (.*)$ ]]; do envs+=(-x "${BASH_REMATCH[1]}"); args=${BASH_REMATCH[2]}; done
    i=$((i + 1))
    echo "--- mpirun ${envs[*]} -n $w python -m tpattn $args"
    mpirun "${envs[@]}" -n "$w" python3 -m tpattn $args --iters 20 --json "$dir/$(printf %02d $i).json" \
      </dev/null 2>&1 | grep -E "RESULT|check|error|failed" || status=1
  done
  python3 scripts/layer_table.py "$dir"/*.json --md "$dir/table.md" || status=1
}
if want speed; then
  note "layer speed: mpirun -n W python -m tpattn ... (W = 1, 2 where there are 2 GPUs)"
  layer_runs speed <<'RUNS'
1 --kernel fused
1 --kernel fused --cuda-graph
2 --kernel fused
2 --kernel fused --cuda-graph
2 --kernel fused --output-collective allreduce
2 --kernel fused --output-collective allreduce --cuda-graph
2 --kernel fused --reduce-dtype model
2 --kernel fused --reduce-dtype model --cuda-graph
2 --kernel fused --overlap 2
2 --kernel fused --overlap 2 --cuda-graph
2 --kernel fused --overlap 4 --cuda-graph
2 --kernel fused --reduce-dtype model --overlap 2 --cuda-graph
2 NCCL_MAX_NCHANNELS=8 --kernel fused --overlap 2 --cuda-graph
2 NCCL_MAX_NCHANNELS=8 --kernel fused --cuda-graph
2 --kernel fused --sequence-parallel
2 --kernel fused --sequence-parallel --cuda-graph
2 --kernel fused --sequence-parallel --overlap 2
1 --kernel fused --causal
2 --kernel fused --causal
2 --kernel fused --causal --cuda-graph
1 --kernel naive
2 --kernel naive
RUNS
fi
if want speedshort; then
  note "layer speed, the main rows: fused eager and graph on 1 and 2 GPUs, fp16 partials, causal, sequence-parallel"
  layer_runs speedshort <<'RUNS'
1 --kernel fused
1 --kernel fused --cuda-graph
2 --kernel fused
2 --kernel fused --cuda-graph
2 --kernel fused --reduce-dtype model --cuda-graph
2 --kernel fused --output-collective allreduce --cuda-graph
2 --kernel fused --causal --cuda-graph
2 --kernel fused --sequence-parallel --cuda-graph
2 TPATTN_FUSED_CFG=fusedh_f16_d128 --kernel fused --cuda-graph
RUNS
fi
if want p2p; then
  note "p2p: GPU tests, bench_comm, faults, the layer with --output-collective p2p beside NCCL"
  timeout 300 python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_layer.py \
    -k "peer or output_collectives" 2>&1 | tee "$OUT/p2p_pytest_gpu.log" | tail -15 || status=1
  port=$((29500 + RANDOM % 1000))
  timeout 240 mpirun -n 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$port python3 scripts/model/bench_comm.py \
    --variants nccl nccl-reg p2p busy --json "$OUT/p2p_bench_comm.json" </dev/null 2>&1 \
    | grep -v -i warn | tee "$OUT/p2p_bench_comm.log" || status=1
  ARGS="--kernel fused --output-collective p2p" FAULTS="1:forward:hang 1:allreduce:skip 1:forward:kill" \
    timeout 300 bash scripts/nccl_faults.sh 15 2>&1 | tee "$OUT/p2p_faults.log" || status=1
  layer_runs p2p <<'RUNS'
2 --kernel fused
2 --kernel fused --cuda-graph
2 --kernel fused --output-collective p2p
2 --kernel fused --output-collective p2p --cuda-graph
2 --kernel fused --reduce-dtype model --output-collective p2p
2 --kernel fused --reduce-dtype model --output-collective p2p --cuda-graph
2 --kernel fused --causal --output-collective p2p --cuda-graph
2 --kernel naive --output-collective p2p
1 --kernel fused
1 --kernel fused --cuda-graph
RUNS
fi
if want nccltune; then
  # NCCL's channel and protocol settings on the layer's own collectives (CUDA graph: totals only).
  note "NCCL settings: mpirun -x NAME=value -n 2 python -m tpattn --kernel fused --cuda-graph ..."
  mkdir -p "$OUT/nccltune"
  i=0
  while read -r envs; do
    for extra in "" "--reduce-dtype model"; do
      i=$((i + 1)); xs=()
      for e in $envs; do xs+=(-x "$e"); done
      echo "--- mpirun ${xs[*]} -n 2 python -m tpattn --kernel fused --cuda-graph $extra"
      mpirun "${xs[@]}" -n 2 python3 -m tpattn --kernel fused --cuda-graph $extra --iters 30 \
        --json "$OUT/nccltune/$(printf %02d $i).json" </dev/null 2>&1 | grep -E "RESULT|error|failed" || status=1
    done
  done <<'ENVS'
NCCL_DEBUG=WARN
NCCL_MIN_CTAS=32
NCCL_MIN_CTAS=64 NCCL_MAX_CTAS=64
NCCL_PROTO=Simple
NCCL_PROTO=LL128
NCCL_ALGO=Tree
NCCL_BUFFSIZE=16777216
ENVS
  python3 scripts/layer_table.py "$OUT"/nccltune/*.json --md "$OUT/nccltune/table.md" | cut -d"|" -f2-5,18 || status=1
fi
if want sweep; then
  # The sweep at world sizes 1 and 2 with the peers (DTensor, plain TP + SDPA default/flash/cuDNN,
  # a bare all-reduce of the same bytes), for --kernel fused and for the naive kernels.
  note "scaling sweep, fused and naive, world sizes 1 2"
  python3 scripts/scaling.py --world-sizes 1 2 --kernel fused --warmup 5 --iters 20 --tag h200x2_fused \
    --out "$OUT/bench" 2>&1 | tail -30 || status=1
  python3 scripts/scaling.py --world-sizes 1 2 --kernel naive --tag h200x2 --out "$OUT/bench" 2>&1 | tail -30 || status=1
fi
if want faults; then
  note "faults over NCCL: every row of the fault table (mpirun), the stalls under torchrun, the GPU fault tests"
  bash scripts/nccl_faults.sh 15 2>&1 | tee "$OUT/nccl_faults.log"
  FAULTS="1:forward:hang" bash scripts/nccl_faults.sh 15 torchrun 2>&1 | tee -a "$OUT/nccl_faults.log"
  python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_faults.py 2>&1 | tail -5 || status=1
fi
if want layertests; then
  note "pytest -m gpu: the layer (styles, overlap, graph) and faults over NCCL"
  python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_layer.py tests/test_gpu_faults.py 2>&1 \
    | tee "$OUT/pytest_gpu_layer.log" | tail -40 || status=1
fi
if want checks; then
  {
    note "NaN in a loaded weight, naive kernels (expect exit 2, one line per rank)"
    python3 -c "import torch; w={k: torch.randn(4096, 4096) / 64 for k in ('wq','wk','wv','wo')}; \
w['wk'][7, 7] = float('nan'); torch.save(w, '/tmp/nan.pt')"
    mpirun -n 1 python3 -m tpattn --kernel naive --load /tmp/nan.pt; echo "exit $?"
    note "memory pre-flight (expect exit 2 and the largest N that fits)"
    python3 -m tpattn --kernel naive --seq-len 300000 --heads 32; echo "exit $?"
    note "N = 50000, one head: N^2 > 2^31, naive kernels, through the CLI"
    python3 -m tpattn --kernel naive --seq-len 50000 --heads 1 --head-dim 128 --warmup 0 --iters 1; echo "exit $?"
  } 2>&1 | tee "$OUT/gpu_checks.log"
fi
if want gqa || want gqatests; then
  note "pytest -m gpu -k gqa"
  python3 -m pytest -m gpu -k gqa -q -p no:warnings --tb=short tests/test_gpu.py tests/test_gpu_ladder.py \
    tests/test_gpu_layer.py 2>&1 | tee "$OUT/pytest_gpu_gqa.log" | tail -30 || status=1
fi
if want gqa || want gqabench; then
  mkdir -p "$OUT/gqa"
  note "bench_gqa (non-causal, then causal)"
  for c in "" "--causal"; do
    python3 scripts/bench_gqa.py $c --fused-configs 2:w4_m1_c64 --out "$OUT/gqa" 2>&1 | tee -a "$OUT/gqa.log" \
      | grep -vE "^\| " || status=1
  done
  note "the layer with --kv-heads 8 (and 1): mpirun -n 1, and -n 2 over NCCL where there are 2 GPUs"
  gpus=$(nvidia-smi -L | wc -l)
  for w in 1 2; do
    [ "$w" -gt "$gpus" ] && continue
    for g in 8 1; do
      mpirun -n "$w" python3 -m tpattn --kernel fused --kv-heads "$g" --iters 20 \
        --json "$OUT/gqa/layer_np${w}_kv${g}.json" </dev/null 2>&1 | tee -a "$OUT/gqa.log" \
        | grep -E "rank [0-9]+:|RESULT|check|error|failed" || status=1
    done
  done
fi
if want uneven; then
  # Uneven heads: 3 heads on 2 GPUs over NCCL (rank 0 owns 2, rank 1 one), naive and fused, causal
  # and not, sequence-parallel and CUDA graph (pytest -k uneven), then one CLI run at d = 128 (D = 384).
  note "uneven heads: pytest -m gpu -k uneven, then mpirun -n 2 python -m tpattn --heads 3 --uneven-heads"
  mkdir -p "$OUT/uneven"
  python3 -m pytest -m gpu -k uneven -q -p no:warnings --tb=short tests/test_gpu_layer.py 2>&1 \
    | tee "$OUT/uneven/pytest_gpu_uneven.log" | tail -15 || status=1
  mpirun -n 2 python3 -m tpattn --kernel fused --heads 3 --head-dim 128 --uneven-heads --iters 20 \
    --json "$OUT/uneven/layer_np2_h3_fused.json" </dev/null 2>&1 | tee "$OUT/uneven/layer.log" || status=1
fi
if want model; then
  # The cost model (python -m tpattn.plan): calibrate on one GPU, then on two (NCCL collectives too),
  # then the layer on 1 and 2 GPUs and the bare collectives at 8-256 MiB against the predictions of the
  # 2-GPU calibration (judged), the shipped h200x2 file and the 1-GPU calibration. All under $OUT/model.
  note "cost model: calibrate on 1 GPU, on 2 GPUs, validate"
  mkdir -p "$OUT/model"
  gpus=$(nvidia-smi -L | wc -l)
  python3 -m tpattn.plan --calibrate --name h200_1gpu --out "$OUT/model/h200_1gpu.json" </dev/null 2>&1 \
    | tee "$OUT/model/calibrate_1gpu.log" || status=1
  if [ "$gpus" -ge 2 ]; then
    mpirun -n 2 python3 -m tpattn.plan --calibrate --name h200x2_cal --out "$OUT/model/h200x2_cal.json" </dev/null 2>&1 \
      | tee "$OUT/model/calibrate_2gpu.log" || status=1
    mpirun -n 2 python3 scripts/model/validate_model.py --machine "$OUT/model/h200x2_cal.json" h200x2 "$OUT/model/h200_1gpu.json" \
      --out "$OUT/model" </dev/null 2>&1 | tee "$OUT/model/validate.log" || status=1
  else
    python3 scripts/model/validate_model.py --machine "$OUT/model/h200_1gpu.json" h200x2 --out "$OUT/model" </dev/null 2>&1 \
      | tee "$OUT/model/validate.log" || status=1
  fi
  for k in naive fused; do
    python3 -m tpattn.plan --machine "$OUT/model/h200x2_cal.json" --kernel "$k" --world-sizes 1 2 </dev/null 2>&1 \
      | tee -a "$OUT/model/plan.log" || status=1
  done
  if [ "$gpus" -ge 2 ]; then
    mpirun -n 2 python3 scripts/model/host_probe.py --kernels fused tiled --seq-lens 2048 4096 --profile </dev/null 2>&1 \
      | tee "$OUT/model/host_probe.log" | grep -v "^ *[0-9]" || status=1
    # the naive layer's reduce-scatter at N = 4096 beside bare ones, with the clocks sampled every 100 ms;
    # the SM clock and where the ranks arrive at each of its calls; a bare one after an idle link, and
    # with one rank late
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv -lms 100 > "$OUT/model/collective_probe_smi.csv" 2>&1 & smi=$!
    mpirun -n 2 python3 scripts/model/collective_probe.py --kernels naive tiled --seq-len 4096 --as-validation --clocks \
      --idle 1 10 20 40 60 80 160 --skew 0 25 50 100 150 200 300 </dev/null 2>&1 \
      | tee "$OUT/model/collective_probe.log" || status=1
    kill $smi 2>/dev/null
  fi
fi
if want decode; then
  note "decode"
  python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_decode.py 2>&1 | tee "$OUT/pytest_decode.log" \
    | tail -15 || status=1
  python3 scripts/bench_decode.py --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
    --out "$OUT/decode_h200" 2>&1 || status=1
  timeout 400 python3 scripts/sweep_decode_splits.py 2>&1 | tee "$OUT/sweep_decode_splits.log" | grep -v "^    " \
    || status=1
  timeout 300 python3 scripts/ab_decode_staged.py 2>&1 | tee "$OUT/ab_decode_staged.log" || status=1
  timeout 300 python3 scripts/bench_paged.py --layer --no-kernel --rounds 3 --pages 16 --rope-theta 0 2>&1 \
    | tee "$OUT/layer_vs_plain.log" | grep -E "B=|against" || status=1
  timeout 300 python3 scripts/profile_decode_steps.py --shapes 1,32,4096 1,8,32768 16,8,4096 64,8,4096 2>&1 \
    | tee "$OUT/profile_decode_steps.log" | grep -v -i warn \
    || status=1
  timeout 300 python3 scripts/trace_decode_blocks.py 2>&1 | tee "$OUT/trace_decode_blocks.log" || status=1
  timeout 300 python3 scripts/time_decode_splits.py 2>&1 | tee "$OUT/time_decode_splits.log" || status=1
  for graph in "" --cuda-graph; do
    python3 -m tpattn --kernel fused --causal --decode 32 $graph 2>&1 | tee "$OUT/cli_decode${graph}.log" | tail -8 \
      || status=1
  done
fi
if want oneshot; then
  note "oneshot: the one-shot peer all-reduce (ranks sharing a GPU over gloo; one GPU each with 2+ GPUs)"
  python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_layer.py -k oneshot 2>&1 \
    | tee "$OUT/pytest_oneshot.log" | tail -5 || status=1
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # the 2-GPU rows: the decode step on 1 and 2 GPUs, the sums
    mpirun -n 2 python3 scripts/bench_allreduce.py --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
      --out "$OUT/allreduce_h200x2" 2>&1 | tee "$OUT/bench_allreduce.log" || status=1
    for w in 1 2; do
      for coll in auto allreduce; do
        mpirun -n $w python3 -m tpattn --kernel fused --causal --decode 32 --cuda-graph --output-collective $coll \
          --json "$OUT/decode_w${w}_${coll}.json" 2>&1 | tee "$OUT/cli_decode_w${w}_${coll}.log" | tail -6 || status=1
      done
    done
  fi
fi
if want triton; then
  note "triton"
  export TRITON_CACHE_DIR=$(mktemp -d)  # a cold first call: compile and autotune timed from nothing
  python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_triton.py 2>&1 | tee "$OUT/pytest_triton.log" \
    | tail -15 || status=1
  for c in "" --causal; do
    python3 scripts/bench_kernels.py --seq-lens 4096 16384 --heads 32 --kernels fused triton sdpa_flash sdpa_cudnn $c \
      --out "$OUT/triton_fwd${c}" 2>&1 | tail -12 || status=1
  done
  python3 scripts/bench_backward.py --seq-lens 4096 16384 --both-causal --kernels fused triton sdpa_flash sdpa_cudnn \
    --commit "${COMMIT:-unknown}" --out "$OUT/triton_bwd" 2>&1 | tail -14 || status=1
fi
if want tritondims; then
  note "the users' shapes (d = 96 and 256 among them): triton beside SDPA cuDNN and flash (the fused rows skip d = 96, 256)"
  timeout 500 python3 scripts/bench_kernels.py --shapes users --kernels triton fused sdpa_cudnn sdpa_flash --iters 30 \
    --out "$OUT" --name triton_shapes ${COMMIT:+--commit "$COMMIT"} 2>&1 | grep -E "^  |Lowest" || status=1
  for d in 32 80 96 160 192 256; do
    note "triton at head dim $d (H = 4096 / d) beside SDPA"
    for c in "" "--causal"; do
      timeout 300 python3 scripts/bench_kernels.py --seq-lens 4096 --heads $((4096 / d)) --head-dim $d $c \
        --kernels triton sdpa_flash sdpa_cudnn --out "$OUT/triton_d$d${c:+_causal}" 2>&1 | grep -E "^  " || status=1
      timeout 300 python3 scripts/bench_backward.py --seq-lens 4096 --heads $((4096 / d)) --head-dim $d $c \
        --kernels triton sdpa_flash sdpa_cudnn --commit "${COMMIT:-unknown}" --out "$OUT/triton_bwd_d$d${c:+_causal}" \
        2>&1 | grep "^  " || status=1
    done
  done
fi
if want backward5; then
  note "the five-product backward: GPU tests"
  for f in test_gpu_backward_fused test_gpu_backward_props test_gpu_compile test_gpu_train test_gpu_backward_naive; do
    python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/$f.py 2>&1 | tee "$OUT/pytest_$f.log" | tail -3 || status=1
  done
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 300 "$san" --tool $tool --error-exitcode 9 python3 scripts/sanitize_backward.py > "$OUT/sanitizer_bwd_$tool.log" 2>&1
    echo "$tool exit $?"; tail -1 "$OUT/sanitizer_bwd_$tool.log"
  done
  c=${COMMIT:-unknown}
  K="fused fused_red fused_det sdpa_flash sdpa_cudnn"
  note "bench_backward and bench_train"
  for args in "--seq-lens 4096 --both-causal" "--batch 2 --kv-heads 8 --seq-lens 8192 --dtype bf16 --causal --sdpa-gqa native" \
              "--seq-lens 16384 --causal" "--batch 8 --heads 16 --head-dim 64 --seq-lens 1024 --dtype bf16 --causal"; do
    tag=$(echo "$args" | tr -d ' -' | cut -c1-40)
    python3 scripts/bench_backward.py $args --kernels $K --commit "$c" --out "$OUT/backward5_$tag" 2>&1 | grep "^  " || status=1
  done
  for args in "" "--causal" "--batch 2 --kv-heads 8 --dtype bf16 --causal" \
              "--batch 8 --seq-len 1024 --heads 16 --head-dim 64 --dtype bf16 --causal"; do
    tag=$(echo "x$args" | tr -d ' -' | cut -c1-40)
    python3 scripts/bench_train.py $args --profile 12 --commit "$c" --out "$OUT/train5_$tag" 2>&1 | grep -v -i warn || status=1
  done
fi
if want ring; then
  note "context parallelism: GPU tests, the backward's sanitizer runs, the ring's compute per rank"
  timeout 500 python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_ring.py 2>&1 | tee "$OUT/pytest_gpu_ring.log" \
    | tail -3 || status=1
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 400 "$san" --tool $tool --error-exitcode 9 python3 scripts/sanitize_backward.py > "$OUT/sanitizer_bwd_$tool.log" 2>&1
    echo "$tool exit $?"; tail -1 "$OUT/sanitizer_bwd_$tool.log"
  done
  timeout 400 python3 scripts/bench_ring.py --seq-len 65536 --rounds 3 --causal --json "$OUT/bench_ring_64k_causal.json" 2>&1 \
    | tee "$OUT/bench_ring_64k_causal.log" | tail -12 || status=1
fi
if want paged; then
  note "the paged cache: GPU tests, the graphed decode step and the prefills beside their baselines"
  for f in test_gpu_paged test_gpu_decode; do
    timeout 480 python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/$f.py 2>&1 | tee "$OUT/pytest_$f.log" | tail -3 \
      || status=1
  done
  timeout 400 python3 scripts/bench_paged.py --layer --prefill --no-kernel --rounds 3 --profile-prefill 20 \
    --prefill-backends fused triton \
    --json "$OUT/bench_paged.json" 2>&1 | tee "$OUT/bench_paged.log" | grep -E "B=|  [0-9]|wall|copy rate" || status=1
  timeout 200 python3 scripts/bench_paged.py --rounds 3 --pages 16 64 --graph 2>&1 | tee "$OUT/bench_paged_kernels.log" \
    | grep -E "B=|  [a-z]|copy rate" || status=1
  for chunk in 1024 2048; do  # the chunked prefill's host time per chunk size (issue time beside wall time)
    timeout 200 python3 scripts/bench_paged.py --prefill --no-kernel --rounds 3 --prefill-backends fused --pages 16 \
      --prefill-chunk $chunk --host-profile 25 2>&1 | tee "$OUT/bench_paged_host_$chunk.log" | grep -E "  [0-9]|issues" \
      || status=1
  done
  timeout 200 python3 scripts/serve_llama.py --device cuda --dtype fp16 --hidden 1024 --heads 8 --kv-heads 2 --layers 4 \
    --prompts 16 --new-tokens 64 --max-batch 8 --check --graphs 2>&1 | tail -4 || status=1
  # the prompts in graphed chunks of 32 rows (ChunkGraphs inside generate: the fused backend, head dim 128)
  timeout 200 python3 scripts/serve_llama.py --device cuda --dtype fp16 --hidden 1024 --heads 8 --kv-heads 2 --layers 4 \
    --prompts 16 --prompt-lens 40 200 --new-tokens 32 --max-batch 8 --check --graphs --prefill-chunk 32 --backend fused \
    2>&1 | tail -4 || status=1
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 300 "$san" --tool $tool --error-exitcode 9 python3 scripts/sanitize_decode.py > "$OUT/sanitizer_decode_$tool.log" 2>&1
    echo "$tool exit $?"; tail -1 "$OUT/sanitizer_decode_$tool.log"
  done
fi
if want fp8; then
  note "the FP8 forward beside fp16 and SDPA; the FP8 pool: its kernels' GPU tests, the decode kernel and the graphed step"
  timeout 300 python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_fp8.py 2>&1 \
    | tee "$OUT/pytest_fp8_fwd.log" | tail -3 || status=1
  for args in "" "--causal" "--head-dim 256 --seq-lens 4096" "--scaling block --rotate --seq-lens 16384"; do
    tag=$(echo "x$args" | tr -d ' -' | cut -c1-40)
    timeout 200 python3 scripts/bench_fp8.py $args --commit "${COMMIT:-unknown}" --out "$OUT/fp8_$tag" 2>&1 \
      | grep -E "N=|  [a-z]|RMSE|error" || status=1
  done
  timeout 240 python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_paged.py -k fp8 2>&1 \
    | tee "$OUT/pytest_fp8.log" | tail -3 || status=1
  timeout 300 python3 scripts/bench_paged.py --fp8 --layer --pages 16 64 --rounds 3 --json "$OUT/bench_paged_fp8.json" 2>&1 \
    | tee "$OUT/bench_paged_fp8.log" | grep -E "B=|  [a-z]|copy rate" || status=1
  timeout 200 python3 scripts/serve_llama.py --device cuda --dtype fp16 --hidden 1024 --heads 8 --kv-heads 2 --layers 4 \
    --prompts 16 --new-tokens 64 --max-batch 8 --check --graphs --kv-dtype fp8 2>&1 | tail -4 || status=1
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 300 "$san" --tool $tool --error-exitcode 9 python3 scripts/sanitize_decode.py > "$OUT/sanitizer_fp8_$tool.log" 2>&1
    echo "$tool exit $?"; grep -E "FP8|ERROR SUMMARY" "$OUT/sanitizer_fp8_$tool.log" | tail -5
  done
fi
if want fp8tune; then
  note "where the FP8 kernels' time goes: the pool's chunk counts and builds, the forward's knobs, trace and profile"
  shapes="1,8,32768 16,8,4096 64,8,4096"
  timeout 300 python3 scripts/sweep_decode_splits.py --fp8 --shapes $shapes 2>&1 | tee "$OUT/sweep_fp8.log" || status=1
  timeout 200 python3 scripts/bench_paged.py --fp8 --fp8-other-build --other-16bit-build --graph --pages 16 --rounds 3 \
    --shapes $shapes \
    --json "$OUT/bench_paged_fp8_builds.json" 2>&1 | tee "$OUT/bench_paged_fp8_builds.log" || status=1
  timeout 300 python3 scripts/ab_fp8.py --rounds 3 2>&1 | tee "$OUT/ab_fp8.log" || status=1
  timeout 120 python3 scripts/trace_fused.py --fp8 --out "$OUT" --name trace_fp8 --commit "${COMMIT:-unknown}" \
    2>&1 | tee "$OUT/trace_fp8.log" || status=1
  timeout 120 python3 scripts/trace_fused.py --fp8 --fp8-build 0:0:1:2 --out "$OUT" --name trace_fp8_turn \
    --commit "${COMMIT:-unknown}" 2>&1 | tee "$OUT/trace_fp8_turn.log" || status=1
  mkdir -p "$OUT/ncu"
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for c in fp8 fp16; do
    timeout 300 "$ncu" --clock-control none --profile-from-start off --set full --import-source yes -f \
      -o "/tmp/fwd_$c" python3 scripts/ncu_fp8.py --contender $c > "$OUT/ncu/run_fwd_$c.log" 2>&1 || status=1
    "$ncu" --import "/tmp/fwd_$c.ncu-rep" --csv --page details > "$OUT/ncu/fwd_$c.csv" || status=1
    "$ncu" --import "/tmp/fwd_$c.ncu-rep" --csv --page source --print-source sass > "$OUT/ncu/fwd_${c}_sass.csv" || status=1
  done
  python3 scripts/ncu_fp8.py --report "$OUT/ncu/fwd_fp8.csv" "$OUT/ncu/fwd_fp16.csv" | tee "$OUT/ncu/fwd_table.txt" || status=1
  python3 scripts/ncu_fp8.py --opcodes "$OUT/ncu/fwd_fp8_sass.csv" | tee "$OUT/ncu/fwd_fp8_opcodes.txt" || status=1
fi
if want ncubwd; then
  note "the backward under Nsight Compute: tpattn's kernels beside cuDNN's"
  mkdir -p "$OUT/ncu"
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for shape in "default:" "gqa:--batch 2 --kv-heads 8 --seq-len 8192 --dtype bf16 --causal"; do
    tag=${shape%%:*}; args=${shape#*:}
    for c in tpattn cudnn; do
      timeout 300 "$ncu" --clock-control none --profile-from-start off --set full -f -o "/tmp/bwd_${tag}_$c" \
        python3 scripts/ncu_backward.py --contender $c $args > "$OUT/ncu/run_${tag}_$c.log" 2>&1 || status=1
      "$ncu" --import "/tmp/bwd_${tag}_$c.ncu-rep" --csv --page details > "$OUT/ncu/bwd_${tag}_$c.csv" || status=1
    done
    python3 scripts/ncu_backward.py --report "$OUT/ncu/bwd_${tag}_tpattn.csv" "$OUT/ncu/bwd_${tag}_cudnn.csv" \
      | tee "$OUT/ncu/report_$tag.txt" || status=1
  done
fi
if want multigpu; then
  M="$OUT/multigpu"
  mkdir -p "$M"
  gpus=$(nvidia-smi -L | wc -l)
  ws=""
  for w in 2 4 8; do [ "$w" -le "$gpus" ] && ws="$ws $w"; done
  note "multigpu: world sizes 1$ws on $gpus GPU(s), one GPU a rank, NCCL"
  if [ -z "$ws" ]; then
    echo "multigpu: this node has one GPU: nothing between GPUs to run" | tee "$M/skipped.txt"
  else
    c=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
    # 1. the forward layer: the seed's naive table (with its speedup column), then the fused layer with every
    #    output collective beside the plain PyTorch TP layer and the DTensor one (scaling.py's peers), and graphed
    python3 scripts/scaling.py --world-sizes 1 $ws --kernel naive --tag multi_naive --out "$M" || status=1
    for coll in auto allreduce split p2p oneshot; do
      sizes="1 $ws"; case $coll in p2p|oneshot) sizes=$ws ;; esac  # peer sums: between GPUs only
      python3 scripts/scaling.py --world-sizes $sizes --kernel fused --output-collective $coll --warmup 5 --iters 20 \
        --tag "multi_fused_$coll" --out "$M" || status=1
    done
    for w in 1 $ws; do
      for coll in auto allreduce split p2p oneshot; do
        [ "$w" = 1 ] && { [ "$coll" = p2p ] || [ "$coll" = oneshot ]; } && continue
        echo "$w --kernel fused --output-collective $coll --cuda-graph"
      done
    done | layer_runs multigpu/graph
    # 2. the training step: x.grad and full_grads() against float64 (the NCCL rows), the step eager and graphed,
    #    and beside the plain PyTorch TP layer's step in the same processes
    python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_train.py -k nccl 2>&1 \
      | tee "$M/pytest_train_nccl.log" | tail -5 || status=1
    for w in 1 $ws; do
      for g in "" --cuda-graph; do
        mpirun -n "$w" python3 -m tpattn --kernel fused --backward $g --json "$M/train_w${w}${g:+_graph}.json" \
          </dev/null 2>&1 | grep -E "RESULT|check|error|failed" || status=1
      done
      mpirun -n "$w" python3 scripts/peer_tp.py --kernel fused --backward --warmup 5 --iters 20 \
        --json "$M/train_peer_w$w.json" </dev/null 2>&1 | grep -v -i warn || status=1
    done
    # 3. the decode step: the one-shot peer all-reduce against NCCL's (8 KiB - 1 MiB), the graphed step with the
    #    one-shot sum (auto) and with NCCL's (allreduce)
    for w in $ws; do
      mpirun -n "$w" python3 scripts/bench_allreduce.py --commit "$c" --out "$M/allreduce_w$w" </dev/null 2>&1 \
        | tail -12 || status=1
    done
    for w in 1 $ws; do
      for coll in auto allreduce; do
        mpirun -n "$w" python3 -m tpattn --kernel fused --causal --decode 32 --cuda-graph --output-collective $coll \
          --json "$M/decode_w${w}_$coll.json" </dev/null 2>&1 | tail -4 || status=1
      done
    done
    # 4. context parallelism: C = 2, 4, 8 and T x C = 2 x 2, 2 x 4, causal N = 16384, forward and backward
    #    checked against the single-process layer; the traces say when each K/V pass was posted
    for wc in "2 2" "4 4" "8 8" "4 2" "8 4"; do
      read -r w cp <<< "$wc"
      [ "$w" -gt "$gpus" ] && continue
      for b in "" --backward; do
        tag="ring_w${w}_c${cp}${b:+_bwd}"
        mpirun -n "$w" python3 -m tpattn --kernel fused --causal --seq-len 16384 --context-parallel "$cp" $b \
          --json "$M/$tag.json" --profile "$M/$tag.trace.json" </dev/null 2>&1 | grep -E "RESULT|check|ring|error" \
          || status=1
        python3 scripts/ring_trace.py "$M/$tag.trace.json" "$M/$tag.trace.json".rank* > "$M/$tag.trace.txt" 2>&1 \
          || status=1
        tail -6 "$M/$tag.trace.txt"
      done
    done
    # 5. faults over NCCL at the smallest and the largest W: a rank stalled in the forward or the backward, one
    #    killed, one raising, one skipping its all-reduce (scripts/nccl_faults.sh), a stalled graph replay
    for w in $(echo $ws | tr ' ' '\n' | sed -n '1p;$p' | sort -un); do
      RANKS=$w timeout 1200 bash scripts/nccl_faults.sh 15 2>&1 | tee "$M/faults_w$w.log" || status=1
      RANKS=$w ARGS="--kernel fused --backward" FAULTS="1:backward:hang 1:backward:kill" timeout 400 \
        bash scripts/nccl_faults.sh 15 2>&1 | tee -a "$M/faults_w$w.log" || status=1
    done
    python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_faults.py 2>&1 \
      | tee "$M/pytest_faults.log" | tail -5 || status=1
    # 6. the cost model: calibrated on this node's GPUs, then predicted against measured per pass at every W
    mpirun -n "$gpus" python3 -m tpattn.plan --calibrate --name "multi_${gpus}gpu" --out "$M/model_cal.json" \
      </dev/null 2>&1 | tee "$M/calibrate.log" || status=1
    for w in 1 $ws; do
      mpirun -n "$w" python3 scripts/model/validate_model.py --machine "$M/model_cal.json" h200x2 \
        --out "$M/validate_w$w" </dev/null 2>&1 | tee "$M/validate_w$w.log" | tail -20 || status=1
    done
  fi
fi
if want headdims; then
  note "the fused forward at the other head dims: GPU tests, the sanitizer, beside SDPA and the Triton rung"
  timeout 500 python3 -m pytest -m gpu -q -p no:warnings --tb=short tests/test_gpu_headdims.py 2>&1 \
    | tee "$OUT/pytest_gpu_headdims.log" | tail -3 || status=1
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 300 "$san" --tool $tool --error-exitcode 9 python3 scripts/sanitize_fused_dims.py > "$OUT/sanitizer_dims_$tool.log" 2>&1
    echo "$tool exit $?"; tail -1 "$OUT/sanitizer_dims_$tool.log"
  done
  for d in 96 192 256; do
    for c in "" "--causal"; do
      timeout 200 python3 scripts/bench_kernels.py --heads 32 --seq-lens 4096 --head-dim $d $c \
        --kernels fused triton sdpa_flash sdpa_cudnn --out "$OUT" --name "headdims_d$d${c:+_causal}" \
        --commit "${COMMIT:-unknown}" 2>&1 | tail -5 || status=1
    done
    timeout 200 python3 scripts/bench_backward.py --head-dim $d --causal --commit "${COMMIT:-unknown}" \
      --out "$OUT/backward_d$d" 2>&1 | tail -8 || status=1
  done
fi
if want gputests; then
  note "pytest -m gpu (all)"
  python3 -m pytest -m gpu -q -p no:warnings --tb=line 2>&1 | tee "$OUT/pytest_gpu_all.log" | tail -25 || status=1
fi
exit $status
