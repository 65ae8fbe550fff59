# Sourced by the sbatch templates in this folder (not run on its own). It turns the Slurm
# allocation into a torch.distributed job and launches scripts/pretrain.py with srun, one
# task per GPU (or per CPU rank for tiny-cpu.sbatch):
#   rendezvous  MASTER_ADDR = the allocation's first host (scontrol show hostnames), MASTER_PORT
#               from the job id; each task maps SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS to
#               RANK/LOCAL_RANK/WORLD_SIZE (slurm/task.sh)
#   layout      the preset's suggested TP/PP/ZeRO/batch flags (python -m hybridlm.presets),
#               unless the template's LAYOUT_FLAGS gives others
#   resume      --save and --load name the same RUN_DIR: a fresh run starts at iteration 0,
#               a requeued one continues from RUN_DIR's latest complete checkpoint
#   preemption  #SBATCH --signal=USR1@T sends SIGUSR1 to every task T seconds before the time
#               limit; --exit-signal-handler makes all ranks finish the step, save, and exit 75;
#               on 75 this script runs `scontrol requeue` and the job starts again, resuming.
#               EXIT_SIGNAL=SIGTERM suits clusters that preempt with SIGTERM and a grace time.
# DRY_RUN=1 prints the srun command with every variable filled in instead of running it
# (outside Slurm the node and task counts come from the preset's layout).
# Variables the template sets: MODEL HYBRIDLM_DIR VENV RUN_DIR LAYOUT_FLAGS.

REQUEUE_EXIT_CODE=75  # hybridlm/training/preemption.py EXIT_CODE

hl_environment() {
    cd "$HYBRIDLM_DIR" || { echo "error: HYBRIDLM_DIR $HYBRIDLM_DIR is not a directory" >&2; exit 2; }
    if [ -f "$VENV/bin/activate" ]; then
        # shellcheck disable=SC1091
        source "$VENV/bin/activate"
    fi
    export PYTHONUNBUFFERED=1
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    # NCCL: a failed collective raises instead of hanging; warnings (not info) in the log.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # Fewer cross-stream allocator holds for NCCL buffers (lower peak memory).
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    # Site-specific, set them here when your cluster needs them:
    #   export NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5 NCCL_IB_GID_INDEX=3 NCCL_NET_GDR_LEVEL=PHB
}

hl_rendezvous() {
    if [ -n "${SLURM_JOB_ID:-}" ]; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        NODES=$SLURM_JOB_NUM_NODES
        TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-$((SLURM_NTASKS / SLURM_JOB_NUM_NODES))}
    else  # a dry run outside Slurm: the layout's resources
        MASTER_ADDR=$(hostname)
        read -r NODES TASKS_PER_NODE < <(python -m hybridlm.presets --resources "$MODEL") || exit 2
    fi
    # One port per job (and the same one after a requeue, when the old job is gone).
    MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
    export MASTER_ADDR MASTER_PORT
}

# hl_train [pretrain flags...]: launch the job; requeue it when it stopped on the exit signal.
hl_train() {
    hl_environment
    hl_rendezvous
    local layout
    layout=${LAYOUT_FLAGS:-$(python -m hybridlm.presets --layout-flags "$MODEL")} || exit 2
    # shellcheck disable=SC2206  # LAYOUT_FLAGS is a word list on purpose
    # Not --kill-on-bad-exit: on the exit signal every rank exits 75 after the same barrier, and
    # killing the slower ones would turn 75 into 143. --wait ends the step this many seconds
    # after the first task exits, so a crashed rank cannot leave the others waiting.
    local cmd=(srun --kill-on-bad-exit=0 --wait="${TASK_EXIT_WAIT:-60}" "$HYBRIDLM_DIR/slurm/task.sh"
               python -u scripts/pretrain.py --model "$MODEL" $layout "$@"
               --save "$RUN_DIR" --load "$RUN_DIR" --exit-signal-handler --exit-signal "${EXIT_SIGNAL:-SIGUSR1}")
    echo "hybridlm: job ${SLURM_JOB_ID:-<dry run>} (restart ${SLURM_RESTART_COUNT:-0}) on $NODES node(s) x" \
         "$TASKS_PER_NODE task(s), rendezvous $MASTER_ADDR:$MASTER_PORT, run directory $RUN_DIR"
    if [ -n "${DRY_RUN:-}" ]; then
        printf '%q ' "${cmd[@]}"
        echo
        return 0
    fi
    mkdir -p "$RUN_DIR"
    "${cmd[@]}"
    local rc=$?
    if [ "$rc" -eq "$REQUEUE_EXIT_CODE" ]; then
        echo "hybridlm: stopped on the exit signal after saving; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    exit "$rc"
}
