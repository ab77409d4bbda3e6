"""README.md and docs/*.md against the code: the commands they show name flags and config fields that exist, their
links between files resolve, and the README's layout names every module.

The commands are read from the text (`python -m flaxformer_nmt.NAME --flag ...`, continuation lines joined); each
command's flags are those its define_flags defines, as `python -m` would parse them.
"""
import importlib
import pathlib
import re

import pytest
from absl import flags

from flaxformer_nmt import config as config_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / 'flaxformer_nmt'
DOCS = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]
# A command (not the placeholder NAME) up to the end of its backticks, table cell, comment, redirection or line.
COMMAND = re.compile(r'python -m flaxformer_nmt\.([a-z_]+)([^`|;#<>\n]*)')
FLAG = re.compile(r'(?<![\w-])--([\w.]+)')
CONFIG_FIELD = re.compile(r'(?<!error: )--config\.([\w.]+)')
LINK = re.compile(r'\]\(([^)#\s]+)(?:#[^)]*)?\)')


def doc_commands(text):
  """[(command, [flag names])] of every `python -m flaxformer_nmt.NAME ...` in `text`."""
  text = text.replace('\\\n', ' ')
  return [(match.group(1), FLAG.findall(match.group(2))) for match in COMMAND.finditer(text)]


def command_flags(name):
  """The flags `python -m flaxformer_nmt.NAME` parses: its own (and --noX of a boolean) and absl's."""
  module = importlib.import_module(f'flaxformer_nmt.{name}')
  before = set(flags.FLAGS)
  module.define_flags()
  defined = set(flags.FLAGS) - before
  try:
    return before | defined | {f'no{flag}' for flag in defined if flags.FLAGS[flag].boolean}
  finally:
    for flag in defined:
      delattr(flags.FLAGS, flag)


def is_config_field(path):
  node = config_lib.base_config()
  for part in path.split('.'):
    if part not in node:
      return False
    node = node[part]
  return True


def unknown_names(paths):
  """'FILE: --config.FIELD' for each field base_config lacks (but in a quoted error about a misspelt one), and
  'FILE: python -m flaxformer_nmt.NAME --flag' for each other flag the command does not take."""
  found, known = [], {}
  for path in paths:
    text = path.read_text()
    found += [f'{path.name}: --config.{name.rstrip(".")}' for name in CONFIG_FIELD.findall(text)
              if not is_config_field(name.rstrip('.'))]
    for command, names in doc_commands(text):
      if command not in known:
        known[command] = command_flags(command)
      found += [f'{path.name}: python -m flaxformer_nmt.{command} --{name}' for name in names
                if not name.startswith('config.') and name not in known[command]]
  return found


def test_every_flag_and_config_field_a_documented_command_names_exists():
  assert unknown_names(DOCS) == []


def test_the_command_reader_finds_a_misspelt_flag_and_field(tmp_path):
  """The checker itself: a flag of another command, a misspelt field (in a command and in the text), and flags
  after a continuation line; not the flags of a comment or of another program, nor the field of a quoted error."""
  doc = tmp_path / 'doc.md'
  doc.write_text('```bash\npython -m flaxformer_nmt.average --workdir W \\\n    --beam_size 4  # --bogus\n'
                 'python -m flaxformer_nmt.train --config c.py --config.model.d_modle=3 --config.seed=1\n```\n'
                 '`python -m flaxformer_nmt.decode --greedy` | `fairseq-generate --lenpen 1`\n'
                 '(`error: --config.model.d_modle: no such field`; `--config.seed`.)\n')
  assert unknown_names([doc]) == ['doc.md: --config.model.d_modle',
                                  'doc.md: python -m flaxformer_nmt.average --beam_size']


@pytest.mark.parametrize('path', DOCS, ids=lambda p: p.name)
def test_links_between_files_resolve(path):
  links = [link for link in LINK.findall(path.read_text()) if not re.match(r'[a-z]+:', link)]
  assert [link for link in links if not (path.parent / link).exists()] == []


def test_the_readme_layout_names_every_module():
  """Each subpackage's line names its modules, and the commands' line each command."""
  block = (REPO / 'README.md').read_text().split('\n## Layout\n', 1)[1].split('```')[1]
  parts = re.split(r'^  (\w+)/', block, flags=re.M)
  described = {package: set(re.findall(r'\w+', text)) for package, text in zip(parts[1::2], parts[2::2])}
  missing = []
  for package in sorted(p for p in PACKAGE.iterdir() if (p / '__init__.py').exists()):
    missing += [f'{package.name}/{module.stem}' for module in sorted(package.glob('*.py'))
                if module.stem != '__init__' and module.stem not in described.get(package.name, ())]
  missing += [module.name for module in sorted(PACKAGE.glob('*.py'))
              if module.stem != '__init__' and not re.search(rf'(?<![\w/]){module.name}\b', block)]
  assert missing == []
