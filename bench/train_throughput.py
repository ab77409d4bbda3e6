r"""Times the compiled train step of configs after warm-up: tokens/s, model TFLOP/s, MFU and step time; on
CPU also the achieved FLOP rate over the rate of a large matmul of the step's operand dtype (float32, or bfloat16
with matmul_precision 'bfloat16') measured in the same process.

  python bench/train_throughput.py --configs base,big,multi30k --lengths 32 --tokens_per_batch 4096
  python bench/train_throughput.py --configs big --tokens_per_batch 32768 --peak 989e12   # an H100
  python bench/train_throughput.py --configs multi30k,lm_multi30k,mlm_multi30k --lengths 64   # the three tasks
  python bench/train_throughput.py --configs multi30k_best --matmul_precision bfloat16   # bf16 operands on CPU
  python bench/train_throughput.py --configs multi30k_best --dropout_rate 0   # what the dropout masks cost
  python bench/train_throughput.py --configs multi30k_best --lengths 64 --packed_segments 4 --steps 30 \
      --prng_impl threefry2x32,rbg --alternate   # the dropout masks' keys: threefry against XLA's generator
  python bench/train_throughput.py --configs multi30k --lengths 64 --packed_segments 4 \
      --profile_dir /tmp/step_profile   # where the one-hour config's packed step goes, op by op
  python bench/train_throughput.py --configs big --lengths 64 --tokens_per_batch 65536,131072,262144 \
      --remat none,dots,full   # on a GPU: each remat policy's largest budget that fits
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python bench/train_throughput.py --configs multi30k_best \
      --lengths 64 --packed_segments 4   # the CPU as 2 devices, as config.cpu_devices=2 gives the trainer

--tokens_per_batch, --attention_impl, --remat and --prng_impl take lists: every combination is timed, one
compiled step each, in one process, one after the other. The step keeps getting faster for the first minutes of
a process, so to compare variants pass --alternate: single steps of each in turn, medians reported (first
column: the variant, attention/remat, then /prng_impl where given):

  python bench/train_throughput.py --configs multi30k --lengths 64 --packed_segments 4 --steps 30 \
      --attention_impl xla,einsum --alternate

A budget that runs out of device memory prints a row saying so and ends that config's list (the larger ones
would not fit either).

Sizing a run to a time budget on this machine: --fit_minutes M times each config's train step at its own token
budget (config.tokens_per_batch, rows of config.packed_length or --lengths tokens), one checkpoint save and one
validation (the loss over --valid_sentences, and validation BLEU's search where the config has it), and prints the
num_train_steps that fit M minutes with their evaluations and saves, the cooldown in proportion (warmup unchanged):

  python bench/train_throughput.py --configs multi30k --fit_minutes 60 --steps 20
  ...
  --config.num_train_steps=4210 --config.cooldown_steps=2105

The untrained model's searches run to their length limit, so the validation time is an upper bound; start-up
(reading the corpus, the vocabulary) is not counted.

Where a real run's time goes: --trainer_steps N runs the trainer for N steps of each config in a new workdir
and prints its wall time by phase (set-up, compiling, steps, validation, saves) against N x the step timed
alone, and the share of the run in which the device runs no train step (the trainer gets this script's
overrides of the config, --dtype, --matmul_precision, --dropout_rate, --vocab_size, --grad_accumulation_steps and
--fsdp, as --config flags; --fit_minutes prints them with its num_train_steps):

  python bench/train_throughput.py --configs multi30k --trainer_steps 1000 --steps 20

Each config trains its task's model (config.task: translation, lm, mlm). tok/s counts the tokens of one
side: translation reads as many source tokens again; the LM and the MLM read only these.

Batches are full rows of random tokens (no padding), `tokens_per_batch` per side over all devices (data
parallel). Model FLOPs are analytic (flaxformer_nmt/runtime/flops.py: 3x the forward matmuls, attention
included); the first config's compiled step is also checked against XLA's own FLOP count. MFU needs a peak:
the table in flops.py for GPUs/TPUs, or --peak (per device); on CPU it is left out.
"""
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from etils import epath

import op_profile  # bench/op_profile.py, beside this script

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.decoding import search as search_lib
from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import flops as flops_lib
from flaxformer_nmt.runtime import host_memory
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.training import step as train_step_lib

_CONFIGS = flags.DEFINE_list('configs', ['base', 'big', 'multi30k'], 'Configs (configs/NAME.py) to time.')
_LENGTHS = flags.DEFINE_list('lengths', ['32'], 'Padded lengths (per side) to time.')
_TOKENS = flags.DEFINE_list('tokens_per_batch', ['4096'], 'Tokens per side per step, over all devices; several are '
                            'timed in turn, and the first that runs out of device memory ends the list.')
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per length.')
_VOCAB = flags.DEFINE_integer('vocab_size', 0, "Vocabulary size (default: each config's).")
_DTYPE = flags.DEFINE_string('dtype', '', "Override config.model.dtype ('auto': bf16 on GPU/TPU, f32 on CPU).")
_ATTENTION = flags.DEFINE_list('attention_impl', [''], 'Override config.model.attention_impl; several are timed '
                               'in turn.')
_REMAT = flags.DEFINE_list('remat', [''], 'Override config.model.remat; several are timed in turn.')
_MATMUL = flags.DEFINE_string('matmul_precision', '', "Override config.model.matmul_precision ('bfloat16').")
_MATMUL_STEPS = flags.DEFINE_integer('matmul_steps', 20, 'Timed runs of the reference matmul on a CPU (/matmul).',
                                     lower_bound=1)
_DROPOUT = flags.DEFINE_float('dropout_rate', -1.0, "Override config.model.dropout_rate (-1: the config's).")
_PRNG = flags.DEFINE_list('prng_impl', [''], "Override config.prng_impl ('rbg': the dropout masks' keys from XLA's "
                          'RngBitGenerator instead of threefry); several are timed in turn.')
_CHUNK = flags.DEFINE_list('vocabulary_loss_chunk_tokens', [''], 'Override config.vocabulary_loss_chunk_tokens '
                           "(0: whole logits; N: the chunked vocabulary loss); several are timed in turn.")
_MEMORY = flags.DEFINE_bool('memory', False, "Print XLA's memory analysis of each compiled step (temporary and "
                            'argument bytes) instead of timing it: what a token budget needs, without running it, '
                            'for the backend of this machine.')
_ACCUMULATE = flags.DEFINE_integer('grad_accumulation_steps', 1, 'Microbatches per step.')
_FSDP = flags.DEFINE_integer('fsdp', 1, 'fsdp_parallelism of the mesh.')
_CHECK_XLA = flags.DEFINE_bool('check_xla_flops', True, "Compare XLA's FLOP count of the first compiled step with "
                                'the analytic count (compiles that step twice).')
_SEGMENTS = flags.DEFINE_integer('packed_segments', 0, 'Split every row into this many examples (segment ids and '
                                 'positions as config.packed_length batches carry), so the step runs the packed '
                                 'masks; 0: one example a row.')
_PROFILE = flags.DEFINE_string('profile_dir', '', 'Trace 3 steps of each timed case with jax.profiler into '
                               'DIR/CONFIG_LENGTH_ROWS and print its costliest XLA operations with the model code '
                               'they come from (bench/op_profile.py).')
_ALTERNATE = flags.DEFINE_bool('alternate', False, 'Compare the --attention_impl x --remat x --prng_impl variants of '
                               'each config by single steps in turn (medians), not one variant after the other.')
_PROFILE_TOP = flags.DEFINE_integer('profile_top', 25, 'Operations printed per profile.')
_PEAK = flags.DEFINE_float('peak', 0.0, 'Per-device peak FLOP/s for MFU (default: flops.py table; none on CPU).')
_FIT_MINUTES = flags.DEFINE_float('fit_minutes', 0.0, 'Instead of the table: print the num_train_steps (and a '
                                  'proportional cooldown_steps) of each config that fit this many minutes of '
                                  'training on this machine, validation and saves included.')
_TRAINER_STEPS = flags.DEFINE_integer('trainer_steps', 0, 'Instead of the table: run the trainer this many steps '
                                     'of each config and print the share of its wall time outside the train step.')
_TRAINER_FLAGS = flags.DEFINE_multi_string('trainer_flag', [], 'A flag for the trainer of --trainer_steps '
                                           '(repeatable), e.g. --config.data_dir=DIR.')
_VALID_SENTENCES = flags.DEFINE_integer('valid_sentences', 1014, 'Sentences of the validation split, for '
                                        "--fit_minutes (Multi30k's valid: 1,014).")


def xla_flops(compiled):
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis.get('flops', 0.0)) if analysis else 0.0


# By file path, so the script runs from any directory (configs/ is not a package on sys.path).
CONFIGS = epath.Path(__file__).resolve().parent.parent / 'configs'


def load_config(name, attention_impl, remat, prng_impl='', chunk=''):
  config = config_lib.load_config_file(str(CONFIGS / f'{name}.py'))
  for field, value in (('dtype', _DTYPE.value), ('attention_impl', attention_impl), ('remat', remat),
                       ('matmul_precision', _MATMUL.value)):
    if value:
      config.model[field] = value
  if _DROPOUT.value >= 0:
    config.model.dropout_rate = _DROPOUT.value
  if prng_impl:
    config.prng_impl = prng_impl
  if chunk:
    config.vocabulary_loss_chunk_tokens = int(chunk)
  config.grad_accumulation_steps = _ACCUMULATE.value
  config.fsdp_parallelism = _FSDP.value
  return config


def override_flags():
  """The trainer's --config flags for this script's overrides of a config (load_config), so that a run of the
  trainer trains the step timed here: --dtype, --matmul_precision, --vocab_size and --dropout_rate where given,
  --grad_accumulation_steps and --fsdp where not 1."""
  given = {'model.dtype': _DTYPE.value or None, 'model.matmul_precision': _MATMUL.value or None,
           'vocab_size': _VOCAB.value or None, 'model.dropout_rate': _DROPOUT.value if _DROPOUT.value >= 0 else None,
           'grad_accumulation_steps': _ACCUMULATE.value if _ACCUMULATE.value != 1 else None,
           'fsdp_parallelism': _FSDP.value if _FSDP.value != 1 else None}
  return [f'--config.{field}={value}' for field, value in given.items() if value is not None]


def out_of_memory(error):
  return 'RESOURCE_EXHAUSTED' in str(error) or 'out of memory' in str(error).lower()


def build(name, attention_impl, remat, prng_impl='', chunk=''):
  """(model, train state, compiled train step, mesh, vocabulary size, config) of a config, its line printed."""
  config = load_config(name, attention_impl, remat, prng_impl, chunk)
  vocab = _VOCAB.value or config.vocab_size
  task = lm.task_of(config)
  model_config = model_lib.ModelConfig.from_config(config, vocab, architecture=lm.ARCHITECTURES[task])
  model = lm.build(task, model_config, mask_id=4)
  mesh = sharding.mesh_from_config(config)
  state, state_sharding = train_step_lib.create_state(model, config, mesh)
  train_fn, _ = train_step_lib.jit_steps(model, config, mesh, state_sharding)
  dtype, attention = model.config.dtype, model.config.attention_impl  # as settled for this machine
  print(f'# {name} ({task}): {model_lib.count_params(state.params):,} parameters, vocab {vocab}, {dtype}, attention '
        f'{attention}, matmul {config.model.matmul_precision}, remat {config.model.remat}, keys {config.prng_impl}, '
        f'vocabulary loss chunk {config.vocabulary_loss_chunk_tokens or "-"}, mesh {dict(mesh.shape)}')
  return model, state, train_fn, mesh, vocab, config


def batch_shapes(mesh, config):
  """(rows, length) of every --tokens_per_batch x --lengths case, rows a multiple of what the mesh needs."""
  rows_multiple = sharding.rows_multiple(mesh) * config.grad_accumulation_steps
  for tokens_per_batch in [int(x) for x in _TOKENS.value]:
    for length in [int(x) for x in _LENGTHS.value]:
      yield max(tokens_per_batch // length // rows_multiple, 1) * rows_multiple, length


def reference_rate(matmul, model):
  """The rate (FLOP/s) of the large matmul (matmul: {operand dtype: rate} or None) whose operands are of the
  dtype the model's matmuls round theirs to."""
  return matmul and matmul[model_lib.vocabulary_operand_dtype(model.config)]


def print_row(label, rows, length, seconds, analytic, peak, matmul):
  achieved = analytic / seconds
  mfu = f'{achieved / (peak * jax.device_count()):7.1%}' if peak else f'{"-":>7}'
  ratio = f'{achieved / matmul:8.2f}' if matmul else f'{"-":>8}'
  print(f'{label:>9} {length:5d} {rows:5d} {seconds * 1e3:9.1f} {rows * length / seconds:10.0f} '
        f'{achieved / 1e12:8.3f} {mfu} {ratio}', flush=True)


def variant_flags():
  """Every (attention_impl, remat, prng_impl, vocabulary_loss_chunk_tokens) combination of the flags."""
  return itertools.product(_ATTENTION.value, _REMAT.value, _PRNG.value, _CHUNK.value)


def alternate_variants(name, peak, matmul):
  """Every --attention_impl x --remat x --prng_impl x --vocabulary_loss_chunk_tokens variant of one config, timed
  by single steps in turn (the order reversed every round) and reported as medians: in one process the step keeps
  getting faster for minutes, so variants timed one after the other favour the later ones (bench/RESULTS.md).
  Each variant's steps go on from its latest state, shape after shape (a step donates the state it is given)."""
  runs = []
  for a, r, p, c in variant_flags():
    model, state, train_fn, mesh, vocab, config = build(name, a, r, p, c)
    runs.append({'label': f'{a or "-"}/{r or "-"}' + (f'/{p}' if p else '') + (f'/c{c}' if c else ''),
                 'model': model, 'state': state, 'fn': train_fn, 'mesh': mesh, 'vocab': vocab, 'config': config})
  rng = np.random.default_rng(0)
  for rows, length in batch_shapes(runs[0]['mesh'], runs[0]['config']):
    for run in runs:
      run['batch'] = sharding.put_batch(synthetic_batch(rng, (rows, length), run['vocab'], _SEGMENTS.value),
                                        sharding.batch_sharded(run['mesh']))
      run['state'], _ = run['fn'](run['state'], run['batch'])  # compile + warm-up
      jax.block_until_ready(run['state'])
      run['analytic'] = flops_lib.train_flops(run['model'].config, run['vocab'], rows * length, rows * length,
                                              length, length)
      run['seconds'] = []
    for round_ in range(_STEPS.value):
      for run in (runs if round_ % 2 == 0 else runs[::-1]):
        start = time.perf_counter()
        run['state'], _ = run['fn'](run['state'], run['batch'])
        jax.block_until_ready(run['state'])
        run['seconds'].append(time.perf_counter() - start)
    for run in runs:
      print_row(run['label'], rows, length, float(np.median(run['seconds'])), run['analytic'], peak,
                reference_rate(matmul, run['model']))


def bench_config(name, variant, peak, matmul, check_xla):
  model, state, train_fn, mesh, vocab, config = build(name, *variant)
  rng = np.random.default_rng(0)
  for rows, length in batch_shapes(mesh, config):
    if _MEMORY.value:
      print_memory(name, variant, train_fn, state, rows, length, vocab, mesh)
      continue
    analytic = flops_lib.train_flops(model.config, vocab, rows * length, rows * length, length, length)
    check = analytic if check_xla else 0
    if check and config.vocabulary_loss_chunk_tokens:
      print('# XLA cost analysis: not compared (it counts the chunked vocabulary loss\'s loop body once)')
      check = 0
    try:
      state, seconds = time_steps(train_fn, state, rng, (rows, length), vocab, mesh, check,
                                  profile_dir=_PROFILE.value and os.path.join(_PROFILE.value,
                                                                               f'{name}_{length}_{rows}'),
                                  microbatches=config.grad_accumulation_steps)
    except Exception as error:  # pylint: disable=broad-except
      if not out_of_memory(error):
        raise
      # The largest budget that fits is the row above; larger ones will not fit either.
      print(f'{name:>9} {length:5d} {rows:5d} {"out of device memory":>40}', flush=True)
      return
    check_xla = False
    print_row(name, rows, length, seconds, analytic, peak, reference_rate(matmul, model))


def print_memory(name, variant, train_fn, state, rows, length, vocab, mesh):
  batch = sharding.put_batch(synthetic_batch(np.random.default_rng(0), (rows, length), vocab, _SEGMENTS.value),
                             sharding.batch_sharded(mesh))
  analysis = train_fn.lower(state, batch).compile().memory_analysis()
  label = '/'.join(v or '-' for v in variant)
  print(f'{name:>9} {length:5d} {rows:5d} {label:>16}  temporary {analysis.temp_size_in_bytes / 2**30:6.2f} GiB, '
        f'arguments {analysis.argument_size_in_bytes / 2**30:6.2f} GiB (per device)', flush=True)


def synthetic_batch(rng, shape, vocab, segments):
  """Random tokens, no padding; with `segments` > 0 each row holds that many packed examples of equal length."""
  tokens = rng.integers(4, vocab, shape, dtype=np.int32)
  batch = {'src': tokens, 'tgt_in': tokens, 'tgt_out': tokens}
  if segments:
    rows, length = shape
    ids = np.minimum(np.arange(length) * segments // length, segments - 1)  # 0, 0, .., 1, 1, .., segments - 1
    starts = np.searchsorted(ids, ids)  # where each position's example starts
    for side in ('src', 'tgt'):
      batch[f'{side}_segments'] = np.broadcast_to(ids + 1, shape).astype(np.int32)
      batch[f'{side}_positions'] = np.broadcast_to(np.arange(length) - starts, shape).astype(np.int32)
  return batch


def time_steps(train_fn, state, rng, shape, vocab, mesh, analytic, profile_dir='', microbatches=1):
  """Seconds per step of `train_fn` on a batch of `shape` (rows, length) random tokens, after a warm-up step;
  with `analytic` FLOPs, XLA's own count of the compiled step is printed against them first (its count of the
  loop over `microbatches` microbatches, whose body it counts once, times their number); with `profile_dir`,
  3 more steps are traced there and their costliest operations printed."""
  batch = sharding.put_batch(synthetic_batch(rng, shape, vocab, _SEGMENTS.value), sharding.batch_sharded(mesh))
  # One extra compile serves both the FLOP check and the profile's HLO (before the state is donated).
  compiled = train_fn.lower(state, batch).compile() if analytic or profile_dir else None
  if analytic:
    counted = xla_flops(compiled) * mesh.size * microbatches  # XLA counts the program of one device
    if counted:
      print(f'# XLA cost analysis / analytic FLOPs: {counted / analytic:.3f}')

  def run_steps(steps):
    nonlocal state
    for _ in range(steps):
      state, _ = train_fn(state, batch)
    jax.block_until_ready(state)

  run_steps(1)  # compile + warm-up
  start = time.perf_counter()
  run_steps(_STEPS.value)
  seconds = (time.perf_counter() - start) / _STEPS.value
  if profile_dir:
    op_profile.print_profile(compiled.as_text(), run_steps, steps=3,
                             directory=profile_dir, top=_PROFILE_TOP.value, step_ms=seconds * 1e3)
  return state, seconds


def seconds_of(fn, *args):
  """Wall seconds of fn(*args) until its outputs are ready, and the outputs."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, out


def validation_seconds(model, params, config, mesh, vocab, length):
  """Seconds of one validation of --valid_sentences sentences of `length` tokens: (the loss pass (eval step),
  validation BLEU's search (beam config.eval_bleu_beam_size, up to the length limit, over the first
  config.eval_bleu_max_sentences of them where that is set) where the config has it, else 0)."""
  sentences, rng = _VALID_SENTENCES.value, np.random.default_rng(1)
  _, eval_fn = train_step_lib.jit_steps(model, config, mesh)
  rows = max(config.tokens_per_batch // length // sharding.rows_multiple(mesh), 1) * sharding.rows_multiple(mesh)
  batch = sharding.put_batch(synthetic_batch(rng, (rows, length), vocab, 0), sharding.batch_sharded(mesh))
  seconds_of(eval_fn, params, batch)  # compile
  loss = seconds_of(eval_fn, params, batch)[0] * -(-sentences // rows)
  if not config.eval_bleu_every_steps or lm.task_of(config) != 'translation':
    return loss, 0.0
  sentences = min(config.eval_bleu_max_sentences or sentences, sentences)
  search = jax.jit(search_lib.search, static_argnums=0, static_argnames=('beam_size', 'extra_length'))
  rows = max(config.decode_tokens_per_batch // length, 1)
  src = jnp.asarray(rng.integers(4, vocab, (min(rows, sentences), length), dtype=np.int32))
  options = dict(beam_size=config.eval_bleu_beam_size, alpha=np.float32(config.length_penalty_alpha),
                 extra_length=config.max_decode_extra_length)
  params = jax.device_put(params, jax.devices()[0])
  seconds_of(lambda: search(model, params, src, **options))  # compile
  return loss, seconds_of(lambda: search(model, params, src, **options))[0] * -(-sentences // src.shape[0])


def save_seconds(state):
  """Seconds of one checkpoint save of `state`, written synchronously (the trainer's are asynchronous: less)."""
  with tempfile.TemporaryDirectory() as directory:
    with checkpoints_lib.Checkpoints(directory, keep=1, async_save=False) as store:
      start = time.perf_counter()
      store.save(1, state, {}, force=True)
      return time.perf_counter() - start


def steps_that_fit(config, minutes, step, first_step, loss, bleu, save):
  """The most steps whose training (`step` seconds each), evaluations (`loss` seconds every eval_every_steps,
  `bleu` every eval_bleu_every_steps) and saves (`save` every checkpoint_every_steps), plus the first step's
  `first_step` (compilation) and the final evaluation and save, fit `minutes`."""
  per_step = step + save / config.checkpoint_every_steps + loss / config.eval_every_steps
  if config.eval_bleu_every_steps:
    per_step += bleu / config.eval_bleu_every_steps
  fixed = first_step - step + loss + bleu + save
  return max(int((minutes * 60 - fixed) / per_step), 0)


def config_step(name):
  """(model, state, mesh, vocabulary size, config, the first step's seconds, a step's seconds) of config `name` at
  its own token budget (rows of config.packed_length or --lengths tokens), timed over --steps steps."""
  model, state, train_fn, mesh, vocab, config = build(name, '', '')
  length = config.packed_length or int(_LENGTHS.value[0])
  rows = max(config.tokens_per_batch // length // sharding.rows_multiple(mesh), 1) * sharding.rows_multiple(mesh)
  batch = sharding.put_batch(synthetic_batch(np.random.default_rng(0), (rows, length), vocab, _SEGMENTS.value),
                             sharding.batch_sharded(mesh))
  first_step, (state, _) = seconds_of(train_fn, state, batch)  # compiles
  start = time.perf_counter()
  for _ in range(_STEPS.value):
    state, _ = train_fn(state, batch)
  jax.block_until_ready(state)
  print(f'# {name}: {rows} x {length} tokens a step in {(time.perf_counter() - start) / _STEPS.value * 1e3:.1f} ms '
        f'(the first {first_step:.1f} s)', flush=True)
  return model, state, mesh, vocab, config, first_step, (time.perf_counter() - start) / _STEPS.value


def fit_to_minutes(name, minutes):
  """Measures config `name` on this machine and prints the num_train_steps (and the cooldown in proportion) that
  fit `minutes`, as overrides to paste."""
  model, state, mesh, vocab, config, first_step, step = config_step(name)
  length = config.packed_length or int(_LENGTHS.value[0])
  (loss, bleu), save = validation_seconds(model, state.params, config, mesh, vocab, length), save_seconds(state)
  steps = steps_that_fit(config, minutes, step, first_step, loss, bleu, save)
  cooldown = round(config.cooldown_steps * steps / config.num_train_steps)
  print(f'# {name}: validation loss {loss:.1f} s every {config.eval_every_steps} steps, BLEU {bleu:.1f} s every '
        f'{config.eval_bleu_every_steps or "-"}, a save {save:.2f} s every {config.checkpoint_every_steps}: '
        f'{steps} steps fit {minutes:g} minutes (configured: {config.num_train_steps}, cooldown '
        f'{config.cooldown_steps}, warmup {config.warmup_steps})')
  if steps < config.warmup_steps:
    print(f'# {steps} steps do not reach the end of the {config.warmup_steps}-step warmup: a shorter warmup or '
          'more minutes')
  print(' '.join([f'--config.num_train_steps={steps}', f'--config.cooldown_steps={cooldown}', *override_flags()]),
        flush=True)
  return steps, cooldown


def trainer_share(name, steps):
  """Runs the trainer (python -m flaxformer_nmt.train) for `steps` steps of config `name` in a new workdir and
  prints its wall time by phase (metrics.jsonl's wall/...) against the steps it ran x the step timed alone here:
  the share of the run in which the device runs no train step. A --trainer_flag may stop it sooner
  (--config.max_train_minutes); its last validation BLEU is printed too."""
  step = config_step(name)[-1]
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, '-m', 'flaxformer_nmt.train', f'--config={CONFIGS / (name + ".py")}',
               f'--workdir={workdir}', f'--config.num_train_steps={steps}', f'--config.cooldown_steps={steps // 2}',
               '--config.max_train_minutes=0', *override_flags(), *_TRAINER_FLAGS.value]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    total = time.perf_counter() - start
    if result.returncode:
      raise RuntimeError(f'the trainer failed ({result.returncode}):\n{result.stderr[-3000:]}')
    records = [json.loads(line) for line in (epath.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]
  phases = next(r for r in reversed(records) if 'wall/total' in r)
  ran = phases['step']
  intervals = [r['train/step_time'] for r in records if 'train/step_time' in r]
  print(f'# the trainer, {ran} of {steps} steps of {name}: {total:.1f} s from launch to exit; by phase (up to '
        'finishing): ' + ', '.join(f'{k[5:]} {v:.1f} s' for k, v in phases.items() if k.startswith('wall/')))
  print('# its log:', *re.findall(r'Wall time .*', result.stderr)[-1:])
  bleu = [r for r in records if 'eval/tok_bleu' in r]
  if bleu:
    print(f'# its last validation BLEU, step {bleu[-1]["step"]}: {bleu[-1]["eval/tok_bleu"]:.2f} lc-tok '
          f'(sacreBLEU {bleu[-1]["eval/bleu"]:.2f}), {bleu[-1]["eval/bleu_sentences"]} sentences')
  outside = total - phases['wall/steps']
  print(f'# the steps phase: {phases["wall/steps"] / ran * 1e3:.1f} ms a step (the logged intervals\' median '
        f'{np.median(intervals) * 1e3:.1f} ms; the step alone here: {step * 1e3:.1f} ms)')
  print(f'outside the steps (launch to exit, less the steps phase): {outside:.1f} s, {outside / total:.1%} of the run; '
        f'1 - steps x step alone / launch to exit: {1 - ran * step / total:.1%}', flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  host_memory.keep_freed_memory()  # as the trainer does, before the first computation
  if _FIT_MINUTES.value > 0 or _TRAINER_STEPS.value:  # the devices the trainer runs the first config on
    sharding.split_host_cpu(load_config(_CONFIGS.value[0], '', '').cpu_devices)
    checkpoints_lib.quiet_orbax_logs()
  backend = jax.default_backend()
  peak = flops_lib.peak_flops_per_device(override=_PEAK.value)
  matmul = ({jnp.dtype(d): flops_lib.matmul_rate(d, _MATMUL_STEPS.value) for d in (jnp.float32, jnp.bfloat16)}
            if backend == 'cpu' else None)
  print(f'# backend {backend}, {jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}, '
        f'peak {peak / 1e12 if peak else "-"} TFLOP/s per device, {",".join(_TOKENS.value)} tokens per side per step')
  if matmul:
    print(f'# float32 4096x1024x1024 matmul: {matmul[jnp.dtype(jnp.float32)] / 1e9:.1f} GFLOP/s; with bfloat16 '
          f'operands (float32 accumulation and result): {matmul[jnp.dtype(jnp.bfloat16)] / 1e9:.1f} GFLOP/s; '
          '/matmul: against the one of the step\'s operand dtype')
  print(f'# {"config":>7} {"len":>5} {"rows":>5} {"step ms":>9} {"tok/s":>10} {"TFLOP/s":>8} {"MFU":>7} '
        f'{"/matmul":>8}')
  if _FIT_MINUTES.value > 0:
    for name in _CONFIGS.value:
      fit_to_minutes(name, _FIT_MINUTES.value)
    return
  if _TRAINER_STEPS.value:
    for name in _CONFIGS.value:
      trainer_share(name, _TRAINER_STEPS.value)
    return
  first = _CHECK_XLA.value
  for name in _CONFIGS.value:
    if _ALTERNATE.value:
      alternate_variants(name, peak, matmul)
      continue
    for variant in variant_flags():
      bench_config(name, variant, peak, matmul, check_xla=first)
      first = False


if __name__ == '__main__':
  app.run(main)
