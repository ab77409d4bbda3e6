#!/usr/bin/env bash
# Trains on N GPU nodes x G GPUs: one process per node drives that node's G GPUs; process 0's host is the
# coordinator. Each node gets JAX_COORDINATOR_ADDRESS (the first host without its user@), JAX_NUM_PROCESSES and
# JAX_PROCESS_ID, which flaxformer_nmt.distributed passes to jax.distributed.initialize. Started over ssh (the
# repository and its lean environment must already be at --repo on every node, and --workdir on storage every
# node sees), or with --slurm as one srun step of one task per node (JAX reads SLURM's variables itself;
# flaxformer_nmt.distributed gives each task all its node's GPUs). With --tfds-data-dir (a directory every
# node reads: shared filesystem or gs://), the first node alone installs the [tfds] extra (TensorFlow) and
# prepares the config's TFDS builder into it before training starts; every node trains with that directory.
# Over ssh, Ctrl-C (or SIGTERM, SIGHUP) stops every node's process: each runs in a terminal of its own
# (ssh -tt) that sshd hangs up when its ssh ends. A node whose process fails stops the others' (fail fast), and the
# status is its, else 0.
#
#   launch/gpu_multinode.sh --hosts node1,node2 --gpus-per-node 8 --tfds-data-dir /shared/tensorflow_datasets \
#       -- --config configs/wmt14_ende_big.py --workdir /shared/runs/big
#   launch/gpu_multinode.sh --slurm --nodes 4 --gpus-per-node 8 --tfds-data-dir ... -- --config ...
#   launch/gpu_multinode.sh --dry-run ...     # print every command instead of running it
set -euo pipefail

usage() {
  sed -n '2,/^set /s/^# \{0,1\}//p' "$0"  # the comment above
  echo "options: (--hosts H1,H2,... | --slurm --nodes N) [--gpus-per-node 8] [--port 12355] [--repo DIR]"
  echo "         [--python python3] [--tfds-data-dir DIR] [--dry-run] -- TRAIN_ARGS..."
  exit "${1:-2}"
}

HOSTS="" NODES="" GPUS=8 PORT=12355 PYTHON="python3" SLURM=0 DRY_RUN=0 TFDS_DATA_DIR=""
REPO="$(cd "$(dirname "$0")/.." && pwd)"
while [[ $# -gt 0 ]]; do
  case "$1" in --slurm|--dry-run|-h|--help|--) ;; --*) [[ $# -ge 2 ]] || { echo "$1 needs a value" >&2; usage; } ;; esac
  case "$1" in
    --hosts) HOSTS="$2"; shift 2 ;;
    --nodes) NODES="$2"; shift 2 ;;
    --gpus-per-node) GPUS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --repo) REPO="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --tfds-data-dir) TFDS_DATA_DIR="$2"; shift 2 ;;
    --slurm) SLURM=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "unknown option: $1" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || { echo "training arguments (after --) are required" >&2; usage; }
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || { echo "--gpus-per-node must be a positive number, not $GPUS" >&2; usage; }
# shellcheck source=launch/common.sh
. "$(dirname "$0")/common.sh"
ARGS=("$@")
[[ -n "$TFDS_DATA_DIR" ]] && ARGS+=("--config.tfds_data_dir=$TFDS_DATA_DIR")
mapfile -t CONFIG_ARGS < <(config_args "${ARGS[@]}")
VISIBLE="$(seq -s, 0 $((GPUS - 1)))"
REMOTE_PYTHON="$(printf '%q' "$PYTHON")"  # one word in the remote command lines, as srun gets it
PREPARE="cd $(quote "$REPO") && $REMOTE_PYTHON -m pip install -q -e '.[tfds]'"
PREPARE+=" && $REMOTE_PYTHON -m flaxformer_nmt.corpora prepare $(quote "${CONFIG_ARGS[@]}")"

run() {  # prints the command (shell-quoted); runs it unless --dry-run
  quote "$@"; echo
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}

if [[ "$SLURM" == 1 ]]; then
  [[ -n "$NODES" ]] || { echo "--slurm needs --nodes" >&2; usage; }
  if [[ -n "$TFDS_DATA_DIR" ]]; then  # one task on one node, finished before the training step starts
    run srun --nodes 1 --ntasks 1 bash -c "$PREPARE"
  fi
  run srun --nodes "$NODES" --ntasks-per-node 1 --gpus-per-node "$GPUS" --chdir "$REPO" \
    "$PYTHON" -m flaxformer_nmt.train --distributed=on "${ARGS[@]}"
  exit 0
fi

[[ -n "$HOSTS" ]] || { echo "--hosts (or --slurm) is required" >&2; usage; }
IFS=, read -r -a HOST_LIST <<< "$HOSTS"
NUM=${#HOST_LIST[@]}
COORDINATOR="${HOST_LIST[0]#*@}"  # ssh takes user@host; the coordinator address is host:port,
if [[ "$COORDINATOR" == *:* ]]; then COORDINATOR="[$COORDINATOR]"; fi  # an IPv6 host in brackets
COORDINATOR+=":$PORT"
# A remote terminal (-tt) is hung up by sshd when its ssh ends, which stops the command in it (SIGHUP); without
# one the command would go on running. ssh's own input is /dev/null, so it leaves the local terminal alone.
SSH=(ssh -tt)
PIDS=()
stop() { kill "${PIDS[@]}" 2>/dev/null || true; wait; exit "$1"; }  # the ssh clients ignore SIGINT (background)
trap 'stop 130' INT; trap 'stop 143' TERM; trap 'stop 129' HUP
on_host() {  # on_host HOST COMMAND: prints the ssh command; unless --dry-run, starts it in the background
  quote "${SSH[@]}" "$1" "$2"; echo
  if [[ "$DRY_RUN" == 0 ]]; then "${SSH[@]}" "$1" "$2" < /dev/null & PIDS+=($!); fi
}
# Waits for every ssh started. The first to fail stops the others (their trainers would otherwise wait on the lost
# process in a collective until JAX's timeout) and gives its status; else 0.
wait_all() {
  local status=0 _
  for _ in "${PIDS[@]}"; do
    wait -n || { status=$?; kill "${PIDS[@]}" 2>/dev/null || true; wait; break; }
  done
  PIDS=()
  return "$status"
}
if [[ -n "$TFDS_DATA_DIR" ]]; then
  on_host "${HOST_LIST[0]}" "$PREPARE"; wait_all  # no node trains before the data is prepared
fi
for i in "${!HOST_LIST[@]}"; do
  REMOTE="cd $(quote "$REPO") && JAX_COORDINATOR_ADDRESS=$COORDINATOR JAX_NUM_PROCESSES=$NUM JAX_PROCESS_ID=$i"
  REMOTE+=" CUDA_VISIBLE_DEVICES=$VISIBLE $REMOTE_PYTHON -m flaxformer_nmt.train --distributed=on $(quote "${ARGS[@]}")"
  on_host "${HOST_LIST[$i]}" "$REMOTE"
done
wait_all
