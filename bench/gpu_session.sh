#!/usr/bin/env bash
# The GPU measurements of issue #15 (item 4), as stages that fit one short lease of a lent GPU machine.
#
#   bash bench/gpu_session.sh env tests throughput decode     # the first lease's first call (447 s on an H100)
#   bash bench/gpu_session.sh diagnose multi30k               # its second call
#   bash bench/gpu_session.sh env tests throughput memory     # the second lease (cut at 585 s, in memory)
#   bash bench/gpu_session.sh decode                          # still owed: newstest (bench/RESULTS.md, GPU sections)
#   bash bench/gpu_session.sh env sweep profile               # the third lease (2026-11-27)
#   SWEEP_PARALLEL=12 bash bench/gpu_session.sh env sweep     # the fourth (2026-11-27): NLL came back, no BLEU
#   SWEEP_SECONDS=500 bash bench/gpu_session.sh sweep         # the fifth (2026-11-27, evening): greedy BLEU of seed 0
#                                                             # in 505 s; seeds 1-3 by hand, 1.5 min each (cache warm)
#   SWEEP_FLAGS=bench/sweeps/hour_casing.flags SWEEP_PARALLEL=9 SWEEP_SECONDS=510 bash bench/gpu_session.sh env sweep
#   bash bench/gpu_session.sh score                            # the sixth (2026-11-27, night): the sweep's greedy BLEU
#                                                             # was cut while compiling; score took 46 s (beam 4)
#   SWEEP_SECONDS=420 SCORE_SECONDS=100 bash bench/gpu_session.sh env recipe
#                                                             # the seventh (H200, 2026-11-29): the recipe and R-Drop,
#                                                             # two seeds each, 6.9 min; the scoring, cut beside a test
#                                                             # run, took 59 s alone (SCORE_SECONDS=230 ... score)
#   RECIPE_SCREENS="seeds short" SWEEP_SECONDS=420 SCORE_SECONDS=150 bash bench/gpu_session.sh env recipe
#                                                             # next: the warmup of a slow CPU's 6,500 fitted steps
#   SUITE_SECONDS=540 bash bench/gpu_session.sh env suite     # and the whole test suite (owed)
#
# Stages:
#   env         the GPU, driver and the Python stack that will run
#   tests       tests/test_model.py on the GPU: the cuDNN flash-attention cases (the attention call against a
#               float64 reference, values and gradients; the bf16 model against float32) run only there
#   suite       the whole test suite (or SUITE_FILES) on the GPU, SUITE_WORKERS (8) pytest-xdist workers, bounded
#               by SUITE_SECONDS (540): still owed there (bench/RESULTS.md, the seventh lease)
#   diagnose    each attention path's error against a float32 reference (bench/gpu_attention_check.py), and
#               the padding test with float32 matmuls at full precision
#   throughput  transformer base and big train steps in bf16 (dtype 'auto'): tokens/s and MFU; cuDNN
#               against XLA attention
#   memory      big: remat none/dots/full, and the largest token budget that fits
#   decode      sentences/s and target tokens/s, beam 4 and greedy, of the Multi30k model of gpu_carry/m30k
#               on Multi30k test2016 and newstest2013 (bench/decode_throughput.py)
#   multi30k    configs/multi30k.py:bfloat16 trained on the GPU (the wall time of its steps), then test2016 BLEU
#   sweep       16 short Multi30k runs, SWEEP_PARALLEL (8) at a time (bench/sweep.py, bench/sweeps/
#               hour_float32.flags): recipe choices for issue 14 scored on valid; SWEEP_SECONDS (420) bounds it.
#               16 at a time (the third lease) spent 5 of 6.4 minutes starting, 16 processes on 16 host cores;
#               12 at a time (the fourth) 4 of 6 minutes compiling, and the last step's beam search did not end
#               8 at a time, greedy (the fifth): 7.4 min for the first wave, 1.5 min for each later one (a
#               variant's other seeds load its programs from the runs' shared compilation cache)
#   score       beam-4 valid BLEU of every sweep run's last checkpoint in /tmp/sweep (flaxformer_nmt.compare),
#               all at once on the warm machine: for a sweep whose own greedy BLEU the time limit cut (a cold
#               screen's BLEU compiles for minutes); 46 s for nine runs in the sixth lease
#   recipe      issue 14 item 3's recipe on valid: its seeds (bench/sweeps/recipe_seeds.flags) and levers not yet
#               measured on it (recipe_levers.flags), trained side by side, then each run scored with the recipe's
#               decode (beam 5, alpha 1.5, its last 10 checkpoints averaged) by the score stage's code;
#               SWEEP_SECONDS (450) bounds the training
#   profile     the big step traced (bench/op_profile.py): time per part of the model and the costliest ops
#
# What must travel with the working tree (the lent machine reaches no network and has no ../shared), made
# here before the lease and named in the call's carry (gpu_carry and .whl are git-ignored):
#   gpu_carry/m30k   a trained Multi30k workdir, slimmed: config.json, vocab.model and averaged/ (27 MB)
#                      mkdir -p gpu_carry/m30k gpu_carry/data; cp runs/W/{config.json,vocab.model} gpu_carry/m30k
#                      cp -r runs/W/averaged gpu_carry/m30k
#   gpu_carry/data   cp -r ../shared/data/{multi30k,multi30k_tok} ../shared/data/wmt_ende/newstest2013.en gpu_carry/data
#   gpu_carry/sweep_prepared   the sweep's vocabularies (seconds here; learnt on the GPU machine if absent):
#                      python bench/sweep.py --flagfile=bench/sweeps/hour_float32.flags --prepare_only \
#                        --prepared gpu_carry/sweep_prepared --extra='--config.data_dir=gpu_carry/data/multi30k'
#   gpu_carry/recipe_prepared  the recipe screens' one vocabulary, likewise (the recipe stage's --extra):
#                      python bench/sweep.py --flagfile=bench/sweeps/recipe_seeds.flags --prepare_only \
#                        --prepared gpu_carry/recipe_prepared --extra='--config.data_dir=gpu_carry/data/multi30k
#                        --config.eval_bleu_tok_ref_dir=gpu_carry/data/multi30k_tok --config.model.dtype=float32'
#   .whl             Python 3.12 wheels (pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl)
#                    of ml-collections, sacremoses, tensorboardX, importlib_resources, orbax-checkpoint, flax
#                    and optax: setup() installs those whose pyproject.toml range the image's version misses
# Logs go to $OUT/<stage>.log (absl's INFO/WARNING lines there only); each stage has its own time limit, so
# one that hangs leaves the others. SMOKE=1 shrinks every stage, to check the script on a CPU before a lease.
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
else
  TT_SIZES=(--steps 20)
  DECODE_SIZES=(--max_sentences 1000)
  TRAIN_SIZES=(--config.max_train_minutes=2.5)
fi

setup() {
  # The dependencies of pyproject.toml that this Python lacks or has outside their pinned ranges: those get
  # the carried wheels; the image's own packages are used where they fit the pins.
  local need
  need=$($PY - <<'EOF'
import importlib.metadata as md, tomllib
from packaging.requirements import Requirement
with open('pyproject.toml', 'rb') as f:
  dependencies = tomllib.load(f)['project']['dependencies']
for requirement in map(Requirement, dependencies):
  try:
    if requirement.specifier.contains(md.version(requirement.name), prereleases=True):
      continue
  except md.PackageNotFoundError:
    pass
  print(requirement.name.lower().replace('-', '_'))
EOF
)
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

stage_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  $PY -c "
import importlib.metadata as md, jax
print('jax', jax.__version__, jax.devices(), jax.default_backend())
print({n: md.version(n) for n in ('jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'ml-collections', 'sentencepiece',
                                  'sacrebleu', 'tensorstore', 'numpy')})
import flaxformer_nmt.model as m; print('model imports from', m.__file__)"
}

stage_tests() {
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_model.py -rs
}

stage_suite() {
  # The test suite on the GPU (SUITE_FILES: a part of it), pytest-xdist workers sharing the GPU's memory. -v names
  # each test as it ends, so a run cut by the call's limit still says which passed and failed (2026-11-29, an
  # H200: test_train_step, test_against_numpy and test_beam_search, 51 tests, took 91 s with 8 workers)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SUITE_SECONDS:-540}" $PY -m pytest -v -p no:cacheprovider \
    -n "${SUITE_WORKERS:-8}" -rfs --durations=20 ${SUITE_FILES:-tests}
}

stage_diagnose() {
  # Each attention path's error against a float32 'highest' reference, and the padding test under full
  # float32 matmuls (a GPU's default runs float32 matmuls as TF32)
  timeout 150 $PY bench/gpu_attention_check.py
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_model.py \
    -k no_position_sees_padding
}

stage_throughput() {
  local tt="$PY bench/train_throughput.py"
  # base and big at two lengths, dtype and attention 'auto' (bf16, cuDNN flash attention on a GPU)
  timeout 200 $tt --configs base,big --lengths 32,64 --tokens_per_batch 16384 "${TT_SIZES[@]}"
  # XLA's attention on the same big step
  timeout 100 $tt --nocheck_xla_flops --configs big --lengths 64 --tokens_per_batch 16384 --attention_impl xla \
    "${TT_SIZES[@]}"
}

stage_memory() {
  local tt="$PY bench/train_throughput.py --nocheck_xla_flops"
  # remat policies at a larger budget, then the largest budget that fits without remat, then with 'dots'
  timeout 150 $tt --configs big --lengths 64 --tokens_per_batch 32768 --remat none,dots,full "${TT_SIZES[@]}"
  timeout 150 $tt --configs big --lengths 64 --tokens_per_batch 65536,131072,262144 --remat none,dots \
    "${TT_SIZES[@]}"
  # The chunked vocabulary loss (no [tokens, 37k] logits nor their gradient): 131,072 tokens ran out of memory
  # without it on an H100 (2026-11-26); the CPU's compile of base at 16,384 tokens needs 31% less with 1,024-token
  # chunks (bench/RESULTS.md, 2026-11-29)
  timeout 150 $tt --configs big --lengths 64 --tokens_per_batch 131072,262144 --remat none \
    --vocabulary_loss_chunk_tokens 8192 "${TT_SIZES[@]}"
}

stage_decode() {
  timeout 180 $PY bench/decode_throughput.py --workdir gpu_carry/m30k --checkpoint averaged --variants ours \
    --inputs gpu_carry/data/multi30k/test2016.en,gpu_carry/data/newstest2013.en --repeats 2 "${DECODE_SIZES[@]}"
}

stage_multi30k() {
  local workdir=/tmp/m30k_gpu
  local start=$SECONDS
  # :bfloat16, the variant of the earlier GPU rows, whatever the host CPU's instructions (configs/multi30k.py)
  timeout 240 $PY -m flaxformer_nmt.train --config configs/multi30k.py:bfloat16 --workdir $workdir \
    --config.data_dir=gpu_carry/data/multi30k --config.eval_bleu_tok_ref_dir=gpu_carry/data/multi30k_tok \
    "${TRAIN_SIZES[@]}"
  echo "# training wall time: $((SECONDS - start)) s"
  grep -h '"eval/tok_bleu"' $workdir/metrics.jsonl | tail -5
  timeout 90 $PY -m flaxformer_nmt.compare --workdir $workdir --checkpoints latest --split test2016
  # bf16 against float32 decoding of the same CPU-trained weights (the numerics of decode's dtype 'auto')
  for dtype in bfloat16 float32; do
    timeout 60 $PY -m flaxformer_nmt.decode --workdir gpu_carry/m30k --checkpoint averaged --dtype $dtype \
      --input gpu_carry/data/multi30k/test2016.en --reference gpu_carry/data/multi30k/test2016.de \
      --output "$OUT/test2016.$dtype.de"
  done
}

stage_sweep() {
  # Recipe choices for configs/multi30k.py's float32 hour, runs sharing the GPU (bench/sweeps/*.flags)
  local seconds=${SWEEP_SECONDS:-420}
  # float32 activations and matmuls as on the CPU the recipe is for; the vocabularies prepared before the lease
  # (bench/sweep.py --prepare_only --prepared gpu_carry/sweep_prepared, same --extra) where carried
  # SWEEP_FLAGS: another screen (bench/sweeps/*.flags); SWEEP_SEEDS: other seeds than the flags' (a later call on
  # the warm machine runs more seeds of the same variants in 1.5 minutes a wave: the cache in /tmp/sweep stays)
  timeout $((seconds + 30)) $PY bench/sweep.py --flagfile="${SWEEP_FLAGS:-bench/sweeps/hour_float32.flags}" \
    ${SWEEP_SEEDS:+--seeds="$SWEEP_SEEDS"} --root /tmp/sweep \
    --extra='--config.data_dir=gpu_carry/data/multi30k --config.eval_bleu_tok_ref_dir=gpu_carry/data/multi30k_tok
             --config.model.dtype=float32' --prepared gpu_carry/sweep_prepared \
    --out "$OUT" --parallel "${SWEEP_PARALLEL:-8}" --timeout_s "$seconds"
  # where each run's minutes went: the start of its log and its end, one archive (a lease returns 8 files at most)
  mkdir -p /tmp/sweep_logs
  for log in /tmp/sweep/*.log; do
    { head -n 60 "$log"; echo ...; tail -n 40 "$log"; } > "/tmp/sweep_logs/$(basename "$log")"
  done
  tar -czf "$OUT/sweep_logs.tar.gz" -C /tmp sweep_logs
}

stage_score() {
  # One process per run, sharing the GPU: JAX must not take 75% of its memory in each (8 of 9 failed to start so).
  # SCORE_CHECKPOINTS: what compare decodes of each run (latest; the recipe stage: last:10, as the screens keep
  # no trainer's average)
  local w out checkpoints=${SCORE_CHECKPOINTS:-latest}
  for w in ${SCORE_RUNS:-/tmp/sweep/*.s[0-9]*}; do
    [ -d "$w/checkpoints" ] || continue
    out="/tmp/score.$(basename "$w").txt"
    (XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SCORE_SECONDS:-200} $PY -m flaxformer_nmt.compare --workdir "$w" \
       --checkpoints "$checkpoints" > "$out" 2>&1
     echo "$(basename "$w") $(grep -F "| $checkpoints" "$out" || tail -n 3 "$out")") &
  done
  wait
}

stage_recipe() {
  # The screens at once (RECIPE_SCREENS: bench/sweeps/recipe_NAME.flags, 'seeds levers' unless given; 8 runs at most
  # share the GPU; sweep.py gives each run its share of GPU memory), from one vocabulary learnt before the lease
  # (gpu_carry/recipe_prepared; learnt here first if it was not carried)
  local seconds=${SWEEP_SECONDS:-450} screen
  local extra='--config.data_dir=gpu_carry/data/multi30k --config.eval_bleu_tok_ref_dir=gpu_carry/data/multi30k_tok
               --config.model.dtype=float32'
  [ "${SMOKE:-0}" = 1 ] && extra+=' --config.num_train_steps=20 --config.warmup_steps=10 --config.cooldown_steps=10
                                    --config.checkpoint_every_steps=2'
  # A refused config stops here, in seconds, not after the others have trained
  for screen in ${RECIPE_SCREENS:-seeds levers}; do
    $PY bench/sweep.py --flagfile=bench/sweeps/recipe_$screen.flags --extra="$extra" --check_only || return 1
  done
  $PY bench/sweep.py --flagfile=bench/sweeps/recipe_seeds.flags --extra="$extra" --prepared gpu_carry/recipe_prepared \
    --prepare_only
  for screen in ${RECIPE_SCREENS:-seeds levers}; do
    mkdir -p "$OUT/$screen"
    timeout $((seconds + 30)) $PY bench/sweep.py --flagfile=bench/sweeps/recipe_$screen.flags --extra="$extra" \
      --prepared gpu_carry/recipe_prepared --root /tmp/recipe_$screen --out "$OUT/$screen" --parallel 8 \
      --timeout_s "$seconds" > /tmp/recipe_$screen.txt 2>&1 &
  done
  wait
  for screen in ${RECIPE_SCREENS:-seeds levers}; do cat /tmp/recipe_$screen.txt; done
  SCORE_RUNS='/tmp/recipe_*/*.s[0-9]*' SCORE_SECONDS=${SCORE_SECONDS:-110} SCORE_CHECKPOINTS=last:10 stage_score
}

stage_profile() {
  # Where the big step's time goes, op by op (bench/op_profile.py): the share MFU does not account for
  timeout 150 $PY bench/train_throughput.py --nocheck_xla_flops --configs big --lengths 64 --tokens_per_batch 16384 \
    --steps 10 --profile_dir /tmp/big_profile --profile_top 30
}

setup
for stage in "$@"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  "stage_$stage" 2>&1 | tee "$OUT/$stage.log" | grep --line-buffered -v -E '^(W|I)[0-9]{4} '
  echo "=== $stage exit $? ($(date -u +%H:%M:%S))"
done
