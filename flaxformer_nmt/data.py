"""Parallel text -> token-budget batches.

The road of a sentence pair: `{split}.{src}` / `{split}.{tgt}` lines are read and checked (same line count,
valid UTF-8), whitespace is normalized, both sides are tokenized with the joint vocabulary (EOS appended),
overlong pairs are dropped, and pairs are grouped by padded length into batches of about
`tokens_per_batch` tokens per side.

Every batch of a bucket has the same shape, so the jitted train step compiles once per length bucket. A
training epoch's batches are a pure function of (seed, epoch), and the iterator's position is the small
dict `{'epoch', 'batch'}`: saving it with a checkpoint makes resumption exact.
"""
import dataclasses

import numpy as np
from absl import logging
from etils import epath

from flaxformer_nmt import tokenizer as tokenizer_lib


class DataError(ValueError):
  """Bad input data; the message names the file and line."""


def read_lines(path):
  """The lines of a UTF-8 text file, whitespace-normalized; errors name the file and line."""
  path = epath.Path(path)
  if not path.exists():
    raise DataError(f'{path}: file not found')
  raw = path.read_bytes()
  lines = raw.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()
  out = []
  for number, line in enumerate(lines, start=1):
    try:
      text = line.decode('utf-8')
    except UnicodeDecodeError as e:
      raise DataError(f'{path}:{number}: invalid UTF-8 ({e.reason} at byte {e.start})') from None
    out.append(tokenizer_lib.normalize_whitespace(text))
  return out


def split_paths(data_dir, split, source_lang, target_lang):
  base = epath.Path(data_dir)
  return base / f'{split}.{source_lang}', base / f'{split}.{target_lang}'


def read_parallel(data_dir, split, source_lang, target_lang, max_line_chars=0, skip_bad_pairs=False):
  """(source lines, target lines) of one split, checked to be non-empty and aligned.

  A pair with one empty side (a sign of misaligned files) or a line over `max_line_chars` characters (a sign
  of a broken file) is an error naming the file and line, or with `skip_bad_pairs` is dropped and counted.
  Pairs empty on both sides are dropped.
  """
  src_path, tgt_path = split_paths(data_dir, split, source_lang, target_lang)
  src, tgt = read_lines(src_path), read_lines(tgt_path)
  if not src:
    raise DataError(f'{src_path}: file is empty')
  if len(src) != len(tgt):
    raise DataError(f'{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: the sides must be aligned')
  keep, bad = [], 0
  for number, (s, t) in enumerate(zip(src, tgt), start=1):
    if not s and not t:
      continue
    problem = None
    if not s or not t:
      problem = f'{src_path if not s else tgt_path}:{number}: empty line while {tgt_path if not s else src_path}:{number} has text'
    elif max_line_chars and max(len(s), len(t)) > max_line_chars:
      problem = (f'{src_path if len(s) > max_line_chars else tgt_path}:{number}: line of '
                 f'{max(len(s), len(t)):,} characters (config.max_line_chars={max_line_chars:,})')
    if problem is None:
      keep.append(number - 1)
    elif skip_bad_pairs:
      bad += 1
    else:
      raise DataError(problem + '; fix the data or set --config.skip_bad_pairs=true to drop such pairs')
  if bad:
    logging.warning('Dropped %d bad pairs from %s/%s (config.skip_bad_pairs)', bad, data_dir, split)
  if len(keep) < len(src):
    src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
  return src, tgt


@dataclasses.dataclass
class TokenizedCorpus:
  """Token id sequences (each ending with EOS) of aligned source and target sentences."""
  source: list
  target: list
  # Index of each kept pair in the original files (to restore input order after decoding).
  line_numbers: np.ndarray

  def __len__(self):
    return len(self.source)


def tokenize_parallel(src_lines, tgt_lines, tokenizer, max_length=None):
  """Tokenizes both sides; drops pairs with an empty side or (if max_length) too many tokens."""
  src_ids, tgt_ids = tokenizer.encode(src_lines), tokenizer.encode(tgt_lines)
  keep = [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids))
          if len(s) > 1 and len(t) > 1 and (not max_length or max(len(s), len(t)) <= max_length)]
  return TokenizedCorpus([src_ids[i] for i in keep], [tgt_ids[i] for i in keep], np.asarray(keep, np.int64))


def bucket_length(length, buckets):
  """The smallest bucket that holds `length` tokens (lengths beyond the last bucket round up to x8)."""
  for b in buckets:
    if length <= b:
      return b
  return -(-length // 8) * 8


def batch_size_for(padded_length, tokens_per_batch, multiple_of=1):
  """Rows per batch in a bucket: as many as the token budget allows, a multiple of `multiple_of` (devices)."""
  rows = max(tokens_per_batch // padded_length, 1)
  return max(rows // multiple_of, 1) * multiple_of


def pad_rows(sequences, rows, length, prefix=None):
  """[rows, length] int32 of PAD holding `sequences` (each optionally shifted right behind `prefix`)."""
  out = np.full((rows, length), tokenizer_lib.PAD_ID, np.int32)
  for r, seq in enumerate(sequences):
    seq = seq if prefix is None else [prefix] + seq[:-1]
    out[r, :len(seq)] = seq
  return out


def make_batch(src_seqs, tgt_seqs, rows, length):
  """Padded arrays for the model.

  src:     source tokens + EOS
  tgt_in:  BOS + target tokens (the decoder input, shifted right)
  tgt_out: target tokens + EOS (what the decoder predicts); PAD marks positions without a target.
  """
  return {
      'src': pad_rows(src_seqs, rows, length),
      'tgt_in': pad_rows(tgt_seqs, rows, length, prefix=tokenizer_lib.BOS_ID),
      'tgt_out': pad_rows(tgt_seqs, rows, length),
  }


def plan_batches(lengths, buckets, tokens_per_batch, multiple_of, order):
  """Groups example indices (taken in `order`) by bucket into lists of at most the bucket's batch size."""
  by_bucket = {}
  for i in order:
    by_bucket.setdefault(bucket_length(lengths[i], buckets), []).append(i)
  plan = []
  for padded, members in sorted(by_bucket.items()):
    rows = batch_size_for(padded, tokens_per_batch, multiple_of)
    for start in range(0, len(members), rows):
      plan.append((padded, rows, members[start:start + rows]))
  return plan


class TrainBatches:
  """Endless shuffled token-budget batches with a saveable position.

  Epoch e is planned from `np.random.default_rng((seed, e))`: examples are shuffled, grouped by bucket, and
  the batches shuffled again, so a restart at {'epoch': e, 'batch': b} yields exactly the batches an
  uninterrupted run would have.
  """

  def __init__(self, corpus, *, tokens_per_batch, buckets, seed, multiple_of=1):
    self.corpus = corpus
    self.tokens_per_batch = tokens_per_batch
    self.buckets = tuple(buckets)
    self.seed = seed
    self.multiple_of = multiple_of
    self.lengths = np.array([max(len(s), len(t)) for s, t in zip(corpus.source, corpus.target)])
    self.epoch, self.batch = 0, 0
    self._plan_epoch = None
    self._plan = None

  def state(self):
    return {'epoch': self.epoch, 'batch': self.batch, 'seed': self.seed}

  def restore(self, state):
    if state['seed'] != self.seed:
      raise ValueError(f"checkpointed data seed {state['seed']} differs from the config's seed {self.seed}")
    self.epoch, self.batch = int(state['epoch']), int(state['batch'])

  def plan(self, epoch):
    if self._plan_epoch != epoch:
      rng = np.random.default_rng((self.seed, epoch))
      plan = plan_batches(self.lengths, self.buckets, self.tokens_per_batch, self.multiple_of,
                           rng.permutation(len(self.lengths)))
      self._plan = [plan[i] for i in rng.permutation(len(plan))]
      self._plan_epoch = epoch
    return self._plan

  def __iter__(self):
    return self

  def __next__(self):
    plan = self.plan(self.epoch)
    if self.batch >= len(plan):
      self.epoch, self.batch = self.epoch + 1, 0
      plan = self.plan(self.epoch)
    padded, rows, members = plan[self.batch]
    self.batch += 1
    return make_batch([self.corpus.source[i] for i in members], [self.corpus.target[i] for i in members],
                      rows, padded)

  def batches_per_epoch(self):
    return len(self.plan(self.epoch))


def eval_batches(corpus, *, tokens_per_batch, buckets, multiple_of=1):
  """Deterministic batches over a whole corpus (sorted by length), for validation loss."""
  lengths = [max(len(s), len(t)) for s, t in zip(corpus.source, corpus.target)]
  order = np.argsort(lengths, kind='stable')
  for padded, rows, members in plan_batches(lengths, buckets, tokens_per_batch, multiple_of, order):
    yield make_batch([corpus.source[i] for i in members], [corpus.target[i] for i in members], rows, padded)
