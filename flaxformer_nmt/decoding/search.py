"""The batched search of a trained translation model: the encoder once, then the decoder's steps over a KV cache
(beam_search.py for the rules of beam, greedy and sampling), either in one jit-able call (`search`) or started
and continued in segments between which a host loop drops finished sentences (`start_search`, `run_segment`;
batch_search.py runs them on the ladder of shapes of ladder.py)."""
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
  """One model's step_fn(tokens, index, cache, ancestry=None) -> (logits, cache) over its `_member_inputs`
  (ancestry: Transformer.decode_step's, for a cache of beam slots)."""
  variables = {'params': params}
  if cache_cross_kv:
    cross_kv, src = inputs

    def step_fn(tokens, index, cache, ancestry=None):
      return model.apply(variables, tokens, index, cache, cross_kv, src, ancestry, method=Transformer.decode_step)
  else:
    encoded_rows, src_rows = inputs

    def step_fn(tokens, index, cache, ancestry=None):
      # XLA would hoist a loop-invariant projection out of the loop by itself (it does on CPU), which is
      # the cache again; tying the encoder output to the step index keeps the projection in every step.
      step_encoded, _ = jax.lax.optimization_barrier((encoded_rows, index))
      step_kv = model.apply(variables, step_encoded, method=Transformer.decoding_cross_kv)
      return model.apply(variables, tokens, index, cache, step_kv, src_rows, ancestry,
                         method=Transformer.decode_step)
  return step_fn


# An ensemble's next-token distribution from its members' (kept here under its old name).
average_probabilities = beam_search.average_probabilities


def _ensemble_step(step_fns):
  """One step_fn over several models (a tuple of caches): the average of their probabilities, returned as
  log probabilities (already normalized, so the search's log_softmax leaves them as they are)."""
  def step_fn(tokens, index, caches, ancestry=None):
    log_probs, new_caches = [], []
    for member_step, cache in zip(step_fns, caches):
      logits, cache = member_step(tokens, index, cache, ancestry)
      log_probs.append(jax.nn.log_softmax(logits.astype(jnp.float32)))
      new_caches.append(cache)
    return average_probabilities(jnp.stack(log_probs)), tuple(new_caches)
  return step_fn


def _slot_step(step_fn):
  """step_fn over a beam_search.SlotCache: the model reads its slots through the beams' ancestry."""
  def step(tokens, index, cache):
    logits, slots = step_fn(tokens, index, cache.slots, cache.ancestry)
    return logits, cache._replace(slots=slots)
  return step


LIMIT_SLACK = 1e-4  # so that e.g. 0.7 * 10 gives 7 in float32 as in Python's float64


def max_steps(src_length, max_len_a, max_len_b, max_position):
  """The static number of decoding steps of a source batch padded to `src_length` (EOS included): the
  limit of its longest possible sentence, EOS included, within the position table."""
  return min(int(math.floor(max_len_a * (src_length - 1) + max_len_b + LIMIT_SLACK)) + 1, max_position)


def output_limits(src, max_len_a, max_len_b, max_position):
  """[B] limits on the generated tokens (EOS included) of a padded source batch [B, S], at most max_position;
  max_len_a and max_len_b may be inputs of a program (one program for every limit).

  fairseq's rule per sentence: at most floor(max_len_a * n + max_len_b) tokens before EOS, n being the
  sentence's source length in pieces (EOS not counted; fairseq counts it, and takes the longest source of
  the batch). The default a = 1, b = 50 is the paper's source length + 50.
  """
  src_tokens = (src != PAD_ID).sum(axis=1)
  limits = jnp.floor(max_len_a * (src_tokens - 1).astype(jnp.float32) + max_len_b + LIMIT_SLACK).astype(jnp.int32) + 1
  # Rows that only pad the batch may produce nothing but EOS, so that they never keep the search loop running.
  return jnp.minimum(jnp.where(src_tokens > 0, limits, 1), max_position)


FORBIDDEN_IDS = (PAD_ID, BOS_ID)  # never generated
# Tokens before EOS may end an output: fairseq's --min-len and CTranslate2's min_decoding_length default.
MIN_LEN = 1


class SearchInputs(NamedTuple):
  """What a batch's decoder steps read and never change; every array leads with the sentence axis (or its
  rows), as the search state does."""
  src: jax.Array  # [B, S] the padded sources
  members: tuple  # per model, its _member_inputs
  sample_keys: Any  # [B * n, ...] PRNG key data, a sentence's n samples consecutive; None: beam or greedy search


def _members(model, params):
  """((models), (their parameters)): an ensemble passes tuples, a single model does not."""
  return (model, params) if isinstance(model, tuple) else ((model,), (params,))


def max_position_of(model):
  """The positions every model of `model` (one, or an ensemble's tuple) has."""
  return min(m.config.max_position for m in (model if isinstance(model, tuple) else (model,)))


def start_search(model, params, src, sample_keys=None, *, beam_size, extra_length, max_len_a=1.0,
                 cache_cross_kv=True, cache_length=None, length=None, **unused):
  """(inputs, state) of the search of a padded source batch [B, S], before its first step: `inputs` holds what
  the steps read and never change (each member's encoder-decoder keys/values and source, the sample keys),
  `state` the search itself (beam_search.BeamState or TokenState). Both lead with the sentence axis, so a
  host loop may drop finished sentences between segments (batch_search.py).

  The self-attention cache gets `cache_length` positions and the state room for `length` tokens (default
  both: max_steps of the batch, every step it may take, which needs max_len_a and extra_length static); each
  row's limit on its tokens (output_limits) is kept whole, so a search whose cache and state grow later
  (beam_search.grow_state) goes on to it.
  sample_keys: [B, n] PRNG keys, n samples per sentence; None: beam search (beam_size > 0) or greedy.
  """
  del unused
  models, member_params = _members(model, params)
  batch, max_position = src.shape[0], max_position_of(model)
  length = length or max_steps(src.shape[1], max_len_a, extra_length, max_position)
  limits = output_limits(src, max_len_a, extra_length, max_position)
  rows = sample_keys.shape[1] if sample_keys is not None else max(beam_size, 1)  # decoder rows per sentence
  inputs = tuple(_member_inputs(m, p, src, rows, cache_cross_kv) for m, p in zip(models, member_params))
  beams = beam_size if sample_keys is None else 0  # beam search keeps its rows' keys/values in slots
  caches = tuple(m.apply({'params': p}, batch if beams else batch * rows, cache_length or length, beams,
                         method=Transformer.init_cache) for m, p in zip(models, member_params))
  cache = caches[0] if len(models) == 1 else caches
  cache = beam_search.slot_cache(cache, beams) if beams else cache
  common = dict(max_length=length, bos_id=BOS_ID)
  if sample_keys is not None:
    state = beam_search.token_start(cache, batch_size=batch * rows, max_lengths=jnp.repeat(limits, rows), **common)
    keys = jax.random.key_data(sample_keys.reshape(-1))
    return SearchInputs(src, inputs, keys), state._replace(max_lengths=jnp.repeat(limits, rows))
  inputs = SearchInputs(src, inputs, None)
  if beam_size == 0:
    state = beam_search.token_start(cache, batch_size=batch, max_lengths=limits, **common)
  else:
    state = beam_search.beam_start(cache, batch_size=batch, beam_size=beam_size, max_lengths=limits, **common)
  return inputs, state._replace(max_lengths=limits)


def _search_rule(model, params, inputs, *, beam_size, alpha, temperature=1.0, top_k=0, cache_cross_kv=True,
                 min_len=MIN_LEN, scores=True, **unused):
  """(first(state) -> state, step(state) -> state) of the search start_search began: `first` takes its first
  step (beam search's on one row per sentence where the rows share their sentence's encoder keys/values,
  beam_search.beam_first_step), `step` every later one.
  scores=False lets greedy search skip the normalizer of its log probabilities (the same tokens; its scores
  are then not log probabilities, see beam_search.best_extensions)."""
  del unused
  models, member_params = _members(model, params)
  step_fns = [_member_step(m, p, i, cache_cross_kv) for m, p, i in zip(models, member_params, inputs.members)]
  step_fn = step_fns[0] if len(step_fns) == 1 else _ensemble_step(step_fns)
  common = dict(eos_id=EOS_ID, forbidden_ids=FORBIDDEN_IDS, min_length=min_len)
  if inputs.sample_keys is not None:
    choose = beam_search.sampling_rule(jax.random.wrap_key_data(inputs.sample_keys), temperature, top_k)
    step = functools.partial(beam_search.token_step, step_fn, choose, **common)
    return step, step
  if beam_size == 0:
    step = functools.partial(beam_search.token_step, step_fn, None, normalize=scores, **common)
    return step, step
  step_fn = _slot_step(step_fn)
  step = functools.partial(beam_search.beam_step, step_fn, alpha=alpha, **common)
  if not cache_cross_kv:  # the encoder's output is repeated for every row: the first step runs on all of them
    return step, step
  return functools.partial(beam_search.beam_first_step, step_fn, alpha=alpha, **common), step


def unfinished_sentences(inputs, state):
  """[B] bool: the sentences still searching (a sampled sentence while any of its samples is)."""
  if isinstance(state, beam_search.BeamState):
    return beam_search.beam_unfinished(state)
  return beam_search.token_unfinished(state).reshape(inputs.src.shape[0], -1).any(axis=1)


def run_segment(model, params, inputs, state, stop=0, *, first=False, **options):
  """(the state stepped until its cache is full, no sentence searches, or at most `stop` (a traced scalar)
  still search; [B] bool: the sentences still searching). A host loop then drops the finished sentences
  or grows the cache (batch_search.py). first=True: `state` is start_search's, whose first step runs first."""
  first_step, step = _search_rule(model, params, inputs, **options)
  if first:
    state = first_step(state)
  live = lambda s: unfinished_sentences(inputs, s)
  until = beam_search.cache_length(state)
  state = jax.lax.while_loop(lambda s: (s.index < until) & (live(s).sum() > stop), step, state)
  return state, live(state)


def search_output(inputs, state):
  """(tokens [B, K, L], scores [B, K]), best first, of a search state; samples sorted by log probability.
  NumPy arrays (a state read back to the host) give NumPy arrays, without a program to compile."""
  xp = np if isinstance(state.sequences, np.ndarray) else jnp
  if isinstance(state, beam_search.BeamState):
    return state.finished_sequences[:, :, 1:], state.finished_scores
  batch = inputs.src.shape[0]
  tokens, scores = state.sequences[:, 1:], state.scores
  tokens, scores = tokens.reshape(batch, -1, tokens.shape[-1]), scores.reshape(batch, -1)
  if inputs.sample_keys is None:  # greedy
    return tokens, scores
  best_first = xp.argsort(-scores, axis=1, stable=True)
  return xp.take_along_axis(tokens, best_first[:, :, None], axis=1), xp.take_along_axis(scores, best_first, 1)


def search(model, params, src, sample_keys=None, *, beam_size, alpha, extra_length, max_len_a=1.0, temperature=1.0,
           top_k=0, cache_cross_kv=True, grow_cache=True, min_len=MIN_LEN, cache_lengths=None, scores=True):
  """Translations of a padded source batch [B, S]: (tokens [B, K, L], scores [B, K]), best first, in one
  jit-able call: the whole batch steps until its last sentence ends, on the device, without the host.

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
  to measure what the cache saves; same results). The self-attention cache has cache_lengths[0] positions
  and grows to each next length when the decoder gets there (beam_search.staged_search), L being the last;
  None: from the source's length, doubling (beam_search.cache_lengths_for) to max_steps. grow_cache=False
  allocates all L positions at once (same results, slower). scores=False: greedy search without its
  scores (see _search_rule).
  """
  options = dict(beam_size=beam_size, alpha=alpha, extra_length=extra_length, max_len_a=max_len_a,
                 temperature=temperature, top_k=top_k, cache_cross_kv=cache_cross_kv, min_len=min_len, scores=scores)
  if cache_lengths is None:
    length = max_steps(src.shape[1], max_len_a, extra_length, max_position_of(model))
    cache_lengths = beam_search.cache_lengths_for(src.shape[1], length)
  if not grow_cache:
    cache_lengths = cache_lengths[-1:]
  inputs, state = start_search(model, params, src, sample_keys, cache_length=cache_lengths[0],
                               length=cache_lengths[-1], **options)
  first_step, step = _search_rule(model, params, inputs, **options)
  unfinished = lambda s: unfinished_sentences(inputs, s)
  return search_output(inputs, beam_search.staged_search(unfinished, step, first_step(state), cache_lengths))


def take_sentences(tree, keep, batch):
  """The sentences `keep` ([b] indices) of every array in `tree`, whose arrays lead with a sentence axis of
  `batch` or with its rows ([batch * r, ...], sentence-major); scalars (the step index) stay as they are.
  NumPy in, NumPy out: the host's copy of a search."""
  def take(x):
    if x.ndim == 0:
      return x
    rows = x.shape[0] // batch
    x = x.reshape((batch, rows) + x.shape[1:])[keep]
    return x.reshape((keep.shape[0] * rows,) + x.shape[2:])
  return jax.tree_util.tree_map(take, tree)


def check_seed(seed):
  """Raises ValueError for a seed that the sampling keys' int32 input cannot hold."""
  if not -2**31 <= seed < 2**31:
    raise ValueError(f'seed={seed}: give an integer from {-2**31} to {2**31 - 1}')


@functools.partial(jax.jit, static_argnames='num_samples')
def sample_keys(seed, line_numbers, num_samples):
  """[B, n] PRNG keys: sample j of input line i uses fold_in(fold_in(key(seed), i), j), whatever the batching."""
  return line_keys(seed, line_numbers, num_samples)


def line_keys(seed, line_numbers, num_samples):
  """sample_keys, unjitted: for a program that draws its own keys."""
  def keys_of(line):
    line_key = jax.random.fold_in(jax.random.key(seed), line)
    return jax.vmap(lambda j: jax.random.fold_in(line_key, j))(jnp.arange(num_samples))
  return jax.vmap(keys_of)(line_numbers)
