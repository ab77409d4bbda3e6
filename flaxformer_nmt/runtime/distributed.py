"""Multi-host start: one process per host (TPU VM worker or GPU node), joined by JAX's distributed runtime.

`initialize()` runs before anything touches a device:
  - explicit: a coordinator address from the argument or JAX_COORDINATOR_ADDRESS, with the number of
    processes and this process's id from the arguments or JAX_NUM_PROCESSES / JAX_PROCESS_ID
    (launch/gpu_multinode.sh sets these on every node);
  - SLURM (a task of an srun step with more than one task: the variables JAX reads, SLURM_JOB_ID,
    SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID) and Open MPI (mpirun): JAX reads the
    job's environment;
  - Cloud TPU VMs: JAX asks the TPU metadata server for the workers (launch/tpu_vm.sh).
Otherwise (one machine) nothing is initialized and jax runs as a single process. A start that lacks what it
needs (a SLURM job of several tasks outside srun, `on` without a job, an explicit start missing a value, a
non-integer JAX_NUM_PROCESSES, a coordinator address that is not HOST:PORT) raises DistributedError naming
what is missing.

Under SLURM or Open MPI JAX gives each process the one GPU numbered by its local rank (one process per GPU);
with one process per node, initialize() passes all the node's GPUs instead (JAX_LOCAL_DEVICE_IDS overrides).

Detection only reads the environment and /dev: initializing a jax backend first would make
jax.distributed.initialize fail.
"""
import glob
import importlib.util
import os
import re

import jax
from absl import logging
from jax.experimental import multihost_utils

MODES = ('auto', 'on', 'off')
# What JAX's SLURM detection reads: all are set in the tasks of an srun step, not in an salloc or sbatch shell.
SLURM_STEP_VARIABLES = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')
EXPLICIT = (('JAX_COORDINATOR_ADDRESS', '--coordinator_address'), ('JAX_NUM_PROCESSES', '--num_processes'),
            ('JAX_PROCESS_ID', '--process_id'))
# HOST:PORT, an IPv6 host in brackets ([fd00::1]:12355): what JAX's client and its service's bind address take.
COORDINATOR_ADDRESS = re.compile(r'(\[[^\]\s]+\]|[^\s:\[\]/]+):([0-9]{1,5})')


class DistributedError(Exception):
  """The environment or flags do not describe a multi-process start that can proceed."""


def _env_int(name):
  value = os.environ.get(name, '').strip()
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise DistributedError(f'{name} must be an integer, not {value!r}') from None


def check_coordinator_address(address):
  """Raises DistributedError unless `address` is HOST:PORT with a port 1-65535. JAX fails on anything else
  far from the cause: an IndexError without a port, a service that does not start with a named port, and an
  unbracketed IPv6 address its processes wait on until they abort."""
  match = COORDINATOR_ADDRESS.fullmatch(address)
  if not match or not 0 < int(match.group(2)) < 65536:
    raise DistributedError(f'coordinator address {address!r} (--coordinator_address or JAX_COORDINATOR_ADDRESS) '
                           'must be HOST:PORT with a port 1-65535, e.g. node1:12355 or [fd00::1]:12355')


def on_cloud_tpu_vm():
  """libtpu installed and TPU chips attached (their device files), without starting a backend."""
  return (importlib.util.find_spec('libtpu') is not None
          and bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*')))


def _slurm_job_outside_step():
  """SLURM_NTASKS > 1 in a SLURM job, but not in a task of an srun step (an salloc or sbatch shell)."""
  tasks = _env_int('SLURM_NTASKS')
  return bool(os.environ.get('SLURM_JOB_ID') and tasks and tasks > 1
              and not all(name in os.environ for name in SLURM_STEP_VARIABLES))


def cluster_from_environment(least_processes=2):
  """The launcher whose environment describes a job of at least `least_processes` processes (2: a multi-process
  job; 1, for --distributed=on: a one-task srun step or a one-process mpirun too), or None. Open MPI comes first,
  as in JAX: mpirun in a SLURM job starts its daemons in an srun step, whose variables its processes inherit."""
  if (_env_int('OMPI_COMM_WORLD_SIZE') or 0) >= least_processes:
    return 'openmpi'
  if all(name in os.environ for name in SLURM_STEP_VARIABLES) and (_env_int('SLURM_NTASKS') or 0) >= least_processes:
    return 'slurm'
  if on_cloud_tpu_vm():
    return 'tpu'
  return None


def _one_process_per_node(cluster):
  if cluster == 'slurm':
    nodes = _env_int('SLURM_STEP_NUM_NODES')
    return nodes is not None and nodes == _env_int('SLURM_NTASKS')
  if cluster == 'openmpi':
    return _env_int('OMPI_COMM_WORLD_LOCAL_SIZE') == 1
  return False


def local_device_ids(cluster):
  """All of this node's GPUs (0..n-1 of CUDA_VISIBLE_DEVICES, else of /dev/nvidiaN) when it runs one process of
  a SLURM or Open MPI job, where JAX would keep only GPU SLURM_LOCALID / the local rank; else None (JAX's
  choice, or JAX_LOCAL_DEVICE_IDS)."""
  if os.environ.get('JAX_LOCAL_DEVICE_IDS') or not _one_process_per_node(cluster):
    return None
  visible = os.environ.get('CUDA_VISIBLE_DEVICES')
  if visible is not None:
    count = len([device for device in visible.split(',') if device.strip()])
  else:
    count = len(glob.glob('/dev/nvidia[0-9]*'))
  return list(range(count)) or None


def _check_start(mode, cluster, settings):
  """Raises DistributedError if a start in `mode` lacks what it needs; returns whether to initialize."""
  if cluster is None and _slurm_job_outside_step() and settings[0] is None:
    unset = ', '.join(name for name in SLURM_STEP_VARIABLES if name not in os.environ)
    raise DistributedError(f'this SLURM job has {os.environ["SLURM_NTASKS"]} tasks but this process is not one '
                           f'of them ({unset} unset): run it under srun (launch/gpu_multinode.sh --slurm), or '
                           'pass --distributed=off for one process')
  if cluster is not None:
    return True
  if mode == 'auto' and all(value is None for value in settings):
    return False
  missing = [f'{name} ({flag})' for (name, flag), value in zip(EXPLICIT, settings) if value is None]
  if missing and settings[0] is None:
    raise DistributedError(f'--distributed={mode} found no srun step, Open MPI job or Cloud TPU VM: set '
                           + ', '.join(missing))
  if missing:
    raise DistributedError(f'coordinator {settings[0]} given without ' + ', '.join(missing))
  return True


def initialize(mode='auto', coordinator_address=None, num_processes=None, process_id=None):
  """Joins the distributed runtime when this is a multi-process job; returns True if it did.

  mode 'off' never initializes; 'on' always does (JAX detects what the arguments leave unset from a SLURM step,
  an Open MPI job or a Cloud TPU VM); 'auto' initializes given a coordinator address (argument or environment)
  or a detected cluster, and refuses a process count or id without a coordinator. Raises DistributedError when
  the start lacks something or JAX refuses it.
  """
  if mode not in MODES:
    raise ValueError(f'--distributed must be one of {MODES}, not {mode!r}')
  if mode == 'off':
    return False
  if jax.distributed.is_initialized():
    return True
  coordinator_address = coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS') or None
  num_processes = num_processes if num_processes is not None else _env_int('JAX_NUM_PROCESSES')
  process_id = process_id if process_id is not None else _env_int('JAX_PROCESS_ID')
  if coordinator_address is not None:
    check_coordinator_address(coordinator_address)
  cluster = cluster_from_environment(1 if mode == 'on' else 2)
  if not _check_start(mode, cluster, (coordinator_address, num_processes, process_id)):
    return False
  devices = local_device_ids(cluster)
  logging.info('Joining the distributed runtime (%s): coordinator %s, %s processes, process id %s, GPUs %s',
               cluster or 'explicit', coordinator_address or 'auto', num_processes or 'auto',
               process_id if process_id is not None else 'auto', devices or 'auto')
  try:
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=devices)
  except (ValueError, TypeError, RuntimeError) as e:
    raise DistributedError(f'joining the distributed runtime ({cluster or "explicit"}) failed: {e}') from e
  logging.info('Process %d of %d: %d local devices, %d in all', jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  if jax.process_count() > 1 and jax.default_backend() == 'cpu':
    # A cross-process CPU program that JAX loads from its persistent compilation cache waits forever in its first
    # collective (jax 0.12.1: a resumed two-process run hung in its first step; compiled afresh, it ran).
    jax.config.update('jax_enable_compilation_cache', False)
    logging.info('Processes joined on CPUs compile their programs afresh: no persistent compilation cache')
  return True


def is_leader():
  """Process 0 writes logs, summaries, config and vocabulary; every process writes its checkpoint shards."""
  return jax.process_index() == 0


def barrier(name):
  """Every process waits here until all have arrived (a no-op for a single process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
