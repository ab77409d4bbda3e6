r"""Trains a Transformer: `python -m flaxformer_nmt.train --config configs/multi30k.py --workdir runs/m30k`.

Fields of the config are overridden with `--config.field=value` (e.g. `--config.num_train_steps=500`). The
workdir receives the vocabulary (vocab.model), the config (config.json), checkpoints, TensorBoard event files
(tensorboard/) and the logged metrics (metrics.jsonl). Rerunning the same command resumes from the newest
checkpoint.
"""
import functools
import json
import signal
import sys
import threading
import time

import jax
import numpy as np
from absl import app, flags, logging
from etils import epath
from jax.experimental import multihost_utils
from ml_collections import config_flags

from flaxformer_nmt import checkpoints as checkpoints_lib
from flaxformer_nmt import cli
from flaxformer_nmt import corpora
from flaxformer_nmt import data as data_lib
from flaxformer_nmt import distributed
from flaxformer_nmt import flops as flops_lib
from flaxformer_nmt import model as model_lib
from flaxformer_nmt import sharding
from flaxformer_nmt import tokenizer as tokenizer_lib
from flaxformer_nmt.workdir import ConfigError, build_model, save_or_check_config
from flaxformer_nmt import train_step as train_step_lib

class MetricsLog:
  """TensorBoard scalars and metrics.jsonl, written by process 0 only.

  Cloud storage (gs://...) has no append: there metrics.jsonl is rewritten whole at each write (a few
  thousand lines over a long run); local files are appended to.
  """

  def __init__(self, workdir):
    self.enabled = distributed.is_leader()
    if self.enabled:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self.writer = SummaryWriter(str(epath.Path(workdir) / 'tensorboard'))
      self.path = epath.Path(workdir) / 'metrics.jsonl'
      self.remote = '://' in str(self.path)
      if self.remote:
        self.lines = self.path.read_text().splitlines(keepends=True) if self.path.exists() else []
      else:
        self.jsonl = self.path.open('a')

  def write(self, step, scalars):
    if not self.enabled:
      return
    for name, value in scalars.items():
      self.writer.add_scalar(name, value, step)
    line = json.dumps({'step': step, **scalars}) + '\n'
    if self.remote:
      self.lines.append(line)
      self.path.write_text(''.join(self.lines))
    else:
      self.jsonl.write(line)
      self.jsonl.flush()

  def close(self):
    if self.enabled:
      self.writer.close()
      if not self.remote:
        self.jsonl.close()


def _duration(seconds):
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else f'{seconds // 60}m{seconds % 60:02d}s'


def input_pipeline(config, workdir, num_devices):
  """Corpus -> vocabulary -> cached token ids -> (train batches, eval batches factory, tokenizer).

  Every host plans the same global batches and builds its own rows of them (data.py).
  """
  if config.data_source == 'tfds':
    # Process 0 downloads and prepares; the others find it prepared (shared storage) or prepare their own.
    if distributed.is_leader():
      corpora.prepare_tfds(config.tfds_name, config.tfds_data_dir)
    distributed.barrier('prepare-tfds')
    corpora.prepare_tfds(config.tfds_name, config.tfds_data_dir)
  train_pairs = corpora.open_split(config, config.train_split)
  eval_pairs = corpora.open_split(config, config.eval_split)
  tokenizer = tokenizer_lib.load_or_train(
      workdir, lambda: tokenizer_lib.sample_sentences(train_pairs, config.sentencepiece_max_chars, config.seed),
      vocab_size=config.vocab_size, model_type=config.sentencepiece_model_type,
      character_coverage=config.sentencepiece_character_coverage, is_leader=distributed.is_leader(),
      barrier=distributed.barrier)
  hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
  tokenize = functools.partial(data_lib.tokenize_cached, tokenizer=tokenizer, barrier=distributed.barrier,
                               num_threads=config.tokenize_threads, **hosts)
  train_corpus = tokenize(train_pairs, cache_dir=epath.Path(workdir) / 'tokenized' / config.train_split)
  eval_corpus = tokenize(eval_pairs, cache_dir=epath.Path(workdir) / 'tokenized' / config.eval_split)
  max_length = min(config.max_length, config.packed_length) if config.packed_length else config.max_length
  train_examples = train_corpus.usable(max_length)
  logging.info('Training pairs: %d of %d kept (at most %d tokens a side) from %s; validation pairs: %d',
               len(train_examples), len(train_corpus), max_length, train_pairs.description,
               len(eval_corpus.usable()))
  train_batches = data_lib.TrainBatches(
      train_corpus, examples=train_examples, tokens_per_batch=config.tokens_per_batch,
      buckets=config.length_buckets, seed=config.seed, multiple_of=num_devices, prefetch=config.prefetch_batches,
      packed_length=config.packed_length, **hosts)
  eval_batches = functools.partial(data_lib.eval_batches, eval_corpus, tokens_per_batch=config.tokens_per_batch,
                                   buckets=config.length_buckets, multiple_of=num_devices, **hosts)
  return train_batches, eval_batches, tokenizer


def evaluate(eval_fn, params, batches, batch_sharding):
  sums = None
  for batch in batches:
    metrics = eval_fn(params, sharding.put_batch(batch, batch_sharding))
    sums = metrics if sums is None else jax.tree_util.tree_map(lambda a, b: a + b, sums, metrics)
  sums = jax.device_get(sums)
  nll = float(sums['nll_sum'] / sums['target_tokens'])
  return {'eval/loss': float(sums['loss_sum'] / sums['target_tokens']), 'eval/nll': nll,
          'eval/perplexity': float(np.exp(nll))}


def validate_config(config):
  if config.data_source == 'text' and not config.data_dir:
    raise ConfigError('config.data_dir is empty: pass --config.data_dir=DIR holding {split}.{lang} files')
  if config.data_source == 'tfds' and not config.tfds_name:
    raise ConfigError("config.tfds_name is empty: name a TFDS builder, e.g. 'wmt14_translate/de-en'")
  if config.data_source not in ('text', 'tfds'):
    raise ConfigError(f"config.data_source={config.data_source!r}: use 'text' or 'tfds'")
  if config.average_last_checkpoints > config.keep_checkpoints > 0:
    raise ConfigError(f'config.average_last_checkpoints={config.average_last_checkpoints} needs '
                      f'config.keep_checkpoints >= it (now {config.keep_checkpoints})')
  for field in ('max_length', 'packed_length'):
    if config[field] > config.model.max_position:
      raise ConfigError(f'config.{field}={config[field]} exceeds config.model.max_position='
                        f'{config.model.max_position}: positions past it would all share its encoding. Lower '
                        f'{field} or raise model.max_position (a new model).')
  for field in ('tokens_per_batch', 'log_every_steps', 'eval_every_steps', 'checkpoint_every_steps',
                'grad_accumulation_steps'):
    if config[field] <= 0:
      raise ConfigError(f'config.{field} must be positive, not {config[field]}')


class StopSignal:
  """SIGTERM/SIGINT (a preemption notice, Ctrl-C) ask the loop to save after the current step and exit 0."""

  def __init__(self):
    self.received = None
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    logging.warning('Received %s: finishing this step, saving a checkpoint, then exiting.', self.received)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)


class NonFiniteError(RuntimeError):
  """A NaN/Inf loss or gradient, with config.skip_nonfinite_updates off."""


class Throughput:
  """Model FLOPs of the logged steps, from each step's token counts and padded lengths (flops.py), as
  FLOP/s and MFU against the devices' peak (omitted where the peak is unknown, e.g. CPU)."""

  def __init__(self, model_config, vocab_size, num_devices, peak_per_device):
    self.model_config, self.vocab_size = model_config, vocab_size
    self.num_devices, self.peak_per_device = num_devices, peak_per_device

  def metrics(self, pending, lengths, seconds):
    """pending: the steps' metrics on the host; lengths: their (source, target) padded lengths."""
    total = sum(flops_lib.train_flops(self.model_config, self.vocab_size, float(m['source_tokens']),
                                      float(m['target_tokens']), src_len, tgt_len)
                for m, (src_len, tgt_len) in zip(pending, lengths))
    out = {'train/tflops_per_second': total / seconds / 1e12,
           'train/tflops_per_second_per_device': total / seconds / 1e12 / self.num_devices}
    if self.peak_per_device:
      out['train/mfu'] = total / seconds / (self.peak_per_device * self.num_devices)
    return out


class Profiler:
  """Traces steps [start, start + steps) with jax.profiler into {workdir}/profile, on process 0."""

  def __init__(self, workdir, start, steps):
    self.directory = str(epath.Path(workdir) / 'profile')
    self.start, self.stop = start, start + steps
    self.enabled = steps > 0 and distributed.is_leader()
    self.active = False

  def before_step(self, step):
    if self.enabled and step == self.start and not self.active:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after_step(self, step, state):
    """`step`: the number of steps done. The trace ends once the traced steps have run on the device."""
    if self.active and step >= self.stop:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False
      logging.info('Profiled steps %d..%d into %s', self.start, step, self.directory)


def _interval_metrics(pending, seconds, start_time, epoch, lengths=None, throughput=None):
  """Summary of the steps since the last log line (one host transfer for all of them)."""
  pending = jax.device_get(pending)
  total = lambda key: sum(float(m[key]) for m in pending)
  tokens = total('target_tokens')
  accounting = throughput.metrics(pending, lengths, seconds) if throughput is not None else {}
  return {
      **accounting,
      'train/loss': total('loss_sum') / max(tokens, 1.0),
      'train/nll': total('nll_sum') / max(tokens, 1.0),
      'train/learning_rate': float(pending[-1]['learning_rate']),
      'train/grad_norm': float(pending[-1]['grad_norm']),
      'train/target_tokens_per_second': tokens / seconds,
      'train/source_tokens_per_second': total('source_tokens') / seconds,
      'train/step_time': seconds / len(pending),
      'train/skipped_updates': total('nonfinite'),
      'elapsed_seconds': time.time() - start_time,
      'epoch': epoch,
  }


def _check_finite(unchecked, first_step, config):
  """Consumes the per-step NaN/Inf flags of `unchecked` (steps first_step+1...); returns how many were set.

  Raises NonFiniteError naming the first such step unless config.skip_nonfinite_updates.
  """
  flags_ = [int(f) for f in jax.device_get(unchecked)]
  unchecked.clear()
  if any(flags_) and not config.skip_nonfinite_updates:
    bad = first_step + flags_.index(1) + 1
    raise NonFiniteError(f'step {bad}: the loss or a gradient is NaN/Inf; the update was not applied and '
                         'training stopped (the newest checkpoint holds the last good state). Lower the '
                         'learning rate (--config.learning_rate_scale), clip gradients (--config.grad_clip_norm='
                         '1.0) or skip such updates (--config.skip_nonfinite_updates=true), and rerun the same '
                         'command: it resumes from that checkpoint with the new setting.')
  return sum(flags_)


def train_and_evaluate(config, workdir):
  """Trains to config.num_train_steps (or max_train_minutes, or a stop signal); returns the last metrics."""
  start_time = time.time()
  validate_config(config)
  workdir = epath.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  save_or_check_config(config, workdir)

  mesh = sharding.mesh_from_config(config)
  batch_sharding = sharding.batch_sharded(mesh)
  num_devices = mesh.devices.size
  logging.info('Mesh %s over %d devices (%s) in %d processes', dict(mesh.shape), num_devices,
               jax.devices()[0].device_kind, jax.process_count())
  # Batch rows: a multiple of the device count times the microbatches, so that every device gets the same
  # number of rows in every microbatch.
  train_batches, eval_batches, tokenizer = input_pipeline(
      config, workdir, num_devices=sharding.rows_multiple(mesh) * config.grad_accumulation_steps)

  # Model, optimizer, state (fresh or restored).
  model = build_model(config, tokenizer)
  optimizer, schedule = train_step_lib.make_optimizer(config)
  state, state_sharding = train_step_lib.create_state(model, optimizer, config, mesh)
  logging.info('Model: %s parameters, %s', f'{model_lib.count_params(state.params):,}', model.config)
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=config.keep_checkpoints)
  restored = checkpoints.restore_newest_good(checkpoints_lib.abstract_like(state), tokenizer.sha256)
  if restored is not None:
    state, data_state = restored
    train_batches.restore(data_state)
  train_fn, eval_fn = train_step_lib.jit_steps(model, optimizer, schedule, config, mesh, state_sharding)
  peak = flops_lib.peak_flops_per_device(override=config.peak_flops_per_device)
  throughput = Throughput(model.config, tokenizer.vocab_size, num_devices, peak)
  profiler = Profiler(workdir, config.profile_start_step, config.profile_steps)

  log = MetricsLog(workdir)
  step = first_step = int(state.step)
  logging.info('Starting at step %d of %d; %d batches per epoch', step, config.num_train_steps,
               train_batches.batches_per_epoch())
  pending, lengths, unchecked, last, skipped, data_wait = [], [], [], {}, 0, 0.0
  signalled = False  # stopped by SIGTERM/SIGINT (on any host): the run is to be resumed, not averaged
  interval_start = last_save = time.time()
  time_limit = config.max_train_minutes * 60 if config.max_train_minutes > 0 else float('inf')
  save_interval = config.checkpoint_every_minutes * 60 if config.checkpoint_every_minutes > 0 else float('inf')
  with StopSignal() as stop:
    while step < config.num_train_steps:
      wait_start = time.time()
      host_batch = next(train_batches)
      data_wait += time.time() - wait_start  # time the step loop stood waiting for input
      lengths.append((host_batch['src'].shape[1], host_batch['tgt_in'].shape[1]))  # for the FLOP count
      profiler.before_step(step)
      state, metrics = train_fn(state, sharding.put_batch(host_batch, batch_sharding))
      pending.append(metrics)  # device arrays: reading them waits for the step, so only at log/save time
      unchecked.append(metrics['nonfinite'])
      step += 1
      profiler.after_step(step, state)
      out_of_time = time.time() - start_time >= time_limit
      signalled = stop.received is not None
      done = step >= config.num_train_steps or out_of_time or signalled
      save = (step % config.checkpoint_every_steps == 0 or time.time() - last_save >= save_interval or done)
      if jax.process_count() > 1:
        # Clocks and signals are per host, but every host must take the same decisions, or one would wait
        # in a collective the others never join: a stop seen by any host stops (and saves) them all.
        save, done, out_of_time, signalled = (bool(x) for x in multihost_utils.process_allgather(
            np.array([save, done, out_of_time, signalled])).any(axis=0))

      if step % config.log_every_steps == 0 or save:
        skipped += _check_finite(unchecked, step - len(unchecked), config)
      if step % config.log_every_steps == 0 or done:
        last = _interval_metrics(pending, time.time() - interval_start, start_time, train_batches.epoch,
                                 lengths, throughput)
        last['train/data_wait_fraction'] = data_wait / (time.time() - interval_start)
        eta = min((config.num_train_steps - step) * last['train/step_time'],
                  max(time_limit - last['elapsed_seconds'], 0))
        mfu = f' | MFU {last["train/mfu"]:.1%}' if 'train/mfu' in last else ''
        logging.info('step %d/%d | loss %.4f | nll %.4f | lr %.3g | %.0f tgt + %.0f src tok/s | %.3g TFLOP/s%s | '
                     '%.0f ms/step | epoch %d | %s elapsed | ETA %s%s', step, config.num_train_steps,
                     last['train/loss'], last['train/nll'], last['train/learning_rate'],
                     last['train/target_tokens_per_second'], last['train/source_tokens_per_second'],
                     last['train/tflops_per_second'], mfu, last['train/step_time'] * 1e3, last['epoch'],
                     _duration(last['elapsed_seconds']), _duration(eta),
                     f' | {skipped} skipped updates' if skipped else '')
        log.write(step, last)
        pending, lengths, interval_start, data_wait = [], [], time.time(), 0.0

      if step % config.eval_every_steps == 0 or done:
        eval_metrics = evaluate(eval_fn, state.params, eval_batches(), batch_sharding)
        eval_metrics['elapsed_seconds'] = time.time() - start_time
        logging.info('step %d | validation loss %.4f | nll %.4f | perplexity %.2f', step,
                     eval_metrics['eval/loss'], eval_metrics['eval/nll'], eval_metrics['eval/perplexity'])
        log.write(step, eval_metrics)
        last.update(eval_metrics)
        interval_start, data_wait = time.time(), 0.0  # keep evaluation out of the next interval's tokens/s

      if save:
        checkpoints.save(step, state, train_batches.state(), force=True, vocab_sha256=tokenizer.sha256)
        last_save = time.time()
      if done:
        reason = ('a stop signal' if signalled else 'config.max_train_minutes' if out_of_time
                  else 'config.num_train_steps')
        logging.info('Stopping at step %d after %s (%s)', step, _duration(time.time() - start_time), reason)
        break

  train_batches.close()
  checkpoints.wait()
  checkpoints.close()
  log.close()
  # Training ended (by steps or time), not paused by a preemption: average for decoding.
  if config.average_last_checkpoints > 0 and not signalled:
    checkpoints_lib.average_last(workdir, last=config.average_last_checkpoints)
  logging.info('Trained steps %d..%d in %s', first_step, step, _duration(time.time() - start_time))
  return last


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory (or gs:// URL) for the vocabulary, checkpoints and logs.')
  flags.DEFINE_enum('distributed', 'auto', distributed.MODES,
                    'Multi-host start: auto (a coordinator address, SLURM, Open MPI or a Cloud TPU VM), on, off.')
  flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS).')
  flags.DEFINE_integer('num_processes', None, 'Processes in the job (default: $JAX_NUM_PROCESSES).')
  flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1 (default: $JAX_PROCESS_ID).')
  flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  checkpoints_lib.quiet_orbax_logs()
  distributed.initialize(flags.FLAGS.distributed, flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                         flags.FLAGS.process_id)
  try:
    train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  except (data_lib.DataError, ConfigError, tokenizer_lib.TokenizerError, NonFiniteError,
          checkpoints_lib.AveragingError, checkpoints_lib.CheckpointMismatchError,
          checkpoints_lib.CheckpointStorageError, checkpoints_lib.CheckpointsDamagedError) as e:
    logging.error('%s', e)
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
