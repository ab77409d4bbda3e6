"""Masks, positions and the model's invariances, checked against direct computations."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from flaxformer_nmt.models import transformer as model_lib


def test_sinusoidal_positions_match_the_paper_formula():
  table = model_lib.sinusoidal_positions(50, 16)
  for pos in (0, 1, 7, 49):
    for i in range(8):
      angle = pos / 10000 ** (2 * i / 16)
      assert math.isclose(table[pos, 2 * i], math.sin(angle), abs_tol=1e-6)
      assert math.isclose(table[pos, 2 * i + 1], math.cos(angle), abs_tol=1e-6)


def _dropout(rate, x, seed=0, deterministic=False):
  return model_lib.Dropout(rate).apply({}, x, deterministic, rngs={'dropout': jax.random.PRNGKey(seed)})


@pytest.mark.parametrize('rate', [0.1, 0.3])
def test_dropout_zeroes_at_its_rate_and_scales_the_rest_to_keep_the_mean(rate):
  x = jnp.ones((300, 1001), jnp.float32)  # odd width: the last 32-bit word is cut in half
  y = np.asarray(_dropout(rate, x))
  dropped = y == 0
  # 300k Bernoulli draws: the standard error of the fraction is below 0.001.
  assert abs(dropped.mean() - rate) < 0.004
  np.testing.assert_allclose(y[~dropped], 1 / (1 - rate), rtol=1e-4)
  assert abs(y.mean() - 1.0) < 0.01
  # Each row, and each column, drops its own share: no mask repeated along an axis.
  assert np.all(np.abs(dropped.mean(axis=1) - rate) < 0.08) and np.all(np.abs(dropped.mean(axis=0) - rate) < 0.15)
  # The two 16-bit halves of one random word are independent: both dropped with probability rate^2.
  both = dropped[:, 0:1000:2] & dropped[:, 1:1000:2]
  assert abs(both.mean() - rate ** 2) < 0.006
  assert len({row.tobytes() for row in dropped}) == len(dropped)


@pytest.mark.parametrize('rate', [0.1, 0.3])
def test_bfloat16_dropout_rounds_each_kept_value_once(rate):
  x = jax.random.normal(jax.random.PRNGKey(3), (400, 1000), jnp.bfloat16)
  y = np.asarray(_dropout(rate, x), np.float32)
  kept = y != 0
  keep = 1 - round(rate * 2 ** 16) / 2 ** 16  # the rate applied
  # x / keep in float64, rounded once to bfloat16. Dividing by keep rounded to bfloat16 first (0.8984 for 0.9)
  # scaled every kept value 0.18% (rate 0.1) or 0.11% (0.3) too much.
  want = np.asarray(jnp.asarray(np.asarray(x, np.float64)[kept] / keep, jnp.bfloat16), np.float32)
  mismatched = np.mean(y[kept] != want)
  assert mismatched < 0.01, mismatched  # float32's own rounding of x / keep may tip a rare tie


def test_dropout_is_the_identity_when_deterministic_or_off_and_keeps_dtype_and_key():
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 7, 3), jnp.bfloat16)
  assert _dropout(0.3, x, deterministic=True) is x and _dropout(0.0, x) is x
  y = _dropout(0.5, x)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  np.testing.assert_array_equal(y, _dropout(0.5, x))  # same key, same mask
  assert not np.array_equal(y, _dropout(0.5, x, seed=2))
  np.testing.assert_array_equal(_dropout(1.0, x), np.zeros(x.shape))


def test_padding_and_causal_masks_match_loops():
  q = np.array([[5, 6, 0], [7, 0, 0]])
  k = np.array([[5, 0, 0, 0], [7, 8, 9, 0]])
  mask = np.asarray(model_lib.padding_mask(q, k))
  causal = np.asarray(model_lib.causal_mask(4))
  for b in range(2):
    for i in range(3):
      for j in range(4):
        assert mask[b, 0, i, j] == (q[b, i] != 0 and k[b, j] != 0)
  for i in range(4):
    for j in range(4):
      assert causal[0, 0, i, j] == (j <= i)


def test_no_position_sees_padding_or_the_future():
  # On a GPU float32 matmuls default to TF32, which rounds ~1e-3: this test is about masks, not precision.
  with jax.default_matmul_precision('highest'):
    model, params = tiny_model()
    src = jnp.array([[4, 5, 6, 3, 0, 0]])
    tgt = jnp.array([[2, 7, 8, 9, 10, 0]])
    logits = model.apply({'params': params}, src, tgt)
    # Extra padding columns on either side leave every real position unchanged...
    longer = model.apply({'params': params}, jnp.pad(src, ((0, 0), (0, 3))), jnp.pad(tgt, ((0, 0), (0, 3))))
    # float32 sums over other lengths round differently (~2e-5 here); a leak from padding or the future moves
    # logits by orders of magnitude more.
    np.testing.assert_allclose(logits[0, :5], longer[0, :5], rtol=1e-5, atol=5e-5)
    # ...and changing target token t changes no logit before position t.
    for t in range(1, 5):
      changed = model.apply({'params': params}, src, tgt.at[0, t].set(12))
      np.testing.assert_allclose(logits[0, :t], changed[0, :t], rtol=1e-5, atol=5e-5)
      assert not np.allclose(logits[0, t], changed[0, t], atol=1e-5)


def test_attention_equals_a_numpy_softmax():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(2, 3, 4, 8)).astype(np.float32) for _ in range(3))
  mask = rng.random((2, 1, 3, 3)) > 0.3
  mask[..., 0] = True
  out, weights = model_lib.scaled_dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                        jnp.asarray(mask))
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(8)
  scores = np.where(mask, scores, -np.inf)
  expected_w = np.exp(scores - scores.max(-1, keepdims=True))
  expected_w /= expected_w.sum(-1, keepdims=True)
  np.testing.assert_allclose(weights, expected_w, atol=1e-6)
  np.testing.assert_allclose(out, np.einsum('bhqk,bkhd->bqhd', expected_w, v), atol=1e-5)


def test_bfloat16_attention_logits_are_the_float32_products_of_the_bfloat16_operands():
  """The explicit path in bfloat16 (decoding, attention dropout): the weights are the float32 softmax of q.k /
  sqrt(d_k) for the bf16 q and k it is given, with no second rounding of the queries (sqrt(32) is no power of 2)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 6, 4, 32)) * 2, jnp.bfloat16) for _ in range(3))
  mask = rng.random((2, 1, 6, 6)) > 0.3
  mask[..., 0] = True
  _, weights = model_lib.scaled_dot_product_attention(q, k, v, jnp.asarray(mask))
  q64, k64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k))
  scores = np.where(mask, np.einsum('bqhd,bkhd->bhqk', q64, k64) / np.sqrt(32), -np.inf)
  expected = np.exp(scores - scores.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  assert weights.dtype == jnp.float32
  np.testing.assert_allclose(weights, expected, atol=2e-6)


def test_embedding_is_shared_and_scaled():
  model, params = tiny_model()
  embedding = np.asarray(params['shared_embedding']['embedding'])
  # One matrix only: no separate source, target or output projection parameters.
  names = jax.tree_util.tree_flatten_with_path(params)[0]
  assert sum('embedding' in jax.tree_util.keystr(path) for path, _ in names) == 1
  src = jnp.array([[4, 3]])
  x = model.apply({'params': params}, src, jnp.arange(2)[None], True, method=model_lib.Transformer.embed)
  expected = embedding[[4, 3]] * np.sqrt(32) + model_lib.sinusoidal_positions(2, 32)
  np.testing.assert_allclose(x[0], expected, atol=1e-5)


def test_initialization_is_normal_embeddings_of_std_d_to_the_minus_half_and_xavier_uniform_kernels():
  """The shared embedding ~ N(0, d^-1/2) (unit-variance inputs after the sqrt(d) scale, unit-scale logits), every
  dense kernel [fan_in, fan_out] ~ U(-a, a) with a = sqrt(6 / (fan_in + fan_out)), biases 0, LayerNorm scales 1."""
  config = model_lib.ModelConfig(vocab_size=1000, num_encoder_layers=1, num_decoder_layers=1, d_model=64, d_ff=256,
                                 num_heads=4, dtype='float32')
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(model_lib.Transformer(config).init)(jax.random.PRNGKey(0), dummy, dummy)['params']
  embedding = np.asarray(params['shared_embedding']['embedding'], np.float64)
  assert abs(embedding.std() - 64 ** -0.5) < 0.02 * 64 ** -0.5 and abs(embedding.mean()) < 0.005
  kernels = 0
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, x = jax.tree_util.keystr(path), np.asarray(x, np.float64)
    if name.endswith("['kernel']"):
      bound = math.sqrt(6 / (x.shape[0] + x.shape[1]))
      assert 0.98 * bound < np.abs(x).max() <= bound, name
      assert abs(x.std() - bound / math.sqrt(3)) < 0.03 * bound / math.sqrt(3), name
      kernels += 1
    elif name.endswith("['bias']"):
      assert np.all(x == 0), name
    elif name.endswith("['scale']"):
      assert np.all(x == 1), name
  assert kernels == 3 + 4 + 2 + 2  # encoder qkv, output; decoder qkv, output, query, kv; 2 feed-forward each


@pytest.mark.parametrize('rate', [0.1, 0.3])
def test_source_word_dropout_blanks_whole_source_tokens_at_its_rate_and_keeps_their_positions(rate):
  """Sennrich and Zhang's word dropout: a dropped source token enters as its position encoding alone (no
  rescaling), a kept one as embedding x sqrt(d) + position; never at evaluation. (The target side takes `embed`'s
  default rate of 0: only `encode` passes the config's.)"""
  model, params = tiny_model(dropout_rate=0.0)
  model = _variant(model, source_word_dropout=rate)
  embedding = np.asarray(params['shared_embedding']['embedding'])
  src = jax.random.randint(jax.random.PRNGKey(3), (100, 40), 3, embedding.shape[0])
  positions = model_lib.sinusoidal_positions(40, 32)
  full = embedding[np.asarray(src)] * np.sqrt(32) + positions
  # The encoder's input, as encode builds it (captured before the first layer).
  def encoder_input(module, src, deterministic):
    return module.embed(src, jnp.arange(40)[None], deterministic, module.config.source_word_dropout)
  x = np.asarray(model.apply({'params': params}, src, False, method=encoder_input,
                             rngs={'dropout': jax.random.PRNGKey(0)}))
  blank = np.all(np.abs(x - positions) < 1e-5, axis=-1)
  kept = np.all(np.abs(x - full) < 1e-4, axis=-1)
  assert np.all(blank ^ kept)  # every token is either whole or blank: one draw per token, not per feature
  # 4,000 draws: the standard error of the fraction is below 0.008.
  assert abs(blank.mean() - rate) < 0.03
  evaluation = model.apply({'params': params}, src, True, method=encoder_input)
  np.testing.assert_allclose(evaluation, full, atol=1e-4)
  # Training-mode logits differ from evaluation's only through the source: with the rate at 0 they are equal.
  tgt = src[:, :10]
  train = lambda m: m.apply({'params': params}, src, tgt, False, rngs={'dropout': jax.random.PRNGKey(0)})
  assert not np.allclose(train(model), model.apply({'params': params}, src, tgt))
  np.testing.assert_allclose(train(_variant(model, source_word_dropout=0.0)),
                             model.apply({'params': params}, src, tgt), atol=1e-5)


def _variant(model, **changes):
  return model.clone(config=dataclasses.replace(model.config, **changes))


def test_fused_attention_equals_the_einsum_path_and_keeps_padding_rows_finite():
  model, params = tiny_model()
  src = jnp.array([[4, 5, 6, 3, 0, 0], [7, 3, 0, 0, 0, 0]])
  tgt = jnp.array([[2, 7, 8, 9, 10, 0], [2, 5, 0, 0, 0, 0]])
  reference = _variant(model, attention_impl='einsum').apply({'params': params}, src, tgt)
  fused = _variant(model, attention_impl='xla').apply({'params': params}, src, tgt)
  # Padding query rows attend to nothing: both paths must stay finite there (the loss masks them).
  assert np.isfinite(np.asarray(fused)).all() and np.isfinite(np.asarray(reference)).all()
  np.testing.assert_allclose(fused[0, :5], reference[0, :5], rtol=1e-5, atol=5e-5)
  np.testing.assert_allclose(fused[1, :2], reference[1, :2], rtol=1e-5, atol=5e-5)


def test_auto_attention_picks_cudnn_only_for_gpu_half_precision():
  assert model_lib.resolve_attention_impl('auto', jnp.bfloat16, 64, 'gpu') == 'cudnn'
  assert model_lib.resolve_attention_impl('auto', jnp.float16, 128, 'gpu') == 'cudnn'
  assert model_lib.resolve_attention_impl('auto', jnp.float32, 64, 'gpu') == 'xla'
  assert model_lib.resolve_attention_impl('auto', jnp.bfloat16, 64, 'tpu') == 'xla'
  assert model_lib.resolve_attention_impl('auto', jnp.bfloat16, 136, 'gpu') == 'xla'
  assert model_lib.resolve_attention_impl('auto', jnp.bfloat16, 60, 'gpu') == 'xla'
  assert model_lib.resolve_attention_impl('einsum', jnp.bfloat16, 64, 'gpu') == 'einsum'


def test_model_config_settles_dtype_and_attention_for_its_platform_not_this_machine():
  settled = lambda platform, **kw: model_lib.ModelConfig(vocab_size=100, platform=platform, **kw)
  # 'auto' follows the named platform, whatever backend runs this test (CPU in CI).
  cuda = settled('cuda')
  assert (cuda.platform, cuda.dtype, cuda.attention_impl) == ('gpu', 'bfloat16', 'cudnn')
  assert (settled('tpu').dtype, settled('tpu').attention_impl) == ('bfloat16', 'xla')
  assert (settled('cpu').dtype, settled('cpu').attention_impl) == ('float32', 'xla')
  assert settled('auto').platform == jax.default_backend()
  assert settled('cuda', dtype='float32').attention_impl == 'xla'
  # Big: 1024 / 16 = 64 per head, which cuDNN takes.
  assert settled('cuda', d_model=1024, d_ff=4096, num_heads=16).attention_impl == 'cudnn'
  with pytest.raises(model_lib.ConfigError, match="platform must be 'auto' or one of"):
    settled('metal')


@pytest.mark.parametrize('fields, rule', [
    # Each rule of cuDNN's flash attention, broken on its own (the other fields within it).
    (dict(d_model=480, num_heads=8),
     r'needs a head dim \(config.model.d_model / config.model.num_heads = 480 / 8 = 60\) that is a multiple of 8 '
     r'and at most 128'),
    (dict(d_model=1088, num_heads=4),
     r'needs a head dim .* = 1088 / 4 = 272\) that is a multiple of 8 and at most 128'),
    (dict(dtype='float32'), r'needs config.model.dtype bfloat16 or float16 .* not float32'),
    (dict(platform='tpu'), r"needs a CUDA GPU; this model is built for 'tpu'"),
    (dict(platform='cpu', dtype='bfloat16'), r"needs a CUDA GPU; this model is built for 'cpu'"),
])
def test_cudnn_attention_on_a_config_cudnn_refuses_is_a_config_error(fields, rule):
  fields = {'platform': 'cuda', 'dtype': 'auto', **fields}
  with pytest.raises(model_lib.ConfigError, match=r"config.model.attention_impl='cudnn' " + rule):
    model_lib.ModelConfig(vocab_size=100, attention_impl='cudnn', **fields)


@pytest.mark.parametrize('fields', [dict(d_model=1024, num_heads=8), dict(d_model=64, num_heads=8),
                                    dict(dtype='float16')])
def test_cudnn_attention_is_accepted_at_the_limits(fields):
  # Head dims 128 and 8 (the edges of the rule) and float16.
  config = model_lib.ModelConfig(vocab_size=100, attention_impl='cudnn', platform='cuda', **fields)
  assert config.attention_impl == 'cudnn'


def test_cudnn_lengths_must_be_one_per_row():
  mask = model_lib.AttentionMask(jnp.ones((2, 1, 3, 3), bool), jnp.array([3, 2]), jnp.array([3, 1]))
  query, key = model_lib.cudnn_lengths(mask, 2)
  assert query.dtype == jnp.int32 and key.tolist() == [3, 1]
  with pytest.raises(ValueError, match=r'query_lengths of shape \(4,\), got \(2,\)'):
    model_lib.cudnn_lengths(mask, 4)
  with pytest.raises(ValueError, match=r'key_lengths of shape \(2,\), got None'):
    model_lib.cudnn_lengths(model_lib.AttentionMask(mask.mask, mask.query_lengths), 2)


# The fused paths in bfloat16: 'xla' runs everywhere, 'cudnn' (flash attention) only on a CUDA GPU, where CI
# never runs; the same checks on 'xla' show on every machine that their tolerances pass a correct bf16 path.
BF16_FUSED = ['xla', pytest.param('cudnn', marks=pytest.mark.skipif(
    jax.default_backend() != 'gpu', reason='cuDNN flash attention runs on a CUDA GPU only'))]


def _reference_attention(q, k, v, allowed, cotangent):
  """softmax(q k^T / sqrt(d)) v over [B, T, H, D] float64 arrays, and the gradients of sum(out * cotangent) with
  respect to q, k and v, by the chain rule written out (dS = P * (dP - rowsum(dP * P)))."""
  scale = 1 / math.sqrt(q.shape[-1])
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) * scale
  scores = np.where(allowed, scores, -np.inf)
  top = np.max(np.where(allowed, scores, -1e300), axis=-1, keepdims=True)
  weights = np.where(allowed, np.exp(scores - top), 0.0)
  weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
  out = np.einsum('bhqk,bkhd->bqhd', weights, v)
  d_weights = np.einsum('bqhd,bkhd->bhqk', cotangent, v)
  d_scores = weights * (d_weights - (d_weights * weights).sum(-1, keepdims=True))
  dq = np.einsum('bhqk,bkhd->bqhd', d_scores, k) * scale
  dk = np.einsum('bhqk,bqhd->bkhd', d_scores, q) * scale
  dv = np.einsum('bhqk,bqhd->bkhd', weights, cotangent)
  return out, (dq, dk, dv)


@pytest.mark.parametrize('impl', BF16_FUSED)
@pytest.mark.parametrize('causal,query_len', [(True, 16), (False, 16), (False, 12)])
def test_fused_attention_in_bfloat16_matches_a_float64_reference(impl, causal, query_len):
  """The fused attention call itself, values and gradients, on padded rows of different lengths. Padded keys
  carry huge values, so that attending to one moves an output far past bf16 rounding; each path reads its own
  form of the mask (cuDNN the lengths and the causal flag, XLA the dense mask)."""
  rng = np.random.default_rng(0)
  batch, key_len, heads, head_dim = 3, 16, 2, 64
  query_lengths = np.array([query_len, 9, 1]) if causal else np.array([query_len, 5, 1])
  key_lengths = query_lengths if causal else np.array([key_len, 9, 3])
  as_bf16 = lambda shape: np.array(jnp.asarray(rng.normal(size=shape), jnp.bfloat16).astype(jnp.float32), np.float64)
  q, k, v = as_bf16((batch, query_len, heads, head_dim)), as_bf16((batch, key_len, heads, head_dim)), \
      as_bf16((batch, key_len, heads, head_dim))
  real_queries = np.arange(query_len)[None, :] < query_lengths[:, None]
  real_keys = np.arange(key_len)[None, :] < key_lengths[:, None]
  v[~real_keys] = 64.0  # exact in bf16; a leak from padding shows at once
  allowed = real_queries[:, None, :, None] & real_keys[:, None, None, :]
  if causal:
    allowed = allowed & np.tril(np.ones((query_len, key_len), bool))[None, None]
  cotangent = as_bf16(q.shape) * real_queries[:, :, None, None]  # padding query rows are not scored
  want, want_grads = _reference_attention(q, k, v, allowed, cotangent)

  mask = model_lib.AttentionMask(jnp.asarray(allowed), jnp.asarray(query_lengths, jnp.int32),
                                 jnp.asarray(key_lengths, jnp.int32), causal=causal)
  def loss(q, k, v):
    out = model_lib.fused_attention(q, k, v, mask, impl)
    return (out.astype(jnp.float32) * cotangent).sum(), out
  bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  (_, got), got_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*bf16)
  got = np.asarray(got, np.float64)
  assert np.isfinite(got[real_queries]).all()
  # bf16 keeps 8 bits: its rounding of the weights and the output stays under 1% of the largest value.
  scale = np.abs(want[real_queries]).max()
  assert np.abs(got[real_queries] - want[real_queries]).max() <= 0.02 * scale
  for name, g, w in zip('qkv', got_grads, want_grads):
    g = np.asarray(g, np.float64)
    assert np.abs(g - w).max() <= 0.03 * np.abs(w).max(), f'gradient of {name}'


@pytest.mark.parametrize('impl', BF16_FUSED)
def test_fused_attention_in_a_bfloat16_model_is_as_close_to_float32_as_the_einsum_path(impl):
  """The model with a fused path in bf16 (cuDNN: the lengths and the causal flag that the encoder, the decoder's
  self-attention and its encoder-decoder attention pass) is as near the float32 model as the bf16 einsum path
  is. Two correct bf16 paths round differently, by ~1% of the largest logit here, so each is measured against
  float32, not against each other."""
  model, params = tiny_model()
  params = jax.tree_util.tree_map(lambda x: x / 3.0 if x.ndim == 2 else x, params)  # init scale: less rounding
  src = jnp.array([[4, 5, 6, 3, 0, 0, 0, 0], [7, 3, 0, 0, 0, 0, 0, 0]])
  tgt = jnp.array([[2, 7, 8, 9, 10, 11, 0, 0], [2, 5, 0, 0, 0, 0, 0, 0]])
  real = np.asarray(tgt != 0)
  logits = lambda **changes: np.asarray(_variant(model, **changes).apply({'params': params}, src, tgt), np.float64)
  with jax.default_matmul_precision('highest'):  # a GPU would run float32 matmuls as TF32
    reference = logits(dtype='float32', attention_impl='einsum')
  scale = np.abs(reference[real]).max()
  error = lambda got: np.abs(got[real] - reference[real]).max() / scale
  einsum_error = error(logits(dtype='bfloat16', attention_impl='einsum'))
  fused_error = error(logits(dtype='bfloat16', attention_impl=impl))
  assert 0 < einsum_error < 0.03
  assert fused_error <= 2 * einsum_error + 0.005, (fused_error, einsum_error)


def test_intermediates_hold_float32_attention_weights_per_module():
  model, params = tiny_model()
  src, tgt = jnp.array([[4, 5, 3]]), jnp.array([[2, 6, 7, 8]])
  _, state = model.apply({'params': params}, src, tgt, mutable=['intermediates'])
  decoder = state['intermediates']['decoder_1']
  (self_weights,), (cross_weights,) = decoder['self_attention']['attention_weights'], \
      decoder['cross_attention']['attention_weights']
  assert self_weights.shape == (1, 4, 4, 4) and cross_weights.shape == (1, 4, 4, 3)
  assert self_weights.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(cross_weights).sum(-1), 1.0, atol=1e-5)
  assert np.allclose(np.triu(np.asarray(self_weights)[0, 0], 1), 0)  # causal


@pytest.mark.parametrize('remat', ['full', 'dots'])
def test_remat_gives_the_same_gradients(remat):
  model, params = tiny_model()
  src, tgt = jnp.array([[4, 5, 6, 3]]), jnp.array([[2, 7, 8, 9]])
  loss = lambda m: jax.grad(lambda p: (m.apply({'params': p}, src, tgt) ** 2).mean())(params)
  plain, rematerialized = loss(model), loss(_variant(model, remat=remat))
  for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(rematerialized)):
    # Recomputation changes float32 rounding (jax 0.12 fuses differently; 2.3e-6 on a leaf of magnitude ~0.1
    # on an AMD EPYC): 1e-5 of each leaf's scale, far below what a wrong or missing recomputed activation gives.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


@pytest.mark.parametrize('remat, policy', [('full', jax.checkpoint_policies.nothing_saveable),
                                           ('dots', jax.checkpoint_policies.dots_with_no_batch_dims_saveable)])
def test_remat_wraps_every_layer_in_its_policy(remat, policy):
  """The gradients above are the same whether or not anything is recomputed: here the traced forward pass holds one
  rematerialized block per layer (2 encoder + 2 decoder), each with the policy the setting names."""
  model, params = tiny_model()
  src, tgt = jnp.array([[4, 5, 6, 3]]), jnp.array([[2, 7, 8, 9]])
  policies = lambda m: [eqn.params['policy'] for eqn in jax.make_jaxpr(
      lambda p: m.apply({'params': p}, src, tgt))(params).eqns if 'policy' in eqn.params]
  assert policies(model) == []
  assert policies(_variant(model, remat=remat)) == [policy] * 4


def test_bfloat16_computes_in_bfloat16_with_float32_params_and_logits():
  model, params = tiny_model()
  bf16 = _variant(model, dtype='bfloat16')
  src, tgt = jnp.array([[4, 5, 6, 3]]), jnp.array([[2, 7, 8, 9]])
  logits = bf16.apply({'params': params}, src, tgt)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, model.apply({'params': params}, src, tgt),
                             atol=0.15 * float(jnp.abs(logits).max()))
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(bf16.init(jax.random.PRNGKey(0), src, tgt)))
  jaxpr = str(jax.make_jaxpr(lambda p: bf16.apply({'params': p}, src, tgt))(params))
  assert 'bf16' in jaxpr


def test_length_form_of_the_masks_equals_the_dense_masks(monkeypatch):
  """cuDNN gets padding and causality as per-row lengths and a flag; here XLA computes with that form, and
  every real position must come out as with the dense masks."""
  model, params = tiny_model()
  src = jnp.array([[4, 5, 6, 3, 0, 0], [7, 3, 0, 0, 0, 0]])
  tgt = jnp.array([[2, 7, 8, 9, 10, 0], [2, 5, 0, 0, 0, 0]])
  model = _variant(model, attention_impl='xla')
  dense = model.apply({'params': params}, src, tgt)
  used = []

  def length_form(q, k, v, mask, impl):
    if mask.query_lengths is None:
      return jax.nn.dot_product_attention(q, k, v, mask=mask.mask, implementation=impl)
    used.append(mask.causal)
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, query_seq_lengths=mask.query_lengths,
                                        key_value_seq_lengths=mask.key_lengths, implementation=impl)

  monkeypatch.setattr(model_lib, 'fused_attention', length_form)
  lengths = model.apply({'params': params}, src, tgt)
  assert sorted(set(used)) == [False, True] and len(used) == 2 + 2 * 2  # encoder self, decoder self + cross
  np.testing.assert_allclose(lengths[0, :5], dense[0, :5], atol=1e-5)
  np.testing.assert_allclose(lengths[1, :2], dense[1, :2], atol=1e-5)


def _bf16(x):
  """x rounded to bfloat16, as float64: the operands a bfloat16 matmul multiplies."""
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_bfloat16_matmul_rounds_operands_and_accumulates_in_float32_forward_and_backward():
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64)), np.float32)
  w = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (64, 7)), np.float32)
  cotangent = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (3, 5, 7)), np.float32)
  y = model_lib.bfloat16_matmul(jnp.asarray(x), jnp.asarray(w), jnp.float32)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, _bf16(x) @ _bf16(w), rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(y) - x.astype(np.float64) @ w).max() > 1e-3  # the operands were rounded
  dx, dw = jax.grad(lambda x, w: jnp.sum(model_lib.bfloat16_matmul(x, w, jnp.float32) * cotangent),
                    argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
  assert dx.dtype == dw.dtype == jnp.float32
  np.testing.assert_allclose(dx, _bf16(cotangent) @ _bf16(w).T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, _bf16(x).reshape(-1, 64).T @ _bf16(cotangent).reshape(-1, 7), rtol=1e-5, atol=1e-4)


def test_bfloat16_matmul_precision_keeps_the_parameters_and_nearly_the_logits():
  model, params = tiny_model()
  fast = _variant(model, matmul_precision='bfloat16')
  src, tgt = jnp.array([[4, 5, 6, 3]]), jnp.array([[2, 7, 8, 9]])
  fast_params = fast.init(jax.random.PRNGKey(0), src, tgt)['params']
  assert jax.tree.structure(fast_params) == jax.tree.structure(params)  # checkpoints interchange
  exact = model.apply({'params': params}, src, tgt)
  rounded = fast.apply({'params': params}, src, tgt)
  assert rounded.dtype == jnp.float32
  difference = np.abs(np.asarray(rounded) - np.asarray(exact))
  assert 1e-4 < difference.max() < 0.05 * np.abs(np.asarray(exact)).max()
  with pytest.raises(model_lib.ConfigError, match='config.model.matmul_precision must be one of'):
    _variant(model, matmul_precision='bf16')


@pytest.mark.parametrize('changes, rounds', [({}, False), ({'matmul_precision': 'bfloat16'}, True),
                                              ({'dtype': 'bfloat16'}, True)])
def test_a_searchs_vocabulary_kernel_gives_the_logits_of_the_shared_embedding(changes, rounds):
  # The search's [d, V] kernel made once (with_vocabulary_kernel) against the projection onto the embedding that
  # training runs: a kernel left float32 where the operands are rounded, or rounded where they are not, or the
  # states not rounded alike, gives other logits than the trained model and than the plain product below.
  model, params = tiny_model()
  model = _variant(model, **changes)
  states = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (2, 3, 32)), np.float32)
  logits = model.apply({'params': params}, jnp.asarray(states), method=model_lib.Transformer.vocabulary_logits)
  search_params = model_lib.with_vocabulary_kernel(model.config, params)
  assert search_params[model_lib.VOCABULARY_KERNEL].shape == (32, params['shared_embedding']['embedding'].shape[0])
  from_kernel = model.apply({'params': search_params}, jnp.asarray(states),
                            method=model_lib.Transformer.vocabulary_logits)
  assert from_kernel.dtype == logits.dtype == jnp.float32
  np.testing.assert_array_equal(from_kernel, logits)
  embedding = np.asarray(params['shared_embedding']['embedding'], np.float64)
  expected = _bf16(states) @ _bf16(embedding).T if rounds else states.astype(np.float64) @ embedding.T
  np.testing.assert_allclose(from_kernel, expected, rtol=1e-5, atol=1e-5)


def test_auto_matmul_precision_is_bfloat16_only_on_a_cpu_with_bfloat16_dot_instructions(tmp_path, monkeypatch):
  zen4, avx2 = tmp_path / 'zen4', tmp_path / 'avx2'
  zen4.write_text('processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\n')
  avx2.write_text('processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n\n')
  assert model_lib.cpu_has_bfloat16_dot(str(zen4)) and not model_lib.cpu_has_bfloat16_dot(str(avx2))
  assert not model_lib.cpu_has_bfloat16_dot(str(tmp_path / 'missing'))  # not Linux: stay float32
  monkeypatch.setattr(model_lib, 'cpu_has_bfloat16_dot', lambda: True)
  assert model_lib.resolve_matmul_precision('auto', 'cpu') == 'bfloat16'
  assert model_lib.resolve_matmul_precision('auto', 'gpu') == 'float32'  # there dtype bfloat16 decides
  assert model_lib.resolve_matmul_precision('float32', 'cpu') == 'float32'
  monkeypatch.setattr(model_lib, 'cpu_has_bfloat16_dot', lambda: False)
  assert model_lib.resolve_matmul_precision('auto', 'cpu') == 'float32'
