"""The other two Transformers built from transformer.py's blocks: a decoder-only language model (GPT-style) and an
encoder-only masked language model (BERT-style), with BERT's masking and the per-task forward pass the
train and eval steps call.

  config.task = 'translation'  transformer.Transformer: encoder + decoder with cross-attention (the paper).
  config.task = 'lm'           DecoderOnlyLM: `decoder_{i}` layers without cross-attention, causal
                               self-attention only, the embedding tied to the output projection; trained to
                               predict token t+1 from tokens <= t (BOS first, EOS last).
  config.task = 'mlm'          MaskedLM: `encoder_{i}` layers (bidirectional self-attention), then BERT's
                               prediction head (dense + GELU + LayerNorm, the tied embedding, an output bias);
                               trained to recover the tokens that `bert_mask` selected.

Both read the batches translation uses (data.make_batch / packing.py) from one side of text: the LM the
decoder arrays (`tgt_in` = BOS + tokens, `tgt_out` = tokens + EOS, `tgt_segments`/`tgt_positions` when
packed), the MLM the encoder arrays (`src` = tokens + EOS, `src_segments`/`src_positions`).
"""
import jax
import jax.numpy as jnp
from flax import linen as nn

from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.models.tokens import BOS_ID, EOS_ID, MASK_PIECE, PAD_ID

TASKS = ('translation', 'lm', 'mlm')
# model.ModelConfig.architecture of each task (flops.py counts by it).
ARCHITECTURES = {'translation': 'encoder_decoder', 'lm': 'decoder_only', 'mlm': 'encoder_only'}


def task_of(config):
  """config.task (config.validate checks it is one of TASKS)."""
  return config.task


class DecoderOnlyLM(model_lib.TransformerStacks):
  """GPT-style language model: embedding, decoder layers without cross-attention, tied output projection."""

  def setup(self):
    self.setup_embedding()
    self.setup_decoder(has_cross_attention=False)

  def __call__(self, tokens, deterministic=True, *, segments=None, positions=None):
    """tokens [B, T] (BOS + text) -> logits [B, T, V] of the next token at every position."""
    return self.run_decoder(tokens, deterministic, tgt_segments=segments, tgt_positions=positions)


class MaskedLM(model_lib.TransformerStacks):
  """BERT-style masked language model: embedding, encoder layers, and BERT's prediction head."""
  mask_id: int = 4

  def setup(self):
    self.setup_embedding()
    self.setup_encoder()
    c = self.config
    self.head_dense = nn.Dense(c.d_model, kernel_init=model_lib.xavier_uniform, dtype=self.dtype,
                               dot_general=model_lib.dense_dot_general(c.matmul_precision))
    self.head_norm = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32)
    self.head_bias = self.param('head_bias', nn.initializers.zeros, (c.vocab_size,))

  def __call__(self, tokens, deterministic=True, *, segments=None, positions=None):
    """tokens [B, T] (text + EOS, some replaced by bert_mask) -> logits [B, T, V] of the original tokens."""
    x = self.encode(tokens, deterministic, src_segments=segments, src_positions=positions)
    x = self.head_norm(nn.gelu(self.head_dense(x), approximate=False))
    return self.vocabulary_logits(x) + self.head_bias


def build(task, model_config, mask_id=None):
  """The flax module of a task."""
  if task == 'translation':
    return model_lib.Transformer(model_config)
  if task == 'lm':
    return DecoderOnlyLM(model_config)
  if mask_id is None:
    raise ValueError(f'the MLM needs a {MASK_PIECE} piece in its vocabulary (trained with config.task=mlm)')
  return MaskedLM(model_config, mask_id=mask_id)


# --- BERT masking ------------------------------------------------------------------------------------------

def bert_mask(rng, tokens, *, mask_id, vocab_size, select_rate=0.15, random_low=None):
  """BERT's corruption of tokens [B, T]: each non-pad, non-special token (EOS/BOS, like BERT's [SEP]/[CLS],
  are left alone) is selected with probability `select_rate`; a selected token becomes `mask_id` with
  probability 0.8, a uniformly random ordinary token (ids random_low..V-1, by default those after the mask
  id) with 0.1, and stays itself with 0.1.

  Returns (inputs [B, T], targets [B, T]): targets hold the original token at selected positions and PAD
  elsewhere, so the loss counts the selected positions only.
  """
  random_low = mask_id + 1 if random_low is None else random_low
  select_rng, kind_rng, random_rng = jax.random.split(rng, 3)
  eligible = (tokens != PAD_ID) & (tokens != EOS_ID) & (tokens != BOS_ID)
  selected = eligible & (jax.random.uniform(select_rng, tokens.shape) < select_rate)
  kind = jax.random.uniform(kind_rng, tokens.shape)
  random_tokens = jax.random.randint(random_rng, tokens.shape, random_low, vocab_size, dtype=tokens.dtype)
  inputs = jnp.where(selected & (kind < 0.8), mask_id, tokens)
  inputs = jnp.where(selected & (kind >= 0.8) & (kind < 0.9), random_tokens, inputs)
  targets = jnp.where(selected, tokens, PAD_ID)
  return inputs, targets


def eval_mask_rng(tokens, seed=0):
  """A validation batch's masking key, from its content: the same masks at every evaluation (comparable
  numbers), different masks for different batches."""
  weights = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.uint32)[None]
  digest = (tokens.astype(jnp.uint32) * weights).sum() + jnp.uint32(tokens.shape[0])
  return jax.random.fold_in(jax.random.PRNGKey(seed), digest)


# --- The forward pass of each task -------------------------------------------------------------------------

# Optional packed-row keys, per task, passed to the model as keyword arguments.
_PACKING = {'translation': ('src_segments', 'tgt_segments', 'src_positions', 'tgt_positions')}


def forward(task, model, params, batch, deterministic, rngs=None, mask_rng=None, project=True):
  """(logits [B, T, V], targets [B, T] with PAD where nothing is predicted, input tokens counted).

  mask_rng: the MLM's masking key (the train step's own stream; validation derives it from the batch).
  project=False (translation only): the decoder states [B, T, d] the logits would be projected from, for a
  loss that projects them itself (train_step.chunked_vocabulary_loss).
  """
  variables = {'params': params}
  if task == 'translation':
    packing = {key: batch[key] for key in _PACKING['translation'] if key in batch}
    logits = model.apply(variables, batch['src'], batch['tgt_in'], deterministic, rngs=rngs, project=project,
                         **packing)
    return logits, batch['tgt_out'], (batch['src'] != PAD_ID).sum()
  if not project:
    raise ValueError(f'decoder states instead of logits are for the translation task, not {task!r}')
  if task == 'lm':
    logits = model.apply(variables, batch['tgt_in'], deterministic, rngs=rngs, segments=batch.get('tgt_segments'),
                         positions=batch.get('tgt_positions'))
    # No source: every token the LM reads is also a prediction (counted as target tokens).
    return logits, batch['tgt_out'], jnp.zeros((), jnp.int32)
  tokens = batch['src']
  if mask_rng is None:
    mask_rng = eval_mask_rng(tokens)
  inputs, targets = bert_mask(mask_rng, tokens, mask_id=model.mask_id, vocab_size=model.config.vocab_size)
  logits = model.apply(variables, inputs, deterministic, rngs=rngs, segments=batch.get('src_segments'),
                       positions=batch.get('src_positions'))
  return logits, targets, (tokens != PAD_ID).sum()


def correct_predictions(logits, targets):
  """How many predicted positions (targets not PAD) have the target as their most likely token."""
  hits = (jnp.argmax(logits, axis=-1) == targets) & (targets != PAD_ID)
  return hits.sum().astype(jnp.float32)
