"""Reading, checking, tokenizing and batching parallel text."""
import threading

import numpy as np
import pytest

from flaxformer_nmt.data import batching
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID


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
  src, tgt, lines, num_lines = data_lib.read_parallel(tmp_path, 'train', 'en', 'de', max_line_chars=40,
                                                     skip_bad_pairs=True)
  assert src == ['a dog', '', 'the cat', 'fine'] and tgt == ['ein hund', '', 'die katze', 'gut']
  assert lines == [0, 1, 2, 4] and num_lines == 5


def test_a_pair_empty_on_both_sides_keeps_its_line_and_is_not_trained_on(tmp_path):
  # Validation reads its references (and the tokenized ones of another directory) by line number: pair i must
  # be line i of both files, a blank pair included.
  (tmp_path / 'valid.en').write_text('A dog.\n\nTwo cats.\n \t\nThe end.\n')
  (tmp_path / 'valid.de').write_text('Ein Hund.\n\nZwei Katzen.\n\nDas Ende.\n')
  src, tgt, _, _ = data_lib.read_parallel(tmp_path, 'valid', 'en', 'de')
  expected = [[line.strip() for line in (tmp_path / f'valid.{lang}').read_text().split('\n')[:-1]]
              for lang in ('en', 'de')]
  assert [src, tgt] == expected

  class Characters:
    def encode(self, lines, num_threads=0):
      return [[ord(c) for c in line] + [EOS_ID] for line in lines]

  corpus = data_lib.tokenize(src, tgt, Characters())
  assert corpus.usable().tolist() == [i for i, line in enumerate(expected[0]) if line]


@pytest.mark.parametrize('en, de, message', [(50, 60, r'train\.de:1: line of 60 characters'),
                                              (60, 50, r'train\.en:1: line of 60 characters')])
def test_a_pair_overlong_on_both_sides_names_the_longer_line_and_its_length(tmp_path, en, de, message):
  (tmp_path / 'train.en').write_text('x' * en + '\n')
  (tmp_path / 'train.de').write_text('y' * de + '\n')
  with pytest.raises(data_lib.DataError, match=message):
    data_lib.read_parallel(tmp_path, 'train', 'en', 'de', max_line_chars=40)


def test_invalid_utf8_names_file_and_line(tmp_path):
  (tmp_path / 'train.en').write_bytes(b'fine\nbad \xff byte\n')
  with pytest.raises(data_lib.DataError, match=r'train.en:2: invalid UTF-8'):
    data_lib.read_lines(tmp_path / 'train.en')


def test_a_byte_order_mark_is_not_text(tmp_path):
  # Catches a byte order mark (some editors write one first) kept on the first line: a reference's first word
  # then never matches its hypothesis. Only the file's first bytes are one; a U+FEFF further on is text.
  path = tmp_path / 'test.de'
  path.write_bytes('\ufeffEin Hund.\n\ufeffZwei Katzen.\n'.encode('utf-8'))
  expected = ['Ein Hund.', '\ufeffZwei Katzen.']
  assert data_lib.read_text_lines(path) == expected
  assert [line for chunk in data_lib.read_chunks(str(path), 1) for line in chunk] == expected


def test_a_lone_carriage_return_stays_inside_its_line(tmp_path):
  """Lines end at \\n alone (a final \\r dropped), for the training text, the references and the decode command's
  input alike: a \\r, U+0085 or U+2028 inside a line (str.splitlines would split there) keeps the pair on its line
  number, and the files aligned."""
  raw = 'one\rtwo\r\nthree\x85four\u2028five\nsix\r\n'
  (tmp_path / 'train.en').write_bytes(raw.encode('utf-8'))
  (tmp_path / 'train.de').write_bytes('eins\nzwei\nsechs\n'.encode('utf-8'))
  expected = ['one\rtwo', 'three\x85four\u2028five', 'six']
  assert data_lib.read_text_lines(tmp_path / 'train.en') == expected
  assert [line for chunk in data_lib.read_chunks(str(tmp_path / 'train.en'), 2) for line in chunk] == expected
  src, tgt, keep, num_lines = data_lib.read_parallel(tmp_path, 'train', 'en', 'de')
  assert (src, tgt, keep, num_lines) == (['one two', 'three four five', 'six'], ['eins', 'zwei', 'sechs'],
                                         [0, 1, 2], 3)


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


def test_the_vocabulary_is_learnt_with_the_requested_options(toy_corpus, tmp_path):
  """The sentencepiece options reach the trainer: the vocabulary has vocab_size pieces; a BPE model scores its
  merges by rank (whole numbers), a unigram one by log probabilities; character_coverage=1.0 keeps a character
  seen once (sentencepiece's default, 0.9995, maps it to UNK); a user symbol gets the first id after the reserved
  ones and is encoded whole."""
  lines = data_lib.read_lines(toy_corpus / 'train.en') + data_lib.read_lines(toy_corpus / 'train.de')
  lines.append('ein \u00f8 .')  # one rare character among about 15,000
  def train(name, **options):
    return tokenizer_lib.Tokenizer(tokenizer_lib.train_sentencepiece(lines, tmp_path / name, **options))
  bpe = train('bpe.model', vocab_size=70, model_type='bpe', character_coverage=1.0, user_defined_symbols=('<mask>',))
  assert bpe.vocab_size == 70
  scores = [bpe.sp.get_score(i) for i in range(bpe.vocab_size)]
  assert all(score == int(score) for score in scores)
  assert UNK_ID not in bpe.encode(['\u00f8'])[0]
  assert bpe.mask_id == EOS_ID + 1 and bpe.encode(['a <mask> dog'])[0].count(EOS_ID + 1) == 1
  unigram = train('unigram.model', vocab_size=40, model_type='unigram', character_coverage=0.9995)
  assert unigram.vocab_size == 40
  assert any(score != int(score) for score in (unigram.sp.get_score(i) for i in range(unigram.vocab_size)))
  assert UNK_ID in unigram.encode(['\u00f8'])[0] and unigram.mask_id is None


def test_the_pipeline_learns_the_vocabulary_with_the_configs_options(toy_corpus, tmp_path):
  """config.vocab_size, sentencepiece_model_type and sentencepiece_character_coverage reach the trainer (a
  unigram model scores pieces by log probability; coverage below 1 maps a character seen twice to UNK), and the
  vocabulary is learnt from both languages (a German-only word's characters are not UNK); an MLM's has '<mask>'."""
  from conftest import small_config  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  for lang, line in (('en', 'a \u00f8 .'), ('de', 'ein \u00f8 .')):
    with open(toy_corpus / f'train.{lang}', 'a', encoding='utf-8') as f:
      f.write(line + '\n')
  config = small_config(toy_corpus)
  config.vocab_size, config.sentencepiece_model_type, config.sentencepiece_character_coverage = 40, 'unigram', 0.9995
  tokenizer = pipeline.vocabulary_and_tokens(config, tmp_path / 'work')[0]
  assert tokenizer.vocab_size == 40
  assert any(score != int(score) for score in (tokenizer.sp.get_score(i) for i in range(tokenizer.vocab_size)))
  assert UNK_ID in tokenizer.encode(['\u00f8'])[0]
  german_only = sorted(set(''.join(data_lib.read_lines(toy_corpus / 'train.de'))) - set(
      ''.join(data_lib.read_lines(toy_corpus / 'train.en'))) - {'\u00f8'})
  assert german_only and UNK_ID not in tokenizer.encode([''.join(german_only)])[0]
  assert tokenizer.mask_id is None
  config.task, config.vocab_size, config.sentencepiece_model_type = 'mlm', 64, 'bpe'  # '<mask>' after the reserved ids
  assert pipeline.vocabulary_and_tokens(config, tmp_path / 'mlm')[0].mask_id == EOS_ID + 1


def corpus_of_lengths(lengths):
  source = [[5] * (n - 1) + [EOS_ID] for n in lengths]
  target = [[6] * (n - 1) + [EOS_ID] for n in lengths]
  return data_lib.TokenizedCorpus.from_lists(source, target)


def smallest_bucket(n, buckets):
  """The padded length of an n-token example, written out: the first bucket that holds it, else n rounded up to
  a multiple of 8."""
  return next((b for b in sorted(buckets) if b >= n), -(-n // 8) * 8)


def test_batches_respect_the_token_budget_and_shift_targets():
  """Every batch is padded to the smallest bucket that holds each of its examples (beyond the last bucket: a
  multiple of 8) with as many rows as the budget allows. Catches an example of exactly a bucket's length put in
  the next one up (first bucket > n), a rounding past the buckets other than to 8, or rows left unused."""
  rng = np.random.default_rng(0)
  corpus = corpus_of_lengths(rng.integers(2, 60, size=500))
  buckets = (8, 16, 32, 48)
  batches = batching.TrainBatches(corpus, tokens_per_batch=256, buckets=buckets, seed=1)
  seen, lengths_seen = 0, set()
  for _ in range(batches.batches_per_epoch()):
    batch = next(batches)
    rows, length = batch['src'].shape
    assert rows == 256 // length
    real = batch['tgt_out'] != PAD_ID
    seen += int(real.any(axis=1).sum())
    # tgt_in is BOS followed by tgt_out shifted right, on real rows.
    for r in np.flatnonzero(real.any(axis=1)):
      n = int(real[r].sum())
      assert length == smallest_bucket(n, buckets), (n, length)
      lengths_seen.add(n)
      np.testing.assert_array_equal(batch['src'][r], [5] * (n - 1) + [EOS_ID] + [PAD_ID] * (length - n))
      assert batch['tgt_in'][r, 0] == BOS_ID
      np.testing.assert_array_equal(batch['tgt_in'][r, 1:n], batch['tgt_out'][r, :n - 1])
      assert batch['tgt_out'][r, n - 1] == EOS_ID
  assert seen == 500  # every example exactly once per epoch
  assert {8, 16, 32, 48, 56} <= lengths_seen  # examples exactly at a bucket's length, and one past the last
  assert batches.epoch == 0 and batches.batch == batches.batches_per_epoch()


def test_epochs_are_shuffled_differently_and_reproducibly():
  corpus = corpus_of_lengths(np.random.default_rng(0).integers(2, 40, size=300))
  a = batching.TrainBatches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48), seed=3)
  b = batching.TrainBatches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48), seed=3)
  first = [a.plan(0)[i][2].tolist() for i in range(5)]
  assert first == [b.plan(0)[i][2].tolist() for i in range(5)]
  assert first != [a.plan(1)[i][2].tolist() for i in range(5)]


def test_iterator_resumes_exactly_from_a_saved_position():
  corpus = corpus_of_lengths(np.random.default_rng(0).integers(2, 40, size=200))
  make = lambda: batching.TrainBatches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48), seed=7)
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


def test_each_epoch_regroups_its_examples_and_shuffles_its_batches():
  """Two epochs' plans against properties written out: within an epoch the batches' bucket lengths are mixed
  (a plan left in bucket order changes length only between buckets), and another epoch groups other examples
  together (shuffling only the order of the batches, or the same draw every epoch, keeps the groups)."""
  corpus = corpus_of_lengths(np.random.default_rng(8).integers(2, 40, size=400))
  buckets = (8, 16, 32, 48)
  batches = batching.TrainBatches(corpus, tokens_per_batch=128, buckets=buckets, seed=6, prefetch=0)
  plans = [batches.plan(epoch) for epoch in (0, 1)]
  for plan in plans:
    lengths = [length for length, _, _ in plan]
    changes = sum(a != b for a, b in zip(lengths, lengths[1:]))
    assert changes > 4 * len(buckets), lengths
    assert sorted(i for _, _, members in plan for i in members.tolist()) == list(range(400))
  groups = [{frozenset(members.tolist()) for _, _, members in plan if len(members) > 1} for plan in plans]
  assert len(groups[0] & groups[1]) < len(groups[0]) // 4


@pytest.mark.parametrize('multiple_of', [2, 3, 8])
def test_rows_are_the_largest_multiple_the_token_budget_holds(multiple_of):
  """A batch's rows: the largest multiple of `multiple_of` with rows x padded length within the budget (at least
  `multiple_of` rows where the budget holds fewer), written out as a loop. Catches rounding up to the multiple
  (a batch over the budget)."""
  corpus = corpus_of_lengths(np.random.default_rng(9).integers(2, 60, size=300))
  budget = 200
  batches = batching.TrainBatches(corpus, tokens_per_batch=budget, buckets=(8, 16, 24, 32, 48), seed=1,
                                  multiple_of=multiple_of, prefetch=0)
  seen = set()
  for length, rows, members in batches.plan(0):
    expected = multiple_of
    while (expected + multiple_of) * length <= budget:
      expected += multiple_of
    assert rows == expected, (length, rows, expected)
    assert len(members) <= rows
    seen.add(length)
  assert any(budget // length % multiple_of for length in seen)  # a bucket where the budget is not a multiple


def test_batches_are_padded_to_the_longer_side_of_each_pair():
  """Sources and targets of independent lengths: every row sits in the smallest bucket that holds the longer
  side (a plan by one side puts a longer target in too short a bucket), with both sides intact."""
  rng = np.random.default_rng(10)
  src_lengths, tgt_lengths = rng.integers(2, 40, size=200), rng.integers(2, 40, size=200)
  source = [[10 + i] * (n - 1) + [EOS_ID] for i, n in enumerate(src_lengths)]
  target = [[500 + i] * (n - 1) + [EOS_ID] for i, n in enumerate(tgt_lengths)]
  corpus = data_lib.TokenizedCorpus.from_lists(source, target)
  buckets = (8, 16, 32, 48)
  batches = batching.TrainBatches(corpus, tokens_per_batch=256, buckets=buckets, seed=2, prefetch=0)
  seen = []
  for _ in range(batches.batches_per_epoch()):
    batch = next(batches)
    length = batch['src'].shape[1]
    for s, t in _pairs_of(batch):
      i = s[0] - 10
      assert (list(s), list(t)) == (source[i], target[i])
      assert length == smallest_bucket(max(src_lengths[i], tgt_lengths[i]), buckets)
      seen.append(i)
  assert sorted(seen) == list(range(200))
  assert any(smallest_bucket(s, buckets) < smallest_bucket(t, buckets) for s, t in zip(src_lengths, tgt_lengths))


def test_eval_batches_cover_everything_once_in_a_fixed_order():
  corpus = corpus_of_lengths(np.random.default_rng(0).integers(2, 40, size=100))
  runs = [list(batching.eval_batches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48))) for _ in range(2)]
  assert sum(int((b['src'] != PAD_ID).any(axis=1).sum()) for b in runs[0]) == 100
  for x, y in zip(*runs):
    np.testing.assert_array_equal(x['src'], y['src'])


@pytest.mark.parametrize('multiple_of', [1, 3])
def test_eval_batches_keep_the_token_budget_and_the_smallest_bucket(multiple_of):
  """Validation batches are planned as training's: rows the largest multiple of `multiple_of` within the budget
  (written as a loop), each row in the smallest bucket that holds its pair. Catches a validation batch over
  the token budget (out of memory on the device where training fits), or a bucket chosen by one side."""
  rng = np.random.default_rng(11)
  side = lambda token: [[token] * (n - 1) + [EOS_ID] for n in rng.integers(2, 60, size=300)]
  corpus = data_lib.TokenizedCorpus.from_lists(side(5), side(6))
  buckets, budget = (8, 16, 24, 32, 48), 200
  seen = 0
  for batch in batching.eval_batches(corpus, tokens_per_batch=budget, buckets=buckets, multiple_of=multiple_of):
    rows, length = batch['src'].shape
    expected = multiple_of
    while (expected + multiple_of) * length <= budget:
      expected += multiple_of
    assert rows == expected, (length, rows, expected)
    real = np.maximum((batch['src'] != PAD_ID).sum(axis=1), (batch['tgt_out'] != PAD_ID).sum(axis=1))
    assert all(length == smallest_bucket(int(n), buckets) for n in real[real > 0])
    seen += int((real > 0).sum())
  assert seen == 300


def test_length_filter_drops_long_and_empty_pairs(toy_corpus, tmp_path):
  lines = data_lib.read_lines(toy_corpus / 'train.en') + data_lib.read_lines(toy_corpus / 'train.de')
  tokenizer = tokenizer_lib.load_or_train(tmp_path / 'work', lambda: lines, vocab_size=64)
  src = ['a dog', '', 'a dog ' * 50, 'the cat']
  tgt = ['ein hund', 'leer', 'ein hund ' * 50, '']
  corpus = data_lib.tokenize(src, tgt, tokenizer)
  assert list(corpus.usable(max_length=20)) == [0]
  assert list(corpus.usable()) == [0, 2]


def test_length_filter_keeps_a_pair_whose_longer_side_is_at_most_the_limit():
  """usable(8) against a plain loop over both sides' lengths (EOS included): catches the limit applied to the
  shorter side only (a long target beside a short source kept), a pair of exactly 8 tokens dropped (< for <=),
  or a side of EOS alone (an empty line) kept."""
  rng = np.random.default_rng(4)
  src_lengths, tgt_lengths = rng.integers(0, 12, size=300), rng.integers(0, 12, size=300)
  sides = lambda lengths: [[5] * (n - 1) + [EOS_ID] if n else [] for n in lengths]
  corpus = data_lib.TokenizedCorpus.from_lists(sides(src_lengths), sides(tgt_lengths))
  expected = [i for i, (s, t) in enumerate(zip(src_lengths, tgt_lengths)) if s > 1 and t > 1 and max(s, t) <= 8]
  assert corpus.usable(max_length=8).tolist() == expected
  assert corpus.usable().tolist() == [i for i, (s, t) in enumerate(zip(src_lengths, tgt_lengths)) if s > 1 and t > 1]
  longest = np.maximum(src_lengths, tgt_lengths)
  shortest = np.minimum(src_lengths, tgt_lengths)
  assert (longest[expected] == 8).any()  # pairs at the limit
  assert ((longest > 8) & (shortest > 1) & (shortest <= 8)).any()  # one side over, the other within


@pytest.mark.parametrize('hosts', [2, 4])
def test_host_shards_are_disjoint_equal_shaped_and_cover_every_example(hosts):
  corpus = corpus_of_lengths(np.random.default_rng(0).integers(2, 40, size=400))
  usable = np.arange(0, 400, 3)  # a subset, as a length filter would leave
  make = lambda p: batching.TrainBatches(corpus, examples=usable, tokens_per_batch=256, buckets=(8, 16, 32, 48),
                                         seed=5, multiple_of=hosts, process_index=p, process_count=hosts)
  shards = [make(p) for p in range(hosts)]
  single = batching.TrainBatches(corpus, examples=usable, tokens_per_batch=256, buckets=(8, 16, 32, 48), seed=5,
                                 multiple_of=hosts)
  seen = []
  for b in range(single.batches_per_epoch()):
    per_host = [set(s.plans.host_members(0, b)[0].tolist()) for s in shards]
    for i in range(hosts):
      for j in range(i):
        assert not per_host[i] & per_host[j]
    assert set().union(*per_host) == set(single.plan(0)[b][2].tolist())
    batches = [next(s) for s in shards]
    assert len({x['src'].shape for x in batches}) == 1  # every host feeds the same shape at every step
    assert sum(int((x['src'] != PAD_ID).any(axis=1).sum()) for x in batches) == len(single.plan(0)[b][2])
    seen += [i for h in per_host for i in h]
  assert sorted(seen) == usable.tolist()  # one epoch: every usable example exactly once, over all hosts
  for s in shards:
    s.close()


def test_sharded_iteration_resumes_exactly_with_and_without_prefetch():
  corpus = corpus_of_lengths(np.random.default_rng(1).integers(2, 40, size=200))
  make = lambda prefetch: batching.TrainBatches(corpus, tokens_per_batch=128, buckets=(8, 16, 32, 48), seed=2,
                                                multiple_of=2, process_index=1, process_count=2, prefetch=prefetch)
  reference = make(0)
  expected = [next(reference) for _ in range(70)]
  first = make(3)
  for _ in range(41):
    next(first)
  state = first.state()  # the position of the batches handed out, not of those the thread built ahead
  first.close()
  resumed = make(3)
  resumed.restore(state)
  for want in expected[41:]:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  resumed.close()


def test_eval_batches_split_rows_over_hosts():
  corpus = corpus_of_lengths(np.random.default_rng(2).integers(2, 40, size=90))
  kwargs = dict(tokens_per_batch=128, buckets=(8, 16, 32, 48), multiple_of=2)
  whole = list(batching.eval_batches(corpus, **kwargs))
  halves = [list(batching.eval_batches(corpus, process_index=p, process_count=2, **kwargs)) for p in range(2)]
  for batch, first, second in zip(whole, *halves):
    np.testing.assert_array_equal(np.concatenate([first['src'], second['src']]), batch['src'])


class CountingTokenizer:
  """A tokenizer that counts the lines it encodes (to see whether the cache was used)."""

  def __init__(self, tokenizer):
    self.inner, self.lines = tokenizer, 0
    self.sha256, self.vocab_size = tokenizer.sha256, tokenizer.vocab_size

  def encode(self, texts, num_threads=0):
    self.lines += len(texts)
    return self.inner.encode(texts, num_threads)


def toy_tokenizer(toy_corpus, workdir):
  lines = data_lib.read_lines(toy_corpus / 'train.en') + data_lib.read_lines(toy_corpus / 'train.de')
  return tokenizer_lib.load_or_train(workdir, lambda: lines, vocab_size=64)


def test_tokenization_is_cached_and_rebuilt_when_the_text_changes(toy_corpus, tmp_path):
  from flaxformer_nmt.data import corpora  # pylint: disable=g-import-not-at-top
  tokenizer = CountingTokenizer(toy_tokenizer(toy_corpus, tmp_path / 'work'))
  pairs = corpora.TextPairs(toy_corpus, 'train', 'en', 'de')
  cache = tmp_path / 'work' / 'tokenized' / 'train'
  first = data_lib.tokenize_cached(pairs, tokenizer, cache, chunk_pairs=64)
  assert tokenizer.lines == 2 * 300 and len(list(cache.glob('chunk_*.npz'))) == 5
  direct = data_lib.tokenize(*pairs.read(range(len(pairs))), tokenizer.inner)
  for a, b in ((first.source, direct.source), (first.target, direct.target)):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.offsets, b.offsets)
  again = data_lib.tokenize_cached(pairs, tokenizer, cache, chunk_pairs=64)
  assert tokenizer.lines == 600  # the second run read the cache
  np.testing.assert_array_equal(again.target.tokens, first.target.tokens)
  # A changed file (another size) is a different corpus: tokenized again.
  (toy_corpus / 'train.de').write_text((toy_corpus / 'train.de').read_text().replace('hund', 'hunde'))
  data_lib.tokenize_cached(corpora.TextPairs(toy_corpus, 'train', 'en', 'de'), tokenizer, cache, chunk_pairs=64)
  assert tokenizer.lines == 1200


def run_as_hosts(count, fn):
  """Runs fn(process_index, barrier) in `count` threads standing in for hosts; returns their results."""
  barrier = threading.Barrier(count, timeout=60)
  results, errors = [None] * count, []

  def host(p):
    try:
      results[p] = fn(p, lambda name: barrier.wait())
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
      barrier.abort()
  threads = [threading.Thread(target=host, args=(p,)) for p in range(count)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return results


def test_hosts_tokenize_disjoint_chunks_and_load_the_same_corpus(toy_corpus, tmp_path):
  from flaxformer_nmt.data import corpora  # pylint: disable=g-import-not-at-top
  base = toy_tokenizer(toy_corpus, tmp_path / 'work')
  pairs = corpora.TextPairs(toy_corpus, 'train', 'en', 'de')
  tokenizers = [CountingTokenizer(base) for _ in range(3)]
  corpora_ = run_as_hosts(3, lambda p, barrier: data_lib.tokenize_cached(
      pairs, tokenizers[p], tmp_path / 'cache', process_index=p, process_count=3, barrier=barrier, chunk_pairs=50))
  # 6 chunks of 50 pairs: each host tokenized its 2, nobody more.
  assert [t.lines for t in tokenizers] == [200, 200, 200]
  for c in corpora_[1:]:
    np.testing.assert_array_equal(c.source.tokens, corpora_[0].source.tokens)
    np.testing.assert_array_equal(c.target.offsets, corpora_[0].target.offsets)
  assert len(corpora_[0]) == 300


def test_only_the_leader_trains_the_vocabulary(toy_corpus, tmp_path):
  lines = data_lib.read_lines(toy_corpus / 'train.en') + data_lib.read_lines(toy_corpus / 'train.de')
  calls = []

  def sentences(p):
    calls.append(p)
    return lines
  tokenizers = run_as_hosts(2, lambda p, barrier: tokenizer_lib.load_or_train(
      tmp_path / 'work', lambda: sentences(p), vocab_size=64, is_leader=p == 0, barrier=barrier))
  assert calls == [0]
  assert tokenizers[0].sha256 == tokenizers[1].sha256


def test_vocabulary_sample_respects_the_character_budget(toy_corpus):
  from flaxformer_nmt.data import corpora  # pylint: disable=g-import-not-at-top
  pairs = corpora.TextPairs(toy_corpus, 'train', 'en', 'de')
  everything = tokenizer_lib.sample_sentences(pairs, max_chars=0)
  assert len(everything) == 600
  sample = tokenizer_lib.sample_sentences(pairs, max_chars=2000, seed=1, read_size=7)
  chars = sum(len(s) for s in sample)
  assert 2000 <= chars < 2000 + max(len(s) for s in sample)
  assert sample == tokenizer_lib.sample_sentences(pairs, max_chars=2000, seed=1)  # seeded
  assert sample != tokenizer_lib.sample_sentences(pairs, max_chars=2000, seed=2)
  assert sample[:2] != everything[:2] and set(sample) <= set(everything)  # a random draw, not the head


def test_packed_batches_hold_every_example_once_per_epoch_split_over_hosts():
  lengths = np.random.default_rng(3).integers(2, 20, size=300)
  corpus = corpus_of_lengths(lengths)
  make = lambda p: batching.TrainBatches(corpus, tokens_per_batch=256, buckets=(8,), seed=4, multiple_of=2,
                                         process_index=p, process_count=2, packed_length=32)
  hosts = [make(0), make(1)]
  real_tokens = 0
  for _ in range(hosts[0].batches_per_epoch()):
    batches = [next(h) for h in hosts]
    for batch in batches:
      assert batch['src'].shape == (4, 32)  # 256 tokens / 32 per row = 8 rows, 4 per host
      # Positions restart with every packed example; segments number the examples of a row.
      for r in range(4):
        segments, positions = batch['src_segments'][r], batch['src_positions'][r]
        for s in set(segments[segments > 0].tolist()):
          np.testing.assert_array_equal(positions[segments == s], np.arange((segments == s).sum()))
      real_tokens += int((batch['src'] != PAD_ID).sum())
  assert hosts[0].epoch == 0 and real_tokens == lengths.sum()  # every example once, none cut
  for h in hosts:
    h.close()
  with pytest.raises(ValueError, match='longer than packed_length=16'):
    batching.TrainBatches(corpus, tokens_per_batch=256, buckets=(8,), seed=4, packed_length=16)


def _pairs_of(batch):
  """The (source, target) token tuples of an unpacked batch's real rows."""
  real = batch['tgt_out'] != PAD_ID
  return [(tuple(s[s != PAD_ID].tolist()), tuple(t[t != PAD_ID].tolist()))
          for s, t, r in zip(batch['src'], batch['tgt_out'], real) if r.any()]


def _named_pairs(lengths):
  """Pair i: source tokens 10 + i, target tokens 500 + i, so a row names its pair and its direction."""
  source = [[10 + i] * (n - 1) + [EOS_ID] for i, n in enumerate(lengths)]
  target = [[500 + i] * (n // 2) + [EOS_ID] for i, n in enumerate(lengths)]
  return source, target, data_lib.TokenizedCorpus.from_lists(source, target)


def test_bidirectional_epochs_hold_every_pair_both_ways_then_one_way():
  source, target, corpus = _named_pairs(np.random.default_rng(5).integers(2, 30, size=120))
  examples = np.arange(1, 120)  # pair 0 left out, as `usable` would
  batches = batching.TrainBatches(corpus, examples=examples, tokens_per_batch=256, buckets=(8, 16, 32, 48),
                                  seed=3, prefetch=0, bidirectional_epochs=2)
  forward = sorted((tuple(source[i]), tuple(target[i])) for i in examples)
  reverse = sorted((t, s) for s, t in forward)
  seen = {0: [], 1: [], 2: []}
  while not (batches.epoch == 2 and batches.batch == batches.batches_per_epoch()):
    batch = next(batches)
    seen[batches.epoch] += _pairs_of(batch)  # the position after a batch is in the batch's epoch
  assert sorted(seen[0]) == sorted(seen[1]) == sorted(forward + reverse)  # each pair once each way
  assert sorted(seen[2]) == forward
  assert len(batches.plan(0)) > 1.5 * len(batches.plan(2))
  assert batches.state()['batching']['bidirectional_epochs'] == 2
  # A position saved with another value belongs to other batches.
  one_way = batching.TrainBatches(corpus, examples=examples, tokens_per_batch=256, buckets=(8, 16, 32, 48), seed=3)
  with pytest.raises(batching.BatchingError, match='config.bidirectional_epochs was 2, now 0'):
    one_way.restore(batches.state())


def _packed_pairs_of(batch):
  """The (source, target) token tuples of a packed batch: one per segment of each row."""
  pairs = []
  for r in range(batch['src'].shape[0]):
    for s in sorted(set(batch['tgt_segments'][r][batch['tgt_segments'][r] > 0].tolist())):
      pairs.append((tuple(batch['src'][r][batch['src_segments'][r] == s].tolist()),
                    tuple(batch['tgt_out'][r][batch['tgt_segments'][r] == s].tolist())))
  return pairs


def test_bidirectional_epochs_pack_reversed_pairs_as_their_own_examples():
  # As above, in packed rows (the recipe's batches): a reversed pair is one segment whose source is the
  # pair's target, never a forward source cut or joined to another example's target.
  source, target, corpus = _named_pairs(np.random.default_rng(6).integers(2, 30, size=90))
  batches = batching.TrainBatches(corpus, tokens_per_batch=256, buckets=(8,), seed=2, prefetch=0,
                                  packed_length=32, bidirectional_epochs=1)
  forward = sorted((tuple(s), tuple(t)) for s, t in zip(source, target))
  seen = {0: [], 1: []}
  while not (batches.epoch == 1 and batches.batch == batches.batches_per_epoch()):
    batch = next(batches)
    assert batch['src'].shape == (8, 32)
    seen[batches.epoch] += _packed_pairs_of(batch)
  assert sorted(seen[0]) == sorted(forward + [(t, s) for s, t in forward])
  assert sorted(seen[1]) == forward


def test_the_pipeline_trains_both_ways_for_the_configured_epochs(toy_corpus, tmp_path):
  from conftest import WORDS, small_config  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  config = small_config(toy_corpus)
  config.bidirectional_epochs = 1
  config.prefetch_batches = 0
  train_batches, _, tokenizer = pipeline.input_pipeline(config, tmp_path / 'work', num_devices=1)
  english, german = set(WORDS) | {'.'}, set(WORDS.values()) | {'.'}
  directions = {0: set(), 1: set()}
  while not (train_batches.epoch == 1 and train_batches.batch == train_batches.batches_per_epoch()):
    batch = next(train_batches)
    for s, t in _pairs_of(batch):
      source, target = tokenizer.decode(np.array(s)).split(), tokenizer.decode(np.array(t)).split()
      assert set(source) <= english and set(target) <= german or set(source) <= german and set(target) <= english
      directions[train_batches.epoch].add('en-de' if set(source) <= english else 'de-en')
  assert directions == {0: {'en-de', 'de-en'}, 1: {'en-de'}}


def test_bidirectional_epochs_reverse_each_epochs_own_pieces_under_bpe_dropout():
  corpus = corpus_of_lengths([3, 5, 7, 9])
  def resegment(epoch):  # a stand-in for SavedSegmentations: epoch e's pieces are the ids plus 10 * (e + 1)
    return data_lib.TokenizedCorpus(
        data_lib.Ragged(np.where(corpus.source.tokens == EOS_ID, EOS_ID, corpus.source.tokens + 10 * (epoch + 1)),
                        corpus.source.offsets), corpus.target)
  batches = batching.TrainBatches(corpus, tokens_per_batch=64, buckets=(16,), seed=0, prefetch=0, bpe_dropout=0.1,
                                  resegment=resegment, bidirectional_epochs=1)
  seen = {0: [], 1: []}
  while not (batches.epoch == 1 and batches.batch == batches.batches_per_epoch()):
    batch = next(batches)
    seen[batches.epoch] += _pairs_of(batch)
  for epoch, piece in ((0, 15), (1, 25)):
    forward = [((piece,) * (n - 1) + (EOS_ID,), (6,) * (n - 1) + (EOS_ID,)) for n in (3, 5, 7, 9)]
    expected = forward + [(t, s) for s, t in forward] if epoch == 0 else forward
    assert sorted(seen[epoch]) == sorted(expected), epoch


def test_right_to_left_targets_reverse_each_target_before_its_eos():
  rng = np.random.default_rng(7)
  source = [list(rng.integers(4, 90, size=n)) + [EOS_ID] for n in rng.integers(1, 12, size=40)]
  target = [list(rng.integers(4, 90, size=n)) + [EOS_ID] for n in rng.integers(1, 12, size=40)]
  target[3] = []  # an empty line (no EOS) stays empty
  corpus = data_lib.TokenizedCorpus.from_lists(source, target)
  reversed_ = data_lib.right_to_left_targets(corpus)
  for i in range(40):
    assert reversed_.source[i].tolist() == source[i]
    expected = [] if not target[i] else target[i][-2::-1] + [EOS_ID]  # written out: last word first, EOS last
    assert reversed_.target[i].tolist() == expected
    assert data_lib.reverse_before_eos(reversed_.target[i]) == target[i]  # its own inverse
  corrupt = data_lib.TokenizedCorpus.from_lists(source[:2], [[5, 6], [7, EOS_ID]])
  with pytest.raises(ValueError, match='end with EOS'):
    data_lib.right_to_left_targets(corrupt)


def test_the_pipeline_gives_right_to_left_targets_to_training_and_validation(toy_corpus, tmp_path):
  from conftest import small_config  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  pairs = {}
  for right_to_left in (False, True):
    config = small_config(toy_corpus)
    config.target_right_to_left, config.prefetch_batches = right_to_left, 0
    train_batches, eval_batches, tokenizer = pipeline.input_pipeline(config, tmp_path / 'work', num_devices=1)
    batch = next(train_batches)
    pairs[right_to_left] = (_pairs_of(batch), [p for b in eval_batches() for p in _pairs_of(b)])
    train_batches.close()
  for forward, backward in zip(pairs[False], pairs[True]):
    assert len(forward) == len(backward) > 0
    assert [(s, tuple(data_lib.reverse_before_eos(t))) for s, t in forward] == backward
  assert any(len(t) > 2 for _, t in pairs[False][0])  # reversing changed something


def test_a_corpus_with_no_pair_within_the_length_limit_is_one_clear_error(toy_corpus, tmp_path):
  from conftest import small_config  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  config = small_config(toy_corpus)
  config.max_length = 2  # every toy sentence is longer: the first batch raised IndexError
  with pytest.raises(data_lib.DataError, match='no training pair with both sides non-empty and at most 2 tokens'):
    pipeline.input_pipeline(config, tmp_path, num_devices=1)


def test_packed_training_keeps_the_pairs_within_the_shorter_of_max_length_and_packed_length(toy_corpus, tmp_path):
  """With packed rows shorter than config.max_length, the training pairs are those with both sides non-empty and
  at most packed_length tokens (EOS included), counted here by a loop over the tokenized lines; a limit taken
  from the longer setting kept pairs no packed row holds, and planning the batches raised ValueError."""
  from conftest import small_config  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  config = small_config(toy_corpus)
  config.max_length, config.packed_length, config.prefetch_batches = 64, 8, 0
  train_batches, _, tokenizer = pipeline.input_pipeline(config, tmp_path / 'work', num_devices=1)
  source = tokenizer.encode(data_lib.read_lines(toy_corpus / 'train.en'))
  target = tokenizer.encode(data_lib.read_lines(toy_corpus / 'train.de'))
  expected = sum(1 for s, t in zip(source, target) if max(len(s), len(t)) <= 8)
  assert 0 < expected < len(source)
  assert train_batches.batching['training_examples'] == expected
  batch = next(train_batches)
  assert batch['src'].shape[1] == 8


def prefetcher_get_within(prefetcher, seconds=10):
  """What prefetcher.get() returns or raises, from a thread: ('hung', None) where it waits longer than `seconds`."""
  outcome = [('hung', None)]

  def get():
    try:
      outcome[0] = ('item', prefetcher.get())
    except BaseException as e:  # pylint: disable=broad-except
      outcome[0] = ('raised', e)
  thread = threading.Thread(target=get, daemon=True)
  thread.start()
  thread.join(seconds)
  return outcome[0]


@pytest.mark.parametrize('error', [ValueError('bad line'), SystemExit(3)])
def test_an_error_in_the_prefetch_thread_is_raised_by_every_get_and_none_waits(error):
  """Wrong rules caught: an exception not derived from Exception (SystemExit) ended the thread without a word and
  the consumer waited for ever; and a second get after the error waited for ever on the empty queue."""
  def build(step):
    if step == 2:
      raise error
    return step, (step + 1,)  # (item, the next position)
  prefetcher = batching.Prefetcher(build, (0,), depth=1)
  assert [prefetcher_get_within(prefetcher) for _ in range(2)] == [('item', (0, (1,))), ('item', (1, (2,)))]
  for _ in range(2):
    assert prefetcher_get_within(prefetcher) == ('raised', error)


def test_validation_leaves_out_pairs_longer_than_the_models_positions(toy_corpus, tmp_path, caplog):
  """A validation pair with a side of more than config.model.max_position tokens would be scored at positions past
  the sinusoidal table, which the model reads as its last row (a wrong eval/loss, without a word): such pairs are
  left out, with a warning. The pairs kept are counted from the text tokenized here, written out; training's
  shorter config.max_length does not apply to them."""
  from conftest import small_config  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  config = small_config(toy_corpus)
  config.model.max_position, config.max_length = 8, 6
  config.prefetch_batches = 0
  train_batches, eval_batches, tokenizer = pipeline.input_pipeline(config, tmp_path / 'work', num_devices=1)
  train_batches.close()
  encode = lambda lang: tokenizer.encode(data_lib.read_lines(toy_corpus / f'valid.{lang}'))
  pairs = [(tuple(s), tuple(t)) for s, t in zip(encode('en'), encode('de'))]
  expected = sorted((s, t) for s, t in pairs if max(len(s), len(t)) <= 8)
  assert 0 < len(expected) < len(pairs)  # the toy validation split has pairs on both sides of the limit
  assert any(max(len(s), len(t)) > 6 for s, t in expected)
  assert sorted(p for batch in eval_batches() for p in _pairs_of(batch)) == expected
  assert f'{len(pairs) - len(expected)} validation pairs' in caplog.text
