r"""Reliability of training on a tiny model, measured end to end through the CLI, as a table:

  python bench/reliability.py                      # 10 kill -9 trials, corruption, storage faults, config changes
  python bench/reliability.py --trials 3 --steps 20
  python bench/reliability.py --smoke              # every part once, on a 10-step run

1. kill -9: a run is SIGKILLed at a random moment of its training steps, rerun with the same command to the
   end, and its final parameters compared bitwise with an uninterrupted run's. The moment is drawn uniformly
   over the reference run's time after start-up, and the reference run is made after a first run that filled
   the compilation cache, so that its window (and each trial's) holds the steps and saves, not compiling. A
   trial whose run had already finished when the kill came is reported 'not killed', not as a pass.
2. Corruption of the newest checkpoint (truncated array files, deleted commit marker, garbage tree metadata):
   the rerun must set it aside, resume from the one before it (of the listed steps) and finish.
3. Storage failing during a save (ENOSPC raised by orbax's file writes, in process): the save fails loudly,
   the previous checkpoint stays listed and restores.
4. Config changes on resume (grad_clip_norm, a model shape, the vocabulary size): a clear error with every
   checkpoint in place, or (grad_clip_norm, which keeps no optimizer state) a resume.

Everything runs on the CPU in a temporary directory; one training run is a few seconds on a quiet machine.
"""
import argparse
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WORDS = {'a': 'ein', 'big': 'grosser', 'small': 'kleiner', 'dog': 'hund', 'cat': 'katze', 'runs': 'rennt',
         'sleeps': 'schlaeft', 'red': 'roter', 'man': 'mann', 'sees': 'sieht', 'the': 'der', 'ball': 'ball'}


def write_corpus(directory, seed=0):
  rng = random.Random(seed)
  directory.mkdir(parents=True, exist_ok=True)
  for split, n in (('train', 300), ('valid', 20)):
    sentences = [[rng.choice(list(WORDS)) for _ in range(rng.randint(2, 8))] for _ in range(n)]
    (directory / f'{split}.en').write_text(''.join(' '.join(s) + ' .\n' for s in sentences))
    (directory / f'{split}.de').write_text(''.join(' '.join(WORDS[w] for w in s) + ' .\n' for s in sentences))


def command(data_dir, workdir, steps, *extra):
  overrides = dict(data_dir=data_dir, vocab_size=64, tokens_per_batch=512, length_buckets='(32,)',
                   num_train_steps=steps, log_every_steps=5, eval_every_steps=10_000, checkpoint_every_steps=5,
                   keep_checkpoints=3, average_last_checkpoints=0, warmup_steps=20, prefetch_batches=0,
                   **{'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1, 'model.d_model': 32,
                      'model.d_ff': 64, 'model.num_heads': 2, 'model.dtype': 'float32'})
  return ([sys.executable, '-m', 'flaxformer_nmt.train', f'--config={REPO}/configs/base.py',
           f'--workdir={workdir}'] + [f'--config.{k}={v}' for k, v in overrides.items()] + list(extra))


def run(args, timeout=900):
  return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def final_params(workdir, step):
  from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_leaves(checkpoints_lib.saved_params(workdir, step))


def listing(path):
  return sorted(str(p.relative_to(path)) for p in path.rglob('*'))


def steps_of(workdir):
  directory = workdir / 'checkpoints'
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def _popen_logged(args, log_path):
  with open(log_path, 'w') as log:
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)


def _wait_for_training(process, log_path):
  """Seconds until the run logs 'Starting at step' (start-up, vocabulary, compilation before it)."""
  start = time.time()
  while process.poll() is None and 'Starting at step' not in log_path.read_text():
    time.sleep(0.05)
  return time.time() - start


def training_seconds(data, workdir, steps):
  """A run to the end: (seconds spent in training steps after start-up, exit status, its log)."""
  log_path = workdir.parent / f'{workdir.name}.log'
  process = _popen_logged(command(data, workdir, steps), log_path)
  _wait_for_training(process, log_path)
  start = time.time()
  process.wait()
  return time.time() - start, process.returncode, log_path


def kill_trials(root, data, reference, train_seconds, steps, trials, rng):
  """SIGKILL at a moment drawn uniformly over the training steps (start-up excluded, so that the kills land
  between checkpoints of a running loop, not before it), then the same command to the end."""
  rows = []
  for trial in range(trials):
    workdir = root / f'kill{trial}'
    log_path = root / f'kill{trial}.log'
    process = _popen_logged(command(data, workdir, steps), log_path)
    _wait_for_training(process, log_path)
    delay = rng.uniform(0.0, train_seconds)
    time.sleep(delay)
    if process.poll() is not None:  # finished before the kill: nothing was tested
      rows.append((f'kill -9 #{trial + 1}', f'{delay:.2f} s into training',
                   f'the run had finished (exit {process.returncode})', 'not killed'))
      print(' | '.join(rows[-1]), flush=True)
      continue
    process.send_signal(signal.SIGKILL)
    process.wait()
    at_kill = steps_of(workdir)
    result = run(command(data, workdir, steps))
    equal = result.returncode == 0 and all(
        np.array_equal(a, b) for a, b in zip(final_params(workdir, steps), reference))
    rows.append((f'kill -9 #{trial + 1}', f'{delay:.2f} s into training',
                 f'checkpoints at kill {at_kill or "none"}; rerun exit {result.returncode}',
                 'bitwise equal' if equal else 'DIFFERENT'))
    print(' | '.join(rows[-1]), flush=True)
  killed = [r for r in rows if r[3] != 'not killed']
  print(f'kill -9: {sum(r[3] == "bitwise equal" for r in killed)} of {len(killed)} killed runs bitwise equal; '
        f'{len(rows) - len(killed)} of {len(rows)} trials not killed (finished first)', flush=True)
  return rows


def truncate_arrays(step_dir):
  for path in (step_dir / 'state').rglob('*'):
    if path.is_file() and 'ocdbt.process' in str(path):
      path.write_bytes(path.read_bytes()[:10])


CORRUPTIONS = {
    'truncated array files': truncate_arrays,
    'deleted commit marker': lambda d: (d / 'commit_success.txt').unlink(),
    'garbage tree metadata': lambda d: (d / 'state' / '_METADATA').write_text('{garbage'),
}


def corruption_trials(root, data, source, steps, cases=None):
  rows = []
  for name, damage in list(CORRUPTIONS.items())[:cases]:
    workdir = root / name.replace(' ', '_')
    shutil.copytree(source, workdir)
    newest, previous = steps_of(workdir)[-1], steps_of(workdir)[-2]
    damage(workdir / 'checkpoints' / str(newest))
    result = run(command(data, workdir, steps + 5))
    aside = sorted(p.name for p in (workdir / 'corrupt_checkpoints').iterdir()) if (
        workdir / 'corrupt_checkpoints').exists() else []
    resumed = next((line.split('Starting at step ')[1].split()[0] for line in result.stderr.splitlines()
                    if 'Starting at step' in line), '?')
    ok = result.returncode == 0 and aside == [str(newest)] and resumed == str(previous)
    rows.append((name, f'checkpoint {newest}', f'set aside {aside}, resumed at {resumed}, exit {result.returncode}',
                 'as designed' if ok else 'UNEXPECTED'))
    print(' | '.join(rows[-1]), flush=True)
  return rows


def storage_full_trial(root, source):
  """ENOSPC from orbax's file writes in the middle of a save (in process): the previous checkpoint stays."""
  import jax  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import async_path  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib  # pylint: disable=g-import-not-at-top
  workdir = root / 'storage_full'
  shutil.copytree(source, workdir)
  store = checkpoints_lib.Checkpoints(workdir, keep=3, async_save=False)
  newest = store.latest_step()
  state, data_state = store.restore(None, newest)
  before = listing(workdir / 'checkpoints')

  async def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device')
  real = async_path.write_text
  async_path.write_text = no_space
  error = None
  try:
    store.save(newest + 5, state, data_state, force=True)
    store.wait()
  except Exception as e:  # pylint: disable=broad-except  (whatever orbax raises, it must raise)
    error = e
  finally:
    async_path.write_text = real
  store.close()
  store = checkpoints_lib.Checkpoints(workdir, keep=3)
  listed = store.steps()
  restored, _ = store.restore_newest_good(checkpoints_lib.abstract_like(jax.device_put(state)))
  restored_step = int(restored['step'])  # restored as saved, without a template: a dict
  ok = error is not None and max(listed) == newest and restored_step == newest and all(
      p in listing(workdir / 'checkpoints') for p in before)
  row = ('storage full during a save', f'save of {newest + 5} (ENOSPC)',
         f'save raised {type(error).__name__ if error else "nothing"}; listed {listed}; restored {restored_step}',
         'previous intact' if ok else 'UNEXPECTED')
  print(' | '.join(row), flush=True)
  return [row]


CONFIG_CHANGES = (('grad_clip_norm 0 -> 1.0', '--config.grad_clip_norm=1.0', True),
                  ('model shape (d_ff 64 -> 48)', '--config.model.d_ff=48', False),
                  ('vocabulary size 64 -> 80', '--config.vocab_size=80', False))


def config_change_trials(root, data, source, steps, cases=None):
  rows = []
  for name, flag, expect_resume in CONFIG_CHANGES[:cases]:
    workdir = root / ('change_' + flag.split('=')[0].split('.')[-1])
    shutil.copytree(source, workdir)
    before, old_steps = listing(workdir), steps_of(workdir)
    result = run(command(data, workdir, steps + 5, flag))
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''
    if expect_resume:  # retention (keep 3) may then drop the oldest checkpoint: that is not a move
      moved = (workdir / 'corrupt_checkpoints').exists()
      outcome = f'resumed, exit {result.returncode}, checkpoints {old_steps} -> {steps_of(workdir)}'
      ok = result.returncode == 0 and not moved and steps_of(workdir) == (old_steps + [steps + 5])[-3:]
    else:
      moved = (workdir / 'corrupt_checkpoints').exists() or listing(workdir) != before
      outcome = f'exit {result.returncode}: {last[:110]}'
      ok = result.returncode == 1 and not moved and last.startswith('error:')
    rows.append((f'config change: {name}', 'rerun', outcome, ('MOVED' if moved else 'nothing moved') +
                 ('' if ok else ' UNEXPECTED')))
    print(' | '.join(rows[-1]), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--trials', type=int, default=10)
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--skip', default='', help='comma list of parts to skip: kill,corrupt,storage,config')
  parser.add_argument('--smoke', action='store_true', help='every part once, quickly: a 10-step run, one kill '
                      'trial, the first corruption and the first config change')
  args = parser.parse_args()
  cases = 1 if args.smoke else None
  if args.smoke:
    args.trials, args.steps = 1, 10
  skip = set(args.skip.split(','))
  rng = random.Random(args.seed)
  root = __import__('pathlib').Path(tempfile.mkdtemp(prefix='reliability_'))
  data = root / 'data'
  write_corpus(data)
  for name in ('warm_up', 'reference'):  # the first fills the compilation cache: the reference times warm steps
    duration, returncode, log_path = training_seconds(data, root / name, args.steps)
    if returncode:
      sys.exit(log_path.read_text()[-3000:])
  print(f'reference run (compilation cache warm): {args.steps} steps in {duration:.2f} s after start-up',
        flush=True)
  reference = final_params(root / 'reference', args.steps)
  parts = {'corrupt': lambda: corruption_trials(root, data, root / 'reference', args.steps, cases),
           'storage': lambda: storage_full_trial(root, root / 'reference'),
           'config': lambda: config_change_trials(root, data, root / 'reference', args.steps, cases),
           'kill': lambda: kill_trials(root, data, reference, duration, args.steps, args.trials, rng)}
  rows = []
  for name, part in parts.items():
    if name in skip:
      continue
    try:
      rows += part()
    except Exception as e:  # pylint: disable=broad-except  (a broken part is a row, the others still run)
      rows.append((name, 'bench error', f'{type(e).__name__}: {str(e)[:200]}', 'NOT MEASURED'))
      print(' | '.join(rows[-1]), flush=True)
  print('\n| case | fault | what happened | result |\n|---|---|---|---|')
  for row in rows:
    print('| ' + ' | '.join(row) + ' |')
  shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
  main()
