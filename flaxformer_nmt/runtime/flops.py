"""Model FLOPs of a training step, from the model's shape and the batch's token counts, and the peak
FLOP/s of the accelerators (for MFU, model FLOP utilization); on a CPU, a large matmul's rate measured now
stands for the peak (matmul_rate).

Counted (one multiply-add = 2 FLOPs), forward pass, d = d_model, f = d_ff, V = vocabulary, L_enc / L_dec
layers, S / T = the padded source / target row lengths the attention runs over:

  per source token:  L_enc * (2 (4 d^2 + 2 d f)      QKV, output projection, feed-forward
                              + 4 S d)               scores Q K^T and weights x V
                     + L_dec * 2 (2 d^2)             encoder-decoder keys/values, projected once
  per target token:  L_dec * (2 (6 d^2 + 2 d f)      self QKV + output, cross Q + output, feed-forward
                              + 4 T d + 4 S d)       self- and encoder-decoder attention
                     + 2 d V                         pre-softmax projection over the vocabulary

Training = 3 x forward (the backward pass costs two matmuls per forward matmul). Embedding lookups,
LayerNorm, softmax and the optimizer are left out (a few percent at most). Rematerialization's recomputation
is not model FLOPs and is not counted (MFU's convention). Only real (non-padding) tokens count, so padding
lowers MFU; attention is counted over the padded row length the kernels compute, which for packed rows is
also the length of the row, not of each example.

Decoder-only LM (config.task=lm; per token, T = row length): L_dec * (2 (4 d^2 + 2 d f) + 4 T d) + 2 d V.
Encoder-only MLM (config.task=mlm; per input token, S = row length; the head runs at every position):
L_enc * (2 (4 d^2 + 2 d f) + 4 S d) + 2 d^2 + 2 d V.

Transformer big (d 1024, f 4096, 6+6 layers, 37k vocabulary) with as many source as target tokens: about
1.28 GFLOP per target token plus attention (1.29 at 27-token sentences), next to the ~1.26 GFLOP the
paper's numbers imply (tested).
"""
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity), matched in order against
# jax.Device.device_kind; the first match wins, so more specific names come first.
PEAK_FLOPS_PER_DEVICE = (
    ('H100 PCIe', 756e12),
    # NVL (PCIe cards with an NVLink bridge): 835, half the 1,671 TFLOP/s with sparsity of NVIDIA's H100 and H200
    # datasheets (SXM: 1,979, so 989 dense); ahead of 'H100' and 'H200', which their names contain
    ('H100 NVL', 835e12),
    ('H200 NVL', 835e12),
    ('H100', 989e12),        # SXM
    ('H200', 989e12),
    ('GH200', 989e12),
    ('A100', 312e12),
    ('TPU v6 lite', 918e12),  # v6e (Trillium)
    ('TPU v6e', 918e12),
    ('TPU v5 lite', 197e12),  # v5e
    ('TPU v5e', 197e12),
    ('TPU v5p', 459e12),
    ('TPU v5', 459e12),
    ('TPU v4', 275e12),
)


def peak_flops_per_device(device_kind=None, override=0.0):
  """Peak FLOP/s of one device: `override` if > 0, else from the table; None if unknown (CPU)."""
  if override and override > 0:
    return float(override)
  if device_kind is None:
    device_kind = jax.devices()[0].device_kind
  for name, peak in PEAK_FLOPS_PER_DEVICE:
    if name.lower() in device_kind.lower():
      return peak
  return None


def forward_flops(model_config, vocab_size, source_tokens, target_tokens, src_len, tgt_len):
  """Forward-pass model FLOPs of a batch with these real token counts and padded row lengths."""
  d, f = model_config.d_model, model_config.d_ff
  enc_layers, dec_layers = model_config.num_encoder_layers, model_config.num_decoder_layers
  architecture = getattr(model_config, 'architecture', 'encoder_decoder')
  if architecture == 'decoder_only':
    # Language model: decoder layers without encoder-decoder attention, the vocabulary at every token.
    per_token = dec_layers * (2 * (4 * d * d + 2 * d * f) + 4 * tgt_len * d) + 2 * d * vocab_size
    return per_token * target_tokens
  if architecture == 'encoder_only':
    # Masked LM: encoder layers, then the head (d x d dense, vocabulary) at every input token, not only at
    # the masked ones (the model computes all of them; the loss reads the masked ones).
    per_token = enc_layers * (2 * (4 * d * d + 2 * d * f) + 4 * src_len * d) + 2 * d * d + 2 * d * vocab_size
    return per_token * source_tokens
  per_source = enc_layers * (2 * (4 * d * d + 2 * d * f) + 4 * src_len * d) + dec_layers * 2 * (2 * d * d)
  per_target = dec_layers * (2 * (6 * d * d + 2 * d * f) + 4 * tgt_len * d + 4 * src_len * d) + 2 * d * vocab_size
  return per_source * source_tokens + per_target * target_tokens


def train_flops(model_config, vocab_size, source_tokens, target_tokens, src_len, tgt_len):
  """Model FLOPs of one training step (forward + backward = 3 x forward)."""
  return 3 * forward_flops(model_config, vocab_size, source_tokens, target_tokens, src_len, tgt_len)


def matmul_rate(dtype=jnp.float32, steps=20):
  """FLOP/s of a 4096x1024x1024 matmul on the default device, measured now (a CPU's practical peak), operands in
  `dtype`, float32 accumulation and result (bfloat16: what model.matmul_precision='bfloat16' runs)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (4096, 1024), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (1024, 1024), jnp.float32).astype(dtype)
  product = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
  jax.block_until_ready(product(a, b))
  start = time.perf_counter()
  for _ in range(steps):
    out = product(a, b)
  jax.block_until_ready(out)
  return 2 * 4096 * 1024 * 1024 * steps / (time.perf_counter() - start)
