r"""BLEU of detokenized translations, two ways.

1. sacreBLEU (cased, 13a tokenization) against the raw references: the WMT standard, reported with its
   signature.
2. Paper-comparable Multi30k BLEU: most multimodal-MT papers score lowercased, Moses-tokenized text against
   the official `*.lc.norm.tok.*` references (the download command fetches them with Multi30k). The hypotheses
   go through the same pipeline as those references: Moses punctuation normalization (normalize-punctuation.perl
   -l LANG), Moses tokenization with XML escaping (tokenizer.perl -l LANG, as `&quot;` in the references shows),
   lowercasing; then sacreBLEU with tokenize='none' and lowercase (case:lc) against the tokenized references.

  python -m flaxformer_nmt.evaluate --hyp hyp.de --ref test2016.de \
      [--tok_ref ~/.cache/flaxformer_nmt/multi30k_tok/test2016.de]

A model trained on lowercased text (config.lowercase) writes lowercase translations: with --lowercase, 1. is
case-insensitive (sacreBLEU's own option; its signature says case:lc); 2. lowercases anyway.
"""
import functools

import sacrebleu

from flaxformer_nmt.data import corpus


@functools.lru_cache(maxsize=None)
def _moses(lang):
  # Imported here: sacremoses compiles its regular expressions on import (0.6 s of the decode command's 3 s
  # start on a 2-core CPU), and only tokenized BLEU needs it.
  from sacremoses import MosesPunctNormalizer, MosesTokenizer  # pylint: disable=g-import-not-at-top
  return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def moses_lowercase_tokenize(lines, lang):
  """Lowercased, punctuation-normalized, Moses-tokenized text (the Multi30k `lc.norm.tok` recipe). Each line is
  normalized with its newline, as normalize-punctuation.perl reads it: its rule that moves a period behind a
  closing quote ('tea."' -> 'tea".', not for English) needs a character after the quote."""
  normalizer, tokenizer = _moses(lang)
  return [tokenizer.tokenize(normalizer.normalize(line.lower() + '\n'), escape=True, return_str=True)
          for line in lines]


def sacrebleu_score(hypotheses, references, lowercase=False):
  """(score, signature) of sacreBLEU with 13a tokenization: cased, or case-insensitive with `lowercase` (for
  models of config.lowercase; the signature then says case:lc)."""
  bleu = sacrebleu.BLEU(lowercase=lowercase)
  result = bleu.corpus_score(list(hypotheses), [list(references)])
  return result.score, str(bleu.get_signature())


def moses_languages():
  """The languages the Moses recipe has rules for: sacremoses' nonbreaking prefixes, and the CJK scripts its
  tokenizer splits. For any other code sacremoses tokenizes as English, without a word."""
  from sacremoses.corpus import NonbreakingPrefixes  # pylint: disable=g-import-not-at-top  (as in _moses)
  return sorted(set(NonbreakingPrefixes().available_langs.values()) | {'ja', 'ko'})


def tokenized_bleu(hypotheses, tokenized_references, lang):
  """(score, description) of lowercased Moses-tokenized BLEU against already-tokenized references (lowercased
  too: the official lc.norm.tok files already are)."""
  bleu = sacrebleu.BLEU(tokenize='none', lowercase=True, force=True)
  result = bleu.corpus_score(moses_lowercase_tokenize(hypotheses, lang), [list(tokenized_references)])
  return result.score, f'lowercased moses-tokenized ({lang}) | {bleu.get_signature()}'


def chrf_score(hypotheses, references, lowercase=False):
  chrf = sacrebleu.CHRF(lowercase=lowercase)
  return chrf.corpus_score(list(hypotheses), [list(references)]).score, str(chrf.get_signature())


def read_text(path):
  """A reference or hypothesis file's lines as they are (data.corpus.read_text_lines: split as the decode command
  reads its input, so that line i of a reference is line i of the translations)."""
  return corpus.read_text_lines(path)


def read_named(name, path):
  """read_text, its error led by what named the file: `--ref PATH: reason`, `--split test: PATH: line 2 ...`."""
  try:
    return read_text(path)
  except ValueError as e:  # the file and its reason, or its line
    raise ValueError(f'{name} {e}') from None


def report(hypotheses, references, tokenized_references=None, lang='de', lowercase=False):
  """Score lines (text) for console output, plus a dict of the numbers; `lowercase`: sacreBLEU and chrF
  case-insensitive (a model of config.lowercase writes lowercase text)."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} hypotheses but {len(references)} references')
  if not references:
    raise ValueError('no lines to score: the hypotheses and references are empty')
  score, signature = sacrebleu_score(hypotheses, references, lowercase)
  chrf, chrf_signature = chrf_score(hypotheses, references, lowercase)
  lines = [f'BLEU = {score:.2f}  ({signature})', f'chrF = {chrf:.2f}  ({chrf_signature})']
  numbers = {'bleu': score, 'chrf': chrf}
  if tokenized_references is not None:
    if len(tokenized_references) != len(hypotheses):
      raise ValueError(f'{len(hypotheses)} hypotheses but {len(tokenized_references)} tokenized references')
    tok_score, description = tokenized_bleu(hypotheses, tokenized_references, lang)
    lines.append(f'BLEU = {tok_score:.2f}  ({description})')
    numbers['tokenized_bleu'] = tok_score
  return lines, numbers
