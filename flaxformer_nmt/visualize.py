r"""Attention pictures: translate sentences, then draw where the model looked.

  python -m flaxformer_nmt.visualize --workdir runs/m30k --output_dir attention \
      --sentences "A man in a blue shirt is standing on a ladder." [--input more.en] [--checkpoint averaged]

Each sentence is translated (beam search by default), then the model is run teacher-forced on (source,
translation) with the 'intermediates' collection mutable, which collects the softmax weights [B, H, Tq, Tk]
that every attention layer sows as `attention_weights`. Written per sentence i, as PNG heatmaps with the
sentencepiece pieces on both axes (padding cropped):

  {i:02d}_cross_layer{l}.png    encoder-decoder attention of decoder layer l, one panel per head
                                (rows: the target piece being predicted; columns: source pieces)
  {i:02d}_cross_average.png     the same averaged over heads, per layer, and over all layers
  {i:02d}_encoder_layer{l}.png  encoder self-attention of layer l, one panel per head

An ensemble's workdir (config.ensemble_members) is translated by the ensemble, and the weights drawn are its
first member's, run teacher-forced on that translation.

Language models (workdirs trained with config.task=lm or mlm) have self-attention only; each text is run
as it is (LM: BOS + the text, causal; MLM: the text with its <mask>s + EOS) and drawn per layer and head,
and averaged:

  {i:02d}_decoder_layer{l}.png / {i:02d}_encoder_layer{l}.png    self-attention of layer l (LM / MLM)
  {i:02d}_self_average.png                                       per layer and over all layers
"""
import importlib.util
import sys

from absl import app, flags

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation.attention import (attention_maps, self_attention_maps, write_pictures,
                                                 write_self_attention_pictures)
from flaxformer_nmt.models import lm
from flaxformer_nmt.runtime import cache
from flaxformer_nmt.runtime import flags as cli


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config.json, vocab.model, checkpoints/).')
  flags.DEFINE_multi_string('sentences', [], 'A source sentence (repeat the flag for more); for a language model '
                            '(config.task lm/mlm) the text to run (MLM: with <mask>s).')
  flags.DEFINE_string('input', None, 'A file of source sentences, one per line (empty lines skipped).')
  flags.DEFINE_string('output_dir', None, 'Where the PNGs go.')
  flags.DEFINE_string('checkpoint', None, f'{checkpoints_lib.CHECKPOINT_NAMES} (default: the config\'s '
                      'decode_checkpoint for a translation model, latest for a language model).')
  flags.DEFINE_integer('beam_size', None, 'Beam width for the translation (default: the config\'s); 0 is greedy.')
  flags.mark_flags_as_required(['workdir', 'output_dir'])


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if importlib.util.find_spec('matplotlib') is None:
    sys.exit('error: attention pictures need matplotlib: pip install "flaxformer_nmt[plot]"')
  if message := cli.unmakeable_directory('output_dir', FLAGS.output_dir):  # before any decoding
    sys.exit(message)
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()
  try:
    sentences = list(FLAGS.sentences)
    if FLAGS.input:
      sentences += [line for line in data_lib.read_lines(FLAGS.input) if line]
    if not sentences:
      raise ValueError('no sentences: pass --sentences or --input')
    if lm.task_of(workdir_lib.load_config(FLAGS.workdir)) != 'translation':
      maps = self_attention_maps(FLAGS.workdir, sentences, FLAGS.checkpoint or 'latest')
      for path in write_self_attention_pictures(maps, FLAGS.output_dir):
        print(path)
      return
    translator = decode.Translator(FLAGS.workdir, FLAGS.checkpoint)
    maps = attention_maps(translator, sentences, beam_size=FLAGS.beam_size)
    for m in maps:
      print(f'{m["source"]}\n-> {m["translation"]}')
    for path in write_pictures(maps, FLAGS.output_dir):
      print(path)
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
