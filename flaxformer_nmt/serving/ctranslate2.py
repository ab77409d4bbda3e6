"""A trained workdir as a CTranslate2 model: the parameters mapped onto ctranslate2.specs.TransformerSpec (post-
or pre-LN, the paper's interleaved sinusoids stored as the position table, one shared embedding), the
vocabulary, and a README with the command that decodes it."""
import shutil

import ml_dtypes
import numpy as np
from etils import epath

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import loader
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib

FORMATS = ('ctranslate2',)
QUANTIZATIONS = ('int8', 'int8_float32', 'int8_float16', 'int8_bfloat16', 'int16', 'float16', 'bfloat16',
                 'float32')
LAYER_NORM_EPSILON = 1e-5  # model.SublayerConnection and the final norms of pre-LN
# CTranslate2's converter casts to bfloat16 through torch: these are quantized as their float32 counterpart, then
# cast here (optimize).
BFLOAT16_OF = {'bfloat16': 'float32', 'int8_bfloat16': 'int8_float32'}


class ExportError(ValueError):
  """A workdir or option that cannot be exported."""


def _import_ctranslate2():
  try:
    import ctranslate2  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ExportError('ctranslate2 is not installed: pip install -e ".[serve]"') from None
  return ctranslate2


def _linear(spec, dense):
  """A Flax Dense ({'kernel': [in, out], 'bias'?}) into a CTranslate2 LinearSpec (weight [out, in])."""
  spec.weight = np.array(np.asarray(dense['kernel'], np.float32).T, order='C')
  if 'bias' in dense:
    spec.bias = np.array(dense['bias'], np.float32)


def _layer_norm(spec, norm):
  spec.gamma = np.array(norm['scale'], np.float32)
  spec.beta = np.array(norm['bias'], np.float32)


def _feed_forward(spec, feed_forward, norm):
  _layer_norm(spec.layer_norm, norm)
  _linear(spec.linear_0, feed_forward['wi'])
  _linear(spec.linear_1, feed_forward['wo'])


def _self_attention(spec, attention, norm):
  # Our qkv output splits as [3, heads, head_dim] (model.MultiHeadAttention._split_heads): the rows of the
  # transposed kernel are Q, K, V one after the other, heads within each, which is CTranslate2's fused order.
  _layer_norm(spec.layer_norm, norm)
  _linear(spec.linear[0], attention['qkv'])
  _linear(spec.linear[1], attention['output'])


def _cross_attention(spec, attention, norm):
  _layer_norm(spec.layer_norm, norm)
  _linear(spec.linear[0], attention['query'])
  _linear(spec.linear[1], attention['kv'])  # [2, heads, head_dim]: K rows then V rows, as CTranslate2's
  _linear(spec.linear[2], attention['output'])


def ctranslate2_spec(params, model_config, pieces):
  """A ctranslate2.specs.TransformerSpec holding `params` (our parameter tree) for `model_config`
  (model.ModelConfig), with the vocabulary `pieces` (sentencepiece pieces in id order)."""
  ctranslate2 = _import_ctranslate2()
  c = model_config
  if len(pieces) != c.vocab_size:
    raise ExportError(f'the vocabulary has {len(pieces)} pieces but the model {c.vocab_size} embeddings')
  spec = ctranslate2.specs.TransformerSpec.from_config(
      (c.num_encoder_layers, c.num_decoder_layers), c.num_heads, pre_norm=c.pre_layer_norm)
  embedding = np.array(params['shared_embedding']['embedding'], np.float32)
  positions = model_lib.sinusoidal_positions(c.max_position, c.d_model)
  # The same arrays in all three places: CTranslate2 stores them once (it aliases equal variables).
  for stack in (spec.encoder, spec.decoder):
    embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
    embeddings.weight = embedding
    stack.scale_embeddings = True  # x sqrt(d_model), as model.Transformer.embed
    stack.position_encodings.encodings = positions  # row i is position i (0-based), as ours
  spec.decoder.projection.weight = embedding  # logits = y E^T: no bias, no scale
  for i, layer in enumerate(spec.encoder.layer):
    ours = params[f'encoder_{i}']
    _self_attention(layer.self_attention, ours['self_attention'], ours['attention_block']['norm'])
    _feed_forward(layer.ffn, ours['feed_forward'], ours['feed_forward_block']['norm'])
  for i, layer in enumerate(spec.decoder.layer):
    ours = params[f'decoder_{i}']
    _self_attention(layer.self_attention, ours['self_attention'], ours['self_block']['norm'])
    _cross_attention(layer.attention, ours['cross_attention'], ours['cross_block']['norm'])
    _feed_forward(layer.ffn, ours['feed_forward'], ours['feed_forward_block']['norm'])
  if c.pre_layer_norm:
    _layer_norm(spec.encoder.layer_norm, params['encoder_norm'])
    _layer_norm(spec.decoder.layer_norm, params['decoder_norm'])
  spec.register_source_vocabulary(list(pieces))
  spec.register_target_vocabulary(list(pieces))
  spec.config.unk_token = pieces[tokenizer_lib.UNK_ID]
  spec.config.bos_token = pieces[tokenizer_lib.BOS_ID]
  spec.config.eos_token = pieces[tokenizer_lib.EOS_ID]
  spec.config.decoder_start_token = spec.config.bos_token  # our first decoder input is <s>
  spec.config.add_source_eos = True  # our sources end with </s> (tokenizer.Tokenizer.encode)
  spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
  return spec


README_TEMPLATE = """\
# CTranslate2 export of {workdir}

Exported by `python -m flaxformer_nmt.export` from {checkpoint} of `{workdir}` ({direction},
{layers}, weights {quantization}). `vocab.model` is the sentencepiece model the pieces come from.

Translate (`pip install "ctranslate2>=4.5,<5" sentencepiece`):

```python
import ctranslate2
import sentencepiece as spm

sp = spm.SentencePieceProcessor(model_file='{output_dir}/vocab.model')
translator = ctranslate2.Translator('{output_dir}', device='cpu', inter_threads=1, intra_threads=2)
sentences = ['A man is running.']
pieces = sp.encode([{prepare} for s in sentences], out_type=str)  # </s> is appended by the model
# Our length penalty ((5 + n) / 6)^{alpha} is CTranslate2's n^length_penalty with the same slope where
# length_penalty = {alpha} * (m + 1) / (m + 6) for a sentence of m pieces (a call a sentence here; batch the
# sentences that share a value).
results = [translator.translate_batch([p], beam_size={beam_size}, max_decoding_length=256,
                                      length_penalty=round({alpha} * (len(p) + 1) / (len(p) + 6), 2),
                                      suppress_sequences=[['<pad>'], ['<s>']])[0] for p in pieces]
print([sp.decode(r.hypotheses[0]) for r in results])
```

`suppress_sequences` forbids the two tokens our decoder never emits (padding and <s>). `beam_size=1` is
greedy search and gives the same tokens as `flaxformer_nmt.decode --greedy` (float32).
Beam search differs from `flaxformer_nmt.decode` in its length normalization: CTranslate2 divides a
hypothesis's log probability by length^length_penalty, this project by ((5 + length) / 6)^alpha (GNMT).
The two agree in slope at a sentence's expected length with length_penalty = alpha * (m + 1) / (m + 6) for a
source of m pieces (as above): on Multi30k test2016 99% of beam outputs are then identical, 89% with
`length_penalty={alpha}`.
Our decoder also stops every sentence at (source length + {extra}) tokens: CTranslate2's
`max_decoding_length` is one limit for the batch. Load with `compute_type='int8'` (or export with
`--quantization int8`) for the faster 8-bit model.
"""


def write_readme(output_dir, *, workdir, checkpoint, config, quantization, directory=None):
  """The export's README.md, naming output_dir, written into `directory` (default: output_dir)."""
  c = config.model
  text = README_TEMPLATE.format(
      workdir=workdir, checkpoint=checkpoint, direction=f'{config.source_lang}->{config.target_lang}',
      layers=f'{c.num_encoder_layers}+{c.num_decoder_layers} layers, d_model {c.d_model}, {c.num_heads} heads, '
             f'{"pre" if c.pre_layer_norm else "post"}-LN, {c.max_position} positions',
      quantization=quantization or 'float32', output_dir=output_dir, beam_size=config.beam_size,
      alpha=config.length_penalty_alpha, extra=config.max_decode_extra_length,
      # A model of config.lowercase learnt lowercased text: its inputs are lowercased as decode.py does.
      prepare="' '.join(s.split()).lower()" if tokenizer_lib.lowercase_of(config) else "' '.join(s.split())")
  (epath.Path(directory or output_dir) / 'README.md').write_text(text)


def length_penalty_for(alpha, source_pieces):
  """CTranslate2's length_penalty closest to our GNMT penalty ((5 + n) / 6)^alpha for a sentence of
  `source_pieces` pieces (EOS not counted): CTranslate2 divides by n^length_penalty, so the two agree in slope
  (d log penalty / dn) at n = source_pieces + 1, the translation's expected length with EOS. On Multi30k
  test2016 (beam 5, alpha 2.0) 99.1% of lines come out identical, against 89.0% with length_penalty=alpha."""
  n = source_pieces + 1
  return round(alpha * n / (n + 5), 2)


def check_exportable(workdir, config):
  """Raises ExportError for a workdir whose model the export does not take (a language model, a right-to-left
  rescorer), before any checkpoint is read."""
  task = lm.task_of(config)
  if task != 'translation':
    # CTranslate2's Translator serves encoder-decoders; our LM/MLM workdirs have no source side to map.
    raise ExportError(f'{workdir} holds a config.task={task!r} model: the export (CTranslate2 or Argos) '
                      'takes translation models only (generate with python -m flaxformer_nmt.generate, fill masks '
                      'with python -m flaxformer_nmt.fill_mask)')
  if data_lib.right_to_left(config):
    # CTranslate2 would write the target reversed, and its callers read its tokens as they come.
    raise ExportError(f'{workdir} writes its targets right to left (config.target_right_to_left): it rescores a '
                      'left-to-right model\'s n best and is not exported for serving')


def export_ctranslate2(workdir, output_dir, checkpoint=None, quantization=None, force=False):
  """Writes the CTranslate2 model of `checkpoint` of `workdir` (None: its config.decode_checkpoint) into
  `output_dir`; returns the checkpoint's description. An existing non-empty output_dir is replaced only with
  force=True."""
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ExportError(f'--quantization must be one of {QUANTIZATIONS}, not {quantization!r}')
  output_dir = epath.Path(output_dir)
  run = epath.Path(workdir).resolve()
  if output_dir.resolve() in (run, *run.parents):  # --force would delete the run before reading it
    raise ExportError(f'--output_dir {output_dir} holds the workdir {workdir}: choose another --output_dir')
  if output_dir.exists() and any(output_dir.iterdir()):
    if not force:
      raise ExportError(f'{output_dir} exists and is not empty: choose another --output_dir or pass --force')
    if not (output_dir / 'model.bin').exists():  # --force replaces an export, never other files (checkpoints/)
      raise ExportError(f'{output_dir} holds no CTranslate2 model (model.bin), so --force would delete other '
                        'files: choose another --output_dir')
  check_exportable(workdir, workdir_lib.load_config(workdir))
  loaded = loader.load_for_inference(workdir, checkpoint)
  write_model(workdir, loaded, output_dir, quantization)
  return loaded.description


def write_model(workdir, loaded, output_dir, quantization=None):
  """Writes the CTranslate2 model of `loaded` (loader.load_for_inference(workdir, ...)) into `output_dir`, which
  it replaces once the new model is written whole beside it."""
  tokenizer = loaded.tokenizer
  model_config = model_lib.ModelConfig.from_config(loaded.config, tokenizer.vocab_size)
  pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
  spec = ctranslate2_spec(jax_to_numpy(loaded.params), model_config, pieces)
  spec.validate()
  optimize(spec, quantization)
  target = epath.Path(output_dir).resolve()
  staged = target.with_name(f'.{target.name}.partial')
  staged.rmtree(missing_ok=True)  # what a killed export left
  try:
    staged.mkdir(parents=True)
    spec.save(str(staged))
    shutil.copyfile(epath.Path(workdir) / tokenizer_lib.VOCAB_FILENAME, staged / tokenizer_lib.VOCAB_FILENAME)
    write_readme(output_dir, workdir=workdir, checkpoint=loaded.description, config=loaded.config,
                 quantization=quantization, directory=staged)
  except BaseException:  # a failed write, Ctrl-C: the half-written model goes, the export before stays
    staged.rmtree(missing_ok=True)
    raise
  checkpoints_lib.replace_directory(staged, target)


def optimize(spec, quantization):
  """spec.optimize(quantization), without torch for the bfloat16 types: as CTranslate2's converter does, the
  float32 variables become bfloat16 and the int8 weights' scales stay float32."""
  spec.optimize(quantization=BFLOAT16_OF.get(quantization, quantization))
  if quantization in BFLOAT16_OF:
    for name, value in spec.variables().items():
      if isinstance(value, str) or value.is_scalar() or value.dtype != 'float32' or name.endswith('_scale'):
        continue  # an alias (the name of an equal variable), a scalar or an int8 weight's scale
      value.array = np.asarray(value.numpy(), ml_dtypes.bfloat16)


def jax_to_numpy(tree):
  """Host float32 NumPy arrays of a parameter tree (device arrays or NumPy)."""
  if isinstance(tree, dict):
    return {k: jax_to_numpy(v) for k, v in tree.items()}
  return np.array(tree, np.float32)  # a writable copy: quantization scales the arrays in place
