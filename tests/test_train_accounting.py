"""What the training loop logs about speed (tokens/s, FLOP/s, MFU, step time) and the profiler option; the
training time it counts across resumes, and config.max_train_minutes, the guard that stops a run on time."""
import contextlib
import json
import time

import jax
import numpy as np
import pytest

import in_process
from conftest import small_config
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import flops
from flaxformer_nmt.training import ensemble
from flaxformer_nmt.training import loop as train
from flaxformer_nmt.training import preemption


@pytest.mark.profiler
def test_log_carries_throughput_flops_mfu_and_the_profile_is_written(toy_corpus, tmp_path):
  config = small_config(toy_corpus)
  config.num_train_steps = 6
  config.log_every_steps = 3
  config.eval_every_steps = 6
  config.checkpoint_every_steps = 6
  config.peak_flops_per_device = 1e9  # a made-up peak: CPUs have none in the table
  config.profile_start_step, config.profile_steps = 2, 2
  config.grad_accumulation_steps = 2
  train.train_and_evaluate(config, tmp_path / 'run')
  model_config = model_lib.ModelConfig.from_config(config, config.vocab_size)
  logged = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  intervals = [m for m in logged if 'train/loss' in m]
  assert [m['step'] for m in intervals] == [3, 6]
  for m in intervals:
    assert m['train/target_tokens_per_second'] > 0 and m['train/source_tokens_per_second'] > 0
    assert m['train/step_time'] > 0
    # MFU is the model FLOP rate over the (overridden) peak of the one device.
    assert m['train/mfu'] == pytest.approx(m['train/tflops_per_second'] * 1e12 / 1e9, rel=1e-6)
    # FLOPs per target token are within what the model shape allows (attention over 16..32-token rows).
    per_token = m['train/tflops_per_second'] * 1e12 / m['train/target_tokens_per_second']
    low = flops.train_flops(model_config, config.vocab_size, 0, 1, 0, 0)
    high = flops.train_flops(model_config, config.vocab_size, 3, 1, 32, 32)
    assert low < per_token < high
  traces = list((tmp_path / 'run' / 'profile').rglob('*.xplane.pb'))
  assert traces, 'no profiler trace written'


@pytest.mark.profiler
@pytest.mark.parametrize('ending', ['end', 'error'])
def test_a_profile_window_the_run_stops_inside_is_written_and_closed(toy_corpus, tmp_path, evaluation_fails_at,
                                                                      ending):
  """A run that stops inside its profile window (its end or time limit comes first, or an error escapes the
  loop) writes the steps it traced and leaves no trace running: the process can profile again."""
  config = small_config(toy_corpus)
  config.num_train_steps = 5
  config.eval_every_steps = config.checkpoint_every_steps = 5
  config.profile_start_step, config.profile_steps = 2, 100
  if ending == 'error':
    evaluation_fails_at(3)  # the window opened before the third step
    with pytest.raises(RuntimeError, match='the evaluation failed'):
      train.train_and_evaluate(config, tmp_path / 'run')
  else:
    train.train_and_evaluate(config, tmp_path / 'run')
  assert list((tmp_path / 'run' / 'profile').rglob('*.xplane.pb')), 'the traced steps were not written'
  jax.profiler.start_trace(str(tmp_path / 'again'))  # raises while another trace is running
  jax.profiler.stop_trace()


class _FastClock:
  """time.time() for preemption.py's stop decisions: real time plus `seconds` more at every reading, so a run
  reaches its time limit within a few steps without sleeping."""

  def __init__(self, seconds):
    self.seconds, self.readings = seconds, 0

  def time(self):
    self.readings += 1
    return time.time() + self.seconds * self.readings


def test_the_time_limit_stops_with_a_final_checkpoint_and_the_average_and_warns_the_cooldown_was_cut(
    toy_corpus, tmp_path, monkeypatch, caplog):
  """config.max_train_minutes is a guard, not a schedule: the run stops where the time runs out, saves that step
  (off the regular grid), averages its last regular checkpoints, is marked finished, and warns that its cooldown
  was cut, naming the step and the configured num_train_steps. Catches a stop without a save (the last steps
  lost), a stop that skips the average, one that goes on to num_train_steps, and a silent cut."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.cooldown_steps, config.warmup_steps = 40, 20, 5
  config.checkpoint_every_steps, config.keep_checkpoints, config.average_last_checkpoints = 2, 10, 2
  config.log_every_steps, config.eval_every_steps, config.length_buckets = 1000, 1000, (32,)
  config.max_train_minutes = 100.0  # 6,000 s: the clock below gets there within the first few steps
  monkeypatch.setattr(preemption, 'time', _FastClock(seconds=700.0))
  workdir = tmp_path / 'run'
  with caplog.at_level('WARNING'):
    train.train_and_evaluate(config, workdir)
  steps = checkpoints_lib.saved_steps(workdir)
  stopped = steps[-1]  # the final save is the step the guard stopped at
  assert 2 <= stopped < 10, steps
  assert json.loads((workdir / ensemble.FINISHED_FILE).read_text())['reason'] == 'config.max_train_minutes'
  regular = [s for s in steps if s % 2 == 0][-2:]
  assert json.loads((workdir / 'averaged' / 'averaged.json').read_text()) == {'steps': regular}
  logged = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert max(r['step'] for r in logged) == stopped
  assert (f'config.max_train_minutes=100 stopped the run at step {stopped} of config.num_train_steps=40: its '
          'learning-rate cooldown (the last 20 steps) was cut short') in caplog.text


def test_a_time_limit_reached_at_the_last_step_cuts_nothing_short(toy_corpus, tmp_path, caplog):
  """A one-step run whose config.max_train_minutes is spent by its set-up stops at that step, its last: it is
  finished by the time guard, but trained every step, so no warning says its schedule was cut."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps, config.max_train_minutes = 1, 1, 1e-4
  config.log_every_steps, config.eval_every_steps, config.length_buckets = 1, 1000, (32,)
  with caplog.at_level('WARNING'):
    train.train_and_evaluate(config, tmp_path / 'run')
  finished = json.loads((tmp_path / 'run' / ensemble.FINISHED_FILE).read_text())
  assert (finished['step'], finished['reason']) == (1, 'config.max_train_minutes')
  assert 'stopped the run at step' not in caplog.text


def test_max_train_minutes_counts_training_time_across_resumes(toy_corpus, tmp_path):
  """Each checkpoint records the run's training time; a resume continues that clock (fairseq's cumulative
  --stop-time-hours), so a run resumed past its limit takes no step, and later saves add to the earlier time."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps, config.max_train_minutes = 4, 4, 60.0
  config.log_every_steps, config.eval_every_steps = 1, 1000
  config.length_buckets = (32,)
  workdir = tmp_path / 'run'

  def trained_seconds(step):
    return json.loads((workdir / 'checkpoints' / str(step) / 'data' / 'metadata').read_text())['trained_seconds']

  def set_trained_seconds(step, seconds):
    path = workdir / 'checkpoints' / str(step) / 'data' / 'metadata'
    path.write_text(json.dumps({**json.loads(path.read_text()), 'trained_seconds': seconds}))

  started = time.time()
  train.train_and_evaluate(config, workdir)
  assert 0 < trained_seconds(4) <= time.time() - started
  set_trained_seconds(4, 3600.0)  # as if the first 4 steps had taken the whole hour

  config.num_train_steps = 6
  train.train_and_evaluate(config, workdir)  # resumed past its 60 minutes: no step
  assert checkpoints_lib.saved_steps(workdir) == [4]

  config.max_train_minutes = 90.0  # a larger limit trains on, from the hour already spent
  started = time.time()
  train.train_and_evaluate(config, workdir)
  assert checkpoints_lib.saved_steps(workdir) == [4, 6]
  assert 3600 < trained_seconds(6) <= 3600 + time.time() - started
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  # The logged minutes continue the same clock.
  assert [r['elapsed_seconds'] for r in records if 'elapsed_seconds' in r][-1] > 3600


def test_a_run_killed_in_the_evaluation_its_time_guard_ended_it_with_evaluates_that_step_when_rerun(toy_corpus,
                                                                                                    tmp_path):
  """The time guard stopped the run at step 4 of 6 and saved it; the kill came during that last step's
  evaluation (evaluated.json still names none). The rerun is past the guard, takes no step and marks the run
  finished: it must first log step 4's validation loss, the one evaluation the run's end was due."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps, config.max_train_minutes = 4, 4, 60.0
  config.log_every_steps, config.eval_every_steps, config.length_buckets = 1, 1000, (32,)
  workdir = tmp_path / 'run'
  train.train_and_evaluate(config, workdir)
  metadata = workdir / 'checkpoints' / '4' / 'data' / 'metadata'
  metadata.write_text(json.dumps({**json.loads(metadata.read_text()), 'trained_seconds': 3600.0}))
  (workdir / train.EVALUATED_FILE).unlink()
  (workdir / 'metrics.jsonl').unlink()
  config.num_train_steps = 6  # the run's length: the guard, not the steps, ended it at 4
  train.train_and_evaluate(config, workdir)
  logged = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in logged if 'eval/loss' in r] == [4]
  assert json.loads((workdir / train.EVALUATED_FILE).read_text()) == {'step': 4}
  assert checkpoints_lib.saved_steps(workdir) == [4]


def test_the_bleu_curve_joins_resumed_launches_minutes_whichever_clock_they_logged(tmp_path):
  def minutes(*records):
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    return in_process.bench_script('bleu_curve').read_log(str(tmp_path))[0]

  def start(step, seconds):
    return {'step': step, 'run/trained_seconds_at_start': seconds}

  def at(step, seconds):
    return {'step': step, 'elapsed_seconds': seconds}

  # This trainer: resumed from the checkpoint at step 20 (its clock read 20 s there); the 10 s after it that the
  # kill lost are trained again, not added.
  assert minutes(start(0, 0), at(10, 10), at(20, 20), at(30, 30), start(20, 20), at(25, 25), at(30, 30)) == {
      10: 10, 20: 20, 25: 25, 30: 30}
  # An older trainer's launches (no start logged): each resume started its clock again.
  assert minutes(at(10, 10), at(20, 20), at(25, 5)) == {10: 10, 20: 20, 25: 25}
  # Both: this trainer resuming an older checkpoint (no clock saved: starts at 0), then resumed again.
  assert minutes(at(10, 10), at(20, 20), start(20, 0), at(25, 5), start(25, 5), at(28, 8)) == {
      10: 10, 20: 20, 25: 25, 28: 28}


def test_a_call_takes_steps_per_dispatch_steps_wherever_that_many_are_left():
  """The calls of a run of config.steps_per_dispatch=4: 4 steps a call while 4 or more are left, the last of them
  included, then single steps. Catches the last full call split into single steps (a one-step program compiled
  for nothing at the run's end)."""
  def calls(num_train_steps):
    config = config_lib.base_config()
    config.steps_per_dispatch, config.num_train_steps = 4, num_train_steps
    sizes, step = [], 0
    while step < num_train_steps:
      sizes.append(train.steps_in_call(config, step))
      step += sizes[-1]
    return sizes
  assert calls(12) == [4, 4, 4]
  assert calls(14) == [4, 4, 4, 1, 1]
  assert calls(6) == [4, 1, 1]
  assert calls(3) == [1, 1, 1]


def test_steps_run_several_a_call_log_save_and_resume_as_steps_run_one_at_a_time(toy_corpus, tmp_path):
  """config.steps_per_dispatch=4 over packed batches, stopped at step 6 and resumed to 14: the calls run 0-4, then
  single steps 5, 6 (the end is nearer than 4), then after the resume 7, 8 (up to a multiple), 8-12, 13, 14. The
  logged losses, validation losses and saved steps equal those of one step a call. Catches batches taken out of
  order or skipped, a call's metrics counted as one step, and a log, evaluation or save step passed over."""
  def launches(workdir, many):
    config = small_config(toy_corpus)
    config.packed_length, config.steps_per_dispatch = 32, many
    config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps = 4, 8, 4
    for steps in (6, 14):
      config.num_train_steps = steps
      train.train_and_evaluate(config, workdir)
    return ([json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()],
            checkpoints_lib.saved_steps(workdir))

  def values(records, name):
    return {r['step']: r[name] for r in records if name in r}

  (one, one_saved), (many, many_saved) = launches(tmp_path / 'one', 1), launches(tmp_path / 'many', 4)
  # The newest 3 (config.keep_checkpoints), and the newest 3 at the 4-step interval: the final 14 is off it.
  assert many_saved == one_saved == [4, 8, 12, 14]
  assert sorted(values(many, 'train/loss')) == [4, 6, 8, 12, 14]
  for name in ('train/loss', 'train/nll', 'train/learning_rate', 'eval/loss'):
    want = values(one, name)
    assert values(many, name) == pytest.approx(want, rel=1e-5), name


def test_the_interval_summary_is_per_target_token_and_per_step_whatever_the_calls(monkeypatch):
  """Three steps in two calls (one alone, then two stacked: config.steps_per_dispatch) of 10, 30 and 60 target
  tokens, over 6 s. Catches a loss averaged per step or as the mean of the steps' per-token losses (one step an
  interval, as most tests log, cannot tell them apart), the learning rate or gradient norm of the interval's first
  step instead of its last, a step time per call instead of per step, tokens/s of the source for the target, an
  R-Drop divergence per token of both copies, and an interval that keeps the steps of the one before."""
  import types  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  clock = {'now': 1000.0}
  monkeypatch.setattr(metrics_lib, 'time', types.SimpleNamespace(time=lambda: clock['now'],
                                                                 perf_counter=time.perf_counter))
  names = ('loss_sum', 'nll_sum', 'target_tokens', 'source_tokens', 'learning_rate', 'grad_norm',
           'rdrop_divergence_sum', 'nonfinite')
  steps = [(20.0, 15.0, 10, 12, 1e-4, 3.0, 2.0, 0), (90.0, 60.0, 30, 25, 2e-4, 5.0, 9.0, 1),
           (60.0, 42.0, 60, 70, 3e-4, 7.0, 12.0, 0), (8.0, 6.0, 4, 5, 4e-4, 1.5, 1.0, 0)]
  as_metrics = lambda rows: {name: np.asarray([row[i] for row in rows]) for i, name in enumerate(names)}
  batch = {'src': np.zeros((2, 8), np.int32), 'tgt_in': np.zeros((2, 8), np.int32)}
  interval = metrics_lib.TrainInterval(None, skip_nonfinite_updates=True)
  interval.add({name: np.asarray(value) for name, value in zip(names, steps[0])}, [batch])
  interval.add(as_metrics(steps[1:3]), [batch] * 2)
  clock['now'] += 6.0
  first = interval.summarize(start_time=900.0, epoch=2)
  column = lambda rows, i: np.array([row[i] for row in rows], np.float64)
  rows = steps[:3]
  tokens = column(rows, 2).sum()
  assert first['train/loss'] == pytest.approx(column(rows, 0).sum() / tokens)  # 1.7, not 2.0 nor 56.7
  assert first['train/nll'] == pytest.approx(column(rows, 1).sum() / tokens)
  assert (first['train/learning_rate'], first['train/grad_norm']) == pytest.approx((3e-4, 7.0))
  assert first['train/step_time'] == pytest.approx(6.0 / 3)
  assert first['train/target_tokens_per_second'] == pytest.approx(tokens / 6.0)
  assert first['train/source_tokens_per_second'] == pytest.approx(column(rows, 3).sum() / 6.0)
  assert first['train/rdrop_divergence'] == pytest.approx(column(rows, 6).sum() / (tokens / 2))
  assert first['train/skipped_updates'] == 1 and first['epoch'] == 2
  assert first['elapsed_seconds'] == pytest.approx(1006.0 - 900.0)
  # The next interval holds its own step alone.
  interval.add({name: np.asarray(value) for name, value in zip(names, steps[3])}, [batch])
  clock['now'] += 1.0
  second = interval.summarize(start_time=900.0, epoch=2)
  assert second['train/loss'] == pytest.approx(8.0 / 4) and second['train/step_time'] == pytest.approx(1.0)
  assert second['train/target_tokens_per_second'] == pytest.approx(4.0)


def test_the_run_records_its_wall_time_by_phase(trained_toy):
  # Catches a phase left out of the clock or counted twice (the steps are the rest: they would come out too
  # long, or negative), and validation or saves timed around nothing.
  logged = [json.loads(line) for line in (trained_toy / 'metrics.jsonl').read_text().splitlines()]
  (phases,) = [m for m in logged if 'wall/total' in m]
  assert phases['step'] == 400
  named = {k: v for k, v in phases.items() if k.startswith('wall/') and k not in ('wall/total', 'wall/steps')}
  assert set(named) == {'wall/set-up', 'wall/compiling', 'wall/validation', 'wall/saves'}, phases
  assert phases['wall/steps'] + sum(named.values()) == pytest.approx(phases['wall/total'], rel=1e-9)
  assert all(v > 0 for v in named.values()) and phases['wall/steps'] > 0
  # Validation (two greedy BLEU decodes of the validation split and two loss passes) takes longer than the
  # four asynchronous saves' share of the loop.
  assert phases['wall/validation'] > phases['wall/saves']


def numpy_train_flops(d, f, vocab, enc_layers, dec_layers, source_tokens, target_tokens, src_len, tgt_len):
  """flops.py's documented count of an encoder-decoder step (3 x forward), written out here."""
  per_source = enc_layers * (2 * (4 * d * d + 2 * d * f) + 4 * src_len * d) + dec_layers * 2 * (2 * d * d)
  per_target = dec_layers * (2 * (6 * d * d + 2 * d * f) + 4 * tgt_len * d + 4 * src_len * d) + 2 * d * vocab
  return 3 * (source_tokens * per_source + target_tokens * per_target)


def test_throughput_counts_each_steps_own_tokens_and_lengths_over_all_devices():
  """Two steps with more source than target tokens and rows of other lengths on each side, on 2 devices. Catches
  the source and target counts (or the two padded lengths) passed in each other's place, one step's lengths used
  for another, and an MFU against one device's peak where two ran."""
  from flaxformer_nmt.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  model_config = model_lib.ModelConfig(vocab_size=50, num_encoder_layers=2, num_decoder_layers=3, d_model=16,
                                       d_ff=40, num_heads=2, max_position=128, dtype='float32')
  throughput = metrics_lib.Throughput(model_config, vocab_size=50, num_devices=2, peak_per_device=1e9)
  pending = [{'source_tokens': np.asarray(70), 'target_tokens': np.asarray(30)},
             {'source_tokens': np.asarray(20), 'target_tokens': np.asarray(45)}]
  lengths = [(24, 8), (8, 40)]
  out = throughput.metrics(pending, lengths, seconds=4.0)
  total = (numpy_train_flops(16, 40, 50, 2, 3, 70, 30, 24, 8) + numpy_train_flops(16, 40, 50, 2, 3, 20, 45, 8, 40))
  assert out['train/tflops_per_second'] == pytest.approx(total / 4.0 / 1e12, rel=1e-9)
  assert out['train/tflops_per_second_per_device'] == pytest.approx(total / 4.0 / 1e12 / 2, rel=1e-9)
  assert out['train/mfu'] == pytest.approx(total / 4.0 / (2 * 1e9), rel=1e-9)
  no_peak = metrics_lib.Throughput(model_config, vocab_size=50, num_devices=2, peak_per_device=None)
  assert 'train/mfu' not in no_peak.metrics(pending, lengths, seconds=4.0)  # no MFU of an unknown peak


def test_a_profile_window_inside_a_call_of_several_steps_is_traced(tmp_path, monkeypatch):
  """With config.steps_per_dispatch the calls begin at multiples of it: a window that starts between two of
  them (10..13 with calls at 0, 8, 16) was never traced, as only a call beginning inside it started the trace."""
  from flaxformer_nmt.runtime import profiler as profiler_lib  # pylint: disable=g-import-not-at-top
  events = []
  monkeypatch.setattr(jax.profiler, 'start_trace', lambda directory: events.append('start'))
  monkeypatch.setattr(jax.profiler, 'stop_trace', lambda: events.append('stop'))
  for steps, calls in ((8, (0, 8, 16, 24)), (1, range(20))):
    events.clear()
    profile = profiler_lib.Profiler(tmp_path, start=10, steps=4)
    for step in calls:
      profile.before_step(step, steps)
      events.append(step)
      profile.after_step(step + steps, jax.numpy.zeros(()))
    traced = events[events.index('start') + 1:events.index('stop')]
    assert events.count('start') == events.count('stop') == 1
    assert traced == ([8] if steps == 8 else [10, 11, 12, 13]), events


def test_the_validation_loss_is_per_target_token_over_every_batch(monkeypatch):
  """Two validation batches of 10 and 90 target tokens: the loss, NLL and masked-token accuracy are the sums over
  both divided by the 100 tokens, perplexity exp(NLL). Catches the mean of the batches' per-token values (a short
  last batch weighing as much as a full one), and a perplexity of the label-smoothed loss."""
  sums = [{'loss_sum': 30.0, 'nll_sum': 20.0, 'target_tokens': 10.0, 'correct': 9.0},
          {'loss_sum': 90.0, 'nll_sum': 45.0, 'target_tokens': 90.0, 'correct': 27.0}]
  monkeypatch.setattr(train.sharding, 'put_batch', lambda batch, sharding: batch)
  out = train.evaluate(lambda params, batch: {k: np.float32(v) for k, v in batch.items()}, None, sums, None)
  assert out['eval/loss'] == pytest.approx(120.0 / 100)  # not (3.0 + 1.0) / 2
  assert out['eval/nll'] == pytest.approx(65.0 / 100)
  assert out['eval/perplexity'] == pytest.approx(np.exp(65.0 / 100))
  assert out['eval/accuracy'] == pytest.approx(36.0 / 100)


def test_the_first_call_of_each_batch_shape_is_timed_as_compiling(monkeypatch):
  """Length-bucketed batches compile the train step once per bucket: each bucket's first call is compiling,
  not step time (only the first call per steps-per-call count was, so the other buckets' compiles went into
  the steps' time, tokens/s and MFU)."""
  import types  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  shapes = [(4, 16), (4, 16), (2, 32), (4, 16), (2, 32), (1, 64)]
  batches = iter({'src': np.zeros(shape, np.int32), 'tgt': np.zeros(shape, np.int32)} for shape in shapes)
  run = types.SimpleNamespace(train_batches=None, dispatched=set(), state=0, batch_sharding=None,
                              train_fn=lambda state, batch: (state + 1, {}))
  interval = types.SimpleNamespace(next_batch=lambda _: next(batches), add=lambda metrics, batches: None,
                                   paused=contextlib.nullcontext)
  phases = []

  class Clock(metrics_lib.WallClock):
    def phase(self, name):
      phases.append((run.state, name))
      return super().phase(name)

  monkeypatch.setattr(train.sharding, 'put_batch', lambda batch, sharding: batch)
  for _ in shapes:
    train.dispatch_steps(run, interval, 1, Clock())
  assert phases == [(0, 'compiling'), (2, 'compiling'), (5, 'compiling')]


@pytest.fixture
def step_clock(monkeypatch):
  """The interval clock (metrics.py's time) as a dict {'now': seconds} that each dispatched train step advances
  by 1 s and nothing else, unless a test adds more."""
  import types  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  clock = {'now': time.time()}
  monkeypatch.setattr(metrics_lib, 'time', types.SimpleNamespace(time=lambda: clock['now'],
                                                                 perf_counter=time.perf_counter))
  dispatch = train.dispatch_steps

  def timed_dispatch(run, interval, count, wall):
    out = dispatch(run, interval, count, wall)
    clock['now'] += 1.0 * count
    return out
  monkeypatch.setattr(train, 'dispatch_steps', timed_dispatch)
  return clock


def logged_intervals(workdir):
  """(every metrics.jsonl record, the train intervals' records by step)."""
  logged = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return logged, {m['step']: m for m in logged if 'train/step_time' in m}


def test_evaluation_time_is_kept_out_of_the_interval_and_its_steps_are_not(toy_corpus, tmp_path, monkeypatch,
                                                                           step_clock):
  """The interval clock (metrics.py's time) advances 1 s per train step and 100 s per evaluation, and nothing
  else: every logged interval then lasts 1 s a step. Evaluation at step 6 falls inside the 5..8 interval (eval
  every 6, log every 4): the clock restarted there dropped steps 5 and 6's seconds but kept their tokens (0.5 s a
  step). A resume whose first step catches up a missed evaluation booked that evaluation into its first interval
  (26 s a step). The resume catches up step 12's evaluation though evaluated.json names an earlier one."""
  evaluate = train.evaluate_step

  def timed_evaluation(*args):
    out = evaluate(*args)
    step_clock['now'] += 100.0 if out else 0.0  # called after every step, evaluating where one is due
    return out
  monkeypatch.setattr(train, 'evaluate_step', timed_evaluation)
  config = small_config(toy_corpus)
  config.length_buckets = (32,)
  config.num_train_steps, config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps = 12, 4, 6, 6
  workdir = tmp_path / 'run'
  train.train_and_evaluate(config, workdir)
  # As if the run had stopped during step 12's evaluation (step 6's, the one before, ended).
  (workdir / train.EVALUATED_FILE).write_text(json.dumps({'step': 6}))
  config.num_train_steps = 16
  train.train_and_evaluate(config, workdir)
  logged, intervals = logged_intervals(workdir)
  assert sorted(intervals) == [4, 8, 12, 16]
  assert [m['step'] for m in logged if 'eval/loss' in m] == [6, 12, 12, 16]
  for step, m in intervals.items():
    assert m['train/step_time'] == pytest.approx(1.0), step
    assert m['train/data_wait_fraction'] == 0.0, step


def test_a_new_batch_shape_s_compile_is_kept_out_of_the_interval(toy_corpus, tmp_path, monkeypatch, step_clock):
  """The interval clock advances 1 s per train step and 50 s inside the first call of each batch shape (its
  compile), and nothing else: every logged interval then lasts 1 s a step. Catches a compile booked as step time
  (a length bucket's first batch slowed its interval's tokens/s and MFU)."""
  shapes, put_batch = set(), train.sharding.put_batch

  def compiling_put_batch(batch, batch_sharding):  # called inside the first call's compiling phase, as jit is
    shape = tuple(np.shape(x) for x in jax.tree_util.tree_leaves(batch))
    step_clock['now'] += 50.0 if shape not in shapes else 0.0
    shapes.add(shape)
    return put_batch(batch, batch_sharding)
  monkeypatch.setattr(train.sharding, 'put_batch', compiling_put_batch)
  config = small_config(toy_corpus)
  config.length_buckets = (8, 16, 32)
  config.num_train_steps, config.log_every_steps, config.eval_every_steps = 12, 4, 100
  workdir = tmp_path / 'run'
  train.train_and_evaluate(config, workdir)
  assert len(shapes) > 1
  _, intervals = logged_intervals(workdir)
  assert sorted(intervals) == [4, 8, 12]
  for step, m in intervals.items():
    assert m['train/step_time'] == pytest.approx(1.0), step
