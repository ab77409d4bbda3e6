"""What the training loop logs about speed (tokens/s, FLOP/s, MFU, step time) and the profiler option."""
import json

import jax
import pytest

from conftest import small_config
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import flops
from flaxformer_nmt.training import loop as train


@pytest.mark.profiler
def test_log_carries_throughput_flops_mfu_and_the_profile_is_written(toy_corpus, tmp_path):
  config = small_config(toy_corpus)
  config.num_train_steps = 6
  config.log_every_steps = 3
  config.eval_every_steps = 6
  config.checkpoint_every_steps = 6
  config.peak_flops_per_device = 1e9  # a made-up peak: CPUs have none in the table
  config.profile_start_step, config.profile_steps = 2, 2
  config.grad_accumulation_steps = 2
  train.train_and_evaluate(config, tmp_path / 'run')
  model_config = model_lib.ModelConfig.from_config(config, config.vocab_size)
  logged = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  intervals = [m for m in logged if 'train/loss' in m]
  assert [m['step'] for m in intervals] == [3, 6]
  for m in intervals:
    assert m['train/target_tokens_per_second'] > 0 and m['train/source_tokens_per_second'] > 0
    assert m['train/step_time'] > 0
    # MFU is the model FLOP rate over the (overridden) peak of the one device.
    assert m['train/mfu'] == pytest.approx(m['train/tflops_per_second'] * 1e12 / 1e9, rel=1e-6)
    # FLOPs per target token are within what the model shape allows (attention over 16..32-token rows).
    per_token = m['train/tflops_per_second'] * 1e12 / m['train/target_tokens_per_second']
    low = flops.train_flops(model_config, config.vocab_size, 0, 1, 0, 0)
    high = flops.train_flops(model_config, config.vocab_size, 3, 1, 32, 32)
    assert low < per_token < high
  traces = list((tmp_path / 'run' / 'profile').rglob('*.xplane.pb'))
  assert traces, 'no profiler trace written'


def test_a_workdir_with_pre_fused_checkpoints_is_refused_not_moved_aside(toy_corpus, tmp_path):
  workdir = tmp_path / 'old'
  (workdir / 'checkpoints' / '100').mkdir(parents=True)
  config = small_config(toy_corpus)
  saved = json.loads(config.to_json_best_effort())
  for field in ('attention_impl', 'remat'):
    del saved['model'][field]
  (workdir / 'config.json').write_text(json.dumps(saved))
  with pytest.raises(workdir_lib.ConfigError, match='cannot resume'):
    train.train_and_evaluate(config, workdir)
  assert (workdir / 'checkpoints' / '100').exists()


@pytest.mark.profiler
@pytest.mark.parametrize('ending', ['end', 'error'])
def test_a_profile_window_the_run_stops_inside_is_written_and_closed(toy_corpus, tmp_path, evaluation_fails_at,
                                                                      ending):
  """A run that stops inside its profile window (its end or time limit comes first, or an error escapes the
  loop) writes the steps it traced and leaves no trace running: the process can profile again."""
  config = small_config(toy_corpus)
  config.num_train_steps = 5
  config.eval_every_steps = config.checkpoint_every_steps = 5
  config.profile_start_step, config.profile_steps = 2, 100
  if ending == 'error':
    evaluation_fails_at(3)  # the window opened before the third step
    with pytest.raises(RuntimeError, match='the evaluation failed'):
      train.train_and_evaluate(config, tmp_path / 'run')
  else:
    train.train_and_evaluate(config, tmp_path / 'run')
  assert list((tmp_path / 'run' / 'profile').rglob('*.xplane.pb')), 'the traced steps were not written'
  jax.profiler.start_trace(str(tmp_path / 'again'))  # raises while another trace is running
  jax.profiler.stop_trace()
