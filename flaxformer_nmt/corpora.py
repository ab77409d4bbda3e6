r"""Where sentence pairs come from: local parallel text or a TensorFlow Datasets builder.

Both kinds of corpus are random-access sequences of (source text, target text) pairs, in the direction the
config asks for, so everything downstream (vocabulary, tokenization cache, batching) is one code path:

  config.data_source = 'text'   `{data_dir}/{split}.{source_lang}` and `.{target_lang}` files, checked line
                                by line (data.read_parallel).
  config.data_source = 'tfds'   a TFDS builder such as `wmt14_translate/de-en`, prepared as array_record so
                                that it is read with random access (`builder.as_data_source`) and without
                                TensorFlow. Which side is the source is chosen by the language *names*: TFDS
                                stores WMT pairs as (de, en), and En->De reads the 'en' feature as source.

Preparing a WMT builder downloads and converts the corpus once (TensorFlow is needed for that step only:
`pip install "flaxformer_nmt[tfds]"`). Training prepares it on first use; to do it ahead of time, or to write
a split out as text files for decode/evaluate (e.g. newstest2014 as test.en/test.de):

  python -m flaxformer_nmt.corpora prepare --config configs/wmt14_ende_base.py
  python -m flaxformer_nmt.corpora export --config configs/wmt14_ende_base.py --split test --output_dir data/wmt14
"""
import sys

from absl import app, flags

from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.corpora import export_text, open_split, prepare_tfds
from flaxformer_nmt.runtime import flags as cli


def define_flags():
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('split', None, 'export: the split to write out (e.g. test, validation).')
  flags.DEFINE_string('output_dir', None, 'export: directory for {split}.{lang} files.')
  flags.mark_flags_as_required(['config'])


def main(argv):
  if len(argv) != 2 or argv[1] not in ('prepare', 'export'):
    raise app.UsageError('usage: python -m flaxformer_nmt.corpora prepare|export --config CONFIG [...]')
  config = flags.FLAGS.config
  if argv[1] == 'export' and not (flags.FLAGS.split and flags.FLAGS.output_dir):  # before any download
    raise app.UsageError('export needs --split and --output_dir')
  try:
    if config.data_source == 'tfds':
      prepare_tfds(config.tfds_name, config.tfds_data_dir)
    elif argv[1] == 'prepare':
      print(f'nothing to prepare: the config reads local text (config.data_source={config.data_source!r}, '
            f'config.data_dir={config.data_dir!r})')
    if argv[1] == 'export':
      pairs = open_split(config, flags.FLAGS.split)
      try:
        paths = export_text(pairs, flags.FLAGS.output_dir, flags.FLAGS.split, config.source_lang, config.target_lang)
      except OSError as e:  # a file where the directory goes, no permission, a full disk
        sys.exit(f'error: --output_dir {flags.FLAGS.output_dir}: {e}')
      for path in paths:
        print(f'wrote {path} ({len(pairs):,} lines)')
  except data_lib.DataError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
