r"""BLEU of every kept checkpoint of a workdir (and of its averaged one), with the training time it took.

  python bench/bleu_curve.py --workdir runs/m30k --split test2016 [--beam_size 4]

Reads `{data_dir}/{split}.{src,tgt}` from the workdir's config and, for Multi30k, the tokenized references in
`../shared/data/multi30k_tok`; prints a Markdown table: step, training minutes, validation loss and
perplexity (from metrics.jsonl), cased sacreBLEU and lowercased tokenized BLEU, decode seconds. Training
minutes are those of the process that logged the step: a resumed run starts its clock again.
"""
import json
import os
import time

from absl import app, flags
from etils import epath

from flaxformer_nmt import checkpoints as checkpoints_lib
from flaxformer_nmt import config as config_lib
from flaxformer_nmt import data as data_lib
from flaxformer_nmt import decode
from flaxformer_nmt import evaluate
from flaxformer_nmt import workdir as workdir_lib

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir.')
_SPLIT = flags.DEFINE_string('split', 'test2016', 'Split to translate and score.')
_BEAM = flags.DEFINE_integer('beam_size', 4, 'Beam width; 0 is greedy.')
_TOK_DIR = flags.DEFINE_string('tok_dir', config_lib.shared_data_dir('multi30k_tok'),
                               'Directory of lowercased Moses-tokenized references ({split}.{lang}); may be absent.')
_STEPS = flags.DEFINE_list('steps', None, 'Only these checkpoints (default: all, then averaged if present).')


def eval_log(workdir):
  """step -> (elapsed seconds, validation loss, perplexity) from metrics.jsonl."""
  rows = {}
  for line in (epath.Path(workdir) / 'metrics.jsonl').read_text().splitlines():
    record = json.loads(line)
    if 'eval/nll' in record:
      rows[record['step']] = (record['elapsed_seconds'], record['eval/nll'], record['eval/perplexity'])
  return rows


def main(_):
  workdir = _WORKDIR.value
  checkpoints_lib.quiet_orbax_logs()
  config = workdir_lib.load_config(workdir)
  src_path, ref_path = data_lib.split_paths(config.data_dir, _SPLIT.value, config.source_lang, config.target_lang)
  sources, references = data_lib.read_lines(src_path), evaluate.read_text(ref_path)
  tok_path = epath.Path(_TOK_DIR.value) / f'{_SPLIT.value}.{config.target_lang}'
  tok_references = evaluate.read_text(tok_path) if tok_path.exists() else None
  steps = [int(s) for s in _STEPS.value] if _STEPS.value else checkpoints_lib.Checkpoints(workdir, keep=0).steps()
  names = [str(s) for s in steps]
  if not _STEPS.value and (epath.Path(workdir) / checkpoints_lib.AVERAGED_DIR).exists():
    names.append('averaged')
  log = eval_log(workdir)
  print(f'{_SPLIT.value}, {"greedy" if _BEAM.value == 0 else f"beam {_BEAM.value}"}, {os.path.basename(workdir)}')
  print('| checkpoint | training min | valid nll | valid ppl | sacreBLEU | tok. BLEU | decode s |')
  print('|---|---:|---:|---:|---:|---:|---:|')
  for name in names:
    translator = decode.Translator(workdir, checkpoint=name)
    start = time.time()
    hypotheses = translator.translate(sources, beam_size=_BEAM.value)
    seconds = time.time() - start
    _, numbers = evaluate.report(hypotheses, references, tok_references, config.target_lang)
    elapsed, nll, ppl = log.get(int(name), (None, None, None)) if name.isdigit() else (None, None, None)
    cell = lambda x, fmt: format(x, fmt) if x is not None else '-'
    print(f'| {translator.checkpoint} | {cell(elapsed and elapsed / 60, ".1f")} | {cell(nll, ".3f")} | '
          f'{cell(ppl, ".2f")} | {numbers["bleu"]:.2f} | {cell(numbers.get("tokenized_bleu"), ".2f")} | {seconds:.0f} |',
          flush=True)


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir'])
  app.run(main)
