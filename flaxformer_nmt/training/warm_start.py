"""Fine-tuning and warm starts: a new run whose parameters come from another run (`--config.init_from`).

  --config.init_from=runs/m30k                                 # its newest checkpoint
  --config.init_from=runs/m30k --config.init_checkpoint=averaged  # or best, or a step number
  --config.init_from=runs/m30k/checkpoints/1800                # a checkpoint directory (or averaged/, best/)

Only the parameters are taken: the optimizer state, the learning-rate schedule and the step start afresh
(step 0), as fairseq's --restore-file with --reset-optimizer --reset-lr-scheduler does. The vocabulary must be
the source's: a new workdir without one gets a copy of the source's vocab.model, and a different one (by
sha256; for a checkpoint directory away from its workdir, against the sha256 its save recorded) or a parameter
of another shape is an error naming it. A workdir that already has checkpoints
resumes from them and ignores init_from.
"""
import hashlib
import json

import jax
import numpy as np
from absl import logging
from etils import epath

from flaxformer_nmt.checkpointing import best as best_checkpoint
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import VOCAB_FILENAME
from flaxformer_nmt.runtime import distributed


class WarmStartError(ValueError):
  """An init_from source that cannot seed this run."""


def _is_workdir(path):
  return (path / 'config.json').exists() or checkpoints_lib.checkpoint_directory(path).is_dir()


def _params_dir(path):
  """Where the parameter tree of a checkpoint-like directory is: (orbax directory, subtree or None)."""
  if (path / 'state').is_dir():  # a training checkpoint, checkpoints/{step}
    return path / 'state', 'params'
  if (path / 'params').is_dir():  # averaged/
    return path / 'params', None
  if (path / best_checkpoint.INFO_FILENAME).exists():  # best/: best.json names its parameters
    return path / json.loads((path / best_checkpoint.INFO_FILENAME).read_text())['params'], None
  if (path / '_METADATA').exists():  # a parameter tree saved by itself
    return path, None
  raise WarmStartError(f'config.init_from={path}: neither a training workdir nor a checkpoint directory '
                       '(no config.json, checkpoints/, state/ or params/ in it)')


def resolve(init_from, init_checkpoint='latest'):
  """(orbax directory, subtree, the source's workdir or None, a description) of what init_from names."""
  path = checkpoints_lib.absolute(init_from)
  if not path.exists():
    raise WarmStartError(f'config.init_from={init_from}: not found')
  if not _is_workdir(path):
    directory, subtree = _params_dir(path)
    source = next((p for p in (path, path.parent, path.parent.parent) if (p / VOCAB_FILENAME).exists()), None)
    return directory, subtree, source, str(path)
  which = str(init_checkpoint)
  if which == 'best':  # best/best.json names the parameters of the best evaluation (checkpointing/best.py)
    info = best_checkpoint.read_info(path)
    if info is None:
      raise WarmStartError(f'config.init_checkpoint=best: {best_checkpoint.directory(path)} not found (or no '
                           'best.json in it: train with --config.best_checkpoint_metric to keep a best checkpoint)')
    return best_checkpoint.directory(path) / info['params'], None, path, f'best (step {info["step"]}) of {path}'
  if which == 'averaged':
    if not (path / which).is_dir():
      raise WarmStartError(f'config.init_checkpoint={which}: {path / which} not found')
    directory, subtree = _params_dir(path / which)
    return directory, subtree, path, f'{which} of {path}'
  steps = checkpoints_lib.saved_steps(path)
  if which == 'latest':
    if not steps:
      raise WarmStartError(f'config.init_from={init_from}: no checkpoint in '
                           f'{checkpoints_lib.checkpoint_directory(path)}')
    step = max(steps)
  elif which.isdigit() and int(which) in steps:
    step = int(which)
  else:
    raise WarmStartError(f'config.init_checkpoint={which}: use latest, averaged, best or one of the steps '
                         f'{sorted(steps)} of {path}')
  return checkpoints_lib.state_directory(path, step), 'params', path, f'checkpoint {step} of {path}'


def adopt_vocabulary(config, workdir):
  """Before the tokenizer is loaded: a new workdir fine-tuning from init_from gets the source's vocab.model
  (the embeddings belong to it) unless it has a vocabulary already. The vocabulary of an MLM
  (config.task='mlm') must have a <mask> piece: a source trained as an LM or translation model has none."""
  target = epath.Path(workdir) / VOCAB_FILENAME
  if not config.init_from or not distributed.is_leader():
    return
  if target.exists():
    _check_mask_piece(config, target)
    return
  _, _, source, _ = resolve(config.init_from, config.init_checkpoint)
  if source is None:
    return
  _check_mask_piece(config, source / VOCAB_FILENAME)
  target.write_bytes((source / VOCAB_FILENAME).read_bytes())
  logging.info('Vocabulary copied from %s (config.init_from)', source / VOCAB_FILENAME)


def _check_mask_piece(config, vocabulary):
  if config.task == 'mlm' and tokenizer_lib.Tokenizer(vocabulary).mask_id is None:
    raise WarmStartError(f'config.init_from={config.init_from}: the MLM (config.task=mlm) needs a '
                         f'{tokenizer_lib.MASK_PIECE} piece in its vocabulary and {vocabulary} has none: warm-start '
                         'an MLM from an MLM run')


def _sha256(path):
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _recorded_vocab_sha256(path):
  """The vocab.model sha256 a training checkpoint directory's save recorded (Checkpoints.save), or None."""
  try:
    metadata = json.loads((path / '_CHECKPOINT_METADATA').read_text())
  except (OSError, ValueError):
    return None
  return ((metadata.get('custom_metadata') or {}) if isinstance(metadata, dict) else {}).get('vocab_sha256')


def load_params(state, state_sharding, config, tokenizer):
  """`state` with the parameters of config.init_from, placed like `state_sharding.params`; the step, the
  optimizer state and the dropout key stay those of the fresh state."""
  directory, subtree, source, description = resolve(config.init_from, config.init_checkpoint)
  if source is not None:
    theirs, where = _sha256(source / VOCAB_FILENAME), source / VOCAB_FILENAME
  else:  # a checkpoint directory away from its workdir: the vocabulary its save recorded
    theirs, where = _recorded_vocab_sha256(checkpoints_lib.absolute(config.init_from)), 'recorded in the checkpoint'
    if theirs is None:
      logging.warning('config.init_from=%s: no vocab.model beside it and none recorded in it; its embeddings are '
                      'taken as made for this run\'s vocabulary, unchecked', config.init_from)
  if theirs is not None and theirs != tokenizer.sha256:
    raise WarmStartError(
        f'config.init_from: {description} was trained with another vocabulary ({where} '
        f'sha256 {theirs[:12]}..., this run {tokenizer.sha256[:12]}...): its embeddings do not fit. Start the new '
        'run in an empty --workdir beside the source\'s vocab.model (it copies it), or put that vocab.model in '
        '--workdir.')
  try:
    params = checkpoints_lib.read_params(directory, subtree)
  except Exception as e:  # pylint: disable=broad-except  (orbax and tensorstore raise many kinds)
    raise WarmStartError(f'config.init_from: {description} cannot be read from {directory} '
                         f'({type(e).__name__}: {str(e).strip()[:300]}): give another checkpoint of it '
                         '(--config.init_checkpoint) or another --config.init_from') from e
  expected = {f'params.{k}': v for k, v in checkpoints_lib.tree_signature(state.params).items()}
  differences = checkpoints_lib.describe_mismatch(
      {f'params.{k}': v for k, v in checkpoints_lib.tree_signature(params).items()}, expected)
  if differences:
    raise WarmStartError(f'config.init_from: {description} holds another model than this config builds: '
                         + '; '.join(differences) + '. Use the model fields of its config.json.')
  params = jax.tree_util.tree_map(lambda x, like: np.asarray(x, like.dtype), params, state.params)
  params = jax.device_put(params, state_sharding.params)
  logging.info('Initialized the parameters from %s (config.init_from); optimizer, schedule and step start '
               'afresh', description)
  return state.replace(params=params)
