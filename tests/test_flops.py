"""The analytic FLOP count against a count by hand, the matmuls the model's program runs, the paper's figure and
XLA's own count of the lowered step."""
import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from conftest import small_config
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import flops
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.training import step as ts
from configs import big as big_config


def tiny_model_config():
  return model_lib.ModelConfig(vocab_size=12, num_encoder_layers=1, num_decoder_layers=1, d_model=8, d_ff=16,
                               num_heads=2, dropout_rate=0.0, dtype='float32', max_position=16)


def test_forward_flops_of_a_tiny_model_counted_by_hand():
  """One sentence pair, 3 source and 2 target tokens, d_model 8, d_ff 16, vocabulary 12, 1 + 1 layers: every
  matmul as (2 x rows x inner x columns). Catches a term left out or counted per the wrong side's tokens."""
  encoder = (3 * 2 * 3 * 8 * 8      # queries, keys, values of the 3 source tokens
             + 2 * 3 * 3 * 8        # scores: 3 queries x 3 keys over d_model
             + 2 * 3 * 3 * 8        # the weights times the 3 values
             + 2 * 3 * 8 * 8        # attention output projection
             + 2 * 3 * 8 * 16       # feed-forward in
             + 2 * 3 * 16 * 8)      # feed-forward out
  self_attention = (3 * 2 * 2 * 8 * 8 + 2 * 2 * 2 * 8 + 2 * 2 * 2 * 8 + 2 * 2 * 8 * 8)  # 2 target tokens
  cross_attention = (2 * 2 * 8 * 8      # queries of the 2 target tokens
                     + 2 * 2 * 3 * 8 * 8  # keys and values of the 3 source tokens
                     + 2 * 2 * 3 * 8 + 2 * 2 * 3 * 8  # scores and weighted values: 2 queries x 3 keys
                     + 2 * 2 * 8 * 8)   # output projection
  decoder = self_attention + cross_attention + 2 * 2 * 8 * 16 + 2 * 2 * 16 * 8
  vocabulary = 2 * 2 * 8 * 12
  assert encoder + decoder + vocabulary == 7392
  assert flops.forward_flops(tiny_model_config(), 12, 3, 2, 3, 2) == 7392
  assert flops.train_flops(tiny_model_config(), 12, 3, 2, 3, 2) == 3 * 7392


def dot_flops(jaxpr):
  """2 x (output elements) x (contracted size) summed over the dot_generals of a jaxpr and the jaxprs inside it
  (a scan's body times its length)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      (contracting, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracting)
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(inner, 'jaxpr', inner)
        if hasattr(inner, 'eqns'):
          total += dot_flops(inner) * (eqn.params['length'] if eqn.primitive.name == 'scan' else 1)
  return total


def test_the_count_is_the_matmuls_the_models_program_runs():
  """Full rows (no padding), 2 + 2 layers: the forward count equals the dot_general FLOPs of the model's jaxpr,
  and the training count those of its gradient's (the backward pass: two matmuls per forward matmul). Catches a
  matmul added to the model and not to the count."""
  config = dataclasses.replace(tiny_model_config(), num_encoder_layers=2, num_decoder_layers=2)
  model = model_lib.Transformer(config)
  src, tgt = jnp.full((2, 5), 5, jnp.int32), jnp.full((2, 4), 6, jnp.int32)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), src, tgt)['params']  # shapes are all it needs
  forward = jax.make_jaxpr(lambda p: model.apply({'params': p}, src, tgt))(params)
  gradient = jax.make_jaxpr(jax.grad(lambda p: model.apply({'params': p}, src, tgt).sum()))(params)
  assert dot_flops(forward.jaxpr) == flops.forward_flops(config, 12, 10, 8, 5, 4)
  assert dot_flops(gradient.jaxpr) == flops.train_flops(config, 12, 10, 8, 5, 4)


def test_transformer_big_costs_about_1_26_gflop_per_target_token():
  c = big_config.get_config()
  model_config = model_lib.ModelConfig.from_config(c, 37_000)
  per_token = flops.train_flops(model_config, 37_000, source_tokens=27, target_tokens=27, src_len=27,
                                tgt_len=27) / 27
  assert 1.2e9 < per_token < 1.35e9, per_token
  # Without attention it is the 6 N rule over the weights every token goes through: every kernel of the
  # parameter tree and the (tied) embedding, which projects the decoder's states onto the vocabulary.
  tokens = jnp.ones((1, 4), jnp.int32)
  params = jax.eval_shape(model_lib.Transformer(model_config).init, jax.random.PRNGKey(0), tokens, tokens)['params']
  weights = sum(math.prod(v.shape) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]
                if path[-1].key in ('kernel', 'embedding'))
  assert flops.train_flops(model_config, 37_000, 1, 1, 0, 0) == 6 * weights


def test_peak_table_and_override():
  assert flops.peak_flops_per_device('NVIDIA H100 80GB HBM3') == 989e12
  assert flops.peak_flops_per_device('NVIDIA H100 PCIe') == 756e12
  assert flops.peak_flops_per_device('NVIDIA A100-SXM4-40GB') == 312e12
  assert flops.peak_flops_per_device('TPU v5 lite') == 197e12
  assert flops.peak_flops_per_device('TPU v5p') == 459e12
  assert flops.peak_flops_per_device('TPU v4') == 275e12
  assert flops.peak_flops_per_device('cpu') is None
  assert flops.peak_flops_per_device('cpu', override=1e12) == 1e12


def test_nvl_cards_get_their_own_peak():
  """The H100 NVL and H200 NVL (device_kind 'NVIDIA H100 NVL', 'NVIDIA H200 NVL') run dense bf16 at 835 TFLOP/s.
  Catches them matched by the generic 'H100'/'H200' entries, whose SXM 989 TFLOP/s understates their MFU."""
  assert flops.peak_flops_per_device('NVIDIA H100 NVL') == 835e12
  assert flops.peak_flops_per_device('NVIDIA H200 NVL') == 835e12
  assert flops.peak_flops_per_device('NVIDIA H200') == 989e12


def test_matmul_rate_counts_two_flops_per_multiply_add(monkeypatch):
  """A CPU's stand-in peak: 4096 x 1024 x 1024 multiply-adds a matmul, 2 FLOPs each, times the timed matmuls over the
  seconds they took (made 4 s here). Catches a multiply-add counted as one FLOP (every CPU MFU the benches report
  twice too high) and the count of timed matmuls left out."""
  clock = iter([10.0, 14.0])
  monkeypatch.setattr(flops, 'time', types.SimpleNamespace(perf_counter=lambda: next(clock)))
  assert flops.matmul_rate(steps=2) == 2 * 4096 * 1024 * 1024 * 2 / 4.0


def xla_flops(lowered):
  analysis = lowered.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis['flops'])


def test_analytic_flops_match_xla_cost_analysis():
  length = 48
  config = small_config('unused')
  config.model.d_model, config.model.d_ff, config.model.num_heads = 64, 256, 4
  config.model.num_encoder_layers = config.model.num_decoder_layers = 2
  vocab = 512
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(config, vocab))
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  state = jax.eval_shape(lambda: ts.create_state(model, config, mesh)[0])  # shapes only: no initialization
  train_fn, _ = ts.jit_steps(model, config, mesh)
  rows = 8
  batch = {name: jax.ShapeDtypeStruct((rows, length), np.int32) for name in ('src', 'tgt_in', 'tgt_out')}
  # The lowered step's HLO, before XLA's optimizations (no compile: a few seconds less).
  lowered = train_fn.lower(state, batch)
  analytic = flops.train_flops(model.config, vocab, rows * length, rows * length, length, length)
  # XLA counts every op (softmax, LayerNorm, Adam, ...) as well as the matmuls: about 4% more here.
  ratio = xla_flops(lowered) / analytic
  print(f"XLA / analytic FLOPs at length {length}: {ratio:.3f}")
  assert 1.0 < ratio < 1.2, ratio
