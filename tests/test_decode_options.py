"""fairseq-style decoding options at the search level, on tiny random models: ensembles (per-step average
of the members' probabilities, checked against the members' full decoders in NumPy) and the output length
limit max_len_a * source length + max_len_b."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from flaxformer_nmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from flaxformer_nmt.decoding import beam_search
from flaxformer_nmt.decoding import search as search_lib

SRC = jnp.array([[5, 6, 7, 8, 9, 10, 11, EOS_ID],
                 [12, 4, 9, EOS_ID, 0, 0, 0, 0],
                 [7, 7, 13, 14, 15, 5, EOS_ID, 0],
                 [10, EOS_ID, 0, 0, 0, 0, 0, 0]], jnp.int32)


STATIC = ('beam_size', 'alpha', 'extra_length', 'max_len_a')


def run(model, params, beam_size, **options):
  options = {'alpha': 0.6, 'extra_length': 10, **options}
  search = jax.jit(functools.partial(search_lib.search, model), static_argnames=STATIC)
  tokens, scores = search(params, SRC, beam_size=beam_size, **options)
  return np.asarray(tokens), np.asarray(scores)


def second_model():
  """A pre-LN model with other weights: an ensemble member of another architecture, same vocabulary."""
  model, params = tiny_model(pre_layer_norm=True)
  params = jax.tree_util.tree_map(lambda x: x[::-1] if x.ndim == 2 else x, params)  # other weights, same shapes
  return model, params


@functools.lru_cache(maxsize=None)
def full_decoder(model):
  return jax.jit(lambda params, src, tgt_in: model.apply({'params': params}, src, tgt_in))


def member_probabilities(model, params, src_row, output):
  """[len(output), V] next-token probabilities of the full (uncached) decoder, teacher-forced on `output`
  (right-padded to a multiple of 8 for fewer compiled shapes: the causal mask keeps the padding out of them)."""
  tgt_in = np.full((1, -(-len(output) // 8) * 8), PAD_ID, np.int32)
  tgt_in[0, :len(output)] = [BOS_ID] + output[:-1]
  logits = np.asarray(full_decoder(model)(params, src_row[None], tgt_in), np.float64)[0, :len(output)]
  exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
  return exp / exp.sum(axis=-1, keepdims=True)


def through_eos(row):
  row = [int(t) for t in row]
  return row[:row.index(EOS_ID) + 1]


def plain_greedy(model, params, src_row, limit, min_len=1):
  """Greedy decoding written plainly: the whole (uncached) decoder on the prefix at every step, PAD and BOS never
  chosen, EOS not before min_len tokens and forced as the limit's last token (EOS included)."""
  output = []
  for t in range(limit):
    tgt_in = np.array([[BOS_ID] + output], np.int32)
    logits = np.array(full_decoder(model)(params, src_row[None], tgt_in), np.float64)[0, -1]
    logits[[PAD_ID, BOS_ID]] = -np.inf
    if t < min_len:
      logits[EOS_ID] = -np.inf
    output.append(EOS_ID if t == limit - 1 else int(np.argmax(logits)))
    if output[-1] == EOS_ID:
      break
  return output


@pytest.mark.parametrize('on_device, grow_cache', [(True, True), (False, False)])
def test_a_limit_shorter_than_the_sources_length_rung_searches_every_path(on_device, grow_cache):
  # max_len_a=0 and max_len_b=2: at most 2 tokens before EOS, a cache rung (16) below the source's rung (32).
  # Catches a search that sized its cache from the rungs between the source's length and the limit's (none:
  # an IndexError on the device's path, a negative padding without grow_cache) instead of the limit's.
  from flaxformer_nmt.decoding import batch_search  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.decoding.ladder import Ladder  # pylint: disable=g-import-not-at-top
  model, params = tiny_model()
  sources = [[5, 6, 7, 8] * 5 + [EOS_ID], [9, 10, EOS_ID]]  # 21 tokens: padded to 32; 3 tokens: to 16
  options = dict(beam_size=0, alpha=0.6, extra_length=2, max_len_a=0.0, min_len=1, grow_cache=grow_cache)
  found = batch_search.search_batches(model, params, sources, Ladder(256, 128, min_length=16), options,
                                      on_device=on_device)
  for source, (tokens, _) in zip(sources, found):
    expected = plain_greedy(model, params, jnp.asarray(source, jnp.int32), 3)
    assert through_eos(tokens[0]) == expected, (source, tokens)


def test_ensemble_steps_average_the_members_probabilities():
  # Greedy ensemble decoding, re-derived in NumPy from each member's full decoder: at every step the chosen
  # token must be the argmax of the mean of the members' probabilities (padding and <s> excluded, as
  # decoding forbids them) and the score the sum of the log of that mean. Averaging logits or log
  # probabilities, or following one member, gives other scores (the members disagree: checked below).
  members = [tiny_model(), second_model()]
  models, params = tuple(m for m, _ in members), tuple(p for _, p in members)
  tokens, scores = run(models, params, 0)
  disagreement = 0.0
  for b in range(SRC.shape[0]):
    output = through_eos(tokens[b, 0])
    member_probs = [member_probabilities(m, p, SRC[b], output) for m, p in members]
    probs = np.mean(member_probs, axis=0)
    allowed = probs.copy()
    allowed[:, [PAD_ID, BOS_ID]] = -1
    for t, token in enumerate(output[:-1]):  # the last token may be EOS forced by the length limit
      assert token == int(np.argmax(allowed[t])), (b, t)
    chosen = [np.log(q[np.arange(len(output)), output]).sum() for q in member_probs]
    np.testing.assert_allclose(scores[b, 0], np.log(probs[np.arange(len(output)), output]).sum(), atol=1e-4)
    disagreement = max(disagreement, abs(chosen[0] - chosen[1]))
  assert disagreement > 1.0  # the members score the ensemble's outputs differently


def test_ensemble_beam_scores_are_length_normalized_log_mean_probabilities():
  members = [tiny_model(), second_model()]
  tokens, scores = run(tuple(m for m, _ in members), tuple(p for _, p in members), 3, alpha=0.6)
  for b in range(SRC.shape[0]):
    for k in range(3):
      output = through_eos(tokens[b, k])
      probs = np.mean([member_probabilities(m, p, SRC[b], output) for m, p in members], axis=0)
      log_p = np.log(probs[np.arange(len(output)), output]).sum()
      np.testing.assert_allclose(scores[b, k], log_p / ((5 + len(output)) / 6) ** 0.6, atol=1e-4)


def test_a_warm_up_for_a_limit_shorter_than_the_sources_leaves_no_program_to_compile():
  # A limit (max_len_a=0.5, max_len_b=0) whose searches need a cache of 16 positions for sources padded to 32:
  # their segments still run at the source's 32 positions, in the row rungs below a batch's. Catches a warm-up
  # that compiled the segments of the limit's cache lengths only: a first translation then compiled one more.
  from flaxformer_nmt.decoding import batch_search  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.decoding.ladder import Ladder  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.runtime import cache  # pylint: disable=g-import-not-at-top
  model, params = tiny_model()
  ladder = Ladder(64, 64, min_length=16)  # rows 8 and 1 at 16 positions, 2 and 1 at 32
  options = dict(beam_size=2, alpha=0.6, extra_length=0, max_len_a=0.5, min_len=3)  # min_len: programs of its own
  batch_search.warm_up(model, params, ladder, options, max_source_length=31, on_device=False)
  sources = [[5] * 16 + [EOS_ID], [6] * 30 + [EOS_ID]]  # 17 and 31 tokens: limits of 9 and 16 tokens
  with cache.ProgramCounter() as search:
    found = batch_search.search_batches(model, params, sources, ladder, options, on_device=False)
  assert search.names == [], search.names
  lengths = [len(through_eos(tokens[0])) for tokens, _ in found]
  assert lengths[0] != lengths[1], lengths  # one sentence searched on alone: a segment in the rung below


def test_average_probabilities_is_log_of_mean_probability():
  log_probs = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (3, 4, 16)) * 4)
  expected = np.log(np.exp(np.asarray(log_probs, np.float64)).mean(axis=0))
  np.testing.assert_allclose(beam_search.average_probabilities(log_probs), expected, atol=1e-5)


def test_segmented_sampling_goes_on_with_a_sentence_until_its_last_sample_ends():
  # The segments (batch_search.py) drop a sentence once all its samples have ended: catches one dropped at its
  # first ended sample (its other samples cut short, without EOS) and samples not sorted by log probability.
  # Each sample is checked against the whole (uncached) decoder: it ends with EOS within its limit, and its
  # score is its log probability there.
  from flaxformer_nmt.decoding import batch_search  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.decoding.ladder import Ladder  # pylint: disable=g-import-not-at-top
  model, params = tiny_model()
  sources = [[5, 6, EOS_ID], [7, 8, 9, 10, EOS_ID], [11, EOS_ID], [12, 13, 14, EOS_ID], [15, 4, 5, 6, 7, 8, EOS_ID]]
  options = dict(beam_size=0, alpha=0.0, extra_length=12, max_len_a=1.0, min_len=1, temperature=3.0, top_k=0,
                 num_samples=4)
  # 8 rows at 16 positions: the first segment ends where the cache is full, before most samples end.
  found = batch_search.search_batches(model, params, sources, Ladder(64, 128, min_length=16), options,
                                      on_device=False)
  lengths = set()
  for source, (tokens, scores) in zip(sources, found):
    limit = len(source) - 1 + 12 + 1  # EOS included
    assert list(scores) == sorted(scores, reverse=True), scores
    for row, score in zip(tokens, scores):
      assert EOS_ID in list(row), (source, row)  # ended, not cut short
      output = through_eos(row)
      assert len(output) <= limit, (source, output)
      probs = member_probabilities(model, params, jnp.asarray(source, jnp.int32), output)
      np.testing.assert_allclose(score, np.log(probs[np.arange(len(output)), output]).sum(), rtol=1e-4, atol=1e-4)
      lengths.add(len(output))
  assert min(lengths) < 16 < max(lengths), lengths  # samples ended in the first segment and after it


# Each case compiles a search of its own (a and b are static): three limits by default, a fraction rounded down,
# no source term and a long one; two more with -m slow (14 s of the 2-core CI machine's time).
@pytest.mark.parametrize('beam_size', [0, 2])
@pytest.mark.parametrize('a,b', [pytest.param(1.0, 10, marks=pytest.mark.slow),
                                 pytest.param(0.5, 3, marks=pytest.mark.slow), (0.0, 2), (1.5, 0), (0.7, 1)])
def test_output_length_is_at_most_a_times_source_plus_b(beam_size, a, b):
  # The sharpened random model rarely says EOS: most rows run to their limit, so a wrong limit (another
  # rounding, counting the source's EOS, the batch's longest source) shows as a length.
  model, params = tiny_model()
  tokens, _ = run(model, params, beam_size, extra_length=b, max_len_a=a)
  source_lengths = np.asarray((SRC != PAD_ID).sum(axis=1)) - 1
  at_limit = 0
  for row, n in zip(tokens[:, 0], source_lengths):
    limit = math.floor(a * n + b + 1e-9)  # fairseq's int(a * n + b), in float64
    generated = len(through_eos(row)) - 1
    assert generated <= limit
    at_limit += generated == limit
  assert at_limit >= 2


def test_default_limit_is_source_length_plus_50():
  model, params = tiny_model()
  tokens, _ = run(model, params, 0, extra_length=50)
  lengths = [len(through_eos(row)) - 1 for row in tokens[:, 0]]
  source_lengths = list(np.asarray((SRC != PAD_ID).sum(axis=1)) - 1)
  assert all(n <= s + 50 for n, s in zip(lengths, source_lengths))
  assert any(n == s + 50 for n, s in zip(lengths, source_lengths))


def test_output_limits_are_the_floor_of_the_decimal_a_times_n_plus_b():
  # fairseq's floor(a * n + b) tokens before EOS, n the source's pieces without EOS, of the decimal a as typed
  # (exact fractions here): float32 alone gives 0.21 * 300 = 62.99998 and 0.13 * 900 = 116.99999, a token short.
  # A row of padding alone may produce EOS only (it never keeps a search running); the table caps every limit.
  from fractions import Fraction  # pylint: disable=g-import-not-at-top
  pieces = [0, 1, 7, 10, 300, 900]
  src = np.zeros((len(pieces) + 1, 904), np.int32)  # the last row: padding alone
  for row, n in enumerate(pieces):
    src[row, :n + 1] = [5] * n + [EOS_ID]
  for a in (0.0, 0.13, 0.21, 0.7, 1.0, 1.5):
    for b in (0, 1, 50):
      for max_position in (1024, 300):
        expected = [min(math.floor(Fraction(str(a)) * n + b) + 1, max_position) for n in pieces] + [1]
        # As the programs take them: float32 and int32 inputs.
        limits = search_lib.output_limits(jnp.asarray(src), np.float32(a), np.int32(b), max_position)
        assert list(np.asarray(limits)) == expected, (a, b, max_position)
        # The static number of steps of a batch padded to 904 tokens: the limit of its longest possible source.
        longest = min(math.floor(Fraction(str(a)) * 903 + b) + 1, max_position)
        assert search_lib.max_steps(src.shape[1], a, b, max_position) == longest, (a, b, max_position)


def test_limit_beyond_the_position_table_is_capped():
  model, params = tiny_model()  # max_position 128: 20 * 7 would need 140 positions
  tokens, _ = run(model, params, 0, extra_length=0, max_len_a=20.0)
  max_position = model.config.max_position
  assert tokens.shape[-1] <= max_position
  assert all(EOS_ID in list(row) for row in tokens[:, 0])
  # The cap is the whole table: BOS and the first max_position - 1 tokens fill its positions, so a capped row
  # may generate max_position tokens, EOS included. The sharpened model runs its rows to their limits: the
  # 7-token source (limit 141) uses every position, where a cap one short ends it at 127.
  source_lengths = np.asarray((SRC != PAD_ID).sum(axis=1)) - 1
  limits = [min(math.floor(20.0 * n) + 1, max_position) for n in source_lengths]  # EOS included
  lengths = [len(through_eos(row)) for row in tokens[:, 0]]
  assert all(n <= limit for n, limit in zip(lengths, limits)), (lengths, limits)
  assert lengths[0] == limits[0] == max_position, lengths


@pytest.mark.parametrize('beam_size', [0, 3])
def test_a_segment_stops_once_no_more_sentences_search_than_the_rung_below_holds(beam_size):
  # Catches a segment loop (search.run_segment) that goes on to its cache's end after every sentence has ended,
  # or with as many searching sentences as the row rung below holds (`stop`): the outputs stay, the time does
  # not. With max_len_a=0 and max_len_b=b every sentence ends by step b + 1 (EOS forced there), and with
  # min_len=1 none before step 2.
  model, params = tiny_model()
  for b, stop in ((0, 0), (2, 0), (2, len(SRC))):
    options = dict(beam_size=beam_size, alpha=0.6, extra_length=b, max_len_a=0.0, min_len=1)
    inputs, state = search_lib.start_search(model, params, SRC, cache_length=16, length=16, **options)
    state, live = search_lib.run_segment(model, params, inputs, state, stop, first=True, **options)
    live = int(np.asarray(live).sum())
    if stop:  # every sentence still searches after the first step: no step more
      assert (int(state.index), live) == (1, len(SRC)), (b, stop, state.index, live)
    else:
      assert int(state.index) <= b + 1 and live == 0, (b, stop, state.index, live)
