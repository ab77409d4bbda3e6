"""A window of training steps traced with jax.profiler (config.profile_steps from config.profile_start_step)."""
import jax
from absl import logging
from etils import epath

from flaxformer_nmt.runtime import distributed


class Profiler:
  """Traces steps [start, start + steps) with jax.profiler into {workdir}/profile, on process 0."""

  def __init__(self, workdir, start, steps):
    self.directory = str(epath.Path(workdir) / 'profile')
    self.start, self.stop = start, start + steps
    self.enabled = steps > 0 and distributed.is_leader()
    self.active = False

  def before_step(self, step, steps=1):
    """Before a call that runs `steps` steps after `step`: the trace starts with the first call that runs a step
    of the window (a call of several steps may begin before it)."""
    if self.enabled and step < self.stop and step + steps > self.start and not self.active:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after_step(self, step, state):
    """`step`: the number of steps done. The trace ends once the traced steps have run on the device."""
    if self.active and step >= self.stop:
      jax.block_until_ready(state)
      self._stop(f'{self.start}..{step}')

  def close(self, state=None):
    """Ends a trace still open because the run stopped inside the window (the time limit, a stop signal:
    `state` is the last one; an error: no state, nothing waited for). The steps traced so far are written;
    without this the trace was lost, and in a process that carries on (a notebook, a sweep driver) the next
    start_trace failed on the trace still running."""
    if not self.active:
      return
    if state is not None:
      jax.block_until_ready(state)
    self._stop(f'{self.start}..{int(state.step)}' if state is not None else f'from {self.start}, cut by an error')

  def _stop(self, steps):
    jax.profiler.stop_trace()
    self.active = False
    logging.info('Profiled steps %s into %s', steps, self.directory)
