#!/bin/bash
# qwen2.5-32b-async_golden: written by `areal-hpc submit` (areal_hpc 0.0-golden, hetjob layout).
# Run directory: /shared/runs/qwen2.5-32b-async/golden
# component 0 (gen): gen_server
#SBATCH --job-name=qwen2.5-32b-async_golden
#SBATCH --chdir=/home/u/rl
#SBATCH --output=/shared/runs/qwen2.5-32b-async/golden/slurm/%j_0_log.out
#SBATCH --error=/shared/runs/qwen2.5-32b-async/golden/slurm/%j_0_log.err
#SBATCH --open-mode=append
#SBATCH --no-requeue
#SBATCH --signal=B:USR2@120
#SBATCH --comment=areal_hpc-0.0-golden
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --mem=512G
#SBATCH hetjob
# component 1 (train): trainer, controller, rollout
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --mem=512G

set -uo pipefail
export AREAL_RUN_DIR=/shared/runs/qwen2.5-32b-async/golden
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
srun --het-group=0 --nodes=4 --ntasks=32 --ntasks-per-node=8 --cpus-per-task=8 --gpus-per-node=8 --kill-on-bad-exit=1 --output="$logs/gen_server%t.log" \
    /opt/areal/bin/python -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" gen_server &
names+=(gen_server)
pids+=($!)
srun --het-group=1 --nodes=4 --ntasks=32 --ntasks-per-node=8 --cpus-per-task=8 --gpus-per-node=8 --kill-on-bad-exit=1 --output="$logs/trainer%t.log" \
    /opt/areal/bin/python -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" trainer &
names+=(trainer)
pids+=($!)
srun --het-group=1 --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=1 --overlap --kill-on-bad-exit=1 --output="$logs/controller.log" \
    /opt/areal/bin/python -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" controller &
names+=(controller)
pids+=($!)
srun --het-group=1 --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=1 --overlap --kill-on-bad-exit=1 --output="$logs/rollout.log" \
    /opt/areal/bin/python -m areal_hpc.launch.roles --run-dir "$AREAL_RUN_DIR" rollout &
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

fail() {  # recover_mode is disabled: a failed attempt ends the job
    echo "areal-hpc: recover_mode is disabled: the job is not requeued" >&2
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
