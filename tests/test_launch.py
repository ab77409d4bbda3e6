"""The launch scripts in --dry-run mode print every command they would run, in order; run against a fake ssh and
gcloud, Ctrl-C stops every remote process and a failing one fails the launcher."""
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib

import pytest

from conftest import as_a_foreground_job

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch')
TRAIN_ARGS = ['--config', 'configs/wmt14_ende_big.py', '--workdir', 'gs://bucket/runs/big',
              '--config.model.remat', 'full', '--config.seed=3']
# The config part of TRAIN_ARGS (both override forms), which preparation must see too; --workdir it must not.
CONFIG_ARGS = ['--config', 'configs/wmt14_ende_big.py', '--config.model.remat', 'full', '--config.seed=3']


def dry_run(script, *args):
  out = subprocess.run(['bash', os.path.join(LAUNCH, script), '--dry-run', *args], capture_output=True, text=True,
                       timeout=60, check=True)
  return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def module_args(words, module):
  """The arguments after `python3 -m MODULE` in a command's words (None if it does not run MODULE)."""
  for i in range(len(words) - 1):
    if words[i] == '-m' and words[i + 1] == module:
      rest = words[i + 2:]
      return rest[:rest.index('&&')] if '&&' in rest else rest
  return None


def test_gpu_multinode_over_ssh_gives_every_node_its_process_id():
  commands = dry_run('gpu_multinode.sh', '--hosts', 'gpu1,gpu2,gpu3', '--gpus-per-node', '4', '--port', '9999',
                     '--', '--config', 'configs/big.py', '--workdir', '/shared/run big')
  assert len(commands) == 3  # no --tfds-data-dir: nothing to prepare
  for i, (ssh, tty, host, remote) in enumerate(commands):
    assert [ssh, tty] == ['ssh', '-tt'] and host == f'gpu{i + 1}'
    assert f'JAX_PROCESS_ID={i} ' in remote
    assert 'JAX_COORDINATOR_ADDRESS=gpu1:9999 JAX_NUM_PROCESSES=3 ' in remote
    assert 'CUDA_VISIBLE_DEVICES=0,1,2,3 ' in remote
    assert module_args(shlex.split(remote), 'flaxformer_nmt.train') == [
        '--distributed=on', '--config', 'configs/big.py', '--workdir', '/shared/run big']


def test_gpu_multinode_without_config_arguments_still_launches():
  """The config may come from a flag file (`--flagfile run.flags`): no --config among the arguments leaves nothing
  for preparation, and the nodes still start (not a silent exit with status 1 and no command printed)."""
  commands = dry_run('gpu_multinode.sh', '--hosts', 'gpu1,gpu2', '--', '--flagfile', 'run.flags')
  assert [host for *_, host, _ in commands] == ['gpu1', 'gpu2']
  for *_, remote in commands:
    assert module_args(shlex.split(remote), 'flaxformer_nmt.train') == ['--distributed=on', '--flagfile', 'run.flags']


def test_gpu_multinode_coordinator_address_is_the_first_host_without_its_ssh_user():
  """`--hosts alice@node1,...`: ssh needs the user, but JAX_COORDINATOR_ADDRESS must be host:port, never
  alice@node1:port."""
  commands = dry_run('gpu_multinode.sh', '--hosts', 'alice@node1,bob@node2', '--', '--config', 'c')
  assert [host for *_, host, _ in commands] == ['alice@node1', 'bob@node2']
  for *_, remote in commands:
    assert 'JAX_COORDINATOR_ADDRESS=node1:12355 ' in remote


def test_gpu_multinode_puts_an_ipv6_coordinator_in_brackets():
  """`--hosts alice@fd00::1,fd00::2`: ssh takes the bare IPv6 address, but fd00::1:12355 is no address JAX can
  use (every process waited, then aborted); the coordinator is [fd00::1]:12355."""
  commands = dry_run('gpu_multinode.sh', '--hosts', 'alice@fd00::1,fd00::2', '--', '--config', 'c')
  assert [host for *_, host, _ in commands] == ['alice@fd00::1', 'fd00::2']
  for *_, remote in commands:
    assert 'JAX_COORDINATOR_ADDRESS=[fd00::1]:12355 ' in remote


def test_gpu_multinode_prepares_once_on_the_first_node_before_any_node_trains():
  commands = dry_run('gpu_multinode.sh', '--hosts', 'gpu1,gpu2', '--tfds-data-dir', '/shared/tfds', '--',
                     *TRAIN_ARGS)
  prepare, *trains = [shlex.split(remote) for *_, remote in commands]
  assert [host for *_, host, _ in commands] == ['gpu1', 'gpu1', 'gpu2']
  assert '.[tfds]' in prepare  # TensorFlow where preparation runs
  shared = ['--config.tfds_data_dir=/shared/tfds']
  assert module_args(prepare, 'flaxformer_nmt.corpora') == ['prepare'] + CONFIG_ARGS + shared
  for words in trains:
    assert module_args(words, 'flaxformer_nmt.train') == ['--distributed=on'] + TRAIN_ARGS + shared
    assert '.[tfds]' not in words and module_args(words, 'flaxformer_nmt.corpora') is None


def test_gpu_multinode_under_slurm_prepares_in_one_task_then_trains_in_one_step():
  prepare, train = dry_run('gpu_multinode.sh', '--slurm', '--nodes', '2', '--gpus-per-node', '8',
                           '--tfds-data-dir', 'gs://b/tfds', '--', *TRAIN_ARGS)
  assert prepare[:5] == ['srun', '--nodes', '1', '--ntasks', '1']
  assert module_args(shlex.split(prepare[-1]), 'flaxformer_nmt.corpora') == [
      'prepare'] + CONFIG_ARGS + ['--config.tfds_data_dir=gs://b/tfds']
  assert train[:8] == ['srun', '--nodes', '2', '--ntasks-per-node', '1', '--gpus-per-node', '8', '--chdir']
  assert module_args(train, 'flaxformer_nmt.train') == ['--distributed=on'] + TRAIN_ARGS + [
      '--config.tfds_data_dir=gs://b/tfds']


def test_a_bare_boolean_override_does_not_take_the_next_flag_as_its_value():
  """`--config.skip_bad_pairs` alone sets the field True (absl's boolean form): preparation gets it, and neither
  the trainer's --workdir nor its value; the overrides after it still reach preparation."""
  commands = dry_run('gpu_multinode.sh', '--hosts', 'gpu1', '--tfds-data-dir', '/shared/tfds', '--',
                     '--config', 'configs/big.py', '--config.skip_bad_pairs', '--workdir', '/shared/run',
                     '--config.data_parallelism', '-1')
  prepare = shlex.split(commands[0][-1])
  assert module_args(prepare, 'flaxformer_nmt.corpora') == [
      'prepare', '--config', 'configs/big.py', '--config.skip_bad_pairs', '--config.data_parallelism', '-1',
      '--config.tfds_data_dir=/shared/tfds']


def test_tpu_vm_creates_copies_installs_prepares_on_worker_0_and_trains_on_all_workers():
  commands = dry_run('tpu_vm.sh', '--name', 'nmt', '--zone', 'us-central2-b', '--project', 'p',
                     '--accelerator-type', 'v4-32', '--create', '--tfds-data-dir', 'gs://bucket/tfds', '--',
                     *TRAIN_ARGS)
  create, mkdir, copy, install, prepare, train = commands
  assert create[:5] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create'] and 'v4-32' in create
  assert mkdir[mkdir.index('--command') + 1] == 'mkdir -p ~/flaxformer_nmt'
  # The code goes into ~/flaxformer_nmt/ (not a nested copy of the checkout's folder).
  assert copy[4] == 'scp' and '--worker=all' in copy and copy[-1] == 'nmt:~/flaxformer_nmt/'
  assert {os.path.basename(x) for x in copy if x.startswith('/')} >= {'flaxformer_nmt', 'configs', 'pyproject.toml'}
  for command in (mkdir, install, prepare, train):
    assert command[4:6] == ['ssh', 'nmt']
    assert command[command.index('--zone') + 1] == 'us-central2-b' and '--project' in command
  remote = {name: shlex.split(c[c.index('--command') + 1]) for name, c in
            (('install', install), ('prepare', prepare), ('train', train))}
  # Every worker installs lean (no TensorFlow) and trains; worker 0 alone installs [tfds] and prepares.
  assert '--worker=all' in install and '--worker=all' in train and '--worker=0' in prepare
  assert remote['install'][-1] == '.' and not any('tfds' in w for w in remote['install'])
  assert '.[tfds]' in remote['prepare']
  shared = ['--config.tfds_data_dir=gs://bucket/tfds']
  assert module_args(remote['prepare'], 'flaxformer_nmt.corpora') == ['prepare'] + CONFIG_ARGS + shared
  assert module_args(remote['train'], 'flaxformer_nmt.train') == ['--distributed=auto'] + TRAIN_ARGS + shared
  assert module_args(remote['train'], 'flaxformer_nmt.corpora') is None and '.[tfds]' not in remote['train']


def steps(words):
  """A command line's `&&`-separated commands, each a list of words."""
  commands = [[]]
  for word in words:
    if word == '&&':
      commands.append([])
    else:
      commands[-1].append(word)
  return commands


def test_tpu_vm_runs_every_python_command_in_a_new_enough_python():
  """The TPU runtime image's python3 is 3.10, older than pyproject's requires-python: every worker gets a
  virtual environment of a Python that satisfies it (made by uv), and installation, preparation and training use
  that environment; the image's python3 only installs uv and runs it."""
  with open(os.path.join(os.path.dirname(LAUNCH), 'pyproject.toml'), 'rb') as f:
    assert tomllib.load(f)['project']['requires-python'] == '>=3.11'
  commands = dry_run('tpu_vm.sh', '--name', 'nmt', '--zone', 'z', '--tfds-data-dir', 'gs://b/tfds', '--',
                     *TRAIN_ARGS)
  install, prepare, train = [steps(shlex.split(c[c.index('--command') + 1])) for c in commands[2:]]  # after scp
  assert install[1] == ['python3', '-m', 'pip', 'install', '-q', '--user', '-U', 'uv']
  venv = install[2]
  assert venv[:4] == ['python3', '-m', 'uv', 'venv'] and venv[-1] == '.venv'
  assert tuple(int(x) for x in venv[venv.index('--python') + 1].split('.')) >= (3, 11)
  uv_installs = [install[3], prepare[1]]  # the lean install on every worker, [tfds] on worker 0
  for words in uv_installs:
    assert words[:5] == ['python3', '-m', 'uv', 'pip', 'install']
    assert words[words.index('--python') + 1] == '.venv/bin/python'
  assert install[3][-2:] == ['-e', '.'] and prepare[1][-2:] == ['-e', '.[tfds]']
  assert prepare[2][:3] == ['.venv/bin/python', '-m', 'flaxformer_nmt.corpora']
  assert train[1][:3] == ['.venv/bin/python', '-m', 'flaxformer_nmt.train']


def test_tpu_vm_without_a_tfds_directory_prepares_nothing():
  commands = dry_run('tpu_vm.sh', '--name', 'nmt', '--zone', 'z', '--', '--config', 'configs/big.py',
                     '--workdir', 'gs://b/r', '--config.data_dir=gs://b/text')
  assert len(commands) == 4  # mkdir, copy, install, train
  assert not any('flaxformer_nmt.corpora' in ' '.join(c) for c in commands)


@pytest.mark.parametrize('script,args,message', [
    ('tpu_vm.sh', ['--zone', 'z', '--', '--config', 'c'], 'required'),
    ('gpu_multinode.sh', ['--', '--config', 'c'], 'required'),
    ('tpu_vm.sh', ['--name', 'n', '--zone', 'z'], 'required'),
    # A worker's local disk is not shared: the TPU script needs a bucket.
    ('tpu_vm.sh', ['--name', 'n', '--zone', 'z', '--tfds-data-dir', '/tmp/tfds', '--', '--config', 'c'],
     'must be a gs:// directory'),
    # An option's value left out at the end was bash's `$2: unbound variable`.
    ('gpu_multinode.sh', ['--hosts'], '--hosts needs a value'), ('tpu_vm.sh', ['--zone'], '--zone needs a value')])
def test_bad_options_fail(script, args, message):
  out = subprocess.run(['bash', os.path.join(LAUNCH, script), '--dry-run', *args], capture_output=True, text=True,
                       timeout=60, check=False)
  assert out.returncode != 0 and message in out.stderr


def test_the_printed_preparation_command_parses(tmp_path):
  # The config arguments the scripts hand to `flaxformer_nmt.corpora prepare` are ones its flags accept (a local
  # text config: nothing to download, so it exits at once).
  commands = dry_run('gpu_multinode.sh', '--hosts', 'h', '--tfds-data-dir', str(tmp_path), '--',
                     '--config', 'configs/multi30k.py', '--workdir', 'w', '--config.model.remat', 'full',
                     '--config.seed=3')
  args = module_args(shlex.split(commands[0][-1]), 'flaxformer_nmt.corpora')
  repo = os.path.dirname(LAUNCH)
  out = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.corpora', *args], cwd=repo, capture_output=True,
                       text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr


def test_an_unknown_field_in_a_flag_file_is_one_line(tmp_path):
  """The launch scripts pass a `--flagfile` through: a misspelt override in it stops with the one `error:` line a
  misspelt override on the command line gives, not ml_collections' traceback ending in AttributeError."""
  repo = os.path.dirname(LAUNCH)
  flag_file = tmp_path / 'run.flags'
  flag_file.write_text(f'--config={repo}/configs/multi30k.py\n--config.model.d_modle=64\n')
  out = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.corpora', 'prepare', f'--flagfile={flag_file}'],
                       cwd=repo, capture_output=True, text=True, timeout=300, check=False)
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith("error: --config.model.d_modle: the config of ") and "no field 'model.d_modle'" in lines[0]
  assert 'did you mean --config.model.d_model' in lines[0]


@pytest.mark.parametrize('script,options', [('gpu_multinode.sh', ['--hosts', 'h']),
                                            ('tpu_vm.sh', ['--name', 'n', '--zone', 'z'])])
def test_a_flag_file_config_reaches_preparation(tmp_path, script, options):
  """`-- --flagfile run.flags` with --tfds-data-dir: preparation reads the flag file's config (the trainer's own
  flags in it skipped), not a bare --config.tfds_data_dir that absl refuses as an unknown flag."""
  repo = os.path.dirname(LAUNCH)
  flag_file = tmp_path / 'run.flags'
  flag_file.write_text(f'--config={repo}/configs/multi30k.py\n--workdir={tmp_path}/w\n--distributed=on\n')
  commands = dry_run(script, *options, '--tfds-data-dir', f'gs://{tmp_path}', '--', '--flagfile', str(flag_file),
                     '--config.seed=3')
  remote = [c[-1] for c in commands if 'flaxformer_nmt.corpora' in c[-1]]
  args = module_args(shlex.split(remote[0]), 'flaxformer_nmt.corpora')
  out = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.corpora', *args], cwd=repo, capture_output=True,
                       text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize('slurm', [False, True])
def test_a_python_path_with_a_space_stays_one_word(slurm):
  """--python '/opt/nmt env/bin/python': every remote command line runs that interpreter, not `/opt/nmt`."""
  python = '/opt/nmt env/bin/python'
  where = ['--slurm', '--nodes', '2'] if slurm else ['--hosts', 'gpu1,gpu2']
  commands = dry_run('gpu_multinode.sh', *where, '--python', python, '--tfds-data-dir', '/shared/tfds', '--',
                     '--config', 'c', '--workdir', 'w')
  remote = [command[-1] for command in commands if command[0] == 'ssh' or command[-3:-1] == ['bash', '-c']]
  lines = [shlex.split(line) for line in remote]
  for words in lines:
    for module in ('pip', 'flaxformer_nmt.corpora', 'flaxformer_nmt.train'):
      for i in range(1, len(words)):
        if words[i] == '-m' and words[i + 1] == module:
          assert words[i - 1] == python, words
  assert len(lines) == (1 if slurm else 3)


@pytest.mark.parametrize('script,args,message', [
    # A path the remote shell splits (`mkdir -p ~/my dir`) and which scp's legacy and SFTP modes quote differently.
    ('tpu_vm.sh', ['--remote-dir', 'my dir'], '--remote-dir must be'),
    ('tpu_vm.sh', ['--remote-dir', 'x;rm -rf ~'], '--remote-dir must be'),
    ('tpu_vm.sh', ['--remote-dir', '/opt/nmt'], '--remote-dir must be'),  # it would be ~/opt/nmt
    ('gpu_multinode.sh', ['--gpus-per-node', '0'], '--gpus-per-node must be'),  # CUDA_VISIBLE_DEVICES= : no GPU
    ('gpu_multinode.sh', ['--gpus-per-node', 'eight'], '--gpus-per-node must be')])
def test_bad_paths_and_counts_fail(script, args, message):
  where = ['--hosts', 'h'] if script == 'gpu_multinode.sh' else ['--name', 'n', '--zone', 'z']
  out = subprocess.run(['bash', os.path.join(LAUNCH, script), '--dry-run', *where, *args, '--', '--config', 'c'],
                       capture_output=True, text=True, timeout=60, check=False)
  assert out.returncode == 2 and message in out.stderr, out.stderr


def test_tpu_vm_remote_dir_reaches_every_step():
  commands = dry_run('tpu_vm.sh', '--name', 'nmt', '--zone', 'z', '--remote-dir', 'runs/nmt-1', '--', '--config', 'c')
  mkdir, copy, install, train = commands
  assert mkdir[mkdir.index('--command') + 1] == 'mkdir -p ~/runs/nmt-1' and copy[-1] == 'nmt:~/runs/nmt-1/'
  for command in (install, train):
    assert shlex.split(command[command.index('--command') + 1])[:2] == ['cd', '~/runs/nmt-1']


# Stands in for ssh and for `gcloud compute tpus tpu-vm ssh|scp|create`. It runs the remote command here, in a session
# of its own as on another machine, and models what sshd does when the connection closes: it hangs up a remote
# terminal (-tt), which sends SIGHUP to the command in it; a command without one goes on running. Like sshd's, its
# remote command starts with every signal's default action, whatever the local side ignores (`nohup`, a background
# job's SIGINT).
FAKE_REMOTE_CLIENT = r'''#!/bin/bash
tty=0 command=
if [[ "$(basename "$0")" == gcloud ]]; then
  [[ "$4" == ssh ]] || exit 0
  for arg; do
    [[ "$arg" == --ssh-flag=-tt ]] && tty=1
    [[ "${previous:-}" == --command ]] && command="$arg"
    previous="$arg"
  done
else
  [[ "$1" == -tt ]] && tty=1
  command="${!#}"
fi
if [[ "$tty" == 1 && -t 0 ]]; then echo "ssh -tt would put the local terminal in raw mode" >&2; exit 97; fi
setsid env --default-signal bash -c "$command" & remote=$!
[[ "$tty" == 0 ]] || trap 'kill -HUP -- -$remote; exit 255' INT TERM HUP
wait "$remote"
'''
# The remote python: notes its process id, then runs until stopped; with FAKE_FAIL, exits 3 as the process it names
# (after FAKE_FAIL_AFTER seconds), and the others exit 0 unless FAKE_OTHERS_RUN is set.
FAKE_PYTHON = r'''#!/bin/bash
echo $$ > "$FAKE_STARTED/$$"
if [[ -n "${FAKE_FAIL:-}" ]]; then
  [[ "${JAX_PROCESS_ID:-prepare}" == "$FAKE_FAIL" ]] && { sleep "${FAKE_FAIL_AFTER:-0}"; exit 3; }
  [[ -n "${FAKE_OTHERS_RUN:-}" ]] || exit 0
fi
exec sleep 600
'''


def fake_hosts(tmp_path, fail=None):
  """Fake ssh and gcloud on PATH, and a fake python at --repo (GPU) and in ~/flaxformer_nmt/.venv (TPU)."""
  bin_dir, started, home = tmp_path / 'bin', tmp_path / 'started', tmp_path / 'home'
  venv = home / 'flaxformer_nmt' / '.venv' / 'bin'
  for folder in (bin_dir, started, venv):
    folder.mkdir(parents=True)
  for path, text in ((bin_dir / 'ssh', FAKE_REMOTE_CLIENT), (bin_dir / 'gcloud', FAKE_REMOTE_CLIENT),
                     (tmp_path / 'python', FAKE_PYTHON), (venv / 'python', FAKE_PYTHON)):
    path.write_text(text)
    path.chmod(0o755)
  env = dict(os.environ, PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', HOME=str(home), FAKE_STARTED=str(started))
  if fail is not None:
    env['FAKE_FAIL'] = fail
  return env, started


def running(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


def wait_until(condition, seconds):
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.1)
  return condition()


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc')
@pytest.mark.parametrize('script,step,signum,to_group', [
    ('gpu_multinode.sh', 'train', signal.SIGINT, True),  # Ctrl-C: SIGINT to the terminal's foreground group
    ('gpu_multinode.sh', 'prepare', signal.SIGINT, True),
    ('gpu_multinode.sh', 'train', signal.SIGTERM, False),  # `kill PID`
    ('gpu_multinode.sh', 'prepare', signal.SIGTERM, False),
    ('tpu_vm.sh', 'train', signal.SIGINT, True),
    ('tpu_vm.sh', 'prepare', signal.SIGINT, True)])
def test_stopping_the_launcher_stops_every_remote_process(tmp_path, script, step, signum, to_group):
  """Like torchrun or mpirun: Ctrl-C stops the whole job, leaving no trainer on a remote host holding its GPUs or
  TPU (over ssh without a remote terminal the remote commands went on running)."""
  env, started = fake_hosts(tmp_path)
  if script == 'gpu_multinode.sh':
    options, processes = ['--hosts', 'gpu1,gpu2', '--repo', str(tmp_path), '--python', str(tmp_path / 'python')], 2
  else:
    options, processes = ['--name', 'nmt', '--zone', 'z', '--no-install'], 1
  if step == 'prepare':
    options, processes = options + ['--tfds-data-dir', 'gs://b/tfds'], 1
  terminal, stdin = os.openpty()  # started from a shell: the input is a terminal
  with open(tmp_path / 'out', 'w') as out:
    launcher = subprocess.Popen(['bash', os.path.join(LAUNCH, script), *options, '--', '--config', 'c'], env=env,
                                stdin=stdin, stdout=out, stderr=out, process_group=0,
                                preexec_fn=as_a_foreground_job)
  pids = lambda: [int(name) for name in os.listdir(started)]
  try:
    assert wait_until(lambda: len(pids()) == processes, 30), (tmp_path / 'out').read_text()
    (os.killpg if to_group else os.kill)(launcher.pid, signum)
    assert launcher.wait(timeout=30) != 0
    assert wait_until(lambda: not any(running(pid) for pid in pids()), 10), 'a remote process goes on running'
  finally:
    for pid in pids():
      if running(pid):
        os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait()
    os.close(terminal)
    os.close(stdin)


# processes: the fake pythons that start, at least and at most (a failing node stops the nodes that have not yet).
@pytest.mark.parametrize('fail,status,processes', [('none', 0, (5, 5)), ('1', 3, (3, 5)), ('prepare', 3, (1, 1))])
def test_gpu_multinode_exits_with_a_failing_process_status(tmp_path, fail, status, processes):
  """A failing node (or a failing preparation, after which no node trains) makes the launcher fail."""
  env, started = fake_hosts(tmp_path, fail)
  out = subprocess.run(['bash', os.path.join(LAUNCH, 'gpu_multinode.sh'), '--hosts', 'gpu1,gpu2,gpu3', '--repo',
                        str(tmp_path), '--python', str(tmp_path / 'python'), '--tfds-data-dir', str(tmp_path), '--',
                        '--config', 'c'], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60, check=False)
  assert out.returncode == status, out.stderr
  assert processes[0] <= len(os.listdir(started)) <= processes[1]  # preparation's pip and corpora, then the nodes


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc')
def test_a_failing_node_stops_the_others_at_once(tmp_path):
  """Fail fast, as torchrun does: a node's trainer that dies leaves its peers waiting in a collective until JAX's
  timeout (minutes), holding their GPUs. Catches a launcher that waits for the nodes in order: it would wait on
  node 0, which runs until stopped."""
  env, started = fake_hosts(tmp_path, fail='1')
  env.update(FAKE_OTHERS_RUN='1', FAKE_FAIL_AFTER='1')  # the others have started when node 1 fails
  pids = lambda: [int(name) for name in os.listdir(started)]
  try:
    out = subprocess.run(['bash', os.path.join(LAUNCH, 'gpu_multinode.sh'), '--hosts', 'gpu1,gpu2,gpu3', '--repo',
                          str(tmp_path), '--python', str(tmp_path / 'python'), '--', '--config', 'c'], env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 3, out.stderr
    assert len(pids()) == 3
    assert wait_until(lambda: not any(running(pid) for pid in pids()), 10), 'a node goes on running'
  finally:
    for pid in pids():
      if running(pid):
        os.kill(pid, signal.SIGKILL)
