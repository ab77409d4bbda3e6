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

from absl import app, flags

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import loader
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.decoding import mbr
from flaxformer_nmt.decoding import rerank
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation.compare import alpha_values, rerank_rows, score_row, sentences
from flaxformer_nmt.runtime import cache
from flaxformer_nmt.runtime import sharding


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


def check_flags(f):
  """Raises app.UsageError for flags that contradict each other or are empty, before anything decodes."""
  if f.rerank_workdir and f.mbr:
    raise app.UsageError('--rerank_workdir and --mbr each choose among the n best: give one')
  if f.n_best and not f.mbr:
    raise app.UsageError('--n_best gives --mbr its candidates: give --mbr too')
  if not f.checkpoints:
    raise app.UsageError('--checkpoints is empty: give the checkpoints to score, e.g. best,averaged')
  for name in f.checkpoints:  # all before the first one decodes
    if not checkpoints_lib.is_checkpoint_name(name):
      raise app.UsageError(f'--checkpoints: {name!r} is none of {checkpoints_lib.CHECKPOINT_NAMES}')
  if f.ref and not f.input:
    raise app.UsageError('--ref is the references of --input: give --input too (a --split has its own)')
  if f.input and f.split:
    raise app.UsageError('--input and --split each name the sentences: give one')
  if not f.rerank_workdir and (f.rerank_checkpoint or f['rerank_weight'].present):
    raise app.UsageError('--rerank_checkpoint and --rerank_weight are options of --rerank_workdir: give it too')
  if f.rerank_workdir and not f.rerank_weight:
    raise app.UsageError('--rerank_weight is empty: give the rescorer\'s weights, e.g. 0.3,0.5')


def check_models(f):
  """ValueError, before anything decodes, where a workdir is no translation model or a checkpoint is not saved."""
  for workdir, _ in loader.ensemble_members(f.workdir, None):
    loader.inference_config(workdir, task='translation')
  if f.rerank_workdir:
    loader.inference_config(f.rerank_workdir, task='translation')
  for name in f.checkpoints:
    for workdir, checkpoint in loader.ensemble_members(f.workdir, name):
      loader.check_checkpoint(workdir, checkpoint)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  check_flags(f)
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()  # every checkpoint decodes the same shapes
  try:
    devices = sharding.local_devices(f.devices)  # before the first computation: it may split the CPU
    # Several workdirs ('A,B') or an ensemble's (config.ensemble_members) compare as one ensemble; the first
    # member's config names the split and the decoding defaults.
    config = workdir_lib.load_config(loader.ensemble_members(f.workdir, None)[0][0])
    description, sources, references, tok_references = sentences(config, f.split, f.input, f.ref, f.tok_ref)
    check_models(f)
    beam_size = config.beam_size if f.beam_size is None else f.beam_size
    if beam_size < 0:
      raise app.UsageError(f'--beam_size={beam_size}: give 0 (greedy) or a beam width')
    alphas = alpha_values(f.alpha, config.length_penalty_alpha)
    n_best = (f.n_best or beam_size) if f.mbr else 1
    if f.mbr and not 2 <= n_best <= beam_size:  # before any checkpoint loads
      raise app.UsageError(f'--mbr chooses among --n_best of the beam\'s candidates, 2 to the beam size: n_best '
                           f'{n_best}, beam size {beam_size} (--beam_size, or the config\'s)')
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
