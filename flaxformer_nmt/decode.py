r"""Translates with a trained workdir; scores with sacreBLEU when references are given.

  python -m flaxformer_nmt.decode --workdir runs/m30k --input test2016.en --output hyp.de --reference test2016.de
  cat sentences.en | python -m flaxformer_nmt.decode --workdir runs/m30k > out.de

One output line per input line, in input order; an empty input line gives an empty output line. Input is
read in chunks of --buffer_lines, so a long stream is translated as it arrives. Within a chunk, sentences
are sorted by length into batches of a fixed ladder of shapes (decoding/ladder.py): the programs compiled do
not depend on the input. On a CPU a batch decodes in segments and goes on with its unfinished sentences only
(as CTranslate2 and fairseq drop finished sentences); on GPU and TPU each batch searches in one program.
Compiled programs are kept in JAX's persistent cache (runtime/cache.py): a later run on this machine loads
them; --warmup compiles (or loads) all of the ladder's before the first line is read.

  --greedy | --beam_size=K | --sampling [--temperature=T --top_k=K --seed=S]
  --format=fairseq [--n_best=N]: S-i (source), H-i (score, sentencepiece pieces), D-i (score, text) lines
  --n_best=N --mbr=bleu|chrf: of N candidates (beams, or samples), the one that agrees most with the others
  --max_len_a=A --max_len_b=B: at most floor(A * source length + B) tokens before EOS (default 1, 50)
  --min_len=N: at least N tokens before EOS (default 1, as fairseq and CTranslate2: no empty outputs)
  --checkpoint=1700,1800 or --workdir=A,B: an ensemble (per-step average of the members' probabilities)
  --dtype=float32|bfloat16: compute dtype of decoding
  --devices=N: each batch's sentences split over N devices (data parallel; a CPU host's CPU split into N, one
  a core; 0: every local device)
  --warmup [--warmup_max_length=N]: compile every program of the ladder (for sources of up to N tokens) first

Python API:
  translator = Translator('runs/m30k')
  translator.translate(['A man is running.'], beam_size=4)
  translator.translate(['A man is running.'], sampling=True, top_k=10, seed=1)
"""
import contextlib
import gc
import itertools
import sys
import time

from absl import app, flags, logging
from etils import epath

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.tokenizer import EOS_ID
from flaxformer_nmt.decoding import mbr as mbr_lib
from flaxformer_nmt.decoding import rerank as rerank_lib
from flaxformer_nmt.decoding.search import MIN_LEN
from flaxformer_nmt.decoding.translator import DTYPES, Translator
from flaxformer_nmt.evaluation import bleu as evaluate
from flaxformer_nmt.runtime import cache
from flaxformer_nmt.runtime import flags as cli
from flaxformer_nmt.runtime import host_memory
from flaxformer_nmt.runtime import sharding


def fairseq_lines(line_number, source, hypotheses, tokenizer):
  """fairseq-generate's lines for one input: S-i source, then per hypothesis H-i score pieces and D-i score
  text (ids counted from 0 in input order; scores are natural-log, as `translate(return_scores=True)`)."""
  lines = [f'S-{line_number}\t{source}']
  for ids, score in hypotheses:
    lines.append(f'H-{line_number}\t{score:.4f}\t{" ".join(tokenizer.pieces(i for i in ids if i != EOS_ID))}')
    lines.append(f'D-{line_number}\t{score:.4f}\t{tokenizer.decode(ids)}')
  return lines


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config.json, vocab.model, checkpoints/); several, '
                      'comma-separated, with one vocabulary, decode as an ensemble.')
  flags.DEFINE_string('input', '-', 'Source sentences, one per line; - reads stdin.')
  flags.DEFINE_string('output', '-', 'Where translations go; - writes stdout.')
  flags.DEFINE_string('reference', None, 'Raw references: prints sacreBLEU (13a) and chrF, both case-insensitive '
                      'for a model of config.lowercase.')
  flags.DEFINE_string('tok_reference', None,
                      'Lowercased Moses-tokenized references: prints the paper-comparable BLEU.')
  flags.DEFINE_string('checkpoint', None, 'latest, averaged (see flaxformer_nmt.average), best (the best '
                      'validation checkpoint), last:K (the newest K averaged now) or a step; several, '
                      'comma-separated (1700,1800), decode as an ensemble (per-step average of probabilities). '
                      'Default: the config\'s decode_checkpoint (latest unless the config chose another).')
  flags.DEFINE_float('max_len_a', None, 'Output at most max_len_a * source length + max_len_b tokens before EOS '
                     '(default 1, as the paper).')
  flags.DEFINE_integer('max_len_b', None, 'See max_len_a (default: the config\'s max_decode_extra_length, 50).')
  flags.DEFINE_integer('min_len', MIN_LEN, 'At least this many tokens before EOS (fairseq\'s --min-len, CTranslate2\'s '
                       'min_decoding_length): 1 means no empty translation of a non-empty line; 0 allows EOS first.')
  flags.DEFINE_enum('dtype', None, list(DTYPES), 'Compute dtype for decoding (default: the config\'s, auto = '
                    'bfloat16 on GPU/TPU, float32 on CPU); float32 also keeps the matmul operands float32 where '
                    'the config rounds them to bfloat16 (config.model.matmul_precision).')
  flags.DEFINE_integer('beam_size', None, 'Beam width (default: the config\'s); 0 is greedy.', lower_bound=0)
  flags.DEFINE_bool('greedy', False, 'Greedy decoding (same as --beam_size=0).')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent (default: the config\'s).')
  flags.DEFINE_bool('sampling', False, 'Sample translations from the model instead of searching.')
  flags.DEFINE_float('temperature', 1.0, 'Sampling: draw from softmax(logits / temperature).')
  flags.DEFINE_integer('top_k', 0, 'Sampling: only from the k most likely tokens (0: all).')
  flags.DEFINE_integer('seed', 0, 'Sampling: random seed (a line\'s samples depend only on it and the line).')
  flags.DEFINE_integer('n_best', 1, 'Hypotheses per input (beams, or samples); more than 1 needs --format=fairseq '
                       'or --mbr.')
  flags.DEFINE_enum('mbr', None, list(mbr_lib.UTILITIES), 'Minimum Bayes risk (mbr.py): write the one of the '
                    '--n_best candidates (beams, or samples) that agrees most with the others by this sentence '
                    'metric, instead of the best-scored.')
  flags.DEFINE_string('rerank_workdir', None, 'A second model (often right to left: config.target_right_to_left, '
                      'same vocabulary) that rescores each line\'s beam candidates; the line gets the best of '
                      '(1 - w) search score + w rescorer score (rerank.py).')
  flags.DEFINE_string('rerank_checkpoint', None, 'The rescorer\'s checkpoint(s), as --checkpoint (default: its '
                      'config\'s).')
  flags.DEFINE_float('rerank_weight', 0.5, 'w of --rerank_workdir, from 0 (the search alone) to 1 (the rescorer '
                     'alone).')
  flags.DEFINE_enum('format', 'plain', ['plain', 'fairseq'],
                    'plain: one translation per input line. fairseq: S-i, H-i (score, pieces), D-i (score, text).')
  flags.DEFINE_integer('tokens_per_batch', None, 'Source tokens per batch (default: the config\'s '
                       'decode_tokens_per_batch, on a CPU at most 512).', lower_bound=1)
  flags.DEFINE_integer('buffer_lines', 5000, 'Lines read and translated at a time.', lower_bound=1)
  flags.DEFINE_integer('devices', 1, 'Devices to split each batch\'s sentences over (data parallel, the parameters '
                       'replicated on each): 1 the default device, N the first N local devices (a CPU host\'s CPU '
                       'split into N devices, one a core), 0 every local device.')
  flags.DEFINE_bool('batch_invariant', False, 'Each line\'s translation and score independent of the other lines '
                    'it is batched with, as the server\'s --batch_invariant answers (a CPU with bf16 dot, bfloat16 '
                    'matmul operands); about 20% fewer sentences/s in beam search.')
  flags.DEFINE_bool('warmup', False, 'Compile (or load from the compilation cache) every program the search may '
                    'run before reading the input, and log their count and time.')
  flags.DEFINE_integer('warmup_max_length', None, '--warmup: for sources of up to this many tokens (default: as '
                       'long as the model takes).')
  flags.mark_flags_as_required(['workdir'])


def check_flag_combinations(FLAGS):  # pylint: disable=invalid-name
  """app.UsageError for flags that cannot go together."""
  if FLAGS.mbr and (FLAGS.n_best < 2 or FLAGS.format != 'plain'):
    raise app.UsageError('--mbr writes one chosen translation per line of --n_best >= 2 candidates: give --n_best '
                         'and --format=plain')
  if FLAGS.rerank_workdir and (FLAGS.mbr or FLAGS.sampling or FLAGS.greedy or FLAGS.beam_size == 0
                               or FLAGS.n_best > 1 or FLAGS.format != 'plain'):
    raise app.UsageError('--rerank_workdir writes one chosen translation per line of the beam\'s candidates: '
                         'not with --mbr, --sampling, greedy search, --n_best or --format=fairseq')
  if FLAGS.batch_invariant and FLAGS.rerank_workdir:
    raise app.UsageError('--batch_invariant covers the search, not --rerank_workdir\'s rescoring: not together')
  if FLAGS.greedy and FLAGS.beam_size:
    raise app.UsageError(f'--greedy and --beam_size={FLAGS.beam_size} ask for two searches: give one')
  if FLAGS.tok_reference and not FLAGS.reference:
    raise app.UsageError('--tok_reference scores alongside --reference: give both')
  if FLAGS.n_best > 1 and FLAGS.format == 'plain' and not FLAGS.mbr:
    raise app.UsageError('--n_best > 1 gives several lines per input: use --format=fairseq (or choose one: --mbr)')


def describe_method(FLAGS, beam_size, rescorer):  # pylint: disable=invalid-name
  """How the command translates, for its log line (beam_size 0: greedy)."""
  if FLAGS.sampling:
    method = f'sampling (temperature {FLAGS.temperature}, top-k {FLAGS.top_k or "off"}, seed {FLAGS.seed})'
  else:
    method = 'greedy' if beam_size == 0 else f'beam {beam_size}'
  if FLAGS.mbr:
    method += f', MBR by sentence {FLAGS.mbr} among {FLAGS.n_best} candidates'
  if rescorer is not None:
    method += (f', its candidates reranked with {rescorer.checkpoint} of {FLAGS.rerank_workdir} '
               f'(weight {FLAGS.rerank_weight:g})')
  return method


def choose_candidates(FLAGS, translator, rescorer, token_lists, results, texts):  # pylint: disable=invalid-name
  """Each line's written candidate: the rescorer's choice (rerank.py), MBR's (mbr.py), or the search's best."""
  if rescorer is not None:
    alpha = translator.config.length_penalty_alpha if FLAGS.alpha is None else FLAGS.alpha
    return rerank_lib.Reranker(rescorer, token_lists, results, alpha).choose(FLAGS.rerank_weight)
  return [mbr_lib.select(t, FLAGS.mbr) if FLAGS.mbr else 0 for t in texts]


def describe_programs(counter):
  """What a cache.ProgramCounter counted, for the log."""
  return (f'{counter.compiled} compiled, {counter.loaded} loaded from the compilation cache, '
          f'{counter.executables} loaded as saved executables')


def warm_up(translator, options, max_length):
  """Compiles the ladder's programs for these options (Translator.warm_up_ladder) and logs what it took."""
  start, counter = time.time(), cache.ProgramCounter()
  with counter:
    programs = translator.warm_up_ladder(max_length, **options)
  logging.info('Warm-up: %d search programs (%s) in %.1f s', programs, describe_programs(counter),
               time.time() - start)


def open_files(FLAGS):  # pylint: disable=invalid-name
  """(the input's chunks, the output stream): the input opened and its first chunk read first, so that a missing
  one, one with a bad line there, or one that is also --output, stops the command before the output file is
  emptied."""
  if FLAGS.output != '-' and FLAGS.input != '-' and (
      epath.Path(FLAGS.output).resolve() == epath.Path(FLAGS.input).resolve()):
    sys.exit(f'error: --output {FLAGS.output} is the --input file: writing would empty it first')
  try:
    chunks = data_lib.read_chunks(FLAGS.input, FLAGS.buffer_lines)
    first = next(chunks, None)
  except OSError as e:  # missing, a directory, no permission
    sys.exit(f'error: --input {FLAGS.input}: {e.strerror or e}')
  except ValueError as e:  # a line that is not UTF-8, named
    sys.exit(f'error: {e}')
  chunks = itertools.chain([] if first is None else [first], chunks)
  try:
    return chunks, sys.stdout if FLAGS.output == '-' else epath.Path(FLAGS.output).open('w', encoding='utf-8')
  except OSError as e:  # a directory, under a file, no permission
    sys.exit(f'error: --output {FLAGS.output}: {e.strerror or e}')


def write_output(FLAGS, out, text):  # pylint: disable=invalid-name
  """Writes `text` to the output and flushes it. A failed write (a full disk) stops the command with a line naming
  the output; a reader of stdout that stopped reading (`| head`), quietly."""
  try:
    out.write(text)
    out.flush()
  except OSError as e:
    if out is not sys.stdout:
      sys.exit(f'error: {FLAGS.output}: {e}')
    if isinstance(e, BrokenPipeError):
      cli.exit_for_closed_stdout()
    sys.exit(f'error: <stdout>: {e}')


def translate_input(FLAGS, translator, rescorer, options, chunks, out):  # pylint: disable=invalid-name
  """Translates the input's chunks (--buffer_lines lines each) into `out`, logging the pace; returns the
  written translations where --reference will score them."""
  hypotheses, done, target_tokens, start = [], 0, 0, time.time()
  for chunk in chunks:
    chunk = translator.prepare(chunk)
    # Cut to the model's positions here (the search would), so that a rescorer reads what the search read.
    token_lists = translator.fit_to_positions(translator.tokenizer.encode(chunk), first_line=done)
    results = translator.search_tokens(token_lists, first_line=done, **options)
    texts = [[translator.tokenizer.decode(ids) for ids, _ in hyps] for hyps in results]
    chosen = choose_candidates(FLAGS, translator, rescorer, token_lists, results, texts)
    best = [t[i] for t, i in zip(texts, chosen)]
    if FLAGS.format == 'fairseq':
      lines = [line for i, (source, hyps) in enumerate(zip(chunk, results))
               for line in fairseq_lines(done + i, source, hyps, translator.tokenizer)]
    else:
      lines = best
    write_output(FLAGS, out, ''.join(line + '\n' for line in lines))
    hypotheses += best if FLAGS.reference else []
    done += len(chunk)
    target_tokens += sum(len(hyps[i][0]) for hyps, i in zip(results, chosen))  # the written translations
    seconds = time.time() - start
    logging.info('%d sentences, %.1f sentences/s, %.0f target tokens/s', done, done / seconds,
                 target_tokens / seconds)
  return hypotheses


def read_references(FLAGS):  # pylint: disable=invalid-name
  """(--reference's lines, --tok_reference's or None), read before anything is translated: a missing or bad file,
  references of two counts and, where --input is a file, a count of lines other than the input's stop the command
  first; None without --reference."""
  if not FLAGS.reference:
    return None
  lines = {}
  for flag in ('reference', 'tok_reference'):
    path = FLAGS[flag].value
    try:
      lines[flag] = evaluate.read_named(f'--{flag}', path) if path else None
    except (OSError, ValueError) as e:
      sys.exit(f'error: {e}')
  if lines['tok_reference'] is not None and len(lines['tok_reference']) != len(lines['reference']):
    sys.exit(f'error: --tok_reference {FLAGS.tok_reference} has {len(lines["tok_reference"])} lines but --reference '
             f'{FLAGS.reference} has {len(lines["reference"])}')
  if FLAGS.input != '-':
    try:
      with epath.Path(FLAGS.input).open('rb') as f:
        count = sum(1 for _ in f)
    except OSError as e:
      sys.exit(f'error: --input {FLAGS.input}: {e.strerror or e}')
    for flag, text in lines.items():
      if text is not None and len(text) != count:
        sys.exit(f'error: --{flag} {FLAGS[flag].value} has {len(text)} lines but --input {FLAGS.input} has {count}')
  return lines['reference'], lines['tok_reference']


def score_against_reference(FLAGS, translator, hypotheses, references, stream):  # pylint: disable=invalid-name
  """Prints the written translations' scores against (--reference's, --tok_reference's) lines to `stream`."""
  try:
    lines, _ = evaluate.report(hypotheses, *references, translator.config.target_lang,
                               lowercase=translator.lowercase)
  except ValueError as e:
    sys.exit(f'error: --reference {FLAGS.reference}: {e}')
  print('\n'.join(lines), file=stream)


def load_translators(FLAGS):  # pylint: disable=invalid-name
  """(the devices, the Translator, the --rerank_workdir's Translator or None); a workdir that cannot be loaded
  stops the command with one line."""
  try:
    devices = sharding.local_devices(FLAGS.devices)  # before the first computation: it may split the CPU
    translator = Translator(FLAGS.workdir, FLAGS.checkpoint, dtype=FLAGS.dtype, devices=devices,
                            batch_invariant=FLAGS.batch_invariant)
    rescorer = None
    if FLAGS.rerank_workdir:
      rerank_lib.check_weight(FLAGS.rerank_weight)
      # The rescorer teacher-forces on the default device (rerank.score_pairs batches for one device).
      rescorer = Translator(FLAGS.rerank_workdir, FLAGS.rerank_checkpoint, dtype=FLAGS.dtype)
      rerank_lib.check_partners(translator, rescorer)
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')
  return devices, translator, rescorer


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  check_flag_combinations(FLAGS)
  host_memory.few_malloc_arenas()  # before the first computation starts XLA's threads (host_memory.py)
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()
  devices, translator, rescorer = load_translators(FLAGS)
  beam_size = 0 if FLAGS.greedy else FLAGS.beam_size
  method = describe_method(FLAGS, translator.config.beam_size if beam_size is None else beam_size, rescorer)
  logging.info('Translating with %s of %s (%s) on %d %s device%s', translator.checkpoint, FLAGS.workdir, method,
               len(devices), devices[0].platform, 's' * (len(devices) > 1))
  options = dict(beam_size=beam_size, alpha=FLAGS.alpha, n_best=FLAGS.n_best,
                 tokens_per_batch=FLAGS.tokens_per_batch, max_len_a=FLAGS.max_len_a, max_len_b=FLAGS.max_len_b,
                 min_len=FLAGS.min_len)
  if FLAGS.sampling:
    options.update(sampling=True, temperature=FLAGS.temperature, top_k=FLAGS.top_k, seed=FLAGS.seed)
  if rescorer is not None:  # every beam's candidate
    options['n_best'] = FLAGS.beam_size or translator.config.beam_size
  # Scores are written (fairseq lines) or read (reranking); greedy search skips them otherwise.
  options['scores'] = FLAGS.format == 'fairseq' or rescorer is not None
  try:  # bad option values stop before the output file is opened
    translator.check_options(**options)
  except ValueError as e:
    sys.exit(f'error: {e}')
  references = read_references(FLAGS)
  if FLAGS.warmup:
    warm_up(translator, options, FLAGS.warmup_max_length)
  chunks, out = open_files(FLAGS)
  counter = cache.ProgramCounter()
  try:
    with counter:
      hypotheses = translate_input(FLAGS, translator, rescorer, options, chunks, out)
  except OSError as e:
    sys.exit(f'error: {FLAGS.input}: {e}')
  except ValueError as e:  # bad input (the message names the line) or bad option values
    sys.exit(f'error: {e}')
  finally:
    if out is not sys.stdout:
      with contextlib.suppress(OSError):  # after a failed write, closing flushes what failed again
        out.close()
  logging.info('Programs: %s (%.1f s)', describe_programs(counter), counter.seconds)
  if FLAGS.reference:
    score_against_reference(FLAGS, translator, hypotheses, references,
                            sys.stderr if out is sys.stdout else sys.stdout)
  # The interpreter's shutdown runs the collector over jax's and XLA's objects again and again (0.2 s of a 6.5 s
  # decode of 1,000 sentences on 2 CPU cores); frozen, they are skipped, and still freed.
  gc.freeze()


if __name__ == '__main__':
  define_flags()
  app.run(main)
