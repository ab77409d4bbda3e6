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


def test_average_probabilities_is_log_of_mean_probability():
  log_probs = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (3, 4, 16)) * 4)
  expected = np.log(np.exp(np.asarray(log_probs, np.float64)).mean(axis=0))
  np.testing.assert_allclose(beam_search.average_probabilities(log_probs), expected, atol=1e-5)


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
