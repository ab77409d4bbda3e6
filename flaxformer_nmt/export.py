r"""Exports a trained workdir to CTranslate2 for serving, or as an Argos Translate package.

  python -m flaxformer_nmt.export --workdir runs/m30k --checkpoint averaged --format ctranslate2 \
      --output_dir m30k_ct2 [--quantization int8]
  python -m flaxformer_nmt.export --workdir runs/m30k --format argos --output_dir packages

--format argos writes {output_dir}/translate-SRC_TGT-1_0.argosmodel, the package Argos Translate and
LibreTranslate install (serving/argos.py): metadata.json, the CTranslate2 model in model/, sentencepiece.model.

writes a CTranslate2 model directory (model.bin, config.json, shared_vocabulary.json) built through
CTranslate2's own spec API, plus the sentencepiece model (`vocab.model`) and a README.md with the lines that
translate with it. The exported model computes the same function as ours:

- post-LN or pre-LN as the workdir's config says (pre-LN adds the final encoder/decoder LayerNorms);
- one embedding matrix for source, target and the output projection (no logit bias or scale), entering
  with the x sqrt(d_model) scale;
- our interleaved sin/cos position table, stored in the model (CTranslate2's built-in table concatenates
  the halves);
- EOS appended to every source, <s> (id 2) as the first decoder input, LayerNorm epsilon 1e-5;
- our fused projections: self-attention [d, 3d] (Q, K, V) and encoder-decoder K/V [d, 2d] are exactly
  CTranslate2's fused layouts once transposed (Flax kernels are [in, out], CTranslate2 weights [out, in]).

Quantization (`int8`, `int8_float32`, `float16`, ...) is applied by CTranslate2's converter code when
saving (the bfloat16 casts here, as that code does but without torch); any model can also be loaded with
another `compute_type`.
"""
import sys

from absl import app, flags, logging

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.runtime import flags as cli
from flaxformer_nmt.serving import argos
from flaxformer_nmt.serving.ctranslate2 import FORMATS, QUANTIZATIONS, export_ctranslate2


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config.json, vocab.model, checkpoints/).')
  flags.DEFINE_string('checkpoint', None, 'latest, averaged (see flaxformer_nmt.average), best, last:K or a step '
                      '(default: the config\'s decode_checkpoint).')
  flags.DEFINE_enum('format', 'ctranslate2', list(FORMATS) + ['argos'], 'Export format: a CTranslate2 model '
                    'directory, or an Argos Translate package (.argosmodel) written into --output_dir.')
  flags.DEFINE_string('output_dir', None, 'Directory for the exported model (created).')
  flags.DEFINE_string('package_version', '1.0', '--format argos: the package\'s version, numbers joined by '
                      'dots (in its name and metadata).')
  flags.DEFINE_enum('quantization', None, list(QUANTIZATIONS),
                    'Weight type of the saved model (default float32); CTranslate2 can still load it with '
                    'another compute_type.')
  flags.DEFINE_bool('force', False, 'Replace a non-empty --output_dir.')
  flags.mark_flags_as_required(['workdir', 'output_dir'])


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if message := cli.unmakeable_directory('output_dir', FLAGS.output_dir):  # before the checkpoint loads
    sys.exit(message)
  checkpoints_lib.quiet_orbax_logs()
  try:
    if FLAGS.format == 'argos':
      path, description = argos.export_argos(FLAGS.workdir, FLAGS.output_dir, FLAGS.checkpoint, FLAGS.quantization,
                                             FLAGS.force, FLAGS.package_version)
      logging.info('Exported %s of %s to %s (Argos Translate package, %s)', description, FLAGS.workdir, path,
                   FLAGS.quantization or 'float32')
      return
    description = export_ctranslate2(FLAGS.workdir, FLAGS.output_dir, FLAGS.checkpoint, FLAGS.quantization,
                                     FLAGS.force)
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')
  logging.info('Exported %s of %s to %s (CTranslate2, %s)', description, FLAGS.workdir, FLAGS.output_dir,
               FLAGS.quantization or 'float32')


if __name__ == '__main__':
  define_flags()
  app.run(main)
