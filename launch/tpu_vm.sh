#!/usr/bin/env bash
# Trains on every worker of a Cloud TPU VM slice: (optionally) creates the TPU VM, copies this repository
# to every worker, installs it, and starts the same training command on all workers at once. Each worker
# runs one process; flaxformer_nmt.distributed finds the other workers through the TPU metadata server
# (jax.distributed.initialize), so no addresses are passed. Keep --workdir and data on gs://.
#
#   launch/tpu_vm.sh --name nmt --zone us-central2-b --accelerator-type v4-32 --create \
#       -- --config configs/big.py --workdir gs://BUCKET/runs/big --config.data_dir=gs://BUCKET/wmt14
#   launch/tpu_vm.sh --dry-run ...     # print the commands instead of running them
set -euo pipefail

usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  echo "options: --name NAME --zone ZONE [--project P] [--accelerator-type v4-32] [--version RUNTIME] [--create]"
  echo "         [--repo DIR] [--remote-dir DIR] [--no-install] [--dry-run] -- TRAIN_ARGS..."
  exit "${1:-2}"
}

NAME="" ZONE="" PROJECT="" ACCELERATOR="v4-8" VERSION="tpu-ubuntu2204-base" CREATE=0 DRY_RUN=0 INSTALL=1
REPO="$(cd "$(dirname "$0")/.." && pwd)"
REMOTE_DIR="flaxformer_nmt"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) NAME="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --accelerator-type) ACCELERATOR="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --create) CREATE=1; shift ;;
    --repo) REPO="$2"; shift 2 ;;
    --remote-dir) REMOTE_DIR="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "unknown option: $1" >&2; usage ;;
  esac
done
[[ -n "$NAME" && -n "$ZONE" ]] || { echo "--name and --zone are required" >&2; usage; }
[[ $# -gt 0 ]] || { echo "training arguments (after --) are required" >&2; usage; }

GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=(--project "$PROJECT")

run() {  # prints the command (shell-quoted); runs it unless --dry-run
  printf '%q ' "$@"; echo
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}

TRAIN_ARGS="$(printf '%q ' "$@")"
if [[ "$CREATE" == 1 ]]; then
  run "${GCLOUD[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type "$ACCELERATOR" --version "$VERSION"
fi
# Copy what runs into an existing ~/$REMOTE_DIR: copying the checkout's folder itself would nest it inside
# that directory on a second run, leaving the old code in place.
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command "mkdir -p ~/$REMOTE_DIR"
run "${GCLOUD[@]}" scp --recurse --worker=all "${WHERE[@]}" "$REPO/pyproject.toml" "$REPO/README.md" \
  "$REPO/flaxformer_nmt" "$REPO/configs" "$NAME:~/$REMOTE_DIR/"
if [[ "$INSTALL" == 1 ]]; then
  run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" \
    --command "cd ~/$REMOTE_DIR && python3 -m pip install -q -U 'jax[tpu]' && python3 -m pip install -q -e ."
fi
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" \
  --command "cd ~/$REMOTE_DIR && python3 -m flaxformer_nmt.train --distributed=auto $TRAIN_ARGS"
