"""Loss, learning-rate schedule, optimizer, the pure train/eval steps, and their jit-compiled forms that
`train.py` runs (jit_steps, create_state)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from flaxformer_nmt.config import DEFAULT_PRNG_IMPL
from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import sharding

from flaxformer_nmt.data.tokenizer import PAD_ID


@struct.dataclass
class TrainState:
  """Everything a step changes; saved whole in each checkpoint."""
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  # Base dropout key, as raw key data (uint32 words, 2 for threefry, 4 for rbg) of config.prng_impl's
  # generator; step s uses fold_in(rng, s), so the key stream needs no state of its own.
  rng: jax.Array


# --- Schedule and optimizer --------------------------------------------------------------------------------

def paper_schedule(d_model, warmup_steps, scale=1.0):
  """lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), with step = 1 for the first update."""
  def schedule(count):  # optax counts updates from 0
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def inverse_sqrt_schedule(peak, warmup_steps):
  """fairseq's inverse_sqrt: lr = peak * min(step / warmup, sqrt(warmup / step)), with step = 1 for the first
  update (fairseq's first update runs at its warmup_init_lr, ~0; here it runs at peak / warmup)."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return peak * jnp.minimum(step / warmup_steps, jnp.sqrt(warmup_steps / step))
  return schedule


def with_cooldown(schedule, num_train_steps, cooldown_steps):
  """`schedule` times a linear ramp from 1 down to 0 over the last `cooldown_steps` updates of a `num_train_steps` run
  (the decay stage of warmup-stable-decay schedules; fairseq's tri_stage decays exponentially): update num_train_steps -
  cooldown_steps + i (counted from 0) runs at (1 - i / cooldown_steps) times the schedule, so the last one runs at 1 /
  cooldown_steps of it. A short run ends at a low learning rate instead of where the slow inverse square root has left
  it."""
  def cooled(count):
    ramp = jnp.clip((num_train_steps - jnp.asarray(count, jnp.float32)) / cooldown_steps, 0.0, 1.0)
    return schedule(count) * ramp
  return cooled


def schedule_numbers(config):
  """The numbers of the learning-rate schedule of `config` (checked by config.validate): what make_schedule
  computes with. jit_steps passes them to the compiled train step as an input rather than baking them in as
  constants, so that runs that differ only in them (a warmup, a peak, a length) run one compiled program."""
  if config.learning_rate_schedule == 'paper':
    numbers = dict(d_model=config.model.d_model, warmup_steps=config.warmup_steps, peak=config.learning_rate_scale)
  else:
    numbers = dict(warmup_steps=config.warmup_steps, peak=config.learning_rate)
  if config.cooldown_steps > 0:
    numbers.update(num_train_steps=config.num_train_steps, cooldown_steps=config.cooldown_steps)
  return numbers


def make_schedule(config, numbers=None):
  """The learning rate as a function of the update count: config.learning_rate_schedule ('paper' or
  'inverse_sqrt'), then the cooldown. `numbers`: the schedule_numbers to compute with (traced inside the
  compiled step); default: those of config."""
  numbers = schedule_numbers(config) if numbers is None else numbers
  if config.learning_rate_schedule == 'paper':
    schedule = paper_schedule(numbers['d_model'], numbers['warmup_steps'], numbers['peak'])
  else:
    schedule = inverse_sqrt_schedule(numbers['peak'], numbers['warmup_steps'])
  if 'cooldown_steps' not in numbers:
    return schedule
  return with_cooldown(schedule, numbers['num_train_steps'], numbers['cooldown_steps'])


def make_optimizer(config, numbers=None):
  """(Adam on the configured schedule, the schedule): see adam_of and make_schedule; `numbers` change the
  schedule only, never the optimizer state."""
  schedule = make_schedule(config, numbers)
  return adam_of(config, schedule), schedule


def adam_of(config, schedule):
  """Adam(b1, b2, eps) on `schedule` (decoupled weight decay if config.weight_decay > 0, as fairseq's Adam and
  optax.adamw apply it: lr * weight_decay * param), after optional gradient clipping. `config`: a config, or
  the StepOptions that carry its fields.

  Clipping is stateless, so it is applied inside Adam's update rather than chained in front of it: the
  optimizer state is Adam's alone with or without clipping, and a run can be resumed with
  --config.grad_clip_norm switched on or off (as the NaN error advises).
  """
  if config.weight_decay > 0:
    adam = optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                       weight_decay=config.weight_decay)
  else:
    adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  if config.grad_clip_norm > 0:
    clip = optax.clip_by_global_norm(config.grad_clip_norm)

    def update(updates, state, params=None):
      clipped, _ = clip.update(updates, clip.init(updates))
      return adam.update(clipped, state, params)
    return optax.GradientTransformation(adam.init, update)
  return adam


# --- Loss --------------------------------------------------------------------------------------------------

def label_smoothed_cross_entropy(logits, targets, smoothing):
  """Sums over non-pad targets of the smoothed cross entropy and of the plain NLL, and their count.

  The smoothed target puts 1 - smoothing on the reference token and smoothing / (V - 1) on every other
  token (fairseq's and the Flax example's split); PAD targets mark positions without a prediction.

  What is minimized and logged (train/loss, eval/loss) is this cross entropy H(q, p), in nats per target
  token, as fairseq's `loss` (which fairseq reports in bits). It is not the KL divergence KL(q || p) =
  H(q, p) - H(q) that the Flax WMT example logs: the two have the same gradient but differ by the constant
  entropy H(q) of the smoothed target (about 1.38 nats for smoothing 0.1 and a 37k vocabulary), so a KL
  reading is that much lower. `nll` is the plain cross entropy of the reference token; perplexity is exp(nll).
  """
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  # From the log-normalizer rather than a materialized log_softmax: log p_v = logits_v - logsumexp(logits).
  # No second [tokens, V] array is written, and the backward pass is one fused softmax-minus-target pass
  # (about 40% less loss time at 4096 x 8000 on the CPU; the vocabulary dominates a small model's step).
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)
  nll = log_normalizer - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  off_value = smoothing / (vocab - 1)
  sum_log_probs = logits.sum(axis=-1) - vocab * log_normalizer
  # -sum_v q_v log p_v with q = off everywhere except the reference, which gets 1 - smoothing.
  smoothed = (1.0 - smoothing - off_value) * nll - off_value * sum_log_probs
  weights = (targets != PAD_ID).astype(jnp.float32)
  return (smoothed * weights).sum(), (nll * weights).sum(), weights.sum()


def _vocabulary_chunks(states, targets, chunk_tokens):
  """[B, T, d] states and [B, T] targets -> [n, B, T / n, d] and [n, B, T / n]: n chunks of positions, each
  about `chunk_tokens` tokens (the largest divisor of T at most chunk_tokens / B positions). Chunks of positions
  keep every row on its device."""
  rows, length = targets.shape
  width = max(1, min(length, chunk_tokens // rows))
  while length % width:
    width -= 1
  split = lambda x: jnp.swapaxes(x.reshape((rows, length // width, width) + x.shape[2:]), 0, 1)
  return split(states), split(targets)


def _chunked_loss_and_grads(states, embedding, targets, smoothing, chunk_tokens, operand_dtype):
  """label_smoothed_cross_entropy of states @ embedding.T, a chunk of positions at a time, with the gradients of
  the smoothed loss sum with respect to states and embedding: ((loss_sum, nll_sum, tokens), d_states,
  d_embedding). No [B, T, V] array is made, only [B, T / n, V] chunks. Each chunk's logit gradient (softmax
  minus the smoothed target on non-pad positions) is label_smoothed_cross_entropy's own derivative; the two
  gradient matmuls take it rounded to the operands' dtype, with float32 accumulation, as
  `model.bfloat16_matmul` does."""
  weights = embedding.astype(operand_dtype)

  def chunk(carry, xs):
    d_embedding, sums = carry
    h, t = xs
    h = h.astype(operand_dtype)
    logits = jnp.einsum('bcd,vd->bcv', h, weights, preferred_element_type=jnp.float32)

    def loss(x):  # differentiated: the smoothed sum; carried along: the NLL sum and the token count
      loss_sum, nll_sum, tokens = label_smoothed_cross_entropy(x, t, smoothing)
      return loss_sum, (nll_sum, tokens)

    loss_sum, loss_vjp, (nll_sum, tokens) = jax.vjp(loss, logits, has_aux=True)
    g = loss_vjp(jnp.ones((), jnp.float32))[0].astype(operand_dtype)
    d_h = jnp.einsum('bcv,vd->bcd', g, weights, preferred_element_type=jnp.float32)
    d_embedding = d_embedding + jnp.einsum('bcv,bcd->vd', g, h, preferred_element_type=jnp.float32)
    return (d_embedding, sums + jnp.stack([loss_sum, nll_sum, tokens])), d_h.astype(states.dtype)

  state_chunks, target_chunks = _vocabulary_chunks(states, targets, chunk_tokens)
  init = (jnp.zeros(embedding.shape, jnp.float32), jnp.zeros(3, jnp.float32))
  (d_embedding, sums), d_states = jax.lax.scan(chunk, init, (state_chunks, target_chunks))
  d_states = jnp.swapaxes(d_states, 0, 1).reshape(states.shape)
  return (sums[0], sums[1], sums[2]), d_states, d_embedding.astype(embedding.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_vocabulary_loss(states, embedding, targets, smoothing, chunk_tokens, operand_dtype):
  """label_smoothed_cross_entropy(states @ embedding.T, targets, smoothing) without the [B, T, V] logits.

  The vocabulary projection, the loss and its gradient run a chunk of about `chunk_tokens` target positions at
  a time (lax.scan), the gradients computed in the same pass, so neither the float32 logits nor their gradient
  ([tokens, V] each: 2.4 GB apiece at 16,384 tokens and 37k pieces) is ever held whole. Same sums, same
  gradients (to float32 rounding). What it buys is memory (bench/RESULTS.md: Transformer base at
  16,384 tokens, 19.9 -> 13.7 GiB of temporaries with 1,024-token chunks, XLA:CPU); on a 2-core CPU the step
  took as long as with whole logits.

  Only loss_sum is differentiated; nll_sum and the token count are statistics and carry no gradient. Called
  without differentiation it still computes the gradients (for the train step only)."""
  return _chunked_loss_and_grads(states, embedding, targets, smoothing, chunk_tokens, operand_dtype)[0]


def _chunked_vocabulary_loss_forward(states, embedding, targets, smoothing, chunk_tokens, operand_dtype):
  sums, d_states, d_embedding = _chunked_loss_and_grads(states, embedding, targets, smoothing, chunk_tokens,
                                                        operand_dtype)
  return sums, (d_states, d_embedding)


def _chunked_vocabulary_loss_backward(smoothing, chunk_tokens, operand_dtype, residuals, cotangents):
  del smoothing, chunk_tokens, operand_dtype
  d_states, d_embedding = residuals
  scale = cotangents[0]  # of loss_sum; nll_sum and the count carry none
  no_gradient = np.zeros(d_states.shape[:-1], jax.dtypes.float0)  # the integer targets
  return (scale * d_states).astype(d_states.dtype), (scale * d_embedding).astype(d_embedding.dtype), no_gradient


chunked_vocabulary_loss.defvjp(_chunked_vocabulary_loss_forward, _chunked_vocabulary_loss_backward)


def rdrop_divergence(logits, targets):
  """R-Drop's regularizer (Liang et al. 2021): summed over the non-pad target positions of each row pair, the
  symmetric KL divergence (KL(P || Q) + KL(Q || P)) / 2 between the two predictions P and Q of one example.

  logits [2B, T, V] hold rows 2i and 2i + 1 as the same example under two dropout masks (`duplicate_rows`);
  targets [2B, T] mark padding with PAD. Both directions are differentiated, as in the authors' fairseq code.
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  pairs = log_probs.reshape((-1, 2) + log_probs.shape[1:])  # [B, 2, T, V]: the pair axis beside each row
  log_p, log_q = pairs[:, 0], pairs[:, 1]
  # KL(P || Q) + KL(Q || P) = sum_v (p_v - q_v) (log p_v - log q_v): one pass over the vocabulary.
  symmetric = ((jnp.exp(log_p) - jnp.exp(log_q)) * (log_p - log_q)).sum(axis=-1)
  weights = (targets.reshape((-1, 2) + targets.shape[1:])[:, 0] != PAD_ID).astype(jnp.float32)
  return 0.5 * (symmetric * weights).sum()


def duplicate_rows(batch):
  """Every [B, ...] array of `batch` as [2B, ...] with rows 2i and 2i + 1 copies of row i. Each device's block
  of rows stays on that device (a concatenation of the batch with itself would move rows between devices)."""
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, 2, axis=0), batch)


# --- Steps -------------------------------------------------------------------------------------------------

def split_microbatches(batch, num_microbatches):
  """[B, T] arrays -> [num_microbatches, B / num_microbatches, T]. Microbatch i takes rows i, i + k, i + 2k, ...
  so that each device's block of rows contributes to every microbatch and no rows move between devices."""
  def split(x):
    rows = x.shape[0]
    if rows % num_microbatches:
      raise ValueError(f'a batch of {rows} rows does not split into {num_microbatches} microbatches')
    return jnp.swapaxes(x.reshape((rows // num_microbatches, num_microbatches) + x.shape[1:]), 0, 1)
  return jax.tree_util.tree_map(split, batch)


# The MLM's masking keys: a stream of their own next to the dropout keys.
_MASKING_STREAM = 0x6D61736B


def _loss_sums(params, microbatch, rng, *, model, task, label_smoothing, rdrop_alpha, vocabulary_loss_chunk_tokens):
  """(the summed loss that is differentiated, (NLL sum, target tokens, R-Drop divergence sum)) of a microbatch."""
  if rdrop_alpha > 0:
    microbatch = duplicate_rows(microbatch)
  chunked = vocabulary_loss_chunk_tokens > 0
  outputs, targets, _ = lm.forward(task, model, params, microbatch, False, rngs={'dropout': rng},
                                   mask_rng=jax.random.fold_in(rng, _MASKING_STREAM), project=not chunked)
  if chunked:
    loss_sum, nll_sum, tokens = chunked_vocabulary_loss(
        outputs, model_lib.shared_embedding(params), targets, label_smoothing, vocabulary_loss_chunk_tokens,
        model_lib.vocabulary_operand_dtype(model.config))
    return loss_sum, (nll_sum, tokens, jnp.zeros((), jnp.float32))
  logits = outputs
  loss_sum, nll_sum, tokens = label_smoothed_cross_entropy(logits, targets, label_smoothing)
  divergence_sum = rdrop_divergence(logits, targets) if rdrop_alpha > 0 else jnp.zeros((), jnp.float32)
  return loss_sum + rdrop_alpha * divergence_sum, (nll_sum, tokens, divergence_sum)


def _summed_gradients(grad_fn, params, batch, rng, grad_accumulation_steps):
  """(gradient sums, (loss, NLL, tokens, divergence) sums) over the batch: in one pass, or over k microbatches
  in a lax.scan, microbatch i drawing dropout from fold_in(rng, i)."""
  if grad_accumulation_steps == 1:
    (loss_sum, aux), grad_sums = grad_fn(params, batch, rng)
    return grad_sums, (loss_sum, *aux)

  def accumulate(carry, inputs):
    index, microbatch = inputs
    (loss_sum, aux), grads = grad_fn(params, microbatch, jax.random.fold_in(rng, index))
    grad_sums, sums = carry
    grad_sums = jax.tree_util.tree_map(jnp.add, grad_sums, grads)
    return (grad_sums, sums + jnp.stack([loss_sum, *aux])), None

  zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  microbatches = split_microbatches(batch, grad_accumulation_steps)
  (grad_sums, sums), _ = jax.lax.scan(accumulate, (zeros, jnp.zeros(4, jnp.float32)),
                                      (jnp.arange(grad_accumulation_steps), microbatches))
  return grad_sums, tuple(sums)


def train_step(state, batch, *, model, optimizer, schedule, label_smoothing, grad_accumulation_steps=1,
               task='translation', rdrop_alpha=0.0, prng_impl=DEFAULT_PRNG_IMPL, vocabulary_loss_chunk_tokens=0):
  """One update on the batch loss: smoothed cross entropy summed over all target tokens (for the MLM the
  positions bert_mask selected), divided by their count over the whole (global) batch.

  With rdrop_alpha > 0 (R-Drop) every example runs twice, under two dropout masks, and the loss adds
  rdrop_alpha times their symmetric KL divergence (`rdrop_divergence`) to the cross entropy of both copies,
  all divided by the target tokens of both copies: the weighting of the authors' fairseq criterion, whose
  sum is divided by the tokens of one copy instead (a constant factor 2, which Adam does not see). The token
  counts (and so tokens/s and FLOP/s) then count every example twice: the model computes both copies.

  With vocabulary_loss_chunk_tokens > 0 (translation, no R-Drop) the model stops at the decoder's states and
  `chunked_vocabulary_loss` projects them onto the shared embedding, a chunk of that many tokens at a time: the
  same loss and update without the [B, T, V] logits.

  With grad_accumulation_steps = k the batch is processed as k microbatches in a loop (lax.scan) that sums
  the gradients of the summed loss; dividing by the total target count afterwards makes the update equal
  to the one-batch update, at 1/k of the activation memory.
  """
  dropout_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng, impl=prng_impl), state.step)
  loss_fn = functools.partial(_loss_sums, model=model, task=task, label_smoothing=label_smoothing,
                              rdrop_alpha=rdrop_alpha, vocabulary_loss_chunk_tokens=vocabulary_loss_chunk_tokens)
  grad_sums, (loss_sum, nll_sum, tokens, divergence_sum) = _summed_gradients(
      jax.value_and_grad(loss_fn, has_aux=True), state.params, batch, dropout_rng, grad_accumulation_steps)
  grads = jax.tree_util.tree_map(lambda g: g / jnp.maximum(tokens, 1.0), grad_sums)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  # A NaN/Inf loss or gradient never reaches the parameters: the update is dropped here, on device, and the
  # training loop decides (at its next host sync) whether to stop or to go on counting skipped updates.
  finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
  params, opt_state = _keep_if_finite(finite, (params, opt_state), (state.params, state.opt_state))
  metrics = {
      'loss_sum': loss_sum, 'nll_sum': nll_sum, 'target_tokens': tokens,
      # Tokens read by the encoder (translation: the source; MLM: the whole text; LM: none).
      'source_tokens': _source_tokens(task, batch) * (2 if rdrop_alpha > 0 else 1),
      'grad_norm': grad_norm, 'learning_rate': schedule(state.step),
      'nonfinite': (~finite).astype(jnp.int32),
  }
  if rdrop_alpha > 0:
    metrics['rdrop_divergence_sum'] = divergence_sum  # part of loss_sum, times rdrop_alpha
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _keep_if_finite(finite, new, old):
  """The new parameters and optimizer state where the update is `finite`, else the old ones but for the
  optimizer's step counts, which go on so that the schedule stays at state.step (the rate logged)."""
  is_count = lambda path: isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == 'count'
  return jax.tree_util.tree_map_with_path(lambda path, n, o: n if is_count(path) else jnp.where(finite, n, o),
                                          new, old)


def _source_tokens(task, batch):
  if task == 'lm':
    return jnp.zeros((), jnp.float32)
  return (batch['src'] != PAD_ID).sum().astype(jnp.float32)


def eval_step(params, batch, *, model, label_smoothing, task='translation'):
  """Sums for validation loss and perplexity (no dropout); for the MLM also the correctly predicted masked
  tokens (masks drawn from each batch's content, the same at every evaluation)."""
  logits, targets, _ = lm.forward(task, model, params, batch, True)
  loss_sum, nll_sum, tokens = label_smoothed_cross_entropy(logits, targets, label_smoothing)
  sums = {'loss_sum': loss_sum, 'nll_sum': nll_sum, 'target_tokens': tokens}
  if task == 'mlm':
    sums['correct'] = lm.correct_predictions(logits, targets)
  return sums


def init_state(model, optimizer, seed, batch_shape=(1, 8), prng_impl=DEFAULT_PRNG_IMPL):
  """Fresh parameters (xavier-uniform dense layers) and optimizer state, both keys from `seed` by the
  `prng_impl` generator (for threefry the keys of jax.random.PRNGKey(seed), as before the choice existed)."""
  params_rng, dropout_rng = jax.random.split(jax.random.key(seed, impl=prng_impl))
  dummy = jnp.ones(batch_shape, jnp.int32)
  inputs = (dummy, dummy) if isinstance(model, lm.model_lib.Transformer) else (dummy,)  # LM, MLM: one text
  params = model.init(params_rng, *inputs)['params']
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=optimizer.init(params),
                    rng=jax.random.key_data(dropout_rng))


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """What the compiled train and eval steps are specialized on: the model and the config fields the steps
  read, under their config names (adam_of reads them as it reads a config). Frozen and hashable, it is a
  static argument of module-level step functions, so runs of one model and options in one process (an
  ensemble's members, a run resumed in-process, a sweep, the tests) trace and lower their steps once; the
  schedule's numbers are an input (schedule_numbers), the seed a static argument of the initialization only."""
  model: object
  task: str
  label_smoothing: float
  grad_accumulation_steps: int
  rdrop_alpha: float
  prng_impl: str
  vocabulary_loss_chunk_tokens: int
  learning_rate_schedule: str
  weight_decay: float
  adam_b1: float
  adam_b2: float
  adam_eps: float
  grad_clip_norm: float

  @classmethod
  def of(cls, model, config):
    return cls(model=model, task=lm.task_of(config), label_smoothing=float(config.label_smoothing),
               grad_accumulation_steps=int(config.grad_accumulation_steps), rdrop_alpha=float(config.rdrop_alpha),
               prng_impl=config.prng_impl,
               vocabulary_loss_chunk_tokens=int(config.vocabulary_loss_chunk_tokens),
               learning_rate_schedule=config.learning_rate_schedule, weight_decay=float(config.weight_decay),
               adam_b1=float(config.adam_b1), adam_b2=float(config.adam_b2), adam_eps=float(config.adam_eps),
               grad_clip_norm=float(config.grad_clip_norm))


def _fresh_state(seed, options):
  # The optimizer state holds Adam's moments and the schedule's update count; the schedule itself is not
  # called at initialization, so any schedule gives the same state.
  return init_state(options.model, adam_of(options, lambda count: 0.0), seed, prng_impl=options.prng_impl)


def _train(state, batch, numbers, options):
  optimizer, schedule = make_optimizer(options, numbers=numbers)
  return train_step(state, batch, model=options.model, optimizer=optimizer, schedule=schedule,
                    label_smoothing=options.label_smoothing, grad_accumulation_steps=options.grad_accumulation_steps,
                    task=options.task, rdrop_alpha=options.rdrop_alpha, prng_impl=options.prng_impl,
                    vocabulary_loss_chunk_tokens=options.vocabulary_loss_chunk_tokens)


def _train_steps(state, batches, numbers, options):
  """As many train steps as `batches` has rows on its leading axis, in one program (lax.scan): the same updates as
  that many calls of _train in order, their metrics stacked on a leading axis."""
  return jax.lax.scan(lambda carry, batch: _train(carry, batch, numbers, options), state, batches)


def _evaluate(params, batch, options):
  return eval_step(params, batch, model=options.model, label_smoothing=options.label_smoothing, task=options.task)


@functools.lru_cache(maxsize=8)
def _abstract_state(options):
  # jax.eval_shape traces at every call; the shapes are the same for an equal model and options, any seed.
  return jax.eval_shape(functools.partial(_fresh_state, 0, options))


def state_shardings(model, config, mesh):
  """The sharding of every leaf of the train state (parameters replicated, or FSDP-sharded over 'fsdp';
  optimizer moments laid out like their parameters), from its shapes alone (no FLOPs)."""
  return sharding.state_shardings(_abstract_state(StepOptions.of(model, config)), mesh)


def create_state(model, config, mesh):
  """(fresh train state created directly in its sharded layout, its shardings)."""
  shardings = state_shardings(model, config, mesh)
  init = jax.jit(_fresh_state, static_argnums=(0, 1), out_shardings=shardings)
  return init(config.seed, StepOptions.of(model, config)), shardings


class TrainStep:
  """The compiled train step with its schedule's numbers (schedule_numbers, an input of the program):
  step(state, batch) -> (state, metrics); step.many(state, batches) runs one step per batch of `batches` (stacked
  on a new leading axis) in one call, their metrics stacked; lower and trace, as jax.jit's, take (state, batch),
  and trace_many takes many's (state, batches)."""

  def __init__(self, jitted, many_jitted, options, config, replicated):
    self.jitted, self.options, self.config, self.replicated = jitted, options, config, replicated
    self.many_jitted = many_jitted
    self.numbers = {name: np.float32(value) for name, value in schedule_numbers(config).items()}
    self._on_devices = None

  def __call__(self, state, batch):
    return self.jitted(state, batch, self._numbers_on_devices(), self.options)

  def many(self, state, batches):
    return self.many_jitted(state, batches, self._numbers_on_devices(), self.options)

  def _numbers_on_devices(self):
    if self._on_devices is None:  # replicated, put once (no transfer per step); every process holds them all
      self._on_devices = {name: jax.make_array_from_process_local_data(self.replicated, np.asarray(value))
                          for name, value in self.numbers.items()}
    return self._on_devices

  def _abstract_numbers(self):
    """The numbers as the compiler sees them (a mesh of abstract devices, as for lowering for another
    platform, holds no arrays)."""
    return {name: jax.ShapeDtypeStruct((), np.float32, sharding=self.replicated) for name in self.numbers}

  def lower(self, state, batch):
    return self.jitted.lower(state, batch, self._abstract_numbers(), self.options)

  def trace_many(self, state, batches):
    return self.many_jitted.trace(state, batches, self._abstract_numbers(), self.options)

  def trace(self, state, batch):
    return self.jitted.trace(state, batch, self._abstract_numbers(), self.options)


def jit_steps(model, config, mesh, state_sharding=None):
  """(the compiled train step, a TrainStep; the compiled eval step), with explicit shardings: the state as
  `state_sharding` (default: as state_shardings gives it), the batch's rows split over every device of the
  mesh, metrics and the schedule's numbers replicated. The train state is donated, so its buffers are updated
  in place. Adam and the schedule are built inside the step from StepOptions and the numbers it is given. The
  steps of one call (TrainStep.many) take their batches stacked on a leading axis that is not split.
  jax.jit compiles on first use: a run that never calls `many` never compiles it."""
  if state_sharding is None:
    state_sharding = state_shardings(model, config, mesh)
  options = StepOptions.of(model, config)
  batch_sharding, replicated = sharding.batch_sharded(mesh), sharding.replicated(mesh)
  train_jitted = jax.jit(_train, in_shardings=(state_sharding, batch_sharding, replicated),
                         out_shardings=(state_sharding, replicated), static_argnums=3, donate_argnums=0)
  many_jitted = jax.jit(_train_steps, in_shardings=(state_sharding, sharding.steps_batch_sharded(mesh), replicated),
                        out_shardings=(state_sharding, replicated), static_argnums=3, donate_argnums=0)
  eval_jitted = jax.jit(_evaluate, in_shardings=(state_sharding.params, batch_sharding), out_shardings=replicated,
                        static_argnums=2)
  evaluate = lambda params, batch: eval_jitted(params, batch, options)
  return TrainStep(train_jitted, many_jitted, options, config, replicated), evaluate
