"""Where the toolkit keeps what it can reuse between runs: downloads, tokenized corpora and compiled programs."""
import os

import jax
from absl import logging
from etils import epath

CACHE_ENV = 'FLAXFORMER_NMT_CACHE'


def cache_dir():
  """$FLAXFORMER_NMT_CACHE, else $XDG_CACHE_HOME/flaxformer_nmt, else ~/.cache/flaxformer_nmt."""
  if os.environ.get(CACHE_ENV):
    return epath.Path(os.environ[CACHE_ENV])
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return epath.Path(base) / 'flaxformer_nmt'


def use_compilation_cache():
  """Keeps compiled programs in JAX's persistent cache, `{cache_dir()}/jax_compilation` unless
  $JAX_COMPILATION_CACHE_DIR names another (empty: off), so that the next run of the same command with the
  same shapes loads them instead of compiling again (decoding test2016 compiles ~25 loop shapes, ~1 s each on
  a 2-core CPU)."""
  if 'JAX_COMPILATION_CACHE_DIR' in os.environ:  # JAX reads it itself
    return
  directory = cache_dir() / 'jax_compilation'
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    logging.warning('No compilation cache (%s): every run compiles again.', e)
    return
  jax.config.update('jax_compilation_cache_dir', str(directory))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)  # the small programs too
