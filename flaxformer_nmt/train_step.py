"""Loss, learning-rate schedule, optimizer and the pure train/eval steps that `train.py` jit-compiles."""
import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct

from flaxformer_nmt import sharding

from flaxformer_nmt.tokenizer import PAD_ID


@struct.dataclass
class TrainState:
  """Everything a step changes; saved whole in each checkpoint."""
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  # Base dropout key; step s uses fold_in(rng, s), so the key stream needs no state of its own.
  rng: jax.Array


# --- Schedule and optimizer --------------------------------------------------------------------------------

def paper_schedule(d_model, warmup_steps, scale=1.0):
  """lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), with step = 1 for the first update."""
  def schedule(count):  # optax counts updates from 0
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def make_optimizer(config):
  """Adam(b1, b2, eps) on the paper's schedule, after optional global-norm gradient clipping."""
  schedule = paper_schedule(config.model.d_model, config.warmup_steps, config.learning_rate_scale)
  adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam), schedule
  return adam, schedule


# --- Loss --------------------------------------------------------------------------------------------------

def label_smoothed_cross_entropy(logits, targets, smoothing):
  """Sums over non-pad targets of the smoothed cross entropy and of the plain NLL, and their count.

  The smoothed target puts 1 - smoothing on the reference token and smoothing / (V - 1) on every other
  token (fairseq's and the Flax example's split); PAD targets mark positions without a prediction.
  """
  vocab = logits.shape[-1]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  off_value = smoothing / (vocab - 1)
  # -sum_v q_v log p_v with q = off everywhere except the reference, which gets 1 - smoothing.
  smoothed = (1.0 - smoothing - off_value) * nll - off_value * log_probs.sum(axis=-1)
  weights = (targets != PAD_ID).astype(jnp.float32)
  return (smoothed * weights).sum(), (nll * weights).sum(), weights.sum()


# --- Steps -------------------------------------------------------------------------------------------------

def train_step(state, batch, *, model, optimizer, schedule, label_smoothing):
  """One update on the batch loss: smoothed cross entropy summed over all target tokens, divided by their
  count over the whole (global) batch."""
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    logits = model.apply({'params': params}, batch['src'], batch['tgt_in'], deterministic=False,
                         rngs={'dropout': dropout_rng})
    loss_sum, nll_sum, tokens = label_smoothed_cross_entropy(logits, batch['tgt_out'], label_smoothing)
    return loss_sum / jnp.maximum(tokens, 1.0), (loss_sum, nll_sum, tokens)

  (_, (loss_sum, nll_sum, tokens)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  # A NaN/Inf loss or gradient never reaches the parameters: the update is dropped here, on device, and the
  # training loop decides (at its next host sync) whether to stop or to go on counting skipped updates.
  finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
  keep_if_finite = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
  params, opt_state = keep_if_finite(params, state.params), keep_if_finite(opt_state, state.opt_state)
  metrics = {
      'loss_sum': loss_sum, 'nll_sum': nll_sum, 'target_tokens': tokens,
      'source_tokens': (batch['src'] != PAD_ID).sum().astype(jnp.float32),
      'grad_norm': grad_norm, 'learning_rate': schedule(state.step),
      'nonfinite': (~finite).astype(jnp.int32),
  }
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch, *, model, label_smoothing):
  """Sums for validation loss and perplexity (no dropout)."""
  logits = model.apply({'params': params}, batch['src'], batch['tgt_in'], deterministic=True)
  loss_sum, nll_sum, tokens = label_smoothed_cross_entropy(logits, batch['tgt_out'], label_smoothing)
  return {'loss_sum': loss_sum, 'nll_sum': nll_sum, 'target_tokens': tokens}


def init_state(model, optimizer, seed, batch_shape=(1, 8)):
  """Fresh parameters (xavier-uniform dense layers) and optimizer state."""
  params_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
  dummy = jnp.ones(batch_shape, jnp.int32)
  params = model.init(params_rng, dummy, dummy)['params']
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=optimizer.init(params),
                    rng=dropout_rng)


def jit_steps(model, optimizer, schedule, config, mesh):
  """The compiled train and eval steps: state replicated, batch split over the mesh's 'data' axis. The
  train state is donated, so its buffers are updated in place."""
  train = functools.partial(train_step, model=model, optimizer=optimizer, schedule=schedule,
                            label_smoothing=config.label_smoothing)
  evaluate = functools.partial(eval_step, model=model, label_smoothing=config.label_smoothing)
  state_sharding, batch_sharding = sharding.replicated(mesh), sharding.batch_sharded(mesh)
  return (jax.jit(train, in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, state_sharding),
                  donate_argnums=0),
          jax.jit(evaluate, in_shardings=(state_sharding, batch_sharding), out_shardings=state_sharding))
