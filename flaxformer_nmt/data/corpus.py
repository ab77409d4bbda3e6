"""Sentence pairs -> token ids, cached: reading and checking text, tokenizing with the joint vocabulary, and the
corpora of token ids that batching.py plans batches from.

The road of a sentence pair: a corpus (corpora.py: checked local text, or a TFDS builder) yields (source,
target) text; both sides are tokenized with the joint vocabulary (EOS appended) once, and the ids are cached
in the workdir, so a restarted run does not tokenize again; overlong pairs are left out.
"""
import dataclasses
import io
import itertools
import json
import sys
import time

import numpy as np
from absl import logging
from etils import epath

from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import EOS_ID


class DataError(ValueError):
  """Bad input data; the message names the file and line."""


BOM = '\ufeff'.encode('utf-8')  # a byte order mark: not text (it would cling to the first line's first word)


def read_lines(path):
  """The lines of a UTF-8 text file, whitespace-normalized; errors name the file and line."""
  return [tokenizer_lib.normalize_whitespace(line) for line in read_text_lines(path)]


def read_text_lines(path):
  """The lines of a UTF-8 text file as they are, split at \\n alone (a line's final \\r dropped) and a byte order
  mark that some editors write first left out, as read_chunks splits the decode command's input; errors name the
  file and line."""
  path = epath.Path(path)
  if not path.exists():
    raise DataError(f'{path}: file not found')
  try:
    lines = path.read_bytes().removeprefix(BOM).split(b'\n')
  except OSError as e:  # a directory, no permission
    raise DataError(f'{path}: {e.strerror or e}') from None
  if lines and lines[-1] == b'':
    lines.pop()
  out = []
  for number, line in enumerate(lines, start=1):
    try:
      out.append(line.decode('utf-8').rstrip('\r'))
    except UnicodeDecodeError as e:
      raise DataError(f'{path}:{number}: invalid UTF-8 ({e.reason} at byte {e.start})') from None
  return out


def read_chunks(path, size):
  """Lists of up to `size` lines of a file or stdin (-), read as they arrive; bad UTF-8 names the line. The
  file opens here (a missing one raises OSError now, not at the first chunk)."""
  if size < 1:
    raise ValueError(f'chunks of {size} lines: give at least 1')
  name = '<stdin>' if path == '-' else path
  stream = sys.stdin.buffer if path == '-' else epath.Path(path).open('rb')  # gs:// too
  return _chunks(stream, name, size)


def _chunks(stream, name, size):
  number = 0
  try:
    while raw_lines := list(itertools.islice(stream, size)):
      chunk = []
      for raw in raw_lines:
        number += 1
        try:
          chunk.append((raw.removeprefix(BOM) if number == 1 else raw).decode('utf-8').rstrip('\r\n'))
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
  """(source lines, target lines, the 0-based line index of each pair, the files' line count) of one split,
  checked to be non-empty and aligned.

  A pair with one empty side (a sign of misaligned files) or a line over `max_line_chars` characters (a sign
  of a broken file) is an error naming the file and line, or with `skip_bad_pairs` is dropped and counted.
  Pairs empty on both sides are kept, so that pair i stays line i (validation references read by line number):
  they tokenize to empty pairs, which training and validation loss leave out (TokenizedCorpus.usable).
  """
  src_path, tgt_path = split_paths(data_dir, split, source_lang, target_lang)
  src, tgt = read_lines(src_path), read_lines(tgt_path)
  if not src:
    raise DataError(f'{src_path}: file is empty')
  if len(src) != len(tgt):
    raise DataError(f'{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: the sides must be aligned')
  keep, bad = [], 0
  for number, (s, t) in enumerate(zip(src, tgt), start=1):
    problem = None
    if bool(s) != bool(t):
      empty, other = (src_path, tgt_path) if not s else (tgt_path, src_path)
      problem = f'{empty}:{number}: empty line while {other}:{number} has text'
    elif max_line_chars and max(len(s), len(t)) > max_line_chars:
      path, chars = (src_path, len(s)) if len(s) >= len(t) else (tgt_path, len(t))
      problem = f'{path}:{number}: line of {chars:,} characters (config.max_line_chars={max_line_chars:,})'
    if problem is None:
      keep.append(number - 1)
    elif skip_bad_pairs:
      bad += 1
    else:
      raise DataError(problem + '; fix the data or set --config.skip_bad_pairs=true to drop such pairs')
  if bad:
    logging.warning('Dropped %d bad pairs from %s/%s (config.skip_bad_pairs)', bad, data_dir, split)
  num_lines = len(src)
  if len(keep) < num_lines:
    src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
  return src, tgt, keep, num_lines


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
  return bool(config.target_right_to_left)


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
  if process_index == 0:
    _reset_cache_unless(cache_dir, meta)
  barrier(f'tokenize-meta-{cache_dir}')
  num_chunks = -(-len(pairs) // chunk_pairs)
  _write_chunks(pairs, tokenizer, cache_dir, meta, range(process_index, num_chunks, process_count), process_index,
                num_threads)
  barrier(f'tokenize-chunks-{cache_dir}')
  return _load_chunks(cache_dir, num_chunks)


def _chunk_path(cache_dir, c):
  return cache_dir / f'chunk_{c:05d}.npz'


def _reset_cache_unless(cache_dir, meta):
  """Empties `cache_dir` unless its meta.json is `meta` (the same corpus, vocabulary and chunking)."""
  meta_path = cache_dir / 'meta.json'
  if meta_path.exists() and json.loads(meta_path.read_text()) == meta:
    return
  if cache_dir.exists():
    logging.info('Tokenization cache %s is for other data or another vocabulary: rebuilding it', cache_dir)
    cache_dir.rmtree()
  cache_dir.mkdir(parents=True, exist_ok=True)
  meta_path.write_text(json.dumps(meta, sort_keys=True))


def _write_chunks(pairs, tokenizer, cache_dir, meta, chunks, process_index, num_threads):
  """Tokenizes and saves the chunks of `chunks` that are not cached yet."""
  chunk_pairs, start_time, tokenized_pairs = meta['chunk_pairs'], time.time(), 0
  for c in chunks:
    if _chunk_path(cache_dir, c).exists():
      continue
    indices = range(c * chunk_pairs, min((c + 1) * chunk_pairs, len(pairs)))
    part = tokenize(*pairs.read(indices), tokenizer, num_threads)
    buffer = io.BytesIO()
    arrays = dict(source_tokens=part.source.tokens.astype(meta['dtype']), source_offsets=part.source.offsets)
    if part.target is not part.source:  # monolingual text is stored once
      arrays.update(target_tokens=part.target.tokens.astype(meta['dtype']), target_offsets=part.target.offsets)
    np.savez(buffer, **arrays)
    # Write then rename: a crash never leaves a truncated chunk that a later run would trust.
    tmp = cache_dir / f'.chunk_{c:05d}.npz.tmp{process_index}'
    tmp.write_bytes(buffer.getvalue())
    tmp.rename(_chunk_path(cache_dir, c))
    tokenized_pairs += len(indices)
  if tokenized_pairs:
    seconds = time.time() - start_time
    logging.info('Tokenized %d pairs of %s in %.1f s (%.0f pairs/s) into %s', tokenized_pairs, pairs.description,
                 seconds, tokenized_pairs / max(seconds, 1e-9), cache_dir)


def _load_chunks(cache_dir, num_chunks):
  """The corpus of every cached chunk, in order (a monolingual corpus's target is its source)."""
  parts = []
  for c in range(num_chunks):
    path = _chunk_path(cache_dir, c)
    if not path.exists():
      raise DataError(f'{path} is missing after every host tokenized its part: the workdir must be on '
                      'storage shared by all hosts')
    with np.load(io.BytesIO(path.read_bytes())) as f:
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
