r"""Times the compiled train step of a config after warm-up: tokens/s, model TFLOP/s and, on CPU, the
achieved rate over a large float32 matmul's rate measured in the same process.

  python bench/train_throughput.py --config configs/multi30k.py [--config.tokens_per_batch=4096]
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from flaxformer_nmt import model as model_lib
from flaxformer_nmt import sharding
from flaxformer_nmt import train_step as train_step_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_LENGTHS = flags.DEFINE_string('lengths', '16,24,32', 'Padded lengths (per side) to time.')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps per length.')
_VOCAB = flags.DEFINE_integer('vocab_size', 0, 'Vocabulary size (default: the config\'s).')


def train_flops_per_target_token(c, src_len, tgt_len, vocab):
  """Analytic matmul FLOPs (forward + backward = 3x forward) per target token of a padded batch row."""
  d, f = c.d_model, c.d_ff
  enc = c.num_encoder_layers * (4 * d * d + 2 * d * f + 2 * src_len * d)  # per source token
  dec = c.num_decoder_layers * (4 * d * d + 2 * d * f + 2 * tgt_len * d + 2 * src_len * d)  # per target token
  cross_kv = c.num_decoder_layers * 2 * d * d  # per source token
  per_row = src_len * (enc + cross_kv) + tgt_len * (dec + vocab * d)
  return 3 * 2 * per_row / tgt_len


def time_fn(fn, *args, steps):
  out = fn(*args)
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(steps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def matmul_rate():
  a = jax.random.normal(jax.random.PRNGKey(0), (4096, 1024), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (1024, 1024), jnp.float32)
  seconds = time_fn(jax.jit(jnp.matmul), a, b, steps=20)
  return 2 * 4096 * 1024 * 1024 / seconds


def main(_):
  config = _CONFIG.value
  vocab = _VOCAB.value or config.vocab_size
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(config, vocab))
  optimizer, schedule = train_step_lib.make_optimizer(config)
  mesh = sharding.make_mesh()
  state = jax.jit(functools.partial(train_step_lib.init_state, model, optimizer, config.seed),
                  out_shardings=sharding.replicated(mesh))()
  train_fn, _ = train_step_lib.jit_steps(model, optimizer, schedule, config, mesh)
  backend = jax.default_backend()
  peak = matmul_rate() if backend == 'cpu' else None
  print(f'backend {backend}, {jax.device_count()} device(s), {model_lib.count_params(state.params):,} parameters')
  if peak:
    print(f'float32 4096x1024x1024 matmul: {peak / 1e9:.1f} GFLOP/s')
  print(f'{"len":>5} {"rows":>5} {"step ms":>8} {"tgt tok/s":>10} {"TFLOP/s":>8} {"/matmul":>8}')
  rng = np.random.default_rng(0)
  for length in [int(x) for x in _LENGTHS.value.split(',')]:
    rows = max(config.tokens_per_batch // length, 1)
    tokens = rng.integers(4, vocab, (rows, length), dtype=np.int32)
    batch = sharding.put_batch({'src': tokens, 'tgt_in': tokens, 'tgt_out': tokens}, sharding.batch_sharded(mesh))
    step = jax.jit(lambda s, b: train_fn(s, b)[0], donate_argnums=0)
    state = step(state, batch)  # compile + warm-up
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(_STEPS.value):
      state = step(state, batch)
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - start) / _STEPS.value
    flops = train_flops_per_target_token(config.model, length, length, vocab) * rows * length / seconds
    ratio = f'{flops / peak:8.2f}' if peak else f'{"-":>8}'
    print(f'{length:5d} {rows:5d} {seconds * 1e3:8.1f} {rows * length / seconds:10.0f} {flops / 1e12:8.3f} {ratio}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
