"""Orbax checkpoints under `{workdir}/checkpoints/{step}`: the whole train state plus the data position.

Each checkpoint holds two items: `state` (step, parameters, optimizer state, dropout key) and `data` (the
training iterator's position, a small JSON dict), so a restarted run continues where the last one stopped.
Only the newest `keep` checkpoints are kept. Orbax writes each checkpoint to a temporary directory and renames
it when complete, so a half-written one is never listed; a listed one that fails to restore (truncated or
missing files) is moved to `{workdir}/corrupt_checkpoints/` with a warning and the previous one is used, so
retention can never delete the last good checkpoint in its favour.

Averaging (the paper averages the last 5 or 20 checkpoints) reads the parameters alone, one checkpoint at a
time, into a float32 running sum, and writes `{workdir}/averaged/` with the steps it averaged.
"""
import json
import logging as std_logging

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from flaxformer_nmt import model as model_lib

CHECKPOINT_DIR = 'checkpoints'
AVERAGED_DIR = 'averaged'
CORRUPT_DIR = 'corrupt_checkpoints'


class _QuietOrbax:
  """absl log filter: orbax reports every save at INFO; keep its warnings only."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or '/orbax/' not in record.pathname


def quiet_orbax_logs():
  logging.get_absl_handler().addFilter(_QuietOrbax())


def absolute(path):
  """Orbax (tensorstore) needs absolute paths; local relative ones are resolved, URLs (gs://...) kept."""
  path = epath.Path(path)
  return path if '://' in str(path) else path.absolute()


class Checkpoints:
  """Save/restore of (train state, data position) at integer steps."""

  def __init__(self, workdir, keep=5, async_save=True):
    self.directory = absolute(workdir) / CHECKPOINT_DIR
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(keep) if keep else None,
        create=True,
        enable_async_checkpointing=async_save,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step, state, data_state, force=False):
    saved = self.manager.save(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)
    if saved:
      logging.info('Saving checkpoint %d to %s', step, self.directory)
    return saved

  def steps(self):
    return list(self.manager.all_steps())

  def latest_step(self):
    return self.manager.latest_step()

  def restore(self, abstract_state, step=None):
    """(state, data position) at `step` (default: newest), laid out like `abstract_state`."""
    step = self.latest_step() if step is None else int(step)
    if step is None:
      raise FileNotFoundError(f'no checkpoint in {self.directory}')
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    logging.info('Restored checkpoint %d from %s', step, self.directory)
    return restored.state, restored.data

  def restore_newest_good(self, abstract_state):
    """(state, data position) of the newest checkpoint that restores, or None if there is none.

    Unreadable newer checkpoints are moved aside (not deleted) with a warning naming them.
    """
    for step in sorted(self.steps(), reverse=True):
      try:
        return self.restore(abstract_state, step)
      except Exception as e:  # pylint: disable=broad-except  (tensorstore and orbax raise many kinds)
        aside = self.directory.parent / CORRUPT_DIR / str(step)
        logging.warning('Checkpoint %d in %s cannot be restored (%s: %s); moving it to %s and trying the '
                        'previous one.', step, self.directory, type(e).__name__, str(e).split('\n')[0][:300], aside)
        if jax.process_index() == 0:
          aside.parent.mkdir(parents=True, exist_ok=True)
          (self.directory / str(step)).rename(aside)
        self.manager.reload()
    return None

  def restore_params(self, step):
    """The parameters of checkpoint `step` as host arrays, reading nothing else from disk (checkpoints from
    before the fused attention projections are converted to today's layout)."""
    return model_lib.upgrade_legacy_params(read_params(self.directory / str(int(step)) / 'state', subtree='params'))

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of `tree`: the layout a restore should produce."""
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def read_params(path, subtree=None):
  """A tree of host numpy arrays saved at `path` (or only its `subtree` item), read without a template."""
  checkpointer = ocp.PyTreeCheckpointer()
  metadata = checkpointer.metadata(path).item_metadata.tree
  if subtree is not None:
    metadata = {subtree: metadata[subtree]}
  restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
  restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
      item=metadata, restore_args=restore_args, partial_restore=subtree is not None))
  return restored[subtree] if subtree is not None else restored


class AveragingError(ValueError):
  """Checkpoints that cannot be averaged (missing, or of different shapes)."""


def average_params(workdir, steps):
  """Mean of the parameters of checkpoints `steps`, in float32, holding at most two copies in memory."""
  store = Checkpoints(workdir, keep=0, async_save=False)
  available = store.steps()
  missing = [s for s in steps if s not in available]
  if missing or not steps:
    raise AveragingError(f'checkpoints {missing or steps} not found in {store.directory}; there are {available}')
  total, reference_step = None, None
  for step in steps:
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), store.restore_params(step))
    if total is None:
      total, reference_step = params, step
      continue
    _check_same_shapes(total, params, reference_step, step)
    total = jax.tree_util.tree_map(np.add, total, params)
    del params
  store.close()
  return jax.tree_util.tree_map(lambda x: x / len(steps), total)


def average_last(workdir, last=None, steps=None):
  """Averages `steps` (or the newest `last` checkpoints) into {workdir}/averaged; returns the steps used."""
  available = Checkpoints(workdir, keep=0, async_save=False).steps()
  steps = sorted(int(s) for s in steps) if steps else sorted(available)[-last:]
  if not steps:
    raise AveragingError(f'no checkpoints in {absolute(workdir) / CHECKPOINT_DIR}')
  directory = save_averaged(workdir, average_params(workdir, steps), steps)
  logging.info('Averaged checkpoints %s into %s', steps, directory)
  return steps


def _check_same_shapes(a, b, step_a, step_b):
  paths_a = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(a)[0]}
  paths_b = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(b)[0]}
  if paths_a.keys() != paths_b.keys():
    differing = sorted(paths_a.keys() ^ paths_b.keys())[:3]
    raise AveragingError(f'checkpoints {step_a} and {step_b} hold different parameters (e.g. {differing})')
  for path, shape in paths_a.items():
    if paths_b[path] != shape:
      raise AveragingError(f'checkpoints {step_a} and {step_b} differ in shape at params{path}: '
                           f'{shape} vs {paths_b[path]}')


def save_averaged(workdir, params, steps):
  """Writes `{workdir}/averaged/` (parameters + averaged.json naming the steps), replacing an older one."""
  directory = absolute(workdir) / AVERAGED_DIR
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory / 'params', params, force=True)
  checkpointer.wait_until_finished()
  checkpointer.close()
  # The orbax save above is collective (every host calls it); the small index is written by process 0.
  if jax.process_index() == 0:
    (directory / 'averaged.json').write_text(json.dumps({'steps': [int(s) for s in steps]}))
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('averaged.json written')
  return directory


def load_averaged(workdir):
  """(parameters as host arrays, info) of the workdir's averaged checkpoint."""
  directory = absolute(workdir) / AVERAGED_DIR
  if not (directory / 'averaged.json').exists():
    raise FileNotFoundError(f'{directory} not found: run `python -m flaxformer_nmt.average --workdir {workdir}` first')
  params = model_lib.upgrade_legacy_params(read_params(directory / 'params'))
  return params, json.loads((directory / 'averaged.json').read_text())
