#!/bin/bash
# toy-cpu_golden_gen: written by `areal-hpc submit` (areal_hpc 0.0-golden, two-jobs layout).
# Run directory: /shared/runs/toy-cpu/golden
# component 0 (gen): gen_server
#SBATCH --job-name=toy-cpu_golden_gen
#SBATCH --chdir=/home/u/rl
#SBATCH --output=/shared/runs/toy-cpu/golden/slurm/%j_0_log.out
#SBATCH --error=/shared/runs/toy-cpu/golden/slurm/%j_0_log.err
#SBATCH --open-mode=append
#SBATCH --no-requeue
#SBATCH --signal=B:USR2@120
#SBATCH --comment=areal_hpc-0.0-golden
#SBATCH --partition=gen
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --gpus-per-node=1
#SBATCH --mem=2G

set -uo pipefail
export AREAL_RUN_DIR=/shared/runs/toy-cpu/golden
# Roles read their rank and world from the job through submitit's JobEnvironment.
export SUBMITIT_EXECUTOR=slurm
export PYTHONUNBUFFERED=1
# NVLink SHARP (NVLS) is never enabled: it hangs weight broadcasts on some fabrics.
export NCCL_NVLS_ENABLE=0
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

# `areal-hpc submit` began this attempt before submitting both jobs of the run (begin_attempt clears state
# that the other job uses, so neither job may begin one itself).
attempt=0
export AREAL_ATTEMPT="$attempt"
logs="$AREAL_RUN_DIR/logs/attempt$attempt"
echo "areal-hpc: job ${SLURM_JOB_ID} AREAL_ATTEMPT=$attempt (Slurm restart ${SLURM_RESTART_COUNT:-0}) started on $(hostname) at $(date -Is)"

names=()
pids=()
srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=1 --gpus-per-node=1 --kill-on-bad-exit=1 --output="$logs/gen_server%t.log" \
    /opt/areal/bin/python -P -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" gen_server &
names+=(gen_server)
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

# The two jobs meet through the run directory, and a new attempt clears the coordination state both use:
# one job requeued alone would strand the other. A two-job run recovers with `areal-hpc submit --recover`.
fail() {
    echo "areal-hpc: a two-job run is not requeued from inside a job; recover it with:" \
        "areal-hpc submit --recover $AREAL_RUN_DIR" >&2
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
