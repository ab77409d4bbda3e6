r"""Our decoder beside its CTranslate2 export (float32 and int8) on the same weights: speed, BLEU, empty
lines and the share of lines identical to ours.

  python bench/ctranslate2_export.py --workdir runs/m30k --checkpoint averaged [--threads 2] [--max_sentences N] \
      [--dtype float32]

Exports the checkpoint with flaxformer_nmt.export (float32 and int8) into a temporary directory, then
translates Multi30k test2016 (`--input`, `--reference`, `--tok_reference`) with the config's beam size and
greedy search: ours (Translator with --dtype, default the config's, warmed up so compilation is excluded;
its row names the compute dtype and the matmul operands' precision the model runs with, e.g. bfloat16
operands where the config's matmul_precision is auto on a CPU with bf16 dot instructions) and CTranslate2
(`translate_batch` on the whole input with `max_batch_size` 64 sorted by length, `intra_threads=--threads`,
default every CPU, after a warm-up on the first 64 sentences; each of its measurements in a fresh process,
shared neither with our XLA threads nor with an earlier int8 translation). Our beam uses the config's
GNMT length penalty ((5 + n) / 6)^alpha; CTranslate2's closest is length_penalty=alpha on length^alpha: the
row "identical lines" measures how far apart that leaves the two. Timings are decoding only (tokenization
and detokenization excluded on both sides). Prints a Markdown table.
"""
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
from absl import app, flags

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.data.tokenizer import EOS_ID
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import bleu as evaluate
from flaxformer_nmt.runtime import cache
from flaxformer_nmt.serving import ctranslate2 as export

DATA = cache.cache_dir()  # where `python -m flaxformer_nmt.download` puts Multi30k


def define_flags():
  flags.DEFINE_string('workdir', None, 'Trained workdir.')
  flags.DEFINE_string('checkpoint', 'averaged', 'latest, averaged or a step.')
  flags.DEFINE_string('input', str(DATA / 'multi30k' / 'test2016.en'), 'Source sentences.')
  flags.DEFINE_string('reference', str(DATA / 'multi30k' / 'test2016.de'), 'Raw references (sacreBLEU).')
  flags.DEFINE_string('tok_reference', str(DATA / 'multi30k_tok' / 'test2016.de'), 'Tokenized references.')
  flags.DEFINE_integer('max_sentences', 0, 'Use the first N sentences (0: all).')
  flags.DEFINE_integer('threads', os.cpu_count(), 'CTranslate2 intra_threads (default: every CPU, as JAX uses).')
  flags.DEFINE_enum('dtype', None, list(decode.DTYPES), 'Ours: the compute dtype (default: the config\'s).')
  flags.mark_flags_as_required(['workdir'])


def ours(translator, token_lists, beam_size):
  """(pieces per line, seconds) of our decoder, compilation excluded."""
  translator.warm_up(token_lists, beam_size=beam_size)
  start = time.perf_counter()
  results = translator.search_tokens(token_lists, beam_size=beam_size)
  seconds = time.perf_counter() - start
  return [[t for t in hyps[0][0] if t != EOS_ID] for hyps in results], seconds


# One CTranslate2 measurement in a process of its own (job on stdin, results on stdout, as JSON): in one process,
# an int8 model's translation left CTranslate2 float32 greedy search 3.5x slower for the rest of the process.
THEIRS_SCRIPT = r"""
import json, sys, time, ctranslate2
job = json.load(sys.stdin)
translator = ctranslate2.Translator(job['model_dir'], device='cpu', compute_type=job['compute_type'], inter_threads=1,
                                    intra_threads=job['threads'])
translator.translate_batch(job['pieces'][:64], **job['options'])  # warm-up: allocations, thread pool
start = time.perf_counter()
results = translator.translate_batch(job['pieces'], **job['options'])
seconds = time.perf_counter() - start
json.dump({'hypotheses': [r.hypotheses[0] for r in results], 'seconds': seconds}, sys.stdout)
"""


def theirs(model_dir, compute_type, pieces, beam_size, alpha, threads, max_lengths):
  """(pieces per line, seconds) of CTranslate2, in a fresh process (THEIRS_SCRIPT); max_decoding_length is one
  per call, so the longest limit of the input (each line is then cut to its own limit, as ours would be)."""
  options = dict(beam_size=beam_size, length_penalty=alpha if beam_size > 1 else 1.0,
                 max_decoding_length=max(max_lengths), max_batch_size=64, batch_type='examples',
                 suppress_sequences=[['<pad>'], ['<s>']])
  job = dict(model_dir=str(model_dir), compute_type=compute_type, threads=threads, pieces=pieces, options=options)
  result = subprocess.run([sys.executable, '-c', THEIRS_SCRIPT], input=json.dumps(job), capture_output=True,
                          text=True, check=False)
  if result.returncode:
    raise RuntimeError(f'CTranslate2 {compute_type} failed ({result.returncode}):\n{result.stderr[-3000:]}')
  found = json.loads(result.stdout)
  return [h[:limit] for h, limit in zip(found['hypotheses'], max_lengths)], found['seconds']


def main(argv):
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  checkpoints_lib.quiet_orbax_logs()
  translator = decode.Translator(FLAGS.workdir, FLAGS.checkpoint, dtype=FLAGS.dtype)
  m = translator.model.config
  ours_name = f'ours (JAX, {m.dtype}, {m.matmul_precision} matmuls)'
  sp, c = translator.tokenizer.sp, translator.config
  sources = evaluate.read_text(FLAGS.input)
  references = evaluate.read_text(FLAGS.reference)
  tok_references = evaluate.read_text(FLAGS.tok_reference)
  if FLAGS.max_sentences:
    sources, references, tok_references = (x[:FLAGS.max_sentences] for x in (sources, references, tok_references))
  if not sources or not len(sources) == len(references) == len(tok_references):
    sys.exit(f'error: {FLAGS.input}, {FLAGS.reference}, {FLAGS.tok_reference}: {len(sources)}, {len(references)} '
             f'and {len(tok_references)} lines (at least one sentence, as many lines in each)')
  token_lists = translator.tokenizer.encode(translator.prepare(sources))
  pieces = [[sp.id_to_piece(t) for t in ids[:-1]] for ids in token_lists]
  max_lengths = [len(p) + c.max_decode_extra_length for p in pieces]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for quantization in ('float32', 'int8'):
      export.export_ctranslate2(FLAGS.workdir, f'{tmp}/{quantization}', FLAGS.checkpoint,
                                None if quantization == 'float32' else quantization)
    for mode, beam_size in ((f'beam {c.beam_size}', c.beam_size), ('greedy', 0)):
      reference_ids, seconds = ours(translator, token_lists, beam_size)
      systems = [(ours_name, reference_ids, seconds)]
      for quantization in ('float32', 'int8'):
        out, seconds = theirs(f'{tmp}/{quantization}', quantization, pieces, max(beam_size, 1),
                              c.length_penalty_alpha, FLAGS.threads, max_lengths)
        systems.append((f'CTranslate2 {quantization}', [[sp.piece_to_id(p) for p in h] for h in out], seconds))
      for name, ids, seconds in systems:
        text = [sp.decode(i) for i in ids]
        bleu, _ = evaluate.sacrebleu_score(text, references, translator.lowercase)
        tok_bleu, _ = evaluate.tokenized_bleu(text, tok_references, c.target_lang)
        same = sum(a == b for a, b in zip(ids, reference_ids)) / len(ids)
        rows.append(f'| {mode} | {name} | {len(ids) / seconds:.1f} | {bleu:.2f} | {tok_bleu:.2f} | '
                    f'{sum(not t.strip() for t in text)} | {100 * same:.1f}% |')
  print(f'{translator.checkpoint} of {FLAGS.workdir}; {len(sources)} sentences of {FLAGS.input}; '
        f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}, '
        f'CTranslate2 threads {FLAGS.threads}')
  print('| search | system | sentences/s | sacreBLEU | tok BLEU | empty lines | identical to ours |')
  print('|---|---|---:|---:|---:|---:|---:|')
  print('\n'.join(rows))


if __name__ == '__main__':
  define_flags()
  app.run(main)
