"""Beam search and greedy search over an incremental decoder, as pure functions for jax.jit.

Both drive `step_fn(tokens [N], index, cache) -> (logits [N, V], cache)`, which feeds the token at position
`index` (0 is BOS) and returns the distribution of the token at `index + 1`. Only the self-attention cache
is carried and reordered between steps; anything constant per sentence (encoder keys/values) belongs in
the closure of `step_fn`.

Beam search keeps, per sentence, the `beam_size` best unfinished prefixes ("alive") and the `beam_size`
best finished hypotheses. At each step every alive prefix is extended by every token: its extension by EOS
is a finished candidate scored log P / lp(length), with the GNMT length penalty
lp(n) = ((5 + n) / 6)^alpha (n counts the generated tokens, EOS included); the best non-EOS extensions
become the next alive set. A sentence stops once no alive prefix can still beat its worst kept finished
hypothesis, and the loop exits when every sentence has stopped. A sentence of n source tokens may produce
at most n + extra tokens: EOS is forced at that length.

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
  vocab = log_probs.shape[-1]
  for token in forbidden_ids:
    log_probs = log_probs.at[..., token].set(NEG_INF)
  at_limit = (index + 1 >= max_lengths)
  at_limit = at_limit.reshape(at_limit.shape + (1,) * (log_probs.ndim - at_limit.ndim))
  return jnp.where(at_limit & (jnp.arange(vocab) != eos_id), NEG_INF, log_probs)


def beam_search(step_fn, cache, *, batch_size, beam_size, max_length, max_lengths, alpha, bos_id, eos_id,
                forbidden_ids=()):
  """Returns (sequences [B, K, max_length], scores [B, K]), best first; sequences end at EOS, then pad 0.

  cache: pytree whose leaves have a leading axis of B * K (sentence-major: row b * K + k).
  max_length: static number of decoding steps (the cache's length).
  max_lengths: [B] int, each sentence's limit on generated tokens (<= max_length).
  """
  B, K, L = batch_size, beam_size, max_length
  sequences = jnp.zeros((B, K, L + 1), jnp.int32).at[:, :, 0].set(bos_id)
  # Only the first beam starts alive: K identical beams would fill the beam with duplicates.
  alive_log_probs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (K - 1), jnp.float32), (B, 1))
  finished_sequences = jnp.zeros_like(sequences)
  finished_scores = jnp.full((B, K), NEG_INF, jnp.float32)
  max_lengths = jnp.minimum(max_lengths, L)
  best_penalty = jnp.maximum(length_penalty(1.0, alpha), length_penalty(max_lengths.astype(jnp.float32), alpha))

  def gather_beams(x, beams):
    """Rows of x [B * K, ...] (or [B, K, ...]) reordered so that beam k of sentence b comes from beams[b, k]."""
    grouped = x.reshape((B, K) + x.shape[1:]) if x.shape[0] == B * K else x
    picked = jnp.take_along_axis(grouped, beams.reshape((B, K) + (1,) * (grouped.ndim - 2)), axis=1)
    return picked.reshape(x.shape)

  def still_running(state):
    index, _, alive_log_probs, _, finished_scores, _ = state
    # Best score any alive prefix could still reach: its log P can only fall, its penalty grow to the max.
    best_possible = alive_log_probs[:, 0] / best_penalty
    open_sentences = (best_possible > finished_scores[:, K - 1]) & (index < max_lengths)
    return (index < L) & jnp.any(open_sentences)

  def step(state):
    index, sequences, alive_log_probs, finished_sequences, finished_scores, cache = state
    logits, cache = step_fn(sequences[:, :, index].reshape(B * K), index, cache)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(B, K, -1)
    log_probs = _mask_logits(log_probs, index, max_lengths[:, None], eos_id, forbidden_ids)
    candidates = alive_log_probs[:, :, None] + log_probs  # [B, K, V]
    vocab = candidates.shape[-1]

    # Finished candidates: every alive prefix + EOS, merged with those kept so far.
    eos_scores = candidates[:, :, eos_id] / length_penalty(index + 1.0, alpha)
    eos_scores = jnp.where(alive_log_probs > NEG_INF / 2, eos_scores, NEG_INF)
    eos_sequences = sequences.at[:, :, index + 1].set(eos_id)
    pool_scores = jnp.concatenate([finished_scores, eos_scores], axis=1)
    pool_sequences = jnp.concatenate([finished_sequences, eos_sequences], axis=1)
    finished_scores, keep = jax.lax.top_k(pool_scores, K)
    finished_sequences = jnp.take_along_axis(pool_sequences, keep[:, :, None], axis=1)

    # Alive candidates: the K best non-EOS extensions over all beams.
    extend = candidates.at[:, :, eos_id].set(NEG_INF).reshape(B, K * vocab)
    alive_log_probs, flat = jax.lax.top_k(extend, K)
    beams, tokens = flat // vocab, flat % vocab
    sequences = gather_beams(sequences, beams).at[:, :, index + 1].set(tokens)
    cache = jax.tree_util.tree_map(lambda x: gather_beams(x, beams), cache)
    return index + 1, sequences, alive_log_probs, finished_sequences, finished_scores, cache

  state = (jnp.asarray(0), sequences, alive_log_probs, finished_sequences, finished_scores, cache)
  _, sequences, alive_log_probs, finished_sequences, finished_scores, _ = jax.lax.while_loop(
      still_running, step, state)
  # A sentence with no finished hypothesis (only possible if EOS was never allowed) returns its alive ones.
  none_finished = finished_scores[:, :1] <= NEG_INF / 2
  finished_sequences = jnp.where(none_finished[:, :, None], sequences, finished_sequences)
  finished_scores = jnp.where(none_finished, alive_log_probs, finished_scores)
  return finished_sequences[:, :, 1:], finished_scores


def _token_by_token(step_fn, cache, choose, *, batch_size, max_length, max_lengths, bos_id, eos_id,
                    forbidden_ids):
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
  _, sequences, _, scores, _ = jax.lax.while_loop(still_running, step, state)
  return sequences[:, 1:], scores


def greedy_search(step_fn, cache, *, batch_size, max_length, max_lengths, bos_id, eos_id, forbidden_ids=()):
  """Returns (sequences [B, max_length], log probabilities [B]): the most likely token at every step."""
  return _token_by_token(step_fn, cache, lambda log_probs, index: jnp.argmax(log_probs, axis=-1),
                         batch_size=batch_size, max_length=max_length, max_lengths=max_lengths, bos_id=bos_id,
                         eos_id=eos_id, forbidden_ids=forbidden_ids)


def sample_search(step_fn, cache, keys, *, temperature, top_k, batch_size, max_length, max_lengths, bos_id,
                  eos_id, forbidden_ids=()):
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
                         max_lengths=max_lengths, bos_id=bos_id, eos_id=eos_id, forbidden_ids=forbidden_ids)
