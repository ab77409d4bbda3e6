"""Sharded train steps (data parallel, FSDP, both, with gradient accumulation) against one device.

The comparison runs in a subprocess with 4 virtual CPU devices (the device count is fixed when jax starts).
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import subprocess_env, xla_flags_without_device_count

from flaxformer_nmt.runtime import sharding

HERE = os.path.dirname(__file__)


@pytest.fixture(scope='module')
def report():
  out = subprocess.run([sys.executable, os.path.join(HERE, 'sharded_steps.py')],
                       env=subprocess_env(JAX_PLATFORMS='cpu'), capture_output=True, text=True, timeout=600,
                       check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  line = [l for l in out.stdout.splitlines() if l.startswith('REPORT ')][-1]
  return json.loads(line[len('REPORT '):])


@pytest.mark.parametrize('layout', ['data=4,fsdp=1,accumulate=1', 'data=1,fsdp=4,accumulate=1',
                                    'data=2,fsdp=2,accumulate=2', 'data=2,fsdp=2,accumulate=2,chunk=16',
                                    'data=2,fsdp=2,accumulate=1,many=3'])
def test_sharded_steps_equal_the_single_device_step(report, layout):
  result = report[layout]
  assert result['loss_max_abs_diff'] < 1e-4, result
  assert result['eval_loss_abs_diff'] < 1e-4, result
  # Adam hides a gradient scaled by the device count (summed where it should be averaged); its norm does not.
  assert result['grad_norm_max_rel_diff'] < 1e-4, result
  # Three Adam steps from the same start: parameters agree to float32 reduction-order noise (~3e-6; gradients 4x
  # too large moved them 1.6e-4 apart).
  assert result['param_max_abs_diff'] < 3e-5, result
  fsdp = int(layout.split('fsdp=')[1].split(',')[0])
  assert result['optimizer_state_sharded'] == (fsdp > 1)
  assert any('fsdp' in spec for spec in result['specs']) == (fsdp > 1)


def test_training_moved_the_parameters(report):
  losses = report['reference_losses']
  assert len(losses) == 3 and losses[-1] < losses[0]
  assert all(norm > 0.01 for norm in report['reference_grad_norms'])  # a norm compared above is not ~0


@pytest.mark.parametrize('xla_device_count, want', [(None, '2 2'), (3, '0 3')])
def test_split_host_cpu_gives_jax_the_devices_unless_xla_flags_set_them(xla_device_count, want):
  """config.cpu_devices in a fresh process: JAX then has that many CPU devices; a count XLA_FLAGS already sets
  (a user's or a test's) is the one kept."""
  flags = xla_flags_without_device_count()
  if xla_device_count:
    flags += f' {sharding.XLA_DEVICE_COUNT_FLAG}={xla_device_count}'
  code = ('from flaxformer_nmt.runtime import sharding; applied = sharding.split_host_cpu(2); import jax; '
          'print(applied, len(jax.devices()))')
  out = subprocess.run([sys.executable, '-c', code], env=subprocess_env(JAX_PLATFORMS='cpu', XLA_FLAGS=flags),
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split('\n')[-2] == want


def test_split_host_cpu_after_the_backend_started_keeps_its_devices(monkeypatch, caplog):
  monkeypatch.setenv('XLA_FLAGS', xla_flags_without_device_count())
  before = len(jax.devices('cpu'))  # started
  with caplog.at_level('WARNING'):
    assert sharding.split_host_cpu(before + 1) == 0
  assert len(jax.devices('cpu')) == before
  assert any(f'cpu_devices={before + 1} not applied' in r.getMessage() for r in caplog.records)
  assert sharding.split_host_cpu(0) == 0
  with pytest.raises(sharding.MeshError, match='config.cpu_devices=-1'):
    sharding.split_host_cpu(-1)


def test_mesh_shape_fills_minus_one_and_rejects_mismatches():
  assert sharding.mesh_shape(8) == (8, 1)
  assert sharding.mesh_shape(8, -1, 4) == (2, 4)
  assert sharding.mesh_shape(8, 2, -1) == (2, 4)
  for bad in ((3, 1), (-1, 3), (-1, -1), (4, 4)):
    with pytest.raises(sharding.MeshError):
      sharding.mesh_shape(8, *bad)


def test_fsdp_splits_the_largest_divisible_dimension():
  assert sharding.fsdp_spec((512, 2048), 4) == P(None, 'fsdp')
  assert sharding.fsdp_spec((2048, 512), 4) == P('fsdp', None)
  assert sharding.fsdp_spec((6, 512), 4) == P(None, 'fsdp')
  # Ties (the square [d_model, d_model] attention kernels) go to the first such dimension, not the last.
  assert sharding.fsdp_spec((512, 512), 4) == P('fsdp', None)
  assert sharding.fsdp_spec((6, 12, 12), 4) == P(None, 'fsdp', None)
  assert sharding.fsdp_spec((6, 10), 4) == P()          # nothing divisible: replicated
  assert sharding.fsdp_spec((512,), 4) == P()           # vectors (biases, LayerNorm) replicated
  assert sharding.fsdp_spec((512, 2048), 1) == P()      # no FSDP axis
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  specs = sharding.state_shardings({'w': np.zeros((4, 8)), 'rng': np.zeros(2)}, mesh)
  assert specs['w'].spec == P() and specs['rng'].spec == P()
