"""The translate CLI and API on a tiny trained workdir: order, empty lines, streaming, fairseq lines, sampling,
batching switches, attention pictures."""
import dataclasses
import functools
import json
import math
import re
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import in_process
from conftest import first_line_then_close, small_config, write_toy_corpus
from flaxformer_nmt import decode as decode_command
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.tokenizer import BOS_ID
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import attention as visualize
from flaxformer_nmt.models.transformer import cpu_has_bfloat16_dot
from flaxformer_nmt.training import loop as train
from flaxformer_nmt.decoding import batch_search
from flaxformer_nmt.decoding import beam_search
from flaxformer_nmt.decoding import search as search_lib
from flaxformer_nmt.runtime import executables


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """A toy model trained for 20 steps: enough for a vocabulary and a checkpoint; the outputs need not be good."""
  root = tmp_path_factory.mktemp('decode')
  config = small_config(write_toy_corpus(root / 'data'))
  config.num_train_steps = 20
  train.train_and_evaluate(config, str(root / 'run'))
  return root / 'run'


def copy_with_config(workdir, path, edit):
  """A copy of `workdir` at `path` whose config.json `edit` (a function of the config's dict) has changed."""
  shutil.copytree(workdir, path)
  config = json.loads((path / 'config.json').read_text())
  edit(config)
  (path / 'config.json').write_text(json.dumps(config))
  return path


@pytest.fixture(scope='module')
def translator(workdir):
  return decode.Translator(workdir)


@pytest.fixture(scope='module')
def mixed():
  """Sources of mixed lengths in no particular order, with empty and blank lines among them."""
  words = 'a big dog runs . the small red cat sleeps . a man sees the ball .'.split()
  lines = [' '.join(words[:n]) for n in (3, 15, 1, 9, 0, 12, 2, 7, 0, 0, 5, 14, 4)]
  lines[8] = '   '  # blank: whitespace only
  return lines


def test_batches_hold_every_sentence_once_within_the_token_budget(translator):
  lengths = [4, 31, 2, 1, 13, 8, 51, 3, 9, 1, 17, 6, 5, 40, 2]  # 1 is EOS alone: an empty sentence
  token_lists = [[5 + i % 7 for i in range(n - 1)] + [3] for n in lengths]
  nonempty = [i for i, n in enumerate(lengths) if n > 1]
  budget = 64
  for sort_by_length in (True, False):
    seen = []
    for members, src in translator.batches(token_lists, budget, sort_by_length):
      rows, padded = src.shape
      counted = padded // 2 if padded == translator.ladder(budget).lengths[0] else padded  # see Ladder.rows
      assert len(members) <= rows and (rows * counted <= budget or rows == 1)
      assert rows & (rows - 1) == 0 or rows == budget // counted  # a power of two, or a full batch
      for r, i in enumerate(members):
        assert list(src[r, :lengths[i]]) == token_lists[i] and not src[r, lengths[i]:].any()
      assert not src[len(members):].any()
      seen += [int(i) for i in members]
    assert sorted(seen) == nonempty
    if not sort_by_length:
      assert seen == nonempty  # input order


def run_cli(args, workdir, stdin=None, extra_workdir=True, as_subprocess=False):
  """The decode command on `args` (and --workdir=workdir): its main in this process, or `python -m` (in_process)."""
  args = ([f'--workdir={workdir}'] if extra_workdir else []) + args
  return in_process.run(decode_command, args, stdin, as_subprocess=as_subprocess)


def test_batched_translations_equal_one_sentence_at_a_time(translator, mixed):
  # Sorted token-budget batches (small budget: several batches) and input-order batches must both put every
  # translation back on its own line; translating each sentence alone is the independent reference.
  alone = [translator.translate([s], beam_size=2, return_scores=True)[0] for s in mixed]
  for sort_by_length in (True, False):
    batched = translator.translate(mixed, beam_size=2, tokens_per_batch=64, return_scores=True,
                                   sort_by_length=sort_by_length)
    assert [text for text, _ in batched] == [text for text, _ in alone]
    np.testing.assert_allclose([s for _, s in batched], [s for _, s in alone], atol=1e-4)
  assert all(alone[i] == ('', 0.0) for i in (4, 8, 9))  # empty and blank lines translate to empty lines


# .ci/run does not count a skip whose reason says it "needs a CPU with" something: the CPUs CI lands on differ.
needs_bf16_dot = pytest.mark.skipif(not cpu_has_bfloat16_dot(),
                                    reason='batch-invariant decoding needs a CPU with bf16 dot')


@pytest.fixture(scope='module')
def bfloat16_workdir(workdir, tmp_path_factory):
  """The toy workdir with bfloat16 matmul operands (what 'auto' gives on a bf16-dot CPU)."""
  return copy_with_config(workdir, tmp_path_factory.mktemp('bf16') / 'run',
                          lambda config: config['model'].update(matmul_precision='bfloat16'))


@needs_bf16_dot
@pytest.mark.parametrize('beam_size', [4, 0])
def test_a_batch_invariant_search_scores_each_sentence_as_it_would_alone(workdir, bfloat16_workdir, beam_size):
  # Exact equality, scores to the last bit, whatever the batch: 64 sentences x 4 beams in one batch hand
  # LayerNorm's and the normalizer's sums to YNNPACK (arrays of 4,096 floats or more), a sentence alone takes
  # XLA's own loops and matrix-vector products. Fails without BATCH_INVARIANT_OPTIONS or BATCH_INVARIANT_MIN_ROWS.
  invariant = decode.Translator(bfloat16_workdir, batch_invariant=True)
  lines = (workdir.parent / 'data' / 'train.en').read_text().splitlines()[:64]
  token_lists = invariant.tokenizer.encode(lines)
  search = lambda sources: invariant.search_tokens(sources, beam_size=beam_size, tokens_per_batch=1024)
  together = search(token_lists)
  assert [search([t])[0] for t in token_lists[:12]] == together[:12]
  assert search(token_lists[12:15]) == together[12:15]


@needs_bf16_dot
def test_the_batch_invariant_matmuls_round_each_row_alike_at_the_configs_widths():
  # What the batch-invariant search rests on: a row's bfloat16 matmul gives the same float32 sums whatever the row
  # count, at the widths of every shipped config's layers and vocabulary. XLA's kernels do not for outputs of 32
  # columns or fewer (a toy's 64 -> 32 feed-forward output differs from 16 rows on); a jaxlib whose kernels change
  # with the rows at these widths breaks --batch_invariant.
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  configs = [config_lib.load_config_file(os.path.join(repo, 'configs', name))
             for name in sorted(os.listdir(os.path.join(repo, 'configs'))) if name.endswith('.py')]
  shapes = {(k, n) for c in configs for d, f in [(c.model.d_model, c.model.d_ff)]
            for k, n in ((d, d), (d, f), (f, d), (d, c.vocab_size))}
  assert (128, 256) in shapes and (1024, 37_000) in shapes
  rng = np.random.default_rng(0)
  matmul = lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  for k, n in sorted(shapes):
    x, w = rng.standard_normal((256, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    first_rows = [np.asarray(jax.jit(matmul).lower(x[:rows], w).compile(
        compiler_options=batch_search.BATCH_INVARIANT_OPTIONS)(x[:rows], w))[:2] for rows in (2, 8, 16, 64, 256)]
    for rows, found in zip((8, 16, 64, 256), first_rows[1:]):
      np.testing.assert_array_equal(found, first_rows[0], err_msg=f'{k} x {n} at {rows} rows')


def test_batch_invariance_is_refused_where_it_cannot_hold(workdir, bfloat16_workdir):
  # Not silently ignored: the device's one-program search, float32 matmuls (their kernels change with the row
  # count), and a rescorer's teacher-forced batches are not batch-invariant.
  with pytest.raises(ValueError, match='one CPU device'):
    decode.Translator(bfloat16_workdir, batch_invariant=True, on_device=True)
  with pytest.raises(ValueError, match='bfloat16 matmul operands'):
    decode.Translator(workdir, batch_invariant=True)
  result = run_cli(['--batch_invariant'], workdir, stdin='a dog .\n')  # the command hands its flag on
  assert result.returncode != 0 and 'bfloat16 matmul operands' in result.stderr
  result = run_cli(['--batch_invariant', f'--rerank_workdir={workdir}'], bfloat16_workdir, stdin='a dog .\n')
  assert result.returncode != 0 and 'not --rerank_workdir' in result.stderr


def test_cli_from_stdin_in_chunks_equals_the_api(workdir, translator, mixed):
  # The real command (`python -m`, stdin a pipe), as in test_cli_bad_input_names_the_line; the other CLI tests
  # run its main in this process.
  result = run_cli(['--buffer_lines=3'], workdir, stdin=''.join(s + '\n' for s in mixed), as_subprocess=True)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.split('\n')
  assert lines[-1] == '' and len(lines) - 1 == len(mixed)
  assert lines[:-1] == translator.translate(mixed)
  assert all(lines[i] == '' for i in (4, 8, 9))  # empty in, empty out
  assert 'sentences/s' in result.stderr


def test_cli_fairseq_format_with_n_best(workdir, translator, mixed, tmp_path):
  (tmp_path / 'in.en').write_text('\n'.join(mixed) + '\n')
  # Chunks of 5 lines: the ids count on across chunks.
  result = run_cli(['--input', str(tmp_path / 'in.en'), '--format=fairseq', '--n_best=2', '--beam_size=3',
                    '--buffer_lines=5'], workdir)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.rstrip('\n').split('\n')
  assert len(lines) == 5 * len(mixed)  # S, then H and D for each of the 2 hypotheses
  expected = translator.translate(mixed, beam_size=3, n_best=2, return_scores=True)
  sp = translator.tokenizer.sp
  for i, source in enumerate(mixed):
    s, h1, d1, h2, d2 = lines[5 * i:5 * i + 5]
    assert s == f'S-{i}\t{" ".join(source.split())}'
    for (h, d), (text, score) in zip(((h1, d1), (h2, d2)), expected[i]):
      h_tag, h_score, pieces = h.split('\t')
      d_tag, d_score, detokenized = d.split('\t')
      assert (h_tag, d_tag) == (f'H-{i}', f'D-{i}')
      assert float(h_score) == float(d_score) == pytest.approx(score, abs=1e-4)
      assert detokenized == text
      assert sp.decode_pieces(pieces.split(' ')) == text  # H holds the pieces of D
    if source.strip():
      assert float(h1.split('\t')[1]) >= float(h2.split('\t')[1])


def test_sampling_depends_on_seed_and_line_not_on_batching(workdir, translator, mixed):
  options = dict(sampling=True, top_k=5, temperature=1.5)
  api = translator.translate(mixed, seed=7, **options)
  assert translator.translate(mixed, seed=7, tokens_per_batch=48, **options) == api
  assert translator.translate(mixed, seed=8, **options) != api
  result = run_cli(['--sampling', '--top_k=5', '--temperature=1.5', '--seed=7', '--buffer_lines=4'], workdir,
                   stdin='\n'.join(mixed) + '\n')
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split('\n')[:-1] == api
  samples = translator.translate(mixed[:2], seed=7, n_best=3, return_scores=True, **options)
  assert all(len(s) == 3 and s[0][1] >= s[1][1] >= s[2][1] for s in samples)


@pytest.mark.parametrize('temperature', [1e9, float('inf')])
def test_sampling_at_any_temperature_keeps_the_length_limit_and_the_forbidden_tokens(translator, mixed, temperature):
  # Catches a temperature applied to the masked log probabilities: NEG_INF divided by a huge temperature is about
  # 0, so PAD and BOS get drawn and the EOS forced at the length limit is not (rows run to the buffer's end).
  from flaxformer_nmt.data.tokenizer import EOS_ID, PAD_ID  # pylint: disable=g-import-not-at-top
  token_lists = translator.tokenizer.encode(translator.prepare(mixed[:3]))
  found = translator.search_tokens(token_lists, sampling=True, temperature=temperature, n_best=4, seed=1,
                                   max_len_a=0.0, max_len_b=3)
  samples = [list(tokens) for sentence in found for tokens, _ in sentence]
  assert all(len(tokens) <= 4 and tokens[-1] == EOS_ID for tokens in samples), samples  # 3 pieces, then EOS
  assert not {PAD_ID, BOS_ID} & {t for tokens in samples for t in tokens}, samples
  assert len({t for tokens in samples for t in tokens}) > 8  # spread over the vocabulary
  for bad in (dict(temperature=float('nan')), dict(seed=2**31)):
    with pytest.raises(ValueError, match='temperature|seed'):
      translator.search_tokens(token_lists, sampling=True, **bad)


def test_cli_bad_input_names_the_line(workdir):
  result = run_cli([], workdir, stdin=b'a dog\nthe cat\n\xff\xfe bad\n')
  assert result.returncode == 1
  assert '<stdin>:3: invalid UTF-8' in result.stderr


def test_attention_maps_are_softmax_rows_over_the_pieces(translator):
  sentences = ['a big dog runs .', 'the cat sleeps .']
  maps = visualize.attention_maps(translator, sentences, beam_size=2)
  config = translator.config.model
  for m, sentence in zip(maps, sentences):
    assert m['translation'] == translator.translate([sentence], beam_size=2)[0]
    s, t = len(m['source_pieces']), len(m['target_pieces'])
    assert m['source_pieces'][-1] == m['target_pieces'][-1] == '</s>'
    assert m['cross'].shape == (config.num_decoder_layers, config.num_heads, t, s)
    assert m['encoder'].shape == (config.num_encoder_layers, config.num_heads, s, s)
    for weights in (m['cross'], m['encoder']):  # padding cropped: each row is a whole softmax
      assert np.all(weights >= 0)
      np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)


def test_attention_maps_are_the_numpy_attention_of_the_translation_as_the_model_wrote_it(workdir, translator,
                                                                                       tmp_path):
  """The weights drawn against the NumPy forward pass of the model's parameters (test_against_numpy), teacher-forced
  on BOS + the translation in the order the model wrote it (right to left: reversed before EOS, as the module
  says): cross-attention row t is the attention while the model predicted piece t, labelled with that piece; the
  encoder's rows and columns are the source pieces. Catches BOS left out (every row a piece late), a right-to-left
  model teacher-forced or labelled in reading order, another stack's or kind's weights, and another sentence's."""
  from test_against_numpy import np_transformer  # pylint: disable=g-import-not-at-top
  r2l = decode.Translator(copy_with_config(workdir, tmp_path / 'r2l', lambda c: c.update(target_right_to_left=True)))
  sentences = ['a big dog runs .', 'the small cat sleeps .']
  for model, right_to_left in ((translator, False), (r2l, True)):
    config = model.config.model
    for m, sentence in zip(visualize.attention_maps(model, sentences, beam_size=0), sentences):
      source = model.tokenizer.encode([sentence])[0]
      [[(reading, _)]] = model.search_tokens([source], beam_size=0)
      written = reading[:-1][::-1] + reading[-1:] if right_to_left else reading
      assert len(written) > 2 and m['translation'] == model.tokenizer.decode(reading)
      assert m['source_pieces'] == model.tokenizer.pieces(source)
      assert m['target_pieces'] == model.tokenizer.pieces(written)
      found = {}
      np_transformer(model.params, np.array(source), np.array([BOS_ID] + written[:-1]), heads=config.num_heads,
                     pre_ln=config.pre_layer_norm, weights=found)
      for name, stack, kind, layers in (('cross', 'decoder', 'cross_attention', config.num_decoder_layers),
                                        ('encoder', 'encoder', 'self_attention', config.num_encoder_layers)):
        want = np.stack([np.stack(found[(stack, layer, kind)]) for layer in range(layers)])  # [L, H, Tq, Tk]
        np.testing.assert_allclose(m[name], want, atol=1e-5, err_msg=f'{name}, right_to_left={right_to_left}')


def test_find_attention_weights_looks_through_any_nesting():
  w = np.full((1, 2, 3, 3), 1 / 3, np.float32)
  tree = {'encoder_0': {'self_attention': {'attention_weights': (w,)}},
          'decoder_1': {'remat': {'cross_attention': {'attention_weights': (w * 2,)}},
                        'self_attention': {'attention_weights': (w * 3,)}},
          'unrelated': {'attention_weights': (w,)}}
  found = visualize.find_attention_weights(tree)
  assert sorted(found) == [('decoder', 1, 'cross_attention'), ('decoder', 1, 'self_attention'),
                           ('encoder', 0, 'self_attention')]
  np.testing.assert_array_equal(found[('decoder', 1, 'cross_attention')], w * 2)


def test_visualize_cli_writes_pngs(workdir, tmp_path):
  matplotlib_image = pytest.importorskip('matplotlib.image')
  (tmp_path / 'in.en').write_text('the small cat sleeps .\n\n')
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.visualize', f'--workdir={workdir}', '--sentences=a dog runs .',
       f'--input={tmp_path / "in.en"}', f'--output_dir={tmp_path / "pictures"}', '--beam_size=0'],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  names = sorted(p.name for p in (tmp_path / 'pictures').iterdir())
  # 1 decoder and 1 encoder layer in the toy config; 2 sentences.
  assert names == [f'{i:02d}_{kind}.png' for i in range(2)
                   for kind in ('cross_average', 'cross_layer0', 'encoder_layer0')]
  for name in names:
    path = tmp_path / 'pictures' / name
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    image = matplotlib_image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # a picture, not a blank page
    assert str(path) in result.stdout


@pytest.mark.parametrize('output_dir, where', [('taken', 'is a file'), ('taken/pictures', 'is under the file {}')])
def test_visualize_refuses_an_output_dir_that_is_a_file_before_decoding(workdir, tmp_path, monkeypatch, output_dir,
                                                                         where):
  # Catches the check left to the pictures' mkdir: the whole translation ran first, then "[Errno 17] File exists"
  # (or "[Errno 20] Not a directory" for a directory under the file).
  from flaxformer_nmt import visualize as visualize_command  # pylint: disable=g-import-not-at-top
  pytest.importorskip('matplotlib')
  (tmp_path / 'taken').write_text('')
  monkeypatch.setattr(visualize_command.decode, 'Translator', lambda *a, **k: pytest.fail('decoded first'))
  result = in_process.run(visualize_command, [f'--workdir={workdir}', '--sentences=a dog runs .',
                                              f'--output_dir={tmp_path / output_dir}'])
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [
      f'error: --output_dir {tmp_path / output_dir}: {where.format(tmp_path / "taken")}, not a directory']


def test_a_source_longer_than_the_positions_is_cut_with_its_line_named(workdir, translator, caplog, monkeypatch):
  from flaxformer_nmt.data.tokenizer import EOS_ID  # pylint: disable=g-import-not-at-top
  lists = [[5] * 10 + [EOS_ID], [6] * 40 + [EOS_ID], [7] * 29 + [EOS_ID], [8] * 5000 + [EOS_ID]]
  cut = decode.fit_to_positions(lists, max_position=80, extra_length=50, first_line=100)
  assert cut[0] == lists[0] and cut[2] == lists[2]  # 30 tokens: exactly the limit, kept whole
  assert cut[1] == [6] * 29 + [EOS_ID] and cut[3] == [8] * 29 + [EOS_ID]
  assert 'Input lines 102, 104: longer than the model allows' in caplog.text
  # Through the translator: a 5,000-word line is cut (and said so), not silently clamped. An ensemble cuts to its
  # shortest member's positions (cut to the first member's, the line overflowed the other's batch: a crash).
  caplog.clear()
  ensemble = decode.Translator(workdir, checkpoint='20,20')
  first, second = ensemble.models
  # A short cut keeps the search quick.
  monkeypatch.setattr(ensemble, 'models', (first, second.clone(config=dataclasses.replace(second.config,
                                                                                          max_position=80))))
  long_line = ' '.join(['a big dog runs .'] * 1000)
  outputs = ensemble.translate(['a dog .', long_line], beam_size=0)
  assert len(outputs) == 2
  assert 'Input line 2: longer than the model allows (max_position 80 - max_decode_extra_length 10' in caplog.text


# --- fairseq-style options: ensembles, --max_len_a/--max_len_b, --dtype ----------------------------------------


def test_translators_of_one_model_share_compiled_searches_and_alpha_is_not_compiled_in(workdir, translator, mixed):
  # compare decodes each checkpoint with a new Translator of the same model, and --alpha=0.6,1.5 the same
  # sentences again: neither compiles the search again (alpha is an input of the programs, not a constant).
  token_lists = translator.tokenizer.encode(translator.prepare(mixed))
  first = translator.search_tokens(token_lists, beam_size=3, alpha=0.6)
  programs = lambda: (batch_search._begin_jit.cache_size(), batch_search._segment_jit.cache_size())
  compiled = programs()
  second = decode.Translator(workdir).search_tokens(token_lists, beam_size=3, alpha=1.5)
  assert programs() == compiled
  # The programs read the alpha they are given: a translation found under both scores log P / lp(n, alpha),
  # lp(n, alpha) = ((5 + n) / 6) ** alpha for its n tokens (EOS counted), so log P agrees.
  both = [(a[0], b[0]) for a, b in zip(first, second) if a[0][0] == b[0][0] and a[0][0]]
  assert len(both) >= len(mixed) // 2, (first, second)
  for (tokens, score_06), (_, score_15) in both:
    base = (5.0 + len(tokens)) / 6.0
    assert score_06 * base ** 0.6 == pytest.approx(score_15 * base ** 1.5, rel=1e-5)
    assert score_06 != pytest.approx(score_15, rel=1e-3)


def test_other_length_limits_compile_no_other_search(translator, mixed):
  # The limit floor(max_len_a * n + max_len_b) is an input of the programs: a server whose requests each asked
  # for another max_length compiled a begin program per value (2.5-3 s each on 2 cores, without bound).
  token_lists = translator.tokenizer.encode(translator.prepare(mixed))
  # (A shorter limit may end a batch in a segment program of another rung; the begin programs are per batch.)
  translator.search_tokens(token_lists, beam_size=2)
  begun = batch_search._begin_jit.cache_size()
  for a, b in ((0.5, 2), (0.0, 3), (1.5, 1)):
    found = translator.search_tokens(token_lists, beam_size=2, max_len_a=a, max_len_b=b)
    assert batch_search._begin_jit.cache_size() == begun, (a, b)
    lengths = [(len(tokens) - 1, math.floor(a * (len(source) - 1) + b + 1e-9))
               for source, [(tokens, _)] in zip(token_lists, found)]
    assert all(n <= limit for n, limit in lengths), (a, b, lengths)  # EOS not counted, as fairseq's int(a * n + b)
    assert any(n == limit for n, limit in lengths), (a, b, lengths)


def test_ensemble_of_one_checkpoint_twice_equals_that_checkpoint(workdir, mixed):
  single = decode.Translator(workdir, checkpoint='20')
  double = decode.Translator(workdir, checkpoint='20,20')
  assert double.checkpoint == 'an ensemble of checkpoint 20, checkpoint 20'
  # Beam search only: the greedy ensemble step is checked against NumPy in test_decode_options.py.
  a = single.translate(mixed, beam_size=3, return_scores=True)
  b = double.translate(mixed, beam_size=3, return_scores=True)
  assert [text for text, _ in a] == [text for text, _ in b]
  np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=1e-5, atol=1e-5)


def test_cli_ensemble_of_workdirs_equals_the_api(workdir, mixed, tmp_path):
  other = tmp_path / 'copy'
  shutil.copytree(workdir, other)
  api = decode.Translator([str(workdir), str(other)], checkpoint='10,20').translate(mixed, beam_size=2)
  result = run_cli([f'--workdir={workdir},{other}', '--checkpoint=10,20', '--beam_size=2'], workdir=workdir,
                   stdin='\n'.join(mixed) + '\n', extra_workdir=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split('\n')[:-1] == api
  assert 'an ensemble of checkpoint 10 of' in result.stderr


def test_ensemble_with_another_vocabulary_names_both_workdirs(workdir, tmp_path):
  from flaxformer_nmt.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  other = tmp_path / 'other'
  shutil.copytree(workdir, other)
  (other / 'vocab.model').unlink()
  text = (workdir.parent / 'data' / 'train.de').read_text().splitlines()
  tokenizer_lib.train_sentencepiece(text, other / 'vocab.model', vocab_size=48)
  with pytest.raises(ValueError, match='one vocabulary') as error:
    decode.Translator(f'{workdir},{other}')
  assert str(workdir) in str(error.value) and str(other) in str(error.value)
  result = run_cli([f'--workdir={workdir},{other}', f'--output={tmp_path / "out.de"}'], workdir=workdir,
                   stdin='a dog .\n', extra_workdir=False)
  assert result.returncode == 1 and 'one vocabulary' in result.stderr and str(other) in result.stderr
  with pytest.raises(ValueError, match='3 workdirs and 2 checkpoints'):
    decode.ensemble_members(f'{workdir},{other},{other}', '10,20')


def test_an_ensemble_of_another_direction_or_target_order_is_refused_naming_both(workdir, tmp_path):
  """Members that share the vocabulary (a joint one) and the shapes but translate de->en, or write the target right
  to left, would have their next-token probabilities averaged with the en->de member's: refused, naming them."""
  reverse = copy_with_config(workdir, tmp_path / 'reverse', lambda c: c.update(source_lang='de', target_lang='en'))
  with pytest.raises(ValueError, match=re.escape(f'one direction: {reverse} is de->en, {workdir} en->de')):
    decode.Translator(f'{workdir},{reverse}')
  backwards = copy_with_config(workdir, tmp_path / 'backwards', lambda c: c.update(target_right_to_left=True))
  with pytest.raises(ValueError, match=re.escape(f'one order: {backwards} right to left, {workdir} not')):
    decode.Translator(f'{workdir},{backwards}')


def test_a_lowercased_model_lowercases_its_inputs_and_scores_case_insensitively(workdir, translator, tmp_path):
  # The toy corpus is lowercase; the same workdir marked config.lowercase must read 'A BIG Dog' as 'a big dog'
  # (the unmarked one meets capitals its vocabulary never saw), and decode's scores ignore case.
  lowered = copy_with_config(workdir, tmp_path / 'lowered', lambda config: config.update(lowercase=True))
  shouting = ['A BIG Dog runs .', 'The Small RED cat sleeps .']
  quiet = [s.lower() for s in shouting]
  expected = translator.translate(quiet, beam_size=2)
  assert translator.translate(shouting, beam_size=2) != expected  # capitals change what the cased model reads
  assert decode.Translator(lowered).translate(shouting, beam_size=2) == expected
  reference = tmp_path / 'ref.de'
  reference.write_text(''.join(line.upper() + '\n' for line in expected))  # the right words, other case
  # One line a chunk: the scores read every chunk's translations.
  result = run_cli(['--beam_size=2', f'--reference={reference}', f'--output={tmp_path / "out.de"}',
                    '--buffer_lines=1'], lowered, stdin=''.join(s + '\n' for s in shouting))
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / 'out.de').read_text().splitlines() == expected
  # (chrF: the toy's translations are too short for 4-grams, so BLEU would be 0 whatever the case)
  assert 'chrF = 100.00  (nrefs:1|case:lc' in result.stdout, result.stdout
  from flaxformer_nmt.evaluation import compare  # pylint: disable=g-import-not-at-top
  sacrebleu_column = lambda refs: compare.score_row('latest', decode.Translator(lowered), shouting, refs, None, 2,
                                                    None)
  (upper, signature), (same, _) = sacrebleu_column([l.upper() for l in expected]), sacrebleu_column(expected)
  assert upper.split('|')[4] == same.split('|')[4] and 'case:lc' in signature, (upper, same, signature)


def test_decode_uses_the_checkpoint_the_config_chose_unless_told(workdir, mixed, tmp_path):
  other = tmp_path / 'run'
  shutil.copytree(workdir, other)
  saved = json.loads((other / 'config.json').read_text())

  def set_default(value):
    saved.pop('decode_checkpoint', None)
    if value is not None:
      saved['decode_checkpoint'] = value
    (other / 'config.json').write_text(json.dumps(saved))

  set_default(None)  # a workdir trained before the field: the newest checkpoint, as before
  assert decode.Translator(other).checkpoint == 'checkpoint 20'
  set_default('10')
  assert decode.Translator(other).checkpoint == 'checkpoint 10'
  result = run_cli(['--greedy'], other, stdin='\n'.join(mixed) + '\n')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Translating with checkpoint 10 of' in result.stderr
  assert result.stdout.split('\n')[:-1] == decode.Translator(other, '10').translate(mixed, beam_size=0)
  # A default that the workdir lacks (no average written) names the field and the way out; --checkpoint wins.
  set_default('averaged')
  result = run_cli(['--greedy'], other, stdin='a dog .\n')
  assert result.returncode == 1
  assert "config.decode_checkpoint='averaged'" in result.stderr and 'flaxformer_nmt.average' in result.stderr
  result = run_cli(['--greedy', '--checkpoint=latest'], other, stdin='a dog .\n')
  assert result.returncode == 0 and 'Translating with checkpoint 20 of' in result.stderr


def test_cli_max_len_limits_the_output_and_rejects_bad_values(workdir, translator, mixed, tmp_path):
  result = run_cli(['--max_len_a=0', '--max_len_b=2', '--greedy', '--format=fairseq'], workdir,
                   stdin='\n'.join(mixed) + '\n')
  assert result.returncode == 0, result.stderr[-3000:]
  pieces = [line.split('\t')[2] for line in result.stdout.splitlines() if line.startswith('H-')]
  assert len(pieces) == len(mixed) and all(len(p.split()) <= 2 for p in pieces)
  assert max(len(p.split()) for p in pieces) == 2  # the toy model does not stop by itself within 2 pieces
  api = translator.translate(mixed, beam_size=0, max_len_a=0, max_len_b=2)
  assert [line.split('\t')[2] for line in result.stdout.splitlines() if line.startswith('D-')] == api
  # A limit of no token for a one-piece source (0.5 x 1 + 0) left only EOS, and n-best slots of padding.
  for bad, name in ((['--max_len_a=-1'], 'max_len_a'), (['--max_len_a=0', '--max_len_b=0'], 'max_len_a'),
                    (['--max_len_a=0.5', '--max_len_b=0'], 'max_len_a'), (['--min_len=-1'], 'min_len'),
                    (['--beam_size=-2'], 'beam_size'), (['--buffer_lines=0'], 'buffer_lines'),
                    (['--tok_reference=x.de'], '--reference')):
    result = run_cli(bad + [f'--output={tmp_path / "out.de"}'], workdir, stdin='a dog .\n')
    assert result.returncode == 1 and name in result.stderr
    assert not (tmp_path / 'out.de').exists()
  # min_len (no EOS before that many tokens; its rule is tested in test_beam_search.py) reaches every search.
  _, options = translator._prepare(beam_size=2, min_len=3)
  assert options['min_len'] == 3 and translator._prepare()[1]['min_len'] == 1  # fairseq's and CTranslate2's
  src = jnp.asarray(translator.tokenizer.encode(['a dog .']))
  for beam_size, keys in ((2, None), (0, None), (0, search_lib.sample_keys(0, jnp.arange(1), 2))):
    inputs, _ = search_lib.start_search(translator.model, translator.params, src, keys, beam_size=beam_size,
                                        extra_length=5)
    for step in search_lib._search_rule(translator.model, translator.params, inputs, beam_size=beam_size,
                                        alpha=0.6, min_len=3):
      assert step.keywords['min_length'] == 3


def test_cli_never_empties_the_output_for_a_bad_input_or_output(workdir, tmp_path):
  out = tmp_path / 'out.de'
  out.write_text('earlier translations\n')
  for args, message in (([f'--input={tmp_path / "missing.en"}'], 'missing.en'),
                        ([f'--input={out}'], 'is the --input file')):
    result = run_cli(args + [f'--output={out}'], workdir)
    assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
    assert out.read_text() == 'earlier translations\n'
  result = run_cli([f'--output={tmp_path / "no_dir" / "out.de"}'], workdir, stdin='a dog .\n')
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (f'error: --output {tmp_path / "no_dir" / "out.de"}: No such file '
                                                    'or directory')


def test_an_input_or_output_that_cannot_be_opened_is_one_line_naming_its_flag(workdir, tmp_path):
  # It was "error: PATH: [Errno 21] Is a directory: 'PATH'": the path twice, the flag not at all.
  (tmp_path / 'folder').mkdir()
  (tmp_path / 'taken').write_text('')
  source = tmp_path / 'in.en'
  source.write_text('a dog .\n')
  for args, line in (([f'--input={tmp_path / "folder"}'], f'error: --input {tmp_path / "folder"}: Is a directory'),
                     ([f'--input={source}', f'--output={tmp_path / "folder"}'],
                      f'error: --output {tmp_path / "folder"}: Is a directory'),
                     ([f'--input={source}', f'--output={tmp_path / "taken" / "out.de"}'],
                      f'error: --output {tmp_path / "taken" / "out.de"}: Not a directory')):
    result = run_cli(args, workdir)
    assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == line
  assert (tmp_path / 'taken').read_text() == ''


def test_bfloat16_decoding_computes_in_bfloat16(workdir, translator, mixed):
  bf16 = decode.Translator(workdir, dtype='bfloat16')
  assert bf16.model.config.dtype == 'bfloat16'
  ours = translator.translate(mixed, beam_size=0, return_scores=True)
  theirs = bf16.translate(mixed, beam_size=0, return_scores=True)
  same = [(a, b) for (ta, a), (tb, b) in zip(ours, theirs) if ta == tb and ta]
  assert len(same) >= len(mixed) // 2
  assert any(a != b for a, b in same)  # bfloat16 rounding shows in the scores ...
  np.testing.assert_allclose([b for _, b in same], [a for a, _ in same], rtol=0.05, atol=0.1)  # ... a little
  with pytest.raises(ValueError, match='dtype'):
    decode.Translator(workdir, dtype='float8')


def _through_eos_rows(tokens):
  """Each row of a [K, L] search result through its first EOS (rows of different L compare)."""
  return [tuple(decode._through_eos(row)) for row in np.asarray(tokens)]


# Greedy and sampling step through the same segment loop as beam search (whose case runs by default); their
# cases cost the 2-core CI machine's time: -m slow.
@pytest.mark.parametrize('mode', ['beam', pytest.param('greedy', marks=pytest.mark.slow),
                                  pytest.param('sampling', marks=pytest.mark.slow)])
def test_segments_and_the_device_search_give_the_one_call_search(translator, mixed, mode, monkeypatch):
  # Catches a segment loop that loses or mixes up sentences when it drops finished ones, splits the searching
  # ones over several batches or grows their cache (and the encoder's keys/values, and the source mask), and a
  # device search that differs from the one-call search of search_lib.search over the whole batch.
  segments = []  # (rows, cache length) of every segment after a batch's first
  segment = batch_search._segment_jit
  monkeypatch.setattr(batch_search, '_segment_jit', lambda model, params, inputs, state, *a, **k: segments.append(
      (len(inputs.src), beam_search.cache_length(state))) or segment(model, params, inputs, state, *a, **k))
  n = 3 if mode == 'sampling' else 1
  base = dict(beam_size=2 if mode == 'beam' else 0, alpha=0.6, temperature=1.0, top_k=0, cache_cross_kv=True,
              grow_cache=True, num_samples=n if mode == 'sampling' else 0)
  # At most one token more than the source: short sources end early, long ones keep few rows searching. Then
  # 20 tokens for every sentence, none before 17: all search past the first cache of 16 positions, more
  # sentences than the top rung at 32 holds.
  cases = [dict(base, extra_length=1, max_len_a=1.0, min_len=1), dict(base, extra_length=20, max_len_a=0.0, min_len=17)]
  one_call = jax.jit(functools.partial(search_lib.search, translator.model),
                     static_argnames=tuple(k for k in cases[0] if k not in ('alpha', 'num_samples')))
  token_lists = translator.tokenizer.encode([mixed[2]] * 12 + [mixed[1]] * 4 + mixed)
  # Rungs from 16 positions, not the default 32: the cases cross a rung in few steps.
  ladder = dataclasses.replace(translator.ladder(256), min_length=16)
  for options in cases:
    for members, src in ladder.batches(token_lists):
      lines = np.arange(len(src), dtype=np.int32)
      rows = batch_search._segmented_batch(translator.model, translator.params, src, lines, 5, ladder, options,
                                           lambda tree: tree)
      device = batch_search._device_batch(translator.model, translator.params, src, lines, 5, ladder, options,
                                          lambda tree: tree)
      keys = search_lib.sample_keys(5, lines, n) if mode == 'sampling' else None
      call = {k: v for k, v in options.items() if k != 'num_samples'}
      tokens, scores = jax.device_get(one_call(translator.params, src, keys, **call))
      real = lambda found: sorted(r for r, _, _ in found if r < len(members))  # not the batch's padding rows
      assert real(rows) == real(device) == list(range(len(members)))
      for found in (rows, device):
        for r, row_tokens, row_scores in found:
          if r < len(members):
            assert _through_eos_rows(row_tokens) == _through_eos_rows(tokens[r]), (options, r)
            np.testing.assert_allclose(row_scores, scores[r], rtol=1e-5, atol=1e-5)
  # The batches dropped finished sentences into fewer rows; in the second case a batch of 16 rows at 16
  # positions grew its cache and split its searching sentences over two batches of the top rung at 32.
  assert any(rows < ladder.rows(16)[0] for rows, length in segments if length == 16), segments
  assert segments.count((ladder.rows(32)[0], 32)) >= 2, segments

def test_going_on_keeps_the_searching_sentences_and_marks_padding_rows_finished():
  # Catches a batch that goes on with the wrong rows or their row numbers instead of their sentences, and padding
  # rows (copies of a searching sentence) that are not marked finished: they would keep the batch searching.
  from flaxformer_nmt.decoding import ladder as ladder_lib  # pylint: disable=g-import-not-at-top
  batch, beams, samples, length = 8, 2, 3, 16
  rng = np.random.default_rng(0)
  ints = lambda *shape: rng.integers(4, 99, shape).astype(np.int32)
  cache = lambda rows: {'keys': rng.normal(size=(rows, 1, length, 2)).astype(np.float32)}
  beam = beam_search.BeamState(
      index=np.int32(5), sequences=ints(batch, beams, length + 1), alive_log_probs=np.zeros((batch, beams)),
      finished_sequences=ints(batch, beams, length + 1), finished_scores=np.zeros((batch, beams)),
      num_finished=np.zeros(batch, np.int32), max_lengths=np.arange(20, 20 + batch, dtype=np.int32),
      cache=cache(batch * beams))
  sampled = beam_search.TokenState(
      index=np.int32(5), sequences=ints(batch * samples, length + 1), finished=rng.random(batch * samples) < 0.5,
      scores=np.zeros(batch * samples, np.float32), max_lengths=np.full(batch * samples, 20, np.int32),
      cache=cache(batch * samples))
  inputs = search_lib.SearchInputs(src=ints(batch, length), members=(), sample_keys=None)
  sentences = np.array([30, 31, 32, 33, 34, 35, 36, -1])
  live = np.array([True, False, True, False, False, True, False, False])
  ladder = ladder_lib.Ladder(tokens_per_batch=32, max_position=64, min_length=16)  # rows 4 and 1 at 16
  for state, rows in ((beam, beams), (sampled, samples)):
    (went_on, batch_inputs, batch_state), = batch_search._go_on(sentences, inputs, state, live, ladder)
    assert list(went_on) == [30, 32, 35, -1]
    for row, old in enumerate([0, 2, 5]):
      assert (batch_inputs.src[row] == inputs.src[old]).all()
      new, before = slice(rows * row, rows * (row + 1)), slice(rows * old, rows * (old + 1))
      assert (batch_state.cache['keys'][new] == state.cache['keys'][before]).all()
      if rows == beams:
        assert (batch_state.sequences[row] == state.sequences[old]).all()
        assert batch_state.max_lengths[row] == state.max_lengths[old]
      else:
        assert (batch_state.sequences[new] == state.sequences[before]).all()
        assert (batch_state.finished[new] == state.finished[before]).all()
    # A padding row has no step left (beam) or its samples are finished: it never keeps the batch searching.
    if rows == beams:
      assert batch_state.max_lengths[3] == 0
    else:
      assert batch_state.finished[3 * rows:].all()


def test_the_ladder_has_a_few_shapes_that_hold_every_batch():
  # Catches rungs that break the token budget, rows that are not the ladder's, and batches that waste more than
  # the rung below them would.
  from flaxformer_nmt.decoding import ladder as ladder_lib  # pylint: disable=g-import-not-at-top
  ladder = ladder_lib.Ladder(tokens_per_batch=4096, max_position=1024)
  assert ladder.lengths == (32, 64, 128, 256, 512, 1024)
  assert ladder_lib.Ladder(4096, 80).lengths == (32, 64, 80)
  assert ladder_lib.Ladder(4096, 80, min_length=16).lengths == (16, 32, 64, 80)
  assert [ladder.length_for(n) for n in (1, 32, 33, 600, 5000)] == [32, 32, 64, 1024, 1024]
  for length in ladder.lengths:
    rows = ladder.rows(length)
    counted = length // 2 if length == ladder.lengths[0] else length  # the shortest rung's rows at half its length
    top = max(r for r in (2 ** e for e in range(13)) if r * counted <= 4096 or r == 1)
    assert rows[0] == top and rows[-1] == 1
    assert all(a == b * ladder_lib.ROW_RATIO or (b == 1 and a < ladder_lib.ROW_RATIO) for a, b in zip(rows, rows[1:]))
    for n in range(1, 3 * top + 2):
      batches = ladder.split(n, length)
      assert set(batches) <= set(rows) and 0 <= sum(batches) - n < batches[-1], (n, batches)
      assert (sum(batches) - n) * 2 <= batches[-1], (n, batches)  # at least half of a batch holds sentences
  assert ladder.rows(32) == (256, 32, 4, 1) and ladder.rows(64) == (64, 8, 1) and ladder.rows(1024) == (4, 1)
  assert ladder_lib.Ladder(4096, 80, min_length=16).rows(16) == (512, 64, 8, 1)
  assert ladder.split(150, 64) == [64, 64, 8, 8, 8] and ladder.split(20, 64) == [8, 8, 8]
  assert ladder_lib.Ladder(4096, 1024, row_multiple=2).rows(64) == (64, 8, 2)
  assert ladder_lib.Ladder(4096, 1024, row_multiple=2).rows(1024) == (4, 2)
  invariant = ladder_lib.Ladder(4096, 1024, min_rows=2)  # a batch-invariant search never runs one sentence alone
  assert invariant.rows(64) == (64, 8, 2) and invariant.rows(1024) == (4, 2) and invariant.split(1, 64) == [2]


def test_a_length_with_more_sentences_than_its_top_rung_pads_its_last_batch_to_it():
  # Catches a last batch in a row rung of its own where full batches of the length run anyway (a begin program
  # more per length for the rest of a file), and fewer sentences padded to the top rung (a lone sentence's
  # search then starts in 32 rows: twice its latency).
  from flaxformer_nmt.decoding import ladder as ladder_lib  # pylint: disable=g-import-not-at-top
  ladder = ladder_lib.Ladder(tokens_per_batch=512, max_position=1024)
  top = ladder.rows(32)[0]
  sentences = [[5] * 9 + [3]] * (2 * top + 3)  # 10 tokens: the length rung 32
  shapes = lambda n: [(src.shape, len(members)) for members, src in ladder.batches(sentences[:n])]
  assert shapes(2 * top + 3) == [((top, 32), top), ((top, 32), top), ((top, 32), 3)]
  assert shapes(top) == [((top, 32), top)]
  assert shapes(1) == [((1, 32), 1)] and shapes(3) == [((4, 32), 3)]  # split's rows

def test_a_source_is_padded_to_the_smallest_length_rung_that_holds_it():
  # Catches a rung one off at its edge: a source of exactly 32 tokens (EOS included) padded to 64.
  from flaxformer_nmt.decoding import ladder as ladder_lib  # pylint: disable=g-import-not-at-top
  ladder = ladder_lib.Ladder(tokens_per_batch=512, max_position=256)
  for n in (2, 31, 32, 33, 64, 65, 128, 129):
    expected = 32
    while expected < n:
      expected *= 2
    for sort_by_length in (True, False):
      ((members, src),) = ladder.batches([[5] * (n - 1) + [3]], sort_by_length)
      assert members == [0] and src.shape == (1, expected), (n, sort_by_length, src.shape)
  # In input order a batch holds at most the top rung of rows: 33 sentences at 32 rows, 32 and then 1.
  shapes = [(len(members), src.shape) for members, src in ladder.batches([[5] * 9 + [3]] * 33, False)]
  assert shapes == [(32, (32, 32)), (1, (1, 32))], shapes
  # A batch goes on in a rung strictly below its rows (rows 32, 4 and 1 at length 32), none below one row.
  assert ladder.rows(32) == (32, 4, 1) and [ladder.below(r, 32) for r in (32, 4, 1)] == [4, 1, 0]


def test_commands_keep_compiled_programs_in_the_user_cache(tmp_path):
  code = ('from flaxformer_nmt.runtime import cache; cache.use_compilation_cache(); import jax, jax.numpy as jnp; '
          'jax.jit(lambda x: jnp.tanh(x) @ x)(jnp.ones((8, 8))).block_until_ready(); '
          'print(jax.config.jax_compilation_cache_dir)')
  run = lambda env: subprocess.run([sys.executable, '-c', code], env=env, check=True, timeout=300,
                                   capture_output=True, text=True).stdout.strip()
  env = {**os.environ, 'FLAXFORMER_NMT_CACHE': str(tmp_path)}
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  # JAX's default minimum compile time (1 s) keeps no program this small: the test session's 0 must not stand in
  # for the command's own setting.
  env.pop('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', None)
  assert run(env) == str(tmp_path / 'jax_compilation')
  # Even a small program is kept (beside the folder of saved executables, made whatever JAX keeps).
  assert [p for p in (tmp_path / 'jax_compilation').iterdir() if p.name != 'executables']
  # A directory the user gives JAX is left to JAX.
  env['JAX_COMPILATION_CACHE_DIR'] = str(tmp_path / 'chosen')
  assert run(env) == str(tmp_path / 'chosen')


def test_mbr_chooses_among_the_n_best_in_the_api_the_cli_and_compare(workdir, translator, mixed, monkeypatch):
  from flaxformer_nmt.evaluation import compare
  from flaxformer_nmt.decoding import mbr  # pylint: disable=g-import-not-at-top
  candidates = translator.translate(mixed, beam_size=3, n_best=3)
  chosen = translator.translate(mixed, beam_size=3, n_best=3, mbr='chrf')
  assert chosen == [c[mbr.select(c, 'chrf')] for c in candidates]
  assert chosen != [c[0] for c in candidates]  # the toy's beams disagree: some choice is not the best-scored
  with pytest.raises(ValueError, match='n_best=1 must be at least 2'):
    translator.translate(mixed, beam_size=3, mbr='chrf')
  with pytest.raises(ValueError, match='n_best=2: greedy search gives one candidate'):  # not 'beam size (0)'
    translator.translate(mixed, beam_size=0, n_best=2)
  result = run_cli(['--beam_size=3', '--n_best=3', '--mbr=chrf'], workdir, stdin=''.join(s + '\n' for s in mixed))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split('\n')[:-1] == chosen and 'MBR by sentence chrf among 3 candidates' in result.stderr
  result = run_cli(['--beam_size=3', '--mbr=chrf'], workdir, stdin='a dog .\n')
  assert result.returncode != 0 and '--mbr writes one chosen translation per line' in result.stderr
  # compare scores the choices (the toy's outputs are too short for BLEU's 4-grams to tell, so its translations
  # are read on their way to the scorer)
  scored = []
  monkeypatch.setattr(translator, 'translate', lambda *a, **k: scored.append(decode.Translator.translate(
      translator, *a, **k)) or scored[-1])
  compare.score_row('latest', translator, mixed, mixed, None, 3, None, 'chrf', 3)
  assert scored == [chosen]


def test_contradicting_or_empty_search_options_are_refused_not_ignored(workdir, translator, mixed):
  # --greedy silently won over --beam_size=3, and a budget of 0 tokens silently meant the config's (0 is falsy).
  result = run_cli(['--greedy', '--beam_size=3'], workdir, stdin='a dog .\n')
  assert result.returncode != 0 and '--greedy and --beam_size=3' in result.stderr
  result = run_cli(['--tokens_per_batch=0'], workdir, stdin='a dog .\n')
  assert result.returncode != 0 and 'tokens_per_batch' in result.stderr and not result.stdout
  for budget in (0, -64, 2.5):
    with pytest.raises(ValueError, match=f'tokens_per_batch={budget} must be a whole number >= 1'):
      translator.translate(mixed, beam_size=2, tokens_per_batch=budget)


def test_dtype_float32_decodes_a_bfloat16_matmul_config_in_float32(workdir, translator, mixed, tmp_path):
  # A workdir trained on a bf16-dot CPU says matmul_precision 'bfloat16' (the recipes' 'auto' there): decoding it
  # rounds the operands, and --dtype=float32 must undo that, scoring exactly as the float32 config does.
  rounded = copy_with_config(workdir, tmp_path / 'rounded',
                             lambda config: config['model'].update(matmul_precision='bfloat16'))
  token_lists = translator.tokenizer.encode(mixed)
  scores = lambda t: [hyps[0][1] for hyps in t.search_tokens(token_lists, beam_size=2)]
  as_trained = scores(translator)
  assert scores(decode.Translator(rounded)) != as_trained  # bfloat16 operands move the log probabilities
  assert scores(decode.Translator(rounded, dtype='float32')) == as_trained


def _decode_on_two_devices(workdir, tmp_path, lines, args, xla_device_count=None):
  """The decode command (a fresh process, so that it can split the CPU) on `lines` with --devices=2 and `args`."""
  (tmp_path / 'in.en').write_text('\n'.join(lines) + '\n')
  xla_flags = conftest.xla_flags_without_device_count()
  if xla_device_count:
    xla_flags += f' --xla_force_host_platform_device_count={xla_device_count}'
  command = [sys.executable, '-m', 'flaxformer_nmt.decode', f'--workdir={workdir}', f'--input={tmp_path / "in.en"}',
             '--devices=2', '--tokens_per_batch=48', *args]
  return subprocess.run(command, env=conftest.subprocess_env(XLA_FLAGS=xla_flags.strip()), capture_output=True,
                        text=True, timeout=300)


@pytest.mark.slow  # a fresh process on two CPU devices compiles every search again: the suite's costliest test
def test_cli_on_two_devices_translates_each_line_as_one_device_does(workdir, translator, mixed, tmp_path):
  # --devices=2 splits the CPU in two and each batch's sentences over the halves: rows padded to an even count
  # (odd full batches of a small token budget, single sentences, a compacted batch's survivors), finished
  # sentences dropped between segments. Every line must keep its own translations and scores, as decoding on
  # one device in this process gives them; and the command must say it used two devices (else this compares
  # one device with itself).
  lines = mixed + mixed[::-1][:7]
  beams = _decode_on_two_devices(workdir, tmp_path, lines, ['--beam_size=3', '--n_best=2', '--format=fairseq'])
  assert beams.returncode == 0, beams.stderr[-3000:]
  assert 'on 2 cpu devices' in beams.stderr
  expected = translator.translate(lines, beam_size=3, n_best=2, tokens_per_batch=48, return_scores=True)
  written = [line.split('\t') for line in beams.stdout.split('\n') if line.startswith('D-')]
  assert [text for _, _, text in written] == [text for hyps in expected for text, _ in hyps]
  np.testing.assert_allclose([float(score) for _, score, _ in written],
                             [score for hyps in expected for _, score in hyps], atol=1e-3)
  # Where the CPU device count is fixed (XLA_FLAGS), more devices than it gives are refused, not silently fewer.
  refused = _decode_on_two_devices(workdir, tmp_path, lines, [], xla_device_count=1)
  assert refused.returncode == 1, refused.stderr[-2000:]
  assert 'devices=2: this process has 1 cpu device' in refused.stderr


@pytest.mark.slow  # 20 s more of a fresh process; the padding rows' keys come from line -1 (search_tokens)
def test_sampling_on_two_devices_draws_each_line_as_one_device_does(workdir, translator, mixed, tmp_path):
  lines = mixed + mixed[::-1][:7]
  samples = _decode_on_two_devices(workdir, tmp_path, lines, ['--sampling', '--top_k=4', '--seed=5'])
  assert samples.returncode == 0, samples.stderr[-3000:]
  assert 'on 2 cpu devices' in samples.stderr
  assert samples.stdout.split('\n')[:-1] == translator.translate(lines, sampling=True, top_k=4, seed=5)


def test_a_right_to_left_model_writes_its_output_back_in_reading_order(workdir, translator, mixed, tmp_path):
  # The same parameters read as a right-to-left model search the same token sequences; the translator turns
  # them around (EOS last) before anything reads them.
  r2l = decode.Translator(copy_with_config(workdir, tmp_path / 'r2l',
                                           lambda c: c.update(target_right_to_left=True)))
  tokens = translator.tokenizer.encode(translator.prepare(mixed))
  forward = translator.search_tokens(tokens, beam_size=3, n_best=2)
  backward = r2l.search_tokens(tokens, beam_size=3, n_best=2)
  assert [[(data_lib.reverse_before_eos(ids), s) for ids, s in hyps] for hyps in forward] == backward
  assert any(len(ids) > 2 for hyps in forward for ids, _ in hyps)
  with pytest.raises(ValueError, match='one order'):
    decode.Translator([str(workdir), str(tmp_path / 'r2l')])
  # Attention pictures teacher-force the pieces in the order the model wrote them: the same pass as the
  # left-to-right reading of the same parameters, under the reversed translation.
  sentences = ['a big dog runs .', 'the cat sleeps .']
  maps = zip(visualize.attention_maps(translator, sentences, beam_size=2),
             visualize.attention_maps(r2l, sentences, beam_size=2), r2l.translate(sentences, beam_size=2))
  for ltr, rtl, reading in maps:
    assert rtl['target_pieces'] == ltr['target_pieces'] and rtl['translation'] == reading
    np.testing.assert_allclose(rtl['cross'], ltr['cross'], atol=1e-6)
  from flaxformer_nmt.serving import ctranslate2 as export  # pylint: disable=g-import-not-at-top
  with pytest.raises(export.ExportError, match='right to left'):
    export.export_ctranslate2(tmp_path / 'r2l', tmp_path / 'ct2')


def test_teacher_forced_scores_equal_the_search_and_reverse_for_a_right_to_left_model(workdir, translator, mixed,
                                                                                       tmp_path):
  from flaxformer_nmt.decoding import rerank  # pylint: disable=g-import-not-at-top
  tokens = translator.tokenizer.encode(translator.prepare(mixed))
  hyps = translator.search_tokens(tokens, beam_size=3, n_best=3, alpha=0.6)
  pairs = [(tokens[i], ids, score) for i, h in enumerate(hyps) for ids, score in h if ids]
  forced = rerank.score_pairs(translator, [s for s, _, _ in pairs], [t for _, t, _ in pairs])
  # The beam's score is log P / ((5 + n) / 6)^0.6 with n the tokens through EOS, from the cached step-by-step
  # decoder; teacher forcing computes log P again in one pass.
  searched = [score * ((5 + len(ids)) / 6) ** 0.6 for _, ids, score in pairs]
  np.testing.assert_allclose(forced, searched, rtol=1e-4, atol=1e-4)
  # Independently of the search: a sum of each token's log softmax, one sentence at a time (no batching).
  model, params = translator.model, translator.params
  for (src, ids, _), score in list(zip(pairs, forced))[:2]:
    logits = model.apply({'params': params}, jnp.asarray([src]), jnp.asarray([[BOS_ID] + ids[:-1]]))
    log_probs = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)))
    np.testing.assert_allclose(score, sum(log_probs[t, token] for t, token in enumerate(ids)), rtol=1e-4)
  # A right-to-left model (the same parameters) scores a candidate as the other reads it turned around.
  r2l = decode.Translator(copy_with_config(workdir, tmp_path / 'r2l',
                                           lambda c: c.update(target_right_to_left=True)))
  turned = rerank.score_pairs(r2l, [s for s, _, _ in pairs], [data_lib.reverse_before_eos(t) for _, t, _ in pairs])
  np.testing.assert_allclose(turned, forced, rtol=1e-5, atol=1e-5)
  assert beam_search.length_penalty(7, 0.6) == ((5 + 7) / 6) ** 0.6
  # A pair past the position table is refused (the lookup would clamp to its last row: a wrong score, silently).
  positions = translator.model.config.max_position
  with pytest.raises(ValueError, match=f'{positions + 1} tokens is longer than the scoring model\'s {positions}'):
    rerank.score_pairs(translator, [tokens[0], [5] * positions + tokens[0][-1:]], [pairs[0][1]] * 2)


def test_rerank_scores_divide_the_rescore_by_the_gnmt_penalty_of_the_length_with_eos(monkeypatch):
  """combined = (1 - w) * search score + w * log Q / ((5 + n) / 6)^alpha, n the candidate's tokens with EOS,
  written out per candidate; the rescores are given (score_pairs is checked above), chosen to flip the choice."""
  from flaxformer_nmt.decoding import rerank  # pylint: disable=g-import-not-at-top
  candidates = [[([5, 6, 7, 8, 9, 10, 11, 12, 13, 3], -1.0), ([5, 3], -1.2)], [([], 0.0), ([], 0.0)],
                [([6, 3], -0.5), ([6, 7, 3], -0.7)]]
  given = {(5, 6, 7, 8, 9, 10, 11, 12, 13, 3): -2.0, (5, 3): -1.5, (6, 3): -1.7, (6, 7, 3): -1.9}
  monkeypatch.setattr(rerank, 'score_pairs', lambda _, sources, targets: np.array([given[tuple(t)] for t in targets]))
  alpha = 1.0
  reranker = rerank.Reranker(None, [[4, 3], [], [4, 3]], candidates, alpha)
  for weight in (0.0, 0.3, 0.7, 1.0):
    expected_choice = []
    for i, hyps in enumerate(candidates):
      combined = []
      for k, (ids, score) in enumerate(hyps):
        if ids:
          combined.append((1 - weight) * score + weight * given[tuple(ids)] / ((5 + len(ids)) / 6) ** alpha)
          np.testing.assert_allclose(rerank.combined_scores(reranker.search_scores, reranker.rescores, reranker.lengths,
                                                            weight, alpha)[i, k], combined[-1], rtol=1e-12)
      expected_choice.append(int(np.argmax(combined)) if combined else 0)
    assert list(reranker.choose(weight)) == expected_choice, weight
  assert list(reranker.choose(1.0)) == [0, 0, 1]  # the penalty decides sentence 0: -2 / 2.5 beats -1.5 / (7 / 6)


def test_reranking_chooses_by_the_weighted_sum_in_the_api_and_compare(workdir, translator, mixed, tmp_path):
  from flaxformer_nmt import compare  # pylint: disable=g-import-not-at-top  (the command)
  from flaxformer_nmt.decoding import rerank  # pylint: disable=g-import-not-at-top
  r2l = decode.Translator(copy_with_config(workdir, tmp_path / 'r2l',
                                           lambda c: c.update(target_right_to_left=True)))
  _, translations = rerank.rerank_sources(translator, r2l, mixed, beam_size=3, alpha=1.0)
  tokens = translator.tokenizer.encode(translator.prepare(mixed))
  candidates = translator.search_tokens(tokens, beam_size=3, n_best=3, alpha=1.0)  # [(ids, log P / lp)]
  text = translator.tokenizer.decode
  assert translations(0.0) == [text(hyps[0][0]) for hyps in candidates]  # the search's own choice
  # The rescorer's log probability of every (source, candidate) pair, in one call (score_pairs itself is checked
  # against the search and a plain sum above).
  pairs = [(source, ids) for source, hyps in zip(tokens, candidates) for ids, _ in hyps if ids]
  rescored = dict(zip(map(repr, pairs), rerank.score_pairs(r2l, [s for s, _ in pairs], [t for _, t in pairs])))
  expected = {}
  for weight in (0.5, 1.0):
    expected[weight] = []
    for source, hyps in zip(tokens, candidates):
      if not hyps[0][0]:  # an empty line
        expected[weight].append('')
        continue
      best, best_score = None, -np.inf
      for ids, score in hyps:  # written out: the combined score of each candidate, the highest kept
        rescore = rescored[repr((source, ids))] / ((5 + len(ids)) / 6) ** 1.0
        combined = (1 - weight) * score + weight * rescore
        if combined > best_score:
          best, best_score = text(ids), combined
      expected[weight].append(best)
    assert translations(weight) == expected[weight]
  assert expected[1.0] != translations(0.0)  # the rescorer changes some choice: the weight is used
  with pytest.raises(ValueError, match='between 0'):
    translations(1.5)
  result = run_cli([f'--rerank_workdir={tmp_path / "r2l"}', '--rerank_weight=0.5', '--beam_size=3', '--alpha=1'],
                   workdir, stdin=''.join(s + '\n' for s in mixed))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split('\n')[:-1] == expected[0.5] and 'reranked with' in result.stderr
  result = run_cli([f'--rerank_workdir={tmp_path / "r2l"}', '--greedy'], workdir, stdin='a dog .\n')
  assert result.returncode != 0 and 'not with --mbr, --sampling, greedy search' in result.stderr
  result = in_process.run(compare, ['--workdir', str(workdir), '--checkpoints', 'latest', '--input',
                                      str(workdir.parent / 'data' / 'valid.en'), '--ref',
                                      str(workdir.parent / 'data' / 'valid.de'), '--beam_size', '3',
                                      '--rerank_workdir', str(tmp_path / 'r2l'), '--rerank_weight', '0,1'])
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [line for line in result.stdout.splitlines() if 'reranked by' in line]
  assert len(rows) == 2 and 'w=0 |' in rows[0] and 'w=1 |' in rows[1]
  assert 'sacreBLEU nrefs:1' in result.stdout


def test_the_trainers_validation_bleu_reads_a_right_to_left_model_in_reading_order(workdir, tmp_path):
  # The in-training greedy search of a right-to-left model turns its rows around as the translator does (at
  # first it decoded the reversed rows whole, PAD included: every hypothesis came out empty).
  from flaxformer_nmt.training import validation as bleu_eval
  from flaxformer_nmt.runtime import sharding
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  r2l_dir = copy_with_config(workdir, tmp_path / 'r2l', lambda c: c.update(target_right_to_left=True))
  r2l = decode.Translator(r2l_dir)
  config = workdir_lib.load_config(r2l_dir)
  config.eval_bleu_every_steps, config.eval_bleu_max_sentences = 1, 12
  validation = bleu_eval.ValidationBleu(config, r2l.tokenizer, r2l_dir, sharding.make_mesh(devices=jax.devices()[:1]))
  sources = (workdir.parent / 'data' / 'valid.en').read_text().splitlines()[:12]
  expected = r2l.translate(sources, beam_size=0)
  assert validation.translate(r2l.params) == expected
  assert sum(len(t.split()) > 1 for t in expected) > 6


def test_beam_step_zero_on_one_row_and_greedy_without_its_normalizer_change_no_output(translator, mixed, monkeypatch):
  # Catches a first beam step on one row per sentence that differs from the step on all K rows (its candidates,
  # their beams, the cache slots the beams read), and a greedy pick that changes when the log-softmax's
  # normalizer is skipped.
  members, src = next(translator.ladder(256).batches(translator.tokenizer.encode(mixed), sort_by_length=False))
  search = lambda **options: jax.device_get(jax.jit(functools.partial(
      search_lib.search, translator.model, **options))(translator.params, src))
  options = dict(beam_size=3, alpha=0.6, extra_length=10)
  one_row = search(**options)
  monkeypatch.setattr(beam_search, 'beam_first_step', beam_search.beam_step)
  every_row = search(**options)
  np.testing.assert_array_equal(one_row[0], every_row[0])
  np.testing.assert_allclose(one_row[1], every_row[1], rtol=1e-6)
  assert (one_row[1][:len(members)] > -1e8).all()  # real hypotheses, not empty slots compared
  greedy = dict(beam_size=0, alpha=0.0, extra_length=10)
  np.testing.assert_array_equal(search(**greedy, scores=False)[0], search(**greedy)[0])


def test_after_the_ladder_warm_up_inputs_of_any_size_compile_no_program(workdir, monkeypatch):
  # Catches programs whose shapes depend on the input (a batch, source or cache shape off the ladder, an eager
  # operation on the host's side of the segments) and a warm-up that misses some of the ladder's programs.
  from flaxformer_nmt.runtime import cache  # pylint: disable=g-import-not-at-top
  translator = decode.Translator(workdir)
  options = dict(beam_size=3, min_len=2, tokens_per_batch=64)  # options no other test searches with
  with cache.ProgramCounter() as warm_up:
    count = translator.warm_up_ladder(max_source_length=40, **options)
  assert len(warm_up.names) == count and set(warm_up.names) == {'jit(_begin)', 'jit(_segment)'}, warm_up.names
  # A begin program per row rung of each source length up to 40 tokens' (64), and a segment program per row rung
  # of each cache length up to the longest search's: 64 positions of source + max_decode_extra_length.
  ladder = translator.ladder(options['tokens_per_batch'])
  longest = min(64 + translator.config.max_decode_extra_length, ladder.max_position)
  rungs = lambda top: sum(len(ladder.rows(c)) for c in ladder.lengths if c <= top)
  assert count == rungs(64) + rungs(next(c for c in ladder.lengths if c >= longest)), count
  shapes = []
  for name in ('_begin_jit', '_segment_jit'):
    program = getattr(batch_search, name)
    monkeypatch.setattr(batch_search, name, lambda model, params, src_or_inputs, *a, _p=program, _n=name, **k: (
        shapes.append((_n, *np.shape(getattr(src_or_inputs, 'src', src_or_inputs)))) or _p(
            model, params, src_or_inputs, *a, **k)))
  words = 'a big dog runs . the small red cat sleeps . a man sees the ball .'.split()
  one = ['a dog .']
  lines = [' '.join((words * 4)[:n]) for n in range(1, 50)]
  many = [line for line, ids in zip(lines, translator.tokenizer.encode(lines)) if len(ids) <= 40] * 3
  for sentences in (one, many):
    with cache.ProgramCounter() as search:
      translator.translate(sentences, **options)
    assert search.names == [], search.names
  ladder = translator.ladder(options['tokens_per_batch'])
  assert {(rows, length) for _, rows, length in shapes} <= {(r, c) for c in ladder.lengths for r in ladder.rows(c)}
  assert len({length for name, _, length in shapes if name == '_begin_jit'}) >= 2, shapes  # 32 and 64


def test_compare_scores_the_beams_best_translations_as_decode_gives_them(workdir, translator, mixed, tmp_path):
  # Catches compare asking the search for the beam's n best without --mbr: each row then scores lists of candidates
  # (a TypeError traceback after the whole decode; only --beam_size=0 and --mbr rows ran in the default suite).
  import sacrebleu  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import compare  # pylint: disable=g-import-not-at-top  (the command)
  sources = [line for line in mixed if line]
  (tmp_path / 'in.en').write_text(''.join(line + '\n' for line in sources))
  (tmp_path / 'ref.de').write_text(''.join(line + '\n' for line in sources))
  result = in_process.run(compare, ['--workdir', str(workdir), '--checkpoints', 'latest', '--beam_size=3',
                                    '--alpha=1', '--input', str(tmp_path / 'in.en'), '--ref', str(tmp_path / 'ref.de')])
  assert result.returncode == 0, result.stderr[-3000:]
  (row,) = [[cell.strip() for cell in line.split('|')[1:-1]] for line in result.stdout.splitlines()
            if line.startswith('| latest |')]
  bleu = sacrebleu.corpus_bleu(translator.translate(sources, beam_size=3, alpha=1.0), [sources])
  assert [float(row[3]), float(row[5])] == pytest.approx([bleu.score, bleu.sys_len / bleu.ref_len], abs=0.0051)


def test_cli_warmup_compiles_what_the_translation_then_runs(workdir):
  # Catches a --warmup that compiles the ladder for other options than the command then searches with (the
  # command's log counts the programs its translation still had to compile or load).
  result = run_cli(['--warmup', '--warmup_max_length=12', '--greedy', '--tokens_per_batch=32'], workdir,
                   stdin='a dog .\nthe small red cat sleeps .\n')
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'Warm-up: \d+ search programs', result.stderr), result.stderr[-2000:]
  assert 'Programs: 0 compiled, 0 loaded' in result.stderr, result.stderr[-2000:]


def test_commands_refuse_empty_files_nan_alphas_and_bad_checkpoint_names_up_front(workdir, tmp_path):
  from flaxformer_nmt import compare  # pylint: disable=g-import-not-at-top  (the command)
  from flaxformer_nmt import evaluate as evaluate_command  # pylint: disable=g-import-not-at-top  (the command)
  empty, one = tmp_path / 'empty', tmp_path / 'one'
  empty.write_text('')
  one.write_text('a dog .\n')
  # sacreBLEU raised IndexError on no lines; a wrong checkpoint name came after the rows before it were decoded.
  result = in_process.run(evaluate_command, [f'--hyp={empty}', f'--ref={empty}'])
  assert result.returncode == 1 and 'no lines to score' in result.stderr, result.stderr[-2000:]
  common = ['--workdir', str(workdir), '--input', str(one), '--ref', str(one)]
  result = in_process.run(compare, common + ['--checkpoints', 'latest,lst:10'])
  assert result.returncode == 1 and "'lst:10' is none of" in result.stderr and '| latest' not in result.stdout
  for args, message in ((['--input', str(empty), '--ref', str(empty)], 'no lines to translate'),
                        (common[2:] + ['--alpha', 'nan'], 'are finite numbers')):
    result = in_process.run(compare, common[:2] + ['--checkpoints', 'latest'] + args)
    assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
  result = run_cli(['--alpha=nan'], workdir, stdin='a dog .\n')  # wrote empty lines
  assert result.returncode == 1 and 'alpha=nan must be a finite number' in result.stderr


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full')
def test_a_begin_program_loaded_from_disk_feeds_a_segment_program_traced_afresh(translator, mixed, tmp_path):
  # A program loaded from its saved executable returns arrays laid out as it was compiled: a segment program
  # traced for them refuses them (its while loop's carry "layouts do not match") unless the host reads them
  # back first, as it reads every program's.
  before = executables.directory()
  executables.enable(tmp_path / 'executables')
  try:
    executables.clear()
    expected = translator.translate(mixed)  # compiled and saved
    segments = list((tmp_path / 'executables').glob('*/_segment-*.executable'))
    assert segments and list((tmp_path / 'executables').glob('*/_begin-*.executable'))
    for path in segments:
      path.unlink()
    executables.clear()
    assert translator.translate(mixed) == expected
  finally:
    executables.enable(before)
    executables.clear()


def test_a_failed_write_names_the_output_and_a_closed_pipe_stops_quietly(workdir, translator, tmp_path):
  result = run_cli(['--output=/dev/full'], workdir, stdin='a dog .\n')
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == 'error: /dev/full: [Errno 28] No space left on device'
  source = tmp_path / 'in.en'
  source.write_text('a dog .\n' * 200)
  first, returncode, stderr = first_line_then_close(
      decode_command, [f'--workdir={workdir}', f'--input={source}', '--buffer_lines=1', '--verbosity=-1'], '')
  assert first == translator.translate(['a dog .'])[0] + '\n'
  assert returncode == 1 and not re.search('error|Traceback', stderr), stderr[-3000:]


def test_references_of_two_line_counts_stop_a_decode_from_stdin_before_translating(workdir, tmp_path):
  reference, tokenized = tmp_path / 'ref.de', tmp_path / 'ref.tok.de'
  reference.write_text('ein hund .\nder hund .\n')
  tokenized.write_text('ein hund .\nder hund .\neine katze .\n')
  result = run_cli([f'--reference={reference}', f'--tok_reference={tokenized}'], workdir,
                   stdin='a dog .\nthe dog .\n')
  assert result.returncode == 1 and result.stdout == '', result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (f'error: --tok_reference {tokenized} has 3 lines but '
                                                    f'--reference {reference} has 2')


def test_a_bad_line_in_the_first_chunk_leaves_the_output_file_as_it_was(workdir, tmp_path):
  source, out = tmp_path / 'in.en', tmp_path / 'out.de'
  source.write_bytes(b'a dog .\n\xff bad\nthe cat .\n')
  out.write_text('earlier translations\n')
  result = run_cli([f'--input={source}', f'--output={out}'], workdir)
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == f'error: {source}:2: invalid UTF-8 (invalid start byte at byte 0)'
  assert out.read_text() == 'earlier translations\n'
