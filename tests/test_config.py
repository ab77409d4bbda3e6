"""Config files, command-line overrides and their errors, through the real entry point."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*args, cwd=REPO):
  return subprocess.run([sys.executable, '-m', 'flaxformer_nmt.train', *args], cwd=cwd, capture_output=True,
                        text=True, timeout=120)


@pytest.mark.parametrize('name', ['base', 'big', 'multi30k', 'wmt14_ende_base', 'wmt14_ende_big'])
def test_configs_load_with_the_paper_values(name):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  assert set(c.keys()) == set(config_lib.base_config().keys())
  # The paper's label smoothing, except for the CPU hour, whose 0.2 was chosen on valid (bench/RESULTS.md).
  assert (c.adam_b1, c.adam_b2, c.adam_eps, c.label_smoothing) == (0.9, 0.98, 1e-9, 0.2 if name == 'multi30k' else 0.1)
  # The paper's post-LN, except for the hour where bf16 dots exist: the quality recipe's pre-LN model.
  assert not c.model.pre_layer_norm or (name == 'multi30k' and c.model.d_model == 128)
  if name.startswith('wmt14'):
    assert (c.data_source, c.tfds_name, c.source_lang, c.target_lang) == ('tfds', 'wmt14_translate/de-en', 'en', 'de')
    assert (c.eval_split, c.vocab_size, c.checkpoint_every_minutes) == ('validation', 37_000, 10.0)
  if name == 'wmt14_ende_base':
    assert (c.num_train_steps, c.average_last_checkpoints) == (100_000, 5)
  if name.endswith('base'):
    assert (c.model.num_encoder_layers, c.model.d_model, c.model.d_ff, c.model.num_heads) == (6, 512, 2048, 8)
    assert (c.model.dropout_rate, c.warmup_steps, c.tokens_per_batch) == (0.1, 4000, 25_000)
  if name.endswith('big'):
    assert (c.num_train_steps, c.average_last_checkpoints) == (300_000, 20)
    assert (c.model.d_model, c.model.d_ff, c.model.num_heads, c.model.dropout_rate) == (1024, 4096, 16, 0.3)


def load_config_file(name, *args):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.load_config_file(os.path.join(REPO, 'configs', f'{name}.py'), *args)


def flat(c, prefix=''):
  """{'model.d_model': 128, ...}: a config's fields, the model's included."""
  out = {}
  for key, value in c.items():
    out.update(flat(value, f'{prefix}{key}.') if hasattr(value, 'items') else {prefix + key: value})
  return out


def test_the_hour_is_the_quality_recipe_cut_to_an_hour_where_bf16_dots_exist():
  hour, recipe = flat(load_config_file('multi30k', 'bfloat16')), flat(load_config_file('multi30k_best'))
  # The recipe's model, data, schedule shape and decoding (adopted on valid, 2026-12-01): only its length differs.
  assert {k for k in hour.keys() | recipe.keys() if hour.get(k) != recipe.get(k)} == {
      'num_train_steps', 'cooldown_steps', 'max_train_minutes'}
  assert (hour['model.d_model'], hour['model.pre_layer_norm'], hour['vocab_size']) == (128, True, 8000)
  assert (hour['num_train_steps'], hour['cooldown_steps'], hour['max_train_minutes']) == (6500, 3250, 58.0)
  # The last 5 averaged lie within the cooldown, and the run keeps them until it averages them.
  assert hour['checkpoint_every_steps'] * hour['average_last_checkpoints'] <= hour['cooldown_steps']
  assert hour['keep_checkpoints'] >= hour['average_last_checkpoints']


def test_the_hour_halves_its_batch_where_matmuls_stay_float32(monkeypatch):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.models import transformer as model_lib  # pylint: disable=g-import-not-at-top
  slow = load_config_file('multi30k', 'float32')
  # The d_model-256 post-LN hour as measured on the Zen 3, not the tiny recipe of the bf16 variant.
  m = slow.model
  assert (m.d_model, m.d_ff, m.num_encoder_layers, m.num_decoder_layers, m.pre_layer_norm) == (256, 1024, 3, 3, False)
  assert (slow.vocab_size, slow.learning_rate_schedule, slow.beam_size) == (12000, 'paper', 4)
  # Twice the steps of half the 4,096-token batch: the warmup, the whole run, and the spacing of evaluations
  # and saves cover the tokens of the full batch's 500 / 2,250 / 250 / 500 / 100 steps; the cooldown still
  # starts where the warmup ends.
  assert (slow.tokens_per_batch, slow.warmup_steps, slow.num_train_steps) == (2048, 1000, 4500)
  assert (slow.eval_every_steps, slow.eval_bleu_every_steps, slow.checkpoint_every_steps) == (500, 1000, 200)
  assert slow.cooldown_steps == slow.num_train_steps - slow.warmup_steps
  # The regularization, peak learning rate and decoding chosen on valid for the fewer tokens it sees.
  assert (m.dropout_rate, slow.learning_rate_scale, slow.label_smoothing) == (0.1, 1.414, 0.2)
  assert (slow.decode_checkpoint, slow.length_penalty_alpha, slow.lowercase) == ('averaged', 1.5, True)
  # By default the CPU's instructions choose; configs/multi30k.py:float32 chooses from the command line.
  for has_bf16, expected in ((True, (4096, 128)), (False, (2048, 256))):
    monkeypatch.setattr(model_lib, 'cpu_has_bfloat16_dot', lambda has=has_bf16: has)
    c = load_config_file('multi30k')
    assert (c.tokens_per_batch, c.model.d_model) == expected
  argv = ['prog', '--config', os.path.join(REPO, 'configs', 'multi30k.py') + ':float32']
  values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  assert values.config.tokens_per_batch == 2048
  with pytest.raises(ValueError, match='multi30k.py:fp16'):
    load_config_file('multi30k', 'fp16')


def test_multi30k_tiny_is_the_fairseq_tiny_recipe():
  c = load_config_file('multi30k_tiny')
  m = c.model
  assert (m.d_model, m.d_ff, m.num_heads, m.num_encoder_layers, m.num_decoder_layers, m.dropout_rate) == (
      128, 256, 4, 4, 4, 0.3)
  assert (c.learning_rate_schedule, c.learning_rate, c.warmup_steps, c.adam_b1, c.adam_b2) == (
      'inverse_sqrt', 0.005, 2000, 0.9, 0.98)
  assert (c.num_train_steps, c.tokens_per_batch, c.average_last_checkpoints, c.beam_size) == (8000, 4096, 10, 5)
  assert c.cooldown_steps == 0 and c.eval_split == 'valid'


def test_multi30k_best_is_the_tiny_recipe_with_a_cooldown_and_trains_from_valid_only():
  from flaxformer_nmt.training import validation as bleu_eval  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  c = load_config_file('multi30k_best')
  assert set(c.keys()) == set(config_lib.base_config().keys())
  m = c.model
  # The anchor's Transformer-tiny and its schedule (42.55 valid against the d_model-256 model's 42.03).
  assert (m.d_model, m.d_ff, m.num_heads, m.num_encoder_layers, m.num_decoder_layers, m.dropout_rate) == (
      128, 256, 4, 4, 4, 0.3)
  assert (c.learning_rate_schedule, c.learning_rate, c.warmup_steps, c.adam_b1, c.adam_b2, c.label_smoothing) == (
      'inverse_sqrt', 0.005, 2000, 0.9, 0.98, 0.2)
  # One run (a tie on valid with two members goes to the simpler), a linear cooldown to zero over the second half.
  assert (c.ensemble_members, c.num_train_steps, c.cooldown_steps) == (1, 12000, 6000)
  assert c.checkpoint_every_steps * 10 <= c.cooldown_steps  # the last 10 averaged lie within the cooldown
  assert (c.tokens_per_batch, c.packed_length, c.beam_size) == (4096, 64, 5)
  # The hour's findings: bf16 operands where the CPU has them; BPE-dropout stays off (it set the run back).
  assert (m.matmul_precision, c.bpe_dropout) == ('auto', 0.0)
  # Pre-LN (42.78 on valid against post-LN's 42.55, 2026-12-01).
  assert m.pre_layer_norm
  # Lowercased text, decoded as chosen on valid: the trainer's average of the last 5 checkpoints, alpha 2.0; the
  # run keeps 10 (keep_checkpoints >= 10), so `compare --checkpoints last:10` can still be scored.
  assert (c.lowercase, c.decode_checkpoint, c.length_penalty_alpha) == (True, 'averaged', 2.0)
  assert c.average_last_checkpoints == 5 and c.keep_checkpoints >= 10
  assert c.max_train_minutes <= 150 and c.average_last_checkpoints <= c.keep_checkpoints
  # Selection sees validation data only.
  assert c.eval_split == 'valid' and c.best_checkpoint_metric == 'bleu' and c.eval_bleu_every_steps > 0
  bleu_eval.validate_config(c)
  for name in ('multi30k', 'multi30k_best', 'multi30k_tiny', 'lm_multi30k', 'mlm_multi30k'):
    assert load_config_file(name).data_download == 'multi30k'
  hour = load_config_file('multi30k')
  # Both end their cooldown within their time limit on a slower machine (a Zen 3 EPYC takes 3.3 s a step).
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  assert c.fit_schedule_to_time and hour.fit_schedule_to_time
  workdir_lib.validate_config(c)
  workdir_lib.validate_config(hour)


def test_decode_checkpoint_names_one_the_run_will_have():
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  for name in ('base', 'big', 'multi30k', 'multi30k_best', 'multi30k_tiny', 'wmt14_ende_base', 'wmt14_ende_big'):
    c = load_config_file(name)
    c.data_dir = c.data_dir or '/data'  # base and big name none
    workdir_lib.validate_config(c)
  c = config_lib.base_config()
  c.data_dir = '/data'
  for good in ('latest', 'averaged', 'last:3', '1200'):
    c.decode_checkpoint = good
    workdir_lib.validate_config(c)
  for bad, average, metric, match in (('avg', 5, '', 'use latest'), ('last:0', 5, '', 'use latest'),
                                      ('averaged', 0, '', 'average_last_checkpoints > 0'),
                                      ('best', 5, '', 'best_checkpoint_metric')):
    c.decode_checkpoint, c.average_last_checkpoints, c.best_checkpoint_metric = bad, average, metric
    with pytest.raises(workdir_lib.ConfigError, match=match):
      workdir_lib.validate_config(c)
  c.decode_checkpoint, c.best_checkpoint_metric = 'best', 'bleu'
  workdir_lib.validate_config(c)


def test_unknown_field_is_a_clear_error(tmp_path):
  result = run_train('--config', 'configs/multi30k.py', '--workdir', str(tmp_path), '--config.no_such_field=1')
  assert result.returncode != 0
  assert 'no_such_field' in result.stderr
  assert not (tmp_path / 'checkpoints').exists()


def test_wrong_type_is_a_clear_error(tmp_path):
  result = run_train('--config', 'configs/multi30k.py', '--workdir', str(tmp_path), '--config.model.d_model=wide')
  assert result.returncode != 0
  assert 'd_model' in result.stderr


def test_missing_data_is_one_clear_line(tmp_path):
  # (data_download off: the Multi30k config would otherwise fetch the corpus into the directory named.)
  result = run_train('--config', 'configs/multi30k.py', '--workdir', str(tmp_path / 'w'),
                     f'--config.data_dir={tmp_path}/nowhere', '--config.data_download=')
  assert result.returncode == 1
  assert 'nowhere/train.en: file not found' in result.stderr
  assert 'Traceback' not in result.stderr


def test_overrides_reach_the_config():
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  argv = ['prog', '--config', os.path.join(REPO, 'configs', 'multi30k.py') + ':float32', '--config.model.d_model=128',
          '--config.length_buckets=(8,16)', '--config.model.pre_layer_norm=true', '--config.data_dir=/data/x']
  values = flags.FlagValues()
  # The override flags are found in the argv (sys.argv when run as a program).
  config_flags.DEFINE_config_file('config', None, flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  c = values.config
  assert c.model.d_model == 128 and c.model.pre_layer_norm and tuple(c.length_buckets) == (8, 16)
  assert c.data_dir == '/data/x' and c.model.num_heads == 4


def test_a_workdir_refuses_a_different_model(tmp_path):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.base_config()
  workdir_lib.save_or_check_config(config, tmp_path)
  workdir_lib.save_or_check_config(config, tmp_path)  # the same model is fine
  config.model.d_model = 64
  with pytest.raises(workdir_lib.ConfigError, match='holds a different model: config.model was'):
    workdir_lib.save_or_check_config(config, tmp_path)


def test_a_workdir_refuses_to_resume_in_the_other_target_order(tmp_path):
  # A right-to-left model resumed left to right (or the reverse) would unlearn what it learnt.
  import json  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.base_config()
  workdir_lib.save_or_check_config(config, tmp_path)
  saved = json.loads((tmp_path / 'config.json').read_text())
  del saved['target_right_to_left']  # a workdir written before the field reads as left to right
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  workdir_lib.save_or_check_config(config, tmp_path)
  config.target_right_to_left = True
  with pytest.raises(workdir_lib.ConfigError, match='config.target_right_to_left was False, now True'):
    workdir_lib.save_or_check_config(config, tmp_path)


def test_a_workdir_refuses_to_resume_with_the_other_case(tmp_path):
  # Its vocabulary was learnt on text of one case: resuming on the other would feed it text it never saw.
  import json  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.base_config()
  workdir_lib.save_or_check_config(config, tmp_path)
  config.lowercase = True
  with pytest.raises(workdir_lib.ConfigError, match='config.lowercase was False, now True'):
    workdir_lib.save_or_check_config(config, tmp_path)
  # A config.json written before the field existed describes cased text: resuming it cased is fine.
  saved = json.loads((tmp_path / 'config.json').read_text())
  del saved['lowercase']
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  config.lowercase = False
  workdir_lib.save_or_check_config(config, tmp_path)


def test_cudnn_attention_where_cudnn_cannot_run_stops_before_any_work(tmp_path):
  # float32 is refused by cuDNN on every machine (and on this CPU there is no cuDNN at all): one line naming the
  # field, before the vocabulary or the data are touched.
  result = run_train('--config', 'configs/multi30k.py', '--workdir', str(tmp_path / 'w'),
                     '--config.model.attention_impl=cudnn', '--config.model.dtype=float32')
  assert result.returncode == 1
  assert "config.model.attention_impl='cudnn' needs" in result.stderr and 'Traceback' not in result.stderr
  assert not (tmp_path / 'w' / 'vocab.model').exists()
  assert 'Host memory: freed buffers kept for reuse' in result.stderr  # train.main set it first (host_memory.py)

@pytest.mark.parametrize('rate, task, message', [(1.0, 'translation', 'is a probability'),
                                                 (-0.1, 'translation', 'is a probability'),
                                                 (0.1, 'lm', "not 'lm'")])
def test_bad_source_word_dropout_settings_are_named(rate, task, message):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.data_dir = '/data'
  c.model.source_word_dropout, c.task = rate, task
  with pytest.raises(workdir_lib.ConfigError, match=f'config.model.source_word_dropout=.*{message}'):
    workdir_lib.validate_config(c)


@pytest.mark.parametrize('epochs, task, message', [(-1, 'translation', 'counts epochs'), (3, 'lm', "not 'lm'")])
def test_bad_bidirectional_epochs_are_named(epochs, task, message):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.data_dir = '/data'
  c.bidirectional_epochs, c.task = epochs, task
  with pytest.raises(workdir_lib.ConfigError, match=f'config.bidirectional_epochs=.*{message}'):
    workdir_lib.validate_config(c)


def test_rdrop_is_refused_where_it_cannot_work():
  """R-Drop without any dropout compares two equal predictions (a regularizer that does nothing); on the MLM
  the two copies would be masked differently. Both stop at validation, naming the field."""
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.data_dir = '/data'
  c.rdrop_alpha = 5.0
  workdir_lib.validate_config(c)  # dropout 0.1: fine
  c.model.dropout_rate = 0.0
  with pytest.raises(workdir_lib.ConfigError, match='config.rdrop_alpha=5.0 needs dropout'):
    workdir_lib.validate_config(c)
  c.model.source_word_dropout = 0.1  # source words dropped: the two predictions differ
  workdir_lib.validate_config(c)
  c.model.source_word_dropout = 0.0
  c.model.relu_dropout_rate = 0.1
  workdir_lib.validate_config(c)
  c.task = 'mlm'
  with pytest.raises(workdir_lib.ConfigError, match='not for the MLM'):
    workdir_lib.validate_config(c)
  c.task, c.rdrop_alpha = 'translation', -1.0
  with pytest.raises(workdir_lib.ConfigError, match='is a weight'):
    workdir_lib.validate_config(c)


def test_the_chunked_vocabulary_loss_is_refused_where_it_cannot_work():
  """The chunked loss never holds whole predictions: not with R-Drop (which compares them), and only the
  translation model stops at its decoder states."""
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.data_dir = '/data'
  c.vocabulary_loss_chunk_tokens = 512
  workdir_lib.validate_config(c)
  c.rdrop_alpha = 5.0
  with pytest.raises(workdir_lib.ConfigError, match='vocabulary_loss_chunk_tokens=512 cannot go with config.rdrop'):
    workdir_lib.validate_config(c)
  c.rdrop_alpha, c.task = 0.0, 'lm'
  with pytest.raises(workdir_lib.ConfigError, match="for the translation task, not 'lm'"):
    workdir_lib.validate_config(c)
  c.task, c.vocabulary_loss_chunk_tokens = 'translation', -1
  with pytest.raises(workdir_lib.ConfigError, match='counts tokens'):
    workdir_lib.validate_config(c)


def test_prng_impl_is_checked_and_a_workdir_from_before_the_field_resumes_only_on_threefry(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.base_config()
  config.data_dir = '/data'
  config.prng_impl = 'philox'
  with pytest.raises(workdir_lib.ConfigError, match=r"config.prng_impl='philox': use one of"):
    workdir_lib.validate_config(config)
  config.prng_impl = 'threefry2x32'
  workdir_lib.save_or_check_config(config, tmp_path)
  saved = json.loads((tmp_path / 'config.json').read_text())
  del saved['prng_impl']  # as every config.json written before the field: those runs drew threefry keys
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  workdir_lib.save_or_check_config(config, tmp_path)
  config.prng_impl = 'rbg'
  with pytest.raises(workdir_lib.ConfigError, match=r"config.prng_impl='threefry2x32', now 'rbg'"):
    workdir_lib.save_or_check_config(config, tmp_path)


@pytest.mark.parametrize('field, value', [('bpe_dropout', 0.1), ('bidirectional_epochs', 2), ('task', 'lm')])
def test_right_to_left_targets_refuse_what_re_reads_or_swaps_the_targets(field, value):
  from flaxformer_nmt import config as config_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.data_dir = '/data'
  c.target_right_to_left = True
  workdir_lib.validate_config(c)  # alone it trains
  c[field] = value
  with pytest.raises(workdir_lib.ConfigError, match=f'config.target_right_to_left .*config.{field}='):
    workdir_lib.validate_config(c)
