"""Packing: rows are filled in order, and a packed batch gives each example exactly its unpacked loss."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from flaxformer_nmt.data import batching
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import packing
from flaxformer_nmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from flaxformer_nmt.models import lm
from flaxformer_nmt.training import step as ts


def examples(n, vocab=16, seed=0, max_len=7):
  rng = np.random.default_rng(seed)
  src = [list(rng.integers(4, vocab, rng.integers(1, max_len))) + [EOS_ID] for _ in range(n)]
  tgt = [list(rng.integers(4, vocab, rng.integers(1, max_len))) + [EOS_ID] for _ in range(n)]
  return src, tgt


def test_plan_rows_first_fit_within_the_length():
  src, tgt = [3, 4, 2, 5, 1], [2, 2, 6, 1, 1]
  # 0+1: 7 src, 4 tgt. 2 would bring row 0's target to 10: row 1. 3 would bring row 0's source to 12: row 1 (7
  # src, 7 tgt). 4 still fits row 0 (8 src, 5 tgt): first fit goes back to it; next fit only looks at row 1.
  assert packing.plan_rows(src, tgt, length=8) == [[0, 1, 4], [2, 3]]
  assert packing.plan_rows(src, tgt, length=8, open_rows=1) == [[0, 1], [2, 3, 4]]
  with pytest.raises(ValueError, match='more than the packed length'):
    packing.plan_rows([9], [1], length=8)


def test_plan_rows_closes_the_oldest_row_past_open_rows():
  lengths = [3, 3, 3, 1]  # three rows of 3, then one token that fits any of them
  assert packing.plan_rows(lengths, lengths, length=4, open_rows=3) == [[0, 3], [1], [2]]
  assert packing.plan_rows(lengths, lengths, length=4, open_rows=2) == [[0], [1, 3], [2]]  # row 0 was closed


def test_packing_with_no_open_row_is_refused():
  corpus = data_lib.TokenizedCorpus.from_lists([[5, EOS_ID]] * 4, [[6, EOS_ID]] * 4)
  with pytest.raises(ValueError, match='packing_open_rows=0'):
    batching.TrainBatches(corpus, tokens_per_batch=64, buckets=(8,), seed=0, prefetch=0, packed_length=8,
                          packing_open_rows=0)


def test_plan_rows_packs_every_example_once_and_tighter_than_next_fit():
  rng = np.random.default_rng(0)
  src, tgt = rng.integers(1, 30, 2000), rng.integers(1, 30, 2000)
  rows = packing.plan_rows(src, tgt, length=64)
  assert sorted(i for row in rows for i in row) == list(range(2000))
  assert all(row == sorted(row) for row in rows)
  assert max(src[row].sum() for row in rows) <= 64 and max(tgt[row].sum() for row in rows) <= 64
  next_fit = packing.plan_rows(src, tgt, length=64, open_rows=1)
  assert len(rows) < 0.93 * len(next_fit)


def test_packed_batch_layout():
  src, tgt = [[5, 6, EOS_ID], [7, EOS_ID]], [[8, EOS_ID], [9, 10, EOS_ID]]
  batch = packing.make_packed_batch(src, tgt, [[0, 1]], num_rows=2, length=6)
  np.testing.assert_array_equal(batch['src'][0], [5, 6, EOS_ID, 7, EOS_ID, PAD_ID])
  np.testing.assert_array_equal(batch['src_segments'][0], [1, 1, 1, 2, 2, 0])
  np.testing.assert_array_equal(batch['src_positions'][0], [0, 1, 2, 0, 1, 0])
  np.testing.assert_array_equal(batch['tgt_in'][0], [BOS_ID, 8, BOS_ID, 9, 10, PAD_ID])
  np.testing.assert_array_equal(batch['tgt_out'][0], [8, EOS_ID, 9, 10, EOS_ID, PAD_ID])
  np.testing.assert_array_equal(batch['tgt_segments'][0], [1, 1, 2, 2, 2, 0])
  np.testing.assert_array_equal(batch['tgt_positions'][0], [0, 1, 0, 1, 2, 0])
  assert (batch['src'][1] == PAD_ID).all() and (batch['tgt_segments'][1] == 0).all()


@pytest.mark.parametrize('attention_impl', ['xla', 'einsum'])
def test_packed_loss_equals_unpacked_loss(attention_impl):
  model, params = tiny_model()
  model = model.clone(config=dataclasses.replace(model.config, attention_impl=attention_impl))
  src, tgt = examples(12)
  rows = packing.plan_rows([len(s) for s in src], [len(t) for t in tgt], length=16)
  assert len(rows) <= 8
  packed = packing.make_packed_batch(src, tgt, rows, num_rows=8, length=16)
  assert (packed['src_segments'].max(axis=1) > 1).any()  # some rows really hold several examples
  unpacked = batching.make_batch(src, tgt, rows=len(src), length=8)

  def sums(batch):
    logits, _, _ = lm.forward('translation', model, params, {k: jnp.asarray(v) for k, v in batch.items()}, True)
    return [float(x) for x in ts.label_smoothed_cross_entropy(logits, jnp.asarray(batch['tgt_out']), 0.1)]

  p_loss, p_nll, p_tokens = sums(packed)
  u_loss, u_nll, u_tokens = sums(unpacked)
  assert p_tokens == u_tokens == sum(len(t) for t in tgt)
  np.testing.assert_allclose(p_loss / p_tokens, u_loss / u_tokens, rtol=1e-5)
  np.testing.assert_allclose(p_nll / p_tokens, u_nll / u_tokens, rtol=1e-5)


def test_packed_examples_do_not_see_each_other():
  model, params = tiny_model()
  src, tgt = [[5, 6, EOS_ID], [7, EOS_ID]], [[8, EOS_ID], [9, 10, EOS_ID]]
  other_src = [[5, 6, EOS_ID], [12, 13, EOS_ID]]
  a = packing.make_packed_batch(src, tgt, [[0, 1]], num_rows=1, length=8)
  b = packing.make_packed_batch(other_src, tgt, [[0, 1]], num_rows=1, length=8)
  logits = lambda batch: lm.forward('translation', model, params, {k: jnp.asarray(v) for k, v in batch.items()},
                                   True)[0]
  la, lb = np.asarray(logits(a)), np.asarray(logits(b))
  # The first example's predictions ignore what the second example's source says...
  np.testing.assert_allclose(la[0, :2], lb[0, :2], atol=1e-5)
  # ...and the second's depend on it.
  assert not np.allclose(la[0, 2:5], lb[0, 2:5], atol=1e-5)
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x: np.isfinite(x).all(), la))
