"""Train a few steps, checkpoint, resume, decode through the CLI and the Python API."""
import json
import logging
import subprocess
import sys

import jax
import numpy as np

from conftest import small_config
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.training import loop as train


def params_at(workdir, step):
  return decode.Translator(workdir, checkpoint=str(step)).params


def test_train_checkpoint_resume_decode(toy_corpus, tmp_path, monkeypatch, caplog):
  # A relative workdir, as users type it (orbax itself needs absolute paths).
  monkeypatch.chdir(tmp_path)
  workdir = tmp_path / 'run'
  config = small_config(toy_corpus)
  config.num_train_steps = 20
  config.average_last_checkpoints = 2
  metrics = train.train_and_evaluate(config, 'run')
  assert np.isfinite(metrics['train/loss']) and np.isfinite(metrics['eval/perplexity'])
  for name in ('vocab.model', 'config.json', 'metrics.jsonl', 'tensorboard'):
    assert (workdir / name).exists(), name
  assert checkpoints_lib.saved_steps(workdir) == [10, 20]
  assert json.loads((workdir / 'averaged' / 'averaged.json').read_text()) == {'steps': [10, 20]}  # at the end

  # Rerunning with more steps resumes at 20 and reuses the vocabulary.
  vocab_bytes = (workdir / 'vocab.model').read_bytes()
  config.num_train_steps = 30
  train.train_and_evaluate(config, 'run')
  assert checkpoints_lib.saved_steps(workdir) == [10, 20, 30]
  assert (workdir / 'vocab.model').read_bytes() == vocab_bytes

  # The resumed run equals an uninterrupted one: state and data position were restored exactly.
  straight = tmp_path / 'straight'
  train.train_and_evaluate(config, straight)
  resumed, uninterrupted = params_at(workdir, 30), params_at(straight, 30)
  for a, b in zip(jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(uninterrupted)):
    np.testing.assert_array_equal(a, b)

  # Averaging the last two checkpoints equals their mean computed here; decode loads it as 'averaged'.
  with caplog.at_level(logging.WARNING):
    assert checkpoints_lib.average_last('run', last=2) == [20, 30]
  # Reading a step's item directory on its own, orbax warned once per checkpoint that the step's metadata file
  # (one level up) was missing: noise in every training log that averages.
  assert not [r for r in caplog.records if 'Metadata file does not exist' in r.getMessage()]
  expected = jax.tree_util.tree_map(lambda a, b: (np.asarray(a, np.float64) + np.asarray(b)) / 2,
                                    params_at(workdir, 20), resumed)
  averaged = decode.Translator('run', checkpoint='averaged')
  assert averaged.checkpoint == 'the average of checkpoints [20, 30]'
  for a, b in zip(jax.tree_util.tree_leaves(averaged.params), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

  # Decode through the CLI: one line out per line in, empty lines kept, BLEU printed with its signature.
  sources = (toy_corpus / 'test.en').read_text().splitlines()
  mixed = sources[:5] + [''] + sources[5:12] + ['', '']
  (tmp_path / 'in.en').write_text('\n'.join(mixed) + '\n')
  references = (toy_corpus / 'test.de').read_text().splitlines()
  (tmp_path / 'ref.de').write_text('\n'.join(references[:5] + [''] + references[5:12] + ['', '']) + '\n')
  result = subprocess.run(
      [sys.executable, '-m', 'flaxformer_nmt.decode', '--workdir=run', '--input=in.en', '--output=hyp.de',
       '--reference=ref.de', '--tok_reference=ref.de', '--buffer_lines=4'],
      cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'nrefs:1|case:mixed|eff:no|tok:13a' in result.stdout and 'chrF = ' in result.stdout
  assert 'lowercased moses-tokenized (de)' in result.stdout
  hypotheses = (tmp_path / 'hyp.de').read_text().split('\n')[:-1]
  assert len(hypotheses) == len(mixed)
  assert [i for i, h in enumerate(hypotheses) if not h] == [i for i, s in enumerate(mixed) if not s]

  # The Python API gives the same translations as the CLI; greedy works too.
  translator = decode.Translator(workdir)
  assert translator.checkpoint == 'checkpoint 30'
  assert translator.translate(mixed) == hypotheses
  greedy = translator.translate(mixed, beam_size=0)
  assert len(greedy) == len(mixed) and greedy[5] == ''
  nbest = translator.translate(sources[:3], n_best=2, return_scores=True)
  assert all(len(h) == 2 and h[0][1] >= h[1][1] for h in nbest)

  # A workdir trained with cuDNN attention (a GPU run) decodes here too, to the same translations.
  saved = json.loads((workdir / 'config.json').read_text())
  saved['model']['attention_impl'], saved['model']['remat'] = 'cudnn', 'full'
  (workdir / 'config.json').write_text(json.dumps(saved))
  assert decode.Translator(workdir).translate(mixed) == hypotheses


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
