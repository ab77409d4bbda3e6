"""The accelerator paths, lowered for CUDA and TPU on a CPU-only machine, without compute.

JAX lowers a jitted function for platforms this machine lacks (`.trace(...).lower(lowering_platforms=...)`)
from abstract inputs (`jax.eval_shape`, `jax.ShapeDtypeStruct`) and an `AbstractMesh` of devices that do not
exist. So CI traces what a GPU or TPU user would run, with the configs they would run: the train step of
configs/base.py and configs/big.py in bfloat16 (model.dtype 'auto' settled for the target platform) on a
data 4 x fsdp 2 mesh, with and without rematerialization and gradient accumulation, the train steps of the
decoder-only LM and the MLM (configs/lm_multi30k.py, configs/mlm_multi30k.py), several steps in one call
(config.steps_per_dispatch), and the beam-search and greedy decode loops. The StableHLO is then read for what
must be there: bfloat16 matmuls, cuDNN flash attention on CUDA (and only there), the mesh and the FSDP layout,
the remat barriers, the accumulation loop.

cuDNN's attention asks the CUDA plugin for the cuDNN version and the GPU generation before it lowers; without
the plugin that check raises "cuDNN is not detected". `cudnn_version_check_answered` answers it (cuDNN 9.10 on
Hopper) so that the lowering itself runs; what cuDNN accepts is our own check (model.check_cudnn_attention,
tests/test_model.py) and the real call is run on a GPU (bench/RESULTS.md lists the commands).

The lowerings of base and big cost tens of seconds each on a 2-core machine: base's plain step and the decode
loops run by default, the rest with -m slow.
"""
import collections
import contextlib
import functools
import importlib.util
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo

from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.training import step as train_step
from flaxformer_nmt.decoding import search as search_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLATFORMS = ('cuda', 'tpu')
# data 4 x fsdp 2: eight devices that need not exist. Auto axes, as sharding.make_mesh's Mesh has (AbstractMesh
# defaults to Explicit axes from jax 0.12 on, where linen's embedding gather would need an out_sharding).
MESH = jax.sharding.AbstractMesh((4, 2), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
ROWS, LENGTH = 64, 32  # a batch of 64 rows of 32 tokens a side, split over the 8 devices


def load_config(name, **overrides):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for field, value in overrides.items():
    target, key = (config.model, field[len('model.'):]) if field.startswith('model.') else (config, field)
    target[key] = value
  return config


@contextlib.contextmanager
def cudnn_version_check_answered():
  """Lets jax lower cuDNN flash attention without the CUDA plugin: its version and compute-capability queries
  answer cuDNN 9.10 on Hopper. Shapes, dtypes and layouts still go through jax's own checks."""
  with mock.patch.object(fused_attention_stablehlo, 'check_cudnn_version', return_value=91000), \
       mock.patch.object(fused_attention_stablehlo, 'check_compute_capability', return_value=True):
    yield


def abstract_like(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@functools.lru_cache(maxsize=None)  # each lowering once per session, shared by the tests that read it
def lowered_train_step(name, platform, remat='none', accumulation=1, attention='auto', on_mesh=True, steps=1,
                       **overrides):
  """(ModelConfig, StableHLO text) of the jitted train step of configs/NAME.py, built for `platform` and
  lowered for it: on MESH, or (on_mesh=False) on this machine's first device standing in for one GPU or TPU;
  steps > 1: that many steps in one call (TrainStep.many), their batches stacked."""
  mesh = MESH if on_mesh else sharding.make_mesh(devices=jax.devices()[:1])
  config = load_config(name, **{'model.remat': remat, 'model.attention_impl': attention,
                                'grad_accumulation_steps': accumulation,
                                'data_parallelism': mesh.shape['data'], 'fsdp_parallelism': mesh.shape['fsdp'],
                                **overrides})
  task = lm.task_of(config)
  model = lm.build(task, model_lib.ModelConfig.from_config(config, config.vocab_size, platform,
                                                           architecture=lm.ARCHITECTURES[task]), mask_id=4)
  optimizer, _ = train_step.make_optimizer(config)
  abstract_mesh = jax.sharding.use_abstract_mesh(MESH) if on_mesh else contextlib.nullcontext()
  with abstract_mesh, cudnn_version_check_answered():
    abstract = jax.eval_shape(functools.partial(train_step.init_state, model, optimizer, config.seed))
    shardings = sharding.state_shardings(abstract, mesh)
    train_fn, _ = train_step.jit_steps(model, config, mesh, shardings)
    if steps == 1:
      batch = {key: jax.ShapeDtypeStruct((ROWS, LENGTH), jnp.int32, sharding=sharding.batch_sharded(mesh))
               for key in ('src', 'tgt_in', 'tgt_out')}
      traced = train_fn.trace(abstract_like(abstract, shardings), batch)
    else:
      batches = {key: jax.ShapeDtypeStruct((steps, ROWS, LENGTH), jnp.int32,
                                           sharding=sharding.steps_batch_sharded(mesh))
                 for key in ('src', 'tgt_in', 'tgt_out')}
      traced = train_fn.trace_many(abstract_like(abstract, shardings), batches)
    lowered = traced.lower(lowering_platforms=(platform,))
  return model.config, lowered.as_text()


def dot_operand_dtypes(text):
  """Counter of the operand element types of every stablehlo.dot_general, e.g. {('bf16', 'bf16'): 300}."""
  counts = collections.Counter()
  for line in text.splitlines():
    if 'stablehlo.dot_general' in line:
      operands = line.rsplit(': (', 1)[1].split(') ->')[0]
      counts[tuple(re.findall(r'tensor<(?:\d+x)*(\w+)>', operands))] += 1
  return counts


def dense_matmuls(model_config):
  """Weight matmuls of one forward pass, counted from the architecture: per encoder layer the fused QKV,
  the output projection and the two feed-forward layers; per decoder layer self QKV and output, cross Q,
  fused KV and output, and the two feed-forward layers (the LM's decoder layers have no cross-attention:
  4); the MLM's prediction-head dense layer; and the pre-softmax projection."""
  architecture = model_config.architecture
  per_decoder_layer = 4 if architecture == 'decoder_only' else 7
  head = 1 if architecture == 'encoder_only' else 0
  return 4 * model_config.num_encoder_layers + per_decoder_layer * model_config.num_decoder_layers + head + 1


def custom_calls(text, target):
  return len(re.findall(r'custom_call @' + re.escape(target) + r'\b', text))


def check_bfloat16_matmuls(model_config, text, passes):
  """Every weight matmul of the forward pass (and, passes=3, both of its backward matmuls) takes bfloat16
  operands, the pre-softmax projection's too (its float32 logit gradient is rounded to bfloat16 for the two
  backward matmuls: model.bfloat16_matmul), and no dot has only float32 operands. A step that silently ran in
  float32 would have no bfloat16 dot at all."""
  dots = dot_operand_dtypes(text)
  assert dots[('bf16', 'bf16')] >= passes * dense_matmuls(model_config), dots
  # (float32 attention weights times bfloat16 values, and their gradients, are mixed: softmax stays float32.)
  assert sum(count for operands, count in dots.items() if 'bf16' not in operands) == 0, dots


def check_train_step(name, platform, remat, accumulation):
  """The step on the data 4 x fsdp 2 mesh, with XLA attention: jax's cuDNN attention is a custom-partitioned
  call, which needs real devices to lower on a mesh (check_cudnn_train_step covers it on one device)."""
  model_config, text = lowered_train_step(name, platform, remat, accumulation, attention='xla')
  assert model_config.platform == ('gpu' if platform == 'cuda' else platform)
  assert model_config.dtype == 'bfloat16'  # the configs say 'auto'
  check_bfloat16_matmuls(model_config, text, passes=3)
  # The data 4 x fsdp 2 mesh, parameters split over 'fsdp', batch rows over both axes.
  assert re.search(r'num_partitions = 8\b', text)
  assert re.search(r'"data"\s*=\s*4, "fsdp"\s*=\s*2', text)
  assert '[{"fsdp"}, {}]' in text or '[{}, {"fsdp"}]' in text
  assert '[{"data", "fsdp"}, {}]' in text
  # Remat: jax.checkpoint keeps its saved values behind optimization barriers; no remat, no barrier.
  assert ('stablehlo.optimization_barrier' in text) == (remat != 'none')
  # Accumulation is a lax.scan over the microbatches, the only loop in the step.
  assert ('stablehlo.while' in text) == (accumulation > 1)
  assert 'cudnn' not in text


def check_cudnn_train_step(name, remat):
  """The step as one GPU runs it by default ('auto' in bf16 with 64-wide heads = cuDNN flash attention): in
  every encoder self-attention, decoder self-attention and encoder-decoder attention, forward and backward."""
  model_config, text = lowered_train_step(name, 'cuda', remat, on_mesh=False)
  assert (model_config.dtype, model_config.attention_impl) == ('bfloat16', 'cudnn')
  check_bfloat16_matmuls(model_config, text, passes=3)
  layers = model_config.num_encoder_layers + 2 * model_config.num_decoder_layers
  forward, backward = custom_calls(text, '__cudnn$fmhaSoftmax'), custom_calls(text, '__cudnn$fmhaSoftmaxBackward')
  assert backward == layers
  # With remat the forward is run again inside the backward pass.
  assert forward == layers if remat == 'none' else forward >= 2 * layers


@pytest.mark.parametrize('platform', PLATFORMS)
def test_base_train_step_lowers_in_bfloat16_on_data_and_fsdp_mesh(platform):
  check_train_step('base', platform, remat='none', accumulation=1)


def test_base_train_step_lowers_with_cudnn_attention_for_cuda():
  check_cudnn_train_step('base', remat='none')


def test_the_chunked_vocabulary_loss_lowers_in_bfloat16_on_data_and_fsdp_mesh():
  """config.vocabulary_loss_chunk_tokens on the GPU path: the projection and its two gradient matmuls, now
  inside the chunks' loop, still take bfloat16 operands (the logit gradient rounded), on the data x fsdp mesh."""
  model_config, text = lowered_train_step('base', 'cuda', attention='xla', vocabulary_loss_chunk_tokens=4096)
  assert model_config.dtype == 'bfloat16'
  check_bfloat16_matmuls(model_config, text, passes=3)
  assert 'stablehlo.while' in text  # the chunks' lax.scan (no accumulation here)
  assert '[{"data", "fsdp"}, {}]' in text


@pytest.mark.parametrize('platform', PLATFORMS)
def test_several_train_steps_in_one_call_lower_in_bfloat16_on_data_and_fsdp_mesh(platform):
  """config.steps_per_dispatch as a GPU or TPU would run the recipe's small model (configs/multi30k.py): one loop
  (lax.scan) around the whole step with its bfloat16 matmuls; the stacked batches split by rows over both
  axes, not by step."""
  model_config, text = lowered_train_step('multi30k', platform, attention='xla', steps=4)
  assert model_config.dtype == 'bfloat16'
  check_bfloat16_matmuls(model_config, text, passes=3)
  assert text.count('stablehlo.while') == 1
  assert '[{}, {"data", "fsdp"}, {}]' in text


@pytest.mark.parametrize('name', ['lm_multi30k', 'mlm_multi30k'])
def test_language_model_train_steps_lower_in_bfloat16_on_data_and_fsdp_mesh(name):
  # The decoder-only LM and the MLM (BERT's masking inside the step) on the GPU path users would run.
  check_train_step(name, 'cuda', remat='none', accumulation=1)


@pytest.mark.slow
@pytest.mark.parametrize('platform', PLATFORMS)
@pytest.mark.parametrize('name, remat, accumulation', [
    ('base', 'full', 2), ('base', 'dots', 1), ('big', 'none', 1), ('big', 'full', 2)])
def test_train_step_lowers_with_remat_and_accumulation(name, remat, accumulation, platform):
  check_train_step(name, platform, remat, accumulation)


@pytest.mark.slow
@pytest.mark.parametrize('name, remat', [('base', 'full'), ('big', 'none'), ('big', 'dots')])
def test_train_step_lowers_with_cudnn_attention_and_remat(name, remat):
  check_cudnn_train_step(name, remat)


@functools.lru_cache(maxsize=None)
def lowered_search(platform, beam_size):
  """(ModelConfig, StableHLO text) of search_lib.search on configs/base.py's model built for `platform`."""
  config = load_config('base')
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(config, config.vocab_size, platform))
  dummy = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  src = jax.ShapeDtypeStruct((16, LENGTH), jnp.int32)
  search = jax.jit(functools.partial(search_lib.search, model, beam_size=beam_size, alpha=config.length_penalty_alpha,
                                     extra_length=config.max_decode_extra_length))
  with cudnn_version_check_answered():
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), dummy, dummy)['params']
    lowered = search.trace(params, src).lower(lowering_platforms=(platform,))
  return model.config, lowered.as_text()


@pytest.mark.parametrize('platform', PLATFORMS)
@pytest.mark.parametrize('beam_size', [4, 0], ids=['beam4', 'greedy'])
def test_decode_loops_lower_in_bfloat16(platform, beam_size):
  model_config, text = lowered_search(platform, beam_size)
  assert model_config.dtype == 'bfloat16'
  assert 'stablehlo.while' in text  # the decoding loop stays a device loop
  check_bfloat16_matmuls(model_config, text, passes=1)
  # The encoder's self-attention goes through cuDNN on CUDA; decoding steps (one query against a dense cache
  # mask) through XLA.
  expected = model_config.num_encoder_layers if platform == 'cuda' else 0
  assert custom_calls(text, '__cudnn$fmhaSoftmax') == expected


@pytest.mark.parametrize('platform', PLATFORMS)
def test_the_device_search_of_a_ladder_batch_is_one_program_without_the_host(platform):
  # On GPU and TPU a batch of the ladder's top rung searches in one program (batch_search._on_device): one
  # device loop per cache length, the cache growing between them inside the program, and nothing that calls
  # back to the host. Catches a device path that falls back to host segments or a host callback.
  from flaxformer_nmt.decoding import batch_search  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.decoding.ladder import Ladder  # pylint: disable=g-import-not-at-top
  config = load_config('base', **{'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1})
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(config, config.vocab_size, platform))
  ladder = Ladder(config.decode_tokens_per_batch, model.config.max_position)
  rows = ladder.rows(LENGTH)[0]
  top = ladder.length_for(search_lib.max_steps(LENGTH, 1.0, config.max_decode_extra_length, ladder.max_position))
  cache_lengths = tuple(c for c in ladder.lengths if LENGTH <= c <= top)
  assert cache_lengths == (32, 64, 128)  # a 32-token source may get 32 + 50 tokens
  dummy = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  options = dict(beam_size=4, cache_cross_kv=True, min_len=1, scores=True, temperature=1.0, top_k=0, grow_cache=True,
                 num_samples=0)
  with cudnn_version_check_answered():
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), dummy, dummy)['params']
    lowered = batch_search._on_device_jit().jitted.trace(
        model, params, jax.ShapeDtypeStruct((rows, LENGTH), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32), 0,
        0.6, np.float32(1.0), np.int32(config.max_decode_extra_length), cache_lengths=cache_lengths,
        **options).lower(lowering_platforms=(platform,))
  text = lowered.as_text()
  assert text.count('stablehlo.while') == len(cache_lengths)
  assert 'callback' not in text


def test_lowering_follows_the_model_platform_not_this_machine():
  # The same config built for CPU (this machine's 'auto') lowers in float32: the bf16 counts above come from
  # the platform the model was built for.
  config = load_config('base', **{'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1})
  model = model_lib.Transformer(model_lib.ModelConfig.from_config(config, config.vocab_size, 'cpu'))
  dummy = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), dummy, dummy)['params']
  text = jax.jit(model.apply).trace({'params': params}, dummy, dummy).lower(lowering_platforms=('tpu',)).as_text()
  dots = dot_operand_dtypes(text)
  assert dots[('bf16', 'bf16')] == 0 and dots[('f32', 'f32')] >= dense_matmuls(model.config), dots
