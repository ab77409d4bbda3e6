"""Reading, checking, tokenizing and batching parallel text."""
import numpy as np
import pytest

from flaxformer_nmt import data as data_lib
from flaxformer_nmt import tokenizer as tokenizer_lib
from flaxformer_nmt.tokenizer import BOS_ID, EOS_ID, PAD_ID


def test_whitespace_is_normalized(tmp_path):
  path = tmp_path / 'x.de'
  path.write_text('Ein\u00a0Mann  l\u00e4uft.\t \nZwei\tHunde \n', encoding='utf-8')
  assert data_lib.read_lines(path) == ['Ein Mann l\u00e4uft.', 'Zwei Hunde']


@pytest.mark.parametrize('src, tgt, message', [
    ('a\nb\n', 'x\n', 'has 2 lines but'),
    ('', '', 'is empty'),
])
def test_misaligned_or_empty_files_are_named(tmp_path, src, tgt, message):
  (tmp_path / 'train.en').write_text(src)
  (tmp_path / 'train.de').write_text(tgt)
  with pytest.raises(data_lib.DataError, match=message) as e:
    data_lib.read_parallel(tmp_path, 'train', 'en', 'de')
  assert 'train.en' in str(e.value)


def test_one_sided_empty_and_overlong_lines_are_named_or_skipped(tmp_path):
  (tmp_path / 'train.en').write_text('a dog\n\nthe cat\n' + 'x' * 50 + '\nfine\n')
  (tmp_path / 'train.de').write_text('ein hund\n\n\nkurz\ngut\n')
  with pytest.raises(data_lib.DataError, match=r'train.de:3: empty line while .*train.en:3 has text'):
    data_lib.read_parallel(tmp_path, 'train', 'en', 'de')
  (tmp_path / 'train.de').write_text('ein hund\n\ndie katze\nkurz\ngut\n')
  with pytest.raises(data_lib.DataError, match=r'train.en:4: line of 50 characters'):
    data_lib.read_parallel(tmp_path, 'train', 'en', 'de', max_line_chars=40)
  src, tgt = data_lib.read_parallel(tmp_path, 'train', 'en', 'de', max_line_chars=40, skip_bad_pairs=True)
  assert src == ['a dog', 'the cat', 'fine'] and tgt == ['ein hund', 'die katze', 'gut']


def test_invalid_utf8_names_file_and_line(tmp_path):
  (tmp_path / 'train.en').write_bytes(b'fine\nbad \xff byte\n')
  with pytest.raises(data_lib.DataError, match=r'train.en:2: invalid UTF-8'):
    data_lib.read_lines(tmp_path / 'train.en')


def test_missing_file_is_named(tmp_path):
  with pytest.raises(data_lib.DataError, match=r'train.en: file not found'):
    data_lib.read_parallel(tmp_path, 'train', 'en', 'de')


def test_tokenizer_round_trip_and_reserved_ids(toy_corpus, tmp_path):
  lines = data_lib.read_lines(toy_corpus / 'train.en') + data_lib.read_lines(toy_corpus / 'train.de')
  tokenizer = tokenizer_lib.load_or_train(tmp_path / 'work', lambda: lines, vocab_size=64)
  assert (tmp_path / 'work' / 'vocab.model').exists()
  ids = tokenizer.encode(['a big dog runs .'])[0]
  assert ids[-1] == EOS_ID and min(ids[:-1]) > EOS_ID
  assert tokenizer.decode(ids + [7, 8]) == 'a big dog runs .'
  # A second call reuses the stored model instead of training again.
  again = tokenizer_lib.load_or_train(tmp_path / 'work', lambda: pytest.fail('retrained'), vocab_size=64)
  assert again.encode(['a big dog runs .'])[0] == ids


def corpus_of_lengths(lengths):
  source = [[5] * (n - 1) + [EOS_ID] for n in lengths]
  target = [[6] * (n - 1) + [EOS_ID] for n in lengths]
  return data_lib.TokenizedCorpus(source, target, np.arange(len(lengths)))


def test_batches_respect_the_token_budget_and_shift_targets():
  rng = np.random.default_rng(0)
  corpus = corpus_of_lengths(rng.integers(2, 40, size=500))
  batches = data_lib.TrainBatches(corpus, tokens_per_batch=256, buckets=(8, 16, 32, 48), seed=1)
  seen = 0
  for _ in range(batches.batches_per_epoch()):
    batch = next(batches)
    rows, length = batch['src'].shape
    assert rows * length <= 256 and length in (8, 16, 32, 48)
    real = batch['tgt_out'] != PAD_ID
    seen += int(real.any(axis=1).sum())
    # tgt_in is BOS followed by tgt_out shifted right, on real rows.
    for r in np.flatnonzero(real.any(axis=1)):
      n = int(real[r].sum())
      assert batch['tgt_in'][r, 0] == BOS_ID
      np.testing.assert_array_equal(batch['tgt_in'][r, 1:n], batch['tgt_out'][r, :n - 1])
      assert batch['tgt_out'][r, n - 1] == EOS_ID
  assert seen == 500  # every example exactly once per epoch
  assert batches.epoch == 0 and batches.batch == batches.batches_per_epoch()


def test_epochs_are_shuffled_differently_and_reproducibly():
  corpus = corpus_of_lengths(np.random.default_rng(0).integers(2, 40, size=300))
  a = data_lib.TrainBatches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48), seed=3)
  b = data_lib.TrainBatches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48), seed=3)
  first = [a.plan(0)[i][2] for i in range(5)]
  assert first == [b.plan(0)[i][2] for i in range(5)]
  assert first != [a.plan(1)[i][2] for i in range(5)]


def test_iterator_resumes_exactly_from_a_saved_position():
  corpus = corpus_of_lengths(np.random.default_rng(0).integers(2, 40, size=200))
  make = lambda: data_lib.TrainBatches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48), seed=7)
  uninterrupted = make()
  reference = [next(uninterrupted) for _ in range(60)]  # crosses an epoch boundary
  first = make()
  for _ in range(37):
    next(first)
  resumed = make()
  resumed.restore(first.state())
  for expected in reference[37:]:
    got = next(resumed)
    for key in expected:
      np.testing.assert_array_equal(got[key], expected[key])


def test_eval_batches_cover_everything_once_in_a_fixed_order():
  corpus = corpus_of_lengths(np.random.default_rng(0).integers(2, 40, size=100))
  runs = [list(data_lib.eval_batches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48))) for _ in range(2)]
  assert sum(int((b['src'] != PAD_ID).any(axis=1).sum()) for b in runs[0]) == 100
  for x, y in zip(*runs):
    np.testing.assert_array_equal(x['src'], y['src'])


def test_length_filter_drops_long_and_empty_pairs(toy_corpus, tmp_path):
  lines = data_lib.read_lines(toy_corpus / 'train.en') + data_lib.read_lines(toy_corpus / 'train.de')
  tokenizer = tokenizer_lib.load_or_train(tmp_path / 'work', lambda: lines, vocab_size=64)
  src = ['a dog', '', 'a dog ' * 50, 'the cat']
  tgt = ['ein hund', 'leer', 'ein hund ' * 50, '']
  corpus = data_lib.tokenize_parallel(src, tgt, tokenizer, max_length=20)
  assert list(corpus.line_numbers) == [0]
