"""Fine-tuning with --config.init_from: parameters only (fresh optimizer, schedule and step), the source's
vocabulary, clear errors for another vocabulary or shape, and resuming wins over init_from."""
import json
import logging
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from flaxformer_nmt.checkpointing import best as best_checkpoint
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing.workdir import build_model
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.training import loop as train
from flaxformer_nmt.training import step as ts
from flaxformer_nmt.training import warm_start


def deterministic_config(toy_corpus):
  config = small_config(toy_corpus)
  config.model.dropout_rate = 0.0  # so that the train-step loss equals the eval loss computed below
  config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 10, 5, 100
  config.log_every_steps = 1
  return config


@pytest.fixture(scope='module')
def source(tmp_path_factory):
  from conftest import write_toy_corpus  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('warm')
  config = deterministic_config(write_toy_corpus(root / 'data'))
  train.train_and_evaluate(config, root / 'source')
  return config, root / 'source'


def metrics(workdir):
  return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]


def test_the_first_step_loss_of_a_warm_start_is_the_source_models_loss_on_that_batch(source, tmp_path):
  config, source_dir = source
  config = config.copy_and_resolve_references()
  config.init_from, config.init_checkpoint = str(source_dir), '5'
  config.num_train_steps = 1
  workdir = tmp_path / 'finetune'
  train.train_and_evaluate(config, workdir)
  first = next(m for m in metrics(workdir) if 'train/loss' in m)
  assert first['step'] == 1

  # Independently: checkpoint 5's parameters, read from disk, on the new run's first batch, by the eval step.
  params = checkpoints_lib.saved_params(source_dir, 5)
  train_batches, _, tokenizer = train.input_pipeline(config, workdir, num_devices=1)
  batch = next(train_batches)
  train_batches.close()
  sums = ts.eval_step(params, batch, model=build_model(config, tokenizer), label_smoothing=config.label_smoothing)
  np.testing.assert_allclose(first['train/loss'], float(sums['loss_sum'] / sums['target_tokens']), rtol=2e-5)
  # ... which is not what a fresh model scores (the source's own first step started from random weights).
  source_first = next(m for m in metrics(source_dir) if 'train/loss' in m)
  assert first['train/loss'] < source_first['train/loss'] - 0.2
  # Fresh schedule: the learning rate of step 1 is the schedule's first value, not the source's sixth.
  schedule = ts.paper_schedule(config.model.d_model, config.warmup_steps, config.learning_rate_scale)
  np.testing.assert_allclose(first['train/learning_rate'], float(schedule(0)), rtol=1e-6)
  # The vocabulary is the source's (copied in), and the run counts its own steps from 0.
  assert (workdir / 'vocab.model').read_bytes() == (source_dir / 'vocab.model').read_bytes()
  assert checkpoints_lib.saved_steps(workdir) == [1]


@pytest.mark.slow
def test_resuming_wins_over_init_from(source, tmp_path, caplog):
  caplog.set_level(logging.INFO)
  config, source_dir = source
  config = config.copy_and_resolve_references()
  config.num_train_steps = 2
  workdir = tmp_path / 'w'
  train.train_and_evaluate(config, workdir)  # a run of its own, no init_from
  config.init_from, config.num_train_steps = str(source_dir), 3
  train.train_and_evaluate(config, workdir)
  assert 'Resuming this workdir; config.init_from=' in caplog.text and 'is ignored' in caplog.text
  assert 'Initialized the parameters from' not in caplog.text
  assert [m['step'] for m in metrics(workdir) if 'train/loss' in m] == [1, 2, 3]


def test_a_checkpoint_in_the_workdir_wins_over_init_from_and_only_a_new_run_takes_it(monkeypatch, caplog):
  """The rule of the slow test above, at restore_or_start with stand-ins: a workdir with a checkpoint resumes from
  it (its parameters, data position and training time; init_from said to be ignored, never read); one without
  takes init_from's parameters."""
  caplog.set_level(logging.INFO)
  warm_started = []
  monkeypatch.setattr(warm_start, 'load_params', lambda state, *_: warm_started.append(state) or {'w': np.full(2, 5.0)})

  class Store:
    def __init__(self, restored):
      self.restored = restored

    def restore_newest_good(self, abstract, vocab_sha256):
      del abstract, vocab_sha256
      return self.restored

  class Batches:
    data_state = None

    def restore(self, data_state, allow_batching_change):
      del allow_batching_change
      self.data_state = data_state

  config = small_config('data')
  config.init_from = '/runs/source'
  tokenizer = tokenizer_lib.Tokenizer.__new__(tokenizer_lib.Tokenizer)
  tokenizer.sha256 = 'abc'
  fresh, batches = {'w': jnp.zeros(2)}, Batches()
  saved = ({'w': jnp.ones(2)}, {'epoch': 1, 'batch': 7, 'seed': 0, train.TRAINED_SECONDS: 30.0})
  state, seconds = train.restore_or_start(config, fresh, None, Store(saved), batches, tokenizer)
  assert not warm_started
  np.testing.assert_array_equal(state['w'], [1.0, 1.0])
  assert seconds == 30.0 and batches.data_state == {'epoch': 1, 'batch': 7, 'seed': 0}
  assert 'Resuming this workdir; config.init_from=/runs/source is ignored' in caplog.text

  state, seconds = train.restore_or_start(config, fresh, None, Store(None), Batches(), tokenizer)
  assert warm_started == [fresh] and seconds == 0.0
  np.testing.assert_array_equal(state['w'], [5.0, 5.0])


def test_a_new_fine_tuning_workdir_gets_the_sources_vocabulary_and_one_with_its_own_keeps_it(source, tmp_path):
  """Before the tokenizer loads, an empty workdir gets the source's vocab.model (also where init_from names one of
  its checkpoints): one it learnt on its own fine-tuning corpus would not fit the embeddings. A vocab.model put
  in the workdir beforehand is kept (and checked against the source's when the parameters are read)."""
  config, source_dir = source
  config = config.copy_and_resolve_references()
  for init_from in (source_dir, source_dir / 'checkpoints' / '5'):
    config.init_from, workdir = str(init_from), tmp_path / init_from.name
    workdir.mkdir()
    warm_start.adopt_vocabulary(config, workdir)
    assert (workdir / 'vocab.model').read_bytes() == (source_dir / 'vocab.model').read_bytes()
  (tmp_path / 'own').mkdir()
  (tmp_path / 'own' / 'vocab.model').write_bytes(b'its own')
  warm_start.adopt_vocabulary(config, tmp_path / 'own')
  assert (tmp_path / 'own' / 'vocab.model').read_bytes() == b'its own'
  # An MLM needs a mask piece, which a translation run's vocabulary lacks: refused before anything is copied (a
  # vocab.model left behind would be the workdir's vocabulary for every later launch).
  config.task, config.init_from = 'mlm', str(source_dir)
  (tmp_path / 'mlm').mkdir()
  with pytest.raises(warm_start.WarmStartError, match=f'needs a .* piece in its vocabulary and '
                     f'{source_dir / "vocab.model"} has none'):
    warm_start.adopt_vocabulary(config, tmp_path / 'mlm')
  assert not (tmp_path / 'mlm' / 'vocab.model').exists()


def test_resolve_names_workdirs_checkpoint_directories_and_their_choices(source, tmp_path):
  _, source_dir = source
  directory, subtree, workdir, _ = warm_start.resolve(source_dir)
  assert directory == source_dir / 'checkpoints' / '10' / 'state' and subtree == 'params' and workdir == source_dir
  assert warm_start.resolve(source_dir, '5')[0] == source_dir / 'checkpoints' / '5' / 'state'
  assert warm_start.resolve(source_dir / 'checkpoints' / '5')[:3] == (
      source_dir / 'checkpoints' / '5' / 'state', 'params', source_dir)
  checkpoints_lib.average_last(source_dir, last=2)
  assert warm_start.resolve(source_dir, 'averaged')[:2] == (source_dir / 'averaged' / 'params', None)
  with pytest.raises(warm_start.WarmStartError, match=r'use latest, averaged, best or one of the steps \[5, 10\]'):
    warm_start.resolve(source_dir, '7')
  with pytest.raises(warm_start.WarmStartError, match='best not found'):
    warm_start.resolve(source_dir, 'best')
  with pytest.raises(warm_start.WarmStartError, match='neither a training workdir nor a checkpoint directory'):
    warm_start.resolve(tmp_path)


def test_another_vocabulary_or_shape_is_a_clear_error(source, tmp_path):
  config, source_dir = source
  config = config.copy_and_resolve_references()
  config.init_from = str(source_dir)
  workdir = tmp_path / 'other_vocab'
  workdir.mkdir()
  text = [line.upper() for line in (source_dir.parent / 'data' / 'train.en').read_text().splitlines()]
  tokenizer_lib.train_sentencepiece(text * 2, workdir / 'vocab.model', vocab_size=config.vocab_size)
  with pytest.raises(warm_start.WarmStartError, match='was trained with another vocabulary'):
    train.train_and_evaluate(config, workdir)
  config.model.d_ff = 48
  workdir = tmp_path / 'other_shape'
  with pytest.raises(warm_start.WarmStartError,
                     match=r'params\.decoder_0\.feed_forward\.wi\.kernel: shape \(32, 64\) in the checkpoint, '
                           r'\(32, 48\) in this config'):
    train.train_and_evaluate(config, workdir)
  assert not (workdir / 'checkpoints').exists() or not list((workdir / 'checkpoints').iterdir())


def test_a_checkpoint_directory_away_from_its_workdir_is_checked_against_its_recorded_vocabulary(source, tmp_path):
  """A checkpoint copied out of its workdir has no vocab.model beside it: the vocabulary its save recorded
  decides (the check was skipped, and a run with another vocabulary took its embeddings). best/ is a
  checkpoint directory too (best.json names its parameters)."""
  config, source_dir = source
  config = config.copy_and_resolve_references()
  lonely = tmp_path / 'lonely' / '5'
  shutil.copytree(source_dir / 'checkpoints' / '5', lonely)
  assert warm_start.resolve(lonely)[2] is None  # no vocabulary found beside it
  config.init_from = str(lonely)
  workdir = tmp_path / 'other_vocab'
  workdir.mkdir()
  text = [line.upper() for line in (source_dir.parent / 'data' / 'train.en').read_text().splitlines()]
  tokenizer_lib.train_sentencepiece(text * 2, workdir / 'vocab.model', vocab_size=config.vocab_size)
  with pytest.raises(warm_start.WarmStartError, match=r'another vocabulary \(recorded in the checkpoint sha256'):
    train.train_and_evaluate(config, workdir)
  workdir = tmp_path / 'same_vocab'  # the source's vocabulary: accepted
  workdir.mkdir()
  shutil.copy(source_dir / 'vocab.model', workdir / 'vocab.model')
  config.num_train_steps = 1
  train.train_and_evaluate(config, workdir)
  assert checkpoints_lib.saved_steps(workdir) == [1]

  run = tmp_path / 'with_best'
  params = checkpoints_lib.saved_params(source_dir, 5)
  best_checkpoint.BestCheckpoint(run, 'bleu').update(5, params, {'eval/bleu': 1.0})
  assert warm_start.resolve(run / 'best')[:2] == (run / 'best' / 'params_5', None)


def test_an_unreadable_source_checkpoint_is_a_clear_error_naming_it(source, tmp_path):
  """A source checkpoint whose tree metadata is gone stops the run with a WarmStartError naming the directory
  (it escaped as a FileNotFoundError, which the train command printed as a traceback)."""
  config, source_dir = source
  config = config.copy_and_resolve_references()
  damaged = tmp_path / 'damaged' / '5'
  shutil.copytree(source_dir / 'checkpoints' / '5', damaged)
  shutil.copy(source_dir / 'vocab.model', damaged.parent / 'vocab.model')
  (damaged / 'state' / '_METADATA').unlink()
  config.init_from = str(damaged)
  with pytest.raises(warm_start.WarmStartError, match=f"cannot be read from {damaged / 'state'}"):
    train.train_and_evaluate(config, tmp_path / 'run')
