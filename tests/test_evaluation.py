"""The attention pictures of `visualize`: what they draw, checked against the text they were given."""
import numpy as np
import pytest

from flaxformer_nmt.evaluation import attention


def _uniform(layers, heads, rows, columns):
  return np.full((layers, heads, rows, columns), 1.0 / columns, np.float32)


def test_pictures_draw_dollar_signs_as_written(tmp_path, monkeypatch):
  """Sentences and pieces with two `$` were matplotlib mathtext: '$5 or $10' lost its dollars and spaces, and
  '$x_{2$' ended the command with a ValueError after the whole translation."""
  pyplot = pytest.importorskip('matplotlib.pyplot')
  from matplotlib import text as text_lib  # pylint: disable=g-import-not-at-top
  figures, close = [], pyplot.close
  monkeypatch.setattr(pyplot, 'close', lambda fig: (figures.append(fig), close(fig)))
  maps = []
  for source, source_pieces in (('it costs $5 or $10 .', ['▁it', '▁$5', '▁or', '▁$10', '</s>']),
                                ('set $x_{2$ now', ['▁set', '▁$x_{2$', '▁now', '</s>'])):
    s = len(source_pieces)
    maps.append({'source': source, 'translation': source, 'source_pieces': source_pieces,
                 'target_pieces': source_pieces, 'cross': _uniform(1, 2, s, s), 'encoder': _uniform(1, 2, s, s)})
  paths = attention.write_pictures(maps, tmp_path)
  assert [p.name for p in paths] == [f'{i:02d}_{kind}.png' for i in range(2)
                                     for kind in ('cross_layer0', 'cross_average', 'encoder_layer0')]
  drawn = [t.get_text() for fig in figures for t in fig.findobj(text_lib.Text) if '$' in t.get_text()]
  assert '▁$5' in drawn and any('it costs $5 or $10 .' in t for t in drawn)
  for fig in figures:
    for t in fig.findobj(text_lib.Text):
      assert t._preprocess_math(t.get_text()) == (t.get_text(), False)  # pylint: disable=protected-access


def test_pictures_put_target_pieces_on_rows_and_draw_each_head_and_the_head_averages(tmp_path, monkeypatch):
  """A cross-attention map of 4 target x 5 source pieces: every layer's picture has a panel per head showing that
  head's weights, target pieces down and source pieces across; the average picture has each layer's mean over heads
  and then the mean over all layers and heads (loops below). The encoder's picture has its heads' weights with
  source pieces on both axes."""
  pyplot = pytest.importorskip('matplotlib.pyplot')
  figures, close = [], pyplot.close
  monkeypatch.setattr(pyplot, 'close', lambda fig: (figures.append(fig), close(fig)))
  rng = np.random.default_rng(0)
  layers, heads, t, s = 2, 3, 4, 5
  cross = rng.random((layers, heads, t, s)).astype(np.float32)
  encoder = rng.random((1, heads, s, s)).astype(np.float32)
  source_pieces, target_pieces = ['▁a', '▁b', '▁c', '▁d', '</s>'], ['▁w', '▁x', '▁y', '</s>']
  maps = [{'source': 'a b c d', 'translation': 'w x y', 'source_pieces': source_pieces,
           'target_pieces': target_pieces, 'cross': cross, 'encoder': encoder}]
  paths = attention.write_pictures(maps, tmp_path)
  names = [p.name for p in paths]
  assert names == ['00_cross_layer0.png', '00_cross_layer1.png', '00_cross_average.png', '00_encoder_layer0.png']
  drawn = {name: [(np.asarray(ax.get_images()[0].get_array()), [label.get_text() for label in ax.get_yticklabels()],
                   [label.get_text() for label in ax.get_xticklabels()]) for ax in fig.axes if ax.get_images()]
           for name, fig in zip(names, figures)}
  expected = {f'00_cross_layer{layer}.png': [cross[layer, h] for h in range(heads)] for layer in range(layers)}
  averages = []
  for layer in range(layers):
    averages.append(sum(cross[layer, h].astype(np.float64) for h in range(heads)) / heads)
  averages.append(sum(cross[layer, h].astype(np.float64) for layer in range(layers) for h in range(heads))
                  / (layers * heads))
  expected['00_cross_average.png'] = averages
  expected['00_encoder_layer0.png'] = [encoder[0, h] for h in range(heads)]
  for name, panels in expected.items():
    assert len(drawn[name]) == len(panels), name
    for (image, rows, columns), want in zip(drawn[name], panels):
      assert rows == (source_pieces if 'encoder' in name else target_pieces) and columns == source_pieces, name
      np.testing.assert_allclose(image, want, rtol=1e-6, err_msg=name)


def test_layers_are_stacked_in_their_numeric_order():
  """Twelve decoder layers, layer i's weights all i: the stack holds them in the order 0, 1, ..., 11. Catches layers
  taken in the order of their module names ('decoder_10' before 'decoder_2': a deep model's pictures titled with
  the wrong layers)."""
  tree = {f'decoder_{i}': {'cross_attention': {'attention_weights': (np.full((1, 2, 3, 4), i, np.float32),)}}
          for i in range(12)}
  found = attention.find_attention_weights(tree)
  stacked = attention._stack(found, 'decoder', 'cross_attention')  # pylint: disable=protected-access
  assert stacked.shape == (1, 12, 2, 3, 4)
  for i in range(12):
    assert (stacked[:, i] == i).all(), i


def test_language_model_pictures_draw_each_layer_and_head_and_the_averages_of_every_layer(tmp_path, monkeypatch):
  """A language model's self-attention of 2 layers x 3 heads over 4 pieces: a picture per layer with a panel per
  head, then the average picture with each layer's mean over heads and the mean over all layers and heads (loops
  below); the pieces on both axes."""
  pyplot = pytest.importorskip('matplotlib.pyplot')
  figures, close = [], pyplot.close
  monkeypatch.setattr(pyplot, 'close', lambda fig: (figures.append(fig), close(fig)))
  layers, heads, pieces = 2, 3, ['<s>', '▁ein', '▁hund', '▁.']
  weights = np.random.default_rng(1).random((layers, heads, len(pieces), len(pieces))).astype(np.float32)
  paths = attention.write_self_attention_pictures(
      [{'text': 'ein hund .', 'stack': 'decoder', 'pieces': pieces, 'self': weights}], tmp_path)
  names = [p.name for p in paths]
  assert names == ['00_decoder_layer0.png', '00_decoder_layer1.png', '00_self_average.png']
  expected = [[weights[layer, h] for h in range(heads)] for layer in range(layers)]
  averages = [sum(weights[layer, h].astype(np.float64) for h in range(heads)) / heads for layer in range(layers)]
  averages.append(sum(weights[layer, h].astype(np.float64) for layer in range(layers) for h in range(heads))
                  / (layers * heads))
  for name, fig, panels in zip(names, figures, expected + [averages]):
    drawn = [ax for ax in fig.axes if ax.get_images()]
    assert len(drawn) == len(panels), name
    for ax, want in zip(drawn, panels):
      assert [label.get_text() for label in ax.get_yticklabels()] == pieces, name
      assert [label.get_text() for label in ax.get_xticklabels()] == pieces, name
      np.testing.assert_allclose(np.asarray(ax.get_images()[0].get_array()), want, rtol=1e-6, err_msg=name)
