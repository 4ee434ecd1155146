#!/usr/bin/env bash
# Stop the one-node CI SLURM cluster started by .ci/slurm_up.sh:
# cancel all jobs, stop slurmd, slurmctld and munged.  Safe to run when
# nothing is running.  State/config/logs are kept so slurm_up.sh can restart.
set -euo pipefail

TIMEOUT="${SLURM_DOWN_TIMEOUT:-20}"
log() { echo "[slurm_down] $*"; }

# stop_pidfile PIDFILE NAME: SIGTERM the process named in PIDFILE, wait, then SIGKILL
stop_pidfile() {
    local pidfile=$1 name=$2 pid comm i
    if [[ ! -r "$pidfile" ]]; then
        log "$name: no pidfile ($pidfile)"
        return 0
    fi
    pid="$(tr -dc '0-9' < "$pidfile")"
    if [[ -z "$pid" ]] || ! kill -0 "$pid" 2>/dev/null; then
        log "$name: not running"
        rm -f "$pidfile"
        return 0
    fi
    comm="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
    if [[ "$comm" != "$name"* ]]; then
        log "$name: pid $pid is '$comm', not $name; leaving it alone"
        rm -f "$pidfile"
        return 0
    fi
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < TIMEOUT * 2; i++)); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
        sleep 0.5
    done
    log "$name (pid $pid) did not exit after ${TIMEOUT}s; SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

[[ "$(id -u)" -eq 0 ]] || { echo "[slurm_down] must run as root" >&2; exit 1; }

if command -v scontrol >/dev/null && timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then
    log "cancelling all jobs"
    timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
    # also jobs of other users (CI may submit as a non-root user)
    mapfile -t jobs < <(timeout 10 squeue -h -o '%i' 2>/dev/null || true)
    if ((${#jobs[@]})); then
        timeout 10 scancel --full --quiet "${jobs[@]}" 2>/dev/null || true
        for ((i = 0; i < TIMEOUT; i++)); do
            [[ -z "$(squeue -h -o '%i' 2>/dev/null || true)" ]] && break
            sleep 1
        done
    fi
fi

stop_pidfile /run/slurmd.pid slurmd
# slurmstepd processes (children of our slurmd) can outlive a killed slurmd.
for pid in $(pgrep -x slurmstepd || true); do
    log "killing leftover slurmstepd (pid $pid)"
    kill -KILL "$pid" 2>/dev/null || true
done
stop_pidfile /run/slurmctld.pid slurmctld
stop_pidfile /run/munge/munged.pid munged
log "stopped"
