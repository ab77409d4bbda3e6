"""Orbax checkpoints under `{workdir}/checkpoints/{step}`: the whole train state plus the data position.

Each checkpoint holds two items: `state` (step, parameters, optimizer state, dropout key) and `data` (the
training iterator's position, a small JSON dict), so a restarted run continues where the last one stopped.
Only the newest `keep` checkpoints are kept.
"""
import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

CHECKPOINT_DIR = 'checkpoints'


class Checkpoints:
  """Save/restore of (train state, data position) at integer steps."""

  def __init__(self, workdir, keep=5, async_save=True):
    self.directory = epath.Path(workdir) / CHECKPOINT_DIR
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

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


def abstract_like(tree, sharding=None):
  """ShapeDtypeStructs of `tree` (optionally with one sharding for all leaves), for restore targets."""
  def to_struct(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if sharding is not None else x.sharding)
  return jax.tree_util.tree_map(to_struct, tree)
