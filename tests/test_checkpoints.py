"""Checkpoint averaging on hand-made checkpoints: the mean, and the refusal of mismatched shapes."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.training.step import TrainState


def save(store, step, params):
  state = TrainState(step=jnp.asarray(step), params=params, opt_state={'mu': params}, rng=jnp.zeros(2, jnp.uint32))
  store.save(step, state, {'epoch': 0, 'batch': step, 'seed': 0}, force=True)


def test_average_of_the_last_k_is_their_mean(tmp_path):
  store = checkpoints_lib.Checkpoints(tmp_path, keep=3)
  rng = np.random.default_rng(0)
  saved = {}
  for step in (1, 2, 3, 4):
    saved[step] = {'dense': {'kernel': rng.normal(size=(3, 4)).astype(np.float32)},
                   'bias': rng.normal(size=(4,)).astype(np.float32)}
    save(store, step, jax_tree(saved[step]))
  store.wait()
  assert store.steps() == [2, 3, 4]  # keep=3
  assert checkpoints_lib.average_last(tmp_path, last=2) == [3, 4]
  params, info = checkpoints_lib.load_averaged(tmp_path)
  assert info == {'steps': [3, 4]}
  np.testing.assert_allclose(params['dense']['kernel'], (saved[3]['dense']['kernel'] + saved[4]['dense']['kernel']) / 2,
                             rtol=1e-6)
  np.testing.assert_allclose(params['bias'], (saved[3]['bias'] + saved[4]['bias']) / 2, rtol=1e-6)


def test_last_k_of_the_loader_is_the_window_average_takes_and_bad_counts_are_refused(tmp_path):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import loader  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  store = checkpoints_lib.Checkpoints(tmp_path, keep=0)
  for step in (10, 20, 27):  # 27: an off-interval final save, too far after 20 for the spacing rule to drop it
    save(store, step, {'w': jnp.full((2,), float(step))})
  store.wait()
  config = config_lib.base_config()
  config.checkpoint_every_steps = 10
  workdir_lib.save_or_check_config(config, tmp_path)
  # The raw newest two (20, 27) would put the final save beside the regular one before it; config.json's
  # checkpoint_every_steps leaves it out (without it, averaging_window's spacing rule keeps 27).
  params, description = loader.load_params(tmp_path, 'last:2')
  assert description == 'the average of checkpoints [10, 20]'
  np.testing.assert_allclose(params['w'], [15.0, 15.0])
  assert checkpoints_lib.average_last(tmp_path, last=2) == [10, 20]
  for last in (0, -1):  # on_grid[-0:] averaged them all, [-(-1):] all but the oldest
    with pytest.raises(checkpoints_lib.AveragingError, match=f'average the last {last} checkpoints: give 1'):
      checkpoints_lib.average_last(tmp_path, last=last)
  with pytest.raises(checkpoints_lib.AveragingError, match='more than once'):
    checkpoints_lib.average_last(tmp_path, steps=['20', '20', '10'])



def test_best_and_averaged_are_checked_up_front_and_load_their_own_parameters(tmp_path):
  """compare checks every name it is given before it translates with the first (check_checkpoint); then
  --checkpoint best of a run whose best evaluation was not its last, and averaged: the parameters they name."""
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import best as best_checkpoint  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import loader  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  store = checkpoints_lib.Checkpoints(tmp_path, keep=0)
  for step in (10, 20, 30):
    save(store, step, {'w': jnp.full((2,), float(step))})
  store.wait()
  workdir_lib.save_or_check_config(config_lib.base_config(), tmp_path)
  for name, message in (('best', 'best.json not found'), ('averaged', 'averaged not found'),
                        ('40', 'no checkpoint 40 in')):
    with pytest.raises(FileNotFoundError, match=message):
      loader.check_checkpoint(tmp_path, name)
  for name in ('latest', '20', 'last:2'):
    loader.check_checkpoint(tmp_path, name)
  for name, message in (('latest', 'no checkpoint latest in'), ('last:2', 'no checkpoints to average')):
    with pytest.raises(FileNotFoundError, match=message):
      loader.check_checkpoint(tmp_path / 'untrained', name)
  best_checkpoint.BestCheckpoint(tmp_path, 'bleu').update(10, {'w': np.full((2,), 10.0)}, {'eval/bleu': 5.0})
  params, description = loader.load_params(tmp_path, 'best')
  np.testing.assert_allclose(params['w'], [10.0, 10.0])
  assert description == 'the best checkpoint (step 10, bleu 5)'
  checkpoints_lib.average_last(tmp_path, steps=[10, 20])
  params, description = loader.load_params(tmp_path, 'averaged')
  np.testing.assert_allclose(params['w'], [15.0, 15.0])
  assert description == 'the average of checkpoints [10, 20]'
  for name in ('best', 'averaged'):
    loader.check_checkpoint(tmp_path, name)


def test_last_k_with_fewer_regular_checkpoints_says_how_many_it_averaged(tmp_path, caplog):
  """Wrong rule caught: decode --checkpoint last:5 of a workdir holding 2 regular saves averaged those 2 without a
  word, where the average command warns with the count."""
  import logging  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import loader  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  saved_run(tmp_path, (10, 20, 22))  # 22: an off-interval final save
  config = config_lib.base_config()
  config.checkpoint_every_steps = 10
  workdir_lib.save_or_check_config(config, tmp_path)
  with caplog.at_level(logging.WARNING):
    params, description = loader.load_params(tmp_path, 'last:5')
  assert description == 'the average of checkpoints [10, 20]'
  np.testing.assert_allclose(params['w'], [(10 + 20) / 2] * 2)
  assert 'last:5 averages 2 checkpoints [10, 20], fewer than the 5 asked' in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert loader.load_params(tmp_path, 'last:2')[1] == 'the average of checkpoints [10, 20]'
  assert 'fewer than' not in caplog.text


def test_mismatched_shapes_are_refused_by_name(tmp_path):
  store = checkpoints_lib.Checkpoints(tmp_path, keep=0)
  save(store, 1, {'w': jnp.zeros((2, 3))})
  save(store, 2, {'w': jnp.zeros((2, 4))})
  store.wait()
  with pytest.raises(checkpoints_lib.AveragingError, match=r"differ in shape at params\['w'\]: \(2, 3\) vs \(2, 4\)"):
    checkpoints_lib.average_params(tmp_path, [1, 2])
  with pytest.raises(checkpoints_lib.AveragingError, match='not found'):
    checkpoints_lib.average_params(tmp_path, [7])


def jax_tree(tree):
  return {k: jax_tree(v) if isinstance(v, dict) else jnp.asarray(v) for k, v in tree.items()}


def test_listing_the_steps_of_a_workdir_without_checkpoints_writes_nothing(tmp_path):
  """decode --checkpoint latest, warm starts and averaging list a workdir's steps before anything else; a
  mistyped or empty workdir must get its error without gaining a `checkpoints/` folder (orbax's manager makes
  the directory it opens)."""
  assert checkpoints_lib.saved_steps(tmp_path / 'typo') == []
  assert not (tmp_path / 'typo').exists()
  (tmp_path / 'empty').mkdir()
  assert checkpoints_lib.saved_steps(tmp_path / 'empty') == []
  assert list((tmp_path / 'empty').iterdir()) == []


def saved_run(workdir, steps, keep=0, every_steps=None):
  """Hand-made checkpoints of parameters {'w': [step, step]} at `steps`."""
  store = checkpoints_lib.Checkpoints(workdir, keep=keep, every_steps=every_steps)
  for step in steps:
    save(store, step, {'w': jnp.full((2,), float(step))})
  store.wait()
  store.close()


def test_a_failed_new_average_leaves_the_old_one_and_a_missing_one_is_named(tmp_path, monkeypatch):
  """Wrong rule caught: re-averaging removed averaged/params before writing the new one, so a failed write (disk
  full, a kill) left averaged.json naming parameters that were gone, and reading them crashed with
  AttributeError ('NoneType' ... 'tree') instead of an error naming the missing path."""
  import errno  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import best as best_lib  # pylint: disable=g-import-not-at-top
  saved_run(tmp_path, (10, 20))
  checkpoints_lib.average_last(tmp_path, steps=[10, 20])

  async def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'async_save', no_space)
  with pytest.raises(OSError, match='No space left'):
    checkpoints_lib.average_last(tmp_path, steps=[10])
  monkeypatch.undo()
  params, info = checkpoints_lib.load_averaged(tmp_path)
  assert info == {'steps': [10, 20]}
  np.testing.assert_array_equal(params['w'], [15.0, 15.0])
  assert checkpoints_lib.average_last(tmp_path, steps=[10]) == [10]  # the next write replaces it
  assert checkpoints_lib.load_averaged(tmp_path)[1] == {'steps': [10]}
  assert sorted(p.name for p in tmp_path.iterdir()) == ['averaged', 'checkpoints']
  # Parameters that are gone (or were never written whole) are named, for the averaged and the best checkpoint.
  (tmp_path / 'averaged' / 'params').rename(tmp_path / 'elsewhere')
  with pytest.raises(FileNotFoundError, match=re.escape(f'{tmp_path}/averaged/params not found')):
    checkpoints_lib.load_averaged(tmp_path)
  (tmp_path / 'averaged' / 'params').mkdir()
  with pytest.raises(FileNotFoundError, match='averaged/params holds no checkpoint'):
    checkpoints_lib.load_averaged(tmp_path)
  (tmp_path / 'best').mkdir()
  (tmp_path / 'best' / 'best.json').write_text('{"metric": "loss", "step": 20, "value": 1.0, "params": "params_20"}')
  with pytest.raises(FileNotFoundError, match='best/params_20 not found'):
    best_lib.load_best(tmp_path)


def test_the_average_command_takes_the_window_the_trainer_averages(tmp_path):
  """Wrong rule caught: without --last the command averaged the newest 5, whatever the workdir's
  config.average_last_checkpoints, and so replaced the trainer's average with another window."""
  import in_process  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import average  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  saved_run(tmp_path, (10, 20, 30, 40, 50))
  config = config_lib.base_config()
  config.checkpoint_every_steps, config.average_last_checkpoints = 10, 2
  workdir_lib.save_or_check_config(config, tmp_path)
  result = in_process.run(average, [f'--workdir={tmp_path}'])
  assert result.returncode == 0, result.stderr[-2000:]
  assert checkpoints_lib.load_averaged(tmp_path)[1] == {'steps': [40, 50]}
  assert in_process.run(average, [f'--workdir={tmp_path}', '--last=3']).returncode == 0
  assert checkpoints_lib.load_averaged(tmp_path)[1] == {'steps': [30, 40, 50]}
  config.average_last_checkpoints = 0  # the trainer averaged nothing: the flag's documented default
  workdir_lib.write_config(config, tmp_path)
  assert in_process.run(average, [f'--workdir={tmp_path}']).returncode == 0
  assert checkpoints_lib.load_averaged(tmp_path)[1] == {'steps': [10, 20, 30, 40, 50]}


def test_the_trainers_end_averages_average_last_checkpoints_and_a_paused_run_neither_averages_nor_finishes(tmp_path):
  """The trainer's end (loop.finish) on hand-made checkpoints 10..40 kept by config.keep_checkpoints=4 with
  config.average_last_checkpoints=2: the average is of 30 and 40, and finished.json names the step. A run
  paused by a stop signal leaves both for the launch that ends it. Catches the window sized by keep_checkpoints."""
  import types  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import loop  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.base_config()
  config.checkpoint_every_steps, config.keep_checkpoints, config.average_last_checkpoints = 10, 4, 2
  for workdir, signalled in ((tmp_path / 'ended', False), (tmp_path / 'paused', True)):
    saved_run(workdir, (10, 20, 30, 40), keep=4, every_steps=10)
    workdir_lib.write_config(config, workdir)
    run = types.SimpleNamespace(config=config, workdir=workdir, state=None, close=lambda last_state: None,
                                log=types.SimpleNamespace(write=lambda step, metrics: None))
    decision = types.SimpleNamespace(signalled=signalled,
                                     reason='a stop signal' if signalled else 'config.num_train_steps')
    loop.finish(run, 40, decision, metrics_lib.WallClock())
  assert checkpoints_lib.load_averaged(tmp_path / 'ended')[1] == {'steps': [30, 40]}
  finished = json.loads((tmp_path / 'ended' / 'finished.json').read_text())
  assert (finished['step'], finished['reason']) == (40, 'config.num_train_steps')
  assert not (tmp_path / 'paused' / 'averaged').exists() and not (tmp_path / 'paused' / 'finished.json').exists()


def test_an_empty_steps_flag_is_refused_not_taken_for_the_default_window(tmp_path):
  """Wrong rule caught: --steps= (say --steps=$STEPS with STEPS unset) averaged the default window and replaced
  averaged/ without a word."""
  import in_process  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import average  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  saved_run(tmp_path, (10, 20, 30))
  config = config_lib.base_config()
  config.checkpoint_every_steps, config.average_last_checkpoints = 10, 2
  workdir_lib.save_or_check_config(config, tmp_path)
  result = in_process.run(average, [f'--workdir={tmp_path}', '--steps='])
  assert result.returncode != 0 and '--steps is empty' in result.stderr, result.stderr[-2000:]
  assert not (tmp_path / 'averaged').exists()


_READ_ONLY_AVERAGE = '''
import errno, os, runpy, sys
workdir, real_mkdir = sys.argv[1], os.mkdir
def mkdir(path, *args, **kwargs):  # as a read-only mount answers: an existing folder exists, nothing new is made
  if os.fspath(path).startswith(workdir):
    if os.path.exists(path):
      raise FileExistsError(errno.EEXIST, 'File exists', os.fspath(path))
    raise OSError(errno.EROFS, 'Read-only file system', os.fspath(path))
  return real_mkdir(path, *args, **kwargs)
os.mkdir = mkdir
sys.argv = ['average', '--workdir=' + workdir, '--steps=10,20']
runpy.run_module('flaxformer_nmt.average', run_name='__main__')
'''


def test_averaging_a_read_only_workdir_is_one_error_line_not_a_hang(tmp_path):
  """Wrong rule caught: on a read-only workdir the average command printed orbax's traceback and then never
  exited (orbax's writer threads waited for ever once it could not make its folder)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from conftest import subprocess_env  # pylint: disable=g-import-not-at-top
  saved_run(tmp_path, (10, 20))
  before = sorted(p.name for p in tmp_path.iterdir())
  try:
    result = subprocess.run([sys.executable, '-c', _READ_ONLY_AVERAGE, str(tmp_path)], capture_output=True,
                            text=True, env=subprocess_env(), timeout=60)
  except subprocess.TimeoutExpired:
    pytest.fail('the average command did not exit')
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(
      f'error: the average cannot be written into {tmp_path} ([Errno 30] Read-only file system: ')
  assert 'Traceback' not in result.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_retention_keeps_the_regular_saves_an_off_interval_save_would_push_out(tmp_path):
  """Wrong rule caught: rotation kept the newest `keep` of any kind, so a stop signal's save (35) and the final one
  (45) pushed regular saves out and the average of the last 2 became [40] alone instead of [30, 40]. Saving by
  time alone (nothing on the interval) still keeps the newest `keep`."""
  saved_run(tmp_path / 'steps', (10, 20, 30, 35, 40, 45), keep=3, every_steps=10)
  assert checkpoints_lib.saved_steps(tmp_path / 'steps') == [20, 30, 35, 40, 45]
  assert checkpoints_lib.average_last(tmp_path / 'steps', last=2, every_steps=10) == [30, 40]
  saved_run(tmp_path / 'time', (3, 7, 12, 16), keep=2, every_steps=1000)
  assert checkpoints_lib.saved_steps(tmp_path / 'time') == [12, 16]


def test_a_path_that_is_no_workdir_is_named_as_such(tmp_path):
  """decode --workdir with a typo said only "No such file or directory: '.../vocab.model'"."""
  from flaxformer_nmt.checkpointing import loader  # pylint: disable=g-import-not-at-top
  for ensemble in (False, True):
    with pytest.raises(FileNotFoundError, match=f'{tmp_path / "nope"} is not a training workdir'):
      loader.load_for_inference(tmp_path / 'nope', ensemble=ensemble)
