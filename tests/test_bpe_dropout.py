"""BPE-dropout (config.bpe_dropout): other pieces of the same sentences every epoch, a function of (seed, epoch)."""
import collections

import numpy as np
import pytest

from conftest import small_config, write_toy_corpus
from flaxformer_nmt.data import batching
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.data import corpus as data
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.training import loop as train


class Pairs:
  """The corpora.* interface sample_segmentation reads the text through."""

  def __init__(self, source, target):
    self.source, self.target = source, target

  def __len__(self):
    return len(self.source)

  def read(self, indices):
    return [self.source[i] for i in indices], [self.target[i] for i in indices]


@pytest.fixture(scope='module')
def toy(tmp_path_factory):
  """(tokenizer, pairs, deterministic corpus) of the toy corpus's training split, a 64-piece BPE vocabulary."""
  directory = write_toy_corpus(tmp_path_factory.mktemp('data'))
  source = (directory / 'train.en').read_text().splitlines()
  target = (directory / 'train.de').read_text().splitlines()
  path = tokenizer_lib.train_sentencepiece(source + target, tmp_path_factory.mktemp('vocab') / 'vocab.model',
                                           vocab_size=64)
  tokenizer = tokenizer_lib.Tokenizer(path)
  return tokenizer, Pairs(source, target), data.tokenize(source, target, tokenizer)


def test_dropout_one_gives_characters_and_a_small_rate_other_pieces_of_the_same_text(toy):
  tokenizer, pairs, _ = toy
  lines = pairs.target[:50]
  deterministic = tokenizer.encode(lines)
  # Every merge skipped: one character per piece (sentencepiece's word-boundary mark is a character too).
  for ids in tokenizer.encode_sampled(lines, 1.0, seed=3):
    assert ids[-1] == tokenizer_lib.EOS_ID
    assert all(len(piece) == 1 for piece in tokenizer.pieces(ids[:-1])), tokenizer.pieces(ids)
  sampled = tokenizer.encode_sampled(lines, 0.1, seed=3)
  assert [tokenizer.decode(ids) for ids in sampled] == [tokenizer.decode(ids) for ids in deterministic]
  assert [' '.join(line.split()) for line in lines] == [tokenizer.decode(ids) for ids in sampled]
  changed = sum(a != b for a, b in zip(sampled, deterministic))
  assert 0 < changed < len(lines)  # a 10% rate splits some sentences, not all
  assert sum(map(len, sampled)) > sum(map(len, deterministic))
  assert tokenizer.encode_sampled(lines, 0.0, seed=3) == deterministic


def test_the_same_seed_samples_the_same_pieces_within_a_process_but_not_across(toy):
  tokenizer, pairs, _ = toy
  lines = pairs.target[:100]
  first = tokenizer.encode_sampled(lines, 0.2, seed=11)
  assert tokenizer.encode_sampled(lines, 0.2, seed=12) != first
  # Again after another seed was used: sentencepiece keeps a generator per thread, seeded only once.
  assert tokenizer.encode_sampled(lines, 0.2, seed=11) == first


def test_an_epochs_sample_is_saved_once_and_read_back_by_later_runs_and_other_hosts(toy, tmp_path):
  tokenizer, pairs, corpus = toy
  examples = corpus.usable(32)
  calls = []

  def sample(epoch):
    calls.append(epoch)
    return data.sample_segmentation(corpus, pairs, tokenizer, dropout=0.2, seed=0, epoch=epoch,
                                    examples=examples, max_length=32)

  fingerprint = {'bpe_dropout': 0.2, 'vocabulary_sha256': tokenizer.sha256}
  leader = data.SavedSegmentations(tmp_path / 's', sample, fingerprint=fingerprint, keep_epochs=2)
  epochs = [leader(e) for e in range(3)]
  assert calls == [0, 1, 2]
  assert sorted(p.name for p in (tmp_path / 's').iterdir()) == ['epoch_000001.npz', 'epoch_000002.npz']
  refuse = lambda epoch: pytest.fail(f'epoch {epoch} sampled again')
  for reader in (data.SavedSegmentations(tmp_path / 's', refuse, fingerprint=fingerprint),  # a resumed run
                 data.SavedSegmentations(tmp_path / 's', refuse, fingerprint=fingerprint, is_leader=False)):
    for epoch in (1, 2):
      for side in ('source', 'target'):
        np.testing.assert_array_equal(getattr(reader(epoch), side).tokens, getattr(epochs[epoch], side).tokens)
        np.testing.assert_array_equal(getattr(reader(epoch), side).offsets, getattr(epochs[epoch], side).offsets)
  # Another host waits for process 0's file; one that never comes is an error naming it.
  waiting = data.SavedSegmentations(tmp_path / 's', refuse, fingerprint=fingerprint, is_leader=False,
                                    wait_seconds=0.2)
  with pytest.raises(data.DataError, match='epoch_000003.npz'):
    waiting(3)
  # Settings of another run (here another dropout) never read this one's samples.
  other = data.SavedSegmentations(tmp_path / 's', sample, fingerprint={**fingerprint, 'bpe_dropout': 0.3})
  other(2)
  assert calls == [0, 1, 2, 2]


def row_sentences(row):
  """The sentences of one batch row (one, or several packed), each up to and without its EOS."""
  tokens = [int(t) for t in row if t != tokenizer_lib.PAD_ID]
  sentences, current = [], []
  for t in tokens:
    if t == tokenizer_lib.EOS_ID:
      sentences.append(current)
      current = []
    else:
      current.append(t)
  assert not current, 'a sentence without its EOS'
  return sentences


def make_batches(toy, dropout, packed_length, directory=None, sample=None, max_length=32):
  """TrainBatches over the toy corpus; with dropout, each epoch's sample saved in `directory`."""
  tokenizer, pairs, corpus = toy
  examples = corpus.usable(max_length)
  resegment = None
  if dropout:
    sample = sample or (lambda epoch: data.sample_segmentation(
        corpus, pairs, tokenizer, dropout=dropout, seed=5, epoch=epoch, examples=examples, max_length=max_length))
    resegment = data.SavedSegmentations(directory, sample, fingerprint={'bpe_dropout': dropout})
  return batching.TrainBatches(corpus, examples=examples, tokens_per_batch=256, buckets=(16, 32), seed=5, prefetch=0,
                           packed_length=packed_length, max_length=max_length, bpe_dropout=dropout,
                           resegment=resegment)


@pytest.mark.parametrize('packed_length', [0, 32])
def test_each_epoch_trains_every_pair_once_in_its_own_pieces_and_resumes_exactly(toy, packed_length, tmp_path):
  tokenizer, pairs, corpus = toy
  batches = make_batches(toy, 0.2, packed_length, tmp_path)
  epoch0 = [next(batches) for _ in range(batches.batches_per_epoch())]
  epoch1 = [next(batches)]
  saved = batches.state()
  assert (saved['epoch'], saved['batch']) == (1, 1)
  epoch1 += [next(batches) for _ in range(len(batches.plan(1)) - 1)]

  text = lambda ids: tokenizer.decode(list(ids) + [tokenizer_lib.EOS_ID])
  expected = collections.Counter((pairs.source[i], pairs.target[i]) for i in corpus.usable(32))
  by_text = lambda sentences: {(text(s), text(t)): (s, t) for s, t in sentences}
  epochs = [batch_sentences(epoch0), batch_sentences(epoch1)]
  for sentences in epochs:
    # Every usable pair once, its text intact, within the length limit on both sides (EOS included).
    assert collections.Counter((text(s), text(t)) for s, t in sentences) == expected
    assert max(max(len(s), len(t)) + 1 for s, t in sentences) <= 32
  plain = make_batches(toy, 0.0, packed_length)
  deterministic = by_text(batch_sentences([next(plain) for _ in range(plain.batches_per_epoch())]))
  differs = lambda a, b: sum(a[k] != b[k] for k in a)
  assert differs(by_text(epochs[0]), deterministic) > len(expected) // 4
  assert differs(by_text(epochs[0]), by_text(epochs[1])) > len(expected) // 4  # each epoch its own pieces

  # A resumed run's iterator at (epoch 1, batch 1) reads epoch 1's saved sample.
  resumed = make_batches(toy, 0.2, packed_length, tmp_path, sample=lambda e: pytest.fail(f'epoch {e} sampled'))
  resumed.restore(saved)
  for expected_batch in epoch1[1:]:
    batch = next(resumed)
    for key in expected_batch:
      np.testing.assert_array_equal(batch[key], expected_batch[key])


def batch_sentences(batches):
  """The (source ids, target ids) tuples of every row of `batches`."""
  pairs = []
  for batch in batches:
    for src_row, tgt_row in zip(batch['src'], batch['tgt_out']):
      src, tgt = row_sentences(src_row), row_sentences(tgt_row)
      assert len(src) == len(tgt)
      pairs += zip(map(tuple, src), map(tuple, tgt))
  return pairs


def test_pairs_sampled_past_the_length_limit_keep_their_deterministic_pieces(toy):
  tokenizer, pairs, corpus = toy
  examples = corpus.usable(32)
  limit = int(corpus.lengths()[examples].max())
  # Dropout 1 spells every sentence in characters, which only the short ones fit in `limit` tokens.
  sampled = data.sample_segmentation(corpus, pairs, tokenizer, dropout=1.0, seed=0, epoch=0, examples=examples,
                                     max_length=limit)
  spelled, kept = 0, 0
  for i in examples:
    src, tgt = list(sampled.source[i]), list(sampled.target[i])
    characters = [len(''.join(pairs.source[i].split())) + len(pairs.source[i].split()),
                  len(''.join(pairs.target[i].split())) + len(pairs.target[i].split())]
    if max(characters) + 1 <= limit:  # + EOS
      assert [len(src) - 1, len(tgt) - 1] == characters
      spelled += 1
    else:
      assert (src, tgt) == (list(corpus.source[i]), list(corpus.target[i]))
      kept += 1
  assert spelled and kept


def test_a_resume_with_another_bpe_dropout_is_refused_by_name(toy, tmp_path):
  saved = make_batches(toy, 0.1, 0, tmp_path).state()
  with pytest.raises(batching.BatchingError, match='config.bpe_dropout was 0.1, now 0.0'):
    make_batches(toy, 0.0, 0).restore(saved)


@pytest.mark.parametrize('override, message', [
    (dict(bpe_dropout=1.5), 'is a probability'),
    (dict(bpe_dropout=0.1, sentencepiece_model_type='unigram'), "sentencepiece_model_type='bpe'"),
    (dict(bpe_dropout=0.1, task='lm'), "task 'lm'"),
])
def test_bad_bpe_dropout_settings_are_named(tmp_path, override, message):
  config = small_config(tmp_path)
  config.update(override)
  with pytest.raises(config_lib.ConfigError, match=f'config.bpe_dropout=.*{message}'):
    config_lib.validate(config)


def test_training_with_bpe_dropout_resegments_every_epoch(toy_corpus, tmp_path, caplog):
  config = small_config(toy_corpus)
  config.bpe_dropout, config.num_train_steps, config.eval_every_steps = 0.1, 8, 8
  caplog.set_level('INFO')
  train.train_and_evaluate(config, tmp_path / 'run')
  lines = [r.getMessage() for r in caplog.records if 'BPE-dropout 0.10 resegmented' in r.getMessage()]
  assert lines and lines[0].startswith('Epoch 0:')
  assert (tmp_path / 'run' / 'tokenized' / 'train_bpe_dropout' / 'epoch_000000.npz').exists()


def test_validation_batches_keep_the_deterministic_pieces_under_bpe_dropout(toy_corpus, tmp_path):
  """BPE-dropout segments training pairs only: with config.bpe_dropout=1 (every sentence in characters) the
  validation batches hold the validation text's deterministic encoding, pair for pair."""
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  config = small_config(toy_corpus)
  config.bpe_dropout, config.prefetch_batches = 1.0, 0
  train_batches, eval_batches, tokenizer = pipeline.input_pipeline(config, tmp_path / 'work', num_devices=1)
  train_batches.close()
  encode = lambda lang: tokenizer.encode(data.read_lines(toy_corpus / f'valid.{lang}'))
  expected = sorted((tuple(s), tuple(t)) for s, t in zip(encode('en'), encode('de'))
                    if max(len(s), len(t)) <= config.model.max_position)
  got = sorted(pair for batch in eval_batches() for pair in batch_sentences([batch]))
  assert got == [(s[:-1], t[:-1]) for s, t in expected]
