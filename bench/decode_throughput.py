r"""Decoding throughput of a trained workdir: sentences/s and target tokens/s, beam 4 and greedy, and in the
same run the speed-ups of the encoder-decoder key/value cache, the growing self-attention cache and
length-sorted batches; with --compare ctranslate2, CTranslate2 on the same weights in the same rounds.

  python bench/decode_throughput.py --workdir runs/m30k [--max_sentences 500] [--checkpoint averaged]
  python bench/decode_throughput.py --workdir runs/m30k --checkpoint averaged --compare ctranslate2 \
      --variants ours --inputs ../shared/data/multi30k/test2016.en [--threads 2] [--dtype float32] \
      [--compute_type int8]

Variants (same translations, different speed):
  ours            cross-attention keys/values once per sentence; a self-attention cache that starts with the
                  source's length and doubles when needed; batches sorted by length
  no_cross_cache  cross-attention keys/values projected again at every decoding step
  full_cache      the self-attention cache allocated at its full length (source + 50) from the first step
  no_sorting      batches filled in input order (same token budget, padded to their longest sentence)
  plain           cross-attention cache and sorting off
  ctranslate2     (--compare ctranslate2) the workdir exported by `python -m flaxformer_nmt.export` into a
                  temporary directory, decoded by ctranslate2.Translator (compute_type --compute_type, default
                  float32; intra_threads --threads, default all cores, as XLA uses; the same beam size, the same token
                  budget per batch, length_penalty alpha, max_decoding_length = longest source + 50): its
                  decoding time only (sentencepiece pieces in, pieces out); "outputs differing from ours"
                  counts lines whose tokens are not ours (CTranslate2 normalizes by length^alpha, we by
                  ((5 + n) / 6)^alpha, so some differ by design). The last column is our speed over its.
Every variant is warmed up first (Translator.warm_up runs the timed pass once, which compiles every batch
shape, also the smaller batches that finished sentences leave), so the timed pass excludes compilation; the
warm-up time (compilation plus one pass) is printed apart. With --repeats N the variants are timed
in N rounds and each keeps its fastest pass. Target tokens count the generated tokens with EOS; "tokens
per output" shows when a model stops early (a Multi30k model on news text mostly outputs EOS at once). Inputs
that are missing are skipped. The tables print as Markdown.
"""
import collections
import functools
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags
from etils import epath

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data.tokenizer import EOS_ID
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.decoding import search as search_lib

DATA = epath.Path(__file__).resolve().parent.parent.parent / 'shared' / 'data'
VARIANTS = {
    'ours': dict(cache_cross_kv=True, sort_by_length=True),
    'no_cross_cache': dict(cache_cross_kv=False, sort_by_length=True),
    'full_cache': dict(grow_cache=False),
    'no_sorting': dict(cache_cross_kv=True, sort_by_length=False),
    'plain': dict(cache_cross_kv=False, sort_by_length=False),
}
MODES = {'beam4': 4, 'greedy': 0}


def define_flags():
  flags.DEFINE_string('workdir', None, 'Trained workdir.')
  flags.DEFINE_string('checkpoint', 'latest', 'latest, averaged or a step.')
  flags.DEFINE_list('inputs', [str(DATA / 'multi30k' / 'test2016.en'), str(DATA / 'wmt_ende' / 'newstest2013.en')],
                    'Source files.')
  flags.DEFINE_integer('max_sentences', 0, 'Use the first N sentences of each input (0: all).')
  flags.DEFINE_list('modes', list(MODES), f'Of {list(MODES)}.')
  flags.DEFINE_list('variants', list(VARIANTS), f'Of {list(VARIANTS)}.')
  flags.DEFINE_integer('repeats', 1, 'Timed passes per variant (in rounds); the fastest is reported.')
  flags.DEFINE_integer('tokens_per_batch', None, 'Source tokens per batch (default: the config\'s).')
  flags.DEFINE_enum('compare', None, ['ctranslate2'], 'Also time CTranslate2 on the same weights, same rounds.')
  flags.DEFINE_integer('threads', os.cpu_count(), 'CTranslate2 intra_threads (XLA uses every core).')
  flags.DEFINE_enum('compute_type', 'float32', ['float32', 'int8', 'int8_float32', 'bfloat16', 'auto'],
                    'CTranslate2\'s compute_type (its CPU build has bfloat16 only where the CPU does).')
  flags.DEFINE_integer('devices', 1, 'Ours: decode.py\'s --devices (each batch split over N devices; on a CPU '
                       'host its CPU split into N; 0: every local device).')
  flags.DEFINE_enum('dtype', None, list(decode.DTYPES), 'Ours: decode.py\'s --dtype (default: the config\'s; '
                    'float32 also keeps matmul operands float32 where the config rounds them to bfloat16).')
  flags.mark_flags_as_required(['workdir'])


def loop_body_dots(translator, beam_size, cache_cross_kv, length=32):
  """Matrix products inside the compiled decoding loop's body (fusions included), from the optimized HLO: the
  per-step variant must show each decoder layer's two extra key/value projections."""
  search = jax.jit(functools.partial(search_lib.search, translator.model),
                   static_argnames=('beam_size', 'alpha', 'extra_length', 'cache_cross_kv', 'grow_cache'))
  src = np.full((8, length), 5, np.int32)
  hlo = search.lower(translator.params, src, beam_size=beam_size, alpha=0.6, extra_length=50,
                     cache_cross_kv=cache_cross_kv, grow_cache=False).compile().as_text()  # one loop
  computations, current = collections.defaultdict(list), None
  for line in hlo.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$', line)
    if header:
      current = header.group(1)
    elif current:
      computations[current].append(line)

  def dots(name, seen):
    if name in seen:
      return 0
    seen.add(name)
    count = 0
    for line in computations.get(name, []):
      count += bool(re.search(r'= \S+ dot\(', line))
      for callee in re.findall(r'(?:calls|body|condition|to_apply)=%?([\w.\-]+)', line):
        count += dots(callee, seen)
    return count
  return sum(dots(body, set()) for body in re.findall(r'body=%?([\w.\-]+)', hlo))


class CTranslate2Decoder:
  """The workdir exported by `python -m flaxformer_nmt.export` (this checkout's, in a subprocess) into a
  temporary directory and loaded by ctranslate2.Translator on the CPU with `compute_type`."""

  def __init__(self, workdir, checkpoint, threads, compute_type='float32'):
    import ctranslate2  # pylint: disable=import-outside-toplevel  (the `serve` extra)
    self.directory = tempfile.TemporaryDirectory(prefix='ct2_')
    output_dir = os.path.join(self.directory.name, 'model')
    root = str(epath.Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
    subprocess.run([sys.executable, '-m', 'flaxformer_nmt.export', f'--workdir={workdir}',
                    f'--checkpoint={checkpoint}', '--format=ctranslate2', f'--output_dir={output_dir}'],
                   check=True, env=env)
    self.translator = ctranslate2.Translator(output_dir, device='cpu', compute_type=compute_type, inter_threads=1,
                                             intra_threads=threads)

  def search_tokens(self, tokenizer, token_lists, beam_size, alpha, tokens_per_batch, extra_length):
    """Like Translator.search_tokens (best hypothesis only): [[(ids ending with EOS, score)]]."""
    sources = [tokenizer.pieces(ids[:-1]) for ids in token_lists]  # the exported model appends </s>
    nonempty = [i for i, pieces in enumerate(sources) if pieces]
    results = self.translator.translate_batch(
        [sources[i] for i in nonempty], max_batch_size=tokens_per_batch, batch_type='tokens',
        beam_size=max(beam_size, 1), length_penalty=alpha, suppress_sequences=[['<pad>'], ['<s>']],
        max_decoding_length=max(map(len, sources)) + extra_length + 1)
    outputs = [[([EOS_ID], 0.0)] for _ in sources]  # an empty source translates to an empty line
    for i, result in zip(nonempty, results):
      outputs[i] = [([tokenizer.sp.piece_to_id(p) for p in result.hypotheses[0]] + [EOS_ID], 0.0)]
    return outputs


def ctranslate2_version():
  import ctranslate2  # pylint: disable=import-outside-toplevel
  return ctranslate2.__version__


def cpu_name():
  try:
    names = re.findall(r'^model name\s*:\s*(.+)$', epath.Path('/proc/cpuinfo').read_text(), re.M)
  except OSError:
    names = []
  return f'{names[0] if names else platform.machine()}, {os.cpu_count()} cores visible'


def main(argv):
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  unknown = set(FLAGS.modes) - set(MODES) | set(FLAGS.variants) - set(VARIANTS)
  if unknown:
    raise app.UsageError(f'unknown modes or variants: {sorted(unknown)}')
  variants = ['ours'] + [v for v in FLAGS.variants if v != 'ours']  # the others are compared with it
  checkpoints_lib.quiet_orbax_logs()
  devices = sharding.local_devices(FLAGS.devices)  # before the first computation: it may split the CPU
  translator = decode.Translator(FLAGS.workdir, FLAGS.checkpoint, dtype=FLAGS.dtype, devices=devices)
  c = translator.config
  tokens_per_batch = FLAGS.tokens_per_batch or c.decode_tokens_per_batch
  if FLAGS.compare == 'ctranslate2':
    ct2 = CTranslate2Decoder(FLAGS.workdir, FLAGS.checkpoint, FLAGS.threads, FLAGS.compute_type)
    variants.append('ctranslate2')
    print(f'ctranslate2 {ctranslate2_version()} {FLAGS.compute_type}, intra_threads '
          f'{FLAGS.threads}; XLA: every core ({os.cpu_count()})')
  print(f'device: {jax.devices()[0].device_kind} x{jax.device_count()} ({jax.default_backend()}; ours searches '
        f'on {len(devices)}), '
        f'{cpu_name()}; jax {jax.__version__}; {FLAGS.workdir} '
        f'({translator.checkpoint}); model dtype {c.model.dtype}, matmul operands '
        f'{translator.models[0].config.matmul_precision}; '
        f'tokens_per_batch {tokens_per_batch}; '
        f'{time.strftime("%Y-%m-%d %H:%M")}')
  print(f'matrix products in the decoding loop body (beam 4): cached {loop_body_dots(translator, 4, True)}, '
        f'per step {loop_body_dots(translator, 4, False)}')
  rows = []
  for path in FLAGS.inputs:
    if not epath.Path(path).exists():
      print(f'skipped: {path} not found')
      continue
    sources = data_lib.read_lines(path)
    sources = sources[:FLAGS.max_sentences] if FLAGS.max_sentences else sources
    token_lists = translator.tokenizer.encode(translator.prepare(sources))
    for mode in FLAGS.modes:
      options = {v: dict(beam_size=MODES[mode], tokens_per_batch=FLAGS.tokens_per_batch, **VARIANTS.get(v, {}))
                 for v in variants}
      compile_seconds = {}

      def run(variant):
        if variant == 'ctranslate2':
          return ct2.search_tokens(translator.tokenizer, token_lists, MODES[mode], c.length_penalty_alpha,
                                   tokens_per_batch, c.max_decode_extra_length)
        return translator.search_tokens(token_lists, **options[variant])

      for variant in variants:
        start = time.perf_counter()
        if variant == 'ctranslate2':
          run(variant)  # a first pass: CTranslate2 allocates its caches
        else:
          translator.warm_up(token_lists, **options[variant])
        compile_seconds[variant] = time.perf_counter() - start
      # Rounds over the variants, keeping each one's fastest pass: load from other processes drifts, and
      # in rounds it falls on every variant alike.
      seconds, outputs = collections.defaultdict(list), {}
      for _ in range(FLAGS.repeats):
        for variant in variants:
          start = time.perf_counter()
          results = run(variant)
          seconds[variant].append(time.perf_counter() - start)
          outputs[variant] = [hyps[0][0] for hyps in results]
          print(f'{epath.Path(path).name} {mode} {variant}: {seconds[variant][-1]:.1f} s '
                f'(warm-up {compile_seconds[variant]:.1f} s)', flush=True)
      for variant in variants:
        best = min(seconds[variant])
        rows.append(dict(input=epath.Path(path).name, n=len(sources), mode=mode, variant=variant, seconds=best,
                         sentences=len(sources) / best, tokens=sum(map(len, outputs[variant])) / best,
                         length=sum(map(len, outputs[variant])) / len(sources),
                         differing=sum(a != b for a, b in zip(outputs[variant], outputs['ours']))))
  print_table(rows, FLAGS.repeats)


def print_table(rows, repeats):
  """The rows as a Markdown table, each variant beside ours on the same input and decoding, then CTranslate2's
  speed against ours in words."""
  print(f'\nfastest of {repeats} passes; target tokens include EOS\n')
  print('| input | sentences | decoding | variant | seconds | sentences/s | target tokens/s | tokens per output '
        '| ours is x faster | outputs differing from ours |')
  print('|---|---:|---|---|---:|---:|---:|---:|---:|---:|')
  ours_of = {(r['input'], r['mode']): r for r in rows if r['variant'] == 'ours'}  # the row each is compared with
  for row in rows:
    ours = ours_of[row['input'], row['mode']]
    print(f'| {row["input"]} | {row["n"]} | {row["mode"]} | {row["variant"]} | {row["seconds"]:.1f} | '
          f'{row["sentences"]:.1f} | {row["tokens"]:,.0f} | {row["length"]:.1f} | '
          f'{row["seconds"] / ours["seconds"]:.2f} | {row["differing"]} |')
  for row in rows:
    if row['variant'] == 'ctranslate2':
      ours = ours_of[row['input'], row['mode']]
      print(f'{row["input"]} {row["mode"]}: ours {ours["sentences"]:.1f} sentences/s, ctranslate2 '
            f'{row["sentences"]:.1f} sentences/s: ours takes {ours["seconds"] / row["seconds"]:.2f}x its time; '
            f'{100 * (1 - row["differing"] / row["n"]):.1f}% of lines identical')


if __name__ == '__main__':
  define_flags()
  app.run(main)
