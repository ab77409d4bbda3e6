"""Corpora: TFDS WMT builders (on tfds.testing.mock_data), the translation direction and text export (the Multi30k
download: test_download.py)."""
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import in_process
from flaxformer_nmt import config as config_lib
from flaxformer_nmt import corpora as corpora_command
from flaxformer_nmt.data import corpora
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.data.tokenizer import PAD_ID

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


class SplitRecords:
  """A split's examples as a prepared builder's array_record source serves them (text as bytes, by index or in one
  batched read), for tfds.testing.mock_data's as_data_source_fn: each split its own text, unlike the random text
  that mock_data gives every split alike."""

  def __init__(self, examples):
    self.examples = [{lang: text.encode('utf-8') for lang, text in example.items()} for example in examples]

  def __len__(self):
    return len(self.examples)

  def __getitem__(self, index):
    return self.examples[index]

  def __getitems__(self, indices):
    return [self.examples[i] for i in indices]


def mock_splits(splits):
  """tfds.testing.mock_data serving {split: [{'en': ..., 'de': ...}, ...]} as every builder's splits."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  return tfds.testing.mock_data(as_data_source_fn=lambda builder, split, **kwargs: SplitRecords(splits[split]))


# WMT14 De-En as TFDS splits it (validation: newstest2013, test: newstest2014), each split with its own numbered
# pairs and whitespace the reader folds.
WMT_SPLITS = {
    'train': [{'en': f'a  man walks {i}', 'de': f'ein Mann\tgeht {i}'} for i in range(9)],
    'validation': [{'en': f'Newstest2013 line {i} .', 'de': f'Zeile\u00a0{i} aus newstest2013 .'} for i in range(7)],
    'test': [{'en': f' newstest2014 line {i}', 'de': f'Zeile {i}  aus newstest2014 '} for i in range(5)],
}


def plain_lines(split, lang):
  """The `lang` side of WMT_SPLITS[split] as an export writes it: whitespace folded, one line per example."""
  return ''.join(' '.join(example[lang].split()) + '\n' for example in WMT_SPLITS[split])


@requires_tensorflow
@pytest.mark.parametrize('source_lang, target_lang', [('en', 'de'), ('de', 'en')])
def test_export_writes_each_side_of_a_tfds_split_in_order_under_its_language(source_lang, target_lang, tmp_path):
  """Line i of test.en and test.de is example i's English and German, whichever way the corpus is read: catches
  sides swapped or written under the other's name, and examples skipped, repeated or reordered."""
  with mock_splits(WMT_SPLITS):
    pairs = corpora.TfdsPairs('wmt14_translate/de-en', 'test', source_lang, target_lang)
    paths = corpora.export_text(pairs, tmp_path, 'test', source_lang, target_lang)
  assert [p.name for p in paths] == [f'test.{source_lang}', f'test.{target_lang}']
  plain = lambda i, lang: ' '.join(WMT_SPLITS['test'][i][lang].split())
  assert pairs.read([3, 0]) == ([plain(3, source_lang), plain(0, source_lang)], [plain(3, target_lang),
                                                                              plain(0, target_lang)])
  for lang in ('en', 'de'):
    assert (tmp_path / f'test.{lang}').read_text(encoding='utf-8') == plain_lines('test', lang)


@requires_tensorflow
@pytest.mark.parametrize('split', ['test', 'validation'])
def test_the_export_command_writes_the_wmt_split_it_is_asked_for(split, tmp_path):
  """`corpora export --config configs/wmt14_ende_base.py --split test` writes newstest2014 (TFDS's test split) as
  test.en and test.de, the English the source side: the split named, not the config's eval_split."""
  with mock_splits(WMT_SPLITS):
    result = in_process.run(corpora_command, ['export', '--config', os.path.join(REPO, 'configs', 'wmt14_ende_base.py'),
                                              '--split', split, '--output_dir', str(tmp_path)])
  assert result.returncode == 0, result.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == [f'{split}.de', f'{split}.en']
  for lang in ('en', 'de'):
    assert (tmp_path / f'{split}.{lang}').read_text(encoding='utf-8') == plain_lines(split, lang)
  count = len(WMT_SPLITS[split])
  assert result.stdout.splitlines() == [f'wrote {tmp_path / split}.{lang} ({count} lines)' for lang in ('en', 'de')]


def test_prepare_on_a_text_config_says_there_is_nothing_to_prepare(tmp_path):
  # It exited 0 printing nothing: a user could not tell a prepared corpus from a config that has none to prepare.
  result = in_process.run(corpora_command, ['prepare', '--config', os.path.join(REPO, 'configs', 'multi30k.py'),
                                            f'--config.data_dir={tmp_path}'])
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines() == [
      f"nothing to prepare: the config reads local text (config.data_source='text', config.data_dir='{tmp_path}')"]


@requires_tensorflow
def test_a_wmt_config_reads_its_tfds_splits_as_the_config_says():
  """open_split on the WMT config: lowercased with config.lowercase, and, for a language model (task lm) on the
  German text feature, each split's own text (validation is not the training text)."""
  config = load_config('wmt14_ende_base')
  config.lowercase = True
  plain = lambda split, lang: [' '.join(e[lang].split()).lower() for e in WMT_SPLITS[split]]
  with mock_splits(WMT_SPLITS):
    assert corpora.open_split(config, 'validation').read(range(7)) == (plain('validation', 'en'),
                                                                       plain('validation', 'de'))
    config.lowercase = False
    config.task, config.tfds_text_feature = 'lm', 'de'
    text = corpora.open_split(config, 'validation')
    assert text.read(range(len(text))) == ([' '.join(e['de'].split()) for e in WMT_SPLITS['validation']], None)


def test_an_unknown_builder_name_is_one_error_naming_the_field(tmp_path):
  with pytest.raises(corpora.data_lib.DataError, match=r"config.tfds_name='wmt14_translat/de-en': cannot load"):
    corpora.TfdsPairs('wmt14_translat/de-en', 'train', 'en', 'de', data_dir=str(tmp_path))


@requires_tensorflow
def test_the_wmt_vocabulary_is_learnt_from_the_training_split_alone(tmp_path):
  """The vocabulary sample reads the training split only (validation and test text written in other alphabets
  must give it no piece), and the validation corpus is the validation split (newstest2013), pair for pair."""
  from flaxformer_nmt.data import pipeline  # pylint: disable=g-import-not-at-top
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  words = lambda letters, n: ' '.join(''.join(rng.choice(list(letters), 4)) for _ in range(n))
  splits = {'train': [{'en': words('abcdef', 6), 'de': words('ghijkl', 6)} for _ in range(30)],
            'validation': [{'en': words('\u03b1\u03b2\u03b3', 3), 'de': words('\u03b4\u03b5', 3)} for _ in range(7)],
            'test': [{'en': words('\u0430\u0431\u0432', 3), 'de': words('\u0433\u0434', 3)} for _ in range(5)]}
  config = load_config('wmt14_ende_base')
  config.vocab_size = 40
  with mock_splits(splits):
    _, _, train_corpus, eval_corpus = pipeline.vocabulary_and_tokens(config, tmp_path)
  vocabulary = spm.SentencePieceProcessor(model_file=str(tmp_path / 'vocab.model'))
  letters = set(''.join(vocabulary.id_to_piece(i) for i in range(vocabulary.get_piece_size())))
  held_out = {c for split in ('validation', 'test') for e in splits[split] for c in e['en'] + e['de']} - {' '}
  assert set('abcdefghijkl') <= letters and not letters & held_out
  assert (len(train_corpus), len(eval_corpus)) == (30, 7)


def translation_builder(class_name, splits, supervised_keys=None):
  """A TFDS translation builder class named after class_name ('ToyTranslate': 'toy_translate') whose splits hold
  the (en, de) pairs of `splits` ({split: pairs}), not prepared."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def info(builder):
    return tfds.core.DatasetInfo(builder=builder, features=tfds.features.Translation(languages=('de', 'en')),
                                 supervised_keys=supervised_keys)

  def examples(builder, pairs):
    del builder
    for i, (en, de) in enumerate(pairs):
      yield i, {'en': en, 'de': de}

  return type(class_name, (tfds.core.GeneratorBasedBuilder,), {
      'VERSION': tfds.core.Version('1.0.0'), '_info': info, '_generate_examples': examples,
      '_split_generators': lambda builder, dl_manager: {
          split: builder._generate_examples(pairs) for split, pairs in splits.items()}})


def prepare_translation_builder(class_name, pairs, data_dir, supervised_keys=None):
  """Prepares, as array_record in data_dir, a TFDS translation builder named after class_name ('ToyTranslate':
  'toy_translate') whose train split holds the (en, de) pairs."""
  builder_class = translation_builder(class_name, {'train': pairs}, supervised_keys)
  builder_class(data_dir=data_dir, file_format='array_record').download_and_prepare()


def stored_lines(name, data_dir, split, lang):
  """The `lang` side of a prepared builder's split as an export writes it, read straight from its records."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  records = tfds.builder(name, data_dir=data_dir, file_format='array_record').as_data_source(split=split)
  return ''.join(' '.join(records[i][lang].decode('utf-8').split()) + '\n' for i in range(len(records)))


def test_an_unprepared_builder_is_one_error_naming_how_to_prepare_it(tmp_path):
  """Reading a builder before it is prepared: a KeyError about `splits` from deep inside TFDS, not a line naming
  the builder, where it was looked for and the command that prepares it."""
  translation_builder('UnpreparedTranslate', {'train': [('a dog', 'ein Hund')]})
  data_dir = str(tmp_path / 'tfds')
  prepare = r'unprepared_translate is not prepared in .*tfds.*python -m flaxformer_nmt.corpora prepare'
  with pytest.raises(corpora.data_lib.DataError, match=prepare):
    corpora.TfdsPairs('unprepared_translate', 'train', 'en', 'de', data_dir=data_dir)
  with pytest.raises(corpora.data_lib.DataError, match=prepare):
    corpora.TfdsText('unprepared_translate', 'train', feature='de', data_dir=data_dir)


def test_prepare_prepares_a_builder_once(tmp_path, monkeypatch):
  pairs = [(f'dog {i}', f'Hund {i}') for i in range(6)]
  builder_class = translation_builder('PreparedOnceTranslate', {'train': pairs, 'test': pairs[:2]})
  data_dir = str(tmp_path / 'tfds')
  assert corpora.prepare_tfds('prepared_once_translate', data_dir).is_prepared()
  assert stored_lines('prepared_once_translate', data_dir, 'train', 'de').count('\n') == 6

  def fails(*args, **kwargs):
    raise AssertionError('a prepared builder is prepared again')

  monkeypatch.setattr(builder_class, 'download_and_prepare', fails)
  corpora.prepare_tfds('prepared_once_translate', data_dir)  # left alone
  shutil.rmtree(data_dir)

  def needs_tensorflow(*args, **kwargs):
    raise ImportError("No module named 'tensorflow'")

  monkeypatch.setattr(builder_class, 'download_and_prepare', needs_tensorflow)
  with pytest.raises(corpora.data_lib.DataError, match=r'preparing prepared_once_translate needs TensorFlow.*'
                     r'pip install "flaxformer_nmt\[tfds\]".*--config.tfds_data_dir'):
    corpora.prepare_tfds('prepared_once_translate', data_dir)


def _connection_error(url):
  import requests  # pylint: disable=g-import-not-at-top
  return requests.exceptions.ConnectionError('Max retries exceeded (Caused by NameResolutionError)',
                                             request=requests.Request('GET', url))


_EUROPARL = 'http://www.statmt.org/wmt13/europarl.tgz'


@pytest.mark.parametrize('name, failure, named', [
    ('offline_translate', lambda: _connection_error(_EUROPARL), _EUROPARL),
    ('moved_translate', lambda: corpora._import_tfds().download.DownloadError('Failed to get url: HTTP code 404'),
     'its files')])
def test_a_download_that_fails_is_one_line_naming_the_builder_and_the_copy_to_make(tmp_path, monkeypatch, name,
                                                                                   failure, named):
  """Offline, TFDS retries its download, then lets the requests library's ConnectionError through (a 404 ends in
  its own DownloadError): the prepare command and training must end in one line naming the builder, what failed
  and --config.tfds_data_dir, not a traceback from a download thread. Catches either exception let through."""
  class_name = ''.join(word.title() for word in name.split('_'))  # 'offline_translate': 'OfflineTranslate'
  builder_class = translation_builder(class_name, {'train': [('a dog', 'ein Hund')]})

  def fails(*args, **kwargs):
    raise failure()

  monkeypatch.setattr(builder_class, 'download_and_prepare', fails)
  data_dir = str(tmp_path / 'tfds')
  args = ['prepare', '--config', os.path.join(REPO, 'configs', 'wmt14_ende_base.py'),
          f'--config.tfds_name={name}', f'--config.tfds_data_dir={data_dir}']
  result = in_process.run(corpora_command, args)
  assert result.returncode == 1, result.stderr
  [line] = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert 'Traceback' not in result.stderr
  assert line.startswith(f'error: preparing {name} could not download {named} (')
  assert line.endswith(f'point --config.tfds_data_dir at the copy (now {data_dir})')


@pytest.mark.parametrize('source_lang, target_lang', [('en', 'de'), ('de', 'en')])
def test_the_export_command_prepares_the_builder_then_writes_its_split(source_lang, target_lang, tmp_path):
  """`corpora export` on a builder not prepared yet prepares it (no mocks: array_record files in tfds_data_dir),
  then writes the split's records in their stored order, each side under its language."""
  pairs = [(f'sentence  {i}', f'Satz\u00a0{i}') for i in range(8)]
  class_name = f'Export{source_lang.title()}{target_lang.title()}Translate'
  name = f'export_{source_lang}_{target_lang}_translate'
  translation_builder(class_name, {'train': pairs, 'test': pairs[5:]})
  data_dir, out = str(tmp_path / 'tfds'), tmp_path / 'out'
  args = ['export', '--config', os.path.join(REPO, 'configs', 'wmt14_ende_base.py'), f'--config.tfds_name={name}',
          f'--config.tfds_data_dir={data_dir}', f'--config.source_lang={source_lang}',
          f'--config.target_lang={target_lang}']
  missing = in_process.run(corpora_command, args + ['--output_dir', str(out)])
  # A forgotten --split is told before the download, not after it.
  assert missing.returncode == 1 and 'export needs --split' in missing.stderr and not os.path.exists(data_dir)
  result = in_process.run(corpora_command, args + ['--split', 'test', '--output_dir', str(out)])
  assert result.returncode == 0, result.stderr
  assert sorted(p.name for p in out.iterdir()) == ['test.de', 'test.en']
  for lang in ('en', 'de'):
    expected = stored_lines(name, data_dir, 'test', lang)
    assert (out / f'test.{lang}').read_text(encoding='utf-8') == expected and expected.count('\n') == 3


def test_a_prepared_array_record_builder_is_read_without_mocks(toy_corpus, tmp_path):
  """The real read path: a translation builder prepared as array_record (as WMT is), read by language name."""
  english = (toy_corpus / 'train.en').read_text().splitlines()
  german = (toy_corpus / 'train.de').read_text().splitlines()
  prepare_translation_builder('ToyTranslate', [(en + '\u00a0', de) for en, de in zip(english, german)],
                              str(tmp_path / 'tfds'), supervised_keys=('de', 'en'))
  pairs = corpora.TfdsPairs('toy_translate', 'train', 'en', 'de', data_dir=str(tmp_path / 'tfds'))
  text = corpora.TextPairs(toy_corpus, 'train', 'en', 'de')
  assert len(pairs) == len(text)
  # Same pairs (whitespace normalized), in whatever order the builder stored them.
  assert sorted(zip(*pairs.read(range(len(pairs))))) == sorted(zip(*text.read(range(len(text)))))
  with pytest.raises(corpora.data_lib.DataError, match=r"split 'valid' not in toy_translate"):
    corpora.TfdsPairs('toy_translate', 'valid', 'en', 'de', data_dir=str(tmp_path / 'tfds'))


def test_a_tfds_split_expression_reads_that_part_of_the_split(tmp_path):
  """TFDS split expressions ('train[:4]', 'train[4:]') name parts of a split, as the builder's readers take them."""
  data_dir = str(tmp_path / 'tfds')
  prepare_translation_builder('SlicedTranslate', [(f'sentence {i}', f'satz {i}') for i in range(10)], data_dir)
  records = corpora.tfds_builder('sliced_translate', data_dir).as_data_source(split='train')
  stored = [(records[i]['en'].decode(), records[i]['de'].decode()) for i in range(len(records))]
  head = corpora.TfdsPairs('sliced_translate', 'train[:4]', 'en', 'de', data_dir=data_dir)
  tail = corpora.TfdsPairs('sliced_translate', 'train[4:]', 'en', 'de', data_dir=data_dir)
  assert [head[i] for i in range(len(head))] == stored[:4]
  assert [tail[i] for i in range(len(tail))] == stored[4:]
  text = corpora.TfdsText('sliced_translate', 'train[:4]', feature='de', data_dir=data_dir)
  assert [text[i] for i in range(len(text))] == [de for _, de in stored[:4]]
  with pytest.raises(corpora.data_lib.DataError, match=r"split 'valid\[:3\]' not in sliced_translate"):
    corpora.TfdsPairs('sliced_translate', 'valid[:3]', 'en', 'de', data_dir=data_dir)


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


def test_export_cli_writes_text_splits(toy_corpus, tmp_path):
  config = os.path.join(REPO, 'configs', 'multi30k.py')
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.corpora', 'export', '--config', config,
       f'--config.data_dir={toy_corpus}', '--split', 'valid', '--output_dir', str(tmp_path / 'out')],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert (tmp_path / 'out' / 'valid.en').read_text() == (toy_corpus / 'valid.en').read_text()


def test_export_cli_names_an_output_dir_it_cannot_make_in_one_line(toy_corpus, tmp_path):
  (tmp_path / 'taken').write_text('a file where the directory should go\n')
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.corpora', 'export', '--config',
       os.path.join(REPO, 'configs', 'multi30k.py'), f'--config.data_dir={toy_corpus}', '--split', 'valid',
       '--output_dir', str(tmp_path / 'taken')],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  taken = tmp_path / 'taken'
  assert result.stderr.strip().splitlines() == [f"error: --output_dir {taken}: [Errno 17] File exists: '{taken}'"]


def test_export_writes_monolingual_text_as_the_target_side_alone(tmp_path):
  """An lm/mlm config's corpus reads as (lines, None): export wrote its German lines as valid.en, then failed with
  a TypeError on the missing second side."""
  raw = 'Ein  Hund\tläuft.\n\n  Zwei Katzen \r\nDas Ende.'
  (tmp_path / 'valid.de').write_bytes(raw.encode('utf-8'))
  expected = [' '.join(line.split()) for line in raw.split('\n') if line.strip()]
  paths = corpora.export_text(corpora.TextLines(tmp_path / 'valid.de'), tmp_path / 'out', 'valid', 'en', 'de')
  assert [p.name for p in paths] == ['valid.de']
  assert (tmp_path / 'out' / 'valid.de').read_text(encoding='utf-8') == ''.join(line + '\n' for line in expected)
  assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['valid.de']


def test_export_refuses_to_write_over_the_files_it_reads(tmp_path):
  (tmp_path / 'valid.en').write_text('A  Dog runs .\n')
  (tmp_path / 'valid.de').write_text('Ein  Hund läuft .\n')
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  pairs = corpora.TextPairs(tmp_path, 'valid', 'en', 'de', lowercase=True)
  with pytest.raises(corpora.data_lib.DataError, match='valid.en is a file the export reads'):
    corpora.export_text(pairs, tmp_path, 'valid', 'en', 'de')
  lines = corpora.TextLines(tmp_path / 'valid.de')
  with pytest.raises(corpora.data_lib.DataError, match='valid.de is a file the export reads'):
    corpora.export_text(lines, tmp_path / '.', 'valid', 'en', 'de')
  assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_export_that_fails_midway_leaves_the_files_before_it(toy_corpus, tmp_path):
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'valid.en').write_text('an earlier export\n')
  (out / '.valid.de.partial').mkdir()  # the second file cannot be written
  pairs = corpora.TextPairs(toy_corpus, 'valid', 'en', 'de')
  with pytest.raises(OSError):
    corpora.export_text(pairs, out, 'valid', 'en', 'de')
  assert not (out / 'valid.de').exists() and (out / 'valid.en').read_text() == 'an earlier export\n'


def test_an_export_interrupted_midway_leaves_no_partial_file(toy_corpus, tmp_path, monkeypatch):
  # Ctrl-C while the second file was written: .valid.en.partial stayed beside the export before.
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'valid.en').write_text('an earlier export\n')
  path_type = type(corpora.epath.Path(out))
  write_text = path_type.write_text

  def interrupted(path, *args, **kwargs):
    if path.name.endswith('.de.partial'):
      raise KeyboardInterrupt
    return write_text(path, *args, **kwargs)

  monkeypatch.setattr(path_type, 'write_text', interrupted)
  with pytest.raises(KeyboardInterrupt):
    corpora.export_text(corpora.TextPairs(toy_corpus, 'valid', 'en', 'de'), out, 'valid', 'en', 'de')
  assert sorted(p.name for p in out.iterdir()) == ['valid.en']
  assert (out / 'valid.en').read_text() == 'an earlier export\n'


def test_a_file_rewritten_within_the_same_second_with_the_same_size_is_another_corpus(tmp_path):
  """Wrong rule caught: the fingerprint kept the modification time in whole seconds, so a fix of the same length
  (a typo, `sed -i`) made in the second the file was written kept serving the stale token cache."""
  data = tmp_path / 'data'
  data.mkdir()
  (data / 'train.en').write_text('a man\n')
  (data / 'train.de').write_text('ein mann\n')
  os.utime(data / 'train.de', (1_700_000_000.25, 1_700_000_000.25))
  before = corpora.TextPairs(data, 'train', 'en', 'de').fingerprint
  (data / 'train.de').write_text('ein maus\n')  # same size, written in the same second
  os.utime(data / 'train.de', (1_700_000_000.75, 1_700_000_000.75))
  assert corpora.TextPairs(data, 'train', 'en', 'de').fingerprint != before


def test_a_lowercased_tfds_split_lowercases_both_sides_and_keys_its_own_fingerprint(tmp_path):
  """config.lowercase on a TFDS corpus: every side is str.lower of the whitespace-normalized text (as for text
  files), the source and the target alike, and the fingerprint tells it from the cased corpus."""
  english = ['A  Man on the STREET', 'Two\u00a0Dogs RUN', 'ÜBER Alles']
  german = ['Ein Mann auf der STRAßE', 'Zwei\tHunde', 'Über ALLES']
  data_dir = str(tmp_path / 'tfds')
  prepare_translation_builder('CasedTranslate', list(zip(english, german)), data_dir)
  lowered = corpora.TfdsPairs('cased_translate', 'train', 'en', 'de', data_dir=data_dir, lowercase=True)
  cased = corpora.TfdsPairs('cased_translate', 'train', 'en', 'de', data_dir=data_dir)
  expected = sorted((' '.join(en.split()).lower(), ' '.join(de.split()).lower()) for en, de in zip(english, german))
  assert sorted(zip(*lowered.read(range(3)))) == expected
  assert sorted(lowered[i] for i in range(3)) == expected
  assert sorted(zip(*cased.read(range(3)))) == sorted((' '.join(en.split()), ' '.join(de.split()))
                                                       for en, de in zip(english, german))
  assert lowered.fingerprint != cased.fingerprint
  text = corpora.TfdsText('cased_translate', 'train', feature='de', data_dir=data_dir, lowercase=True)
  assert sorted(text[i] for i in range(3)) == sorted(' '.join(de.split()).lower() for de in german)
