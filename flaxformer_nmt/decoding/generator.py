"""Text generation with a decoder-only language model (config.task='lm'): greedy, or sampling with temperature,
top-k and top-p, over a KV cache; the generate command's library."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_nmt.data import batching
from flaxformer_nmt.checkpointing import loader
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from flaxformer_nmt.decoding import beam_search
from flaxformer_nmt.decoding import search as search_lib
from flaxformer_nmt.models import lm

NEG_INF = beam_search.NEG_INF
WORD_START = '\u2581'  # sentencepiece's mark of a piece that starts a word


def top_k_filter(log_probs, top_k):
  """Keeps the `top_k` largest entries of each row (ties with the k-th included); 0 keeps everything."""
  if top_k <= 0 or top_k >= log_probs.shape[-1]:
    return log_probs
  kth = jax.lax.top_k(log_probs, top_k)[0][..., -1:]
  return jnp.where(log_probs >= kth, log_probs, NEG_INF)


def top_p_filter(log_probs, top_p):
  """Nucleus sampling's cut: per row of log probabilities, keeps exactly the smallest set of most likely
  tokens whose probabilities sum to at least `top_p` (a token is kept when the tokens more likely than it
  sum to less than top_p), the rest get NEG_INF. top_p >= 1 keeps everything."""
  if top_p >= 1.0:
    return log_probs
  order = jnp.argsort(-log_probs, axis=-1)
  probs = jnp.exp(jnp.take_along_axis(log_probs, order, axis=-1))
  keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p
  keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
  return jnp.where(keep, log_probs, NEG_INF)


def _step_functions(model, params, rows, max_length, use_cache):
  """(step_fn, initial cache) for beam_search's loop: the KV cache, or the whole prefix rerun per step; both
  hold positions 0..max_length-1 (the last step feeds position max_length - 1 and is given EOS)."""
  variables = {'params': params}
  if use_cache:
    cache = model.apply(variables, rows, max_length, method=lm.DecoderOnlyLM.init_cache)

    def cached_step(tokens, index, cache):
      return model.apply(variables, tokens, index, cache, method=lm.DecoderOnlyLM.decode_step)
    return cached_step, cache

  def full_step(tokens, index, prefix):
    # The "cache" is the token sequence so far; later positions hold PAD, which no query attends to.
    prefix = prefix.at[:, index].set(tokens)
    logits = model.apply(variables, prefix, True)
    return jax.lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False), prefix
  return full_step, jnp.zeros((rows, max_length), jnp.int32)


def generate_tokens(model, params, prompts, prompt_lengths, keys, *, max_new_tokens, greedy, temperature, top_k,
                    top_p, use_cache=True):
  """Generated sequences [N, W - 1 + max_new_tokens + 1] (prompt tokens, then the continuation, EOS, PAD).

  prompts: [N, W] BOS + prompt tokens, PAD after; prompt_lengths: [N] BOS + prompt tokens; keys: [N] PRNG
  keys (token t of row r uses fold_in(keys[r], t)). The prompt's positions are forced, the rest chosen.
  """
  rows, width = prompts.shape
  max_length = width - 1 + max_new_tokens + 1  # static: room for the longest prompt, the new tokens and EOS
  step_fn, cache = _step_functions(model, params, rows, max_length, use_cache)

  def choose(log_probs, index):
    if greedy:
      picked = jnp.argmax(log_probs, axis=-1)
    else:
      filtered = top_p_filter(jax.nn.log_softmax(top_k_filter(beam_search.tempered(log_probs, temperature), top_k)),
                              top_p)
      picked = jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, index), row))(keys, filtered)
    prompt_token = jax.lax.dynamic_index_in_dim(prompts, jnp.minimum(index + 1, width - 1), axis=1, keepdims=False)
    return jnp.where(index + 1 < prompt_lengths, prompt_token, picked)

  # Row r may produce positions up to prompt_lengths[r] - 1 + max_new_tokens; EOS is forced after them.
  tokens, _ = beam_search.token_by_token(
      step_fn, cache, choose, batch_size=rows, max_length=max_length,
      max_lengths=prompt_lengths + max_new_tokens, bos_id=BOS_ID, eos_id=EOS_ID, forbidden_ids=(PAD_ID, BOS_ID))
  return tokens


def check_options(*, max_new_tokens, temperature, top_k, top_p, num_samples, seed):
  """Raises ValueError naming the first generation option outside its range (`name=value: give ...`)."""
  for name, value, allowed, rule in (('temperature', temperature, temperature > 0, 'above 0'),
                                     ('top_k', top_k, top_k >= 0, '0 (off) or more'),
                                     ('top_p', top_p, 0 < top_p <= 1, 'above 0 and at most 1'),
                                     ('max_new_tokens', max_new_tokens, max_new_tokens >= 1, '1 or more'),
                                     ('num_samples', num_samples, num_samples >= 1, '1 or more')):
    if not allowed:  # NaN too
      raise ValueError(f'{name}={value}: give {rule}')
  search_lib.check_seed(seed)


class Generator:
  """A trained language model, loaded once, continuing lists of prompts."""

  def __init__(self, workdir, checkpoint='latest'):
    loaded = loader.load_for_inference(workdir, checkpoint, task='lm')
    self.config, self.tokenizer, self.model = loaded.config, loaded.tokenizer, loaded.model
    self.params, self.checkpoint = loaded.params, loaded.description
    self._generate = jax.jit(functools.partial(generate_tokens, self.model),
                             static_argnames=('max_new_tokens', 'greedy', 'temperature', 'top_k', 'top_p',
                                              'use_cache'))

  def generate_ids(self, prompt_ids, *, max_new_tokens=50, greedy=False, temperature=1.0, top_k=0, top_p=1.0,
                   num_samples=1, seed=0, use_cache=True, first_prompt=0):
    """For each prompt (token ids, no EOS), `num_samples` lists of generated ids (EOS excluded)."""
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  num_samples=num_samples, seed=seed)
    if not prompt_ids:
      return []
    max_position = self.config.model.max_position
    long = self.too_long(prompt_ids, max_new_tokens)
    if long is not None:
      raise ValueError(f'prompts[{first_prompt + long}]: BOS + {len(prompt_ids[long])} prompt tokens + '
                       f'{max_new_tokens} new tokens exceed the model\'s {max_position} positions')
    # Prompt widths rounded up to a multiple of 16 (few shapes to compile), at most what leaves the new tokens
    # room: the search's width + max_new_tokens positions stay within the positional table.
    width = min(-(-(1 + max(len(p) for p in prompt_ids)) // 16) * 16, max_position - max_new_tokens)
    rows = [[BOS_ID] + list(p) for p in prompt_ids for _ in range(num_samples)]
    prompts = batching.pad_rows(rows, len(rows), width)
    lengths = np.array([len(r) for r in rows], np.int32)
    keys = search_lib.sample_keys(seed, jnp.arange(first_prompt, first_prompt + len(prompt_ids), dtype=jnp.int32),
                              num_samples).reshape(-1)
    tokens = jax.device_get(self._generate(
        self.params, prompts, lengths, keys, max_new_tokens=int(max_new_tokens), greedy=bool(greedy),
        temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), use_cache=bool(use_cache)))
    out = []
    for r, n in enumerate(lengths):
      new = [int(t) for t in tokens[r, n - 1:]]
      out.append(new[:new.index(EOS_ID)] if EOS_ID in new else new)
    return [out[i * num_samples:(i + 1) * num_samples] for i in range(len(prompt_ids))]

  def too_long(self, prompt_ids, max_new_tokens):
    """The index of the first prompt that with BOS and `max_new_tokens` exceeds the model's positions, or None."""
    room = self.config.model.max_position - 1 - max_new_tokens
    return next((i for i, p in enumerate(prompt_ids) if len(p) > room), None)

  def encode_prompt(self, texts):
    lowercase = tokenizer_lib.lowercase_of(self.config)  # a model of config.lowercase learnt lowercased text
    return [ids[:-1] for ids in self.tokenizer.encode([tokenizer_lib.prepare_text(t, lowercase) for t in texts])]

  def continued(self, prompt, ids):
    """The prompt text as given, followed by the decoded continuation `ids` (see join_continuation)."""
    starts_word = bool(ids) and self.tokenizer.sp.id_to_piece(int(ids[0])).startswith(WORD_START)
    return join_continuation(prompt, self.tokenizer.decode(ids), starts_word)

  def generate(self, prompts, **options):
    """For each prompt (str), a list of `num_samples` texts: the prompt continued. Options as generate_ids."""
    results = self.generate_ids(self.encode_prompt(prompts), **options)
    return [[self.continued(prompt, ids) for ids in samples] for prompt, samples in zip(prompts, results)]


def join_continuation(prompt, continuation, starts_word):
  """`prompt` followed by `continuation` (decoded on its own, without a leading space): the prompt's trailing
  whitespace is replaced by one space where the continuation's first piece starts a word, by nothing where it
  continues the prompt's last word; an empty continuation leaves the prompt as it is."""
  if not continuation:
    return prompt
  head = prompt.rstrip()
  return head + (' ' if head and starts_word else '') + continuation
