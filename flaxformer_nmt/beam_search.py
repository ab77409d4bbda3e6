"""Beam search and greedy search over an incremental decoder, as pure functions for jax.jit.

Both drive `step_fn(tokens [N], index, cache) -> (logits [N, V], cache)`, which feeds the token at position
`index` (0 is BOS) and returns the distribution of the token at `index + 1`. Only the self-attention cache
is carried and reordered between steps; anything constant per sentence (encoder keys/values) belongs in
the closure of `step_fn`.

Beam search follows the standard finishing rule (fairseq's and CTranslate2's). Per sentence it keeps K =
`beam_size` unfinished prefixes ("alive") and up to K finished hypotheses. Each step extends every alive
prefix by every token and ranks the 2K best of those K x V candidates by log P (ties to the lower beam, then
the lower token id). An EOS candidate finishes a hypothesis only if it ranks among the K best of the 2K;
the K best non-EOS candidates become the next alive prefixes. An EOS extension of a prefix that is not
among the K best does not finish, so a very unlikely short hypothesis never wins on its length penalty
(exact search prefers the empty output for most sentences; Stahlberg and Byrne 2019).
A finished hypothesis scores log P / lp(n) with the GNMT length penalty lp(n) = ((5 + n) / 6)^alpha, where
n counts the generated tokens, EOS included (BOS not): "EOS" alone has n = 1.
Stopping rule (fairseq's): a sentence is done once K hypotheses have finished (the first K to finish; of
one step's, the better ones) or at its length limit. A sentence of n source tokens may produce at most
n + extra tokens: EOS is forced at that length, so every sentence finishes at least one hypothesis. The
loop exits when every sentence is done; the finished hypotheses come back sorted by score.

Greedy search and sampling share one loop that picks a single token per row and step; it exits once every
row has produced EOS. Scores and log probabilities are float32 whatever the model's dtype.
"""
import jax
import jax.numpy as jnp

NEG_INF = -1.0e9  # finite, so that -inf - -inf never makes a NaN


def length_penalty(length, alpha):
  return ((5.0 + length) / 6.0) ** alpha


def _mask_logits(log_probs, index, max_lengths, eos_id, forbidden_ids):
  """Forbids `forbidden_ids`, and everything but EOS for rows that reached their length limit."""
  tokens = jnp.arange(log_probs.shape[-1])
  forbidden = jnp.isin(tokens, jnp.asarray(forbidden_ids, jnp.int32)) if forbidden_ids else tokens < 0
  at_limit = (index + 1 >= max_lengths)
  at_limit = at_limit.reshape(at_limit.shape + (1,) * (log_probs.ndim - at_limit.ndim))
  # One select over [rows, V] (not one scatter per forbidden token): a single pass over the largest array.
  return jnp.where(forbidden | (at_limit & (tokens != eos_id)), NEG_INF, log_probs)


def beam_search(step_fn, cache, *, batch_size, beam_size, max_length, max_lengths, alpha, bos_id, eos_id,
                forbidden_ids=(), cache_lengths=()):
  """Returns (sequences [B, K, max_length], scores [B, K]), best first; sequences end at EOS, then pad 0.

  cache: pytree whose leaves have a leading axis of B * K (sentence-major: row b * K + k).
  max_length: static number of decoding steps (the cache's length).
  max_lengths: [B] int, each sentence's limit on generated tokens (<= max_length).
  cache_lengths: see `_staged_while_loop` (empty: the cache has max_length positions throughout).
  Scores are log P / length_penalty(n, alpha). A slot with no hypothesis (a sentence whose length limit
  leaves fewer than K possible outputs) scores NEG_INF.
  """
  B, K, L = batch_size, beam_size, max_length
  sequences = jnp.zeros((B, K, L + 1), jnp.int32).at[:, :, 0].set(bos_id)
  # Only the first beam starts alive: K identical beams would fill the beam with duplicates.
  alive_log_probs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (K - 1), jnp.float32), (B, 1))
  finished_sequences = jnp.zeros_like(sequences)
  finished_scores = jnp.full((B, K), NEG_INF, jnp.float32)
  num_finished = jnp.zeros((B,), jnp.int32)
  max_lengths = jnp.minimum(max_lengths, L)

  def still_running(state):
    index, _, _, _, _, num_finished, _ = state
    return (index < L) & jnp.any((num_finished < K) & (index < max_lengths))

  def step(state):
    index, sequences, alive_log_probs, finished_sequences, finished_scores, num_finished, cache = state
    logits, cache = step_fn(sequences[:, :, index].reshape(B * K), index, cache)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(B, K, -1)
    log_probs = _mask_logits(log_probs, index, max_lengths[:, None], eos_id, forbidden_ids)
    scores, beams, tokens = _top_candidates(alive_log_probs[:, :, None] + log_probs, 2 * K)
    valid = scores > NEG_INF / 2  # extensions of dead beams and masked tokens are not hypotheses
    is_eos = tokens == eos_id

    # Finished: EOS candidates among the K best, in rank order, while the sentence has fewer than K.
    eos_in_top = is_eos[:, :K] & valid[:, :K]
    admitted = eos_in_top & (num_finished[:, None] + jnp.cumsum(eos_in_top, axis=1) <= K)
    new_scores = jnp.where(admitted, scores[:, :K] / length_penalty(index + 1.0, alpha), NEG_INF)
    new_sequences = _gather_beams(sequences, beams[:, :K]).at[:, :, index + 1].set(eos_id)
    # Stable top_k: the earlier finished hypotheses first among equal scores, then these in rank order.
    finished_scores, keep = jax.lax.top_k(jnp.concatenate([finished_scores, new_scores], axis=1), K)
    finished_sequences = jnp.take_along_axis(
        jnp.concatenate([finished_sequences, new_sequences], axis=1), keep[:, :, None], axis=1)
    num_finished = num_finished + admitted.sum(axis=1)

    # Alive: the K best non-EOS candidates (of 2K there are at least K: each beam has one EOS extension).
    _, picks = jax.lax.top_k(jnp.where(is_eos, -1, 2 * K - jnp.arange(2 * K)), K)
    alive_log_probs = jnp.take_along_axis(scores, picks, axis=1)
    beams, tokens = jnp.take_along_axis(beams, picks, axis=1), jnp.take_along_axis(tokens, picks, axis=1)
    sequences = _gather_beams(sequences, beams).at[:, :, index + 1].set(tokens)
    cache = jax.tree_util.tree_map(lambda x: _gather_rows(x, beams), cache)
    return index + 1, sequences, alive_log_probs, finished_sequences, finished_scores, num_finished, cache

  state = (jnp.asarray(0), sequences, alive_log_probs, finished_sequences, finished_scores, num_finished, cache)
  _, _, _, finished_sequences, finished_scores, _, _ = _staged_while_loop(still_running, step, state, cache_lengths)
  return finished_sequences[:, :, 1:], finished_scores


def _staged_while_loop(still_running, step, state, cache_lengths):
  """jax.lax.while_loop(still_running, step, state), where state = (index, ..., cache), with a cache that grows.

  cache_lengths: ascending position counts, the last one the cache's full length; the given cache has the
  first. While index < cache_lengths[i] the loop runs on a cache of that many positions, then every cache
  leaf is zero-padded along its position axis (axis 2: leaves are [rows, heads, positions, ...], the model's
  head-major cache) to the next length. A step reads and reorders the
  whole cache, so the early steps, where most searches end, cost a fraction of a full-length step. One loop
  per length, all inside the same jit: a later loop finds every sentence done and runs no step.
  """
  if len(cache_lengths) <= 1:
    return jax.lax.while_loop(still_running, step, state)
  for i, length in enumerate(cache_lengths):
    if i:
      state = state[:-1] + (jax.tree_util.tree_map(
          lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2])] + [(0, 0)] * (x.ndim - 3)), state[-1]),)
    state = jax.lax.while_loop(lambda s, length=length: still_running(s) & (s[0] < length), step, state)
  return state


def cache_lengths_for(first, max_length):
  """Cache lengths first, 2 * first, 4 * first, ..., max_length (see _staged_while_loop); a doubling that would
  reach 3/4 of max_length is max_length itself (one loop less to compile, for little extra reading)."""
  lengths = [min(first, max_length)]
  while lengths[-1] < max_length:
    lengths.append(2 * lengths[-1] if 2 * lengths[-1] < 0.75 * max_length else max_length)
  return tuple(lengths)


def _top_candidates(candidates, n):
  """The n best of candidates [B, K, V] per sentence over all beams: (scores, beams, tokens), each [B, n].

  Ranked by score, ties to the lower beam, then the lower token (lax.top_k is stable). Each beam's n best
  first, then the n best of those K * n: the same candidates as one top_k over K * V, on a smaller array.
  """
  B, K, V = candidates.shape
  if n >= V:
    scores, flat = jax.lax.top_k(candidates.reshape(B, K * V), n)
    return scores, flat // V, flat % V
  beam_scores, beam_tokens = jax.lax.top_k(candidates, n)  # [B, K, n]
  scores, flat = jax.lax.top_k(beam_scores.reshape(B, K * n), n)
  return scores, flat // n, jnp.take_along_axis(beam_tokens.reshape(B, K * n), flat, axis=1)


def _gather_beams(x, beams):
  """x [B, K, ...] reordered so that beam k of sentence b comes from beam beams[b, k]."""
  return jnp.take_along_axis(x, beams.reshape(beams.shape + (1,) * (x.ndim - 2)), axis=1)


def _gather_rows(x, beams):
  """x [B * K, ...] (sentence-major rows) reordered like _gather_beams."""
  B, K = beams.shape
  return _gather_beams(x.reshape((B, K) + x.shape[1:]), beams).reshape(x.shape)


def _token_by_token(step_fn, cache, choose, *, batch_size, max_length, max_lengths, bos_id, eos_id,
                    forbidden_ids, cache_lengths=()):
  """One token per row and step, picked by `choose(log_probs [N, V], index) -> tokens [N]`.

  Returns (sequences [N, max_length], log probabilities [N]): the model's log P of each row's tokens (EOS
  included), whatever rule picked them.
  """
  B, L = batch_size, max_length
  max_lengths = jnp.minimum(max_lengths, L)
  sequences = jnp.zeros((B, L + 1), jnp.int32).at[:, 0].set(bos_id)
  finished = jnp.zeros((B,), jnp.bool_)
  scores = jnp.zeros((B,), jnp.float32)

  def still_running(state):
    index, _, finished, _, _ = state
    return (index < L) & ~jnp.all(finished)

  def step(state):
    index, sequences, finished, scores, cache = state
    logits, cache = step_fn(sequences[:, index], index, cache)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    log_probs = _mask_logits(log_probs, index, max_lengths, eos_id, forbidden_ids)
    tokens = choose(log_probs, index)
    scores = scores + jnp.where(finished, 0.0, jnp.take_along_axis(log_probs, tokens[:, None], axis=1)[:, 0])
    tokens = jnp.where(finished, 0, tokens)  # pad after EOS
    sequences = sequences.at[:, index + 1].set(tokens)
    return index + 1, sequences, finished | (tokens == eos_id), scores, cache

  state = (jnp.asarray(0), sequences, finished, scores, cache)
  _, sequences, _, scores, _ = _staged_while_loop(still_running, step, state, cache_lengths)
  return sequences[:, 1:], scores


def greedy_search(step_fn, cache, *, batch_size, max_length, max_lengths, bos_id, eos_id, forbidden_ids=(),
                  cache_lengths=()):
  """Returns (sequences [B, max_length], log probabilities [B]): the most likely token at every step."""
  return _token_by_token(step_fn, cache, lambda log_probs, index: jnp.argmax(log_probs, axis=-1),
                         batch_size=batch_size, max_length=max_length, max_lengths=max_lengths, bos_id=bos_id,
                         eos_id=eos_id, forbidden_ids=forbidden_ids, cache_lengths=cache_lengths)


def sample_search(step_fn, cache, keys, *, temperature, top_k, batch_size, max_length, max_lengths, bos_id,
                  eos_id, forbidden_ids=(), cache_lengths=()):
  """Returns (sequences [B, max_length], log probabilities [B]) sampled token by token.

  Each token is drawn from softmax(logits / temperature) restricted to the `top_k` most likely tokens
  (top_k=0: the whole vocabulary). keys: [B] PRNG keys, one per row; the token at position t of row r uses
  fold_in(keys[r], t), so a row's sample does not depend on the other rows of its batch. The returned log
  probabilities are the model's (temperature 1, unrestricted), as for greedy search.
  """
  if temperature <= 0:
    raise ValueError(f'temperature must be positive, not {temperature}')

  def choose(log_probs, index):
    k = min(top_k, log_probs.shape[-1]) if top_k > 0 else log_probs.shape[-1]
    # top_k of the whole vocabulary is an (expensive) sort; skip it when there is nothing to cut.
    candidates, ids = (jax.lax.top_k(log_probs, k) if k < log_probs.shape[-1]
                       else (log_probs, jnp.broadcast_to(jnp.arange(k), log_probs.shape)))
    # Forbidden tokens keep a log probability of NEG_INF (also after dividing): never drawn.
    picks = jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, index), row))(
        keys, candidates / temperature)
    return jnp.take_along_axis(ids, picks[:, None], axis=1)[:, 0]

  return _token_by_token(step_fn, cache, choose, batch_size=batch_size, max_length=max_length,
                         max_lengths=max_lengths, bos_id=bos_id, eos_id=eos_id, forbidden_ids=forbidden_ids,
                         cache_lengths=cache_lengths)


def token_by_token(step_fn, cache, choose, *, batch_size, max_length, max_lengths, bos_id, eos_id,
                   forbidden_ids=()):
  """The loop greedy and sampled search share, with the caller's token rule `choose(log_probs [N, V], index)
  -> tokens [N]` (generate.py: prompts fed through the cache, top-p sampling). Same returns."""
  return _token_by_token(step_fn, cache, choose, batch_size=batch_size, max_length=max_length,
                         max_lengths=max_lengths, bos_id=bos_id, eos_id=eos_id, forbidden_ids=forbidden_ids)
