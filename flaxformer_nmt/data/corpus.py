"""Sentence pairs -> token ids (cached) -> token-budget batches, each host reading its own part.

The road of a sentence pair: a corpus (corpora.py: checked local text, or a TFDS builder) yields (source,
target) text; both sides are tokenized with the joint vocabulary (EOS appended) once, and the ids are cached
in the workdir, so a restarted run does not tokenize again; overlong pairs are left out; pairs are grouped by
padded length into batches of about `tokens_per_batch` tokens per side.

Every batch of a bucket has the same shape, so the jitted train step compiles once per length bucket. A
training epoch's batches are a pure function of (seed, epoch), and the iterator's position is the small
dict `{'epoch', 'batch', 'seed'}`: saving it with a checkpoint makes resumption exact.

On several hosts every host plans the same global batches (from the lengths of all pairs) and builds only
its own slice of rows: the hosts' rows are disjoint and together are the global batch, and every host's
array has the same shape at every step, as the sharded train step needs.
"""
import dataclasses
import io
import itertools
import json
import queue
import sys
import threading
import time

import numpy as np
from absl import logging
from etils import epath

from flaxformer_nmt.data import packing
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import EOS_ID


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


def read_chunks(path, size):
  """Lists of up to `size` lines of a file or stdin (-), read as they arrive; bad UTF-8 names the line."""
  name = '<stdin>' if path == '-' else path
  stream = sys.stdin.buffer if path == '-' else epath.Path(path).open('rb')  # gs:// too
  number = 0
  try:
    while raw_lines := list(itertools.islice(stream, size)):
      chunk = []
      for raw in raw_lines:
        number += 1
        try:
          chunk.append(raw.decode('utf-8').rstrip('\r\n'))
        except UnicodeDecodeError as e:
          raise DataError(f'{name}:{number}: invalid UTF-8 ({e.reason} at byte {e.start})') from None
      yield chunk
  finally:
    if stream is not sys.stdin.buffer:
      stream.close()


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
      empty, other = (src_path, tgt_path) if not s else (tgt_path, src_path)
      problem = f'{empty}:{number}: empty line while {other}:{number} has text'
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


class Ragged:
  """Variable-length token id sequences stored flat: sequence i is tokens[offsets[i]:offsets[i + 1]]."""

  def __init__(self, tokens, offsets):
    self.tokens, self.offsets = tokens, offsets

  @classmethod
  def from_lists(cls, sequences, dtype=np.int32):
    lengths = np.array([len(s) for s in sequences], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for s in sequences for t in s), dtype, count=int(offsets[-1]))
    return cls(tokens, offsets)

  @property
  def lengths(self):
    return np.diff(self.offsets)

  def __len__(self):
    return len(self.offsets) - 1

  def __getitem__(self, i):
    return self.tokens[self.offsets[i]:self.offsets[i + 1]]


@dataclasses.dataclass
class TokenizedCorpus:
  """Token ids (each sentence ending with EOS) of aligned source and target sentences; pair i is
  (source[i], target[i]). Empty sentences have length 0 (no EOS)."""
  source: Ragged
  target: Ragged

  @classmethod
  def from_lists(cls, source, target):
    return cls(Ragged.from_lists(source), Ragged.from_lists(target))

  def __len__(self):
    return len(self.source)

  def lengths(self):
    """Tokens of the longer side of every pair (what its padded batch row needs)."""
    return np.maximum(self.source.lengths, self.target.lengths)

  def usable(self, max_length=None):
    """Indices of the pairs to train on: both sides non-empty and, with max_length, no side longer."""
    src, tgt = self.source.lengths, self.target.lengths
    keep = (src > 1) & (tgt > 1)
    if max_length:
      keep &= np.maximum(src, tgt) <= max_length
    return np.flatnonzero(keep)


def _concatenate(corpora):
  def join(parts):
    offsets = [np.zeros(1, np.int64)]
    total = 0
    for part in parts:
      offsets.append(part.offsets[1:] + total)
      total += int(part.offsets[-1])
    return Ragged(np.concatenate([p.tokens for p in parts]), np.concatenate(offsets))
  return TokenizedCorpus(join([c.source for c in corpora]), join([c.target for c in corpora]))


def both_directions(corpus, examples):
  """(corpus, examples) with every pair also reversed: pair len(corpus) + i is (target[i], source[i])."""
  reverse = TokenizedCorpus(corpus.target, corpus.source)
  return _concatenate([corpus, reverse]), np.concatenate([examples, examples + len(corpus)])


def right_to_left(config):
  """Whether a model writes its targets right to left (config.target_right_to_left)."""
  return bool(config.get('target_right_to_left', False))


def reverse_before_eos(ids):
  """Token ids with the ones before a final EOS in reverse order (EOS stays last); ids without a final EOS are
  reversed whole. Its own inverse: a right-to-left model's output back in reading order."""
  ids = list(ids)
  if ids and ids[-1] == EOS_ID:
    return ids[-2::-1] + [EOS_ID]
  return ids[::-1]


def right_to_left_targets(corpus):
  """The corpus with every target's tokens before its EOS in reverse order (config.target_right_to_left)."""
  target = corpus.target
  lengths = target.lengths
  starts = np.repeat(target.offsets[:-1], lengths)
  ends = np.repeat(target.offsets[1:], lengths)  # one past each sequence's EOS
  position = np.arange(len(target.tokens)) - starts
  before_eos = starts + position < ends - 1
  source_index = np.where(before_eos, ends - 2 - position, starts + position)
  if len(target.tokens) and not np.all(target.tokens[ends - 1] == EOS_ID):
    raise ValueError('every non-empty target must end with EOS to be reversed before it')
  return TokenizedCorpus(corpus.source, Ragged(target.tokens[source_index], target.offsets))


def _encode(tokenizer, lines, num_threads):
  ids = tokenizer.encode(lines, num_threads=num_threads)
  # An empty line stays empty (no EOS), so that `usable` can leave it out.
  return [seq if len(seq) > 1 else [] for seq in ids]


def tokenize(source_lines, target_lines, tokenizer, num_threads=0):
  """Token ids of parallel lines, in memory (no cache). target_lines None (monolingual text, lm/mlm):
  the lines are tokenized once and serve as both sides."""
  source = Ragged.from_lists(_encode(tokenizer, source_lines, num_threads))
  if target_lines is None:
    return TokenizedCorpus(source, source)
  return TokenizedCorpus(source, Ragged.from_lists(_encode(tokenizer, target_lines, num_threads)))


# Pairs per cache file: the unit of work a host tokenizes. Fixed, so the cache does not depend on how many
# hosts wrote it.
CHUNK_PAIRS = 100_000


def _no_barrier(name):
  del name


def tokenize_cached(pairs, tokenizer, cache_dir, *, process_index=0, process_count=1, barrier=_no_barrier,
                    num_threads=0, chunk_pairs=CHUNK_PAIRS):
  """Token ids of every pair of `pairs` (a corpora.* corpus), tokenized once and cached in `cache_dir`.

  The cache is a directory of `chunk_NNNNN.npz` files of `chunk_pairs` pairs and a `meta.json` naming what
  they hold (the corpus's fingerprint and the vocabulary's hash): a different corpus or vocabulary is
  tokenized again. Host p tokenizes the chunks p, p + P, p + 2P, ... that are not cached yet (sentencepiece
  spreads each chunk over `num_threads` threads); after a barrier every host loads every chunk, so the
  cache must be on storage all hosts share (as the workdir must be for checkpoints).
  """
  cache_dir = epath.Path(cache_dir)
  meta = {'fingerprint': pairs.fingerprint, 'vocabulary_sha256': tokenizer.sha256, 'pairs': len(pairs),
          'chunk_pairs': chunk_pairs, 'dtype': 'uint16' if tokenizer.vocab_size <= 1 << 16 else 'int32'}
  meta_path = cache_dir / 'meta.json'
  if process_index == 0:
    if not meta_path.exists() or json.loads(meta_path.read_text()) != meta:
      if cache_dir.exists():
        logging.info('Tokenization cache %s is for other data or another vocabulary: rebuilding it', cache_dir)
        cache_dir.rmtree()
      cache_dir.mkdir(parents=True, exist_ok=True)
      meta_path.write_text(json.dumps(meta, sort_keys=True))
  barrier(f'tokenize-meta-{cache_dir}')

  num_chunks = -(-len(pairs) // chunk_pairs)
  chunk_path = lambda c: cache_dir / f'chunk_{c:05d}.npz'
  start_time, tokenized_pairs = time.time(), 0
  for c in range(process_index, num_chunks, process_count):
    if chunk_path(c).exists():
      continue
    indices = range(c * chunk_pairs, min((c + 1) * chunk_pairs, len(pairs)))
    source, target = pairs.read(indices)
    part = tokenize(source, target, tokenizer, num_threads)
    buffer = io.BytesIO()
    arrays = dict(source_tokens=part.source.tokens.astype(meta['dtype']), source_offsets=part.source.offsets)
    if part.target is not part.source:  # monolingual text is stored once
      arrays.update(target_tokens=part.target.tokens.astype(meta['dtype']), target_offsets=part.target.offsets)
    np.savez(buffer, **arrays)
    # Write then rename: a crash never leaves a truncated chunk that a later run would trust.
    tmp = cache_dir / f'.chunk_{c:05d}.npz.tmp{process_index}'
    tmp.write_bytes(buffer.getvalue())
    tmp.rename(chunk_path(c))
    tokenized_pairs += len(indices)
  if tokenized_pairs:
    seconds = time.time() - start_time
    logging.info('Tokenized %d pairs of %s in %.1f s (%.0f pairs/s) into %s', tokenized_pairs, pairs.description,
                 seconds, tokenized_pairs / max(seconds, 1e-9), cache_dir)
  barrier(f'tokenize-chunks-{cache_dir}')

  parts = []
  for c in range(num_chunks):
    if not chunk_path(c).exists():
      raise DataError(f'{chunk_path(c)} is missing after every host tokenized its part: the workdir must be on '
                      'storage shared by all hosts')
    with np.load(io.BytesIO(chunk_path(c).read_bytes())) as f:
      source = Ragged(f['source_tokens'], f['source_offsets'])
      target = Ragged(f['target_tokens'], f['target_offsets']) if 'target_tokens' in f else source
      parts.append(TokenizedCorpus(source, target))
  if not parts:
    return TokenizedCorpus.from_lists([], [])
  corpus = _concatenate(parts)
  if all(p.target is p.source for p in parts):
    corpus.target = corpus.source
  return corpus


def split_long(corpus, max_length):
  """Monolingual text (lm/mlm) with every sequence longer than `max_length` tokens cut into consecutive
  pieces of at most `max_length` (documents a line are trained on whole, not dropped as overlong pairs
  are). Only the last piece of a line ends with EOS; each piece starts a new row (BOS in the LM)."""
  lengths = corpus.source.lengths
  if not len(lengths) or lengths.max() <= max_length:
    return corpus
  pieces = np.maximum(-(-lengths // max_length), 1)
  starts = np.repeat(corpus.source.offsets[:-1], pieces) + max_length * (
      np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces))
  ends = np.minimum(starts + max_length, np.repeat(corpus.source.offsets[1:], pieces))
  index = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if len(starts) else np.zeros(0, np.int64)
  offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
  text = Ragged(corpus.source.tokens[index], offsets)
  logging.info('Cut %d lines longer than %d tokens into pieces: %d sequences', int((lengths > max_length).sum()),
               max_length, len(text))
  return TokenizedCorpus(text, text)


def sample_segmentation(corpus, pairs, tokenizer, *, dropout, seed, epoch, examples, max_length,
                        chunk_pairs=CHUNK_PAIRS):
  """`corpus` with the pairs of `examples` segmented anew by BPE-dropout for `epoch` (config.bpe_dropout), so
  that every epoch trains on other pieces of the same sentences, drawn from (seed, epoch) (repeatable within a
  process only: SavedSegmentations keeps each epoch's draw). `pairs` is the corpora.* corpus `corpus` was
  tokenized from: its text is read again.

  A pair whose sampled pieces are longer than `max_length` on either side keeps its deterministic pieces, so
  the batching limits hold. The other pairs (never trained on) are left as they are.
  """
  source = [corpus.source[i] for i in range(len(corpus))]
  target = [corpus.target[i] for i in range(len(corpus))]
  examples = np.sort(np.asarray(examples))
  pieces_before, pieces_after, kept = 0, 0, 0
  for start in range(0, len(examples), chunk_pairs):
    indices = examples[start:start + chunk_pairs]
    chunk_seed = int(np.random.SeedSequence((seed, epoch, start)).generate_state(1)[0])
    source_text, target_text = pairs.read(indices)
    sampled_source = tokenizer.encode_sampled(source_text, dropout, chunk_seed)
    sampled_target = tokenizer.encode_sampled(target_text, dropout, chunk_seed + 1)
    for i, src, tgt in zip(indices, sampled_source, sampled_target):
      pieces_before += len(source[i]) + len(target[i])
      if max(len(src), len(tgt)) > max_length:
        kept += 1
        pieces_after += len(source[i]) + len(target[i])
        continue
      source[i], target[i] = np.asarray(src, np.int32), np.asarray(tgt, np.int32)
      pieces_after += len(src) + len(tgt)
  logging.info('Epoch %d: BPE-dropout %.2f resegmented %d pairs, %+.1f%% pieces; %d kept their deterministic '
               'pieces (longer than %d)', epoch, dropout, len(examples),
               100 * (pieces_after / max(pieces_before, 1) - 1), kept, max_length)
  dtype = corpus.source.tokens.dtype  # uint16 from the tokenization cache for vocabularies up to 65,536
  flat = lambda sequences: Ragged(np.concatenate([np.zeros(0, dtype), *sequences]).astype(dtype),
                                  np.concatenate([[0], np.cumsum([len(x) for x in sequences])]).astype(np.int64))
  return TokenizedCorpus(flat(source), flat(target))


class SavedSegmentations:
  """epoch -> the training corpus segmented for that epoch by BPE-dropout (`sample(epoch)`, e.g. a partial of
  `sample_segmentation`), sampled once and saved in `directory`, then read back by every later call, host
  and run of the workdir.

  sentencepiece's sampling is not a function of its seed across processes, so the saved sample is what keeps
  a resumed run on the batches of an uninterrupted one and all hosts on the same pieces: process 0 samples
  and writes `epoch_EEEEEE.npz` (write then rename), the others wait for it (shared storage, as the
  checkpoints need). A file written for other settings (`fingerprint`: vocabulary, dropout, seed, pairs) is
  not used. The newest `keep_epochs` epochs are kept: a resume from a checkpoint older than those samples
  its epoch anew, with a warning.
  """

  def __init__(self, directory, sample, *, fingerprint, is_leader=True, keep_epochs=5, wait_seconds=600.0):
    self.directory = epath.Path(directory)
    self.sample = sample
    self.fingerprint = json.dumps(fingerprint, sort_keys=True)
    self.is_leader = is_leader
    self.keep_epochs = keep_epochs
    self.wait_seconds = wait_seconds

  def path(self, epoch):
    return self.directory / f'epoch_{epoch:06d}.npz'

  def __call__(self, epoch):
    corpus = self._load(epoch)
    if corpus is not None:
      return corpus
    if not self.is_leader:
      return self._wait(epoch)
    if any(saved >= epoch for saved in self._saved_epochs()):  # a resume into epochs sampled before
      logging.warning('No saved BPE-dropout sample of epoch %d in %s (older than the newest %d epochs kept, or '
                      'written for other settings): sampling it anew, so its batches differ from the first '
                      'run\'s.', epoch, self.directory, self.keep_epochs)
    corpus = self.sample(epoch)
    self._save(epoch, corpus)
    for saved in self._saved_epochs():
      if saved <= epoch - self.keep_epochs:
        self.path(saved).unlink()
    return corpus

  def _saved_epochs(self):
    if not self.directory.exists():
      return []
    return sorted(int(p.name[len('epoch_'):-len('.npz')]) for p in self.directory.glob('epoch_*.npz'))

  def _load(self, epoch):
    path = self.path(epoch)
    if not path.exists():
      return None
    with np.load(io.BytesIO(path.read_bytes())) as f:
      if str(f['fingerprint']) != self.fingerprint:
        return None
      return TokenizedCorpus(Ragged(f['source_tokens'], f['source_offsets']),
                             Ragged(f['target_tokens'], f['target_offsets']))

  def _save(self, epoch, corpus):
    self.directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, fingerprint=np.array(self.fingerprint), source_tokens=corpus.source.tokens,
             source_offsets=corpus.source.offsets, target_tokens=corpus.target.tokens,
             target_offsets=corpus.target.offsets)
    tmp = self.directory / f'.{self.path(epoch).name}.tmp'
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(self.path(epoch))  # over a sample written for other settings

  def _wait(self, epoch):
    deadline = time.time() + self.wait_seconds
    while time.time() < deadline:
      corpus = self._load(epoch)
      if corpus is not None:
        return corpus
      time.sleep(0.5)
    raise DataError(f'{self.path(epoch)} (the BPE-dropout sample of epoch {epoch}, written by process 0) did not '
                    f'appear within {self.wait_seconds:.0f} s: the workdir must be on storage all hosts share')


def bucket_length(length, buckets):
  """The smallest bucket that holds `length` tokens (lengths beyond the last bucket round up to x8)."""
  return int(bucket_lengths(np.asarray([length]), buckets)[0])


def bucket_lengths(lengths, buckets):
  """`bucket_length` of every entry of an int array."""
  buckets = np.asarray(sorted(buckets))
  lengths = np.asarray(lengths)
  index = np.searchsorted(buckets, lengths)  # first bucket >= length
  beyond = -(-lengths // 8) * 8
  return np.where(index < len(buckets), buckets[np.minimum(index, len(buckets) - 1)], beyond)


def batch_size_for(padded_length, tokens_per_batch, multiple_of=1):
  """Rows per batch in a bucket: as many as the token budget allows, a multiple of `multiple_of` (devices)."""
  rows = max(tokens_per_batch // padded_length, 1)
  return max(rows // multiple_of, 1) * multiple_of


def pad_rows(sequences, rows, length, prefix=None):
  """[rows, length] int32 of PAD holding `sequences` (each optionally shifted right behind `prefix`)."""
  out = np.full((rows, length), tokenizer_lib.PAD_ID, np.int32)
  for r, seq in enumerate(sequences):
    n = len(seq)
    if prefix is None:
      out[r, :n] = seq
    elif n:
      out[r, 0] = prefix
      out[r, 1:n] = seq[:-1]
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
  """Groups example indices (taken in `order`) by bucket into arrays of at most the bucket's batch size.

  Returns [(padded length, rows, member indices)], buckets in increasing length, members in `order`.
  """
  order = np.asarray(order, np.int64)
  padded = bucket_lengths(np.asarray(lengths)[order], buckets)
  by_bucket = np.argsort(padded, kind='stable')  # stable: keeps `order` within a bucket
  order, padded = order[by_bucket], padded[by_bucket]
  plan = []
  for length, start, count in zip(*np.unique(padded, return_index=True, return_counts=True)):
    rows = batch_size_for(int(length), tokens_per_batch, multiple_of)
    members = order[start:start + count]
    for first in range(0, count, rows):
      plan.append((int(length), rows, members[first:first + rows]))
  return plan


def layout_rows(rows, pad_rows_to):
  """Rows of a planned batch as the devices take it: padded with empty (all-PAD) rows up to a multiple of
  `pad_rows_to`. Empty rows have no targets, so they add nothing to the loss, its gradient or its count."""
  return -(-rows // pad_rows_to) * pad_rows_to


def host_slice(members, rows, process_index, process_count):
  """This host's part of a global batch's members, and its number of rows."""
  if rows % process_count:
    raise ValueError(f'{rows} rows cannot be split over {process_count} hosts')
  host_rows = rows // process_count
  return members[process_index * host_rows:(process_index + 1) * host_rows], host_rows


class BatchingError(DataError):
  """A checkpoint's data position that belongs to other batches than the config now plans."""


class TrainBatches:
  """Endless shuffled token-budget batches with a saveable position, built ahead in a background thread.

  Epoch e is planned from `np.random.default_rng((seed, e))`: the usable examples are shuffled, grouped by
  bucket, and the batches shuffled again, so a restart at {'epoch': e, 'batch': b} yields exactly the
  batches an uninterrupted run would have. Batches are padded `prefetch` ahead of the train step by a
  thread; the position is that of the batches handed out, not of those built ahead.

  The plan depends only on the examples, the seed and the batching settings (token budget, buckets, packed
  length, and `multiple_of`, the row granularity), never on the machine: the devices and hosts only decide
  how a planned batch is laid out, padded with empty rows to a multiple of `pad_rows_to` (devices x
  microbatches) and split over hosts. So a run resumed on another number of devices or hosts, or with other
  gradient accumulation, trains on the same global batches. The position is saved with the batching
  settings, and `restore` refuses a position planned with other ones.

  With `resegment` (BPE-dropout: epoch -> the corpus segmented for that epoch, a SavedSegmentations) each
  epoch is planned and built from its own segmentation, saved with the workdir, so a resumed run plans the
  epoch it resumes in from the same pieces.

  With `bidirectional_epochs` (bidirectional training, Ding et al. 2021) the first that many epochs hold every
  example twice, as it is and reversed (target -> source), shuffled together: twice the batches an epoch.
  """

  def __init__(self, corpus, *, tokens_per_batch, buckets, seed, multiple_of=1, pad_rows_to=1, examples=None,
               process_index=0, process_count=1, prefetch=2, packed_length=0, max_length=None,
               packing_open_rows=packing.OPEN_ROWS, bpe_dropout=0.0, resegment=None, bidirectional_epochs=0):
    if bool(bpe_dropout) != (resegment is not None):
      raise ValueError('bpe_dropout and resegment go together')
    self.corpus = corpus
    self.resegment = resegment
    self.examples = np.arange(len(corpus)) if examples is None else np.asarray(examples)
    self.bidirectional_epochs = int(bidirectional_epochs)
    self.tokens_per_batch = tokens_per_batch
    self.buckets = tuple(buckets)
    self.seed = seed
    self.multiple_of = multiple_of
    # Every host must get the same number of rows: the layout is a multiple of the host count too.
    self.pad_rows_to = int(np.lcm(pad_rows_to, process_count))
    self.process_index, self.process_count = process_index, process_count
    # What the saved position depends on besides the seed, by config field: a change moves every batch.
    self.batching = {'tokens_per_batch': int(tokens_per_batch), 'length_buckets': [int(b) for b in self.buckets],
                     'max_length': max_length, 'packed_length': int(packed_length),
                     'packing_open_rows': int(packing_open_rows) if packed_length else 0,
                     'batch_rows_multiple': int(multiple_of), 'bpe_dropout': float(bpe_dropout),
                     'bidirectional_epochs': self.bidirectional_epochs, 'training_examples': int(self.examples.size)}
    self.prefetch = prefetch
    self.lengths = corpus.lengths()
    # > 0: several examples per row of this many tokens (packing.py), every batch one shape.
    self.packed_length = packed_length
    self.packing_open_rows = packing_open_rows
    if packed_length and self.examples.size and self.lengths[self.examples].max() > packed_length:
      raise ValueError(f'examples longer than packed_length={packed_length}: filter them first')
    self.epoch, self.batch = 0, 0
    self._plans = {}
    self._plan_lock = threading.Lock()
    self._worker = None

  def state(self):
    """The position of the batches handed out, with what their plan depends on."""
    return {'epoch': self.epoch, 'batch': self.batch, 'seed': self.seed, 'batching': dict(self.batching),
            'batches_in_epoch': len(self.plan(self.epoch))}

  def restore(self, state, allow_batching_change=False):
    """Continues from a saved position. A position planned with other batching settings points into other
    batches: that is a BatchingError naming the settings, unless `allow_batching_change`, which continues in
    the same epoch at the same fraction of it, with a warning."""
    if state['seed'] != self.seed:
      raise BatchingError(f"the checkpoint's data position was planned with config.seed={state['seed']}, now "
                          f'{self.seed}: resume with the original seed, or start a new --workdir')
    self.close()
    epoch, batch = int(state['epoch']), int(state['batch'])
    saved = state.get('batching')
    if saved is not None and 'packing_open_rows' not in saved:  # saved before the field: packed rows were next fit
      saved = {**saved, 'packing_open_rows': 1 if saved.get('packed_length') else 0}
    if saved is not None and 'bpe_dropout' not in saved:  # saved before the field: deterministic pieces
      saved = {**saved, 'bpe_dropout': 0.0}
    if saved is not None and 'bidirectional_epochs' not in saved:  # saved before the field: one direction
      saved = {**saved, 'bidirectional_epochs': 0}
    if saved is None:
      logging.warning('The checkpoint\'s data position (epoch %d, batch %d) was saved without its batching '
                      'settings (an older checkpoint): assuming they are unchanged.', epoch, batch)
    changed = [f'config.{field} was {saved.get(field)!r}, now {value!r}' for field, value in self.batching.items()
               if saved is not None and saved.get(field) != value]
    if changed and not allow_batching_change:
      raise BatchingError(
          f"the checkpoint's data position (epoch {epoch}, batch {batch}) belongs to other batches: "
          f"{'; '.join(changed)}. Restore the setting to resume exactly, or pass "
          '--config.allow_batching_change=true to continue in the same epoch with the new batches.')
    if changed:
      new_batches = len(self.plan(epoch))
      batch = min(round(batch / max(int(state.get('batches_in_epoch') or 0), 1) * new_batches), new_batches)
      logging.warning('Batching changed (%s; --config.allow_batching_change): continuing in epoch %d at batch '
                      '%d of %d, the same fraction of the epoch; the batches differ from those of an '
                      'uninterrupted run.', '; '.join(changed), epoch, batch, new_batches)
    self.epoch, self.batch = epoch, batch

  def plan(self, epoch):
    """The global batches of `epoch`: [(padded length, rows, member example indices)]."""
    return self._epoch(epoch)[1]

  def corpus_of(self, epoch):
    """The token ids `epoch` is built from: the corpus, or with BPE-dropout that epoch's segmentation (in a
    bidirectional epoch, followed by its pairs reversed)."""
    return self._epoch(epoch)[0]

  def _epoch(self, epoch):
    """(corpus, plan) of `epoch`, made once."""
    with self._plan_lock:
      if epoch not in self._plans:
        corpus = self.resegment(epoch) if self.resegment else self.corpus
        examples = self.examples
        if epoch < self.bidirectional_epochs:
          corpus, examples = both_directions(corpus, examples)
        rng = np.random.default_rng((self.seed, epoch))
        order = rng.permutation(examples)
        if self.packed_length:
          plan = self._plan_packed(corpus, order)
        else:
          plan = plan_batches(corpus.lengths(), self.buckets, self.tokens_per_batch, self.multiple_of, order)
        # The consumer's epoch and the one the background thread may have moved on to.
        self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
        self._plans[epoch] = (corpus, [plan[i] for i in rng.permutation(len(plan))])
      return self._plans[epoch]

  def _plan_packed(self, corpus, order):
    """Packed batches: examples (in `order`) fill rows of packed_length tokens a side, rows fill batches.
    A batch's members are its rows, each an array of example indices."""
    rows = packing.plan_rows(corpus.source.lengths[order], corpus.target.lengths[order],
                             self.packed_length, self.packing_open_rows)
    rows = [order[r] for r in rows]
    per_batch = batch_size_for(self.packed_length, self.tokens_per_batch, self.multiple_of)
    return [(self.packed_length, per_batch, rows[i:i + per_batch]) for i in range(0, len(rows), per_batch)]

  def host_members(self, epoch, batch):
    """This host's example indices of the batch at (epoch, batch) (packed: its rows), and its number of rows."""
    _, rows, members = self.plan(epoch)[batch]
    return host_slice(members, layout_rows(rows, self.pad_rows_to), self.process_index, self.process_count)

  def _build(self, epoch, batch):
    """(the batch at this position, the position after it)."""
    if batch >= len(self.plan(epoch)):
      epoch, batch = epoch + 1, 0
    padded = self.plan(epoch)[batch][0]
    members, rows = self.host_members(epoch, batch)
    corpus = self.corpus_of(epoch)
    if self.packed_length:
      arrays = packing.make_packed_batch(corpus.source, corpus.target, members, rows, padded)
      return arrays, (epoch, batch + 1)
    arrays = make_batch([corpus.source[i] for i in members], [corpus.target[i] for i in members], rows, padded)
    return arrays, (epoch, batch + 1)

  def _produce(self, out, stop, epoch, batch):
    def put(item):  # waits for room, unless asked to stop (then close() can join this thread)
      while not stop.is_set():
        try:
          out.put(item, timeout=0.1)
          return
        except queue.Full:
          pass
    try:
      while not stop.is_set():
        item = self._build(epoch, batch)
        epoch, batch = item[1]
        put(item)
    except Exception as e:  # pylint: disable=broad-except
      put(e)  # raised in the consumer's thread

  def __iter__(self):
    return self

  def __next__(self):
    if self.prefetch <= 0:
      arrays, (self.epoch, self.batch) = self._build(self.epoch, self.batch)
      return arrays
    if self._worker is None:
      out, stop = queue.Queue(maxsize=self.prefetch), threading.Event()
      thread = threading.Thread(target=self._produce, args=(out, stop, self.epoch, self.batch), daemon=True,
                                name='TrainBatches')
      thread.start()
      self._worker = (thread, out, stop)
    item = self._worker[1].get()
    if isinstance(item, Exception):
      self.close()
      raise item
    arrays, (self.epoch, self.batch) = item
    return arrays

  def close(self):
    """Stops the background thread (batches built ahead are dropped; the position is unaffected)."""
    if self._worker is not None:
      thread, _, stop = self._worker
      stop.set()
      thread.join()
      self._worker = None

  def batches_per_epoch(self):
    return len(self.plan(self.epoch))


def eval_batches(corpus, *, tokens_per_batch, buckets, multiple_of=1, examples=None, process_index=0,
                 process_count=1):
  """Deterministic batches over the corpus (sorted by length), this host's rows of each, for validation."""
  examples = corpus.usable() if examples is None else np.asarray(examples)
  lengths = corpus.lengths()
  order = examples[np.argsort(lengths[examples], kind='stable')]
  for padded, rows, members in plan_batches(lengths, buckets, tokens_per_batch, multiple_of, order):
    members, host_rows = host_slice(members, rows, process_index, process_count)
    yield make_batch([corpus.source[i] for i in members], [corpus.target[i] for i in members], host_rows, padded)
