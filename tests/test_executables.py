"""Saved executables (runtime/executables.py): a later process runs a program without tracing it, and never
runs another program's executable."""
import concurrent.futures
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
import types

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from etils import epath

from conftest import subprocess_env, xla_flags_without_device_count
from flaxformer_nmt.runtime import executables


def loop(x, w, *, k):
  """k rounds of tanh(x @ w) + column index: a while loop, an iota and a static argument."""
  y = x + jnp.arange(x.shape[1], dtype=x.dtype)
  return jax.lax.fori_loop(0, k, lambda i, y: jnp.tanh(y @ w), y)


def loop_in_numpy(x, w, k):
  y = np.asarray(x, np.float64) + np.arange(x.shape[1])
  for _ in range(k):
    y = np.tanh(y @ np.asarray(w, np.float64))
  return y


def arguments(columns=8, dtype=np.float32):
  rng = np.random.default_rng(columns)
  return (rng.normal(size=(4, columns)).astype(dtype), (rng.normal(size=(columns, columns)) / columns).astype(dtype))


@pytest.fixture
def saved_in(tmp_path):
  before = executables.directory()
  executables.enable(tmp_path / 'executables')
  yield tmp_path / 'executables'
  executables.enable(before)


def saved(directory):
  return list(directory.glob('*/*.executable'))


def loads(program, *args, **kwargs):
  """(result, whether it came from a saved executable) of a call."""
  events = []
  listener = lambda event, duration, **unused: events.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    result = program(*args, **kwargs)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return np.asarray(result), executables.LOADED_EVENT in events


_PROCESS = textwrap.dedent('''
  import sys, jax, jax.numpy as jnp, numpy as np
  from flaxformer_nmt.runtime import executables
  def loop(x, w, *, k):
    y = x + jnp.arange(x.shape[1], dtype=x.dtype)
    return jax.lax.fori_loop(0, k, lambda i, y: jnp.tanh(y @ w), y)
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(4, 8)).astype(np.float32), (rng.normal(size=(8, 8)) / 8).astype(np.float32)
  expected = x.astype(np.float64) + np.arange(8)
  for _ in range(3):
    expected = np.tanh(expected @ w)
  jax.jit(loop, static_argnames='k')(x, w, k=3)  # the plain jit: into JAX's persistent cache
  executables.enable({directory!r})
  program = executables.Program(loop, static_argnames=('k',))
  if sys.argv[1] == 'load':
    program.jitted.lower = None  # a traced program would fail here
  np.testing.assert_allclose(program(x, w, k=3), expected, rtol=1e-4, atol=1e-5)
  print('OK', len(list(executables.directory().glob('*/*.executable'))))
''')


def test_a_saved_executable_runs_in_another_process_without_tracing(tmp_path):
  # Catches an executable saved from JAX's persistent cache (XLA's CPU backend serializes such a program
  # without its functions: the next process fails with 'Function ... not found'), and a key that differs
  # between processes (the second would trace the program again).
  script = _PROCESS.format(directory=str(tmp_path / 'saved'))
  # Two CPU devices, the program on one (as validation BLEU runs in a trainer of config.cpu_devices=2): catches
  # an executable loaded onto all of the backend's devices, which then wants its inputs in two shards.
  env = subprocess_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'jax_cache'), JAX_PLATFORMS='cpu',
                       XLA_FLAGS=xla_flags_without_device_count() + ' --xla_force_host_platform_device_count=2')
  for mode in ('save', 'save', 'load'):  # the second: the program in JAX's cache, its executable saved again
    if mode == 'save':
      shutil.rmtree(tmp_path / 'saved', ignore_errors=True)
    result = subprocess.run([sys.executable, '-c', script, mode], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0 and 'OK 1' in result.stdout, (mode, result.stderr[-3000:])


def test_the_key_tells_static_arguments_shapes_and_dtypes_apart(saved_in):
  # Catches a key that leaves out a static argument, a shape or a dtype: a fresh Program (as a new process
  # has) would load the other call's executable and give its numbers, or fail on the shapes.
  calls = [(arguments(), 2), (arguments(), 3), (arguments(16), 3), (arguments(16, jnp.bfloat16), 3)]
  for (x, w), k in calls:
    result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=k)
    assert not loaded
    tolerance = 2e-2 if x.dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(result.astype(np.float64), loop_in_numpy(x, w, k), rtol=tolerance, atol=tolerance)
  assert len(saved(saved_in)) == len(calls)
  for (x, w), k in calls:  # each again in a fresh Program: its own executable
    result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=k)
    assert loaded
    tolerance = 2e-2 if x.dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(result.astype(np.float64), loop_in_numpy(x, w, k), rtol=tolerance, atol=tolerance)


def test_a_damaged_executable_is_compiled_again_and_replaced(saved_in, caplog):
  # Catches a damaged file that stops the program (or is loaded and run) instead of being compiled again.
  x, w = arguments()
  executables.Program(loop, static_argnames=('k',))(x, w, k=2)
  (path,) = saved(saved_in)
  path.write_bytes(path.read_bytes()[:1000])
  with caplog.at_level(logging.WARNING):
    result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)
  assert not loaded and 'not loaded' in caplog.text and path.name in caplog.text
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)
  result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)
  assert loaded
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)


def test_a_file_damaged_inside_is_never_handed_to_xla(saved_in, caplog, monkeypatch):
  # Catches a damaged file that still unpickles (a byte flipped inside the executable's bytes) passed to XLA:
  # it loads many such executables and runs them to a crash (SIGILL) in this and every later process.
  x, w = arguments()
  executables.Program(loop, static_argnames=('k',))(x, w, k=2)
  (path,) = saved(saved_in)
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x5A
  path.write_bytes(bytes(data))
  handed = []
  def deserialize_and_load(serialized, *unused, **unused_kwargs):
    handed.append(serialized)
    raise RuntimeError('a damaged executable reached XLA')
  monkeypatch.setattr(executables.serialize_executable, 'deserialize_and_load', deserialize_and_load)
  with caplog.at_level(logging.WARNING):
    result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)
  assert not handed and not loaded and 'damaged' in caplog.text and path.name in caplog.text
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)
  monkeypatch.undo()
  result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)  # replaced by a whole one
  assert loaded
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)


def test_without_a_directory_a_program_is_plain_jit(tmp_path):
  # Catches files written (or read) while executables are off, as in a process no command turned them on.
  before = executables.directory()
  executables.enable(None)
  try:
    x, w = arguments()
    result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)
  finally:
    executables.enable(before)
  assert not loaded
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)


def test_the_sets_of_other_environments_beyond_the_newest_are_deleted(tmp_path):
  """Each environment (jax version, this package's source, ...) saves into its own folder; opening one keeps it
  and the KEEP_SETS - 1 most recently opened others, and deletes the older sets and files of the flat layout.
  Catches a directory that grows by a set at every upgrade or edit, and a prune that deletes the newest sets
  (or this environment's) instead of the oldest."""
  root = tmp_path / 'executables'
  ages = {f'{i:016x}': 1000.0 * (i + 1) for i in range(executables.KEEP_SETS + 2)}  # seconds since opened
  for name, age in ages.items():
    (root / name).mkdir(parents=True)
    (root / name / 'loop-0.executable').write_bytes(b'x')
    os.utime(root / name, (time.time() - age, time.time() - age))
  (root / 'loop-flat.executable').write_bytes(b'x')
  before = executables.directory()
  executables.enable(root)
  try:
    x, w = arguments()
    executables.Program(loop, static_argnames=('k',))(x, w, k=2)
  finally:
    executables.enable(before)
  (own,) = [p for p in root.iterdir() if p.name not in ages]
  assert len(list(own.glob('*.executable'))) == 1
  newest_others = sorted(ages, key=ages.get)[:executables.KEEP_SETS - 1]
  assert sorted(p.name for p in root.iterdir()) == sorted(newest_others + [own.name])


def test_a_directory_that_cannot_hold_executables_leaves_programs_compiling(tmp_path, caplog):
  # Catches an unusable cache folder (read-only, or a file in its place) that stops the program instead of
  # leaving it to compile as plain jit would.
  root = tmp_path / 'executables'
  before = executables.directory()
  executables.enable(root)
  root.rmdir()
  root.write_text('not a folder')
  try:
    x, w = arguments()
    with caplog.at_level(logging.WARNING):
      result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)
  finally:
    executables.enable(before)
  assert not loaded and 'not usable' in caplog.text
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)


def test_a_program_xla_cannot_serialize_runs_and_is_not_saved(saved_in, caplog, monkeypatch):
  # Catches a save failure that stops the call: XLA's CPU backend refuses to serialize some programs
  # ('UNIMPLEMENTED: `LessThan` is not serializable', a sort's comparator), and the program must still run.
  def refuse(*unused):
    raise jax.errors.JaxRuntimeError('UNIMPLEMENTED: `LessThan` is not serializable.')
  monkeypatch.setattr(executables.serialize_executable, 'serialize', refuse)
  x, w = arguments()
  with caplog.at_level(logging.WARNING):
    result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)
  assert not loaded and 'not saved' in caplog.text and not saved(saved_in)
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)


def add_iota(x):
  return x + jnp.arange(3)


def test_the_key_tells_jax_trace_settings_apart(saved_in):
  """A program saved without jax_enable_x64, then called with it (in the same Program, and in a fresh one as a
  process started with JAX_ENABLE_X64=1 has): plain jit traces again and gives int64. Catches a key, in memory
  or on disk, that leaves out JAX's trace settings: the int32 program of the other setting is run."""
  x = np.ones(3, np.int32)
  program = executables.Program(add_iota)
  assert program(x).dtype == np.int32
  before = jax.config.jax_enable_x64
  jax.config.update('jax_enable_x64', True)
  try:
    same_program = np.asarray(program(x)).dtype
    executables.clear()
    result, loaded = loads(executables.Program(add_iota), x)
  finally:
    jax.config.update('jax_enable_x64', before)
  assert same_program == np.int64 and result.dtype == np.int64 and loaded
  assert len(saved(saved_in)) == 2


def test_the_key_tells_xla_build_settings_apart(saved_in):
  """A program saved as usual, then asked for under jax_disable_most_optimizations (a debugging run): it is compiled
  again, not loaded. Catches a key that leaves out JAX's settings of XLA's build options, which trace_context
  does not hold: the unoptimized program would then be loaded by every later run."""
  x = np.ones(3, np.int32)
  executables.Program(add_iota)(x)
  executables.clear()
  before = jax.config.values['jax_disable_most_optimizations']
  jax.config.update('jax_disable_most_optimizations', True)
  try:
    _, loaded = loads(executables.Program(add_iota), x)
  finally:
    jax.config.update('jax_disable_most_optimizations', before)
  assert not loaded and len(saved(saved_in)) == 2


def test_a_remote_directory_turns_saved_executables_off_and_writes_nothing_here(tmp_path, monkeypatch, caplog):
  """A gs:// directory (JAX's persistent cache on a bucket) leaves the programs as plain jit, with a warning.
  Catches such a path read as a local one ('gs:/bucket/...', relative): executables written into a folder
  'gs:' under the working directory."""
  monkeypatch.chdir(tmp_path)
  gpath, local_mkdir = type(epath.Path('gs://bucket')), type(epath.Path('gs://bucket')).mkdir
  def mkdir(self, *args, **kwargs):  # the bucket exists: creating a folder there succeeds
    if not str(self).startswith('gs://'):
      local_mkdir(self, *args, **kwargs)
  monkeypatch.setattr(gpath, 'mkdir', mkdir)
  before = executables.directory()
  try:
    with caplog.at_level(logging.WARNING):
      executables.enable('gs://bucket/jax_cache/executables')
      x, w = arguments()
      result, loaded = loads(executables.Program(loop, static_argnames=('k',)), x, w, k=2)
    directory = executables.directory()
  finally:
    executables.enable(before)
  assert directory is None and not loaded and 'not on a local file system' in caplog.text
  assert not list(tmp_path.iterdir())
  np.testing.assert_allclose(result, loop_in_numpy(x, w, 2), rtol=1e-4, atol=1e-5)


def halved_plus_bfloat16(x):
  return x / 2 + jnp.zeros(3, jnp.bfloat16)


def test_the_key_tells_python_number_types_and_weak_types_apart(saved_in):
  """A Program called with 3 and then 3.5 (Python numbers, as a search's alpha), and with a float32 array and then a
  weakly typed one (which bfloat16 operands win over, as with jit): each gives what jax.jit gives, in the same
  Program and in a fresh one. Catches a key that describes a Python number without its type (3.5 run through the
  int program: 1.5) or an array without its weak type (the float32 program's dtype for the weak one)."""
  for first, second in ((3, 3.5), (jnp.ones((), jnp.float32), jnp.asarray(1.0))):
    program = executables.Program(halved_plus_bfloat16)
    for x in (first, second):
      want = jax.jit(halved_plus_bfloat16)(x)
      result = program(x)
      assert result.dtype == want.dtype
      np.testing.assert_array_equal(result, want)
    executables.clear()
    result, loaded = loads(executables.Program(halved_plus_bfloat16), second)
    want = np.asarray(jax.jit(halved_plus_bfloat16)(second))
    assert loaded and result.dtype == want.dtype
    np.testing.assert_array_equal(result, want)


def scaled(k, x):
  return x * k


def test_the_key_tells_positional_static_arguments_device_array_dtypes_and_jit_options_apart(saved_in):
  # Catches a key that leaves out a static argument given by position (the search's model), the dtype of a
  # jax.Array argument, or the Program's jit options (the batch-invariant programs' compiler options): a fresh
  # Program would load the other call's executable.
  x = np.arange(4, dtype=np.float32)
  for k in (2.0, 3.0):
    result, loaded = loads(executables.Program(scaled, static_argnums=(0,)), k, x)
    assert not loaded
    np.testing.assert_array_equal(result, x * k)
  for dtype in (jnp.float32, jnp.bfloat16):
    result, loaded = loads(executables.Program(loop, static_argnames=('k',)), *map(jnp.asarray, arguments(8, dtype)),
                           k=2)
    assert not loaded and result.dtype == dtype
  _, loaded = loads(executables.Program(loop, static_argnames=('k',), keep_unused=True), *map(jnp.asarray, arguments()),
                    k=2)
  assert not loaded
  assert len(saved(saved_in)) == 5


def test_the_environment_tells_xla_flags_apart(monkeypatch):
  # Catches an environment that leaves out XLA_FLAGS: executables compiled under other flags (fast math, another
  # device count) would be loaded.
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_enable_fast_math=true')
  fast = executables.environment.__wrapped__()
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_enable_fast_math=false')
  assert executables.environment.__wrapped__() != fast


def test_the_environment_tells_versions_source_edits_devices_and_cpus_apart(monkeypatch, tmp_path):
  """Each thing a saved executable depends on besides its program, changed alone, changes the environment (and
  with it the folder the executables are saved in and loaded from). Catches an environment that leaves out the jax,
  jaxlib or flax version (an upgrade would run executables of the old one), an edit of any module of this package,
  one in a subpackage included (an edited model or search would still run as the saved program), the device kind
  (another accelerator reading a shared cache) or the CPU's instruction set (a cache on a shared home)."""
  package = tmp_path / 'flaxformer_nmt'
  (package / 'decoding').mkdir(parents=True)
  (package / 'runtime').mkdir()
  (package / '__init__.py').write_text('')
  module = package / 'decoding' / 'search.py'
  module.write_text('STEP = 1\n')
  monkeypatch.setattr(executables, '__file__', str(package / 'runtime' / 'executables.py'))
  environment = executables.environment.__wrapped__  # uncached
  base = environment()
  changed = {}
  for library in (jax, jaxlib, flax):
    with monkeypatch.context() as m:
      m.setattr(library, '__version__', library.__version__ + '.post1')
      changed[f'{library.__name__} version'] = environment()
  module.write_text('STEP = 2\n')
  changed['an edit in a subpackage'] = environment()
  module.write_text('STEP = 1\n')
  device = jax.devices()[0]
  with monkeypatch.context() as m:
    other = types.SimpleNamespace(platform=device.platform, device_kind='another kind', client=device.client)
    m.setattr(jax, 'devices', lambda *unused: [other])
    changed['device kind'] = environment()
  with monkeypatch.context() as m:
    m.setattr(executables, '_cpu_features', lambda: 'flags\t\t: fpu sse2\n')
    changed['CPU'] = environment()
  assert environment() == base  # every change undone
  for what, value in changed.items():
    assert value != base, what


def test_two_functions_of_one_name_in_two_modules_are_two_executables(saved_in):
  """Catches executables keyed by the function's bare name: a `_segment` of another module with the same
  signature would load this one's program and return its results."""
  def double(x):
    return 2 * x

  def triple(x):
    return 3 * x

  triple.__name__, triple.__qualname__, triple.__module__ = double.__name__, double.__qualname__, 'another.module'
  x = np.arange(4, dtype=np.float32)
  np.testing.assert_array_equal(executables.Program(double)(x), 2 * x)
  result, loaded = loads(executables.Program(triple), x)
  assert not loaded and len(saved(saved_in)) == 2
  np.testing.assert_array_equal(result, 3 * x)


def test_threads_asking_for_one_program_at_once_trace_and_compile_it_once(saved_in):
  """Catches a program obtained without a lock (the CPU search runs two batches at once): the threads'
  _compile_fresh calls interleave their raise and restore of JAX's persistent-cache floor, one restores the
  other's raised floor, and JAX's cache stays off for the rest of the process."""
  traces = []

  def slow_to_trace(x):
    traces.append(1)
    time.sleep(0.5)  # at trace time: the other thread asks meanwhile
    return x + 1

  program, x = executables.Program(slow_to_trace), np.arange(4, dtype=np.float32)
  floor = jax.config.jax_persistent_cache_min_compile_time_secs
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda _: np.asarray(program(x)), range(2)))
  assert len(traces) == 1 and len(saved(saved_in)) == 1
  assert jax.config.jax_persistent_cache_min_compile_time_secs == floor
  for result in results:
    np.testing.assert_array_equal(result, x + 1)
