"""Attention maps of a trained model, teacher-forced on its own translations (cross- and self-attention, per
layer and head), and the heatmap pictures the visualize command writes."""
import functools
import re

import jax
import numpy as np
from etils import epath

from flaxformer_nmt.data import batching
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.tokenizer import BOS_ID
from flaxformer_nmt.models import lm


def find_attention_weights(intermediates):
  """{(stack, layer, kind): weights [B, H, Tq, Tk]} for every sown `attention_weights` in the tree, where
  stack is 'encoder' or 'decoder' (from module names `encoder_{i}` / `decoder_{i}`) and kind is
  'self_attention' or 'cross_attention'. Searched by name along each path, so extra nesting (remat, scan
  wrappers, sow's tuple) does not matter."""
  found = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
    names = [str(getattr(key, 'key', getattr(key, 'name', key))) for key in path]
    if 'attention_weights' not in names:
      continue
    layers = [m for m in map(re.compile(r'(encoder|decoder)_(\d+)').fullmatch, names) if m]
    kinds = [n for n in names if n in ('self_attention', 'cross_attention')]
    if layers and kinds:
      found.setdefault((layers[-1].group(1), int(layers[-1].group(2)), kinds[-1]), np.asarray(leaf, np.float32))
  return found


def _stack(found, stack, kind):
  layers = sorted(layer for s, layer, k in found if (s, k) == (stack, kind))
  if not layers:
    raise ValueError(f'the model sowed no {stack} {kind} weights (found {sorted(found)})')
  return np.stack([found[(stack, layer, kind)] for layer in layers], axis=1)  # [B, layers, H, Tq, Tk]


def attention_maps(translator, sentences, beam_size=None):
  """For each sentence, a dict of its source and target pieces and its attention weights, padding cropped:
    'cross'   [decoder layers, heads, target pieces, source pieces]
    'encoder' [encoder layers, heads, source pieces, source pieces]
  Target pieces are the translation's tokens with the final EOS, in the order the model wrote them (last word
  first for a right-to-left model, config.target_right_to_left): row t is the attention while predicting
  piece t. Every row is a softmax over the real (unpadded) keys, so it sums to one.
  """
  tokenizer = translator.tokenizer
  sources = translator.prepare(sentences)  # lowercased for a model of config.lowercase
  for number, source in enumerate(sources, start=1):
    if not source:
      raise ValueError(f'sentence {number} is empty: nothing to draw')
  # Cut as the search cuts a source past the position table: the pass below sees what was translated.
  source_ids = translator.fit_to_positions(tokenizer.encode(sources))
  reading_ids = [hyps[0][0] for hyps in translator.search_tokens(source_ids, beam_size=beam_size)]
  target_ids = reading_ids  # teacher-forced as the model wrote them: a right-to-left model's turned back
  if data_lib.right_to_left(translator.config):
    target_ids = [data_lib.reverse_before_eos(ids) for ids in reading_ids]
  # One padded batch (one compilation): sources, and BOS + translation as the decoder input.
  buckets = translator.config.length_buckets
  src_len = batching.bucket_length(max(map(len, source_ids)), buckets)
  tgt_len = batching.bucket_length(max(map(len, target_ids)), buckets)
  src = batching.pad_rows(source_ids, len(sources), src_len)
  tgt_in = batching.pad_rows(target_ids, len(sources), tgt_len, prefix=BOS_ID)
  found = find_attention_weights(jax.device_get(_sown(translator.model, translator.params, src, tgt_in)))
  cross, encoder = _stack(found, 'decoder', 'cross_attention'), _stack(found, 'encoder', 'self_attention')
  maps = []
  for b, (source, src_ids, tgt_ids) in enumerate(zip(sources, source_ids, target_ids)):
    s, t = len(src_ids), len(tgt_ids)
    maps.append({
        'source': source, 'translation': tokenizer.decode(reading_ids[b]),
        'source_pieces': tokenizer.pieces(src_ids), 'target_pieces': tokenizer.pieces(tgt_ids),
        'cross': cross[b, :, :, :t, :s], 'encoder': encoder[b, :, :, :s, :s],
    })
  return maps


def self_attention_maps(workdir, sentences, checkpoint='latest'):
  """For a language model's workdir (config.task lm or mlm), per text a dict of its pieces (the rows and
  columns) and 'self' [layers, heads, T, T]: the decoder's causal self-attention over BOS + text (LM) or
  the encoder's over the text with its <mask>s + EOS (MLM), padding cropped."""
  from flaxformer_nmt.decoding import fill_mask
  from flaxformer_nmt.decoding import generator as generate  # pylint: disable=g-import-not-at-top
  task = lm.task_of(workdir_lib.load_config(workdir))
  if task == 'lm':
    runner = generate.Generator(workdir, checkpoint)
    token_lists = [[BOS_ID] + ids for ids in runner.encode_prompt(sentences)]
  elif task == 'mlm':
    runner = fill_mask.FillMask(workdir, checkpoint)
    token_lists = [runner.encode(text) for text in sentences]
  else:
    raise ValueError(f'{workdir} is a translation workdir: use attention_maps')
  max_position = runner.config.model.max_position
  for number, (text, ids) in enumerate(zip(sentences, token_lists), start=1):
    if len(ids) > max_position:
      start = text if len(text) <= 40 else text[:40] + '...'
      raise ValueError(f'text {number} ({start!r}): {len(ids)} tokens exceed the model\'s {max_position} positions')
  length = min(batching.bucket_length(max(map(len, token_lists)), runner.config.length_buckets), max_position)
  tokens = batching.pad_rows(token_lists, len(token_lists), length)
  found = find_attention_weights(jax.device_get(_sown_self(runner.model, runner.params, tokens)))
  stack = 'decoder' if task == 'lm' else 'encoder'
  weights = _stack(found, stack, 'self_attention')
  return [{'text': text, 'stack': stack, 'pieces': runner.tokenizer.pieces(ids),
           'self': weights[b, :, :, :len(ids), :len(ids)]}
          for b, (text, ids) in enumerate(zip(sentences, token_lists))]


@functools.partial(jax.jit, static_argnums=0)
def _sown_self(model, params, tokens):
  _, state = model.apply({'params': params}, tokens, True, mutable=['intermediates'])
  return state['intermediates']


def write_self_attention_pictures(maps, output_dir):
  """Writes the language models' PNGs described in the module docstring; returns their paths."""
  output_dir = epath.Path(output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  for i, m in enumerate(maps):
    pieces, kind = m['pieces'], 'causal decoder' if m['stack'] == 'decoder' else 'encoder'
    paths += _layer_pictures(m['self'], pieces, pieces, f'{kind} self-attention, layer', m['text'],
                             output_dir / f'{i:02d}_{m["stack"]}_layer')
    paths.append(_average_picture(m['self'], pieces, pieces, f'{kind} self-attention', m['text'],
                                  output_dir / f'{i:02d}_self_average.png'))
  return paths


def _layer_pictures(attention, row_labels, col_labels, title, caption, path_prefix):
  """A PNG per layer of `attention` ([layers, heads, Tq, Tk]), a panel per head: {path_prefix}{layer}.png."""
  return [_heatmaps(heads, [f'head {h}' for h in range(len(heads))], row_labels, col_labels,
                    f'{title} {layer}\n{caption}', epath.Path(f'{path_prefix}{layer}.png'))
          for layer, heads in enumerate(attention)]


def _average_picture(attention, row_labels, col_labels, title, caption, path):
  """One PNG of `attention` ([layers, heads, Tq, Tk]) averaged over heads: a panel per layer, then over all."""
  per_layer = list(attention.mean(axis=1)) + [attention.mean(axis=(0, 1))]
  titles = [f'layer {layer}, mean of heads' for layer in range(len(attention))] + ['all layers and heads']
  return _heatmaps(per_layer, titles, row_labels, col_labels, f'{title}, averaged\n{caption}', path)


@functools.partial(jax.jit, static_argnums=0)
def _sown(model, params, src, tgt_in):
  _, state = model.apply({'params': params}, src, tgt_in, mutable=['intermediates'])
  return state['intermediates']


def _heatmaps(panels, titles, row_labels, col_labels, title, path, columns=4):
  """One PNG with a heatmap per panel ([Tq, Tk] arrays), rows and columns labelled with pieces. Labels and titles
  are drawn as written: a sentence with two `$` is not matplotlib mathtext."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  columns = min(columns, len(panels))
  rows = -(-len(panels) // columns)
  # About a quarter inch per piece, so that the labels stay readable.
  cell = 0.24
  width, height = max(2.5, 1.2 + cell * len(col_labels)), max(2.0, 1.2 + cell * len(row_labels))
  fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows + 0.4), squeeze=False)
  for ax, panel, panel_title in zip(axes.flat, panels, titles):
    ax.imshow(panel, cmap='viridis', vmin=0.0, vmax=max(float(panel.max()), 1e-6), aspect='equal')
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=90, fontsize=7, parse_math=False)
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7, parse_math=False)
    ax.set_title(panel_title, fontsize=9, parse_math=False)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis('off')
  fig.suptitle(title, fontsize=9, parse_math=False)
  fig.tight_layout()
  fig.savefig(path, dpi=90, bbox_inches='tight')  # long pieces stay inside the picture
  plt.close(fig)
  return path


def write_pictures(maps, output_dir):
  """Writes the PNGs described in the module docstring; returns their paths."""
  output_dir = epath.Path(output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  for i, m in enumerate(maps):
    src, tgt = m['source_pieces'], m['target_pieces']
    caption = f'{m["source"]}\n-> {m["translation"]}'
    paths += _layer_pictures(m['cross'], tgt, src, 'cross-attention, decoder layer', caption,
                             output_dir / f'{i:02d}_cross_layer')
    paths.append(_average_picture(m['cross'], tgt, src, 'cross-attention', caption,
                                  output_dir / f'{i:02d}_cross_average.png'))
    paths += _layer_pictures(m['encoder'], src, src, 'encoder self-attention, layer', m['source'],
                             output_dir / f'{i:02d}_encoder_layer')
  return paths
