"""Helper for test_against_numpy.py, run in its own process (XLA_FLAGS must give 2 CPU devices before jax
starts): one train step over a batch split across 2 devices; prints the step's loss sum, target count and
gradient norm, and the batch, as JSON."""
import json
import os
import sys

os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'
# The forced devices are host (CPU) devices: on a GPU machine jax would otherwise pick its one GPU.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(__file__))
from test_against_numpy import two_device_setup  # pylint: disable=wrong-import-position
from flaxformer_nmt.runtime import sharding  # pylint: disable=wrong-import-position
from flaxformer_nmt.training import step as ts  # pylint: disable=wrong-import-position


def main():
  model, _, config = two_device_setup()
  mesh = sharding.make_mesh()
  assert mesh.devices.size == 2
  state, shardings = ts.create_state(model, config, mesh)
  train_fn, _ = ts.jit_steps(model, config, mesh, shardings)
  # Row 0 (device 0): 1 target token; row 1 (device 1): 11.
  batch = {'src': np.array([[5, 3] + [0] * 10, [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3]], np.int32),
           'tgt_out': np.array([[3] + [0] * 11, [17, 18, 19, 4, 5, 6, 7, 8, 9, 10, 3, 0]], np.int32)}
  batch['tgt_in'] = np.where(batch['tgt_out'] != 0, np.concatenate(
      [np.full((2, 1), 2, np.int32), batch['tgt_out'][:, :-1]], axis=1), 0).astype(np.int32)
  _, metrics = train_fn(state, sharding.put_batch(batch, sharding.batch_sharded(mesh)))
  metrics = jax.device_get(metrics)
  print(json.dumps({'devices': jax.device_count(), 'loss_sum': float(metrics['loss_sum']),
                    'target_tokens': int(metrics['target_tokens']), 'grad_norm': float(metrics['grad_norm']),
                    'batch': {k: v.tolist() for k, v in batch.items()}}))


if __name__ == '__main__':
  main()
