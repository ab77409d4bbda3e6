"""Where sentence pairs come from: checked local parallel text (`{data_dir}/{split}.{lang}`) or a TensorFlow
Datasets builder prepared as array_record (random access, no TensorFlow to read it), both as random-access
sequences of (source, target) text in the config's direction."""

import os

from absl import logging
from etils import epath

from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib


class TextPairs:
  """The checked, whitespace-normalized lines of `{data_dir}/{split}.{lang}` files, held in memory (lowercased
  with `lowercase`)."""

  def __init__(self, data_dir, split, source_lang, target_lang, max_line_chars=0, skip_bad_pairs=False,
               lowercase=False):
    # line_indices: the pair's line in the files (pairs dropped by skip_bad_pairs leave gaps) of num_lines lines.
    self.source_lines, self.target_lines, self.line_indices, self.num_lines = data_lib.read_parallel(
        data_dir, split, source_lang, target_lang, max_line_chars=max_line_chars, skip_bad_pairs=skip_bad_pairs)
    if lowercase:
      self.source_lines, self.target_lines = _lower(self.source_lines), _lower(self.target_lines)
    src_path, tgt_path = data_lib.split_paths(data_dir, split, source_lang, target_lang)
    # Identifies the text for the tokenization cache: a changed file gets tokenized again.
    self.fingerprint = {'kind': 'text', 'files': [_file_stamp(src_path), _file_stamp(tgt_path)],
                        'max_line_chars': max_line_chars, 'skip_bad_pairs': skip_bad_pairs,
                        **_lowercase_stamp(lowercase)}
    self.description, self.files = f'{src_path} + {tgt_path}', (src_path, tgt_path)

  def __len__(self):
    return len(self.source_lines)

  def __getitem__(self, index):
    return self.source_lines[index], self.target_lines[index]

  def read(self, indices):
    """(source lines, target lines) of the pairs at `indices`."""
    return [self.source_lines[i] for i in indices], [self.target_lines[i] for i in indices]


def _lower(lines):
  return [tokenizer_lib.prepare_text(line, lowercase=True) for line in lines]


def _lowercase_stamp(lowercase):
  # Only where set, so that caches of cased text written before the field existed stay valid.
  return {'lowercase': True} if lowercase else {}


def _file_stamp(path):
  if '://' not in str(path):  # etils' stat keeps whole seconds, blind to an edit of the same size within one
    info = os.stat(path)
    return [str(path), info.st_size, info.st_mtime_ns]
  info = epath.Path(path).stat()
  return [str(path), info.length, int(info.mtime)]


def _import_tfds():
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise data_lib.DataError(f'config.data_source=tfds needs tensorflow-datasets ({e})') from None
  return tfds


def tfds_builder(name, data_dir=None):
  """The builder of `name` (e.g. 'wmt14_translate/de-en'), writing array_record files for random access."""
  tfds = _import_tfds()
  try:
    return tfds.builder(name, data_dir=data_dir or None, file_format='array_record')
  except Exception as e:  # TFDS raises several types for unknown names and missing modules.
    raise data_lib.DataError(f'config.tfds_name={name!r}: cannot load the TFDS builder: {e}') from None


def prepare_tfds(name, data_dir=None):
  """Downloads and prepares a TFDS builder (once; a prepared builder is left alone)."""
  builder = tfds_builder(name, data_dir)
  if not builder.is_prepared():
    logging.info('Preparing %s in %s (download and conversion; done once)', name, builder.data_dir)
    try:
      builder.download_and_prepare()
    except ImportError as e:
      raise data_lib.DataError(
          f'preparing {name} needs TensorFlow ({e}): pip install "flaxformer_nmt[tfds]", or prepare it on '
          'another machine and point --config.tfds_data_dir at the result') from None
    except _download_errors() as e:  # TFDS has retried by now: offline, a host down, a file moved
      raise data_lib.DataError(
          f'preparing {name} could not download {_failed_url(e)} ({type(e).__name__}: {str(e)[:300]}). '
          'Prepare it once where its hosts can be reached, copy the TFDS data directory it was prepared in '
          f'here and point --config.tfds_data_dir at the copy (now {builder.data_dir_root})') from None
  return builder


def _download_errors():
  """The exceptions TFDS's downloads end in: its DownloadError and the requests library's errors (TFDS fetches
  with requests and lets its ConnectionError through once its retries are spent)."""
  import requests  # pylint: disable=g-import-not-at-top  (a dependency of tensorflow-datasets)
  return (_import_tfds().download.DownloadError, requests.exceptions.RequestException)


def _failed_url(error):
  request = getattr(error, 'request', None)
  return getattr(request, 'url', None) or 'its files'


def _check_split(builder, name, split):
  """A DataError unless the prepared builder reads `split`: a split name or a TFDS split expression such as
  'train[:1000]' or 'train+validation' (the splits are unknown before preparation: nothing to check)."""
  if not builder.info.splits:
    return
  try:
    builder.info.splits[split]
  except (KeyError, ValueError) as e:
    raise data_lib.DataError(f'split {split!r} not in {name}: {e.args[0] if e.args else e}') from None


def _data_source(builder, name, split):
  """The records of `split` (checked), or one DataError naming how to prepare a builder not prepared yet."""
  _check_split(builder, name, split)
  try:
    return builder.as_data_source(split=split)
  except KeyError:  # "`splits` is empty": checked here, not before, as tfds.testing.mock_data reads such builders
    if builder.info.splits:
      raise
    raise data_lib.DataError(
        f'{name} is not prepared in {builder.data_dir}: python -m flaxformer_nmt.corpora prepare --config CONFIG '
        '(training prepares it on first use), or point --config.tfds_data_dir at where it was prepared') from None


class TfdsPairs:
  """One split of a prepared TFDS translation builder, read as (source, target) by language name."""

  def __init__(self, name, split, source_lang, target_lang, data_dir=None, lowercase=False):
    builder = tfds_builder(name, data_dir)
    features = set(builder.info.features.keys())
    for field, lang in (('source_lang', source_lang), ('target_lang', target_lang)):
      if lang not in features:
        raise data_lib.DataError(f'config.{field}={lang!r}: {name} has the languages {sorted(features)}')
    self.records = _data_source(builder, name, split)
    self.source_lang, self.target_lang, self.lowercase = source_lang, target_lang, lowercase
    self.fingerprint = {'kind': 'tfds', 'name': name, 'version': str(builder.info.version), 'split': split,
                        'pairs': len(self.records), 'source_lang': source_lang, 'target_lang': target_lang,
                        **_lowercase_stamp(lowercase)}
    self.description = f'{name}:{split} ({builder.data_dir})'

  def __len__(self):
    return len(self.records)

  def _pair(self, example):
    text = lambda x: tokenizer_lib.prepare_text(x.decode('utf-8') if isinstance(x, bytes) else str(x),
                                                self.lowercase)
    return text(example[self.source_lang]), text(example[self.target_lang])

  def __getitem__(self, index):
    return self._pair(self.records[int(index)])

  def read(self, indices):
    """(source lines, target lines) of the pairs at `indices`, in one batched read (about 6x faster than
    record by record on array_record files)."""
    pairs = [self._pair(e) for e in self.records.__getitems__([int(i) for i in indices])]
    return [s for s, _ in pairs], [t for _, t in pairs]


class TextLines:
  """Monolingual text (config.task lm/mlm): the checked, whitespace-normalized non-empty lines of one file,
  each a sentence or a document. Reads as (lines, None): there is no second side."""
  monolingual = True

  def __init__(self, path, max_line_chars=0, skip_bad_pairs=False, lowercase=False):
    lines = data_lib.read_lines(path)
    lines = _lower(lines) if lowercase else lines
    keep, bad = [], 0
    for number, line in enumerate(lines, start=1):
      if max_line_chars and len(line) > max_line_chars:
        if not skip_bad_pairs:
          raise data_lib.DataError(f'{path}:{number}: line of {len(line):,} characters (config.max_line_chars='
                                   f'{max_line_chars:,}); for documents this long pass --config.max_line_chars=0 '
                                   '(no limit), or drop such lines: --config.skip_bad_pairs=true')
        bad += 1
      elif line:
        keep.append(line)
    if not keep:
      raise data_lib.DataError(f'{path}: no text')
    if bad:
      logging.warning('Dropped %d overlong lines from %s (config.skip_bad_pairs)', bad, path)
    self.lines = keep
    self.fingerprint = {'kind': 'text_lines', 'file': _file_stamp(path), 'max_line_chars': max_line_chars,
                        'skip_bad_pairs': skip_bad_pairs, **_lowercase_stamp(lowercase)}
    self.description, self.files = str(path), (path,)

  def __len__(self):
    return len(self.lines)

  def __getitem__(self, index):
    return self.lines[index]

  def read(self, indices):
    return [self.lines[i] for i in indices], None


class TfdsText:
  """The text feature `feature` of one split of a prepared TFDS builder (e.g. lm1b's 'text'), as TextLines."""
  monolingual = True

  def __init__(self, name, split, feature='text', data_dir=None, lowercase=False):
    builder = tfds_builder(name, data_dir)
    features = set(builder.info.features.keys())
    if feature not in features:
      raise data_lib.DataError(f'config.tfds_text_feature={feature!r}: {name} has the features {sorted(features)}')
    self.records = _data_source(builder, name, split)
    self.feature, self.lowercase = feature, lowercase
    self.fingerprint = {'kind': 'tfds_text', 'name': name, 'version': str(builder.info.version), 'split': split,
                        'examples': len(self.records), 'feature': feature, **_lowercase_stamp(lowercase)}
    self.description = f'{name}:{split}[{feature}] ({builder.data_dir})'

  def __len__(self):
    return len(self.records)

  def _text(self, example):
    x = example[self.feature]
    return tokenizer_lib.prepare_text(x.decode('utf-8') if isinstance(x, bytes) else str(x), self.lowercase)

  def __getitem__(self, index):
    return self._text(self.records[int(index)])

  def read(self, indices):
    return [self._text(e) for e in self.records.__getitems__([int(i) for i in indices])], None


def open_text(config, split):
  """The monolingual corpus of `split` for config.task lm/mlm (see config.py)."""
  lowercase = tokenizer_lib.lowercase_of(config)
  if config.data_source == 'tfds':
    return TfdsText(config.tfds_name, split, config.tfds_text_feature, config.tfds_data_dir, lowercase)
  if config.data_source != 'text':
    raise data_lib.DataError(f"config.data_source={config.data_source!r}: use 'text' or 'tfds'")
  named = config.text_train_file if split == config.train_split else config.text_eval_file
  path = named or data_lib.split_paths(config.data_dir, split, config.source_lang, config.target_lang)[1]
  return TextLines(path, max_line_chars=config.max_line_chars, skip_bad_pairs=config.skip_bad_pairs,
                   lowercase=lowercase)


def open_split(config, split):
  """The corpus of `split` as the config describes it."""
  if config.task != 'translation':
    return open_text(config, split)
  lowercase = tokenizer_lib.lowercase_of(config)
  if config.data_source == 'text':
    return TextPairs(config.data_dir, split, config.source_lang, config.target_lang,
                     max_line_chars=config.max_line_chars, skip_bad_pairs=config.skip_bad_pairs, lowercase=lowercase)
  if config.data_source == 'tfds':
    return TfdsPairs(config.tfds_name, split, config.source_lang, config.target_lang, config.tfds_data_dir,
                     lowercase)
  raise data_lib.DataError(f"config.data_source={config.data_source!r}: use 'text' or 'tfds'")


def export_text(pairs, output_dir, split, source_lang, target_lang):
  """Writes `{split}.{source_lang}` / `{split}.{target_lang}` files (for decode --input and evaluate --ref), the
  text as training reads it (whitespace normalized; lowercased for a lowercased config). Monolingual text
  (lm/mlm, read as (lines, None)) is the target side alone: `{split}.{target_lang}`."""
  output_dir = epath.Path(output_dir)
  source, target = pairs.read(range(len(pairs)))
  sides = ((target_lang, source),) if target is None else ((source_lang, source), (target_lang, target))
  paths = [output_dir / f'{split}.{lang}' for lang, _ in sides]
  read = {os.path.realpath(name) for name in getattr(pairs, 'files', ())}  # text files (TFDS splits: none)
  for path in paths:
    if os.path.realpath(path) in read:
      raise data_lib.DataError(f'--output_dir {output_dir}: {path} is a file the export reads: choose another '
                               '--output_dir')
  output_dir.mkdir(parents=True, exist_ok=True)
  partials = [path.with_name(f'.{path.name}.partial') for path in paths]
  try:
    for partial, (_, lines) in zip(partials, sides):  # every file written whole before any is replaced
      partial.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  except BaseException:  # a full disk, Ctrl-C: no half-written file stays beside the export before
    for partial in partials:
      partial.unlink(missing_ok=True)
    raise
  for partial, path in zip(partials, paths):
    partial.replace(path)
  return paths
