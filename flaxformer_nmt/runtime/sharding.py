"""Device mesh and shardings: data parallel over every device of every host, FSDP as an option.

The mesh has two axes, ('data', 'fsdp'), of sizes config.data_parallelism x config.fsdp_parallelism (-1:
all the devices the other axis leaves). Each batch is split along its rows over both axes, so every device
computes on its own rows. Parameters and optimizer state are replicated over 'data'; over 'fsdp' each
matrix is split along its largest dimension that the axis size divides (vectors, scalars and matrices with
no such dimension stay replicated), ZeRO-3 / FSDP style: XLA gathers a layer's weights just before using
them and reduce-scatters their gradients. Adam's moments have their parameter's shape, so the same rule
gives them their parameter's layout.

The mesh is built with `jax.sharding.Mesh` (Auto axis types), which linen's embedding gather needs under
jax 0.10. Devices are laid out in jax.devices() order (process by process), so the 'fsdp' axis spans
neighbouring devices (one host's fast interconnect) when fsdp_parallelism <= devices per host.
"""
import os

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp')
XLA_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'  # XLA_FLAGS' own way to split the host CPU
BATCH_AXES = ('data', 'fsdp')  # the batch's rows are split over both


class MeshError(ValueError):
  """A mesh shape that does not match the devices."""


def split_host_cpu(count, setting='config.cpu_devices'):
  """Presents this host's CPU to JAX as `count` devices (config.cpu_devices; 0 leaves JAX's one), so that the
  data-parallel mesh splits every batch's rows over them. Returns the count in force, 0 where nothing was set.
  `setting` names what asked for the count in the messages (decode's --devices: local_devices).

  Why: a small model's CPU step is some 2,000 small operations, most too small for XLA's intra-op threads to
  split, so one device leaves the second core idle much of the step. With a device per core each half-batch's
  operations run side by side; the gradients are summed across them as on any data-parallel mesh, so the
  update is the same (the tests compare the losses). On a 2-core AMD EPYC Zen 3, float32 (configs/multi30k.py's
  model, 4,096 tokens a step): 1.35-1.60 s a step on one device, 1.03-1.21 s on two.

  It fixes JAX's CPU client, so it runs before the first computation (train.main does it first). A device
  count already asked of XLA (XLA_DEVICE_COUNT_FLAG in XLA_FLAGS) is left as it is; where the
  backend has already started (a training run inside a process that computed before) the devices it has are
  used, with a warning. On a GPU or TPU host jax.devices() are the accelerators whatever this says.
  """
  if count < 0:
    raise MeshError(f'{setting}={count}: use 0 (JAX\'s one CPU device) or the number of devices to '
                    'split the host CPU into (its cores)')
  if count == 0:
    return 0
  if XLA_DEVICE_COUNT_FLAG in os.environ.get('XLA_FLAGS', ''):
    logging.info('%s=%d not applied: XLA_FLAGS already sets the CPU device count', setting, count)
    return 0
  try:
    jax.config.update('jax_num_cpu_devices', count)
  except RuntimeError:  # the backend started before with another count
    logging.warning('%s=%d not applied: JAX\'s backend had already started in this process with %d CPU devices',
                    setting, count, len(jax.devices('cpu')))
    return 0
  return count


def mesh_shape(num_devices, data_parallelism=-1, fsdp_parallelism=1):
  """(data, fsdp) sizes whose product is num_devices; one of them may be -1 (the rest)."""
  data, fsdp = data_parallelism, fsdp_parallelism
  if data == -1 and fsdp == -1:
    raise MeshError('at most one of data_parallelism and fsdp_parallelism may be -1')
  if data == -1:
    data = num_devices // fsdp if fsdp > 0 and num_devices % fsdp == 0 else 0
  elif fsdp == -1:
    fsdp = num_devices // data if data > 0 and num_devices % data == 0 else 0
  if data <= 0 or fsdp <= 0 or data * fsdp != num_devices:
    raise MeshError(f'mesh data_parallelism={data_parallelism} x fsdp_parallelism={fsdp_parallelism} does not '
                    f'cover the {num_devices} devices')
  return data, fsdp


def make_mesh(data_parallelism=-1, fsdp_parallelism=1, devices=None):
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(len(devices), data_parallelism, fsdp_parallelism)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def mesh_from_config(config):
  return make_mesh(config.data_parallelism, config.fsdp_parallelism)


def replicated(mesh):
  return NamedSharding(mesh, P())


def batch_sharded(mesh):
  return NamedSharding(mesh, P(BATCH_AXES))


def steps_batch_sharded(mesh):
  """Several steps' batches stacked on a leading axis (one per step, not split), their rows split as
  batch_sharded's."""
  return NamedSharding(mesh, P(None, BATCH_AXES))


def fsdp_spec(shape, fsdp_size):
  """PartitionSpec of an array of `shape`: its largest dimension divisible by the 'fsdp' size is split over
  'fsdp' (the first such on ties); vectors and scalars, and everything when fsdp_size is 1, are replicated."""
  if fsdp_size == 1 or len(shape) < 2:
    return P()
  candidates = [d for d in range(len(shape)) if shape[d] % fsdp_size == 0]
  if not candidates:
    return P()
  split = max(candidates, key=lambda d: (shape[d], -d))
  return P(*[('fsdp' if d == split else None) for d in range(len(shape))])


def state_shardings(abstract_tree, mesh):
  """NamedShardings for every leaf of a tree of arrays or ShapeDtypeStructs (a train state)."""
  fsdp_size = mesh.shape['fsdp']
  return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, fsdp_size)), abstract_tree)


def rows_multiple(mesh):
  """Global batch rows must be a multiple of this: every device gets the same number of rows."""
  return mesh.devices.size


def put_batch(batch, sharding):
  """Host numpy batch -> global device arrays split over the batch axes.

  Each process passes the rows it read (its devices' share of the global batch, in process order);
  `make_array_from_process_local_data` stitches them into the global batch without moving rows between
  hosts (for one process this is a plain sharded device_put).
  """
  return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def local_devices(count):
  """The first `count` of this process's devices (0: all of them), for data-parallel decoding. On a host without
  accelerators the CPU is first split into `count` devices (split_host_cpu), so call this before the first
  computation; on a GPU or TPU host they are its accelerators."""
  if count < 0:
    raise MeshError(f'devices={count}: use 0 (every local device) or how many to split the batches over')
  if count > 1:
    split_host_cpu(count, setting='devices')
  devices = jax.local_devices()
  if count > len(devices):
    raise MeshError(f'devices={count}: this process has {len(devices)} {devices[0].platform} device'
                    f'{"s" * (len(devices) > 1)}')
  return devices[:count or len(devices)]


def spread_rows(tree, mesh):
  """Every array of `tree` on `mesh`'s devices: split along its first axis (sentences, or their rows), which the
  device count divides; scalars (a search's step index) replicated. Arrays already laid out so are not moved."""
  rows, whole = batch_sharded(mesh), replicated(mesh)
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, whole if np.ndim(x) == 0 else rows), tree)
