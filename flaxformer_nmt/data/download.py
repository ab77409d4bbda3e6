r"""Fetches Multi30k's raw En-De text (task 1) from its public GitHub repository into a data directory.

  python -m flaxformer_nmt.download --data_dir data/multi30k
  python -m flaxformer_nmt.train --config configs/multi30k.py --config.data_dir=data/multi30k --workdir runs/m30k

The files come from the repository `multi30k/dataset` at a pinned commit, are gunzipped, renamed to this
project's `{split}.{lang}` layout (train, valid, test2016) and checked against their known sha256 values.
Files already present and correct are not fetched again; a download goes to a temporary name first, so an
interrupted run never leaves a half-written file behind.

Training fetches the corpus by itself on first use (configs with `data_download = 'multi30k'`, such as
configs/multi30k.py): `../shared/data/multi30k` beside the repository when present (offline machines),
otherwise the user cache `$FLAXFORMER_NMT_CACHE/multi30k` (default `~/.cache/flaxformer_nmt/multi30k`,
or under $XDG_CACHE_HOME), filled from the pinned files when absent. $FLAXFORMER_NMT_MULTI30K_URL names a
mirror of the .gz files.
"""
import gzip
import hashlib
import os
import time
import urllib.error
import urllib.request

from absl import logging
from etils import epath

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.runtime.cache import cache_dir

# The last commit touching data/task1/raw/ (2020-11-09).
MULTI30K_COMMIT = 'c40b37b23d6387214f8ab37335b5a8672b9745f2'
MULTI30K_URL = f'https://raw.githubusercontent.com/multi30k/dataset/{MULTI30K_COMMIT}/data/task1/raw'

# Our name -> (name in the repository, sha256 of the gunzipped file, lines).
MULTI30K_FILES = {
    'train.en': ('train.en.gz', '460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6', 29000),
    'train.de': ('train.de.gz', '2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72', 29000),
    'valid.en': ('val.en.gz', '1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227', 1014),
    'valid.de': ('val.de.gz', '660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660', 1014),
    'test2016.en': ('test_2016_flickr.en.gz', '399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182',
                    1000),
    'test2016.de': ('test_2016_flickr.de.gz', '4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16',
                    1000),
}


URL_ENV = 'FLAXFORMER_NMT_MULTI30K_URL'


class DownloadError(RuntimeError):
  """A file that could not be fetched or does not match its checksum; the message names it."""


def multi30k_data_dir():
  """Where configs/multi30k.py reads Multi30k: ../shared/data/multi30k when it holds the corpus (the
  development machines, offline ones), else the user cache (filled on first use, see ensure_corpus)."""
  shared = epath.Path(config_lib.shared_data_dir('multi30k'))
  if (shared / 'train.en').exists():
    return str(shared)
  return str(cache_dir() / 'multi30k')


def ensure_multi30k(data_dir, base_url=None):
  """Downloads the Multi30k files missing from `data_dir` (files present are left as they are)."""
  data_dir = epath.Path(data_dir)
  missing = {name: entry for name, entry in MULTI30K_FILES.items() if not (data_dir / name).exists()}
  if not missing:
    return
  base_url = base_url or os.environ.get(URL_ENV) or MULTI30K_URL
  logging.info('Multi30k is not in %s: downloading %d files from %s (first use only)', data_dir, len(missing),
               base_url)
  download_multi30k(data_dir, base_url=base_url, files=missing)


def ensure_corpus(config, is_leader=True, barrier=lambda name: None):
  """Fetches the corpus named by config.data_download into config.data_dir when absent: process 0 first,
  then any host that still lacks it (its data_dir is not on shared storage). Raises data.DataError naming
  --config.data_dir when the files cannot be fetched (e.g. no internet)."""
  from flaxformer_nmt.data import corpus as data_lib  # pylint: disable=g-import-not-at-top
  if not config.data_download or config.data_source != 'text':
    return
  if config.data_download != 'multi30k':
    raise data_lib.DataError(f"config.data_download={config.data_download!r}: use 'multi30k' or '' (never)")
  needed = [epath.Path(config.data_dir) / f'{split}.{lang}' for split in (config.train_split, config.eval_split)
            for lang in (config.source_lang, config.target_lang)]
  if all(path.exists() for path in needed):
    return  # the run's own files are there (e.g. a --config.data_dir of the user's): nothing to fetch
  try:
    if is_leader:
      ensure_multi30k(config.data_dir)
    barrier('corpus downloaded')
    ensure_multi30k(config.data_dir)
  except (DownloadError, OSError) as e:
    raise data_lib.DataError(
        f'Multi30k is not in {config.data_dir} and could not be downloaded ({e}). Without internet access, '
        'copy the corpus to this machine (python -m flaxformer_nmt.download --data_dir DIR on one that has '
        'it) and pass --config.data_dir=DIR.') from None


def fetch(url, attempts=3, timeout=60):
  """The bytes at `url` (http(s):// or file://), retried with backoff on network errors."""
  for attempt in range(1, attempts + 1):
    try:
      with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()
    except urllib.error.HTTPError as e:
      if e.code < 500 or attempt == attempts:  # 404 and the like will not get better
        raise DownloadError(f'{url}: HTTP {e.code} {e.reason}') from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
      if attempt == attempts:
        raise DownloadError(f'{url}: {getattr(e, "reason", e)} (after {attempts} attempts)') from None
    logging.warning('%s: attempt %d failed, retrying', url, attempt)
    time.sleep(2 ** attempt)


def sha256(data):
  return hashlib.sha256(data).hexdigest()


def download_multi30k(data_dir, base_url=MULTI30K_URL, files=None, verify=True):
  """Writes train/valid/test2016 .en/.de into `data_dir`; returns their paths."""
  files = MULTI30K_FILES if files is None else files
  data_dir = epath.Path(data_dir)
  data_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for number, (name, (remote, expected, lines)) in enumerate(files.items(), 1):
    path = data_dir / name
    if path.exists() and (not verify or sha256(path.read_bytes()) == expected):
      logging.info('%s is present', path)
      written.append(path)
      continue
    url = f'{base_url.rstrip("/")}/{remote}'
    start = time.time()
    raw = fetch(url)
    logging.info('[%d/%d] %s: %.1f MB in %.1f s', number, len(files), url, len(raw) / 1e6, time.time() - start)
    try:
      text = gzip.decompress(raw) if remote.endswith('.gz') else raw
    except (OSError, EOFError) as e:
      raise DownloadError(f'{url}: not a valid gzip file ({e})') from None
    if verify and sha256(text) != expected:
      raise DownloadError(f'{url}: sha256 {sha256(text)} differs from the expected {expected} (a changed or '
                          'corrupted file)')
    got_lines = text.count(b'\n')
    if got_lines != lines:
      raise DownloadError(f'{url}: {got_lines} lines, expected {lines}')
    # This process's own temporary name: runs started together (bench/sweep.py, two commands sharing the
    # cache) each write a whole file and rename it into place, never one another's half-written one.
    tmp = data_dir / f'.{name}.{os.getpid()}.tmp'
    tmp.write_bytes(text)
    tmp.rename(path)
    logging.info('Wrote %s (%d lines) from %s', path, lines, url)
    written.append(path)
  return written
