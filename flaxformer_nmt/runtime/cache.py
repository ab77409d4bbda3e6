"""Where the toolkit keeps what it can reuse between runs: downloads, tokenized corpora and compiled programs."""
import os

import jax
from absl import logging
from etils import epath

from flaxformer_nmt.runtime import executables

CACHE_ENV = 'FLAXFORMER_NMT_CACHE'
# jax.monitoring events: one per program a process obtains (compiled, or read from the persistent cache), with
# its name and seconds; and one per program read from the persistent cache.
PROGRAM_EVENT = '/jax/core/compile/backend_compile_duration'
CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'


def cache_dir():
  """$FLAXFORMER_NMT_CACHE, else $XDG_CACHE_HOME/flaxformer_nmt, else ~/.cache/flaxformer_nmt."""
  if os.environ.get(CACHE_ENV):
    return epath.Path(os.environ[CACHE_ENV])
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return epath.Path(base) / 'flaxformer_nmt'


def use_compilation_cache():
  """Keeps compiled programs between runs: in JAX's persistent cache, `{cache_dir()}/jax_compilation` unless
  $JAX_COMPILATION_CACHE_DIR names another (empty: off), and the programs made with executables.Program (the
  search's) also as whole executables in its `executables` folder, which a later run loads without tracing
  them (executables.py). JAX keys each entry by the program, the jaxlib version, the platform and devices, the
  XLA flags and the compile options, so one directory serves every model, version and device without mixing
  them up; the executables' keys add the package's source and the CPU's instruction set. Nothing where the cache
  is off (distributed.initialize turns it off for processes joined on CPUs)."""
  if not jax.config.jax_enable_compilation_cache:
    return
  directory = os.environ.get('JAX_COMPILATION_CACHE_DIR')  # JAX reads it itself
  if directory is None:
    directory = cache_dir() / 'jax_compilation'
    try:
      directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      logging.warning('No compilation cache (%s): every run compiles again.', e)
      return
    jax.config.update('jax_compilation_cache_dir', str(directory))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)  # the small programs too
  if not directory:
    return
  try:
    executables.enable(epath.Path(directory) / 'executables')
  except OSError as e:
    logging.warning('No saved executables (%s): every run traces the search programs again.', e)


_counters = []  # the ProgramCounters entered now


def _report(event, duration, **kwargs):
  for counter in tuple(_counters):  # a copy: another thread may enter or end a counter meanwhile
    counter._program(event, duration, **kwargs)  # pylint: disable=protected-access


def _report_hit(event, **kwargs):
  for counter in tuple(_counters):
    counter._hit(event, **kwargs)  # pylint: disable=protected-access


# Registered once: counters come and go in _counters, never in jax.monitoring's lists, which jax walks without a
# copy (a listener removed by one thread while another reports a program made jax skip the next listener).
jax.monitoring.register_event_duration_secs_listener(_report)
jax.monitoring.register_event_listener(_report_hit)


class ProgramCounter:
  """Counts the programs this process obtains while it is entered: compiled, loaded from the persistent
  compilation cache, or loaded as saved executables (a program already in the process's memory is not
  obtained again). names: each program's function name, in order; seconds: the time spent obtaining them
  (for a compiled or cache-loaded program, XLA's part: not its tracing and lowering).

    with ProgramCounter() as counter:
      translator.translate(sentences)
    counter.names, counter.compiled, counter.loaded, counter.executables, counter.seconds
  """

  def __init__(self):
    self.names, self.durations, self.loaded, self.executables = [], [], 0, 0

  def _program(self, event, duration, **kwargs):
    if event in (PROGRAM_EVENT, executables.LOADED_EVENT):
      self.names.append(kwargs.get('fun_name'))
      self.durations.append(duration)
      self.executables += event == executables.LOADED_EVENT

  def _hit(self, event, **unused):
    if event == CACHE_HIT_EVENT:
      self.loaded += 1

  @property
  def compiled(self):
    return len(self.names) - self.loaded - self.executables

  @property
  def seconds(self):
    return sum(self.durations)

  def __enter__(self):
    _counters.append(self)
    return self

  def __exit__(self, *unused):
    _counters.remove(self)
