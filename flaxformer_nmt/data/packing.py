"""Sequence packing: several (source, target) examples per fixed-length row, without padding between them.

Short sentences waste most of a padded batch; packing fills each row of `length` tokens (per side) with
several examples, as the Flax WMT example does, first fit over the newest rows (plan_rows). Each token carries
its example's segment number within the row (1, 2, ...; 0 on the padding at the row's end) and its position
within its example (0, 1, ... restarting with every example). The model keeps attention inside a segment
(self-attention, encoder-decoder attention, and causally in the decoder) and takes sinusoidal positions from
the `*_positions` arrays, so a packed example is computed exactly as it would be alone.
"""
import numpy as np

from flaxformer_nmt.data.tokenizer import BOS_ID, PAD_ID

PACKED_KEYS = ('src', 'tgt_in', 'tgt_out', 'src_segments', 'tgt_segments', 'src_positions', 'tgt_positions')


# Rows still open to new examples (config.packing_open_rows). Next fit (1) leaves 15% of the target tokens of
# Multi30k's 64-token rows padding, as each row is closed by the first example that does not fit; 16 open rows
# leave 6% (64 rows, 5%) while the caller's shuffle still decides which examples share a row.
OPEN_ROWS = 16


def plan_rows(src_lengths, tgt_lengths, length, open_rows=OPEN_ROWS):
  """Examples (indices) grouped into rows of at most `length` tokens a side, first fit: an example joins the
  oldest of the open rows that still has room on both sides, else it opens a new row, and once more than
  `open_rows` are open the oldest is closed. Rows come out in the order they were opened, each row's examples
  in input order; open_rows=1 is next fit, the examples in order."""
  rows, rows_src, rows_tgt = [], [], []  # every row so far, and its tokens a side
  for i, (s, t) in enumerate(zip(src_lengths, tgt_lengths)):
    if s > length or t > length:
      raise ValueError(f'example {i} has {max(s, t)} tokens on one side, more than the packed length {length}')
    for r in range(max(len(rows) - open_rows, 0), len(rows)):  # the open rows, oldest first
      if rows_src[r] + s <= length and rows_tgt[r] + t <= length:
        break
    else:
      r = len(rows)
      rows.append([])
      rows_src.append(0)
      rows_tgt.append(0)
    rows[r].append(i)
    rows_src[r] += s
    rows_tgt[r] += t
  return rows


def _fill(row, sequences, out_tokens, out_segments, out_positions, prefix=None):
  offset = 0
  for segment, seq in enumerate(sequences, start=1):
    seq = list(seq) if prefix is None else [prefix] + list(seq[:-1])
    n = len(seq)
    out_tokens[row, offset:offset + n] = seq
    out_segments[row, offset:offset + n] = segment
    out_positions[row, offset:offset + n] = np.arange(n)
    offset += n


def make_packed_batch(src_seqs, tgt_seqs, rows, num_rows, length):
  """Arrays [num_rows, length] for the examples grouped in `rows` (lists of indices into the sequences).

  Keys as batching.make_batch (src, tgt_in = BOS + target shifted right per example, tgt_out = target + EOS;
  PAD marks positions without a target) plus src/tgt_segments and src/tgt_positions. Rows beyond
  len(rows) are all padding.
  """
  if len(rows) > num_rows:
    raise ValueError(f'{len(rows)} packed rows do not fit a batch of {num_rows}')
  batch = {key: np.full((num_rows, length), PAD_ID, np.int32) for key in PACKED_KEYS}
  for key in ('src_segments', 'tgt_segments', 'src_positions', 'tgt_positions'):
    batch[key][:] = 0
  for r, members in enumerate(rows):
    _fill(r, [src_seqs[i] for i in members], batch['src'], batch['src_segments'], batch['src_positions'])
    _fill(r, [tgt_seqs[i] for i in members], batch['tgt_out'], batch['tgt_segments'],
          batch['tgt_positions'])
    _fill(r, [tgt_seqs[i] for i in members], batch['tgt_in'], np.zeros_like(batch['tgt_segments']),
          np.zeros_like(batch['tgt_positions']), prefix=BOS_ID)
  return batch
