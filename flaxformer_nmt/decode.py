r"""Translates with a trained workdir; scores with sacreBLEU when references are given.

  python -m flaxformer_nmt.decode --workdir runs/m30k --input test2016.en --output hyp.de --reference test2016.de
  cat sentences.en | python -m flaxformer_nmt.decode --workdir runs/m30k > out.de

One output line per input line, in input order; an empty input line gives an empty output line. Input is
read in chunks of --buffer_lines, so a long stream is translated as it arrives. Within a chunk, sentences
are sorted by length into token-budget batches (few shapes to compile, little padding).

Python API:
  translator = Translator('runs/m30k')
  translator.translate(['A man is running.'], beam_size=4)
"""
import functools
import itertools
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from etils import epath

from flaxformer_nmt import beam_search
from flaxformer_nmt import checkpoints as checkpoints_lib
from flaxformer_nmt import data as data_lib
from flaxformer_nmt import evaluate
from flaxformer_nmt import tokenizer as tokenizer_lib
from flaxformer_nmt import train
from flaxformer_nmt.model import Transformer
from flaxformer_nmt.tokenizer import BOS_ID, EOS_ID, PAD_ID


def search(model, params, src, *, beam_size, alpha, extra_length):
  """Translations of a padded source batch [B, S]: (tokens [B, K, L], scores [B, K]); greedy if beam_size=0.

  The encoder runs once, the encoder-decoder keys/values are projected once per sentence, and each step
  runs only the new position through the decoder against its self-attention cache.
  """
  variables = {'params': params}
  batch, src_len = src.shape
  max_length = src_len + extra_length  # static: the cache's length
  # Limit per sentence: its source length (EOS excluded) + extra tokens, then EOS. Rows that only pad the
  # batch may produce nothing but EOS, so that they never keep the search loop running.
  src_tokens = (src != PAD_ID).sum(axis=1)
  max_lengths = jnp.where(src_tokens > 0, src_tokens - 1 + extra_length + 1, 1)
  encoded = model.apply(variables, src, method=Transformer.encode)
  cross_kv = model.apply(variables, encoded, method=Transformer.cross_attention_kv)
  rows = max(beam_size, 1)
  if rows > 1:  # every beam of a sentence shares its encoder keys/values
    cross_kv = jax.tree_util.tree_map(lambda x: jnp.repeat(x, rows, axis=0), cross_kv)
  src_rows = jnp.repeat(src, rows, axis=0)
  cache = model.apply(variables, batch * rows, max_length, method=Transformer.init_cache)

  def step_fn(tokens, index, cache):
    return model.apply(variables, tokens, index, cache, cross_kv, src_rows, method=Transformer.decode_step)

  common = dict(max_length=max_length, max_lengths=max_lengths, bos_id=BOS_ID, eos_id=EOS_ID,
                forbidden_ids=(PAD_ID, BOS_ID))
  if beam_size == 0:
    tokens, scores = beam_search.greedy_search(step_fn, cache, batch_size=batch, **common)
    return tokens[:, None], scores[:, None]
  return beam_search.beam_search(step_fn, cache, batch_size=batch, beam_size=beam_size, alpha=alpha, **common)


def load_params(workdir, checkpoint='latest'):
  """(parameters on the default device, description) of checkpoint `latest`, `averaged` or STEP.

  Only the parameters are read: decoding needs neither the optimizer state nor the data position.
  """
  if checkpoint == 'averaged':
    params, info = checkpoints_lib.load_averaged(workdir)
    return jax.device_put(params), f'the average of checkpoints {info["steps"]}'
  if checkpoint != 'latest' and not checkpoint.isdigit():
    raise ValueError(f'--checkpoint must be latest, averaged or a step number, not {checkpoint!r}')
  store = checkpoints_lib.Checkpoints(workdir, keep=0, async_save=False)
  steps = store.steps()
  store.close()
  step = (steps[-1] if steps else None) if checkpoint == 'latest' else int(checkpoint)
  if step not in steps:
    raise FileNotFoundError(f'no checkpoint {checkpoint} in {store.directory}; there are {steps}')
  return jax.device_put(store.restore_params(step)), f'checkpoint {step}'


class Translator:
  """A trained model, loaded once, translating lists of sentences."""

  def __init__(self, workdir, checkpoint='latest'):
    self.workdir = epath.Path(workdir)
    self.config = train.load_config(workdir)
    self.tokenizer = tokenizer_lib.Tokenizer(self.workdir / tokenizer_lib.VOCAB_FILENAME)
    self.model = train.build_model(self.config, self.tokenizer)
    self.params, self.checkpoint = load_params(workdir, checkpoint)
    self._search = jax.jit(functools.partial(search, self.model),
                           static_argnames=('beam_size', 'alpha', 'extra_length'))

  def batches(self, token_lists, tokens_per_batch):
    """(indices, padded source [rows, len]) batches, sentences sorted by length; each bucket has one shape.
    Empty sentences (EOS alone) are left out: they translate to empty lines."""
    lengths = [len(t) for t in token_lists]
    order = sorted((i for i, n in enumerate(lengths) if n > 1), key=lengths.__getitem__)
    for padded, rows, members in data_lib.plan_batches(lengths, self.config.length_buckets, tokens_per_batch, 1,
                                                       order):
      yield members, data_lib.pad_rows([token_lists[i] for i in members], rows, padded)

  def translate(self, sentences, beam_size=None, alpha=None, n_best=1, tokens_per_batch=None, return_scores=False):
    """Translations of `sentences` (list of str), in order. beam_size=0 decodes greedily.

    With n_best > 1 each item is a list of the n best translations. With return_scores, items are
    (translation, score) pairs: the length-normalized log probability (beam) or the log probability (greedy).
    """
    beam_size = self.config.beam_size if beam_size is None else beam_size
    alpha = self.config.length_penalty_alpha if alpha is None else alpha
    if n_best > max(beam_size, 1):
      raise ValueError(f'n_best={n_best} exceeds beam_size={beam_size}')
    tokens_per_batch = tokens_per_batch or self.config.decode_tokens_per_batch
    token_lists = self.tokenizer.encode([tokenizer_lib.normalize_whitespace(s) for s in sentences])
    results = [[('', 0.0)] * n_best for _ in sentences]
    for members, src in self.batches(token_lists, tokens_per_batch):
      tokens, scores = jax.device_get(self._search(self.params, src, beam_size=beam_size, alpha=float(alpha),
                                                   extra_length=self.config.max_decode_extra_length))
      for r, i in enumerate(members):
        results[i] = [(self.tokenizer.decode(tokens[r, k]), float(scores[r, k])) for k in range(n_best)]
    if not return_scores:
      results = [[text for text, _ in hyps] for hyps in results]
    return [hyps if n_best > 1 else hyps[0] for hyps in results]


def _read_chunks(path, size):
  stream = sys.stdin if path == '-' else open(path, encoding='utf-8')  # pylint: disable=consider-using-with
  try:
    while chunk := [line.rstrip('\n') for line in itertools.islice(stream, size)]:
      yield chunk
  finally:
    if stream is not sys.stdin:
      stream.close()


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config.json, vocab.model, checkpoints/).')
  flags.DEFINE_string('input', '-', 'Source sentences, one per line; - reads stdin.')
  flags.DEFINE_string('output', '-', 'Where translations go; - writes stdout.')
  flags.DEFINE_string('reference', None, 'Raw references: prints cased sacreBLEU (13a) and chrF.')
  flags.DEFINE_string('tok_reference', None,
                      'Lowercased Moses-tokenized references: prints the paper-comparable BLEU.')
  flags.DEFINE_string('checkpoint', 'latest', 'latest, averaged (see flaxformer_nmt.average) or a step.')
  flags.DEFINE_integer('beam_size', None, 'Beam width (default: the config\'s); 0 is greedy.')
  flags.DEFINE_bool('greedy', False, 'Greedy decoding (same as --beam_size=0).')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent (default: the config\'s).')
  flags.DEFINE_integer('tokens_per_batch', None, 'Source tokens per batch.')
  flags.DEFINE_integer('buffer_lines', 5000, 'Lines read and translated at a time.')
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  checkpoints_lib.quiet_orbax_logs()
  try:
    translator = Translator(FLAGS.workdir, FLAGS.checkpoint)
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')
  beam_size = 0 if FLAGS.greedy else FLAGS.beam_size
  logging.info('Translating with %s of %s (%s)', translator.checkpoint, FLAGS.workdir,
               'greedy' if beam_size == 0 else f'beam {beam_size or translator.config.beam_size}')
  out = sys.stdout if FLAGS.output == '-' else open(FLAGS.output, 'w', encoding='utf-8')  # pylint: disable=consider-using-with
  hypotheses, done, start = [], 0, time.time()
  try:
    for chunk in _read_chunks(FLAGS.input, FLAGS.buffer_lines):
      translations = translator.translate(chunk, beam_size=beam_size, alpha=FLAGS.alpha,
                                          tokens_per_batch=FLAGS.tokens_per_batch)
      out.write(''.join(t + '\n' for t in translations))
      out.flush()
      hypotheses += translations if FLAGS.reference else []
      done += len(chunk)
      logging.info('%d sentences, %.1f sentences/s', done, done / (time.time() - start))
  except (OSError, UnicodeDecodeError) as e:
    sys.exit(f'error: {FLAGS.input}: {e}')
  finally:
    if out is not sys.stdout:
      out.close()
  if FLAGS.reference:
    try:
      lines, _ = evaluate.report(hypotheses, evaluate.read_text(FLAGS.reference),
                                 evaluate.read_text(FLAGS.tok_reference) if FLAGS.tok_reference else None,
                                 translator.config.target_lang)
    except (OSError, ValueError) as e:
      sys.exit(f'error: {e}')
    print('\n'.join(lines), file=sys.stderr if out is sys.stdout else sys.stdout)


if __name__ == '__main__':
  define_flags()
  app.run(main)
