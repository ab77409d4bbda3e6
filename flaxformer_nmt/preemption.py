"""When the training loop saves and stops: step and time limits, save intervals, and stop signals.

SIGTERM (a preemption notice) and SIGINT (Ctrl-C) ask the loop to finish its step, save a checkpoint and exit 0,
so that rerunning the command resumes. Clocks and signals are per host, but every host must take the same
decision at the same step, or one would wait in a collective (the save) that the others never join.
"""
import signal
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils


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


class StopDecision:
  """After each step: save now? stop now? (and why), the same on every host.

  Saves fall every config.checkpoint_every_steps steps, every config.checkpoint_every_minutes, and at the
  end; the run ends at config.num_train_steps, after config.max_train_minutes, or on a stop signal.
  """

  def __init__(self, config, start_time, stop_signal):
    self.num_steps, self.every_steps = config.num_train_steps, config.checkpoint_every_steps
    self.start_time, self.last_save = start_time, time.time()
    self.time_limit = config.max_train_minutes * 60 if config.max_train_minutes > 0 else float('inf')
    self.save_interval = (config.checkpoint_every_minutes * 60 if config.checkpoint_every_minutes > 0
                          else float('inf'))
    self.stop_signal = stop_signal
    self.reason = None  # why the run stopped: 'config.num_train_steps', 'config.max_train_minutes', 'a stop signal'

  @property
  def signalled(self):
    """Stopped by a signal (on any host): the run is to be resumed, not averaged."""
    return self.reason == 'a stop signal'

  def seconds_left(self):
    return max(self.time_limit - (time.time() - self.start_time), 0)

  def after_step(self, step):
    """(save, done) after `step` steps."""
    out_of_time = time.time() - self.start_time >= self.time_limit
    signalled = self.stop_signal.received is not None
    done = step >= self.num_steps or out_of_time or signalled
    save = step % self.every_steps == 0 or time.time() - self.last_save >= self.save_interval or done
    if jax.process_count() > 1:
      # A stop seen by any host stops (and saves) them all.
      save, done, out_of_time, signalled = (bool(x) for x in multihost_utils.process_allgather(
          np.array([save, done, out_of_time, signalled])).any(axis=0))
    if done:
      self.reason = ('a stop signal' if signalled else 'config.max_train_minutes' if out_of_time
                     else 'config.num_train_steps')
    return save, done

  def saved(self):
    self.last_save = time.time()
