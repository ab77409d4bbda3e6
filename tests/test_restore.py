"""Restore tells failures apart: damaged checkpoints are set aside, mismatched ones stop the run with nothing
moved, failing storage is retried and then stops the run with nothing moved."""
import errno
import functools
import json
import pathlib
import subprocess

import jax

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import small_config
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import batching
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.training import loop as train
from flaxformer_nmt.training import step as ts
from test_resilience import cli_args


def tiny_transformer(**changes):
  """conftest's tiny model, built without initializing it (eval_shape below needs only the module)."""
  fields = dict(vocab_size=16, num_encoder_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4,
                dropout_rate=0.0, max_position=128, dtype='float32')
  return model_lib.Transformer(model_lib.ModelConfig(**{**fields, **changes}))


def fresh_state(model=None, optimizer=None):
  """A train state of the tiny model filled with random numbers (shapes are what matter here; eval_shape
  keeps it cheap; zeros would not be written at all, being the arrays' fill value)."""
  model = model or tiny_transformer()
  optimizer = optimizer or ts.make_optimizer(config_lib.base_config())[0]
  shapes = jax.eval_shape(functools.partial(ts.init_state, model, optimizer, 0))
  rng = np.random.default_rng(0)
  return jax.tree_util.tree_map(lambda s: jnp.asarray(rng.integers(1, 100, s.shape), s.dtype), shapes)


def write_checkpoints(workdir, state, steps, vocab_sha256=None):
  store = checkpoints_lib.Checkpoints(workdir, keep=0)
  for step in steps:
    store.save(step, state.replace(step=jnp.asarray(step)), {'epoch': 0, 'batch': step, 'seed': 0}, force=True,
               vocab_sha256=vocab_sha256)
  store.wait()
  store.close()
  return workdir / 'checkpoints'


def listing(workdir):
  return sorted(str(p.relative_to(workdir)) for p in workdir.rglob('*'))


def test_each_kind_of_damage_is_set_aside_by_name_and_the_previous_one_restored(tmp_path, caplog):
  state = fresh_state()
  directory = write_checkpoints(tmp_path, state, (1, 2, 3, 4, 5))
  for path in (directory / '5' / 'state').rglob('*'):  # 5: array files truncated
    if path.is_file() and 'ocdbt.process' in str(path):
      path.write_bytes(path.read_bytes()[:10])
  (directory / '4' / checkpoints_lib.COMMIT_MARKER).unlink()  # 4: no commit marker
  (directory / '3' / 'state' / '_METADATA').write_text('{garbage')  # 3: garbage tree metadata
  (directory / '2' / 'data' / 'metadata').write_text('not json')  # 2: garbage data position

  store = checkpoints_lib.Checkpoints(tmp_path, keep=0)
  restored, data_state = store.restore_newest_good(checkpoints_lib.abstract_like(state))
  assert int(restored.step) == 1 and data_state['batch'] == 1
  warnings = [r.getMessage() for r in caplog.records if 'is damaged' in r.getMessage()]
  assert [w.split()[1] for w in warnings] == ['5', '4', '3', '2']
  assert 'OUT_OF_RANGE' in warnings[0] or 'reading array' in warnings[0]
  assert 'no commit marker' in warnings[1] and 'unreadable metadata' in warnings[2]
  assert sorted(p.name for p in (tmp_path / 'corrupt_checkpoints').iterdir()) == ['2', '3', '4', '5']
  assert store.steps() == [1]
  store.close()


def test_a_checkpoint_missing_a_file_is_damaged_not_a_storage_failure(tmp_path, monkeypatch):
  """A file gone from a committed checkpoint (FileNotFoundError) is the checkpoint's damage: it is set aside and
  the previous one restored at once, not retried and then reported as failing storage."""
  state = fresh_state()
  directory = write_checkpoints(tmp_path, state, (1, 2))
  (directory / '2' / 'data' / 'metadata').unlink()
  waits = []
  monkeypatch.setattr(checkpoints_lib.time, 'sleep', waits.append)
  with checkpoints_lib.Checkpoints(tmp_path) as store:
    restored, data_state = store.restore_newest_good(checkpoints_lib.abstract_like(state))
  assert int(restored.step) == 1 and data_state['batch'] == 1 and waits == []
  assert sorted(p.name for p in (tmp_path / 'corrupt_checkpoints').iterdir()) == ['2']

def test_every_checkpoint_damaged_is_an_error_not_a_silent_restart(tmp_path):
  state = fresh_state()
  directory = write_checkpoints(tmp_path, state, (1,))
  (directory / '1' / checkpoints_lib.COMMIT_MARKER).unlink()
  with (checkpoints_lib.Checkpoints(tmp_path) as store,
        pytest.raises(checkpoints_lib.CheckpointsDamagedError, match='all 1 were damaged')):
    store.restore_newest_good(checkpoints_lib.abstract_like(state))
  assert (tmp_path / 'corrupt_checkpoints' / '1').exists()


def legacy_clipped_optimizer():
  """The optimizer as built before clipping became stateless: clip_by_global_norm chained before Adam."""
  config = config_lib.base_config()
  schedule = ts.paper_schedule(config.model.d_model, config.warmup_steps)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9))


def test_another_optimizer_tree_stops_before_anything_moves_naming_the_entries(tmp_path):
  write_checkpoints(tmp_path, fresh_state(optimizer=legacy_clipped_optimizer()), (1, 2))
  # The newest is also damaged: it must stay in place too, since the run stops.
  (tmp_path / 'checkpoints' / '2' / checkpoints_lib.COMMIT_MARKER).unlink()
  before = listing(tmp_path)
  with checkpoints_lib.Checkpoints(tmp_path) as store, pytest.raises(checkpoints_lib.CheckpointMismatchError) as error:
    store.restore_newest_good(checkpoints_lib.abstract_like(fresh_state()))
  message = str(error.value)
  assert 'checkpoint 1' in message and 'optimizer state' in message
  assert 'opt_state.1.0.count' in message and 'opt_state.0.count' in message  # stored vs built
  assert 'parameters' not in message.split('. Nothing')[0]  # the parameters match: not named
  assert f'--config.init_from={tmp_path}' in message and 'Nothing was moved' in message
  assert listing(tmp_path) == before


def test_another_layer_shape_is_named_with_both_shapes(tmp_path):
  write_checkpoints(tmp_path, fresh_state(), (1,))
  wider = tiny_transformer(d_ff=48)
  with (checkpoints_lib.Checkpoints(tmp_path) as store,
        pytest.raises(checkpoints_lib.CheckpointMismatchError,
                      match=r'params\.decoder_0\.feed_forward\.wi\.kernel: shape \(32, 64\) in the checkpoint, '
                            r'\(32, 48\) in this config')):
    store.restore_newest_good(checkpoints_lib.abstract_like(fresh_state(wider)))
  assert not (tmp_path / 'corrupt_checkpoints').exists()


def test_another_vocabulary_is_refused_by_hash(tmp_path):
  state = fresh_state()
  write_checkpoints(tmp_path, state, (1,), vocab_sha256='a' * 64)
  store = checkpoints_lib.Checkpoints(tmp_path)
  with pytest.raises(checkpoints_lib.CheckpointMismatchError, match=r'vocabulary: vocab.model sha256 aaaaaaaaaaaa'):
    store.restore_newest_good(checkpoints_lib.abstract_like(state), vocab_sha256='b' * 64)
  restored, _ = store.restore_newest_good(checkpoints_lib.abstract_like(state), vocab_sha256='a' * 64)
  assert int(restored.step) == 1
  store.close()


@pytest.mark.parametrize('failure', [
    OSError(errno.EIO, 'Input/output error'),
    Exception('Encountered error while reading array index')])
def test_storage_errors_are_retried_then_stop_the_run_and_move_nothing(tmp_path, monkeypatch, failure):
  if not isinstance(failure, OSError):  # tensorstore's way: a status in the cause of orbax's exception
    failure.__cause__ = ValueError('UNAVAILABLE: Error reading gs://bucket/w/checkpoints/2/state: 503')
  state = fresh_state()
  write_checkpoints(tmp_path, state, (1, 2))
  before = listing(tmp_path)
  store = checkpoints_lib.Checkpoints(tmp_path)
  store.storage_retry_seconds = 0.001
  calls, waits = [], []
  monkeypatch.setattr(checkpoints_lib.time, 'sleep', waits.append)

  def failing_restore(*args, **kwargs):
    calls.append(args)
    raise failure
  monkeypatch.setattr(store.manager, 'restore', failing_restore)
  with pytest.raises(checkpoints_lib.CheckpointStorageError, match='checkpoint 2: storage error in 4 attempts'):
    store.restore_newest_good(checkpoints_lib.abstract_like(state))
  assert len(calls) == 4 and waits == [0.001, 0.002, 0.004]  # exponential backoff between the tries
  assert listing(tmp_path) == before
  store.close()


def test_a_storage_hiccup_is_retried_and_the_newest_restored(tmp_path, monkeypatch):
  state = fresh_state()
  write_checkpoints(tmp_path, state, (1, 2))
  store = checkpoints_lib.Checkpoints(tmp_path)
  monkeypatch.setattr(checkpoints_lib.time, 'sleep', lambda s: None)
  real_restore, failures = store.manager.restore, [OSError(errno.ETIMEDOUT, 'timed out')] * 2

  def flaky_restore(*args, **kwargs):
    if failures:
      raise failures.pop()
    return real_restore(*args, **kwargs)
  monkeypatch.setattr(store.manager, 'restore', flaky_restore)
  restored, _ = store.restore_newest_good(checkpoints_lib.abstract_like(state))
  assert int(restored.step) == 2 and not (tmp_path / 'corrupt_checkpoints').exists()
  store.close()


def test_clipping_leaves_the_optimizer_state_alone_and_still_clips(tmp_path):
  config = config_lib.base_config()
  plain, _ = ts.make_optimizer(config)
  config.grad_clip_norm = 1.0
  clipped, _ = ts.make_optimizer(config)
  write_checkpoints(tmp_path, fresh_state(optimizer=plain), (1,))
  with checkpoints_lib.Checkpoints(tmp_path) as store:
    restored, _ = store.restore_newest_good(checkpoints_lib.abstract_like(fresh_state(optimizer=clipped)))
  assert int(restored.step) == 1
  # The clipped update is Adam's update of the gradient scaled to norm 1 (checked against plain Adam).
  params = {'w': jnp.asarray([1.0, 2.0])}
  grads = {'w': jnp.asarray([30.0, -40.0])}  # norm 50
  by_clipped, _ = clipped.update(grads, clipped.init(params), params)
  by_plain, _ = plain.update({'w': grads['w'] / 50.0}, plain.init(params), params)
  np.testing.assert_allclose(by_clipped['w'], by_plain['w'], rtol=1e-6)
  # Adam's first update hides the scale of the gradient: the second one shows whether it was clipped.
  state_c, state_p = clipped.update(grads, clipped.init(params), params)[1], plain.init(params)
  state_p = plain.update({'w': grads['w'] / 50.0}, state_p, params)[1]
  second = {'w': jnp.asarray([0.3, 0.4])}  # norm 0.5: not clipped
  np.testing.assert_allclose(clipped.update(second, state_c, params)[0]['w'],
                             plain.update(second, state_p, params)[0]['w'], rtol=1e-6)


@pytest.mark.slow
def test_grad_clipping_can_be_switched_on_when_resuming(toy_corpus, tmp_path):
  """The NaN error's advice (--config.grad_clip_norm) leads somewhere that works: the same workdir resumes."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 6, 2, 100
  train.train_and_evaluate(config, tmp_path / 'w')
  args = cli_args(config, tmp_path / 'w') + ['--config.grad_clip_norm=1.0', '--config.num_train_steps=8']
  result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Starting at step 6 of 8' in result.stderr
  assert not (tmp_path / 'w' / 'corrupt_checkpoints').exists()
  assert checkpoints_lib.saved_steps(tmp_path / 'w') == [4, 6, 8]


@pytest.mark.slow
def test_a_replaced_vocabulary_stops_the_cli_with_every_checkpoint_in_place(toy_corpus, tmp_path):
  config = small_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 4, 2, 100
  workdir = tmp_path / 'w'
  train.train_and_evaluate(config, workdir)
  other = [line.upper() for line in (toy_corpus / 'train.en').read_text().splitlines()]
  (workdir / 'vocab.model').unlink()
  tokenizer_lib.train_sentencepiece(other + other, workdir / 'vocab.model', vocab_size=config.vocab_size)
  before = listing(workdir / 'checkpoints')
  result = subprocess.run(cli_args(config, workdir), cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('error: checkpoint 4 in') and 'vocabulary: vocab.model sha256' in last
  assert 'Traceback' not in result.stderr
  assert listing(workdir / 'checkpoints') == before and not (workdir / 'corrupt_checkpoints').exists()


def test_storage_full_during_a_save_leaves_the_previous_checkpoint_listed_and_restorable(tmp_path, monkeypatch):
  from orbax.checkpoint._src.path import async_path  # pylint: disable=g-import-not-at-top
  state = fresh_state()
  write_checkpoints(tmp_path, state, (1,))
  store = checkpoints_lib.Checkpoints(tmp_path, async_save=False)

  async def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(async_path, 'write_text', no_space)  # orbax's writes of small files (commit marker)
  # The storage's own error reaches the caller as it is (a bug elsewhere in the save would raise another).
  with pytest.raises(OSError, match='No space left on device') as raised:
    store.save(2, state.replace(step=jnp.asarray(2)), {'epoch': 0, 'batch': 2, 'seed': 0}, force=True)
    store.wait()
  assert type(raised.value) is OSError and raised.value.errno == errno.ENOSPC, repr(raised.value)
  monkeypatch.undo()
  store.close()
  store = checkpoints_lib.Checkpoints(tmp_path)
  assert store.steps() == [1]
  restored, _ = store.restore_newest_good(checkpoints_lib.abstract_like(state))
  assert int(restored.step) == 1 and not (tmp_path / 'corrupt_checkpoints').exists()
  store.close()


def test_a_run_on_rbg_keys_resumes_exactly_and_keeps_its_generator(toy_corpus, tmp_path):
  # Its checkpoints hold 4-word key data: the restore must expect that shape and go on with the same stream.
  config = small_config(toy_corpus)
  config.prng_impl, config.model.dropout_rate = 'rbg', 0.3
  config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 8, 4, 100
  train.train_and_evaluate(config, tmp_path / 'straight')
  first_half = config.copy_and_resolve_references()
  first_half.num_train_steps = 4
  train.train_and_evaluate(first_half, tmp_path / 'resumed')
  train.train_and_evaluate(config, tmp_path / 'resumed')
  for a, b in zip(jax.tree_util.tree_leaves(checkpoints_lib.saved_params(tmp_path / 'straight', 8)),
                  jax.tree_util.tree_leaves(checkpoints_lib.saved_params(tmp_path / 'resumed', 8))):
    np.testing.assert_array_equal(a, b)
  config.prng_impl = 'threefry2x32'
  with pytest.raises(workdir_lib.ConfigError, match=r"config.prng_impl='rbg', now 'threefry2x32'"):
    train.train_and_evaluate(config, tmp_path / 'resumed')


def test_a_checkpoint_without_trained_seconds_resumes_from_zero():
  # Checkpoints written before the data position recorded the training time hold no such entry.
  class Store:
    def restore_newest_good(self, abstract, vocab_sha256):
      del abstract, vocab_sha256
      return {'w': jnp.ones(2)}, {'epoch': 1, 'batch': 7, 'seed': 0}

  class Batches:
    def restore(self, data_state, allow_batching_change):
      del allow_batching_change
      self.data_state = data_state

  batches, config = Batches(), config_lib.base_config()
  tokenizer = tokenizer_lib.Tokenizer.__new__(tokenizer_lib.Tokenizer)
  tokenizer.sha256 = 'abc'
  state, seconds = train.restore_or_start(config, {'w': jnp.zeros(2)}, None, Store(), batches, tokenizer)
  assert seconds == 0.0 and batches.data_state == {'epoch': 1, 'batch': 7, 'seed': 0}
  np.testing.assert_array_equal(state['w'], [1.0, 1.0])


def test_a_step_damaged_a_second_time_is_set_aside_beside_the_first(tmp_path):
  """Wrong rule caught: setting aside used corrupt_checkpoints/STEP as it was, so a step damaged again after an
  earlier one of that step was set aside stopped the restart with FileExistsError."""
  state = fresh_state()
  write_checkpoints(tmp_path, state, (1,))
  for _ in range(2):
    directory = write_checkpoints(tmp_path, state, (2,))
    (directory / '2' / checkpoints_lib.COMMIT_MARKER).unlink()
    with checkpoints_lib.Checkpoints(tmp_path) as store:
      restored, _ = store.restore_newest_good(checkpoints_lib.abstract_like(state))
    assert int(restored.step) == 1
  assert sorted(p.name for p in (tmp_path / 'corrupt_checkpoints').iterdir()) == ['2', '2.1']


def test_a_refused_resume_leaves_config_json_as_it_was(toy_corpus, tmp_path):
  """Wrong rule caught: config.json was rewritten with the new settings before the checkpoint's data position
  refused them, so the error's advice (revert the field in config.json) found the refused value there. A
  resume that is accepted records its settings."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 2, 2, 100
  train.train_and_evaluate(config, tmp_path / 'w')
  recorded = (tmp_path / 'w' / 'config.json').read_text()
  config.seed, config.num_train_steps = 7, 3
  with pytest.raises(batching.BatchingError, match='config.seed=0, now 7'):
    train.train_and_evaluate(config, tmp_path / 'w')
  assert (tmp_path / 'w' / 'config.json').read_text() == recorded
  config.seed = 0
  train.train_and_evaluate(config, tmp_path / 'w')
  assert workdir_lib.load_config(tmp_path / 'w').num_train_steps == 3


def test_a_truncated_config_json_is_a_config_error_naming_the_file(tmp_path):
  """A config.json cut short (or edited by hand into invalid JSON) stops the resume with a ConfigError naming it,
  which the train command prints as one line, not a JSONDecodeError traceback."""
  workdir = tmp_path / 'w'
  workdir_lib.write_config(config_lib.base_config(), workdir)
  (workdir / 'vocab.model').write_bytes(b'')
  path = workdir / 'config.json'
  path.write_text(path.read_text()[:200])
  with pytest.raises(workdir_lib.ConfigError, match=f'{path} is not valid JSON'):
    workdir_lib.check_config(config_lib.base_config(), workdir)


def test_a_config_write_cut_short_leaves_the_previous_config_json_whole(tmp_path, monkeypatch):
  """config.json was written in place: a process killed (or a disk filled) mid-write left a truncated file that
  stopped every later resume, decode and export of the workdir."""
  workdir_lib.write_config(config_lib.base_config(), tmp_path)
  before = (tmp_path / 'config.json').read_text()
  path_type = type(workdir_lib.epath.Path(tmp_path))
  write_text = path_type.write_text

  def cut_short(path, text, *args, **kwargs):
    write_text(path, text[:100], *args, **kwargs)
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(path_type, 'write_text', cut_short)
  config = config_lib.base_config()
  config.num_train_steps = 7
  with pytest.raises(OSError):
    workdir_lib.write_config(config, tmp_path)
  monkeypatch.undo()
  assert (tmp_path / 'config.json').read_text() == before
  workdir_lib.write_config(config, tmp_path)
  assert workdir_lib.load_config(tmp_path).num_train_steps == 7


def test_a_new_peak_of_the_paper_schedule_is_a_schedule_change(tmp_path):
  """config.learning_rate_scale is the peak of the 'paper' schedule: resuming with another one changes the learning
  rate of the steps left, and is named among the schedule's changes as another inverse_sqrt peak is."""
  saved = config_lib.base_config()
  workdir_lib.write_config(saved, tmp_path)
  config = config_lib.base_config()
  config.learning_rate_scale = 0.5
  assert workdir_lib.schedule_changes(config, tmp_path) == [('learning_rate_scale', 1.0, 0.5)]


@pytest.mark.parametrize('schedule', config_lib.SCHEDULES)
def test_every_field_that_moves_the_learning_rate_is_named_as_a_schedule_change(tmp_path, schedule):
  """Each top-level field, changed alone on resume: where the learning rate the trainer computes (make_schedule)
  moves at some step, schedule_changes names that field (a resume with another warmup, cooldown or schedule said
  nothing when one was left out)."""
  saved = config_lib.base_config()
  saved.learning_rate_schedule, saved.learning_rate, saved.num_train_steps = schedule, 1e-3, 1000
  saved.warmup_steps, saved.cooldown_steps = 50, 100
  workdir_lib.write_config(saved, tmp_path)
  steps = np.arange(0, 1000, 7)
  before = np.asarray(ts.make_schedule(saved)(steps))
  moved = []
  for field, value in saved.items():
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
      continue
    config = saved.copy_and_resolve_references()
    if field == 'learning_rate_schedule':
      config[field] = next(other for other in config_lib.SCHEDULES if other != schedule)
    elif isinstance(value, str):
      continue
    else:
      config[field] = value * 2 if value else type(value)(1)
    if not np.allclose(np.asarray(ts.make_schedule(config)(steps)), before, rtol=1e-6, atol=0):
      moved.append(field)
      assert field in [name for name, _, _ in workdir_lib.schedule_changes(config, tmp_path)], field
  assert {'warmup_steps', 'cooldown_steps', 'num_train_steps', 'learning_rate_schedule'} <= set(moved)


def truncate_arrays(checkpoint_directory):
  for path in checkpoint_directory.rglob('*'):
    if path.is_file() and 'ocdbt.process' in str(path):
      path.write_bytes(path.read_bytes()[:10])


def test_a_damaged_checkpoint_in_the_final_average_is_named_and_the_run_still_finished(
    toy_corpus, tmp_path, monkeypatch):
  """Wrong rule caught: the trainer's final average read a damaged checkpoint with orbax's own error (a
  ValueError traceback out of `train`) and finished.json was never written, so every rerun ended the same way.
  Now the error names the checkpoint and the command that averages others, and the run is marked finished."""
  config = small_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps, config.keep_checkpoints = 4, 2, 10
  config.average_last_checkpoints, config.eval_every_steps, config.log_every_steps = 2, 1000, 1000
  workdir = tmp_path / 'run'
  read = checkpoints_lib.saved_params

  def damaged_first(workdir_, step):  # checkpoint 2 turns out damaged when the average reads it
    if step == 2:
      truncate_arrays(pathlib.Path(checkpoints_lib.state_directory(workdir_, step)))
    return read(workdir_, step)
  monkeypatch.setattr(checkpoints_lib, 'saved_params', damaged_first)
  with pytest.raises(checkpoints_lib.AveragingError,
                     match=rf'checkpoint 2 in {workdir}/checkpoints cannot be read \(ValueError: OUT_OF_RANGE.*'
                           rf'flaxformer_nmt.average --workdir {workdir} --steps'):
    train.train_and_evaluate(config, workdir)
  assert json.loads((workdir / 'finished.json').read_text())['step'] == 4
  assert not (workdir / 'averaged').exists()
