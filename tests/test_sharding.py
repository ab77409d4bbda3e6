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


def test_local_devices_zero_is_all_of_them_and_too_many_is_refused(monkeypatch):
  # Catches --devices=0 ('every local device') giving none, and more devices than the process has silently cut.
  monkeypatch.setenv('XLA_FLAGS', xla_flags_without_device_count())
  assert sharding.local_devices(0) == jax.local_devices()
  assert sharding.local_devices(1) == jax.local_devices()[:1]
  count, platform = len(jax.local_devices()), jax.local_devices()[0].platform
  with pytest.raises(sharding.MeshError, match=f'devices={count + 1}: this process has {count} {platform} device'):
    sharding.local_devices(count + 1)
  with pytest.raises(sharding.MeshError, match='devices=-1'):
    sharding.local_devices(-1)


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


_LAYOUT = '''
import json, jax, numpy as np
from flaxformer_nmt.runtime import sharding
held = lambda array: {s.device.id: np.asarray(s.data).tolist() for s in array.addressable_shards}
report = {}
for data, fsdp in ((2, 2), (1, 4)):
  mesh = sharding.make_mesh(data, fsdp)
  rows = np.arange(8 * 2).reshape(8, 2)
  state = jax.device_put(np.arange(6 * 8).reshape(6, 8), sharding.state_shardings(np.zeros((6, 8)), mesh))
  report[f'{data}x{fsdp}'] = {
      'mesh': [[d.id for d in line] for line in mesh.devices],
      'rows_multiple': sharding.rows_multiple(mesh),
      'batch': held(sharding.put_batch(rows, sharding.batch_sharded(mesh))),
      'steps': held(sharding.put_batch(np.stack([rows, rows + 100, rows + 200]), sharding.steps_batch_sharded(mesh))),
      'state': held(state)}
print('LAYOUT ' + json.dumps(report))
'''


def test_each_device_holds_its_own_rows_and_its_fsdp_share_of_the_weights():
  """Four CPU devices as meshes (data 2, fsdp 2) and (data 1, fsdp 4): device k (jax.devices() order) holds rows
  2k and 2k+1 of an 8-row batch, of every stacked step's batch, and the columns of a [6, 8] weight that its place
  along 'fsdp' gives it. Catches a batch split over 'data' alone (every FSDP device then computes all the rows of
  its group: the same loss, 2-4x the work), the steps' axis split instead of the rows, the mesh's axes or device
  order swapped (the FSDP gathers then cross hosts), and a rows multiple of the data axis alone."""
  flags = xla_flags_without_device_count() + f' {sharding.XLA_DEVICE_COUNT_FLAG}=4'
  out = subprocess.run([sys.executable, '-c', _LAYOUT], env=subprocess_env(JAX_PLATFORMS='cpu', XLA_FLAGS=flags),
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  report = json.loads([l for l in out.stdout.splitlines() if l.startswith('LAYOUT ')][-1][len('LAYOUT '):])
  rows = np.arange(8 * 2).reshape(8, 2)
  weight = np.arange(6 * 8).reshape(6, 8)
  for data, fsdp in ((2, 2), (1, 4)):
    layout = report[f'{data}x{fsdp}']
    assert layout['mesh'] == [[d * fsdp + f for f in range(fsdp)] for d in range(data)]
    assert layout['rows_multiple'] == 4
    for k in range(4):
      mine = rows[2 * k:2 * k + 2]
      assert layout['batch'][str(k)] == mine.tolist(), (data, fsdp, k)
      assert layout['steps'][str(k)] == [mine.tolist(), (mine + 100).tolist(), (mine + 200).tolist()], (data, fsdp, k)
      width = 8 // fsdp  # the largest dimension (8 columns) split over 'fsdp', replicated over 'data'
      place = k % fsdp
      assert layout['state'][str(k)] == weight[:, place * width:(place + 1) * width].tolist(), (data, fsdp, k)
