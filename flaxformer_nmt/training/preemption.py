"""When the training loop saves and stops: step and time limits, save intervals, and stop signals.

SIGTERM (a preemption notice) and SIGINT (Ctrl-C) ask the loop to finish its step, save a checkpoint and exit 0,
so that rerunning the command resumes. Clocks and signals are per host, but every host must take the same
decision at the same step, or one would wait in a collective (the save) that the others never join. Without
a host sync at every step:

- A preemption notice (SIGTERM) on several hosts goes through JAX's preemption sync manager (set up by
  jax.distributed.initialize): the host that receives it tells the others through the coordination service,
  they agree on the next step all of them can reach, and `reached_preemption_sync_point` is true at that
  step on every host. Checking it every step costs no collective.
- Time limits (max_train_minutes, checkpoint_every_minutes), Ctrl-C, and SIGTERM where the sync manager is
  off are agreed on every `agree_every_steps` steps (the log interval) by one small all-gather: a time limit
  can overrun by up to that many steps.
- On one process everything is decided locally at every step.

Every decision is taken for a step the device has (nearly) reached: StepsInFlight bounds how far the loop's
asynchronous dispatch runs ahead of the computation.
An error that escapes the loop (a failed evaluation, a device out of memory, a refused resume) goes through
closed_on_error: the save in flight finishes and the input thread stops before the error goes on.
"""
import collections
import contextlib
import signal
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from flaxformer_nmt.training import metrics as metrics_lib


class StepsInFlight:
  """Keeps the loop at most `max_steps` dispatched steps ahead of the device.

  JAX dispatches a jitted step and returns at once, so without a bound the loop may run ahead until its next
  host read (the log interval's metrics, up to log_every_steps steps) and decide to stop, or to end on time, at
  a step the device reaches only that many step times later: 50 steps of configs/multi30k_best.py on two CPU
  cores are 95 s, against the ~30 s a preempted cloud VM gets. Waiting for the step `max_steps` back keeps one
  step queued behind the running one, so the device never idles while Python prepares the next.
  """

  def __init__(self, max_steps=2):
    self.max_steps = max_steps
    self._outputs = collections.deque()

  def add(self, step_outputs):
    """After dispatching a step: blocks until the steps more than `max_steps` back have finished."""
    self._outputs.append(step_outputs)
    while len(self._outputs) > self.max_steps:
      jax.block_until_ready(self._outputs.popleft())


class StopSignal:
  """SIGTERM/SIGINT (a preemption notice, Ctrl-C) ask the loop to save after the current step and exit 0; a
  further one, while the run is stopping, is logged and ignored (the loop waits for its save inside the block).

  handle_sigterm=False leaves SIGTERM to JAX's preemption sync manager (a Python handler would replace its
  handler, and the other hosts would never hear of the notice).
  """

  def __init__(self, handle_sigterm=True):
    self.received = None
    self._signals = (signal.SIGTERM, signal.SIGINT) if handle_sigterm else (signal.SIGINT,)
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self.received is not None:
      logging.warning('Received %s again: the run is already stopping; ignored until its checkpoint is written '
                      '(SIGKILL stops it at once and loses that checkpoint).', signal.Signals(signum).name)
      return
    self.received = signal.Signals(signum).name
    logging.warning('Received %s: finishing this step, saving a checkpoint, then exiting.', self.received)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for signum in self._signals:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)


@contextlib.contextmanager
def closed_on_error(*resources):
  """Closes `resources` in order when the block raises, then lets the error go on. Checkpoints.close waits for
  the save in flight, so an error right after a save keeps that save; and a process that carries on after the
  error (a notebook, a sweep driver) is left with no orbax or input thread still writing or reading."""
  try:
    yield
  except BaseException:
    for resource in resources:
      resource.close()
    raise


def preemption_sync_available(step):
  """Whether JAX's preemption sync manager serves this job (several processes joined by jax.distributed, with
  jax_enable_preemption_service on). Asks it about `step`, the step training starts from, on every host."""
  if jax.process_count() == 1:
    return False
  try:
    multihost_utils.reached_preemption_sync_point(step)
    return True
  except RuntimeError as e:  # the preemption service is off
    logging.warning('No preemption sync manager (%s): SIGTERM is agreed on with the other hosts every few '
                    'steps instead.', e)
    return False


def time_limit_seconds(config):
  """config.max_train_minutes in seconds (infinite where it is 0: no guard)."""
  return config.max_train_minutes * 60 if config.max_train_minutes > 0 else float('inf')


class StopDecision:
  """After each step: save now? stop now? (and why), the same on every host.

  Saves fall every config.checkpoint_every_steps steps, every config.checkpoint_every_minutes, and at the
  end; the run ends at config.num_train_steps, after config.max_train_minutes, or on a stop signal.
  `preemption_sync`: a preemption sync manager serves this job (see preemption_sync_available).
  """

  def __init__(self, config, start_time, stop_signal, preemption_sync=False, agree_every_steps=None):
    self.num_steps, self.every_steps = config.num_train_steps, config.checkpoint_every_steps
    self.agree_every = agree_every_steps or config.log_every_steps
    self.start_time, self.last_save = start_time, time.time()
    self.time_limit = time_limit_seconds(config)
    self.save_interval = (config.checkpoint_every_minutes * 60 if config.checkpoint_every_minutes > 0
                          else float('inf'))
    self.stop_signal, self.preemption_sync = stop_signal, preemption_sync
    self.reason = None  # why the run stopped: 'config.num_train_steps', 'config.max_train_minutes', 'a stop signal'

  @property
  def signalled(self):
    """Stopped by a signal (on any host): the run is to be resumed, not averaged."""
    return self.reason == 'a stop signal'

  def seconds_left(self):
    return max(self.time_limit - (time.time() - self.start_time), 0)

  def spent_before_start(self, trained_seconds):
    """Whether a resumed run's earlier training (`trained_seconds`, from its checkpoint: every host reads the
    same value, so all decide alike) already used up config.max_train_minutes; if so it stops before any step."""
    if trained_seconds < self.time_limit:
      return False
    logging.warning('The run has trained for %s, config.max_train_minutes=%g: no step taken. Pass a larger '
                    '--config.max_train_minutes to train on.', metrics_lib.duration(trained_seconds),
                    self.time_limit / 60)
    self.reason = 'config.max_train_minutes'
    return True

  def after_step(self, step, steps=1):
    """(save, done) after `step` steps, the last `steps` of them run by one call."""
    out_of_time = time.time() - self.start_time >= self.time_limit
    signalled = self.stop_signal.received is not None
    save_by_time = time.time() - self.last_save >= self.save_interval
    if jax.process_count() > 1:
      # The sync point is one step number: each step of the call is offered (every host's calls are alike).
      preempted = self.preemption_sync and any([multihost_utils.reached_preemption_sync_point(done)
                                                for done in range(step - steps + 1, step + 1)])
      if preempted:
        logging.warning('Preemption notice on a host: every host saves at step %d and exits.', step)
      if step % self.agree_every == 0:
        # Any host's clock or signal decides for all of them.
        out_of_time, signalled, save_by_time = (bool(x) for x in multihost_utils.process_allgather(
            np.array([out_of_time, signalled, save_by_time])).any(axis=0))
      else:
        out_of_time = signalled = save_by_time = False
      signalled = signalled or preempted
    done = step >= self.num_steps or out_of_time or signalled
    save = step % self.every_steps == 0 or save_by_time or done
    if done:
      self.reason = ('a stop signal' if signalled else 'config.max_train_minutes' if out_of_time
                     else 'config.num_train_steps')
    return save, done

  def saved(self):
    self.last_save = time.time()
