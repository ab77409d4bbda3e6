"""Cached decoding against uncached decoding, and beam search against exhaustive search."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from flaxformer_nmt import beam_search
from flaxformer_nmt import decode
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


def jitted_search(model, **static):
  return jax.jit(functools.partial(decode.search, model), static_argnames=tuple(static))


@pytest.mark.parametrize('beam_size', [0, 4])
def test_search_projecting_cross_attention_every_step_equals_the_cache(beam_size):
  model, params = tiny_model()
  options = dict(beam_size=beam_size, alpha=0.6, extra_length=6)
  cached = jitted_search(model, cache_cross_kv=True, **options)(params, SRC, cache_cross_kv=True, **options)
  per_step = jitted_search(model, cache_cross_kv=False, **options)(params, SRC, cache_cross_kv=False, **options)
  np.testing.assert_array_equal(cached[0], per_step[0])
  np.testing.assert_allclose(cached[1], per_step[1], atol=1e-5)


def test_sampling_from_the_top_1_is_greedy():
  model, params = tiny_model()
  options = dict(beam_size=0, alpha=0.6, extra_length=8)
  greedy_tokens, greedy_scores = jitted_search(model, **options)(params, SRC, **options)
  keys = decode.sample_keys(0, jnp.arange(SRC.shape[0]), 3)
  sampled = jitted_search(model, top_k=1, **options)(params, SRC, keys, top_k=1, **options)
  for k in range(3):
    np.testing.assert_array_equal(sampled[0][:, k], greedy_tokens[:, 0])
    np.testing.assert_allclose(sampled[1][:, k], greedy_scores[:, 0], atol=1e-5)


def test_samples_use_only_the_top_k_tokens_of_the_full_decoder():
  model, params = tiny_model()
  top_k, extra = 3, 8
  options = dict(beam_size=0, alpha=0.6, extra_length=extra, top_k=top_k, temperature=3.0)
  keys = decode.sample_keys(1, jnp.arange(SRC.shape[0]), 16)
  tokens, scores = jitted_search(model, **options)(params, SRC, keys, **options)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  # Re-score every sample with the whole (uncached) decoder run on its prefix; rank the tokens it chose.
  ranks = []
  for b in range(SRC.shape[0]):
    limit = int((SRC[b] != PAD_ID).sum()) - 1 + extra + 1  # generated tokens allowed, EOS included
    targets = tokens[b]
    tgt_in = np.concatenate([np.full((len(targets), 1), BOS_ID), targets[:, :-1]], axis=1)
    src = jnp.repeat(SRC[b:b + 1], len(targets), axis=0)
    log_probs = np.array(jax.nn.log_softmax(model.apply({'params': params}, src, jnp.asarray(tgt_in))))
    log_probs[:, :, [PAD_ID, BOS_ID]] = -np.inf
    for k, sample in enumerate(targets):
      length = list(sample).index(EOS_ID) + 1
      assert length <= limit
      for t in range(length):
        if t == limit - 1:  # the last allowed position forces EOS
          assert sample[t] == EOS_ID
          continue
        ranks.append(int((log_probs[k, t] > log_probs[k, t, sample[t]]).sum()))
      # The score is the model's log probability of the sample (temperature 1, no top-k).
      np.testing.assert_allclose(scores[b, k], sum(log_probs[k, t, sample[t]] for t in range(length)), rtol=1e-4)
  assert max(ranks) < top_k, ranks
  assert len(set(ranks)) == top_k  # every allowed rank occurs at this temperature: really sampling


def test_sampled_token_frequencies_follow_the_tempered_top_k_distribution():
  vocab, rows, temperature, top_k = 8, 6000, 2.0, 4
  logits = jnp.array([0.0, 1.0, 3.0, 0.5, 2.0, 1.5, -1.0, 2.5])  # ids 0 (pad) and 2 (bos) are forbidden

  def step_fn(tokens, index, cache):
    return jnp.broadcast_to(logits, (tokens.shape[0], vocab)), cache

  keys = jax.random.split(jax.random.key(0), rows)
  tokens, _ = beam_search.sample_search(step_fn, jnp.zeros(()), keys, temperature=temperature, top_k=top_k,
                                        batch_size=rows, max_length=2, max_lengths=jnp.full((rows,), 2),
                                        bos_id=BOS_ID, eos_id=EOS_ID, forbidden_ids=(PAD_ID, BOS_ID))
  allowed = np.array(logits).copy()
  allowed[[PAD_ID, BOS_ID]] = -np.inf
  top = np.argsort(-allowed)[:top_k]
  expected = np.zeros(vocab)
  expected[top] = np.exp(allowed[top] / temperature) / np.exp(allowed[top] / temperature).sum()
  observed = np.bincount(np.asarray(tokens[:, 0]), minlength=vocab) / rows
  np.testing.assert_allclose(observed, expected, atol=0.025)
  assert np.all(np.asarray(tokens[:, 1]) == EOS_ID)  # the length limit forces EOS next
