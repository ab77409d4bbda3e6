r"""Many short training runs of one config at once, each with its own overrides, and the validation numbers
each run logged at its last step: a screen of recipe choices on one accelerator (a Multi30k model leaves an
H100 idle most of a step, so a dozen runs share it), or a few at a time on a CPU.

  python bench/sweep.py --config configs/multi30k.py:float32 --root /tmp/sweep --parallel 12 \
      --common='--config.num_train_steps=1900 --config.eval_bleu_every_steps=100000 --config.eval_bleu_beam_size=4' \
      --variant='base:' --variant='dropout_0.1: --config.model.dropout_rate=0.1' --seeds=0,1
  python bench/sweep.py --flagfile=bench/sweeps/hour_float32.flags --root /tmp/sweep

Each variant x seed trains in {root}/{variant}.s{seed} (log beside it) with the config, the --common overrides,
then the variant's own, then --config.seed. Validation BLEU comes from the trainer's own evaluation at the last
step (bleu_eval.py; give the beam size and an eval_bleu_every_steps past the end in --common, so that it runs
once), so every run is scored by the same code as a real run. Prints a Markdown table (also {root}/sweep.md and
sweep.json): steps done, validation NLL, cased sacreBLEU, lowercased tokenized BLEU, length ratio, wall time.
Validation only: choices are made on it.

Runs that would learn the same vocabulary share one: before any run starts, each distinct vocabulary is learnt
and the corpus tokenized once (pipeline.vocabulary_and_tokens, in --prepared/<key>/), then copied into the
workdirs it serves, where the trainer finds and reuses it. Sixteen runs each learning a 12k vocabulary on one
GPU machine's 16 host cores spent most of a 6.4-minute screen starting (bench/RESULTS.md, the third GPU lease).
--prepare_only builds --prepared and stops: a machine lent for minutes can be handed it ready. --check_only
resolves every run's config and checks it as the trainer does (an unknown field, a refused combination), in
seconds: tests/test_sweep.py runs it on every screen in bench/sweeps.
"""
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = flags.DEFINE_string('config', 'configs/multi30k.py', 'The config every run starts from.')
_ROOT = flags.DEFINE_string('root', '/tmp/sweep', 'One workdir per run under it.')
_COMMON = flags.DEFINE_string('common', '', 'Overrides (trainer flags) given to every run.')
_EXTRA = flags.DEFINE_string('extra', '', 'More overrides for every run, after --common: what a flagfile '
                             'cannot know, such as where this machine keeps the data.')
_VARIANTS = flags.DEFINE_multi_string('variant', [], "'name: --config.x=1 --config.y=2' (nothing after ':' = "
                                      "the config and --common alone; '@other' = an earlier variant's overrides).")
_SEEDS = flags.DEFINE_list('seeds', ['0'], 'config.seed of each variant\'s runs.')
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'Runs at once.')
_TIMEOUT = flags.DEFINE_float('timeout_s', 0.0, 'Stop the runs still going after this many seconds (0: none) '
                              'and report the rest.')
_OUT = flags.DEFINE_string('out', '', 'Also copy sweep.md and sweep.json into this folder.')
_SHARE = flags.DEFINE_bool('share_vocabulary', True, 'Learn each distinct vocabulary once and copy it into the '
                           'runs that use it (--noshare_vocabulary: each run learns its own).')
_PREPARED = flags.DEFINE_string('prepared', '', 'Where the shared vocabularies and token ids are kept, one folder '
                                'per vocabulary ("": {root}/prepared).')
_PREPARE_ONLY = flags.DEFINE_bool('prepare_only', False, 'Prepare the shared vocabularies in --prepared and stop.')
_CHECK_ONLY = flags.DEFINE_bool('check_only', False, 'Resolve each run\'s config and check it as the trainer does '
                                'before any work, list the runs, and stop: seconds on any machine, before a lease.')

# Config fields that shape only the model, training, evaluation and saving, never the vocabulary or the token
# ids that pipeline.vocabulary_and_tokens writes: runs that differ in nothing else share one preparation. The
# list errs one way only: a field missing here costs an extra preparation, never a wrong vocabulary.
_NOT_VOCABULARY = re.compile(
    r'(model|adam_.*|learning_rate.*|warmup_steps|cooldown_steps|num_train_steps|label_smoothing|rdrop_alpha|'
    r'weight_decay|grad_.*|skip_nonfinite_updates|tokens_per_batch|packed_length|packing_open_rows|length_buckets|'
    r'batch_rows_multiple|allow_batching_change|prefetch_batches|bpe_dropout|bidirectional_epochs|max_length|'
    r'max_train_minutes|fit_schedule_to_time|ensemble_members|.*_parallelism|eval_every_steps|eval_bleu_.*|'
    r'log_every_steps|checkpoint_every_.*|keep_checkpoints|average_last_checkpoints|best_checkpoint_metric|'
    r'decode_.*|beam_size|length_penalty_alpha|max_decode_extra_length|profile_.*|peak_flops_per_device)')


def parse_variant(text):
  """'name: overrides' -> (name, [override, ...])."""
  name, sep, overrides = text.partition(':')
  if not sep or not name.strip():
    raise app.UsageError(f"--variant={text!r}: write 'name: --config.field=value ...'")
  return name.strip(), shlex.split(overrides)


def parse_variants(texts):
  """[(name, [override, ...])] of --variant texts, where '@other' stands for the overrides of a variant given
  before it: 'tiny_dropout_0.2: @tiny --config.model.dropout_rate=0.2' is tiny's overrides, then its own (the
  later one wins)."""
  variants = {}
  for text in texts:
    name, overrides = parse_variant(text)
    if name in variants:
      raise app.UsageError(f'--variant names repeat: {name!r}')
    resolved = []
    for override in overrides:
      if override.startswith('@'):
        if override[1:] not in variants:
          raise app.UsageError(f'--variant={text!r}: {override} names no variant given before it '
                               f'({sorted(variants) or "none"})')
        resolved += variants[override[1:]]
      else:
        resolved.append(override)
    variants[name] = resolved
  return list(variants.items())


def last_metrics(workdir):
  """The last value of each key in {workdir}/metrics.jsonl, with the step it was logged at."""
  path = os.path.join(workdir, 'metrics.jsonl')
  last = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        last.update(json.loads(line))
  return last


def summary_row(name, seed, workdir, status, seconds):
  m = last_metrics(workdir)
  number = lambda key, fmt: format(m[key], fmt) if key in m else '-'
  return {'variant': name, 'seed': seed, 'status': status, 'steps': m.get('step', 0),
          'valid_nll': number('eval/nll', '.3f'), 'sacrebleu': number('eval/bleu', '.2f'),
          'lc_tok': number('eval/tok_bleu', '.2f'), 'length_ratio': number('eval/bleu_length_ratio', '.3f'),
          'train_nll': number('train/nll', '.3f'), 'minutes': f'{seconds / 60:.1f}'}


def resolved_config(overrides):
  """The config a run's trainer will see: --config with the run's --config.* overrides applied."""
  argv = ['sweep', '--config', _CONFIG.value, *[o for o in overrides if o.startswith('--config.')]]
  values = flags.FlagValues()
  # sys_argv: the config file is read when the flag is defined, so that its fields' override flags exist
  config_flags.DEFINE_config_file('config', None, flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def vocabulary_key(config):
  """A name for what the run's vocabulary and token ids depend on (config.seed only where sentencepiece learns
  from a seeded sample)."""
  fields = {k: v for k, v in config.to_dict().items() if not _NOT_VOCABULARY.fullmatch(k)}
  if not config.sentencepiece_max_chars:
    del fields['seed']
  return f'v{config.vocab_size}-' + hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()
                                                  ).hexdigest()[:10]


def prepare_vocabularies(runs, prepared):
  """Learns each distinct vocabulary of `runs` once in prepared/<key>/ (kept there for later sweeps) and copies
  it, with the token ids, into the runs' workdirs that have none yet."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')  # this process only tokenizes: leave the accelerator to the runs
  from flaxformer_nmt import pipeline  # pylint: disable=g-import-not-at-top
  done = set()
  for _, _, command, workdir in runs:
    config = resolved_config(command)
    if config.init_from:  # the trainer adopts the source run's vocabulary (warm_start.py)
      continue
    folder = os.path.join(prepared, vocabulary_key(config))
    if folder not in done:
      began = time.time()
      pipeline.vocabulary_and_tokens(config, folder)
      print(f'vocabulary {folder}: ready in {time.time() - began:.0f} s', flush=True)
      done.add(folder)
    if _PREPARE_ONLY.value or os.path.exists(os.path.join(workdir, 'vocab.model')):
      continue
    os.makedirs(workdir, exist_ok=True)
    shutil.copy(os.path.join(folder, 'vocab.model'), workdir)
    shutil.copytree(os.path.join(folder, 'tokenized'), os.path.join(workdir, 'tokenized'), dirs_exist_ok=True)


def check_runs(runs):
  """Each run's config, resolved from its overrides and checked by the trainer's own checks (train.check_config);
  the first that fails stops the screen with its run named, before anything is prepared or started."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')  # nothing runs: leave any accelerator alone
  from flaxformer_nmt import train  # pylint: disable=g-import-not-at-top
  for name, seed, command, _ in runs:
    try:
      train.check_config(resolved_config(command))
    except Exception as error:  # pylint: disable=broad-except  (an unknown field, a bad value: named with its run)
      message = error.args[0] if len(error.args) == 1 else error
      sys.exit(f'run {name}.s{seed}: {type(error).__name__}: {message}')
    print(f'{name}.s{seed}: ok', flush=True)


def run_all(runs):
  """Runs (name, seed, command, workdir) _PARALLEL at a time; returns their summary rows."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE='false')  # a dozen processes share one GPU's memory
  # One persistent compilation cache for all the runs: a second seed of a variant, variants that differ only in
  # their schedule's numbers (train_step.schedule_numbers: an input of the compiled step), and the validation
  # decoding of variants with the same model load the programs an earlier run compiled instead of compiling again.
  env.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(_ROOT.value, 'jax_compilation'))
  env.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  waiting, running, rows = list(runs), {}, []
  start = time.time()
  while waiting or running:
    while waiting and len(running) < _PARALLEL.value:
      name, seed, command, workdir = waiting.pop(0)
      log = open(workdir + '.log', 'w')
      running[subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)] = (
          name, seed, workdir, time.time(), log)
    time.sleep(2)
    out_of_time = _TIMEOUT.value and time.time() - start > _TIMEOUT.value
    for process, (name, seed, workdir, began, log) in list(running.items()):
      if process.poll() is None and not out_of_time:
        continue
      killed = process.poll() is None
      if killed:
        process.kill()
        process.wait()
      status = 'timeout' if killed else 'ok' if process.returncode == 0 else f'exit {process.returncode}'
      log.close()
      rows.append(summary_row(name, seed, workdir, status, time.time() - began))
      print(' '.join(f'{k}={v}' for k, v in rows[-1].items()), flush=True)
      if status != 'ok':  # the error, not only that there was one
        with open(workdir + '.log') as f:
          print(''.join(f.readlines()[-4:]), end='', flush=True)
      del running[process]
    if out_of_time:
      rows += [summary_row(name, seed, workdir, 'not started', 0) for name, seed, _, workdir in waiting]
      waiting = []
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not _VARIANTS.value:
    raise app.UsageError('give at least one --variant')
  variants = parse_variants(_VARIANTS.value)
  os.makedirs(_ROOT.value, exist_ok=True)
  runs = []
  for seed in _SEEDS.value:  # every variant's first seed first: a sweep cut short still covers them all
    for name, overrides in variants:
      workdir = os.path.join(_ROOT.value, f'{name}.s{seed}')
      runs.append((name, seed, [sys.executable, '-m', 'flaxformer_nmt.train', '--config', _CONFIG.value,
                                '--workdir', workdir, *shlex.split(_COMMON.value),
                                *shlex.split(_EXTRA.value), *overrides,
                                f'--config.seed={seed}'], workdir))
  if _CHECK_ONLY.value:
    check_runs(runs)
    return
  if _SHARE.value or _PREPARE_ONLY.value:
    prepare_vocabularies(runs, _PREPARED.value or os.path.join(_ROOT.value, 'prepared'))
  if _PREPARE_ONLY.value:
    return
  rows = run_all(runs)
  order = {name: i for i, (name, _) in enumerate(variants)}
  rows.sort(key=lambda r: (order[r['variant']], r['seed']))
  keys = list(rows[0])
  table = ['| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
  table += ['| ' + ' | '.join(str(r[k]) for k in keys) + ' |' for r in rows]
  header = [f'config {_CONFIG.value}; common {_COMMON.value or "-"} {_EXTRA.value}', '']
  header += [f'- {name}: {" ".join(o) or "-"}' for name, o in variants] + ['']
  text = '\n'.join(header + table) + '\n'
  print(text)
  for folder in filter(None, (_ROOT.value, _OUT.value)):
    with open(os.path.join(folder, 'sweep.md'), 'w') as f:
      f.write(text)
    with open(os.path.join(folder, 'sweep.json'), 'w') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  app.run(main)
