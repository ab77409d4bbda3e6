"""Two training processes joined by jax.distributed on localhost (CPU): train, checkpoint from both, restart
both, resume; the resumed run ends where an uninterrupted two-process run ends."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import subprocess_env, xla_flags_without_device_count
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.runtime import distributed

HERE = os.path.dirname(__file__)


def free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def start_processes(data_dir, workdir, num_steps, num_processes=2, overrides=()):
  port = free_port()
  env = subprocess_env(JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags_without_device_count())  # one CPU device a process
  return [subprocess.Popen([sys.executable, os.path.join(HERE, 'multiprocess_train.py'), str(port), str(i),
                            str(num_processes), str(data_dir), str(workdir), str(num_steps), *overrides],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for i in range(num_processes)]


def run_processes(data_dir, workdir, num_steps, num_processes=2, overrides=(), procs=None, timeout=900):
  """Starts every process of a job (or takes `procs`, started), waits for all (`timeout` seconds each: a job whose
  hosts disagree hangs in a collective); returns their RESULT lines."""
  procs = procs or start_processes(data_dir, workdir, num_steps, num_processes, overrides)
  outputs = []
  for proc in procs:
    try:
      out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
    outputs.append(out)
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f'process {i} failed:\n{out[-4000:]}'
  return [next(l for l in out.splitlines() if l.startswith('RESULT ')) for out in outputs]


def params_at(workdir, step):
  return checkpoints_lib.read_params(checkpoints_lib.absolute(workdir) / 'checkpoints' / str(step) / 'state',
                                     subtree='params')


@pytest.mark.slow
def test_two_processes_train_checkpoint_restart_and_resume(toy_corpus, tmp_path):
  workdir, straight = tmp_path / 'run', tmp_path / 'straight'
  first = run_processes(toy_corpus, workdir, 10)
  assert all('devices=2' in line for line in first), first  # one global mesh over both processes
  assert checkpoints_lib.saved_steps(workdir) == [10]

  resumed = run_processes(toy_corpus, workdir, 20)
  assert checkpoints_lib.saved_steps(workdir) == [10, 20]
  # Both processes averaged together at the end (process 0 wrote the index).
  assert json.loads((workdir / 'averaged' / 'averaged.json').read_text()) == {'steps': [10, 20]}
  logged = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  # Only process 0 logs: each train step interval appears once, across both runs.
  assert [m['step'] for m in logged if 'train/loss' in m] == [5, 10, 15, 20]
  # Both processes saw the same global loss.
  assert len({line.split('loss=')[1] for line in resumed}) == 1

  uninterrupted = run_processes(toy_corpus, straight, 20)
  assert resumed[0].split('loss=')[1] == uninterrupted[0].split('loss=')[1]
  for a, b in zip(jax.tree_util.tree_leaves(params_at(workdir, 20)),
                  jax.tree_util.tree_leaves(params_at(straight, 20))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sigterm_to_one_process_makes_both_save_the_same_step_and_the_resume_is_exact(toy_corpus, tmp_path):
  """A preemption notice reaches one host only: JAX's preemption sync manager tells the other, both save the
  same step (no host sync per step) and exit 0; the resumed job ends where an uninterrupted one ends."""
  workdir, straight = tmp_path / 'run', tmp_path / 'straight'
  overrides = ('checkpoint_every_steps=100000', 'eval_every_steps=100000', 'log_every_steps=5')
  procs = start_processes(toy_corpus, workdir, 100000, overrides=overrides)
  metrics = workdir / 'metrics.jsonl'
  deadline = time.time() + 400
  while not (metrics.exists() and '"train/loss"' in metrics.read_text()):  # step 5 logged: both are training
    assert time.time() < deadline and all(p.poll() is None for p in procs)
    time.sleep(0.1)
  procs[1].send_signal(signal.SIGTERM)
  stopped = run_processes(toy_corpus, workdir, 100000, procs=procs)  # both exited 0
  steps = checkpoints_lib.saved_steps(workdir)
  assert len(steps) == 1 and 5 <= steps[0] < 100000  # one checkpoint, the preemption's, by both processes
  assert {line.split('step=')[1].split()[0] for line in stopped} == {str(steps[0])}
  assert not (workdir / 'averaged').exists()  # a paused run is resumed, not averaged

  end = steps[0] + 6
  resumed = run_processes(toy_corpus, workdir, end, overrides=overrides)
  uninterrupted = run_processes(toy_corpus, straight, end, overrides=overrides)
  assert resumed[0].split('loss=')[1] == uninterrupted[0].split('loss=')[1]
  for a, b in zip(jax.tree_util.tree_leaves(params_at(workdir, end)),
                  jax.tree_util.tree_leaves(params_at(straight, end))):
    np.testing.assert_array_equal(a, b)


def test_single_machine_without_coordinator_does_not_initialize(monkeypatch):
  for name in ('JAX_COORDINATOR_ADDRESS', 'SLURM_NTASKS', 'SLURM_JOB_ID', 'OMPI_COMM_WORLD_SIZE'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(distributed, 'on_cloud_tpu_vm', lambda: False)
  assert distributed.initialize('auto') is False
  assert distributed.initialize('off', coordinator_address='localhost:1') is False
  with pytest.raises(ValueError, match='--distributed'):
    distributed.initialize('sometimes')


def test_cluster_detection_reads_the_launchers_environment(monkeypatch):
  monkeypatch.setattr(distributed, 'on_cloud_tpu_vm', lambda: False)
  for name in ('SLURM_NTASKS', 'SLURM_JOB_ID', 'OMPI_COMM_WORLD_SIZE'):
    monkeypatch.delenv(name, raising=False)
  assert distributed.cluster_from_environment() is None
  monkeypatch.setenv('SLURM_JOB_ID', '7')
  monkeypatch.setenv('SLURM_NTASKS', '1')
  assert distributed.cluster_from_environment() is None  # a one-task allocation: a single process
  monkeypatch.setenv('SLURM_NTASKS', '16')
  assert distributed.cluster_from_environment() == 'slurm'
  monkeypatch.delenv('SLURM_NTASKS')
  monkeypatch.setenv('OMPI_COMM_WORLD_SIZE', '4')
  assert distributed.cluster_from_environment() == 'openmpi'
  monkeypatch.delenv('OMPI_COMM_WORLD_SIZE')
  monkeypatch.setattr(distributed, 'on_cloud_tpu_vm', lambda: True)
  assert distributed.cluster_from_environment() == 'tpu'
