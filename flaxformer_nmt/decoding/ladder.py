"""The ladder: the few shapes the search of any input runs in, so that what is compiled does not depend on the
data.

  ladder = Ladder(tokens_per_batch=4096, max_position=1024)
  ladder.lengths             # (32, 64, 128, 256, 512, 1024): padded source and cache lengths
  ladder.rows(64)            # (64, 8, 1): sentences a batch holds at that length
  ladder.batches(token_lists)

A source batch is padded to a length rung S (the smallest that holds its longest sentence) and its rows to a
row rung of S; the decoder's self-attention cache starts with S positions and grows to the next length rung
when the decoder gets there, the encoder's keys/values and the source mask padded along. Row rungs at length
L are the largest power of two whose rows x L fit the token budget (rows x L / 2 at the shortest length), and
that divided by ROW_RATIO, ROW_RATIO^2, ... down to min_rows sentences (one by default): a program at (rows, L)
holds about the same number of positions at every rung, and what it holds never depends on the sentences. Where
the sentences still searching fit a lower rung, they go on in it (batch_search.py); where they need more than
the rung at the next length holds, they split over several batches of that length.
"""
import dataclasses

import numpy as np

from flaxformer_nmt.data.tokenizer import PAD_ID

# The shortest padded source and cache. At 512 tokens a batch on a 2-core CPU, 16 compiled 9 programs for Multi30k
# test2016 and 15-16 for newstest2015, 32 compiles 5 and 11-12: the decode command 35-45% faster cold, 55 MB less
# RSS. Counting the shortest rung's rows at its full length made the search 5-15% slower and the server 7-16% at
# 32 clients (half the rows of a rung from 16); at half its length they are as fast as from 16. bench/RESULTS.md.
MIN_LENGTH = 32
# Between neighbouring row rungs of one length: 4 compiled 13 programs for Multi30k test2016 (beam 5, rungs from
# 16), 8 compiled 11, at the same speed (2-core CPU).
ROW_RATIO = 8


def _floor_power_of_two(n):
  return 1 << (max(int(n), 1).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Ladder:
  """The rungs of a model's search: tokens_per_batch (source tokens a batch holds at most, before the beam),
  max_position (the model's positions: the longest cache), row_multiple (every row count is a multiple of
  it: the devices a batch is split over), min_rows (the fewest sentences a batch has: more than one for a
  batch-invariant search, batch_search.BATCH_INVARIANT_MIN_ROWS), min_length (the shortest rung)."""
  tokens_per_batch: int
  max_position: int
  row_multiple: int = 1
  min_rows: int = 1
  min_length: int = MIN_LENGTH

  @property
  def lengths(self):
    """The padded source and cache lengths: powers of two from min_length, and max_position last."""
    lengths, length = [], self.min_length
    while length < self.max_position:
      lengths.append(length)
      length *= 2
    return tuple(lengths) + (self.max_position,)

  def length_for(self, n):
    """The smallest length rung of at least n positions (the longest where n exceeds every rung)."""
    return next((length for length in self.lengths if length >= n), self.lengths[-1])

  def next_length(self, length):
    """The length rung after `length` (the cache a search that reached `length` grows to)."""
    return self.length_for(length + 1)

  def rows(self, length):
    """The row rungs at `length`, largest first. The shortest rung holds sentences of any length up to it, not
    from half of it as the others do: its rows are counted at half its length."""
    counted = length // 2 if length == self.min_length else length
    top = max(_floor_power_of_two(self.tokens_per_batch // counted), self.min_rows)
    rungs = []
    while True:
      rungs.append(-(-top // self.row_multiple) * self.row_multiple)
      if top <= self.min_rows:
        break
      top = max(top // ROW_RATIO, self.min_rows)
    return tuple(sorted(set(rungs), reverse=True))

  def below(self, rows, length):
    """The largest row rung at `length` below `rows` (0: none): a batch of `rows` rows goes on in it once the
    sentences still searching fit."""
    return next((r for r in self.rows(length) if r < rows), 0)

  def split(self, n, length):
    """Row rungs at `length` whose batches hold n sentences: the top rung while n fills it, then the smallest
    rung that holds the rest if at least half of it is used, else the largest that the rest fills, and so
    on: split(150, 64) = [64, 64, 8, 8, 8] at 4,096 tokens a batch."""
    rungs, batches = self.rows(length), []
    while n > 0:
      fitting = [r for r in rungs if r >= n]
      rows = fitting[-1] if fitting and fitting[-1] <= 2 * n else next((r for r in rungs if r <= n), rungs[-1])
      batches.append(rows)
      n -= rows
    return batches

  def source_lengths(self, max_source_length=None):
    """The length rungs a source of up to `max_source_length` tokens (None: any) is padded to."""
    top = self.length_for(max_source_length) if max_source_length else self.lengths[-1]
    return tuple(length for length in self.lengths if length <= top)

  def batches(self, token_lists, sort_by_length=True, top_rows=False):
    """(indices, padded source [rows, length]) batches of the sources (token ids ending with EOS) on the
    ladder. Sorted by length, each length rung's sentences fill batches in length order: batches of the top
    rung of rows where they are more than it holds (the last one padded: no program of its own for the rest),
    else split's rows (a lone sentence, one row); sort_by_length=False keeps input order (to measure what
    sorting saves): consecutive sentences fill a batch while the top rung of their longest one's length holds
    them. Empty sentences (EOS alone) are left out: they translate to empty lines. Padding rows are empty (all
    PAD). top_rows=True: every batch has its length's top rung of rows (one shape per length, for a search
    that does not drop sentences)."""
    lengths = [len(t) for t in token_lists]
    nonempty = [i for i, n in enumerate(lengths) if n > 1]
    groups = self._sorted_groups(lengths, nonempty) if sort_by_length else self._input_order_groups(lengths, nonempty)
    for length, members in groups:
      start = 0
      top = self.rows(length)[0]
      full = top_rows or len(members) > top
      for rows in ([top] * -(-len(members) // top) if full else self.split(len(members), length)):
        chunk = members[start:start + rows]
        start += rows
        src = np.full((rows, length), PAD_ID, np.int32)
        for r, i in enumerate(chunk):
          src[r, :lengths[i]] = token_lists[i]
        yield list(chunk), src

  def _sorted_groups(self, lengths, order):
    """[(length rung, member indices)]: the sentences of each rung, shortest first."""
    order = sorted(order, key=lengths.__getitem__)
    rungs = [self.length_for(lengths[i]) for i in order]
    return [(rung, [i for i, r in zip(order, rungs) if r == rung]) for rung in sorted(set(rungs))]

  def _input_order_groups(self, lengths, order):
    """[(length rung, member indices)]: consecutive sentences, a group closing where one more would not fit
    the top row rung of its longest sentence's length."""
    groups, members, length = [], [], 0
    for i in order:
      grown = max(length, self.length_for(lengths[i]))
      if members and len(members) + 1 > self.rows(grown)[0]:
        groups.append((length, members))
        members, grown = [], self.length_for(lengths[i])
      members.append(i)
      length = grown
    return groups + ([(length, members)] if members else [])
