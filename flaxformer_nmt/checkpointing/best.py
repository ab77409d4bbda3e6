"""The best checkpoint: the parameters of the evaluation with the best validation metric, kept in
`{workdir}/best/` apart from the rolling checkpoints (rotation never deletes it).

  {workdir}/best/params_STEP/   the parameters (orbax), as `averaged/params`
  {workdir}/best/best.json      {"metric": "bleu", "step": STEP, "value": ..., "metrics": {...}}

`config.best_checkpoint_metric` chooses the metric: 'bleu' / 'tok_bleu' (validation BLEU, higher is better,
needs config.eval_bleu_every_steps), 'loss' / 'nll' (validation loss, lower is better). A new best is
written under a new name first and best.json switched to it before the old parameters are removed, so an
interruption leaves the previous best whole. A resumed run reads best.json: a later, worse evaluation never
replaces a better one from before the restart. Decode, export and compare load it with `--checkpoint best`.
"""
import json
import math

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.runtime import files

BEST_DIR = 'best'
INFO_FILENAME = 'best.json'
# config.best_checkpoint_metric (config.BEST_CHECKPOINT_METRICS) -> (the logged metric, True if higher is better).
METRICS = {'bleu': ('eval/bleu', True), 'tok_bleu': ('eval/tok_bleu', True), 'loss': ('eval/loss', False),
           'nll': ('eval/nll', False)}


def directory(workdir):
  return checkpoints_lib.absolute(workdir) / BEST_DIR


def read_info(workdir):
  """best.json as a dict, or None when the workdir has no best checkpoint."""
  path = directory(workdir) / INFO_FILENAME
  return json.loads(path.read_text()) if path.exists() else None


def required_info(workdir):
  """best.json as a dict; FileNotFoundError, naming how to keep one, where the workdir has no best checkpoint."""
  info = read_info(workdir)
  if info is None:
    raise FileNotFoundError(f'{directory(workdir) / INFO_FILENAME} not found: train with '
                            '--config.best_checkpoint_metric=bleu (or tok_bleu, loss, nll) to keep a best checkpoint')
  return info


def load_best(workdir):
  """(parameters as host arrays, best.json) of the workdir's best checkpoint."""
  info = required_info(workdir)
  return checkpoints_lib.read_params(directory(workdir) / info['params']), info


class BestCheckpoint:
  """Tracks the best value of one validation metric and saves the parameters that reach it."""

  def __init__(self, workdir, metric):
    self.workdir, self.metric = workdir, metric
    self.key, self.higher_is_better = METRICS[metric]
    info = read_info(workdir)
    if info is not None and info.get('metric') != metric:
      logging.warning('%s holds the best %s (step %s); this run keeps the best %s and will replace it',
                      directory(workdir), info.get('metric'), info.get('step'), metric)
      info = None
    self.best_value = info['value'] if info else None
    self.best_step = info['step'] if info else None
    if info:
      logging.info('Best checkpoint so far: step %d, %s %.4f', self.best_step, metric, self.best_value)

  def is_better(self, value):
    if value is None or math.isnan(value):
      return False
    if self.best_value is None:
      return True
    return value > self.best_value if self.higher_is_better else value < self.best_value

  def update(self, step, params, metrics):
    """Saves `params` as the best if `metrics` holds this metric at a better value; returns whether it did.

    Collective when the parameters are sharded over hosts: every host calls it with the same metrics.
    """
    value = metrics.get(self.key)
    if not self.is_better(value):
      return False
    old = read_info(self.workdir)
    name = f'params_{int(step)}'
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory(self.workdir) / name, params, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
    if jax.process_index() == 0:
      # NaN or infinity (a diverged loss beside the BLEU kept) is not JSON: other readers of the file refuse it.
      numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
      info = {'metric': self.metric, 'step': int(step), 'value': float(value), 'params': name,
              'metrics': numbers}
      files.write_atomically(directory(self.workdir) / INFO_FILENAME, json.dumps(info, indent=2))
      if old is not None and old.get('params') not in (None, name):
        stale = directory(self.workdir) / old['params']
        if stale.exists():
          stale.rmtree()
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('best.json written')
    logging.info('New best checkpoint: step %d, %s %.4f (was %s) -> %s', step, self.metric, value,
                 'none' if self.best_value is None else f'{self.best_value:.4f} at step {self.best_step}',
                 directory(self.workdir))
    self.best_value, self.best_step = float(value), int(step)
    return True
