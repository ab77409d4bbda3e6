"""What the trainer reports: per-interval training metrics, the log line, and where they are written.

The train step returns its metrics as device arrays; `TrainInterval` keeps them unread until a log line or a
save is due, so the loop never waits on the device between those (one host transfer per interval). The loss
logged as `train/loss` and `eval/loss` is the label-smoothed cross entropy per target token (what the step
minimizes, step.label_smoothed_cross_entropy), `*/nll` the plain cross entropy per target token, and
`eval/perplexity` exp(eval/nll).
"""
import collections
import contextlib
import json
import time

import jax
import numpy as np
from etils import epath

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.runtime import distributed
from flaxformer_nmt.runtime import flops as flops_lib


class MetricsLog:
  """TensorBoard scalars and metrics.jsonl, written by process 0 only.

  Cloud storage (gs://...) has no append: there metrics.jsonl is rewritten whole at each write (a few
  thousand lines over a long run); local files are appended to.
  """

  def __init__(self, workdir):
    self.enabled = distributed.is_leader()
    if self.enabled:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self.writer = SummaryWriter(str(epath.Path(workdir) / 'tensorboard'))
      self.path = epath.Path(workdir) / 'metrics.jsonl'
      self.remote = '://' in str(self.path)
      if self.remote:
        self.lines = self.path.read_text().splitlines(keepends=True) if self.path.exists() else []
      else:
        self.jsonl = self.path.open('a')

  def write(self, step, scalars):
    if not self.enabled:
      return
    for name, value in scalars.items():
      if isinstance(value, str):  # e.g. the sacreBLEU signature
        self.writer.add_text(name, value, step)
      else:
        self.writer.add_scalar(name, value, step)
    line = json.dumps({'step': step, **scalars}) + '\n'
    if self.remote:
      self.lines.append(line)
      self.path.write_text(''.join(self.lines))
    else:
      self.jsonl.write(line)
      self.jsonl.flush()

  def close(self):
    if self.enabled:
      self.writer.close()
      if not self.remote:
        self.jsonl.close()


def duration(seconds):
  """'1h05m' or '4m07s'."""
  seconds = int(seconds)
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m' if seconds >= 3600 else f'{seconds // 60}m{seconds % 60:02d}s'


class NonFiniteError(RuntimeError):
  """A NaN/Inf loss or gradient, with config.skip_nonfinite_updates off."""


def check_finite(unchecked, first_step, skip_nonfinite_updates, learning_rate_schedule='paper'):
  """Consumes the per-step NaN/Inf flags of `unchecked` (steps first_step+1...); returns how many were set.

  Raises NonFiniteError naming the first such step unless skip_nonfinite_updates; its advice names the field that
  sets the peak of `learning_rate_schedule` (config.learning_rate_schedule).
  """
  flags = [int(f) for flag in jax.device_get(unchecked) for f in np.ravel(flag)]  # a step's, or one call's steps'
  unchecked.clear()
  if any(flags) and not skip_nonfinite_updates:
    bad = first_step + flags.index(1) + 1
    raise NonFiniteError(f'step {bad}: the loss or a gradient is NaN/Inf; the update was not applied and '
                         'training stopped (the newest checkpoint holds the last good state). Lower the '
                         f'learning rate (--config.{config_lib.PEAK_FIELDS[learning_rate_schedule]}), clip '
                         'gradients (--config.grad_clip_norm=1.0) or skip such updates '
                         '(--config.skip_nonfinite_updates=true), and rerun the same command: it resumes from that '
                         'checkpoint with the new setting.')
  return sum(flags)


class Throughput:
  """Model FLOPs of the logged steps, from each step's token counts and padded lengths (flops.py), as
  FLOP/s and MFU against the devices' peak (omitted where the peak is unknown, e.g. CPU)."""

  def __init__(self, model_config, vocab_size, num_devices, peak_per_device):
    self.model_config, self.vocab_size = model_config, vocab_size
    self.num_devices, self.peak_per_device = num_devices, peak_per_device

  def metrics(self, pending, lengths, seconds):
    """pending: the steps' metrics on the host; lengths: their (source, target) padded lengths."""
    total = sum(flops_lib.train_flops(self.model_config, self.vocab_size, float(m['source_tokens']),
                                      float(m['target_tokens']), src_len, tgt_len)
                for m, (src_len, tgt_len) in zip(pending, lengths))
    out = {'train/tflops_per_second': total / seconds / 1e12,
           'train/tflops_per_second_per_device': total / seconds / 1e12 / self.num_devices}
    if self.peak_per_device:
      out['train/mfu'] = total / seconds / (self.peak_per_device * self.num_devices)
    return out


def per_step(metrics):
  """[one step's metrics] of a step's metrics, or of several steps' stacked on a leading axis (TrainStep.many)."""
  if np.ndim(metrics['loss_sum']) == 0:
    return [metrics]
  return [{name: value[i] for name, value in metrics.items()} for i in range(len(metrics['loss_sum']))]


def interval_metrics(pending, seconds, start_time, epoch, lengths=None, throughput=None):
  """Summary of the steps since the last log line (one host transfer for all of them); `pending` holds each
  call's metrics (per_step)."""
  pending = [step for metrics in jax.device_get(pending) for step in per_step(metrics)]
  total = lambda key: sum(float(m[key]) for m in pending)
  tokens = total('target_tokens')
  accounting = throughput.metrics(pending, lengths, seconds) if throughput is not None else {}
  if 'rdrop_divergence_sum' in pending[0]:  # R-Drop: per example's target token (both copies count in tokens)
    accounting['train/rdrop_divergence'] = total('rdrop_divergence_sum') / max(tokens / 2, 1.0)
  return {
      **accounting,
      'train/loss': total('loss_sum') / max(tokens, 1.0),  # label-smoothed cross entropy per target token
      'train/nll': total('nll_sum') / max(tokens, 1.0),
      'train/learning_rate': float(pending[-1]['learning_rate']),
      'train/grad_norm': float(pending[-1]['grad_norm']),
      'train/target_tokens_per_second': tokens / seconds,
      'train/source_tokens_per_second': total('source_tokens') / seconds,
      'train/step_time': seconds / len(pending),
      'train/skipped_updates': total('nonfinite'),
      'elapsed_seconds': time.time() - start_time,
      'epoch': epoch,
  }


class TrainInterval:
  """The steps since the last log line: their metrics (device arrays, read only when summarized), padded
  lengths (for the FLOP count), the time the loop waited for input, and the NaN flags not yet checked."""

  def __init__(self, throughput, skip_nonfinite_updates, learning_rate_schedule='paper'):
    self.throughput, self.skip_nonfinite_updates = throughput, skip_nonfinite_updates
    self.learning_rate_schedule = learning_rate_schedule
    self.pending, self.lengths, self.unchecked = [], [], []
    self.skipped = 0  # updates skipped as non-finite in this launch (a resume counts from 0)
    self.restart()

  def restart(self):
    """Starts the clock of a new interval (after a log line)."""
    self.start, self.data_wait = time.time(), 0.0

  @contextlib.contextmanager
  def paused(self):
    """Keeps the block's time (an evaluation, a compile) out of the interval's seconds, and so out of tokens/s and step
    time; the steps before it stay in the interval with theirs."""
    start = time.time()
    try:
      yield
    finally:
      self.start += time.time() - start

  def next_batch(self, batches):
    wait_start = time.time()
    batch = next(batches)
    self.data_wait += time.time() - wait_start  # time the step loop stood waiting for input
    return batch

  def add(self, metrics, batches):
    """A call's metrics (device arrays; of several steps, stacked) and the host batches of its steps."""
    self.pending.append(metrics)
    self.lengths.extend((batch['src'].shape[1], batch['tgt_in'].shape[1]) for batch in batches)
    self.unchecked.append(metrics['nonfinite'])

  def check_finite(self, step):
    """Reads the unchecked steps' NaN flags (up to `step`): raises NonFiniteError or counts them as skipped."""
    unchecked_steps = sum(np.size(flags) for flags in self.unchecked)
    self.skipped += check_finite(self.unchecked, step - unchecked_steps, self.skip_nonfinite_updates,
                                 self.learning_rate_schedule)

  def summarize(self, start_time, epoch):
    """The interval's metrics (interval_metrics plus the input wait); starts the next interval."""
    summary = interval_metrics(self.pending, time.time() - self.start, start_time, epoch, self.lengths,
                               self.throughput)
    summary['train/data_wait_fraction'] = self.data_wait / (time.time() - self.start)
    self.pending, self.lengths = [], []
    self.restart()
    return summary


def train_log_line(step, num_steps, metrics, eta_seconds, skipped=0):
  mfu = f' | MFU {metrics["train/mfu"]:.1%}' if 'train/mfu' in metrics else ''
  return (f'step {step}/{num_steps} | loss {metrics["train/loss"]:.4f} | nll {metrics["train/nll"]:.4f} | '
          f'lr {metrics["train/learning_rate"]:.3g} | {metrics["train/target_tokens_per_second"]:.0f} tgt + '
          f'{metrics["train/source_tokens_per_second"]:.0f} src tok/s | '
          f'{metrics["train/tflops_per_second"]:.3g} TFLOP/s{mfu} | {metrics["train/step_time"] * 1e3:.0f} ms/step | '
          f'epoch {metrics["epoch"]} | {duration(metrics["elapsed_seconds"])} elapsed | ETA {duration(eta_seconds)}'
          + (f' | {skipped} skipped updates' if skipped else ''))


def eval_log_line(step, metrics):
  accuracy = f' | masked-token accuracy {metrics["eval/accuracy"]:.2%}' if 'eval/accuracy' in metrics else ''
  return (f'step {step} | validation loss {metrics["eval/loss"]:.4f} | nll {metrics["eval/nll"]:.4f} | '
          f'perplexity {metrics["eval/perplexity"]:.2f}{accuracy}')


class WallClock:
  """A launch's wall seconds by phase (set-up, compiling: each train program's first call, validation, saves,
  finishing), the rest being the loop's steps: `phases()` for its last log line and metrics.jsonl (`wall/...`),
  so that the time outside the train step is read off a run (bench/train_throughput.py --trainer_steps)."""

  def __init__(self):
    self.start, self.seconds = time.perf_counter(), collections.Counter()

  @contextlib.contextmanager
  def phase(self, name):
    start = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] += time.perf_counter() - start

  def phases(self):
    """{'wall/total': s, 'wall/steps': s, 'wall/PHASE': s ...}: the phases and the loop's steps (the rest)."""
    total = time.perf_counter() - self.start
    out = {f'wall/{name}': seconds for name, seconds in self.seconds.items()}
    return {'wall/total': total, 'wall/steps': total - sum(self.seconds.values()), **out}


def wall_log_line(phases):
  """'Wall time 464.0 s: steps 411.2 s (88.6%), set-up 10.1 s (2.2%), ...'."""
  total = phases['wall/total']
  parts = [f'{name[5:]} {seconds:.1f} s ({100 * seconds / total:.1f}%)'
           for name, seconds in phases.items() if name != 'wall/total']
  return f'Wall time {total:.1f} s: ' + ', '.join(parts)
