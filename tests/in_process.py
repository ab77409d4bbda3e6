"""A command's main run in the test process, as `python -m flaxformer_nmt.X ARGS` runs it in its own.

A subprocess costs the 2-core CI machine seconds that test nothing: importing jax, flax and orbax again (~2.5 s)
and tracing and lowering every program again (the compilation cache spares only XLA's part). Tests of what a
command does with its flags, input and output run its `main` here instead, the way absl's `app.run` would:
its flags defined and parsed, stdin, stdout and stderr its own, its absl log lines on stderr, `sys.exit` and
`app.UsageError` turned into an exit status. Each command keeps at least one real `python -m` run in the suite
(`as_subprocess=True`), which also covers its entry point.
"""
import functools
import importlib.util
import io
import logging
import os
import subprocess
import sys

from absl import app, flags
from absl import logging as absl_logging  # defines --verbosity

from flaxformer_nmt.runtime import executables
from flaxformer_nmt.runtime import flags as cli
from flaxformer_nmt.runtime import host_memory


_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'bench')


@functools.cache
def bench_script(name):
  """bench/{name}.py as a module (bench/ is no package): its functions, and its main for run() where it defines
  its flags in define_flags, as the commands do."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCH, f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# The trainer's main sets glibc's malloc to keep freed memory (host_memory.py), which slows every later compile
# of the process it runs in: not the test process's.
_ENVIRONMENT = {host_memory.ENV: '0'}


def run(module, args, stdin=None, as_subprocess=False):
  """subprocess.CompletedProcess(args, returncode, stdout, stderr) of `module.main` on `args` (stdin: str, or
  bytes for input that is not UTF-8); with as_subprocess=True, of `python -m module args` instead."""
  stdin_bytes = stdin if isinstance(stdin, bytes) else (stdin or '').encode('utf-8')
  if as_subprocess:
    result = subprocess.run([sys.executable, '-m', module.__name__, *args], input=stdin_bytes, capture_output=True,
                            timeout=300)
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode('utf-8', 'replace'),
                                       result.stderr.decode('utf-8', 'replace'))
  environment = {name: os.environ.get(name) for name in _ENVIRONMENT}
  os.environ.update(_ENVIRONMENT)
  defined = set(flags.FLAGS)
  module.define_flags()
  stdout, stderr = io.StringIO(), io.StringIO()
  log = logging.StreamHandler(stderr)
  absl_logger = absl_logging.get_absl_logger()
  absl_level = absl_logger.level
  absl_logger.addHandler(log)
  saved = sys.argv, sys.stdin, sys.stdout, sys.stderr
  executables_directory = executables.directory()  # a command turns saved executables on for its own run
  sys.argv = [module.__name__, *args]  # ml_collections' config flag finds its --config.FIELD overrides there
  sys.stdin = io.TextIOWrapper(io.BytesIO(stdin_bytes), encoding='utf-8')
  sys.stdout, sys.stderr = stdout, stderr
  parsed = None
  try:
    argv = cli.parse_flags(sys.argv)  # what app.run calls for train and corpora; absl's own parsing within it
    parsed = set(flags.FLAGS)  # the module's, and those its parsing added (--config.FIELD)
    if flags.FLAGS['verbosity'].using_default_value:  # as app.run: INFO, unless the args chose a level
      flags.FLAGS.verbosity = 0
    module.main(argv)
    returncode = 0
  except flags.Error as e:  # app.run: the error and usage, exit 1
    print(f'FATAL Flags parsing error: {e}', file=stderr)
    returncode = 1
  except app.UsageError as e:
    print(e, file=stderr)
    returncode = e.exitcode
  except SystemExit as e:  # sys.exit(message) prints it and exits 1; sys.exit(n) exits n
    if isinstance(e.code, str):
      print(e.code, file=stderr)
    returncode = 1 if isinstance(e.code, str) else (e.code or 0)
  finally:
    sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
    for name, value in environment.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
    executables.enable(executables_directory)
    sys.modules.pop('config_config', None)  # ml_collections loads a --config file into this module, reusing it
    absl_logger.removeHandler(log)
    flags.FLAGS.unparse_flags()  # the verbosity too, which sets absl's logger at WARNING:
    absl_logger.setLevel(absl_level)  # as before the run, or a later test's caplog misses INFO lines
    # Those a library defines when main first imports it stay, as its module stays imported.
    for name in (set(flags.FLAGS) if parsed is None else parsed) - defined:
      delattr(flags.FLAGS, name)
  return subprocess.CompletedProcess([module.__name__, *args], returncode, stdout.getvalue(), stderr.getvalue())
