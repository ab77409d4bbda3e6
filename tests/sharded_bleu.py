"""Helper for test_quality.py, run in its own process: XLA_FLAGS must give 4 CPU devices before jax starts.

Translates a toy validation split with ValidationBleu on parameters laid out on meshes (data, fsdp) =
(1, 1), (4, 1) and (1, 4), and prints a JSON report: the hypotheses of each layout.
"""
import json
import os
import pathlib
import sys
import tempfile

os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=4'
# The forced devices are host (CPU) devices: on a GPU machine jax would otherwise pick its one GPU.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(__file__))
from conftest import small_config, write_toy_corpus  # pylint: disable=wrong-import-position
from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=wrong-import-position
from flaxformer_nmt.data import corpora  # pylint: disable=wrong-import-position
from flaxformer_nmt.data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from flaxformer_nmt.runtime import sharding  # pylint: disable=wrong-import-position
from flaxformer_nmt.training import step as ts  # pylint: disable=wrong-import-position
from flaxformer_nmt.training import validation as bleu_eval  # pylint: disable=wrong-import-position


def main():
  with tempfile.TemporaryDirectory() as directory:
    print(json.dumps(translations(pathlib.Path(directory))))


def translations(root):
  config = small_config(write_toy_corpus(root / 'data'))
  config.eval_bleu_every_steps, config.eval_bleu_beam_size = 10, 2
  tokenizer = tokenizer_lib.load_or_train(
      root, lambda: tokenizer_lib.sample_sentences(corpora.open_split(config, 'train')), vocab_size=config.vocab_size)
  model = workdir_lib.build_model(config, tokenizer)
  optimizer, _ = ts.make_optimizer(config)
  host_params = jax.tree_util.tree_map(np.asarray, ts.init_state(model, optimizer, config.seed).params)
  # Sharper than the init distribution (as conftest.tiny_model), so that sentences get different outputs.
  host_params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim == 2 else x, host_params)
  report = {}
  for data, fsdp in ((1, 1), (4, 1), (1, 4)):
    mesh = sharding.make_mesh(data, fsdp, devices=jax.devices()[:data * fsdp])
    params = jax.device_put(host_params, sharding.state_shardings(host_params, mesh))
    report[f'{data}x{fsdp}'] = bleu_eval.ValidationBleu(config, tokenizer, root, mesh).translate(params)
  return report


if __name__ == '__main__':
  main()
