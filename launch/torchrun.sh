#!/usr/bin/env bash
# Launch megatron_rl training on one node with torchrun.
#
#   launch/torchrun.sh [--dry-run] CONFIG [key=value ...]
#
# CONFIG is a preset (configs/*.yaml); key=value overrides go to the trainer as they are.
# This script holds no hyperparameters: the number of processes comes from the preset's
# cluster section (trainer processes per node), as `megatron-rl plan --launch-env` reads it.
#
# Environment:
#   NPROC_PER_NODE  processes to start (default: from the preset)
#   PYTHON          python with megatron_rl installed (default: python3)
#   TORCHRUN        torchrun command (default: torchrun)
#   DRY_RUN=1       print the environment and the command line instead of running them
set -euo pipefail

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
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

# Fail fast instead of hanging: NCCL errors abort the process group; one connection per
# device keeps megatron's tensor/sequence-parallel communication ordered.
env_vars=(
    "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    "TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    "NCCL_DEBUG=${NCCL_DEBUG:-WARN}"
    "PYTHONUNBUFFERED=1"
)
read -r -a torchrun <<<"${TORCHRUN:-torchrun}"
cmd=(
    "${torchrun[@]}" --standalone --nnodes=1 "--nproc-per-node=$NPROC_PER_NODE"
    -m megatron_rl.cli train --config "$config" "$@"
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
