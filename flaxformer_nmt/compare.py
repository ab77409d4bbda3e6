r"""Scores several checkpoints of one workdir on the same sentences, in one table: the best checkpoint against
the average of the last k, the latest, or given steps.

  python -m flaxformer_nmt.compare --workdir runs/m30k --checkpoints best,averaged,last:10,latest
  python -m flaxformer_nmt.compare --workdir runs/m30k --checkpoints best,averaged --split test2016
  python -m flaxformer_nmt.compare --workdir runs/m30k --checkpoints best,2000 --input test.en --ref test.de \
      [--tok_ref test.tok.de]
  python -m flaxformer_nmt.compare --workdir runs/m30k --checkpoints last:10 --beam_size 8 --mbr bleu
  python -m flaxformer_nmt.compare --workdir runs/m30k --checkpoints latest,last:10 --alpha 0.6,1.0,1.5,2.0
  python -m flaxformer_nmt.compare --workdir runs/a,runs/b --checkpoints latest,last:10   # ensembles
  python -m flaxformer_nmt.compare --workdir runs/m30k --devices 2   # each batch split over two devices
  python -m flaxformer_nmt.compare --workdir runs/m30k --checkpoints averaged --rerank_workdir runs/m30k_r2l \
      --rerank_weight 0,0.3,0.5   # the beam's n best rescored by a right-to-left model (rerank.py)

Checkpoints: `best` (config.best_checkpoint_metric), `averaged` ({workdir}/averaged), `last:K` (the newest K
checkpoints averaged in memory, nothing written), `latest`, or a step. By default the sentences are the
workdir's validation split (`{data_dir}/{eval_split}.{lang}`), and the lowercased tokenized references come
from config.eval_bleu_tok_ref_dir where present: choose between checkpoints on validation, and score the
chosen one on test once. Prints a Markdown table: cased sacreBLEU (13a), lowercased Moses-tokenized BLEU,
hypothesis/reference length ratio, brevity penalty, and decoding seconds, one row per checkpoint and length
penalty (--alpha takes several: the search compiles once for them all, as alpha is not compiled in). A model
trained on lowercased text (config.lowercase) reads the sources lowercased, and its sacreBLEU is
case-insensitive (`case:lc`).
"""
import sys
import time

import sacrebleu
from absl import app, flags
from etils import epath

from flaxformer_nmt import checkpoints as checkpoints_lib
from flaxformer_nmt import cli
from flaxformer_nmt import data as data_lib
from flaxformer_nmt import decode
from flaxformer_nmt import evaluate
from flaxformer_nmt import mbr
from flaxformer_nmt import rerank
from flaxformer_nmt import sharding
from flaxformer_nmt import workdir as workdir_lib


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir; several (A,B), or an ensemble\'s workdir, compare as '
                      'one ensemble.')
  flags.DEFINE_list('checkpoints', ['best', 'averaged', 'latest'], 'best, averaged, last:K, latest or steps.')
  flags.DEFINE_string('split', None, 'A split of the workdir\'s data_dir (default: its eval_split).')
  flags.DEFINE_string('input', None, 'Source sentences instead of --split (needs --ref).')
  flags.DEFINE_string('ref', None, 'Raw references of --input.')
  flags.DEFINE_string('tok_ref', None, 'Lowercased Moses-tokenized references (default for a split: '
                      '{config.eval_bleu_tok_ref_dir}/{split}.{lang} where it exists).')
  flags.DEFINE_integer('beam_size', None, 'Beam width (default: the config\'s); 0 is greedy.')
  flags.DEFINE_list('alpha', None, 'Length penalty exponents, a row each (default: the config\'s).')
  flags.DEFINE_enum('mbr', None, list(mbr.UTILITIES), 'Minimum Bayes risk among the beam\'s --n_best candidates '
                    '(mbr.py) instead of its best-scored translation.')
  flags.DEFINE_integer('n_best', None, 'Candidates for --mbr (default: the beam size).')
  flags.DEFINE_string('rerank_workdir', None, 'A model (often right to left: config.target_right_to_left) that '
                      'rescores the beam\'s n best (rerank.py); rows for each --rerank_weight.')
  flags.DEFINE_string('rerank_checkpoint', None, 'The rescorer\'s checkpoint (default: its config\'s).')
  flags.DEFINE_list('rerank_weight', ['0.5'], 'Weights w of the rescorer: (1 - w) search + w rescorer, a row '
                    'each.')
  flags.DEFINE_integer('devices', 1, 'Devices to split each batch\'s sentences over, as decode\'s --devices.')
  flags.mark_flags_as_required(['workdir'])


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
  sources, references = evaluate.read_text(input_path), evaluate.read_text(ref_path)
  tok_references = evaluate.read_text(tok_ref_path) if tok_ref_path else None
  if len(sources) != len(references) or (tok_references is not None and len(tok_references) != len(sources)):
    raise ValueError(f'{input_path}, {ref_path}{", " + str(tok_ref_path) if tok_ref_path else ""}: different '
                     'numbers of lines')
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
          f'{bleu.sys_len / bleu.ref_len:.3f} | {bleu.bp:.3f} | {seconds:.0f} |')


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
    return [float(v) for v in values]
  except ValueError:
    raise ValueError(f'{flag}={",".join(values)}: {what} are numbers, e.g. 0.3,0.5') from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  if f.rerank_workdir and f.mbr:
    raise app.UsageError('--rerank_workdir and --mbr each choose among the n best: give one')
  if f.n_best and not f.mbr:
    raise app.UsageError('--n_best gives --mbr its candidates: give --mbr too')
  checkpoints_lib.quiet_orbax_logs()
  cli.use_compilation_cache()  # every checkpoint decodes the same shapes
  try:
    devices = sharding.local_devices(f.devices)  # before the first computation: it may split the CPU
    # Several workdirs ('A,B') or an ensemble's (config.ensemble_members) compare as one ensemble; the first
    # member's config names the split and the decoding defaults.
    config = workdir_lib.load_config(decode.ensemble_members(f.workdir, None)[0][0])
    description, sources, references, tok_references = sentences(config, f.split, f.input, f.ref, f.tok_ref)
    beam_size = config.beam_size if f.beam_size is None else f.beam_size
    alphas = alpha_values(f.alpha, config.length_penalty_alpha)
    n_best = (f.n_best or beam_size) if f.mbr else 1
    print(f'{description}: {len(sources)} sentences, {"greedy" if beam_size == 0 else f"beam {beam_size}"}'
          + (f', MBR by sentence {f.mbr} among {n_best} candidates' if f.mbr else ''))
    print('| checkpoint | parameters | alpha | sacreBLEU | lc-tok BLEU | length ratio | BP | decode s |')
    print('|---|---|---:|---:|---:|---:|---:|---:|')
    signature = ''
    rescorer = None
    if f.rerank_workdir:
      weights = alpha_values(f.rerank_weight, None, '--rerank_weight', 'rescorer weights')
      for weight in weights:
        rerank.check_weight(weight)
      # On the default device: rerank.score_pairs batches for one device.
      rescorer = decode.Translator(f.rerank_workdir, checkpoint=f.rerank_checkpoint)
    for name in f.checkpoints:
      translator = decode.Translator(f.workdir, checkpoint=name, devices=devices)
      for alpha in alphas:
        if rescorer is not None:
          rows, signature = rerank_rows(name, translator, rescorer, (sources, references, tok_references),
                                        beam_size, alpha, weights)
          print('\n'.join(rows), flush=True)
          continue
        row, signature = score_row(name, translator, sources, references, tok_references, beam_size, alpha,
                                   f.mbr, n_best)
        print(row, flush=True)
    print(f'\nsacreBLEU {signature}')
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
