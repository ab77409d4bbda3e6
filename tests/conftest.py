"""Shared fixtures: a tiny random Transformer, a small synthetic parallel corpus and a toy model trained on it
once per session."""
import fcntl
import functools
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

# One persistent compilation cache for the test session, read and written by its subprocesses too: the commands a
# test runs as subprocesses load the programs the suite already compiled (the default suite: 695 s against 821 s
# without it, 2 Zen 4 cores). TESTS_COMPILATION_CACHE=0 compiles everything afresh. jax reads these variables on
# import.
# The session's first process makes the directory and removes it at its end; the processes it starts (xdist's
# workers, the scripts that import this file) find it in their environment and share it.
_COMPILATION_CACHE = None
_SESSION_CACHE_VARIABLE = 'FLAXFORMER_NMT_TESTS_COMPILATION_CACHE'
if os.environ.get('TESTS_COMPILATION_CACHE', '1') == '1':
  if not os.environ.get(_SESSION_CACHE_VARIABLE):
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix='flaxformer_nmt_tests_jax_cache_')
    os.environ[_SESSION_CACHE_VARIABLE] = _COMPILATION_CACHE
  os.environ['JAX_COMPILATION_CACHE_DIR'] = os.environ[_SESSION_CACHE_VARIABLE]
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'  # the small programs too
else:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = ''  # off in the subprocesses and the commands run in process too

# The tests compile hundreds of small programs and run each for a few steps: at LLVM optimization level 0 XLA's
# CPU backend compiles them ~3x faster (the toy trainer's step: 11.9 s -> 3.8 s on a 2-core Zen 3) for code
# that runs slower, which tiny models do not feel. Subprocesses inherit it. TESTS_XLA_OPTIMIZE=1 keeps XLA's
# default level (the level users train at).
if os.environ.get('TESTS_XLA_OPTIMIZE', '0') != '1':
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0').strip()


def _jaxlib_older_than(version):
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    installed = metadata.version('jaxlib')
  except metadata.PackageNotFoundError:
    return False
  return tuple(int(part) for part in installed.split('.')[:2]) < version


# In jaxlib 0.10, XLA's CPU backend can still emit fusions with its older elemental emitter instead of the MLIR
# fusion emitters (jaxlib 0.11.2, the GPU machines', and 0.12 have only those, and abort on the flag): it compiles
# the toy trainer's step in half the time (4.3-5.4 s -> 2.0-2.5 s, jaxlib 0.10.2 on the 2-core Zen 3), for code
# that agrees to float32 rounding. With it the oldest stack's pytest took 1,330 s instead of 1,698 s in CI (the
# newest's: 1,470 s). TESTS_XLA_OPTIMIZE=1 keeps XLA's defaults here too.
if os.environ.get('TESTS_XLA_OPTIMIZE', '0') != '1' and _jaxlib_older_than((0, 11)):
  os.environ['XLA_FLAGS'] += ' --xla_cpu_use_fusion_emitters=false'

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import executables  # pylint: disable=wrong-import-position


def distinct_vectors(params):
  """params with every LayerNorm scale and bias and every feed-forward bias made different: at init they are all
  ones or zeros, and a sub-layer reading another one's LayerNorm, or a missing bias, would go unseen."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  return jax.tree_util.tree_unflatten(tree, [x + 0.3 * jax.random.normal(key, x.shape) if x.ndim == 1 else x
                                             for x, key in zip(leaves, keys)])


def tiny_model(vocab_size=16, pre_layer_norm=False, dropout_rate=0.0):
  """(model, params) of a tiny random Transformer; the same weights at every call with the same arguments."""
  model, params = _tiny_model(vocab_size, pre_layer_norm, dropout_rate)
  return model, jax.tree_util.tree_map(lambda x: x, params)  # the test's own dicts (the arrays are immutable)


@functools.lru_cache(maxsize=None)  # ~45 tests ask for it: 0.2 s of eagerly run init each, after the first
def _tiny_model(vocab_size, pre_layer_norm, dropout_rate):
  config = model_lib.ModelConfig(vocab_size=vocab_size, num_encoder_layers=2, num_decoder_layers=2, d_model=32,
                                 d_ff=64, num_heads=4, dropout_rate=dropout_rate, pre_layer_norm=pre_layer_norm,
                                 max_position=128, dtype='float32')
  model = model_lib.Transformer(config)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), dummy, dummy)['params']
  # Sharper than the init distribution, so that searches have clear winners and losers to find.
  params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim == 2 else x, params)
  return model, params


_TESTS = os.path.dirname(os.path.abspath(__file__))


def subprocess_env(**variables):
  """The environment for a test's Python subprocess: the caller's, with the repository and tests/ in front of
  its PYTHONPATH (kept: packages installed with --target or carried to a GPU machine live there), and
  `variables` set."""
  path = os.pathsep.join(p for p in (os.path.dirname(_TESTS), _TESTS, os.environ.get('PYTHONPATH', '')) if p)
  return dict(os.environ, PYTHONPATH=path, **variables)


def as_a_foreground_job():
  """A subprocess's preexec_fn: the signal actions of a command a terminal's shell runs in the foreground (Ctrl-C,
  hang-up, kill), also where the tests run with SIGHUP or SIGINT ignored (under `nohup`, as a shell's background
  job), which the child would otherwise inherit."""
  for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
    signal.signal(signum, signal.SIG_DFL)


def first_line_then_close(module, args, stdin):
  """(the first stdout line, exit status, stderr) of `python -m module args` whose reader closes its stdout after
  that line, as `| head -1` does."""
  with subprocess.Popen([sys.executable, '-m', module.__name__, *args], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env()) as process:
    process.stdin.write(stdin.encode('utf-8'))
    process.stdin.close()
    first = process.stdout.readline().decode('utf-8')
    process.stdout.close()
    stderr = process.stderr.read().decode('utf-8', 'replace')
    return first, process.wait(timeout=300), stderr


def xla_flags_without_device_count():
  """This process's XLA_FLAGS less a CPU device count: a subprocess given them has JAX's one CPU device, or the
  count its own code asks for."""
  from flaxformer_nmt.runtime import sharding  # pylint: disable=g-import-not-at-top
  flags = os.environ.get('XLA_FLAGS', '').split()
  return ' '.join(f for f in flags if not f.startswith(sharding.XLA_DEVICE_COUNT_FLAG))


@pytest.fixture
def full_float32_matmuls():
  """float32 matmuls at full precision for the test. A GPU runs them as TF32 by default (a 10-bit mantissa):
  measured on an H200 (2026-11-29), the forward pass differed from the float64 NumPy Transformer by up to 2% and
  a cached search chose another hypothesis than the uncached one. On a CPU this changes nothing."""
  with jax.default_matmul_precision('highest'):
    yield


@pytest.fixture
def tiny():
  return tiny_model()


WORDS = {'a': 'ein', 'big': 'grosser', 'small': 'kleiner', 'dog': 'hund', 'cat': 'katze', 'runs': 'rennt',
         'sleeps': 'schlaeft', 'red': 'roter', 'man': 'mann', 'sees': 'sieht', 'the': 'der', 'ball': 'ball'}


def write_toy_corpus(directory, splits=(('train', 300), ('valid', 20), ('test', 20)), seed=0):
  """Word-by-word 'translation' of random sentences: learnable in a few hundred steps."""
  rng = random.Random(seed)
  directory.mkdir(parents=True, exist_ok=True)
  en_words = list(WORDS)
  for split, n in splits:
    src, tgt = [], []
    for _ in range(n):
      sentence = [rng.choice(en_words) for _ in range(rng.randint(2, 8))]
      src.append(' '.join(sentence) + ' .')
      tgt.append(' '.join(WORDS[w] for w in sentence) + ' .')
    (directory / f'{split}.en').write_text('\n'.join(src) + '\n')
    (directory / f'{split}.de').write_text('\n'.join(tgt) + '\n')
  return directory


@pytest.fixture
def toy_corpus(tmp_path):
  return write_toy_corpus(tmp_path / 'data')


def small_config(data_dir):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.data_dir = str(data_dir)
  c.vocab_size = 64
  c.tokens_per_batch = 512
  c.length_buckets = (16, 32)
  c.model.num_encoder_layers = 1
  c.model.num_decoder_layers = 1
  c.model.d_model = 32
  c.model.d_ff = 64
  c.model.num_heads = 2
  c.model.dtype = 'float32'
  c.warmup_steps = 20
  c.learning_rate_scale = 2.0
  c.num_train_steps = 20
  c.log_every_steps = 5
  c.eval_every_steps = 10
  c.checkpoint_every_steps = 10
  c.keep_checkpoints = 3
  c.average_last_checkpoints = 0
  c.decode_tokens_per_batch = 256
  c.max_decode_extra_length = 10
  return c


def trained_toy_config(root):
  """small_config on the toy corpus in root/data, for the session's trained toy (`trained_toy`): 400 steps at
  learning-rate scale 0.5 (at 2.0 the toy stalls at "." outputs), checkpoints every 100 of which the last two are
  kept and averaged, validation BLEU (greedy) at 200 and 400 against root/tok's tokenized references too, and the
  best checkpoint by BLEU."""
  config = small_config(root / 'data')
  config.learning_rate_scale = 0.5
  config.num_train_steps = 400
  config.log_every_steps = 50
  config.eval_every_steps = 200
  config.checkpoint_every_steps = 100
  config.keep_checkpoints = 2
  config.average_last_checkpoints = 2
  config.eval_bleu_every_steps = 200
  config.eval_bleu_beam_size = 0
  config.eval_bleu_tok_ref_dir = str(root / 'tok')
  config.best_checkpoint_metric = 'bleu'
  return config


def built_once(tmp_path_factory, name, build):
  """The directory `name`, made by build(directory) once per test session: under pytest-xdist in the directory its
  workers share, by the first worker to ask for it while the others wait."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent  # this session's, above each worker's own
  root = shared / name
  with open(shared / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / 'built').exists():
      shutil.rmtree(root, ignore_errors=True)  # a worker that failed part-way
      root.mkdir()
      build(root)
      (root / 'built').touch()
  return root


@pytest.fixture(scope='session')
def trained_toy(tmp_path_factory):
  """The workdir of a toy model trained once per test session (trained_toy_config): it translates the toy
  corpus partly (validation BLEU 20-30, a quarter of the test lines exactly), with outputs of 2 to 20-odd
  pieces. Checkpoints 300 and 400, their average, the best; the corpus in workdir.parent / 'data'. Shared by
  every test that reads a trained workdir: a test that changes it works on a copy (shutil.copytree)."""
  return built_once(tmp_path_factory, 'trained_toy', _train_toy) / 'run'


def _train_toy(root):
  from flaxformer_nmt.evaluation import bleu  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import loop  # pylint: disable=g-import-not-at-top
  write_toy_corpus(root / 'data')
  (root / 'tok').mkdir()
  references = (root / 'data' / 'valid.de').read_text().splitlines()
  (root / 'tok' / 'valid.de').write_text('\n'.join(bleu.moses_lowercase_tokenize(references, 'de')) + '\n')
  loop.train_and_evaluate(trained_toy_config(root), root / 'run')


def copy_of_trained_toy(trained_toy, directory, **config_fields):
  """A copy of the trained toy's workdir, its corpus beside it, for a test that writes into it or changes
  `config_fields` of its config.json (top-level fields)."""
  root = shutil.copytree(trained_toy.parent, directory)
  workdir = root / trained_toy.name
  if config_fields:
    saved = json.loads((workdir / 'config.json').read_text())
    saved.update(config_fields)
    (workdir / 'config.json').write_text(json.dumps(saved))
  return workdir


@pytest.fixture
def traces():
  """The names of the functions jax traces for jit while the test runs, in order (jax.monitoring's trace
  events: a call that reuses a compiled program, or a trace cached by an earlier call, adds none)."""
  names = []

  def listener(event, duration, **kwargs):
    if event == '/jax/core/compile/jaxpr_trace_duration':
      names.append(kwargs.get('fun_name'))
  jax.monitoring.register_event_duration_secs_listener(listener)
  yield names
  jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def checkpoint_closes(monkeypatch):
  """The directories of the Checkpoints closed while the test runs, in order (Checkpoints.close still runs)."""
  from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib  # pylint: disable=g-import-not-at-top
  closed = []
  close = checkpoints_lib.Checkpoints.close
  monkeypatch.setattr(checkpoints_lib.Checkpoints, 'close', lambda self: (closed.append(self.directory), close(self)))
  return closed


@pytest.fixture
def evaluation_fails_at(monkeypatch):
  """evaluation_fails_at(step): the loop's evaluation after `step` raises RuntimeError('the evaluation failed'),
  the others run as usual (monkeypatch.undo() restores it)."""
  from flaxformer_nmt.training import loop as train  # pylint: disable=g-import-not-at-top
  evaluate_step = train.evaluate_step

  def fail_at(failing_step):
    def failing_evaluation(run, step, *args):
      if step == failing_step:
        raise RuntimeError('the evaluation failed')
      return evaluate_step(run, step, *args)
    monkeypatch.setattr(train, 'evaluate_step', failing_evaluation)
  return fail_at


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_programs():
  """Drops every compiled program after each test module. XLA's CPU backend maps ~4 memory regions per program
  it holds (code, read-only data, data) and jit keeps every program it compiled: the whole suite in one process
  passed Linux's default vm.max_map_count (65,530) and XLA crashed (SIGSEGV) in the next compile."""
  yield
  jax.clear_caches()
  executables.clear()
  gc.collect()


def pytest_collection_modifyitems(session, config, items):  # pylint: disable=unused-argument
  """Tests marked `profiler` run first. jax.profiler's stop_trace writes out every compiled program the
  process holds (measured: a 5-step toy run's 2-step trace took 1.3 s in a fresh process, 5.0 s once 40 small
  searches had been compiled); late in the suite, with hundreds held, each such test took 9-12 s."""
  items.sort(key=lambda item: item.get_closest_marker('profiler') is None)  # stable: the rest keep their order


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  if _COMPILATION_CACHE:
    shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)
