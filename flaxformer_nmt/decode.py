r"""Translates with a trained workdir; scores with sacreBLEU when references are given.

  python -m flaxformer_nmt.decode --workdir runs/m30k --input test2016.en --output hyp.de --reference test2016.de
  cat sentences.en | python -m flaxformer_nmt.decode --workdir runs/m30k > out.de

One output line per input line, in input order; an empty input line gives an empty output line. Input is
read in chunks of --buffer_lines, so a long stream is translated as it arrives. Within a chunk, sentences
are sorted by length into token-budget batches (few shapes to compile, little padding). A batch decodes in
segments of a few steps; once few of its sentences still search, it goes on with those only (as CTranslate2
and fairseq drop finished sentences), so that one long output does not keep every row computing. Compiled
programs are kept in JAX's persistent cache (cli.use_compilation_cache): a later run loads those it has seen.

  --greedy | --beam_size=K | --sampling [--temperature=T --top_k=K --seed=S]
  --format=fairseq [--n_best=N]: S-i (source), H-i (score, sentencepiece pieces), D-i (score, text) lines
  --n_best=N --mbr=bleu|chrf: of N candidates (beams, or samples), the one that agrees most with the others
  --max_len_a=A --max_len_b=B: at most floor(A * source length + B) tokens before EOS (default 1, 50)
  --min_len=N: at least N tokens before EOS (default 1, as fairseq and CTranslate2: no empty outputs)
  --checkpoint=1700,1800 or --workdir=A,B: an ensemble (per-step average of the members' probabilities)
  --dtype=float32|bfloat16: compute dtype of decoding
  --devices=N: each batch's sentences split over N devices (data parallel; a CPU host's CPU split into N, one
  a core; 0: every local device)

Python API:
  translator = Translator('runs/m30k')
  translator.translate(['A man is running.'], beam_size=4)
  translator.translate(['A man is running.'], sampling=True, top_k=10, seed=1)
"""
import functools
import itertools
import math
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from etils import epath

from flaxformer_nmt import beam_search
from flaxformer_nmt import best_checkpoint
from flaxformer_nmt import checkpoints as checkpoints_lib
from flaxformer_nmt import cli
from flaxformer_nmt import data as data_lib
from flaxformer_nmt import evaluate
from flaxformer_nmt import mbr as mbr_lib
from flaxformer_nmt import rerank as rerank_lib
from flaxformer_nmt import sharding
from flaxformer_nmt import tokenizer as tokenizer_lib
from flaxformer_nmt import workdir as workdir_lib
from flaxformer_nmt.model import Transformer
from flaxformer_nmt.tokenizer import BOS_ID, EOS_ID, PAD_ID


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


def default_checkpoint(workdir):
  """The checkpoint the workdir's config chose for decoding (config.decode_checkpoint; 'latest' for workdirs
  trained before the field)."""
  return workdir_lib.load_config(workdir).get('decode_checkpoint', 'latest')


def load_params(workdir, checkpoint=None):
  """(parameters on the default device, description) of checkpoint `latest`, `averaged`, `best` (the best
  validation metric, best_checkpoint.py), `last:K` (the average of the newest K checkpoints, computed now and
  not written) or STEP; None: the workdir's config.decode_checkpoint.

  Only the parameters are read: decoding needs neither the optimizer state nor the data position.
  """
  workdir_lib.single_run(workdir)
  if checkpoint is None:
    checkpoint = default_checkpoint(workdir)
    try:
      return load_params(workdir, checkpoint)
    except FileNotFoundError as e:  # e.g. 'averaged' of a run that has not finished
      raise FileNotFoundError(f'{e} (config.decode_checkpoint={checkpoint!r} of {workdir} is the default; '
                              'pass --checkpoint latest, or another, to decode something else)') from None
  if not checkpoints_lib.is_checkpoint_name(checkpoint):
    raise ValueError(f'--checkpoint must be {checkpoints_lib.CHECKPOINT_NAMES}, not {checkpoint!r}')
  if checkpoint == 'averaged':
    params, info = checkpoints_lib.load_averaged(workdir)
    return jax.device_put(params), f'the average of checkpoints {info["steps"]}'
  if checkpoint == 'best':
    params, info = best_checkpoint.load_best(workdir)
    return jax.device_put(params), f'the best checkpoint (step {info["step"]}, {info["metric"]} {info["value"]:.4g})'
  if checkpoint.startswith('last:'):
    steps = checkpoints_lib.saved_steps(workdir)[-int(checkpoint[5:]):]
    return jax.device_put(checkpoints_lib.average_params(workdir, steps)), f'the average of checkpoints {steps}'
  steps = checkpoints_lib.saved_steps(workdir)
  step = (steps[-1] if steps else None) if checkpoint == 'latest' else int(checkpoint)
  if step not in steps:
    raise FileNotFoundError(f'no checkpoint {checkpoint} in {checkpoints_lib.checkpoint_directory(workdir)}; '
                            f'there are {steps}')
  return jax.device_put(checkpoints_lib.saved_params(workdir, step)), f'checkpoint {step}'


def _split_list(value):
  """'a,b' or ['a', 'b'] (or one value, a path too) -> ['a', 'b']."""
  items = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value).split(',')
  return [item.strip() for item in items]


def ensemble_members(workdirs, checkpoints):
  """[(workdir, checkpoint)] of an ensemble: one workdir with several checkpoints ('1700,1800'), several
  workdirs with one checkpoint each ('latest' or 'averaged' of all), or as many checkpoints as workdirs
  (paired in order). checkpoints None: each workdir's config.decode_checkpoint (resolved by load_params). The
  workdir of an ensemble trained in one (config.ensemble_members, ensemble.py) stands for its members."""
  workdirs = _split_list(workdirs)
  checkpoints = None if checkpoints is None else _split_list(checkpoints)
  if '' in workdirs or '' in (checkpoints or []):
    raise ValueError(f'empty entry in --workdir {",".join(workdirs)!r} or --checkpoint '
                     f'{",".join(checkpoints or [])!r}')
  workdirs = [str(member) for w in workdirs for member in workdir_lib.member_workdirs(w)]
  if checkpoints is None:
    return [(w, None) for w in workdirs]
  if len(workdirs) == 1:
    return [(workdirs[0], c) for c in checkpoints]
  if len(checkpoints) == 1:
    return [(w, checkpoints[0]) for w in workdirs]
  if len(workdirs) != len(checkpoints):
    raise ValueError(f'{len(workdirs)} workdirs and {len(checkpoints)} checkpoints: give one checkpoint for all '
                     'workdirs, or one per workdir')
  return list(zip(workdirs, checkpoints))


DTYPES = ('auto', 'float32', 'bfloat16')
SEGMENT_STEPS = 8  # decoding steps between two looks at which sentences of a batch still search
COMPACT_BELOW = 0.9  # a batch goes on with its searching sentences only once that saves a tenth of its rows
FINE_ROWS_FROM = 64  # batch_rows: eighths of a power of two from 64 sentences on, powers of two below


# The jitted stages of Translator's search, shared by every Translator: the model (or the tuple of an ensemble's
# models) is a static argument, and equal models (a hashable dataclass of their config) share compiled programs,
# so a second Translator of the same model (compare's checkpoints, an ensemble's members) traces nothing again.
# Each stage is static only in what shapes or Python control flow reads; the length penalty's alpha is traced,
# so that a sweep of alphas (compare --alpha) reuses one compiled search.
START_STATIC = ('beam_size', 'extra_length', 'max_len_a', 'cache_cross_kv', 'grow_cache')
CONTINUE_STATIC = ('beam_size', 'temperature', 'top_k', 'cache_cross_kv', 'min_len')
_start = jax.jit(start_search, static_argnums=0, static_argnames=START_STATIC)
_continue = jax.jit(continue_search, static_argnums=0, static_argnames=CONTINUE_STATIC)
_grow = jax.jit(beam_search.grow_cache, static_argnames='length')
_take = jax.jit(take_sentences, static_argnames='batch')
_output = jax.jit(search_output)


class Translator:
  """A trained model (or an ensemble of several), loaded once, translating lists of sentences.

  workdir: a training workdir, or several ('A,B' or a list) with the same vocabulary; checkpoint: latest,
  averaged, a step, or several ('1700,1800'): more than one member makes an ensemble that averages the
  members' probabilities at every step (see ensemble_members); None: the config's decode_checkpoint. dtype:
  the compute dtype of decoding ('auto': bfloat16 on GPU/TPU, float32 on CPU; 'float32' also multiplies in
  float32 where the config rounds matmul operands to bfloat16; None: the config's); parameters stay as
  stored, log probabilities float32.
  devices: data-parallel decoding, each batch's sentences split over these devices (its rows padded to a
  multiple of their count) and the parameters replicated on each (sharding.local_devices finds them; on a CPU
  host, call it before the first computation); None: the default device alone.
  The decoding settings (beam size, length penalty, batch budget, max length) come from the first member.
  """

  def __init__(self, workdir, checkpoint=None, dtype=None, devices=None):
    if dtype is not None and dtype not in DTYPES:
      raise ValueError(f'dtype must be one of {DTYPES}, not {dtype!r}')
    members = ensemble_members(workdir, checkpoint)
    self.workdir = epath.Path(members[0][0])
    self.config = workdir_lib.load_config(self.workdir)
    self.tokenizer = tokenizer_lib.Tokenizer(self.workdir / tokenizer_lib.VOCAB_FILENAME)
    models, params, descriptions, configs = [], [], [], {}
    for member_workdir, member_checkpoint in members:
      if member_workdir not in configs:
        configs[member_workdir] = self._member_config(member_workdir, dtype)
        models.append(workdir_lib.build_model(configs[member_workdir], self.tokenizer))
      else:
        models.append(models[[w for w, _ in members].index(member_workdir)])
      member_params, description = load_params(member_workdir, member_checkpoint)
      params.append(member_params)
      one_workdir = len({w for w, _ in members}) == 1
      descriptions.append(description if one_workdir else f'{description} of {member_workdir}')
    self.config = configs[members[0][0]]
    # A model that learnt lowercased text (config.lowercase) reads its inputs lowercased too.
    self.lowercase = tokenizer_lib.lowercase_of(self.config)
    self.models, self.member_params = tuple(models), tuple(params)
    # The first member, for single-model users (attention pictures teacher-force one model).
    self.model, self.params = self.models[0], self.member_params[0]
    self.checkpoint = descriptions[0] if len(members) == 1 else f'an ensemble of {", ".join(descriptions)}'
    self._search_model = self.models if len(members) > 1 else self.model
    self.mesh = sharding.make_mesh(devices=list(devices)) if devices is not None and len(devices) > 1 else None
    if self.mesh is not None:
      self.member_params = jax.device_put(self.member_params, sharding.replicated(self.mesh))
      self.params = self.member_params[0]

  def _member_config(self, workdir, dtype):
    """A member's config, checked against the first member's vocabulary and direction."""
    config = workdir_lib.load_config(workdir)
    if config.get('task', 'translation') != 'translation':
      raise ValueError(f'{workdir} holds a language model (config.task={config.task!r}): use '
                       'flaxformer_nmt.generate (lm) or flaxformer_nmt.fill_mask (mlm)')
    vocab = epath.Path(workdir) / tokenizer_lib.VOCAB_FILENAME
    if vocab.read_bytes() != (self.workdir / tokenizer_lib.VOCAB_FILENAME).read_bytes():
      raise ValueError(f'an ensemble needs one vocabulary: {vocab} differs from '
                       f'{self.workdir / tokenizer_lib.VOCAB_FILENAME}')
    direction = lambda c: f'{c.source_lang}->{c.target_lang}'
    if direction(config) != direction(self.config):
      raise ValueError(f'an ensemble translates one direction: {workdir} is {direction(config)}, '
                       f'{self.workdir} {direction(self.config)}')
    if data_lib.right_to_left(config) != data_lib.right_to_left(self.config):
      raise ValueError(f'an ensemble writes its targets in one order: {workdir} '
                       f'{"right to left" if data_lib.right_to_left(config) else "left to right"}, {self.workdir} not')
    # How attention is computed and what is recomputed for gradients do not change the parameters: decide them
    # for this machine, not the one that trained (a workdir trained with 'cudnn' decodes on a CPU too).
    config.model.attention_impl, config.model.remat = 'auto', 'none'
    if dtype is not None:
      config.model.dtype = dtype
    if dtype == 'float32':  # float32 throughout: also the matmul operands a bf16-dot CPU's config rounds
      config.model.matmul_precision = 'float32'
    return config

  @property
  def search_params(self):
    """What the jitted search takes as `params`: one tree, or a tuple of them for an ensemble."""
    return self.member_params if len(self.models) > 1 else self.params

  def batches(self, token_lists, tokens_per_batch, sort_by_length=True):
    """source_batches with this model's length buckets."""
    return source_batches(token_lists, self.config.length_buckets, tokens_per_batch, sort_by_length)

  def _prepare(self, token_lists, beam_size=None, alpha=None, n_best=1, tokens_per_batch=None, sampling=False,
               temperature=1.0, top_k=0, cache_cross_kv=True, grow_cache=True, sort_by_length=True, max_len_a=None,
               max_len_b=None, min_len=MIN_LEN):
    """(the static options of the jitted search, its batches) for search_tokens and warm_up."""
    max_len_a = 1.0 if max_len_a is None else float(max_len_a)
    max_len_b = self.config.max_decode_extra_length if max_len_b is None else max_len_b
    if max_len_a < 0 or max_len_b < 0 or int(max_len_b) != max_len_b or (max_len_a == 0 and max_len_b < 1):
      raise ValueError(f'max_len_a={max_len_a} and max_len_b={max_len_b} must leave room for a token: '
                       'max_len_a >= 0, max_len_b a whole number >= 0, not both 0')
    if min_len < 0 or int(min_len) != min_len:
      raise ValueError(f'min_len={min_len} must be a whole number >= 0')
    beam_size = self.config.beam_size if beam_size is None else beam_size
    alpha = self.config.length_penalty_alpha if alpha is None else alpha
    if n_best < 1 or (not sampling and n_best > max(beam_size, 1)):
      raise ValueError(f'n_best={n_best} must be between 1 and the beam size ({beam_size})')
    if sampling and (temperature <= 0 or top_k < 0):
      raise ValueError(f'sampling needs temperature > 0 and top_k >= 0, not {temperature} and {top_k}')
    options = dict(beam_size=beam_size, alpha=float(alpha), extra_length=int(max_len_b), max_len_a=max_len_a,
                   cache_cross_kv=cache_cross_kv, grow_cache=grow_cache, min_len=int(min_len))
    if sampling:
      options.update(beam_size=0, alpha=0.0, temperature=float(temperature), top_k=int(top_k))
    tokens_per_batch = tokens_per_batch or self.config.decode_tokens_per_batch
    return options, self.batches(token_lists, tokens_per_batch, sort_by_length)

  def check_options(self, seed=0, **options):
    """Raises ValueError for option values that search_tokens would refuse."""
    del seed  # any integer
    self._prepare([], **options)

  def search_tokens(self, token_lists, n_best=1, sampling=False, seed=0, first_line=0, **options):
    """For each source (token ids ending with EOS), its n_best [(target ids ending with EOS, score)], in
    order; an empty source gives [([], 0.0)] * n_best.

    options: beam_size (0: greedy), alpha, tokens_per_batch, temperature, top_k, max_len_a and max_len_b (at
    most floor(max_len_a * source length + max_len_b) tokens before EOS; default 1 and the config's
    max_decode_extra_length, 50: the paper's source length + 50), min_len (at least that many tokens before
    EOS; default 1: no empty output for a non-empty source). sampling draws n_best
    samples per sentence (beam_size is then unused); sample j of sentence i depends only on (seed,
    first_line + i, j), so a stream read in chunks samples as the whole list would. cache_cross_kv=False,
    grow_cache=False and sort_by_length=False switch off three speed-ups, for measuring them.
    """
    token_lists = fit_to_positions(token_lists, self.config.model.max_position,
                                   self.config.max_decode_extra_length, first_line)
    options, batches = self._prepare(token_lists, n_best=n_best, sampling=sampling, **options)
    results = [[([], 0.0)] * n_best for _ in token_lists]
    for members, src in batches:
      src = self._pad_to_devices(src)
      keys = None
      if sampling:  # padding rows sample too, from line -1's keys, and are dropped
        lines = [first_line + i for i in members] + [-1] * (len(src) - len(members))
        keys = sample_keys(seed, jnp.asarray(lines, jnp.int32), n_best)
      tokens, scores = self._search_batch(src, keys, options)
      for r, i in enumerate(members):
        results[i] = [(reading_order(self.config, tokens[r, k]), float(scores[r, k])) for k in range(n_best)]
    return results

  def _device_multiple(self, rows):
    """`rows` rounded up to a multiple of the devices' count: every device searches as many rows."""
    return rows if self.mesh is None else -(-rows // self.mesh.size) * self.mesh.size

  def _pad_to_devices(self, src):
    """A source batch with empty rows (they end at once) added up to _device_multiple rows."""
    return np.pad(src, ((0, self._device_multiple(src.shape[0]) - src.shape[0]), (0, 0)), constant_values=PAD_ID)

  def _spread(self, tree):
    """Each sentence's arrays on the device that searches it (data-parallel decoding), or as they are."""
    return tree if self.mesh is None else sharding.spread_rows(tree, self.mesh)

  def _search_batch(self, src, keys, options):
    """(tokens [B, K, L], scores [B, K]) of a padded source batch, as `search` returns them, run in segments
    of SEGMENT_STEPS steps. Between segments the host reads which sentences are still searching; once they
    fit in COMPACT_BELOW of the rows, the finished ones are read out and the batch goes on with the others
    only, in batch_rows rows (few shapes to compile). A batch's last sentences (often one
    that runs to its length limit) then no longer keep every row computing; the results are the same.
    """
    start_options = {k: options[k] for k in START_STATIC if k in options}
    continue_options = {k: options[k] for k in CONTINUE_STATIC + ('alpha',) if k in options}
    inputs, state = self._spread(_start(self._search_model, self.search_params, *self._spread((src, keys)),
                                        **start_options))
    _, cache_lengths = search_lengths(self._search_model, src.shape, **options)
    sentences = np.arange(src.shape[0])  # the batch row of each row now searched
    results = []

    def read_out(rows):
      tokens, scores = jax.device_get(_output(inputs, state))
      results.append((sentences[rows], tokens[rows], scores[rows]))

    grown_to = cache_lengths[0]
    for cache_length, until in segment_ends(cache_lengths, SEGMENT_STEPS):
      if cache_length > grown_to:
        state, grown_to = self._spread(_grow(state, length=cache_length)), cache_length
      state, unfinished = _continue(self._search_model, self.search_params, inputs, state, np.int32(until),
                                    **continue_options)
      unfinished = np.asarray(unfinished)
      live, done = np.flatnonzero(unfinished), np.flatnonzero(~unfinished)
      if not len(live):
        break
      rows = self._device_multiple(batch_rows(len(live)))
      if rows <= COMPACT_BELOW * len(unfinished):
        read_out(done)
        keep = np.concatenate([live, np.full(rows - len(live), done[0])])  # a finished row pads
        inputs, state = self._spread(_take((inputs, state), keep, batch=len(unfinished)))
        sentences = sentences[keep]
    read_out(np.arange(len(sentences)))
    tokens = np.zeros((src.shape[0],) + results[0][1].shape[1:], results[0][1].dtype)
    scores = np.zeros((src.shape[0],) + results[0][2].shape[1:], results[0][2].dtype)
    for rows, row_tokens, row_scores in results:  # a padding row repeats its sentence's final result
      tokens[rows], scores[rows] = row_tokens, row_scores
    return tokens, scores

  def warm_up(self, token_lists, n_best=1, sampling=False, **options):
    """Runs search_tokens(token_lists, ...) once, which compiles every shape that the same call will run
    (also the smaller batches that finished sentences leave): timings after it exclude compilation."""
    self.search_tokens(token_lists, n_best=n_best, sampling=sampling, **options)

  def prepare(self, sentences):
    """Input lines as the model learnt to read them: whitespace normalized, lowercased where it learnt
    lowercased text."""
    return [tokenizer_lib.prepare_text(s, self.lowercase) for s in sentences]

  def translate(self, sentences, beam_size=None, alpha=None, n_best=1, tokens_per_batch=None, return_scores=False,
                mbr=None, **options):
    """Translations of `sentences` (list of str), in order. beam_size=0 decodes greedily.

    With n_best > 1 each item is a list of the n best translations; with mbr ('bleu' or 'chrf', mbr.py) and
    n_best > 1 it is the minimum-Bayes-risk choice among those n candidates. With return_scores, items are
    (translation, score) pairs: the length-normalized log probability (beam) or the log probability (greedy,
    sampling). `options`: sampling=True, temperature, top_k, seed, max_len_a, max_len_b (see search_tokens).
    """
    if mbr:  # before the search: its options are checked there
      mbr_lib.metric(mbr)
      if n_best < 2:
        raise ValueError(f'MBR chooses among candidates: n_best={n_best} must be at least 2')
    token_lists = self.tokenizer.encode(self.prepare(sentences))
    results = self.search_tokens(token_lists, beam_size=beam_size, alpha=alpha, n_best=n_best,
                                 tokens_per_batch=tokens_per_batch, **options)
    results = [[(self.tokenizer.decode(ids), score) for ids, score in hyps] for hyps in results]
    if mbr:
      results = [[hyps[mbr_lib.select([text for text, _ in hyps], mbr)]] for hyps in results]
      n_best = 1
    if not return_scores:
      results = [[text for text, _ in hyps] for hyps in results]
    return [hyps if n_best > 1 else hyps[0] for hyps in results]


def fit_to_positions(token_lists, max_position, extra_length, first_line=0):
  """Sources cut to what the model's position table holds, with a warning naming the lines (1-based).

  A source gets at most max_position - extra_length tokens (EOS included), so that its translation, up to
  extra_length tokens longer, has positions too; past the table every position would share the last
  row's encoding and the output would be cut short silently.
  """
  limit = max(max_position - extra_length, 2)
  long_lines = [first_line + i + 1 for i, tokens in enumerate(token_lists) if len(tokens) > limit]
  if not long_lines:
    return token_lists
  shown = ', '.join(map(str, long_lines[:10])) + (f' and {len(long_lines) - 10} more' if len(long_lines) > 10 else '')
  logging.warning('Input line%s %s: longer than the model allows (max_position %d - max_decode_extra_length '
                  '%d = %d tokens); translating only the first %d tokens.', 's' * (len(long_lines) > 1), shown,
                  max_position, extra_length, limit, limit - 1)
  return [list(tokens[:limit - 1]) + [EOS_ID] if len(tokens) > limit else tokens for tokens in token_lists]


def reading_order(config, tokens):
  """A searched row's token ids through its first EOS, in reading order: a right-to-left model's turned around
  (EOS stays last)."""
  ids = _through_eos(tokens)
  return data_lib.reverse_before_eos(ids) if data_lib.right_to_left(config) else ids


def _through_eos(tokens):
  """Token ids up to and including the first EOS."""
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def _read_chunks(path, size):
  """Lists of up to `size` lines of a file or stdin (-), read as they arrive; bad UTF-8 names the line."""
  name = '<stdin>' if path == '-' else path
  stream = sys.stdin.buffer if path == '-' else epath.Path(path).open('rb')  # gs:// too
  number = 0
  try:
    while raw_lines := list(itertools.islice(stream, size)):
      chunk = []
      for raw in raw_lines:
        number += 1
        try:
          chunk.append(raw.decode('utf-8').rstrip('\r\n'))
        except UnicodeDecodeError as e:
          raise data_lib.DataError(f'{name}:{number}: invalid UTF-8 ({e.reason} at byte {e.start})') from None
      yield chunk
  finally:
    if stream is not sys.stdin.buffer:
      stream.close()


def fairseq_lines(line_number, source, hypotheses, tokenizer):
  """fairseq-generate's lines for one input: S-i source, then per hypothesis H-i score pieces and D-i score
  text (ids counted from 0 in input order; scores are natural-log, as `translate(return_scores=True)`)."""
  lines = [f'S-{line_number}\t{source}']
  for ids, score in hypotheses:
    lines.append(f'H-{line_number}\t{score:.4f}\t{" ".join(tokenizer.pieces(i for i in ids if i != EOS_ID))}')
    lines.append(f'D-{line_number}\t{score:.4f}\t{tokenizer.decode(ids)}')
  return lines


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config.json, vocab.model, checkpoints/); several, '
                      'comma-separated, with one vocabulary, decode as an ensemble.')
  flags.DEFINE_string('input', '-', 'Source sentences, one per line; - reads stdin.')
  flags.DEFINE_string('output', '-', 'Where translations go; - writes stdout.')
  flags.DEFINE_string('reference', None, 'Raw references: prints cased sacreBLEU (13a) and chrF (case-insensitive '
                      'for a model of config.lowercase).')
  flags.DEFINE_string('tok_reference', None,
                      'Lowercased Moses-tokenized references: prints the paper-comparable BLEU.')
  flags.DEFINE_string('checkpoint', None, 'latest, averaged (see flaxformer_nmt.average), best (the best '
                      'validation checkpoint), last:K (the newest K averaged now) or a step; several, '
                      'comma-separated (1700,1800), decode as an ensemble (per-step average of probabilities). '
                      'Default: the config\'s decode_checkpoint (latest unless the config chose another).')
  flags.DEFINE_float('max_len_a', None, 'Output at most max_len_a * source length + max_len_b tokens before EOS '
                     '(default 1, as the paper).')
  flags.DEFINE_integer('max_len_b', None, 'See max_len_a (default: the config\'s max_decode_extra_length, 50).')
  flags.DEFINE_integer('min_len', MIN_LEN, 'At least this many tokens before EOS (fairseq\'s --min-len, CTranslate2\'s '
                       'min_decoding_length): 1 means no empty translation of a non-empty line; 0 allows EOS first.')
  flags.DEFINE_enum('dtype', None, list(DTYPES), 'Compute dtype for decoding (default: the config\'s, auto = '
                    'bfloat16 on GPU/TPU, float32 on CPU); float32 also keeps the matmul operands float32 where '
                    'the config rounds them to bfloat16 (config.model.matmul_precision).')
  flags.DEFINE_integer('beam_size', None, 'Beam width (default: the config\'s); 0 is greedy.')
  flags.DEFINE_bool('greedy', False, 'Greedy decoding (same as --beam_size=0).')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent (default: the config\'s).')
  flags.DEFINE_bool('sampling', False, 'Sample translations from the model instead of searching.')
  flags.DEFINE_float('temperature', 1.0, 'Sampling: draw from softmax(logits / temperature).')
  flags.DEFINE_integer('top_k', 0, 'Sampling: only from the k most likely tokens (0: all).')
  flags.DEFINE_integer('seed', 0, 'Sampling: random seed (a line\'s samples depend only on it and the line).')
  flags.DEFINE_integer('n_best', 1, 'Hypotheses per input (beams, or samples); more than 1 needs --format=fairseq '
                       'or --mbr.')
  flags.DEFINE_enum('mbr', None, list(mbr_lib.UTILITIES), 'Minimum Bayes risk (mbr.py): write the one of the '
                    '--n_best candidates (beams, or samples) that agrees most with the others by this sentence '
                    'metric, instead of the best-scored.')
  flags.DEFINE_string('rerank_workdir', None, 'A second model (often right to left: config.target_right_to_left, '
                      'same vocabulary) that rescores each line\'s beam candidates; the line gets the best of '
                      '(1 - w) search score + w rescorer score (rerank.py).')
  flags.DEFINE_string('rerank_checkpoint', None, 'The rescorer\'s checkpoint(s), as --checkpoint (default: its '
                      'config\'s).')
  flags.DEFINE_float('rerank_weight', 0.5, 'w of --rerank_workdir, from 0 (the search alone) to 1 (the rescorer '
                     'alone).')
  flags.DEFINE_enum('format', 'plain', ['plain', 'fairseq'],
                    'plain: one translation per input line. fairseq: S-i, H-i (score, pieces), D-i (score, text).')
  flags.DEFINE_integer('tokens_per_batch', None, 'Source tokens per batch.')
  flags.DEFINE_integer('buffer_lines', 5000, 'Lines read and translated at a time.')
  flags.DEFINE_integer('devices', 1, 'Devices to split each batch\'s sentences over (data parallel, the parameters '
                       'replicated on each): 1 the default device, N the first N local devices (a CPU host\'s CPU '
                       'split into N devices, one a core), 0 every local device.')
  flags.mark_flags_as_required(['workdir'])


def check_flag_combinations(FLAGS):  # pylint: disable=invalid-name
  """app.UsageError for flags that cannot go together."""
  if FLAGS.mbr and (FLAGS.n_best < 2 or FLAGS.format != 'plain'):
    raise app.UsageError('--mbr writes one chosen translation per line of --n_best >= 2 candidates: give --n_best '
                         'and --format=plain')
  if FLAGS.rerank_workdir and (FLAGS.mbr or FLAGS.sampling or FLAGS.greedy or FLAGS.beam_size == 0
                               or FLAGS.n_best > 1 or FLAGS.format != 'plain'):
    raise app.UsageError('--rerank_workdir writes one chosen translation per line of the beam\'s candidates: '
                         'not with --mbr, --sampling, greedy search, --n_best or --format=fairseq')
  if FLAGS.n_best > 1 and FLAGS.format == 'plain' and not FLAGS.mbr:
    raise app.UsageError('--n_best > 1 gives several lines per input: use --format=fairseq (or choose one: --mbr)')


def describe_method(FLAGS, beam_size, rescorer):  # pylint: disable=invalid-name
  """How the command translates, for its log line (beam_size 0: greedy)."""
  if FLAGS.sampling:
    method = f'sampling (temperature {FLAGS.temperature}, top-k {FLAGS.top_k or "off"}, seed {FLAGS.seed})'
  else:
    method = 'greedy' if beam_size == 0 else f'beam {beam_size}'
  if FLAGS.mbr:
    method += f', MBR by sentence {FLAGS.mbr} among {FLAGS.n_best} candidates'
  if rescorer is not None:
    method += (f', its candidates reranked with {rescorer.checkpoint} of {FLAGS.rerank_workdir} '
               f'(weight {FLAGS.rerank_weight:g})')
  return method


def choose_candidates(FLAGS, translator, rescorer, token_lists, results, texts):  # pylint: disable=invalid-name
  """Each line's written candidate: the rescorer's choice (rerank.py), MBR's (mbr.py), or the search's best."""
  if rescorer is not None:
    alpha = translator.config.length_penalty_alpha if FLAGS.alpha is None else FLAGS.alpha
    return rerank_lib.Reranker(rescorer, token_lists, results, alpha).choose(FLAGS.rerank_weight)
  return [mbr_lib.select(t, FLAGS.mbr) if FLAGS.mbr else 0 for t in texts]


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  check_flag_combinations(FLAGS)
  checkpoints_lib.quiet_orbax_logs()
  cli.use_compilation_cache()
  try:
    devices = sharding.local_devices(FLAGS.devices)  # before the first computation: it may split the CPU
    translator = Translator(FLAGS.workdir, FLAGS.checkpoint, dtype=FLAGS.dtype, devices=devices)
    rescorer = None
    if FLAGS.rerank_workdir:
      rerank_lib.check_weight(FLAGS.rerank_weight)
      # The rescorer teacher-forces on the default device (rerank.score_pairs batches for one device).
      rescorer = Translator(FLAGS.rerank_workdir, FLAGS.rerank_checkpoint, dtype=FLAGS.dtype)
      rerank_lib.check_partners(translator, rescorer)
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')
  beam_size = 0 if FLAGS.greedy else FLAGS.beam_size
  logging.info('Translating with %s of %s (%s) on %d %s device%s', translator.checkpoint, FLAGS.workdir,
               describe_method(FLAGS, translator.config.beam_size if beam_size is None else beam_size, rescorer), len(devices),
               devices[0].platform, 's' * (len(devices) > 1))
  options = dict(beam_size=beam_size, alpha=FLAGS.alpha, n_best=FLAGS.n_best,
                 tokens_per_batch=FLAGS.tokens_per_batch, max_len_a=FLAGS.max_len_a, max_len_b=FLAGS.max_len_b,
                 min_len=FLAGS.min_len)
  if FLAGS.sampling:
    options.update(sampling=True, temperature=FLAGS.temperature, top_k=FLAGS.top_k, seed=FLAGS.seed)
  if rescorer is not None:  # every beam's candidate
    options['n_best'] = FLAGS.beam_size or translator.config.beam_size
  try:  # bad option values stop before the output file is opened
    translator.check_options(**options)
  except ValueError as e:
    sys.exit(f'error: {e}')
  out = sys.stdout if FLAGS.output == '-' else epath.Path(FLAGS.output).open('w', encoding='utf-8')
  hypotheses, done, target_tokens, start = [], 0, 0, time.time()
  try:
    for chunk in _read_chunks(FLAGS.input, FLAGS.buffer_lines):
      chunk = translator.prepare(chunk)
      token_lists = translator.tokenizer.encode(chunk)
      results = translator.search_tokens(token_lists, first_line=done, **options)
      texts = [[translator.tokenizer.decode(ids) for ids, _ in hyps] for hyps in results]
      chosen = choose_candidates(FLAGS, translator, rescorer, token_lists, results, texts)
      best = [t[i] for t, i in zip(texts, chosen)]
      if FLAGS.format == 'fairseq':
        lines = [line for i, (source, hyps) in enumerate(zip(chunk, results))
                 for line in fairseq_lines(done + i, source, hyps, translator.tokenizer)]
      else:
        lines = best
      out.write(''.join(line + '\n' for line in lines))
      out.flush()
      hypotheses += best if FLAGS.reference else []
      done += len(chunk)
      target_tokens += sum(len(hyps[i][0]) for hyps, i in zip(results, chosen))  # the written translations
      seconds = time.time() - start
      logging.info('%d sentences, %.1f sentences/s, %.0f target tokens/s', done, done / seconds,
                   target_tokens / seconds)
  except OSError as e:
    sys.exit(f'error: {FLAGS.input}: {e}')
  except ValueError as e:  # bad input (the message names the line) or bad option values
    sys.exit(f'error: {e}')
  finally:
    if out is not sys.stdout:
      out.close()
  if FLAGS.reference:
    try:
      lines, _ = evaluate.report(hypotheses, evaluate.read_text(FLAGS.reference),
                                 evaluate.read_text(FLAGS.tok_reference) if FLAGS.tok_reference else None,
                                 translator.config.target_lang, lowercase=translator.lowercase)
    except (OSError, ValueError) as e:
      sys.exit(f'error: {e}')
    print('\n'.join(lines), file=sys.stderr if out is sys.stdout else sys.stdout)


if __name__ == '__main__':
  define_flags()
  app.run(main)
