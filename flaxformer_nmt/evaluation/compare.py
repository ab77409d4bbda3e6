"""Scoring one or more checkpoints on a split: the sentences, their BLEU (sacreBLEU and lowercased tokenized),
and the rows of the table the compare command prints."""
import math
import time

import sacrebleu
from etils import epath

from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding import rerank
from flaxformer_nmt.evaluation import bleu as evaluate


def sentences(config, split=None, input_path=None, ref_path=None, tok_ref_path=None):
  """(description, sources, references, tokenized references or None)."""
  if input_path:
    if not ref_path:
      raise ValueError('--input needs --ref')
    description = input_path
  else:
    split = split or config.eval_split
    input_path, ref_path = data_lib.split_paths(config.data_dir, split, config.source_lang, config.target_lang)
    description = f'{split} ({config.data_dir})'
    if tok_ref_path is None and config.get('eval_bleu_tok_ref_dir'):
      candidate = epath.Path(config.eval_bleu_tok_ref_dir) / f'{split}.{config.target_lang}'
      tok_ref_path = candidate if candidate.exists() else None
  # Each file's error names what gave it: the flag, or the split.
  given = ('--input', '--ref') if description == input_path else (f'--split {split}:',) * 2
  sources, references = evaluate.read_named(given[0], input_path), evaluate.read_named(given[1], ref_path)
  tok_references = evaluate.read_named('--tok_ref', tok_ref_path) if tok_ref_path else None
  if len(sources) != len(references) or (tok_references is not None and len(tok_references) != len(sources)):
    counts = [len(sources), len(references)] + ([len(tok_references)] if tok_references is not None else [])
    raise ValueError(f'{input_path}, {ref_path}{", " + str(tok_ref_path) if tok_ref_path else ""}: different '
                     f'numbers of lines ({", ".join(map(str, counts))})')
  if not sources:
    raise ValueError(f'{input_path}: no lines to translate and score')
  return description, sources, references, tok_references


def scores(translator, sources, references, tok_references, beam_size, alpha, mbr_utility=None, n_best=1):
  """(hypotheses, sacrebleu BLEU, lowercased tokenized BLEU or None, decoding seconds, signature) of the
  translator on the sentences."""
  start = time.time()
  hypotheses = translator.translate(sources, beam_size=beam_size, alpha=alpha, mbr=mbr_utility, n_best=n_best)
  seconds = time.time() - start
  metric = sacrebleu.BLEU(lowercase=translator.lowercase)  # case-insensitive for a model of config.lowercase
  bleu = metric.corpus_score(hypotheses, [references])
  tok = (evaluate.tokenized_bleu(hypotheses, tok_references, translator.config.target_lang)[0]
         if tok_references is not None else None)
  return hypotheses, bleu, tok, seconds, str(metric.get_signature())


def score_row(name, translator, sources, references, tok_references, beam_size, alpha, mbr_utility=None,
              n_best=1):
  """One table row: the checkpoint's scores on the sentences (alpha None: the config's)."""
  alpha = translator.config.length_penalty_alpha if alpha is None else alpha
  _, bleu, tok, seconds, signature = scores(translator, sources, references, tok_references, beam_size, alpha,
                                            mbr_utility, n_best)
  return table_row(name, translator.checkpoint, alpha, bleu, tok, seconds), signature


def table_row(name, parameters, alpha, bleu, tok, seconds):
  tok = f'{tok:.2f}' if tok is not None else '-'
  return (f'| {name} | {parameters} | {alpha:g} | {bleu.score:.2f} | {tok} | '
          f'{bleu.ratio:.3f} | {bleu.bp:.3f} | {seconds:.0f} |')  # ratio: 0 where the references are empty


def rerank_rows(name, translator, rescorer, sentences_, beam_size, alpha, weights):
  """Table rows of the beam's n best rescored by `rescorer`, one per weight (one search, one rescoring)."""
  sources, references, tok_references = sentences_
  start = time.time()
  reranker, translations = rerank.rerank_sources(translator, rescorer, sources, beam_size=beam_size, alpha=alpha)
  seconds = time.time() - start
  rows = []
  metric = sacrebleu.BLEU(lowercase=translator.lowercase)
  for weight in weights:
    hypotheses = translations(weight)
    bleu = metric.corpus_score(hypotheses, [references])
    tok = (evaluate.tokenized_bleu(hypotheses, tok_references, translator.config.target_lang)[0]
           if tok_references is not None else None)
    rows.append(table_row(f'{name}, reranked by {rescorer.checkpoint} of {rescorer.workdir}, w={weight:g}',
                          translator.checkpoint, reranker.alpha, bleu, tok, seconds))
  return rows, str(metric.get_signature())


def alpha_values(values, default, flag='--alpha', what='length penalty exponents'):
  """A list flag's floats (--alpha's by default; several: a row each), or [default]."""
  if not values:
    return [default]
  try:
    numbers = [float(v) for v in values]
  except ValueError:
    numbers = []
  if len(numbers) < len(values) or not all(math.isfinite(n) for n in numbers):
    raise ValueError(f'{flag}={",".join(values)}: {what} are finite numbers, e.g. 0.3,0.5')
  return numbers
