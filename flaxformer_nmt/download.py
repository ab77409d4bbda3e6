r"""Fetches Multi30k En-De (task 1): the raw text and the official lowercased tokenized references.

  python -m flaxformer_nmt.download                    # ~/.cache/flaxformer_nmt/multi30k and multi30k_tok
  python -m flaxformer_nmt.download --data_dir DIR     # DIR and DIR_tok, for --config.data_dir=DIR offline

The files come from the repository `multi30k/dataset` at a pinned commit and are checked against their sha256
(data/download.py). The first training run of a Multi30k config fetches the same files into the cache by itself.
"""
import sys

from absl import app, flags

from flaxformer_nmt.data import download


def define_flags():
  flags.DEFINE_string('data_dir', None, 'Directory for train/valid/test2016 .en/.de (default: the user cache, '
                      'where the Multi30k configs read).')
  flags.DEFINE_string('tok_dir', None, 'Directory for the lowercased tokenized text (default: DATA_DIR_tok; '
                      'the cache\'s multi30k_tok without --data_dir).')
  flags.DEFINE_string('base_url', None, 'A mirror laid out as the repository (data/task1/raw, data/task1/tok), '
                      f'http(s):// or file:// (default: ${download.URL_ENV}, else {download.MULTI30K_URL}).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  data_dir = f.data_dir or download.multi30k_data_dir()
  tok_dir = f.tok_dir or (download.tok_dir_beside(f.data_dir) if f.data_dir else download.multi30k_tok_dir())
  try:
    for path in download.download_multi30k(data_dir, tok_dir, f.base_url):
      print(path)
  except download.UnreachableError as e:
    sys.exit(f'error: {e}. {download.OFFLINE_HINT}')
  except download.DownloadError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
