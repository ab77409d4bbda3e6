"""Helper for test_sharding.py, run in its own process: XLA_FLAGS must give 4 CPU devices before jax starts.

Trains a tiny model for a few steps on one device and on meshes (data, fsdp) = (4, 1), (1, 4) and (2, 2), the
last with gradient accumulation (and once more with the chunked vocabulary loss too, and once with all the steps
in one call: config.steps_per_dispatch), and prints a JSON report
of how far each run's parameters and metrics are from the single-device run's. A wrong data-parallel reduction,
FSDP gather or accumulation each shows in one of them. The gradient norms are compared too: Adam divides each
update by the gradient's own scale, so gradients summed over devices where they should be averaged (4x too
large) move the parameters almost as the right ones do, and only the norm shows it.
"""
import json
import os
import sys

os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=4'
# The forced devices are host (CPU) devices: on a GPU machine jax would otherwise pick its one GPU.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(__file__))
from conftest import small_config  # pylint: disable=wrong-import-position
from flaxformer_nmt.models import transformer as model_lib  # pylint: disable=wrong-import-position
from flaxformer_nmt.runtime import sharding  # pylint: disable=wrong-import-position
from flaxformer_nmt.training import step as ts  # pylint: disable=wrong-import-position

STEPS = 3


def batches(vocab, rows=8, length=12, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(STEPS):
    lengths = rng.integers(3, length + 1, size=rows)
    src = np.zeros((rows, length), np.int32)
    tgt = np.zeros((rows, length), np.int32)
    for r, n in enumerate(lengths):
      src[r, :n] = rng.integers(4, vocab, n)
      tgt[r, :n - 1] = rng.integers(4, vocab, n - 1)
      tgt[r, n - 1] = 3
    tgt_in = np.concatenate([np.full((rows, 1), 2, np.int32), tgt[:, :-1]], axis=1) * (tgt != 0)
    out.append({'src': src, 'tgt_in': tgt_in.astype(np.int32), 'tgt_out': tgt})
  return out


def run(config, mesh):
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(config, config.vocab_size))
  state, shardings = ts.create_state(model, config, mesh)
  train_fn, eval_fn = ts.jit_steps(model, config, mesh, shardings)
  batch_sharding = sharding.batch_sharded(mesh)
  if config.steps_per_dispatch > 1:  # all the steps in one call, their batches stacked
    stacked = jax.tree_util.tree_map(lambda *arrays: np.stack(arrays), *batches(config.vocab_size))
    state, metrics = train_fn.many(state, sharding.put_batch(stacked, sharding.steps_batch_sharded(mesh)))
    steps_metrics = [{name: value[i] for name, value in metrics.items()} for i in range(STEPS)]
  else:
    steps_metrics = []
    for batch in batches(config.vocab_size):
      state, metrics = train_fn(state, sharding.put_batch(batch, batch_sharding))
      steps_metrics.append(metrics)
  losses = [float(m['loss_sum'] / m['target_tokens']) for m in steps_metrics]
  grad_norms = [float(m['grad_norm']) for m in steps_metrics]
  evaluation = eval_fn(state.params, sharding.put_batch(batches(config.vocab_size, seed=1)[0], batch_sharding))
  split = sorted({str(leaf.sharding.spec) for leaf in jax.tree_util.tree_leaves(state.params)})
  shard_rows = [leaf.addressable_shards[0].data.shape for leaf in jax.tree_util.tree_leaves(state.opt_state)
                if leaf.ndim == 2]
  full_rows = [leaf.shape for leaf in jax.tree_util.tree_leaves(state.opt_state) if leaf.ndim == 2]
  return {'params': jax.device_get(state.params), 'losses': losses, 'grad_norms': grad_norms,
          'eval_loss': float(evaluation['loss_sum'] / evaluation['target_tokens']), 'specs': split,
          'optimizer_state_sharded': any(a != b for a, b in zip(shard_rows, full_rows))}


def max_difference(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def main():
  assert jax.device_count() == 4, jax.devices()
  config = small_config('unused')
  config.model.dropout_rate = 0.0  # the same update whatever the layout of the dropout masks
  config.model.d_model = 32
  config.model.num_heads = 4
  # Adam moves each weight by about lr per step whatever its gradient's size, so float32 reduction-order
  # noise in near-zero gradients shows up in the parameters in proportion to lr: keep it moderate.
  config.learning_rate_scale = 0.5
  config.warmup_steps = 3
  reference = run(config, sharding.make_mesh(devices=jax.devices()[:1]))
  report = {'reference_losses': reference['losses'], 'reference_grad_norms': reference['grad_norms']}
  # The last: the chunked vocabulary loss (config.vocabulary_loss_chunk_tokens) against the reference's whole
  # logits, its embedding gradient summed over the data-parallel rows and its chunks over positions per device.
  # And the three steps in one call (config.steps_per_dispatch): their batches stacked, each one's rows split.
  for data, fsdp, accumulate, chunk, many in ((4, 1, 1, 0, 1), (1, 4, 1, 0, 1), (2, 2, 2, 0, 1), (2, 2, 2, 16, 1),
                                              (2, 2, 1, 0, STEPS)):
    config.grad_accumulation_steps = accumulate
    config.vocabulary_loss_chunk_tokens = chunk
    config.steps_per_dispatch = many
    devices = jax.devices()[:data * fsdp]
    result = run(config, sharding.make_mesh(data, fsdp, devices=devices))
    report[f'data={data},fsdp={fsdp},accumulate={accumulate}' + (f',chunk={chunk}' if chunk else '')
           + (f',many={many}' if many > 1 else '')] = {
        'param_max_abs_diff': max_difference(result['params'], reference['params']),
        'loss_max_abs_diff': max(abs(a - b) for a, b in zip(result['losses'], reference['losses'])),
        'grad_norm_max_rel_diff': max(abs(a - b) / b for a, b in zip(result['grad_norms'], reference['grad_norms'])),
        'eval_loss_abs_diff': abs(result['eval_loss'] - reference['eval_loss']),
        'specs': result['specs'], 'optimizer_state_sharded': result['optimizer_state_sharded'],
    }
  config.grad_accumulation_steps, config.vocabulary_loss_chunk_tokens, config.steps_per_dispatch = 1, 0, 1
  print('REPORT ' + json.dumps(report))


if __name__ == '__main__':
  main()
