"""Corpora: TFDS WMT builders (on tfds.testing.mock_data), the translation direction, text export and the
Multi30k download helper (on a local HTTP server)."""
import functools
import gzip
import hashlib
import http.server
import importlib.util
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.data import corpora
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import download
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import PAD_ID
from flaxformer_nmt.runtime import cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_MULTI30K = config_lib.shared_data_dir('multi30k')

# The WMT builders need TensorFlow to load, even under mock_data (the `tfds` extra). Looked up, not imported: a
# subprocess importing it took 10 s of every test session on the 2-core CPU.
requires_tensorflow = pytest.mark.skipif(importlib.util.find_spec('tensorflow') is None,
                                         reason='TensorFlow (the tfds extra) is not installed')


@pytest.fixture(autouse=True)
def batched_reads_under_mock_data(monkeypatch):
  """tfds.testing.mock_data (TFDS 4.9.10) installs `__getitems__` on its fake array_record source as a bare
  functools.partial, so batched reads miss their `self` argument; give the partial a function without it."""
  try:
    from tensorflow_datasets.testing import mocking  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  original = mocking._getitems  # pylint: disable=protected-access
  monkeypatch.setattr(mocking, '_getitems', lambda record_keys, generator, serialized=False: original(
      None, record_keys, generator, serialized))


def load_config(name):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@requires_tensorflow
@pytest.mark.parametrize('name', ['wmt14_translate/de-en', 'wmt17_translate/de-en'])
def test_direction_is_chosen_by_language_name(name):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=6):
    records = corpora.tfds_builder(name).as_data_source(split='train')
    en_de = corpora.TfdsPairs(name, 'train', 'en', 'de')
    de_en = corpora.TfdsPairs(name, 'train', 'de', 'en')
    for i in range(len(records)):
      en, de = (tokenizer_lib.normalize_whitespace(records[i][k].decode()
                                                   if isinstance(records[i][k], bytes) else records[i][k])
                for k in ('en', 'de'))
      assert en_de[i] == (en, de)
      assert de_en[i] == (de, en)
    with pytest.raises(corpora.data_lib.DataError, match=r"config.target_lang='fr'.*\['de', 'en'\]"):
      corpora.TfdsPairs(name, 'train', 'en', 'fr')


@requires_tensorflow
@pytest.mark.parametrize('config_name', ['wmt14_ende_base', 'wmt14_ende_big'])
def test_wmt_configs_build_their_pipeline_on_mock_data(config_name, tmp_path):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  config = load_config(config_name)
  # Random mock text cannot fill a 37k vocabulary or 25k-token batches; everything else is the config's.
  config.vocab_size = 200
  config.tokens_per_batch = 512
  with tfds.testing.mock_data(num_examples=60):
    train_batches, eval_batches, tokenizer = pipeline.input_pipeline(config, tmp_path, num_devices=1)
    records = corpora.tfds_builder(config.tfds_name).as_data_source(split='train')
    english = {tokenizer_lib.normalize_whitespace(records[i]['en']) for i in range(len(records))}
    german = {tokenizer_lib.normalize_whitespace(records[i]['de']) for i in range(len(records))}
  assert (tmp_path / 'vocab.model').exists() and (tmp_path / 'tokenized' / 'train' / 'meta.json').exists()
  batch = next(train_batches)
  train_batches.close()
  rows, length = batch['src'].shape
  assert rows * length <= 512 and batch['tgt_in'].shape == batch['tgt_out'].shape == (rows, length)
  # En->De: every source row is an English side, every target row a German side of the builder's pairs.
  for r in np.flatnonzero((batch['src'] != PAD_ID).any(axis=1)):
    assert tokenizer.decode(batch['src'][r]) in english
    assert tokenizer.decode(batch['tgt_out'][r]) in german
  assert sum(int((b['src'] != PAD_ID).any(axis=1).sum()) for b in eval_batches()) == 60


@requires_tensorflow
def test_export_writes_a_tfds_split_as_text(tmp_path):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=5):
    pairs = corpora.TfdsPairs('wmt14_translate/de-en', 'test', 'en', 'de')
    src_path, tgt_path = corpora.export_text(pairs, tmp_path, 'test', 'en', 'de')
    expected = [pairs[i] for i in range(5)]
  assert src_path.read_text().splitlines() == [s for s, _ in expected]
  assert tgt_path.read_text().splitlines() == [t for _, t in expected]


def test_a_prepared_array_record_builder_is_read_without_mocks(toy_corpus, tmp_path):
  """The real read path: a translation builder prepared as array_record (as WMT is), read by language name."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  class ToyTranslate(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.Translation(languages=('de', 'en')),
                                   supervised_keys=('de', 'en'))

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples()}

    def _generate_examples(self):
      english = (toy_corpus / 'train.en').read_text().splitlines()
      german = (toy_corpus / 'train.de').read_text().splitlines()
      for i, (en, de) in enumerate(zip(english, german)):
        yield i, {'en': en + '\u00a0', 'de': de}

  ToyTranslate(data_dir=str(tmp_path / 'tfds'), file_format='array_record').download_and_prepare()
  pairs = corpora.TfdsPairs('toy_translate', 'train', 'en', 'de', data_dir=str(tmp_path / 'tfds'))
  text = corpora.TextPairs(toy_corpus, 'train', 'en', 'de')
  assert len(pairs) == len(text)
  # Same pairs (whitespace normalized), in whatever order the builder stored them.
  assert sorted(zip(*pairs.read(range(len(pairs))))) == sorted(zip(*text.read(range(len(text)))))
  with pytest.raises(corpora.data_lib.DataError, match=r"split 'valid' not in toy_translate"):
    corpora.TfdsPairs('toy_translate', 'valid', 'en', 'de', data_dir=str(tmp_path / 'tfds'))


def test_text_corpus_reads_by_index(toy_corpus):
  pairs = corpora.TextPairs(toy_corpus, 'train', 'en', 'de')
  source = (toy_corpus / 'train.en').read_text().splitlines()
  target = (toy_corpus / 'train.de').read_text().splitlines()
  assert len(pairs) == len(source) and pairs[3] == (source[3], target[3])
  assert pairs.read([5, 1]) == ([source[5], source[1]], [target[5], target[1]])


def test_lowercase_reads_every_split_lowercased_and_keys_its_own_token_cache(tmp_path):
  # config.lowercase: the text the vocabulary and the model see is str.lower of the normalized line (German
  # 'ß' stays 'ß': case folding would write 'ss', which no lowercased reference holds).
  data = tmp_path / 'data'
  data.mkdir()
  (data / 'train.en').write_text('A  Man on the STREET\nTwo Dogs\n')
  (data / 'train.de').write_text('Ein Mann auf der Straße\nZwei\tHunde\n')
  config = config_lib.base_config()
  config.data_dir = str(data)
  cased = corpora.open_split(config, 'train')
  config.lowercase = True
  lowered = corpora.open_split(config, 'train')
  assert cased.read([0, 1]) == (['A Man on the STREET', 'Two Dogs'], ['Ein Mann auf der Straße', 'Zwei Hunde'])
  assert lowered.read([0, 1]) == (['a man on the street', 'two dogs'], ['ein mann auf der straße', 'zwei hunde'])
  # The token cache of the cased text must not serve the lowercased one; a cased fingerprint keeps its old
  # form, so caches written before the field existed stay valid.
  assert cased.fingerprint != lowered.fingerprint and 'lowercase' not in cased.fingerprint
  lines = corpora.TextLines(data / 'train.de', lowercase=True)
  assert lines.read([0, 1])[0] == ['ein mann auf der straße', 'zwei hunde']
  # A workdir's config saved before the field existed reads cased text.
  del config['lowercase']
  assert corpora.open_split(config, 'train').read([0])[0] == ['A Man on the STREET']


def test_export_cli_writes_text_splits(toy_corpus, tmp_path):
  config = os.path.join(REPO, 'configs', 'multi30k.py')
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.corpora', 'export', '--config', config,
       f'--config.data_dir={toy_corpus}', '--split', 'valid', '--output_dir', str(tmp_path / 'out')],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert (tmp_path / 'out' / 'valid.en').read_text() == (toy_corpus / 'valid.en').read_text()


# --- The Multi30k download helper, against a local HTTP server --------------------------------------------

@pytest.fixture
def file_server(tmp_path):
  """An HTTP server on localhost serving tmp_path/'remote'."""
  root = tmp_path / 'remote'
  root.mkdir()
  handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
  handler.log_message = lambda *args: None
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield root, f'http://127.0.0.1:{server.server_address[1]}'
  server.shutdown()


def test_download_gunzips_renames_and_checks(file_server, tmp_path):
  root, url = file_server
  files = {}
  for name, remote in (('train.en', 'train.en.gz'), ('valid.de', 'val.de.gz')):
    text = ''.join(f'{name} line {i}\n' for i in range(7)).encode()
    (root / remote).write_bytes(gzip.compress(text))
    files[name] = (remote, hashlib.sha256(text).hexdigest(), 7)
  paths = download.download_multi30k(tmp_path / 'data', base_url=url, files=files)
  assert [p.name for p in paths] == ['train.en', 'valid.de']
  assert (tmp_path / 'data' / 'valid.de').read_text().splitlines()[6] == 'valid.de line 6'
  # Present and correct: not fetched again (the server no longer has it).
  (root / 'train.en.gz').unlink()
  download.download_multi30k(tmp_path / 'data', base_url=url, files=files)
  # A changed upstream file is refused by name, and nothing is written.
  (root / 'train.en.gz').write_bytes(gzip.compress(b'tampered\n'))
  (tmp_path / 'data' / 'train.en').unlink()
  with pytest.raises(download.DownloadError, match=r'train.en.gz: sha256 .* differs'):
    download.download_multi30k(tmp_path / 'data', base_url=url, files=files)
  assert not (tmp_path / 'data' / 'train.en').exists()
  with pytest.raises(download.DownloadError, match=r'missing.gz: HTTP 404'):
    download.download_multi30k(tmp_path / 'data', base_url=url, files={'x.en': ('missing.gz', '', 1)})


@pytest.mark.skipif(not os.path.isdir(SHARED_MULTI30K), reason='../shared/data/multi30k not present')
def test_download_cli_reproduces_the_shared_multi30k_files(file_server, tmp_path):
  """Serves gzipped copies of ../shared/data/multi30k under the repository's names; the CLI must rebuild
  byte-identical files (the pinned checksums are those of the real upstream files)."""
  root, url = file_server
  for name, (remote, _, _) in download.MULTI30K_FILES.items():
    with open(os.path.join(SHARED_MULTI30K, name), 'rb') as f:
      (root / remote).write_bytes(gzip.compress(f.read()))
  result = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.download', '--data_dir', str(tmp_path / 'm30k'),
                           '--base_url', url], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  for name in download.MULTI30K_FILES:
    with open(os.path.join(SHARED_MULTI30K, name), 'rb') as f:
      assert (tmp_path / 'm30k' / name).read_bytes() == f.read()


# --- Multi30k fetched on first use --------------------------------------------------------------------------

def serve_toy_multi30k(root, monkeypatch, names=('train.en', 'train.de', 'valid.en', 'valid.de')):
  """Gzipped toy files under Multi30k's remote names, and download.MULTI30K_FILES pinned to their hashes."""
  files = {}
  for name in names:
    text = ''.join(f'{name} sentence {i}\n' for i in range(5)).encode()
    remote = download.MULTI30K_FILES[name][0]
    (root / remote).write_bytes(gzip.compress(text))
    files[name] = (remote, hashlib.sha256(text).hexdigest(), 5)
  monkeypatch.setattr(download, 'MULTI30K_FILES', files)
  return files


def multi30k_config(data_dir):
  c = config_lib.base_config()
  c.data_dir, c.data_download = str(data_dir), 'multi30k'
  return c


def test_first_use_fetches_multi30k_into_the_cache_and_checks_it(file_server, tmp_path, monkeypatch):
  root, url = file_server
  files = serve_toy_multi30k(root, monkeypatch)
  monkeypatch.setenv(download.URL_ENV, url)
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  # Without ../shared/data/multi30k the config reads the user cache.
  monkeypatch.setattr(config_lib, '_SHARED_DATA', tmp_path / 'no_shared')
  data_dir = download.multi30k_data_dir()
  assert data_dir == str(tmp_path / 'cache' / 'multi30k')
  download.ensure_corpus(multi30k_config(data_dir))
  for name in files:
    assert (tmp_path / 'cache' / 'multi30k' / name).read_text().splitlines()[4] == f'{name} sentence 4'
  # Present: nothing is fetched again (the server has nothing left), and a local edit is left alone.
  for path in root.iterdir():
    path.unlink()
  (tmp_path / 'cache' / 'multi30k' / 'valid.de').write_text('edited\n')
  download.ensure_corpus(multi30k_config(data_dir))
  assert (tmp_path / 'cache' / 'multi30k' / 'valid.de').read_text() == 'edited\n'
  # With the shared corpus present, that is where the config reads.
  (tmp_path / 'shared' / 'multi30k').mkdir(parents=True)
  (tmp_path / 'shared' / 'multi30k' / 'train.en').write_text('x\n')
  monkeypatch.setattr(config_lib, '_SHARED_DATA', tmp_path / 'shared')
  assert download.multi30k_data_dir() == str(tmp_path / 'shared' / 'multi30k')


def test_a_data_dir_holding_the_runs_own_splits_is_not_downloaded_into(tmp_path, monkeypatch):
  """--config.data_dir with the user's own train/valid files: a config with data_download never fetches
  (here any fetch would fail: the mirror is a closed address)."""
  for name in ('train.en', 'train.de', 'valid.en', 'valid.de'):
    (tmp_path / name).write_text('a line\n')
  monkeypatch.setenv(download.URL_ENV, 'http://127.0.0.1:9')
  download.ensure_corpus(multi30k_config(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == ['train.de', 'train.en', 'valid.de', 'valid.en']
  (tmp_path / 'valid.de').unlink()  # a split of the run missing: the fetch is tried, and fails in one error
  with pytest.raises(data_lib.DataError, match='--config.data_dir=DIR'):
    download.ensure_corpus(multi30k_config(tmp_path))


def test_a_corrupted_download_is_rejected_and_not_written(file_server, tmp_path, monkeypatch):
  root, url = file_server
  serve_toy_multi30k(root, monkeypatch)
  (root / 'val.de.gz').write_bytes(gzip.compress(b'valid.de sentence 0\ncorrupted\n'))
  monkeypatch.setenv(download.URL_ENV, url)
  with pytest.raises(data_lib.DataError, match=r'val.de.gz: sha256 .* differs.*--config.data_dir=DIR'):
    download.ensure_corpus(multi30k_config(tmp_path / 'm30k'))
  assert not (tmp_path / 'm30k' / 'valid.de').exists()
  assert not list((tmp_path / 'm30k').glob('.*.tmp'))


def test_training_offline_stops_with_one_error_naming_the_flag(tmp_path):
  """The README command on a machine without the corpus and without internet (a closed local port)."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    closed = f'http://127.0.0.1:{s.getsockname()[1]}'
  env = dict(os.environ, **{download.URL_ENV: closed})
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.train', '--config', os.path.join(REPO, 'configs', 'multi30k.py'),
       f'--config.data_dir={tmp_path / "absent"}', f'--workdir={tmp_path / "run"}'],
      capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('error: Multi30k is not in') and 'pass --config.data_dir=DIR' in last, result.stderr[-2000:]
