r"""Scores translations: sacreBLEU (13a, cased or --lowercase) against raw references, and with --tok_ref the
lowercased, Moses-tokenized BLEU that Multi30k papers report, against the official tokenized references.

  python -m flaxformer_nmt.evaluate --hyp hyp.de --ref ~/.cache/flaxformer_nmt/multi30k/test2016.de \
      --tok_ref ~/.cache/flaxformer_nmt/multi30k_tok/test2016.de --lowercase
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
