"""Errors of each attention path and precision against a float32 'highest' einsum reference, on the tiny model of
the tests (conftest.tiny_model), to tell bf16/TF32 rounding from a wrong mask: logits and gradients, and how much
extra padding moves the logits of real positions.

  python bench/gpu_attention_check.py      # on a GPU: einsum, xla, cudnn; on a CPU: einsum, xla
  python bench/gpu_attention_check.py --smoke   # float32 at full precision only (seconds on a CPU)
"""
import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tests'))
from conftest import tiny_model  # pylint: disable=wrong-import-position

SRC = jnp.array([[4, 5, 6, 3, 0, 0, 0, 0], [7, 3, 0, 0, 0, 0, 0, 0]])
TGT = jnp.array([[2, 7, 8, 9, 10, 11, 0, 0], [2, 5, 0, 0, 0, 0, 0, 0]])
REAL = np.asarray(TGT != 0)


def run(model, params, precision, src=SRC, tgt=TGT, **changes):
  variant = model.clone(config=dataclasses.replace(model.config, **changes))
  real = np.asarray(tgt != 0)
  def f(p):
    logits = variant.apply({'params': p}, src, tgt)
    return (logits * real[..., None]).sum() / 1e3, logits
  with jax.default_matmul_precision(precision):
    (_, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return np.asarray(logits, np.float32), [np.asarray(g, np.float32) for g in jax.tree_util.tree_leaves(grads)]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--smoke', action='store_true', help='the first row only')
  args = parser.parse_args()
  model, params = tiny_model()
  ref_logits, ref_grads = run(model, params, 'highest', dtype='float32', attention_impl='einsum')
  scale = np.abs(ref_logits[REAL]).max()
  impls = ['einsum', 'xla'] + (['cudnn'] if jax.default_backend() == 'gpu' else [])
  print(f'backend {jax.default_backend()}; logit scale {scale:.3f}')
  print('| dtype | precision | attention | max logit error / scale | worst gradient error / its scale | '
        'padding moves real logits by |')
  print('|---|---|---|---:|---:|---:|')
  rows = (('float32', 'highest'), ('float32', 'default'), ('bfloat16', 'default'))
  for dtype, precision in rows[:1] if args.smoke else rows:
    for impl in impls:
      if impl == 'cudnn' and dtype == 'float32':
        continue
      try:
        logits, grads = run(model, params, precision, dtype=dtype, attention_impl=impl)
        longer, _ = run(model, params, precision, src=jnp.pad(SRC, ((0, 0), (0, 8))),
                        tgt=jnp.pad(TGT, ((0, 0), (0, 8))), dtype=dtype, attention_impl=impl)
      except Exception as error:  # pylint: disable=broad-except
        print(f'| {dtype} | {precision} | {impl} | failed: {str(error)[:200]} | | |')
        continue
      logit_error = np.abs(logits[REAL] - ref_logits[REAL]).max() / scale
      grad_error = max(np.abs(g - r).max() / (np.abs(r).max() + 1e-12) for g, r in zip(grads, ref_grads))
      pad_move = np.abs(longer[:, :8][REAL] - logits[REAL]).max() / scale
      print(f'| {dtype} | {precision} | {impl} | {logit_error:.2e} | {grad_error:.2e} | {pad_move:.2e} |', flush=True)


if __name__ == '__main__':
  main()
