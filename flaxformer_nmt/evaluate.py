r"""Scores translations: sacreBLEU (13a, cased or --lowercase) against raw references, and with --tok_ref the
lowercased, Moses-tokenized BLEU that Multi30k papers report, against the official tokenized references.

  python -m flaxformer_nmt.evaluate --hyp hyp.de --ref ~/.cache/flaxformer_nmt/multi30k/test2016.de \
      --tok_ref ~/.cache/flaxformer_nmt/multi30k_tok/test2016.de --lowercase
"""
import sys

from absl import app, flags

from flaxformer_nmt.evaluation.bleu import moses_languages, read_named, report


def define_flags():
  flags.DEFINE_string('hyp', None, 'Detokenized hypotheses, one per line.')
  flags.DEFINE_string('ref', None, 'Raw references, one per line.')
  flags.DEFINE_string('tok_ref', None, 'Lowercased Moses-tokenized references (Multi30k lc.norm.tok).')
  flags.DEFINE_string('lang', 'de', 'Target language, for Moses normalization and tokenization.')
  flags.DEFINE_bool('lowercase', False, 'Case-insensitive sacreBLEU and chrF (hypotheses of a model trained with '
                    'config.lowercase).')
  flags.mark_flags_as_required(['hyp', 'ref'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  if f.tok_ref and f.lang not in moses_languages():  # only the tokenized BLEU reads it
    sys.exit(f'error: --lang {f.lang}: the Moses tokenization of --tok_ref has no rules for it (one of '
             f'{", ".join(moses_languages())})')
  texts = {}
  for flag in ('hyp', 'ref', 'tok_ref'):
    if not f[flag].value:
      continue
    try:
      texts[flag] = read_named(f'--{flag}', f[flag].value)
    except ValueError as e:
      sys.exit(f'error: {e}')
  for flag, text in texts.items():
    if len(text) != len(texts['hyp']):
      sys.exit(f'error: --{flag} {f[flag].value} has {len(text)} lines but --hyp {f.hyp} has {len(texts["hyp"])}')
  try:
    lines, _ = report(texts['hyp'], texts['ref'], texts.get('tok_ref'), f.lang, lowercase=f.lowercase)
  except ValueError as e:
    sys.exit(f'error: {e}')
  print('\n'.join(lines))


if __name__ == '__main__':
  define_flags()
  app.run(main)
