"""Loss, schedule and optimizer steps, against hand computations (NumPy loops and the paper's formulas)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from conftest import tiny_model
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.training import step as ts


def numpy_label_smoothed_loss(logits, targets, eps):
  logits = logits.astype(np.float64)
  vocab = logits.shape[-1]
  log_probs = logits - logits.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  total = nll_total = count = 0.0
  for b in range(targets.shape[0]):
    for t in range(targets.shape[1]):
      if targets[b, t] == 0:
        continue
      q = np.full(vocab, eps / (vocab - 1))
      q[targets[b, t]] = 1 - eps
      total += -(q * log_probs[b, t]).sum()
      nll_total += -log_probs[b, t, targets[b, t]]
      count += 1
  return total, nll_total, count


def test_label_smoothed_loss_equals_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
  targets = rng.integers(1, 11, size=(3, 5))
  targets[0, 3:] = 0
  targets[2, 1:] = 0
  loss, nll, count = ts.label_smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), 0.1)
  e_loss, e_nll, e_count = numpy_label_smoothed_loss(logits, targets, 0.1)
  assert count == e_count == 15 - 2 - 4
  np.testing.assert_allclose(loss, e_loss, rtol=1e-5)
  np.testing.assert_allclose(nll, e_nll, rtol=1e-5)


def test_label_smoothed_loss_gradient_is_softmax_minus_smoothed_target():
  """d loss / d logits = w * (softmax(logits) - q) for each non-pad position, written out in NumPy: catches a
  wrong off-value, a smoothing mass on PAD targets or on the reference, or a normalizer missing from the
  backward pass."""
  rng = np.random.default_rng(1)
  V, eps = 13, 0.1
  logits = rng.normal(size=(2, 6, V)).astype(np.float32) * 4
  targets = rng.integers(1, V, size=(2, 6))
  targets[1, 4:] = 0
  grad = np.asarray(jax.grad(lambda x: ts.label_smoothed_cross_entropy(x, jnp.asarray(targets), eps)[0])(
      jnp.asarray(logits)))
  expected = np.zeros_like(grad, dtype=np.float64)
  for b in range(2):
    for t in range(6):
      if targets[b, t] == 0:
        continue
      z = logits[b, t].astype(np.float64)
      p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
      q = np.full(V, eps / (V - 1))
      q[targets[b, t]] = 1 - eps
      expected[b, t] = p - q
  np.testing.assert_allclose(grad, expected, atol=2e-6)


def test_schedule_equals_the_paper_formula():
  schedule = ts.paper_schedule(d_model=512, warmup_steps=4000, scale=2.0)
  for step in (1, 10, 1000, 3999, 4000, 4001, 10_000, 100_000):
    expected = 2.0 * 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
    np.testing.assert_allclose(schedule(step - 1), expected, rtol=1e-5)  # optax counts updates from 0
  peak = 512 ** -0.5 * 4000 ** -0.5
  np.testing.assert_allclose(ts.paper_schedule(512, 4000)(3999), peak, rtol=1e-5)


def numpy_adam_on_the_paper_schedule(params, grads_per_step, d_model, warmup, scale, b1, b2, eps, weight_decay=0.0):
  """Adam with bias correction (Kingma & Ba, Algorithm 1), lr_t = scale * d^-0.5 * min(t^-0.5, t * w^-1.5); with
  weight_decay, AdamW's decoupled decay lr_t * weight_decay * param added to each update."""
  params = np.asarray(params, np.float64)
  m, v = np.zeros_like(params), np.zeros_like(params)
  for t, g in enumerate(grads_per_step, start=1):
    g = np.asarray(g, np.float64)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    lr = scale * d_model ** -0.5 * min(t ** -0.5, t * warmup ** -1.5)
    params = params - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * params)
  return params


@pytest.mark.parametrize('b1,b2,eps,weight_decay', [(0.9, 0.98, 1e-9, 0.0), (0.8, 0.9, 1e-3, 0.0),
                                                     (0.8, 0.9, 1e-3, 0.05)])
def test_optimizer_is_adam_with_bias_correction_on_the_paper_schedule(b1, b2, eps, weight_decay):
  """Several steps with gradients of changing sign and size (Adam's first step is sign(g) whatever the moments,
  so only later steps see beta2 and epsilon), across the warmup peak; eps = 1e-3 on gradients of that size.
  With weight decay the optimizer is built by another call (AdamW), which must take the same betas and epsilon."""
  c = config_lib.base_config()
  c.model.d_model, c.warmup_steps, c.learning_rate_scale = 64, 3, 2.0
  c.adam_b1, c.adam_b2, c.adam_eps, c.weight_decay = b1, b2, eps, weight_decay
  tx, _ = ts.make_optimizer(c)
  rng = np.random.default_rng(0)
  grads_per_step = [rng.normal(size=4) * 10.0 ** rng.uniform(-4, 0, size=4) for _ in range(8)]
  params = {'w': jnp.array([1.0, -2.0, 0.5, 3.0])}
  state = tx.init(params)
  for g in grads_per_step:
    updates, state = tx.update({'w': jnp.asarray(g, jnp.float32)}, state, params)
    params = optax.apply_updates(params, updates)
  expected = numpy_adam_on_the_paper_schedule([1.0, -2.0, 0.5, 3.0], grads_per_step, 64, 3, 2.0, b1, b2, eps,
                                              weight_decay)
  np.testing.assert_allclose(params['w'], expected, rtol=1e-5, atol=1e-7)
  # The reference is sensitive to what it checks: another beta2 or epsilon moves the result beyond tolerance.
  for other in (dict(b2=0.999), dict(eps=max(eps * 100, 1e-5))):
    args = {**dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay), **other}
    moved = numpy_adam_on_the_paper_schedule([1.0, -2.0, 0.5, 3.0], grads_per_step, 64, 3, 2.0, **args)
    assert not np.allclose(moved, expected, rtol=1e-5, atol=1e-7)


def test_gradient_clipping_rescales_to_the_global_norm_before_adam():
  """grad_clip_norm: a gradient whose global norm (over every leaf) exceeds the limit is scaled down to it, then
  Adam runs on it; one below the limit passes unchanged. Checked over steps whose norms lie on both sides, where
  Adam's moments remember the clipped sizes (its first step alone is sign(g), blind to any scaling)."""
  c = config_lib.base_config()
  c.model.d_model, c.warmup_steps, c.learning_rate_scale = 64, 3, 2.0
  c.adam_b1, c.adam_b2, c.adam_eps, c.grad_clip_norm = 0.8, 0.9, 1e-3, 0.5
  tx, _ = ts.make_optimizer(c)
  rng = np.random.default_rng(4)
  steps = [(rng.normal(size=2) * size, rng.normal(size=(2, 2)) * size) for size in (3.0, 0.01, 2.0, 0.05, 10.0, 0.2)]
  params = {'a': jnp.array([1.0, -2.0]), 'b': jnp.array([[0.5, 3.0], [-1.0, 0.25]])}
  state = tx.init(params)
  for a, b in steps:
    updates, state = tx.update({'a': jnp.asarray(a, jnp.float32), 'b': jnp.asarray(b, jnp.float32)}, state, params)
    params = optax.apply_updates(params, updates)
  flat = [np.concatenate([a, b.ravel()]) for a, b in steps]
  norms = [np.sqrt((g ** 2).sum()) for g in flat]
  assert min(norms) < 0.5 < max(norms)
  clipped = [g * min(1.0, 0.5 / norm) for g, norm in zip(flat, norms)]
  start = [1.0, -2.0, 0.5, 3.0, -1.0, 0.25]
  expected = numpy_adam_on_the_paper_schedule(start, clipped, 64, 3, 2.0, 0.8, 0.9, 1e-3)
  got = np.concatenate([np.asarray(params['a']), np.asarray(params['b']).ravel()])
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
  unclipped = numpy_adam_on_the_paper_schedule(start, flat, 64, 3, 2.0, 0.8, 0.9, 1e-3)
  assert not np.allclose(unclipped, expected, rtol=1e-5, atol=1e-7)  # clipping changes the result


def test_inverse_sqrt_schedule_equals_fairseqs_formula():
  c = config_lib.base_config()
  c.learning_rate_schedule, c.learning_rate, c.warmup_steps = 'inverse_sqrt', 0.005, 2000
  c.learning_rate_scale = 7.0  # unused by inverse_sqrt, like d_model
  schedule = ts.make_schedule(c)
  for step in (1, 2, 500, 1999, 2000, 2001, 8000, 50_000):
    expected = 0.005 * min(step / 2000, (2000 / step) ** 0.5)
    np.testing.assert_allclose(schedule(step - 1), expected, rtol=1e-5)  # optax counts updates from 0
  np.testing.assert_allclose(schedule(1999), 0.005, rtol=1e-6)  # the peak, at the end of warmup
  np.testing.assert_allclose(schedule(7999), 0.0025, rtol=1e-5)  # half the peak at 4x warmup


def test_schedule_settings_that_cannot_train_are_refused_by_name():
  """A peakless inverse_sqrt trains at learning rate 0; an unknown schedule would silently run another; a
  cooldown longer than the run starts below 1 (a jump at the first update)."""
  c = config_lib.base_config()
  c.data_dir = '/data'
  c.learning_rate_schedule, c.learning_rate = 'inverse_sqrt', 0.0
  with pytest.raises(config_lib.ConfigError, match=r'config.learning_rate=0.0: .*needs a peak'):
    config_lib.validate(c)
  c.learning_rate_schedule = 'cosine'
  with pytest.raises(config_lib.ConfigError, match=r"config.learning_rate_schedule='cosine': use one of \('paper'"):
    config_lib.validate(c)
  c.learning_rate_schedule, c.num_train_steps, c.cooldown_steps = 'paper', 100, 101
  with pytest.raises(config_lib.ConfigError, match=r'cooldown_steps=101: use 0 .* to config.num_train_steps=100'):
    config_lib.validate(c)
  c.cooldown_steps = 100  # the whole run
  config_lib.validate(c)


def _first_update(c, params, grads):
  tx, schedule = ts.make_optimizer(c)
  updates, _ = tx.update(grads, tx.init(params), params)
  return np.asarray(updates['w']), float(schedule(0))


def test_adam_betas_and_decoupled_weight_decay_follow_the_config():
  params = {'w': jnp.array([1.0, -2.0, 3.0])}
  g = np.array([0.5, 0.25, -1.0])
  c = config_lib.base_config()
  c.warmup_steps = 10
  c.weight_decay = 0.0
  plain, lr = _first_update(c, params, {'w': jnp.asarray(g)})
  c.weight_decay = 0.01
  decayed, _ = _first_update(c, params, {'w': jnp.asarray(g)})
  # AdamW (fairseq's Adam): the decay is lr * wd * param, added outside the Adam normalization.
  np.testing.assert_allclose(decayed - plain, -lr * 0.01 * np.array([1.0, -2.0, 3.0]), rtol=1e-5)
  # Two steps with a changed gradient expose b1 and b2 (the first Adam step is -lr * sign(g) for any betas).
  c.weight_decay, c.adam_b1, c.adam_b2, c.adam_eps = 0.0, 0.8, 0.9, 1e-8
  tx, schedule = ts.make_optimizer(c)
  state = tx.init(params)
  _, state = tx.update({'w': jnp.asarray(g)}, state, params)
  g2 = np.array([1.0, 1.0, 1.0])
  updates, _ = tx.update({'w': jnp.asarray(g2)}, state, params)
  m = (0.8 * 0.2 * g + 0.2 * g2) / (1 - 0.8 ** 2)
  v = (0.9 * 0.1 * g ** 2 + 0.1 * g2 ** 2) / (1 - 0.9 ** 2)
  np.testing.assert_allclose(updates['w'], -float(schedule(1)) * m / (np.sqrt(v) + 1e-8), rtol=1e-5)


@pytest.mark.parametrize('field, value', [('adam_b1', 1.0), ('adam_b2', 1.0), ('adam_eps', 0.0), ('adam_b1', 0.0),
                                          ('adam_b2', 0.0), ('adam_b2', 0.9999), ('adam_eps', 1e-30)])
def test_adam_settings_are_refused_exactly_where_a_finite_gradient_gets_a_nonfinite_update(field, value):
  """Adam's first update m_hat / (sqrt(v_hat) + eps), written out in NumPy, of a gradient holding a dead ReLU's 0:
  where it is NaN the optimizer's is too (and the train step's NaN guard, which reads the loss and the gradient,
  lets it into the parameters), so config.validate must refuse the setting, naming the field; elsewhere accept it."""
  c = config_lib.base_config()
  c.data_dir, c.warmup_steps = '/data', 1
  c[field] = value
  g = np.array([0.0, 0.5, -2.0])
  b1, b2, eps = c.adam_b1, c.adam_b2, c.adam_eps
  with np.errstate(all='ignore'):
    expected = ((1 - b1) * g / (1 - b1)) / (np.sqrt((1 - b2) * g * g / (1 - b2)) + eps)
  tx, _ = ts.make_optimizer(c)
  params = {'w': jnp.zeros(3)}
  updates, _ = tx.update({'w': jnp.asarray(g, jnp.float32)}, tx.init(params), params)
  assert bool(np.all(np.isfinite(updates['w']))) == bool(np.all(np.isfinite(expected)))
  if np.all(np.isfinite(expected)):
    config_lib.validate(c)
  else:
    with pytest.raises(config_lib.ConfigError, match=f'config.{field}={value}'):
      config_lib.validate(c)


def test_train_step_lowers_the_loss_on_a_repeated_batch():
  model, _ = tiny_model()
  c = config_lib.base_config()
  c.model.d_model = 32
  c.warmup_steps = 5
  c.learning_rate_scale = 5.0
  tx, schedule = ts.make_optimizer(c)
  state = ts.init_state(model, tx, seed=0)
  step = jax.jit(lambda s, b: ts.train_step(s, b, model=model, optimizer=tx, schedule=schedule,
                                            label_smoothing=0.1))
  batch = {'src': jnp.array([[4, 5, 6, 3], [7, 8, 3, 0]]), 'tgt_in': jnp.array([[2, 9, 10, 11], [2, 12, 0, 0]]),
           'tgt_out': jnp.array([[9, 10, 11, 3], [12, 3, 0, 0]])}
  losses = []
  for _ in range(20):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss_sum'] / metrics['target_tokens']))
    assert float(metrics['target_tokens']) == 6
  assert int(state.step) == 20
  assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize('name', ['paper', 'inverse_sqrt'])
def test_cooldown_ramps_the_schedule_linearly_to_zero_over_the_last_steps(name):
  """Update k (from 1) of an n-update run with a c-update cooldown runs at base(k) * min(1, (n - k + 1) / c):
  untouched before the ramp, 1/c of the base at the last update. Catches a ramp one update off, one that
  reaches 0 before the end (a wasted update), or one anchored at the start of the run."""
  c = config_lib.base_config()
  c.learning_rate_schedule, c.learning_rate, c.warmup_steps = name, 0.005, 100
  c.model.d_model, c.num_train_steps, c.cooldown_steps = 64, 1000, 300
  base = ts.paper_schedule(64, 100) if name == 'paper' else ts.inverse_sqrt_schedule(0.005, 100)
  cooled = ts.make_schedule(c)
  for k in (1, 50, 100, 699, 700, 701, 702, 850, 999, 1000):
    factor = 1.0 if k <= 700 else (1000 - k + 1) / 300
    np.testing.assert_allclose(cooled(k - 1), base(k - 1) * factor, rtol=1e-5)
  np.testing.assert_allclose(cooled(999) / base(999), 1 / 300, rtol=1e-4)
  assert float(cooled(1000)) == 0.0  # past the end (never applied)
  c.cooldown_steps = 0
  np.testing.assert_allclose(ts.make_schedule(c)(999), base(999), rtol=1e-6)  # off by default


def tiny_run(**fields):
  """(fresh state, train step, eval step, a batch) of a 1+1-layer model on one device, config fields overridden;
  every call builds a new, equal model object."""
  c = config_lib.base_config()
  c.vocab_size, c.model.dtype, c.cooldown_steps = 32, 'float32', 100
  c.model.num_encoder_layers = c.model.num_decoder_layers = 1
  c.model.d_model, c.model.d_ff, c.model.num_heads = 16, 32, 2
  c.update(fields)
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(c, c.vocab_size))
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  state, shardings = ts.create_state(model, c, mesh)
  train_fn, eval_fn = ts.jit_steps(model, c, mesh, shardings)
  tokens = np.full((2, 8), 5, np.int32)
  return state, train_fn, eval_fn, {'src': tokens, 'tgt_in': tokens, 'tgt_out': tokens}


def test_the_steps_of_one_call_update_as_the_same_steps_called_one_at_a_time():
  """TrainStep.many (config.steps_per_dispatch): k batches in one call make the k updates of k calls, in order,
  under dropout (each step's own masks: the step counter advances inside the call), with each step's metrics at
  its index. A wrong order of batches, one batch reused, one dropout key for all the steps, or the schedule read
  at the call's first step each changes the parameters or the metrics."""
  rng = np.random.default_rng(0)
  batches = [{key: rng.integers(4, 32, (2, 8), dtype=np.int32) for key in ('src', 'tgt_in', 'tgt_out')}
             for _ in range(3)]
  state, train_fn, _, _ = tiny_run(warmup_steps=2)
  assert train_fn.options.model.config.dropout_rate > 0
  expected = []
  for batch in batches:
    state, metrics = train_fn(state, batch)
    expected.append(jax.device_get(metrics))
  together, stacked = train_fn.many(tiny_run(warmup_steps=2)[0],
                                    jax.tree_util.tree_map(lambda *arrays: np.stack(arrays), *batches))
  assert int(together.step) == 3
  # The same operations, fused differently inside the loop: float32 rounding apart (2e-6 here), where the
  # batches in another order, or one batch twice, move some parameter by 0.5 or more.
  for got, want in zip(jax.tree_util.tree_leaves(together), jax.tree_util.tree_leaves(state)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  stacked = jax.device_get(stacked)
  assert len({float(m['learning_rate']) for m in expected}) == 3  # the warmup: every step's rate differs
  for i, want in enumerate(expected):
    for name, value in want.items():
      np.testing.assert_allclose(stacked[name][i], value, rtol=1e-5, err_msg=f'step {i + 1}: {name}')


def _padded_batch(rng, rows, length=8, vocab=32):
  """Random rows of real tokens then padding (each row a different length), as src, tgt_in and tgt_out."""
  batch = {key: rng.integers(4, vocab, (rows, length), dtype=np.int32) for key in ('src', 'tgt_in', 'tgt_out')}
  for key in batch:
    for row, real in enumerate(rng.integers(2, length + 1, rows)):
      batch[key][row, real:] = 0
  return batch


def test_accumulated_microbatches_give_the_loss_and_gradient_of_the_whole_batch():
  """grad_accumulation_steps=2: microbatch i holds rows i, i + 2, ... and draws its dropout from fold_in(the step's
  key, i); the step's loss is the sum over both, and its gradient that of the sum over all target tokens. Written
  out by hand, scored in NumPy: catches microbatch gradients averaged instead of summed (half the gradient), or
  the same dropout key for every microbatch."""
  state, train_fn, _, _ = tiny_run(grad_accumulation_steps=2, warmup_steps=2)
  model = train_fn.options.model
  assert model.config.dropout_rate > 0
  batch = _padded_batch(np.random.default_rng(5), 4)
  params, base_key = jax.device_get(state.params), jax.device_get(state.rng)
  _, metrics = train_fn(state, batch)
  step_key = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(base_key)), 0)

  @jax.jit
  def gradient_and_logits(p, rows, key):  # of the summed smoothed loss of some rows, with one dropout key
    def loss(p):
      logits = model.apply({'params': p}, rows['src'], rows['tgt_in'], False, rngs={'dropout': key})
      return ts.label_smoothed_cross_entropy(logits, rows['tgt_out'], 0.1)[0], logits
    return jax.grad(loss, has_aux=True)(p)

  loss_sum = count = 0.0
  grads = []
  for i in range(2):
    rows = {key: value[i::2] for key, value in batch.items()}
    g, logits = gradient_and_logits(params, rows, jax.random.fold_in(step_key, i))
    loss, _, tokens = numpy_label_smoothed_loss(np.asarray(logits), rows['tgt_out'], 0.1)
    loss_sum, count = loss_sum + loss, count + tokens
    grads.append([np.asarray(leaf, np.float64) for leaf in jax.tree_util.tree_leaves(g)])
  assert float(metrics['target_tokens']) == count == (batch['tgt_out'] != 0).sum()
  np.testing.assert_allclose(metrics['loss_sum'], loss_sum, rtol=1e-5)
  norm = np.sqrt(sum(((a + b) ** 2).sum() for a, b in zip(*grads)))
  np.testing.assert_allclose(metrics['grad_norm'], norm / count, rtol=1e-4)


def test_the_logged_rate_is_the_applied_one_and_evaluation_scores_the_smoothed_loss_without_dropout():
  """Update t (from 1) runs at d^-0.5 * min(t^-0.5, t * w^-1.5), and its metrics log that rate: Adam's first update
  moves every parameter whose gradient is far above epsilon by the rate itself. The eval step's sums are the
  label-smoothed loss of the deterministic model, in NumPy."""
  state, train_fn, eval_fn, _ = tiny_run(warmup_steps=2)
  model = train_fn.options.model
  batch = _padded_batch(np.random.default_rng(6), 2)
  before = jax.device_get(state.params)
  rates = []
  for t in (1, 2, 3):
    state, metrics = train_fn(state, batch)
    rates.append(float(metrics['learning_rate']))
    if t == 1:
      moved = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
          jax.tree_util.tree_leaves(jax.device_get(state.params)), jax.tree_util.tree_leaves(before)))
  np.testing.assert_allclose(rates, [16 ** -0.5 * min(t ** -0.5, t * 2 ** -1.5) for t in (1, 2, 3)], rtol=1e-6)
  np.testing.assert_allclose(moved, rates[0], rtol=1e-4)
  params = jax.device_get(state.params)
  sums = eval_fn(state.params, batch)
  logits = np.asarray(model.apply({'params': params}, batch['src'], batch['tgt_in']))
  loss, nll, count = numpy_label_smoothed_loss(logits, batch['tgt_out'], 0.1)
  assert float(sums['target_tokens']) == count
  np.testing.assert_allclose([sums['loss_sum'], sums['nll_sum']], [loss, nll], rtol=1e-5)


@jax.custom_vjp
def _nan_gradient(x):
  return x


_nan_gradient.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.nan,))


class _FiniteLossNonfiniteGradient(nn.Module):
  """Logits from one parameter vector, finite forward, NaN backward (as an overflowing half-precision backward
  pass gives): a loss that is finite over a gradient that is not."""

  @nn.compact
  def __call__(self, src, tgt_in, deterministic=True, project=True):
    w = self.param('w', nn.initializers.ones, (8,))
    return _nan_gradient(jnp.broadcast_to(w, tgt_in.shape + (8,)))


def test_an_update_whose_gradient_alone_is_nonfinite_is_not_applied():
  tx, schedule = ts.make_optimizer(config_lib.base_config())
  params = {'w': jnp.ones(8)}
  state = ts.TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                        rng=jax.random.key_data(jax.random.PRNGKey(0)))
  tokens = jnp.array([[4, 5, 3]])
  new, metrics = jax.jit(lambda s, b: ts.train_step(s, b, model=_FiniteLossNonfiniteGradient(), optimizer=tx,
                                                    schedule=schedule, label_smoothing=0.1))(
      state, {'src': tokens, 'tgt_in': tokens, 'tgt_out': tokens})
  assert np.isfinite(float(metrics['loss_sum'])) and not np.isfinite(float(metrics['grad_norm']))
  assert int(metrics['nonfinite']) == 1 and int(new.step) == 1
  np.testing.assert_array_equal(new.params['w'], np.ones(8))


def test_runs_differing_only_in_the_schedules_numbers_compile_to_one_program():
  """The schedule's numbers are an input of the compiled step, not constants in it: runs that differ only in
  warmup, peak or length lower to the same program (JAX's persistent cache serves them all). Which schedule,
  and whether it has a cooldown, is the program's."""
  def lowered(**fields):
    state, train_fn, _, batch = tiny_run(**fields)
    return train_fn.lower(state, batch).as_text()

  program = lowered()
  assert lowered(warmup_steps=7, learning_rate_scale=0.3, num_train_steps=500, cooldown_steps=123) == program
  assert lowered(cooldown_steps=0) != program
  assert lowered(learning_rate_schedule='inverse_sqrt', learning_rate=0.005) != program


def test_a_second_run_of_an_equal_model_and_options_traces_nothing(traces):
  """The steps are module-level functions with the model and StepOptions static: another run of an equal model
  and config in the same process (an ensemble's next member, the tests) reuses the traced and compiled steps,
  whatever its schedule's numbers; a seed retraces the initialization only; another option is another step."""
  def run(**fields):
    state, train_fn, eval_fn, batch = tiny_run(**fields)
    state, metrics = train_fn(state, batch)
    return float(metrics['learning_rate']), float(eval_fn(state.params, batch)['loss_sum'])

  first = run()
  traces.clear()
  again = run(warmup_steps=7, num_train_steps=500)
  assert traces == [] and again[0] != first[0]  # the other warmup's learning rate, from the same program
  run(seed=5)
  assert traces == ['_fresh_state']
  traces.clear()
  run(label_smoothing=0.3)
  assert {'_train', '_evaluate'} <= set(traces)


def numpy_rdrop_divergence(logits, targets):
  """Sum over the non-pad positions of each row pair (2i, 2i + 1) of (KL(P || Q) + KL(Q || P)) / 2."""
  logits = logits.astype(np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  total = 0.0
  for i in range(logits.shape[0] // 2):
    for t in range(logits.shape[1]):
      if targets[2 * i, t] == 0:
        continue
      p, q = probs[2 * i, t], probs[2 * i + 1, t]
      total += 0.5 * ((p * np.log(p / q)).sum() + (q * np.log(q / p)).sum())
  return total


def test_rdrop_divergence_equals_numpy():
  """Catches pairing the wrong rows (halves instead of neighbours), one KL direction only, a missing 1/2, or
  padding counted."""
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(6, 5, 9)).astype(np.float32) * 2
  targets = np.repeat(rng.integers(1, 9, size=(3, 5)), 2, axis=0)
  targets[2:4, 3:] = 0
  got = ts.rdrop_divergence(jnp.asarray(logits), jnp.asarray(targets))
  np.testing.assert_allclose(got, numpy_rdrop_divergence(logits, targets), rtol=1e-5)
  same = np.repeat(logits[::2], 2, axis=0)  # identical predictions: no divergence
  np.testing.assert_allclose(ts.rdrop_divergence(jnp.asarray(same), jnp.asarray(targets)), 0.0, atol=1e-6)


def test_rdrop_train_step_loss_is_both_copies_cross_entropy_plus_alpha_times_their_divergence():
  """The step's loss against the same model run by hand on the duplicated rows with the step's dropout key,
  scored in NumPy: catches a batch not duplicated, copies paired with other examples, the same dropout mask
  on both copies (no divergence), alpha not applied, or the tokens of one copy only."""
  model, _ = tiny_model(dropout_rate=0.3)
  c = config_lib.base_config()
  c.model.d_model = 32
  tx, schedule = ts.make_optimizer(c)
  state = ts.init_state(model, tx, seed=0)
  batch = {'src': jnp.array([[4, 5, 6, 3], [7, 8, 3, 0]]), 'tgt_in': jnp.array([[2, 9, 10, 11], [2, 12, 0, 0]]),
           'tgt_out': jnp.array([[9, 10, 11, 3], [12, 3, 0, 0]])}
  alpha, eps = 2.5, 0.1
  _, metrics = jax.jit(lambda s, b: ts.train_step(s, b, model=model, optimizer=tx, schedule=schedule,
                                                  label_smoothing=eps, rdrop_alpha=alpha))(state, batch)
  doubled = {k: np.repeat(np.asarray(v), 2, axis=0) for k, v in batch.items()}
  logits = np.asarray(model.apply({'params': state.params}, doubled['src'], doubled['tgt_in'], False,
                                  rngs={'dropout': jax.random.fold_in(state.rng, state.step)}))
  cross_entropy, _, count = numpy_label_smoothed_loss(logits, doubled['tgt_out'], eps)
  divergence = numpy_rdrop_divergence(logits, doubled['tgt_out'])
  assert divergence > 1e-3  # the copies saw different dropout masks
  assert float(metrics['target_tokens']) == count == 12
  assert float(metrics['source_tokens']) == 14
  np.testing.assert_allclose(metrics['rdrop_divergence_sum'], divergence, rtol=1e-4)
  np.testing.assert_allclose(metrics['loss_sum'], cross_entropy + alpha * divergence, rtol=1e-4)


def _one_step_loss(state, batch, model, c, prng_impl=None):
  tx, schedule = ts.make_optimizer(c)
  kwargs = {'prng_impl': prng_impl} if prng_impl else {}
  _, metrics = jax.jit(lambda s, b: ts.train_step(s, b, model=model, optimizer=tx, schedule=schedule,
                                                  label_smoothing=0.1, **kwargs))(state, batch)
  return float(metrics['loss_sum'])


def _loss_with_dropout_key(state, batch, model, key):
  logits, targets, _ = lm.forward('translation', model, state.params, batch, False, rngs={'dropout': key})
  return float(ts.label_smoothed_cross_entropy(logits, targets, 0.1)[0])


_DROPOUT_BATCH = {'src': jnp.array([[4, 5, 6, 3], [7, 8, 3, 0]]), 'tgt_in': jnp.array([[2, 9, 10, 11], [2, 12, 0, 0]]),
                  'tgt_out': jnp.array([[9, 10, 11, 3], [12, 3, 0, 0]])}


def test_the_default_generator_keeps_the_keys_and_masks_of_runs_saved_before_the_choice():
  # Checkpoints written before config.prng_impl hold threefry's 2-word key split from PRNGKey(seed), and step s
  # drew its masks from fold_in(that key, s): a resumed run must go on drawing the same ones.
  model, _ = tiny_model(dropout_rate=0.3)
  c = config_lib.base_config()
  state = ts.init_state(model, ts.make_optimizer(c)[0], seed=3)
  params_key, dropout_key = jax.random.split(jax.random.PRNGKey(3))
  np.testing.assert_array_equal(state.rng, dropout_key)
  dummy = jnp.ones((1, 8), jnp.int32)
  for got, want in zip(jax.tree_util.tree_leaves(state.params),
                       jax.tree_util.tree_leaves(model.init(params_key, dummy, dummy)['params'])):
    np.testing.assert_array_equal(got, want)
  state = state.replace(step=jnp.asarray(7, jnp.int32))
  want = _loss_with_dropout_key(state, _DROPOUT_BATCH, model, jax.random.fold_in(dropout_key, 7))
  np.testing.assert_allclose(_one_step_loss(state, _DROPOUT_BATCH, model, c), want, rtol=1e-6)


def test_rbg_keys_are_four_words_of_xlas_generator_and_draw_the_masks():
  model, _ = tiny_model(dropout_rate=0.3)
  c = config_lib.base_config()
  state = ts.init_state(model, ts.make_optimizer(c)[0], seed=3, prng_impl='rbg')
  _, dropout_key = jax.random.split(jax.random.key(3, impl='rbg'))
  assert state.rng.shape == (4,) and state.rng.dtype == jnp.uint32
  np.testing.assert_array_equal(state.rng, jax.random.key_data(dropout_key))
  state = state.replace(step=jnp.asarray(7, jnp.int32))
  rbg = _one_step_loss(state, _DROPOUT_BATCH, model, c, prng_impl='rbg')
  np.testing.assert_allclose(rbg, _loss_with_dropout_key(state, _DROPOUT_BATCH, model,
                                                         jax.random.fold_in(dropout_key, 7)), rtol=1e-6)
  # Other keys give other masks, so the equality above could not hold by the masks not mattering.
  threefry_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng[:2]), 7)
  assert abs(rbg - _loss_with_dropout_key(state, _DROPOUT_BATCH, model, threefry_key)) > 1e-3


# --- The chunked vocabulary loss (config.vocabulary_loss_chunk_tokens) ---------------------------------------

def numpy_projected_loss_and_grads(states, embedding, targets, eps):
  """Loss sums of states @ embedding.T and the loss sum's gradients with respect to states and embedding, in
  float64 loops: d loss / d logits = softmax - q on non-pad positions, then through the projection."""
  states, embedding = states.astype(np.float64), embedding.astype(np.float64)
  vocab = embedding.shape[0]
  logits = states @ embedding.T
  total, nll_total, count = numpy_label_smoothed_loss(logits, targets, eps)
  d_states, d_embedding = np.zeros_like(states), np.zeros_like(embedding)
  for b in range(targets.shape[0]):
    for t in range(targets.shape[1]):
      if targets[b, t] == 0:
        continue
      p = np.exp(logits[b, t] - logits[b, t].max())
      p /= p.sum()
      q = np.full(vocab, eps / (vocab - 1))
      q[targets[b, t]] = 1 - eps
      g = p - q
      d_states[b, t] = g @ embedding
      d_embedding += np.outer(g, states[b, t])
  return (total, nll_total, count), d_states, d_embedding


@pytest.mark.parametrize('chunk_tokens', [1, 8, 12, 1000])  # one position, 4 of 6, 2 of 6 (12 // 3 = 4 -> 3), all
def test_chunked_vocabulary_loss_and_its_gradients_equal_numpy(chunk_tokens):
  """The chunked loss and its gradients against the plain float64 computation: catches a chunk left out or
  stitched back in another order, PAD positions counted, a wrong smoothing split in the hand-written gradient,
  or a transposed embedding gradient."""
  rng = np.random.default_rng(3)
  B, T, d, V, eps = 3, 6, 5, 17, 0.2
  states = rng.normal(size=(B, T, d)).astype(np.float32)
  embedding = rng.normal(size=(V, d)).astype(np.float32)
  targets = rng.integers(1, V, size=(B, T))
  targets[0, 4:] = 0
  targets[2, 1:] = 0
  loss = lambda s, e: ts.chunked_vocabulary_loss(s, e, jnp.asarray(targets), eps, chunk_tokens, jnp.float32)
  sums = jax.jit(loss)(jnp.asarray(states), jnp.asarray(embedding))
  d_states, d_embedding = jax.jit(jax.grad(lambda s, e: loss(s, e)[0], argnums=(0, 1)))(
      jnp.asarray(states), jnp.asarray(embedding))
  (e_loss, e_nll, e_count), e_d_states, e_d_embedding = numpy_projected_loss_and_grads(states, embedding, targets,
                                                                                       eps)
  assert float(sums[2]) == e_count == 18 - 2 - 5
  np.testing.assert_allclose(sums[0], e_loss, rtol=1e-5)
  np.testing.assert_allclose(sums[1], e_nll, rtol=1e-5)
  np.testing.assert_allclose(d_states, e_d_states, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(d_embedding, e_d_embedding, rtol=1e-4, atol=1e-5)
  assert np.abs(d_states[2, 1:]).max() == 0  # padding positions get no gradient


def test_chunks_are_positions_of_every_row():
  states, targets = jnp.zeros((4, 12, 2)), jnp.arange(48).reshape(4, 12)
  state_chunks, target_chunks = ts._vocabulary_chunks(states, targets, 20)  # 20 // 4 = 5 -> 4 positions
  assert state_chunks.shape == (3, 4, 4, 2)
  np.testing.assert_array_equal(target_chunks[1], np.asarray(targets)[:, 4:8])


@pytest.mark.parametrize('matmul_precision', ['float32', 'bfloat16'])
def test_train_step_with_the_chunked_vocabulary_loss_makes_the_plain_steps_update(matmul_precision):
  """Two steps of the tiny model with dropout, packed-free rows and padding: the chunked loss's step against
  the plain one (whole logits). Catches the embedding's gradient from the projection lost or counted twice
  (it is also the input embedding), the states taken before the pre-LN final norm, or dropout keys differing.
  With bfloat16 operands both paths round the same operands (model.bfloat16_matmul's backward rounds the logit
  gradient too), so they agree to accumulation order."""
  c = config_lib.base_config()
  c.model.d_model, c.model.d_ff, c.model.num_heads = 32, 64, 4
  # One layer each: what the comparison can catch lies in the loss, the tied embedding and the final norm, not in
  # the depth (both cases, beside another test run on the 2-core Zen 3: 2 + 2 layers 39.5 s, 1 + 1 31.9 s).
  c.model.num_encoder_layers = c.model.num_decoder_layers = 1
  c.model.dropout_rate, c.model.pre_layer_norm, c.model.dtype = 0.1, True, 'float32'
  c.model.matmul_precision = matmul_precision
  c.warmup_steps, c.learning_rate_scale = 1, 0.05  # updates of about 0.01: parameters that visibly move
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(c, 16))
  tx, schedule = ts.make_optimizer(c)
  state = ts.init_state(model, tx, seed=0)
  batch = {'src': jnp.array([[4, 5, 6, 3], [7, 8, 3, 0]]), 'tgt_in': jnp.array([[2, 9, 10, 11], [2, 12, 0, 0]]),
           'tgt_out': jnp.array([[9, 10, 11, 3], [12, 3, 0, 0]])}
  results = {}
  for chunk in (0, 2):
    step = jax.jit(lambda s, b, chunk=chunk: ts.train_step(s, b, model=model, optimizer=tx, schedule=schedule,
                                                           label_smoothing=0.1, vocabulary_loss_chunk_tokens=chunk))
    s, m1 = step(state, batch)
    s, m2 = step(s, batch)
    results[chunk] = (s.params, m1, m2)
  (plain, p1, p2), (chunked, c1, c2) = results[0], results[2]
  tolerance = 1e-5 if matmul_precision == 'float32' else 2e-3
  for key in ('loss_sum', 'nll_sum', 'target_tokens', 'grad_norm'):
    np.testing.assert_allclose(c1[key], p1[key], rtol=tolerance)
    np.testing.assert_allclose(c2[key], p2[key], rtol=tolerance)
  embedding = lambda p: np.asarray(p['shared_embedding']['embedding'])
  assert np.abs(embedding(chunked) - embedding(state.params)).min() > 1e-3  # every row moved, as in the plain step
  for a, b in zip(jax.tree_util.tree_leaves(chunked), jax.tree_util.tree_leaves(plain)):
    # Parameters near zero differ by summation order only, about 1e-6 in float32 (measured: 1.4e-6 with XLA's
    # older CPU emitter, conftest.py): the atol of float32 is its rtol.
    np.testing.assert_allclose(a, b, rtol=tolerance, atol=1e-5 if matmul_precision == 'float32' else 2e-4)
