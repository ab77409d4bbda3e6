r"""Load on the translation server (python -m flaxformer_nmt.serve): throughput, latency, batching, refusals.

  python bench/serve_load.py --workdir runs/m30k --sentences test2016.en [--clients 1,8,32,128] \
      [--duration_s 30] [--overload] [--kill_test] [--server_flag=--max_batch_tokens=2048 ...]

Starts the server on 127.0.0.1 (or loads --url, a server already running), waits for /ready, then:

1. closed loop: for each client count C, C clients (httpx, asyncio) each send one sentence per request, the
   next as soon as the last is answered, for --duration_s; prints sentences/s, p50/p95/p99 latency, the
   batch sizes the server formed (its /metrics) and the answers by status;
2. --overload: requests are scheduled at 4x the best sustained rate (open loop) for --duration_s; every answer
   must be a 200 or a 503 with Retry-After, none may hang past --client_timeout_s, and the server's memory (RSS)
   is reported before and after. target_per_second is the scheduled rate, offered_per_second the requests the
   clients actually sent per second (a warning is printed when it is more than 10% below the target), and each
   request's latency runs from its scheduled time (start + i / rate), so a client that falls behind shows as
   latency rather than as a lower rate; from_send gives the latencies from the moment each request was handed to
   its client (the server's share, with the client's own delays in reading the answer), and server_side_mean_s
   the server's own mean time for a /v1/translate request;
3. --kill_test: under 32 clients, the server is killed with SIGKILL; the clients must see connection errors,
   never a wrong translation; sentences/s is the rate up to the kill, and the server is started again and the
   time to /ready and to its first answer is reported.

Latency percentiles are over the 200 answers; a step with none reports them as null ('-' when printed).

Every 200 answer is compared with the offline decode of the same sentence (python -m flaxformer_nmt.decode on
the same workdir, checkpoint and decode options, or --expected): a server that answers, answers right. The
offline decode gets the server flags that change translations (DECODE_FLAGS) and runs at each start (seconds), so
that it is of the checkpoint and code the server runs now. With --batch_invariant both
decode batch-invariantly, and every 200 must equal its offline line whatever the batches.
"""
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from absl import app, flags

from flaxformer_nmt.runtime import host_memory

OPEN_LOOP_PROCESSES = 4  # the arrivals of --overload, spread so that no client process falls behind
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE_FLAGS = ('--dtype', '--batch_invariant', '--nobatch_invariant', '--checkpoint')  # server flags decode shares
SHORTFALL_WARNING = 0.10  # --overload warns when the clients sent this much less than the target rate


def define_flags():
  flags.DEFINE_string('workdir', None, 'Trained workdir to serve (and to decode offline for the reference).')
  flags.DEFINE_string('checkpoint', None, 'The checkpoint served and decoded offline (default: the config\'s).')
  flags.DEFINE_string('sentences', None, 'Source sentences, one per line.')
  flags.DEFINE_string('expected', None, 'The offline translations of --sentences (default: decoded now).')
  flags.DEFINE_string('url', None, 'A running server to load instead of starting one (no --kill_test).')
  flags.DEFINE_list('clients', ['1', '8', '32', '128'], 'Concurrent client counts.')
  flags.DEFINE_float('duration_s', 30.0, 'Seconds of load per step.')
  flags.DEFINE_integer('clients_per_process', 32, 'Clients per load process: one asyncio process of httpx clients '
                       'falls behind at about 64 (measured: 128 in one process sent half of what 2 x 64 did).')
  flags.DEFINE_float('client_timeout_s', 60.0, 'A request not answered by then counts as hung.')
  flags.DEFINE_bool('overload', False, 'Also: open-loop arrivals at 4x the best sustained rate.')
  flags.DEFINE_bool('kill_test', False, 'Also: SIGKILL the server under load and start it again.')
  flags.DEFINE_bool('batch_invariant', False, 'Serve and decode offline with --batch_invariant: every 200 must then '
                    'equal the offline translation exactly, whatever the batches.')
  flags.DEFINE_multi_string('server_flag', [], 'A flag for the server (repeatable), e.g. --max_wait_ms=5.')
  flags.DEFINE_string('output', None, 'Also write the results as JSON here.')
  flags.mark_flags_as_required(['sentences'])


@dataclasses.dataclass
class Tally:
  """What the clients of one step saw."""
  latencies: list = dataclasses.field(default_factory=list)
  from_send: list = dataclasses.field(default_factory=list)  # the same answers' latencies from their send
  statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  wrong: int = 0
  wrong_examples: dict = dataclasses.field(default_factory=dict)  # sentence index -> the answer
  missing_retry_after: int = 0
  sentences: int = 0
  sent: int = 0  # requests sent (open loop)

  def summary(self, seconds):
    return {'sentences_per_second': round(self.sentences / seconds, 2), **percentiles(self.latencies),
            'statuses': {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
            'wrong_translations': self.wrong, 'wrong_lines': sorted(i + 1 for i in self.wrong_examples),
            '503_without_retry_after': self.missing_retry_after}


def percentiles(latencies):
  """{'p50_s', 'p95_s', 'p99_s'} of the latencies in seconds; None each where there are none."""
  if not latencies:
    return {'p50_s': None, 'p95_s': None, 'p99_s': None}
  return {f'p{q}_s': round(float(np.percentile(latencies, q)), 3) for q in (50, 95, 99)}


def offered_rate(sent, seconds, target):
  """(requests sent per second, True where that is more than SHORTFALL_WARNING below the target rate)."""
  achieved = sent / seconds if seconds > 0 else 0.0
  return achieved, achieved < (1 - SHORTFALL_WARNING) * target


def printable(result):
  """The result as a JSON line, its null latency percentiles (also in nested dicts) written '-'."""
  def dashes(d):
    return {k: dashes(v) if isinstance(v, dict) else '-' if v is None and k in ('p50_s', 'p95_s', 'p99_s') else v
            for k, v in d.items()}
  return json.dumps(dashes(result))


async def one_request(client, url, index, sentences, expected, tally, start=None):
  """POSTs sentence `index`; records the status (or the error's name) and checks a 200 answer. Its latency runs
  from `start` (a perf_counter time: when it was due) or else from now; tally.from_send's from now."""
  sent_at = time.perf_counter()
  start = sent_at if start is None else start
  try:
    answer = await client.post(f'{url}/v1/translate', json={'text': [sentences[index]]})
  except httpx.TimeoutException:
    tally.statuses['hung (client timeout)'] += 1
    return
  except httpx.TransportError as e:
    tally.statuses[type(e).__name__] += 1
    return
  tally.statuses[answer.status_code] += 1
  if answer.status_code == 200:
    answered_at = time.perf_counter()
    tally.latencies.append(answered_at - start)
    tally.from_send.append(answered_at - sent_at)
    tally.sentences += 1
    text = answer.json()['translations'][0]['text']
    if text != expected[index]:
      tally.wrong += 1
      tally.wrong_examples[index] = text
  elif answer.status_code == 503 and 'retry-after' not in answer.headers:
    tally.missing_retry_after += 1


async def closed_loop(url, clients, seconds, sentences, expected, timeout, stop_after=None):
  """`clients` clients sending one sentence at a time for `seconds` (or until stop_after() is true)."""
  tally, deadline = Tally(), time.perf_counter() + seconds
  limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
  async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
    async def worker(k):
      i = k
      while time.perf_counter() < deadline and not (stop_after and stop_after()):
        await one_request(client, url, i % len(sentences), sentences, expected, tally)
        i += clients
    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(clients)))
  return tally, time.perf_counter() - start


async def open_loop(url, rate, seconds, sentences, expected, timeout):
  """Requests scheduled at `rate` per second for `seconds`, whatever the answers: request i is due at
  start + i / rate and its latency counts from then. tally.sent counts those actually sent within `seconds`."""
  tally, tasks = Tally(), []
  limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
  async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
    start, i = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
      tasks.append(asyncio.create_task(one_request(client, url, i % len(sentences), sentences, expected, tally,
                                                   start=start + i / rate)))
      i += 1
      await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
    tally.sent = i
    await asyncio.gather(*tasks)
  return tally, time.perf_counter() - start


def batch_histogram(url):
  """(count, sum, {upper bound: cumulative count}, (translate requests, their seconds)) of the server's
  flaxformer_nmt_batch_sentences and its own timing of /v1/translate."""
  text = httpx.get(f'{url}/metrics', timeout=30).text
  count = total = 0.0
  buckets, server_side = {}, [0.0, 0.0]
  for line in text.splitlines():
    if line.startswith('flaxformer_nmt_request_seconds_count{route="/v1/translate"}'):
      server_side[0] = float(line.split()[-1])
    elif line.startswith('flaxformer_nmt_request_seconds_sum{route="/v1/translate"}'):
      server_side[1] = float(line.split()[-1])
    if line.startswith('flaxformer_nmt_batch_sentences_count'):
      count = float(line.split()[-1])
    elif line.startswith('flaxformer_nmt_batch_sentences_sum'):
      total = float(line.split()[-1])
    elif line.startswith('flaxformer_nmt_batch_sentences_bucket'):
      buckets[line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
  return count, total, buckets, server_side


def batch_sizes(before, after):
  """Batches formed between two batch_histogram readings: their count, mean size, and counts by size range."""
  count, total = after[0] - before[0], after[1] - before[1]
  ranges, previous = {}, 0.0
  for bound, cumulative in after[2].items():
    n = cumulative - before[2].get(bound, 0.0)
    if n - previous:
      ranges[f'<={bound}'] = int(n - previous)
    previous = n
  requests, seconds = after[3][0] - before[3][0], after[3][1] - before[3][1]
  return {'batches': int(count), 'mean_sentences': round(total / count, 1) if count else 0, 'by_size': ranges,
          'server_side_mean_s': round(seconds / requests, 3) if requests else None}


class ServerProcess:
  """python -m flaxformer_nmt.serve on a free port of 127.0.0.1."""

  def __init__(self, workdir, extra_flags, log_path):
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      self.port = s.getsockname()[1]
    self.url = f'http://127.0.0.1:{self.port}'
    self.command = [sys.executable, '-m', 'flaxformer_nmt.serve', f'--workdir={workdir}', f'--port={self.port}',
                    *extra_flags]
    self.log_path, self.process = log_path, None

  def start(self):
    """Starts it; returns (seconds to /ready, seconds to the first translation)."""
    start = time.perf_counter()
    with open(self.log_path, 'a', encoding='utf-8') as log:
      self.process = subprocess.Popen(self.command, cwd=REPOSITORY, stdout=log, stderr=subprocess.STDOUT)
    while not ready(self.url):
      if self.process.poll() is not None:
        raise RuntimeError(f'the server exited with {self.process.returncode}: see {self.log_path}')
      time.sleep(0.1)
    to_ready = time.perf_counter() - start
    httpx.post(f'{self.url}/v1/translate', json={'text': ['A dog runs.']}, timeout=300).raise_for_status()
    return to_ready, time.perf_counter() - start

  def rss_mb(self):
    return host_memory.resident_mb(self.process.pid)

  def kill(self):
    self.process.send_signal(signal.SIGKILL)
    self.process.wait()

  def stop(self):
    if self.process and self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      self.process.wait(120)


def ready(url):
  try:
    return httpx.get(f'{url}/ready', timeout=5).status_code == 200
  except httpx.TransportError:
    return False


def decode_flags(server_flags):
  """The server flags that change translations and that the decode command takes too (DECODE_FLAGS)."""
  return [f for f in server_flags if f.split('=')[0] in DECODE_FLAGS]


def offline_translations(workdir, checkpoint, sentences_path, extra_flags=()):
  """The decode command's translations of the sentences, decoded now."""
  with tempfile.TemporaryDirectory() as scratch:
    expected_path = os.path.join(scratch, 'expected.txt')
    subprocess.run([sys.executable, '-m', 'flaxformer_nmt.decode', f'--workdir={workdir}',
                    f'--input={sentences_path}', f'--output={expected_path}', *extra_flags,
                    *([f'--checkpoint={checkpoint}'] if checkpoint else [])], cwd=REPOSITORY, check=True)
    return read_lines(expected_path)


def read_lines(path):
  with open(path, encoding='utf-8') as f:
    return f.read().split('\n')[:-1]


def _in_process(kind, *args):
  return asyncio.run(closed_loop(*args) if kind == 'closed' else open_loop(*args))


def split_load(kind, total, per_process, url, seconds, sentences, expected, timeout):
  """closed_loop with `total` clients, or open_loop at `total` requests/s, over processes of at most
  `per_process` each; the merged Tally and the longest elapsed time."""
  processes = max(1, math.ceil(total / per_process))
  share = total / processes if kind == 'open' else None
  with concurrent.futures.ProcessPoolExecutor(processes) as pool:
    futures = [pool.submit(_in_process, kind, url, share or len(range(k, int(total), processes)), seconds,
                           sentences, expected, timeout) for k in range(processes)]
    parts = [f.result() for f in futures]
  merged = Tally()
  for tally, _ in parts:
    merged.latencies += tally.latencies
    merged.from_send += tally.from_send
    merged.statuses.update(tally.statuses)
    merged.wrong_examples.update(tally.wrong_examples)
    merged.wrong += tally.wrong
    merged.missing_retry_after += tally.missing_retry_after
    merged.sentences += tally.sentences
    merged.sent += tally.sent
  return merged, max(elapsed for _, elapsed in parts)


def run_clients(url, counts, seconds, sentences, expected, timeout, per_process):
  """The closed-loop steps, one per client count; returns {count: summary}."""
  results = {}
  for clients in counts:
    before = batch_histogram(url)
    tally, elapsed = split_load('closed', clients, per_process, url, seconds, sentences, expected, timeout)
    results[clients] = dict(tally.summary(elapsed), **batch_sizes(before, batch_histogram(url)))
    print(f'{clients:4d} clients: {printable(results[clients])}', flush=True)
  return results


def kill_test(server, sentences, expected, timeout):
  """SIGKILL under 32 clients; what the clients saw, and the restart's times."""
  started, killed_at = time.perf_counter(), []

  def kill():
    killed_at.append(time.perf_counter())
    server.kill()

  async def load_and_kill():
    loop = asyncio.get_running_loop()
    loop.call_later(5.0, kill)
    return await closed_loop(server.url, 32, 8.0, sentences, expected, timeout)
  tally, _ = asyncio.run(load_and_kill())
  to_ready, to_answer = server.start()
  # sentences/s over the load up to the kill, not the dead time after it nor the restart
  result = {'client_view': tally.summary(killed_at[0] - started), 'restart_to_ready_s': round(to_ready, 1),
            'restart_to_first_answer_s': round(to_answer, 1)}
  print(f'kill -9: {printable(result)}', flush=True)
  return result


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.getLogger('httpx').setLevel(logging.WARNING)  # not a line per request
  with open(FLAGS.sentences, encoding='utf-8') as f:
    sentences = f.read().split('\n')[:-1]
  invariant = ['--batch_invariant'] if FLAGS.batch_invariant else []
  offline_flags = decode_flags(FLAGS.server_flag) + invariant
  expected = (read_lines(FLAGS.expected) if FLAGS.expected else
              offline_translations(FLAGS.workdir, FLAGS.checkpoint, FLAGS.sentences, offline_flags))
  if len(expected) != len(sentences):
    raise app.UsageError(f'{len(sentences)} sentences but {len(expected)} expected translations')
  server, results = None, {'machine': os.uname().nodename, 'server_flags': FLAGS.server_flag,
                            'batch_invariant': FLAGS.batch_invariant}
  if FLAGS.url:
    url = FLAGS.url
  else:
    server_flags = FLAGS.server_flag + invariant + ([f'--checkpoint={FLAGS.checkpoint}'] if FLAGS.checkpoint else [])
    server = ServerProcess(FLAGS.workdir, server_flags, os.path.join(FLAGS.workdir, 'serve_load_server.log'))
    results['start_to_ready_s'], results['start_to_first_answer_s'] = [round(t, 1) for t in server.start()]
    print(f'server ready in {results["start_to_ready_s"]} s', flush=True)
    url = server.url
  try:
    counts = [int(c) for c in FLAGS.clients]
    results['closed_loop'] = run_clients(url, counts, FLAGS.duration_s, sentences, expected, FLAGS.client_timeout_s,
                                         FLAGS.clients_per_process)
    if FLAGS.overload:
      results['overload'] = overload(server, url, results['closed_loop'], FLAGS.duration_s, sentences, expected,
                                     FLAGS.client_timeout_s)
    if FLAGS.kill_test and server is not None:
      results['kill_test'] = kill_test(server, sentences, expected, FLAGS.client_timeout_s)
  finally:
    if server is not None:
      server.stop()
  if FLAGS.output:
    with open(FLAGS.output, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=2)


def overload(server, url, closed, seconds, sentences, expected, timeout):
  """Open-loop arrivals scheduled at 4x the best sustained rate of the closed-loop steps; reports the target and
  the rate the clients actually sent."""
  rate = 4 * max(r['sentences_per_second'] for r in closed.values())
  rss_before, histogram = server.rss_mb() if server else None, batch_histogram(url)
  tally, elapsed = split_load('open', rate, rate / OPEN_LOOP_PROCESSES, url, seconds, sentences, expected, timeout)
  offered, short = offered_rate(tally.sent, seconds, rate)
  result = dict(tally.summary(elapsed), from_send=percentiles(tally.from_send), target_per_second=round(rate, 1),
                offered_per_second=round(offered, 1), sent=tally.sent, rss_mb_before=rss_before and round(rss_before),
                rss_mb_after=server and round(server.rss_mb()), **batch_sizes(histogram, batch_histogram(url)))
  if short:
    print(f'WARNING: overload: the clients sent {offered:.1f} requests/s, more than {SHORTFALL_WARNING:.0%} below '
          f'the target {rate:.1f}/s: the load processes fell behind, this is not {rate:.1f}/s offered', flush=True)
  print(f'overload: {printable(result)}', flush=True)
  return result


if __name__ == '__main__':
  define_flags()
  app.run(main)
