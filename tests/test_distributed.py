"""Two training processes joined by jax.distributed on localhost (CPU): train, checkpoint from both, restart
both, resume; the resumed run ends where an uninterrupted two-process run ends."""
import json
import os
import re
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


_STARTED = []  # every trainer start_processes started, for the fixture below


@pytest.fixture(autouse=True)
def _stop_started_processes():
  """Kills the trainers a test started that still run when it ends: a test that fails, or that pytest-timeout stops,
  does not leave its processes waiting in a collective."""
  yield
  while _STARTED:
    proc = _STARTED.pop()
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def start_processes(data_dir, workdir, num_steps, num_processes=2, overrides=()):
  port = free_port()
  env = subprocess_env(JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags_without_device_count())  # one CPU device a process
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, 'multiprocess_train.py'), str(port), str(i),
                             str(num_processes), str(data_dir), str(workdir), str(num_steps), *overrides],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  _STARTED.extend(procs)
  return procs


def run_processes(data_dir, workdir, num_steps, num_processes=2, overrides=(), procs=None, timeout=900):
  """Starts every process of a job (or takes `procs`, started), waits for all (`timeout` seconds each: a job whose
  hosts disagree hangs in a collective); returns their RESULT lines."""
  procs = procs or start_processes(data_dir, workdir, num_steps, num_processes, overrides)
  outputs = []
  for proc in procs:
    out, _ = proc.communicate(timeout=timeout)  # on a timeout the test fails and its fixture kills them all
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


# Every variable the start reads: the tests set what they simulate on a clean environment.
LAUNCH_VARIABLES = ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'JAX_LOCAL_DEVICE_IDS',
                    'CUDA_VISIBLE_DEVICES', 'SLURM_STEP_NUM_NODES', 'OMPI_COMM_WORLD_SIZE',
                    'OMPI_COMM_WORLD_LOCAL_SIZE', 'SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS',
                    'SLURM_PROCID', 'SLURM_LOCALID', 'OMPI_MCA_orte_hnp_uri', 'OMPI_COMM_WORLD_RANK',
                    'OMPI_COMM_WORLD_LOCAL_RANK', 'OMPI_VERSION')
# What srun --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 gives the task on the second node.
SRUN_TASK = {'SLURM_JOB_ID': '1234', 'SLURM_STEP_NODELIST': 'gpu[1-2]', 'SLURM_NTASKS': '2', 'SLURM_PROCID': '1',
             'SLURM_LOCALID': '0', 'SLURM_STEP_NUM_NODES': '2', 'CUDA_VISIBLE_DEVICES': '0,1,2,3,4,5,6,7'}


@pytest.fixture
def clean_environment(monkeypatch):
  for name in LAUNCH_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(distributed, 'on_cloud_tpu_vm', lambda: False)
  return monkeypatch


def test_single_machine_without_coordinator_does_not_initialize(clean_environment):
  assert distributed.initialize('auto') is False
  assert distributed.initialize('off', coordinator_address='localhost:1') is False
  with pytest.raises(ValueError, match='--distributed'):
    distributed.initialize('sometimes')


def test_cluster_detection_reads_the_variables_jax_reads(clean_environment):
  """SLURM_JOB_ID with SLURM_NTASKS > 1 is also what an salloc or sbatch shell has; JAX's SLURM detection needs
  SLURM_STEP_NODELIST, SLURM_PROCID and SLURM_LOCALID too (an srun step's tasks), so only all of them together
  are a SLURM job."""
  monkeypatch = clean_environment
  assert distributed.cluster_from_environment() is None
  monkeypatch.setenv('SLURM_JOB_ID', '7')
  monkeypatch.setenv('SLURM_NTASKS', '16')
  assert distributed.cluster_from_environment() is None  # an salloc or sbatch shell: not a task of a step
  for name, value in SRUN_TASK.items():
    monkeypatch.setenv(name, value)
  assert distributed.cluster_from_environment() == 'slurm'
  monkeypatch.setenv('SLURM_NTASKS', '1')
  assert distributed.cluster_from_environment() is None  # a one-task step: a single process
  monkeypatch.delenv('SLURM_NTASKS')
  monkeypatch.setenv('OMPI_COMM_WORLD_SIZE', '4')
  assert distributed.cluster_from_environment() == 'openmpi'
  monkeypatch.delenv('OMPI_COMM_WORLD_SIZE')
  monkeypatch.setattr(distributed, 'on_cloud_tpu_vm', lambda: True)
  assert distributed.cluster_from_environment() == 'tpu'


def initialize_as_jax_would(monkeypatch, environment):
  """The coordinator, process count, process id and local device ids JAX settles on for distributed.initialize's
  call in `environment` (JAX's own cluster detection fills in what the call leaves unset)."""
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  for name, value in environment.items():
    monkeypatch.setenv(name, value)
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kwargs: calls.append(kwargs))
  assert distributed.initialize('auto')
  (call,) = calls
  return clusters.ClusterEnv.auto_detect_unset_distributed_params(
      call['coordinator_address'], call['num_processes'], call['process_id'], call.get('local_device_ids'), None,
      None)


def test_one_srun_task_per_node_drives_all_the_nodes_gpus(clean_environment):
  """With one process per node, JAX's SLURM detection alone would give each process the single GPU numbered
  SLURM_LOCALID (GPU 0 of 8); the task must get all GPUs of its node. One task per GPU keeps JAX's choice."""
  assert initialize_as_jax_would(clean_environment, SRUN_TASK) == ('gpu1:62674', 2, 1, list(range(8)))
  one_per_gpu = dict(SRUN_TASK, SLURM_NTASKS='16', SLURM_PROCID='9', SLURM_LOCALID='1')
  assert initialize_as_jax_would(clean_environment, one_per_gpu) == ('gpu1:62674', 16, 9, [1])
  for name, value in SRUN_TASK.items():  # one task per node again: the node's GPUs, unless the user chose them
    clean_environment.setenv(name, value)
  assert distributed.local_device_ids('slurm') == list(range(8))
  clean_environment.setenv('JAX_LOCAL_DEVICE_IDS', '0,1')  # the user's choice: left to JAX, which reads it
  assert distributed.local_device_ids('slurm') is None


def test_mpirun_inside_a_slurm_job_keeps_jaxs_open_mpi_choice(clean_environment):
  """mpirun in a SLURM job starts its daemons with one srun task per node, so its processes also carry that
  step's SLURM variables (two tasks on two nodes: one per node). JAX takes Open MPI's ranks first; with 8 ranks
  a node each process drives the one GPU of its local rank, not all 8."""
  mpirun_rank = dict(SRUN_TASK, OMPI_MCA_orte_hnp_uri='1531576320.0;tcp://10.0.0.1:34911', OMPI_COMM_WORLD_SIZE='16',
                     OMPI_COMM_WORLD_RANK='11', OMPI_COMM_WORLD_LOCAL_RANK='3', OMPI_COMM_WORLD_LOCAL_SIZE='8')
  assert initialize_as_jax_would(clean_environment, mpirun_rank) == ('10.0.0.1:62624', 16, 11, [3])


@pytest.mark.parametrize('environment', [
    # launch/gpu_multinode.sh --slurm --nodes 1: srun --nodes 1 --ntasks-per-node 1 ... train --distributed=on
    dict(SRUN_TASK, SLURM_STEP_NODELIST='gpu1', SLURM_NTASKS='1', SLURM_PROCID='0', SLURM_STEP_NUM_NODES='1'),
    {'OMPI_COMM_WORLD_SIZE': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '1'}])  # mpirun -np 1
def test_on_in_a_one_process_job_joins_it(clean_environment, environment):
  """--distributed=on in a one-task srun step or a one-process mpirun joins that job (one process, the node's
  GPUs), not an error that no srun step or Open MPI job was found; auto runs it as a plain single process."""
  for name, value in environment.items():
    clean_environment.setenv(name, value)
  calls = []
  clean_environment.setattr(jax.distributed, 'initialize', lambda **kwargs: calls.append(kwargs))
  assert distributed.initialize('auto') is False and not calls
  assert distributed.initialize('on') is True
  (call,) = calls
  assert call['coordinator_address'] is None and call['num_processes'] is None and call['process_id'] is None
  if 'SLURM_JOB_ID' in environment:
    assert call['local_device_ids'] == list(range(8))


def test_a_one_task_slurm_job_runs_its_process_alone_without_srun(clean_environment):
  # Catches an sbatch script of one task (--ntasks=1) that runs the trainer directly refused as a job of several
  # tasks outside its srun step: it is a single process.
  calls = []
  clean_environment.setattr(jax.distributed, 'initialize', lambda **kwargs: calls.append(kwargs))
  clean_environment.setenv('SLURM_JOB_ID', '5')
  clean_environment.setenv('SLURM_NTASKS', '1')
  assert distributed.initialize('auto') is False and not calls


@pytest.mark.parametrize('mode,environment,message', [
    # An salloc or sbatch shell: the job has two tasks, but this process is not one of them.
    ('auto', {'SLURM_JOB_ID': '5', 'SLURM_NTASKS': '2'}, 'run it under srun'),
    ('on', {'SLURM_JOB_ID': '5', 'SLURM_NTASKS': '2', 'SLURM_PROCID': '0'}, 'SLURM_STEP_NODELIST, SLURM_LOCALID unset'),
    ('on', {}, 'set JAX_COORDINATOR_ADDRESS (--coordinator_address), JAX_NUM_PROCESSES'),
    ('auto', {'JAX_COORDINATOR_ADDRESS': 'h:1'}, 'without JAX_NUM_PROCESSES (--num_processes), JAX_PROCESS_ID'),
    # Process 1 of 2 without a coordinator: not a lone process 0 that writes the shared workdir as the leader.
    ('auto', {'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '1'}, 'set JAX_COORDINATOR_ADDRESS (--coordinator_address)'),
    ('auto', {'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': 'two', 'JAX_PROCESS_ID': '0'},
     "JAX_NUM_PROCESSES must be an integer, not 'two'")])
def test_a_start_that_lacks_something_raises_an_error_naming_it(clean_environment, mode, environment, message):
  """A multi-process start that cannot proceed raises DistributedError naming what is missing, never JAX's
  ValueError ('coordinator_address should be defined.') or int()'s."""
  for name, value in environment.items():
    clean_environment.setenv(name, value)
  with pytest.raises(distributed.DistributedError, match=re.escape(message)):
    distributed.initialize(mode)


@pytest.mark.parametrize('address,valid', [
    ('node1:12355', True), ('10.0.0.1:1', True), ('[fd00::1]:12355', True), ('node1:65535', True),
    ('node1', False), ('node1:', False), (':12355', False), ('node1:http', False), ('node1:0', False),
    ('node1:65536', False), ('fd00::1:12355', False), ('node1:12355 ', False)])
def test_the_coordinator_address_is_host_and_port(clean_environment, address, valid):
  """An address without a port made JAX raise IndexError (a traceback), a named port failed to start the service,
  and an IPv6 address without brackets left every process waiting until it aborted: each is one DistributedError
  before JAX is called, from the flag or from JAX_COORDINATOR_ADDRESS alike."""
  calls = []
  clean_environment.setattr(jax.distributed, 'initialize', lambda **kwargs: calls.append(kwargs))
  for given in ({'coordinator_address': address}, {}):
    clean_environment.setenv('JAX_COORDINATOR_ADDRESS', 'unused:1' if given else address)
    if valid:
      assert distributed.initialize('on', num_processes=2, process_id=1, **given)
      assert calls.pop()['coordinator_address'] == address
    else:
      with pytest.raises(distributed.DistributedError, match=re.escape(f'{address!r}') + '.* must be HOST:PORT'):
        distributed.initialize('on', num_processes=2, process_id=1, **given)
      assert not calls


def test_a_start_jax_refuses_raises_an_error(clean_environment):
  """What jax.distributed.initialize refuses (an id out of range, a coordinator that does not answer) reaches
  the trainer as DistributedError, not as JAX's exception."""
  def refuse(**_):
    raise ValueError('process_id and num_processes must be nonnegative, with process_id < num_processes.')
  clean_environment.setattr(jax.distributed, 'initialize', refuse)
  with pytest.raises(distributed.DistributedError, match='failed: process_id and num_processes'):
    distributed.initialize('on', 'localhost:1', 2, 5)


def test_the_trainer_reports_a_bad_start_in_one_error_line(tmp_path):
  """`python -m flaxformer_nmt.train` in an salloc shell (SLURM_NTASKS=2, no srun step) exits non-zero with one
  `error:` line saying to run it under srun, not a traceback."""
  env = subprocess_env(JAX_PLATFORMS='cpu', SLURM_JOB_ID='5', SLURM_NTASKS='2')
  for name in ('JAX_COORDINATOR_ADDRESS', 'SLURM_STEP_NODELIST'):
    env.pop(name, None)
  out = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.train', '--config', 'configs/multi30k.py',
                        '--workdir', str(tmp_path / 'w')], cwd=os.path.dirname(HERE), env=env,
                       capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode != 0 and 'Traceback' not in out.stderr, out.stderr
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('error: this SLURM job has 2 tasks') and 'srun' in last, out.stderr
