#!/usr/bin/env bash
# Launch rlhf.cli.train under torchrun on this node (one process per GPU, or per CPU rank).
#
# Usage:
#   launch/torchrun.sh [--dry-run] --config configs/gsm8k_8gpu.yaml [key=value ...] [--print-config]
#
#   # two nodes: run on each node with its own NODE_RANK
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh --config configs/gsm8k_2node.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/torchrun.sh --config configs/gsm8k_2node.yaml
#
# Environment (defaults in brackets):
#   NNODES         number of nodes [1]
#   NODE_RANK      this node's rank, 0 .. NNODES-1 [0]
#   MASTER_ADDR    address of node 0, reachable from every node [127.0.0.1]
#   MASTER_PORT    free TCP port on node 0 for the rendezvous [29500]
#   GPUS_PER_NODE  processes on this node [GPUs listed by nvidia-smi, or 1 without GPUs]
#   PYTHON         interpreter [the active environment's python]
#
# The launch's sizes win over the config file: trainer.nnodes=$NNODES and
# trainer.n_gpus_per_node=$GPUS_PER_NODE are appended to the overrides. Those two keys on
# the command line (as verl's scripts set them) set the sizes NNODES / GPUS_PER_NODE leave
# unset (GPUS_PER_NODE not above the GPUs nvidia-smi lists); where both are given they must
# agree, or nothing starts. The resolved command is printed first (on stderr); --dry-run
# prints it on stdout and exits. Check a node first with `rlhf-doctor --config ...`.
set -euo pipefail

refuse() {  # one line on stderr, exit 2
    echo "torchrun.sh: $*" >&2
    exit 2
}

# The size a trainer.nnodes / trainer.n_gpus_per_node override ($1) gives the launch
# variable named $2 (NNODES / GPUS_PER_NODE): it sets it when unset, else must equal it.
size_override() {
    local value="${1#*=}"
    [[ "$value" =~ ^[1-9][0-9]*$ ]] || refuse "$1: not a whole number >= 1"
    if [[ -n "${!2:-}" && "${!2}" != "$value" ]]; then
        refuse "$1 disagrees with $2=${!2}; set one of them, or both alike"
    fi
    printf -v "$2" '%s' "$value"
}

dry_run=0
options=()
overrides=()
nnodes_key=""
gpus_key=""
while (($#)); do
    case "$1" in
        --dry-run) dry_run=1 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        --config)
            (($# >= 2)) || refuse "--config needs a file"
            options+=("$1" "$2")
            shift
            ;;
        -*) options+=("$1") ;;
        trainer.nnodes=* | +trainer.nnodes=* | ++trainer.nnodes=*)
            nnodes_key="$1"  # the last one counts, as for any key
            ;;
        trainer.n_gpus_per_node=* | +trainer.n_gpus_per_node=* | ++trainer.n_gpus_per_node=*)
            gpus_key="$1"
            ;;
        *) overrides+=("$1") ;;
    esac
    shift
done
if [[ -n "$nnodes_key" ]]; then size_override "$nnodes_key" NNODES; fi
if [[ -n "$gpus_key" ]]; then
    detected=0
    if [[ -z "${GPUS_PER_NODE:-}" ]] && command -v nvidia-smi >/dev/null 2>&1; then
        detected="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)"
    fi
    size_override "$gpus_key" GPUS_PER_NODE
    if ((detected > 0 && GPUS_PER_NODE > detected)); then
        refuse "$gpus_key, but nvidia-smi lists $detected GPUs on this node"
    fi
fi

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
# After a SIGTERM torchrun SIGKILLs its workers after this many seconds (its own default:
# 30): long enough that the trainer's trainer.preemption_grace_s, not torchrun, decides
# whether the step in flight gets its checkpoint; the scheduler's SIGKILL still bounds it.
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-600}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        GPUS_PER_NODE="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if ((GPUS_PER_NODE == 0)); then GPUS_PER_NODE=1; fi
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -n "${VIRTUAL_ENV:-}" ]]; then PYTHON="$VIRTUAL_ENV/bin/python"; else PYTHON=python3; fi
fi

cmd=(
    "$PYTHON" -m rlhf.cli.torchrun
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --nproc-per-node "$GPUS_PER_NODE"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
    --shutdown-timeout "$SHUTDOWN_TIMEOUT"
    -m rlhf.cli.train
    "${options[@]}"
    "${overrides[@]}"
    "trainer.nnodes=$NNODES"
    "trainer.n_gpus_per_node=$GPUS_PER_NODE"
)
line="$(printf '%q ' "${cmd[@]}")"
if ((dry_run)); then
    echo "${line% }"
    exit 0
fi
echo "+ ${line% }" >&2  # stderr: keeps --print-config's YAML on stdout clean
exec "${cmd[@]}"
