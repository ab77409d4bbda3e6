"""The launch scripts in --dry-run mode print the commands they would run."""
import os
import shlex
import subprocess

import pytest

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch')


def dry_run(script, *args):
  out = subprocess.run(['bash', os.path.join(LAUNCH, script), '--dry-run', *args], capture_output=True, text=True,
                       timeout=60, check=True)
  return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def test_gpu_multinode_over_ssh_gives_every_node_its_process_id():
  commands = dry_run('gpu_multinode.sh', '--hosts', 'gpu1,gpu2,gpu3', '--gpus-per-node', '4', '--port', '9999',
                     '--', '--config', 'configs/big.py', '--workdir', '/shared/run big')
  assert len(commands) == 3
  for i, (ssh, host, remote) in enumerate(commands):
    assert ssh == 'ssh' and host == f'gpu{i + 1}'
    assert f'JAX_PROCESS_ID={i} ' in remote
    assert 'JAX_COORDINATOR_ADDRESS=gpu1:9999 JAX_NUM_PROCESSES=3 ' in remote
    assert 'CUDA_VISIBLE_DEVICES=0,1,2,3 ' in remote
    words = shlex.split(remote)
    assert words[words.index('-m'):] == ['-m', 'flaxformer_nmt.train', '--distributed=on', '--config',
                                         'configs/big.py', '--workdir', '/shared/run big']


def test_gpu_multinode_under_slurm_is_one_srun_step():
  (command,) = dry_run('gpu_multinode.sh', '--slurm', '--nodes', '2', '--gpus-per-node', '8', '--',
                       '--config', 'configs/base.py', '--workdir', 'runs/b')
  assert command[:8] == ['srun', '--nodes', '2', '--ntasks-per-node', '1', '--gpus-per-node', '8', '--chdir']
  assert command[command.index('-m'):] == ['-m', 'flaxformer_nmt.train', '--distributed=on', '--config',
                                           'configs/base.py', '--workdir', 'runs/b']


def test_tpu_vm_creates_copies_installs_and_runs_on_all_workers():
  commands = dry_run('tpu_vm.sh', '--name', 'nmt', '--zone', 'us-central2-b', '--project', 'p',
                     '--accelerator-type', 'v4-32', '--create', '--', '--config', 'configs/big.py',
                     '--workdir', 'gs://bucket/runs/big')
  create, mkdir, copy, install, train = commands
  assert create[:5] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create'] and 'v4-32' in create
  assert mkdir[mkdir.index('--command') + 1] == 'mkdir -p ~/flaxformer_nmt'
  # The code goes into ~/flaxformer_nmt/ (not a nested copy of the checkout's folder).
  assert copy[4] == 'scp' and '--worker=all' in copy and copy[-1] == 'nmt:~/flaxformer_nmt/'
  assert {os.path.basename(x) for x in copy if x.startswith('/')} >= {'flaxformer_nmt', 'configs', 'pyproject.toml'}
  for command in (mkdir, install, train):
    assert command[4:6] == ['ssh', 'nmt'] and '--worker=all' in command
    assert command[command.index('--zone') + 1] == 'us-central2-b' and '--project' in command
  remote = shlex.split(train[train.index('--command') + 1])
  assert remote[remote.index('-m'):] == ['-m', 'flaxformer_nmt.train', '--distributed=auto', '--config',
                                         'configs/big.py', '--workdir', 'gs://bucket/runs/big']


@pytest.mark.parametrize('script,args', [('tpu_vm.sh', ['--zone', 'z', '--', '--config', 'c']),
                                         ('gpu_multinode.sh', ['--', '--config', 'c']),
                                         ('tpu_vm.sh', ['--name', 'n', '--zone', 'z'])])
def test_missing_required_options_fail(script, args):
  out = subprocess.run(['bash', os.path.join(LAUNCH, script), '--dry-run', *args], capture_output=True, text=True,
                       timeout=60, check=False)
  assert out.returncode != 0 and 'required' in out.stderr
