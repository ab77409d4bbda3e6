"""The trainer's input: corpus -> vocabulary -> cached token ids -> training and validation batches.

Every host plans the same global batches and builds its own rows of them (batching.py).
"""
import functools

import jax
from absl import logging
from etils import epath

from flaxformer_nmt.data import batching
from flaxformer_nmt.data import corpora
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import download
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.models import lm
from flaxformer_nmt.runtime import distributed


def input_pipeline(config, workdir, num_devices):
  """(train batches, eval batches factory, tokenizer).

  Training batches are planned from the data and the batching settings alone (config.batch_rows_multiple
  rows at a time), then padded with empty rows to a multiple of `num_devices` (devices x microbatches);
  validation batches have rows in multiples of `num_devices`.
  """
  tokenizer, train_pairs, train_corpus, eval_corpus = vocabulary_and_tokens(config, workdir)
  if data_lib.right_to_left(config):
    train_corpus = data_lib.right_to_left_targets(train_corpus)
    eval_corpus = data_lib.right_to_left_targets(eval_corpus)
    logging.info('Right-to-left targets: the model writes each target from its last token to its first')
  hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
  max_length = min(config.max_length, config.packed_length) if config.packed_length else config.max_length
  if lm.task_of(config) != 'translation':  # monolingual text: long lines are cut, not dropped
    train_corpus = data_lib.split_long(train_corpus, max_length)
    eval_corpus = data_lib.split_long(eval_corpus, max_length)
  train_examples = train_corpus.usable(max_length)
  if not len(train_examples):
    raise data_lib.DataError(f'{train_pairs.description}: no training pair with both sides non-empty and at most '
                             f'{max_length} tokens a side (config.max_length, config.packed_length)')
  logging.info('Training pairs: %d of %d kept (at most %d tokens a side) from %s; validation pairs: %d',
               len(train_examples), len(train_corpus), max_length, train_pairs.description,
               len(eval_corpus.usable()))
  resegment = None
  if config.bpe_dropout:  # each epoch's own pieces, sampled from the training text when the epoch is planned
    def sample(epoch):
      return data_lib.sample_segmentation(train_corpus, train_pairs, tokenizer, dropout=config.bpe_dropout,
                                          seed=config.seed, epoch=epoch, examples=train_examples,
                                          max_length=max_length)
    resegment = data_lib.SavedSegmentations(
        epath.Path(workdir) / 'tokenized' / f'{config.train_split}_bpe_dropout', sample,
        fingerprint={'vocabulary_sha256': tokenizer.sha256, 'bpe_dropout': config.bpe_dropout, 'seed': config.seed,
                     'pairs': train_pairs.fingerprint, 'max_length': max_length},
        is_leader=distributed.is_leader())
  train_batches = batching.TrainBatches(
      train_corpus, examples=train_examples, tokens_per_batch=config.tokens_per_batch,
      buckets=config.length_buckets, seed=config.seed, multiple_of=config.batch_rows_multiple,
      pad_rows_to=num_devices, prefetch=config.prefetch_batches, packed_length=config.packed_length,
      packing_open_rows=config.packing_open_rows, max_length=max_length, bpe_dropout=config.bpe_dropout,
      resegment=resegment, bidirectional_epochs=config.bidirectional_epochs, **hosts)
  if config.bidirectional_epochs:
    logging.info('Bidirectional training: epochs 0-%d hold every pair both ways (twice the batches), later '
                 'epochs the given direction only', config.bidirectional_epochs - 1)
  if config.batch_rows_multiple % num_devices:
    logging.info('Training batches are planned in multiples of %d rows (config.batch_rows_multiple) and padded '
                 'with empty rows to a multiple of %d (devices x microbatches); a batch_rows_multiple that '
                 '%d divides avoids the padding (a new plan: set it when starting a run).',
                 config.batch_rows_multiple, num_devices, num_devices)
  eval_batches = functools.partial(batching.eval_batches, eval_corpus, tokens_per_batch=config.tokens_per_batch,
                                   buckets=config.length_buckets, multiple_of=num_devices,
                                   examples=validation_examples(config, eval_corpus), **hosts)
  return train_batches, eval_batches, tokenizer


def validation_examples(config, eval_corpus):
  """The validation pairs of the loss: both sides non-empty and at most config.model.max_position tokens (the model
  has no position past its sinusoidal table: it would read every later one as the last)."""
  examples = eval_corpus.usable(config.model.max_position)
  left_out = len(eval_corpus.usable()) - len(examples)
  if left_out:
    logging.warning('%d validation pairs have a side longer than config.model.max_position=%d tokens: left out of '
                    'the validation loss', left_out, config.model.max_position)
  if not len(examples):
    raise data_lib.DataError(f'{config.eval_split}: no validation pair with both sides non-empty and at most '
                             f'config.model.max_position={config.model.max_position} tokens a side')
  return examples


def vocabulary_and_tokens(config, workdir):
  """(tokenizer, training pairs, training token ids, validation token ids): the corpus fetched, the joint
  vocabulary learnt (workdir/vocab.model) and both splits tokenized (workdir/tokenized/) on first use, and
  reused from the workdir afterwards."""
  if config.data_source == 'tfds':
    # Process 0 downloads and prepares; the others find it prepared (shared storage) or prepare their own.
    if distributed.is_leader():
      corpora.prepare_tfds(config.tfds_name, config.tfds_data_dir)
    distributed.barrier('prepare-tfds')
    corpora.prepare_tfds(config.tfds_name, config.tfds_data_dir)
  download.ensure_corpus(config, distributed.is_leader(), distributed.barrier)  # first use of Multi30k
  train_pairs = corpora.open_split(config, config.train_split)
  eval_pairs = corpora.open_split(config, config.eval_split)
  tokenizer = tokenizer_lib.load_or_train(
      workdir, lambda: tokenizer_lib.sample_sentences(train_pairs, config.sentencepiece_max_chars, config.seed),
      vocab_size=config.vocab_size, model_type=config.sentencepiece_model_type,
      character_coverage=config.sentencepiece_character_coverage, is_leader=distributed.is_leader(),
      barrier=distributed.barrier,
      user_defined_symbols=(tokenizer_lib.MASK_PIECE,) if lm.task_of(config) == 'mlm' else ())
  hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
  tokenize = functools.partial(data_lib.tokenize_cached, tokenizer=tokenizer, barrier=distributed.barrier,
                               num_threads=config.tokenize_threads, **hosts)
  train_corpus = tokenize(train_pairs, cache_dir=epath.Path(workdir) / 'tokenized' / config.train_split)
  eval_corpus = tokenize(eval_pairs, cache_dir=epath.Path(workdir) / 'tokenized' / config.eval_split)
  return tokenizer, train_pairs, train_corpus, eval_corpus
