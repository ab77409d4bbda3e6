"""The analytic FLOP count against the paper's figure and against XLA's own count of the compiled step."""

import jax
import numpy as np
import pytest

from conftest import small_config
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import flops
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.training import step as ts
from configs import big as big_config


def test_transformer_big_costs_about_1_26_gflop_per_target_token():
  c = big_config.get_config()
  model_config = model_lib.ModelConfig.from_config(c, 37_000)
  per_token = flops.train_flops(model_config, 37_000, source_tokens=27, target_tokens=27, src_len=27,
                                tgt_len=27) / 27
  assert 1.2e9 < per_token < 1.35e9, per_token
  # Without attention it is the 6 N rule over the weights every token goes through.
  no_attention = flops.train_flops(model_config, 37_000, 1, 1, 0, 0)
  assert no_attention == 6 * flops.matmul_params(model_config, 37_000)


def test_peak_table_and_override():
  assert flops.peak_flops_per_device('NVIDIA H100 80GB HBM3') == 989e12
  assert flops.peak_flops_per_device('NVIDIA H100 PCIe') == 756e12
  assert flops.peak_flops_per_device('NVIDIA A100-SXM4-40GB') == 312e12
  assert flops.peak_flops_per_device('TPU v5 lite') == 197e12
  assert flops.peak_flops_per_device('TPU v5p') == 459e12
  assert flops.peak_flops_per_device('TPU v4') == 275e12
  assert flops.peak_flops_per_device('cpu') is None
  assert flops.peak_flops_per_device('cpu', override=1e12) == 1e12


def xla_flops(compiled):
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis['flops'])


@pytest.mark.parametrize('length', [16, 48])
def test_analytic_flops_match_xla_cost_analysis(length):
  config = small_config('unused')
  config.model.d_model, config.model.d_ff, config.model.num_heads = 64, 256, 4
  config.model.num_encoder_layers = config.model.num_decoder_layers = 2
  vocab = 512
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(config, vocab))
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  state, shardings = ts.create_state(model, config, mesh)
  train_fn, _ = ts.jit_steps(model, config, mesh, shardings)
  rows = 8
  tokens = np.random.default_rng(0).integers(4, vocab, (rows, length), dtype=np.int32)
  batch = {'src': tokens, 'tgt_in': tokens, 'tgt_out': tokens}
  compiled = train_fn.lower(state, batch).compile()
  analytic = flops.train_flops(model.config, vocab, rows * length, rows * length, length, length)
  # XLA counts every op (softmax, LayerNorm, Adam, ...) as well as the matmuls: about 8-10% more here.
  ratio = xla_flops(compiled) / analytic
  print(f"XLA / analytic FLOPs at length {length}: {ratio:.3f}")
  assert 0.95 < ratio < 1.3, ratio
