"""The training loop: `train_and_evaluate(config, workdir)` sets a run up (input, model, state restored or fresh,
compiled steps), then steps, logs, saves, evaluates and stops, and closes what the run holds.

Beside it in training/: the step itself (step.py), what it reports (metrics.py), when it saves and stops
(preemption.py), validation BLEU (validation.py), ensembles (ensemble.py); its input is data/pipeline.py and its
checkpoints checkpointing/checkpoints.py. The command is flaxformer_nmt/train.py.
"""
import contextlib
import dataclasses
import json
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging
from etils import epath

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import best as best_lib
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing.workdir import build_model, check_config, schedule_changes, write_config
from flaxformer_nmt.data import batching
from flaxformer_nmt.data.pipeline import input_pipeline
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import distributed
from flaxformer_nmt.runtime import files
from flaxformer_nmt.runtime import flops as flops_lib
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.runtime.profiler import Profiler
from flaxformer_nmt.training import ensemble
from flaxformer_nmt.training import metrics as metrics_lib
from flaxformer_nmt.training import preemption
from flaxformer_nmt.training import step as train_step_lib
from flaxformer_nmt.training import validation as bleu_eval
from flaxformer_nmt.training import warm_start


# The run's training time at a checkpoint, saved beside its data position.
TRAINED_SECONDS = 'trained_seconds'
# {"step": S}: the newest step whose due evaluations all ended (catch_up_evaluation).
EVALUATED_FILE = 'evaluated.json'


@dataclasses.dataclass
class Run:
  """What the loop works with: built by `set_up`, the state advanced by the loop."""
  config: Any
  workdir: epath.Path
  batch_sharding: Any
  steps_batch_sharding: Any  # the batches of one call's steps, stacked (TrainStep.many)
  train_batches: batching.TrainBatches
  eval_batches: Callable
  state: train_step_lib.TrainState
  train_fn: train_step_lib.TrainStep
  eval_fn: Callable
  checkpoints: checkpoints_lib.Checkpoints
  throughput: metrics_lib.Throughput
  profiler: Profiler
  log: metrics_lib.MetricsLog
  vocab_sha256: str  # recorded with each checkpoint, checked on restore
  validation_bleu: bleu_eval.ValidationBleu
  best: Any  # best_checkpoint.BestCheckpoint, or None (config.best_checkpoint_metric off)
  # Training time before this launch, saved with each checkpoint (0 for a new run): config.max_train_minutes and
  # the logged elapsed_seconds count the run's training time across resumes, not the time between them.
  trained_seconds: float = 0.0
  # The programs already dispatched in this launch, as (steps per call, batch shapes): a first call compiles.
  dispatched: set = dataclasses.field(default_factory=set)

  def close(self, last_state=None):
    """Closes what the run holds: a profile window still open (after `last_state` has run on the device; none
    after an error, whose state may be the failure's), the input thread, the checkpoint manager once the save in
    flight is written, the metrics writers."""
    self.profiler.close(last_state)
    self.train_batches.close()
    self.checkpoints.wait()
    self.checkpoints.close()
    self.log.close()


def set_up(config, workdir):
  """Checks the config against the workdir, then builds the input, the model, the train state (fresh or
  restored from the newest good checkpoint, with the data position) and the compiled steps."""
  config_lib.validate(config)
  # Whether this machine runs the model (its dtype and attention: cuDNN's rules), before any data is prepared.
  model_lib.ModelConfig.from_config(config, config.vocab_size)
  workdir = epath.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  check_config(config, workdir)
  # A new run records its config at once (a run killed after its first save leaves a workdir decode can read); one
  # that may resume, once its checkpoint and data position accepted it: a refused resume leaves config.json as it was.
  resuming = checkpoints_lib.checkpoint_directory(workdir).is_dir()
  if not resuming:
    write_config(config, workdir)
  changes = schedule_changes(config, workdir) if resuming else []
  if changes:
    logging.warning('Resuming with another schedule (%s): the learning rate of the steps left follows the new one '
                    'from the checkpoint\'s step on, and the average takes the last checkpoints of the new end',
                    ', '.join(f'config.{field} {old!r} -> {new!r}' for field, old, new in changes))

  mesh = sharding.mesh_from_config(config)
  num_devices = mesh.devices.size
  logging.info('Mesh %s over %d devices (%s) in %d processes', dict(mesh.shape), num_devices,
               jax.devices()[0].device_kind, jax.process_count())
  warm_start.adopt_vocabulary(config, workdir)  # a fine-tuning run starts with its source's vocabulary
  # The global batches are planned without looking at the machine; each is padded with empty rows to a
  # multiple of the device count times the microbatches, so every device gets the same rows per microbatch.
  train_batches, eval_batches, tokenizer = input_pipeline(
      config, workdir, num_devices=sharding.rows_multiple(mesh) * config.grad_accumulation_steps)

  model = build_model(config, tokenizer)
  state, state_sharding = train_step_lib.create_state(model, config, mesh)
  logging.info('Model: %s parameters, %s', f'{model_lib.count_params(state.params):,}', model.config)
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=config.keep_checkpoints,
                                            every_steps=config.checkpoint_every_steps)
  with preemption.closed_on_error(train_batches, checkpoints):  # a refused resume leaves no thread behind
    state, trained_seconds = restore_or_start(config, state, state_sharding, checkpoints, train_batches, tokenizer)
    if resuming:
      write_config(config, workdir)
  train_fn, eval_fn = train_step_lib.jit_steps(model, config, mesh, state_sharding)
  peak = flops_lib.peak_flops_per_device(override=config.peak_flops_per_device)
  return Run(config, workdir, sharding.batch_sharded(mesh), sharding.steps_batch_sharded(mesh), train_batches,
             eval_batches, state, train_fn, eval_fn, checkpoints,
             metrics_lib.Throughput(model.config, tokenizer.vocab_size, num_devices, peak),
             Profiler(workdir, config.profile_start_step, config.profile_steps), metrics_lib.MetricsLog(workdir),
             tokenizer.sha256, bleu_eval.ValidationBleu(config, tokenizer, workdir, mesh),
             best_lib.BestCheckpoint(workdir, config.best_checkpoint_metric) if config.best_checkpoint_metric else None,
             trained_seconds)


def restore_or_start(config, state, state_sharding, checkpoints, train_batches, tokenizer):
  """(state, training seconds before this launch): the newest good checkpoint with its data position, else
  config.init_from's parameters (a warm start), else the fresh `state`."""
  restored = checkpoints.restore_newest_good(checkpoints_lib.abstract_like(state), tokenizer.sha256)
  if restored is None:
    if config.init_from:
      state = warm_start.load_params(state, state_sharding, config, tokenizer)
    return state, 0.0
  state, data_state = restored
  trained_seconds = float(data_state.pop(TRAINED_SECONDS, 0.0))  # absent from checkpoints of earlier versions
  train_batches.restore(data_state, allow_batching_change=config.allow_batching_change)
  if config.init_from:
    logging.info('Resuming this workdir; config.init_from=%s is ignored (it only starts new runs)', config.init_from)
  return state, trained_seconds


def evaluate(eval_fn, params, batches, batch_sharding):
  """Validation loss (label-smoothed cross entropy), NLL and perplexity per target token."""
  sums = None
  for batch in batches:
    metrics = eval_fn(params, sharding.put_batch(batch, batch_sharding))
    sums = metrics if sums is None else jax.tree_util.tree_map(lambda a, b: a + b, sums, metrics)
  sums = jax.device_get(sums)
  nll = float(sums['nll_sum'] / sums['target_tokens'])
  out = {'eval/loss': float(sums['loss_sum'] / sums['target_tokens']), 'eval/nll': nll,
         'eval/perplexity': float(np.exp(nll))}
  if 'correct' in sums:  # MLM: accuracy on the masked tokens
    out['eval/accuracy'] = float(sums['correct'] / sums['target_tokens'])
  return out


def log_train(run, interval, step, start_time, decision):
  """Writes the interval's metrics and the log line; returns the metrics."""
  metrics = interval.summarize(start_time, run.train_batches.epoch)
  eta = min((run.config.num_train_steps - step) * metrics['train/step_time'], decision.seconds_left())
  logging.info('%s', metrics_lib.train_log_line(step, run.config.num_train_steps, metrics, eta, interval.skipped))
  run.log.write(step, metrics)
  return metrics


def log_eval(run, step, start_time):
  metrics = evaluate(run.eval_fn, run.state.params, run.eval_batches(), run.batch_sharding)
  metrics['elapsed_seconds'] = time.time() - start_time
  logging.info('%s', metrics_lib.eval_log_line(step, metrics))
  run.log.write(step, metrics)
  return metrics


def evaluate_step(run, step, start_time, done):
  """The validation metrics due at this step (loss, BLEU: validation.py), logged and offered to the best
  checkpoint, then recorded as done (EVALUATED_FILE); returns them (empty when none is due)."""
  evaluated = {}
  if step % run.config.eval_every_steps == 0 or done:
    evaluated.update(log_eval(run, step, start_time))
  if run.validation_bleu.due(step, done):
    bleu_metrics = run.validation_bleu.evaluate(step, run.state.params)
    run.log.write(step, bleu_metrics)
    evaluated.update(bleu_metrics)
  if evaluated and run.best is not None:
    run.best.update(step, run.state.params, evaluated)
  if evaluated and distributed.is_leader():  # written whole, then renamed: a kill leaves the old one or the new
    files.write_atomically(run.workdir / EVALUATED_FILE, json.dumps({'step': step}))
  return evaluated


def catch_up_evaluation(run, step, start_time):
  """The evaluations due at a resumed run's first step, where the run before saved that step and stopped
  before they ended (a kill during the validation decode, a stop signal: the save comes first); returns
  their metrics (empty where none were missed). A run whose time guard had run out there ended at that step."""
  done = step >= run.config.num_train_steps or run.trained_seconds >= preemption.time_limit_seconds(run.config)
  due = step % run.config.eval_every_steps == 0 or done or run.validation_bleu.due(step, done)
  path = run.workdir / EVALUATED_FILE  # the workdir is shared by every host: they all decide alike
  if step == 0 or not due or (path.exists() and json.loads(path.read_text())['step'] == step):
    return {}
  logging.info('Evaluating step %d first: the run that saved it stopped before its evaluation ended', step)
  return evaluate_step(run, step, start_time, done)


def steps_in_call(config, step):
  """How many train steps the call after `step` runs: config.steps_per_dispatch of them (TrainStep.many) from a
  multiple of it with that many left (every logging, evaluation and save step is such a multiple:
  config.validate), else one."""
  many = config.steps_per_dispatch
  return many if step % many == 0 and step + many <= config.num_train_steps else 1


@contextlib.contextmanager
def _compiling(clock, interval):
  """A program's first call: the clock's 'compiling', and out of the interval's tokens/s and step time."""
  with clock.phase('compiling'), interval.paused():
    yield


def dispatch_steps(run, interval, count, clock):
  """Dispatches the next `count` train steps (steps_in_call) in one call; returns their metrics (device arrays,
  read at log and save time). The first call of each program (steps per call, batch shapes: a length bucket
  compiles its own) is timed as the clock's 'compiling', and kept out of the interval's tokens/s and step time."""
  batches = [interval.next_batch(run.train_batches) for _ in range(count)]
  program = (count, tuple(np.shape(x) for x in jax.tree_util.tree_leaves(batches[0])))
  with _compiling(clock, interval) if program not in run.dispatched else contextlib.nullcontext():
    if count == 1:
      run.state, metrics = run.train_fn(run.state, sharding.put_batch(batches[0], run.batch_sharding))
    else:
      stacked = jax.tree_util.tree_map(lambda *arrays: np.stack(arrays), *batches)
      run.state, metrics = run.train_fn.many(run.state, sharding.put_batch(stacked, run.steps_batch_sharding))
  run.dispatched.add(program)
  interval.add(metrics, batches)
  return metrics


def train_and_evaluate(config, workdir):
  """Trains to config.num_train_steps (or until config.max_train_minutes or a stop signal); returns the last
  metrics."""
  launch_time, clock = time.time(), metrics_lib.WallClock()
  with clock.phase('set-up'):
    run = set_up(config, workdir)
  start_time = launch_time - run.trained_seconds  # the clock of the run's training time, resumes included
  step = first_step = int(run.state.step)
  logging.info('Starting at step %d of %d; %d batches per epoch%s', step, config.num_train_steps,
               run.train_batches.batches_per_epoch(),
               f'; {metrics_lib.duration(run.trained_seconds)} trained before' if run.trained_seconds else '')
  # Where this launch's clock starts (bench/bleu_curve.py reads it to join the minutes of resumed launches).
  run.log.write(step, {'run/trained_seconds_at_start': run.trained_seconds})
  interval = metrics_lib.TrainInterval(run.throughput, config.skip_nonfinite_updates, config.learning_rate_schedule)
  with clock.phase('validation'), interval.paused(), preemption.closed_on_error(run):
    last = catch_up_evaluation(run, step, start_time)
  preemption_sync = preemption.preemption_sync_available(step)
  # An error that escapes the loop (a failed evaluation, a device out of memory) first lets the save in flight
  # finish: rerunning the command resumes from it.
  with (preemption.closed_on_error(run),
        preemption.StopSignal(handle_sigterm=not preemption_sync) as stop_signal):
    decision = preemption.StopDecision(config, start_time, stop_signal, preemption_sync)
    in_flight = preemption.StepsInFlight()
    spent = step < config.num_train_steps and decision.spent_before_start(run.trained_seconds)
    while step < config.num_train_steps and not spent:
      steps = steps_in_call(config, step)
      run.profiler.before_step(step, steps)
      step_metrics = dispatch_steps(run, interval, steps, clock)
      in_flight.add(step_metrics)  # stop decisions below are for a step the device is about to reach
      step += steps
      run.profiler.after_step(step, run.state)
      save, done = decision.after_step(step, steps)
      if step % config.log_every_steps == 0 or save:
        interval.check_finite(step)
      if step % config.log_every_steps == 0 or done:
        last = log_train(run, interval, step, start_time, decision)
      if save:  # before evaluating: a kill during a long validation decode loses nothing; the write is async
        position = {**run.train_batches.state(), TRAINED_SECONDS: time.time() - start_time}
        with clock.phase('saves'):
          run.checkpoints.save(step, run.state, position, force=True, vocab_sha256=run.vocab_sha256)
        decision.saved()
      if not decision.signalled:  # a preempted run exits at once (its grace period is short); no evaluation
        with clock.phase('validation'), interval.paused():  # evaluation stays out of tokens/s
          evaluated = evaluate_step(run, step, start_time, done)
        last.update(evaluated)
      if done:
        logging.info('Stopping at step %d after %s (%s)', step, metrics_lib.duration(time.time() - start_time),
                     decision.reason)
        break
    with clock.phase('saves'):  # the last save is written before the signal handlers go: a second Ctrl-C waits
      run.checkpoints.wait()
  if decision.reason == 'config.max_train_minutes' and step < config.num_train_steps:
    warn_time_cut(config, step)
  finish(run, step, decision, clock)
  logging.info('Trained steps %d..%d in %s (%s of training in all)', first_step, step,
               metrics_lib.duration(time.time() - launch_time), metrics_lib.duration(time.time() - start_time))
  return last


def finish(run, step, decision, clock):
  """Writes this launch's time by phase (up to finishing: the log closes here) and closes everything (the loop
  waited for the last save); a run that ended (by steps or time), not one paused by a stop signal, averages its last
  checkpoints for decoding and is marked finished (ensemble.py). Logs the time by phase, finishing included."""
  run.log.write(step, clock.phases())
  with clock.phase('finishing'):
    run.close(last_state=run.state)
    if not decision.signalled:
      try:
        if run.config.average_last_checkpoints > 0:
          checkpoints_lib.average_last(run.workdir, last=run.config.average_last_checkpoints,
                                       every_steps=run.config.checkpoint_every_steps)
      finally:  # the training is done even where its average fails: a rerun must not train again
        ensemble.mark_finished(run.workdir, run.config, step,
                               decision.reason or 'its end, reached before this launch')
  logging.info('%s', metrics_lib.wall_log_line(clock.phases()))


def warn_time_cut(config, step):
  """The warning of a run that config.max_train_minutes stopped at `step`, before config.num_train_steps: the
  learning rate never finished its schedule (the cooldown, where there is one, was cut)."""
  schedule = ('its learning-rate cooldown (the last %d steps) was cut short' % config.cooldown_steps
              if config.cooldown_steps else 'its learning-rate schedule did not reach its end')
  logging.warning('config.max_train_minutes=%g stopped the run at step %d of config.num_train_steps=%d: %s. Size '
                  'num_train_steps to the time (`python bench/train_throughput.py --fit_minutes M` prints the steps '
                  'that fit M minutes on this machine), or pass a larger --config.max_train_minutes to train on.',
                  config.max_train_minutes, step, config.num_train_steps, schedule)
