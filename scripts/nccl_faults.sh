#!/usr/bin/env bash
# Every fault of the fault table over NCCL on RANKS GPUs (default 2), timed: rc, seconds, and the tpattn lines.
#   bash scripts/nccl_faults.sh [TIMEOUT] [LAUNCHER]   (LAUNCHER: mpirun (default) or torchrun; ARGS: the
#   run's options, default --kernel fused; FAULTS: which faults, RANK:STEP:MODE, STEP one of start, forward,
#   allreduce, backward (with ARGS holding --backward); RANKS: the world size)
# TPATTN_NO_WATCH=1 turns tpattn's collective watch off, to see what NCCL alone does: such a job is
# killed after TIMEOUT + 45 s, its Python stacks dumped first (faulthandler on SIGABRT).
set -u
T=${1:-15}
L=${2:-mpirun}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONFAULTHANDLER=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
seed=777000
for fault in ${FAULTS:-1:forward:kill 1:forward:raise 1:start:hang 1:forward:hang 0:forward:hang 1:allreduce:skip}; do
  seed=$((seed + 1))
  if [ "$L" = torchrun ]; then
    cmd=(torchrun --nproc-per-node "${RANKS:-2}" -m tpattn)
  else
    cmd=(mpirun -n "${RANKS:-2}" python3 -m tpattn)
  fi
  start=$(date +%s%N)
  TPATTN_DEBUG_INJECT_FAULT=$fault "${cmd[@]}" ${ARGS:---kernel fused} --timeout "$T" --seed $seed </dev/null >/tmp/f.out 2>/tmp/f.err &
  pid=$!
  ( sleep $((T + 45)); pkill -ABRT -f "tpattn.*--seed $seed" ; sleep 5; pkill -9 -f "tpattn.*--seed $seed" ) &
  killer=$!
  wait $pid
  rc=$?
  end=$(date +%s%N)
  kill $killer 2>/dev/null; wait $killer 2>/dev/null
  sleep 1
  left=$(pgrep -f "tpattn.*--seed $seed" | wc -l)
  ms=$(( (end - start) / 1000000 ))
  printf '### %s via %s, %s ranks, --timeout %s%s: rc %s after %d.%d s, %s process(es) left\n' "$fault" "$L" "${RANKS:-2}" "$T" \
    "${TPATTN_NO_WATCH:+ (watch off)}" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) "$left"
  grep -E "tpattn: rank|process rank|exited on signal|Watchdog|watchdog|timed out|Timeout|NCCL WARN|File \"|Thread 0x|Current thread" /tmp/f.err \
    | grep -v "site-packages/torch/" | head -40
  pkill -9 -f "tpattn.*--seed $seed" 2>/dev/null
done
