"""The Translator: a trained workdir (or an ensemble of several) loaded once (checkpointing/loader.py),
translating lists of sentences with the batched search of batch_search.py.

  translator = Translator('runs/m30k')
  translator.translate(['A man is running.'], beam_size=4)
  translator.translate(['A man is running.'], sampling=True, top_k=10, seed=1)
  translator.warm_up_ladder()  # compiles every program a later call may run

Sentences are sorted by length into batches of the ladder's shapes (ladder.py): a fixed set of compiled
programs, whatever the sentences. On a CPU a batch decodes in segments and goes on with its unfinished
sentences only, in fewer rows, as CTranslate2 and fairseq drop finished sentences; on GPU and TPU each batch
searches in one program on the device.
"""
import math

import jax
from absl import logging

from flaxformer_nmt.checkpointing import loader
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import EOS_ID
from flaxformer_nmt.decoding import batch_search
from flaxformer_nmt.decoding import mbr as mbr_lib
from flaxformer_nmt.decoding.ladder import Ladder
from flaxformer_nmt.decoding import search as search_lib
from flaxformer_nmt.decoding.search import MIN_LEN
from flaxformer_nmt.models.transformer import cpu_has_bfloat16_dot
from flaxformer_nmt.models.transformer import with_vocabulary_kernel
from flaxformer_nmt.runtime import sharding

# Kept importable from here for readers that load parameters or ensembles without a Translator.
DTYPES = loader.DTYPES
default_checkpoint, load_params = loader.default_checkpoint, loader.load_params
ensemble_members = loader.ensemble_members


class Translator:
  """A trained model (or an ensemble of several), loaded once, translating lists of sentences.

  workdir: a training workdir, or several ('A,B' or a list) with the same vocabulary; checkpoint: latest,
  averaged, a step, or several ('1700,1800'): more than one member makes an ensemble that averages the
  members' probabilities at every step (see loader.ensemble_members); None: the config's decode_checkpoint.
  dtype: the compute dtype of decoding ('auto': bfloat16 on GPU/TPU, float32 on CPU; 'float32' also
  multiplies in float32 where the config rounds matmul operands to bfloat16; None: the config's); parameters
  stay as stored, log probabilities float32.
  devices: data-parallel decoding, each batch's sentences split over these devices (its rows a multiple of
  their count) and the parameters replicated on each (sharding.local_devices finds them; on a CPU host, call
  it before the first computation); None: the default device alone. on_device: whether each batch searches
  in one program on the device (batch_search.py; None: on GPU and TPU, not on a CPU).
  batch_invariant: each sentence's translation and score the same whatever else a call or batch holds (a
  server's batches; batch_search.BATCH_INVARIANT_OPTIONS): on one CPU device with bf16 dot instructions and
  bfloat16 matmul operands (model.matmul_precision 'bfloat16', or 'auto' there); about 20% fewer sentences/s
  in beam search; layers of 48 units or more (XLA's kernels for narrower matmul outputs round with the row
  count). Attention pictures (the server's return_attention) are not covered.
  The decoding settings (beam size, length penalty, batch budget, max length) come from the first member.
  """

  def __init__(self, workdir, checkpoint=None, dtype=None, devices=None, on_device=None, batch_invariant=False):
    loaded = loader.load_for_inference(workdir, checkpoint, task='translation', dtype=dtype, ensemble=True)
    self.workdir, self.config, self.tokenizer = loaded.workdir, loaded.config, loaded.tokenizer
    self.checkpoint = loaded.description
    # A model that learnt lowercased text (config.lowercase) reads its inputs lowercased too.
    self.lowercase = tokenizer_lib.lowercase_of(self.config)
    self.models = tuple(m.model for m in loaded.members)
    self.member_params = tuple(m.params for m in loaded.members)
    self.mesh = sharding.make_mesh(devices=list(devices)) if devices is not None and len(devices) > 1 else None
    if self.mesh is not None:
      self.member_params = jax.device_put(self.member_params, sharding.replicated(self.mesh))
    # The first member, for single-model users (attention pictures teacher-force one model).
    self.model, self.params = self.models[0], self.member_params[0]
    self._search_params = tuple(with_vocabulary_kernel(m.config, p) for m, p in zip(self.models, self.member_params))
    self.on_device, self.batch_invariant = on_device, batch_invariant
    if batch_invariant:
      self._check_batch_invariance()

  def _check_batch_invariance(self):
    """Raises ValueError where a batch-invariant search cannot be had (see the class docstring)."""
    if self.mesh is not None or jax.default_backend() != 'cpu' or self.on_device:
      raise ValueError('batch_invariant decoding runs on one CPU device: the search on a GPU or TPU, or split '
                       'over several devices, depends on the batch\'s shape')
    if not (cpu_has_bfloat16_dot() and all(m.config.matmul_precision == 'bfloat16' for m in self.models)):
      raise ValueError('batch_invariant decoding needs bfloat16 matmul operands on a CPU with bf16 dot '
                       'instructions (matmul_precision auto or bfloat16, not --dtype float32): XLA:CPU\'s float32 '
                       'matmuls of up to about 50 rows round differently from larger ones')

  @property
  def search_model(self):
    """What the jitted search takes as `model`: one model, or the tuple of an ensemble's."""
    return self.models if len(self.models) > 1 else self.model

  @property
  def search_params(self):
    """What the jitted search takes as `params`: one tree, or a tuple of them for an ensemble; each member's
    parameters with its vocabulary projection's kernel (transformer.with_vocabulary_kernel)."""
    return self._search_params if len(self.models) > 1 else self._search_params[0]

  def ladder(self, tokens_per_batch=None):
    """The shapes this model's search runs in (ladder.py) for a token budget (None: the config's, on a CPU at
    most batch_search.CPU_TOKENS_PER_BATCH)."""
    budget = tokens_per_batch or batch_search.tokens_per_batch_for(self.config.decode_tokens_per_batch,
                                                                   self.on_device)
    return Ladder(budget, min(m.config.max_position for m in self.models), 1 if self.mesh is None else self.mesh.size)

  def batches(self, token_lists, tokens_per_batch=None, sort_by_length=True):
    """The ladder's (indices, padded sources) batches of token lists."""
    return self.ladder(tokens_per_batch).batches(token_lists, sort_by_length)

  def _place(self, tree):
    """A batch's arrays on the devices that search it (data-parallel decoding), or as they are."""
    return tree if self.mesh is None else sharding.spread_rows(tree, self.mesh)

  def _prepare(self, beam_size=None, alpha=None, n_best=1, sampling=False, temperature=1.0, top_k=0,
               cache_cross_kv=True, grow_cache=True, sort_by_length=True, max_len_a=None, max_len_b=None,
               min_len=MIN_LEN, scores=True, tokens_per_batch=None):
    """(the ladder, the options of batch_search.search_batches), checked."""
    max_len_a = 1.0 if max_len_a is None else float(max_len_a)
    max_len_b = self.config.max_decode_extra_length if max_len_b is None else max_len_b
    if max_len_a < 0 or max_len_b < 0 or int(max_len_b) != max_len_b or max_len_a + max_len_b < 1:
      raise ValueError(f'max_len_a={max_len_a} and max_len_b={max_len_b} must leave room for a token: '
                       'max_len_a >= 0, max_len_b a whole number >= 0, max_len_a + max_len_b >= 1 (the limit '
                       'of a one-piece source)')
    if min_len < 0 or int(min_len) != min_len:
      raise ValueError(f'min_len={min_len} must be a whole number >= 0')
    beam_size = self.config.beam_size if beam_size is None else beam_size
    if beam_size < 0:
      raise ValueError(f'beam_size={beam_size} must be >= 0 (0: greedy)')
    alpha = self.config.length_penalty_alpha if alpha is None else alpha
    if not math.isfinite(alpha):  # nan ranks every hypothesis alike: empty outputs
      raise ValueError(f'alpha={alpha} must be a finite number')
    if n_best < 1 or (not sampling and n_best > max(beam_size, 1)):
      raise ValueError(f'n_best={n_best} must be between 1 and the beam size ({beam_size})' if beam_size else
                       f'n_best={n_best}: greedy search gives one candidate (a beam search or sampling gives more)')
    if tokens_per_batch is not None and (int(tokens_per_batch) != tokens_per_batch or tokens_per_batch < 1):
      raise ValueError(f'tokens_per_batch={tokens_per_batch} must be a whole number >= 1 (None: the config\'s)')
    if sampling and (not temperature > 0 or top_k < 0):  # NaN too
      raise ValueError(f'sampling needs temperature > 0 and top_k >= 0, not {temperature} and {top_k}')
    options = dict(beam_size=beam_size, alpha=float(alpha), extra_length=int(max_len_b), max_len_a=max_len_a,
                   cache_cross_kv=cache_cross_kv, grow_cache=grow_cache, min_len=int(min_len),
                   sort_by_length=sort_by_length, scores=bool(scores) or beam_size > 0,
                   batch_invariant=self.batch_invariant)
    if sampling:
      options.update(beam_size=0, alpha=0.0, temperature=float(temperature), top_k=int(top_k), num_samples=n_best,
                     scores=True)
    return self.ladder(tokens_per_batch), options

  def check_options(self, seed=0, **options):
    """Raises ValueError for option values that search_tokens would refuse."""
    search_lib.check_seed(seed)
    self._prepare(**options)

  def search_tokens(self, token_lists, n_best=1, sampling=False, seed=0, first_line=0, **options):
    """For each source (token ids ending with EOS), its n_best [(target ids ending with EOS, score)], in
    order; an empty source gives [([], 0.0)] * n_best.

    options: beam_size (0: greedy), alpha, tokens_per_batch, temperature, top_k, max_len_a and max_len_b (at
    most floor(max_len_a * source length + max_len_b) tokens before EOS; default 1 and the config's
    max_decode_extra_length, 50: the paper's source length + 50), min_len (at least that many tokens before
    EOS; default 1: no empty output for a non-empty source), scores=False (greedy search may then skip its
    normalizer: its scores are not log probabilities). sampling draws n_best samples per sentence (beam_size
    is then unused); sample j of sentence i depends only on (seed, first_line + i, j), so a stream read in
    chunks samples as the whole list would. cache_cross_kv=False, grow_cache=False and sort_by_length=False
    switch off three speed-ups, for measuring them.
    """
    search_lib.check_seed(seed)
    token_lists = self.fit_to_positions(token_lists, first_line)
    ladder, options = self._prepare(n_best=n_best, sampling=sampling, **options)
    lines = [first_line + i for i in range(len(token_lists))]
    found = batch_search.search_batches(self.search_model, self.search_params, token_lists, ladder, options,
                                        lines=lines, seed=seed, on_device=self.on_device, place=self._place,
                                        in_flight=None if self.mesh is None else 1)
    empty = [([], 0.0)] * n_best
    return [empty if f is None else [(reading_order(self.config, f[0][k]), float(f[1][k])) for k in range(n_best)]
            for f in found]

  def fit_to_positions(self, token_lists, first_line=0):
    """Sources cut to what every member's position table holds (module fit_to_positions), as the search
    cuts them."""
    return fit_to_positions(token_lists, self.ladder().max_position, self.config.max_decode_extra_length,
                            first_line)

  def warm_up(self, token_lists, n_best=1, sampling=False, **options):
    """Runs search_tokens(token_lists, ...) once, which compiles every shape that the same call will run:
    timings after it exclude compilation."""
    self.search_tokens(token_lists, n_best=n_best, sampling=sampling, **options)

  def warm_up_ladder(self, max_source_length=None, n_best=1, sampling=False, seed=0, **options):
    """Compiles (or loads from the compilation cache) every program that searching sources of up to
    `max_source_length` tokens (None: as long as the model takes) with search_tokens' options may run, ahead
    of the first sentence (batch_search.warm_up). Returns how many programs that was."""
    del seed  # an input of the programs
    ladder, options = self._prepare(n_best=n_best, sampling=sampling, **options)
    return batch_search.warm_up(self.search_model, self.search_params, ladder, options,
                                max_source_length=max_source_length, on_device=self.on_device, place=self._place)

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
                                 tokens_per_batch=tokens_per_batch, scores=return_scores, **options)
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
