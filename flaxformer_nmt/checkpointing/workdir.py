"""A training workdir's recorded config: config.json, written by the first run (and by a later one once its
checkpoint accepted it), checked by every later one, read by decoding, averaging and export, and the model it
describes.

Training and decoding both stand on this module; decoding never imports the trainer.
"""
import json

import ml_collections
from etils import epath

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.config import ConfigError  # callers catch it as workdir.ConfigError
from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import distributed

CONFIG_FILENAME = 'config.json'
MEMBER_PREFIX = 'member'  # {workdir}/member0, member1, ...: the runs of an ensemble (config.ensemble_members)


# Fields a resumed run must share with the saved config: they shape the parameters, or the text the vocabulary
# was learnt on (lowercase: a vocabulary of lowercased text would meet cased text), or the key data its
# checkpoints hold (prng_impl: 2 or 4 words). A config.json must hold them all: nothing else says what was trained.
_MODEL_FIELDS = ('task', 'vocab_size', 'sentencepiece_model_type', 'source_lang', 'target_lang', 'lowercase',
                 'target_right_to_left', 'prng_impl')
# Fields of config.model that change how the model computes, not its parameters: free to differ on resume, and
# taken from base_config where a config.json lacks them.
_RUNTIME_MODEL_FIELDS = ('dtype', 'attention_impl', 'remat')


def _model_fields(config):
  """{'vocab_size': ..., 'model.d_model': ...}: the fields that name the trained model."""
  fields = {field: config[field] for field in _MODEL_FIELDS}
  fields.update({f'model.{k}': v for k, v in config.model.items() if k not in _RUNTIME_MODEL_FIELDS})
  return fields


def _merge(config, saved, path, prefix=''):
  """Sets every field of `saved` (a dict read from the config.json at `path`) on `config` (a base_config),
  refusing a field base_config does not have and a value of another type."""
  for key, value in saved.items():
    if key not in config:
      raise ConfigError(f'{path}: config.{prefix}{key} is not a field of this version\'s config (base_config); '
                        'the workdir was written by another version: train a new one')
    if isinstance(config[key], ml_collections.ConfigDict):
      if not isinstance(value, dict):
        raise ConfigError(f'{path}: config.{prefix}{key}={value!r} is not of its type (an object of fields)')
      _merge(config[key], value, path, f'{prefix}{key}.')
      continue
    try:
      config[key] = tuple(value) if isinstance(config[key], tuple) and isinstance(value, list) else value
    except TypeError as e:
      raise ConfigError(f'{path}: config.{prefix}{key}={value!r} is not of its type ({e})') from None


def read_config(path):
  """The config saved at `path` (a config.json) merged onto base_config(): a field it lacks takes base_config's
  value, except the fields that name the trained model (their absence is refused, as is a field base_config
  does not have)."""
  path = epath.Path(path)
  try:
    saved = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f'{path} is not valid JSON ({e}): repair it (the config this workdir was trained with) or '
                      'use a new --workdir') from None
  if not isinstance(saved, dict):
    raise ConfigError(f'{path} holds {saved!r:.40}, not a config (a JSON object of fields): repair it (the config '
                      'this workdir was trained with) or use a new --workdir')
  config = config_lib.base_config()
  _merge(config, saved, path)
  for field in _model_fields(config):
    section, _, name = field.rpartition('.')
    if name not in (saved.get(section, {}) if section else saved):
      raise ConfigError(f'{path} lacks config.{field}, which names the trained model: the workdir was written by '
                        'another version; train a new one')
  return config


def save_or_check_config(config, workdir):
  """check_config, then write_config."""
  check_config(config, workdir)
  write_config(config, workdir)


def check_config(config, workdir):
  """ConfigError unless `config` may train in `workdir`: once it holds anything besides config.json, a later run
  must describe the same model (and stay one run, or an ensemble's members, as it began); a start that failed
  before it built anything, e.g. on a vocabulary size sentencepiece refused, binds no later run."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  if path.exists() and any(p.name != CONFIG_FILENAME for p in path.parent.iterdir()):
    saved = read_config(path)
    if (saved.ensemble_members > 1) != (config.ensemble_members > 1):
      raise ConfigError(f'{path} was trained with config.ensemble_members={saved.ensemble_members}, now '
                        f'{config.ensemble_members}: an ensemble\'s runs live in its member directories, one run in '
                        'the workdir itself. Use a new --workdir or the original value.')
    saved_fields, fields = _model_fields(saved), _model_fields(config)
    for field, value in saved_fields.items():
      if fields[field] != value:
        raise ConfigError(f'{path} was trained with config.{field}={value!r}, now {fields[field]!r}: a resumed run '
                          'keeps its model, vocabulary and key generator. Use a new --workdir or the original value.')


# The fields that shape the learning rate of the steps a resumed run has left.
SCHEDULE_FIELDS = ('num_train_steps', 'warmup_steps', 'cooldown_steps', 'learning_rate', 'learning_rate_scale',
                   'learning_rate_schedule')


def schedule_changes(config, workdir):
  """[(field, saved value, new value)] of SCHEDULE_FIELDS that differ from the workdir's config.json (none where
  there is none): a resumed run follows the new schedule from its step on."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  if not path.exists():
    return []
  saved = read_config(path)
  return [(field, saved[field], config[field]) for field in SCHEDULE_FIELDS if saved[field] != config[field]]


def write_config(config, workdir):
  """Writes `config` to the workdir's config.json (the one decoding, averaging and export read)."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  distributed.barrier('config read')  # nobody reads a half-written file
  if distributed.is_leader():
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f'.{CONFIG_FILENAME}.partial'  # renamed into place: a kill leaves the old file whole
    partial.write_text(json.dumps(json.loads(config.to_json_best_effort()), indent=2, sort_keys=True))
    partial.replace(path)
  distributed.barrier('config written')


def load_config(workdir):
  """The ConfigDict a workdir was trained with (read_config of its config.json)."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  if not path.exists():
    raise ConfigError(f'{path} not found: is {workdir} a training workdir?')
  return read_config(path)


def member_workdir(workdir, k):
  """Where member k of an ensemble trains (ensemble.py)."""
  return epath.Path(workdir) / f'{MEMBER_PREFIX}{k}'


def _ensemble_size(workdir):
  """config.ensemble_members of the run in `workdir` (1 where it has no config.json: checked by its reader)."""
  path = epath.Path(workdir) / CONFIG_FILENAME
  return read_config(path).ensemble_members if path.exists() else 1


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


def build_model(config, tokenizer):
  """The model of config.task for this process's backend: the encoder-decoder Transformer, or lm.py's
  decoder-only or masked language model."""
  task = lm.task_of(config)
  model_config = model_lib.ModelConfig.from_config(config, tokenizer.vocab_size, architecture=lm.ARCHITECTURES[task])
  return lm.build(task, model_config, mask_id=tokenizer.mask_id)
