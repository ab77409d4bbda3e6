"""Token-budget batches: a pure plan of each epoch's batches, a thread that builds them ahead, and the saveable
position of a training run in them.

Pairs are grouped by padded length (or packed into fixed-length rows, packing.py) into batches of about
`tokens_per_batch` tokens a side. Every batch of a bucket has one shape, so the jitted train step compiles once
per bucket. An epoch's batches are a pure function of (seed, epoch) and the batching settings, never of the
machine; the position `{'epoch', 'batch', 'seed', 'batching'}` saved with a checkpoint makes resumption exact.

On several hosts every host plans the same global batches (from the lengths of all pairs) and builds only its
own slice of rows: the hosts' rows are disjoint and together are the global batch.
"""
import hashlib
import queue
import threading

import numpy as np
from absl import logging

from flaxformer_nmt.data import packing
from flaxformer_nmt.data.corpus import DataError, both_directions
from flaxformer_nmt.data.tokenizer import BOS_ID, PAD_ID

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
  out = np.full((rows, length), PAD_ID, np.int32)
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
      'tgt_in': pad_rows(tgt_seqs, rows, length, prefix=BOS_ID),
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


class EpochPlans:
  """The batches of each epoch, planned from `np.random.default_rng((seed, epoch))`: the usable examples are
  shuffled, grouped by bucket (or packed into rows), and the batches shuffled again. Planned once per epoch,
  thread-safe; `build(epoch, batch)` pads one batch of this host.

  The plan depends only on the examples, the seed and the batching settings (token budget, buckets, packed
  length, and `multiple_of`, the row granularity): the devices and hosts only decide how a planned batch is laid
  out, padded with empty rows to a multiple of `pad_rows_to` (devices x microbatches) and split over hosts.
  With `resegment` (BPE-dropout: epoch -> that epoch's segmentation) each epoch is planned from its own pieces;
  with `bidirectional_epochs` the first that many epochs hold every example twice, as it is and reversed.
  """

  def __init__(self, corpus, examples, *, tokens_per_batch, buckets, seed, multiple_of, pad_rows_to,
               process_index, process_count, packed_length, packing_open_rows, resegment, bidirectional_epochs):
    self.corpus, self.examples, self.resegment = corpus, examples, resegment
    self.tokens_per_batch, self.buckets, self.seed, self.multiple_of = tokens_per_batch, buckets, seed, multiple_of
    # Every host must get the same number of rows: the layout is a multiple of the host count too.
    self.pad_rows_to = int(np.lcm(pad_rows_to, process_count))
    self.process_index, self.process_count = process_index, process_count
    self.packed_length, self.packing_open_rows = packed_length, packing_open_rows
    self.bidirectional_epochs = bidirectional_epochs
    self._plans = {}
    self._lock = threading.Lock()

  def plan(self, epoch):
    """The global batches of `epoch`: [(padded length, rows, member example indices)]."""
    return self._epoch(epoch)[1]

  def corpus_of(self, epoch):
    """The token ids `epoch` is built from: the corpus, or with BPE-dropout that epoch's segmentation (in a
    bidirectional epoch, followed by its pairs reversed)."""
    return self._epoch(epoch)[0]

  def _epoch(self, epoch):
    """(corpus, plan) of `epoch`, made once."""
    with self._lock:
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

  def build(self, epoch, batch):
    """(the arrays of the batch at this position, the position after it); past an epoch's end, the next."""
    if batch >= len(self.plan(epoch)):
      epoch, batch = epoch + 1, 0
    padded = self.plan(epoch)[batch][0]
    members, rows = self.host_members(epoch, batch)
    corpus = self.corpus_of(epoch)
    if self.packed_length:
      arrays = packing.make_packed_batch(corpus.source, corpus.target, members, rows, padded)
    else:
      arrays = make_batch([corpus.source[i] for i in members], [corpus.target[i] for i in members], rows, padded)
    return arrays, (epoch, batch + 1)


class Prefetcher:
  """Runs `build(position) -> (item, next position)` from `position` on in a background thread, `depth` items
  ahead of the consumer. An exception in the thread is raised in the consumer's `get`, and again by every later
  `get` (the thread has ended)."""

  def __init__(self, build, position, depth):
    self._build, self._error = build, None
    self._out, self._stop = queue.Queue(maxsize=depth), threading.Event()
    self._thread = threading.Thread(target=self._produce, args=(position,), daemon=True, name='Prefetcher')
    self._thread.start()

  def _put(self, item):  # waits for room, unless asked to stop (then close() can join this thread)
    while not self._stop.is_set():
      try:
        self._out.put(item, timeout=0.1)
        return
      except queue.Full:
        pass

  def _produce(self, position):
    try:
      while not self._stop.is_set():
        item = self._build(*position)
        position = item[1]
        self._put(item)
    except BaseException as e:  # pylint: disable=broad-except  (any: the consumer would wait for ever)
      self._put(e)

  def get(self):
    if self._error is not None:
      raise self._error
    item = self._out.get()
    if isinstance(item, BaseException):
      self._error = item
      self.close()
      raise item
    return item

  def close(self):
    """Stops the thread; items built ahead are dropped."""
    self._stop.set()
    self._thread.join()


class TrainBatches:
  """Endless shuffled token-budget batches (EpochPlans) with a saveable position, built `prefetch` ahead by a
  Prefetcher. The position is that of the batches handed out, not of those built ahead: a restart at
  {'epoch': e, 'batch': b} yields exactly the batches an uninterrupted run would have. The position is saved
  with the batching settings, and `restore` refuses a position planned with other ones, so a run resumed on
  another number of devices or hosts, or with other gradient accumulation, trains on the same global batches.
  """

  def __init__(self, corpus, *, tokens_per_batch, buckets, seed, multiple_of=1, pad_rows_to=1, examples=None,
               process_index=0, process_count=1, prefetch=2, packed_length=0, max_length=None,
               packing_open_rows=packing.OPEN_ROWS, bpe_dropout=0.0, resegment=None, bidirectional_epochs=0):
    if bool(bpe_dropout) != (resegment is not None):
      raise ValueError('bpe_dropout and resegment go together')
    examples = np.arange(len(corpus)) if examples is None else np.asarray(examples)
    lengths = corpus.lengths()
    if packed_length and examples.size and lengths[examples].max() > packed_length:
      raise ValueError(f'examples longer than packed_length={packed_length}: filter them first')
    if packed_length and packing_open_rows < 1:  # none open: every example would get a row of its own
      raise ValueError(f'packing_open_rows={packing_open_rows}: use 1 (next fit) or more')
    self.seed, self.prefetch = seed, prefetch
    # What the saved position depends on besides the seed, by config field: a change moves every batch.
    self.batching = {'tokens_per_batch': int(tokens_per_batch), 'length_buckets': [int(b) for b in buckets],
                     'max_length': max_length, 'packed_length': int(packed_length),
                     'packing_open_rows': int(packing_open_rows) if packed_length else 0,
                     'batch_rows_multiple': int(multiple_of), 'bpe_dropout': float(bpe_dropout),
                     'bidirectional_epochs': int(bidirectional_epochs), 'training_examples': int(examples.size),
                     # Another training set of as many examples (edited text) plans other batches too.
                     'training_lengths': _lengths_hash(lengths[examples]),
                     # Packed rows are filled by each side's length, not only the longer one's.
                     'training_side_lengths': _lengths_hash(np.concatenate([
                         corpus.source.lengths[examples], corpus.target.lengths[examples]])) if packed_length else None}
    self.plans = EpochPlans(corpus, examples, tokens_per_batch=tokens_per_batch, buckets=tuple(buckets), seed=seed,
                            multiple_of=multiple_of, pad_rows_to=pad_rows_to, process_index=process_index,
                            process_count=process_count, packed_length=packed_length,
                            packing_open_rows=packing_open_rows, resegment=resegment,
                            bidirectional_epochs=int(bidirectional_epochs))
    self.epoch, self.batch = 0, 0
    self._prefetcher = None

  def plan(self, epoch):
    return self.plans.plan(epoch)

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
    # A field the checkpoint lacks was not recorded when it was written: nothing to compare.
    changed = [f'{"" if field.startswith("training_") else "config."}{field} was {state["batching"][field]!r}, '
               f'now {value!r}' for field, value in self.batching.items()
               if field in state['batching'] and state['batching'][field] != value]
    if changed and not allow_batching_change:
      raise BatchingError(
          f"the checkpoint's data position (epoch {epoch}, batch {batch}) belongs to other batches: "
          f"{'; '.join(changed)}. Restore the setting to resume exactly, or pass "
          '--config.allow_batching_change=true to continue in the same epoch with the new batches.')
    if changed:
      new_batches = len(self.plan(epoch))
      batch = min(round(batch / max(int(state['batches_in_epoch']), 1) * new_batches), new_batches)
      logging.warning('Batching changed (%s; --config.allow_batching_change): continuing in epoch %d at batch '
                      '%d of %d, the same fraction of the epoch; the batches differ from those of an '
                      'uninterrupted run.', '; '.join(changed), epoch, batch, new_batches)
    self.epoch, self.batch = epoch, batch

  def __iter__(self):
    return self

  def __next__(self):
    if self.prefetch <= 0:
      arrays, (self.epoch, self.batch) = self.plans.build(self.epoch, self.batch)
      return arrays
    if self._prefetcher is None:
      self._prefetcher = Prefetcher(self.plans.build, (self.epoch, self.batch), self.prefetch)
    arrays, (self.epoch, self.batch) = self._prefetcher.get()
    return arrays

  def close(self):
    """Stops the background thread (batches built ahead are dropped; the position is unaffected)."""
    if self._prefetcher is not None:
      self._prefetcher.close()
      self._prefetcher = None

  def batches_per_epoch(self):
    return len(self.plan(self.epoch))


def _lengths_hash(lengths):
  return hashlib.sha256(np.asarray(lengths, np.int64).tobytes()).hexdigest()[:16]


def eval_batches(corpus, *, tokens_per_batch, buckets, multiple_of=1, examples=None, process_index=0,
                 process_count=1):
  """Deterministic batches over the corpus (sorted by length), this host's rows of each, for validation."""
  examples = corpus.usable() if examples is None else np.asarray(examples)
  lengths = corpus.lengths()
  order = examples[np.argsort(lengths[examples], kind='stable')]
  for padded, rows, members in plan_batches(lengths, buckets, tokens_per_batch, multiple_of, order):
    members, host_rows = host_slice(members, rows, process_index, process_count)
    yield make_batch([corpus.source[i] for i in members], [corpus.target[i] for i in members], host_rows, padded)
