"""The Argos Translate package (python -m flaxformer_nmt.export --format argos): its layout and metadata, CTranslate2
translating from it as our greedy search does, and the server's ctranslate2 backend on it and on a plain export."""
import json
import shutil
import zipfile

import jax
import numpy as np
import pytest
import sentencepiece as spm

import in_process
from test_serve import SENTENCES, client, serve_until_it_would_listen, trained_workdir

ctranslate2 = pytest.importorskip('ctranslate2')
pytest.importorskip('fastapi')

from flaxformer_nmt import export  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.models.tokens import EOS_ID  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.serving import argos  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.serving import batcher as batcher_lib  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.serving import ctranslate2 as ct2_export  # pylint: disable=g-import-not-at-top

SUPPRESS = [['<pad>'], ['<s>']]
CODE = 'translate-en_de-1_0'


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  return trained_workdir(tmp_path_factory)


@pytest.fixture(scope='module')
def translator(workdir):
  return batcher_lib.JaxBackend(workdir).translator


@pytest.fixture(scope='module')
def package(workdir, tmp_path_factory):
  output = tmp_path_factory.mktemp('argos')
  result = in_process.run(export, [f'--workdir={workdir}', '--format=argos', f'--output_dir={output}'])
  assert result.returncode == 0, result.stderr[-3000:]
  return output / f'{CODE}.argosmodel'


def test_the_package_is_a_zip_of_one_directory_with_argos_layout_and_metadata(package, translator):
  with zipfile.ZipFile(package) as archive:
    names = set(archive.namelist())
    metadata = json.loads(archive.read(f'{CODE}/metadata.json'))
    settings = json.loads(archive.read(f'{CODE}/flaxformer_nmt.json'))
    vocabulary = archive.read(f'{CODE}/sentencepiece.model')
    readme = archive.read(f'{CODE}/README.md').decode()
  assert {name.split('/')[0] for name in names} == {CODE}
  # Its install line is one Argos Translate runs (argospm installs index names, not files).
  assert 'package of an English -> German Transformer' in readme and f"install_from_path('{CODE}.argosmodel')" in readme
  assert {f'{CODE}/metadata.json', f'{CODE}/README.md', f'{CODE}/sentencepiece.model', f'{CODE}/model/model.bin',
          f'{CODE}/model/config.json'} <= names
  assert metadata == {'package_version': '1.0', 'argos_version': '1.9', 'type': 'translate', 'code': CODE,
                      'name': 'English -> German', 'from_code': 'en', 'from_name': 'English', 'to_code': 'de',
                      'to_name': 'German'}
  assert vocabulary == translator.tokenizer.path.read_bytes()
  assert (settings['source_lang'], settings['target_lang'], settings['checkpoint']) == ('en', 'de',
                                                                                       translator.checkpoint)
  assert settings['beam_size'] == translator.config.beam_size and settings['lowercase'] is False


def test_ctranslate2_translates_from_the_unpacked_package_as_our_greedy_search(package, translator, tmp_path):
  with zipfile.ZipFile(package) as archive:
    archive.extractall(tmp_path)
  root = tmp_path / CODE
  sp = spm.SentencePieceProcessor(model_file=str(root / 'sentencepiece.model'))
  model = ctranslate2.Translator(str(root / 'model'), device='cpu', intra_threads=1)
  extra = translator.config.max_decode_extra_length
  theirs = []
  for sentence in SENTENCES:  # as Argos Translate calls it: sentencepiece pieces, no EOS (the model adds it)
    pieces = sp.encode(sentence, out_type=str)
    result = model.translate_batch([pieces], beam_size=1, max_decoding_length=len(pieces) + extra,
                                   suppress_sequences=SUPPRESS)[0]
    theirs.append(sp.decode(result.hypotheses[0]))
  assert theirs == translator.translate(SENTENCES, beam_size=0)


def test_export_refuses_to_replace_a_package_unless_forced(workdir, package):
  result = in_process.run(export, [f'--workdir={workdir}', '--format=argos', f'--output_dir={package.parent}'])
  assert result.returncode == 1
  assert f'error: {package} exists: choose another --output_dir or pass --force' in result.stderr
  forced = in_process.run(export, [f'--workdir={workdir}', '--format=argos', f'--output_dir={package.parent}',
                                   '--force'])
  assert forced.returncode == 0, forced.stderr[-2000:]


def test_the_package_export_reads_the_checkpoint_once(workdir, tmp_path, monkeypatch):
  # It read it twice: once for the parameter count of flaxformer_nmt.json, once more for the CTranslate2 model
  # (with --checkpoint last:K, averaging the checkpoints twice).
  reads = []
  saved_params = checkpoints_lib.saved_params
  monkeypatch.setattr(checkpoints_lib, 'saved_params', lambda *args: reads.append(args) or saved_params(*args))
  path, _ = argos.export_argos(workdir, tmp_path, 'latest')
  assert len(reads) == 1
  with zipfile.ZipFile(path) as archive:
    settings = json.loads(archive.read(f'{CODE}/flaxformer_nmt.json'))
  params = saved_params(*reads[0])
  assert settings['parameters'] == sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def test_an_interrupted_package_export_leaves_no_partial_package(workdir, package, tmp_path, monkeypatch):
  # Ctrl-C while the zip is written: the half-written .argosmodel.partial stayed beside the package before.
  shutil.copy(package, tmp_path / package.name)
  write = zipfile.ZipFile.write

  def interrupted(archive, filename, *args, **kwargs):
    if str(filename).endswith(argos.SENTENCEPIECE_FILE):  # the model is in the archive already
      raise KeyboardInterrupt
    return write(archive, filename, *args, **kwargs)

  monkeypatch.setattr(zipfile.ZipFile, 'write', interrupted)
  with pytest.raises(KeyboardInterrupt):
    argos.export_argos(workdir, tmp_path, 'latest', force=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == [package.name]
  assert (tmp_path / package.name).read_bytes() == package.read_bytes()


def test_export_refuses_a_package_version_argos_cannot_compare(workdir, tmp_path):
  # Argos Translate orders package versions with packaging.version; a '/' would also put the package in a
  # subdirectory, its zip's top directory nested.
  for version in ('1.0/x', 'abc', ''):
    result = in_process.run(export, [f'--workdir={workdir}', '--format=argos', f'--output_dir={tmp_path}',
                                     f'--package_version={version}'])
    assert result.returncode == 1, version
    assert f'error: --package_version must be numbers joined by dots (1.0, 2.1), not {version!r}' in result.stderr
  assert not list(tmp_path.iterdir())


def test_the_server_serves_the_package_through_ctranslate2(package, translator):
  backend = argos.CTranslate2Backend(package, threads=1)
  with client({'en-de': backend}) as c:
    answer = c.post('/v1/translate', json={'text': SENTENCES + [''], 'beam_size': 0})
    model = c.get('/v1/models').json()['models'][0]
    libre = c.post('/translate', json={'q': SENTENCES[0], 'source': 'en', 'target': 'de'})
    attention = c.post('/v1/translate', json={'text': [SENTENCES[0]], 'beam_size': 0, 'return_attention': True})
  assert answer.status_code == 200, answer.text
  assert [t['text'] for t in answer.json()['translations']] == translator.translate(SENTENCES, beam_size=0) + ['']
  assert (model['backend'], model['checkpoint'], model['defaults']['beam_size']) == (
      'ctranslate2', translator.checkpoint, translator.config.beam_size)
  assert libre.status_code == 200 and isinstance(libre.json()['translatedText'], str)
  entry = attention.json()['translations'][0]['attention']
  assert entry['source_tokens'] == translator.tokenizer.pieces(translator.tokenizer.encode([SENTENCES[0]])[0])
  assert len(entry['weights']) == 1 and len(entry['weights'][0]) == len(entry['target_tokens'])
  assert entry['target_tokens'][-1] == '</s>'
  # The rows are CTranslate2's own attention of each generated token over the source pieces it was given (no
  # EOS either way; asked of it here directly), zeros beyond. Catches rows cut from the flat weights at the
  # source's width with EOS, which mixes tokens' rows (or fails where the lengths do not divide).
  pieces = translator.tokenizer.pieces(translator.tokenizer.encode([SENTENCES[0]])[0][:-1])
  own = np.asarray(backend.translator.translate_batch(
      [pieces], beam_size=1, return_attention=True, max_decoding_length=len(pieces) + 50, min_decoding_length=1,
      suppress_sequences=argos.SUPPRESSED)[0].attention[0])
  weights = np.asarray(entry['weights'][0])
  assert weights.shape == (len(entry['target_tokens']), len(entry['source_tokens']))
  assert own.shape == (len(entry['target_tokens']) - 1, len(pieces))
  np.testing.assert_allclose(weights[:own.shape[0], :own.shape[1]], own, rtol=1e-5, atol=1e-6)
  assert not weights[own.shape[0]:].any() and not weights[:, own.shape[1]:].any()


def test_the_serve_commands_device_and_threads_reach_ctranslate2(package, monkeypatch):
  # Wrong rules caught: --device or --threads dropped on the way to ctranslate2.Translator (a --device=cuda server
  # decoded on the CPU without a word).
  created, translator_class = [], ctranslate2.Translator

  def translator(path, **options):  # records the options, then loads the model on the CPU
    created.append(options)
    return translator_class(path, device='cpu', intra_threads=1)
  monkeypatch.setattr(ctranslate2, 'Translator', translator)
  _, config = serve_until_it_would_listen(['--backend=ctranslate2', f'--model=en-de={package}', '--device=cuda',
                                           '--threads=3', '--warmup=none'], monkeypatch)
  assert created == [{'device': 'cuda', 'inter_threads': 1, 'intra_threads': 3}]
  assert config['app'].state.service.backends['en-de'].name == 'ctranslate2'


def test_the_ctranslate2_backend_reads_a_plain_export_from_its_readme(workdir, translator, tmp_path):
  ct2_export.export_ctranslate2(workdir, tmp_path / 'ct2')
  backend = argos.CTranslate2Backend(tmp_path / 'ct2', threads=1)
  assert (backend.source_lang, backend.target_lang) == ('en', 'de')
  assert backend.defaults() == {'beam_size': translator.config.beam_size,
                                'alpha': translator.config.length_penalty_alpha, 'max_len_a': 1.0,
                                'max_len_b': translator.config.max_decode_extra_length}
  with client({'en-de': backend}) as c:
    answer = c.post('/v1/translate', json={'text': SENTENCES[:3], 'beam_size': 0})
  assert [t['text'] for t in answer.json()['translations']] == translator.translate(SENTENCES[:3], beam_size=0)
  with pytest.raises(ValueError, match='neither an Argos package nor a CTranslate2 model directory'):
    argos.CTranslate2Backend(tmp_path)


def test_the_ctranslate2_backend_lowercases_the_input_of_a_model_that_learnt_lowercased_text(workdir, tmp_path):
  # A model of config.lowercase reads its input lowercased, as the jax backend reads it (Translator.prepare), told by
  # a package's flaxformer_nmt.json or a plain export's README. Wrong rules caught: the input passed as sent (pieces
  # of capitals the model never saw), a plain export's README not read for it.
  shutil.copytree(workdir, tmp_path / 'run')
  config = json.loads((tmp_path / 'run' / 'config.json').read_text())
  config['lowercase'] = True
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(config))
  ct2_export.export_ctranslate2(tmp_path / 'run', tmp_path / 'ct2')
  package, _ = argos.export_argos(tmp_path / 'run', tmp_path / 'packages')
  sp = spm.SentencePieceProcessor(model_file=str(tmp_path / 'run' / 'vocab.model'))
  for exported in (tmp_path / 'ct2', package):
    backend = argos.CTranslate2Backend(exported, threads=1)
    assert backend.encode(['A Big  DOG runs .']) == [sp.encode('a big dog runs .') + [EOS_ID]], exported


def test_a_plain_export_keeps_the_models_positions(workdir, tmp_path):
  # A model of 256 positions (its sinusoids are no parameters: the toy's checkpoint with a changed config) refuses
  # a max_length past them, as the jax backend does, rather than decoding past CTranslate2's position table.
  shutil.copytree(workdir, tmp_path / 'run')
  config = json.loads((tmp_path / 'run' / 'config.json').read_text())
  config['model']['max_position'] = 256
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(config))
  ct2_export.export_ctranslate2(tmp_path / 'run', tmp_path / 'ct2')
  backend = argos.CTranslate2Backend(tmp_path / 'ct2', threads=1)
  assert backend.max_position == 256
  with client({'en-de': backend}, max_input_tokens=1000) as c:
    too_long = c.post('/v1/translate', json={'text': ['a dog'], 'max_length': 300})
    long_source = c.post('/v1/translate', json={'text': ['a big dog runs . ' * 60]})
  assert (too_long.status_code, too_long.json()) == (400, {'detail': 'max_length=300 is over the model\'s limit of '
                                                                     '255 target pieces'})
  # Sources of 256 - 10 positions, EOS included, as the jax backend's (wrong rule caught: one piece more).
  assert long_source.status_code == 413 and 'the limit is 245 (--max_input_tokens=1000' in long_source.json()['detail']


def test_the_ctranslate2_backend_scores_greedy_search_as_its_log_probability(package, translator):
  # As the jax backend and the docs say: greedy search's score is the log probability, not normalized by length.
  # (A limit the toy's outputs end before: our search scores the EOS it forces at the limit, CTranslate2 none.)
  backend = argos.CTranslate2Backend(package, threads=1)
  with client({'en-de': backend}) as c:
    answer = c.post('/v1/translate', json={'text': SENTENCES[:4], 'beam_size': 0, 'max_length': 60,
                                           'return_scores': True})
  want = translator.translate(SENTENCES[:4], beam_size=0, max_len_a=0, max_len_b=60, return_scores=True)
  assert [t['text'] for t in answer.json()['translations']] == [text for text, _ in want]
  np.testing.assert_allclose([t['score'] for t in answer.json()['translations']], [s for _, s in want], rtol=1e-2)


def test_the_ctranslate2_backend_passes_each_requests_search_options_to_ctranslate2(package, tmp_path):
  # A request's beam size, n best, alpha (as CTranslate2's length penalty for each source length m:
  # alpha * (m + 1) / (m + 6), rounded to 2 places) and max_length reach CTranslate2: against CTranslate2 called
  # directly, one sentence at a time. Wrong rules caught: the beam size or n_best dropped (greedy answers, one
  # translation repeated as the n best), alpha passed unconverted or converted at the wrong length, the sentences
  # of one length limit decoded with the first one's penalty, max_length ignored.
  with zipfile.ZipFile(package) as archive:
    archive.extractall(tmp_path)
  sp = spm.SentencePieceProcessor(model_file=str(tmp_path / CODE / 'sentencepiece.model'))
  model = ctranslate2.Translator(str(tmp_path / CODE / 'model'), device='cpu', intra_threads=1)
  sentences, alpha = SENTENCES[:5], 1.0
  backend = argos.CTranslate2Backend(package, threads=1)
  with client({'en-de': backend}) as c:
    beam = c.post('/v1/translate', json={'text': sentences, 'beam_size': 3, 'n_best': 2, 'alpha': alpha,
                                         'max_length': 30, 'return_scores': True}).json()['translations']
    short = c.post('/v1/translate', json={'text': sentences, 'beam_size': 0, 'max_length': 2}).json()['translations']
  assert len({len(sp.encode(s)) for s in sentences}) >= 3  # several penalties under one length limit
  for sentence, entry, short_entry in zip(sentences, beam, short):
    pieces = sp.encode(sentence, out_type=str)
    m = len(pieces)
    penalty = round(alpha * (m + 1) / (m + 6), 2)
    want = model.translate_batch([pieces], beam_size=3, num_hypotheses=2, length_penalty=penalty,
                                 max_decoding_length=30, return_scores=True, suppress_sequences=SUPPRESS)[0]
    assert [c['text'] for c in entry['n_best']] == [sp.decode(h) for h in want.hypotheses], sentence
    np.testing.assert_allclose([c['score'] for c in entry['n_best']], want.scores, atol=1e-4)
    greedy = model.translate_batch([pieces], beam_size=1, max_decoding_length=2, suppress_sequences=SUPPRESS)[0]
    assert short_entry['text'] == sp.decode(greedy.hypotheses[0]), sentence
  assert [e['text'] for e in short] != [e['text'] for e in beam]  # the toy's translations are longer than 2 pieces
