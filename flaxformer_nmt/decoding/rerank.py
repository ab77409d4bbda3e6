"""Rescoring a search's n best with a second model, and choosing by the combined score (n-best reranking).

The usual partner is a model that writes its targets right to left (config.target_right_to_left): it reads
each candidate from the end, so that its errors differ from those of the left-to-right model that searched,
which commits to a sentence's start before it sees how it ends (Sennrich et al. 2016, "Edinburgh Neural Machine
Translation Systems for WMT 16"; Liu et al. 2016, "Agreement on Target-bidirectional NMT"). Any translation
model of the same vocabulary and direction can rescore, an ensemble of several too.

For a source x and candidate y of n tokens (EOS included), with the search's score s(y) = log P(y|x) / lp(n)
(beam search's GNMT penalty lp(n) = ((5 + n) / 6)^alpha) and the rescorer's log probability log Q(y|x),
teacher-forced:
  combined(y) = (1 - w) * s(y) + w * log Q(y|x) / lp(n)
w = 0 keeps the search's choice; w = 1 lets the rescorer alone choose among the candidates.

The translator and rescorer are translator.Translator objects (this module stands below decode.py, as mbr.py).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_nmt.data import batching
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.tokenizer import PAD_ID
from flaxformer_nmt.decoding import beam_search

NO_CANDIDATE = -1e30  # the score of an empty slot (an empty source): finite, so that 0 times it is 0


@functools.partial(jax.jit, static_argnums=0)
def target_log_probs(models, params, src, tgt_in, tgt_out):
  """[B] log probability of each row's target (tgt_out, PAD after it) given its source, teacher-forced. Several
  models (an ensemble) give each token the log of their mean probability, as the ensemble's search does."""
  token_log_probs = []
  for model, member_params in zip(models, params):
    logits = model.apply({'params': member_params}, src, tgt_in, deterministic=True)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    token_log_probs.append(jnp.take_along_axis(log_probs, tgt_out[..., None], axis=-1)[..., 0])
  token_log_probs = beam_search.average_probabilities(jnp.stack(token_log_probs))
  return jnp.sum(jnp.where(tgt_out != PAD_ID, token_log_probs, 0.0), axis=-1)


def score_pairs(translator, source_lists, target_lists):
  """[N] float64: log P(target | source) under the translator's model(s), teacher-forced. Sources are token
  ids ending with EOS (translator.tokenizer.encode); targets are in reading order, ending with EOS, and are
  turned around for a right-to-left model. Pairs are batched by length, in few shapes, at most
  config.decode_tokens_per_batch tokens a batch."""
  if translator.mesh is not None:
    raise ValueError('teacher-forced scoring runs on one device: build its Translator without devices')
  if len(source_lists) != len(target_lists):
    raise ValueError(f'{len(source_lists)} sources but {len(target_lists)} targets')
  right_to_left = data_lib.right_to_left(translator.config)
  targets = [data_lib.reverse_before_eos(t) if right_to_left else list(t) for t in target_lists]
  lengths = [max(len(s), len(t)) for s, t in zip(source_lists, targets)]
  positions = min(m.config.max_position for m in translator.models)
  if lengths and max(lengths) > positions:  # past the table every position would read its last row
    raise ValueError(f'a source or target of {max(lengths)} tokens is longer than the scoring model\'s '
                     f'{positions} positions')
  order = sorted(range(len(lengths)), key=lengths.__getitem__)
  scores = np.zeros(len(lengths), np.float64)
  for length, rows, members in batching.plan_batches(lengths, translator.config.length_buckets,
                                                     translator.config.decode_tokens_per_batch, 1, order):
    rows = min(rows, 1 << (len(members) - 1).bit_length())  # a short batch in a power of two of rows
    batch = batching.make_batch([source_lists[i] for i in members], [targets[i] for i in members], rows, length)
    log_probs = target_log_probs(translator.models, translator.member_params, batch['src'], batch['tgt_in'],
                                 batch['tgt_out'])
    scores[members] = np.asarray(log_probs)[:len(members)]
  return scores


def combined_scores(search_scores, rescores, lengths, weight, alpha):
  """(1 - weight) * search_scores + weight * rescores / lp(lengths) (see the module docstring); arrays of one
  shape."""
  penalty = beam_search.length_penalty(np.asarray(lengths, np.float64), alpha)
  return (1.0 - weight) * np.asarray(search_scores, np.float64) + weight * np.asarray(rescores) / penalty


def check_weight(weight):
  if not 0.0 <= weight <= 1.0:
    raise ValueError(f'rerank weight {weight} must be between 0 (the search alone) and 1 (the rescorer alone)')


def check_partners(translator, rescorer):
  """ValueError unless the rescorer reads the translator's pieces and translates its direction."""
  if rescorer.tokenizer.sha256 != translator.tokenizer.sha256:
    raise ValueError(f'the rescorer {rescorer.workdir} has another vocabulary than {translator.workdir}: it '
                     'scores the candidates\' own pieces')
  if rescorer.lowercase != translator.lowercase:
    raise ValueError(f'the rescorer {rescorer.workdir} and {translator.workdir} read their sources differently '
                     '(config.lowercase)')
  direction = lambda t: f'{t.config.source_lang}->{t.config.target_lang}'
  if direction(rescorer) != direction(translator):
    raise ValueError(f'the rescorer {rescorer.workdir} translates {direction(rescorer)}, the search '
                     f'{direction(translator)}')


class Reranker:
  """The n best of each source (token ids and search scores, as Translator.search_tokens gives them), rescored
  once by `rescorer`; `choose(weight)` then gives each source's chosen candidate for any weight."""

  def __init__(self, rescorer, token_lists, candidates, alpha):
    self.candidates, self.alpha = candidates, alpha
    n_best = max(len(hyps) for hyps in candidates) if candidates else 1
    flat = [(i, k, ids, score) for i, hyps in enumerate(candidates) for k, (ids, score) in enumerate(hyps) if ids]
    rescores = score_pairs(rescorer, [token_lists[i] for i, _, _, _ in flat], [ids for _, _, ids, _ in flat])
    # [sources, n_best]; an empty candidate (an empty source's) keeps NO_CANDIDATE, and its source gives [].
    shape = (len(candidates), n_best)
    self.search_scores, self.rescores, self.lengths = np.full(shape, NO_CANDIDATE), np.full(shape, NO_CANDIDATE), \
        np.ones(shape)
    for (i, k, ids, score), rescore in zip(flat, rescores):
      self.search_scores[i, k], self.rescores[i, k], self.lengths[i, k] = score, rescore, len(ids)

  def choose(self, weight):
    """Each source's chosen candidate index at this weight (ties go to the earlier: the search's better one)."""
    check_weight(weight)
    return np.argmax(combined_scores(self.search_scores, self.rescores, self.lengths, weight, self.alpha), axis=1)


def rerank_sources(translator, rescorer, sources, beam_size=None, alpha=None, **options):
  """(Reranker, a function of the weight giving each source's chosen translation as text) of the translator's
  beam over `sources` (raw lines), its whole n best (n = the beam size) rescored by `rescorer`."""
  check_partners(translator, rescorer)
  alpha = translator.config.length_penalty_alpha if alpha is None else alpha
  beam_size = translator.config.beam_size if beam_size is None else beam_size
  if beam_size < 1:
    raise ValueError('reranking needs a beam search\'s n best (beam_size >= 1)')
  # Cut to the model's positions here (the search would), so that the rescorer reads what the search read.
  token_lists = translator.fit_to_positions(translator.tokenizer.encode(translator.prepare(sources)))
  candidates = translator.search_tokens(token_lists, beam_size=beam_size, alpha=alpha, n_best=beam_size, **options)
  reranker = Reranker(rescorer, token_lists, candidates, alpha)
  def translations(weight):
    return [translator.tokenizer.decode(hyps[k][0]) for hyps, k in zip(candidates, reranker.choose(weight))]
  return reranker, translations
