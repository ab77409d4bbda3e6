"""Fitting a run's end to its time limit (config.fit_schedule_to_time).

A recipe such as configs/multi30k.py sizes num_train_steps to one machine; on a slower one
config.max_train_minutes stops the run before the cooldown has brought the learning rate down, and the last
checkpoints (those averaged) are taken at a high learning rate. With fit_schedule_to_time the trainer measures
how long a step takes on this machine (from the run's first step, the evaluations and saves included; at least
MIN_MEASURED_STEPS) and, if the configured steps do not fit in the time left, bends the cooldown to end at the
last step that does (FittedEnd): the learning rate still reaches zero when the time is up.

The bent cooldown keeps its configured share of the run (half of it in configs/multi30k_best.py), beginning no
earlier than the warmup's end and no later than the configured cooldown start: a machine twice as slow trains
half the steps on the same shape of schedule. Where the configured cooldown start itself lies past the time
limit (a float32 CPU at 1.55 s a step reaches multi30k_best's step 6,000 after 155 of its 140 minutes), only
this keeps the run from stopping at a high learning rate with no cooldown at all. So the trainer projects the
fit at every logging step and decides when the fitted cooldown's start arrives; on a machine where the steps
fit that is the configured start, where it measures once more and changes nothing. A run never goes past
num_train_steps: on a faster machine the recipe stays as written. The regular saves then come closer together in
the proportion the cooldown shrank, so the last average_last_checkpoints still span the configured share of
it (averaging the last 5 of a 100-step grid over a 450-step cooldown would reach back to the peak learning
rate: valid 36.93 against 38.91 for the last checkpoint, bench/RESULTS.md). Inside the cooldown the rate is
measured again (ScheduleFit: refits), so a machine whose pace drifts after the fit still ends its cooldown at
the time limit. Every decision is written to {workdir}/fitted_schedule.json; a resumed run replays them at the
updates where they were taken (every update keeps the learning rate it had in the launch that first ran it),
then measures its own steps.
"""
import json
import time

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from flaxformer_nmt.checkpointing.checkpoints import FITTED_SCHEDULE_FILE as FILE
from flaxformer_nmt.training.step import FittedEnd, cooldown_factor

# Steps measured before deciding: enough for the step time to settle after the first (compiling) step.
MIN_MEASURED_STEPS = 100
# A refit moves the end where the pace since the fit puts it at least this share of the steps left away (and
# at least one step): early in the cooldown small differences wait for more measurement, near its end every
# step counts. (With a logging interval as the margin, the hour on an AMD EPYC Zen 3, fitted at 1.59 s a step
# to end at step 2,167 and then running at 1.47, waited until the gap reached 100 steps: one refit, at step
# 1,500, to 2,268, reached 26 s before the limit; without it the run would have ended ~2.5 minutes early.)
REFIT_TOLERANCE = 0.02


def fitted_num_train_steps(step, seconds_left, seconds_per_step, configured):
  """The last update that fits after `step` updates: the steps that seconds_left hold at seconds_per_step,
  never more than `configured` and at least one more. (The bent schedule runs on the step already compiled:
  no time is held back for compiling.)"""
  fit = step + int(seconds_left // seconds_per_step)
  return max(step + 1, min(configured, fit))


def configured_knot(config):
  """The update where the configured cooldown begins."""
  return config.num_train_steps - config.cooldown_steps


def fitted_knot(config, fitted_end):
  """Where the cooldown of a run fitted to end after `fitted_end` updates begins: it keeps its configured share
  of the run, never starting before the warmup has ended nor after the configured start."""
  share = config.cooldown_steps / config.num_train_steps
  proportional = int(round(fitted_end * (1.0 - share)))
  return min(configured_knot(config), max(config.warmup_steps, proportional))


def checkpoint_every_steps(config, fitted):
  """The regular save interval from the fit on: config.checkpoint_every_steps shrunk as the cooldown was (the
  fitted cooldown's length over the configured one's, or over what was left of it for a fit decided inside it)."""
  if fitted is None:
    return config.checkpoint_every_steps
  configured_span = config.num_train_steps - max(fitted.knot_step, configured_knot(config))
  share = min(1.0, (fitted.num_train_steps - fitted.knot_step) / configured_span)
  return max(1, int(config.checkpoint_every_steps * share + 0.5))


def load(workdir):
  """The bends an earlier launch of this workdir decided, in order (the first fit, then its refits): [] if none."""
  path = epath.Path(workdir) / FILE
  if not path.exists():
    return []
  fields = json.loads(path.read_text())
  return [FittedEnd(int(bend['num_train_steps']), int(bend['knot_step']), float(bend['knot_ramp']))
          for bend in [fields, *fields.get('refits', [])]]


def in_force(bends, step):
  """The bend the update after `step` updates runs on (the last whose knot it has reached), or None."""
  reached = [bend for bend in bends if bend.knot_step <= step]
  return reached[-1] if reached else None


class ScheduleFit:
  """The measurements and decisions, driven by the training loop: `first_step_done` after the first
  (compiling) step of this process, `due` after each step, `fit` when due.

  The first decision (the fit) is taken where the fitted cooldown begins. The steps after it can run at
  another rate than those before it (the machine's speed drifts; saves come closer together): a run fitted
  from 0.89 s a step stopped 283 steps short of its fitted end at 0.05 of the peak learning rate (AMD EPYC
  Zen 3, 2026-12-02). So from the fit on, at logging steps, the rate since the fit is projected again, and
  where the time left holds more or fewer steps than the cooldown has left (REFIT_TOLERANCE), the cooldown is
  bent again from the learning rate in force (a refit; never past config.num_train_steps). Every bend is
  recorded; a resumed launch replays those after its checkpoint at their knots, then measures its own steps."""

  def __init__(self, config, workdir, first_step, bends):
    self.config, self.workdir = config, epath.Path(workdir)
    self.on = bool(config.get('fit_schedule_to_time', False))
    self.bends = list(bends)  # the run's decisions so far, as recorded
    self.pending = [bend for bend in self.bends if bend.knot_step > first_step]  # replayed at their knots
    self.current = in_force(self.bends, first_step)
    # The last update at which to decide: the configured cooldown start, or later for a run resumed past it.
    self.fit_step = max(configured_knot(config), first_step + MIN_MEASURED_STEPS)
    self.check_every = max(1, config.log_every_steps)  # projections at logging steps, where the loop syncs anyway
    self.reference = None  # (step, time) after the first step
    self.refit_reference = None  # (step, time) the refits' rate is measured from: the fit, or a resume's first step

  def first_step_done(self, step):
    """Called after the first (compiling) step of this process: the rate is measured from here."""
    self.reference = (step, time.time())
    if self.refitting:
      self.refit_reference = self.reference

  @property
  def enabled(self):
    """The first decision (the fit) is still to take."""
    return self.on and not self.bends

  @property
  def refitting(self):
    """The fit is taken: what is left is refits."""
    return self.on and bool(self.bends)

  def end(self):
    """The update the run ends after, as the bends so far have it."""
    return self.current.num_train_steps if self.current is not None else self.config.num_train_steps

  def save_every(self):
    """The regular save interval: the one the fit chose (refits keep it) from the fit's knot on, the configured
    one before it. (A launch resumed before the knot has the fit among its recorded bends, not yet in force: it
    saves on the configured grid until the replay, as the first launch did.)"""
    return checkpoint_every_steps(self.config, self.bends[0] if self.current is not None else None)

  def _ramp_now(self, step):
    """The cooldown's factor at update `step` on the schedule in force: where a new bend starts from."""
    in_force_now = self.current or FittedEnd.unbent(self.config.num_train_steps, self.config.cooldown_steps)
    return float(cooldown_factor(step, self.config.num_train_steps, self.config.cooldown_steps, in_force_now))

  def due(self, step, seconds_left):
    """Whether to decide after `step` updates: a recorded bend's knot; the fit at the configured cooldown start,
    or earlier at a logging step where the rate so far projects a fitted end whose cooldown has already begun
    (fitted_knot); a refit where the projection moves the end (REFIT_TOLERANCE)."""
    if self.pending:
      return self.pending[0].knot_step == step
    if self.reference is None:
      return False
    if self.refitting:
      return self._refit_due(step, seconds_left)
    if not self.enabled:
      return False
    if step == self.fit_step:
      return True
    measured = step - self.reference[0]
    if step > self.fit_step or measured < MIN_MEASURED_STEPS or step % self.check_every:
      return False
    end = fitted_num_train_steps(step, seconds_left, (time.time() - self.reference[1]) / measured,
                                 self.config.num_train_steps)
    return self._agreed(self._cooldown_begun(step, end))

  def _refit_due(self, step, seconds_left):
    since, then = self.refit_reference
    if step - since < MIN_MEASURED_STEPS or step % self.check_every:
      return False
    end = fitted_num_train_steps(step, seconds_left, (time.time() - then) / (step - since),
                                 self.config.num_train_steps)
    return self._agreed(self._moved(step, end))

  def _moved(self, step, end):
    """Whether a projected `end` is far enough from the end in force to refit (REFIT_TOLERANCE)."""
    return abs(end - self.end()) >= max(1, REFIT_TOLERANCE * (self.end() - step))

  @staticmethod
  def _agreed(decision):
    """Every host decides at the same update: process 0's projection."""
    if jax.process_count() > 1:
      decision = bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))
    return decision

  def _cooldown_begun(self, step, end):
    """Whether a run fitted to end at `end` would have begun its cooldown by `step`: the early decision's rule,
    for the projection (`due`) and for the device's measured rate (`fit`)."""
    return end < self.config.num_train_steps and fitted_knot(self.config, end) <= step

  def _measured_end(self, step, seconds_left, reference, now):
    """(the last update that fits at the rate from `reference` to `now`, that rate): the device's, waited for by
    the caller; process 0's on every host."""
    seconds_per_step = (now - reference[1]) / (step - reference[0])
    end = fitted_num_train_steps(step, seconds_left, seconds_per_step, self.config.num_train_steps)
    if jax.process_count() > 1:  # one schedule for every host: process 0's measurement decides
      end = int(multihost_utils.broadcast_one_to_all(np.int64(end)))
    return end, seconds_per_step

  def fit(self, step, seconds_left, state):
    """Decides after `step` updates; returns the FittedEnd the steps from here run on, or None where nothing
    changes (the configured steps fit; before the configured cooldown start, the device's rate puts the fitted
    cooldown's start later than the projection did; a refit the device's rate does not confirm). `state` is
    waited for, so the time measured is the device's, not the dispatch's."""
    if self.pending:  # a bend an earlier launch decided here
      self.current = self.pending.pop(0)
      return self.current
    jax.block_until_ready(state)
    now = time.time()
    if self.refitting:
      return self._refit(step, seconds_left, now)
    end, seconds_per_step = self._measured_end(step, seconds_left, self.reference, now)
    if step < self.fit_step and not self._cooldown_begun(step, end):
      return None  # not yet: asked again at a later logging step, or at the configured cooldown start
    self.refit_reference = (step, now)
    fitted = FittedEnd(end, step, self._ramp_now(step))
    self._record(fitted, seconds_per_step, seconds_left)  # from here on, refits
    if end >= self.config.num_train_steps:
      logging.info('The configured %d steps fit config.max_train_minutes (%.2f s a step, %.0f s left at step %d)',
                   end, seconds_per_step, seconds_left, step)
      return None
    logging.warning('At %.2f s a step (evaluations and saves included), %.0f s left hold %d more steps, not %d: '
                    'the cooldown now runs from step %d (configured: %d) to step %d, with a save every %d steps '
                    '(config.fit_schedule_to_time; %s)', seconds_per_step, seconds_left, end - step,
                    self.config.num_train_steps - step, step, configured_knot(self.config), end,
                    checkpoint_every_steps(self.config, fitted), self.workdir / FILE)
    return fitted

  def _refit(self, step, seconds_left, now):
    end, seconds_per_step = self._measured_end(step, seconds_left, self.refit_reference, now)
    if not self._moved(step, end):
      return None
    bent = FittedEnd(end, step, self._ramp_now(step))
    logging.info('At %.2f s a step since the fit, %.0f s left hold %d more steps: the cooldown now ends at step %d, '
                 'not %d (a refit, from %.3f of the ramp at step %d; %s)', seconds_per_step, seconds_left, end - step,
                 end, self.end(), bent.knot_ramp, step, self.workdir / FILE)
    self._record(bent, seconds_per_step, seconds_left)
    return bent

  def _record(self, bend, seconds_per_step, seconds_left):
    """Appends `bend` to the run's bends, puts it in force and writes them all for resumes (process 0): the
    fit's fields at the top (as before refits existed), the refits in order under 'refits'."""
    self.bends.append(bend)
    self.current = bend
    if jax.process_index() != 0:
      return
    path = self.workdir / FILE
    fields = dict(num_train_steps=bend.num_train_steps, knot_step=bend.knot_step, knot_ramp=bend.knot_ramp,
                  seconds_per_step=seconds_per_step, seconds_left=seconds_left)
    if len(self.bends) == 1:
      record = dict(fields, configured_num_train_steps=self.config.num_train_steps,
                    checkpoint_every_steps=checkpoint_every_steps(self.config, bend))
    else:
      record = json.loads(path.read_text())  # the bends before this one, as load() gave them to this launch
      record['refits'] = record.get('refits', []) + [fields]
    path.write_text(json.dumps(record, indent=1) + '\n')


def warn_cooldown_cut(step, cooldown_end, fitted):
  """The warning of a run the time limit stopped at `step`, before its cooldown ended at `cooldown_end`."""
  if fitted:  # the (re)fits measured the steps before them; the last ones ran slower
    logging.warning('The time limit stopped the run at step %d, %d steps before the end fitted to it (step %d): '
                    'the last steps ran slower than those measured before them.', step, cooldown_end - step,
                    cooldown_end)
  else:
    logging.warning('The time limit stopped the run at step %d, before its learning-rate cooldown ended at step '
                    '%d: size config.num_train_steps to config.max_train_minutes, or set '
                    'config.fit_schedule_to_time.', step, cooldown_end)
