"""Preemption, crashes, NaNs and damaged checkpoints: a run is never lost and resumes exactly."""
import os
import re
import signal
import json
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import in_process
from conftest import small_config, tiny_model
from flaxformer_nmt import config as config_lib
from flaxformer_nmt import train as train_command
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.training import loop as train
from flaxformer_nmt.training import metrics as metrics_lib
from flaxformer_nmt.training import preemption
from flaxformer_nmt.training import step as ts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_flags(config, workdir):
  """The trainer's flags reproducing `config` from configs/multi30k.py."""
  args = [f'--config={REPO}/configs/multi30k.py', f'--workdir={workdir}']
  for key, value in config.items():
    if key == 'model':
      args += [f'--config.model.{k}={v}' for k, v in value.items()]
    else:
      args.append(f'--config.{key}={value if not isinstance(value, tuple) else str(value).replace(" ", "")}')
  return args


def cli_args(config, workdir):
  """The `python -m flaxformer_nmt.train` command line reproducing `config` from configs/multi30k.py."""
  return [sys.executable, '-m', 'flaxformer_nmt.train', *cli_flags(config, workdir)]


def wait_for_checkpoint(workdir, after, process, timeout=120):
  """Blocks until a finished checkpoint newer than `after` exists; returns its step."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    directory = workdir / 'checkpoints'
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.exists() else []
    if steps and max(steps) > after:
      return max(steps)
    assert process.poll() is None, process.communicate()[1][-3000:]
    time.sleep(0.02)
  raise TimeoutError


# 150 steps in three processes (20-33 s on 2 cores). The default suite keeps each part: a SIGTERM that saves and
# exits (bench/stop_latency.py --smoke) and a kill -9 whose rerun ends bitwise equal (bench/reliability.py --smoke).
@pytest.mark.slow
def test_sigterm_then_sigkill_then_resume_equals_an_uninterrupted_run(toy_corpus, tmp_path):
  config = small_config(toy_corpus)
  config.num_train_steps = 150
  config.checkpoint_every_steps = 10
  config.eval_every_steps = 1000
  config.keep_checkpoints = 3
  config.average_last_checkpoints = 0
  workdir = tmp_path / 'interrupted'
  args = cli_args(config, workdir)

  # A preemption notice: the trainer finishes its step, saves and exits 0.
  process = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  wait_for_checkpoint(workdir, 0, process)
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=60)
  assert process.returncode == 0, stderr[-3000:]
  assert 'Received SIGTERM' in stderr and 'a stop signal' in stderr
  stopped_at = max(checkpoints_lib.saved_steps(workdir))
  assert 0 < stopped_at < config.num_train_steps
  after = stderr.split('Received SIGTERM')[1]  # no evaluation inside the grace period (its loss or BLEU line)
  assert 'validation loss' not in after and 'validation BLEU' not in after, after[-3000:]

  # A crash at an arbitrary point (possibly mid-save): nothing but the finished checkpoints survives.
  process = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  wait_for_checkpoint(workdir, stopped_at + 10, process)
  time.sleep(0.05)
  process.kill()
  process.communicate()
  assert process.returncode == -signal.SIGKILL

  # The same command again runs to the end (its main in this process, in_process.py: no signal is sent to it).
  result = in_process.run(train_command, cli_flags(config, workdir))
  assert result.returncode == 0, result.stderr[-3000:]
  last_step = config.num_train_steps
  assert (result.stderr.index(f'Saving checkpoint {last_step} ')
          < result.stderr.index(f'step {last_step} | validation loss'))  # saved before the evaluation

  reference = tmp_path / 'uninterrupted'
  train.train_and_evaluate(config, reference)
  load = lambda w: checkpoints_lib.saved_params(w, config.num_train_steps)
  for a, b in zip(jax.tree_util.tree_leaves(load(workdir)), jax.tree_util.tree_leaves(load(reference))):
    np.testing.assert_array_equal(a, b)


def test_the_loop_waits_for_the_step_two_back_and_never_for_the_newest():
  """Stop decisions are for a step the device nearly reached (not one 50 dispatches ahead), yet the device keeps
  a step queued: a wrong depth, blocking on the newest step, or in the wrong order fails."""
  blocked = []

  class StepOutput:
    def __init__(self, step):
      self.step = step

    def block_until_ready(self):
      blocked.append(self.step)
      return self

  in_flight = preemption.StepsInFlight(max_steps=2)
  for step in range(1, 7):
    in_flight.add({'loss': StepOutput(step), 'grad_norm': StepOutput(step)})
    assert blocked == [s for s in range(1, step - 1) for _ in range(2)]


def test_a_nonfinite_step_is_never_applied():
  model, _ = tiny_model()
  c = config_lib.base_config()
  tx, schedule = ts.make_optimizer(c)
  state = ts.init_state(model, tx, seed=0)
  batch = {'src': jnp.array([[4, 5, 3]]), 'tgt_in': jnp.array([[2, 6, 7]]), 'tgt_out': jnp.array([[6, 7, 3]])}
  poisoned = state.replace(params=jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), state.params))
  step = jax.jit(lambda s, b: ts.train_step(s, b, model=model, optimizer=tx, schedule=schedule, label_smoothing=0.1))
  new, metrics = step(poisoned, batch)
  assert int(metrics['nonfinite']) == 1 and int(new.step) == 1
  np.testing.assert_equal(jax.device_get(new.params), jax.device_get(poisoned.params))
  # Adam's moments stay; its step counts go on with state.step, so that the next update's rate is the schedule's
  # at that step, the one logged (counts left behind applied an earlier step's rate, skip after skip).
  leaves = lambda tree: jax.tree_util.tree_flatten_with_path(tree)[0]
  for (path, a), (_, b) in zip(leaves(new.opt_state), leaves(poisoned.opt_state)):
    if path[-1] == jax.tree_util.GetAttrKey('count'):
      assert int(a) == int(new.step) == int(b) + 1, path
    else:
      np.testing.assert_array_equal(a, b)
  _, metrics = step(state, batch)
  assert int(metrics['nonfinite']) == 0


def test_nonfinite_steps_stop_training_with_the_step_named_or_are_counted():
  flags_ = lambda: [jnp.asarray(f) for f in (0, 0, 1, 0, 1)]
  with pytest.raises(metrics_lib.NonFiniteError, match='step 103:'):
    metrics_lib.check_finite(flags_(), 100, skip_nonfinite_updates=False)
  unchecked = flags_()
  assert metrics_lib.check_finite(unchecked, 100, skip_nonfinite_updates=True) == 2
  assert metrics_lib.check_finite(unchecked, 105, skip_nonfinite_updates=True) == 0  # each step counted once


def test_the_nan_flag_of_a_step_run_inside_a_call_of_several_names_that_step():
  """config.steps_per_dispatch: a call's flags come stacked, one per step; counting the call as one step would
  name step 106."""
  interval = metrics_lib.TrainInterval(None, skip_nonfinite_updates=False)
  batch = {'src': np.zeros((2, 8), np.int32), 'tgt_in': np.zeros((2, 8), np.int32)}
  interval.add({'nonfinite': jnp.asarray(0)}, [batch])  # step 101
  interval.add({'nonfinite': jnp.asarray([0, 1, 0, 1])}, [batch] * 4)  # steps 102-105 in one call
  with pytest.raises(metrics_lib.NonFiniteError, match='step 103:'):
    interval.check_finite(105)


@pytest.mark.parametrize('schedule', config_lib.SCHEDULES)
def test_the_nan_errors_advice_names_the_field_that_lowers_the_learning_rate_of_the_runs_schedule(schedule):
  """The error tells the user which field to lower: halving the field it names must halve the learning rate of the
  run's schedule at every step (learning_rate_scale moved nothing under 'inverse_sqrt', the Multi30k configs')."""
  interval = metrics_lib.TrainInterval(None, skip_nonfinite_updates=False, learning_rate_schedule=schedule)
  interval.add({'nonfinite': jnp.asarray(1)}, [{'src': np.zeros((1, 4)), 'tgt_in': np.zeros((1, 4))}])
  with pytest.raises(metrics_lib.NonFiniteError, match='step 8:') as error:
    interval.check_finite(8)
  (field,) = re.findall(r'Lower the learning rate \(--config\.(\w+)\)', str(error.value))
  c = config_lib.base_config()
  c.learning_rate_schedule, c.learning_rate, c.learning_rate_scale, c.warmup_steps = schedule, 0.004, 2.0, 10
  rates = [float(ts.make_schedule(c)(k)) for k in (0, 9, 40)]
  c[field] /= 2
  np.testing.assert_allclose([float(ts.make_schedule(c)(k)) for k in (0, 9, 40)], np.array(rates) / 2, rtol=1e-6)


def test_the_trainer_gives_the_nan_error_the_runs_schedule(toy_corpus, tmp_path, monkeypatch):
  """The loop builds its interval with config.learning_rate_schedule: an 'inverse_sqrt' run's error names
  --config.learning_rate (a step reporting NaN is simulated; its update was dropped as the step drops it)."""
  call = ts.TrainStep.__call__
  monkeypatch.setattr(ts.TrainStep, '__call__', lambda self, state, batch: (
      lambda out: (out[0], {**out[1], 'nonfinite': jnp.ones((), jnp.int32)}))(call(self, state, batch)))
  config = small_config(toy_corpus)
  config.learning_rate_schedule, config.learning_rate = 'inverse_sqrt', 0.001
  config.num_train_steps, config.log_every_steps, config.length_buckets = 4, 2, (32,)
  advice = r'step 1: .*Lower the learning rate \(--config\.learning_rate\)'
  with pytest.raises(metrics_lib.NonFiniteError, match=advice):
    train.train_and_evaluate(config, tmp_path / 'run')


def test_a_nonfinite_last_step_off_the_log_interval_stops_the_run_before_its_final_save(
    toy_corpus, tmp_path, monkeypatch):
  """Step 3 of 3 reports NaN (its flag set by hand), and 3 is no logging step: the final save reads the step's flags
  first, so the run stops naming step 3, keeps checkpoint 2 and is not marked finished. Catches flags read at
  logging steps only: the run saved step 3 and finished without a word."""
  call = ts.TrainStep.__call__

  def nan_at_step_3(self, state, batch):
    new, metrics = call(self, state, batch)
    return new, {**metrics, 'nonfinite': jnp.asarray(int(new.step) == 3, jnp.int32)}
  monkeypatch.setattr(ts.TrainStep, '__call__', nan_at_step_3)
  config = small_config(toy_corpus)
  config.num_train_steps, config.log_every_steps, config.checkpoint_every_steps = 3, 2, 2
  config.eval_every_steps, config.length_buckets = 1000, (32,)
  workdir = tmp_path / 'run'
  with pytest.raises(metrics_lib.NonFiniteError, match='step 3: '):
    train.train_and_evaluate(config, workdir)
  assert checkpoints_lib.saved_steps(workdir) == [2]
  assert not (workdir / 'finished.json').exists()


def test_damaged_and_partial_checkpoints_fall_back_to_the_last_good_one(tmp_path, caplog):
  model, _ = tiny_model()
  tx, _ = ts.make_optimizer(config_lib.base_config())
  state = ts.init_state(model, tx, seed=0)
  store = checkpoints_lib.Checkpoints(tmp_path, keep=3)
  for step in (1, 2, 3):
    store.save(step, state.replace(step=jnp.asarray(step)), {'epoch': 0, 'batch': step, 'seed': 0}, force=True)
  store.wait()
  store.close()
  directory = tmp_path / 'checkpoints'
  # 3: every data file truncated. 2: its parameter store deleted. 4: a save cut short (never renamed into place).
  for path in (directory / '3' / 'state').rglob('*'):
    if path.is_file() and 'ocdbt' in str(path):
      path.write_bytes(path.read_bytes()[:10])
  for path in (directory / '2' / 'state').rglob('*'):
    if path.is_file() and 'ocdbt' in str(path):
      path.unlink()
  (directory / '4.orbax-checkpoint-tmp' / 'state').mkdir(parents=True)

  store = checkpoints_lib.Checkpoints(tmp_path, keep=3)
  restored_state, data_state = store.restore_newest_good(checkpoints_lib.abstract_like(state))
  assert int(restored_state.step) == 1 and data_state['batch'] == 1
  warnings = [r.getMessage() for r in caplog.records if 'is damaged' in r.getMessage()]
  assert [w.split()[1] for w in warnings] == ['3', '2']
  assert (tmp_path / 'corrupt_checkpoints' / '3').exists() and (tmp_path / 'corrupt_checkpoints' / '2').exists()
  # Saving on from there keeps the good checkpoint: retention works on what is listed.
  assert store.steps() == [1]
  for step in (2, 3):
    store.save(step, state.replace(step=jnp.asarray(step)), {'epoch': 0, 'batch': step, 'seed': 0}, force=True)
  store.wait()
  assert store.steps() == [1, 2, 3]
  store.close()


def test_a_workdir_of_another_model_is_refused_without_losing_it(toy_corpus, tmp_path):
  config = small_config(toy_corpus)
  config.num_train_steps = 10
  train.train_and_evaluate(config, tmp_path / 'w')
  before = sorted(p.name for p in (tmp_path / 'w' / 'checkpoints').iterdir())
  config.model.d_model = 64
  result = subprocess.run(cli_args(config, tmp_path / 'w'), cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert 'trained with config.model.d_model=32, now 64' in result.stderr and 'Traceback' not in result.stderr
  assert sorted(p.name for p in (tmp_path / 'w' / 'checkpoints').iterdir()) == before


def input_threads():
  """The input threads running (TrainBatches starts one at its first batch)."""
  return sum(t.name == 'Prefetcher' and t.is_alive() for t in threading.enumerate())


def test_an_error_after_a_save_keeps_the_save_and_closes_the_run(toy_corpus, tmp_path, monkeypatch,
                                                                 checkpoint_closes, evaluation_fails_at):
  """An error that escapes the loop right after a save (here the evaluation after step 10's save fails) waits
  for that save and stops the input thread before it goes on; rerunning resumes from step 10."""
  config = small_config(toy_corpus)
  evaluation_fails_at(10)
  threads_before = input_threads()
  with pytest.raises(RuntimeError, match='the evaluation failed'):
    train.train_and_evaluate(config, tmp_path / 'w')
  assert len(checkpoint_closes) == 1 and input_threads() <= threads_before
  # Step 10's save finished before the error went on, not later in a background thread.
  assert checkpoints_lib.saved_steps(tmp_path / 'w') == [10]

  monkeypatch.undo()
  train.train_and_evaluate(config, tmp_path / 'w')
  with open(tmp_path / 'w' / 'metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  assert [r['step'] for r in records if 'run/trained_seconds_at_start' in r] == [0, 10]
  # Step 10's evaluation, cut short, runs first on resume (it resumes at step 11), once; step 20's as scheduled.
  assert [r['step'] for r in records if 'eval/loss' in r] == [10, 20]
  assert json.loads((tmp_path / 'w' / train.EVALUATED_FILE).read_text()) == {'step': 20}
  train.train_and_evaluate(config, tmp_path / 'w')  # a finished run, run again, evaluates nothing again
  with open(tmp_path / 'w' / 'metrics.jsonl') as f:
    assert [r['step'] for r in map(json.loads, f) if 'eval/loss' in r] == [10, 20]


def test_checkpoints_by_elapsed_minutes(toy_corpus, tmp_path):
  config = small_config(toy_corpus)
  config.num_train_steps = 4
  config.checkpoint_every_steps = 1000  # never by steps: every save below is by time
  config.checkpoint_every_minutes = 1e-6
  config.keep_checkpoints = 0
  train.train_and_evaluate(config, tmp_path / 'w')
  assert checkpoints_lib.saved_steps(tmp_path / 'w') == [1, 2, 3, 4]


def test_a_second_stop_signal_waits_for_the_stop_save(toy_corpus, tmp_path, monkeypatch, caplog):
  """Wrong rule caught: the signal handlers were restored as the loop ended, before the stop's save was waited
  for, so a second Ctrl-C while it was written reached the default handler (KeyboardInterrupt) and killed the run
  with only the save's temporary folder left. Here the handler found before the run stands for the default one.
  The stopped run is one to resume: it is not evaluated, averaged or marked finished, and the handler found
  before it is in place again once it returns."""
  config = small_config(toy_corpus)
  config.eval_every_steps, config.average_last_checkpoints = 100, 1
  reached_default = []
  default = lambda signum, frame: reached_default.append(signum)
  previous = signal.signal(signal.SIGINT, default)
  after_step, wait = preemption.StopDecision.after_step, checkpoints_lib.Checkpoints.wait
  waits = []

  def ctrl_c_at_step_2(self, step, steps=1):
    if step == 2:
      signal.raise_signal(signal.SIGINT)
    return after_step(self, step, steps)

  def ctrl_c_while_saving(self):
    if not waits:
      signal.raise_signal(signal.SIGINT)
    waits.append(True)
    wait(self)
  monkeypatch.setattr(preemption.StopDecision, 'after_step', ctrl_c_at_step_2)
  monkeypatch.setattr(checkpoints_lib.Checkpoints, 'wait', ctrl_c_while_saving)
  try:
    train.train_and_evaluate(config, tmp_path / 'w')
    assert signal.getsignal(signal.SIGINT) is default
  finally:
    signal.signal(signal.SIGINT, previous)
  assert not reached_default
  assert any('already stopping' in r.getMessage() for r in caplog.records)
  assert checkpoints_lib.saved_steps(tmp_path / 'w') == [2]
  logged = [json.loads(line) for line in (tmp_path / 'w' / 'metrics.jsonl').read_text().splitlines()]
  assert not [r for r in logged if 'eval/loss' in r]
  assert not (tmp_path / 'w' / 'finished.json').exists() and not (tmp_path / 'w' / 'averaged').exists()


def test_an_error_in_the_evaluation_a_resume_catches_up_closes_the_run(toy_corpus, tmp_path, monkeypatch,
                                                                      checkpoint_closes, evaluation_fails_at):
  """The evaluation of step 10 fails in the run that saved step 10, then again as the resumed run catches it up
  before its first step: that error too closes the checkpoints and the metrics log before it goes on."""
  logs_closed = []
  close = metrics_lib.MetricsLog.close
  monkeypatch.setattr(metrics_lib.MetricsLog, 'close', lambda self: (logs_closed.append(True), close(self)))
  config = small_config(toy_corpus)
  evaluation_fails_at(10)
  for launch in (1, 2):
    with pytest.raises(RuntimeError, match='the evaluation failed'):
      train.train_and_evaluate(config, tmp_path / 'w')
    assert len(checkpoint_closes) == len(logs_closed) == launch
  assert checkpoints_lib.saved_steps(tmp_path / 'w') == [10]


def test_saves_by_minutes_count_from_the_last_save_and_the_end_and_a_stop_are_saved(monkeypatch):
  """StopDecision on a clock that advances 25 s a step: saves every 4 steps, every minute since the last save
  (of either kind), at the end. Catches a time-based save that, once due, falls at every later step (the last
  save's time not taken), a resumed run whose first step saves at once (its minutes counted from the training's
  start instead of this launch's), and an end or stop signal that is not saved."""
  import types  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  clock = {'now': 5000.0}
  monkeypatch.setattr(preemption, 'time', types.SimpleNamespace(time=lambda: clock['now']))
  config = ml_collections.ConfigDict(dict(num_train_steps=10, checkpoint_every_steps=4, log_every_steps=5,
                                          max_train_minutes=0.0, checkpoint_every_minutes=1.0))

  def saves(stop_at=None):
    stop_signal = types.SimpleNamespace(received=None)
    decision = preemption.StopDecision(config, start_time=clock['now'] - 3000.0, stop_signal=stop_signal)
    saved = []
    for step in range(1, config.num_train_steps + 1):
      clock['now'] += 25.0
      stop_signal.received = 'SIGTERM' if step == stop_at else None
      save, done = decision.after_step(step)
      if save:
        decision.saved()
        saved.append(step)
      if done:
        return saved, decision.reason
    raise AssertionError('never done')

  # 75 s at step 3 (by time), 4 (the grid: the minute starts again), 175 - 100 s at step 7, 8, the end at 10.
  assert saves() == ([3, 4, 7, 8, 10], 'config.num_train_steps')
  assert saves(stop_at=6) == ([3, 4, 6], 'a stop signal')
