"""Compiled programs saved as executables, so that a later process loads a program without tracing, lowering
or compiling it again.

JAX's persistent compilation cache (cache.py) saves the compiling, but a process still traces each function
into a jaxpr and lowers it to find the cache entry: for a search program of the decoder that is about as long
as running it (0.5-0.9 s a program on a 2-core CPU). A `Program` is jax.jit with a second, outer cache: keyed
by its function's name, static arguments, the abstract values of the others and JAX's settings that change
a trace (jax_enable_x64, the default matmul precision, ...), together with what the executable depends on
besides (jax, jaxlib, flax and this package's source, the device, the CPU's instruction set, XLA's flags),
it keeps the compiled program in `directory()` and loads it from there (jax's
serialize_executable) when another process asks for the same.

Only programs whose inputs live on one device go through the saved executables; the others (data-parallel
and multi-host batches) are plain jax.jit, as are all programs until `enable` names a directory on a local
file system (one on a remote store, gs://..., leaves them off).

Each environment (a jax upgrade, an edit of this package) saves into its own folder of that directory; a
process that opens a folder deletes those beyond the KEEP_SETS most recently opened, so the directory holds a
few sets (about 18 MB for the programs of a Multi30k test set), not one per version ever run.
"""
import contextlib
import functools
import hashlib
import os
import pathlib
import pickle
import platform
import shutil
import threading
import time
import weakref

import flax
import jax
import jaxlib
import numpy as np
from absl import logging
from etils import epath
from jax._src import config as jax_config
from jax.experimental import serialize_executable

from flaxformer_nmt.runtime import files

# jax.monitoring event for a program loaded from a saved executable, with its seconds and function name.
LOADED_EVENT = '/flaxformer_nmt/executables/load_duration'

# The environments whose executables are kept, this process's among them: two Pythons sharing the directory keep
# theirs, and a jax upgrade or an edit of this package costs one compile of each program, not a set forever.
KEEP_SETS = 4
_DIGEST_BYTES = 32  # the sha256 in front of each file's pickle (_sealed)

_directory = None
_programs = weakref.WeakSet()  # every Program, so that clear() reaches their compiled programs
_obtaining = threading.Lock()  # one thread at a time loads or compiles (threads may ask for the same program)


def enable(directory):
  """Saves and loads executables in `directory` (created if missing); None turns them off, and so does a
  directory on a remote store (gs://...): keeping the folders (their times, the pruning) and the atomic writes
  of the files need a local file system."""
  global _directory
  if directory is not None:
    directory = epath.Path(directory)
    if '://' in str(directory):
      logging.warning('Saved executables off: %s is not on a local file system', directory)
      directory = None
    else:
      directory.mkdir(parents=True, exist_ok=True)
  _directory = directory


def directory():
  """Where executables are saved and loaded; None: they are not."""
  return _directory


def clear():
  """Drops the compiled programs every Program holds in memory (as jax.clear_caches does jit's)."""
  for program in list(_programs):
    program._compiled.clear()  # pylint: disable=protected-access


def _cpu_features():
  """The host CPU's model and instruction set extensions: an executable compiled for one may not run on
  another (a cache directory on a shared home, or a disk image moved between machines)."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      fields = [line for line in f if line.startswith(('flags', 'model name', 'Features'))]
    return ''.join(sorted(set(fields)))
  except OSError:
    return platform.processor() or platform.machine()


@functools.cache
def environment():
  """What a saved executable depends on besides its program, as one string."""
  package = pathlib.Path(__file__).resolve().parent.parent
  source = hashlib.sha256()
  for path in sorted(package.rglob('*.py')):
    source.update(str(path.relative_to(package)).encode() + b'\0' + path.read_bytes())
  device = jax.devices()[0]
  return '\n'.join([
      f'jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__}',
      f'flaxformer_nmt source {source.hexdigest()}',
      f'{jax.device_count()} x {device.platform} {device.device_kind} {getattr(device.client, "platform_version", "")}',
      f'XLA_FLAGS={os.environ.get("XLA_FLAGS", "")}',
      _cpu_features()])


# JAX's settings of XLA's build options, which trace_context leaves out: a program compiled unoptimized while
# debugging must not be loaded by a later run.
COMPILE_SETTINGS = ('jax_disable_most_optimizations', 'jax_optimization_level', 'jax_memory_fitting_level')


def _trace_settings():
  """JAX's settings that change what a function traces to (jax_enable_x64, jax_default_matmul_precision, ...:
  those jax.jit keys its programs by), the default PRNG implementation (a key made inside the function) and
  COMPILE_SETTINGS, read at every call: a process may change them while it runs."""
  return (jax_config.trace_context(), jax.config.jax_default_prng_impl,
          tuple(str(jax.config.values.get(name)) for name in COMPILE_SETTINGS))


def _described(settings):
  """`_trace_settings()` as text that another process writes alike: sets sorted, and objects that only their
  address describes (JAX's axis environment, empty outside a trace) left out."""
  context, prng_impl, compile_settings = settings
  values = [sorted(map(repr, v)) if isinstance(v, (set, frozenset)) else v for v in context
            if type(v).__repr__ is not object.__repr__]
  return repr((values, prng_impl, compile_settings))


@functools.cache
def _set_directory(directory):
  """The folder of `directory` (a str) that holds this environment's executables: created and marked as opened
  now; the sets beyond the KEEP_SETS most recently opened are deleted (a process still loading from one
  compiles its programs again), and so are executables of the flat layout of earlier versions."""
  root = pathlib.Path(directory)
  here = root / hashlib.sha256(environment().encode()).hexdigest()[:16]
  try:
    here.mkdir(parents=True, exist_ok=True)
    os.utime(here)
  except OSError as e:  # a read-only cache: loads find nothing, saves warn, the programs still compile
    logging.warning('Saved executables: %s not usable (%s)', here, e)
    return here

  def opened(folder):
    try:
      return folder.stat().st_mtime
    except OSError:  # deleted meanwhile by another process
      return 0.0

  others = sorted((p for p in root.iterdir() if p.is_dir() and p != here), key=opened, reverse=True)
  for stale in others[KEEP_SETS - 1:]:
    shutil.rmtree(stale, ignore_errors=True)
  for flat in root.glob('*.executable'):
    with contextlib.suppress(OSError):
      flat.unlink()
  return here


def _signature(leaves):
  """A hashable description of the arguments' abstract values (shape, dtype, weak type, sharding), or None
  where one lives on several devices (or is of a kind not described here): those programs stay plain jit.
  Called on every call of a Program: no string formatting here."""
  signature = []
  for x in leaves:
    if isinstance(x, jax.Array):
      if x.sharding.num_devices != 1:
        return None
      signature.append((x.shape, x.dtype, x.weak_type, x.sharding))
    elif isinstance(x, (np.ndarray, np.generic)):
      signature.append((x.shape, x.dtype))
    elif isinstance(x, (bool, int, float)):
      signature.append(type(x).__name__)
    else:
      return None
  return tuple(signature)


class Program:
  """jax.jit(fun, ...), whose compiled programs are also saved as executables while `directory()` is set.

  Called as the jitted function; static arguments as jax.jit's (hashable, and described by their repr on
  disk: a Flax module's repr is its configuration).
  """

  def __init__(self, fun, *, static_argnums=(), static_argnames=(), **jit_options):
    self.name = f'jit({fun.__name__})'  # as jax names the program
    self._function = f'{fun.__module__}.{fun.__qualname__}'  # on disk: two functions may share a name
    self.static_argnums, self.static_argnames = tuple(static_argnums), tuple(static_argnames)
    self.jitted = jax.jit(fun, static_argnums=static_argnums, static_argnames=static_argnames, **jit_options)
    self._options = repr(sorted(jit_options.items()))
    self._compiled = {}
    _programs.add(self)

  def __call__(self, *args, **kwargs):
    if _directory is None:
      return self.jitted(*args, **kwargs)
    dynamic_args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
    dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
    static = (tuple(args[i] for i in self.static_argnums),
              tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
    leaves, tree = jax.tree_util.tree_flatten((dynamic_args, dynamic_kwargs))
    signature = _signature(leaves)
    if signature is None:
      return self.jitted(*args, **kwargs)
    settings = _trace_settings()
    key = (static, tree, signature, settings)
    compiled = self._compiled.get(key)
    if compiled is None:
      compiled = self._obtained(key, leaves, args, kwargs)
    return compiled(*dynamic_args, **dynamic_kwargs)

  def _obtained(self, key, leaves, args, kwargs):
    """The compiled program of a call keyed `key` that this Program does not hold yet, loaded or compiled once
    whatever the threads asking for it."""
    with _obtaining:
      if key not in self._compiled:  # on disk, the devices by id too (a sharding's repr may not name them)
        static, tree, signature, settings = key
        devices = sorted({d.id for x in leaves if isinstance(x, jax.Array) for d in x.sharding.device_set})
        description = repr((static, str(tree), signature, devices, _described(settings)))
        self._compiled[key] = self._obtain(args, kwargs, description)
      return self._compiled[key]

  def cache_size(self):
    """How many compiled programs this Program holds in memory: jit's and those of saved executables."""
    return self.jitted._cache_size() + len(self._compiled)  # pylint: disable=protected-access

  def path(self, description):
    """The file of the executable of this program's call described by `description`."""
    digest = hashlib.sha256('\n'.join([self._function, self._options, description, environment()]).encode())
    return _set_directory(str(_directory)) / f'{self.name[4:-1]}-{digest.hexdigest()[:40]}.executable'

  def _obtain(self, args, kwargs, description):
    """The compiled program for these arguments: loaded from its saved executable (on the devices it was
    compiled for: by default a loaded executable spans all of the backend's), else compiled and saved."""
    path, start = self.path(description), time.perf_counter()
    try:
      serialized, in_tree, out_tree, device_ids = pickle.loads(_unsealed(path.read_bytes()))
      devices = {device.id: device for device in jax.devices()}
      compiled = serialize_executable.deserialize_and_load(
          serialized, in_tree, out_tree, execution_devices=[devices[i] for i in device_ids])
      jax.monitoring.record_event_duration_secs(LOADED_EVENT, time.perf_counter() - start, fun_name=self.name)
      return compiled
    except FileNotFoundError:
      pass
    except Exception as e:  # pylint: disable=broad-except  # a damaged or foreign file is compiled again
      logging.warning('Saved executable %s not loaded (%s: %s): compiling the program again', path,
                      type(e).__name__, e)
    compiled = _compile_fresh(self.jitted.lower(*args, **kwargs))
    try:
      device_ids = sorted({d.id for s in jax.tree_util.tree_leaves(compiled.input_shardings) for d in s.device_set})
      files.write_atomically(path, _sealed(pickle.dumps((*serialize_executable.serialize(compiled), device_ids))))
    except (OSError, ValueError, TypeError, jax.errors.JaxRuntimeError) as e:  # XLA may not serialize a program
      logging.warning('Executable of %s not saved (%s)', self.name, e)
    return compiled


def _compile_fresh(lowered):
  """lowered.compile() past JAX's persistent cache: an executable that cache hands back serializes without
  its functions on XLA's CPU backend (running the reloaded copy fails: 'Function ... not found'). So these
  compiles never read that cache (their compile options, with a default value made explicit, give keys no
  other compile has) nor write it (its minimum compile time raised meanwhile)."""
  floor = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1e12)
  try:
    return lowered.compile(compiler_options={'xla_embed_ir_in_executable': False})
  finally:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', floor)


def _sealed(payload):
  """`payload` behind its sha256: a file damaged after it was written (a flipped bit, a bad sector) is told
  from a whole one before XLA reads it; XLA loads many damaged executables and runs them to a crash
  (SIGILL, SIGSEGV) in every later process."""
  return hashlib.sha256(payload).digest() + payload


def _unsealed(data):
  """The payload of a `_sealed` file; ValueError where it does not match its sha256."""
  digest, payload = data[:_DIGEST_BYTES], data[_DIGEST_BYTES:]
  if hashlib.sha256(payload).digest() != digest:
    raise ValueError('its contents do not match their sha256: the file is damaged')
  return payload
