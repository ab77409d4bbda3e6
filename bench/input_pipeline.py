r"""Throughput of the input pipeline alone (no model): tokenization into the cache, loading the cache, and
building token-budget batches, in examples/s and tokens/s.

  python bench/input_pipeline.py --config configs/multi30k.py --vocab runs/m30k/vocab.model
  python bench/input_pipeline.py --config configs/multi30k.py --vocab runs/m30k/vocab.model --repeat 20

--repeat K stands the corpus K times end to end (a K-times larger corpus of the same sentences) to see how
the stages scale. Without --vocab, a vocabulary is trained first (and timed). --smoke runs every stage in
seconds on a generated 300-pair corpus with a 64-piece vocabulary instead of the config's data (the test suite
runs it so).
"""
import argparse
import os
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flaxformer_nmt.data import batching
from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.data import corpora  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.data import corpus as data_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top,wrong-import-position


class Repeated:
  """A corpus `times` times over (same sentences), with a fingerprint of its own."""

  def __init__(self, pairs, times):
    self.pairs, self.times = pairs, times
    self.fingerprint = {'repeat': times, **pairs.fingerprint}
    self.description = f'{pairs.description} x{times}'

  def __len__(self):
    return len(self.pairs) * self.times

  def read(self, indices):
    return self.pairs.read([int(i) % len(self.pairs) for i in indices])


def write_smoke_corpus(directory, pairs=300):
  """{train,valid}.{en,de} of random sentences over a dozen words, each translated word by word."""
  words = {'a': 'ein', 'big': 'grosser', 'dog': 'hund', 'cat': 'katze', 'runs': 'rennt', 'sleeps': 'schlaeft',
           'red': 'roter', 'man': 'mann', 'sees': 'sieht', 'the': 'der', 'ball': 'ball', 'small': 'kleiner'}
  rng = random.Random(0)
  os.makedirs(directory, exist_ok=True)
  for split in ('train', 'valid'):
    sentences = [[rng.choice(list(words)) for _ in range(rng.randint(2, 8))] for _ in range(pairs)]
    for lang, line in (('en', lambda s: ' '.join(s)), ('de', lambda s: ' '.join(words[w] for w in s))):
      with open(os.path.join(directory, f'{split}.{lang}'), 'w', encoding='utf-8') as f:
        f.writelines(line(s) + ' .\n' for s in sentences)


def smoke_config(config, directory):
  """The config on the generated corpus in `directory`, with a vocabulary it can train and small batches."""
  write_smoke_corpus(directory)
  config.data_source, config.data_dir, config.data_download = 'text', directory, ''
  config.source_lang, config.target_lang, config.train_split = 'en', 'de', 'train'
  config.vocab_size, config.sentencepiece_max_chars, config.tokens_per_batch = 64, 0, 512
  return config


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='configs/multi30k.py')
  parser.add_argument('--vocab', default='', help='an existing vocab.model (else one is trained and timed)')
  parser.add_argument('--repeat', type=int, default=1)
  parser.add_argument('--epochs', type=float, default=2.0, help='epochs of batches to build')
  parser.add_argument('--threads', type=int, default=0, help='sentencepiece threads (0 = all cores)')
  parser.add_argument('--smoke', action='store_true', help='a generated tiny corpus instead of the config\'s data')
  return parser.parse_args()


def vocabulary(args, config, pairs, workdir):
  """The tokenizer of --vocab, or one trained (and timed) on the pairs as the trainer trains it."""
  if args.vocab:
    return tokenizer_lib.Tokenizer(args.vocab)
  start = time.perf_counter()
  tokenizer = tokenizer_lib.load_or_train(
      workdir, lambda: tokenizer_lib.sample_sentences(pairs, config.sentencepiece_max_chars, config.seed),
      vocab_size=config.vocab_size, model_type=config.sentencepiece_model_type)
  budget = f'{config.sentencepiece_max_chars:,}' if config.sentencepiece_max_chars else 'all'
  print(f'sample + sentencepiece training ({budget} characters): {time.perf_counter() - start:.1f} s')
  return tokenizer


def tokenized(pairs, tokenizer, workdir, threads):
  """The tokenized corpus, timed cold (tokenizing and writing the cache) and warm (loading it)."""
  cache = os.path.join(workdir, 'tokenized')
  start = time.perf_counter()
  corpus = data_lib.tokenize_cached(pairs, tokenizer, cache, num_threads=threads)
  cold = time.perf_counter() - start
  tokens = int(corpus.source.offsets[-1] + corpus.target.offsets[-1])
  print(f'tokenize + write cache (cold): {cold:.2f} s = {len(corpus) / cold:,.0f} pairs/s, '
        f'{tokens / cold:,.0f} tokens/s (both sides, {tokens:,} tokens)')
  start = time.perf_counter()
  corpus = data_lib.tokenize_cached(pairs, tokenizer, cache)
  warm = time.perf_counter() - start
  print(f'load cache (warm, a restarted run): {warm:.3f} s = {len(corpus) / warm:,.0f} pairs/s '
        f'({cold / warm:.0f}x faster than tokenizing)')
  return corpus


def time_batches(config, corpus, examples, max_length, epochs):
  """Builds `epochs` epochs of the config's batches (packed where it packs), without and with prefetching."""
  for prefetch in (0, config.prefetch_batches):
    batches = batching.TrainBatches(corpus, examples=examples, tokens_per_batch=config.tokens_per_batch,
                                    buckets=config.length_buckets, seed=config.seed, prefetch=prefetch,
                                    packed_length=config.packed_length,
                                    packing_open_rows=config.packing_open_rows, max_length=max_length)
    count = int(batches.batches_per_epoch() * epochs)
    if not count:  # no rates to give, rather than a division by zero
      print(f'batches (prefetch {prefetch}): 0 batches ({epochs:g} epochs of {batches.batches_per_epoch()} batches)')
      batches.close()
      continue
    start = time.perf_counter()
    real = padded = rows = 0
    for _ in range(count):
      batch = next(batches)
      real += int((batch['src'] != 0).sum() + (batch['tgt_out'] != 0).sum())
      padded += 2 * batch['src'].size
      if 'src_segments' in batch:  # packed: segments 1..n in each row
        rows += int(batch['src_segments'].max(axis=1).sum())
      else:
        rows += int((batch['src'] != 0).any(axis=1).sum())
    seconds = time.perf_counter() - start
    batches.close()
    print(f'batches (prefetch {prefetch}): {count} batches in {seconds:.2f} s = {count / seconds:,.0f} batches/s, '
          f'{rows / seconds:,.0f} examples/s, {real / seconds:,.0f} real tokens/s '
          f'({real / padded:.1%} of padded {padded / seconds:,.0f} tokens/s)')


def main():
  args = parse_args()
  config = config_lib.load_config_file(args.config)
  smoke_dir = tempfile.TemporaryDirectory() if args.smoke else None
  if smoke_dir:
    config = smoke_config(config, os.path.join(smoke_dir.name, 'data'))
  print(f'cores: {os.cpu_count()}; config {args.config}; corpus x{args.repeat}')

  start = time.perf_counter()
  pairs = corpora.open_split(config, config.train_split)
  if args.repeat > 1:
    pairs = Repeated(pairs, args.repeat)
  print(f'read + check text: {len(pairs):,} pairs in {time.perf_counter() - start:.2f} s')

  with tempfile.TemporaryDirectory() as workdir:
    corpus = tokenized(pairs, vocabulary(args, config, pairs, workdir), workdir, args.threads)
    max_length = min(config.max_length, config.packed_length) if config.packed_length else config.max_length
    examples = corpus.usable(max_length)
    time_batches(config, corpus, examples, max_length, args.epochs)
    lengths = corpus.lengths()[examples]
    print(f'example length: mean {np.mean(lengths):.1f}, max {np.max(lengths)} tokens')


if __name__ == '__main__':
  main()
