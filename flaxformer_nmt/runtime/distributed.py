"""Multi-host start: one process per host (TPU VM worker or GPU node), joined by JAX's distributed runtime.

`initialize()` runs before anything touches a device:
  - explicit: a coordinator address from the argument or JAX_COORDINATOR_ADDRESS, with the number of
    processes and this process's id from the arguments or JAX_NUM_PROCESSES / JAX_PROCESS_ID
    (launch/gpu_multinode.sh sets these on every node);
  - SLURM (srun with more than one task) and Open MPI (mpirun): JAX reads the job's environment;
  - Cloud TPU VMs: JAX asks the TPU metadata server for the workers (launch/tpu_vm.sh).
Otherwise (one machine) nothing is initialized and jax runs as a single process.

Detection only reads the environment and /dev: initializing a jax backend first would make
jax.distributed.initialize fail.
"""
import glob
import importlib.util
import os

import jax
from absl import logging
from jax.experimental import multihost_utils

MODES = ('auto', 'on', 'off')


def _env_int(name):
  value = os.environ.get(name)
  return int(value) if value not in (None, '') else None


def on_cloud_tpu_vm():
  """libtpu installed and TPU chips attached (their device files), without starting a backend."""
  return (importlib.util.find_spec('libtpu') is not None
          and bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*')))


def cluster_from_environment():
  """The launcher whose environment describes a multi-process job, or None."""
  if _env_int('SLURM_NTASKS') and _env_int('SLURM_NTASKS') > 1 and os.environ.get('SLURM_JOB_ID'):
    return 'slurm'
  if _env_int('OMPI_COMM_WORLD_SIZE') and _env_int('OMPI_COMM_WORLD_SIZE') > 1:
    return 'openmpi'
  if on_cloud_tpu_vm():
    return 'tpu'
  return None


def initialize(mode='auto', coordinator_address=None, num_processes=None, process_id=None):
  """Joins the distributed runtime when this is a multi-process job; returns True if it did.

  mode 'off' never initializes; 'on' always does (JAX auto-detects what the arguments leave unset); 'auto'
  initializes given a coordinator address (argument or environment) or a detected cluster.
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
  cluster = None
  if mode == 'auto' and coordinator_address is None:
    cluster = cluster_from_environment()
    if cluster is None:
      return False
  logging.info('Joining the distributed runtime (%s): coordinator %s, %s processes, process id %s',
               cluster or 'explicit', coordinator_address or 'auto', num_processes or 'auto',
               process_id if process_id is not None else 'auto')
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id)
  logging.info('Process %d of %d: %d local devices, %d in all', jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True


def is_leader():
  """Process 0 writes logs, summaries, config and vocabulary; every process writes its checkpoint shards."""
  return jax.process_index() == 0


def barrier(name):
  """Every process waits here until all have arrived (a no-op for a single process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
