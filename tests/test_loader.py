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
