"""Beam search and greedy search over an incremental decoder, as pure functions for jax.jit.

Both drive `step_fn(tokens [N], index, cache) -> (logits [N, V], cache)`, which feeds the token at position
`index` (0 is BOS) and returns the distribution of the token at `index + 1`. Only the self-attention cache
is carried between steps; anything constant per sentence (encoder keys/values) belongs in the closure of
`step_fn`. Beam search reorders a plain cache's rows after every step, or, for a SlotCache, only the table
of which slot holds each beam's history (the keys/values stay where they were written).

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
one step's, the better ones) or at its length limit. A sentence of n source pieces (EOS not counted) may
produce at most floor(max_len_a * n + extra) tokens before EOS (search.output_limits): EOS is forced after
them (max_lengths, EOS included, is one more), so every sentence finishes at least one hypothesis. The loop
exits when every sentence is done; the finished hypotheses come back sorted by score.
`min_length` (every search; 0 by default here, 1 in decode.py as fairseq's --min-len and CTranslate2's
min_decoding_length) forbids EOS while fewer tokens have been generated: with 1, a non-empty source never
gets an empty output, whatever the model prefers. A row's length limit wins over it.

The searches are built from a state (BeamState, TokenState) whose arrays all lead with the sentence axis, a
step, and a test of which sentences still search: beam_search() and friends run them in one jitted loop
until every sentence is done; batch_search.py runs them in segments (search.run_segment) and drops the
finished sentences of a batch between segments (the same results, fewer rows computed).

Greedy search and sampling share one loop that picks a single token per row and step; it exits once every
row has produced EOS. Scores and log probabilities are float32 whatever the model's dtype.
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1.0e9  # finite, so that -inf - -inf never makes a NaN


def average_probabilities(log_probs):
  """An ensemble's next-token distribution from its members' log probabilities [M, ..., V]: the log of the
  mean of their probabilities, log((1/M) sum_m exp(log_probs_m)) (fairseq's ensemble rule, not a mean of
  logits)."""
  return jax.nn.logsumexp(log_probs, axis=0) - jnp.log(log_probs.shape[0]).astype(log_probs.dtype)


def length_penalty(length, alpha):
  return ((5.0 + length) / 6.0) ** alpha


def _mask_logits(log_probs, index, max_lengths, eos_id, forbidden_ids, min_length=0):
  """Forbids `forbidden_ids`, EOS before `min_length` tokens, and everything but EOS for rows that reached
  their length limit (the limit wins over min_length, as in best_extensions)."""
  tokens = jnp.arange(log_probs.shape[-1])
  forbidden = jnp.isin(tokens, jnp.asarray(forbidden_ids, jnp.int32)) if forbidden_ids else tokens < 0
  at_limit = (index + 1 >= max_lengths)
  at_limit = at_limit.reshape(at_limit.shape + (1,) * (log_probs.ndim - at_limit.ndim))
  forbidden = jnp.where(at_limit, tokens != eos_id, forbidden | ((tokens == eos_id) & (index < min_length)))
  # One select over [rows, V] (not one scatter per forbidden token): a single pass over the largest array.
  return jnp.where(forbidden, NEG_INF, log_probs)


def best_extensions(logits, base, n, index, max_lengths, eos_id, forbidden_ids, min_length=0, normalize=True):
  """The n best allowed extensions of each row: (scores [..., n], tokens [..., n]), best first.

  logits [..., V]; base [...] (a row's log P so far, 0 for greedy); max_lengths broadcasts against base.
  A row's scores are base + log_softmax(logits)[token] for its allowed tokens (not `forbidden_ids`, nor EOS
  while index < min_length; EOS only once index + 1 reaches the row's limit), ranked by score, ties to the
  lower token, padded with NEG_INF: top_k(base + mask(log_softmax(logits)), n), without [rows, V] arrays of
  log probabilities and masks. Those cost the CPU more than the step's output projection (a write and two
  reads of rows x V floats, and a select the slice maxima of `top_k` do not fuse); here the vocabulary is read
  for its normalizer and maxima only, and the rest works on n + len(forbidden_ids) (+ 1 for EOS under
  min_length) raw-logit candidates per row. (Two logits that round to the same score at the n-th place could
  be kept in logit rather than token order: no case seen.) normalize=False skips the normalizer, the one pass
  over the vocabulary besides the maxima: a row's candidates rank the same (greedy search's choice), and their
  scores are base + logit - the row's largest logit instead of log probabilities.
  """
  logits = logits.astype(jnp.float32)
  # Enough candidates that n remain allowed: the forbidden tokens, and EOS where min_length may forbid it.
  held_back = len(forbidden_ids) + (1 if min_length > 0 else 0)
  values, tokens, row_max = _top_k_and_max(logits, min(n + held_back, logits.shape[-1]))
  shift = jax.lax.stop_gradient(row_max[..., None])
  log_norm = jnp.log(jnp.exp(logits - shift).sum(axis=-1, keepdims=True)) if normalize else 0.0  # log_softmax's
  log_softmax = lambda x: (x - shift) - log_norm
  scores = base[..., None] + log_softmax(values)
  if forbidden_ids:
    scores = jnp.where(jnp.isin(tokens, jnp.asarray(forbidden_ids, jnp.int32)), NEG_INF, scores)
  if min_length > 0:
    scores = jnp.where((tokens == eos_id) & (index < min_length), NEG_INF, scores)
  # A row at its length limit has one extension: EOS, whatever its rank.
  at_limit = jnp.broadcast_to(index + 1 >= max_lengths, base.shape)[..., None]
  slot = jnp.arange(tokens.shape[-1])
  eos_score = base[..., None] + log_softmax(logits[..., eos_id:eos_id + 1])
  scores = jnp.where(at_limit, jnp.where(slot == 0, eos_score, NEG_INF), scores)
  tokens = jnp.where(at_limit, jnp.where(slot == 0, eos_id, 0), tokens)
  # Ranked by score, ties to the lower token, as top_k over the masked vocabulary ranks them.
  neg_scores, tokens = jax.lax.sort((-scores, tokens), dimension=-1, num_keys=2)
  return -neg_scores[..., :n], tokens[..., :n]


class SlotCache(NamedTuple):
  """A beam search's self-attention cache that a step does not copy: beam k of a sentence writes its keys
  and values to slot k at each position, and `ancestry` names, for each beam and position, the slot that
  holds its history there; a step reorders that table, not the keys/values (the model's decode_step reads
  the slots through it)."""
  slots: Any  # the model's cache: leaves [B, H, L * K, D] (position-major)
  ancestry: jax.Array  # [B, K, L] int32


def slot_cache(slots, beam_size):
  """A SlotCache of the model's empty `slots` (before the first step, every beam's history in slot 0)."""
  batch_size, _, entries = jax.tree_util.tree_leaves(slots)[0].shape[:3]
  return SlotCache(slots, jnp.zeros((batch_size, beam_size, entries // beam_size), jnp.int32))


class BeamState(NamedTuple):
  """A beam search of B sentences x K beams after `index` steps. Every array leads with the sentence axis
  (a plain cache's leaves with its B * K rows, sentence-major), so that a batch can drop finished sentences."""
  index: jax.Array  # [] tokens generated so far: the position fed to the decoder next
  sequences: jax.Array  # [B, K, L + 1] the alive prefixes, BOS first
  alive_log_probs: jax.Array  # [B, K] their log P (NEG_INF: no prefix)
  finished_sequences: jax.Array  # [B, K, L + 1]
  finished_scores: jax.Array  # [B, K] log P / length penalty, best first (NEG_INF: no hypothesis)
  num_finished: jax.Array  # [B] hypotheses finished so far (the pool keeps the first K)
  max_lengths: jax.Array  # [B] each sentence's limit on generated tokens, EOS included
  cache: Any  # leaves [B * K, ...], or a SlotCache


def beam_start(cache, *, batch_size, beam_size, max_length, max_lengths, bos_id):
  """The state before the first step: BOS, one alive beam per sentence. max_length: the static number of
  steps (the cache's full length); max_lengths: [B] per-sentence limits (cut to max_length)."""
  B, K, L = batch_size, beam_size, max_length
  sequences = jnp.zeros((B, K, L + 1), jnp.int32).at[:, :, 0].set(bos_id)
  # Only the first beam starts alive: K identical beams would fill the beam with duplicates.
  alive_log_probs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (K - 1), jnp.float32), (B, 1))
  return BeamState(jnp.asarray(0, jnp.int32), sequences, alive_log_probs, jnp.zeros_like(sequences),
                   jnp.full((B, K), NEG_INF, jnp.float32), jnp.zeros((B,), jnp.int32),
                   jnp.minimum(max_lengths, L), cache)


def beam_unfinished(state):
  """[B] bool: the sentences still searching (fewer than K finished and below their length limit)."""
  return (state.num_finished < state.alive_log_probs.shape[1]) & (state.index < state.max_lengths)


def beam_step(step_fn, state, *, alpha, eos_id, forbidden_ids, min_length=0):
  """One step of every sentence's search (see the module docstring for the rule)."""
  B, K = state.alive_log_probs.shape
  cache = state.cache
  if isinstance(cache, SlotCache):  # each beam writes this position to its own slot
    cache = cache._replace(ancestry=cache.ancestry.at[:, :, state.index].set(jnp.arange(K, dtype=jnp.int32)))
  logits, cache = step_fn(state.sequences[:, :, state.index].reshape(B * K), state.index, cache)
  scores, tokens = best_extensions(logits.reshape(B, K, -1), state.alive_log_probs, 2 * K, state.index,
                                   state.max_lengths[:, None], eos_id, forbidden_ids, min_length)
  scores, beams, tokens = _top_candidates(scores, tokens, 2 * K)
  return _beam_advance(state, scores, beams, tokens, cache, alpha, eos_id)


def beam_first_step(step_fn, state, *, alpha, eos_id, forbidden_ids, min_length=0):
  """beam_step from beam_start's state (index 0) on one decoder row per sentence: before the first step a
  sentence has one alive beam (the others score NEG_INF, and their candidates rank below all of its 2K), so
  its 2K best candidates are that beam's, and every beam's cache row is the same. The state beam_step would
  give, for 1/K of its decoder work. step_fn must take any number of rows (search.py's does where the
  sentence's rows share its encoder keys/values)."""
  B, K = state.alive_log_probs.shape
  if isinstance(state.cache, SlotCache):  # beam 0 writes slot 0, which every beam's history starts in
    first_rows = state.cache._replace(ancestry=state.cache.ancestry[:, :1])
  else:
    first_rows = jax.tree_util.tree_map(lambda x: x[::K], state.cache)  # row b * K: beam 0 of sentence b
  logits, cache = step_fn(state.sequences[:, 0, state.index], state.index, first_rows)
  scores, tokens = best_extensions(logits, state.alive_log_probs[:, 0], 2 * K, state.index, state.max_lengths,
                                   eos_id, forbidden_ids, min_length)
  # A vocabulary of fewer than 2K tokens gives fewer candidates: the rest are no hypotheses (NEG_INF) of token 0
  # (PAD), not EOS: K or more EOS candidates would leave the real one among the K alive beams.
  scores, tokens = pad_axis(scores, 1, 2 * K, NEG_INF), pad_axis(tokens, 1, 2 * K, 0)
  if isinstance(cache, SlotCache):
    cache = cache._replace(ancestry=state.cache.ancestry)
  else:
    cache = jax.tree_util.tree_map(lambda x: jnp.repeat(x, K, axis=0), cache)
  return _beam_advance(state, scores, jnp.zeros_like(tokens), tokens, cache, alpha, eos_id)


def _beam_advance(state, scores, beams, tokens, cache, alpha, eos_id):
  """The state after a step whose 2K best candidates per sentence are (scores, beams, tokens) [B, 2K], best
  first, `cache` holding the step's keys/values in the rows of the beams they extend."""
  index, sequences, _, finished_sequences, finished_scores, num_finished, max_lengths, _ = state
  K = sequences.shape[1]
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
  if isinstance(cache, SlotCache):
    cache = cache._replace(ancestry=_gather_beams(cache.ancestry, beams))
  else:
    cache = jax.tree_util.tree_map(lambda x: _gather_rows(x, beams), cache)
  return BeamState(index + 1, sequences, alive_log_probs, finished_sequences, finished_scores, num_finished,
                   max_lengths, cache)


def beam_output(state):
  """(sequences [B, K, L], scores [B, K]) of the finished hypotheses, best first; sequences end at EOS, then
  pad 0."""
  return state.finished_sequences[:, :, 1:], state.finished_scores


def beam_search(step_fn, cache, *, batch_size, beam_size, max_length, max_lengths, alpha, bos_id, eos_id,
                forbidden_ids=(), cache_lengths=(), min_length=0):
  """Returns (sequences [B, K, max_length], scores [B, K]), best first; sequences end at EOS, then pad 0.

  cache: pytree whose leaves have a leading axis of B * K (sentence-major: row b * K + k).
  max_length: static number of decoding steps (the cache's length).
  max_lengths: [B] int, each sentence's limit on generated tokens (<= max_length).
  cache_lengths: see `staged_search` (empty: the cache has max_length positions throughout).
  Scores are log P / length_penalty(n, alpha). A slot with no hypothesis (a sentence whose length limit
  leaves fewer than K possible outputs) scores NEG_INF.
  """
  state = beam_start(cache, batch_size=batch_size, beam_size=beam_size, max_length=max_length,
                     max_lengths=max_lengths, bos_id=bos_id)
  step = functools.partial(beam_step, step_fn, alpha=alpha, eos_id=eos_id, forbidden_ids=forbidden_ids,
                           min_length=min_length)
  return beam_output(staged_search(beam_unfinished, step, state, cache_lengths))


def run_until(unfinished, step, state, until):
  """Steps while some sentence is unfinished and fewer than `until` tokens (a traced scalar too) are
  generated: one segment of a search that the caller may continue, after dropping finished sentences."""
  return jax.lax.while_loop(lambda s: (s.index < until) & jnp.any(unfinished(s)), step, state)


def pad_axis(x, axis, length, value=0):
  """x padded with `value` along `axis` to `length` (NumPy stays NumPy: the host grows a search without a
  program to compile)."""
  xp = np if isinstance(x, np.ndarray) else jnp
  return xp.pad(x, [(0, 0)] * axis + [(0, length - x.shape[axis])] + [(0, 0)] * (x.ndim - axis - 1),
                constant_values=value)


def cache_length(state):
  """The positions of a search state's self-attention cache."""
  if isinstance(state.cache, SlotCache):
    return state.cache.ancestry.shape[-1]
  return jax.tree_util.tree_leaves(state.cache)[0].shape[2]


def grow_cache(state, length):
  """The state with every cache leaf zero-padded along its position axis (axis 2: leaves are [rows, heads,
  positions, ...], the model's head-major cache; a SlotCache's slots hold K entries a position) to `length`
  positions."""
  def grow(tree, entries):  # entries a position
    return jax.tree_util.tree_map(lambda x: pad_axis(x, 2, length * entries), tree)
  if isinstance(state.cache, SlotCache):
    slots, ancestry = state.cache
    return state._replace(cache=SlotCache(grow(slots, ancestry.shape[1]), pad_axis(ancestry, 2, length)))
  return state._replace(cache=grow(state.cache, 1))


def grow_state(state, length):
  """grow_cache, and room for `length` tokens in the state's sequences: a search that goes on past its
  cache's end (the host's copy of a BeamState or TokenState)."""
  state = grow_cache(state, length)
  grown = {name: pad_axis(x, x.ndim - 1, length + 1) for name, x in state._asdict().items()
           if name in ('sequences', 'finished_sequences')}
  return state._replace(**grown)


def staged_search(unfinished, step, state, cache_lengths):
  """Runs `step` until no sentence is `unfinished`, on a cache that grows.

  cache_lengths: ascending position counts, the last one the cache's full length; the given cache has the
  first. While index < cache_lengths[i] the loop runs on a cache of that many positions, then the cache
  grows to the next length (grow_cache). A step reads the whole cache, so the early steps, where
  most searches end, cost a fraction of a full-length step. One loop per length, all inside the same jit: a
  later loop finds every sentence done and runs no step.
  """
  full_length = state.sequences.shape[-1] - 1
  for i, length in enumerate(cache_lengths or (full_length,)):
    if i:
      state = grow_cache(state, length)
    state = run_until(unfinished, step, state, length)
  return state


def cache_lengths_for(first, max_length):
  """Cache lengths first, 2 * first, 4 * first, ..., max_length (see staged_search); a doubling that would
  reach 3/4 of max_length is max_length itself (one loop less to compile, for little extra reading)."""
  lengths = [min(first, max_length)]
  while lengths[-1] < max_length:
    lengths.append(2 * lengths[-1] if 2 * lengths[-1] < 0.75 * max_length else max_length)
  return tuple(lengths)


def _top_candidates(beam_scores, beam_tokens, n):
  """The n best candidates per sentence over all beams, from each beam's best (beam_scores, beam_tokens
  [B, K, m], best first, m <= n): (scores, beams, tokens), each [B, n]. Ranked by score, ties to the lower
  beam, then the lower token (lax.top_k is stable, and each beam's list is in that order)."""
  B, K, m = beam_scores.shape
  scores, flat = jax.lax.top_k(beam_scores.reshape(B, K * m), n)
  return scores, flat // m, jnp.take_along_axis(beam_tokens.reshape(B, K * m), flat, axis=1)


TOP_K_CHUNK = 32  # slice width of top_k (32 timed faster than 64 and 128 at 320 to 1,024 rows x 8,000 on the CPU)


def top_k(x, k, chunk=None):
  """jax.lax.top_k(x, k) over the last axis (same values, same indices, ties to the lower index), through the
  maxima of `chunk`-wide slices: one fused pass over x, then top_k over the slice maxima and over the k best
  slices' elements.

  Exact: an element among the k best lies in a slice whose maximum ranks among the k best slice maxima
  (every better slice holds an element better than it), and the k best slices are gathered in index order,
  so ties keep resolving to the lower index. On the CPU, top_k of a [rows, 8000] vocabulary is a per-row
  partial sort that costs more than the step's output projection; its slice maxima are one vectorized read.
  """
  values, indices, _ = _top_k_and_max(x, k, chunk)
  return values, indices


INNER_TOP_K_CHUNK = 16  # the slice width of top_k's own two top_k (0: lax.top_k)


def _inner_top_k(x, k):
  """top_k over the slice maxima and over the gathered slices, by slices again: lax.top_k costs the CPU ~6 ns
  per element (a per-row partial sort), a slice maximum far less (3% of a beam-4 step at 1,024 rows)."""
  if not INNER_TOP_K_CHUNK:
    return jax.lax.top_k(x, k)
  return top_k(x, k, INNER_TOP_K_CHUNK)


def _top_k_and_max(x, k, chunk=None):
  """top_k's (values, indices) and x's maximum over the last axis. XLA folds the maximum of the slice maxima
  into a reduce of its own over x, which runs beside the slice maxima on the CPU's other thread; taking the
  maximum from values[..., 0] instead saves that read but makes the normalizer wait for the whole top_k chain
  (test2016's beam search 25% slower on 2 cores)."""
  *lead, V = x.shape
  chunk = chunk or TOP_K_CHUNK
  num_chunks = -(-V // chunk)
  if k >= num_chunks:  # nothing to save
    return (*jax.lax.top_k(x, k), x.max(axis=-1))
  # Padding ranks below every real value (also below NEG_INF, the masked tokens), and V >= k real ones exist.
  padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, num_chunks * chunk - V)], constant_values=-jnp.inf)
  slices = padded.reshape(*lead, num_chunks, chunk)
  slice_maxima = slices.max(axis=-1)
  _, best_slices = _inner_top_k(slice_maxima, k)
  best_slices = jnp.sort(best_slices, axis=-1)  # index order: ties go to the lower token
  gathered = jnp.take_along_axis(slices, best_slices[..., None], axis=-2).reshape(*lead, k * chunk)
  values, positions = _inner_top_k(gathered, k)
  indices = jnp.take_along_axis(best_slices, positions // chunk, axis=-1) * chunk + positions % chunk
  return values, indices, slice_maxima.max(axis=-1)


def _gather_beams(x, beams):
  """x [B, K, ...] reordered so that beam k of sentence b comes from beam beams[b, k]."""
  return jnp.take_along_axis(x, beams.reshape(beams.shape + (1,) * (x.ndim - 2)), axis=1)


def _gather_rows(x, beams):
  """x [B * K, ...] (sentence-major rows) reordered like _gather_beams."""
  B, K = beams.shape
  return _gather_beams(x.reshape((B, K) + x.shape[1:]), beams).reshape(x.shape)


class TokenState(NamedTuple):
  """A search that picks one token per row and step (greedy, sampling), after `index` steps: N rows (a
  sentence's samples are consecutive rows), every array leading with them."""
  index: jax.Array  # [] tokens generated so far
  sequences: jax.Array  # [N, L + 1] BOS first, pad 0 after EOS
  finished: jax.Array  # [N] bool: EOS produced
  scores: jax.Array  # [N] the model's log P of the row's tokens so far
  max_lengths: jax.Array  # [N]
  cache: Any  # leaves [N, ...]


def token_start(cache, *, batch_size, max_length, max_lengths, bos_id):
  N, L = batch_size, max_length
  sequences = jnp.zeros((N, L + 1), jnp.int32).at[:, 0].set(bos_id)
  return TokenState(jnp.asarray(0, jnp.int32), sequences, jnp.zeros((N,), jnp.bool_), jnp.zeros((N,), jnp.float32),
                    jnp.minimum(max_lengths, L), cache)


def token_unfinished(state):
  """[N] bool: rows without EOS (a row at its length limit is given EOS, so every row ends)."""
  return ~state.finished


def token_step(step_fn, choose, state, *, eos_id, forbidden_ids, min_length=0, normalize=True):
  """One token per row, picked by `choose(log_probs [N, V], index) -> tokens [N]` (None: the most likely
  allowed token, greedy search; normalize=False: without its log probability, see best_extensions)."""
  index, sequences, finished, scores, max_lengths, cache = state
  logits, cache = step_fn(sequences[:, index], index, cache)
  if choose is None:  # greedy: the best allowed token, without a [rows, V] array of log probabilities
    token_log_probs, tokens = (x[:, 0] for x in best_extensions(
        logits, jnp.zeros(finished.shape, jnp.float32), 1, index, max_lengths, eos_id, forbidden_ids, min_length,
        normalize))
  else:
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    log_probs = _mask_logits(log_probs, index, max_lengths, eos_id, forbidden_ids, min_length)
    tokens = choose(log_probs, index)
    token_log_probs = jnp.take_along_axis(log_probs, tokens[:, None], axis=1)[:, 0]
  scores = scores + jnp.where(finished, 0.0, token_log_probs)
  tokens = jnp.where(finished, 0, tokens)  # pad after EOS
  sequences = sequences.at[:, index + 1].set(tokens)
  return TokenState(index + 1, sequences, finished | (tokens == eos_id), scores, max_lengths, cache)


def token_output(state):
  """(sequences [N, L], log probabilities [N]): the model's log P of each row's tokens (EOS included),
  whatever rule picked them."""
  return state.sequences[:, 1:], state.scores


def _token_by_token(step_fn, cache, choose, *, batch_size, max_length, max_lengths, bos_id, eos_id,
                    forbidden_ids, cache_lengths=(), min_length=0):
  """One token per row and step (see token_step); returns token_output's (sequences, log probabilities)."""
  state = token_start(cache, batch_size=batch_size, max_length=max_length, max_lengths=max_lengths, bos_id=bos_id)
  step = functools.partial(token_step, step_fn, choose, eos_id=eos_id, forbidden_ids=forbidden_ids,
                           min_length=min_length)
  return token_output(staged_search(token_unfinished, step, state, cache_lengths))


def greedy_search(step_fn, cache, *, batch_size, max_length, max_lengths, bos_id, eos_id, forbidden_ids=(),
                  cache_lengths=(), min_length=0):
  """Returns (sequences [B, max_length], log probabilities [B]): the most likely token at every step."""
  return _token_by_token(step_fn, cache, None,
                         batch_size=batch_size, max_length=max_length, max_lengths=max_lengths, bos_id=bos_id,
                         eos_id=eos_id, forbidden_ids=forbidden_ids, cache_lengths=cache_lengths,
                         min_length=min_length)


def sample_search(step_fn, cache, keys, *, temperature, top_k, batch_size, max_length, max_lengths, bos_id,
                  eos_id, forbidden_ids=(), cache_lengths=(), min_length=0):
  """Returns (sequences [B, max_length], log probabilities [B]) sampled token by token.

  Each token is drawn from softmax(logits / temperature) restricted to the `top_k` most likely tokens
  (top_k=0: the whole vocabulary). keys: [B] PRNG keys, one per row; the token at position t of row r uses
  fold_in(keys[r], t), so a row's sample does not depend on the other rows of its batch. The returned log
  probabilities are the model's (temperature 1, unrestricted), as for greedy search.
  """
  return _token_by_token(step_fn, cache, sampling_rule(keys, temperature, top_k), batch_size=batch_size,
                         max_length=max_length, max_lengths=max_lengths, bos_id=bos_id, eos_id=eos_id,
                         forbidden_ids=forbidden_ids, cache_lengths=cache_lengths, min_length=min_length)


def tempered(log_probs, temperature):
  """log_probs / temperature up to a shift (the row's best at 0), the forbidden tokens (NEG_INF: PAD, BOS, all but
  EOS at the length limit) kept at NEG_INF: divided by a large temperature they would come near 0 and be drawn.
  The allowed stay above NEG_INF / 2 however small the temperature, so that they are never outweighed."""
  scaled = (log_probs - jnp.max(log_probs, axis=-1, keepdims=True)) / temperature
  return jnp.where(log_probs > NEG_INF, jnp.maximum(scaled, NEG_INF / 2), NEG_INF)


def sampling_rule(keys, temperature, top_k):
  """sample_search's `choose(log_probs, index)` for token_step: keys [N], one per row."""
  if not temperature > 0:  # NaN too
    raise ValueError(f'temperature must be positive, not {temperature}')

  def choose(log_probs, index):
    k = min(top_k, log_probs.shape[-1]) if top_k > 0 else log_probs.shape[-1]
    # top_k of the whole vocabulary is an (expensive) sort; skip it when there is nothing to cut.
    candidates, ids = (jax.lax.top_k(log_probs, k) if k < log_probs.shape[-1]
                       else (log_probs, jnp.broadcast_to(jnp.arange(k), log_probs.shape)))
    picks = jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, index), row))(
        keys, tempered(candidates, temperature))
    return jnp.take_along_axis(ids, picks[:, None], axis=1)[:, 0]
  return choose


def token_by_token(step_fn, cache, choose, *, batch_size, max_length, max_lengths, bos_id, eos_id,
                   forbidden_ids=()):
  """The loop greedy and sampled search share, with the caller's token rule `choose(log_probs [N, V], index)
  -> tokens [N]` (generate.py: prompts fed through the cache, top-p sampling). Same returns."""
  return _token_by_token(step_fn, cache, choose, batch_size=batch_size, max_length=max_length,
                         max_lengths=max_lengths, bos_id=bos_id, eos_id=eos_id, forbidden_ids=forbidden_ids)
