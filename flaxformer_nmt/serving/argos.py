r"""Argos Translate packages of a trained workdir, and serving CTranslate2 models behind the server's API.

  python -m flaxformer_nmt.export --workdir runs/m30k --format argos --output_dir packages

writes `packages/translate-en_de-1_0.argosmodel`: a zip archive of one directory holding

  metadata.json        Argos Translate's package metadata (language codes and names, versions, type)
  model/               the CTranslate2 model (serving.ctranslate2.export_ctranslate2)
  sentencepiece.model  the workdir's sentencepiece model, as Argos Translate tokenizes with it
  flaxformer_nmt.json  the decode settings and provenance this toolkit's server reads (beam size, length
                       penalty, length limit, lowercasing, checkpoint, parameters, validation BLEU)
  README.md

argostranslate.package.install_from_path installs it (argospm installs the packages of Argos's index, by
name), and LibreTranslate loads it as any installed package.
Argos Translate splits paragraphs into sentences itself (stanza, or its own splitter, as its version does)
and tokenizes with the sentencepiece model; the CTranslate2 model appends the </s> our sources end with.

CTranslate2Backend serves such a package (the .argosmodel file or its directory) or a plain CTranslate2
export directory (--format ctranslate2) through the server's API (serve --backend ctranslate2).
"""
import json
import math
import pathlib
import re
import tempfile
import zipfile

import jax
from etils import epath

from flaxformer_nmt.checkpointing import loader
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.models.tokens import EOS_ID
from flaxformer_nmt.serving import batcher as batcher_lib
from flaxformer_nmt.serving import ctranslate2 as ct2_export

SETTINGS_FILE = 'flaxformer_nmt.json'
SENTENCEPIECE_FILE = 'sentencepiece.model'
DEFAULT_MAX_POSITION = 1024  # config.model.max_position's default, for exports that do not record theirs
SUPPRESSED = [['<pad>'], ['<s>']]  # the pieces our decoder never emits
LANGUAGE_NAMES = {
    'ar': 'Arabic', 'cs': 'Czech', 'da': 'Danish', 'de': 'German', 'el': 'Greek', 'en': 'English', 'es': 'Spanish',
    'et': 'Estonian', 'fi': 'Finnish', 'fr': 'French', 'he': 'Hebrew', 'hi': 'Hindi', 'hu': 'Hungarian',
    'id': 'Indonesian', 'it': 'Italian', 'ja': 'Japanese', 'ko': 'Korean', 'lt': 'Lithuanian', 'lv': 'Latvian',
    'nl': 'Dutch', 'pl': 'Polish', 'pt': 'Portuguese', 'ro': 'Romanian', 'ru': 'Russian', 'sk': 'Slovak',
    'sv': 'Swedish', 'tr': 'Turkish', 'uk': 'Ukrainian', 'vi': 'Vietnamese', 'zh': 'Chinese'}


def language_name(code):
  return LANGUAGE_NAMES.get(code, code)


def package_code(config, package_version):
  """Argos Translate's name of the package: translate-en_de-1_0."""
  return f'translate-{config.source_lang}_{config.target_lang}-{package_version.replace(".", "_")}'


def serving_settings(workdir, config, description, params):
  """What the server needs to decode an exported model as it decodes the workdir (flaxformer_nmt.json)."""
  c = config.model
  steps = batcher_lib.checkpoint_steps(description)
  return {'source_lang': config.source_lang, 'target_lang': config.target_lang,
          'lowercase': bool(tokenizer_lib.lowercase_of(config)), 'beam_size': int(config.beam_size),
          'alpha': float(config.length_penalty_alpha), 'max_decode_extra_length': int(config.max_decode_extra_length),
          'max_position': int(c.max_position), 'checkpoint': description, 'checkpoint_steps': steps,
          'workdir': str(workdir),
          'validation_bleu': batcher_lib.recorded_bleu(workdir, steps),
          'parameters': int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
          'config': {'encoder_layers': c.num_encoder_layers, 'decoder_layers': c.num_decoder_layers,
                     'd_model': c.d_model, 'd_ff': c.d_ff, 'heads': c.num_heads, 'vocab_size': config.vocab_size,
                     'pre_layer_norm': bool(c.pre_layer_norm),
                     'lowercase': bool(tokenizer_lib.lowercase_of(config))}}


README = """\
# {code}

An Argos Translate package of {article} {source_name} -> {target_name} Transformer trained with flaxformer_nmt
({checkpoint} of `{workdir}`, weights {quantization}).

Install it with `python -c "import argostranslate.package as p; p.install_from_path('{code}.argosmodel')"`
(`argospm install` takes the names of Argos's index, not a file); LibreTranslate loads installed packages. Argos
Translate splits sentences with a model of its own, which it downloads on the first translation. `model/` is the
CTranslate2 model, `sentencepiece.model` its tokenizer.
{lowercase}"""


def export_argos(workdir, output_dir, checkpoint=None, quantization=None, force=False, package_version='1.0'):
  """Writes `{output_dir}/{package_code}.argosmodel`; returns (its path, the checkpoint's description).
  An existing package file is replaced only with force=True."""
  if not re.fullmatch(r'\d+(\.\d+)*', package_version):  # Argos compares versions with packaging.version
    raise ct2_export.ExportError(f'--package_version must be numbers joined by dots (1.0, 2.1), not '
                                 f'{package_version!r}')
  config = workdir_lib.load_config(workdir)
  ct2_export.check_exportable(workdir, config)
  code = package_code(config, package_version)
  path = pathlib.Path(output_dir) / f'{code}.argosmodel'
  if path.exists() and not force:
    raise ct2_export.ExportError(f'{path} exists: choose another --output_dir or pass --force')
  loaded = loader.load_for_inference(workdir, checkpoint)
  description = loaded.description
  with tempfile.TemporaryDirectory(prefix='argos_') as tmp:
    root = pathlib.Path(tmp) / code
    ct2_export.write_model(workdir, loaded, root / 'model', quantization)
    (root / 'model' / tokenizer_lib.VOCAB_FILENAME).rename(root / SENTENCEPIECE_FILE)
    (root / 'model' / 'README.md').unlink()
    metadata = {'package_version': package_version, 'argos_version': '1.9', 'type': 'translate',
                'code': code, 'name': f'{language_name(config.source_lang)} -> {language_name(config.target_lang)}',
                'from_code': config.source_lang, 'from_name': language_name(config.source_lang),
                'to_code': config.target_lang, 'to_name': language_name(config.target_lang)}
    (root / 'metadata.json').write_text(json.dumps(metadata, indent=2) + '\n')
    settings = serving_settings(workdir, config, description, loaded.params)
    (root / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + '\n')
    lowercase = ('\nThe model learnt lowercased text: lowercase the input before translating it.\n'
                 if settings['lowercase'] else '')
    (root / 'README.md').write_text(README.format(
        code=code, article='an' if metadata['from_name'][:1] in 'AEIOU' else 'a', source_name=metadata['from_name'],
        target_name=metadata['to_name'], checkpoint=description,
        workdir=workdir, quantization=quantization or 'float32', lowercase=lowercase))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f'.{path.name}.partial'
    try:
      with zipfile.ZipFile(partial, 'w', zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(p for p in root.rglob('*') if p.is_file()):
          archive.write(file, str(file.relative_to(root.parent)))
    except BaseException:  # a failed write, Ctrl-C: the half-written package goes, the package before stays
      partial.unlink(missing_ok=True)
      raise
    partial.replace(path)
  return path, description


def _readme_settings(export_dir):
  """The settings of a plain CTranslate2 export (no flaxformer_nmt.json), read from the README.md the export
  writes (serving.ctranslate2.README_TEMPLATE)."""
  readme = epath.Path(export_dir) / 'README.md'
  text = readme.read_text() if readme.exists() else ''
  direction = re.search(r'\((\w+)->(\w+),', text)
  beam, alpha = re.search(r'beam_size=(\d+)', text), re.search(r'length_penalty=([\d.]+)', text)
  extra = re.search(r'source length \+ (\d+)\)', text)
  positions = re.search(r'(\d+) positions', text)  # not in the READMEs of older exports
  if not (direction and beam and alpha and extra):
    raise ValueError(f'{export_dir} has neither {SETTINGS_FILE} nor the README.md of python -m '
                     'flaxformer_nmt.export: cannot tell its languages and decode settings')
  return {'source_lang': direction.group(1), 'target_lang': direction.group(2), 'lowercase': '.lower()' in text,
          'beam_size': int(beam.group(1)), 'alpha': float(alpha.group(1)),
          'max_decode_extra_length': int(extra.group(1)),
          'max_position': int(positions.group(1)) if positions else DEFAULT_MAX_POSITION,
          'checkpoint': 'unknown', 'checkpoint_steps': [], 'validation_bleu': None, 'parameters': None, 'config': {}}


def open_model(path, unpack_dir):
  """(CTranslate2 model directory, sentencepiece model, settings) of an Argos package (.argosmodel, unpacked
  into unpack_dir, or its directory) or of a plain CTranslate2 export directory."""
  path = epath.Path(path)
  if path.is_file():
    with zipfile.ZipFile(path) as archive:
      archive.extractall(unpack_dir)
    roots = [p for p in epath.Path(unpack_dir).iterdir() if (p / 'metadata.json').exists()]
    if len(roots) != 1:
      raise ValueError(f'{path} is no Argos package: no directory with metadata.json at its top')
    path = roots[0]
  if (path / 'metadata.json').exists() and (path / 'model').is_dir():
    settings_path = path / SETTINGS_FILE
    if not settings_path.exists():
      raise ValueError(f'{path} is an Argos package without {SETTINGS_FILE}: only packages exported by '
                       'python -m flaxformer_nmt.export --format argos are served')
    return path / 'model', path / SENTENCEPIECE_FILE, json.loads(settings_path.read_text())
  if (path / 'model.bin').exists():
    settings_path = path / SETTINGS_FILE
    settings = json.loads(settings_path.read_text()) if settings_path.exists() else _readme_settings(path)
    return path, path / tokenizer_lib.VOCAB_FILENAME, settings
  raise ValueError(f'{path} is neither an Argos package nor a CTranslate2 model directory (no model.bin)')


class CTranslate2Backend:
  """An exported model decoded by CTranslate2 behind the server's API.

  Each sentence gets its own length limit, as in our search (max_len_a * source pieces + max_len_b tokens
  before EOS): the sentences of a batch are decoded in groups of one limit, since CTranslate2's
  max_decoding_length is one limit per call, and in groups of one length penalty
  (ctranslate2.length_penalty_for: CTranslate2's length^penalty closest to our alpha at each source length).
  Beam search's scores are CTranslate2's (log probability / length^penalty), greedy search's the log
  probability (no penalty), as ours; attention is CTranslate2's one averaged map, reported as one layer.
  """

  name = 'ctranslate2'

  def __init__(self, path, device='cpu', threads=0):
    import ctranslate2  # pylint: disable=g-import-not-at-top
    self._unpacked = tempfile.TemporaryDirectory(prefix='ct2_model_')
    model_dir, vocab, self.settings = open_model(path, self._unpacked.name)
    self.path = str(path)
    self.translator = ctranslate2.Translator(str(model_dir), device=device, inter_threads=1,
                                             intra_threads=threads)
    self.tokenizer = tokenizer_lib.Tokenizer(vocab)
    self.source_lang, self.target_lang = self.settings['source_lang'], self.settings['target_lang']
    self.checkpoint = self.settings['checkpoint']
    self.max_position = int(self.settings['max_position'])
    self.max_source_tokens = max(self.settings['max_position'] - self.settings['max_decode_extra_length'], 2) - 1

  def defaults(self):
    return {'beam_size': self.settings['beam_size'], 'alpha': self.settings['alpha'], 'max_len_a': 1.0,
            'max_len_b': self.settings['max_decode_extra_length']}

  def encode(self, texts):
    return self.tokenizer.encode([tokenizer_lib.prepare_text(t, self.settings['lowercase']) for t in texts],
                                 num_threads=1)

  def decode(self, ids):
    return self.tokenizer.decode(ids)

  def pieces(self, ids):
    return self.tokenizer.pieces(ids)

  def check_options(self, options):
    beam, n_best = options['beam_size'], options.get('n_best', 1)
    if n_best > max(beam, 1):
      raise ValueError(f'n_best={n_best} must be between 1 and the beam size ({beam})')

  def run(self, options, token_lists, n_best, attention, tokens_per_batch):
    """[batcher.Sentence] of `token_lists` (none empty), decoded in groups of one length limit."""
    answers = [None] * len(token_lists)
    groups = {}
    for i, tokens in enumerate(token_lists):
      limit = math.floor(options['max_len_a'] * (len(tokens) - 1) + options['max_len_b'] + 1e-4)
      # Greedy search (beam_size 0) scores the log probability, as ours: no length penalty.
      penalty = ct2_export.length_penalty_for(options['alpha'], len(tokens) - 1) if options['beam_size'] else 0.0
      groups.setdefault((max(limit, 1), penalty), []).append(i)
    for (limit, penalty), members in groups.items():
      results = self.translator.translate_batch(
          [self.tokenizer.pieces(token_lists[i][:-1]) for i in members], beam_size=max(options['beam_size'], 1),
          num_hypotheses=n_best, length_penalty=penalty, max_decoding_length=limit,
          min_decoding_length=1, return_scores=True, suppress_sequences=SUPPRESSED,
          return_attention=any(attention[i] for i in members), max_batch_size=tokens_per_batch, batch_type='tokens')
      for i, result in zip(members, results):
        hypotheses = [([self.tokenizer.sp.piece_to_id(p) for p in pieces] + [EOS_ID], float(score))
                      for pieces, score in zip(result.hypotheses, result.scores)]
        answers[i] = batcher_lib.Sentence(hypotheses, self._attention(result, token_lists[i], hypotheses)
                                          if attention[i] else None)
    return answers

  @staticmethod
  def _attention(result, source, hypotheses):
    """CTranslate2's attention of the best hypothesis as [1 layer, target pieces with EOS, source pieces]: its
    rows (one a generated token) over the source it was given, the pieces without EOS; what it leaves out (the
    source's EOS column, the EOS row) stays zero."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    rows = np.zeros((len(hypotheses[0][0]), len(source)), np.float32)
    given = np.asarray(result.attention[0], np.float32).reshape(len(result.attention[0]), -1)
    given = given[:len(rows), :len(source)]
    rows[:given.shape[0], :given.shape[1]] = given
    return rows[None]

  def warm_up(self, max_source_tokens, options, tokens_per_batch):
    del max_source_tokens
    self.run(options, [self.encode(['warm up'])[0]], 1, [True], tokens_per_batch)

  def describe(self):
    return {'path': self.path, 'checkpoint': self.checkpoint, 'checkpoint_steps': self.settings['checkpoint_steps'],
            'validation_bleu': self.settings['validation_bleu'], 'parameters': self.settings['parameters'],
            'config': self.settings['config']}
