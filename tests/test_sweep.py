"""bench/sweep.py learns each distinct vocabulary once and hands it to exactly the runs that would have learnt it,
and its --check_only refuses a screen whose runs the trainer would refuse."""
import ast
import glob
import hashlib
import os
import re
import subprocess
import sys

from conftest import write_toy_corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sha256(path):
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def test_runs_share_a_vocabulary_exactly_where_their_configs_would_learn_the_same_one(tmp_path):
  data = write_toy_corpus(tmp_path / 'data')
  root = tmp_path / 'sweep'
  # The runs are started and stopped at once (--timeout_s): what is checked is what they were handed.
  subprocess.run(
      [sys.executable, os.path.join(REPO, 'bench', 'sweep.py'), '--config', os.path.join(REPO, 'configs', 'base.py'),
       '--root', str(root), '--seeds=0,1', '--parallel=8', '--timeout_s=0.1',
       f'--extra=--config.data_dir={data} --config.vocab_size=64 --config.sentencepiece_max_chars=0',
       '--variant=paper:',
       '--variant=training_only: --config.model.dropout_rate=0.3 --config.learning_rate_scale=3',
       '--variant=smaller_vocabulary: --config.vocab_size=60',
       '--variant=sampled: --config.sentencepiece_max_chars=4000'],
      check=True, capture_output=True, text=True, timeout=300, cwd=REPO)
  prepared = {name: sha256(root / 'prepared' / name / 'vocab.model') for name in os.listdir(root / 'prepared')}
  # paper and training_only share one; a vocabulary size is another; a seeded sample makes one per seed.
  assert sorted(name.split('-')[0] for name in prepared) == ['v60', 'v64', 'v64', 'v64'], sorted(prepared)
  runs = [f'{variant}.s{seed}' for variant in ('paper', 'training_only', 'smaller_vocabulary', 'sampled')
          for seed in (0, 1)]
  handed = {run: sha256(root / run / 'vocab.model') for run in runs}
  assert handed['paper.s0'] == handed['paper.s1'] == handed['training_only.s0'] == handed['training_only.s1']
  assert handed['smaller_vocabulary.s0'] == handed['smaller_vocabulary.s1'] != handed['paper.s0']
  assert set(handed.values()) <= set(prepared.values())
  for run in handed:  # the token ids come along, so no run tokenizes again
    assert (root / run / 'tokenized' / 'train' / 'meta.json').exists()


def test_a_variant_builds_on_an_earlier_one_by_name():
  # '@name' is the named variant's overrides, in place: its own come after, so they win where both set a field.
  def parse(texts):
    code = f'import sys; sys.path.insert(0, "bench"); import sweep; print(sweep.parse_variants({texts!r}))'
    return subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120)
  result = parse(['a: --config.x=1 --config.y=1', 'b: @a --config.y=2', 'c: --config.z=3 @b', 'd:'])
  assert result.returncode == 0, result.stderr[-2000:]
  assert ast.literal_eval(result.stdout) == [
      ('a', ['--config.x=1', '--config.y=1']), ('b', ['--config.x=1', '--config.y=1', '--config.y=2']),
      ('c', ['--config.z=3', '--config.x=1', '--config.y=1', '--config.y=2']), ('d', [])]
  for texts, message in ((['a: @b', 'b: --config.x=1'], '@b names no variant given before it'),
                         (['a: --config.x=1', 'a: --config.x=2'], "--variant names repeat: 'a'")):
    result = parse(texts)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def check_screen(*args):
  return subprocess.run([sys.executable, os.path.join(REPO, 'bench', 'sweep.py'), '--check_only', *args],
                        capture_output=True, text=True, timeout=120, cwd=REPO)


def test_every_shipped_screen_resolves_to_configs_the_trainer_accepts():
  # The screens in bench/sweeps run on a GPU lent for minutes: a config field renamed since a screen was written,
  # or a combination the trainer refuses, must show here rather than cost a lease.
  screens = [path for path in sorted(glob.glob(os.path.join(REPO, 'bench', 'sweeps', '*.flags')))
             if '--variant=' in open(path).read()]
  assert len(screens) >= 5, screens
  # One process checks them all, each as `sweep.py --check_only --flagfile=SCREEN` would (a process each cost
  # ~3 s of imports on the 2-core CI machine); a refused run exits it, after its screen's name.
  code = ('import sys; sys.path.insert(0, "bench"); import sweep; from absl import flags\n'
          'for path in sys.argv[1:]:\n'
          '  flags.FLAGS.unparse_flags(); flags.FLAGS(["sweep", "--check_only", "--flagfile=" + path])\n'
          '  print("screen", path, flush=True); sweep.main(["sweep"])\n')
  result = subprocess.run([sys.executable, '-c', code, *screens], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
  assert result.returncode == 0, (result.stdout.splitlines()[-1:], result.stderr[-2000:])
  sections = result.stdout.split('screen ')[1:]
  assert [section.split('\n')[0] for section in sections] == screens
  for section in sections:
    assert re.search(r'^\S+\.s\d+: ok$', section, re.M), section


def test_the_check_names_the_run_whose_config_the_trainer_would_refuse():
  for variant, message in (('typo: --config.label_smothing=0.1', 'run typo.s0: AttributeError'),
                           ('no_bleu: --config.eval_bleu_every_steps=0',  # the recipe keeps its best by BLEU
                            "run no_bleu.s0: ConfigError: config.best_checkpoint_metric='bleu' needs validation BLEU")):
    result = check_screen('--config', os.path.join(REPO, 'configs', 'multi30k_best.py'), '--variant=fine:',
                          f'--variant={variant}')
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert 'fine.s0: ok' in result.stdout  # checked in order, up to the bad one
