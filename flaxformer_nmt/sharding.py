"""Device mesh and shardings: data parallel over every device of every host.

Parameters and optimizer state are replicated; each batch is split along its first axis over the 'data'
mesh axis. The mesh is built with `jax.sharding.Mesh` (Auto axis types), which linen's embedding gather
needs under jax 0.10.
"""
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def make_mesh():
  return Mesh(np.asarray(jax.devices()), ('data',))


def replicated(mesh):
  return NamedSharding(mesh, P())


def batch_sharded(mesh):
  return NamedSharding(mesh, P('data'))


def put_batch(batch, sharding):
  """Host numpy batch -> global device arrays split over the 'data' axis.

  Each process passes the rows it read; `make_array_from_process_local_data` stitches them into the global
  batch (for one process this is a plain sharded device_put).
  """
  return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)
