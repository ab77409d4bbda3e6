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
import sys

from absl import app, flags

from flaxformer_nmt.data.download import DownloadError, MULTI30K_URL, download_multi30k


def define_flags():
  flags.DEFINE_string('data_dir', None, 'Directory to write train/valid/test2016 .en/.de into.')
  flags.DEFINE_string('base_url', MULTI30K_URL, 'Where the raw .gz files are (a mirror, or file:// for a copy).')
  flags.mark_flags_as_required(['data_dir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  try:
    for path in download_multi30k(flags.FLAGS.data_dir, flags.FLAGS.base_url):
      print(path)
  except DownloadError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
