"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017), in the paper's order.

3.4  Embeddings: one matrix shared by the source embedding, the target embedding and the pre-softmax
     projection, scaled by sqrt(d_model) on the way in.
3.5  Sinusoidal positional encodings, added to the embeddings, then dropout.
3.2  Scaled dot-product attention and multi-head attention.
3.3  Position-wise feed-forward network: two linear maps with a ReLU between.
3.1  Encoder and decoder stacks: every sub-layer wrapped as LayerNorm(x + Dropout(Sublayer(x))) (post-LN, the
     paper); pre-LN, x + Dropout(Sublayer(LayerNorm(x))) with a final LayerNorm, is an option.
5.4  Dropout (P_drop) on every sub-layer output and on the embedding sums, with cheap 16-bit masks (`Dropout`).

Decoding runs the decoder one position at a time with explicit caches: each decoder layer's self-attention
keys/values so far (`init_cache`), and the encoder-decoder attention keys/values, computed once per sentence
(`decoding_cross_kv`). A step then costs O(length) instead of re-running the whole prefix. Both are kept
head-major, [B, H, T, D], the layout of the step's attention products: with [B, T, H, D] XLA copied every
cache into that layout at every step (on the CPU that was half of a step's attention time).

Masks are boolean arrays broadcastable to [batch, heads, queries, keys]; True means "may attend" (carried
with per-row lengths in an `AttentionMask`, the form cuDNN's flash attention takes).

Precision: parameters are float32; with dtype bfloat16 (the default on GPU/TPU) the matmuls and the
residual stream run in bfloat16, while LayerNorm statistics, attention logits and softmax, the pre-softmax
logits and the loss stay float32. Attention goes through jax.nn.dot_product_attention (see
`resolve_attention_impl`); the explicit einsum path serves attention pictures and attention dropout.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from flaxformer_nmt.config import ConfigError
from flaxformer_nmt.models.tokens import PAD_ID

xavier_uniform = nn.initializers.xavier_uniform()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model's hyperparameters (the `model` field of a config, plus the vocabulary size), with the choices
  that depend on the machine (`dtype`, `attention_impl`) settled for `platform` when it is built: outside any
  traced code, so that a step lowered for another platform (tests/test_lowering.py) takes that platform's
  path. Settled, `dtype` is a dtype name ('float32', 'bfloat16', ...) and `attention_impl` one of 'xla',
  'cudnn', 'einsum'."""
  vocab_size: int
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  relu_dropout_rate: float = 0.0
  # Source word dropout (Sennrich and Zhang 2019, for low-resource translation; not in the paper): in training,
  # each source token's embedding is zeroed with this probability; its position encoding stays.
  source_word_dropout: float = 0.0
  pre_layer_norm: bool = False
  max_position: int = 1024
  dtype: str = 'auto'
  # How attention is computed (same parameters either way): 'auto' (cuDNN flash attention on GPU in bf16,
  # else XLA), 'xla', 'cudnn' (jax.nn.dot_product_attention) or 'einsum' (explicit weights).
  attention_impl: str = 'auto'
  # Activation rematerialization per layer: 'none', 'full' or 'dots' (see REMAT_POLICIES).
  remat: str = 'none'
  # The operands of the projection, feed-forward and output matmuls: 'float32' (as the activations), or
  # 'bfloat16': rounded to bfloat16 and multiplied with float32 accumulation and results (`bfloat16_matmul`).
  # With float32 activations that is TPU's default matmul precision, and on CPUs with AVX512-BF16 the step is
  # 1.3-1.4x faster (bench/RESULTS.md). 'auto': 'bfloat16' on a CPU with bf16 dot instructions, else 'float32'
  # (settled like dtype). Attention's own two products stay in `dtype`.
  matmul_precision: str = 'float32'
  # The platform the model computes on: 'auto' = this process's backend (jax.default_backend()), or 'cpu',
  # 'gpu' ('cuda', 'rocm'), 'tpu' to build it for another (lowering for an accelerator on a CPU machine).
  platform: str = 'auto'
  # Which stacks the model has (set from config.task by workdir.build_model; flops.py counts by it):
  # 'encoder_decoder' (translation), 'decoder_only' (language model), 'encoder_only' (masked LM).
  architecture: str = 'encoder_decoder'

  def __post_init__(self):
    platform = resolve_platform(self.platform)
    dtype = resolve_dtype(self.dtype, platform)
    impl = resolve_attention_impl(self.attention_impl, dtype, self.d_model // self.num_heads, platform)
    if impl == 'cudnn':
      check_cudnn_attention(dtype, self.d_model, self.num_heads, platform)
    object.__setattr__(self, 'matmul_precision', resolve_matmul_precision(self.matmul_precision, platform))
    object.__setattr__(self, 'platform', platform)
    object.__setattr__(self, 'dtype', jnp.dtype(dtype).name)
    object.__setattr__(self, 'attention_impl', impl)

  @classmethod
  def from_config(cls, config, vocab_size, platform='auto', architecture='encoder_decoder'):
    return cls(vocab_size=vocab_size, platform=platform, architecture=architecture, **config.model.to_dict())


PLATFORMS = ('cpu', 'gpu', 'tpu')
# jax's lowering platform names -> the backend names jax.default_backend() reports.
_PLATFORM_ALIASES = {'cuda': 'gpu', 'rocm': 'gpu'}


def resolve_platform(name='auto'):
  """'auto' -> this process's backend (call it outside traced code); 'cuda'/'rocm' -> 'gpu'."""
  platform = jax.default_backend() if name == 'auto' else _PLATFORM_ALIASES.get(name, name)
  if platform not in PLATFORMS:
    raise ConfigError(f"model platform must be 'auto' or one of {PLATFORMS + tuple(_PLATFORM_ALIASES)}, "
                      f'not {name!r}')
  return platform


def resolve_dtype(name, platform):
  """'auto' -> bfloat16 on accelerators, float32 on CPU (where bf16 matmuls are slower); else the named dtype."""
  if name == 'auto':
    return jnp.float32 if platform == 'cpu' else jnp.bfloat16
  try:
    return jnp.dtype(name)
  except TypeError:
    raise ConfigError(f"config.model.dtype={name!r} is not a dtype: use 'auto', 'float32', 'bfloat16' or "
                      "'float16'") from None


# --- Matmul precision --------------------------------------------------------------------------------------

MATMUL_PRECISIONS = ('auto', 'float32', 'bfloat16')


@functools.cache  # read once per process: every ModelConfig with 'auto' asks
def cpu_flags(cpuinfo='/proc/cpuinfo'):
  """The instruction-set flags of this CPU from Linux's /proc/cpuinfo (empty where it cannot be read)."""
  try:
    with open(cpuinfo) as f:
      return frozenset(next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), []))
  except OSError:
    return frozenset()


def cpu_has_bfloat16_dot(cpuinfo='/proc/cpuinfo'):
  """Whether this CPU multiplies bfloat16 in hardware (x86 AVX512-BF16 or AMX-BF16; False where
  /proc/cpuinfo cannot be read). Without it XLA converts bf16 operands to float32 first, and bfloat16 matmuls
  are slower than float32 ones."""
  return bool({'avx512_bf16', 'amx_bf16'} & cpu_flags(cpuinfo))


def resolve_matmul_precision(name, platform):
  """'auto' -> 'bfloat16' on a CPU with bf16 dot instructions, else 'float32' (on GPU/TPU `dtype` decides)."""
  if name not in MATMUL_PRECISIONS:
    raise ConfigError(f'config.model.matmul_precision must be one of {MATMUL_PRECISIONS}, not {name!r}')
  if name == 'auto':
    return 'bfloat16' if platform == 'cpu' and cpu_has_bfloat16_dot() else 'float32'
  return name


def _bfloat16_product(x, w, out_dtype):
  return jax.lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), (((x.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bfloat16_matmul(x, w, out_dtype):
  """x [..., k] @ w [k, n] with both operands rounded to bfloat16, accumulated in float32, cast to `out_dtype`.

  The backward pass multiplies the same way (the cotangent rounded to bfloat16, float32 accumulation): jax's
  own derivative of a bfloat16 product would give bfloat16 results, which XLA:CPU computes at a third of the
  rate of a bfloat16 product with float32 results. The gradients come back in the operands' dtypes.
  """
  return _bfloat16_product(x, w, out_dtype)


def _bfloat16_matmul_forward(x, w, out_dtype):
  dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))  # the cotangents' dtypes, as arrays
  return _bfloat16_product(x, w, out_dtype), (x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), dtypes)


def _bfloat16_matmul_backward(out_dtype, residuals, g):
  x, w, (x_dtype, w_dtype) = residuals
  g = g.astype(jnp.bfloat16)
  dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  dw = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]), (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
  return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


bfloat16_matmul.defvjp(_bfloat16_matmul_forward, _bfloat16_matmul_backward)


def _bfloat16_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """nn.Dense's dot_general (contract the input's last axis with the kernel's first) as a `bfloat16_matmul`."""
  (lhs_contract, rhs_contract), batch_dims = dimension_numbers
  if tuple(lhs_contract) != (lhs.ndim - 1,) or tuple(rhs_contract) != (0,) or any(batch_dims) or rhs.ndim != 2:
    raise NotImplementedError(f'bfloat16 matmul of dimension numbers {dimension_numbers}')
  return bfloat16_matmul(lhs, rhs, preferred_element_type or lhs.dtype)


def vocabulary_operand_dtype(config):
  """What the vocabulary projection rounds its operands to (its results are float32 either way): bfloat16 in a
  bfloat16 model or with bfloat16 matmul operands, else the model's dtype."""
  if config.matmul_precision == 'bfloat16' or jnp.dtype(config.dtype) == jnp.bfloat16:
    return jnp.dtype(jnp.bfloat16)
  return jnp.dtype(config.dtype)


def shared_embedding(params):
  """The [V, d] table that embeds source and target tokens and projects decoder states onto the vocabulary."""
  return params['shared_embedding']['embedding']


# The entry of a search's parameters that holds the vocabulary projection's kernel (with_vocabulary_kernel).
VOCABULARY_KERNEL = 'vocabulary_kernel'


def with_vocabulary_kernel(config, params):
  """`params` with the vocabulary projection's [d, V] kernel beside them: the shared embedding transposed and
  rounded to the projection's operand dtype, which Transformer.vocabulary_logits then reads. Made once for a
  search, whose programs would otherwise transpose and round the [V, d] table in every call (on 2 CPU cores a
  tenth of a greedy search of the Multi30k model). The same logits; not for training, whose gradient flows
  through the embedding."""
  return {**params, VOCABULARY_KERNEL: _transposed(shared_embedding(params), vocabulary_operand_dtype(config))}


@functools.partial(jax.jit, static_argnums=1)
def _transposed(x, dtype):
  """x.T in `dtype`: one program (eagerly, transposing and converting are two)."""
  return x.T.astype(dtype)


def dense_dot_general(matmul_precision):
  """The `dot_general` argument of nn.Dense for a matmul precision (None: jax's own, in the compute dtype)."""
  return _bfloat16_dot_general if matmul_precision == 'bfloat16' else None


# --- 3.5 Positional encoding -------------------------------------------------------------------------------

def sinusoidal_positions(max_position, d_model):
  """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d))."""
  position = np.arange(max_position)[:, None]
  div = np.exp(np.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
  table = np.zeros((max_position, d_model), np.float32)
  table[:, 0::2] = np.sin(position * div)
  table[:, 1::2] = np.cos(position * div)
  return table


# --- 5.4 Dropout (every block below uses it) ---------------------------------------------------------------

class Dropout(nn.Module):
  """Inverted dropout, as nn.Dropout: zero each element with probability `rate`, scale the rest by 1 / (1 - rate).

  The keep mask compares 16-bit random integers with rate * 2^16, two of them cut from each 32-bit random word:
  half the random-number work of nn.Dropout's one float per element. At dropout 0.3 nn.Dropout's masks were 7.5%
  of the CPU train step of configs/multi30k_best.py; these cost 5% (bench/RESULTS.md). The rate is kept to
  within 2^-17 and the scale uses the rate actually applied, so the expectation is exact. The words are drawn
  along the last axis only, so the leading (batch) axes keep their sharding.
  """
  rate: float

  @nn.compact
  def __call__(self, x, deterministic):
    if deterministic or self.rate == 0.0:
      return x
    threshold = round(self.rate * 2 ** 16)
    if threshold >= 2 ** 16:  # rate 1 (to 2^-17): everything dropped, and no division by zero
      return jnp.zeros_like(x)
    width = x.shape[-1]
    words = jax.random.bits(self.make_rng('dropout'), x.shape[:-1] + ((width + 1) // 2,), jnp.uint32)
    halves = jax.lax.bitcast_convert_type(words, jnp.uint16)  # [..., words, 2]
    halves = halves.reshape(x.shape[:-1] + (-1,))[..., :width]
    keep_probability = 1.0 - threshold / 2 ** 16
    # Scaled in float32, then rounded: 1 / keep_probability rounded to bfloat16 first would scale every kept
    # bfloat16 element 0.1-0.2% too much at rates 0.1-0.3.
    scaled = (x.astype(jnp.float32) * (1.0 / keep_probability)).astype(x.dtype)
    return jnp.where(halves >= threshold, scaled, jnp.zeros((), x.dtype))


# --- Masks -------------------------------------------------------------------------------------------------

def padding_mask(query_tokens, key_tokens):
  """[B, 1, Tq, Tk]: real queries may attend to real keys; nothing attends to or from padding."""
  return ((query_tokens != PAD_ID)[:, None, :, None] & (key_tokens != PAD_ID)[:, None, None, :])


def causal_mask(length):
  """[1, 1, T, T]: position i may attend to positions <= i."""
  return jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]


# --- 3.2 Attention -----------------------------------------------------------------------------------------

ATTENTION_IMPLEMENTATIONS = ('auto', 'xla', 'cudnn', 'einsum')


def resolve_attention_impl(name, dtype, head_dim, platform):
  """'auto' -> 'cudnn' (flash attention) on GPU in bf16/fp16 with a head size cuDNN takes, else 'xla'."""
  if name not in ATTENTION_IMPLEMENTATIONS:
    raise ConfigError(f'config.model.attention_impl must be one of {ATTENTION_IMPLEMENTATIONS}, not {name!r}')
  if name != 'auto':
    return name
  flash_ok = (platform == 'gpu' and jnp.dtype(dtype) in CUDNN_DTYPES
              and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM)
  return 'cudnn' if flash_ok else 'xla'


# What cuDNN's flash attention takes (jax's check_is_flash_attention / check_layout): half-precision inputs
# and a head dim that is a multiple of 8, at most 128 (256 on Hopper and later; 128 holds on every GPU). Its
# cuDNN version check cannot run without the CUDA plugin, so these rules are ours to check before tracing.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MAX_HEAD_DIM = 128


def check_cudnn_attention(dtype, d_model, num_heads, platform):
  """Raises ConfigError naming the config field and the rule when cuDNN flash attention cannot run this model."""
  if platform != 'gpu':
    raise ConfigError(f"config.model.attention_impl='cudnn' needs a CUDA GPU; this model is built for "
                      f"{platform!r}: use 'auto' or 'xla'")
  if jnp.dtype(dtype) not in CUDNN_DTYPES:
    raise ConfigError(f"config.model.attention_impl='cudnn' needs config.model.dtype bfloat16 or float16 (cuDNN "
                      f"flash attention takes half precision only), not {jnp.dtype(dtype).name}")
  head_dim = d_model // num_heads
  if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
    raise ConfigError(f"config.model.attention_impl='cudnn' needs a head dim (config.model.d_model / "
                      f"config.model.num_heads = {d_model} / {num_heads} = {head_dim}) that is a multiple of 8 "
                      f"and at most {CUDNN_MAX_HEAD_DIM}: use 'xla', or change d_model or num_heads")


def cudnn_lengths(mask, batch):
  """The length form cuDNN takes (int32 [batch] query and key lengths; `_lengths` keeps them at least 1), checked
  at trace time: a wrong shape would otherwise first fail inside cuDNN on the GPU."""
  lengths = []
  for name, value in (('query_lengths', mask.query_lengths), ('key_lengths', mask.key_lengths)):
    if value is None or value.shape != (batch,):
      raise ValueError(f'cuDNN attention needs {name} of shape ({batch},), got '
                       f'{None if value is None else value.shape}')
    lengths.append(value.astype(jnp.int32))
  return lengths


def scaled_dot_product_attention(q, k, v, mask, dropout=None, kv_head_major=False):
  """softmax(Q K^T / sqrt(d_k)) V over [B, T, H, D] arrays; returns (output [B, Tq, H, D], weights [B, H, Tq, Tk]).
  kv_head_major: k and v are [B, H, Tk, D] (the decoding caches' layout).

  The explicit path: it materializes the float32 weights (attention pictures, attention dropout, decoding).
  """
  kv = 'bhkd' if kv_head_major else 'bkhd'
  # Scaled in float32, after the product: dividing bfloat16 queries first would round them a second time.
  scores = jnp.einsum(f'bqhd,{kv}->bhqk', q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  # A select, not an added large negative: adding overflows to NaN in half precision. A fully masked row
  # (a padding query) gets uniform weights: finite, and the loss ignores it.
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if dropout is not None:
    weights = dropout(weights)
  # Heads-first, then transposed: XLA's CPU backend runs 'bhqk,bhkd->bqhd' as a slow batched product (1.2 ms
  # against 0.12 ms for a decoding step's encoder-decoder attention of 256 sentences x 4 beams).
  out = jnp.swapaxes(jnp.einsum(f'bhqk,{kv}->bhqd', weights.astype(v.dtype), v), 1, 2)
  return out, weights


@struct.dataclass
class AttentionMask:
  """Who may attend to whom, in two forms: `mask`, boolean [B or 1, 1, Tq, Tk] (True = may attend), used by
  the XLA and einsum paths; and, for right-padded rows without packing, the per-row lengths plus a causal
  flag, which let cuDNN's flash attention skip padding and the future instead of reading a dense mask."""
  mask: jax.Array
  query_lengths: jax.Array | None = None
  key_lengths: jax.Array | None = None
  causal: bool = struct.field(pytree_node=False, default=False)


def fused_attention(q, k, v, mask, impl):
  """softmax(Q K^T / sqrt(d_k)) V through jax.nn.dot_product_attention (no weights materialized on cuDNN).

  Logits and softmax are float32 inside both implementations; a fully masked query row gives a finite
  output (XLA: uniform weights over a large negative; cuDNN: rows past their length are not attended).
  """
  if impl == 'cudnn':
    if mask.query_lengths is not None:
      query_lengths, key_lengths = cudnn_lengths(mask, q.shape[0])
      return jax.nn.dot_product_attention(
          q, k, v, is_causal=mask.causal, query_seq_lengths=query_lengths,
          key_value_seq_lengths=key_lengths, implementation='cudnn')
    # Packed rows and one-position decoding steps only have the dense mask form, which cuDNN would take as
    # a materialized bias under extra shape limits: XLA computes those.
    impl = 'xla'
  return jax.nn.dot_product_attention(q, k, v, mask=mask.mask, implementation=impl)


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

  Self-attention projects Q, K and V with one fused [d, 3d] matmul (`qkv`); encoder-decoder attention
  projects Q from the decoder (`query`) and K, V from the encoder output with one fused [d, 2d] matmul
  (`kv`), computed once per sentence when decoding.
  """
  num_heads: int
  d_model: int
  attention_dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  is_self_attention: bool = True
  attention_impl: str = 'xla'  # resolved: 'xla', 'cudnn' or 'einsum'
  matmul_precision: str = 'float32'

  def setup(self):
    if self.d_model % self.num_heads:
      raise ValueError(f'd_model {self.d_model} is not divisible by num_heads {self.num_heads}')
    # No biases in the projections, as in the authors' tensor2tensor code. Parameters stay float32
    # (param_dtype); the matmuls run in `dtype`.
    dense = functools.partial(nn.Dense, use_bias=False, kernel_init=xavier_uniform, dtype=self.dtype,
                              dot_general=dense_dot_general(self.matmul_precision))
    if self.is_self_attention:
      self.qkv = dense(3 * self.d_model)
    else:
      self.query = dense(self.d_model)
      self.kv = dense(2 * self.d_model)
    self.output = dense(self.d_model)
    self.attention_dropout = Dropout(self.attention_dropout_rate)

  def _split_heads(self, x, parts):
    """[B, T, parts * d] -> `parts` arrays [B, T, H, D]."""
    x = x.reshape(x.shape[:-1] + (parts, self.num_heads, self.d_model // self.num_heads))
    return [x[..., i, :, :] for i in range(parts)]

  def project_qkv(self, inputs):
    """Self-attention queries, keys and values [B, T, H, D] of `inputs`, from one fused matmul."""
    return self._split_heads(self.qkv(inputs), 3)

  def project_kv(self, kv_inputs):
    """Encoder-decoder keys and values [B, Tk, H, D] of `kv_inputs` (computed once per sentence)."""
    return tuple(self._split_heads(self.kv(kv_inputs), 2))

  def project_q(self, q_inputs):
    return self._split_heads(self.query(q_inputs), 1)[0]

  def attend(self, q, k, v, mask, deterministic, kv_head_major=False):
    """Attention of projected queries q [B, Tq, H, D] over keys k / values v ([B, Tk, H, D], or [B, H, Tk, D]
    with kv_head_major: the decoding caches), then the output projection.

    The explicit einsum path runs when asked for, for head-major caches (one query per step: nothing for a
    fused kernel to save), when attention dropout is active (the fused kernels have none), and whenever
    'intermediates' is mutable, where it sows the float32 weights [B, H, Tq, Tk] as `attention_weights` for
    attention pictures.
    """
    dropout_active = self.attention_dropout_rate > 0 and not deterministic
    if (kv_head_major or self.attention_impl == 'einsum' or dropout_active
        or self.is_mutable_collection('intermediates')):
      dropout = functools.partial(self.attention_dropout, deterministic=False) if dropout_active else None
      out, weights = scaled_dot_product_attention(q, k, v, mask.mask, dropout, kv_head_major)
      self.sow('intermediates', 'attention_weights', weights)
    else:
      out = fused_attention(q, k, v, mask, self.attention_impl)
    return self.output(out.reshape(out.shape[:-2] + (self.d_model,)))

  def __call__(self, q_inputs, kv_inputs, mask, deterministic=True):
    if self.is_self_attention:
      q, k, v = self.project_qkv(q_inputs)
    else:
      q, (k, v) = self.project_q(q_inputs), self.project_kv(kv_inputs)
    return self.attend(q, k, v, mask, deterministic)


# --- 3.3 Feed-forward --------------------------------------------------------------------------------------

class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2."""
  d_model: int
  d_ff: int
  relu_dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  matmul_precision: str = 'float32'

  @nn.compact
  def __call__(self, x, deterministic=True):
    dense = functools.partial(nn.Dense, kernel_init=xavier_uniform, dtype=self.dtype,
                              dot_general=dense_dot_general(self.matmul_precision))
    x = nn.relu(dense(self.d_ff, name='wi')(x))
    x = Dropout(self.relu_dropout_rate)(x, deterministic)
    return dense(self.d_model, name='wo')(x)


# --- 3.1 Encoder and decoder stacks ------------------------------------------------------------------------

class SublayerConnection(nn.Module):
  """Post-LN: LayerNorm(x + Dropout(f(x))). Pre-LN: x + Dropout(f(LayerNorm(x))).

  The residual stream is in the compute dtype; LayerNorm normalizes in float32 and casts back.
  """
  dropout_rate: float
  pre_layer_norm: bool
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.norm = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32)
    self.dropout = Dropout(self.dropout_rate)

  def __call__(self, x, sublayer, deterministic):
    norm = lambda z: self.norm(z).astype(self.dtype)
    if self.pre_layer_norm:
      return x + self.dropout(sublayer(norm(x)), deterministic=deterministic)
    return norm(x + self.dropout(sublayer(x), deterministic=deterministic))


class EncoderLayer(nn.Module):
  config: ModelConfig
  dtype: jnp.dtype
  attention_impl: str

  def setup(self):
    c = self.config
    sublayer = functools.partial(SublayerConnection, c.dropout_rate, c.pre_layer_norm, self.dtype)
    self.self_attention = MultiHeadAttention(c.num_heads, c.d_model, c.attention_dropout_rate, self.dtype,
                                             is_self_attention=True, attention_impl=self.attention_impl,
                                             matmul_precision=c.matmul_precision)
    self.feed_forward = FeedForward(c.d_model, c.d_ff, c.relu_dropout_rate, self.dtype, c.matmul_precision)
    self.attention_block, self.feed_forward_block = sublayer(), sublayer()

  def __call__(self, x, mask, deterministic):
    x = self.attention_block(x, lambda y: self.self_attention(y, y, mask, deterministic), deterministic)
    return self.feed_forward_block(x, lambda y: self.feed_forward(y, deterministic), deterministic)


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, feed-forward. Without `has_cross_attention` it is the
  layer of a decoder-only language model (GPT): the same self-attention and feed-forward sub-layers only."""
  config: ModelConfig
  dtype: jnp.dtype
  attention_impl: str
  has_cross_attention: bool = True

  def setup(self):
    c = self.config
    sublayer = functools.partial(SublayerConnection, c.dropout_rate, c.pre_layer_norm, self.dtype)
    attention = functools.partial(MultiHeadAttention, c.num_heads, c.d_model, c.attention_dropout_rate, self.dtype,
                                  attention_impl=self.attention_impl, matmul_precision=c.matmul_precision)
    self.self_attention = attention(is_self_attention=True)
    if self.has_cross_attention:
      self.cross_attention = attention(is_self_attention=False)
      self.cross_block = sublayer()
    self.feed_forward = FeedForward(c.d_model, c.d_ff, c.relu_dropout_rate, self.dtype, c.matmul_precision)
    self.self_block, self.feed_forward_block = sublayer(), sublayer()

  def __call__(self, y, cross_kv, self_mask, cross_mask, deterministic, cache=None, index=None, slots=0):
    """One decoder layer over y [B, T, d]. With `cache` (head-major keys/values [B, H, L, D] of earlier
    positions, or with slots=K a beam search's [B, H, L * K, D]: TransformerStacks.init_cache), y holds the
    single position `index` and cross_kv is head-major too (decoding_cross_kv); returns (y, updated cache).
    cross_kv/cross_mask: None without cross-attention."""
    incremental = cache is not None

    def self_attention(z):
      nonlocal cache
      q, k, v = self.self_attention.project_qkv(z)
      if not incremental:
        return self.self_attention.attend(q, k, v, self_mask, deterministic)
      if slots:
        cache, out = self._attend_slots(cache, q, k, v, self_mask, index, slots)
        return out.reshape(z.shape)
      head_major = lambda x: jnp.swapaxes(x, 1, 2).astype(cache['k'].dtype)  # [B, 1, H, D] -> [B, H, 1, D]
      k = jax.lax.dynamic_update_slice_in_dim(cache['k'], head_major(k), index, axis=2)
      v = jax.lax.dynamic_update_slice_in_dim(cache['v'], head_major(v), index, axis=2)
      cache = {'k': k, 'v': v}
      return self.self_attention.attend(q, k, v, self_mask, deterministic, kv_head_major=True)

    def cross_attention(z):
      q = self.cross_attention.project_q(z)
      sentences = cross_kv[0].shape[0]
      if not incremental or sentences == q.shape[0]:
        return self.cross_attention.attend(q, *cross_kv, cross_mask, deterministic, kv_head_major=incremental)
      # Decoding with several rows per sentence (beams, samples; sentence-major: row b * K + k): the K rows'
      # queries attend together, as K query positions, to their sentence's one copy of the keys/values,
      # which are then read once per sentence and step instead of once per row.
      q = q.reshape((sentences, -1) + q.shape[2:])  # [B * K, 1, H, D] -> [B, K, H, D]
      out = self.cross_attention.attend(q, *cross_kv, cross_mask, deterministic, kv_head_major=True)
      return out.reshape(z.shape)

    y = self.self_block(y, self_attention, deterministic)
    if self.has_cross_attention:
      y = self.cross_block(y, cross_attention, deterministic)
    y = self.feed_forward_block(y, lambda z: self.feed_forward(z, deterministic), deterministic)
    return y, cache

  def _attend_slots(self, cache, q, k, v, mask, index, slots):
    """(cache, attention output [B, Kq, H, D]) of a step over a beam search's `slots` per position, [B, H,
    L * slots, D] (position-major): the Kq rows of each sentence (q, k, v [B * Kq, 1, H, D], sentence-major;
    Kq is `slots`, or 1 at the first step) write their keys/values to slots 0..Kq-1 of position `index`,
    then attend together, as Kq query positions, to all L x slots entries of their sentence, `mask` ([B, 1,
    Kq, L * slots]) keeping each row's own history."""
    B, H, _, D = cache['k'].shape
    to_slots = lambda x: jnp.swapaxes(x.reshape(B, -1, H, D), 1, 2).astype(cache['k'].dtype)  # [B, H, Kq, D]
    cache = {name: jax.lax.dynamic_update_slice_in_dim(cache[name], to_slots(x), index * slots, axis=2)
             for name, x in (('k', k), ('v', v))}
    out = self.self_attention.attend(q.reshape(B, -1, H, D), cache['k'], cache['v'], mask, True, kv_head_major=True)
    return cache, out


REMAT_POLICIES = {
    'none': None,
    # Keep nothing: every layer's activations are recomputed in the backward pass (least memory).
    'full': jax.checkpoint_policies.nothing_saveable,
    # Keep the projection and feed-forward matmul outputs, recompute the cheap elementwise work and the
    # attention scores (which grow with length squared).
    'dots': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _layer_classes(remat):
  """(encoder layer, decoder layer) classes, rematerialized per layer when `remat` asks for it."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f'remat must be one of {tuple(REMAT_POLICIES)}, not {remat!r}')
  if remat == 'none':
    return EncoderLayer, DecoderLayer
  policy = REMAT_POLICIES[remat]
  # static_argnums count `self` as 0: `deterministic` is a Python bool (dropout on or off).
  return (nn.remat(EncoderLayer, policy=policy, static_argnums=(3,)),
          nn.remat(DecoderLayer, policy=policy, static_argnums=(5,)))


def _same_segment(query_segments, key_segments):
  """[B, 1, Tq, Tk]: packed examples see only themselves."""
  return query_segments[:, None, :, None] == key_segments[:, None, None, :]


def _lengths(tokens):
  """Real tokens per right-padded row, at least 1: rows that only pad a batch (the last batch of a bucket, a
  host with no examples left) then attend to their first position instead of giving cuDNN an empty row,
  whose output is not specified. Their outputs are masked out of the loss either way."""
  return jnp.maximum((tokens != PAD_ID).sum(axis=-1), 1).astype(jnp.int32)


class TransformerStacks(nn.Module):
  """The blocks every model of this project is made of, as methods over linen submodules that subclasses
  create in `setup` under fixed names (so the encoder-decoder's parameter tree is what it always was):

    `shared_embedding` (embedding in, pre-softmax projection out), `encoder_{i}` (+ `encoder_norm` pre-LN),
    `decoder_{i}` (+ `decoder_norm` pre-LN), with or without encoder-decoder attention.

  Transformer = embedding + encoder stack + decoder stack with cross-attention (translation); lm.py builds
  the decoder-only language model (decoder stack without cross-attention) and the encoder-only masked
  language model (encoder stack) from the same methods.

  Packed rows (several examples per row, see packing.py) pass segments (example number per token, 0 on
  padding) and positions (position within its example): attention stays inside each example and positions
  restart with each.
  """
  config: ModelConfig

  def setup_embedding(self):
    c = self.config
    # Settled by ModelConfig for its platform, outside traced code (never jax.default_backend() here).
    self.dtype = jnp.dtype(c.dtype)
    self.attention_impl = c.attention_impl
    # Normal(0, d^-1/2): after the sqrt(d) scale the embeddings enter with unit variance, and as the
    # pre-softmax projection they give unit-scale logits.
    self.embedding = nn.Embed(c.vocab_size, c.d_model, embedding_init=nn.initializers.normal(c.d_model ** -0.5),
                              name='shared_embedding')
    self.positions = sinusoidal_positions(c.max_position, c.d_model)
    self.embedding_dropout = Dropout(c.dropout_rate)

  def setup_encoder(self):
    c = self.config
    encoder_layer, _ = _layer_classes(c.remat)
    self.encoder_layers = [encoder_layer(c, self.dtype, self.attention_impl, name=f'encoder_{i}')
                           for i in range(c.num_encoder_layers)]
    if c.pre_layer_norm:
      self.encoder_norm = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32)

  def setup_decoder(self, has_cross_attention):
    c = self.config
    _, decoder_layer = _layer_classes(c.remat)
    self.decoder_layers = [decoder_layer(c, self.dtype, self.attention_impl, has_cross_attention,
                                         name=f'decoder_{i}')
                           for i in range(c.num_decoder_layers)]
    if c.pre_layer_norm:
      self.decoder_norm = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32)

  def embed(self, tokens, positions, deterministic, word_dropout=0.0):
    """Token embeddings x sqrt(d_model) + positions, then dropout. word_dropout > 0 (training only): each
    token's embedding is zeroed with that probability (unscaled, as a blank word), its position kept."""
    x = self.embedding(tokens) * jnp.sqrt(self.config.d_model).astype(jnp.float32)
    if word_dropout > 0 and not deterministic:
      keep = jax.random.bernoulli(self.make_rng('dropout'), 1.0 - word_dropout, tokens.shape)
      x = jnp.where(keep[..., None], x, jnp.zeros((), x.dtype))
    x = x + jnp.asarray(self.positions)[positions]
    return self.embedding_dropout(x, deterministic=deterministic).astype(self.dtype)

  def encode(self, src, deterministic=True, *, src_segments=None, src_positions=None):
    """src [B, S] -> encoder output [B, S, d] (bidirectional self-attention over the non-pad tokens)."""
    if src_segments is None:
      lengths = _lengths(src)
      mask = AttentionMask(padding_mask(src, src), lengths, lengths)
    else:
      mask = AttentionMask(padding_mask(src, src) & _same_segment(src_segments, src_segments))
    positions = jnp.arange(src.shape[1])[None] if src_positions is None else src_positions
    x = self.embed(src, positions, deterministic, self.config.source_word_dropout)
    for layer in self.encoder_layers:
      x = layer(x, mask, deterministic)
    return self.encoder_norm(x).astype(self.dtype) if self.config.pre_layer_norm else x

  def vocabulary_logits(self, y):
    """Projection onto the shared embedding matrix: a compute-dtype matmul with float32 results.

    In bfloat16 it is a `bfloat16_matmul`, whose backward pass rounds the float32 gradient of the logits to
    bfloat16 for its two matmuls (as mixed-precision training does elsewhere). jax's own derivative would
    multiply that float32 gradient by the bfloat16 states and embedding: CUDA's lowering runs those two
    vocabulary-sized matmuls (about 12% of a Transformer big step's FLOPs) in float32, TPU's in several passes."""
    if self.has_variable('params', VOCABULARY_KERNEL):  # a search's parameters (with_vocabulary_kernel)
      kernel = self.get_variable('params', VOCABULARY_KERNEL)
      return jnp.dot(y.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    embedding = self.embedding.embedding
    if vocabulary_operand_dtype(self.config) == jnp.bfloat16:
      return bfloat16_matmul(y, embedding.T, jnp.float32)
    return jnp.einsum('...d,vd->...v', y.astype(self.dtype), embedding.astype(self.dtype),
                      preferred_element_type=jnp.float32)

  def final_states(self, y):
    """Decoder states as the vocabulary projection reads them: after the final LayerNorm when pre-LN."""
    return self.decoder_norm(y) if self.config.pre_layer_norm else y

  def logits(self, y):
    """Pre-softmax projection of decoder states (after the final LayerNorm when pre-LN)."""
    return self.vocabulary_logits(self.final_states(y))

  def run_decoder(self, tgt_in, deterministic, *, cross_kv=None, cross_mask=None, tgt_segments=None,
                  tgt_positions=None, project=True):
    """Teacher-forced decoder stack over tgt_in [B, T] (causal self-attention) -> logits [B, T, V], or with
    project=False the states the projection would read, [B, T, d] (for a loss that projects them itself,
    train_step.chunked_vocabulary_loss). cross_kv: every layer's encoder keys/values, or None for a decoder
    without cross-attention."""
    causal = padding_mask(tgt_in, tgt_in) & causal_mask(tgt_in.shape[1])
    if tgt_segments is None:
      self_mask = AttentionMask(causal, _lengths(tgt_in), _lengths(tgt_in), causal=True)
    else:
      self_mask = AttentionMask(causal & _same_segment(tgt_segments, tgt_segments))
    positions = jnp.arange(tgt_in.shape[1])[None] if tgt_positions is None else tgt_positions
    y = self.embed(tgt_in, positions, deterministic)
    for layer, kv in zip(self.decoder_layers, cross_kv or [None] * len(self.decoder_layers)):
      y, _ = layer(y, kv, self_mask, cross_mask, deterministic)
    return self.logits(y) if project else self.final_states(y)

  # --- Incremental decoding ---

  def init_cache(self, batch_size, max_length, beams=0):
    """Zeroed self-attention keys/values for `max_length` positions, one dict per decoder layer, head-major:
    [B, H, max_length, D] (positions on axis 2). beams > 0: a beam search's slots, [B, H, max_length * beams,
    D] for B sentences (position-major): beam k writes slot k, and decode_step's `ancestry` says which slot
    holds each beam's history at each position, so that a step reorders that small table instead of copying
    the cache."""
    c = self.config
    shape = (batch_size, c.num_heads, max_length * max(beams, 1), c.d_model // c.num_heads)
    return [{'k': jnp.zeros(shape, self.dtype), 'v': jnp.zeros(shape, self.dtype)}
            for _ in range(c.num_decoder_layers)]

  def decode_step(self, tokens, index, cache, cross_kv=None, src=None, ancestry=None):
    """tokens [N] at position `index` -> (logits [N, V], cache with this position's keys/values).
    cross_kv (from decoding_cross_kv) and src [B, S] (for its padding): the encoder's, or None for a decoder
    without cross-attention. B may divide N: rows b * N/B .. (b + 1) * N/B - 1 (a sentence's beams or samples)
    then share sentence b's keys/values. With a cache of beam slots (init_cache's `beams`), ancestry
    [B, N/B, L] int: the slot that holds row b * N/B + k's history at each position (its own at `index`)."""
    max_length = cache[0]['k'].shape[2] if ancestry is None else ancestry.shape[-1]
    slots = 0 if ancestry is None else cache[0]['k'].shape[2] // max_length
    # The query may see cached positions 0..index, never the unwritten slots after it. One query per row:
    # the dense masks (XLA path), not cuDNN's length form.
    seen = jnp.arange(max_length) <= index
    if ancestry is None:
      self_mask = AttentionMask(seen[None, None, None, :])
    else:  # [B, 1, rows, L * slots]: a row sees position t in the slot its history holds it in
      mask = (ancestry[:, :, :, None] == jnp.arange(slots)) & seen[:, None]
      self_mask = AttentionMask(mask.reshape(mask.shape[0], 1, mask.shape[1], -1))
    cross_mask = None if src is None else AttentionMask((src != PAD_ID)[:, None, None, :])
    y = self.embed(tokens[:, None], jnp.full((1, 1), index), deterministic=True)
    new_cache = []
    for layer, kv, layer_cache in zip(self.decoder_layers, cross_kv or [None] * len(cache), cache):
      y, layer_cache = layer(y, kv, self_mask, cross_mask, True, cache=layer_cache, index=index, slots=slots)
      new_cache.append(layer_cache)
    return self.logits(y)[:, 0], new_cache


class Transformer(TransformerStacks):
  """Encoder-decoder with one embedding shared by source, target and the output projection."""

  def setup(self):
    self.setup_embedding()
    self.setup_encoder()
    self.setup_decoder(has_cross_attention=True)

  def cross_attention_kv(self, encoded):
    """Every decoder layer's encoder-decoder attention keys and values, computed once per sentence."""
    return [layer.cross_attention.project_kv(encoded) for layer in self.decoder_layers]

  def decoding_cross_kv(self, encoded):
    """cross_attention_kv head-major ([B, H, S, D] keys and values), as decode_step reads them: transposed
    once per sentence, not at every step."""
    return [tuple(jnp.swapaxes(x, 1, 2) for x in kv) for kv in self.cross_attention_kv(encoded)]

  def decode(self, tgt_in, encoded, src, deterministic=True, *, src_segments=None, tgt_segments=None,
             tgt_positions=None, project=True):
    """Teacher-forced decoder: tgt_in [B, T] (BOS + target) -> logits [B, T, V] (project=False: the states
    [B, T, d] they are projected from)."""
    cross = padding_mask(tgt_in, src)
    if tgt_segments is None:
      cross_mask = AttentionMask(cross, _lengths(tgt_in), _lengths(src))
    else:
      cross_mask = AttentionMask(cross & _same_segment(tgt_segments, src_segments))
    return self.run_decoder(tgt_in, deterministic, cross_kv=self.cross_attention_kv(encoded), cross_mask=cross_mask,
                            tgt_segments=tgt_segments, tgt_positions=tgt_positions, project=project)

  def __call__(self, src, tgt_in, deterministic=True, *, src_segments=None, tgt_segments=None,
               src_positions=None, tgt_positions=None, project=True):
    if (src_segments is None) != (tgt_segments is None):
      raise ValueError('packed batches need both src_segments and tgt_segments')
    encoded = self.encode(src, deterministic, src_segments=src_segments, src_positions=src_positions)
    return self.decode(tgt_in, encoded, src, deterministic, src_segments=src_segments, tgt_segments=tgt_segments,
                       tgt_positions=tgt_positions, project=project)


def count_params(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
