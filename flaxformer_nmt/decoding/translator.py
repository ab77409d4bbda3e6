"""The Translator: a trained workdir (or an ensemble of several) loaded once, translating lists of sentences
with the batched search of search.py.

  translator = Translator('runs/m30k')
  translator.translate(['A man is running.'], beam_size=4)
  translator.translate(['A man is running.'], sampling=True, top_k=10, seed=1)

Sentences are sorted by length into token-budget batches (few shapes to compile, little padding). A batch
decodes in segments of a few steps; once few of its sentences still search, it goes on with those only (as
CTranslate2 and fairseq drop finished sentences), so that one long output does not keep every row computing.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath

from flaxformer_nmt.checkpointing import best as best_checkpoint
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import EOS_ID, PAD_ID
from flaxformer_nmt.decoding import beam_search
from flaxformer_nmt.decoding import mbr as mbr_lib
from flaxformer_nmt.decoding.search import MIN_LEN, batch_rows, continue_search, sample_keys, search_lengths, search_output, segment_ends, source_batches, start_search, take_sentences
from flaxformer_nmt.runtime import sharding


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
