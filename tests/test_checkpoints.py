"""Checkpoint averaging on hand-made checkpoints: the mean, and the refusal of mismatched shapes."""
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
  for step in (10, 20, 22):  # 22: an off-interval final save
    save(store, step, {'w': jnp.full((2,), float(step))})
  store.wait()
  config = config_lib.base_config()
  config.checkpoint_every_steps = 10
  workdir_lib.save_or_check_config(config, tmp_path)
  # The raw newest two (20, 22) would put the final save beside the regular one before it.
  params, description = loader.load_params(tmp_path, 'last:2')
  assert description == 'the average of checkpoints [10, 20]'
  np.testing.assert_allclose(params['w'], [15.0, 15.0])
  assert checkpoints_lib.average_last(tmp_path, last=2) == [10, 20]
  for last in (0, -1):  # on_grid[-0:] averaged them all, [-(-1):] all but the oldest
    with pytest.raises(checkpoints_lib.AveragingError, match=f'average the last {last} checkpoints: give 1'):
      checkpoints_lib.average_last(tmp_path, last=last)
  with pytest.raises(checkpoints_lib.AveragingError, match='more than once'):
    checkpoints_lib.average_last(tmp_path, steps=['20', '20', '10'])


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
