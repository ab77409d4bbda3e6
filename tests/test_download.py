"""The Multi30k download (data/download.py, python -m flaxformer_nmt.download) against a local HTTP server laid out
as the upstream repository, and the Multi30k configs' data fields."""
import functools
import gzip
import hashlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import zlib

import pytest

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import download
from flaxformer_nmt.runtime import cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), 'shared', 'data')
MULTI30K_CONFIGS = ('multi30k', 'multi30k_best', 'multi30k_tiny', 'lm_multi30k', 'mlm_multi30k')


class TruncatingHandler(http.server.SimpleHTTPRequestHandler):
  """Serves files from `directory`; a file named in `truncated` is announced whole (Content-Length) but only its
  first half is sent before the connection closes, as a dropped connection does; a file named in `limited` is
  answered 429 Too Many Requests that many times first, as a rate-limiting host does."""
  truncated, limited = (), {}

  def do_GET(self):  # pylint: disable=invalid-name
    name = self.path.lstrip('/')
    if self.limited.get(name):
      self.limited[name] -= 1
      self.send_error(429, 'Too Many Requests')
      return None
    if name not in self.truncated:
      return super().do_GET()
    data = open(os.path.join(self.directory, name), 'rb').read()
    self.send_response(200)
    self.send_header('Content-Length', str(len(data)))
    self.end_headers()
    self.wfile.write(data[:len(data) // 2])
    self.close_connection = True
    return None

  def log_message(self, *args):
    pass


@pytest.fixture
def file_server(tmp_path):
  """(root, url, handler): an HTTP server on 127.0.0.1 serving tmp_path/'remote'."""
  root = tmp_path / 'remote'
  root.mkdir()
  handler = type('Handler', (TruncatingHandler,), {'truncated': set(), 'limited': {}})
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(handler, directory=str(root)))
  thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
  thread.start()
  yield root, f'http://127.0.0.1:{server.server_address[1]}', handler
  server.shutdown()


def toy_text(name, tok, lines=5):
  return ''.join(f'{name} {"tok " if tok else ""}sentence {i}\n' for i in range(lines)).encode()


def serve_toy_multi30k(root, monkeypatch):
  """Toy files under the upstream paths (raw gzipped, tok plain), and both pinned tables set to their hashes.
  Returns {(tok, name): text}."""
  texts = {}
  for tok, table_name in ((False, 'MULTI30K_FILES'), (True, 'MULTI30K_TOK_FILES')):
    table = {}
    for name, (remote, _, _) in getattr(download, table_name).items():
      text = toy_text(name, tok)
      (root / remote).parent.mkdir(parents=True, exist_ok=True)
      (root / remote).write_bytes(gzip.compress(text) if remote.endswith('.gz') else text)
      table[name] = (remote, hashlib.sha256(text).hexdigest(), 5)
      texts[tok, name] = text
    monkeypatch.setattr(download, table_name, table)
  return texts


def test_download_writes_raw_and_tokenized_text_from_a_mirror_laid_out_as_upstream(file_server, tmp_path,
                                                                                      monkeypatch):
  """Catches: the tokenized files not fetched, fetched into the raw directory, gunzipped though plain, or renamed
  to the wrong split; a correct file fetched again."""
  root, url, _ = file_server
  texts = serve_toy_multi30k(root, monkeypatch)
  paths = download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  assert len(paths) == 12
  for (tok, name), text in texts.items():
    assert (tmp_path / ('m30k_tok' if tok else 'm30k') / name).read_bytes() == text
  # Present and correct: nothing is fetched again (the server has nothing left).
  for path in sorted(root.rglob('*'), reverse=True):
    path.rmdir() if path.is_dir() else path.unlink()
  download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  assert sorted(p.name for p in (tmp_path / 'm30k').iterdir()) == sorted(download.MULTI30K_FILES)


def test_a_present_file_that_differs_from_its_checksum_is_fetched_again(file_server, tmp_path, monkeypatch):
  """The download command keeps only files that match their sha256: a stale or half-copied file under the right
  name is replaced by the mirror's, the others are left as they are (not fetched: the mirror lacks them)."""
  root, url, _ = file_server
  texts = serve_toy_multi30k(root, monkeypatch)
  download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  stale = tmp_path / 'm30k' / 'valid.de'
  stale.write_bytes(texts[False, 'valid.de'][:10])
  for tok, name in texts:
    if (tok, name) != (False, 'valid.de'):
      (root / (download.MULTI30K_TOK_FILES if tok else download.MULTI30K_FILES)[name][0]).unlink()
  download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  assert stale.read_bytes() == texts[False, 'valid.de']


@pytest.mark.parametrize('tok', [False, True])
def test_a_file_that_differs_from_its_checksum_is_refused_by_name_and_not_written(file_server, tmp_path,
                                                                                   monkeypatch, tok):
  root, url, _ = file_server
  serve_toy_multi30k(root, monkeypatch)
  remote = (download.MULTI30K_TOK_FILES if tok else download.MULTI30K_FILES)['valid.de'][0]
  changed = b'valid.de sentence 0\ncorrupted\n'
  (root / remote).write_bytes(changed if tok else gzip.compress(changed))
  with pytest.raises(download.DownloadError, match=rf'{remote}: sha256 {hashlib.sha256(changed).hexdigest()} '
                                                   'differs from the expected'):
    download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  target = tmp_path / ('m30k_tok' if tok else 'm30k')
  assert not (target / 'valid.de').exists()
  assert not list(target.glob('.*'))  # no temporary file left either


def test_a_connection_dropped_mid_file_leaves_no_file(file_server, tmp_path, monkeypatch):
  """Catches: http.client.IncompleteRead escaping as a traceback, or half a file written under its name."""
  root, url, handler = file_server
  serve_toy_multi30k(root, monkeypatch)
  remote = download.MULTI30K_TOK_FILES['train.de'][0]
  handler.truncated.add(remote)
  monkeypatch.setattr(download.time, 'sleep', lambda seconds: None)  # the retries' backoff
  with pytest.raises(download.DownloadError, match=rf'{remote}: .*IncompleteRead.*after 3 attempts'):
    download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  assert not (tmp_path / 'm30k_tok' / 'train.de').exists()
  assert not list((tmp_path / 'm30k_tok').glob('.*'))


def test_a_rate_limited_file_is_asked_for_again(file_server, tmp_path, monkeypatch):
  """Wrong rule caught: only 5xx answers were retried, so one 429 from a rate-limiting host (GitHub's raw files
  answer so) stopped the download, where a later try gets the file."""
  root, url, handler = file_server
  serve_toy_multi30k(root, monkeypatch)
  remote = download.MULTI30K_TOK_FILES['train.de'][0]
  handler.limited[remote] = 2
  monkeypatch.setattr(download.time, 'sleep', lambda seconds: None)  # the retries' backoff
  download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  assert handler.limited[remote] == 0
  assert (tmp_path / 'm30k_tok' / 'train.de').read_text() == (root / remote).read_text()


def test_a_write_that_fails_midway_leaves_no_file(file_server, tmp_path, monkeypatch):
  """A file-size limit makes the write fail after 50 bytes, as a full disk does. Catches: the temporary file
  left behind, or a half-written file under the final name."""
  root, url, _ = file_server
  serve_toy_multi30k(root, monkeypatch)
  script = (
      'import resource, signal, sys\n'
      'from flaxformer_nmt.data import download\n'
      'download.MULTI30K_FILES = {"train.en": ("data/task1/raw/train.en.gz", sys.argv[2], 5)}\n'
      'signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
      'resource.setrlimit(resource.RLIMIT_FSIZE, (50, 50))\n'
      'try:\n'
      '  download.download_files(sys.argv[1], download.MULTI30K_FILES, sys.argv[3])\n'
      'except download.DownloadError as e:\n'
      '  sys.exit(f"error: {e}")\n')
  expected = download.MULTI30K_FILES['train.en'][1]
  assert len(toy_text('train.en', False)) > 50
  result = subprocess.run([sys.executable, '-c', script, str(tmp_path / 'm30k'), expected, url],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and f'{tmp_path / "m30k" / "train.en"}: cannot write' in result.stderr, (
      result.stderr[-2000:])
  assert list((tmp_path / 'm30k').iterdir()) == []


def test_a_write_interrupted_before_its_rename_leaves_no_file(tmp_path, monkeypatch):
  # Ctrl-C between the write and the rename: the .train.en.PID.tmp stayed, under a name no later run reuses.
  path_type = type(download.epath.Path(tmp_path))

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(path_type, 'replace', interrupted)
  with pytest.raises(KeyboardInterrupt):
    download.write_atomically(download.epath.Path(tmp_path) / 'train.en', b'a dog .\n')
  assert list(tmp_path.iterdir()) == []


def test_download_cli_fills_both_directories_beside_each_other(tmp_path, monkeypatch, file_server):
  """`--data_dir DIR` writes DIR and DIR_tok (file:// mirror from the environment, as offline copies are served).
  Catches: the tokenized text written elsewhere than where the docs tell --config.eval_bleu_tok_ref_dir to look."""
  root, _, _ = file_server
  texts = serve_toy_multi30k(root, monkeypatch)
  tables = {'MULTI30K_FILES': download.MULTI30K_FILES, 'MULTI30K_TOK_FILES': download.MULTI30K_TOK_FILES}
  script = ('import sys\n'
            'from absl import app\n'
            'from flaxformer_nmt import download as command\n'
            'from flaxformer_nmt.data import download\n'
            f'download.MULTI30K_FILES, download.MULTI30K_TOK_FILES = {tables["MULTI30K_FILES"]!r}, '
            f'{tables["MULTI30K_TOK_FILES"]!r}\n'
            'command.define_flags()\n'
            'app.run(command.main)\n')
  env = dict(os.environ, **{download.URL_ENV: root.as_uri()})
  result = subprocess.run([sys.executable, '-c', script, '--data_dir', str(tmp_path / 'data' / 'm30k') + '/'],
                          capture_output=True, text=True, timeout=120, env=env)
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(result.stdout.splitlines()) == 12
  for (tok, name), text in texts.items():
    assert (tmp_path / 'data' / ('m30k_tok' if tok else 'm30k') / name).read_bytes() == text


def test_the_download_command_offline_says_how_to_copy_the_corpus(tmp_path, monkeypatch, capsys):
  """A server that never answers (no internet) ended in the bare connection error; the trainer's offline advice
  (download elsewhere, --config.data_dir) is the way forward here too."""
  import in_process  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import download as command  # pylint: disable=g-import-not-at-top
  with socket.socket() as closed:  # a port nothing listens on
    closed.bind(('127.0.0.1', 0))
    port = closed.getsockname()[1]
  monkeypatch.setattr(download.time, 'sleep', lambda seconds: None)
  result = in_process.run(command, [f'--data_dir={tmp_path / "m30k"}', f'--base_url=http://127.0.0.1:{port}'])
  assert result.returncode == 1, result.stderr[-2000:]
  assert '(after 3 attempts). Without internet access, copy the corpus to this machine' in result.stderr
  assert '--config.data_dir=DIR' in result.stderr


def test_a_directory_where_a_file_goes_is_one_error_naming_it(tmp_path):
  import in_process  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import download as command  # pylint: disable=g-import-not-at-top
  (tmp_path / 'm30k' / 'train.en').mkdir(parents=True)
  result = in_process.run(command, [f'--data_dir={tmp_path / "m30k"}', f'--base_url={tmp_path.as_uri()}'])
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(f'error: {tmp_path / "m30k" / "train.en"}: a directory')


def test_a_file_missing_from_a_local_mirror_is_named_at_once_not_called_unreachable(tmp_path, monkeypatch):
  """A file:// mirror without the file was asked 3 times, about 6 s of backoff, then called unreachable with the
  advice for machines without internet."""
  monkeypatch.setattr(download.time, 'sleep', lambda seconds: pytest.fail('retried a local file'))
  url = (tmp_path / 'train.en.gz').as_uri()
  with pytest.raises(download.DownloadError, match=f'^{url}: ') as raised:
    download.fetch(url)
  assert not isinstance(raised.value, download.UnreachableError)


@pytest.mark.skipif(not all(os.path.isdir(os.path.join(SHARED, d)) for d in ('multi30k', 'multi30k_tok')),
                    reason='../shared/data absent')
def test_the_pinned_checksums_are_those_of_the_shared_copies_of_upstream(file_server, tmp_path):
  """Serves ../shared/data/multi30k (gzipped) and multi30k_tok (as they are) under the upstream paths; the CLI
  must accept every file against the pinned sha256 values and rebuild them byte for byte. Catches: a wrong
  pinned hash, line count or upstream path."""
  root, url, _ = file_server
  for directory, table in (('multi30k', download.MULTI30K_FILES), ('multi30k_tok', download.MULTI30K_TOK_FILES)):
    for name, (remote, _, _) in table.items():
      data = open(os.path.join(SHARED, directory, name), 'rb').read()
      (root / remote).parent.mkdir(parents=True, exist_ok=True)
      (root / remote).write_bytes(gzip.compress(data) if remote.endswith('.gz') else data)
  result = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.download', '--data_dir', str(tmp_path / 'm30k'),
                           '--base_url', url], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  for directory in ('multi30k', 'multi30k_tok'):
    for name in download.MULTI30K_FILES:
      written = tmp_path / directory.replace('multi30k', 'm30k') / name
      assert written.read_bytes() == open(os.path.join(SHARED, directory, name), 'rb').read()


# --- Multi30k fetched by training on first use ----------------------------------------------------------------

def load_config(name='multi30k'):
  """configs/NAME.py (its directories follow $FLAXFORMER_NMT_CACHE as set when it is loaded)."""
  return config_lib.load_config_file(os.path.join(REPO, 'configs', f'{name}.py'))


@pytest.mark.parametrize('name', MULTI30K_CONFIGS)
def test_the_multi30k_configs_read_the_download_cache(name, tmp_path, monkeypatch):
  """Catches: a config reading ../shared (absent from a user's clone) or a tokenized-reference directory other
  than the one the download fills."""
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  c = load_config(name)
  assert (c.data_dir, c.eval_bleu_tok_ref_dir, c.data_download) == (
      str(tmp_path / 'cache' / 'multi30k'), str(tmp_path / 'cache' / 'multi30k_tok'), 'multi30k')
  assert (c.source_lang, c.target_lang, c.train_split, c.eval_split) == ('en', 'de', 'train', 'valid')


def test_first_use_fetches_raw_and_tokenized_multi30k_into_the_cache(file_server, tmp_path, monkeypatch):
  root, url, _ = file_server
  texts = serve_toy_multi30k(root, monkeypatch)
  monkeypatch.setenv(download.URL_ENV, url)
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  config = load_config()
  download.ensure_corpus(config)
  for (tok, name), text in texts.items():
    assert (tmp_path / 'cache' / ('multi30k_tok' if tok else 'multi30k') / name).read_bytes() == text
  # Present: nothing is fetched again (the server has nothing left), and a local edit is left alone.
  for path in sorted(root.rglob('*'), reverse=True):
    path.rmdir() if path.is_dir() else path.unlink()
  (tmp_path / 'cache' / 'multi30k' / 'valid.de').write_text('edited\n')
  download.ensure_corpus(config)
  assert (tmp_path / 'cache' / 'multi30k' / 'valid.de').read_text() == 'edited\n'


def test_a_data_dir_holding_the_runs_own_splits_is_not_downloaded_into(tmp_path, monkeypatch):
  """--config.data_dir with the user's own train/valid files: a config with data_download never fetches
  (here any fetch would fail: the mirror is a closed address)."""
  for name in ('train.en', 'train.de', 'valid.en', 'valid.de'):
    (tmp_path / name).write_text('a line\n')
  monkeypatch.setenv(download.URL_ENV, 'http://127.0.0.1:9')
  monkeypatch.setattr(download.time, 'sleep', lambda seconds: None)  # the retries' backoff
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  config = load_config()
  config.data_dir = str(tmp_path)
  download.ensure_corpus(config)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['train.de', 'train.en', 'valid.de', 'valid.en']
  (tmp_path / 'valid.de').unlink()  # a split of the run missing: the fetch is tried, and fails in one error
  with pytest.raises(data_lib.DataError, match='--config.data_dir=DIR'):
    download.ensure_corpus(config)


def test_a_language_model_fetches_nothing_for_the_splits_it_reads_elsewhere_or_not_at_all(tmp_path, monkeypatch):
  """An LM reads the target side only (it used to fetch Multi30k, or fail offline, for want of train.en), and
  nothing from data_dir where text_train_file and text_eval_file are named (data_dir may then be empty)."""
  monkeypatch.setenv(download.URL_ENV, 'http://127.0.0.1:9')  # any fetch fails
  monkeypatch.setattr(download.time, 'sleep', lambda seconds: None)
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  config = load_config('lm_multi30k')
  config.data_dir = str(tmp_path)
  for name in ('train.de', 'valid.de'):
    (tmp_path / name).write_text('ein hund .\n')
  download.ensure_corpus(config)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['train.de', 'valid.de']
  config.data_dir, config.text_train_file, config.text_eval_file = '', str(tmp_path / 'train.de'), str(
      tmp_path / 'valid.de')
  assert download.files_read(config) == []
  download.ensure_corpus(config)
  config_lib.validate(config)  # no data_dir needed
  config.text_eval_file = ''
  with pytest.raises(config_lib.ConfigError, match='config.data_dir is empty'):
    config_lib.validate(config)


def test_a_corrupted_download_stops_training_with_one_error(file_server, tmp_path, monkeypatch):
  root, url, _ = file_server
  serve_toy_multi30k(root, monkeypatch)
  (root / 'data/task1/raw/val.de.gz').write_bytes(gzip.compress(b'valid.de sentence 0\ncorrupted\n'))
  monkeypatch.setenv(download.URL_ENV, url)
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  with pytest.raises(data_lib.DataError, match=r'val.de.gz: sha256 .* differs.*--config.data_dir=DIR'):
    download.ensure_corpus(load_config())
  assert not (tmp_path / 'cache' / 'multi30k' / 'valid.de').exists()


def test_a_damaged_gzip_stream_is_refused_by_name_and_stops_training_with_one_error(file_server, tmp_path,
                                                                                   monkeypatch):
  """A .gz whose compressed data is damaged (a bad mirror, a flipped bit) made zlib.error escape as a traceback:
  the download command and the first training run named neither the file nor the way forward."""
  root, url, _ = file_server
  serve_toy_multi30k(root, monkeypatch)
  remote = download.MULTI30K_FILES['valid.de'][0]
  damaged = bytearray((root / remote).read_bytes())
  damaged[10] |= 0b110  # the first deflate block's type bits set to 11, a type that does not exist
  (root / remote).write_bytes(bytes(damaged))
  with pytest.raises(zlib.error):
    gzip.decompress(bytes(damaged))
  with pytest.raises(download.DownloadError, match=rf'{remote}: not a valid gzip file'):
    download.download_multi30k(tmp_path / 'm30k', tmp_path / 'm30k_tok', url)
  assert not (tmp_path / 'm30k' / 'valid.de').exists()
  monkeypatch.setenv(download.URL_ENV, url)
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  with pytest.raises(data_lib.DataError, match=r'val.de.gz: not a valid gzip file.*--config.data_dir=DIR'):
    download.ensure_corpus(load_config())


def test_the_default_mirror_is_the_pinned_upstream_commit(monkeypatch):
  """Without --base_url or $FLAXFORMER_NMT_MULTI30K_URL the files come from multi30k/dataset at the commit whose
  files the pinned sha256 values describe; a given mirror is used as it is, less a trailing slash."""
  monkeypatch.delenv(download.URL_ENV, raising=False)
  assert download.mirror() == ('https://raw.githubusercontent.com/multi30k/dataset/'
                               'c40b37b23d6387214f8ab37335b5a8672b9745f2')
  monkeypatch.setenv(download.URL_ENV, 'file:///srv/multi30k/')
  assert download.mirror() == 'file:///srv/multi30k'
  assert download.mirror('http://mirror.example/m30k/') == 'http://mirror.example/m30k'


def test_a_mirror_given_as_a_bare_path_is_one_error_naming_the_url_form(tmp_path, monkeypatch):
  """$FLAXFORMER_NMT_MULTI30K_URL or --base_url set to a directory path (not a file:// URL) ended in urllib's
  ValueError as a traceback, in training and in the download command alike."""
  mirror = str(tmp_path / 'mirror')
  with pytest.raises(download.DownloadError, match=r"mirror '.*/mirror' is not an http\(s\):// or file:// URL"):
    download.download_files(tmp_path / 'm30k', download.MULTI30K_FILES, mirror)
  monkeypatch.setenv(download.URL_ENV, mirror)
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  with pytest.raises(data_lib.DataError, match=r'is not an http\(s\):// or file:// URL.*--config.data_dir=DIR'):
    download.ensure_corpus(load_config())


def test_training_offline_stops_with_one_error_naming_the_flag(tmp_path):
  """The README command on a machine without the corpus and without internet (a closed local port)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    closed = f'http://127.0.0.1:{s.getsockname()[1]}'
  env = dict(os.environ, **{download.URL_ENV: closed, cache.CACHE_ENV: str(tmp_path / 'cache')})
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.train', '--config', os.path.join(REPO, 'configs', 'multi30k.py'),
       f'--workdir={tmp_path / "run"}'], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('error: Multi30k is not in') and 'pass --config.data_dir=DIR' in last, result.stderr[-2000:]
  assert result.stderr.count('Multi30k is not in') == 1, result.stderr[-2000:]  # not logged, then printed again
