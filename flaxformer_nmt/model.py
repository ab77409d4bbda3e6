"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017), in the paper's order.

3.4  Embeddings: one matrix shared by the source embedding, the target embedding and the pre-softmax
     projection, scaled by sqrt(d_model) on the way in.
3.5  Sinusoidal positional encodings, added to the embeddings, then dropout.
3.2  Scaled dot-product attention and multi-head attention.
3.3  Position-wise feed-forward network: two linear maps with a ReLU between.
3.1  Encoder and decoder stacks: every sub-layer wrapped as LayerNorm(x + Dropout(Sublayer(x))) (post-LN, the
     paper); pre-LN, x + Dropout(Sublayer(LayerNorm(x))) with a final LayerNorm, is an option.

Decoding runs the decoder one position at a time with explicit caches: each decoder layer's self-attention
keys/values so far (`init_cache`), and the encoder-decoder attention keys/values, computed once per sentence
(`cross_attention_kv`). A step then costs O(length) instead of re-running the whole prefix.

Masks are boolean arrays broadcastable to [batch, heads, queries, keys]; True means "may attend".
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxformer_nmt.tokenizer import PAD_ID

xavier_uniform = nn.initializers.xavier_uniform()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model's hyperparameters (the `model` field of a config, plus the vocabulary size)."""
  vocab_size: int
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  relu_dropout_rate: float = 0.0
  pre_layer_norm: bool = False
  max_position: int = 1024
  dtype: str = 'auto'

  @classmethod
  def from_config(cls, config, vocab_size):
    return cls(vocab_size=vocab_size, **config.model.to_dict())


def resolve_dtype(name):
  """'auto' -> bfloat16 on accelerators, float32 on CPU; otherwise the named dtype."""
  if name == 'auto':
    return jnp.float32 if jax.default_backend() == 'cpu' else jnp.bfloat16
  return jnp.dtype(name)


# --- 3.5 Positional encoding -------------------------------------------------------------------------------

def sinusoidal_positions(max_position, d_model):
  """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d))."""
  position = np.arange(max_position)[:, None]
  div = np.exp(np.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
  table = np.zeros((max_position, d_model), np.float32)
  table[:, 0::2] = np.sin(position * div)
  table[:, 1::2] = np.cos(position * div)
  return table


# --- Masks -------------------------------------------------------------------------------------------------

def padding_mask(query_tokens, key_tokens):
  """[B, 1, Tq, Tk]: real queries may attend to real keys; nothing attends to or from padding."""
  return ((query_tokens != PAD_ID)[:, None, :, None] & (key_tokens != PAD_ID)[:, None, None, :])


def causal_mask(length):
  """[1, 1, T, T]: position i may attend to positions <= i."""
  return jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]


# --- 3.2 Attention -----------------------------------------------------------------------------------------

def scaled_dot_product_attention(q, k, v, mask, dropout=None):
  """softmax(Q K^T / sqrt(d_k)) V over [B, T, H, D] arrays; returns (output, weights [B, H, Tq, Tk])."""
  q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  scores = jnp.einsum('bqhd,bkhd->bhqk', q, k).astype(jnp.float32)
  # A select, not an added large negative: adding overflows to NaN in half precision.
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if dropout is not None:
    weights = dropout(weights)
  out = jnp.einsum('bhqk,bkhd->bqhd', weights.astype(v.dtype), v)
  return out, weights


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)."""
  num_heads: int
  d_model: int
  attention_dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    if self.d_model % self.num_heads:
      raise ValueError(f'd_model {self.d_model} is not divisible by num_heads {self.num_heads}')
    # No biases in the projections, as in the authors' tensor2tensor code.
    dense = functools.partial(nn.Dense, self.d_model, use_bias=False, kernel_init=xavier_uniform,
                              dtype=self.dtype)
    self.query, self.key, self.value, self.output = dense(), dense(), dense(), dense()
    self.attention_dropout = nn.Dropout(self.attention_dropout_rate)

  def _split_heads(self, x):
    return x.reshape(x.shape[:-1] + (self.num_heads, self.d_model // self.num_heads))

  def project_kv(self, kv_inputs):
    """Keys and values [B, Tk, H, D] of `kv_inputs` (computed once per sentence for cross-attention)."""
    return self._split_heads(self.key(kv_inputs)), self._split_heads(self.value(kv_inputs))

  def attend(self, q_inputs, k, v, mask, deterministic):
    q = self._split_heads(self.query(q_inputs))
    dropout = None
    if self.attention_dropout_rate > 0 and not deterministic:
      dropout = functools.partial(self.attention_dropout, deterministic=False)
    out, weights = scaled_dot_product_attention(q, k, v, mask, dropout)
    # Kept for attention pictures when 'intermediates' is mutable; free otherwise.
    self.sow('intermediates', 'attention_weights', weights)
    return self.output(out.reshape(out.shape[:-2] + (self.d_model,)))

  def __call__(self, q_inputs, kv_inputs, mask, deterministic=True):
    k, v = self.project_kv(kv_inputs)
    return self.attend(q_inputs, k, v, mask, deterministic)


# --- 3.3 Feed-forward --------------------------------------------------------------------------------------

class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2."""
  d_model: int
  d_ff: int
  relu_dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, deterministic=True):
    x = nn.relu(nn.Dense(self.d_ff, kernel_init=xavier_uniform, dtype=self.dtype, name='wi')(x))
    x = nn.Dropout(self.relu_dropout_rate)(x, deterministic=deterministic)
    return nn.Dense(self.d_model, kernel_init=xavier_uniform, dtype=self.dtype, name='wo')(x)


# --- 3.1 Encoder and decoder stacks ------------------------------------------------------------------------

class SublayerConnection(nn.Module):
  """Post-LN: LayerNorm(x + Dropout(f(x))). Pre-LN: x + Dropout(f(LayerNorm(x)))."""
  dropout_rate: float
  pre_layer_norm: bool
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.norm = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)
    self.dropout = nn.Dropout(self.dropout_rate)

  def __call__(self, x, sublayer, deterministic):
    if self.pre_layer_norm:
      return x + self.dropout(sublayer(self.norm(x)), deterministic=deterministic)
    return self.norm(x + self.dropout(sublayer(x), deterministic=deterministic))


class EncoderLayer(nn.Module):
  config: ModelConfig
  dtype: jnp.dtype

  def setup(self):
    c = self.config
    sublayer = functools.partial(SublayerConnection, c.dropout_rate, c.pre_layer_norm, self.dtype)
    self.self_attention = MultiHeadAttention(c.num_heads, c.d_model, c.attention_dropout_rate, self.dtype)
    self.feed_forward = FeedForward(c.d_model, c.d_ff, c.relu_dropout_rate, self.dtype)
    self.attention_block, self.feed_forward_block = sublayer(), sublayer()

  def __call__(self, x, mask, deterministic):
    x = self.attention_block(x, lambda y: self.self_attention(y, y, mask, deterministic), deterministic)
    return self.feed_forward_block(x, lambda y: self.feed_forward(y, deterministic), deterministic)


class DecoderLayer(nn.Module):
  config: ModelConfig
  dtype: jnp.dtype

  def setup(self):
    c = self.config
    sublayer = functools.partial(SublayerConnection, c.dropout_rate, c.pre_layer_norm, self.dtype)
    self.self_attention = MultiHeadAttention(c.num_heads, c.d_model, c.attention_dropout_rate, self.dtype)
    self.cross_attention = MultiHeadAttention(c.num_heads, c.d_model, c.attention_dropout_rate, self.dtype)
    self.feed_forward = FeedForward(c.d_model, c.d_ff, c.relu_dropout_rate, self.dtype)
    self.self_block, self.cross_block, self.feed_forward_block = sublayer(), sublayer(), sublayer()

  def __call__(self, y, cross_kv, self_mask, cross_mask, deterministic, cache=None, index=None):
    """One decoder layer over y [B, T, d]. With `cache` (keys/values [B, L, H, D] of earlier positions), y
    holds the single position `index`; returns (y, updated cache)."""
    def self_attention(z):
      nonlocal cache
      k, v = self.self_attention.project_kv(z)
      if cache is not None:
        k = jax.lax.dynamic_update_slice_in_dim(cache['k'], k.astype(cache['k'].dtype), index, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(cache['v'], v.astype(cache['v'].dtype), index, axis=1)
        cache = {'k': k, 'v': v}
      return self.self_attention.attend(z, k, v, self_mask, deterministic)

    y = self.self_block(y, self_attention, deterministic)
    y = self.cross_block(y, lambda z: self.cross_attention.attend(z, *cross_kv, cross_mask, deterministic),
                         deterministic)
    y = self.feed_forward_block(y, lambda z: self.feed_forward(z, deterministic), deterministic)
    return y, cache


class Transformer(nn.Module):
  """Encoder-decoder with one embedding shared by source, target and the output projection."""
  config: ModelConfig

  def setup(self):
    c = self.config
    self.dtype = resolve_dtype(c.dtype)
    # Normal(0, d^-1/2): after the sqrt(d) scale the embeddings enter with unit variance, and as the
    # pre-softmax projection they give unit-scale logits.
    self.embedding = nn.Embed(c.vocab_size, c.d_model, embedding_init=nn.initializers.normal(c.d_model ** -0.5),
                              name='shared_embedding')
    self.positions = sinusoidal_positions(c.max_position, c.d_model)
    self.embedding_dropout = nn.Dropout(c.dropout_rate)
    self.encoder_layers = [EncoderLayer(c, self.dtype, name=f'encoder_{i}') for i in range(c.num_encoder_layers)]
    self.decoder_layers = [DecoderLayer(c, self.dtype, name=f'decoder_{i}') for i in range(c.num_decoder_layers)]
    if c.pre_layer_norm:
      self.encoder_norm = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)
      self.decoder_norm = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)

  def embed(self, tokens, positions, deterministic):
    x = self.embedding(tokens) * jnp.sqrt(self.config.d_model).astype(jnp.float32)
    x = x + jnp.asarray(self.positions)[positions]
    return self.embedding_dropout(x, deterministic=deterministic).astype(self.dtype)

  def encode(self, src, deterministic=True):
    """src [B, S] -> encoder output [B, S, d]."""
    mask = padding_mask(src, src)
    x = self.embed(src, jnp.arange(src.shape[1])[None], deterministic)
    for layer in self.encoder_layers:
      x = layer(x, mask, deterministic)
    return self.encoder_norm(x) if self.config.pre_layer_norm else x

  def cross_attention_kv(self, encoded):
    """Every decoder layer's encoder-decoder attention keys and values, computed once per sentence."""
    return [layer.cross_attention.project_kv(encoded) for layer in self.decoder_layers]

  def logits(self, y):
    """Pre-softmax projection with the shared embedding matrix, in float32."""
    if self.config.pre_layer_norm:
      y = self.decoder_norm(y)
    return self.embedding.attend(y.astype(jnp.float32))

  def decode(self, tgt_in, encoded, src, deterministic=True):
    """Teacher-forced decoder: tgt_in [B, T] (BOS + target) -> logits [B, T, V]."""
    self_mask = padding_mask(tgt_in, tgt_in) & causal_mask(tgt_in.shape[1])
    cross_mask = padding_mask(tgt_in, src)
    y = self.embed(tgt_in, jnp.arange(tgt_in.shape[1])[None], deterministic)
    for layer, kv in zip(self.decoder_layers, self.cross_attention_kv(encoded)):
      y, _ = layer(y, kv, self_mask, cross_mask, deterministic)
    return self.logits(y)

  def __call__(self, src, tgt_in, deterministic=True):
    return self.decode(tgt_in, self.encode(src, deterministic), src, deterministic)

  # --- Incremental decoding ---

  def init_cache(self, batch_size, max_length):
    """Zeroed self-attention keys/values for `max_length` positions, one dict per decoder layer."""
    c = self.config
    shape = (batch_size, max_length, c.num_heads, c.d_model // c.num_heads)
    return [{'k': jnp.zeros(shape, self.dtype), 'v': jnp.zeros(shape, self.dtype)}
            for _ in range(c.num_decoder_layers)]

  def decode_step(self, tokens, index, cache, cross_kv, src):
    """tokens [B] at position `index` -> (logits [B, V], cache with this position's keys/values)."""
    max_length = cache[0]['k'].shape[1]
    # The query may see cached positions 0..index, never the unwritten slots after it.
    self_mask = (jnp.arange(max_length) <= index)[None, None, None, :]
    cross_mask = (src != PAD_ID)[:, None, None, :]
    y = self.embed(tokens[:, None], jnp.full((1, 1), index), deterministic=True)
    new_cache = []
    for layer, kv, layer_cache in zip(self.decoder_layers, cross_kv, cache):
      y, layer_cache = layer(y, kv, self_mask, cross_mask, True, cache=layer_cache, index=index)
      new_cache.append(layer_cache)
    return self.logits(y)[:, 0], new_cache


def count_params(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
