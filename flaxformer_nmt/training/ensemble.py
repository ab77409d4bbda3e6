r"""Training an ensemble (config.ensemble_members > 1): independent runs of one config, in turn, in one workdir.

  python -m flaxformer_nmt.train --config configs/multi30k.py --workdir runs/ens --config.ensemble_members=2
  python -m flaxformer_nmt.decode --workdir runs/ens --input test.en      # the members' ensemble

Member k is a run of its own in {workdir}/member{k} (its config.json, checkpoints, metrics and TensorBoard
files; decode, average and export take it alone too), with config.seed + k and an equal share of the time
limit, config.max_train_minutes / ensemble_members, so the whole ensemble keeps to the limit. Every member
reads member0's vocabulary, copied in before member k starts: one vocabulary is what lets the members'
probabilities be averaged, and a vocabulary sampled from a character budget (config.sentencepiece_max_chars)
follows the seed.
A vocab.model placed in {workdir} beforehand becomes member0's.

A member that ended (by its steps or its time) writes {member}/finished.json; rerunning the command skips those
and resumes the first one without it, so a stop signal or a crash loses only what the member in progress had
not saved, as for one run. A finished member whose step or time limit was changed since trains on. Once all
have finished, the command scores them together on the validation split with the config's decode
(score_on_validation: {workdir}/ensemble_bleu.json).

Why: two independently trained Transformer-tiny runs decoded together gain 1.0-1.6 valid BLEU on Multi30k
over each of them alone, more than one run's seed spread (bench/RESULTS.md); checkpoints of one run barely do
(+0.06).
"""
import json
import shutil
import jax
from absl import logging
from etils import epath

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data.tokenizer import VOCAB_FILENAME
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import compare
from flaxformer_nmt.runtime import distributed
from flaxformer_nmt.training.validation import HYPOTHESES_DIR

FINISHED_FILE = 'finished.json'
VALIDATION_FILE = 'ensemble_bleu.json'  # the members' validation BLEU together, after the last one
# The fields that say how far a run trains: a member finished under other values is not finished now.
_EXTENT_FIELDS = ('num_train_steps', 'max_train_minutes')


def member_config(config, k):
  """The config member k trains with: the ensemble's, with seed + k and its share of the time limit."""
  member = config.copy_and_resolve_references()
  member.seed = config.seed + k
  member.ensemble_members = 1  # a member is one run
  if config.max_train_minutes > 0:
    member.max_train_minutes = config.max_train_minutes / config.ensemble_members
  return member


def mark_finished(workdir, config, step, reason):
  """Records that the run in `workdir` ended (`reason`: its steps or its time) at `step` under `config`."""
  if distributed.is_leader():
    record = dict(step=step, reason=reason, **{field: config[field] for field in _EXTENT_FIELDS})
    (epath.Path(workdir) / FINISHED_FILE).write_text(json.dumps(record, indent=1) + '\n')
  distributed.barrier('finished written')


def finished(workdir, config):
  """Whether the run in `workdir` ended under the step and time limits `config` sets now."""
  path = epath.Path(workdir) / FINISHED_FILE
  if not path.exists():
    return False
  record = json.loads(path.read_text())
  return all(record[field] == config[field] for field in _EXTENT_FIELDS)


def share_vocabulary(workdir, k):
  """Before member k starts without a vocabulary, copies in member0's (k > 0), or for member0 a vocab.model
  placed in the ensemble's workdir (a vocabulary chosen beforehand, as for one run)."""
  source = epath.Path(workdir) / VOCAB_FILENAME if k == 0 else workdir_lib.member_workdir(workdir, 0) / VOCAB_FILENAME
  target = workdir_lib.member_workdir(workdir, k) / VOCAB_FILENAME
  if target.exists() or (k == 0 and not source.exists()):  # member0 without one learns it
    return
  if not source.exists():
    raise workdir_lib.ConfigError(f'{source} not found: member {k} of {workdir} needs member 0\'s vocabulary '
                                  '(was member0 removed?)')
  if distributed.is_leader():
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
  distributed.barrier('vocabulary shared')


def train_members(config, workdir, train_one):
  """Trains the members of `config` in turn with train_one(member config, member workdir) (the trainer's
  train_and_evaluate); returns the last metrics it returned. Stops after a member that did not finish (a stop
  signal): rerunning resumes it."""
  workdir = epath.Path(workdir)
  config_lib.validate(config)
  workdir.mkdir(parents=True, exist_ok=True)
  workdir_lib.save_or_check_config(config, workdir)
  last = {}
  for k in range(config.ensemble_members):
    member, member_dir = member_config(config, k), workdir_lib.member_workdir(workdir, k)
    if finished(member_dir, member):
      logging.info('Ensemble member %d of %d (%s) has finished', k + 1, config.ensemble_members, member_dir)
      continue
    logging.info('Ensemble member %d of %d: %s, seed %d%s', k + 1, config.ensemble_members, member_dir,
                 member.seed, f', {member.max_train_minutes:g} minutes' if member.max_train_minutes > 0 else '')
    share_vocabulary(workdir, k)
    last = train_one(member, member_dir)
    if not finished(member_dir, member):
      logging.info('Ensemble member %d paused; rerun the command to resume it', k + 1)
      return last
  logging.info('All %d members of %s trained: `python -m flaxformer_nmt.decode --workdir %s` translates with '
               'their ensemble; `python -m flaxformer_nmt.compare --workdir %s --checkpoints %s` scores it on '
               'validation', config.ensemble_members, workdir, workdir, workdir, config.decode_checkpoint)
  return last


def score_on_validation(config, workdir):
  """Once every member has finished: their ensemble's validation BLEU, as `decode --workdir {workdir}` gives it
  (each member's decode_checkpoint, the config's beam and length penalty), logged and written to
  {workdir}/ensemble_bleu.json, its translations to {workdir}/eval/hyp_ensemble.txt; returns the record, or None
  where a member has not finished, validation BLEU is off (eval_bleu_every_steps = 0) or the job has several
  processes (then `compare --workdir {workdir}` scores it). No member's own validation shows this number.
  eval_bleu_max_sentences caps the sentences, as for the members' evaluations."""
  members = [(member_config(config, k), workdir_lib.member_workdir(workdir, k)) for k in range(config.ensemble_members)]
  if not config.eval_bleu_every_steps or not all(finished(d, c) for c, d in members):
    return None
  if jax.process_count() > 1:
    logging.info('Score the ensemble with `python -m flaxformer_nmt.compare --workdir %s` (one process)', workdir)
    return None
  try:
    _, sources, references, tok_references = compare.sentences(config)
  except (OSError, ValueError) as e:  # the members trained: say why there is no score, lose nothing
    logging.warning('The ensemble was not scored on %s: %s', config.eval_split, e)
    return None
  count = min(config.eval_bleu_max_sentences or len(sources), len(sources))
  translator = decode.Translator(str(workdir))
  hypotheses, bleu, tok_bleu, seconds, signature = compare.scores(
      translator, sources[:count], references[:count], tok_references[:count] if tok_references else None,
      config.beam_size, config.length_penalty_alpha)
  record = dict(split=config.eval_split, sentences=count, checkpoints=translator.checkpoint,
                beam_size=config.beam_size, alpha=config.length_penalty_alpha, bleu=bleu.score, tok_bleu=tok_bleu,
                length_ratio=bleu.ratio, seconds=seconds, signature=signature)  # sacreBLEU's: 0 without references
  workdir = epath.Path(workdir)
  (workdir / HYPOTHESES_DIR).mkdir(parents=True, exist_ok=True)
  (workdir / HYPOTHESES_DIR / 'hyp_ensemble.txt').write_text(''.join(h + '\n' for h in hypotheses))
  (workdir / VALIDATION_FILE).write_text(json.dumps(record, indent=1) + '\n')
  tok = f', lowercased tokenized BLEU {record["tok_bleu"]:.2f}' if record['tok_bleu'] is not None else ''
  logging.info('The ensemble of %d members on %s (%d sentences, beam %d, alpha %g): sacreBLEU %.2f%s, length '
               'ratio %.3f, in %.0f s (%s)', config.ensemble_members, config.eval_split, count, config.beam_size,
               config.length_penalty_alpha, bleu.score, tok, record['length_ratio'], record['seconds'],
               record['signature'])
  return record
