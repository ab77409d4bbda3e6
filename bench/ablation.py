r"""Ablation of a recipe on the validation set: each training choice switched back, one run each, and each
decoding choice (beam, length penalty, averaging window, best vs averaged) on the recipe's own run.

  python bench/ablation.py --config configs/multi30k_best.py --root runs/ablation [--minutes 150] \
      [--variants dropout_0.1,no_cooldown] [--split valid]

Training variants (each a run in {root}/{name}, resumable; same seed; steps sized to the recipe's time; a recipe
of config.ensemble_members trains that many members per variant, each scored as the members' ensemble):
  recipe           the config as written
  post_ln          model.pre_layer_norm False: the paper's post-LN (the recipe's until 2026-12-01)
  dropout_0.1      model.dropout_rate 0.1 instead of the recipe's 0.3
  no_smoothing     label_smoothing 0
  no_cooldown      cooldown_steps 0: inverse square root to the end (checkpoints averaged)
  warmup_4000      4,000 warmup steps instead of 2,000 (fairseq's default; the cooldown still ends at the last step)
  model_d256       the recipe's model until 2026-11-28 (3+3 layers, d 256, ff 1,024, the paper's schedule with
                   500 warmup steps), 5,800 steps (its step takes 1.3-1.45 s against 0.65-0.75 s on a Zen 4)
  tokens_8192      8,192 tokens per step instead of 4,096 (half the updates in the same time)
Decoding variants, on the recipe's run: beam 4 and the config's, alpha 0.6 (the paper's) and the config's,
checkpoints latest, best, the average of the last half of the config's averaging window, and the averaged.

Prints Markdown tables of validation sacreBLEU, lowercased tokenized BLEU and length ratio (also written to
{root}/ablation.md). Validation only: this is what choices are made on.
"""
import os
import subprocess
import sys

import sacrebleu
from absl import app, flags
from etils import epath

from flaxformer_nmt import checkpoints as checkpoints_lib
from flaxformer_nmt import compare
from flaxformer_nmt import decode
from flaxformer_nmt import evaluate
from flaxformer_nmt import workdir as workdir_lib

TRAINING_VARIANTS = {
    'recipe': [],
    'post_ln': ['model.pre_layer_norm=False'],
    'dropout_0.1': ['model.dropout_rate=0.1'],
    'no_smoothing': ['label_smoothing=0.0'],
    'no_cooldown': ['cooldown_steps=0'],
    'warmup_4000': ['warmup_steps=4000'],
    'model_d256': ['model.num_encoder_layers=3', 'model.num_decoder_layers=3', 'model.d_model=256',
                   'model.d_ff=1024', 'learning_rate_schedule=paper', 'warmup_steps=500', 'num_train_steps=5800',
                   'cooldown_steps=5300'],
    'tokens_8192': ['tokens_per_batch=8192', 'num_train_steps=6000', 'cooldown_steps=3000', 'warmup_steps=1000'],
}

_CONFIG = flags.DEFINE_string('config', 'configs/multi30k_best.py', 'The recipe.')
_ROOT = flags.DEFINE_string('root', 'runs/ablation', 'One workdir per training variant under it.')
_MINUTES = flags.DEFINE_float('minutes', 0.0, 'Time budget per run (0: the config\'s max_train_minutes).')
_VARIANTS = flags.DEFINE_list('variants', list(TRAINING_VARIANTS), 'Training variants to run.')
_SPLIT = flags.DEFINE_string('split', None, 'Validation split (default: the config\'s eval_split).')


def train(name, overrides):
  workdir = os.path.join(_ROOT.value, name)
  extra = [f'--config.max_train_minutes={_MINUTES.value}'] if _MINUTES.value else []
  command = [sys.executable, '-m', 'flaxformer_nmt.train', '--config', _CONFIG.value, '--workdir', workdir,
             *extra, *(f'--config.{o}' for o in overrides)]
  print('$', ' '.join(command), flush=True)
  if subprocess.run(command, check=False).returncode != 0:
    sys.exit(f'error: training {name} failed')
  return workdir


def scores(translator, data, beam_size, alpha):
  sources, references, tok_references = data
  hypotheses = translator.translate(sources, beam_size=beam_size, alpha=alpha)
  bleu = sacrebleu.BLEU(lowercase=translator.lowercase).corpus_score(hypotheses, [references])
  tok = (f'{evaluate.tokenized_bleu(hypotheses, tok_references, translator.config.target_lang)[0]:.2f}'
         if tok_references is not None else '-')
  return f'{bleu.score:.2f} | {tok} | {bleu.sys_len / bleu.ref_len:.3f}'


def main(_):
  checkpoints_lib.quiet_orbax_logs()
  out = ['| training variant | overrides | valid sacreBLEU | valid lc-tok | length ratio |', '|---|---|---:|---:|---:|']
  recipe_dir, data = None, None
  for name in _VARIANTS.value:
    workdir = train(name, TRAINING_VARIANTS[name])
    recipe_dir = workdir if name == 'recipe' else recipe_dir
    config = workdir_lib.load_config(workdir)
    if data is None:
      _, *data = compare.sentences(config, _SPLIT.value)
    translator = decode.Translator(workdir, checkpoint='averaged')
    out.append(f'| {name} | {" ".join(TRAINING_VARIANTS[name]) or "-"} | '
               f'{scores(translator, data, config.beam_size, config.length_penalty_alpha)} |')
    print(out[-1], flush=True)
  if recipe_dir is not None:
    config = workdir_lib.load_config(recipe_dir)
    out += ['', '| decoding variant (recipe run) | valid sacreBLEU | valid lc-tok | length ratio |',
            '|---|---:|---:|---:|']
    for checkpoint in ('latest', 'best', f'last:{max(config.average_last_checkpoints // 2, 1)}', 'averaged'):
      translator = decode.Translator(recipe_dir, checkpoint=checkpoint)
      for beam_size in sorted({4, config.beam_size}):
        for alpha in sorted({0.6, config.length_penalty_alpha}):
          numbers = scores(translator, data, beam_size, alpha)
          out.append(f'| {checkpoint}, beam {beam_size}, alpha {alpha} | {numbers} |')
          print(out[-1], flush=True)
  epath.Path(_ROOT.value).mkdir(parents=True, exist_ok=True)
  (epath.Path(_ROOT.value) / 'ablation.md').write_text('\n'.join(out) + '\n')
  print('\n'.join(out))


if __name__ == '__main__':
  app.run(main)
