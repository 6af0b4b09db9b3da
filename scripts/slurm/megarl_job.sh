# Sourced by the sbatch scripts in this folder (train.sbatch, train_cpu.sbatch, convert.sbatch):
# where megarl is, and `megarl_train`, which runs one `megarl train` step with srun and turns a
# preemption checkpoint into a requeue. Not a job script itself.
#
# Environment (all optional except RUN_DIR for megarl_train):
#   MEGARL_HOME   the megarl checkout (default: the directory sbatch was called from)
#   PYTHON        the interpreter with megarl installed (default: $MEGARL_HOME/.venv/bin/python)
#   RUN_DIR       the run directory (config.yaml, metrics.jsonl, checkpoints/, hf/, logs/); must be
#                 on a file system every node sees
#   MAX_REQUEUES  stop requeueing after this many restarts (default 20)

# sbatch runs a copy of the script from Slurm's spool directory, so paths come from the
# environment, not from $0.
MEGARL_HOME=${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
PYTHON=${PYTHON:-$MEGARL_HOME/.venv/bin/python}
MAX_REQUEUES=${MAX_REQUEUES:-20}
# megarl/parallel/preempt.py: EXIT_CODE and the record rank 0 writes next to it.
MEGARL_PREEMPT_EXIT=75
MEGARL_PREEMPT_RECORD=preempted.json

megarl_die() {
    echo "megarl job: error: $*" >&2
    exit 2
}

megarl_check_python() {
    [ -x "$PYTHON" ] || megarl_die "PYTHON=$PYTHON is not an executable; set PYTHON (or MEGARL_HOME to the megarl checkout, whose .venv/bin/python is the default)"
    "$PYTHON" -c "import megarl" 2>/dev/null || megarl_die "$PYTHON cannot import megarl; install it there (make venv) or set PYTHON"
}

# megarl_train [megarl train arguments...]
# One srun step of `megarl train --run-dir $RUN_DIR`, with --resume when RUN_DIR holds a
# checkpoint (a requeued or resubmitted job continues). Per-rank logs go to
# $RUN_DIR/logs/<job id>_r<restart>_<rank>.log. When the batch script receives SIGUSR1
# (#SBATCH --signal=B:USR1@<s>, or `scancel --batch --signal=USR1 <job>`) it is forwarded to the
# step: every rank finishes its RL step, checkpoints, and exits 75; the job is then requeued and
# resumes from that checkpoint. Returns (exits with) srun's status otherwise.
megarl_train() {
    : "${RUN_DIR:?set RUN_DIR: the run directory (checkpoints, metrics.jsonl, logs/), on a shared file system}"
    [ -n "${SLURM_JOB_ID:-}" ] || megarl_die "megarl_train runs inside a Slurm job (sbatch); SLURM_JOB_ID is not set"
    megarl_check_python
    local restart=${SLURM_RESTART_COUNT:-0}
    mkdir -p "$RUN_DIR/logs"
    local resume=()
    if compgen -G "$RUN_DIR/checkpoints/step_*" >/dev/null; then
        resume=(--resume)
    fi
    rm -f "$RUN_DIR/$MEGARL_PREEMPT_RECORD"  # an earlier stop's: only this step's may trigger a requeue
    echo "megarl job $SLURM_JOB_ID (restart $restart): $SLURM_NTASKS tasks on $SLURM_JOB_NODELIST, run dir $RUN_DIR ${resume[*]}"

    # srun, not one torchrun per node: every process is a Slurm task (rank = SLURM_PROCID, read by
    # megarl/parallel/launch_env.py), so the USR1 forwarded to srun reaches each rank directly
    # (torchrun's agent does not pass USR1 on), and Slurm accounts and kills every rank.
    # --kill-on-bad-exit: a rank that dies before the process group is up would otherwise leave
    # the others waiting in the rendezvous (megarl's watchdog covers everything after it).
    srun --kill-on-bad-exit=1 --output="$RUN_DIR/logs/${SLURM_JOB_ID}_r${restart}_%t.log" \
        "$PYTHON" -m megarl.cli train --run-dir "$RUN_DIR" "${resume[@]}" "$@" &
    local pid=$! rc interrupted
    # bash runs a trap only between commands, and `wait` is the one that returns early for it:
    # srun runs in the background so the signal is handled at once, then we wait again.
    trap 'interrupted=1; echo "megarl job: $(date +%T) SIGUSR1: the ranks checkpoint after their current step"; kill -USR1 $pid' USR1
    while :; do
        interrupted=0
        wait "$pid"
        rc=$?
        [ "$interrupted" = 1 ] || break
    done
    trap - USR1

    # A stop on a signal: megarl's exit status is 75 on every rank, but srun reports the first
    # rank to exit, and --kill-on-bad-exit may terminate the others while they tear down (after
    # the checkpoint). The record that rank 0 writes after the checkpoint is what counts.
    if [ "$rc" != 0 ] && [ -f "$RUN_DIR/$MEGARL_PREEMPT_RECORD" ]; then
        echo "megarl job: stopped with a checkpoint: $(cat "$RUN_DIR/$MEGARL_PREEMPT_RECORD")"
        if [ "$restart" -ge "$MAX_REQUEUES" ]; then
            echo "megarl job: not requeued: restart $restart reached MAX_REQUEUES=$MAX_REQUEUES; resubmit to continue" >&2
            exit "$MEGARL_PREEMPT_EXIT"
        fi
        # The requeued job starts this script again (same job id) and resumes. Slurm holds a
        # requeued batch job for about two minutes before it is eligible again.
        echo "megarl job: $(date +%T) requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || {
            echo "megarl job: scontrol requeue failed (submitted without --requeue, or JobRequeue=0?): resubmit to resume" >&2
            exit "$MEGARL_PREEMPT_EXIT"
        }
        exit 0  # Slurm ends this run of the script once the requeue takes effect
    fi
    return "$rc"
}
