"""A trained workdir loaded for inference: its config set up for decoding on this machine, its tokenizer, its
model and the parameters of one checkpoint (or of several: an ensemble), read once.

  loaded = load_for_inference('runs/m30k')                      # config.decode_checkpoint of one run
  loaded = load_for_inference('runs/a,runs/b', ensemble=True)   # an ensemble: one member per workdir
  loaded.config, loaded.tokenizer, loaded.model, loaded.params, loaded.description

Every reader of a trained model (the Translator, the language model's generator and fill-mask, export,
attention pictures, compare) loads through `load_for_inference`: one rule for which checkpoint a name means,
for what an ensemble's workdir stands for, and for the config changes that decoding makes.
"""
from typing import Any, NamedTuple

import jax
from absl import logging
from etils import epath

from flaxformer_nmt.checkpointing import best as best_checkpoint
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.models import lm

DTYPES = ('auto', 'float32', 'bfloat16')


def default_checkpoint(workdir):
  """The checkpoint the workdir's config chose for decoding (config.decode_checkpoint; 'latest' for workdirs
  trained before the field)."""
  return workdir_lib.load_config(workdir).get('decode_checkpoint', 'latest')


def load_params(workdir, checkpoint=None):
  """(parameters on the default device, description) of checkpoint `latest`, `averaged`, `best` (the best
  validation metric, checkpointing/best.py), `last:K` (the average of the newest K checkpoints, computed now and
  not written) or STEP; None: the workdir's config.decode_checkpoint.

  Only the parameters are read: decoding needs neither the optimizer state nor the data position.
  """
  workdir_lib.single_run(workdir)
  if checkpoint is None:
    checkpoint = default_checkpoint(workdir)
    try:
      return load_params(workdir, checkpoint)
    except FileNotFoundError as e:  # e.g. 'averaged' of a run that has not finished
      raise FileNotFoundError(f'{e} (config.decode_checkpoint={checkpoint!r} of {workdir} is the default; '
                              'pass --checkpoint latest, or another, to decode something else)') from None
  if not checkpoints_lib.is_checkpoint_name(checkpoint):
    raise ValueError(f'--checkpoint must be {checkpoints_lib.CHECKPOINT_NAMES}, not {checkpoint!r}')
  if checkpoint == 'averaged':
    params, info = checkpoints_lib.load_averaged(workdir)
    return jax.device_put(params), f'the average of checkpoints {info["steps"]}'
  if checkpoint == 'best':
    params, info = best_checkpoint.load_best(workdir)
    return jax.device_put(params), f'the best checkpoint (step {info["step"]}, {info["metric"]} {info["value"]:.4g})'
  if checkpoint.startswith('last:'):
    steps = _last_window(workdir, int(checkpoint[5:]))
    return jax.device_put(checkpoints_lib.average_params(workdir, steps)), f'the average of checkpoints {steps}'
  step = _saved_step(workdir, checkpoint)
  return jax.device_put(checkpoints_lib.saved_params(workdir, step)), f'checkpoint {step}'


def _last_window(workdir, last):
  """The steps `last:K` averages: the window `average` and the trainer's average take (an off-interval final
  save is left out), with a warning, as theirs, where it holds fewer than K."""
  steps = checkpoints_lib.averaging_window(checkpoints_lib.saved_steps(workdir), last,
                                           checkpoints_lib.regular_save_interval(workdir))
  if 0 < len(steps) < last:
    logging.warning('--checkpoint last:%d averages %d checkpoints %s, fewer than the %d asked: %s holds no more '
                    'at the regular interval', last, len(steps), steps, last,
                    checkpoints_lib.checkpoint_directory(workdir))
  return steps


def _saved_step(workdir, checkpoint):
  """The step that `latest` or a step number names; FileNotFoundError where the workdir has none such."""
  steps = checkpoints_lib.saved_steps(workdir)
  step = (steps[-1] if steps else None) if checkpoint == 'latest' else int(checkpoint)
  if step not in steps:
    raise FileNotFoundError(f'no checkpoint {checkpoint} in {checkpoints_lib.checkpoint_directory(workdir)}; '
                            f'there are {steps}')
  return step


def check_checkpoint(workdir, checkpoint):
  """Raises what load_params would where the workdir has no checkpoint `checkpoint` (a name it takes; None:
  the config's), reading no parameters: a command that loads several checkpoints one after another checks
  them all before the first."""
  workdir_lib.single_run(workdir)
  checkpoint = default_checkpoint(workdir) if checkpoint is None else checkpoint
  if not checkpoints_lib.is_checkpoint_name(checkpoint):
    raise ValueError(f'--checkpoint must be {checkpoints_lib.CHECKPOINT_NAMES}, not {checkpoint!r}')
  if checkpoint == 'averaged':
    checkpoints_lib.averaged_directory(workdir)
  if checkpoint == 'best':
    best_checkpoint.required_info(workdir)
  if checkpoint.startswith('last:') and not checkpoints_lib.saved_steps(workdir):
    raise FileNotFoundError(f'no checkpoints to average in {checkpoints_lib.checkpoint_directory(workdir)}')
  if checkpoint == 'latest' or checkpoint.isdigit():
    _saved_step(workdir, checkpoint)


def _split_list(value):
  """'a,b' or ['a', 'b'] (or one value, a path too) -> ['a', 'b']."""
  items = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value).split(',')
  return [item.strip() for item in items]


def ensemble_members(workdirs, checkpoints):
  """[(workdir, checkpoint)] of an ensemble: one workdir with several checkpoints ('1700,1800'), several
  workdirs with one checkpoint each ('latest' or 'averaged' of all), or as many checkpoints as workdirs
  (paired in order). checkpoints None: each workdir's config.decode_checkpoint (resolved by load_params). The
  workdir of an ensemble trained in one (config.ensemble_members, ensemble.py) stands for its members."""
  workdirs = _split_list(workdirs)
  checkpoints = None if checkpoints is None else _split_list(checkpoints)
  if '' in workdirs or '' in (checkpoints or []):
    raise ValueError(f'empty entry in --workdir {",".join(workdirs)!r} or --checkpoint '
                     f'{",".join(checkpoints or [])!r}')
  workdirs = [str(member) for w in workdirs for member in workdir_lib.member_workdirs(w)]
  if checkpoints is None:
    return [(w, None) for w in workdirs]
  if len(workdirs) == 1:
    return [(workdirs[0], c) for c in checkpoints]
  if len(checkpoints) == 1:
    return [(w, checkpoints[0]) for w in workdirs]
  if len(workdirs) != len(checkpoints):
    raise ValueError(f'{len(workdirs)} workdirs and {len(checkpoints)} checkpoints: give one checkpoint for all '
                     'workdirs, or one per workdir')
  return list(zip(workdirs, checkpoints))


_TASK_COMMANDS = {'translation': 'flaxformer_nmt.decode', 'lm': 'flaxformer_nmt.generate',
                  'mlm': 'flaxformer_nmt.fill_mask'}


def inference_config(workdir, dtype=None, task=None):
  """The config of `workdir` as inference runs it: attention and recomputation chosen for this machine (a
  workdir trained with 'cudnn' decodes on a CPU too; neither changes the parameters), and `dtype` ('auto',
  'float32', 'bfloat16'; None: the config's) as the compute dtype, 'float32' also keeping the matmul operands
  float32 where the config rounds them to bfloat16. ValueError where config.task is not `task` (None: any)."""
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f'dtype must be one of {DTYPES}, not {dtype!r}')
  config = workdir_lib.load_config(workdir)
  if task is not None and lm.task_of(config) != task:
    raise ValueError(f'{workdir} was trained with config.task={lm.task_of(config)!r}: this needs '
                     f'config.task={task!r} (python -m {_TASK_COMMANDS[lm.task_of(config)]} reads that workdir)')
  config.model.attention_impl, config.model.remat = 'auto', 'none'
  if dtype is not None:
    config.model.dtype = dtype
  if dtype == 'float32':
    config.model.matmul_precision = 'float32'
  return config


class Member(NamedTuple):
  """One model of what was loaded (an ensemble has several)."""
  workdir: epath.Path
  config: Any  # ConfigDict, as inference_config sets it up
  model: Any
  params: Any  # on the default device
  description: str  # which checkpoint: 'checkpoint 1800', 'the average of checkpoints [...]', ...


class Loaded(NamedTuple):
  """What load_for_inference read: the first member's config, model and parameters (the decoding settings,
  beam size, length penalty, come from it), the vocabulary every member shares, and every member."""
  workdir: epath.Path
  config: Any
  tokenizer: tokenizer_lib.Tokenizer
  model: Any
  params: Any
  description: str  # of the checkpoint, or 'an ensemble of ...'
  members: tuple  # of Member


def _check_partner(first, config, workdir):
  """ValueError unless `workdir` (of `config`) decodes together with the first member: one vocabulary, one
  direction, one order of the target."""
  vocab = epath.Path(workdir) / tokenizer_lib.VOCAB_FILENAME
  first_vocab = first.workdir / tokenizer_lib.VOCAB_FILENAME
  if vocab.read_bytes() != first_vocab.read_bytes():
    raise ValueError(f'an ensemble needs one vocabulary: {vocab} differs from {first_vocab}')
  direction = lambda c: f'{c.source_lang}->{c.target_lang}'
  if direction(config) != direction(first.config):
    raise ValueError(f'an ensemble translates one direction: {workdir} is {direction(config)}, '
                     f'{first.workdir} {direction(first.config)}')
  if data_lib.right_to_left(config) != data_lib.right_to_left(first.config):
    raise ValueError(f'an ensemble writes its targets in one order: {workdir} '
                     f'{"right to left" if data_lib.right_to_left(config) else "left to right"}, {first.workdir} not')


def load_for_inference(workdir, checkpoint=None, *, task=None, dtype=None, ensemble=False):
  """The config, tokenizer, model(s) and parameters of `workdir` at `checkpoint` (see load_params; None: the
  config's decode_checkpoint), for inference on this machine (inference_config: `task` checked, `dtype`).

  ensemble=True: `workdir` and `checkpoint` may name several ('A,B', '1700,1800', or lists; an ensemble's
  workdir stands for its members: ensemble_members), each (workdir, checkpoint) a member; the members must
  share the vocabulary, direction and target order, and members of one workdir share one model. Otherwise
  `workdir` is one run (an ensemble's workdir is refused: give a member) at one checkpoint.
  """
  if not ensemble:
    workdir_lib.single_run(workdir)
  pairs = ensemble_members(workdir, checkpoint) if ensemble else [(str(workdir), checkpoint)]
  for member_workdir, _ in pairs:
    if not (epath.Path(member_workdir) / workdir_lib.CONFIG_FILENAME).exists():
      raise FileNotFoundError(f'{member_workdir} is not a training workdir (no {workdir_lib.CONFIG_FILENAME} in it)')
  first_workdir = epath.Path(pairs[0][0])
  tokenizer = tokenizer_lib.Tokenizer(first_workdir / tokenizer_lib.VOCAB_FILENAME)
  members, models = [], {}
  for member_workdir, member_checkpoint in pairs:
    if member_workdir not in models:
      config = inference_config(member_workdir, dtype, task)
      if members:
        _check_partner(members[0], config, member_workdir)
      models[member_workdir] = config, workdir_lib.build_model(config, tokenizer)
    config, model = models[member_workdir]
    params, description = load_params(member_workdir, member_checkpoint)
    members.append(Member(epath.Path(member_workdir), config, model, params, description))
  if len(members) == 1:
    description = members[0].description
  else:
    one_workdir = len(models) == 1
    description = 'an ensemble of ' + ', '.join(m.description if one_workdir else f'{m.description} of {m.workdir}'
                                                for m in members)
  first = members[0]
  return Loaded(first.workdir, first.config, tokenizer, first.model, first.params, description, tuple(members))
