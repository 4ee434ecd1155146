#!/usr/bin/env bash
# Prove the local SLURM cluster works: sbatch --wait a 2-task job that runs
# `srun hostname` and reports the SLURM_* variables seen by the batch script
# itself and by each srun task.  Exits non-zero (with log tails) on failure.
set -euo pipefail

TIMEOUT="${SLURM_SELFTEST_TIMEOUT:-120}"
work="$(mktemp -d /tmp/slurm_selftest.XXXXXX)"
chmod 755 "$work"
out="$work/job.out"

fail() {
    echo "[slurm_selftest] FAILED: $*" >&2
    [[ -f "$out" ]] && { echo "----- job output -----" >&2; cat "$out" >&2; }
    for f in /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log; do
        [[ -f "$f" ]] && { echo "----- last 30 lines of $f -----" >&2; tail -n 30 "$f" >&2; }
    done
    exit 1
}

cat > "$work/job.sh" <<'JOB'
#!/usr/bin/env bash
set -euo pipefail
vars="SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_STEP_ID SLURM_STEP_NUM_TASKS SLURM_STEPID SLURM_JOB_NODELIST SLURM_JOB_ID"
show() {
    local who=$1 v
    printf '%s' "$who"
    for v in $vars; do printf ' %s=%s' "$v" "${!v-<unset>}"; done
    printf '\n'
}
export -f show
export vars
show "BATCH"
srun hostname | sed 's/^/HOST /'
srun bash -c 'show TASK'
JOB

echo "[slurm_selftest] submitting 2-task job"
set +e
timeout "$TIMEOUT" sbatch --wait --ntasks=2 --time=5 --job-name=selftest \
    --output="$out" "$work/job.sh"
rc=$?
set -e
((rc == 0)) || fail "sbatch --wait exited $rc"
[[ -f "$out" ]] || fail "no job output"
cat "$out"
nhost="$(grep -c '^HOST ' "$out" || true)"
ntask="$(grep -c '^TASK ' "$out" || true)"
[[ "$nhost" -eq 2 ]] || fail "expected 2 'srun hostname' lines, got $nhost"
[[ "$ntask" -eq 2 ]] || fail "expected 2 task lines, got $ntask"
echo "[slurm_selftest] OK"
rm -rf "$work"
