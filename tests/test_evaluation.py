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
