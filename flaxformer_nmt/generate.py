r"""Text generation with a trained language model (a workdir trained with config.task=lm).

  python -m flaxformer_nmt.generate --workdir runs/lm_m30k --prompt "Ein Mann" --prompt "Zwei Hunde"
  python -m flaxformer_nmt.generate --workdir runs/lm_m30k --input prompts.txt --top_p=0.9 --num_samples=3
  echo "Eine Frau" | python -m flaxformer_nmt.generate --workdir runs/lm_m30k --greedy

Each prompt (an empty one generates unconditionally, from BOS alone) is continued token by token until EOS
or --max_new_tokens; one output line per sample, the prompt as given followed by the continuation (a space
between them where the continuation starts a new word), prompts in order and each prompt's samples together.
A prompt that with BOS and --max_new_tokens exceeds the model's positions is an error naming its --prompt or
input line, before anything is generated. Tokens are drawn from softmax(logits / temperature), restricted to the
--top_k most likely tokens and then to the smallest set whose probability reaches --top_p (the order of
Hugging Face's and nanoGPT's samplers); --greedy takes the most likely token. Sample j of prompt i depends
only on (--seed, i, j), whatever the batching.

Decoding runs the decoder one position at a time against its self-attention key/value cache (the prompt
too, one position per step, through the same loop as beam_search's greedy and sampled search); --nocache
reruns the whole prefix at every step instead (same tokens, to check and to measure the cache).

Python API:
  generator = Generator('runs/lm_m30k')
  generator.generate(['Ein Mann'], max_new_tokens=30, top_p=0.9, num_samples=2, seed=1)  # [[text, text]]
"""
import sys

from absl import app, flags, logging

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding.generator import Generator, check_options
from flaxformer_nmt.runtime import cache
from flaxformer_nmt.runtime import flags as cli


def define_flags():
  flags.DEFINE_string('workdir', None, 'Workdir of a language model (config.task=lm).')
  flags.DEFINE_multi_string('prompt', None, 'A prompt (repeatable). Without it, prompts are read from --input.')
  flags.DEFINE_string('input', '-', 'Prompts, one per line (- reads stdin), when no --prompt is given.')
  flags.DEFINE_string('checkpoint', 'latest', 'latest, averaged, best, last:K or a step.')
  flags.DEFINE_integer('max_new_tokens', 50, 'At most this many tokens after each prompt (fewer at EOS).')
  flags.DEFINE_bool('greedy', False, 'Take the most likely token at every step (no sampling).')
  flags.DEFINE_float('temperature', 1.0, 'Sample from softmax(logits / temperature).')
  flags.DEFINE_integer('top_k', 0, 'Sample only from the k most likely tokens (0: all).')
  flags.DEFINE_float('top_p', 1.0, 'Sample only from the smallest set of tokens with probability >= p (1: all).')
  flags.DEFINE_integer('num_samples', 1, 'Samples per prompt.')
  flags.DEFINE_integer('seed', 0, 'Random seed: sample j of prompt i depends only on it, i and j.')
  flags.DEFINE_bool('cache', True, 'Use the key/value cache (--nocache reruns the prefix every step).')
  flags.DEFINE_integer('prompts_per_batch', 64, 'Prompts generated together.')
  flags.mark_flags_as_required(['workdir'])


def check_lengths(generator, prompt_ids, max_new_tokens):
  """Before anything is generated: a ValueError naming the first prompt (its --prompt or its line of --input)
  that with BOS and --max_new_tokens does not fit the model's positions."""
  long = generator.too_long(prompt_ids, max_new_tokens)
  if long is None:
    return
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  where = (f'--prompt number {long + 1}' if FLAGS.prompt is not None
           else f'{"<stdin>" if FLAGS.input == "-" else FLAGS.input}:{long + 1}')
  raise ValueError(f'{where}: BOS + {len(prompt_ids[long])} prompt tokens + {max_new_tokens} new tokens '
                   f'(--max_new_tokens) exceed the model\'s {generator.config.model.max_position} positions')


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]} (prompts go in --prompt "...")')
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()
  if FLAGS.prompts_per_batch < 1:
    sys.exit(f'error: --prompts_per_batch={FLAGS.prompts_per_batch}: give at least 1')
  try:  # before the model loads or any prompt is read: an empty input checks them too
    check_options(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                  top_p=FLAGS.top_p, num_samples=FLAGS.num_samples, seed=FLAGS.seed)
  except ValueError as e:  # the flag's name on its message
    sys.exit(f'error: --{e}')
  try:  # before the model loads
    prompts = list(FLAGS.prompt) if FLAGS.prompt is not None else [
        line for chunk in data_lib.read_chunks(FLAGS.input, 1 << 30) for line in chunk]
  except OSError as e:  # missing, a directory, no permission
    sys.exit(f'error: --input {FLAGS.input}: {e.strerror or e}')
  except ValueError as e:  # a line that is not UTF-8, named
    sys.exit(f'error: {e}')
  try:
    generator = Generator(FLAGS.workdir, FLAGS.checkpoint)
    prompt_ids = generator.encode_prompt(prompts)
    check_lengths(generator, prompt_ids, FLAGS.max_new_tokens)
    logging.info('Generating from %s of %s', generator.checkpoint, FLAGS.workdir)
    options = dict(max_new_tokens=FLAGS.max_new_tokens, greedy=FLAGS.greedy, temperature=FLAGS.temperature,
                   top_k=FLAGS.top_k, top_p=FLAGS.top_p, num_samples=FLAGS.num_samples, seed=FLAGS.seed,
                   use_cache=FLAGS.cache)
    for start in range(0, len(prompts), FLAGS.prompts_per_batch):
      end = start + FLAGS.prompts_per_batch
      results = generator.generate_ids(prompt_ids[start:end], first_prompt=start, **options)
      for prompt, samples in zip(prompts[start:end], results):
        for ids in samples:
          print(generator.continued(prompt, ids), flush=True)
  except BrokenPipeError:  # a reader that stopped reading (`| head`)
    cli.exit_for_closed_stdout()
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
