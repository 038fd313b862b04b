#!/usr/bin/env bash
# Launch megatron_rl training on one node with torchrun.
#
#   launch/torchrun.sh [--dry-run] CONFIG [key=value ...]
#
# CONFIG is a preset (configs/*.yaml); key=value overrides go to the trainer as they are.
# This script holds no hyperparameters: the number of processes and torchrun's restarts come
# from the preset's cluster section, as `megatron-rl plan --launch-env` reads it.
# A rank that dies is restarted (cluster.max_restarts) and resumes from the newest complete
# checkpoint (checkpoint.resume=auto, passed before your overrides); SIGTERM saves at the next
# step boundary and exits 3. torchrun's own log: <logging.dir>/logs/torchrun.log.
#
# Environment:
#   NPROC_PER_NODE  processes to start (default: from the preset)
#   PYTHON          python with megatron_rl installed (default: python3)
#   TORCHRUN        torchrun command (default: $PYTHON -m megatron_rl.elastic, torchrun with
#                   its log in a file and each failed rank's one line at the end)
#   DRY_RUN=1       print the environment and the command line instead of running them
set -euo pipefail

usage() {
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# A word as the shell reads it back: bare when safe, else in single quotes.
quote() {
    if [[ $1 =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$1"
    elif [[ $1 != *"'"* ]]; then
        printf "'%s'" "$1"
    else
        printf '%q' "$1"
    fi
}

print_cmd() {
    local out="" word
    for word in "$@"; do
        out+="$(quote "$word") "
    done
    echo "${out% }"
}

dry_run=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
    dry_run=1
    shift
fi
[[ $# -ge 1 && ${1:-} != -h && ${1:-} != --help ]] || usage
config=$1
shift
if [[ ! -f $config ]]; then
    echo "torchrun.sh: config file '$config' does not exist (pass a preset such as configs/tiny-gspo.yaml)" >&2
    exit 2
fi

python=${PYTHON:-python3}
launch_env=$("$python" -m megatron_rl.cli plan --launch-env --config "$config" "$@")  # NNODES=, NPROC_PER_NODE=
"$python" -m megatron_rl.cli plan --check --config "$config" "$@"  # a layout that does not fit its GPUs stops here
nnodes=$(sed -n 's/^NNODES=//p' <<<"$launch_env")
if [[ $nnodes != 1 ]]; then
    echo "torchrun.sh: $config plans $nnodes trainer nodes: use launch/slurm.sbatch, or override cluster.nodes=1" >&2
    exit 2
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-$(sed -n 's/^NPROC_PER_NODE=//p' <<<"$launch_env")}
max_restarts=$(sed -n 's/^MAX_RESTARTS=//p' <<<"$launch_env")
log_dir=$(sed -n 's/^LOG_DIR=//p' <<<"$launch_env")

# Fail fast instead of hanging: NCCL errors abort the process group; one connection per
# device keeps megatron's tensor/sequence-parallel communication ordered.
env_vars=(
    "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    "TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    "NCCL_DEBUG=${NCCL_DEBUG:-WARN}"
    "PYTHONUNBUFFERED=1"
)
if [[ -n ${TORCHRUN:-} ]]; then
    read -r -a torchrun <<<"$TORCHRUN"
else
    torchrun=("$python" -m megatron_rl.elastic "--log-file=$log_dir/logs/torchrun.log")
fi
cmd=(
    "${torchrun[@]}" --standalone --nnodes=1 "--nproc-per-node=$NPROC_PER_NODE" "--max-restarts=$max_restarts"
    -m megatron_rl.cli train --config "$config" checkpoint.resume=auto "$@"
)

if [[ $dry_run == 1 ]]; then
    for assignment in "${env_vars[@]}"; do
        echo "export $assignment"
    done
    print_cmd "${cmd[@]}"
    exit 0
fi
for assignment in "${env_vars[@]}"; do
    export "${assignment?}"
done
exec "${cmd[@]}"
