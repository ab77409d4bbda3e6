"""config.fit_schedule_to_time: the run's end fitted to its time limit (time_budget.py), measured once and kept
on resume; config.max_train_minutes counted across resumes, and bench/bleu_curve.py's minutes with it."""
import json
import time
import types

import numpy as np
import pytest

import in_process
from conftest import check_pinned_refit_learning_rates, small_config
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing.workdir import ConfigError, validate_config
from flaxformer_nmt.training import loop as train
from flaxformer_nmt.training import step as ts
from flaxformer_nmt.training import time_budget


def test_fitted_steps_are_the_time_left_at_the_measured_rate_never_more_than_configured():
  # 1,000 s left at 2 s a step after 500 updates: 500 more (the bent schedule needs no compiling).
  assert time_budget.fitted_num_train_steps(500, 1000.0, 2.0, 2250) == 1000
  assert time_budget.fitted_num_train_steps(500, 1001.9, 2.0, 2250) == 1000  # whole steps only
  assert time_budget.fitted_num_train_steps(500, 991.0, 2.0, 2250) == 995
  assert time_budget.fitted_num_train_steps(500, 5000.0, 2.0, 2250) == 2250  # never lengthened
  assert time_budget.fitted_num_train_steps(500, 1.0, 2.0, 2250) == 501  # no time: one last step


def test_a_fitted_run_saves_closer_together_in_the_proportion_its_cooldown_shrank():
  config = fit_config()
  config.checkpoint_every_steps = 100
  # The hour on a Zen 3 EPYC: the 1,750-step cooldown became 449 steps: a save every 26 steps, not 100.
  assert time_budget.checkpoint_every_steps(config, ts.FittedEnd(949, 500, 1.0)) == 26
  assert time_budget.checkpoint_every_steps(config, ts.FittedEnd(2250, 500, 1.0)) == 100  # it fit
  assert time_budget.checkpoint_every_steps(config, None) == 100
  assert time_budget.checkpoint_every_steps(config, ts.FittedEnd(501, 500, 1.0)) == 1
  # multi30k_best on a float32 Zen 3: a 6,000-step cooldown fitted to run from step 2,700 to 5,400 keeps the
  # proportion too (2,700 of 6,000: every 90 steps, not 200), measured against the configured cooldown's length
  # and not against the 9,300 steps from the early knot to the configured end.
  recipe = recipe_schedule()
  assert time_budget.checkpoint_every_steps(recipe, ts.FittedEnd(5400, 2700, 1.0)) == 90


def recipe_schedule():
  """multi30k_best's schedule: warmup 2,000, cooldown over the second half of 12,000 steps, a save every 200."""
  c = config_lib.base_config()
  c.num_train_steps, c.cooldown_steps, c.warmup_steps, c.max_train_minutes = 12000, 6000, 2000, 140.0
  c.checkpoint_every_steps, c.log_every_steps, c.fit_schedule_to_time = 200, 50, True
  return c


def test_a_fitted_cooldown_keeps_its_share_of_the_run_from_the_warmup_end_to_the_configured_start():
  recipe = recipe_schedule()
  assert time_budget.fitted_knot(recipe, 5400) == 2700  # half of what fits, as half of 12,000
  assert time_budget.fitted_knot(recipe, 11908) == 5954
  assert time_budget.fitted_knot(recipe, 12000) == 6000  # it fits: as configured
  assert time_budget.fitted_knot(recipe, 3000) == 2000  # not inside the warmup
  hour = fit_config()  # the cooldown begins where the warmup ends: it stays there
  assert [time_budget.fitted_knot(hour, end) for end in (600, 949, 2250)] == [500, 500, 500]


class FakeClock:
  def __init__(self, *times):
    self.times = list(times)

  def time(self):
    return self.times.pop(0)


def fit_config():
  c = config_lib.base_config()
  c.num_train_steps, c.cooldown_steps, c.warmup_steps, c.max_train_minutes = 2250, 1750, 500, 60.0
  c.fit_schedule_to_time = True
  return c


def test_the_fit_measures_from_the_first_step_to_the_cooldown_start_and_is_written_for_resumes(tmp_path,
                                                                                                 monkeypatch):
  config = fit_config()
  fit = time_budget.ScheduleFit(config, tmp_path, first_step=0, bends=[])
  assert fit.fit_step == 500  # where the cooldown begins
  monkeypatch.setattr(time_budget, 'time', types.SimpleNamespace(time=FakeClock(100.0, 1098.0).time))
  fit.first_step_done(1)
  assert not fit.due(499, 1002.0) and fit.due(500, 1000.0)
  # 499 steps in 998 s: 2 s a step; 1,000 s left hold 500 steps (nothing held back for compiling: the bent
  # schedule runs on the compiled step).
  fitted = fit.fit(500, 1000.0, state=np.zeros(1))
  assert fitted == ts.FittedEnd(num_train_steps=1000, knot_step=500, knot_ramp=1.0)
  assert not fit.enabled  # the fit is decided once (refits follow, see below)
  assert time_budget.load(tmp_path) == [fitted]
  record = json.loads((tmp_path / time_budget.FILE).read_text())
  assert record['seconds_per_step'] == pytest.approx(2.0) and record['configured_num_train_steps'] == 2250
  # A resumed run follows the decision instead of measuring again.
  resumed = time_budget.ScheduleFit(config, tmp_path, first_step=600, bends=[fitted])
  assert not resumed.enabled and resumed.current == fitted and resumed.end() == 1000


def test_where_the_configured_cooldown_start_comes_too_late_the_fit_is_decided_when_its_own_start_arrives(
    tmp_path, monkeypatch):
  """A float32 CPU at 2 s a step with 9,998 s: 5,000 steps fit, so the cooldown must begin at 2,500, long
  before the configured 6,000 (which comes after 12,000 s, past the limit: no cooldown at all)."""
  recipe = recipe_schedule()
  fit = time_budget.ScheduleFit(recipe, tmp_path, first_step=0, bends=[])
  clock = FakeClock(0.0, *[2.0 * (s - 1) for s in (2450, 2500, 2500)])
  monkeypatch.setattr(time_budget, 'time', types.SimpleNamespace(time=clock.time))
  fit.first_step_done(1)
  left = lambda s: 9998.0 - 2.0 * (s - 1)  # pylint: disable=unnecessary-lambda-assignment
  assert not fit.due(2449, left(2449))  # not a logging step: no projection (the clock is not read)
  assert not fit.due(2450, left(2450))  # 5,000 fit: their cooldown begins at 2,500
  assert fit.due(2500, left(2500))
  assert fit.fit(2500, left(2500), state=np.zeros(1)) == ts.FittedEnd(5000, 2500, 1.0)
  assert time_budget.load(tmp_path) == [ts.FittedEnd(5000, 2500, 1.0)]


def test_an_early_projection_the_devices_rate_does_not_confirm_waits(tmp_path, monkeypatch):
  """The projection reads the dispatch clock; the fit waits for the device. Where the device's rate puts the
  fitted cooldown's start later, nothing is decided or written and the fit is asked again later."""
  recipe = recipe_schedule()
  fit = time_budget.ScheduleFit(recipe, tmp_path, first_step=0, bends=[])
  # The projection at 2,500 sees 2 s a step; the device, waited for, 1.9 s: 5,262 fit, a cooldown from 2,631.
  monkeypatch.setattr(time_budget, 'time', types.SimpleNamespace(time=FakeClock(0.0, 4998.0, 1.9 * 2499).time))
  fit.first_step_done(1)
  assert fit.due(2500, 9998.0 - 4998.0)
  assert fit.fit(2500, 9998.0 - 1.9 * 2499, state=np.zeros(1)) is None
  assert fit.enabled and not (tmp_path / time_budget.FILE).exists()


def test_a_machine_whose_steps_fit_is_decided_at_the_configured_cooldown_start_only(tmp_path, monkeypatch):
  recipe = recipe_schedule()
  fit = time_budget.ScheduleFit(recipe, tmp_path, first_step=0, bends=[])
  monkeypatch.setattr(time_budget, 'time', types.SimpleNamespace(time=lambda: 0.5 * fit.now))
  fit.now = 1
  fit.first_step_done(1)
  for step in range(150, 6000, 50):  # 0.5 s a step: 12,000 steps take 100 of the 140 minutes
    fit.now = step - 1
    assert not fit.due(step, 8400.0 - 0.5 * (step - 1))
  assert fit.due(6000, 8400.0 - 0.5 * 5999)


def test_a_run_that_fits_keeps_its_steps_and_a_late_resume_measures_its_own_steps_first(tmp_path, monkeypatch):
  config = fit_config()
  fit = time_budget.ScheduleFit(config, tmp_path, first_step=800, bends=[])
  assert fit.fit_step == 900  # resumed past the cooldown's start: MIN_MEASURED_STEPS of its own first
  monkeypatch.setattr(time_budget, 'time', types.SimpleNamespace(time=FakeClock(0.0, 99.0).time))
  fit.first_step_done(801)
  assert fit.fit(900, 5000.0, state=np.zeros(1)) is None  # 1 s a step: 2,250 fit
  assert time_budget.load(tmp_path)[0].num_train_steps == 2250  # recorded: a resume does not measure again


def drifting_fit(tmp_path, monkeypatch):
  """fit_config's run fitted at update 500 after 499 steps of 2 s (1,000 s left: the end at 1,000), logging
  every 50 steps, on a clock the test moves: (the ScheduleFit, the clock's setter)."""
  config = fit_config()
  config.log_every_steps = 50
  fit = time_budget.ScheduleFit(config, tmp_path, first_step=0, bends=[])
  clock = types.SimpleNamespace(now=0.0)
  monkeypatch.setattr(time_budget, 'time', types.SimpleNamespace(time=lambda: clock.now))
  fit.first_step_done(1)
  clock.now = 998.0
  assert fit.fit(500, 1000.0, state=np.zeros(1)) == ts.FittedEnd(1000, 500, 1.0)
  return fit, clock


def test_a_machine_that_slows_after_the_fit_bends_the_cooldown_again_from_the_learning_rate_in_force(
    tmp_path, monkeypatch):
  """After the fit the steps take 3 s, not 2: 100 steps later 700 s hold 233 more steps, so the end moves from
  1,000 to 833, and the cooldown runs from its value at update 600 under the fit ((1000 - 600) / 500) to 0
  there. Catches a refit measured from the run's start (2.33 s a step: the end at 900), one bent from the
  configured ramp (1.0 at update 600), a refit before MIN_MEASURED_STEPS or off a logging step."""
  fit, clock = drifting_fit(tmp_path, monkeypatch)
  for step in (550, 599):
    clock.now = 998.0 + 3.0 * (step - 500)
    assert not fit.due(step, 1000.0 - 3.0 * (step - 500))  # fewer than 100 steps since the fit; not a log step
  clock.now = 998.0 + 300.0
  assert fit.due(600, 700.0)
  refit = fit.fit(600, 700.0, state=np.zeros(1))
  assert (refit.num_train_steps, refit.knot_step) == (833, 600)
  assert refit.knot_ramp == pytest.approx((1000 - 600) / (1000 - 500))
  assert fit.end() == 833 and time_budget.load(tmp_path) == [ts.FittedEnd(1000, 500, 1.0), refit]
  record = json.loads((tmp_path / time_budget.FILE).read_text())
  # The fit's fields and save interval (1,000 x 500 / 1,750) stay; the refit is recorded under them.
  assert record['num_train_steps'] == 1000 and record['checkpoint_every_steps'] == 286
  assert record['refits'][0]['seconds_per_step'] == pytest.approx(3.0)
  # At the same pace the next projections agree with the refitted end: nothing moves.
  clock.now = 998.0 + 3.0 * 150
  assert not fit.due(650, 700.0 - 150.0)


def test_a_refit_waits_for_a_difference_of_two_percent_of_the_steps_left_and_never_passes_the_configured_end(
    tmp_path, monkeypatch):
  """100 steps after the fit 400 are left: a projection 3 steps short waits, one 13 short (> 8) refits; twice
  as fast lengthens the run, at most to the configured 2,250. Catches a refit on any difference (a bend at every
  logging step), a fixed margin of a logging interval (50: the 13 would wait), and a run lengthened past its
  configured steps."""
  fit, clock = drifting_fit(tmp_path, monkeypatch)
  clock.now = 998.0 + 2.01 * 100  # 799 s left hold 397 more steps: the end at 997
  assert not fit.due(600, 799.0)
  clock.now = 998.0 + 2.05 * 100  # 795 s hold 387: the end at 987
  assert fit.due(600, 795.0) and fit.fit(600, 795.0, state=np.zeros(1)).num_train_steps == 987
  clock.now = 998.0 + 150.0  # 1 s a step since the fit: 800 s left hold 800 more steps
  assert fit.due(650, 800.0) and fit.fit(650, 800.0, state=np.zeros(1)).num_train_steps == 1450
  clock.now = 998.0 + 200.0
  assert fit.due(700, 4000.0)  # (a limit far off)
  assert fit.fit(700, 4000.0, state=np.zeros(1)).num_train_steps == 2250


def test_a_resumed_run_replays_the_recorded_bends_at_their_knots_then_measures_its_own_steps(tmp_path,
                                                                                               monkeypatch):
  """A launch resumed from update 550 (between the fit at 500 and the refit at 600) runs on the fit until 600
  and on the refit from there, as the first launch did, whatever its own clock says; only then does it refit
  on its own measurements."""
  fit, clock = drifting_fit(tmp_path, monkeypatch)
  clock.now = 998.0 + 300.0
  refit = fit.fit(600, 700.0, state=np.zeros(1))
  bends = time_budget.load(tmp_path)
  resumed = time_budget.ScheduleFit(fit.config, tmp_path, first_step=550, bends=bends)
  assert resumed.current == bends[0] and resumed.end() == 1000 and not resumed.enabled
  clock.now = 5000.0
  resumed.first_step_done(551)
  monkeypatch.setattr(time_budget, 'fitted_num_train_steps', None)  # a replay measures nothing
  assert not resumed.due(599, 10.0) and resumed.due(600, 10.0)
  assert resumed.fit(600, 10.0, state=np.zeros(1)) == refit and resumed.end() == 833
  assert time_budget.load(tmp_path) == bends  # nothing written
  assert not resumed.due(650, 10.0)  # 99 steps of its own so far
  assert time_budget.in_force(bends, 499) is None and time_budget.in_force(bends, 600) == refit


def test_a_launch_resumed_before_the_fits_knot_saves_on_the_configured_grid_until_the_replay(tmp_path,
                                                                                              monkeypatch):
  """The first launch saved every 500 steps up to the fit at update 500 and every 143 from there (500 x 500 /
  1,750). A launch resumed from update 300, after the fit was recorded (a later checkpoint lost), must save at 500
  as the first launch did, and every 143 only once the replayed fit is in force. Catches the interval taken from
  the recorded bends rather than the bend in force (a save at 429 instead of 500)."""
  config = fit_config()
  config.checkpoint_every_steps = 500
  drifting_fit(tmp_path, monkeypatch)
  bends = time_budget.load(tmp_path)
  resumed = time_budget.ScheduleFit(config, tmp_path, first_step=300, bends=bends)
  assert resumed.current is None and resumed.save_every() == 500 and resumed.end() == 2250
  resumed.first_step_done(301)
  assert resumed.due(500, 10.0) and resumed.fit(500, 10.0, state=np.zeros(1)) == bends[0]
  assert resumed.save_every() == 143 and resumed.end() == 1000
  # A launch resumed after the knot runs on the fit and its interval from its first step.
  assert time_budget.ScheduleFit(config, tmp_path, first_step=700, bends=bends).save_every() == 143


@pytest.mark.parametrize('field, value', [('max_train_minutes', 0.0), ('cooldown_steps', 0)])
def test_fitting_without_a_time_limit_or_a_cooldown_is_a_config_error(toy_corpus, field, value):
  config = small_config(toy_corpus)
  config.max_train_minutes, config.cooldown_steps, config.fit_schedule_to_time = 10.0, 10, True
  validate_config(config)
  config[field] = value
  with pytest.raises(ConfigError, match=f'config.{field}'):
    validate_config(config)


def test_the_trainer_fits_where_the_fitted_cooldown_begins_refits_inside_it_and_stops_at_its_end(
    toy_corpus, tmp_path, monkeypatch, traces):
  """The loop's side: the fit is projected at logging steps with this run's measurements and decided where the
  fitted cooldown (its configured two thirds of the run) begins, before the configured start; the step runs
  on the bent schedule without compiling again (the learning rate logged at every step follows it); where the
  pace since the fit projects another end, the cooldown is bent again from the learning rate in force; the run
  stops at the refitted end, and the same command afterwards trains nothing more. The arithmetic is pinned to
  40 steps up to step 24, 37 from step 25 on."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.cooldown_steps, config.warmup_steps = 60, 40, 10
  config.max_train_minutes, config.fit_schedule_to_time = 100.0, True
  config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps = 1, 1000, 10
  config.keep_checkpoints = config.average_last_checkpoints = 3
  config.length_buckets = (32,)  # few batch shapes to compile
  asked = []

  def pinned(step, seconds_left, seconds_per_step, configured):
    asked.append((step, seconds_left, seconds_per_step, configured))
    return 40 if step < 25 else 37
  monkeypatch.setattr(time_budget, 'fitted_num_train_steps', pinned)
  monkeypatch.setattr(time_budget, 'MIN_MEASURED_STEPS', 10)  # a run this short measures less
  refits, refit, calls, call = [], ts.TrainStep.refit, [], ts.TrainStep.__call__
  monkeypatch.setattr(ts.TrainStep, 'refit', lambda self, fitted: refits.append(refit(self, fitted)) or refits[-1])

  def counted_call(self, state, batch):  # (the jitted function, the batch shape, whether the call traced)
    before = traces.count('_train')
    out = call(self, state, batch)
    calls.append((self.jitted, batch['src'].shape, traces.count('_train') > before))
    return out
  monkeypatch.setattr(ts.TrainStep, '__call__', counted_call)
  workdir = tmp_path / 'run'
  train.train_and_evaluate(config, workdir)
  # Both schedules ran the same compiled programs, one per batch shape: the fit changed the numbers the step
  # reads, not the step. (A step traced earlier in this process, by another test, is not traced again.)
  refitted = ts.FittedEnd(37, 25, pytest.approx(15 / 27))  # from the first bend's (40 - 25) / (40 - 13) to 0
  assert [r.fitted for r in refits] == [ts.FittedEnd(40, 13, 1.0), refitted]
  assert {jitted for jitted, _, _ in calls} == {refits[0].jitted}
  traced_shapes = [shape for _, shape, traced in calls if traced]
  assert len(traced_shapes) == len(set(traced_shapes))

  # Projected from 10 measured steps on; 40 steps fit, so the cooldown keeps 40/60 of them: it begins after
  # update round(40 / 3) = 13, where the fit is decided (the configured start is 20). Refits are projected at
  # every logging step from 10 steps after the fit on; the one at 25 moves the end, later ones agree with it.
  assert [a[0] for a in asked] == [11, 12, 13, 13, 23, 24, 25, 25, *range(26, 38)] and {a[3] for a in asked} == {60}
  for _, seconds_left, seconds_per_step, _ in asked:
    assert 0 < seconds_per_step < 60 and 5000 < seconds_left <= 6000
  check_pinned_refit_learning_rates(workdir, config.model.d_model, config.learning_rate_scale)
  assert time_budget.load(workdir) == [ts.FittedEnd(40, 13, 1.0), refitted]
  # Saves every 7 steps from the fit on (the cooldown of 27 steps against the configured 40: 10 x 27/40), so
  # the last 3 averaged span the same share of it as the configured 10-step grid would have.
  assert checkpoints_lib.saved_steps(workdir) == [28, 35, 37]
  # The end, off that grid, is left out of the average (checkpoints.averaging_window), as a time-limited end is.
  assert json.loads((workdir / 'averaged' / 'averaged.json').read_text())['steps'] == [28, 35]
  assert checkpoints_lib.regular_save_interval(workdir) == 7  # what `python -m flaxformer_nmt.average` uses

  monkeypatch.setattr(time_budget, 'fitted_num_train_steps', None)  # a resume must not fit again
  train.train_and_evaluate(config, workdir)
  assert max(json.loads(line)['step'] for line in (workdir / 'metrics.jsonl').read_text().splitlines()) == 37


def test_a_run_the_time_limit_cut_is_told_to_fit_its_schedule_only_where_it_was_not_fitted(caplog):
  """A fitted run that still ran out of time must not be told to set fit_schedule_to_time (it is set); it is
  told how far short of its fitted end it stopped. An unfitted one is told the two ways out."""
  with caplog.at_level('WARNING'):
    time_budget.warn_cooldown_cut(1884, 1900, fitted=True)
  assert 'step 1884, 16 steps before the end fitted to it (step 1900)' in caplog.text
  assert 'fit_schedule_to_time' not in caplog.text
  caplog.clear()
  with caplog.at_level('WARNING'):
    time_budget.warn_cooldown_cut(949, 2250, fitted=False)
  assert 'before its learning-rate cooldown ended at step 2250' in caplog.text
  assert 'set config.fit_schedule_to_time' in caplog.text


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
