"""Orbax checkpoints under `{workdir}/checkpoints/{step}`: the whole train state plus the data position.

Each checkpoint holds two items: `state` (step, parameters, optimizer state, dropout key) and `data` (the
training iterator's position, a small JSON dict), so a restarted run continues where the last one stopped.
Only the newest `keep` checkpoints are kept, and with them the newest `keep` of those saved at the regular interval
(step % every_steps == 0), so that a save off it (a stop signal's, the final one) never pushes a regular one out of
the averaging window (averaging_window). Orbax writes each checkpoint to a temporary directory and renames
it when complete (with a commit marker, commit_success.txt), so a half-written one is never listed.

A restart tells three kinds of restore failure apart (restore_newest_good):
- damaged: no commit marker, unreadable tree metadata, truncated or missing array files. The checkpoint is
  moved to `{workdir}/corrupt_checkpoints/` (as STEP, or STEP.1, STEP.2, ... beside an earlier one) with a
  warning naming it and the previous one is tried, so retention can never delete the last good checkpoint in
  its favour.
- mismatched: the stored tree, shapes or vocabulary differ from what the config builds (read from the
  checkpoint's own metadata, before any array is read). The run stops before anything is moved, with an
  error naming the differing entries and the ways forward.
- storage: an OSError or a store that is unavailable (gs:// hiccups) is retried with backoff, then stops
  the run; it never moves a checkpoint.

Averaging (the paper averages the last 5 or 20 checkpoints) reads the parameters alone, one checkpoint at a
time, into a float32 running sum, and writes `{workdir}/averaged/` with the steps it averaged. A new average is
written whole beside the old one and then renamed into its place, so a failed write leaves the old one as it was.
"""
import functools
import json
import logging as std_logging
import time

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

# The names decode and export take for a checkpoint (--checkpoint), as config.decode_checkpoint takes them.
from flaxformer_nmt.config import CHECKPOINT_NAMES, is_checkpoint_name  # pylint: disable=unused-import

CHECKPOINT_DIR = 'checkpoints'
AVERAGED_DIR = 'averaged'
AVERAGED_INFO = 'averaged.json'
CORRUPT_DIR = 'corrupt_checkpoints'
COMMIT_MARKER = 'commit_success.txt'  # written by orbax as the last file of a finished checkpoint
# Tensorstore statuses of a store that cannot be reached or refuses us now (not of bytes that are wrong).
_STORAGE_STATUSES = ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED', 'ABORTED', 'CANCELLED',
                     'PERMISSION_DENIED', 'UNAUTHENTICATED')


class CheckpointMismatchError(ValueError):
  """A checkpoint that is intact but holds another train state than the config builds."""


class CheckpointStorageError(OSError):
  """Storage kept failing while reading checkpoints; nothing was moved."""


class CheckpointsDamagedError(RuntimeError):
  """Every checkpoint of a workdir was damaged (all were set aside)."""


class _Damaged(Exception):
  """Internal: a checkpoint that cannot be used as it is (the message says why)."""


def is_storage_error(error):
  """Whether `error` (or one in its cause chain) is the storage failing rather than the checkpoint's bytes."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
      return True
    if str(error).startswith(_STORAGE_STATUSES):
      return True
    error = error.__cause__ or error.__context__
  return False


def _first_line(error):
  return f'{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ""}'


def with_storage_retries(fn, what, attempts=4, delay=2.0):
  """fn(), retried with exponential backoff (delay, 2 delay, ...) while it fails with a storage error; after
  `attempts` tries a CheckpointStorageError. Any other exception passes through at once."""
  for attempt in range(attempts):
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except  (classified just below)
      if not is_storage_error(e):
        raise
      if attempt == attempts - 1:
        raise CheckpointStorageError(
            f'{what}: storage error in {attempts} attempts ({_first_line(e)}); no checkpoint was moved. Check '
            'the storage (space, permissions, network) and rerun the same command to resume.') from e
      logging.warning('%s: storage error (%s); retrying in %.1f s (attempt %d of %d)', what, _first_line(e),
                      delay * 2 ** attempt, attempt + 1, attempts)
      time.sleep(delay * 2 ** attempt)
  raise AssertionError('unreachable')


def _key_name(key):
  for attribute in ('key', 'name', 'idx'):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def tree_signature(tree):
  """{dotted path as orbax names it ('opt_state.0.mu.encoder_0...'): shape} of every array leaf of `tree`
  (arrays, ShapeDtypeStructs or orbax's ArrayMetadata)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {'.'.join(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def _part_of_state(name):
  if name.startswith('opt_state'):
    return 'optimizer state'
  if name.startswith('params'):
    return 'parameters'
  return name


def _list(names, limit=4):
  names = sorted(names)
  return ', '.join(names[:limit]) + (f' and {len(names) - limit} more' if len(names) > limit else '')


def describe_mismatch(stored, expected):
  """Lines naming how two tree signatures differ ([] when they match)."""
  lines = []
  only_stored, only_expected = stored.keys() - expected.keys(), expected.keys() - stored.keys()
  for part in sorted({_part_of_state(n) for n in only_stored | only_expected}):
    lost = {n for n in only_stored if _part_of_state(n) == part}
    new = {n for n in only_expected if _part_of_state(n) == part}
    lines.append(f'{part}: ' + '; '.join(
        ([f'the checkpoint holds {_list(lost)} ({len(lost)} arrays) that this config does not build'] if lost
         else []) + ([f'this config builds {_list(new)} ({len(new)} arrays) that the checkpoint lacks'] if new
                     else [])))
  # Parameters first: the optimizer's moments repeat their shapes.
  reshaped = sorted((n for n in stored.keys() & expected.keys() if stored[n] != expected[n]),
                    key=lambda n: (not n.startswith('params'), n))
  for name in reshaped[:4]:
    lines.append(f'{name}: shape {stored[name]} in the checkpoint, {expected[name]} in this config')
  if len(reshaped) > 4:
    lines.append(f'and {len(reshaped) - 4} more arrays of other shapes')
  return lines


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

  # Storage errors on restore: tries, and the first wait (doubled after each try).
  storage_attempts = 4
  storage_retry_seconds = 2.0

  def __init__(self, workdir, keep=5, async_save=True, every_steps=None):
    self.directory = checkpoint_directory(workdir)
    policies = ocp.checkpoint_managers
    policy = policies.LatestN(keep) if keep else None
    if keep and every_steps:  # see the module's docstring
      policy = policies.AnyPreservationPolicy([policy, policies.EveryNSteps(every_steps, max_to_keep=keep)])
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy,
        create=True,
        enable_async_checkpointing=async_save,
    )
    # Naming the items' handlers lets metadata be read before (or without) a restore.
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler()})

  def save(self, step, state, data_state, force=False, vocab_sha256=None):
    """Saves checkpoint `step`; `vocab_sha256` (of vocab.model) is recorded so that a restore with another
    vocabulary is refused."""
    saved = self.manager.save(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force,
        custom_metadata={'vocab_sha256': vocab_sha256} if vocab_sha256 else None)
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

  def _retrying(self, fn, what):
    return with_storage_retries(fn, what, self.storage_attempts, self.storage_retry_seconds)

  def stored_signature(self, step):
    """The tree signature of checkpoint `step`'s train state, from its metadata (no array is read).

    Raises _Damaged when the checkpoint has no commit marker or its metadata cannot be read.
    """
    path = self.directory / str(step)
    if not self._retrying(lambda: (path / COMMIT_MARKER).exists(), f'checkpoint {step}'):
      raise _Damaged(f'no commit marker ({COMMIT_MARKER}): the save did not finish')
    try:
      tree = self._retrying(lambda: self.manager.item_metadata(int(step))['state'], f'checkpoint {step}')
      data = json.loads(self._retrying(lambda: (path / 'data' / 'metadata').read_text(), f'checkpoint {step}'))
    except CheckpointStorageError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (orbax fails in many ways on bad metadata)
      raise _Damaged(f'unreadable metadata ({_first_line(e)})') from e
    signature = tree_signature(tree) if tree is not None else {}
    if not signature or not isinstance(data, dict):
      raise _Damaged('unreadable metadata (no train-state tree or data position)')
    return signature

  def stored_vocab_sha256(self, step):
    """The vocab.model sha256 recorded with checkpoint `step` (None for checkpoints written without one)."""
    try:
      custom = self._retrying(lambda: self.manager.metadata(int(step)).custom_metadata, f'checkpoint {step}')
    except CheckpointStorageError:
      raise
    except Exception:  # pylint: disable=broad-except  (step metadata is optional: the arrays decide)
      return None
    return (custom or {}).get('vocab_sha256')

  def check_matches(self, step, abstract_state, vocab_sha256=None):
    """Raises CheckpointMismatchError when checkpoint `step` holds another tree, shapes or vocabulary."""
    differences = describe_mismatch(self.stored_signature(step), tree_signature(abstract_state))
    stored_vocab = self.stored_vocab_sha256(step) if vocab_sha256 else None
    if stored_vocab and stored_vocab != vocab_sha256:
      differences.append(f'vocabulary: vocab.model sha256 {stored_vocab[:12]}... in the checkpoint, '
                         f'{vocab_sha256[:12]}... now')
    if differences:
      raise CheckpointMismatchError(
          f'checkpoint {step} in {self.directory} does not fit this config: ' + '; '.join(differences) +
          '. Nothing was moved. Ways forward: rerun with the settings this workdir was trained with '
          '(config.json beside the checkpoints; revert the changed field), or start a new run from these '
          f'parameters with a fresh optimizer: --workdir=NEW --config.init_from={self.directory.parent}.')

  def restore_newest_good(self, abstract_state, vocab_sha256=None):
    """(state, data position) of the newest intact checkpoint, or None when the workdir has none.

    Damaged newer checkpoints are moved to corrupt_checkpoints/ (not deleted) with a warning naming them,
    once a good one is found; a mismatched one raises CheckpointMismatchError and a failing storage
    CheckpointStorageError, in both cases before anything is moved. When every checkpoint is damaged they
    are all set aside and CheckpointsDamagedError says so (rerunning then starts from step 0).
    """
    damaged = []
    for step in sorted(self.steps(), reverse=True):
      try:
        self.check_matches(step, abstract_state, vocab_sha256)
        restore = functools.partial(self.restore, abstract_state, step)
        restored = self._retrying(restore, f'checkpoint {step}')
      except (CheckpointMismatchError, CheckpointStorageError):
        raise
      except Exception as e:  # pylint: disable=broad-except  (tensorstore and orbax raise many kinds)
        damaged.append((step, str(e) if isinstance(e, _Damaged) else _first_line(e)))
        continue
      self._set_aside(damaged)
      return restored
    self._set_aside(damaged)
    if damaged:
      raise CheckpointsDamagedError(
          f'no checkpoint in {self.directory} could be restored: all {len(damaged)} were damaged and moved to '
          f'{self.directory.parent / CORRUPT_DIR}. Rerunning the same command starts training from step 0.')
    return None

  def _aside_path(self, step):
    """corrupt_checkpoints/STEP, or STEP.1, STEP.2, ... where an earlier damaged checkpoint STEP lies there."""
    aside = self.directory.parent / CORRUPT_DIR / str(step)
    copies = 0
    while aside.exists():
      copies += 1
      aside = aside.with_name(f'{step}.{copies}')
    return aside

  def _set_aside(self, damaged):
    for step, reason in damaged:
      # Process 0 moves it (the others name the folder only: they would race its rename).
      aside = self._aside_path(step) if jax.process_index() == 0 else self.directory.parent / CORRUPT_DIR
      logging.warning('Checkpoint %d in %s is damaged (%s); moved it to %s and tried the previous one.', step,
                      self.directory, reason, aside)
      if jax.process_index() == 0:
        aside.parent.mkdir(parents=True, exist_ok=True)
        (self.directory / str(step)).rename(aside)
    if damaged:
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices('damaged checkpoints set aside')
      self.manager.reload()

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def saved_steps(workdir):
  """The steps of the checkpoints saved in `workdir`, oldest first, listed by a manager that is closed again.
  None saved: []. Looking never writes: the manager (which creates its directory) opens only where one exists."""
  if not checkpoint_directory(workdir).is_dir():
    return []
  with Checkpoints(workdir, keep=0, async_save=False) as store:
    return sorted(store.steps())


def checkpoint_directory(workdir):
  """Where `workdir`'s checkpoints are saved (one folder per step)."""
  return absolute(workdir) / CHECKPOINT_DIR  # the one place this path is built


def state_directory(workdir, step):
  """The orbax directory of checkpoint `step`'s train state (its parameters are the `params` subtree)."""
  return checkpoint_directory(workdir) / str(int(step)) / 'state'


def saved_params(workdir, step):
  """The parameters of checkpoint `step` in `workdir` as host arrays, read from its files alone: no manager is
  opened and nothing but the parameters is read."""
  return read_params(state_directory(workdir, step), subtree='params')


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of `tree`: the layout a restore should produce."""
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _not_step_metadata_notice(record):
  """False for orbax's warning that `path`/_CHECKPOINT_METADATA does not exist. read_params reads one item
  directory (checkpoints/N/state, averaged/params) on its own; that file belongs to the step directory one level
  up, and the item reads the same without it. Users saw the warning once per averaged checkpoint."""
  return not str(record.msg).startswith('Metadata file does not exist')


def read_params(path, subtree=None):
  """A tree of host numpy arrays saved at `path` (or only its `subtree` item), read without a template.
  FileNotFoundError naming `path` where it holds no checkpoint (missing, or without its tree metadata)."""
  if not epath.Path(path).exists():
    raise FileNotFoundError(f'{path} not found')
  absl_logger = std_logging.getLogger('absl')
  absl_logger.addFilter(_not_step_metadata_notice)
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      metadata = checkpointer.metadata(path).item_metadata
      if metadata is None:
        raise FileNotFoundError(f'{path} holds no checkpoint (its tree metadata is missing)')
      metadata = metadata.tree
      if subtree is not None:
        metadata = {subtree: metadata[subtree]}
      restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
      restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
          item=metadata, restore_args=restore_args, partial_restore=subtree is not None))
  finally:
    absl_logger.removeFilter(_not_step_metadata_notice)
  return restored[subtree] if subtree is not None else restored


class AveragingError(ValueError):
  """Checkpoints that cannot be averaged (missing, or of different shapes)."""


def average_params(workdir, steps):
  """Mean of the parameters of checkpoints `steps`, in float32, holding at most two copies in memory."""
  available = saved_steps(workdir)
  missing = [s for s in steps if s not in available]
  if missing or not steps:
    raise AveragingError(f'checkpoints {missing or steps} not found in {checkpoint_directory(workdir)}; '
                         f'there are {available}')
  total, reference_step = None, None
  for step in steps:
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), _params_to_average(workdir, step))
    if total is None:
      total, reference_step = params, step
      continue
    _check_same_shapes(total, params, reference_step, step)
    total = jax.tree_util.tree_map(np.add, total, params)
    del params
  return jax.tree_util.tree_map(lambda x: x / len(steps), total)


def _params_to_average(workdir, step):
  """saved_params(workdir, step); AveragingError naming the checkpoint where it cannot be read."""
  try:
    return saved_params(workdir, step)
  except Exception as e:  # pylint: disable=broad-except  (tensorstore and orbax raise many kinds)
    raise AveragingError(f'checkpoint {step} in {checkpoint_directory(workdir)} cannot be read ({_first_line(e)}); '
                         'average others, e.g. `python -m flaxformer_nmt.average --workdir '
                         f'{workdir} --steps S1,S2,...`') from e


def averaging_window(steps, last, every_steps=None):
  """The newest `last` of `steps` that were saved at the regular interval, oldest first.

  Regular saves fall on the grid step % every_steps == 0; saves off it (the forced one when training ends,
  a stop signal, a time-based save) are left out, so an end at step 1801 does not put 1800 and 1801 side by
  side in the average. With no checkpoint on the grid (saving by time) the newest one is left out when it
  came less than half the usual spacing after the one before it.
  """
  steps = sorted(int(s) for s in steps)
  on_grid = [s for s in steps if every_steps and s % every_steps == 0]
  if on_grid:
    return on_grid[-last:]
  if len(steps) >= 3:
    gaps = np.diff(steps[:-1])
    if steps[-1] - steps[-2] < np.median(gaps) / 2:
      steps = steps[:-1]
  return steps[-last:]


def regular_save_interval(workdir):
  """The spacing of the workdir's regular saves, config.checkpoint_every_steps of its config.json (None where it
  has none)."""
  path = absolute(workdir) / 'config.json'
  return json.loads(path.read_text())['checkpoint_every_steps'] if path.exists() else None


def average_last(workdir, last=None, steps=None, every_steps=None):
  """Averages `steps` (or the newest `last` regular checkpoints, see averaging_window) into
  {workdir}/averaged; returns the steps used. every_steps defaults to the workdir's (regular_save_interval)."""
  available = saved_steps(workdir)
  if steps:
    steps = sorted(int(s) for s in steps)
    if len(set(steps)) < len(steps):  # a repeated step would weigh more than the others
      raise AveragingError(f'steps {steps} name a checkpoint more than once')
  else:
    if last is None or last < 1:
      raise AveragingError(f'average the last {last} checkpoints: give 1 or more')
    if every_steps is None:
      every_steps = regular_save_interval(workdir)
    steps = averaging_window(available, last, every_steps)
    if 0 < len(steps) < last:
      logging.warning('Averaging %d checkpoints %s, fewer than the %d asked: %s holds no more at the regular '
                      'interval (keep_checkpoints above average_last_checkpoints leaves room for the final '
                      'save).', len(steps), steps, last, checkpoint_directory(workdir))
  if not steps:
    raise AveragingError(f'no checkpoints in {checkpoint_directory(workdir)}')
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
  """Writes `{workdir}/averaged/` (parameters + averaged.json naming the steps), replacing an older one: the new
  one is written whole into `.averaged.tmp/` and renamed into place, the older one removed only then."""
  directory = absolute(workdir) / AVERAGED_DIR
  staged = directory.with_name(f'.{AVERAGED_DIR}.tmp')
  try:  # here, not in orbax's writer thread: one that cannot make its folder leaves the process waiting for ever
    staged.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise OSError(f'the average cannot be written into {workdir} ({e})') from None
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(staged / 'params', params, force=True)  # force: over what a failed write left there
    checkpointer.wait_until_finished()
  # The orbax save above is collective (every host calls it); the index and the renames are process 0's.
  if jax.process_index() == 0:
    (staged / AVERAGED_INFO).write_text(json.dumps({'steps': [int(s) for s in steps]}))
    replace_directory(staged, directory)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('averaged.json written')
  return directory


def replace_directory(staged, directory):
  """Renames the written `staged` directory (an epath.Path) to `directory`, whose older contents are set aside
  first (`.NAME.old`: a kill before the second rename leaves them whole there) and removed only then."""
  retired = directory.with_name(f'.{directory.name}.old')
  retired.rmtree(missing_ok=True)
  if directory.exists():
    directory.rename(retired)
  staged.rename(directory)
  retired.rmtree(missing_ok=True)


def averaged_directory(workdir):
  """The workdir's averaged checkpoint; FileNotFoundError, naming the command that writes it, where there is none."""
  directory = absolute(workdir) / AVERAGED_DIR
  if not (directory / AVERAGED_INFO).exists():
    raise FileNotFoundError(f'{directory} not found: run `python -m flaxformer_nmt.average --workdir {workdir}` first')
  return directory


def load_averaged(workdir):
  """(parameters as host arrays, info) of the workdir's averaged checkpoint."""
  directory = averaged_directory(workdir)
  return read_params(directory / 'params'), json.loads((directory / AVERAGED_INFO).read_text())
