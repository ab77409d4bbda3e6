"""The package's layers: each module imports only from layers below its own (or from its own subpackage).

  commands (top-level modules: flags + main)
  training, serving
  evaluation
  decoding
  checkpointing
  data
  models
  runtime
  config

So decoding never imports training, and no library module imports a command. The imports are read from the
source (every `import` statement, also those inside functions), not by importing the modules.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'flaxformer_nmt'
LAYERS = {'config': 0, 'runtime': 1, 'models': 2, 'data': 3, 'checkpointing': 4, 'decoding': 5, 'evaluation': 6,
          'training': 7, 'serving': 7}
COMMAND_LAYER = 8


def layer_of(module):
  """('flaxformer_nmt.decoding.search') -> (layer number, subpackage or module name)."""
  parts = module.split('.')
  name = parts[1] if len(parts) > 1 else ''
  if name in LAYERS:
    return LAYERS[name], name
  return COMMAND_LAYER, name


def module_name(path):
  relative = path.relative_to(PACKAGE.parent).with_suffix('')
  parts = list(relative.parts)
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


def imported_modules(path):
  """The flaxformer_nmt modules a file imports (`from flaxformer_nmt.x import y` counts y when y is a module)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(alias.name, node.lineno) for alias in node.names if alias.name.startswith('flaxformer_nmt')]
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('flaxformer_nmt'):
      for alias in node.names:
        candidate = f'{node.module}.{alias.name}'
        is_module = (PACKAGE.parent / (candidate.replace('.', '/') + '.py')).exists() or (
            PACKAGE.parent / candidate.replace('.', '/')).is_dir()
        found.append((candidate if is_module else node.module, node.lineno))
  return found


def all_modules():
  return sorted(p for p in PACKAGE.rglob('*.py'))


def violations():
  found = []
  for path in all_modules():
    importer = module_name(path)
    importer_layer, importer_group = layer_of(importer)
    for imported, line in imported_modules(path):
      if imported == 'flaxformer_nmt':
        continue
      layer, group = layer_of(imported)
      same_subpackage = group == importer_group and importer_layer != COMMAND_LAYER
      if not same_subpackage and layer >= importer_layer:
        found.append(f'{path.relative_to(PACKAGE.parent)}:{line}: {importer} imports {imported}')
  return found


def test_every_module_imports_only_from_layers_below_it():
  assert violations() == []


def test_the_layer_rule_catches_a_library_module_importing_a_command_and_decoding_importing_training(tmp_path):
  """The checker itself: the imports that the rule forbids are found (layer_of ranks them as it must)."""
  assert layer_of('flaxformer_nmt.decode')[0] == COMMAND_LAYER
  assert layer_of('flaxformer_nmt.decoding.search')[0] < layer_of('flaxformer_nmt.training.loop')[0]
  assert layer_of('flaxformer_nmt.training.loop')[0] == layer_of('flaxformer_nmt.serving.server')[0]
  bad = tmp_path / 'bad.py'
  bad.write_text('from flaxformer_nmt.training import loop\nfrom flaxformer_nmt import decode\n'
                 'def f():\n  import flaxformer_nmt.config\n')
  assert [m for m, _ in imported_modules(bad)] == ['flaxformer_nmt.training.loop', 'flaxformer_nmt.decode',
                                                   'flaxformer_nmt.config']


@pytest.mark.parametrize('path', [p for p in PACKAGE.glob('*.py') if p.name not in ('__init__.py', 'config.py')],
                         ids=lambda p: p.stem)
def test_each_command_defines_its_flags_and_main(path):
  tree = ast.parse(path.read_text())
  functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
  assert {'main'} <= functions, f'{path.name} is a command: it defines main'
  classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
  assert not classes, f'{path.name} is a command (flags + main): its classes {classes} belong in a subpackage'
