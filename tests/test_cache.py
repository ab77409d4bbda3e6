"""Where the toolkit keeps its caches (runtime/cache.py): the directory its variables name, and a cache
that cannot be made or is turned off."""
import logging

import jax

from flaxformer_nmt.runtime import cache
from flaxformer_nmt.runtime import executables


def test_the_cache_directory_follows_the_variables_in_their_order(monkeypatch, tmp_path):
  # Catches $XDG_CACHE_HOME ignored (the user's cache moved off a small home), or preferred to the package's own
  # variable.
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  monkeypatch.delenv(cache.CACHE_ENV, raising=False)
  monkeypatch.delenv('XDG_CACHE_HOME', raising=False)
  assert str(cache.cache_dir()) == str(tmp_path / 'home' / '.cache' / 'flaxformer_nmt')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert str(cache.cache_dir()) == str(tmp_path / 'xdg' / 'flaxformer_nmt')
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'own'))
  assert str(cache.cache_dir()) == str(tmp_path / 'own')


def test_a_cache_that_cannot_be_made_or_is_turned_off_leaves_the_programs_compiling(monkeypatch, tmp_path, caplog):
  """A cache path that is a file (or a read-only home): the command goes on without a cache, with a warning, and
  JAX_COMPILATION_CACHE_DIR='' (JAX's way to turn its cache off) turns the saved executables off too. Catches the
  OSError ending the command, and the empty directory read as the working directory (an `executables` folder
  written wherever the command runs)."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv('JAX_COMPILATION_CACHE_DIR', raising=False)
  (tmp_path / 'taken').write_text('a file where the cache would go')
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'taken'))
  before, cache_before = executables.directory(), jax.config.jax_compilation_cache_dir
  with caplog.at_level(logging.WARNING):
    cache.use_compilation_cache()
  assert 'No compilation cache' in caplog.text and jax.config.jax_compilation_cache_dir == cache_before
  monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', '')
  cache.use_compilation_cache()
  assert executables.directory() == before and sorted(p.name for p in tmp_path.iterdir()) == ['taken']


def test_a_counter_that_ends_while_a_program_is_reported_leaves_the_others_counting():
  # The server decodes two batches at once, each counting its programs (a batch that compiled leaves the admission
  # rate alone), and the event loop ends one batch's counter while the other's thread reports a program. Catches
  # counters kept in jax.monitoring's own lists, which jax walks without a copy: a listener removed meanwhile made
  # it skip the next, and the other batch took its compile's seconds as the decoding rate.
  older = cache.ProgramCounter()

  def ends_meanwhile(event, duration, **kwargs):  # here the event loop's thread ends the older batch's counter
    cache.ProgramCounter._program(older, event, duration, **kwargs)  # pylint: disable=protected-access
    older.__exit__(None, None, None)

  older._program = ends_meanwhile  # pylint: disable=protected-access
  older.__enter__()
  with cache.ProgramCounter() as younger:
    jax.monitoring.record_event_duration_secs(cache.PROGRAM_EVENT, 0.5, fun_name='jit(compiled)')
    jax.monitoring.record_event_duration_secs(cache.PROGRAM_EVENT, 0.25, fun_name='jit(later)')
  assert older.names == ['jit(compiled)'] and younger.names == ['jit(compiled)', 'jit(later)']
  assert younger.seconds == 0.75
