"""The batched search of a trained translation model: the encoder once, then the decoder's steps over a KV cache
(beam_search.py for the rules of beam, greedy and sampling), started, continued in segments and read out as
separate jitted stages, plus the batching of sentences into token-budget batches of few shapes."""
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from flaxformer_nmt.decoding import beam_search
from flaxformer_nmt.models.transformer import Transformer


def _member_inputs(model, params, src, rows, cache_cross_kv):
  """What one model's decoder steps read that stays fixed for a batch: its encoder run once over `src`, then
  the encoder-decoder keys/values of each sentence (shared by the sentence's `rows` beams or samples) and the
  source. Without cache_cross_kv: the encoder output and the source repeated for every row."""
  variables = {'params': params}
  encoded = model.apply(variables, src, method=Transformer.encode)
  if cache_cross_kv:
    return model.apply(variables, encoded, method=Transformer.decoding_cross_kv), src
  return jnp.repeat(encoded, rows, axis=0), jnp.repeat(src, rows, axis=0)


def _member_step(model, params, inputs, cache_cross_kv):
  """One model's step_fn(tokens, index, cache) -> (logits, cache) over its `_member_inputs`."""
  variables = {'params': params}
  if cache_cross_kv:
    cross_kv, src = inputs

    def step_fn(tokens, index, cache):
      return model.apply(variables, tokens, index, cache, cross_kv, src, method=Transformer.decode_step)
  else:
    encoded_rows, src_rows = inputs

    def step_fn(tokens, index, cache):
      # XLA would hoist a loop-invariant projection out of the loop by itself (it does on CPU), which is
      # the cache again; tying the encoder output to the step index keeps the projection in every step.
      step_encoded, _ = jax.lax.optimization_barrier((encoded_rows, index))
      step_kv = model.apply(variables, step_encoded, method=Transformer.decoding_cross_kv)
      return model.apply(variables, tokens, index, cache, step_kv, src_rows, method=Transformer.decode_step)
  return step_fn


# An ensemble's next-token distribution from its members' (kept here under its old name).
average_probabilities = beam_search.average_probabilities


def _ensemble_step(step_fns):
  """One step_fn over several models (a tuple of caches): the average of their probabilities, returned as
  log probabilities (already normalized, so the search's log_softmax leaves them as they are)."""
  def step_fn(tokens, index, caches):
    log_probs, new_caches = [], []
    for member_step, cache in zip(step_fns, caches):
      logits, cache = member_step(tokens, index, cache)
      log_probs.append(jax.nn.log_softmax(logits.astype(jnp.float32)))
      new_caches.append(cache)
    return average_probabilities(jnp.stack(log_probs)), tuple(new_caches)
  return step_fn


LIMIT_SLACK = 1e-4  # so that e.g. 0.7 * 10 gives 7 in float32 as in Python's float64


def max_steps(src_length, max_len_a, max_len_b, max_position):
  """The static number of decoding steps of a source batch padded to `src_length` (EOS included): the
  limit of its longest possible sentence, EOS included, within the position table."""
  return min(int(math.floor(max_len_a * (src_length - 1) + max_len_b + LIMIT_SLACK)) + 1, max_position)


def output_limits(src, max_len_a, max_len_b, max_position):
  """(static cache length, [B] limits on generated tokens, EOS included) for a padded source batch [B, S].

  fairseq's rule per sentence: at most floor(max_len_a * n + max_len_b) tokens before EOS, n being the
  sentence's source length in pieces (EOS not counted; fairseq counts it, and takes the longest source of
  the batch). The default a = 1, b = 50 is the paper's source length + 50.
  """
  max_length = max_steps(src.shape[1], max_len_a, max_len_b, max_position)
  src_tokens = (src != PAD_ID).sum(axis=1)
  limits = jnp.floor(max_len_a * (src_tokens - 1).astype(jnp.float32) + max_len_b + LIMIT_SLACK).astype(jnp.int32) + 1
  # Rows that only pad the batch may produce nothing but EOS, so that they never keep the search loop running.
  return max_length, jnp.where(src_tokens > 0, limits, 1)


FORBIDDEN_IDS = (PAD_ID, BOS_ID)  # never generated
# Tokens before EOS may end an output: fairseq's --min-len and CTranslate2's min_decoding_length default.
MIN_LEN = 1
FINE_ROWS_FROM = 64  # batch_rows: eighths of a power of two from 64 sentences on, powers of two below


class SearchInputs(NamedTuple):
  """What a batch's decoder steps read and never change; every array leads with the sentence axis (or its
  rows), as the search state does."""
  src: jax.Array  # [B, S] the padded sources
  members: tuple  # per model, its _member_inputs
  sample_keys: Any  # [B * n] PRNG keys, a sentence's n samples consecutive; None: beam or greedy search


def _members(model, params):
  """((models), (their parameters)): an ensemble passes tuples, a single model does not."""
  return (model, params) if isinstance(model, tuple) else ((model,), (params,))


def search_lengths(models, src_shape, *, extra_length, max_len_a=1.0, grow_cache=True, **unused):
  """(static number of decoding steps, the self-attention cache's lengths) of a source batch shape [B, S]:
  the cache starts with as many positions as the source and doubles when the decoder gets there
  (beam_search.cache_lengths_for); grow_cache=False allocates all max_length positions at once."""
  del unused
  models = models if isinstance(models, tuple) else (models,)
  max_length = max_steps(src_shape[1], max_len_a, extra_length, min(m.config.max_position for m in models))
  return max_length, (beam_search.cache_lengths_for(src_shape[1], max_length) if grow_cache else (max_length,))


def start_search(model, params, src, sample_keys=None, *, beam_size, extra_length, max_len_a=1.0,
                 cache_cross_kv=True, grow_cache=True, **unused):
  """(inputs, state) of the search of a padded source batch [B, S], before its first step: `inputs` holds what
  the steps read and never change (each member's encoder-decoder keys/values and source, the sample keys),
  `state` the search itself (beam_search.BeamState or TokenState). Both lead with the sentence axis, so a
  host loop may drop finished sentences between segments (Translator)."""
  del unused
  models, member_params = _members(model, params)
  batch = src.shape[0]
  max_length, cache_lengths = search_lengths(models, src.shape, extra_length=extra_length, max_len_a=max_len_a,
                                             grow_cache=grow_cache)
  max_lengths = output_limits(src, max_len_a, extra_length, min(m.config.max_position for m in models))[1]
  rows = sample_keys.shape[1] if sample_keys is not None else max(beam_size, 1)  # decoder rows per sentence
  inputs = tuple(_member_inputs(m, p, src, rows, cache_cross_kv) for m, p in zip(models, member_params))
  caches = tuple(m.apply({'params': p}, batch * rows, cache_lengths[0], method=Transformer.init_cache)
                 for m, p in zip(models, member_params))
  cache = caches[0] if len(models) == 1 else caches
  common = dict(max_length=max_length, bos_id=BOS_ID)
  if sample_keys is not None:
    state = beam_search.token_start(cache, batch_size=batch * rows, max_lengths=jnp.repeat(max_lengths, rows),
                                    **common)
    return SearchInputs(src, inputs, sample_keys.reshape(-1)), state
  inputs = SearchInputs(src, inputs, None)
  if beam_size == 0:
    return inputs, beam_search.token_start(cache, batch_size=batch, max_lengths=max_lengths, **common)
  return inputs, beam_search.beam_start(cache, batch_size=batch, beam_size=beam_size, max_lengths=max_lengths,
                                        **common)


def _search_rule(model, params, inputs, *, beam_size, alpha, temperature=1.0, top_k=0, cache_cross_kv=True,
                 min_len=MIN_LEN, **unused):
  """(step(state) -> state, unfinished(state) -> [sentences or rows] bool) of the search start_search began."""
  del unused
  models, member_params = _members(model, params)
  keys = inputs.sample_keys
  step_fns = [_member_step(m, p, i, cache_cross_kv) for m, p, i in zip(models, member_params, inputs.members)]
  step_fn = step_fns[0] if len(step_fns) == 1 else _ensemble_step(step_fns)
  common = dict(eos_id=EOS_ID, forbidden_ids=FORBIDDEN_IDS, min_length=min_len)
  if keys is not None:
    choose = beam_search.sampling_rule(keys, temperature, top_k)
    return functools.partial(beam_search.token_step, step_fn, choose, **common), beam_search.token_unfinished
  if beam_size == 0:
    return functools.partial(beam_search.token_step, step_fn, None, **common), beam_search.token_unfinished
  return (functools.partial(beam_search.beam_step, step_fn, alpha=alpha, **common), beam_search.beam_unfinished)


def continue_search(model, params, inputs, state, until, **options):
  """(the state after steps up to `until` generated tokens, or until no sentence is unfinished, on its
  cache as it is; [B] bool: the sentences still searching). Translator grows the cache between segments."""
  step, unfinished = _search_rule(model, params, inputs, **options)
  state = beam_search.run_until(unfinished, step, state, until)
  return state, unfinished_sentences(inputs, state)


def unfinished_sentences(inputs, state):
  """[B] bool: the sentences still searching (a sampled sentence while any of its samples is)."""
  if isinstance(state, beam_search.BeamState):
    return beam_search.beam_unfinished(state)
  return beam_search.token_unfinished(state).reshape(inputs.src.shape[0], -1).any(axis=1)


def search_output(inputs, state):
  """(tokens [B, K, L], scores [B, K]), best first, of a search state; samples sorted by log probability."""
  if isinstance(state, beam_search.BeamState):
    return beam_search.beam_output(state)
  tokens, scores = beam_search.token_output(state)
  batch = inputs.src.shape[0]
  tokens, scores = tokens.reshape(batch, -1, tokens.shape[-1]), scores.reshape(batch, -1)
  if inputs.sample_keys is None:  # greedy
    return tokens, scores
  best_first = jnp.argsort(-scores, axis=1)
  return jnp.take_along_axis(tokens, best_first[:, :, None], axis=1), jnp.take_along_axis(scores, best_first, 1)


def search(model, params, src, sample_keys=None, *, beam_size, alpha, extra_length, max_len_a=1.0, temperature=1.0,
           top_k=0, cache_cross_kv=True, grow_cache=True, min_len=MIN_LEN):
  """Translations of a padded source batch [B, S]: (tokens [B, K, L], scores [B, K]), best first, in one
  jit-able call (the whole batch steps until its last sentence ends; Translator drops finished sentences).

  beam_size=0 decodes greedily (K = 1). With `sample_keys` ([B, n] PRNG keys) it samples n translations per
  sentence instead (see beam_search.sample_search), sorted by their log probability. A sentence of n source
  pieces gets at most floor(max_len_a * n + extra_length) tokens before EOS (see output_limits), and at least
  min_len (EOS is forbidden before; 1, fairseq's --min-len and CTranslate2's min_decoding_length, means no
  empty output for a non-empty source; 0 allows EOS first).

  An ensemble passes a tuple of models and a tuple of their parameters: each step averages the members'
  probabilities (average_probabilities); every member has its own caches.

  The encoder runs once, the encoder-decoder keys/values are projected once per sentence, and each step
  runs only the new position through the decoder against its self-attention cache. cache_cross_kv=False
  projects the encoder-decoder keys/values again at every step, as decoders without that cache do (kept
  to measure what the cache saves; same results). The self-attention cache starts with as many positions as
  the source and doubles when the decoder gets there (beam_search.cache_lengths_for); grow_cache=False
  allocates all max_length positions at once (same results, slower).
  """
  options = dict(beam_size=beam_size, alpha=alpha, extra_length=extra_length, max_len_a=max_len_a,
                 temperature=temperature, top_k=top_k, cache_cross_kv=cache_cross_kv, grow_cache=grow_cache,
                 min_len=min_len)
  inputs, state = start_search(model, params, src, sample_keys, **options)
  step, unfinished = _search_rule(model, params, inputs, **options)
  _, cache_lengths = search_lengths(model, src.shape, **options)
  return search_output(inputs, beam_search.staged_search(unfinished, step, state, cache_lengths))


def batch_rows(n):
  """The rows a batch of n searching sentences runs in: the next multiple of an eighth of the next power of two
  p >= n (n = 150 -> 160), or p itself below FINE_ROWS_FROM. Few shapes to compile (each costs ~1 s on a
  2-core CPU, against ~5 s for decoding test2016), and at most an eighth of a large batch computes for nothing;
  small batches cost little per step whatever their rows."""
  p = 1 << (n - 1).bit_length()
  step = max(p // 8, 1) if p >= FINE_ROWS_FROM else p
  return -(-n // step) * step


def segment_ends(cache_lengths, steps):
  """[(cache length, tokens generated at the segment's end)] of a search run in segments of `steps` steps
  that also end where the cache grows: segment_ends((16, 32), 8) = [(16, 8), (16, 16), (32, 24), (32, 32)]."""
  ends, start = [], 0
  for length in cache_lengths:
    ends += [(length, until) for until in range(start + steps, length, steps)] + [(length, length)]
    start = length
  return ends


def source_batches(token_lists, buckets, tokens_per_batch, sort_by_length=True):
  """(indices, padded source [rows, len]) batches of the sources (token ids ending with EOS). Sorted by
  length, batches carry little padding; sort_by_length=False keeps input order (to measure what sorting
  saves). A bucket's full batches have as many rows as the token budget allows; a partly filled one (the last
  of a bucket, or a short input) is padded to batch_rows rows only, so a few sentences do not pay for a whole
  batch, and there are still few shapes to compile. Empty sentences (EOS alone) are left out: they translate
  to empty lines."""
  lengths = [len(t) for t in token_lists]
  nonempty = [i for i, n in enumerate(lengths) if n > 1]
  if sort_by_length:
    plan = data_lib.plan_batches(lengths, buckets, tokens_per_batch, 1, sorted(nonempty, key=lengths.__getitem__))
  else:
    plan = input_order_batches(lengths, buckets, tokens_per_batch, nonempty)
  for padded, rows, members in plan:
    rows = min(rows, batch_rows(len(members)))
    yield list(members), data_lib.pad_rows([token_lists[i] for i in members], rows, padded)


def take_sentences(tree, keep, batch):
  """The sentences `keep` ([b] indices) of every array in `tree`, whose arrays lead with a sentence axis of
  `batch` or with its rows ([batch * r, ...], sentence-major); scalars (the step index) stay as they are."""
  def take(x):
    if x.ndim == 0:
      return x
    rows = x.shape[0] // batch
    x = x.reshape((batch, rows) + x.shape[1:])[keep]
    return x.reshape((keep.shape[0] * rows,) + x.shape[2:])
  return jax.tree_util.tree_map(take, tree)


@functools.partial(jax.jit, static_argnames='num_samples')
def sample_keys(seed, line_numbers, num_samples):
  """[B, n] PRNG keys: sample j of input line i uses fold_in(fold_in(key(seed), i), j), whatever the batching."""
  def line_keys(line):
    line_key = jax.random.fold_in(jax.random.key(seed), line)
    return jax.vmap(lambda j: jax.random.fold_in(line_key, j))(jnp.arange(num_samples))
  return jax.vmap(line_keys)(line_numbers)


def input_order_batches(lengths, buckets, tokens_per_batch, order):
  """Like data.plan_batches, but consecutive sentences in `order` fill each batch, unsorted: a batch is
  padded to the bucket of its longest sentence and closes when one more sentence would break the budget.
  (The plain batching that length-sorted batches are measured against.)"""
  plan, members, padded = [], [], 0
  for i in order:
    grown = max(padded, data_lib.bucket_length(lengths[i], buckets))
    if members and (len(members) + 1) * grown > tokens_per_batch:
      plan.append((padded, data_lib.batch_size_for(padded, tokens_per_batch), members))
      members, grown = [], data_lib.bucket_length(lengths[i], buckets)
    members.append(i)
    padded = grown
  if members:
    plan.append((padded, data_lib.batch_size_for(padded, tokens_per_batch), members))
  return plan
