#!/usr/bin/env bash
# Bring up a real one-node SLURM cluster on this (Debian 12) machine so CI can
# submit sbatch/srun jobs.  Must run as root.  Idempotent: safe to run twice;
# already-running daemons with an unchanged config are left alone.
#
# Env knobs:
#   SLURM_UP_TIMEOUT=60        seconds to wait for each daemon / the node
#   SLURM_UP_SKIP_SELFTEST=1   do not run .ci/slurm_selftest.sh at the end
#   SLURM_UP_SKIP_APT=1        never call apt-get (fail if binaries missing)
set -euo pipefail

TIMEOUT="${SLURM_UP_TIMEOUT:-60}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
LOG_DIR=/var/log/slurm
CTLD_LOG="$LOG_DIR/slurmctld.log"
SLURMD_LOG="$LOG_DIR/slurmd.log"
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
MUNGE_KEY=/etc/munge/munge.key
MUNGE_SOCK_DIR=/run/munge
MUNGE_LOG=/var/log/munge/munged.log

log() { echo "[slurm_up] $*"; }

dump_logs() {
    echo "[slurm_up] ===== diagnostics =====" >&2
    for f in "$MUNGE_LOG" "$CTLD_LOG" "$SLURMD_LOG"; do
        if [[ -f "$f" ]]; then
            echo "----- last 40 lines of $f -----" >&2
            tail -n 40 "$f" >&2 || true
        else
            echo "----- $f: (missing) -----" >&2
        fi
    done
    echo "----- sinfo -----" >&2
    sinfo -N -l >&2 2>&1 || true
    echo "----- scontrol show node -----" >&2
    scontrol show node >&2 2>&1 || true
    echo "----- processes -----" >&2
    pgrep -a -f 'munged|slurmctld|slurmd' >&2 || true
}

die() {
    echo "[slurm_up] ERROR: $*" >&2
    exit 1
}
# Any non-zero exit (die or a set -e failure) prints the daemon logs.
on_exit() {
    local rc=$?
    if ((rc != 0)); then
        echo "[slurm_up] FAILED (rc=$rc)" >&2
        dump_logs
    fi
}
trap on_exit EXIT

# pid_alive PIDFILE NAME: true if PIDFILE names a live process called NAME
pid_alive() {
    local pidfile=$1 name=$2 pid comm
    [[ -r "$pidfile" ]] || return 1
    pid="$(tr -dc '0-9' < "$pidfile")"
    [[ -n "$pid" ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    comm="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
    [[ "$comm" == "$name"* ]]
}

# wait_for SECONDS DESCRIPTION CMD...: poll CMD every second until it succeeds
wait_for() {
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs; i++)); do
        if "$@" >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    die "timed out after ${secs}s waiting for: $what"
}

[[ "$(id -u)" -eq 0 ]] || die "must run as root (daemons, /etc/slurm, /etc/munge)"

start_ts=$SECONDS

# ---------------------------------------------------------------------------
# 1. packages
# ---------------------------------------------------------------------------
# libpmix-dev: Slurm's mpi/pmix plugin dlopen()s the *unversioned*
# .../pmix2/lib/libpmix.so, which only the -dev package ships; without it
# `srun --mpi=pmix` fails with "can not load PMIx library".
PKGS=(munge slurmctld slurmd slurm-client libpmix2 libpmix-dev shellcheck)
missing=()
need_restart=0
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done
if ((${#missing[@]})); then
    [[ "${SLURM_UP_SKIP_APT:-0}" == 1 ]] && die "missing packages: ${missing[*]}"
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Do not let package postinst scripts try to start services (no init here).
    created_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${missing[@]}" >/tmp/slurm_up_apt.log 2>&1 \
        || { tail -n 30 /tmp/slurm_up_apt.log >&2; die "apt-get install failed"; }
    if ((created_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    # New libraries/plugins (e.g. libpmix) are only picked up by fresh daemons;
    # a slurmd that started without them wedges on the first pmix step.
    need_restart=1
else
    log "packages already installed"
fi
for b in munged munge unmunge slurmctld slurmd sinfo sbatch srun scontrol shellcheck; do
    command -v "$b" >/dev/null || die "binary $b not found after install"
done

# ---------------------------------------------------------------------------
# 2. munge
# ---------------------------------------------------------------------------
if [[ ! -s "$MUNGE_KEY" ]]; then
    log "creating munge key"
    install -d -o munge -g munge -m 700 /etc/munge
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile="$MUNGE_KEY" --force
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
    fi
fi
chown munge:munge "$MUNGE_KEY"
chmod 400 "$MUNGE_KEY"
install -d -o munge -g munge -m 755 "$MUNGE_SOCK_DIR"
install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge

if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already running"
else
    log "starting munged"
    # munged refuses to run as root unless --force; run it as the munge user.
    # A stale socket/pid from a killed munged would make it refuse to start.
    if ! pid_alive "$MUNGE_SOCK_DIR/munged.pid" munged; then
        rm -f "$MUNGE_SOCK_DIR"/munge.socket.2 "$MUNGE_SOCK_DIR"/munged.pid \
              "$MUNGE_SOCK_DIR"/munge.socket.2.lock
    fi
    runuser -u munge -- /usr/sbin/munged --force \
        || die "munged failed to start"
    wait_for "$TIMEOUT" "munge -n | unmunge" bash -c 'munge -n | unmunge'
fi
munge -n | unmunge | grep -q 'STATUS: *Success' || die "munge/unmunge round trip failed"
log "munge OK"

# ---------------------------------------------------------------------------
# 3. slurm.conf
# ---------------------------------------------------------------------------
NODE="$(hostname -s)"
[[ -n "$NODE" ]] || die "empty hostname -s"

# Real hardware as slurmd sees it; configuring more than this drains the node.
hw="$(slurmd -C | head -n 1)"
get_hw() { sed -n "s/.*[[:space:]]$1=\([0-9]*\).*/\1/p" <<<"$hw"; }
CPUS="$(get_hw CPUs)"
SOCKETS="$(get_hw SocketsPerBoard)"
CORES="$(get_hw CoresPerSocket)"
THREADS="$(get_hw ThreadsPerCore)"
HWMEM="$(get_hw RealMemory)"
[[ -n "$CPUS" ]] || CPUS="$(nproc)"
[[ -n "$HWMEM" ]] || HWMEM="$(awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo)"
# Leave ~5% (at least 256 MB) headroom so RealMemory never exceeds what slurmd reports.
REALMEM=$((HWMEM - (HWMEM / 20 > 256 ? HWMEM / 20 : 256)))
((REALMEM > 0)) || REALMEM=1

NODE_LINE="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS"
if [[ -n "$SOCKETS" && -n "$CORES" && -n "$THREADS" ]]; then
    NODE_LINE+=" Boards=1 SocketsPerBoard=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS"
fi
NODE_LINE+=" RealMemory=$REALMEM State=UNKNOWN"
EXTRA=""
if ((CPUS < 2)); then
    # Single-CPU runner: advertise 2 CPUs anyway so --ntasks=2 jobs can run.
    NODE_LINE="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 RealMemory=$REALMEM State=UNKNOWN"
    EXTRA="SlurmdParameters=config_overrides"
fi

install -d -m 755 "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"

new_conf="$(mktemp /tmp/slurm.conf.XXXXXX)"
cat > "$new_conf" <<CONF
# Generated by .ci/slurm_up.sh -- one-node CI cluster. Do not edit by hand.
ClusterName=ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CryptoType=crypto/munge
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$CTLD_LOG
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
$EXTRA
$NODE_LINE
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

if [[ ! -f "$CONF" ]] || ! cmp -s "$new_conf" "$CONF"; then
    log "writing $CONF"
    install -m 644 "$new_conf" "$CONF"
    need_restart=1
else
    log "$CONF unchanged"
fi
rm -f "$new_conf"

# No cgroup plugins are used (proctrack/linuxproc, task/none); a minimal
# cgroup.conf keeps slurmd from complaining/probing if it looks for one.
if [[ ! -f "$CONF_DIR/cgroup.conf" ]]; then
    cat > "$CONF_DIR/cgroup.conf" <<'CONF'
# Generated by .ci/slurm_up.sh -- cgroups unused (proctrack/linuxproc, task/none)
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
CONF
fi

# ---------------------------------------------------------------------------
# 4. daemons
# ---------------------------------------------------------------------------
if ((need_restart)); then
    # Config/packages changed under running daemons: restart so it takes effect.
    for pf in "$SLURMD_PID" "$CTLD_PID"; do
        if [[ -r "$pf" ]]; then
            pid="$(tr -dc '0-9' < "$pf")"
            if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
                log "config/packages changed: stopping pid $pid ($pf)"
                kill "$pid" || true
                for ((i = 0; i < 20; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            fi
        fi
    done
fi

if pid_alive "$CTLD_PID" slurmctld; then
    log "slurmctld already running (pid $(cat "$CTLD_PID"))"
else
    log "starting slurmctld"
    rm -f "$CTLD_PID"
    slurmctld || die "slurmctld failed to start"
fi
wait_for "$TIMEOUT" "scontrol ping (slurmctld UP)" bash -c 'scontrol ping | grep -q "is UP"'

if pid_alive "$SLURMD_PID" slurmd; then
    log "slurmd already running (pid $(cat "$SLURMD_PID"))"
else
    log "starting slurmd"
    rm -f "$SLURMD_PID"
    slurmd || die "slurmd failed to start"
fi

node_state() { sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1; }
resumed=0
ok=0
for ((i = 0; i < TIMEOUT; i++)); do
    st="$(node_state || true)"
    case "$st" in
        idle | mixed | allocated)
            ok=1
            break
            ;;
        *drain* | *down* | *fail*)
            if ((resumed < 3)) && ((i >= 3)); then
                log "node state '$st' -> resume ($(scontrol show node "$NODE" | sed -n 's/.*Reason=//p'))"
                scontrol update nodename="$NODE" state=resume || true
                resumed=$((resumed + 1))
            fi
            ;;
    esac
    sleep 1
done
((ok)) || die "node $NODE not idle after ${TIMEOUT}s (state: '${st:-?}')"
log "node $NODE is $(node_state) (up in $((SECONDS - start_ts))s)"
sinfo

# ---------------------------------------------------------------------------
# 5. self-test
# ---------------------------------------------------------------------------
if [[ "${SLURM_UP_SKIP_SELFTEST:-0}" != 1 ]]; then
    bash "$HERE/slurm_selftest.sh" || die "self-test failed"
fi
log "done in $((SECONDS - start_ts))s"
