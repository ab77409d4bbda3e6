"""Searching lists of sentences batch by batch on the ladder's shapes (ladder.py), in one of two ways:

- segments (CPU): a batch searches until its cache is full or its searching sentences fit a lower row rung;
  the host then reads it back, keeps the finished sentences' results, and goes on with the others only, in
  that rung's rows (or in several batches of the next length's rung, the cache grown), as CTranslate2 and
  fairseq drop finished sentences. What runs is a `begin` program per (rows, source length) a batch starts in
  and a `segment` program per (rows, cache length) it goes on in: all rungs of the ladder, whatever the data.
  Two batches search at once, each in a thread (CPU_BATCHES_IN_FLIGHT).
- on the device (GPU, TPU): each batch's whole search in one program (search.search, the cache growing
  inside it), with no host round trip until its results: one program per source length rung.

The two give the same translations (tests/test_decode.py). Every program is jitted once per process with the
model static (equal models share them), and saved as an executable that later processes load without tracing
it (runtime/executables.py); the length penalty's alpha, the length limit and the stop rung are inputs, not
constants.
"""

import concurrent.futures
import dataclasses
import functools

import jax
import numpy as np

from flaxformer_nmt.decoding import beam_search
from flaxformer_nmt.decoding import search as search_lib
from flaxformer_nmt.runtime import executables

# Options that shape a program (static); the rest (alpha, the length limit's max_len_a and extra_length) are
# inputs: a server's requests that ask for other limits share its programs.
START_STATIC = ('beam_size', 'cache_cross_kv', 'num_samples')
RULE_STATIC = ('beam_size', 'temperature', 'top_k', 'cache_cross_kv', 'min_len', 'scores')


def _begin(model, params, src, lines, seed, stop, alpha, max_len_a, extra_length, *, cache_length, num_samples=0,
           **options):
  """start_search and its first segment (search.run_segment) of a padded source batch, sampling keys drawn
  here from (seed, line numbers); returns (inputs, state, [B] still searching)."""
  keys = search_lib.line_keys(seed, lines, num_samples) if num_samples else None
  inputs, state = search_lib.start_search(model, params, src, keys, cache_length=cache_length, length=cache_length,
                                          max_len_a=max_len_a, extra_length=extra_length, **options)
  state, live = search_lib.run_segment(model, params, inputs, state, stop, first=True, alpha=alpha, **options)
  return inputs, state, live


def _segment(model, params, inputs, state, stop, alpha, **options):
  return search_lib.run_segment(model, params, inputs, state, stop, alpha=alpha, **options)


def _on_device(model, params, src, lines, seed, alpha, max_len_a, extra_length, *, cache_lengths, num_samples=0,
               **options):
  """search.search of a whole batch, sampling keys drawn here from (seed, line numbers)."""
  keys = search_lib.line_keys(seed, lines, num_samples) if num_samples else None
  return search_lib.search(model, params, src, keys, alpha=alpha, max_len_a=max_len_a, extra_length=extra_length,
                           cache_lengths=cache_lengths, **options)


# A batch-invariant search: each sentence's translation and scores the same whatever else its batch holds (the
# server's batches). XLA:CPU hands a sum over 4,096 elements or more to YNNPACK, which adds in another order than
# XLA's own loops, so a batch's size decides how LayerNorm and attention round; and a lone sentence's matmuls
# take matrix-vector kernels. Batch-invariant programs leave YNNPACK the matmuls only, and their batches hold
# at least BATCH_INVARIANT_MIN_ROWS sentences; beam search runs about 20% fewer sentences/s (bench/RESULTS.md).
# YNNPACK's matmuls round a row alike at any row count where both widths are 48 or more; outputs of 32 columns
# or fewer (a toy's feed-forward) round differently from 16 rows on.
BATCH_INVARIANT_OPTIONS = {'xla_cpu_experimental_ynn_fusion_type': 'LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT'}
BATCH_INVARIANT_MIN_ROWS = 2

_BEGIN_STATIC = tuple(sorted(set(START_STATIC + RULE_STATIC))) + ('cache_length',)
_DEVICE_STATIC = _BEGIN_STATIC[:-1] + ('cache_lengths', 'grow_cache')


def _segment_programs_with(**jit_options):
  """(begin, segment): the jitted programs of a segmented search."""
  return (executables.Program(_begin, static_argnums=(0,), static_argnames=_BEGIN_STATIC, **jit_options),
          executables.Program(_segment, static_argnums=(0,), static_argnames=RULE_STATIC, **jit_options))


_begin_jit, _segment_jit = _segment_programs_with()
_INVARIANT_PROGRAMS = _segment_programs_with(compiler_options=BATCH_INVARIANT_OPTIONS)


def _programs_for(options):
  """(begin, segment) of a segmented search with these options (the batch-invariant ones where asked for)."""
  return _INVARIANT_PROGRAMS if options.get('batch_invariant') else (_begin_jit, _segment_jit)


def _ladder_for(options, ladder):
  """The ladder a search with these options runs on: a batch-invariant one never has a sentence alone."""
  return dataclasses.replace(ladder, min_rows=BATCH_INVARIANT_MIN_ROWS) if options.get('batch_invariant') else ladder


@functools.cache
def _on_device_jit(out_sharding=None):
  """_on_device jitted, its results laid out by `out_sharding` (None: as XLA chooses)."""
  return executables.Program(_on_device, static_argnums=(0,), static_argnames=_DEVICE_STATIC,
                             out_shardings=out_sharding)


def _to_host(x):
  """A result as a NumPy array: the local copy of a replicated array that spans several hosts."""
  return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


# A CPU's batches hold at most this many source tokens where the caller names no budget (the config's
# decode_tokens_per_batch is sized for accelerators): Multi30k test2016, beam 5, on a 2-core EPYC: 136
# sentences/s at 512 tokens, 112 at 1,024, 91 at 4,096 (a step's cache and logits stay in the CPU's caches).
CPU_TOKENS_PER_BATCH = 512


def tokens_per_batch_for(config_budget, on_device=None):
  """The token budget of a search's batches where the caller names none: the config's, on a CPU at most
  CPU_TOKENS_PER_BATCH."""
  on_device = on_device_by_default() if on_device is None else on_device
  return config_budget if on_device else min(config_budget, CPU_TOKENS_PER_BATCH)


def on_device_by_default():
  """Whether a batch's whole search runs on the device: on GPU and TPU (a host round trip costs more than the
  rows it saves), not on a CPU (which computes every row it is given)."""
  return jax.default_backend() != 'cpu'


def _static(options, names):
  return {k: options[k] for k in names if k in options}


def _limit(options):
  """(max_len_a, extra_length) of the length limit, as the programs' inputs (one dtype for any value)."""
  return np.float32(options.get('max_len_a', 1.0)), np.int32(options['extra_length'])


# Batches a CPU searches at once, each in a thread of its own. A segmented search is one chain of small operations
# that keeps about one core busy, and the host's reads between segments stop it: a second batch fills the gaps
# and the other core (test2016, 2 cores: beam 5 1.4x and greedy 1.2x the sentences/s of one batch at a time).
CPU_BATCHES_IN_FLIGHT = 2


def search_batches(model, params, token_lists, ladder, options, *, lines=None, seed=0, on_device=None, place=None,
                   out_sharding=None, in_flight=None):
  """For each source (token ids ending with EOS), (tokens [K, L], scores [K]) as search.search_output gives a
  row, or None for an empty source; options: search.search's, with num_samples (> 0: sampling that many)
  instead of sample keys, sort_by_length, and batch_invariant (the segmented search's batch-invariant programs
  and batches, BATCH_INVARIANT_OPTIONS). lines: each source's line number (sample keys; default
  0, 1, ...). on_device: see the module docstring (None: on_device_by_default). place(tree) puts a batch's
  arrays where the search runs them (data-parallel devices, several hosts' global arrays; default: as jit
  does); out_sharding: the layout of the on-device search's results (replicated, for several hosts).
  in_flight: how many batches are searched at once (None: CPU_BATCHES_IN_FLIGHT for the segmented search, 1 on
  the device; a batch's translations do not depend on it); a `place` that spreads a batch over several devices
  takes 1."""
  options = dict(options)
  sort_by_length = options.pop('sort_by_length', True)
  lines = np.arange(len(token_lists), dtype=np.int32) if lines is None else np.asarray(lines, np.int32)
  on_device = on_device_by_default() if on_device is None else on_device
  in_flight = in_flight or (1 if on_device else CPU_BATCHES_IN_FLIGHT)
  place, ladder = place or (lambda tree: tree), _ladder_for(options, ladder)
  run = functools.partial(_device_batch, out_sharding=out_sharding) if on_device else _segmented_batch

  def search_one(members, src):
    batch_lines = np.full(len(src), -1, np.int32)  # padding rows sample line -1's keys, and are dropped
    batch_lines[:len(members)] = lines[members]
    return run(model, params, src, batch_lines, seed, ladder, options, place)

  results = [None] * len(token_lists)
  batches = ladder.batches(token_lists, sort_by_length, top_rows=on_device)
  for members, found in _searched(batches, search_one, in_flight):
    for row, tokens, scores in found:
      if row < len(members):
        results[members[row]] = tokens, scores
  return results


def _searched(batches, search_one, in_flight):
  """(members, search_one(members, src)) of each (members, src) batch, in order, `in_flight` at a time (a lone
  batch in the caller's thread)."""
  batches = list(batches)
  if in_flight == 1 or len(batches) == 1:
    yield from ((members, search_one(members, src)) for members, src in batches)
    return
  with concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix='batch_search') as pool:
    futures = [(members, pool.submit(search_one, members, src)) for members, src in batches]
    try:
      for members, future in futures:
        yield members, future.result()
    finally:  # an error or an interrupt: the batches not begun are not searched
      for _, future in futures:
        future.cancel()


def _top_cache_length(ladder, source_length, options):
  """The longest cache a batch of sources padded to `source_length` searches in: the rung of its longest output
  limit, or the source's length where that is longer (a batch's cache starts at its source's length)."""
  steps = search_lib.max_steps(source_length, options.get('max_len_a', 1.0), options['extra_length'],
                               ladder.max_position)
  return max(source_length, ladder.length_for(steps))


def _device_batch(model, params, src, lines, seed, ladder, options, place, out_sharding=None):
  """[(row, tokens, scores)] of a batch searched in one program."""
  top = _top_cache_length(ladder, src.shape[1], options)
  cache_lengths = tuple(c for c in ladder.lengths if src.shape[1] <= c <= top)
  static = _static(options, _DEVICE_STATIC)
  found = _on_device_jit(out_sharding)(model, params, *place((src, lines)), seed, options['alpha'], *_limit(options),
                                       cache_lengths=cache_lengths, **static)
  tokens, scores = (_to_host(x) for x in found)
  return [(row, tokens[row], scores[row]) for row in range(len(src))]


def _segmented_batch(model, params, src, lines, seed, ladder, options, place):
  """[(row, tokens, scores)] of a batch searched in segments (see the module docstring)."""
  rows, length = src.shape
  begin_length = length if options.get('grow_cache', True) else _top_cache_length(ladder, length, options)
  src = beam_search.pad_axis(src, 1, begin_length, search_lib.PAD_ID)
  alpha, rule = options['alpha'], _static(options, RULE_STATIC)
  begin_jit, segment_jit = _programs_for(options)
  inputs, state, live = begin_jit(model, params, *place((src, lines)), seed, ladder.below(rows, begin_length),
                                   alpha, *_limit(options), cache_length=begin_length,
                                   **_static(options, _BEGIN_STATIC))
  results, work = [], [(np.arange(rows), inputs, state, live)]
  while work:
    sentences, inputs, state, live = jax.device_get(work.pop())
    tokens, scores = search_lib.search_output(inputs, state)
    results += [(sentences[r], tokens[r], scores[r]) for r in np.flatnonzero(~live) if sentences[r] >= 0]
    for sentences, inputs, state in _go_on(sentences, inputs, state, live, ladder):
      stop = ladder.below(len(sentences), beam_search.cache_length(state))
      state, live = segment_jit(model, params, *place((inputs, state)), stop, alpha, **rule)
      work.append((sentences, inputs, state, live))
  return results


def _go_on(sentences, inputs, state, live, ladder):
  """[(sentences, inputs, state)]: the batches the searching sentences of a host copy go on in: the row rungs
  of split at the cache's length, or of the next length, grown to it, where the cache is full. A batch's
  padding rows copy a searching sentence, marked finished (sentence -1)."""
  searching = np.flatnonzero(live)
  if not len(searching):
    return []
  length = beam_search.cache_length(state)
  if int(state.index) >= length:
    length = ladder.next_length(length)
    inputs, state = grow_inputs(inputs, length), beam_search.grow_state(state, length)
  batches, start = [], 0
  for rows in ladder.split(len(searching), length):
    keep = searching[start:start + rows]
    start += rows
    padding = rows - len(keep)
    keep = np.concatenate([keep, np.full(padding, keep[0])])
    batch_inputs, batch_state = search_lib.take_sentences((inputs, state), keep, batch=len(live))
    finished = np.arange(rows) >= rows - padding
    batches.append((np.where(finished, -1, sentences[keep]), batch_inputs, _mark_finished(batch_state, finished)))
  return batches


def _mark_finished(state, finished):
  """A host copy of a search state whose sentences `finished` ([B] bool) no longer search."""
  if isinstance(state, beam_search.BeamState):
    return state._replace(max_lengths=np.where(finished, 0, state.max_lengths))
  rows = np.repeat(finished, state.finished.shape[0] // len(finished))
  return state._replace(finished=state.finished | rows)


def grow_inputs(inputs, length):
  """A host copy of search.SearchInputs padded to `length` source positions: the sources with PAD (so the
  mask hides the new positions), the encoder's keys/values (head-major [B, H, S, D]) or output rows ([R, S, d],
  without cache_cross_kv) with zeros."""
  grow_src = lambda x: beam_search.pad_axis(x, 1, length, search_lib.PAD_ID)
  members = []
  for encoded, member_src in inputs.members:
    if isinstance(encoded, (list, tuple)):  # per layer (keys, values)
      encoded = [tuple(beam_search.pad_axis(x, 2, length) for x in kv) for kv in encoded]
    else:
      encoded = beam_search.pad_axis(encoded, 1, length)
    members.append((encoded, grow_src(member_src)))
  return inputs._replace(src=grow_src(inputs.src), members=tuple(members))


def warm_up(model, params, ladder, options, *, max_source_length=None, on_device=None, place=None):
  """Compiles (or loads from the compilation cache) every program that searching sources of up to
  `max_source_length` tokens (None: any the model takes) with these options may run, by running each on
  empty sources: later searches compile nothing. Returns how many programs that was."""
  on_device = on_device_by_default() if on_device is None else on_device
  place, ladder = place or (lambda tree: tree), _ladder_for(options, ladder)
  source_lengths = ladder.source_lengths(max_source_length)
  if on_device:
    for length in source_lengths:
      rows = ladder.rows(length)[0]
      _device_batch(model, params, _empty_sources(rows, length), np.zeros(rows, np.int32), 0, ladder, options, place)
    return len(source_lengths)
  begin_jit, segment_jit = _programs_for(options)
  begun = {}
  for length in source_lengths:
    for rows in ladder.rows(length):
      begun[length] = jax.device_get(begin_jit(
          model, params, *place((_empty_sources(rows, length), np.zeros(rows, np.int32))), 0, 0, options['alpha'],
          *_limit(options), cache_length=length, **_static(options, _BEGIN_STATIC)))[:2]
  top = _top_cache_length(ladder, source_lengths[-1], options)
  count, (inputs, state) = sum(len(ladder.rows(length)) for length in source_lengths), begun[source_lengths[0]]
  for length in (c for c in ladder.lengths if c <= top):
    inputs, state = begun.get(length) or (grow_inputs(inputs, length), beam_search.grow_state(state, length))
    for rows in ladder.rows(length):
      batch_inputs, batch_state = search_lib.take_sentences((inputs, state), np.zeros(rows, np.int64),
                                                            batch=len(inputs.src))
      jax.block_until_ready(segment_jit(model, params, *place((batch_inputs, batch_state)), 0, options['alpha'],
                                         **_static(options, RULE_STATIC)))
      count += 1
  return count


def _empty_sources(rows, length):
  """[rows, length] sources of EOS alone: a search of them ends at its first step."""
  src = np.full((rows, length), search_lib.PAD_ID, np.int32)
  src[:, 0] = search_lib.EOS_ID
  return src
