r"""BLEU of detokenized translations, two ways.

1. sacreBLEU (cased, 13a tokenization) against the raw references: the WMT standard, reported with its
   signature.
2. Paper-comparable Multi30k BLEU: most multimodal-MT papers score lowercased, Moses-tokenized text against
   the official `*.lc.norm.tok.*` references (../shared/data/multi30k_tok). The hypotheses go through the same
   pipeline as those references: Moses punctuation normalization (normalize-punctuation.perl -l LANG), Moses
   tokenization with XML escaping (tokenizer.perl -l LANG, as `&quot;` in the references shows), lowercasing;
   then sacreBLEU with tokenize='none' against the tokenized references.

  python -m flaxformer_nmt.evaluate --hyp hyp.de --ref test2016.de [--tok_ref ../shared/data/multi30k_tok/test2016.de]

A model trained on lowercased text (config.lowercase) writes lowercase translations: with --lowercase, 1. is
case-insensitive (sacreBLEU's own option; its signature says case:lc); 2. lowercases anyway.
"""
import sys

from absl import app, flags
from flaxformer_nmt.evaluation.bleu import read_text, report


def define_flags():
  flags.DEFINE_string('hyp', None, 'Detokenized hypotheses, one per line.')
  flags.DEFINE_string('ref', None, 'Raw references, one per line.')
  flags.DEFINE_string('tok_ref', None, 'Lowercased Moses-tokenized references (Multi30k lc.norm.tok).')
  flags.DEFINE_string('lang', 'de', 'Target language, for Moses normalization and tokenization.')
  flags.DEFINE_bool('lowercase', False, 'Case-insensitive sacreBLEU and chrF (hypotheses of a model trained with '
                    'config.lowercase).')
  flags.mark_flags_as_required(['hyp', 'ref'])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    lines, _ = report(read_text(f.hyp), read_text(f.ref), read_text(f.tok_ref) if f.tok_ref else None, f.lang,
                      lowercase=f.lowercase)
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')
  print('\n'.join(lines))


if __name__ == '__main__':
  define_flags()
  app.run(main)
