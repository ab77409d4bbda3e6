"""Cached decoding against uncached decoding, and beam search against exhaustive search."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from flaxformer_nmt import beam_search
from flaxformer_nmt.model import Transformer
from flaxformer_nmt.tokenizer import BOS_ID, EOS_ID, PAD_ID

SRC = jnp.array([[4, 5, 6, 7, 3], [6, 4, 3, 0, 0]])  # ids < 8, the smallest vocabulary used here


def cached_step_fn(model, params, src, rows):
  """The decoder run incrementally: one position per step against its self-attention cache."""
  variables = {'params': params}
  encoded = model.apply(variables, src, method=Transformer.encode)
  cross = jax.tree_util.tree_map(lambda x: jnp.repeat(x, rows, axis=0),
                                 model.apply(variables, encoded, method=Transformer.cross_attention_kv))
  src_rows = jnp.repeat(src, rows, axis=0)
  return jax.jit(lambda tokens, index, cache: model.apply(variables, tokens, index, cache, cross, src_rows,
                                                          method=Transformer.decode_step))


def uncached_step_fn(model, params, src, rows):
  """The reference: the 'cache' is the token prefix, and the whole decoder re-runs on it every step."""
  variables = {'params': params}
  src_rows = jnp.repeat(src, rows, axis=0)

  def step(tokens, index, prefix):
    prefix = prefix.at[:, index].set(tokens)
    logits = model.apply(variables, src_rows, prefix)
    return logits[:, index], prefix
  return step


def run_search(model, params, cached, beam_size, max_length, alpha=0.6, max_lengths=None):
  rows = max(beam_size, 1)
  batch = SRC.shape[0]
  if cached:
    step_fn = cached_step_fn(model, params, SRC, rows)
    cache = model.apply({'params': params}, batch * rows, max_length, method=Transformer.init_cache)
  else:
    step_fn = uncached_step_fn(model, params, SRC, rows)
    cache = jnp.full((batch * rows, max_length), PAD_ID, jnp.int32)
  max_lengths = jnp.full((batch,), max_length) if max_lengths is None else max_lengths
  common = dict(batch_size=batch, max_length=max_length, max_lengths=max_lengths, bos_id=BOS_ID, eos_id=EOS_ID,
                forbidden_ids=(PAD_ID, BOS_ID))
  if beam_size == 0:
    return beam_search.greedy_search(step_fn, cache, **common)
  return beam_search.beam_search(step_fn, cache, beam_size=beam_size, alpha=alpha, **common)


def test_cached_decoder_step_equals_full_decoder():
  model, params = tiny_model()
  tgt = jnp.array([[2, 10, 11, 12, 13, 14], [2, 15, 4, 5, 6, 7]])
  full = model.apply({'params': params}, SRC, tgt)
  step_fn = cached_step_fn(model, params, SRC, 1)
  cache = model.apply({'params': params}, 2, 6, method=Transformer.init_cache)
  for index in range(6):
    logits, cache = step_fn(tgt[:, index], index, cache)
    np.testing.assert_allclose(logits, full[:, index], atol=1e-4)


@pytest.mark.parametrize('beam_size', [0, 4])  # 0 is greedy
def test_search_with_the_cache_equals_search_without_it(beam_size):
  model, params = tiny_model()
  cached = run_search(model, params, True, beam_size, 10)
  uncached = run_search(model, params, False, beam_size, 10)
  np.testing.assert_array_equal(cached[0], uncached[0])
  np.testing.assert_allclose(cached[1], uncached[1], atol=1e-4)


def exhaustive_best(model, params, src_row, max_length, alpha, vocab):
  """Best-scoring output over every token sequence of at most max_length tokens ending in EOS."""
  allowed = [t for t in range(vocab) if t not in (PAD_ID, BOS_ID, EOS_ID)]
  candidates = [list(body) + [EOS_ID] for length in range(1, max_length + 1)
                for body in itertools.product(allowed, repeat=length - 1)]
  targets = np.array([c + [PAD_ID] * (max_length - len(c)) for c in candidates])
  tgt_in = np.concatenate([np.full((len(targets), 1), BOS_ID), targets[:, :-1]], axis=1)
  src = jnp.repeat(src_row[None], len(targets), axis=0)
  log_probs = jax.nn.log_softmax(model.apply({'params': params}, src, jnp.asarray(tgt_in)))
  token_log_probs = np.take_along_axis(np.asarray(log_probs), targets[:, :, None], axis=2)[:, :, 0]
  scores = [token_log_probs[i, :len(c)].sum() / beam_search.length_penalty(len(c), alpha)
            for i, c in enumerate(candidates)]
  best = int(np.argmax(scores))
  return scores[best], candidates[best]


def test_beam_as_wide_as_the_vocabulary_finds_the_exhaustive_optimum():
  vocab = 8
  model, params = tiny_model(vocab_size=vocab)
  for max_length, beam_size in ((2, vocab), (3, 25)):  # 25 = every prefix of 2 allowed tokens (5 x 5)
    for alpha in (0.0, 0.6, 2.0):
      sequences, scores = run_search(model, params, True, beam_size, max_length, alpha)
      for b in range(SRC.shape[0]):
        best_score, best_sequence = exhaustive_best(model, params, SRC[b], max_length, alpha, vocab)
        found = [int(t) for t in sequences[b, 0]]
        found = found[:found.index(EOS_ID) + 1]
        assert found == best_sequence, (max_length, alpha, b)
        np.testing.assert_allclose(scores[b, 0], best_score, rtol=1e-4)


def test_beam_scores_are_sorted_and_respect_per_sentence_limits():
  model, params = tiny_model()
  sequences, scores = run_search(model, params, True, 4, 12, max_lengths=jnp.array([3, 12]))
  assert np.all(np.diff(np.asarray(scores), axis=1) <= 1e-6)
  for k in range(4):
    first = [int(t) for t in sequences[0, k]]
    assert EOS_ID in first[:3]  # sentence 0 may generate at most 3 tokens, EOS included
