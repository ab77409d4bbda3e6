r"""Trains a Transformer: `python -m flaxformer_nmt.train --config configs/multi30k.py --workdir runs/m30k`.

Fields of the config are overridden with `--config.field=value` (e.g. `--config.num_train_steps=500`). The
workdir receives the vocabulary (vocab.model), the config (config.json), checkpoints, TensorBoard event files
(tensorboard/) and the logged metrics (metrics.jsonl). Rerunning the same command resumes from the newest
checkpoint.
"""
import functools
import json
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging
from etils import epath
from ml_collections import config_flags

from flaxformer_nmt import checkpoints as checkpoints_lib
from flaxformer_nmt import data as data_lib
from flaxformer_nmt import model as model_lib
from flaxformer_nmt import sharding
from flaxformer_nmt import tokenizer as tokenizer_lib
from flaxformer_nmt import train_step as train_step_lib

CONFIG_FILENAME = 'config.json'

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py).', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for the vocabulary, checkpoints and logs.')


class ConfigError(ValueError):
  """A config that cannot be trained, or that does not match the workdir."""


# Fields that change the model: a workdir trained with other values cannot be resumed or decoded with these.
_MODEL_FIELDS = ('model', 'vocab_size', 'sentencepiece_model_type', 'source_lang', 'target_lang')


def save_or_check_config(config, workdir):
  """Writes config.json on the first run; later runs must describe the same model."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  current = json.loads(config.to_json_best_effort())
  if path.exists():
    saved = json.loads(path.read_text())
    for field in _MODEL_FIELDS:
      if saved.get(field) != current.get(field):
        raise ConfigError(f'{path} holds a different model: config.{field} was {saved.get(field)!r}, '
                          f'now {current.get(field)!r}. Use a new --workdir or the original config.')
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2, sort_keys=True))


def load_config(workdir):
  """The ConfigDict a workdir was trained with."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  path = epath.Path(workdir) / CONFIG_FILENAME
  if not path.exists():
    raise ConfigError(f'{path} not found: is {workdir} a training workdir?')
  return ml_collections.ConfigDict(json.loads(path.read_text()))


def build_model(config, tokenizer):
  return model_lib.Transformer(model_lib.ModelConfig.from_config(config, tokenizer.vocab_size))


class MetricsLog:
  """Console lines, TensorBoard scalars and metrics.jsonl, written by process 0 only."""

  def __init__(self, workdir):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self.writer = SummaryWriter(str(epath.Path(workdir) / 'tensorboard'))
      self.jsonl = (epath.Path(workdir) / 'metrics.jsonl').open('a')

  def write(self, step, scalars):
    if not self.enabled:
      return
    for name, value in scalars.items():
      self.writer.add_scalar(name, value, step)
    self.jsonl.write(json.dumps({'step': step, **scalars}) + '\n')
    self.jsonl.flush()

  def close(self):
    if self.enabled:
      self.writer.close()
      self.jsonl.close()


class _QuietLibraries:
  """absl log filter: orbax and tensorstore report every save at INFO; keep their warnings only."""

  def filter(self, record):
    return record.levelno >= 30 or '/orbax/' not in record.pathname


def quiet_library_logs():
  logging.get_absl_handler().addFilter(_QuietLibraries())


def _duration(seconds):
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else f'{seconds // 60}m{seconds % 60:02d}s'


def evaluate(eval_fn, params, batches, batch_sharding):
  sums = None
  for batch in batches:
    metrics = eval_fn(params, sharding.put_batch(batch, batch_sharding))
    sums = metrics if sums is None else jax.tree_util.tree_map(lambda a, b: a + b, sums, metrics)
  sums = jax.device_get(sums)
  nll = float(sums['nll_sum'] / sums['target_tokens'])
  return {'eval/loss': float(sums['loss_sum'] / sums['target_tokens']), 'eval/nll': nll,
          'eval/perplexity': float(np.exp(nll))}


def train_and_evaluate(config, workdir):
  """Runs training to config.num_train_steps (or max_train_minutes); returns the last logged metrics."""
  start_time = time.time()
  if not config.data_dir:
    raise ConfigError('config.data_dir is empty: pass --config.data_dir=DIR holding {split}.{lang} files')
  workdir = epath.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  save_or_check_config(config, workdir)

  # Data -> vocabulary -> token ids.
  train_src, train_tgt = data_lib.read_parallel(config.data_dir, config.train_split, config.source_lang,
                                                config.target_lang)
  eval_src, eval_tgt = data_lib.read_parallel(config.data_dir, config.eval_split, config.source_lang,
                                              config.target_lang)
  tokenizer = tokenizer_lib.load_or_train(
      workdir, lambda: train_src + train_tgt, vocab_size=config.vocab_size,
      model_type=config.sentencepiece_model_type, character_coverage=config.sentencepiece_character_coverage,
      max_sentences=config.sentencepiece_max_sentences, seed=config.seed)
  train_corpus = data_lib.tokenize_parallel(train_src, train_tgt, tokenizer, config.max_length)
  eval_corpus = data_lib.tokenize_parallel(eval_src, eval_tgt, tokenizer)
  logging.info('Training pairs: %d of %d kept (at most %d tokens a side); validation pairs: %d',
               len(train_corpus), len(train_src), config.max_length, len(eval_corpus))

  mesh = sharding.make_mesh()
  batch_sharding = sharding.batch_sharded(mesh)
  num_devices = mesh.devices.size
  train_batches = data_lib.TrainBatches(train_corpus, tokens_per_batch=config.tokens_per_batch,
                                        buckets=config.length_buckets, seed=config.seed, multiple_of=num_devices)
  eval_batches = functools.partial(data_lib.eval_batches, eval_corpus, tokens_per_batch=config.tokens_per_batch,
                                   buckets=config.length_buckets, multiple_of=num_devices)

  # Model, optimizer, state (fresh or restored).
  model = build_model(config, tokenizer)
  optimizer, schedule = train_step_lib.make_optimizer(config)
  init = jax.jit(functools.partial(train_step_lib.init_state, model, optimizer, config.seed),
                 out_shardings=sharding.replicated(mesh))
  state = init()
  logging.info('Model: %s parameters, %s', f'{model_lib.count_params(state.params):,}', model.config)
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=config.keep_checkpoints)
  if checkpoints.latest_step() is not None:
    state, data_state = checkpoints.restore(checkpoints_lib.abstract_like(state))
    train_batches.restore(data_state)
  train_fn, eval_fn = train_step_lib.jit_steps(model, optimizer, schedule, config, mesh)

  log = MetricsLog(workdir)
  step = int(state.step)
  first_step = step
  logging.info('Starting at step %d of %d; %d batches per epoch', step, config.num_train_steps,
               train_batches.batches_per_epoch())
  pending, last = [], {}
  interval_start = time.time()
  time_limit = config.max_train_minutes * 60 if config.max_train_minutes > 0 else float('inf')
  while step < config.num_train_steps:
    batch = sharding.put_batch(next(train_batches), batch_sharding)
    state, metrics = train_fn(state, batch)
    pending.append(metrics)  # device arrays: reading them waits for the step, so only at log time
    step += 1
    out_of_time = time.time() - start_time >= time_limit
    done = step >= config.num_train_steps or out_of_time

    if step % config.log_every_steps == 0 or done:
      sums = jax.device_get(jax.tree_util.tree_map(lambda *xs: sum(xs), *pending))
      elapsed = time.time() - interval_start
      steps_left = config.num_train_steps - step
      eta = min(steps_left * elapsed / len(pending), max(time_limit - (time.time() - start_time), 0))
      last = {
          'train/loss': float(sums['loss_sum'] / sums['target_tokens']),
          'train/nll': float(sums['nll_sum'] / sums['target_tokens']),
          'train/learning_rate': float(jax.device_get(pending[-1]['learning_rate'])),
          'train/grad_norm': float(jax.device_get(pending[-1]['grad_norm'])),
          'train/target_tokens_per_second': float(sums['target_tokens'] / elapsed),
          'train/source_tokens_per_second': float(sums['source_tokens'] / elapsed),
          'train/step_time': elapsed / len(pending),
          'elapsed_seconds': time.time() - start_time,
          'epoch': train_batches.epoch,
      }
      logging.info('step %d/%d | loss %.4f | nll %.4f | lr %.3g | %.0f tgt tok/s | epoch %d | %s elapsed | ETA %s',
                   step, config.num_train_steps, last['train/loss'], last['train/nll'],
                   last['train/learning_rate'], last['train/target_tokens_per_second'], train_batches.epoch,
                   _duration(last['elapsed_seconds']), _duration(eta))
      log.write(step, last)
      pending = []
      interval_start = time.time()

    if step % config.eval_every_steps == 0 or done:
      eval_metrics = evaluate(eval_fn, state.params, eval_batches(), batch_sharding)
      eval_metrics['elapsed_seconds'] = time.time() - start_time
      logging.info('step %d | validation loss %.4f | nll %.4f | perplexity %.2f', step, eval_metrics['eval/loss'],
                   eval_metrics['eval/nll'], eval_metrics['eval/perplexity'])
      log.write(step, eval_metrics)
      last.update(eval_metrics)
      interval_start = time.time()  # keep evaluation out of the tokens/s of the next interval

    if step % config.checkpoint_every_steps == 0 or done:
      checkpoints.save(step, state, train_batches.state(), force=True)
    if out_of_time:
      logging.info('Stopping after %s (config.max_train_minutes)', _duration(time.time() - start_time))
      break

  checkpoints.wait()
  checkpoints.close()
  log.close()
  logging.info('Trained steps %d..%d in %s', first_step, step, _duration(time.time() - start_time))
  return last


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _WORKDIR.value is None:
    raise app.UsageError('--workdir is required')
  quiet_library_logs()
  try:
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (data_lib.DataError, ConfigError, tokenizer_lib.TokenizerError) as e:
    logging.error('%s', e)
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
