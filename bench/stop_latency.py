r"""Seconds from a preemption notice (SIGTERM) to the trainer's exit, on a real config, through the CLI.

A preempted cloud VM is killed about 30 s after its SIGTERM (GCE spot/preemptible VMs; AWS gives 2 minutes):
the trainer must finish the step, save and exit within that, or the work since the last checkpoint is lost.

  python bench/stop_latency.py --config configs/multi30k_best.py                 # signal 20 s after step 100
  python bench/stop_latency.py --config configs/multi30k_best.py --after_step 100 --delay 7 --trials 2

Each trial trains a fresh workdir until the log line of step --after_step, waits --delay seconds more (so the
signal falls mid-interval, where the loop has had time to run ahead of the device), sends SIGTERM and times
the exit. It prints: seconds to exit; the step the run stopped (and saved) at; the step the device had reached
at the signal, estimated from the logged step time (the latest step logged once --after_step's line or a later
one appeared, + delay / step time, the step time being the median of the intervals logged before the signal after
the first, which holds compiling; '-' where no interval is steady or the logged time rounds to 0 ms); and the
difference, the steps the loop had dispatched ahead (meaningful when the device step dominates: for a toy model
of a few ms per step, Python's per-step work sets the pace and the estimate runs far past the real step). Extra
--config.FIELD=VALUE arguments go to the trainer. Measured with it and by hand: bench/RESULTS.md.

  python bench/stop_latency.py --smoke    # seconds: a tiny model on a generated corpus, SIGTERM after step 5
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# A model of a few milliseconds a step that trains until the signal, for --smoke.
SMOKE_OVERRIDES = {'vocab_size': 64, 'tokens_per_batch': 512, 'length_buckets': '(32,)',
                   'num_train_steps': 1_000_000, 'log_every_steps': 5, 'eval_every_steps': 1_000_000,
                   'checkpoint_every_steps': 1_000_000, 'average_last_checkpoints': 0,
                   'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1, 'model.d_model': 32,
                   'model.d_ff': 64, 'model.num_heads': 2, 'model.dtype': 'float32'}
STEP_LINE = re.compile(r'step (\d+)/\d+ \|.* (\d+) ms/step')
STOP_LINE = re.compile(r'Stopping at step (\d+) after')


def wait_for_step(log_path, process, step, timeout):
  """Blocks until the log has the line of step `step` or a later one; returns the latest step logged then (where
  the loop logs every N steps, `step` itself may have no line)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    logged = [int(match.group(1)) for match in STEP_LINE.finditer(open(log_path).read())]
    if logged and max(logged) >= step:
      return max(logged)
    if process.poll() is not None:
      sys.exit(f'the trainer exited ({process.returncode}) before step {step}; log: {log_path}')
    time.sleep(0.05)
  sys.exit(f'no step {step} within {timeout} s; log: {log_path}')


def steady_ms_per_step(log_text):
  """The median ms/step of the logged intervals after the first (which includes compiling); None where there
  are none or it is 0 (a step faster than the log's 1 ms resolution)."""
  intervals = sorted(int(m.group(2)) for m in list(STEP_LINE.finditer(log_text))[1:])
  if not intervals:
    return None
  n = len(intervals)
  median = intervals[n // 2] if n % 2 else (intervals[n // 2 - 1] + intervals[n // 2]) / 2
  return median or None


def trial(args, extra, workdir):
  """(seconds to exit, stop step, estimated device step at the signal or None, ms per step or None)."""
  log_path = workdir + '.log'
  command = [sys.executable, '-m', 'flaxformer_nmt.train', f'--config={args.config}', f'--workdir={workdir}'] + extra
  with open(log_path, 'w') as log:
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  logged_step = wait_for_step(log_path, process, args.after_step, args.timeout)
  time.sleep(args.delay)
  ms_per_step = steady_ms_per_step(open(log_path).read())
  signalled = time.time()
  process.send_signal(signal.SIGTERM)
  returncode = process.wait(timeout=args.timeout)
  seconds = time.time() - signalled
  stop = STOP_LINE.search(open(log_path).read())
  if returncode != 0 or not stop:
    sys.exit(f'the trainer did not stop cleanly (exit {returncode}); log: {log_path}')
  device_step = logged_step + args.delay * 1000 / ms_per_step if ms_per_step else None
  return seconds, int(stop.group(1)), device_step, ms_per_step


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default=os.path.join(REPO, 'configs/multi30k_best.py'))
  parser.add_argument('--after_step', type=int, default=100, help='Signal after this step\'s log line...')
  parser.add_argument('--delay', type=float, default=20.0, help='...and this many seconds more.')
  parser.add_argument('--trials', type=int, default=1)
  parser.add_argument('--timeout', type=float, default=900)
  parser.add_argument('--keep', action='store_true', help='Keep the workdirs and logs (printed).')
  parser.add_argument('--smoke', action='store_true', help='A tiny model on a generated corpus (configs/base.py '
                      'with SMOKE_OVERRIDES), SIGTERM 1 s after step 5: the whole path in seconds.')
  args, extra = parser.parse_known_args()
  root = tempfile.mkdtemp(prefix='stop_latency_')
  if args.smoke:
    from input_pipeline import write_smoke_corpus  # pylint: disable=g-import-not-at-top  (bench/, beside this)
    write_smoke_corpus(os.path.join(root, 'data'))
    args.config, args.after_step, args.delay, args.timeout = os.path.join(REPO, 'configs/base.py'), 5, 1.0, 300
    extra = [f'--config.data_dir={os.path.join(root, "data")}', '--config.data_download='] + [
        f'--config.{name}={value}' for name, value in SMOKE_OVERRIDES.items()] + extra
  print(f'{os.path.relpath(args.config, REPO)}: SIGTERM {args.delay:g} s after step {args.after_step}\'s log line\n')
  print('| trial | seconds to exit | stopped at step | device step at the signal (est.) | steps ahead | ms/step |')
  print('|---:|---:|---:|---:|---:|---:|')
  for i in range(args.trials):
    seconds, stop_step, device_step, ms = trial(args, extra, os.path.join(root, f'trial{i}'))
    estimate = (f'{device_step:.1f} | {stop_step - device_step:.1f}' if device_step is not None else '- | -')
    print(f'| {i} | {seconds:.1f} | {stop_step} | {estimate} | {ms if ms is not None else "-"} |', flush=True)
  if args.keep:
    print(f'\nworkdirs and logs: {root}')
  else:
    shutil.rmtree(root)


if __name__ == '__main__':
  main()
