"""Fitting a run's end to its time limit (config.fit_schedule_to_time).

A recipe such as configs/multi30k.py sizes num_train_steps to one machine; on a slower one
config.max_train_minutes stops the run before the cooldown has brought the learning rate down, and the last
checkpoints (those averaged) are taken at a high learning rate. With fit_schedule_to_time the trainer measures
once, at the update where the cooldown begins (at least MIN_MEASURED_STEPS after the run's first step), how
long a step takes on this machine, the evaluations and saves since the first step included. If the configured
steps do not fit in the time left, the cooldown is bent to end at the last step that does (FittedEnd): the
learning rate still reaches zero when the time is up. A run is never lengthened: on a faster machine the
recipe stays as written. The regular saves then come closer together in the same proportion, so the last
average_last_checkpoints still span the configured share of the cooldown (averaging the last 5 of a
100-step grid over a 450-step cooldown would reach back to the peak learning rate: valid 36.93 against 38.91
for the last checkpoint, bench/RESULTS.md). The decision is written to {workdir}/fitted_schedule.json and a
resumed run follows it instead of measuring again, so every update of a run has one schedule.
"""
import json
import time

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from flaxformer_nmt.checkpoints import FITTED_SCHEDULE_FILE as FILE
from flaxformer_nmt.train_step import FittedEnd, cooldown_ramp

# Steps measured before deciding: enough for the step time to settle after the first (compiling) step.
MIN_MEASURED_STEPS = 100


def fitted_num_train_steps(step, seconds_left, seconds_per_step, reserve_seconds, configured):
  """The last update that fits after `step` updates: the steps that seconds_left - reserve_seconds hold at
  seconds_per_step, never more than `configured` and at least one more."""
  fit = step + int((seconds_left - reserve_seconds) // seconds_per_step)
  return max(step + 1, min(configured, fit))


def checkpoint_every_steps(config, fitted):
  """The regular save interval from the fit on: config.checkpoint_every_steps shrunk as the cooldown was."""
  if fitted is None:
    return config.checkpoint_every_steps
  share = (fitted.num_train_steps - fitted.knot_step) / (config.num_train_steps - fitted.knot_step)
  return max(1, int(config.checkpoint_every_steps * share + 0.5))


def load(workdir):
  """The FittedEnd an earlier run of this workdir decided, or None."""
  path = epath.Path(workdir) / FILE
  if not path.exists():
    return None
  fields = json.loads(path.read_text())
  return FittedEnd(int(fields['num_train_steps']), int(fields['knot_step']), float(fields['knot_ramp']))


class ScheduleFit:
  """The measurement and the one decision, driven by the training loop: `first_step_done` after the first
  (compiling) step of this process, `due` after each step, `fit` when due."""

  def __init__(self, config, workdir, first_step, decided):
    self.config, self.workdir = config, epath.Path(workdir)
    self.enabled = bool(config.get('fit_schedule_to_time', False)) and decided is None
    self.fit_step = max(config.num_train_steps - config.cooldown_steps, first_step + MIN_MEASURED_STEPS)
    self.reference = None  # (step, time) after the first step
    self.compile_seconds = 0.0

  def first_step_done(self, step, call_seconds):
    """`call_seconds`: how long the first call of the train step took, its compilation nearly all of it; the
    fitted schedule compiles a new step, so that much is held back from the time left."""
    self.reference, self.compile_seconds = (step, time.time()), call_seconds

  def due(self, step):
    return self.enabled and self.reference is not None and step == self.fit_step

  def fit(self, step, seconds_left, state):
    """Decides the run's end after `step` updates; returns the FittedEnd, or None where the configured steps
    fit. `state` is waited for, so the time measured is the device's, not the dispatch's."""
    self.enabled = False
    jax.block_until_ready(state)
    now = time.time()
    seconds_per_step = (now - self.reference[1]) / (step - self.reference[0])
    end = fitted_num_train_steps(step, seconds_left, seconds_per_step, self.compile_seconds,
                                 self.config.num_train_steps)
    if jax.process_count() > 1:  # one schedule for every host: process 0's measurement decides
      end = int(multihost_utils.broadcast_one_to_all(np.int64(end)))
    knot_ramp = float(cooldown_ramp(step, self.config.num_train_steps, self.config.cooldown_steps))
    fitted = FittedEnd(end, step, knot_ramp)
    if jax.process_index() == 0:
      record = dict(num_train_steps=fitted.num_train_steps, knot_step=step, knot_ramp=fitted.knot_ramp,
                    configured_num_train_steps=self.config.num_train_steps, seconds_per_step=seconds_per_step,
                    seconds_left=seconds_left, compile_seconds=self.compile_seconds,
                    checkpoint_every_steps=checkpoint_every_steps(self.config, fitted))
      (self.workdir / FILE).write_text(json.dumps(record, indent=1) + '\n')
    if end >= self.config.num_train_steps:
      logging.info('The configured %d steps fit config.max_train_minutes (%.2f s a step, %.0f s left at step %d)',
                   end, seconds_per_step, seconds_left, step)
      return None
    logging.warning('At %.2f s a step (evaluations and saves included), %.0f s left hold %d more steps, not %d: '
                    'the cooldown now ends at step %d, with a save every %d steps (config.fit_schedule_to_time; '
                    '%s)', seconds_per_step, seconds_left, end - step, self.config.num_train_steps - step, end,
                    checkpoint_every_steps(self.config, fitted), self.workdir / FILE)
    return fitted


def warn_cooldown_cut(step, cooldown_end, fitted):
  """The warning of a run the time limit stopped at `step`, before its cooldown ended at `cooldown_end`."""
  if fitted:  # the fit measured the steps before it; later ones (or more frequent saves) ran slower
    logging.warning('The time limit stopped the run at step %d, %d steps before the end fitted to it (step %d): '
                    'the steps after the fit ran slower than those before it.', step, cooldown_end - step,
                    cooldown_end)
  else:
    logging.warning('The time limit stopped the run at step %d, before its learning-rate cooldown ended at step '
                    '%d: size config.num_train_steps to config.max_train_minutes, or set '
                    'config.fit_schedule_to_time.', step, cooldown_end)
