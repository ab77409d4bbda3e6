r"""BLEU against training minutes: validation and test2016 BLEU of the checkpoints of a run, its averaged and
its best checkpoint; trains the run first when given a config.

  # Train (resumes if the workdir exists), keeping every checkpoint, then score:
  python bench/bleu_curve.py --config configs/multi30k_best.py --workdir runs/m30k_best
  python bench/bleu_curve.py --config configs/multi30k.py --workdir runs/m30k
  # Score an existing workdir only (its kept checkpoints):
  python bench/bleu_curve.py --workdir runs/m30k --splits valid,test2016 [--beam_size 4] [--curve_every_steps 500]

Reads `{data_dir}/{split}.{src,tgt}` from the workdir's config and the lowercased tokenized references from
config.eval_bleu_tok_ref_dir (the download's multi30k_tok for the Multi30k configs) or --tok_dir; prints
Markdown tables (also written to
{workdir}/bleu_curve.md):
1. the validation BLEU logged during training (metrics.jsonl: step, minutes, BLEU, lc-tok BLEU, length ratio);
2. per checkpoint: training minutes, then per split cased sacreBLEU, lc-tok BLEU and length ratio, decoded
   with the config's beam and length penalty (the decode a user gets), or --beam_size and --alpha.
Training minutes add up over resumed runs as the trainer counts them: a resumed launch's clock starts at the
training time saved with its checkpoint, so steps lost to a hard kill are trained again and their first time is
not counted; a launch of a trainer that saved no clock starts at 0, and the previous launch's last reading is
added to what follows.
An ensemble's workdir (config.ensemble_members > 1) gets these tables for each member, then rows for the members
decoded together (latest, the config's decode_checkpoint, averaged and best; or --steps) at the minutes of the
whole command.
Choose on the validation columns only; test2016 is reported, never used to choose.
"""
import json
import os
import subprocess
import sys
import time

from absl import app, flags
from etils import epath

from flaxformer_nmt.checkpointing import best as best_checkpoint
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import bleu as evaluate
from flaxformer_nmt.evaluation import compare
from flaxformer_nmt.runtime import cache

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir.')
  flags.DEFINE_string('config', None, 'Train this config into --workdir first (resumes a stopped run).')
  flags.DEFINE_list('override', [], 'Extra --config.FIELD=VALUE overrides for training, as FIELD=VALUE.')
  flags.DEFINE_list('splits', ['valid', 'test2016'], 'Splits to translate and score.')
  flags.DEFINE_string('split', None, 'One split only (the same as --splits=SPLIT).')
  flags.DEFINE_integer('beam_size', None, 'Beam width (default: the config\'s); 0 is greedy.')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent (default: the config\'s).')
  flags.DEFINE_string('tok_dir', None, 'Lowercased Moses-tokenized references ({split}.{lang}); default: '
                      'config.eval_bleu_tok_ref_dir.')
  flags.DEFINE_list('steps', None, 'Only these checkpoints (default: all kept, then averaged and best).')
  flags.DEFINE_integer('curve_every_steps', 0, 'Score only checkpoints at multiples of this (0: all).')
  flags.mark_flags_as_required(['workdir'])


def train(config_path, workdir, overrides):
  """Runs the trainer (every checkpoint kept, for the curve); returns its exit status."""
  command = [sys.executable, '-m', 'flaxformer_nmt.train', '--config', config_path, '--workdir', workdir,
             '--config.keep_checkpoints=0'] + [f'--config.{o}' for o in overrides]
  print('$', ' '.join(command), flush=True)
  return subprocess.run(command, check=False).returncode


def read_log(workdir):
  """(step -> training seconds summed over resumed runs, [validation BLEU records]) from metrics.jsonl.

  Each launch of the trainer logs where its clock starts ('run/trained_seconds_at_start'): the training time
  saved with the checkpoint it resumed from, so its elapsed_seconds continue the run's minutes. A launch that
  starts from 0 after earlier ones (a checkpoint written by a trainer that did not save its clock), or logs no
  start at all (older trainers), started its clock again: the earlier launches' last reading is added to it.
  """
  elapsed, bleu = {}, []
  offset, previous = 0.0, 0.0  # seconds not on this launch's clock; its last reading
  marked = False  # this launch logged where its clock starts
  for line in (epath.Path(workdir) / 'metrics.jsonl').read_text().splitlines():
    record = json.loads(line)
    if 'run/trained_seconds_at_start' in record:
      start, marked = record['run/trained_seconds_at_start'], True
      if start == 0 and previous > 0:
        offset += previous
      previous = start
    if 'elapsed_seconds' in record:
      if not marked and record['elapsed_seconds'] < previous:  # an older trainer's resume: its clock started again
        offset += previous
      previous = record['elapsed_seconds']
      elapsed[record['step']] = offset + previous
    if 'eval/bleu' in record:
      bleu.append(record)
  return elapsed, bleu


def logged_bleu_table(records, elapsed):
  lines = ['Validation BLEU logged while training (greedy or the config\'s eval_bleu_beam_size):', '',
           '| step | training min | sacreBLEU | lc-tok BLEU | length ratio | eval s |',
           '|---:|---:|---:|---:|---:|---:|']
  for r in records:
    minutes = elapsed.get(r['step'])
    lines.append(f'| {r["step"]} | {minutes / 60 if minutes else 0:.1f} | {r["eval/bleu"]:.2f} | '
                 f'{r.get("eval/tok_bleu", float("nan")):.2f} | {r["eval/bleu_length_ratio"]:.3f} | '
                 f'{r["eval/bleu_seconds"]:.0f} |')
  return lines


def split_data(config, split, tok_dir):
  src_path, ref_path = data_lib.split_paths(config.data_dir, split, config.source_lang, config.target_lang)
  tok_path = epath.Path(tok_dir) / f'{split}.{config.target_lang}' if tok_dir else None
  return (data_lib.read_lines(src_path), evaluate.read_text(ref_path),
          evaluate.read_text(tok_path) if tok_path is not None and tok_path.exists() else None)


def checkpoint_names(workdir):
  if FLAGS.steps:
    return FLAGS.steps
  steps = checkpoints_lib.saved_steps(workdir)
  names = [str(s) for s in steps if not FLAGS.curve_every_steps or s % FLAGS.curve_every_steps == 0 or s == steps[-1]]
  if (epath.Path(workdir) / checkpoints_lib.AVERAGED_DIR / 'averaged.json').exists():
    names.append('averaged')
  if best_checkpoint.read_info(workdir) is not None:
    names.append('best')
  return names


def ensemble_checkpoint_names(members, config):
  """What an ensemble's rows decode, each the same name in every member: --steps, else latest, the config's
  decode_checkpoint, and averaged and best where every member has them (the members' steps differ where each
  fitted its schedule to its time)."""
  if FLAGS.steps:
    return FLAGS.steps
  names = ['latest'] + ([config.decode_checkpoint] if config.get('decode_checkpoint') else [])
  names += [name for name in ('averaged', 'best') if all(name in checkpoint_names(m) for m in members)]
  return list(dict.fromkeys(names))


def score_row(workdir, name, data, beam, alpha, seconds):
  """One Markdown row: checkpoint `name` of `workdir` (an ensemble's: its members together) decoded and scored on
  each split, after `seconds` of training."""
  translator = decode.Translator(workdir, checkpoint=name)
  cells, start = [], time.time()
  for sources, references, tok_references in data.values():
    _, bleu, tok, _, signature = compare.scores(translator, sources, references, tok_references, beam, alpha)
    cells += [f'{bleu.score:.2f}', f'{tok:.2f}' if tok is not None else '-', f'{bleu.sys_len / bleu.ref_len:.3f}']
  row = (f'| {translator.checkpoint} | {f"{seconds / 60:.1f}" if seconds else "-"} | ' + ' | '.join(cells)
         + f' | {time.time() - start:.0f} |')
  print(row, flush=True)
  return row, signature


def table_header(title, beam, alpha, splits):
  lines = ['', f'{title}: {"greedy" if beam == 0 else f"beam {beam}"}, alpha {alpha}', '',
           '| checkpoint | training min | ' + ' | '.join(f'{s} sacreBLEU | {s} lc-tok | {s} len ratio' for s in splits)
           + ' | decode s |', '|---|---:|' + '---:|' * (3 * len(splits) + 1)]
  print('\n'.join(lines), flush=True)
  return lines


def run_tables(workdir, data, beam, alpha):
  """One run's tables: its logged validation BLEU, then a row per checkpoint. Returns (lines, its training
  seconds, the sacreBLEU signature)."""
  elapsed, logged = read_log(workdir)
  out = logged_bleu_table(logged, elapsed) if logged else []
  if logged:
    print('\n'.join(out), flush=True)
  out += table_header(os.path.basename(os.path.normpath(workdir)), beam, alpha, list(data))
  names, signature = checkpoint_names(workdir), None
  if not names:
    sys.exit(f'error: no checkpoints in {workdir}')
  for name in names:
    row, signature = score_row(workdir, name, data, beam, alpha, elapsed.get(int(name)) if name.isdigit() else None)
    out.append(row)
  return out, max(elapsed.values(), default=0.0), signature


def main(_):
  workdir = FLAGS.workdir
  if FLAGS.config and train(FLAGS.config, workdir, FLAGS.override) != 0:
    sys.exit('error: training failed (see above)')
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()  # every checkpoint decodes the same shapes
  config = workdir_lib.load_config(workdir)
  tok_dir = FLAGS.tok_dir or config.eval_bleu_tok_ref_dir
  beam = config.beam_size if FLAGS.beam_size is None else FLAGS.beam_size
  alpha = config.length_penalty_alpha if FLAGS.alpha is None else FLAGS.alpha
  splits = [FLAGS.split] if FLAGS.split else FLAGS.splits
  data = {split: split_data(config, split, tok_dir) for split in splits}
  # An ensemble's workdir (config.ensemble_members): each member's curve on its own clock, then the members
  # decoded together, at the minutes of the whole command (the members train in turn).
  members = workdir_lib.member_workdirs(workdir)
  out, seconds = [], 0.0
  for member in members:
    lines, member_seconds, signature = run_tables(member, data, beam, alpha)
    out, seconds = out + lines, seconds + member_seconds
  if len(members) > 1:
    out += table_header(f'the ensemble of {len(members)} members of {workdir} ({seconds / 60:.1f} training minutes)',
                        beam, alpha, splits)
    out += [score_row(workdir, name, data, beam, alpha, seconds)[0]
            for name in ensemble_checkpoint_names(members, config)]
  out += ['', f'sacreBLEU {signature}']
  print(out[-1])
  (epath.Path(workdir) / 'bleu_curve.md').write_text('\n'.join(out) + '\n')


if __name__ == '__main__':
  define_flags()
  app.run(main)
