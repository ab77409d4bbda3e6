"""The CTranslate2 export computes our model's function: greedy tokens identical (post-LN and pre-LN),
teacher-forced log probabilities equal to 1e-4, beam search agreeing, the CLI's int8 export translating."""
import json
import shutil
import struct
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import in_process
from conftest import copy_of_trained_toy, tiny_model

ctranslate2 = pytest.importorskip('ctranslate2')

from flaxformer_nmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.decoding import translator as decode  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.models import transformer as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt import export as export_command  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.serving import ctranslate2 as export  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.decoding import search as search_lib

PIECES = ['<pad>', '<unk>', '<s>', '</s>'] + [f'w{i}' for i in range(12)]  # 16: tiny_model's vocabulary
SUPPRESS = [['<pad>'], ['<s>']]  # our decoder never emits these (search_lib.search's forbidden_ids)


def save_spec(model, params, directory, quantization=None):
  spec = export.ctranslate2_spec(export.jax_to_numpy(params), model.config, PIECES)
  spec.validate()
  spec.optimize(quantization=quantization)
  directory.mkdir()
  spec.save(str(directory))
  return ctranslate2.Translator(str(directory), device='cpu', intra_threads=1)


def random_sources(n, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(4, len(PIECES), size=rng.integers(1, 9))] for _ in range(n)]


def padded(sources):
  width = max(len(s) for s in sources) + 1
  return np.array([s + [EOS_ID] + [PAD_ID] * (width - len(s) - 1) for s in sources], np.int32)


def ours_search(model, params, sources, beam_size, alpha=0.0):
  """Our decoder's best hypothesis per source, as token ids without EOS."""
  tokens, _ = search_lib.search(model, params, jnp.asarray(padded(sources)), beam_size=beam_size, alpha=alpha,
                            extra_length=50)
  rows = [[int(t) for t in row] for row in np.asarray(tokens)[:, 0]]
  return [row[:row.index(EOS_ID)] if EOS_ID in row else row for row in rows]


def ct2_search(translator, sources, beam_size, **options):
  # One call per sentence: CTranslate2's max_decoding_length is one limit per call, ours source length + 50.
  results = [translator.translate_batch([[PIECES[t] for t in s]], beam_size=beam_size, max_decoding_length=len(s) + 50,
                                        suppress_sequences=SUPPRESS, **options)[0] for s in sources]
  return [[PIECES.index(p) for p in r.hypotheses[0]] for r in results]


@pytest.mark.parametrize('pre_layer_norm', [False, True])
def test_greedy_tokens_identical_to_ours(tmp_path, pre_layer_norm):
  # A random sharpened model (clear winners) decoded to the length limit on many lines: a wrong position
  # table, embedding scale, norm placement, fused-projection order or transposition changes the tokens.
  model, params = tiny_model(pre_layer_norm=pre_layer_norm)
  translator = save_spec(model, params, tmp_path / 'ct2')
  sources = random_sources(40)
  assert ct2_search(translator, sources, beam_size=1) == ours_search(model, params, sources, beam_size=0)


@pytest.mark.parametrize('pre_layer_norm', [False, True])
def test_teacher_forced_log_probs_agree_to_1e4(tmp_path, pre_layer_norm):
  model, params = tiny_model(pre_layer_norm=pre_layer_norm)
  translator = save_spec(model, params, tmp_path / 'ct2')
  sources, targets = random_sources(12, seed=1), random_sources(12, seed=2)
  scored = translator.score_batch([[PIECES[t] for t in s] for s in sources],
                                  [[PIECES[t] for t in target] for target in targets])
  src = jnp.asarray(padded(sources))
  tgt_out = padded(targets)  # target + EOS, padded
  tgt_in = np.concatenate([np.full((len(targets), 1), BOS_ID, np.int32), tgt_out[:, :-1]], axis=1)
  logits = np.asarray(model.apply({'params': params}, src, jnp.asarray(tgt_in)), np.float64)
  log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  for i, (target, result) in enumerate(zip(targets, scored)):
    ours = [log_probs[i, t, token] for t, token in enumerate(target + [EOS_ID])]
    assert result.tokens == [PIECES[t] for t in target] + ['</s>']
    np.testing.assert_allclose(result.log_probs, ours, atol=1e-4)


@pytest.fixture(scope='module')
def workdir(trained_toy, tmp_path_factory):
  """The session's trained toy (conftest.trained_toy: 400 steps, it translates the toy corpus partly, a quarter
  of the test lines exactly, with output lengths from 2 to 20-odd pieces), copied with its corpus and
  max_decode_extra_length 50, as CTranslate2's max_decoding_length below (small_config has 10). An untrained
  model would compare nothing: at small_config's learning rate every beam output was "." after 60 steps."""
  return copy_of_trained_toy(trained_toy, tmp_path_factory.mktemp('export') / 'toy', max_decode_extra_length=50)


def toy_sources(workdir):
  return (workdir.parent / 'data' / 'test.en').read_text().splitlines() + \
      (workdir.parent / 'data' / 'valid.en').read_text().splitlines()


def run_export(workdir, output_dir, *args, as_subprocess=False):
  """The export command: its main in this process, or `python -m flaxformer_nmt.export` (in_process.run)."""
  args = [f'--workdir={workdir}', f'--output_dir={output_dir}', '--format=ctranslate2', *args]
  return in_process.run(export_command, args, as_subprocess=as_subprocess)


@pytest.fixture(scope='module')
def exported(workdir, tmp_path_factory):
  output_dir = tmp_path_factory.mktemp('exported') / 'ct2'
  result = run_export(workdir, output_dir, as_subprocess=True)  # the file's one run of the real command
  assert result.returncode == 0, result.stderr[-3000:]
  return output_dir


def ct2_translate(model_dir, sentences, beam_size, compute_type='default', **options):
  """The README's lines: sentencepiece pieces in, pieces out, detokenized."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  sp = spm.SentencePieceProcessor(model_file=str(model_dir / 'vocab.model'))
  translator = ctranslate2.Translator(str(model_dir), device='cpu', compute_type=compute_type)
  pieces = sp.encode([' '.join(s.split()) for s in sentences], out_type=str)
  results = [translator.translate_batch([p], beam_size=beam_size, max_decoding_length=len(p) + 50,
                                        suppress_sequences=SUPPRESS, **options)[0] for p in pieces]
  return [sp.decode(r.hypotheses[0]) for r in results]


def test_cli_export_writes_model_vocabulary_and_readme(workdir, exported):
  assert (exported / 'model.bin').exists() and (exported / 'config.json').exists()
  assert (exported / 'vocab.model').read_bytes() == (workdir / 'vocab.model').read_bytes()
  readme = (exported / 'README.md').read_text()
  assert 'ctranslate2.Translator(' in readme and 'length_penalty' in readme and 'checkpoint 400' in readme


def test_trained_model_greedy_identical_on_every_line(workdir, exported):
  sources = toy_sources(workdir)
  ours = decode.Translator(workdir).translate(sources, beam_size=0)
  assert ct2_translate(exported, sources, beam_size=1) == ours


def test_trained_model_beam_identical_on_97_percent_of_lines(workdir, exported):
  # Both searches stop once K = 4 hypotheses have finished, an EOS finishing one only from among the K best
  # candidates. CTranslate2 does so for any length_penalty but 0, where it instead stops when a step's best
  # candidate is EOS (allow_early_exit in its decoding.cc): a length penalty of 1e-6 on both sides keeps the
  # same rule and leaves the ranking that of log P. What still differs: CTranslate2 normalizes its softmax
  # without the suppressed <pad> and <s>, we forbid them after normalizing, so scores differ by ~1e-3 a step
  # and a near tie may go the other way (2 of 199 lines on jax 0.12, 0 on jax 0.10). A search that stops at
  # the first finished hypothesis agrees on 177 of 199 (measured), and fails here.
  # Lines that reach the length limit are left out: there we force EOS (its log probability counts),
  # CTranslate2 stops without it.
  train_sources = (workdir.parent / 'data' / 'train.en').read_text().splitlines()[:160]
  sources = toy_sources(workdir) + train_sources
  # Each batch searched whole in one program (test_decode checks that this gives the segments' results): one
  # program per source length to compile.
  translator = decode.Translator(workdir, on_device=True)
  token_lists = translator.tokenizer.encode(sources)
  results = translator.search_tokens(token_lists, beam_size=4, alpha=1e-6, tokens_per_batch=8192)
  theirs = ct2_translate(exported, sources, beam_size=4, length_penalty=1e-6)
  compared = [(translator.tokenizer.decode(hyps[0][0]), ct2) for src, hyps, ct2 in zip(token_lists, results, theirs)
              if len(hyps[0][0]) - 1 < len(src) - 1 + 50]
  assert len(compared) >= 150
  assert len({len(ours.split()) for ours, _ in compared}) >= 5  # real translations of many lengths, not "."
  same = sum(a == b for a, b in compared)
  assert same >= 0.97 * len(compared), [(a, b) for a, b in compared if a != b][:5]


def test_int8_export_loads_and_scores_close_to_float32(workdir, tmp_path):
  # Line agreement is no measure here: on a barely trained toy model greedy choices are near-ties that 8-bit
  # weights flip (19 of 40 lines on one CPU, 40 of 40 on another). The teacher-forced log probabilities of
  # the same outputs are: 8-bit rounding moves them by ~0.01 nats (0.04 at most, measured), a wrong scale
  # or a float32 copy left unquantized would not.
  for name, args in (('int8', ['--quantization=int8']), ('float32', [])):
    result = run_export(workdir, tmp_path / name, *args, '--checkpoint=300')
    assert result.returncode == 0, result.stderr[-3000:]
  assert 'checkpoint 300' in (tmp_path / 'int8' / 'README.md').read_text()
  config = json.loads((tmp_path / 'int8' / 'config.json').read_text())
  assert config['add_source_eos'] and config['decoder_start_token'] == '<s>'
  sizes = {name: (tmp_path / name / 'model.bin').stat().st_size for name in ('int8', 'float32')}
  assert sizes['int8'] < 0.8 * sizes['float32'], sizes
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  sp = spm.SentencePieceProcessor(model_file=str(tmp_path / 'int8' / 'vocab.model'))
  sources = toy_sources(workdir)
  outputs = decode.Translator(workdir, checkpoint='300').translate(sources, beam_size=0)
  source_pieces, output_pieces = sp.encode(sources, out_type=str), sp.encode(outputs, out_type=str)
  log_probs = {}
  for name in ('int8', 'float32'):
    translator = ctranslate2.Translator(str(tmp_path / name), device='cpu')
    log_probs[name] = np.concatenate([r.log_probs for r in translator.score_batch(source_pieces, output_pieces)])
  difference = np.abs(log_probs['int8'] - log_probs['float32'])
  # CTranslate2's int8 GEMM here is oneDNN's u8s8. With VNNI (vpdpbusd) it accumulates in int32; on a CPU with
  # only AVX2 its vpmaddubsw sums pairs of products into saturating int16 first, which costs accuracy that is
  # CTranslate2's, not the export's: the same export measured 0.062-0.065 mean there, its largest difference 0.82
  # nats on a Zen 3 and 2.7 on a Zen 1 where a sum saturates (the same with CT2_FORCE_CPU_ISA=GENERIC, since oneDNN
  # picks its own kernels), against under 0.01 / 0.04 with VNNI. A wrong scale moves them all by nats (the mean),
  # an unquantized copy not at all.
  int8_dot = {'avx512_vnni', 'avx_vnni', 'amx_int8'} & model_lib.cpu_flags()  # VNNI or AMX-INT8
  mean_bound, max_bound = (0.05, 0.25) if int8_dot else (0.1, np.inf)
  assert difference.mean() < mean_bound and difference.max() < max_bound, (difference.mean(), difference.max())
  assert difference.max() > 0  # it did quantize


CT2_TYPES = ('float32', 'int8', 'int16', 'int32', 'float16', 'bfloat16')  # model.bin's type ids


def model_variables(model_dir):
  """({name: (type, shape, bytes)}, {alias: name}) of a CTranslate2 model.bin, read as its layout is written
  (version, name, revision, the variables, the aliases)."""
  data, offset = (model_dir / 'model.bin').read_bytes(), 0

  def take(fmt):
    nonlocal offset
    values = struct.unpack_from('<' + fmt, data, offset)
    offset += struct.calcsize('<' + fmt)
    return values

  def string():
    nonlocal offset
    (length,) = take('H')  # with the final NUL
    offset += length
    return data[offset - length:offset - 1].decode()

  take('I'), string(), take('I')
  variables = {}
  for _ in range(take('I')[0]):
    name = string()
    shape = take(f'{take("B")[0]}I')
    (type_id,), (size,) = take('B'), take('I')
    variables[name] = (CT2_TYPES[type_id], shape, data[offset:offset + size])
    offset += size
  aliases = {string(): string() for _ in range(take('I')[0])}
  assert offset == len(data)
  return variables, aliases


def test_bfloat16_exports_are_the_float32_and_int8_ones_rounded(workdir, tmp_path):
  # CTranslate2's converter casts to bfloat16 through torch, no dependency of ours (without it: a RuntimeError).
  # As its converter does: every float32 array of the float32 (int8) export rounded to bfloat16, the int8
  # weights and their float32 scales unchanged.
  models = {}
  for quantization in ('float32', 'bfloat16', 'int8', 'int8_bfloat16'):
    result = run_export(workdir, tmp_path / quantization, f'--quantization={quantization}', '--checkpoint=300')
    assert result.returncode == 0, result.stderr[-3000:]
    models[quantization] = model_variables(tmp_path / quantization)
  for plain, rounded in (('float32', 'bfloat16'), ('int8', 'int8_bfloat16')):
    (variables, aliases), (theirs, their_aliases) = models[plain], models[rounded]
    assert their_aliases == aliases and theirs.keys() == variables.keys()
    for name, (dtype, shape, raw) in variables.items():
      if dtype == 'float32' and shape and not name.endswith('_scale'):
        dtype, raw = 'bfloat16', np.frombuffer(raw, np.float32).astype(ml_dtypes.bfloat16).tobytes()
      assert theirs[name] == (dtype, shape, raw), name
  assert {t for t, _, _ in models['int8_bfloat16'][0].values()} >= {'int8', 'float32', 'bfloat16'}
  translator = ctranslate2.Translator(str(tmp_path / 'bfloat16'), device='cpu', intra_threads=1)
  assert translator.translate_batch([['▁a']], beam_size=1, max_decoding_length=5)[0].hypotheses[0]


def test_export_errors_name_the_problem(workdir, exported, tmp_path):
  result = run_export(workdir, exported)  # not empty
  assert result.returncode == 1 and '--force' in result.stderr
  before = sorted(p.name for p in workdir.iterdir())
  for output in (workdir, workdir.parent):  # --force deleted the run, then failed reading its vocabulary
    result = run_export(workdir, output, '--force')
    assert result.returncode == 1 and 'holds the workdir' in result.stderr, result.stderr[-2000:]
  # Wrong rule caught: --force deleted any folder but the workdir and its parents, its checkpoints/ too.
  checkpoints = sorted(str(p) for p in (workdir / 'checkpoints').rglob('*'))
  result = run_export(workdir, workdir / 'checkpoints', '--force')
  assert result.returncode == 1 and 'holds no CTranslate2 model (model.bin)' in result.stderr, result.stderr[-2000:]
  assert sorted(str(p) for p in (workdir / 'checkpoints').rglob('*')) == checkpoints
  assert sorted(p.name for p in workdir.iterdir()) == before
  replaced = tmp_path / 'replaced'
  shutil.copytree(exported, replaced)
  (replaced / 'stale.txt').write_text('from the export before')
  assert run_export(workdir, replaced, '--force').returncode == 0  # an export is replaced whole
  assert sorted(p.name for p in replaced.iterdir()) == sorted(p.name for p in exported.iterdir())
  result = run_export(workdir, tmp_path / 'x', '--checkpoint=999')
  assert result.returncode == 1 and 'no checkpoint 999' in result.stderr
  result = run_export(tmp_path / 'nowhere', tmp_path / 'y')
  assert result.returncode == 1 and 'config.json' in result.stderr
  assert not (tmp_path / 'x').exists() and not (tmp_path / 'y').exists()
  lm_workdir = tmp_path / 'lm'  # an LM run's workdir: refused before any checkpoint is read
  lm_workdir.mkdir()
  lm_config = json.loads((workdir / 'config.json').read_text())
  lm_config['task'] = 'lm'
  (lm_workdir / 'config.json').write_text(json.dumps(lm_config))
  result = run_export(lm_workdir, tmp_path / 'z')
  assert result.returncode == 1 and "config.task='lm'" in result.stderr and 'generate' in result.stderr
  result = run_export(lm_workdir, tmp_path / 'z', '--format=argos')  # the message names no other format
  assert result.returncode == 1 and "config.task='lm'" in result.stderr and '--format ctranslate2' not in result.stderr
  assert not (tmp_path / 'z').exists()


def test_a_forced_export_that_fails_keeps_the_export_before(workdir, tmp_path, monkeypatch):
  output = tmp_path / 'ct2'
  export.export_ctranslate2(workdir, output, 'latest')
  before = {p.name: p.read_bytes() for p in output.iterdir()}

  def disk_full(*args, **kwargs):
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(export, 'write_readme', disk_full)
  with pytest.raises(OSError, match='No space left'):
    export.export_ctranslate2(workdir, output, 'latest', force=True)
  assert {p.name: p.read_bytes() for p in output.iterdir()} == before
  monkeypatch.undo()
  export.export_ctranslate2(workdir, output, '300', force=True)  # over what the failed run left beside it
  assert 'checkpoint 300' in (output / 'README.md').read_text()
  assert sorted(p.name for p in tmp_path.iterdir()) == ['ct2']


@pytest.mark.parametrize('interruption', [KeyboardInterrupt(), OSError(28, 'No space left on device')])
def test_an_interrupted_export_leaves_no_partial_model_beside_the_export_before(workdir, tmp_path, monkeypatch,
                                                                                 interruption):
  # Ctrl-C or a full disk while the model is written: the half-written .ct2.partial stayed until the next export.
  output = tmp_path / 'ct2'
  export.export_ctranslate2(workdir, output, 'latest')
  before = {p.name: p.read_bytes() for p in output.iterdir()}

  def interrupted(*args, **kwargs):
    raise interruption

  monkeypatch.setattr(export, 'write_readme', interrupted)
  with pytest.raises(type(interruption)):
    export.export_ctranslate2(workdir, output, '300', force=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['ct2']
  assert {p.name: p.read_bytes() for p in output.iterdir()} == before


def test_export_defaults_to_the_checkpoint_the_config_chose(workdir, tmp_path):
  # A recipe that chose the average on validation (config.decode_checkpoint) exports it without --checkpoint.
  import shutil  # pylint: disable=g-import-not-at-top
  other = tmp_path / 'run'
  shutil.copytree(workdir, other)
  saved = json.loads((other / 'config.json').read_text())
  saved['decode_checkpoint'] = '300'  # not the latest (400)
  (other / 'config.json').write_text(json.dumps(saved))
  assert export.export_ctranslate2(other, tmp_path / 'ct2') == 'checkpoint 300'
  assert 'checkpoint 300' in (tmp_path / 'ct2' / 'README.md').read_text()


def test_decoding_and_export_do_not_import_the_trainer():
  code = ('import sys, flaxformer_nmt.decode, flaxformer_nmt.export; '
          'print(sorted(m for m in sys.modules if m.startswith("flaxformer_nmt")))')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'flaxformer_nmt.decode' in result.stdout and 'flaxformer_nmt.train' not in result.stdout
  assert 'flaxformer_nmt.train_step' not in result.stdout


def test_the_readme_of_a_lowercased_model_lowercases_its_inputs(tmp_path):
  # A model of config.lowercase never saw a capital: the README's snippet must lowercase as decode.py does.
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.base_config()
  for lowercase, line in ((False, "sp.encode([' '.join(s.split()) for s in sentences]"),
                          (True, "sp.encode([' '.join(s.split()).lower() for s in sentences]")):
    config.lowercase = lowercase
    export.write_readme(tmp_path, workdir='w', checkpoint='checkpoint 1', config=config, quantization=None)
    assert line in (tmp_path / 'README.md').read_text()


def test_the_ctranslate2_length_penalty_has_our_penalty_slope_at_the_expected_length():
  from flaxformer_nmt.serving import ctranslate2 as ct2_export  # pylint: disable=g-import-not-at-top
  ours = lambda n, alpha: alpha * np.log((5 + n) / 6)  # log of GNMT's ((5 + n) / 6)^alpha
  for alpha, pieces in ((2.0, 12), (0.6, 3), (1.0, 40)):
    n, h = pieces + 1.0, 1e-4  # the translation's expected length, EOS counted
    slope = (ours(n + h, alpha) - ours(n - h, alpha)) / (2 * h)
    penalty = ct2_export.length_penalty_for(alpha, pieces)
    assert penalty * (np.log(n + h) - np.log(n - h)) / (2 * h) == pytest.approx(slope, abs=0.01 / n)


@pytest.mark.parametrize('format_', ['ctranslate2', 'argos'])
def test_an_output_dir_under_a_file_is_refused_before_the_checkpoint_loads(workdir, tmp_path, monkeypatch, format_):
  # It loaded and converted the model first, then failed with "[Errno 20] Not a directory" naming a
  # .partial path that the user never gave.
  from flaxformer_nmt.checkpointing import loader  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(loader, 'load_for_inference', lambda *a, **k: pytest.fail('loaded first'))
  (tmp_path / 'taken').write_text('')
  for output, where in ((tmp_path / 'taken', 'is a file'), (tmp_path / 'taken' / 'ct2', f'is under the file '
                                                                                       f'{tmp_path / "taken"}')):
    result = in_process.run(export_command, [f'--workdir={workdir}', f'--output_dir={output}', f'--format={format_}'])
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f'error: --output_dir {output}: {where}, not a directory']
