"""Bad configuration and limits, said up front in one line: unknown config fields, max_length against the
position table, the averaging window (regular checkpoints only, a warning when short), the average and compare
commands' flags that only go with others, and attention maps of a source cut to the position table."""
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import in_process
from flaxformer_nmt import average as average_command
from flaxformer_nmt import compare as compare_command
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.checkpointing.workdir import ConfigError
from flaxformer_nmt.data.tokenizer import EOS_ID
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import attention
from flaxformer_nmt.runtime import flags as cli
from flaxformer_nmt.training.step import TrainState

from conftest import copy_of_trained_toy, subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_unknown_config_field_is_one_line_with_the_nearest_names(tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.train', f'--config={REPO}/configs/multi30k.py',
       f'--workdir={tmp_path / "w"}', '--config.num_train_steps=5', '--config.model.d_modle=64'],
      cwd=tmp_path, capture_output=True, text=True, timeout=120, env=subprocess_env())
  assert result.returncode == 1
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("error: --config.model.d_modle: the config of") and "no field 'model.d_modle'" in lines[0]
  assert 'did you mean --config.model.d_model' in lines[0]
  assert not (tmp_path / 'w').exists()  # nothing started


def test_unknown_override_checks_every_level_and_refuses_absl_bool_negation():
  config = config_lib.base_config()
  argv = ['train', '--config=x.py', '--config.model.d_model=64', '--config.skip_bad_pairs', '--workdir=w']
  assert cli.unknown_override(argv, config) is None
  # ml_collections has no --config.noFIELD (absl's negation of a boolean flag): it raised a bare traceback.
  name, nearest = cli.unknown_override(argv + ['--config.noskip_bad_pairs'], config)
  assert name == 'noskip_bad_pairs' and nearest[0] == 'skip_bad_pairs'
  name, nearest = cli.unknown_override(argv + ['--config.grad_clip=1.0'], config)
  assert name == 'grad_clip' and nearest[0] == 'grad_clip_norm'
  assert cli.unknown_override(['train', '--config.model.no_such_field=1'], config)[0] == 'model.no_such_field'
  assert cli._config_file(['t', '--config', 'a/b.py']) == 'a/b.py'  # pylint: disable=protected-access
  assert cli._config_file(['t', '--config=a/b.py:big']) == 'a/b.py'  # pylint: disable=protected-access


@pytest.mark.parametrize('field', ['max_length', 'packed_length'])
def test_lengths_past_the_position_table_are_refused_before_training(field):
  config = config_lib.base_config()
  config.data_dir = '/nonexistent'
  config.model.max_position = config.max_length = 200
  config[field] = 256
  with pytest.raises(ConfigError, match=f'config.{field}=256 exceeds config.model.max_position=200'):
    config_lib.validate(config)
  config[field] = 200
  config_lib.validate(config)  # exactly the table: fine


def test_the_window_holds_regular_checkpoints_only():
  window = checkpoints_lib.averaging_window
  # Steps: the end-of-run save at 1801 sits one step after the regular 1800.
  assert window([1400, 1500, 1600, 1700, 1800, 1801], 5, every_steps=100) == [1400, 1500, 1600, 1700, 1800]
  assert window([1500, 1600, 1700, 1800, 1801], 5, every_steps=100) == [1500, 1600, 1700, 1800]
  assert window([1600, 1700, 1800, 1900], 2, every_steps=100) == [1800, 1900]  # ended on the grid: kept
  # Saving by time (no step grid): the final save 10 steps after the last timed one is left out...
  assert window([600, 1210, 1805, 2400, 2410], 3, every_steps=1_000_000) == [1210, 1805, 2400]
  # ... but not one that came after a usual spacing.
  assert window([600, 1210, 1805, 2400, 2990], 3, every_steps=1_000_000) == [1805, 2400, 2990]


def save_params(store, step, value):
  params = {'w': jnp.full((2, 3), float(value))}
  state = TrainState(step=jnp.asarray(step), params=params, opt_state={'mu': params}, rng=jnp.zeros(2, jnp.uint32))
  store.save(step, state, {'epoch': 0, 'batch': step, 'seed': 0}, force=True)


def test_averaging_fewer_than_asked_warns_with_the_count(tmp_path, caplog):
  store = checkpoints_lib.Checkpoints(tmp_path, keep=0)
  for step in (10, 20, 30, 31):
    save_params(store, step, step)
  store.wait()
  assert checkpoints_lib.average_last(tmp_path, last=5, every_steps=10) == [10, 20, 30]
  params, _ = checkpoints_lib.load_averaged(tmp_path)
  np.testing.assert_allclose(params['w'], np.full((2, 3), 20.0))  # (10 + 20 + 30) / 3: 31 left out
  assert 'Averaging 3 checkpoints [10, 20, 30], fewer than the 5 asked' in caplog.text


def test_the_average_command_takes_its_steps_from_one_flag_and_names_a_bad_one(tmp_path):
  store = checkpoints_lib.Checkpoints(tmp_path, keep=0)
  for step in (10, 20, 30):
    save_params(store, step, step)
  store.wait()
  workdir_lib.write_config(config_lib.base_config(), tmp_path)
  result = in_process.run(average_command, [f'--workdir={tmp_path}', '--last=2', '--steps=10,20'])
  assert result.returncode != 0 and '--last and --steps' in result.stderr, result.stderr[-2000:]
  assert not (tmp_path / checkpoints_lib.AVERAGED_DIR).exists()
  result = in_process.run(average_command, [f'--workdir={tmp_path}', '--steps=10,2O'])
  assert result.returncode == 1 and 'error: --steps=10,2O: checkpoint steps are whole numbers' in result.stderr
  result = in_process.run(average_command, [f'--workdir={tmp_path}', '--steps=10,30'])
  assert result.returncode == 0, result.stderr[-2000:]
  params, _ = checkpoints_lib.load_averaged(tmp_path)
  np.testing.assert_allclose(params['w'], np.full((2, 3), 20.0))  # (10 + 30) / 2


def test_compare_refuses_rescorer_options_without_a_rescorer(tmp_path):
  for option in ('--rerank_checkpoint=latest', '--rerank_weight=0.3'):
    result = in_process.run(compare_command, [f'--workdir={tmp_path}', option])
    assert result.returncode != 0 and 'options of --rerank_workdir' in result.stderr, result.stderr[-2000:]


def test_compare_refuses_mbr_without_two_candidates_before_loading_a_checkpoint(trained_toy):
  # Wrong order caught: greedy search, one beam or n_best 1 left MBR nothing to choose, and that was found only
  # when the first checkpoint's search began, in an error that named n_best alone.
  for options in (['--beam_size=0'], ['--beam_size=1'], ['--beam_size=3', '--n_best=1'],
                  ['--beam_size=2', '--n_best=3']):
    result = in_process.run(compare_command, [f'--workdir={trained_toy}', '--mbr=bleu', *options])
    assert result.returncode != 0 and '--mbr chooses among --n_best' in result.stderr, (options, result.stderr)
    assert 'Translating' not in result.stderr and '| checkpoint |' not in result.stdout


def test_compare_refuses_a_negative_beam_and_a_language_model_before_the_table(trained_toy, tmp_path):
  lm_workdir = copy_of_trained_toy(trained_toy, tmp_path / 'lm', task='lm')
  for workdir, options, message in ((trained_toy, ['--beam_size=-1'], '--beam_size=-1'),
                                    (lm_workdir, [], "config.task='lm'"),
                                    (trained_toy, [f'--rerank_workdir={lm_workdir}'], "config.task='lm'")):
    result = in_process.run(compare_command, [f'--workdir={workdir}', '--checkpoints=latest', *options])
    assert result.returncode != 0 and message in result.stderr, (options, result.stderr[-2000:])
    assert '| checkpoint |' not in result.stdout, result.stdout


def test_attention_maps_of_a_source_past_the_positions_are_those_of_the_cut_source(trained_toy, tmp_path):
  # max_position 1024 - max_decode_extra_length 1012: the search translates the first 11 tokens and EOS.
  workdir = copy_of_trained_toy(trained_toy, tmp_path / 'toy', max_decode_extra_length=1012)
  translator = decode.Translator(workdir, checkpoint='latest')
  sentence = ' '.join(['a dog runs on the grass .'] * 4)
  ids = translator.tokenizer.encode([sentence])[0]
  assert len(ids) > 12
  cut = ids[:11] + [EOS_ID]
  [m] = attention.attention_maps(translator, [sentence], beam_size=0)
  assert m['source_pieces'] == translator.tokenizer.pieces(cut)
  assert m['encoder'].shape[-2:] == (12, 12) and m['cross'].shape[-1] == 12
  assert m['translation'] == translator.translate([sentence], beam_size=0)[0]
