"""Command-line parsing shared by the programs that take `--config FILE --config.field=value`, and the commands'
quiet stop when the reader of their output stops reading.

ml_collections reports an override of a field the config does not have as a 30-line traceback ending in
`AttributeError: "'no_such_field'"`. `parse_flags` (for `app.run(main, flags_parser=parse_flags)`) turns it
into one line naming the override and the nearest valid fields, and exits with status 1; so does a --config file
that cannot be opened (ml_collections raises that at the config's first use, as a traceback), and one whose code
fails (a syntax error, a name it does not define, no get_config): the file's line and Python's message.

"""
import difflib
import os
import sys
import traceback

import ml_collections
from absl import app
from absl import flags

from flaxformer_nmt import config as config_lib


def _config_file(argv):
  """The path given to --config (`--config=FILE`, `--config FILE`; a `FILE:arg` suffix dropped)."""
  for i, arg in enumerate(argv):
    if arg in ('--config', '-config') and i + 1 < len(argv):
      path = argv[i + 1]
    elif arg.startswith(('--config=', '-config=')):
      path = arg.split('=', 1)[1]
    else:
      continue
    return path if os.path.exists(path) or ':' not in path else path.rsplit(':', 1)[0]
  return None


def field_names(config, prefix=''):
  """Every dotted field name of a ConfigDict, nested ones included ('model', 'model.d_model', ...)."""
  names = []
  for key, value in config.items():
    names.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      names += field_names(value, f'{prefix}{key}.')
  return names


def unknown_override(argv, config):
  """(the --config.X override naming no field of `config`, the nearest valid names), or None."""
  known = set(field_names(config))
  for arg in argv[1:]:
    if not arg.startswith('--config.'):
      continue
    name = arg[len('--config.'):].split('=', 1)[0]
    if name not in known:
      return name, difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.5)
  return None


def unreadable_config(path):
  """The error line for a --config file that cannot be opened (missing, a directory, unreadable), or None."""
  try:
    with open(path, 'rb'):
      return None
  except OSError as e:
    return f'error: --config {path}: {e.strerror}'


def failing_config(path, error):
  """The error line for a --config file whose code raised `error` (a syntax error, a name it does not define, a
  module with no get_config), naming the file's line; None where `error` did not come from the file."""
  target, kind, python = os.path.abspath(path), type(error).__name__, 'a config is Python, as configs/*.py are'
  if isinstance(error, SyntaxError) and error.filename and os.path.abspath(error.filename) == target:
    return f'error: --config {path}, line {error.lineno}: {kind}: {error.msg} ({python})'
  lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == target]
  if lines:
    return f'error: --config {path}, line {lines[-1]}: {kind}: {error}'
  if isinstance(error, AttributeError) and getattr(error, 'name', None) == 'get_config':
    return f'error: --config {path}: the file defines no get_config() ({python})'
  return None


def unmakeable_directory(flag, path):
  """The error line for a directory given to --flag (an output or a workdir) that cannot be made because a file
  is there or above it, or None (a URL, gs://..., is not checked): a command checks it before its work, not at
  the first write after it."""
  if '://' in str(path):
    return None
  here = os.path.abspath(path)
  while not os.path.isdir(here):
    if os.path.lexists(here):
      where = 'is a file' if here == os.path.abspath(path) else f'is under the file {here}'
      return f'error: --{flag} {path}: {where}, not a directory'
    here = os.path.dirname(here)
  return None


def parse_flags(argv):
  """absl's flag parsing (`app.parse_flags_with_usage`); a --config file that cannot be opened, or an override of
  a field the config does not have, is one line and exit 1."""
  expanded = argv[:1] + flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)  # --flagfile's flags too
  path = _config_file(expanded)
  # ml_collections keeps an unopenable file's error until the config's first use, then raises a 40-line traceback.
  if path is not None and (message := unreadable_config(path)):
    sys.exit(message)
  try:
    return app.parse_flags_with_usage(argv)
  except Exception as error:  # pylint: disable=broad-except  (re-raised below unless it is one of these)
    if path is not None and (message := failing_config(path, error)):
      sys.exit(message)
    if not isinstance(error, (AttributeError, KeyError)):
      raise
    try:
      found = unknown_override(expanded, config_lib.load_config_file(path)) if path else None
    except Exception:  # pylint: disable=broad-except  (the config file's own error is reported below)
      found = None
    if found is None:
      raise error
    name, nearest = found
    hint = f'; did you mean {" or ".join(f"--config.{n}" for n in nearest)}?' if nearest else ''
    sys.exit(f'error: --config.{name}: the config of {path} has no field {name!r}{hint} (every field is '
             'described in flaxformer_nmt/config.py)')


def exit_for_closed_stdout():
  """Exits with status 1 and no message where the reader of stdout stopped reading (`| head`): the interpreter's
  flush of stdout as it exits goes to /dev/null, not to the closed pipe."""
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  sys.exit(1)
