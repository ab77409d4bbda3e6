"""The model's forward pass, the tied output projection and the loss normalizer against computations written
out plainly in NumPy (loops and the paper's formulas), independent of Flax and of the train step."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from conftest import distinct_vectors, subprocess_env, tiny_model
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.serving import ctranslate2 as ctranslate2_export
from flaxformer_nmt.training import step as ts

HERE = os.path.dirname(os.path.abspath(__file__))
# Every comparison here is with float64 NumPy or an exact search: float32 matmuls at full precision on a GPU too.
pytestmark = pytest.mark.usefixtures('full_float32_matmuls')


# --- A plain NumPy Transformer forward (float64) -------------------------------------------------------------

def np_positions(length, d):
  table = np.zeros((length, d))
  for pos in range(length):
    for i in range(0, d, 2):
      table[pos, i] = np.sin(pos / 10000 ** (i / d))
      table[pos, i + 1] = np.cos(pos / 10000 ** (i / d))
  return table


def np_layer_norm(x, p, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p['scale'] + p['bias']


def np_attention(queries, keys_values, wq, wk, wv, wo, allowed, heads, record=None):
  """Multi-head attention of one sentence: queries [Tq, d], keys_values [Tk, d]; allowed[i, j]: i sees j.
  record: a list that receives each head's weights [Tq, Tk], head 0 first."""
  d = queries.shape[-1]
  dh = d // heads
  q, k, v = queries @ wq, keys_values @ wk, keys_values @ wv
  out = np.zeros((len(queries), d))
  for h in range(heads):
    cols = slice(h * dh, (h + 1) * dh)
    scores = q[:, cols] @ k[:, cols].T / np.sqrt(dh)
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out[:, cols] = weights @ v[:, cols]
    if record is not None:
      record.append(weights)
  return out @ wo


def np_self_attention(x, p, allowed, heads, record=None):
  d = x.shape[-1]
  qkv = p['qkv']['kernel']  # [d, 3d]: query, key, value columns
  return np_attention(x, x, qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:], p['output']['kernel'], allowed, heads,
                      record)


def np_cross_attention(y, memory, p, allowed, heads, record=None):
  d = y.shape[-1]
  kv = p['kv']['kernel']  # [d, 2d]: key, value columns
  return np_attention(y, memory, p['query']['kernel'], kv[:, :d], kv[:, d:], p['output']['kernel'], allowed, heads,
                      record)


def np_feed_forward(x, p):
  return np.maximum(x @ p['wi']['kernel'] + p['wi']['bias'], 0) @ p['wo']['kernel'] + p['wo']['bias']


def np_sublayer(x, f, norm, pre_ln, drop=1.0):
  """drop: what dropout multiplies the sub-layer output by before the residual sum."""
  return x + drop * f(np_layer_norm(x, norm)) if pre_ln else np_layer_norm(x + drop * f(x), norm)


def np_transformer(params, src, tgt_in, heads, pre_ln, drop=1.0, weights=None):
  """Logits [T, V] of one sentence pair (without padding). drop: what dropout (P_drop, section 5.4) multiplies
  the embedding sums and every sub-layer output by (1: evaluation). weights: a dict that receives every
  attention's weights, {(stack, layer, kind): [each head's [Tq, Tk]]}, stack 'encoder' or 'decoder' and kind
  'self_attention' or 'cross_attention'."""
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  embedding = p['shared_embedding']['embedding']
  d = embedding.shape[1]
  sublayer = lambda x, f, norm: np_sublayer(x, f, norm, pre_ln, drop)
  record = lambda *key: None if weights is None else weights.setdefault(key, [])
  x = (embedding[src] * np.sqrt(d) + np_positions(len(src), d)) * drop
  for i in range(sum(k.startswith('encoder_') and k[8:].isdigit() for k in p)):
    layer = p[f'encoder_{i}']
    x = sublayer(x, lambda z: np_self_attention(z, layer['self_attention'], np.ones((len(src),) * 2, bool), heads,
                                                record('encoder', i, 'self_attention')),
                 layer['attention_block']['norm'])
    x = sublayer(x, lambda z: np_feed_forward(z, layer['feed_forward']), layer['feed_forward_block']['norm'])
  if pre_ln:
    x = np_layer_norm(x, p['encoder_norm'])
  y = (embedding[tgt_in] * np.sqrt(d) + np_positions(len(tgt_in), d)) * drop
  causal = np.tril(np.ones((len(tgt_in),) * 2, bool))
  for i in range(sum(k.startswith('decoder_') and k[8:].isdigit() for k in p)):
    layer = p[f'decoder_{i}']
    y = sublayer(y, lambda z: np_self_attention(z, layer['self_attention'], causal, heads,
                                                record('decoder', i, 'self_attention')), layer['self_block']['norm'])
    y = sublayer(y, lambda z: np_cross_attention(z, x, layer['cross_attention'],
                                                 np.ones((len(tgt_in), len(src)), bool), heads,
                                                 record('decoder', i, 'cross_attention')),
                 layer['cross_block']['norm'])
    y = sublayer(y, lambda z: np_feed_forward(z, layer['feed_forward']), layer['feed_forward_block']['norm'])
  if pre_ln:
    y = np_layer_norm(y, p['decoder_norm'])
  return y @ embedding.T  # the output projection is the shared embedding


SRC = np.array([[5, 9, 7, 12, 3], [8, 6, 3, 0, 0]])
TGT_IN = np.array([[2, 11, 4, 10, 0, 0], [2, 13, 14, 15, 6, 9]])


@pytest.mark.parametrize('pre_layer_norm', [False, True])
@pytest.mark.parametrize('attention_impl', ['xla', 'einsum'])
def test_forward_equals_a_numpy_transformer(pre_layer_norm, attention_impl):
  model, params = tiny_model(pre_layer_norm=pre_layer_norm)
  params = distinct_vectors(params)
  model = model_lib.Transformer(model_lib.ModelConfig(**{**model.config.__dict__, 'attention_impl': attention_impl}))
  logits = np.asarray(model.apply({'params': params}, jnp.asarray(SRC), jnp.asarray(TGT_IN)))
  for row in range(len(SRC)):
    src, tgt_in = SRC[row][SRC[row] != 0], TGT_IN[row][TGT_IN[row] != 0]
    expected = np_transformer(params, src, tgt_in, heads=model.config.num_heads, pre_ln=pre_layer_norm)
    # Real positions only: padding positions carry no prediction (and the padding shortens nothing here).
    np.testing.assert_allclose(logits[row, :len(tgt_in)], expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize('pre_layer_norm', [False, True])
def test_sown_attention_weights_are_the_numpy_softmax_of_each_layer_head_and_kind(pre_layer_norm):
  """What the attention pictures draw: every attention layer's sown `attention_weights` [B, H, Tq, Tk] against
  softmax(q k^T / sqrt(d_k)) of its own q, k projections per head, computed in NumPy along the forward pass.
  Catches heads in another order, another layer's or kind's weights, scores not scaled, a softmax over the
  queries, and masked keys (padding, the future) that are not exactly zero."""
  model, params = tiny_model(pre_layer_norm=pre_layer_norm)
  params = distinct_vectors(params)
  _, state = model.apply({'params': params}, jnp.asarray(SRC), jnp.asarray(TGT_IN), mutable=['intermediates'])
  sown = state['intermediates']
  for row in range(len(SRC)):
    src, tgt_in = SRC[row][SRC[row] != 0], TGT_IN[row][TGT_IN[row] != 0]
    expected = {}
    np_transformer(params, src, tgt_in, heads=model.config.num_heads, pre_ln=pre_layer_norm, weights=expected)
    assert len(expected) == 6  # 2 encoder self-attentions, 2 decoder self- and 2 cross-attentions
    for (stack, layer, kind), heads in expected.items():
      (got,) = sown[f'{stack}_{layer}'][kind]['attention_weights']
      want = np.stack(heads)  # [H, Tq, Tk]
      rows, columns = want.shape[1:]
      got = np.asarray(got)[row]
      assert got.dtype == np.float32
      np.testing.assert_allclose(got[:, :rows, :columns], want, atol=1e-5, err_msg=f'{stack}_{layer} {kind}')
      assert not got[:, :rows, columns:].any()  # padding keys: exactly zero
      if kind == 'self_attention' and stack == 'decoder':
        assert not np.triu(got[:, :rows, :rows], 1).any()  # the future: exactly zero


class ExpectedDropout(nn.Module):
  """Dropout's expectation in its place: in training every element is kept and scaled by 1 / (1 - rate), so that
  a forward pass shows where dropout sits without drawing masks."""
  rate: float

  @nn.compact
  def __call__(self, x, deterministic):
    return x if deterministic or self.rate == 0.0 else x / (1.0 - self.rate)


@pytest.mark.parametrize('pre_layer_norm', [False, True])
def test_dropout_sits_on_the_embedding_sums_and_on_every_sublayer_output(pre_layer_norm, monkeypatch):
  """Section 5.4: dropout on each sub-layer's output before the residual sum (and its LayerNorm, post-LN) and on
  the sums of embeddings and positions, in both stacks; nowhere else at the default rates."""
  monkeypatch.setattr(model_lib, 'Dropout', ExpectedDropout)
  model, params = tiny_model(pre_layer_norm=pre_layer_norm, dropout_rate=0.3)
  params = distinct_vectors(params)
  logits = np.asarray(model.apply({'params': params}, jnp.asarray(SRC), jnp.asarray(TGT_IN), False))
  for row in range(len(SRC)):
    src, tgt_in = SRC[row][SRC[row] != 0], TGT_IN[row][TGT_IN[row] != 0]
    expected = np_transformer(params, src, tgt_in, heads=model.config.num_heads, pre_ln=pre_layer_norm,
                              drop=1 / (1 - model.config.dropout_rate))
    np.testing.assert_allclose(logits[row, :len(tgt_in)], expected, rtol=2e-4, atol=2e-4)


def test_post_and_pre_layer_norm_numpy_forwards_differ():
  """The NumPy reference itself tells the two placements apart (else the test above could not)."""
  _, params = tiny_model(pre_layer_norm=True)
  post = np_transformer(params, SRC[0], TGT_IN[0][:4], heads=4, pre_ln=False)
  pre = np_transformer(params, SRC[0], TGT_IN[0][:4], heads=4, pre_ln=True)
  assert np.abs(post - pre).max() > 1e-2


@pytest.mark.parametrize('pre_layer_norm', [False, True])
def test_every_layer_norm_uses_the_epsilon_of_the_numpy_reference_and_the_export(pre_layer_norm):
  """At unit-scale activations LayerNorm's epsilon is invisible; on states of variance ~1e-5 it is half the
  denominator. Each sub-layer's norm (post-LN: LN(x + f(x)); pre-LN: x + f(LN(x))) and pre-LN's final encoder and
  decoder norms against np_layer_norm with 1e-5, the epsilon the CTranslate2 export declares."""
  eps = ctranslate2_export.LAYER_NORM_EPSILON
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 32)) * 10 ** -2.5
  norm = {'scale': rng.normal(size=32) + 1.0, 'bias': rng.normal(size=32)}
  f = lambda z: 0.5 * z
  sublayer = model_lib.SublayerConnection(0.0, pre_layer_norm)
  got = sublayer.apply({'params': {'norm': norm}}, jnp.asarray(x, jnp.float32), f, True)
  want = x + f(np_layer_norm(x, norm, eps)) if pre_layer_norm else np_layer_norm(x + f(x), norm, eps)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  if pre_layer_norm:
    model, params = tiny_model(pre_layer_norm=True)
    params = distinct_vectors(params)
    for name in ('encoder_norm', 'decoder_norm'):
      got = model.apply({'params': params}, jnp.asarray(x, jnp.float32), method=lambda m, y: getattr(m, name)(y))
      want = np_layer_norm(x, jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params[name]), eps)
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
  assert np.abs(np_layer_norm(x, norm, eps) - np_layer_norm(x, norm, eps / 10)).max() > 0.1  # epsilon matters here


# --- Tied output projection ----------------------------------------------------------------------------------

def test_logits_are_the_decoder_output_times_the_shared_embedding():
  for pre_layer_norm in (False, True):
    model, params = tiny_model(pre_layer_norm=pre_layer_norm)
    logits, state = model.apply({'params': params}, jnp.asarray(SRC), jnp.asarray(TGT_IN),
                                capture_intermediates=True)
    captured = state['intermediates']
    last = f'decoder_{model.config.num_decoder_layers - 1}'
    decoder_output = (captured['decoder_norm']['__call__'][0] if pre_layer_norm
                      else captured[last]['__call__'][0][0])
    embedding = np.asarray(params['shared_embedding']['embedding'], np.float64)
    np.testing.assert_allclose(logits, np.asarray(decoder_output, np.float64) @ embedding.T, rtol=1e-4, atol=1e-4)
  # No separate output matrix: the only [vocab, d] or [d, vocab] parameter is the shared embedding.
  vocab = model.config.vocab_size
  shaped = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if vocab in x.shape]
  assert shaped == ["['shared_embedding']['embedding']"]


def test_the_gradient_reaches_the_embedding_from_the_output_side():
  model, params = tiny_model()
  src, tgt_in = jnp.asarray(SRC), jnp.asarray(TGT_IN)
  tgt_out = jnp.asarray(np.concatenate([TGT_IN[:, 1:], np.zeros((2, 1), int)], axis=1))
  inputs = set(SRC.ravel()) | set(TGT_IN.ravel())
  unseen = [t for t in range(model.config.vocab_size) if t not in inputs]
  assert unseen  # tokens that never enter as input: only the output projection can reach their rows

  def loss(p):
    logits = model.apply({'params': p}, src, tgt_in)
    return ts.label_smoothed_cross_entropy(logits, tgt_out, 0.1)[0]

  grads = np.asarray(jax.jit(jax.grad(loss))(params)['shared_embedding']['embedding'])
  assert np.abs(grads[unseen]).min() > 1e-6
  # ... and equals the output side's own gradient there: d loss / d E[v] = sum_t dL/dlogit[t, v] * y[t].
  _, state = jax.jit(lambda p: model.apply({'params': p}, src, tgt_in, capture_intermediates=True))(params)
  y = state['intermediates'][f'decoder_{model.config.num_decoder_layers - 1}']['__call__'][0][0]
  embedding = params['shared_embedding']['embedding']
  dlogits = jax.grad(lambda logits: ts.label_smoothed_cross_entropy(logits, tgt_out, 0.1)[0])(
      jnp.einsum('btd,vd->btv', y, embedding))
  output_side = np.einsum('btv,btd->vd', np.asarray(dlogits), np.asarray(y))
  np.testing.assert_allclose(grads[unseen], output_side[unseen], rtol=1e-4, atol=1e-7)


# --- The loss normalizer on two devices ----------------------------------------------------------------------

def numpy_smoothed_loss_sum(logits, targets, eps):
  """Sum over non-pad targets of -sum_v q_v log p_v, q = 1 - eps on the target and eps / (V - 1) elsewhere."""
  logits = np.asarray(logits, np.float64)
  vocab = logits.shape[-1]
  total = 0.0
  for b in range(targets.shape[0]):
    for t in range(targets.shape[1]):
      if targets[b, t] == 0:
        continue
      log_p = logits[b, t] - logits[b, t].max()
      log_p -= np.log(np.exp(log_p).sum())
      q = np.full(vocab, eps / (vocab - 1))
      q[targets[b, t]] = 1 - eps
      total -= (q * log_p).sum()
  return total


def test_the_loss_is_normalized_by_the_global_target_count_on_two_devices():
  """Two devices whose rows hold 1 and 11 target tokens: per-device means averaged (the Flax example's pmean)
  would weight them equally; the step must divide the global sum by the global count of 12."""
  out = subprocess.run([sys.executable, os.path.join(HERE, 'two_device_loss.py')], env=subprocess_env(),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report['devices'] == 2
  batch = {k: np.asarray(v) for k, v in report['batch'].items()}
  model, params, _ = two_device_setup()
  logits = model.apply({'params': params}, jnp.asarray(batch['src']), jnp.asarray(batch['tgt_in']))
  count = int((batch['tgt_out'] != 0).sum())
  assert count == 12 and report['target_tokens'] == count
  loss_sum = numpy_smoothed_loss_sum(logits, batch['tgt_out'], 0.1)
  np.testing.assert_allclose(report['loss_sum'], loss_sum, rtol=1e-5)
  # The gradient the step applied: that of the global sum over the global count (its norm, returned by the step).
  grads = jax.jit(jax.grad(lambda p: ts.label_smoothed_cross_entropy(
      model.apply({'params': p}, jnp.asarray(batch['src']), jnp.asarray(batch['tgt_in'])),
      jnp.asarray(batch['tgt_out']), 0.1)[0]))(params)
  norm = np.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum()) for g in jax.tree_util.tree_leaves(grads)))
  np.testing.assert_allclose(report['grad_norm'], norm / count, rtol=1e-4)
  per_device_mean = [numpy_smoothed_loss_sum(logits[rows], batch['tgt_out'][rows], 0.1)
                     / (batch['tgt_out'][rows] != 0).sum() for rows in (slice(0, 1), slice(1, 2))]
  assert abs(np.mean(per_device_mean) - loss_sum / count) > 0.01  # the test can tell the two normalizers apart


def two_device_setup():
  """The model, parameters and config two_device_loss.py trains with (deterministic: seed 0, no dropout)."""
  c = config_lib.base_config()
  c.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=16, d_ff=32, num_heads=2, dropout_rate=0.0,
                 dtype='float32')
  c.vocab_size = 20
  c.warmup_steps = 4
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(c, c.vocab_size))
  optimizer, _ = ts.make_optimizer(c)
  return model, ts.init_state(model, optimizer, seed=0).params, c
