"""One tiny run per language-model task: train, checkpoint, resume exactly, then generate / fill masks through
the CLI and the Python API, and draw self-attention; and the monolingual corpora they read."""
import pathlib
import re

import jax
import numpy as np
import pytest

import in_process
from conftest import first_line_then_close, small_config, write_toy_corpus
from flaxformer_nmt import fill_mask as fill_mask_command
from flaxformer_nmt import generate as generate_command
from flaxformer_nmt.data import corpora
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.decoding import fill_mask
from flaxformer_nmt.decoding import generator as generate
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import attention as visualize
from flaxformer_nmt.training import loop as train
from flaxformer_nmt.training import warm_start


def lm_config(toy_corpus, task):
  config = small_config(toy_corpus)
  config.task = task
  config.label_smoothing = 0.0
  config.num_train_steps = 10
  config.checkpoint_every_steps = 5
  config.eval_every_steps = 5
  config.length_buckets = (16,)
  return config


def run_cli(module, *args, stdin=None, as_subprocess=False):
  """The command's output lines: its main in this process, or `python -m` (in_process.run)."""
  result = in_process.run(module, list(args), stdin, as_subprocess=as_subprocess)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout.splitlines()


def assert_resumes_exactly(config, tmp_path):
  """Train to 10 steps, resume to 15; a straight 15-step run gives the same parameters."""
  metrics = train.train_and_evaluate(config, tmp_path / 'run')
  config.num_train_steps = 15
  train.train_and_evaluate(config, tmp_path / 'run')
  train.train_and_evaluate(config, tmp_path / 'straight')
  for a, b in zip(jax.tree_util.tree_leaves(decode.load_params(tmp_path / 'run', '15')[0]),
                  jax.tree_util.tree_leaves(decode.load_params(tmp_path / 'straight', '15')[0])):
    np.testing.assert_array_equal(a, b)
  return metrics


def trained_run(tmp_path_factory, task):
  """(workdir, metrics) of a tiny run of `task` on the toy corpus, its resume checked (assert_resumes_exactly)."""
  root = tmp_path_factory.mktemp(task)
  metrics = assert_resumes_exactly(lm_config(write_toy_corpus(root / 'data'), task), root)
  return str(root / 'run'), metrics


@pytest.fixture(scope='module')
def lm_run(tmp_path_factory):
  return trained_run(tmp_path_factory, 'lm')


@pytest.fixture(scope='module')
def mlm_run(tmp_path_factory):
  return trained_run(tmp_path_factory, 'mlm')


def last_error(result):
  """A command's error line (the last line on stderr), after checking it failed and printed nothing."""
  assert result.returncode != 0 and result.stdout == ''
  return result.stderr.strip().splitlines()[-1]


def test_language_model_trains_resumes_and_generates(lm_run, tmp_path):
  workdir, metrics = lm_run
  assert np.isfinite(metrics['eval/perplexity']) and metrics['train/source_tokens_per_second'] == 0
  lines = run_cli(generate_command, f'--workdir={workdir}', '--prompt=ein grosser', '--prompt=der',
                  '--num_samples=2', '--max_new_tokens=6', '--seed=3', '--top_p=0.9', as_subprocess=True)
  assert len(lines) == 4 and all(l.startswith('ein grosser') for l in lines[:2]) and lines[2].startswith('der')
  generator = generate.Generator(workdir)
  assert generator.generate(['ein grosser', 'der'], num_samples=2, max_new_tokens=6, seed=3, top_p=0.9) == [
      lines[:2], lines[2:]]
  # stdin: one prompt a line, the same continuations as --prompt (sample j of prompt i: seed, i, j).
  assert run_cli(generate_command, f'--workdir={workdir}', '--num_samples=2', '--max_new_tokens=6',
                 '--seed=3', '--top_p=0.9', stdin='ein grosser\nder\n') == lines
  greedy = generator.generate(['ein'], greedy=True, max_new_tokens=8)[0][0]
  assert generator.generate(['ein'], greedy=True, max_new_tokens=8, use_cache=False)[0][0] == greedy
  maps = visualize.self_attention_maps(workdir, ['ein grosser hund'])
  weights = maps[0]['self']  # [layers, heads, T, T], causal: nothing above the diagonal
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  assert np.all(np.triu(weights, 1) == 0)
  assert len(visualize.write_self_attention_pictures(maps, tmp_path / 'pictures')) == 2


def test_masked_language_model_trains_resumes_and_fills_masks(mlm_run):
  workdir, metrics = mlm_run
  assert 0 <= metrics['eval/accuracy'] <= 1 and np.isfinite(metrics['eval/perplexity'])
  tokenizer = tokenizer_lib.Tokenizer(f'{workdir}/vocab.model')
  assert tokenizer.mask_id == 4  # the user-defined piece right after the reserved ids
  lines = run_cli(fill_mask_command, f'--workdir={workdir}', '--top_k=3', 'ein <mask> hund <mask> .',
                  as_subprocess=True)
  assert lines[0] == 'ein <mask> hund <mask> .' and lines[1] == '  mask 1/2' and lines[5] == '  mask 2/2'
  probabilities = [float(line.split()[0]) for line in lines[2:5]]
  assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0 + 1e-4
  filler = fill_mask.FillMask(workdir)
  result = filler.fill(['ein <mask> hund <mask> .'], top_k=3)[0]
  assert [round(p, 4) for _, p, _ in result[0]] == probabilities
  # The probabilities against a NumPy softmax of the model's logits at each mask over the whole vocabulary,
  # the text unpadded: catches a softmax over the wrong axis or part of the vocabulary, a temperature, logits
  # read at another position, or padding that leaks into the real positions.
  ids = filler.encode('ein <mask> hund <mask> .')
  logits = np.asarray(filler.model.apply({'params': filler.params}, np.array([ids], np.int32), True), np.float64)[0]
  softmax = np.exp(logits - logits.max(-1, keepdims=True))
  softmax /= softmax.sum(-1, keepdims=True)
  positions = [i for i, t in enumerate(ids) if t == filler.mask_id]
  for position, candidates, filled in zip(positions, filler.predict_ids([ids], top_k=3)[0], result):
    # Each piece's probability is the softmax's for that piece, and they are the 3 largest (in order).
    np.testing.assert_allclose([p for _, p in candidates], [softmax[position, i] for i, _ in candidates],
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([p for _, p in candidates], np.sort(softmax[position])[::-1][:3], rtol=1e-4,
                               atol=1e-6)
    assert [piece for piece, _, _ in filled] == [filler.tokenizer.decode([i]) for i, _ in candidates]
  # The text with the first mask filled and the second left as it was.
  assert result[0][0][2].startswith('ein') and result[0][0][2].endswith('hund <mask> .')
  assert result[0][0][2].count('<mask>') == 1
  with pytest.raises(ValueError, match="^text 2: no <mask> in 'ein hund'$"):
    filler.fill(['ein <mask> .', 'ein hund'])
  maps = visualize.self_attention_maps(workdir, ['ein <mask> hund .'])
  np.testing.assert_allclose(maps[0]['self'].sum(-1), 1.0, atol=1e-5)
  assert '<mask>' in maps[0]['pieces']


def test_generate_prints_each_prompt_as_given_then_its_continuation(lm_run):
  """Rule: an output line is the prompt as typed (a character outside the vocabulary kept, not decoded to ⁇),
  then a space where the continuation's first piece starts a word, then the continuation decoded alone."""
  workdir, _ = lm_run
  prompts = ['ein 😀 Hund', 'der', 'ein gros']
  lines = run_cli(generate_command, f'--workdir={workdir}', *(f'--prompt={p}' for p in prompts), '--greedy',
                  '--max_new_tokens=5')
  generator = generate.Generator(workdir)
  ids = generator.generate_ids(generator.encode_prompt(prompts), greedy=True, max_new_tokens=5)
  assert len(lines) == 3 and lines[0].startswith('ein 😀 Hund')
  for prompt, line, [new] in zip(prompts, lines, ids):
    assert new, 'an empty continuation tests no joining'
    space = ' ' if generator.tokenizer.sp.id_to_piece(new[0]).startswith('\u2581') else ''
    assert line == prompt + space + generator.tokenizer.sp.decode(new)
  assert generator.generate(prompts, greedy=True, max_new_tokens=5) == [[line] for line in lines]


def test_generate_samples_the_same_lines_whatever_prompts_per_batch(lm_run):
  """Rule: sample j of prompt i depends only on --seed, i and j, so --prompts_per_batch=1 prints what one batch of
  all prompts does; the same text as prompt 1 and 3 is sampled differently (its own prompt number)."""
  workdir, _ = lm_run
  args = [f'--workdir={workdir}', '--prompt=ein', '--prompt=der', '--prompt=ein', '--num_samples=2',
          '--max_new_tokens=8', '--seed=5', '--temperature=3.0']
  lines = run_cli(generate_command, *args)
  assert len(lines) == 6 and lines[:2] != lines[4:]
  assert run_cli(generate_command, *args, '--prompts_per_batch=1') == lines


def test_generate_refuses_a_too_long_prompt_by_its_line_before_generating(lm_run, tmp_path):
  """Rule: BOS + prompt + --max_new_tokens must fit the model's 1024 positions; the error names the input line
  and the real token count, and nothing is generated first. --prompts_per_batch must be at least 1."""
  workdir, _ = lm_run
  generator = generate.Generator(workdir)
  long = 'ein grosser hund ' * 20
  count = len(generator.tokenizer.sp.encode(long))
  path = tmp_path / 'prompts.txt'
  path.write_text(f'ein\n\nder\n{long}\n')
  result = in_process.run(generate_command, [f'--workdir={workdir}', f'--input={path}', '--prompts_per_batch=1',
                                             f'--max_new_tokens={1024 - count}', '--greedy'])
  assert last_error(result) == (f'error: {path}:4: BOS + {count} prompt tokens + {1024 - count} new tokens '
                                "(--max_new_tokens) exceed the model's 1024 positions")
  result = in_process.run(generate_command, [f'--workdir={workdir}', '--prompt=ein', f'--prompt={long}',
                                             f'--max_new_tokens={1024 - count}'])
  assert last_error(result).startswith(f'error: --prompt number 2: BOS + {count} prompt tokens')
  result = in_process.run(generate_command, [f'--workdir={workdir}', '--prompt=ein', '--prompts_per_batch=0'])
  assert last_error(result) == 'error: --prompts_per_batch=0: give at least 1'


@pytest.mark.parametrize('flag, message', [
    ('--temperature=0', '--temperature=0.0: give above 0'),
    ('--top_p=1.5', '--top_p=1.5: give above 0 and at most 1'),
    ('--seed=2147483648', '--seed=2147483648: give an integer from -2147483648 to 2147483647'),
])
def test_generate_names_a_bad_sampling_flag_whatever_its_input(lm_run, flag, message):
  """Rule: a generation flag outside its range is one error line naming the flag as typed on the command line,
  and a failure, also where the input holds no prompt."""
  workdir, _ = lm_run
  for stdin in ('ein\n', ''):
    result = in_process.run(generate_command, [f'--workdir={workdir}', flag, '--max_new_tokens=2'], stdin)
    assert last_error(result) == f'error: {message}'


def test_fill_mask_checks_every_text_before_printing_and_names_its_line(mlm_run, tmp_path):
  """Rule: a text without <mask> or over the model's positions is an error naming its input line (blank lines
  counted) and its real token count, before any text is printed; --top_k is at most the vocabulary's size."""
  workdir, _ = mlm_run
  filler = fill_mask.FillMask(workdir)
  path = tmp_path / 'texts.txt'
  path.write_text('ein <mask> hund .\n \t\n' * 150 + 'ein hund .\n')  # line 301, after 150 texts and blanks
  result = in_process.run(fill_mask_command, [f'--workdir={workdir}', f'--input={path}'])
  assert last_error(result) == f"error: {path}:301: no <mask> in 'ein hund .'"
  long = 'ein <mask> ' + 'grosser hund ' * 500
  count = len(filler.encode(long))
  assert count > 1024
  path.write_text(f'ein <mask> .\n{long}\n')
  result = in_process.run(fill_mask_command, [f'--workdir={workdir}', f'--input={path}'])
  assert last_error(result) == f"error: {path}:2: {count} tokens (EOS included) exceed the model's 1024 positions"
  vocabulary = filler.tokenizer.vocab_size
  result = in_process.run(fill_mask_command, [f'--workdir={workdir}', f'--top_k={vocabulary + 1}', 'ein <mask> .'])
  assert last_error(result) == f"error: --top_k={vocabulary + 1}: give 1 to {vocabulary} (the vocabulary's size)"
  # The whole vocabulary: probabilities that sum to one.
  everything = filler.fill(['ein <mask> .'], top_k=vocabulary)[0][0]
  assert len(everything) == vocabulary and abs(sum(p for _, p, _ in everything) - 1) < 1e-4
  for top_k in (0, vocabulary + 1):
    with pytest.raises(ValueError, match=f'^top_k={top_k}: give 1 to {vocabulary}'):
      filler.fill(['ein <mask> .'], top_k=top_k)


def test_fill_mask_writes_the_text_around_each_mask_as_given(mlm_run):
  """The filled text keeps the text's own characters around the mask: written back from its ids, a character the
  vocabulary lacks (here a snowman) came back as ⁇. A piece that starts a word follows a space; any other piece
  continues the word before the mask."""
  workdir, _ = mlm_run
  filler = fill_mask.FillMask(workdir)
  text = 'ein \u2603 <mask> hund <mask> .'
  assert filler.tokenizer.sp.unk_id() in filler.encode(text)  # the snowman is not in the vocabulary
  candidates = filler.predict_ids([filler.encode(text)], top_k=8)[0]
  result = filler.fill([text], top_k=8)[0]
  for m, (before, after) in enumerate([('ein \u2603', ' hund <mask> .'), ('ein \u2603 <mask> hund', ' .')]):
    for (piece, _), (_, _, filled) in zip(candidates[m], result[m]):
      raw = filler.tokenizer.sp.id_to_piece(piece)
      word = ' ' + raw[1:] if raw.startswith('\u2581') else filler.tokenizer.decode([piece])
      assert filled == before + word + after, (raw, filled)


def test_fill_mask_reads_each_mask_as_one_whole_piece(mlm_run):
  """Rule: a <mask> stands for one piece, word start included, as the pieces masked in training did: a text's ids
  are those of its words around the masks, each mask id in its word's place and no lone word-start piece before
  it (which the model never saw in front of a mask)."""
  workdir, _ = mlm_run
  filler = fill_mask.FillMask(workdir)
  encode = filler.tokenizer.sp.encode
  expected = encode('ein') + [filler.mask_id] + encode('hund') + [filler.mask_id] + encode('.') + [tokenizer_lib.EOS_ID]
  assert filler.encode('ein <mask> hund <mask> .') == expected
  assert filler.encode('<mask> hund .') == [filler.mask_id] + encode('hund .') + [tokenizer_lib.EOS_ID]


def np_first_layer_self_attention(params, ids, stack, pre_layer_norm, heads):
  """Each head's weights [T, T] of layer 0's self-attention over `ids`, in NumPy (test_against_numpy's layers):
  causal in a decoder, bidirectional in an encoder."""
  from test_against_numpy import np_layer_norm, np_positions, np_self_attention  # pylint: disable=g-import-not-at-top
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  embedding = p['shared_embedding']['embedding']
  x = embedding[ids] * np.sqrt(embedding.shape[1]) + np_positions(len(ids), embedding.shape[1])
  layer = p[f'{stack}_0']
  if pre_layer_norm:
    x = np_layer_norm(x, layer['self_block' if stack == 'decoder' else 'attention_block']['norm'])
  allowed = np.tril(np.ones((len(ids),) * 2, bool)) if stack == 'decoder' else np.ones((len(ids),) * 2, bool)
  weights = []
  np_self_attention(x, layer['self_attention'], allowed, heads, weights)
  return np.stack(weights)


def test_self_attention_maps_are_the_numpy_attention_of_the_text_as_the_model_reads_it(lm_run, mlm_run):
  """Layer 0's self-attention drawn for a language model against NumPy from its parameters: the LM's over BOS +
  the text (causal), the MLM's over the text with its <mask>s + EOS; a piece per row and column, padding cropped
  (two texts of different lengths). Catches BOS left out, labels a piece off, padding rows or columns kept."""
  for (workdir, _), runner_class, stack, texts in (
      (lm_run, generate.Generator, 'decoder', ['ein grosser hund', 'der']),
      (mlm_run, fill_mask.FillMask, 'encoder', ['ein <mask> hund .', 'der <mask>'])):
    runner = runner_class(workdir)
    maps = visualize.self_attention_maps(workdir, texts)
    for m, text in zip(maps, texts):
      if stack == 'decoder':
        ids = [tokenizer_lib.BOS_ID] + runner.tokenizer.sp.encode(text)
      else:
        ids = runner.encode(text)  # <mask> pieces and EOS, as the fill-mask test checks
      assert (m['text'], m['stack'], m['pieces']) == (text, stack, [runner.tokenizer.sp.id_to_piece(i) for i in ids])
      config = runner.config.model
      want = np_first_layer_self_attention(runner.params, ids, stack, config.pre_layer_norm, config.num_heads)
      assert m['self'].shape == (1,) + want.shape  # small_config: one layer
      np.testing.assert_allclose(m['self'][0], want, atol=1e-5, err_msg=stack)


def test_self_attention_refuses_a_text_over_the_models_positions(lm_run, mlm_run):
  """Rule: a text longer than max_position (1024) is an error naming it and its token count, never drawn with
  positions clamped to the table's last."""
  long = 'ein ' * 1100
  for workdir, _ in (lm_run, mlm_run):
    count = 1 + len(tokenizer_lib.Tokenizer(f'{workdir}/vocab.model').sp.encode(long))  # with BOS (LM) or EOS (MLM)
    with pytest.raises(ValueError) as refused:
      visualize.self_attention_maps(workdir, ['ein hund .', long])
    assert str(refused.value) == f"text 2 ('{long[:40]}...'): {count} tokens exceed the model's 1024 positions"


def test_an_mlm_refuses_to_warm_start_from_a_vocabulary_without_mask(lm_run, tmp_path):
  """Rule: an MLM (config.task=mlm) warm-started from an LM run is a WarmStartError (train's one-line error)
  naming config.init_from and the vocabulary without <mask>, before the vocabulary is copied; so is a workdir
  that already holds such a copy."""
  workdir, _ = lm_run
  config = lm_config(write_toy_corpus(tmp_path / 'data'), 'mlm')
  config.init_from = workdir
  with pytest.raises(warm_start.WarmStartError) as refused:
    train.train_and_evaluate(config, tmp_path / 'mlm')
  assert str(refused.value) == (f'config.init_from={workdir}: the MLM (config.task=mlm) needs a <mask> piece in its '
                                f'vocabulary and {workdir}/vocab.model has none: warm-start an MLM from an MLM run')
  assert not (tmp_path / 'mlm' / 'vocab.model').exists()
  (tmp_path / 'copied').mkdir()
  (tmp_path / 'copied' / 'vocab.model').write_bytes(pathlib.Path(workdir, 'vocab.model').read_bytes())
  with pytest.raises(warm_start.WarmStartError, match=f"{tmp_path / 'copied' / 'vocab.model'} has none"):
    train.train_and_evaluate(config, tmp_path / 'copied')


def test_a_generator_refuses_a_workdir_of_another_task(trained_toy):
  with pytest.raises(ValueError, match="config.task='translation'"):
    generate.Generator(trained_toy)
  with pytest.raises(ValueError, match="config.task='translation'"):
    fill_mask.FillMask(trained_toy)


def test_monolingual_text_file_and_tfds_text(tmp_path, toy_corpus):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'text.txt'
  path.write_text('one line\n\n  two\tspaced  \nthree\n')
  text = corpora.TextLines(path)
  assert text.read([0, 1, 2]) == (['one line', 'two spaced', 'three'], None)
  path.write_bytes(b'ok\n\xff\n')
  with pytest.raises(data_lib.DataError, match=r'text.txt:2: invalid UTF-8'):
    corpora.TextLines(path)

  lines = (toy_corpus / 'train.de').read_text().splitlines()

  class ToyText(tfds.core.GeneratorBasedBuilder):  # shaped like lm1b: one 'text' feature
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples()}

    def _generate_examples(self):
      for i, line in enumerate(lines):
        yield i, {'text': line}

  ToyText(data_dir=str(tmp_path / 'tfds'), file_format='array_record').download_and_prepare()
  corpus = corpora.TfdsText('toy_text', 'train', 'text', data_dir=str(tmp_path / 'tfds'))
  read, none = corpus.read(range(len(corpus)))
  assert none is None and sorted(read) == sorted(lines)
  with pytest.raises(data_lib.DataError, match="tfds_text_feature='sentence'"):
    corpora.TfdsText('toy_text', 'train', 'sentence', data_dir=str(tmp_path / 'tfds'))

  # Tokenized once into the cache (one side stored), read back as the same sequences on both sides.
  tokenizer = tokenizer_lib.load_or_train(tmp_path / 'vocab', lambda: lines, vocab_size=48)
  cached = data_lib.tokenize_cached(corpus, tokenizer, tmp_path / 'cache')
  again = data_lib.tokenize_cached(corpus, tokenizer, tmp_path / 'cache')
  assert cached.target is cached.source and again.target is again.source
  expected = tokenizer.encode(read)
  assert [list(again.source[i]) for i in range(len(again))] == expected


def test_generate_and_fill_mask_stop_quietly_when_the_reader_stops_reading(lm_run, mlm_run):
  """Rule: a reader that closes the output early (`| head`) ends the command with status 1 and no error line."""
  workdir, _ = lm_run
  first, returncode, stderr = first_line_then_close(
      generate_command, [f'--workdir={workdir}', '--greedy', '--max_new_tokens=3', '--prompts_per_batch=1',
                         '--verbosity=-1'], 'ein\n' * 200)
  assert first == generate.Generator(workdir).generate(['ein'], greedy=True, max_new_tokens=3)[0][0] + '\n'
  assert returncode == 1 and not re.search('error|Traceback', stderr), stderr[-3000:]
  workdir, _ = mlm_run
  first, returncode, stderr = first_line_then_close(
      fill_mask_command, [f'--workdir={workdir}', '--top_k=1', '--verbosity=-1'], 'ein <mask> .\n' * 300)
  assert first == 'ein <mask> .\n'
  assert returncode == 1 and not re.search('error|Traceback', stderr), stderr[-3000:]


def test_generate_and_fill_mask_name_an_input_they_cannot_read_by_its_flag(lm_run, mlm_run, tmp_path):
  # It was "error: [Errno 21] Is a directory: '...'", naming no flag; generate read it only after loading the model.
  for command, workdir in ((generate_command, lm_run[0]), (fill_mask_command, mlm_run[0])):
    for path, reason in ((tmp_path, 'Is a directory'), (tmp_path / 'missing.txt', 'No such file or directory')):
      result = in_process.run(command, [f'--workdir={workdir}', f'--input={path}'])
      assert last_error(result) == f'error: --input {path}: {reason}', result.stderr[-2000:]


def test_visualize_draws_a_language_models_self_attention_from_the_checkpoint_asked_for(lm_run, mlm_run, tmp_path):
  """The visualize command on an LM's and on an MLM's workdir writes the self-attention pictures (no translation);
  a checkpoint that is not there is an error naming it, not the latest drawn instead."""
  pytest.importorskip('matplotlib')
  from flaxformer_nmt import visualize as visualize_command  # pylint: disable=g-import-not-at-top
  for (workdir, _), stack, text in ((lm_run, 'decoder', 'ein hund'), (mlm_run, 'encoder', 'ein <mask> .')):
    out = tmp_path / stack
    lines = run_cli(visualize_command, f'--workdir={workdir}', f'--sentences={text}', f'--output_dir={out}',
                    '--checkpoint=10')
    assert lines == [str(out / f'00_{stack}_layer0.png'), str(out / '00_self_average.png')]
    result = in_process.run(visualize_command, [f'--workdir={workdir}', f'--sentences={text}',
                                                f'--output_dir={out}', '--checkpoint=7'])
    assert last_error(result) == f'error: no checkpoint 7 in {workdir}/checkpoints; there are [5, 10, 15]'
