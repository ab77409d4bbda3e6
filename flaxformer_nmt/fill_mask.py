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
Blank input lines are skipped. Every text is checked (a <mask>, at most the model's positions) before anything
is printed; an error names the argument or the input line.

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
from flaxformer_nmt.runtime import flags as cli


def define_flags():
  flags.DEFINE_string('workdir', None, 'Workdir of a masked language model (config.task=mlm).')
  flags.DEFINE_string('input', '-', f'Texts with {MASK}, one per line (- reads stdin), when none are arguments.')
  flags.DEFINE_string('checkpoint', 'latest', 'latest, averaged, best, last:K or a step.')
  flags.DEFINE_integer('top_k', 5, 'Candidates per mask.')
  flags.mark_flags_as_required(['workdir'])


def read_texts(argv, path):
  """(names, texts): the arguments (named argument 1, 2, ...), else the non-blank lines of --input (named
  file:line, counting every line)."""
  if argv[1:]:
    return [f'argument {i}' for i in range(1, len(argv))], list(argv[1:])
  name = '<stdin>' if path == '-' else path
  lines = [line for chunk in data_lib.read_chunks(path, 1 << 30) for line in chunk]
  numbered = [(f'{name}:{number}', line) for number, line in enumerate(lines, start=1) if line.strip()]
  return [name for name, _ in numbered], [line for _, line in numbered]


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()
  try:
    filler = FillMask(FLAGS.workdir, FLAGS.checkpoint)
    try:
      filler.check_top_k(FLAGS.top_k)
    except ValueError as e:  # the flag's name on its message
      sys.exit(f'error: --{e}')
    try:
      names, texts = read_texts(argv, FLAGS.input)
    except OSError as e:  # missing, a directory, no permission
      sys.exit(f'error: --input {FLAGS.input}: {e.strerror or e}')
    token_lists = filler.encode_checked(texts, names)  # every text checked before anything is printed
    for start in range(0, len(texts), 256):
      results = filler.fill_ids(texts[start:start + 256], token_lists[start:start + 256], top_k=FLAGS.top_k)
      for text, per_mask in zip(texts[start:start + 256], results):
        print('\n'.join(format_results(text, per_mask)), flush=True)
  except BrokenPipeError:  # a reader that stopped reading (`| head`)
    cli.exit_for_closed_stdout()
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
