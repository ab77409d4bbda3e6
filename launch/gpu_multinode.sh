#!/usr/bin/env bash
# Trains on N GPU nodes x G GPUs: one process per node drives that node's G GPUs; process 0's host is the
# coordinator. Each node gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, which
# flaxformer_nmt.distributed passes to jax.distributed.initialize. Started over ssh (the repository and
# its environment must already be at --repo on every node, and --workdir on storage every node sees), or
# with --slurm as one srun step (JAX reads SLURM's variables itself).
#
#   launch/gpu_multinode.sh --hosts node1,node2 --gpus-per-node 8 \
#       -- --config configs/big.py --workdir /shared/runs/big --config.data_dir=/shared/wmt14
#   launch/gpu_multinode.sh --slurm --nodes 4 --gpus-per-node 8 -- --config ...
#   launch/gpu_multinode.sh --dry-run ...     # print the commands instead of running them
set -euo pipefail

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  echo "options: (--hosts H1,H2,... | --slurm --nodes N) [--gpus-per-node 8] [--port 12355] [--repo DIR]"
  echo "         [--python python3] [--dry-run] -- TRAIN_ARGS..."
  exit "${1:-2}"
}

HOSTS="" NODES="" GPUS=8 PORT=12355 PYTHON="python3" SLURM=0 DRY_RUN=0
REPO="$(cd "$(dirname "$0")/.." && pwd)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) HOSTS="$2"; shift 2 ;;
    --nodes) NODES="$2"; shift 2 ;;
    --gpus-per-node) GPUS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --repo) REPO="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --slurm) SLURM=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "unknown option: $1" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || { echo "training arguments (after --) are required" >&2; usage; }
TRAIN_ARGS="$(printf '%q ' "$@")"
VISIBLE="$(seq -s, 0 $((GPUS - 1)))"

if [[ "$SLURM" == 1 ]]; then
  [[ -n "$NODES" ]] || { echo "--slurm needs --nodes" >&2; usage; }
  CMD=(srun --nodes "$NODES" --ntasks-per-node 1 --gpus-per-node "$GPUS" --chdir "$REPO"
       "$PYTHON" -m flaxformer_nmt.train --distributed=on "$@")
  printf '%q ' "${CMD[@]}"; echo
  if [[ "$DRY_RUN" == 0 ]]; then exec "${CMD[@]}"; fi
  exit 0
fi

[[ -n "$HOSTS" ]] || { echo "--hosts (or --slurm) is required" >&2; usage; }
IFS=, read -r -a HOST_LIST <<< "$HOSTS"
NUM=${#HOST_LIST[@]}
COORDINATOR="${HOST_LIST[0]}:$PORT"
PIDS=()
for i in "${!HOST_LIST[@]}"; do
  REMOTE="cd $(printf '%q' "$REPO") && JAX_COORDINATOR_ADDRESS=$COORDINATOR JAX_NUM_PROCESSES=$NUM JAX_PROCESS_ID=$i"
  REMOTE+=" CUDA_VISIBLE_DEVICES=$VISIBLE $PYTHON -m flaxformer_nmt.train --distributed=on $TRAIN_ARGS"
  printf '%q ' ssh "${HOST_LIST[$i]}" "$REMOTE"; echo
  if [[ "$DRY_RUN" == 0 ]]; then
    ssh "${HOST_LIST[$i]}" "$REMOTE" &
    PIDS+=($!)
  fi
done
STATUS=0
for pid in "${PIDS[@]}"; do wait "$pid" || STATUS=$?; done
exit "$STATUS"
