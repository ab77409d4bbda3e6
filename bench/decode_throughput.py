r"""Decoding speed of a trained workdir beside CTranslate2 on its exported weights, as a user meets both: the
decode command from process start to its last line (cold, and with the compilation cache warm), CTranslate2 as
a whole process (import, load, translate), and the warm search inside one process; with the compiled programs.

  python bench/decode_throughput.py --workdir runs/m30k --checkpoint averaged \
      [--inputs $D/multi30k/test2016.en,newstest2015.en] [--threads 2]    # $D: the download cache

For every input and for beam search (the config's beam size and length penalty, or --beam_size) and greedy:
- `decode command`: `python -m flaxformer_nmt.decode` in a fresh process, first with an empty compilation cache
  (cold: everything compiles), then again on that cache (warm): wall seconds from process start to its output's
  last write (as CTranslate2's process is timed) and to its exit, peak RSS, and the programs it compiled or
  loaded (its own log line).
- `ctranslate2 process`: a fresh Python process that imports ctranslate2 and sentencepiece, loads the export
  (flaxformer_nmt.export, --compute_type), reads and prepares the input as the decode command does, translates
  it (beam size, length penalty alpha, max_decoding_length = longest source + max_decode_extra_length in one
  translate_batch call, each hypothesis then cut to its own source's pieces + max_decode_extra_length as ours
  is limited; intra_threads --threads, batches of --tokens_per_batch tokens, default the config's, sorted by
  length) and writes it (its seconds and peak RSS are up to then). Its OpenMP threads wait as the environment
  says (OMP_WAIT_POLICY; unset: the runtime's own, spinning a while), as a user's process runs, or as
  --omp_wait_policy sets: PASSIVE made its warm search 1.5x slower in beam search and 2.5x in greedy where
  nothing else loads the cores (test2016, 2-core EPYC), but helps it where other processes do (spinning threads
  made it 7x slower there: greedy test2016, 16.5 s against 2.4 s).
- `warm search`: Translator.search_tokens in this process after a pass that compiled its programs, against
  translate_batch again in the CTranslate2 process after its first pass (a process of its own: XLA's threads
  do not share its cores), the fastest of --repeats: sentences per second.
- Agreement of the written lines: greedy search is the same rule on both sides (identical lines expected but
  for float rounding); beam search is not: CTranslate2 divides log P by length^alpha, we by GNMT's
  ((5 + length) / 6)^alpha, so the share of identical lines measures how far apart that leaves them.
- Our search's work (a second table): the decoder row-steps its programs ran (sentences x beams x steps of each
  `begin` and `segment` call, padding rows and finished sentences still in a batch included; the segmented search
  of a CPU only) against those its translations needed (each sentence's beams for as many steps as its output has
  tokens, EOS included), the model FLOPs needed (runtime/flops.py's forward count: the encoder once over each
  source, attention over the positions so far) and their rate over the fastest warm pass, against a
  4096x1024x1024 matmul of the model's matmul operands timed in this process; this process's RSS once the model
  is loaded (the first line), after the first pass and after the warm passes.
The last lines are Markdown tables of all of it. On a machine without ctranslate2 its columns are left out.
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
from absl import app, flags
from etils import epath

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding import batch_search
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import cache
from flaxformer_nmt.runtime import flops as flops_lib
from flaxformer_nmt.runtime import host_memory

REPO = epath.Path(__file__).resolve().parent.parent
DATA = cache.cache_dir()  # where `python -m flaxformer_nmt.download` puts Multi30k
PROGRAMS_LINE = re.compile(r'Programs: (\d+) compiled, (\d+) loaded from the compilation cache, (\d+) loaded as '
                           r'saved executables \(([\d.]+) s\)')

# CTranslate2 as a user's script runs it: everything from the interpreter's start counts.
CT2_SCRIPT = r'''
import sys, time, ctranslate2, sentencepiece as spm
model_dir, source, output, beam, alpha, extra, threads, budget, compute_type, lowercase, repeats = sys.argv[1:]
sp = spm.SentencePieceProcessor(model_file=model_dir + '/vocab.model')
translator = ctranslate2.Translator(model_dir, device='cpu', compute_type=compute_type, inter_threads=1,
                                    intra_threads=int(threads))
lines = [' '.join(line.split()) for line in open(source, encoding='utf-8')]
lines = [line.lower() for line in lines] if lowercase == '1' else lines
pieces = [sp.encode(line, out_type=str) for line in lines]
nonempty = [i for i, p in enumerate(pieces) if p]
batch = [pieces[i] for i in nonempty]
options = dict(beam_size=int(beam), length_penalty=float(alpha), max_batch_size=int(budget), batch_type='tokens',
               max_decoding_length=max(map(len, pieces), default=0) + int(extra),
               suppress_sequences=[['<pad>'], ['<s>']])
results = translator.translate_batch(batch, **options)
out = [''] * len(lines)
for i, result in zip(nonempty, results):
  out[i] = sp.decode(result.hypotheses[0][:len(pieces[i]) + int(extra)])  # each line's own limit, as ours
open(output, 'w', encoding='utf-8').write(''.join(line + '\n' for line in out))
print('written at', time.time(), file=sys.stderr, flush=True)
# its peak RSS up to its output written, where the decode command's life ends (the warm passes may add)
print('peak RSS when written', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0], 'kB',
      file=sys.stderr, flush=True)
if int(repeats):  # the warm search: translate_batch again, after the pass above allocated its caches
  seconds = []
  for _ in range(int(repeats)):
    start = time.perf_counter()
    translator.translate_batch(batch, **options)
    seconds.append(time.perf_counter() - start)
  print('warm seconds', min(seconds), file=sys.stderr)
'''


def define_flags():
  flags.DEFINE_string('workdir', None, 'Trained workdir.')
  flags.DEFINE_string('checkpoint', 'latest', 'latest, averaged, best or a step.')
  flags.DEFINE_list('inputs', [str(DATA / 'multi30k' / 'test2016.en')],
                    'Source files (missing ones are skipped; default: test2016 of the download cache).')
  flags.DEFINE_integer('max_sentences', 0, 'Use the first N sentences of each input (0: all).')
  flags.DEFINE_integer('beam_size', None, 'Beam width (default: the config\'s).')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent, both sides (default: the config\'s).')
  flags.DEFINE_integer('repeats', 2, 'Warm passes of each search; the fastest is reported.', lower_bound=1)
  flags.DEFINE_integer('tokens_per_batch', None, 'Source tokens per batch, both sides (default: ours the decode '
                       'command\'s, CTranslate2 the config\'s decode_tokens_per_batch).')
  flags.DEFINE_integer('threads', os.cpu_count(), 'CTranslate2 intra_threads (XLA uses every core).')
  flags.DEFINE_string('compute_type', 'float32', 'CTranslate2\'s compute_type.')
  flags.DEFINE_enum('omp_wait_policy', None, ['ACTIVE', 'PASSIVE'], 'CTranslate2\'s OMP_WAIT_POLICY (default: '
                    'the environment\'s): PASSIVE where other processes load the cores.')
  flags.DEFINE_enum('dtype', None, list(decode.DTYPES), 'Ours: the decode command\'s --dtype (default: the '
                    'config\'s; float32 also keeps matmul operands float32 where the config rounds them to bfloat16).')
  flags.DEFINE_bool('processes', True, 'Also time the decode command and CTranslate2 as whole processes.')
  flags.mark_flags_as_required(['workdir'])


def run_process(command, env=None):
  """(wall seconds, peak RSS in MB, stderr) of a command run to its end, under /usr/bin/time (a child forked
  from this large process would count this process's pages in its peak); raises on failure."""
  start = time.perf_counter()
  result = subprocess.run(['/usr/bin/time', '-f', 'peak RSS %M KB'] + command, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
  seconds = time.perf_counter() - start
  if result.returncode:
    raise RuntimeError(f'{command[:3]} failed ({result.returncode}):\n{result.stderr[-3000:]}')
  return seconds, int(re.findall(r'peak RSS (\d+) KB', result.stderr)[-1]) / 1024, result.stderr


def export(workdir, checkpoint, directory, compute_type):
  """The workdir's CTranslate2 export (python -m flaxformer_nmt.export) in `directory`, or None without
  ctranslate2."""
  if importlib.util.find_spec('ctranslate2') is None:
    print('ctranslate2 is not installed: its columns are left out')
    return None
  quantization = [] if compute_type in ('float32', 'auto') else [f'--quantization={compute_type}']
  subprocess.run([sys.executable, '-m', 'flaxformer_nmt.export', f'--workdir={workdir}', f'--checkpoint={checkpoint}',
                  '--format=ctranslate2', f'--output_dir={directory}'] + quantization, check=True,
                 capture_output=True)
  return directory


def decode_command(FLAGS, source, output, beam_size, cache_dir):  # pylint: disable=invalid-name
  """The decode command on `source` as a user runs it: (seconds to its output's last write, MB, 'compiled/loaded
  programs, seconds', seconds to its exit)."""
  command = [sys.executable, '-m', 'flaxformer_nmt.decode', f'--workdir={FLAGS.workdir}',
             f'--checkpoint={FLAGS.checkpoint}', f'--input={source}', f'--output={output}', f'--beam_size={beam_size}']
  if FLAGS.alpha is not None:
    command.append(f'--alpha={FLAGS.alpha}')
  if FLAGS.dtype is not None:
    command.append(f'--dtype={FLAGS.dtype}')
  if FLAGS.tokens_per_batch:
    command.append(f'--tokens_per_batch={FLAGS.tokens_per_batch}')
  env = dict(os.environ, FLAXFORMER_NMT_CACHE=cache_dir)
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  launched = time.time()
  seconds, megabytes, log = run_process(command, env)
  found = PROGRAMS_LINE.search(log)
  programs = f'{found[1]} compiled, {int(found[2]) + int(found[3])} loaded, {float(found[4]):.1f} s' if found else '?'
  return os.stat(output).st_mtime - launched, megabytes, programs, seconds


def alpha_of(FLAGS, translator):  # pylint: disable=invalid-name
  return translator.config.length_penalty_alpha if FLAGS.alpha is None else FLAGS.alpha


def ctranslate2_process(FLAGS, translator, model_dir, source, output, beam_size,  # pylint: disable=invalid-name
                        repeats=0):
  """CTranslate2 as a whole process on `source`: (seconds from its launch to its output written, peak MB until
  then, its warm search's seconds: the fastest of `repeats` more passes in that process after the output is
  written; None without)."""
  c = translator.config
  alpha = alpha_of(FLAGS, translator) if beam_size > 1 else 1.0
  env = ctranslate2_env(FLAGS.omp_wait_policy)
  launched = time.time()
  _, _, log = run_process([sys.executable, '-c', CT2_SCRIPT, str(model_dir), source, output,
                           str(max(beam_size, 1)), str(alpha), str(c.max_decode_extra_length),
                           str(FLAGS.threads), str(FLAGS.tokens_per_batch or c.decode_tokens_per_batch),
                           FLAGS.compute_type, '1' if translator.lowercase else '0', str(repeats)], env)
  warm = re.search(r'warm seconds ([\d.e-]+)', log)
  # The process as a user's script: from its launch to its output written (the warm passes come after).
  seconds = float(re.search(r'written at ([\d.]+)', log)[1]) - launched
  megabytes = int(re.search(r'peak RSS when written (\d+) kB', log)[1]) / 1024
  return seconds, megabytes, float(warm[1]) if warm else None


def ctranslate2_env(policy):
  """The CTranslate2 process's environment: this process's, with OMP_WAIT_POLICY=`policy` where one is given."""
  return dict(os.environ, **({'OMP_WAIT_POLICY': policy} if policy else {}))


def warm_search(FLAGS, translator, sources, beam_size):  # pylint: disable=invalid-name
  """Our warm search in this process: {'ours': sentences per second (the fastest of --repeats passes after a
  first that compiled its programs), 'programs': those programs and their seconds, 'work': the row-steps and
  FLOPs that its first pass computed and needed (RowSteps, needed_work), 'rss': this process's MB after the
  first pass and after the others}."""
  token_lists = translator.tokenizer.encode(translator.prepare(sources))
  options = dict(beam_size=beam_size, tokens_per_batch=FLAGS.tokens_per_batch, scores=False, alpha=FLAGS.alpha)
  with cache.ProgramCounter() as first, RowSteps() as computed:
    start = time.perf_counter()
    results = translator.search_tokens(token_lists, **options)
    first_seconds = time.perf_counter() - start
  rss = [host_memory.resident_mb()]
  ours = min(timed(lambda: translator.search_tokens(token_lists, **options)) for _ in range(FLAGS.repeats))
  rss.append(host_memory.resident_mb())
  return {'ours': len(sources) / ours, 'rss': rss,
          'programs': f'{len(first.names)} ({first.seconds:.1f} s compiling; first pass {first_seconds:.1f} s)',
          'work': (computed.count, *needed_work(translator, token_lists, results, beam_size), ours)}


class RowSteps:
  """The decoder row-steps (a sentence's beams, one row in greedy search, times the steps) that the segmented
  search's `begin` and `segment` programs run while this is entered: batch_search's programs wrapped (the CPU's
  search; the device's, each batch in one program, is not counted)."""

  def __init__(self):
    self._counts = []  # one entry per program call: the search's threads append, never add to a shared total
    self._programs_for = batch_search._programs_for  # pylint: disable=protected-access

  def __enter__(self):
    counted = lambda options: self._counted(*self._programs_for(options))
    batch_search._programs_for = counted  # pylint: disable=protected-access
    return self

  def __exit__(self, *unused):
    batch_search._programs_for = self._programs_for  # pylint: disable=protected-access

  def _counted(self, begin, segment):
    def counted_begin(model, params, src, *args, **options):
      inputs, state, live = begin(model, params, src, *args, **options)
      self._counts.append(src.shape[0] * max(options.get('beam_size', 0), 1) * int(state.index))
      return inputs, state, live

    def counted_segment(model, params, inputs, state, *args, **options):
      start = int(state.index)
      state, live = segment(model, params, inputs, state, *args, **options)
      self._counts.append(inputs.src.shape[0] * max(options.get('beam_size', 0), 1) * (int(state.index) - start))
      return state, live
    return counted_begin, counted_segment

  @property
  def count(self):
    return sum(self._counts)


def needed_work(translator, token_lists, results, beam_size):
  """(row-steps, model FLOPs) that the translations found need: each sentence's beams (one row in greedy search)
  for as many steps as its output has tokens (EOS included), and the forward FLOPs of that
  (flops.forward_flops: the encoder once over the source, each step's attention over the positions so far)."""
  rows, steps, flops = max(beam_size, 1), 0, 0.0
  for source, hypotheses in zip(token_lists, results):
    n = len(hypotheses[0][0])
    if len(source) > 1 and n:
      steps += rows * n
      flops += flops_lib.forward_flops(translator.model.config, translator.tokenizer.vocab_size, len(source),
                                       rows * n, len(source), (n + 1) / 2)
  return steps, flops


def timed(function):
  start = time.perf_counter()
  function()
  return time.perf_counter() - start


def identical(path_a, path_b):
  a, b = epath.Path(path_a).read_text().splitlines(), epath.Path(path_b).read_text().splitlines()
  return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def cpu_description():
  """`lscpu`'s model name, and whether the CPU has bf16 dot instructions (AVX512-BF16 or AMX-BF16)."""
  try:
    name = re.search(r'^model name\s*:\s*(.+)$', epath.Path('/proc/cpuinfo').read_text(), re.M)[1]
  except (OSError, TypeError):
    name = 'CPU'
  bf16 = 'with' if model_lib.cpu_has_bfloat16_dot() else 'without'
  return f'{name}, {os.cpu_count()} cores, {bf16} bf16 dot instructions'


def bench_input(FLAGS, translator, model_dir, path, scratch):  # pylint: disable=invalid-name
  """The table rows of one input."""
  sources = data_lib.read_lines(path)
  if FLAGS.max_sentences:
    sources = sources[:FLAGS.max_sentences]
  source = os.path.join(scratch, epath.Path(path).name)
  epath.Path(source).write_text(''.join(s + '\n' for s in sources), encoding='utf-8')
  beam = translator.config.beam_size if FLAGS.beam_size is None else FLAGS.beam_size
  rows = []
  for name, beam_size in ((f'beam {beam}', beam), ('greedy', 0)):
    row = dict(input=f'{epath.Path(path).name} ({len(sources)})', search=name, theirs=None,
               **warm_search(FLAGS, translator, sources, beam_size))
    if model_dir is not None:
      theirs_output = os.path.join(scratch, f'theirs_{beam_size}.txt')
      *row['ct2'], warm = ctranslate2_process(FLAGS, translator, model_dir, source, theirs_output, beam_size,
                                              FLAGS.repeats)
      row['theirs'] = len(sources) / warm
    if FLAGS.processes:
      cache_dir = tempfile.mkdtemp(dir=scratch)
      output = os.path.join(scratch, f'ours_{beam_size}.txt')
      row['cold'] = decode_command(FLAGS, source, output, beam_size, cache_dir)
      row['warm'] = decode_command(FLAGS, source, output, beam_size, cache_dir)
      if model_dir is not None:
        row['identical'] = identical(output, theirs_output)
    print(row, flush=True)
    rows.append(row)
  return rows


def print_table(rows):
  print('\n| input | search | programs (first pass) | warm sentences/s | CTranslate2 warm sentences/s | time x CT2 '
        '| decode command cold: s to its last line / MB (programs) | warm cache: s / MB (programs) '
        '| CTranslate2 process s / MB | cold x CT2 | warm x CT2 | lines identical to CT2 |')
  print('|---|---|---|---:|---:|---:|---|---|---|---:|---:|---:|')
  for r in rows:
    ratio = f'{r["theirs"] / r["ours"]:.2f}' if r['theirs'] else '-'
    process = lambda key: (f'{r[key][0]:.1f} ({r[key][3]:.1f} to exit) / {r[key][1]:.0f} ({r[key][2]})'
                           if key in r else '-')
    ct2 = f'{r["ct2"][0]:.1f} / {r["ct2"][1]:.0f}' if 'ct2' in r else '-'
    against = lambda key: f'{r[key][0] / r["ct2"][0]:.2f}' if key in r and 'ct2' in r else '-'
    same = f'{100 * r["identical"]:.1f}%' if 'identical' in r else '-'
    print(f'| {r["input"]} | {r["search"]} | {r["programs"]} | {r["ours"]:.1f} | '
          f'{r["theirs"] or 0:.1f} | {ratio} | {process("cold")} | {process("warm")} | {ct2} | '
          f'{against("cold")} | {against("warm")} | {same} |')


def print_work_table(rows, matmul):
  """Our warm search's work: decoder row-steps computed (RowSteps) against needed, the model FLOPs needed and
  their rate over the fastest warm pass, against `matmul` (FLOP/s of a large matmul in the model's operands)."""
  print('\n| input | search | row-steps computed / needed | model GFLOP needed | effective GFLOP/s (x matmul) '
        '| our RSS MB after the first pass / after the warm passes |')
  print('|---|---|---|---:|---|---|')
  for r in rows:
    computed, needed, flops, seconds = r['work']
    ratio = f'{computed:,} / {needed:,} ({computed / needed:.2f}x)' if computed else f'- / {needed:,}'
    print(f'| {r["input"]} | {r["search"]} | {ratio} | {flops / 1e9:.1f} | {flops / seconds / 1e9:.1f} '
          f'({flops / seconds / matmul:.3f}) | {r["rss"][0]:.0f} / {r["rss"][1]:.0f} |')


def main(argv):
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  checkpoints_lib.quiet_orbax_logs()
  translator = decode.Translator(FLAGS.workdir, FLAGS.checkpoint, dtype=FLAGS.dtype)
  loaded = host_memory.resident_mb()
  with tempfile.TemporaryDirectory(prefix='decode_bench_') as scratch:  # the export and the cold caches
    run(FLAGS, translator, scratch, loaded)


def run(FLAGS, translator, scratch, loaded):  # pylint: disable=invalid-name
  """Exports the model into `scratch`, then measures every input and prints the tables (`loaded`: this
  process's RSS once the model was loaded)."""
  c = translator.config
  model_dir = export(FLAGS.workdir, FLAGS.checkpoint, os.path.join(scratch, 'ct2'), FLAGS.compute_type)
  operands = model_lib.vocabulary_operand_dtype(translator.model.config)  # bfloat16 in a bfloat16 model too
  matmul = flops_lib.matmul_rate(operands)
  print(f'{time.strftime("%Y-%m-%d %H:%M %Z")}; {cpu_description()}; jax {jax.__version__} '
        f'({jax.default_backend()}); {FLAGS.workdir} ({translator.checkpoint}); model dtype {c.model.dtype}, '
        f'matmul operands {operands.name}; beam length penalty alpha '
        f'{alpha_of(FLAGS, translator)}; tokens per batch: ours '
        f'{translator.ladder(FLAGS.tokens_per_batch).tokens_per_batch}, '
        f'CTranslate2 {FLAGS.tokens_per_batch or c.decode_tokens_per_batch}; '
        f'CTranslate2 {FLAGS.compute_type}, intra_threads {FLAGS.threads}, OMP_WAIT_POLICY '
        f'{ctranslate2_env(FLAGS.omp_wait_policy).get("OMP_WAIT_POLICY", "unset")}; a 4096x1024x1024 matmul of '
        f'{operands.name} operands {matmul / 1e9:.1f} GFLOP/s; our RSS with the model loaded {loaded:.0f} MB')
  rows = []
  for path in FLAGS.inputs:
    if not epath.Path(path).exists():
      print(f'skipped: {path} not found')
      continue
    rows += bench_input(FLAGS, translator, model_dir, path, scratch)
  print_table(rows)
  print_work_table(rows, matmul)


if __name__ == '__main__':
  define_flags()
  app.run(main)
