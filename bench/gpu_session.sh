#!/usr/bin/env bash
# GPU measurements in stages, each bounded by its own time limit, for a GPU machine that is reachable for a few
# minutes and has no network access. Each stage writes $OUT/<stage>.log (absl's INFO/WARNING lines only there).
# Each line below fits one device call of at most 10 minutes: its stages' time limits add up to 9 or less.
#
#   bash bench/gpu_session.sh env decode                      # decoding speed and compile times (3 minutes)
#   bash bench/gpu_session.sh env training                    # training speed: MFU, the Multi30k recipe (9 minutes)
#   bash bench/gpu_session.sh env tests throughput            # stack, cuDNN tests, train-step MFU (7 minutes)
#   bash bench/gpu_session.sh memory                          # remat, the largest budgets (7.5 minutes)
#   bash bench/gpu_session.sh multi30k                        # configs/multi30k.py trained on the GPU (9 minutes)
#   bash bench/gpu_session.sh dispatch                        # one step a call against 10 (7 minutes)
#   bash bench/gpu_session.sh diagnose profile                # attention errors; where the big step's time goes
#   SUITE_SECONDS=540 bash bench/gpu_session.sh env suite     # the whole test suite on the GPU
#   SMOKE=1 bash bench/gpu_session.sh env throughput decode multi30k   # every stage shrunk, on a CPU, beforehand
#
# Stages:
#   env         the GPU, driver and the Python stack that will run
#   tests       tests/test_model.py on the GPU: the cuDNN flash-attention cases (the attention call against a
#               float64 reference, values and gradients; the bf16 model against float32) run only there
#   suite       the whole test suite (or SUITE_FILES) on the GPU, SUITE_WORKERS (8) pytest-xdist workers, bounded
#               by SUITE_SECONDS (540)
#   diagnose    each attention path's error against a float32 reference (bench/gpu_attention_check.py), and
#               the padding test with float32 matmuls at full precision
#   throughput  Transformer base and big train steps in bf16 (dtype 'auto'): tokens/s and MFU; cuDNN
#               against XLA attention
#   memory      big: remat none/dots/full, the largest token budget that fits, the chunked vocabulary loss
#   decode      sentences/s, the config's beam and greedy, of the Multi30k model in gpu_carry/m30k
#               (bench/decode_throughput.py) on test2016 and, where carried, newstest2013
#   dispatch    the recipe's first DISPATCH_STEPS (1,000) steps through the trainer, one step a call and then
#               10 (config.steps_per_dispatch), validation BLEU off (the multi30k stage has it): the steps
#               phase and the time outside the steps, by phase
#   multi30k    configs/multi30k.py trained on the GPU for MULTI30K_MINUTES (2.5; the training's limit is 330 s),
#               MULTI30K_DISPATCH (10) steps a call, then test2016 BLEU, and the carried model decoded in bf16 and
#               float32
#   training    within 9 minutes: base and big train steps at 16,384 and 65,536 tokens (tokens/s, MFU), then the
#               Multi30k recipe through the trainer (its 6,500 steps or TRAINING_MINUTES (3) of them, 10 steps a
#               call, its validation and saves): wall time by phase, the share outside the steps, validation BLEU
#   profile     the big step traced (bench/op_profile.py): time per part of the model and the costliest ops
#
# What travels with the working tree (the machine has no network), made beforehand by
# `bash bench/gpu_carry.sh runs/m30k` (git-ignored; the device call names both in carry):
#   gpu_carry/m30k   a trained Multi30k workdir, slimmed: config.json, vocab.model and averaged/
#   gpu_carry/data   the corpus and its tokenized references; optionally a newstest2013.en for the decode stage
#                    (a missing input is skipped)
#   .whl             wheels for the GPU machine's Python of the dependencies its image lacks or has outside the
#                    ranges of pyproject.toml: setup() installs only those
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ "${SMOKE:-0}" = 1 ]; then
  TT_SIZES=(--steps 2 --configs multi30k_tiny --lengths 16 --tokens_per_batch 256,512)
  DECODE_SIZES=(--max_sentences 40)
  TRAIN_SIZES=(--config.num_train_steps=30 --config.cooldown_steps=20 --config.warmup_steps=10
               --config.eval_bleu_every_steps=30 --config.eval_bleu_max_sentences=40
               --config.checkpoint_every_steps=30)
  DISPATCH_STEPS=${DISPATCH_STEPS:-40}
  TRAINING_STEPS=${TRAINING_STEPS:-40}
  TRAINING_SIZES=(--trainer_flag=--config.eval_bleu_max_sentences=40 --trainer_flag=--config.checkpoint_every_steps=20
                  --trainer_flag=--config.warmup_steps=10)
  PROFILE_SIZES=("${TT_SIZES[@]}")
else
  TT_SIZES=(--steps 20)
  PROFILE_SIZES=(--steps 10)
  DECODE_SIZES=(--max_sentences 1000)
  TRAIN_SIZES=(--config.max_train_minutes=${MULTI30K_MINUTES:-2.5})
  TRAINING_SIZES=()
fi

setup() {
  # The dependencies of pyproject.toml that this Python lacks or has outside their pinned ranges, and the carried
  # wheels' own dependencies it lacks (sacremoses imports joblib and tqdm): those get the carried wheels; the
  # image's own packages are used where they fit the pins.
  local need
  need=$($PY - <<'EOF'
import importlib.metadata as md, os, tomllib
from packaging.requirements import Requirement
with open('pyproject.toml', 'rb') as f:
  dependencies = tomllib.load(f)['project']['dependencies']
need = set()
for requirement in map(Requirement, dependencies):
  try:
    if requirement.specifier.contains(md.version(requirement.name), prereleases=True):
      continue
  except md.PackageNotFoundError:
    pass
  need.add(requirement.name.lower().replace('-', '_'))
for wheel in os.listdir('.whl') if os.path.isdir('.whl') else []:
  try:
    md.version(wheel.split('-')[0])
  except md.PackageNotFoundError:
    need.add(wheel.split('-')[0].lower())
print('\n'.join(sorted(need)))
EOF
) || { echo "# setup: could not read pyproject.toml's dependencies (above)"; exit 1; }
  local wheels=()
  for name in $need; do
    local found=($(ls .whl/ 2>/dev/null | grep -i "^${name}-" | sed 's|^|.whl/|'))
    [ ${#found[@]} -gt 0 ] || echo "# not carried, left out: $name"
    wheels+=("${found[@]}")
  done
  if [ ${#wheels[@]} -gt 0 ]; then
    echo "# installing carried wheels: ${wheels[*]}"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${wheels[@]}" || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
}

# Runs a command of a stage and keeps the largest exit status so far in the stage's $worst: a stage of several
# commands returns its worst one's, not the last one's.
run() {
  "$@"
  local status=$?
  [ $status -gt $worst ] && worst=$status
  return 0
}

stage_env() {
  local worst=0
  run nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  run $PY -c "
import importlib.metadata as md, jax
print('jax', jax.__version__, jax.devices(), jax.default_backend())
print({n: md.version(n) for n in ('jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'ml-collections', 'sentencepiece',
                                  'sacrebleu', 'tensorstore', 'numpy')})
import flaxformer_nmt; print('flaxformer_nmt imports from', flaxformer_nmt.__file__)"
  return $worst
}

stage_tests() {
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_model.py -rs
}

stage_suite() {
  # The test suite on the GPU (SUITE_FILES: a part of it), pytest-xdist workers sharing the GPU's memory. -v names
  # each test as it ends, so a run cut by the time limit still says which passed and failed
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SUITE_SECONDS:-540}" $PY -m pytest -v -p no:cacheprovider \
    -n "${SUITE_WORKERS:-8}" -rfs --durations=20 ${SUITE_FILES:-tests}
}

stage_diagnose() {
  # Each attention path's error against a float32 'highest' reference, and the padding test under full
  # float32 matmuls (a GPU's default runs float32 matmuls as TF32)
  local worst=0
  run timeout 150 $PY bench/gpu_attention_check.py
  run env JAX_DEFAULT_MATMUL_PRECISION=highest timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_model.py \
    -k no_position_sees_padding
  return $worst
}

stage_throughput() {
  local tt="$PY bench/train_throughput.py" worst=0
  # base and big at two lengths, dtype and attention 'auto' (bf16, cuDNN flash attention on a GPU)
  run timeout 200 $tt --configs base,big --lengths 32,64 --tokens_per_batch 16384 "${TT_SIZES[@]}"
  # XLA's attention on the same big step
  run timeout 100 $tt --nocheck_xla_flops --configs big --lengths 64 --tokens_per_batch 16384 --attention_impl xla \
    "${TT_SIZES[@]}"
  return $worst
}

stage_memory() {
  local tt="$PY bench/train_throughput.py --nocheck_xla_flops" worst=0
  # remat policies at a larger budget, then the largest budget that fits without remat, then with 'dots'
  run timeout 150 $tt --configs big --lengths 64 --tokens_per_batch 32768 --remat none,dots,full "${TT_SIZES[@]}"
  run timeout 150 $tt --configs big --lengths 64 --tokens_per_batch 65536,131072,262144 --remat none,dots \
    "${TT_SIZES[@]}"
  # The chunked vocabulary loss (no [tokens, 37k] logits nor their gradient) at the budgets that do not fit without it
  run timeout 150 $tt --configs big --lengths 64 --tokens_per_batch 131072,262144 --remat none \
    --vocabulary_loss_chunk_tokens 8192 "${TT_SIZES[@]}"
  return $worst
}

stage_decode() {
  timeout 180 $PY bench/decode_throughput.py --workdir gpu_carry/m30k --checkpoint averaged \
    --inputs gpu_carry/data/multi30k/test2016.en,gpu_carry/data/newstest2013.en --repeats 2 "${DECODE_SIZES[@]}"
}

stage_dispatch() {
  local steps=${DISPATCH_STEPS:-1000} worst=0
  for many in 1 10; do
    run timeout 200 $PY bench/train_throughput.py --configs multi30k --trainer_steps $steps --steps 20 \
      --trainer_flag=--config.data_dir=gpu_carry/data/multi30k \
      --trainer_flag=--config.eval_bleu_tok_ref_dir=gpu_carry/data/multi30k_tok \
      --trainer_flag=--config.steps_per_dispatch=$many --trainer_flag=--config.eval_bleu_every_steps=0 \
      --trainer_flag=--config.best_checkpoint_metric=
  done
  return $worst
}

stage_multi30k() {
  # A new workdir each time: a rerun on a warm machine would resume the last one, its minutes already trained
  local workdir worst=0
  workdir=$(mktemp -d /tmp/m30k_gpu.XXXXXX)
  local start=$SECONDS
  run timeout 330 $PY -m flaxformer_nmt.train --config configs/multi30k.py --workdir $workdir \
    --config.data_dir=gpu_carry/data/multi30k --config.eval_bleu_tok_ref_dir=gpu_carry/data/multi30k_tok \
    --config.steps_per_dispatch=${MULTI30K_DISPATCH:-10} "${TRAIN_SIZES[@]}"
  echo "# training wall time: $((SECONDS - start)) s"
  grep -h '"eval/tok_bleu"' $workdir/metrics.jsonl | tail -5
  run timeout 90 $PY -m flaxformer_nmt.compare --workdir $workdir --checkpoints latest --split test2016
  # bf16 against float32 decoding of the same CPU-trained weights (the numerics of decode's dtype 'auto')
  for dtype in bfloat16 float32; do
    run timeout 60 $PY -m flaxformer_nmt.decode --workdir gpu_carry/m30k --checkpoint averaged --dtype $dtype \
      --input gpu_carry/data/multi30k/test2016.en --reference gpu_carry/data/multi30k/test2016.de \
      --tok_reference gpu_carry/data/multi30k_tok/test2016.de --output "$OUT/test2016.$dtype.de"
  done
  return $worst
}

stage_training() {
  local tt="$PY bench/train_throughput.py" worst=0
  run timeout 200 $tt --nocheck_xla_flops --configs base,big --lengths 64 --tokens_per_batch 16384,65536 \
    "${TT_SIZES[@]}"
  # The recipe as a user runs it, a time guard keeping the stage within its 9 minutes
  run timeout 300 $tt --configs multi30k --trainer_steps ${TRAINING_STEPS:-6500} --steps 20 \
    --trainer_flag=--config.data_dir=gpu_carry/data/multi30k \
    --trainer_flag=--config.eval_bleu_tok_ref_dir=gpu_carry/data/multi30k_tok \
    --trainer_flag=--config.steps_per_dispatch=10 --trainer_flag=--config.max_train_minutes=${TRAINING_MINUTES:-3} \
    "${TRAINING_SIZES[@]}"
  return $worst
}

stage_profile() {
  # Where the big step's time goes, op by op (bench/op_profile.py): the share MFU does not account for
  timeout 150 $PY bench/train_throughput.py --nocheck_xla_flops --configs big --lengths 64 --tokens_per_batch 16384 \
    --profile_dir /tmp/big_profile --profile_top 30 "${PROFILE_SIZES[@]}"
}

setup
for stage in "$@"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  # The stage's own status, not grep's (1 where it filtered every line) nor tee's
  "stage_$stage" 2>&1 | tee "$OUT/$stage.log" | grep --line-buffered -v -E '^(W|I)[0-9]{4} '
  status=${PIPESTATUS[0]}
  echo "=== $stage exit $status ($(date -u +%H:%M:%S))"
done
