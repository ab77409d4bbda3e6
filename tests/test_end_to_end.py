"""Train a few steps, checkpoint, resume, average; decode a trained workdir through the CLI and the Python API."""
import json
import logging
import re
import shutil

import jax
import numpy as np
import pytest
import sacrebleu

import in_process
from conftest import small_config
from flaxformer_nmt import decode as decode_command
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import bleu as evaluate
from flaxformer_nmt.training import loop as train


def params_at(workdir, step):
  return decode.Translator(workdir, checkpoint=str(step)).params


def test_train_checkpoint_resume_and_average(toy_corpus, tmp_path, monkeypatch, caplog):
  # A relative workdir, as users type it (orbax itself needs absolute paths).
  monkeypatch.chdir(tmp_path)
  workdir = tmp_path / 'run'
  config = small_config(toy_corpus)
  config.num_train_steps = 10
  config.checkpoint_every_steps = config.eval_every_steps = 5
  config.average_last_checkpoints = 2
  metrics = train.train_and_evaluate(config, 'run')
  assert np.isfinite(metrics['train/loss']) and np.isfinite(metrics['eval/perplexity'])
  for name in ('vocab.model', 'config.json', 'metrics.jsonl', 'tensorboard'):
    assert (workdir / name).exists(), name
  assert checkpoints_lib.saved_steps(workdir) == [5, 10]
  assert json.loads((workdir / 'averaged' / 'averaged.json').read_text()) == {'steps': [5, 10]}  # at the end

  # Rerunning with more steps resumes at 10 and reuses the vocabulary.
  vocab_bytes = (workdir / 'vocab.model').read_bytes()
  config.num_train_steps = 15
  train.train_and_evaluate(config, 'run')
  assert checkpoints_lib.saved_steps(workdir) == [5, 10, 15]
  assert (workdir / 'vocab.model').read_bytes() == vocab_bytes

  # The resumed run equals an uninterrupted one: state and data position were restored exactly.
  straight = tmp_path / 'straight'
  train.train_and_evaluate(config, straight)
  resumed, uninterrupted = params_at(workdir, 15), params_at(straight, 15)
  for a, b in zip(jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(uninterrupted)):
    np.testing.assert_array_equal(a, b)

  # Averaging the last two checkpoints equals their mean computed here; decode loads it as 'averaged'.
  with caplog.at_level(logging.WARNING):
    assert checkpoints_lib.average_last('run', last=2) == [10, 15]
  # Reading a step's item directory on its own, orbax warned once per checkpoint that the step's metadata file
  # (one level up) was missing: noise in every training log that averages.
  assert not [r for r in caplog.records if 'Metadata file does not exist' in r.getMessage()]
  expected = jax.tree_util.tree_map(lambda a, b: (np.asarray(a, np.float64) + np.asarray(b)) / 2,
                                    params_at(workdir, 10), resumed)
  averaged = decode.Translator('run', checkpoint='averaged')
  assert averaged.checkpoint == 'the average of checkpoints [10, 15]'
  for a, b in zip(jax.tree_util.tree_leaves(averaged.params), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_decode_cli_and_api_on_a_trained_workdir(trained_toy, tmp_path):
  """The decode command (its main, in this process: tests/test_decode.py runs it as `python -m`): one line out
  per line in, empty lines kept, BLEU printed with its signature and above 0 for a model that translates; the
  API gives the command's lines with the programs the command compiled."""
  data = trained_toy.parent / 'data'
  sources = (data / 'test.en').read_text().splitlines()
  mixed = sources[:5] + [''] + sources[5:12] + ['', '']
  (tmp_path / 'in.en').write_text('\n'.join(mixed) + '\n')
  references = (data / 'test.de').read_text().splitlines()
  padded_references = references[:5] + [''] + references[5:12] + ['', '']
  (tmp_path / 'ref.de').write_text('\n'.join(padded_references) + '\n')
  result = in_process.run(decode_command, [f'--workdir={trained_toy}', f'--input={tmp_path / "in.en"}',
                                           f'--output={tmp_path / "hyp.de"}', f'--reference={tmp_path / "ref.de"}',
                                           f'--tok_reference={tmp_path / "ref.de"}'])
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'nrefs:1|case:mixed|eff:no|tok:13a' in result.stdout and 'chrF = ' in result.stdout
  assert 'lowercased moses-tokenized (de)' in result.stdout
  hypotheses = (tmp_path / 'hyp.de').read_text().split('\n')[:-1]
  assert len(hypotheses) == len(mixed)
  assert [i for i, h in enumerate(hypotheses) if not h] == [i for i, s in enumerate(mixed) if not s]
  # The printed BLEU is sacreBLEU's of the written lines, and above 0: the model translates.
  printed = float(re.search(r'^BLEU = ([\d.]+) .*tok:13a', result.stdout, re.M).group(1))
  assert printed == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [padded_references]).score, abs=0.005)
  assert printed > 5
  tokenized = float(re.search(r'^BLEU = ([\d.]+) .*moses-tokenized', result.stdout, re.M).group(1))
  assert tokenized == pytest.approx(evaluate.tokenized_bleu(hypotheses, padded_references, 'de')[0], abs=0.005)

  # The Python API gives the same translations as the command.
  translator = decode.Translator(trained_toy)
  assert translator.checkpoint == 'checkpoint 400'
  assert translator.translate(mixed) == hypotheses

  # A workdir trained with cuDNN attention (a GPU run) decodes here too, to the same translations.
  gpu_trained = shutil.copytree(trained_toy, tmp_path / 'gpu_trained')
  saved = json.loads((gpu_trained / 'config.json').read_text())
  saved['model']['attention_impl'], saved['model']['remat'] = 'cudnn', 'full'
  (gpu_trained / 'config.json').write_text(json.dumps(saved))
  assert decode.Translator(gpu_trained).translate(mixed) == hypotheses


def test_packed_training_learns(toy_corpus, tmp_path):
  """--config.packed_length: rows of several examples go through the whole loop and the loss falls."""
  config = small_config(toy_corpus)
  config.packed_length = 32
  config.num_train_steps = 40
  config.eval_every_steps = 40
  config.checkpoint_every_steps = 40
  metrics = train.train_and_evaluate(config, str(tmp_path / 'packed'))
  logged = [json.loads(line) for line in (tmp_path / 'packed' / 'metrics.jsonl').read_text().splitlines()]
  losses = [m['train/loss'] for m in logged if 'train/loss' in m]
  assert np.isfinite(metrics['eval/perplexity']) and losses[-1] < losses[0] - 0.5
