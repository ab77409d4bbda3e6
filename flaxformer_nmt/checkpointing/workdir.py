"""A training workdir's recorded config: config.json, written by the first run, checked by every later one,
read by decoding, averaging and export, and the model it describes.

Training and decoding both stand on this module; decoding never imports the trainer.
"""
import json

import ml_collections
from etils import epath

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.config import ConfigError  # callers catch it as workdir.ConfigError
from flaxformer_nmt.config import DEFAULT_PRNG_IMPL, PRNG_IMPLS
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import distributed

CONFIG_FILENAME = 'config.json'
MEMBER_PREFIX = 'member'  # {workdir}/member0, member1, ...: the runs of an ensemble (config.ensemble_members)


# Fields a resumed run must share with the saved config: they shape the parameters, or the text the vocabulary
# was learnt on (lowercase: a vocabulary of lowercased text would meet cased text).
_MODEL_FIELDS = ('task', 'model', 'vocab_size', 'sentencepiece_model_type', 'source_lang', 'target_lang',
                 'lowercase', 'target_right_to_left')
# Fields of config.model that change how the model computes, not its parameters: free to differ on resume.
_RUNTIME_MODEL_FIELDS = ('dtype', 'attention_impl', 'remat')


def _model_identity(config_dict, field):
  value = config_dict.get(field)
  if field == 'task' and value is None:
    value = 'translation'  # written before the task switch
  if field == 'lowercase':
    value = tokenizer_lib.lowercase_of(config_dict)
  if field == 'target_right_to_left':
    value = bool(value)  # written before the field: left to right
  if field == 'model' and isinstance(value, dict):
    value = {k: v for k, v in value.items() if k not in _RUNTIME_MODEL_FIELDS}
  return value


def _validate_decode_checkpoint(config):
  """config.decode_checkpoint names one checkpoint the run will have: found now, not when decoding after it."""
  which = config.get('decode_checkpoint', 'latest')
  if not checkpoints_lib.is_checkpoint_name(which):
    raise ConfigError(f'config.decode_checkpoint={which!r}: use {checkpoints_lib.CHECKPOINT_NAMES}')
  if which == 'averaged' and config.average_last_checkpoints <= 0:
    raise ConfigError("config.decode_checkpoint='averaged' needs config.average_last_checkpoints > 0 (now "
                      f'{config.average_last_checkpoints}): nothing would be averaged')
  if which == 'best' and not config.best_checkpoint_metric:
    raise ConfigError("config.decode_checkpoint='best' needs config.best_checkpoint_metric (now ''): no best "
                      'checkpoint would be kept')


def _validate_rdrop(config):
  alpha = config.get('rdrop_alpha', 0.0)
  if alpha < 0:
    raise ConfigError(f'config.rdrop_alpha={alpha} is a weight: use 0 (off) or more')
  if not alpha:
    return
  if lm.task_of(config) == 'mlm':
    raise ConfigError(f'config.rdrop_alpha={alpha} is not for the MLM: its two copies of an example would be '
                      'masked differently')
  rates = (config.model.dropout_rate, config.model.attention_dropout_rate, config.model.relu_dropout_rate,
           config.model.get('source_word_dropout', 0.0))
  if not any(rates):
    raise ConfigError(f'config.rdrop_alpha={alpha} needs dropout (config.model.dropout_rate, attention_dropout_rate, '
                      'relu_dropout_rate or source_word_dropout > 0): without it both predictions are the same')


def _translation_count(config, field, unit, what):
  """config.{field}, a count of `unit` (0: off) that only the translation task uses (`what` it does)."""
  value = config.get(field, 0)
  if not isinstance(value, int) or value < 0:
    raise ConfigError(f'config.{field}={value!r} counts {unit}: use 0 (off) or more')
  if value and lm.task_of(config) != 'translation':
    raise ConfigError(f'config.{field}={value} {what}: it is for the translation task, not {lm.task_of(config)!r}')
  return value


def _validate_vocabulary_loss_chunk(config):
  chunk = _translation_count(config, 'vocabulary_loss_chunk_tokens', 'tokens', "projects the translation "
                             "decoder's states")
  if chunk and config.get('rdrop_alpha', 0.0):
    raise ConfigError(f'config.vocabulary_loss_chunk_tokens={chunk} cannot go with config.rdrop_alpha='
                      f'{config.rdrop_alpha}: R-Drop compares whole predictions, which the chunked loss never holds')


def _validate_schedule_fit(config):
  if config.get('fit_schedule_to_time', False) and not (config.max_train_minutes > 0 and config.cooldown_steps > 0):
    raise ConfigError('config.fit_schedule_to_time needs a time limit and a cooldown to fit to it: '
                      f'config.max_train_minutes > 0 (now {config.max_train_minutes}) and config.cooldown_steps > 0 '
                      f'(now {config.cooldown_steps})')


def _validate_ensemble(config):
  members = config.get('ensemble_members', 1)
  if not isinstance(members, int) or members < 1:
    raise ConfigError(f'config.ensemble_members={members!r} counts the runs trained and decoded together: use 1 '
                      '(one model) or more')
  if members > 1 and lm.task_of(config) != 'translation':
    raise ConfigError(f'config.ensemble_members={members} is for the translation task, not '
                      f'{lm.task_of(config)!r}: its decoders (generate.py, fill_mask.py) take one model')


def validate_config(config):
  """Raises ConfigError for a config that cannot be trained, before anything is read or written."""
  if config.get('task', 'translation') not in lm.TASKS:
    raise ConfigError(f'config.task={config.task!r}: use one of {lm.TASKS}')
  if config.data_source == 'text' and not config.data_dir:
    raise ConfigError('config.data_dir is empty: pass --config.data_dir=DIR holding {split}.{lang} files')
  if config.data_source == 'tfds' and not config.tfds_name:
    raise ConfigError("config.tfds_name is empty: name a TFDS builder, e.g. 'wmt14_translate/de-en'")
  if config.data_source not in ('text', 'tfds'):
    raise ConfigError(f"config.data_source={config.data_source!r}: use 'text' or 'tfds'")
  _validate_decode_checkpoint(config)
  if config.average_last_checkpoints > config.keep_checkpoints > 0:
    raise ConfigError(f'config.average_last_checkpoints={config.average_last_checkpoints} needs '
                      f'config.keep_checkpoints >= it (now {config.keep_checkpoints})')
  for field in ('max_length', 'packed_length'):
    if config[field] > config.model.max_position:
      raise ConfigError(f'config.{field}={config[field]} exceeds config.model.max_position='
                        f'{config.model.max_position}: positions past it would all share its encoding. Lower '
                        f'{field} or raise model.max_position (a new model).')
  bpe_dropout = config.get('bpe_dropout', 0.0)
  if not 0.0 <= bpe_dropout <= 1.0:
    raise ConfigError(f'config.bpe_dropout={bpe_dropout} is a probability: use 0 (off) to 1')
  if bpe_dropout and (config.sentencepiece_model_type != 'bpe' or lm.task_of(config) != 'translation'):
    raise ConfigError(f'config.bpe_dropout={bpe_dropout} needs a translation task with a BPE vocabulary '
                      f"(config.sentencepiece_model_type='bpe'; now {config.sentencepiece_model_type!r}, task "
                      f'{lm.task_of(config)!r})')
  _translation_count(config, 'bidirectional_epochs', 'epochs', 'reverses translation pairs')
  if config.get('target_right_to_left', False):
    clash = {'task': lm.task_of(config) != 'translation', 'bpe_dropout': bpe_dropout,
             'bidirectional_epochs': config.bidirectional_epochs}
    for field, value in clash.items():
      if value:
        raise ConfigError(f'config.target_right_to_left trains on reversed targets; config.{field}='
                          f'{config[field]!r} cannot go with it (it re-reads or swaps the targets)')
  word_dropout = config.model.get('source_word_dropout', 0.0)
  if not 0.0 <= word_dropout < 1.0:
    raise ConfigError(f'config.model.source_word_dropout={word_dropout} is a probability: use 0 (off) to below 1')
  if word_dropout and lm.task_of(config) != 'translation':
    raise ConfigError(f'config.model.source_word_dropout={word_dropout} needs a source: it is for the translation '
                      f'task, not {lm.task_of(config)!r}')
  if config.get('prng_impl', DEFAULT_PRNG_IMPL) not in PRNG_IMPLS:
    raise ConfigError(f'config.prng_impl={config.prng_impl!r}: use one of {PRNG_IMPLS}')
  _validate_rdrop(config)
  _validate_vocabulary_loss_chunk(config)
  _validate_schedule_fit(config)
  _validate_ensemble(config)
  for field in ('tokens_per_batch', 'log_every_steps', 'eval_every_steps', 'checkpoint_every_steps',
                'grad_accumulation_steps', 'batch_rows_multiple'):
    if config[field] <= 0:
      raise ConfigError(f'config.{field} must be positive, not {config[field]}')
  # The model's dtype and attention rules for this machine (cuDNN's shape and dtype limits among them), checked
  # now rather than after the data and the vocabulary are prepared.
  model_lib.ModelConfig.from_config(config, config.vocab_size)


def save_or_check_config(config, workdir):
  """Writes config.json on the first run; later runs must describe the same model."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  current = json.loads(config.to_json_best_effort())
  if path.exists():
    saved = json.loads(path.read_text())
    if 'attention_impl' not in saved.get('model', {}) and any((epath.Path(workdir) / 'checkpoints').glob('[0-9]*')):
      # Written before the fused attention projections: restoring would fail and move them aside as corrupt.
      raise ConfigError(f'{workdir} holds checkpoints with separate query/key/value projections (before the '
                        'fused projections): decode and average convert them on load, but training cannot '
                        'resume from them. Use a new --workdir.')
    if (saved.get('ensemble_members', 1) > 1) != (current.get('ensemble_members', 1) > 1):
      raise ConfigError(f'{path} was trained with config.ensemble_members={saved.get("ensemble_members", 1)}, now '
                        f'{current.get("ensemble_members", 1)}: an ensemble\'s runs live in its member '
                        'directories, one run in the workdir itself. Use a new --workdir or the original value.')
    saved_impl, impl = (c.get('prng_impl', DEFAULT_PRNG_IMPL) for c in (saved, current))
    if saved_impl != impl:  # its checkpoints hold the other generator's key data (2 or 4 words)
      raise ConfigError(f'{path} was trained with config.prng_impl={saved_impl!r}, now {impl!r}: a run keeps '
                        'the generator of its dropout keys. Use a new --workdir or the original value.')
    for field in _MODEL_FIELDS:
      if _model_identity(saved, field) != _model_identity(current, field):
        raise ConfigError(f'{path} holds a different model: config.{field} was {saved.get(field)!r}, '
                          f'now {current.get(field)!r}. Use a new --workdir or the original config.')
  distributed.barrier('config read')  # nobody reads a half-written file
  if distributed.is_leader():
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2, sort_keys=True))
  distributed.barrier('config written')


def load_config(workdir):
  """The ConfigDict a workdir was trained with."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  if not path.exists():
    raise ConfigError(f'{path} not found: is {workdir} a training workdir?')
  return ml_collections.ConfigDict(json.loads(path.read_text()))


def member_workdir(workdir, k):
  """Where member k of an ensemble trains (ensemble.py)."""
  return epath.Path(workdir) / f'{MEMBER_PREFIX}{k}'


def _ensemble_size(workdir):
  """config.ensemble_members of the run in `workdir` (1 where it has no config.json: checked by its reader)."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  return json.loads(path.read_text()).get('ensemble_members', 1) if path.exists() else 1


def member_workdirs(workdir):
  """The training workdirs `workdir` stands for: its members if it was trained as an ensemble
  (config.ensemble_members > 1), else [workdir] itself."""
  members = _ensemble_size(workdir)
  if members == 1:
    return [workdir]
  paths = [member_workdir(workdir, k) for k in range(members)]
  untrained = [str(p) for p in paths if not (p / CONFIG_FILENAME).exists()]
  if untrained:
    raise ConfigError(f'{workdir} is an ensemble of {members} runs (config.ensemble_members) and '
                      f'{", ".join(untrained)} has not started training: rerun its training command to train it, or '
                      f'decode a member alone (--workdir {paths[0]})')
  return paths


def single_run(workdir):
  """Raises ConfigError where `workdir` is an ensemble's: for readers of one run's parameters (export)."""
  members = _ensemble_size(workdir)
  if members > 1:
    raise ConfigError(f'{workdir} is an ensemble of {members} runs (config.ensemble_members): this reads one run\'s '
                      f'parameters; give a member, e.g. --workdir {member_workdir(workdir, 0)} (decode and compare '
                      'take the ensemble\'s workdir)')


def build_model(config, tokenizer, platform='auto'):
  """The model of config.task for `platform` ('auto': this process's backend): the encoder-decoder
  Transformer, or lm.py's decoder-only or masked language model."""
  task = lm.task_of(config)
  model_config = model_lib.ModelConfig.from_config(config, tokenizer.vocab_size, platform, lm.ARCHITECTURES[task])
  return lm.build(task, model_config, mask_id=tokenizer.mask_id)
