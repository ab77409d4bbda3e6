"""Reading a workdir for inference: its config.json."""
import json

import pytest

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib


@pytest.mark.parametrize('edit', [
    lambda saved: None,
    lambda saved: 5,
    lambda saved: dict(saved, model=None),
    lambda saved: dict(saved, model=5),
])
def test_a_config_json_that_is_no_object_of_fields_is_a_config_error_naming_it(tmp_path, edit):
  """A config.json edited by hand into valid JSON of another shape (null, a number, a model that is no object)
  stopped decode, export and average with a TypeError traceback instead of their one-line error."""
  workdir_lib.write_config(config_lib.base_config(), tmp_path)
  path = tmp_path / 'config.json'
  path.write_text(json.dumps(edit(json.loads(path.read_text()))))
  with pytest.raises(workdir_lib.ConfigError, match=f'^{path}'):
    workdir_lib.load_config(tmp_path)


def test_an_ensembles_workdirs_and_checkpoints_pair_up_as_given(tmp_path):
  """One workdir with several checkpoints, several workdirs with one checkpoint for all, or as many of each
  (paired in order); none given: each workdir's own config.decode_checkpoint (None, resolved when loaded). An
  ensemble's workdir stands for its members."""
  from flaxformer_nmt.checkpointing import loader  # pylint: disable=g-import-not-at-top
  a, b = str(tmp_path / 'a'), str(tmp_path / 'b')  # no config.json: each is one run
  assert loader.ensemble_members(a, '1700,1800') == [(a, '1700'), (a, '1800')]
  assert loader.ensemble_members(f'{a},{b}', 'averaged') == [(a, 'averaged'), (b, 'averaged')]
  assert loader.ensemble_members([a, b], ['10', '20']) == [(a, '10'), (b, '20')]
  assert loader.ensemble_members(f'{a},{b}', None) == [(a, None), (b, None)]
  config = config_lib.base_config()
  config.ensemble_members = 2
  workdir_lib.write_config(config, tmp_path / 'ens')
  members = [workdir_lib.member_workdir(tmp_path / 'ens', k) for k in range(2)]
  for member in members:
    workdir_lib.write_config(config_lib.base_config(), member)
  assert loader.ensemble_members(f'{tmp_path / "ens"},{a}', 'latest') == [
      (str(members[0]), 'latest'), (str(members[1]), 'latest'), (a, 'latest')]
  (members[1] / 'config.json').unlink()  # member1 never started: named, with the ways forward
  with pytest.raises(workdir_lib.ConfigError, match=f'{members[1]} has not started training'):
    loader.ensemble_members(str(tmp_path / 'ens'), None)
  with pytest.raises(workdir_lib.ConfigError, match=r'is an ensemble of 2 runs .*; give a member'):
    loader.load_params(tmp_path / 'ens', 'latest')  # one run's parameters (average, export): the workdir is none
