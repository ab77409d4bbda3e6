"""One joint sentencepiece vocabulary for source and target (the paper's shared source-target vocabulary).

Its reserved ids are models/tokens.py's (pad 0, unk 1, BOS 2, EOS 3) in every vocabulary this project trains.
The model is stored as `vocab.model` in the workdir and reused when training restarts or decoding loads it.
"""
import hashlib
import io
import os
import threading

import numpy as np
import sentencepiece as spm
from absl import logging
from etils import epath

from flaxformer_nmt.models.tokens import BOS_ID, EOS_ID, MASK_PIECE, PAD_ID, UNK_ID
from flaxformer_nmt.runtime import files

VOCAB_FILENAME = 'vocab.model'


# One BPE-dropout sampler at a time: it sets sentencepiece's process-wide seed.
_SAMPLING_LOCK = threading.Lock()


class TokenizerError(ValueError):
  """A vocabulary file that cannot be used."""


def normalize_whitespace(line):
  """Strips and folds every run of Unicode whitespace (tabs, no-break spaces) into one ASCII space."""
  return ' '.join(line.split())


def lowercase_of(config):
  """config.lowercase: whether the model learns (and reads) lowercased text."""
  return bool(config.lowercase)


def prepare_text(line, lowercase=False):
  """A line as the model reads it: whitespace normalized, and lowercased (str.lower: 'ß' stays, unlike case
  folding) where the model learnt lowercased text (config.lowercase)."""
  line = normalize_whitespace(line)
  return line.lower() if lowercase else line


def sample_sentences(pairs, max_chars=0, seed=0, read_size=10_000):
  """Both sides of the pairs of `pairs` (a corpora.* corpus), in a seeded random order, until `max_chars`
  characters are collected (0: all of them).

  A character budget (the Flax WMT example uses 10M) bounds sentencepiece's time and memory on a large
  corpus while still seeing a uniform sample of it.
  """
  order = np.random.default_rng(seed).permutation(len(pairs)) if max_chars else np.arange(len(pairs))
  sentences, chars = [], 0
  for start in range(0, len(order), read_size):
    source, target = pairs.read(order[start:start + read_size])
    # Monolingual corpora (lm/mlm) read as (lines, None).
    lines = source if target is None else (x for pair in zip(source, target) for x in pair)
    for line in lines:
      if line:
        sentences.append(line)
        chars += len(line)
      if max_chars and chars >= max_chars:
        return sentences
  return sentences


def train_sentencepiece(sentences, model_path, *, vocab_size, model_type='bpe', character_coverage=1.0,
                        user_defined_symbols=()):
  """Trains a sentencepiece model on `sentences` (an iterable of str) and writes it to `model_path`.

  user_defined_symbols (e.g. the MLM's '<mask>') get the ids right after the reserved ones, and text that
  contains them is encoded to that one id.
  """
  sentences = [s for s in sentences if s]
  model = io.BytesIO()
  try:
    _train(sentences, model, vocab_size, model_type, character_coverage, user_defined_symbols)
  except RuntimeError as e:  # e.g. a vocabulary smaller than the reserved ids and characters
    raise TokenizerError(f'sentencepiece could not learn a {vocab_size}-piece vocabulary (config.vocab_size): '
                         f'{str(e).strip()}') from None
  path = epath.Path(model_path)
  path.parent.mkdir(parents=True, exist_ok=True)
  files.write_atomically(path, model.getvalue())  # a crash never leaves a half-written vocabulary behind
  logging.info('Trained a %d-piece sentencepiece model on %d sentences: %s', vocab_size, len(sentences), path)
  return path


def _train(sentences, model, vocab_size, model_type, character_coverage, user_defined_symbols):
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
      # Whole sentences, however long: the corpus is already one sentence per line.
      max_sentence_length=1 << 16,
      input_sentence_size=0,
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
      user_defined_symbols=list(user_defined_symbols),
  )


class Tokenizer:
  """Text <-> ids with the reserved ids above; EOS is appended by `encode`."""

  def __init__(self, model_path):
    self.path = epath.Path(model_path)
    proto = self.path.read_bytes()
    # Names the vocabulary in caches of token ids.
    self.sha256 = hashlib.sha256(proto).hexdigest()
    try:
      self.sp = spm.SentencePieceProcessor(model_proto=proto)
    except (OSError, RuntimeError) as e:
      raise TokenizerError(f'{self.path}: cannot load the sentencepiece model ({e})') from None
    if (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
      raise TokenizerError(f'{self.path}: sentencepiece model does not use the reserved ids pad/unk/bos/eos = 0/1/2/3')

  @property
  def vocab_size(self):
    return self.sp.get_piece_size()

  @property
  def mask_id(self):
    """The id of the '<mask>' piece (vocabularies trained for config.task=mlm), else None."""
    mask_id = self.sp.piece_to_id(MASK_PIECE)
    return None if mask_id == UNK_ID else mask_id

  def encode(self, texts, num_threads=0):
    """List of str -> list of int lists, each ending with EOS (num_threads: sentencepiece's; 0 = all cores)."""
    num_threads = num_threads or os.cpu_count() or 1
    return [ids + [EOS_ID] for ids in self.sp.encode(list(texts), num_threads=num_threads)]

  def encode_sampled(self, texts, dropout, seed):
    """BPE-dropout (Provilkov et al. 2020): `encode` with each merge skipped with probability `dropout`, so a
    word comes out in smaller pieces at random (dropout 1: characters).

    The same (texts, dropout, seed) give the same ids within a process, not across processes: sentencepiece's
    sampler depends on per-process state besides its seed (measured with sentencepiece 0.2.x), so whatever
    must be repeated in another process or on another host is saved (corpus.SavedSegmentations). It draws from
    a generator per thread, seeded when the thread first samples: a fresh thread that sets the seed and
    encodes alone (num_threads=1) starts every call from the seed.
    """
    texts, result = list(texts), []

    def sample():
      spm.set_random_generator_seed(seed % 0xFFFFFFFF)  # 0xFFFFFFFF itself means "seed from the clock"
      result.extend(self.sp.encode(texts, enable_sampling=True, alpha=dropout, nbest_size=-1, num_threads=1))

    with _SAMPLING_LOCK:  # the seed is process-wide
      thread = threading.Thread(target=sample, name='bpe-dropout')
      thread.start()
      thread.join()
    if len(result) != len(texts):
      raise TokenizerError(f'{self.path}: sampling the segmentation of {len(texts)} lines failed')
    return [ids + [EOS_ID] for ids in result]

  def decode(self, ids):
    """One id sequence -> text, cut at the first EOS; pad and bos are dropped."""
    ids = [int(i) for i in ids]
    if EOS_ID in ids:
      ids = ids[:ids.index(EOS_ID)]
    return self.sp.decode([i for i in ids if i not in (PAD_ID, BOS_ID)])

  def pieces(self, ids):
    return [self.sp.id_to_piece(int(i)) for i in ids]


def load_or_train(workdir, sentences_fn, *, vocab_size, model_type='bpe', character_coverage=1.0,
                  is_leader=True, barrier=lambda name: None, user_defined_symbols=()):
  """The workdir's tokenizer, trained first from `sentences_fn()` if the workdir has none yet.

  On several hosts only the leader (process 0) trains and writes the vocabulary; the others wait at
  `barrier` and then load what it wrote.
  """
  path = epath.Path(workdir) / VOCAB_FILENAME
  if path.exists():
    logging.info('Reusing the vocabulary in %s', path)
  elif is_leader:
    train_sentencepiece(sentences_fn(), path, vocab_size=vocab_size, model_type=model_type,
                        character_coverage=character_coverage, user_defined_symbols=user_defined_symbols)
  barrier('vocabulary')
  if not path.exists():
    raise TokenizerError(f'{path} was not written by process 0: the workdir must be on storage all hosts share')
  return Tokenizer(path)
