r"""Multi30k En-De (task 1): its pinned files, their download, and the data fields of the Multi30k configs.

  python -m flaxformer_nmt.download                      # into ~/.cache/flaxformer_nmt/multi30k{,_tok}
  python -m flaxformer_nmt.download --data_dir DIR       # into DIR and DIR_tok

Two sets of files come from the repository `multi30k/dataset` at one pinned commit, each renamed to this
project's `{split}.{lang}` layout (train, valid, test2016) and checked against its known sha256 and line count:
the raw text (`data/task1/raw/*.gz`, gunzipped) and the dataset's official lowercased, punctuation-normalized,
Moses-tokenized text (`data/task1/tok/*.lc.norm.tok.*`), the references of lowercased tokenized BLEU. Files
already present are not fetched again; each file is written under a temporary name and renamed into place, so a
failed or interrupted download never leaves a half-written file.

The Multi30k configs (use_multi30k) read the user cache, `$FLAXFORMER_NMT_CACHE/multi30k` and `.../multi30k_tok`
(default `~/.cache/flaxformer_nmt`, or under $XDG_CACHE_HOME), and training fills it on first use
(ensure_corpus). $FLAXFORMER_NMT_MULTI30K_URL names a mirror laid out as the repository (`data/task1/raw/`,
`data/task1/tok/`): an http(s):// or file:// URL.
"""
import gzip
import hashlib
import http.client
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib

from absl import logging
from etils import epath

from flaxformer_nmt.runtime import files as files_lib
from flaxformer_nmt.runtime.cache import cache_dir

# One commit for both sets: the last commit touching data/task1/raw/.
MULTI30K_COMMIT = 'c40b37b23d6387214f8ab37335b5a8672b9745f2'
MULTI30K_URL = f'https://raw.githubusercontent.com/multi30k/dataset/{MULTI30K_COMMIT}'
URL_ENV = 'FLAXFORMER_NMT_MULTI30K_URL'

# Our name -> (path in the repository, sha256 of the (gunzipped) text, lines).
MULTI30K_FILES = {
    'train.en': ('data/task1/raw/train.en.gz', '460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6',
                 29000),
    'train.de': ('data/task1/raw/train.de.gz', '2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72',
                 29000),
    'valid.en': ('data/task1/raw/val.en.gz', '1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227',
                 1014),
    'valid.de': ('data/task1/raw/val.de.gz', '660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660',
                 1014),
    'test2016.en': ('data/task1/raw/test_2016_flickr.en.gz',
                    '399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182', 1000),
    'test2016.de': ('data/task1/raw/test_2016_flickr.de.gz',
                    '4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16', 1000),
}
MULTI30K_TOK_FILES = {
    'train.en': ('data/task1/tok/train.lc.norm.tok.en',
                 '08925f8e0572bcd5a006702fc5fe20e2d77c6917d4eebd576fc20de6693c2119', 29000),
    'train.de': ('data/task1/tok/train.lc.norm.tok.de',
                 'cb5a23529b65ec2061f1dc446192a9c37382b63cc75f81a0be59d34894b3a505', 29000),
    'valid.en': ('data/task1/tok/val.lc.norm.tok.en',
                 '46573ce391ae227f1c72f873392436a20ef18e0a6d518098cfbd70b77c8572ec', 1014),
    'valid.de': ('data/task1/tok/val.lc.norm.tok.de',
                 '97232bd273eceb7207f689527386a97e4be2616b18ada47576bdaf96c8ae1f00', 1014),
    'test2016.en': ('data/task1/tok/test_2016_flickr.lc.norm.tok.en',
                    '5b7f32627cf99eced828311b955dae9800bb52bc8b91cf8b6526829e605b29d2', 1000),
    'test2016.de': ('data/task1/tok/test_2016_flickr.lc.norm.tok.de',
                    'c6a33d39d48f9f510de147651316cd9d918e09ad0219df734a2f16b6baccacc4', 1000),
}


# What to do on a machine that cannot reach the corpus's server.
OFFLINE_HINT = ('Without internet access, copy the corpus to this machine (python -m flaxformer_nmt.download '
                '--data_dir DIR, on a machine with internet, writes DIR and DIR_tok) and pass --config.data_dir=DIR '
                '(and --config.eval_bleu_tok_ref_dir=DIR_tok for tokenized BLEU).')


class DownloadError(RuntimeError):
  """A file that could not be fetched, checked or written; the message names it."""


class UnreachableError(DownloadError):
  """The server did not answer, or the connection broke, however often it was asked."""


def multi30k_data_dir():
  """Where the Multi30k configs read the raw text: the user cache's `multi30k`."""
  return str(cache_dir() / 'multi30k')


def multi30k_tok_dir():
  """Where the Multi30k configs read the tokenized references: the user cache's `multi30k_tok`."""
  return str(cache_dir() / 'multi30k_tok')


def tok_dir_beside(data_dir):
  """`DIR_tok` for the raw text in `DIR`, as the cache keeps `multi30k_tok` beside `multi30k`."""
  return str(epath.Path(data_dir)) + '_tok'


def use_multi30k(c):
  """Sets the Multi30k data fields of config `c` and returns it: English->German, the text from the download
  cache (fetched on first use; offline, --config.data_dir=DIR), validation on valid with BLEU also against the
  tokenized references, lowercased text, 4,096 tokens a step in packed 64-token rows, an 8k vocabulary."""
  c.data_source = 'text'
  c.data_dir = multi30k_data_dir()
  c.data_download = 'multi30k'  # fetch the files absent from data_dir (ensure_corpus)
  c.source_lang, c.target_lang = 'en', 'de'
  c.train_split, c.eval_split = 'train', 'valid'
  c.eval_bleu_tok_ref_dir = multi30k_tok_dir()  # lowercased tokenized BLEU in training
  c.lowercase = True  # as the Multi30k papers train: translations are lowercase, sacreBLEU case:lc
  c.max_length = 128
  c.tokens_per_batch = 4096
  c.packed_length = 64  # several pairs a row: one batch shape, little padding
  c.vocab_size = 8000
  c.sentencepiece_max_chars = 0  # learnt from all 3.9M characters
  return c


def ensure_corpus(config, is_leader=True, barrier=lambda name: None):
  """Fetches Multi30k for a config with data_download='multi30k' whose data_dir lacks the run's splits: the raw
  text into data_dir and the tokenized references into eval_bleu_tok_ref_dir (when set); process 0 first, then
  any host that still lacks them (its directories are not on shared storage). A data_dir that holds the run's
  splits (an offline copy, or the user's own corpus) is read as it is, nothing fetched. Raises corpus.DataError
  naming --config.data_dir when the files cannot be fetched (e.g. no internet)."""
  from flaxformer_nmt.data import corpus as data_lib  # pylint: disable=g-import-not-at-top
  if not config.data_download or config.data_source != 'text':  # config.validate allows '' and 'multi30k'
    return
  if all(path.exists() for path in files_read(config)):  # none at all: nothing to fetch
    return
  try:
    if is_leader:
      ensure_multi30k(config.data_dir, config.eval_bleu_tok_ref_dir)
    barrier('corpus downloaded')
    ensure_multi30k(config.data_dir, config.eval_bleu_tok_ref_dir)
  except (DownloadError, OSError) as e:
    raise data_lib.DataError(
        f'Multi30k is not in {config.data_dir} and could not be downloaded ({e}). {OFFLINE_HINT}') from None


def files_read(config):
  """The files of config.data_dir a run reads: both sides of the train and eval splits for translation, the
  target side for a language model (lm, mlm), except the splits it reads from text_train_file/text_eval_file."""
  translation = config.task == 'translation'
  langs = (config.source_lang, config.target_lang) if translation else (config.target_lang,)
  files = []
  for split, named in ((config.train_split, config.text_train_file), (config.eval_split, config.text_eval_file)):
    if translation or not named:
      files += [epath.Path(config.data_dir) / f'{split}.{lang}' for lang in langs]
  return files


def ensure_multi30k(data_dir, tok_dir=''):
  """Downloads the Multi30k files absent from `data_dir` and (when given) `tok_dir` from `mirror()`; files present
  are left as they are."""
  for directory, files in ((data_dir, MULTI30K_FILES), (tok_dir, MULTI30K_TOK_FILES)):
    if not directory:
      continue
    missing = {name: entry for name, entry in files.items() if not (epath.Path(directory) / name).exists()}
    if missing:
      logging.info('Multi30k: %d files absent from %s, downloading them (first use only)', len(missing), directory)
      download_files(directory, missing)


def download_multi30k(data_dir, tok_dir, base_url=None):
  """Writes the raw text into `data_dir` and the tokenized text into `tok_dir` (train, valid and test2016,
  .en and .de); files present and matching their checksum are kept. Returns the paths."""
  return download_files(data_dir, MULTI30K_FILES, base_url) + download_files(tok_dir, MULTI30K_TOK_FILES, base_url)


def mirror(base_url=None):
  """`base_url`, else $FLAXFORMER_NMT_MULTI30K_URL, else the pinned commit on GitHub."""
  url = (base_url or os.environ.get(URL_ENV) or MULTI30K_URL).rstrip('/')
  if urllib.parse.urlsplit(url).scheme not in ('http', 'https', 'file'):
    raise DownloadError(f'mirror {url!r} is not an http(s):// or file:// URL (--base_url, ${URL_ENV}); for a local '
                        'directory use file:///ABSOLUTE/PATH')
  return url


def download_files(directory, files, base_url=None):
  """Fetches each of `files` ({name: (path in the repository, sha256, lines)}) from the mirror into
  `directory`, unless present with the expected sha256; returns the paths."""
  directory = epath.Path(directory)
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise DownloadError(f'{directory}: cannot create ({e.strerror or e})') from None
  written = []
  for number, (name, (remote, expected, lines)) in enumerate(files.items(), 1):
    path = directory / name
    if is_present(path, expected):
      logging.info('%s is present', path)
    else:
      url = f'{mirror(base_url)}/{remote}'
      start = time.time()
      text = checked_text(url, fetch(url), expected, lines)
      write_atomically(path, text)
      logging.info('[%d/%d] %s: %d lines from %s in %.1f s', number, len(files), path, lines, url,
                   time.time() - start)
    written.append(path)
  return written


def is_present(path, expected):
  """Whether `path` holds the file of sha256 `expected`; DownloadError where it cannot be read or replaced."""
  if path.is_dir():
    raise DownloadError(f'{path}: a directory where the downloaded file goes: move it away or choose another '
                        'directory')
  try:
    return path.exists() and sha256(path.read_bytes()) == expected
  except OSError as e:
    raise DownloadError(f'{path}: cannot read ({e.strerror or e})') from None


def fetch(url, attempts=3, timeout=60):
  """The bytes at `url` (http(s):// or file://), retried with backoff on network errors."""
  for attempt in range(1, attempts + 1):
    try:
      with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()
    except urllib.error.HTTPError as e:
      # 404 and the like will not get better; a server error, a timeout or a rate limit may
      if (e.code < 500 and e.code not in (408, 429)) or attempt == attempts:
        raise DownloadError(f'{url}: HTTP {e.code} {e.reason}') from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as e:
      if url.startswith('file:'):  # a local mirror: asking again will not make a missing file appear
        raise DownloadError(f'{url}: {getattr(e, "reason", None) or repr(e)}') from None
      if attempt == attempts:  # e.g. IncompleteRead: the connection closed before the whole file came
        raise UnreachableError(f'{url}: {getattr(e, "reason", None) or repr(e)} (after {attempts} attempts)') from None
    logging.warning('%s: attempt %d failed, retrying', url, attempt)
    time.sleep(2 ** attempt)


def checked_text(url, data, expected, lines):
  """`data` gunzipped if `url` names a .gz file, once its sha256 and line count are the expected ones."""
  if url.endswith('.gz'):
    try:
      data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged compressed stream
      raise DownloadError(f'{url}: not a valid gzip file ({e})') from None
  if sha256(data) != expected:
    raise DownloadError(f'{url}: sha256 {sha256(data)} differs from the expected {expected} (a changed or '
                        'corrupted file)')
  got_lines = data.count(b'\n')
  if got_lines != lines:
    raise DownloadError(f'{url}: {got_lines} lines, expected {lines}')
  return data


def write_atomically(path, data):
  """files_lib.write_atomically: `path` is either absent or whole, even when two processes fetch into one cache
  together or the disk fills; a file that failed its checksum is replaced."""
  try:
    files_lib.write_atomically(path, data)
  except OSError as e:
    raise DownloadError(f'{path}: cannot write ({e.strerror or e})') from None


def sha256(data):
  return hashlib.sha256(data).hexdigest()
