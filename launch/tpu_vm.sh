#!/usr/bin/env bash
# Trains on every worker of a Cloud TPU VM slice: (optionally) creates the TPU VM, copies this repository to
# every worker and installs it there without TensorFlow, into a Python 3.12 virtual environment made by uv
# (.venv in --remote-dir, ~/flaxformer_nmt; the runtime image's python3, 3.10, is older than the package
# needs; --no-install reuses an earlier run's); with --tfds-data-dir, worker 0 alone installs the [tfds] extra
# (TensorFlow) and prepares the config's TFDS builder once into that gs:// directory; then the same training
# command (the same config, --config.tfds_data_dir included) starts on all workers, which read the prepared
# data. Each worker runs one process; flaxformer_nmt.distributed finds the others through the TPU metadata
# server. Keep --workdir and the data on gs://. Ctrl-C stops the installation, preparation or training on every
# worker: each runs in a terminal of its own (ssh -tt), which sshd hangs up when gcloud's ssh ends.
#
#   launch/tpu_vm.sh --name nmt --zone us-central2-b --accelerator-type v4-32 --create \
#       --tfds-data-dir gs://BUCKET/tensorflow_datasets \
#       -- --config configs/wmt14_ende_big.py --workdir gs://BUCKET/runs/big
#   launch/tpu_vm.sh --dry-run ...     # print every command instead of running it
set -euo pipefail

usage() {
  sed -n '2,/^set /s/^# \{0,1\}//p' "$0"  # the comment above
  echo "options: --name NAME --zone ZONE [--project P] [--accelerator-type v4-8] [--version RUNTIME] [--create]"
  echo "         [--tfds-data-dir gs://DIR] [--repo DIR] [--remote-dir DIR_IN_HOME] [--no-install] [--dry-run]"
  echo "         -- TRAIN_ARGS..."
  exit "${1:-2}"
}

NAME="" ZONE="" PROJECT="" ACCELERATOR="v4-8" VERSION="tpu-ubuntu2204-base" CREATE=0 DRY_RUN=0 INSTALL=1
TFDS_DATA_DIR=""
REPO="$(cd "$(dirname "$0")/.." && pwd)"
REMOTE_DIR="flaxformer_nmt"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --create|--no-install|--dry-run|-h|--help|--) ;;
    --*) [[ $# -ge 2 ]] || { echo "$1 needs a value" >&2; usage; } ;;
  esac
  case "$1" in
    --name) NAME="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --accelerator-type) ACCELERATOR="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --create) CREATE=1; shift ;;
    --tfds-data-dir) TFDS_DATA_DIR="$2"; shift 2 ;;
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
if [[ -n "$TFDS_DATA_DIR" && "$TFDS_DATA_DIR" != gs://* ]]; then
  echo "--tfds-data-dir must be a gs:// directory that every worker reads, not $TFDS_DATA_DIR" >&2; exit 2
fi
# A path in ~ that no shell or scp reads differently (scp's legacy and SFTP modes take quoting differently).
if [[ ! "$REMOTE_DIR" =~ ^[A-Za-z0-9._-][A-Za-z0-9._/-]*$ ]]; then
  echo "--remote-dir must be a relative path (in ~) of letters, digits and ._/- only, not $REMOTE_DIR" >&2; exit 2
fi
# shellcheck source=launch/common.sh
. "$(dirname "$0")/common.sh"

# Every worker, and the preparation, get the same config: the user's arguments plus the shared TFDS directory.
ARGS=("$@")
[[ -n "$TFDS_DATA_DIR" ]] && ARGS+=("--config.tfds_data_dir=$TFDS_DATA_DIR")
mapfile -t CONFIG_ARGS < <(config_args "${ARGS[@]}")

GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=(--project "$PROJECT")

run() {  # prints the command (shell-quoted); runs it unless --dry-run
  quote "$@"; echo
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}
# on_workers all|0 REMOTE_COMMAND, in a remote terminal (-tt): sshd hangs it up when gcloud's ssh ends (Ctrl-C),
# which stops the command (SIGHUP) that would otherwise go on running. gcloud's input is /dev/null, so that ssh
# leaves the local terminal alone.
on_workers() {
  run "${GCLOUD[@]}" ssh "$NAME" "--worker=$1" "${WHERE[@]}" --ssh-flag=-tt --command "$2" < /dev/null
}

if [[ "$CREATE" == 1 ]]; then
  run "${GCLOUD[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type "$ACCELERATOR" --version "$VERSION"
fi
# Copy what runs into an existing ~/$REMOTE_DIR: copying the checkout's folder itself would nest it inside
# that directory on a second run, leaving the old code in place.
# The first command keeps the local terminal as gcloud's input: gcloud may ask there for a new SSH key's passphrase.
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command "mkdir -p ~/$REMOTE_DIR"
run "${GCLOUD[@]}" scp --recurse --worker=all "${WHERE[@]}" "$REPO/pyproject.toml" "$REPO/README.md" \
  "$REPO/flaxformer_nmt" "$REPO/configs" "$NAME:~/$REMOTE_DIR/"
# uv (installed with the image's python3) fetches Python 3.12 where the image has none; the commands below run
# in ~/$REMOTE_DIR and use the environment's interpreter.
UV="python3 -m uv"
UV_INSTALL="$UV pip install -q --python .venv/bin/python"
if [[ "$INSTALL" == 1 ]]; then
  # The lean install: training reads prepared array_record data without TensorFlow.
  on_workers all "cd ~/$REMOTE_DIR && python3 -m pip install -q --user -U uv \
&& $UV venv -q --allow-existing --python 3.12 .venv && $UV_INSTALL -U 'jax[tpu]' -e ."
fi
if [[ -n "$TFDS_DATA_DIR" ]]; then
  # Once, before any training process starts: the download and conversion need TensorFlow (worker 0 only).
  TFDS_INSTALL=""
  [[ "$INSTALL" == 1 ]] && TFDS_INSTALL="$UV_INSTALL -e '.[tfds]' && "
  on_workers 0 "cd ~/$REMOTE_DIR && ${TFDS_INSTALL}.venv/bin/python -m flaxformer_nmt.corpora prepare \
$(quote "${CONFIG_ARGS[@]}")"
fi
on_workers all \
  "cd ~/$REMOTE_DIR && .venv/bin/python -m flaxformer_nmt.train --distributed=auto $(quote "${ARGS[@]}")"
