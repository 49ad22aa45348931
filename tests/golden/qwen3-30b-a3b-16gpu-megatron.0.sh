#!/bin/bash
# qwen3-30b-a3b-async_golden: written by `areal-hpc submit` (areal_hpc 0.0-golden, hetjob layout).
# Run directory: /shared/runs/qwen3-30b-a3b-async/golden
# component 0 (gen): gen_server
#SBATCH --job-name=qwen3-30b-a3b-async_golden
#SBATCH --chdir=/home/u/rl
#SBATCH --output=/shared/runs/qwen3-30b-a3b-async/golden/slurm/%j_0_log.out
#SBATCH --error=/shared/runs/qwen3-30b-a3b-async/golden/slurm/%j_0_log.err
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR2@120
#SBATCH --comment=areal_hpc-0.0-golden
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --mem=512G
#SBATCH hetjob
# component 1 (train): trainer, controller, rollout
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --mem=512G

set -uo pipefail
export AREAL_RUN_DIR=/shared/runs/qwen3-30b-a3b-async/golden
# Roles read their rank and world from the job through submitit's JobEnvironment.
export SUBMITIT_EXECUTOR=slurm
export PYTHONUNBUFFERED=1
# NVLink SHARP (NVLS) is never enabled: it hangs weight broadcasts on some fabrics.
export NCCL_NVLS_ENABLE=0
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

# Each run of this script (the first, and every requeue) is a new attempt: its own log folder, and the last
# attempt's coordination state cleared. Exit code 3: the run already finished, so nothing is started.
attempt=$(/opt/areal/bin/python -m areal_hpc.recover.attempt --run-dir "$AREAL_RUN_DIR")
rc=$?
if [ "$rc" = 3 ]; then
    echo "areal-hpc: job ${SLURM_JOB_ID}: the run already finished; nothing to start"
    exit 0
elif [ "$rc" != 0 ]; then
    echo "areal-hpc: job ${SLURM_JOB_ID}: could not begin an attempt (exit code $rc)" >&2
    exit "$rc"
fi
export AREAL_ATTEMPT="$attempt"
logs="$AREAL_RUN_DIR/logs/attempt$attempt"
echo "areal-hpc: job ${SLURM_JOB_ID} AREAL_ATTEMPT=$attempt (Slurm restart ${SLURM_RESTART_COUNT:-0}) started on $(hostname) at $(date -Is)"

names=()
pids=()
srun --het-group=0 --nodes=1 --ntasks=4 --ntasks-per-node=4 --cpus-per-task=16 --gpus-per-node=8 --kill-on-bad-exit=1 --output="$logs/gen_server%t.log" \
    /opt/areal/bin/python -P -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" gen_server &
names+=(gen_server)
pids+=($!)
srun --het-group=1 --nodes=1 --ntasks=8 --ntasks-per-node=8 --cpus-per-task=8 --gpus-per-node=8 --kill-on-bad-exit=1 --output="$logs/trainer%t.log" \
    /opt/areal/bin/python -P -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" trainer &
names+=(trainer)
pids+=($!)
srun --het-group=1 --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=1 --overlap --kill-on-bad-exit=1 --output="$logs/controller.log" \
    /opt/areal/bin/python -P -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" controller &
names+=(controller)
pids+=($!)
srun --het-group=1 --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=1 --overlap --kill-on-bad-exit=1 --output="$logs/rollout.log" \
    /opt/areal/bin/python -P -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" rollout &
names+=(rollout)
pids+=($!)

forward() {  # send a signal to every step; srun passes it on to the tasks
    kill -s "$1" "${pids[@]}" 2>/dev/null
}
# Preemption or the time limit (--signal=B:USR2): the roles write a recover checkpoint.
trap 'echo "areal-hpc: USR2 at $(date -Is)"; forward USR2' USR2
# TERM: scancel, the time limit, or Slurm's own requeue end the job; then it must not requeue itself.
terminated=""
trap 'terminated=1; forward TERM' TERM

stop_steps() {  # TERM, then KILL whatever is left after the grace period
    forward TERM
    for _ in $(seq 20); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return
        sleep 0.5
    done
    forward KILL
}

# A failed attempt requeues the job (same job id) while recover_retries allow; the next run of this script
# begins the next attempt, which resumes as recover_mode (auto) says. Failures are counted in the
# run directory, not by SLURM_RESTART_COUNT, which also counts requeues that are no failure: preemption,
# node failure, and an attempt that stopped on a notice (exit code 75).
failures_file="$AREAL_RUN_DIR/logs/failed_attempts"
fail() {
    failures=$(cat "$failures_file" 2>/dev/null || echo 0)
    if [ -n "$terminated" ]; then
        echo "areal-hpc: the job was terminated (scancel, time limit or preemption): not requeued" >&2
        exit "$1"
    elif [ "$1" = 78 ] || grep -qs '"permanent":true' "$AREAL_RUN_DIR/status.json"; then
        echo "areal-hpc: attempt $attempt failed in a way a new attempt would repeat (config, inputs, checkpoint):" \
            "the job is not requeued; fix it, then: areal-hpc submit --recover $AREAL_RUN_DIR" >&2
        exit "$1"
    elif [ "$1" = 75 ]; then
        echo "areal-hpc: attempt $attempt stopped on a preemption or time-limit notice after writing a recover" \
            "checkpoint; requeueing job ${SLURM_JOB_ID} (not counted against recover_retries)" >&2
    elif [ "$failures" -ge 10 ]; then
        echo "areal-hpc: attempt $attempt failed and recover_retries (10) are used up" \
            "($failures failed attempts): the job is not requeued" >&2
        exit "$1"
    else
        echo "$((failures + 1))" > "$failures_file"
        echo "areal-hpc: attempt $attempt failed; requeueing job ${SLURM_JOB_ID} in 10 s" \
            "(failed attempt $((failures + 1)) of recover_retries 10)" >&2
        sleep 10 & wait $!  # `wait`, unlike a plain sleep, lets the TERM trap run at once
    fi
    # Slurm then ends this script; sacct shows this run as REQUEUED, not FAILED, whatever it exits with.
    [ -z "$terminated" ] && scontrol requeue "${SLURM_JOB_ID}" && exit 0
    echo "areal-hpc: the job was not requeued (terminated meanwhile, or scontrol requeue failed)" >&2
    exit "$1"
}

# Wait for the first step to end (a trapped signal also wakes `wait -n`, so look before deciding).
while true; do
    wait -n
    rc=$?
    ended=""
    for i in "${!pids[@]}"; do
        kill -0 "${pids[$i]}" 2>/dev/null || ended="${names[$i]}"
    done
    [ -z "$ended" ] && continue
    if [ -e "$AREAL_RUN_DIR/FINISHED" ]; then
        echo "areal-hpc: run finished; stopping the remaining steps"
        stop_steps
        exit 0
    fi
    echo "areal-hpc: step $ended ended (exit code $rc) before the run finished; ending the job" >&2
    stop_steps
    fail $(( rc == 0 ? 1 : rc ))
done
