"""Exact resume on another machine: the global batches do not depend on the devices, hosts or gradient
accumulation; a data position saved with other batching settings is refused (or, when allowed, continued in
the same epoch with a warning)."""
import json
import logging
import os
import subprocess

import jax
import numpy as np
import pytest

from conftest import small_config, subprocess_env, xla_flags_without_device_count
from test_resilience import cli_args
from flaxformer_nmt.data import batching
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.tokenizer import EOS_ID, PAD_ID
from flaxformer_nmt.training import loop as train

BUCKETS = (8, 16, 32, 48)


def numbered_corpus(lengths):
  """Example i is the token 100 + i repeated (then EOS): every row says which example it holds."""
  source = [[100 + i] * (n - 1) + [EOS_ID] for i, n in enumerate(lengths)]
  target = [[100 + i] * (n - 1) + [EOS_ID] for i, n in enumerate(lengths)]
  return data_lib.TokenizedCorpus.from_lists(source, target)


def global_rows(hosts_batches):
  """The non-empty rows of a global batch (the hosts' rows in process order), as example numbers."""
  src = np.concatenate([b['src'] for b in hosts_batches])
  assert all(b['src'].shape == hosts_batches[0]['src'].shape for b in hosts_batches)
  return [int(row[0]) - 100 for row in src if (row != PAD_ID).any()], src.shape


@pytest.mark.parametrize('packed_length', [0, 32])
def test_global_batches_are_the_same_for_any_devices_hosts_and_accumulation(packed_length):
  corpus = numbered_corpus(np.random.default_rng(0).integers(2, 30, size=300))
  make = lambda pad_rows_to, p=0, hosts=1: batching.TrainBatches(
      corpus, tokens_per_batch=200, buckets=BUCKETS, seed=3, pad_rows_to=pad_rows_to, process_index=p,
      process_count=hosts, prefetch=0, packed_length=packed_length)
  reference = make(1)
  steps = reference.batches_per_epoch() + 5  # into the second epoch
  expected = []
  for _ in range(steps):
    held = global_rows([next(reference)])[0]
    planned = reference.plan(reference.epoch)[reference.batch - 1][1]  # the rows the batch was planned with
    expected.append((held, planned))
  # 3 devices, 8 devices x 2 microbatches, 2 hosts of 2 devices, 4 hosts of 1 device x 3 microbatches.
  for pad_rows_to, hosts in ((3, 1), (16, 1), (4, 2), (12, 4)):
    iterators = [make(pad_rows_to, p, hosts) for p in range(hosts)]
    for want, planned in expected:
      got, (rows, _) = global_rows([next(it) for it in iterators])
      assert got == want
      assert rows % pad_rows_to == 0  # every device (and microbatch) gets the same number of rows
      # ... and no more empty rows than that takes: a full set of them added to a batch that divided already
      # (pad_rows_to more rows of wasted compute) is caught here.
      assert planned <= rows < planned + pad_rows_to, (planned, rows, pad_rows_to)


def test_a_changed_batching_is_refused_naming_the_setting_or_continued_in_the_same_epoch_when_allowed(caplog):
  corpus = numbered_corpus(np.random.default_rng(1).integers(2, 30, size=300))
  make = lambda **kw: batching.TrainBatches(corpus, **{**dict(tokens_per_batch=200, buckets=BUCKETS, seed=3,
                                                              prefetch=0, max_length=64), **kw})
  first = make()
  for _ in range(first.batches_per_epoch() + 4):
    next(first)
  state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
  assert state['epoch'] == 1 and state['batch'] == 4
  # Another device count or accumulation (the layout) resumes where it was, with the same batches.
  moved = make(pad_rows_to=4)
  moved.restore(state)
  assert (moved.epoch, moved.batch) == (1, 4)
  for change, field in ((dict(tokens_per_batch=400), 'config.tokens_per_batch was 200, now 400'),
                        (dict(buckets=(8, 16, 48)), 'config.length_buckets was [8, 16, 32, 48], now [8, 16, 48]'),
                        (dict(max_length=32), 'config.max_length was 64, now 32'),
                        (dict(multiple_of=8), 'config.batch_rows_multiple was 1, now 8')):
    with pytest.raises(batching.BatchingError, match=field.replace('[', r'\[').replace(']', r'\]')):
      make(**change).restore(state)
  with pytest.raises(batching.BatchingError, match='config.seed=3, now 4'):
    make(seed=4).restore(state)
  # Another training set of as many examples (edited text): its own plan, so refused too (a count alone let it in).
  edited = numbered_corpus(np.random.default_rng(2).integers(2, 30, size=300))
  with pytest.raises(batching.BatchingError, match='training_lengths was'):
    batching.TrainBatches(edited, tokens_per_batch=200, buckets=BUCKETS, seed=3, prefetch=0,
                          max_length=64).restore(state)
  # A position saved before a field was recorded is compared on the fields it has.
  older = json.loads(json.dumps(state))
  del older['batching']['training_lengths']
  make().restore(older)
  # Allowed: the same epoch, at the same fraction of it (4 of the old epoch's batches), with a warning.
  doubled = make(tokens_per_batch=400)
  with caplog.at_level(logging.WARNING):
    doubled.restore(state, allow_batching_change=True)
  assert doubled.epoch == 1
  assert doubled.batch == round(4 / state['batches_in_epoch'] * doubled.batches_per_epoch())
  assert any('Batching changed (config.tokens_per_batch was 200, now 400' in r.getMessage() for r in caplog.records)


def test_a_packed_position_is_refused_for_a_training_set_with_other_side_lengths():
  # An edit that lengthens targets still shorter than their sources keeps every pair's longer side, but packed
  # rows are filled by each side: the plan moves, and a resume into it would skip and repeat examples.
  rng = np.random.default_rng(4)
  src, tgt = rng.integers(2, 20, size=200), rng.integers(2, 20, size=200)
  edited_tgt = np.where(tgt < src - 3, tgt + 3, tgt)
  assert (np.maximum(src, tgt) == np.maximum(src, edited_tgt)).all() and (tgt != edited_tgt).any()
  corpus = lambda tgt: data_lib.TokenizedCorpus.from_lists([[5] * (n - 1) + [EOS_ID] for n in src],
                                                           [[6] * (n - 1) + [EOS_ID] for n in tgt])
  make = lambda c, packed_length: batching.TrainBatches(c, tokens_per_batch=256, buckets=(8, 16, 32), seed=1,
                                                        prefetch=0, packed_length=packed_length)
  rows = lambda b: [[r.tolist() for r in members] for _, _, members in b.plan(0)]
  first, edited = make(corpus(tgt), 32), make(corpus(edited_tgt), 32)
  assert rows(first) != rows(edited)
  next(first)
  state = json.loads(json.dumps(first.state()))
  with pytest.raises(batching.BatchingError, match='training_side_lengths was'):
    edited.restore(state)
  make(corpus(tgt), 32).restore(state)
  # Unpacked batches are planned from the longer side alone: the edited set resumes into the same batches.
  unpacked = make(corpus(tgt), 0)
  next(unpacked)
  edited = make(corpus(edited_tgt), 0)
  assert [b.tolist() for _, _, b in edited.plan(0)] == [b.tolist() for _, _, b in unpacked.plan(0)]
  edited.restore(json.loads(json.dumps(unpacked.state())))


def resume_config(toy_corpus):
  config = small_config(toy_corpus)
  config.num_train_steps = 12
  config.log_every_steps = 1
  config.checkpoint_every_steps = 6
  config.eval_every_steps = 1000
  config.prefetch_batches = 0
  return config


def logged_losses(workdir):
  lines = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return {m['step']: m['train/loss'] for m in lines if 'train/loss' in m}


def test_the_trainer_split_over_cpu_devices_logs_the_one_device_losses(toy_corpus, tmp_path):
  """`--config.cpu_devices=2`: the command trains on two CPU devices, each step's rows split between them, and
  logs the losses of the one-device run (dropout on: the masks do not depend on the split)."""
  config = resume_config(toy_corpus)
  config.num_train_steps = 4
  assert config.model.dropout_rate > 0
  one, two = tmp_path / 'one', tmp_path / 'two'
  train.train_and_evaluate(config, one)
  config.cpu_devices = 2
  env = subprocess_env(XLA_FLAGS=xla_flags_without_device_count(), JAX_PLATFORMS='cpu')
  result = subprocess.run(cli_args(config, two), env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Host CPU split into 2 devices' in result.stderr and 'over 2 devices' in result.stderr
  want, got = logged_losses(one), logged_losses(two)
  assert sorted(got) == sorted(want) == [1, 2, 3, 4]
  np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)], rtol=2e-5)


@pytest.mark.slow
def test_resuming_on_three_devices_continues_the_one_device_run(toy_corpus, tmp_path):
  """6 steps on 1 device, then steps 7..12 on 3 virtual devices (batches of 16 or 32 rows padded to 18 or 33),
  against 12 steps on 1 device: the same loss at every step and the same parameters, to reduction order."""
  config = resume_config(toy_corpus)
  straight, moved = tmp_path / 'straight', tmp_path / 'moved'
  train.train_and_evaluate(config, straight)
  config.num_train_steps = 6
  train.train_and_evaluate(config, moved)
  config.num_train_steps = 12
  env = subprocess_env(XLA_FLAGS=os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=3',
                       JAX_PLATFORMS='cpu')
  result = subprocess.run(cli_args(config, moved), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'over 3 devices' in result.stderr and 'Starting at step 6' in result.stderr
  want, got = logged_losses(straight), logged_losses(moved)
  assert sorted(got) == sorted(want) == list(range(1, 13))
  np.testing.assert_allclose([got[s] for s in range(7, 13)], [want[s] for s in range(7, 13)], rtol=2e-5)
  load = lambda w: checkpoints_lib.saved_params(w, 12)
  for a, b in zip(jax.tree_util.tree_leaves(load(moved)), jax.tree_util.tree_leaves(load(straight))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_changed_token_budget_stops_the_resume_unless_allowed(toy_corpus, tmp_path, caplog, checkpoint_closes):
  config = resume_config(toy_corpus)
  config.num_train_steps = 3
  config.checkpoint_every_steps = 3
  workdir = tmp_path / 'w'
  train.train_and_evaluate(config, workdir)
  config.num_train_steps = 5
  config.tokens_per_batch = 1024
  closes_before = len(checkpoint_closes)
  with pytest.raises(batching.BatchingError, match='config.tokens_per_batch was 512, now 1024'):
    train.train_and_evaluate(config, workdir)
  assert len(checkpoint_closes) == closes_before + 1  # the refusal closed the checkpoint manager it had opened
  assert checkpoints_lib.saved_steps(workdir) == [3]  # nothing trained, nothing lost
  config.allow_batching_change = True
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, workdir)
  assert any('Batching changed (config.tokens_per_batch was 512, now 1024' in r.getMessage() for r in caplog.records)
  assert checkpoints_lib.saved_steps(workdir)[-1] == 5


def test_resuming_with_another_schedule_is_said(toy_corpus, tmp_path, caplog):
  """Extending a finished run (more num_train_steps) recomputes the cooldown: the learning rate of the steps left
  jumps, which the rerun did silently."""
  config = resume_config(toy_corpus)
  config.num_train_steps, config.checkpoint_every_steps = 3, 3
  workdir = tmp_path / 'w'
  train.train_and_evaluate(config, workdir)
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, workdir)  # the same schedule: nothing to say
  assert not any('another schedule' in r.getMessage() for r in caplog.records)
  config.num_train_steps = 5
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, workdir)
  assert any('Resuming with another schedule (config.num_train_steps 3 -> 5)' in r.getMessage()
             for r in caplog.records)
  assert checkpoints_lib.saved_steps(workdir)[-1] == 5
