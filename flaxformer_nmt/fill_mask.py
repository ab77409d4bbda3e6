r"""Fill-mask with a trained masked language model (a workdir trained with config.task=mlm).

  python -m flaxformer_nmt.fill_mask --workdir runs/mlm_m30k "Ein Mann <mask> ein Pferd ."
  python -m flaxformer_nmt.fill_mask --workdir runs/mlm_m30k --top_k=10 --input sentences.txt
  echo "Zwei <mask> spielen im Schnee ." | python -m flaxformer_nmt.fill_mask --workdir runs/mlm_m30k

Each `<mask>` stands for one sentencepiece piece (a word or the start of one), as in BERT. For every mask
of every text (texts from the arguments, else one per line of --input or stdin) it prints the top-k
pieces with their probabilities, and the text with that mask filled in, like Hugging Face's fill-mask
pipeline:

  Ein Mann <mask> ein Pferd .
    mask 1/1
      0.6123  reitet    Ein Mann reitet ein Pferd .

All masks of a text are predicted together, from the text as given (BERT's one-pass prediction).

Python API:
  filler = FillMask('runs/mlm_m30k')
  filler.fill(['Ein Mann <mask> ein Pferd .'], top_k=5)
  # [[[('reitet', 0.61, 'Ein Mann reitet ein Pferd .'), ...]]]: per text, per mask, (piece, prob, text)
"""
import sys

from absl import app, flags

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding.fill_mask import FillMask, MASK, format_results
from flaxformer_nmt.runtime import cache


def define_flags():
  flags.DEFINE_string('workdir', None, 'Workdir of a masked language model (config.task=mlm).')
  flags.DEFINE_string('input', '-', f'Texts with {MASK}, one per line (- reads stdin), when none are arguments.')
  flags.DEFINE_string('checkpoint', 'latest', 'latest, averaged or a step.')
  flags.DEFINE_integer('top_k', 5, 'Candidates per mask.')
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()
  try:
    filler = FillMask(FLAGS.workdir, FLAGS.checkpoint)
    read = data_lib.read_chunks
    texts = list(argv[1:]) or [line for chunk in read(FLAGS.input, 1 << 30) for line in chunk if line.strip()]
    for start in range(0, len(texts), 256):
      chunk = texts[start:start + 256]
      for text, per_mask in zip(chunk, filler.fill(chunk, top_k=FLAGS.top_k)):
        print('\n'.join(format_results(text, per_mask)), flush=True)
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
