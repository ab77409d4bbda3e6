"""Every script in bench/ run at tiny sizes, so that none breaks unseen: each exits 0 and prints its numbers.

The numbers themselves are measurements, not checked here (bench/RESULTS.md records them); what is checked is
that each script still runs against the current library and prints the table or lines it is for, and (the tests
of their helpers) that what they compute from their measurements (rates, percentiles, ratios, counts) matches
hand counts. Scripts that define their flags in define_flags run in this process (tests/in_process.py); the
others, and those that need a fresh process (their own devices), as `python bench/NAME.py`.
"""
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types

import pytest

import in_process
from conftest import copy_of_trained_toy, subprocess_env, xla_flags_without_device_count

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, 'bench')
# Modules in bench/ that other scripts import and that have no command of their own.
HELPERS = {'op_profile'}  # bench/train_throughput.py --profile_dir runs it (test_train_throughput below)


def run_script(name, *args, timeout=300, **variables):
  """`python bench/{name}.py args` in the repository, with the tests' environment (and `variables` set); asserts
  exit 0."""
  result = subprocess.run([sys.executable, os.path.join(BENCH, f'{name}.py'), *args], cwd=REPO,
                          env=subprocess_env(**variables), capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
  return result.stdout


def run_in_process(name, *args):
  result = in_process.run(in_process.bench_script(name), list(args))
  assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
  return result.stdout


@pytest.fixture(scope='module')
def toy(trained_toy, tmp_path_factory):
  """A copy of the session's trained toy workdir, its corpus beside it: the scripts write into the workdir."""
  return copy_of_trained_toy(trained_toy, tmp_path_factory.mktemp('bench') / 'toy')


def test_every_bench_script_has_a_smoke_test():
  scripts = {name[:-3] for name in os.listdir(BENCH) if name.endswith('.py')} - HELPERS
  tested = {name[len('test_'):] for name in globals() if name.startswith('test_')}
  assert scripts <= tested, f'bench scripts without a smoke test here: {sorted(scripts - tested)}'


def test_gpu_session():
  """bench/gpu_session.sh parses, and every script, test file, config and command it runs exists."""
  script = os.path.join(BENCH, 'gpu_session.sh')
  result = subprocess.run(['bash', '-n', script], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  text = open(script, encoding='utf-8').read()
  paths = set(re.findall(r'\b((?:bench|tests|configs)/\w+\.(?:py|sh))\b', text))
  modules = set(re.findall(r'-m (flaxformer_nmt\.\w+)', text))
  assert 'bench/train_throughput.py' in paths and 'flaxformer_nmt.train' in modules  # the patterns still match
  assert [p for p in sorted(paths) if not os.path.exists(os.path.join(REPO, p))] == []
  assert [m for m in sorted(modules) if not os.path.exists(os.path.join(REPO, *m.split('.')) + '.py')] == []


# A stand-in for the Python that bench/gpu_session.sh runs: absl lines only (the console filters them), and the
# exit status its stage's command is given here.
_STUB_PYTHON = r"""#!/usr/bin/env bash
[ "$1" = - ] && exit 0  # setup's query of the dependencies to install: none
echo 'I1205 12:00:00.000000 1 stub.py:1] an absl line'
case "$*" in
  *pytest*) exit 0 ;;
  *--attention_impl\ xla*) exit 0 ;;
  *train_throughput*) exit 3 ;;
  *decode_throughput*) exit 124 ;;
esac
"""


def test_gpu_session_reports_each_stage_s_own_worst_status(tmp_path):
  """Each stage's line gives its own exit status, and a stage of several commands its worst one's. Catches the
  status of the console filter's grep (1 where it filtered every line: a stage that passed reads as failed, a
  time limit's 124 is lost) and a stage that reports only its last command's status."""
  stub = tmp_path / 'python'
  stub.write_text(_STUB_PYTHON)
  stub.chmod(0o755)
  env = dict(os.environ, OUT=str(tmp_path / 'out'), PY=str(stub))
  result = subprocess.run(['bash', os.path.join(BENCH, 'gpu_session.sh'), 'tests', 'throughput', 'decode'], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
  statuses = re.findall(r'^=== (\w+) exit (\d+)', result.stdout, re.M)
  assert statuses == [('tests', '0'), ('throughput', '3'), ('decode', '124')], (result.stdout, result.stderr)
  assert 'an absl line' in (tmp_path / 'out' / 'tests.log').read_text()


def test_input_pipeline():
  out = run_script('input_pipeline', '--smoke')
  assert 'tokenize + write cache (cold)' in out and 'load cache (warm' in out
  assert re.search(r'batches \(prefetch 0\): \d+ batches', out), out


def test_input_pipeline_building_no_batches():
  """--epochs too few for one batch prints that none was built. Catches the rates divided by zero batches
  (ZeroDivisionError: the real share of no padded tokens)."""
  out = run_script('input_pipeline', '--smoke', '--epochs', '0.001')
  assert re.search(r'batches \(prefetch 0\): 0 batches', out), out


def test_stop_latency():
  out = run_script('stop_latency', '--smoke')
  row = [line for line in out.splitlines() if line.startswith('| 0 |')]
  assert len(row) == 1, out  # the trial's row: it stopped cleanly after the signal


# Each part of the reliability bench is a case of tests/test_resilience.py and tests/test_restore.py; its smoke run
# starts the trainer six times as a subprocess (100 s of CI on a Zen 1's 2 cores): -m slow.
@pytest.mark.slow
def test_reliability():
  out = run_script('reliability', '--smoke', timeout=600)
  table = out[out.index('| case |'):]
  rows = [line for line in table.splitlines()[2:] if line.startswith('| ')]
  assert len(rows) == 4, table  # a corruption, the storage fault, a config change, a kill
  assert not [r for r in rows if 'UNEXPECTED' in r or 'NOT MEASURED' in r or 'DIFFERENT' in r], table


@pytest.mark.slow  # on a CPU its rows are tests/test_model.py's comparison of the XLA and einsum attention paths
def test_gpu_attention_check():
  """On a CPU it compares the einsum and XLA attention paths (the cuDNN rows need a GPU)."""
  out = run_script('gpu_attention_check', '--smoke')
  assert re.search(r'\| float32 \| highest \| xla \| [\d.e+-]+ \|', out), out


def test_train_throughput_alternates_over_several_shapes():
  """--alternate over two lengths: each variant's steps at the second shape go on from the state its steps at
  the first returned. Catches the second shape handed the state the first shape's steps donated ('Array has been
  deleted')."""
  out = run_script('train_throughput', '--configs', 'multi30k_tiny', '--lengths', '16,32', '--tokens_per_batch',
                   '256', '--steps', '1', '--vocab_size', '64', '--nocheck_xla_flops', '--alternate',
                   '--matmul_steps', '1')
  rows = re.findall(r'^\s*-/- +(\d+) +\d+ ', out, re.M)
  assert rows == ['16', '32'], out


def test_train_throughput(tmp_path):
  """A tiny step timed on 2 CPU devices with 2 microbatches, and traced with --profile_dir (bench/op_profile.py).
  XLA's FLOP count of the step (one device's program, the microbatches' loop body counted once) is set against the
  analytic FLOPs of the whole batch. Catches the check reading one device's half, or one microbatch, as the whole
  step's (a ratio near 0.5 or 0.25)."""
  flags = f'{xla_flags_without_device_count()} --xla_force_host_platform_device_count=2'.strip()
  out = run_script('train_throughput', '--configs', 'multi30k_tiny', '--lengths', '16', '--tokens_per_batch', '256',
                   '--steps', '1', '--vocab_size', '64', '--grad_accumulation_steps', '2', '--profile_dir',
                   str(tmp_path / 'profile'), '--profile_top', '3', '--matmul_steps', '1', XLA_FLAGS=flags)
  assert "'data': 2" in out and '# profile of 3 steps' in out and '# the 3 costliest operations:' in out, out
  ratio = float(re.search(r'XLA cost analysis / analytic FLOPs: ([\d.]+)', out)[1])
  assert 0.8 < ratio < 1.3, out


# bench/train_throughput.py's --trainer_steps with the step alone and the trainer's process stood in for: prints the
# trainer's command. A process of its own: the script defines its flags when imported.
_TRAINER_COMMAND = r"""
import sys
from absl import flags
sys.path.insert(0, sys.argv[1])
import train_throughput
flags.FLAGS(['train_throughput', *sys.argv[2:]])
train_throughput.config_step = lambda name: (0.1,)
def trainer(command, **unused):
  print('TRAINER', *command)
  sys.exit(0)
train_throughput.subprocess.run = trainer
train_throughput.trainer_share('multi30k_tiny', 2)
"""


def test_train_throughput_s_trainer_runs_the_step_timed():
  """--trainer_steps sets the trainer's run against the step timed here: the trainer gets the overrides of the
  config that the timed step has. Catches a trainer run with the config's float32 matmuls and dropout against a
  step timed with bfloat16 operands and none."""
  result = subprocess.run([sys.executable, '-c', _TRAINER_COMMAND, BENCH, '--matmul_precision=bfloat16',
                           '--dropout_rate=0', '--trainer_flag=--config.eval_bleu_every_steps=0'], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
  command = re.search(r'^TRAINER (.*)$', result.stdout, re.M)
  assert command, (result.stdout[-2000:], result.stderr[-3000:])
  assert {'--config.model.matmul_precision=bfloat16', '--config.model.dropout_rate=0.0',
          '--config.eval_bleu_every_steps=0'} <= set(command[1].split()), command[1]
  assert 'grad_accumulation_steps' not in command[1] and 'model.dtype' not in command[1], command[1]


def test_bleu_curve(toy):
  out = run_in_process('bleu_curve', f'--workdir={toy}', '--splits=valid', '--steps=400', '--beam_size=0')
  assert '| checkpoint 400 |' in out and '| checkpoint 400 |' in (toy / 'bleu_curve.md').read_text(), out


def test_decode_throughput(toy):
  out = run_in_process('decode_throughput', f'--workdir={toy}', f'--inputs={toy.parent / "data" / "test.en"}',
                       '--max_sentences=8', '--repeats=1')
  assert 'sentences/s' in out or 'sent/s' in out, out
  # The work table: every row-step a translation needs is one the programs ran (a count that leaves out the
  # beams, or a segment's steps, falls below it).
  work = re.findall(r'^\| test.en \(8\) \| (beam \d+|greedy) \| ([\d,]+) / ([\d,]+) \(([\d.]+)x\) \| ([\d.]+) \| '
                    r'([\d.]+) \(', out, re.M)
  assert [w[0] for w in work][1:] == ['greedy'], out
  for _, computed, needed, ratio, gflop, rate in work:
    computed, needed = int(computed.replace(',', '')), int(needed.replace(',', ''))
    assert computed >= needed > 0 and float(ratio) == pytest.approx(computed / needed, abs=0.006), out
    assert float(gflop) >= 0 and float(rate) > 0, out


def test_ctranslate2_export(toy):
  pytest.importorskip('ctranslate2')  # the test extra installs it; CI counts this skip
  data = toy.parent / 'data'
  out = run_in_process('ctranslate2_export', f'--workdir={toy}', f'--input={data / "test.en"}',
                       f'--reference={data / "test.de"}', f'--tok_reference={data / "test.de"}',
                       '--max_sentences=8', '--threads=1')
  assert '| greedy | CTranslate2 int8 |' in out, out
  empty = toy.parent / 'empty.en'  # no sentences: one line saying so, before any export (it crashed after both)
  empty.write_text('')
  result = in_process.run(in_process.bench_script('ctranslate2_export'), [
      f'--workdir={toy}', f'--input={empty}', f'--reference={data / "test.de"}', f'--tok_reference={data / "test.de"}'])
  last_line = result.stderr.strip().splitlines()[-1]
  assert result.returncode != 0 and last_line.startswith(f'error: {empty}, '), result.stderr


def test_serve_load(toy, tmp_path):
  pytest.importorskip('httpx')  # the test extra installs the server's dependencies
  sentences = tmp_path / 'in.en'
  sentences.write_text(''.join(line + '\n' for line in (toy.parent / 'data' / 'test.en').read_text().splitlines()[:4]))
  # A subprocess: its clients run in a process pool, which imports the script by name.
  result = subprocess.run([sys.executable, os.path.join(BENCH, 'serve_load.py'), f'--workdir={toy}',
                           f'--sentences={sentences}', '--clients=1', '--duration_s=1', '--overload',
                           '--server_flag=--warmup=none'],
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-3000:]
  assert re.search(r'^\s*1 clients: \{', out, re.M), out[-3000:]
  overload = json.loads(re.search(r'^overload: (\{.*\})$', out, re.M).group(1))
  # The open loop's answers are timed from their schedule and from their send, and the server's own mean read.
  assert overload['from_send']['p50_s'] <= overload['p50_s'] and overload['server_side_mean_s'] > 0, overload
  # Wrong rule caught: the offline decode was cached in the workdir by checkpoint name, and a workdir trained on
  # (or other code) then counted the server's right answers as wrong.
  assert not list(toy.glob('serve_load_expected_*'))


def test_serve_load_split_load_keeps_each_process_within_its_clients(monkeypatch):
  """Closed-loop clients spread over as few load processes as hold at most --clients_per_process each (32), every
  client placed: 1 and 32 in one process, 40 in 2, 70 in 3, 128 in 4. Catches the count of processes rounded to
  the nearest (40 clients in one process, 70 in 2 of 35, past the limit that keeps a process from falling
  behind)."""
  pytest.importorskip('httpx')
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  serve_load = _bench_module('serve_load')
  shares = []
  monkeypatch.setattr(serve_load, '_in_process',
                      lambda kind, url, share, *unused: shares.append(share) or (serve_load.Tally(), 1.0))
  monkeypatch.setattr(serve_load.concurrent.futures, 'ProcessPoolExecutor', concurrent.futures.ThreadPoolExecutor)
  for clients, processes in ((1, 1), (32, 1), (40, 2), (70, 3), (128, 4)):
    shares.clear()
    serve_load.split_load('closed', clients, 32, 'url', 1.0, ['a'], ['b'], 5.0)
    assert len(shares) == processes and sum(shares) == clients and max(shares) <= 32, (clients, shares)


def _bench_module(name):
  """bench/{name}.py imported as a module (its flags not defined), for its pure helpers."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(f'bench_{name}', os.path.join(BENCH, f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_serve_load_helpers():
  """The offered rate is what was sent (with a warning below 90% of the target), no 200 answers give no
  percentiles, and the offline decode gets the decode flags among the server's."""
  pytest.importorskip('httpx')
  serve_load = _bench_module('serve_load')
  assert serve_load.offered_rate(868, 30.0, 1399 / 30) == (868 / 30, True)
  assert serve_load.offered_rate(95, 10.0, 10.0) == (9.5, False)
  assert serve_load.percentiles([]) == {'p50_s': None, 'p95_s': None, 'p99_s': None}
  assert serve_load.percentiles([1.0, 2.0, 3.0])['p50_s'] == 2.0
  assert '"p50_s": "-"' in serve_load.printable({'client_view': serve_load.percentiles([])})
  assert serve_load.decode_flags(['--dtype=bfloat16', '--max_wait_ms=5', '--batch_invariant']) == [
      '--dtype=bfloat16', '--batch_invariant']


def test_serve_load_percentiles_are_of_the_latencies_given():
  """p50/p95/p99 are the linear-interpolation percentiles of the latencies: 101 shuffled values 0.00-1.00 give
  0.50, 0.95 and 0.99, and [1, 2, 3, 4] gives 2.5, 3.85 and 3.97 by hand (rank q/100 x (n - 1)). Catches a
  percentile read one index off, a wrong q, or read from the unsorted list."""
  pytest.importorskip('httpx')
  serve_load = _bench_module('serve_load')
  values = [i / 100 for i in range(101)]
  shuffled = values[50:] + values[:50]
  assert serve_load.percentiles(shuffled) == {'p50_s': 0.5, 'p95_s': 0.95, 'p99_s': 0.99}
  assert serve_load.percentiles([4.0, 1.0, 3.0, 2.0]) == {'p50_s': 2.5, 'p95_s': 3.85, 'p99_s': 3.97}


def test_serve_load_summary_counts_by_hand():
  """A step's summary: the 200 answers over the step's seconds, the percentiles of the latencies from schedule
  (not those from send), the wrong lines numbered from 1, each once. Catches the rate over another count, the
  percentiles of tally.from_send, and line numbers one off (RESULTS quotes them: 208, 232)."""
  pytest.importorskip('httpx')
  serve_load = _bench_module('serve_load')
  tally = serve_load.Tally(latencies=[0.1, 0.2, 0.3], from_send=[0.01, 0.02, 0.03], sentences=3, sent=9, wrong=3,
                           wrong_examples={4: 'x', 0: 'y'}, missing_retry_after=1)
  tally.statuses.update({200: 3, 503: 2, 'ConnectError': 1})
  summary = tally.summary(2.0)
  assert summary['sentences_per_second'] == 1.5
  assert (summary['p50_s'], summary['p99_s']) == (0.2, 0.298)
  assert summary['wrong_lines'] == [1, 5] and summary['wrong_translations'] == 3
  assert summary['statuses'] == {'200': 3, '503': 2, 'ConnectError': 1} and summary['503_without_retry_after'] == 1


def test_serve_load_batch_sizes_from_the_server_s_metrics():
  """The batches a step formed, read from two /metrics texts of the server's own Metrics: 4 batches of 1, 3, 3 and
  20 sentences before, 3 of 2, 2 and 40 after, so the step formed those 3 (mean 44 / 3 = 14.7, one in (1, 2],
  one in (32, 64]); the server's own mean time of its /v1/translate requests in the step (0.5 and 2.5 s: 1.5),
  its other routes left out. Catches the totals or buckets read without the earlier reading subtracted, a bucket
  counted cumulatively, a metric name the server does not write, another route's time, the mean inverted."""
  pytest.importorskip('httpx')
  prometheus_client = pytest.importorskip('prometheus_client')
  from flaxformer_nmt.serving import server  # pylint: disable=import-outside-toplevel
  serve_load = _bench_module('serve_load')
  metrics = server.Metrics()
  texts = []
  for batches, requests in (([1, 3, 3, 20], [('/v1/translate', 9.0), ('/ready', 30.0)]),
                            ([2, 2, 40], [('/v1/translate', 0.5), ('/v1/translate', 2.5), ('/ready', 50.0)])):
    for sentences in batches:
      metrics.batch(sentences, 10, 10, 0.1)
    for route, seconds in requests:
      metrics.request(route, 200, seconds)
    texts.append(prometheus_client.generate_latest(metrics.registry).decode())
  readings = []
  for text in texts:
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(serve_load.httpx, 'get', lambda *args, text=text, **kwargs: types.SimpleNamespace(text=text))
      readings.append(serve_load.batch_histogram('http://server'))
  assert serve_load.batch_sizes(*readings) == {'batches': 3, 'mean_sentences': 14.7,
                                               'by_size': {'<=2.0': 2, '<=64.0': 1}, 'server_side_mean_s': 1.5}


def test_serve_load_split_load_merges_every_process(monkeypatch):
  """split_load's merged tally: every load process's answers, sends and lines, the longest elapsed time; 96
  clients in 3 processes of 32; the open loop's rate shared equally over 4. Catches a count kept from one process
  only (the overload's offered rate), the rate over the shortest process's time."""
  pytest.importorskip('httpx')
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  serve_load = _bench_module('serve_load')
  calls = []

  def in_process(kind, url, share, *unused):
    calls.append((kind, share))
    k = len(calls)
    tally = serve_load.Tally(latencies=[k], from_send=[k / 10], sentences=k, sent=10 * k, wrong=1,
                             wrong_examples={k: 'x'}, missing_retry_after=k)
    tally.statuses.update({200: k})
    return tally, float(k)
  monkeypatch.setattr(serve_load, '_in_process', in_process)
  monkeypatch.setattr(serve_load.concurrent.futures, 'ProcessPoolExecutor', concurrent.futures.ThreadPoolExecutor)
  merged, elapsed = serve_load.split_load('closed', 96, 32, 'url', 1.0, ['a'], ['b'], 5.0)
  assert [share for _, share in calls] == [32, 32, 32], calls
  assert (merged.sentences, merged.sent, merged.wrong, merged.missing_retry_after, elapsed) == (6, 60, 3, 6, 3.0)
  assert sorted(merged.latencies) == [1, 2, 3] and sorted(merged.wrong_examples) == [1, 2, 3]
  assert merged.statuses == {200: 6} and sorted(merged.from_send) == [0.1, 0.2, 0.3]
  calls.clear()
  serve_load.split_load('open', 100.0, 25.0, 'url', 1.0, ['a'], ['b'], 5.0)
  assert calls == [('open', 25.0)] * 4


def test_serve_load_overload_rates(monkeypatch):
  """--overload's numbers from a tally of 30 answers and 90 requests sent in a 10 s step that took 12 s to its
  last answer: the target 4x the best closed-loop rate (4 x 7.5), offered 90 / 10 = 9 per second (sent within
  the step's seconds), 30 / 12 = 2.5 sentences per second, the percentiles from schedule and from send each of
  their own list. Catches the offered rate over the elapsed time, the target from the last or the first step,
  and the two latency lists swapped."""
  pytest.importorskip('httpx')
  serve_load = _bench_module('serve_load')
  tally = serve_load.Tally(latencies=[2.0, 4.0, 6.0], from_send=[1.0, 1.0, 3.0], sentences=30, sent=90)
  seen = []
  monkeypatch.setattr(serve_load, 'split_load', lambda *args: seen.append(args[:3]) or (tally, 12.0))
  monkeypatch.setattr(serve_load, 'batch_histogram', lambda url: (0.0, 0.0, {}, (0.0, 0.0)))
  closed = {1: {'sentences_per_second': 5.0}, 8: {'sentences_per_second': 7.5}, 32: {'sentences_per_second': 6.0}}
  result = serve_load.overload(None, 'url', closed, 10.0, ['a'], ['b'], 5.0)
  assert seen == [('open', 30.0, 7.5)]
  assert (result['target_per_second'], result['offered_per_second'], result['sent']) == (30.0, 9.0, 90)
  assert result['sentences_per_second'] == 2.5
  assert (result['p50_s'], result['from_send']['p50_s']) == (4.0, 1.0)


def test_serve_load_latency_runs_from_the_schedule_and_from_the_send():
  """A 200 answer's latency runs from the time it was due (2 s before it was sent here), its from_send latency
  from the send; a wrong answer is counted with its line. Catches both timed from the send (an open loop's
  falling behind hidden) or both from the schedule."""
  pytest.importorskip('httpx')
  serve_load = _bench_module('serve_load')

  class Client:
    async def post(self, url, json):
      del url
      await asyncio.sleep(0.05)
      text = 'b' if json['text'] == ['a'] else 'wrong'
      return types.SimpleNamespace(status_code=200, headers={}, json=lambda: {'translations': [{'text': text}]})
  tally = serve_load.Tally()
  asyncio.run(serve_load.one_request(Client(), 'url', 0, ['a', 'c'], ['b', 'd'], tally,
                                     start=time.perf_counter() - 2.0))
  asyncio.run(serve_load.one_request(Client(), 'url', 1, ['a', 'c'], ['b', 'd'], tally))
  assert tally.latencies[0] >= 2.05 and 0.05 <= tally.from_send[0] < 1.0, tally
  assert tally.latencies[1] == pytest.approx(tally.from_send[1], abs=0.01), tally
  assert (tally.sentences, tally.wrong, tally.wrong_examples, tally.statuses) == (2, 1, {1: 'wrong'}, {200: 2})


def test_serve_load_kill_test_rate_is_up_to_the_kill(monkeypatch):
  """--kill_test's sentences/s counts the time up to the kill only: 10 answers, the kill after 0.1 s (its 5 s
  scaled down), the clients and the restart 1 s more. Catches the rate over the dead time and the restart too
  (about 10 per second here against about 100)."""
  pytest.importorskip('httpx')
  serve_load = _bench_module('serve_load')

  class FastLoop:
    def __init__(self, loop):
      self.loop = loop

    def call_later(self, delay, callback):
      return self.loop.call_later(delay / 50, callback)

  async def closed_loop(*unused):
    await asyncio.sleep(0.5)
    return serve_load.Tally(latencies=[0.01] * 10, sentences=10), 0.5
  monkeypatch.setattr(serve_load, 'asyncio', types.SimpleNamespace(
      run=asyncio.run, get_running_loop=lambda: FastLoop(asyncio.get_running_loop())))
  monkeypatch.setattr(serve_load, 'closed_loop', closed_loop)
  killed = []
  server = types.SimpleNamespace(url='url', kill=lambda: killed.append(1),
                                 start=lambda: time.sleep(0.5) or (0.3, 0.5))
  result = serve_load.kill_test(server, ['a'], ['b'], 5.0)
  assert killed == [1] and (result['restart_to_ready_s'], result['restart_to_first_answer_s']) == (0.3, 0.5)
  assert 30 < result['client_view']['sentences_per_second'] <= 100.5, result


def test_stop_latency_steady_ms_per_step():
  """ms/step is the median of the logged intervals after the first (compiling), None where none or 0 ms."""
  stop_latency = _bench_module('stop_latency')
  line = 'I0 loop.py:160] step {}/9 | loss 1 | {} ms/step | epoch 0\n'
  log = ''.join(line.format(step, ms) for step, ms in ((5, 3292), (10, 18), (15, 22), (20, 20)))
  assert stop_latency.steady_ms_per_step(log) == 20
  assert stop_latency.steady_ms_per_step(line.format(5, 3292)) is None
  assert stop_latency.steady_ms_per_step(line.format(5, 3292) + line.format(10, 0)) is None


def test_stop_latency_counts_from_the_step_logged(tmp_path):
  """The device's step at the signal is estimated from the step whose line the wait saw, the latest logged: with a
  line every 50 steps, --after_step 120 waits for step 150's line. Catches the estimate counted from 120, 30 steps
  short (and from an earlier line where several appeared between two polls)."""
  stop_latency = _bench_module('stop_latency')
  log = tmp_path / 'trial.log'
  line = 'I0 loop.py:160] step {}/900 | loss 1 | {} ms/step | epoch 0\n'
  log.write_text(''.join(line.format(step, ms) for step, ms in ((50, 3292), (100, 20), (150, 20))))
  running = types.SimpleNamespace(poll=lambda: None, returncode=None)
  assert stop_latency.wait_for_step(str(log), running, 120, timeout=5) == 150
  assert stop_latency.wait_for_step(str(log), running, 50, timeout=5) == 150


def test_decode_throughput_leaves_ctranslate2_s_thread_policy_to_the_environment(monkeypatch):
  """The CTranslate2 process waits as this process's OMP_WAIT_POLICY says (unset: the OpenMP runtime's own), or
  as --omp_wait_policy sets. Catches a policy forced on it: PASSIVE made its warm search 1.5x (beam) and 2.5x
  (greedy) slower on cores nothing else loads."""
  decode_throughput = _bench_module('decode_throughput')
  seen = []

  def run_process(command, env=None):
    del command
    seen.append(env.get('OMP_WAIT_POLICY'))
    return 1.0, 100.0, 'written at 0\npeak RSS when written 1000 kB\nwarm seconds 0.5\n'
  monkeypatch.setattr(decode_throughput, 'run_process', run_process)
  config = types.SimpleNamespace(length_penalty_alpha=1.0, max_decode_extra_length=50, decode_tokens_per_batch=512)
  translator = types.SimpleNamespace(config=config, lowercase=False)
  for environment, policy in ((None, None), ('ACTIVE', None), (None, 'PASSIVE')):
    if environment:
      monkeypatch.setenv('OMP_WAIT_POLICY', environment)
    else:
      monkeypatch.delenv('OMP_WAIT_POLICY', raising=False)
    flags = types.SimpleNamespace(alpha=None, threads=1, tokens_per_batch=None, compute_type='float32',
                                  omp_wait_policy=policy)
    decode_throughput.ctranslate2_process(flags, translator, 'model', 'in.en', 'out.de', 5, repeats=1)
  assert seen == [None, 'ACTIVE', 'PASSIVE']


# Stand-ins for ctranslate2 and sentencepiece: their second translate_batch call (the first warm pass) holds 300 MB.
_CT2_STUB = """
class _Result:
  hypotheses = [['w']]


class Translator:
  calls = 0

  def __init__(self, *args, **kwargs):
    pass

  def translate_batch(self, batch, **options):
    Translator.calls += 1
    if Translator.calls > 1:
      Translator.held = b'x' * (300 << 20)
    return [_Result() for _ in batch]
"""
_SENTENCEPIECE_STUB = """
class SentencePieceProcessor:
  def __init__(self, model_file):
    pass

  def encode(self, line, out_type=str):
    return line.split()

  def decode(self, pieces):
    return ' '.join(pieces)
"""


def _stub_ctranslate2_process(tmp_path, monkeypatch, text):
  """decode_throughput.ctranslate2_process on `text` (in.en, translated to out.de in tmp_path), its ctranslate2 and
  sentencepiece the stubs above."""
  (tmp_path / 'ctranslate2.py').write_text(_CT2_STUB)
  (tmp_path / 'sentencepiece.py').write_text(_SENTENCEPIECE_STUB)
  (tmp_path / 'in.en').write_text(text)
  monkeypatch.setenv('PYTHONPATH', str(tmp_path))
  config = types.SimpleNamespace(length_penalty_alpha=1.0, max_decode_extra_length=50, decode_tokens_per_batch=512)
  translator = types.SimpleNamespace(config=config, lowercase=False)
  flags = types.SimpleNamespace(alpha=None, threads=1, tokens_per_batch=None, compute_type='float32',
                                omp_wait_policy=None)
  return _bench_module('decode_throughput').ctranslate2_process(
      flags, translator, tmp_path, str(tmp_path / 'in.en'), str(tmp_path / 'out.de'), 5, repeats=1)


def test_decode_throughput_ctranslate2_s_peak_rss_is_up_to_its_output(tmp_path, monkeypatch):
  """The CTranslate2 process's peak RSS is its peak up to its output written, as the decode command's ends with
  its output. Catches the peak of the whole process, its warm passes after the output included (a greedy
  process's 105 MB read 110-114)."""
  _, megabytes, warm = _stub_ctranslate2_process(tmp_path, monkeypatch, 'a dog\na cat\n')
  assert warm is not None and (tmp_path / 'out.de').read_text() == 'w\nw\n'
  assert 0 < megabytes < 200, megabytes


def test_decode_throughput_ctranslate2_process_takes_an_empty_input(tmp_path, monkeypatch):
  """An empty input file gives CTranslate2's process an empty output, as it gives the decode command. Catches the
  length limit taken as the longest of no sources (ValueError: max() of an empty sequence)."""
  _, _, warm = _stub_ctranslate2_process(tmp_path, monkeypatch, '')
  assert warm is not None and (tmp_path / 'out.de').read_text() == ''


def test_decode_throughput_s_matmul_reference_has_the_model_s_operands(monkeypatch, capsys):
  """The work table's reference matmul multiplies operands of the dtype the model's matmuls run in: bfloat16 in a
  bfloat16 model (a GPU's 'auto', --dtype bfloat16) whose matmul_precision is float32. Catches the reference taken
  from matmul_precision alone (a float32 matmul's rate set against a bfloat16 search's)."""
  decode_throughput = _bench_module('decode_throughput')
  rates = []
  monkeypatch.setattr(decode_throughput.flops_lib, 'matmul_rate', lambda dtype: rates.append(dtype) or 1e9)
  monkeypatch.setattr(decode_throughput, 'export', lambda *args: None)
  model_config = types.SimpleNamespace(dtype='bfloat16', matmul_precision='float32')
  config = types.SimpleNamespace(model=types.SimpleNamespace(dtype='bfloat16'), length_penalty_alpha=1.0,
                                 decode_tokens_per_batch=4096)
  translator = types.SimpleNamespace(config=config, model=types.SimpleNamespace(config=model_config),
                                     checkpoint='checkpoint 1', ladder=lambda _: types.SimpleNamespace(
                                         tokens_per_batch=4096))
  flags = types.SimpleNamespace(workdir='w', checkpoint='latest', compute_type='float32', alpha=None, threads=1,
                                tokens_per_batch=None, omp_wait_policy=None, inputs=[])
  decode_throughput.run(flags, translator, 'scratch', 100.0)
  assert [str(dtype) for dtype in rates] == ['bfloat16'], rates
  assert 'matmul operands bfloat16' in capsys.readouterr().out


def _toy_model_config():
  return types.SimpleNamespace(d_model=8, d_ff=16, num_encoder_layers=2, num_decoder_layers=3)


def test_decode_throughput_needed_work_counts_each_output_s_tokens(monkeypatch):
  """The row-steps the translations need: each sentence's beams (one row in greedy search) times its output's
  tokens, EOS included once (the token lists end with it), an empty source none; the FLOPs asked of
  flops.forward_flops for each: the encoder once over the source, the target tokens of every beam, attention over
  (n + 1) / 2 positions on average (1, ..., n over the n steps). Catches EOS counted twice or not at all, the
  beams left out, the source and target sides swapped."""
  decode_throughput = _bench_module('decode_throughput')
  calls = []
  monkeypatch.setattr(decode_throughput.flops_lib, 'forward_flops',
                      lambda config, vocab, *args: calls.append(args) or 1000.0)
  translator = types.SimpleNamespace(model=types.SimpleNamespace(config=_toy_model_config()),
                                     tokenizer=types.SimpleNamespace(vocab_size=32))
  eos = 1
  token_lists = [[5, 6, 7, eos], [eos], [9, eos]]
  results = [[([4, 4, eos], -1.0)], [([], 0.0)], [([8, 8, 8, 8, eos], -2.0)]]
  steps, flops = decode_throughput.needed_work(translator, token_lists, results, 4)
  assert steps == 4 * 3 + 4 * 5 and flops == 2000.0
  mean_positions = [sum(range(1, n + 1)) / n for n in (3, 5)]
  assert calls == [(4, 4 * 3, 4, mean_positions[0]), (2, 4 * 5, 2, mean_positions[1])]
  calls.clear()
  assert decode_throughput.needed_work(translator, token_lists, results, 0) == (3 + 5, 2000.0)
  assert [c[1] for c in calls] == [3, 5]


def test_decode_throughput_identical_counts_equal_lines_over_ours(tmp_path):
  """The share of our lines that CTranslate2's equal, line by line: 2 of 4 (its output one line short)."""
  decode_throughput = _bench_module('decode_throughput')
  ours, theirs = tmp_path / 'ours.txt', tmp_path / 'theirs.txt'
  ours.write_text('a b\n\nc\nd\n')
  theirs.write_text('a b\nx\nc\n')
  assert decode_throughput.identical(ours, theirs) == 0.5
  theirs.write_text('c\na b\n\nd\n')
  assert decode_throughput.identical(ours, theirs) == 0.25


def test_decode_throughput_warm_rate_is_over_the_fastest_warm_pass(monkeypatch):
  """Sentences per second over the fastest of the warm passes (3 s and 2 s: 6 sentences / 2 s), not over the
  first pass that compiled or the slowest; the work table's seconds the same pass's."""
  decode_throughput = _bench_module('decode_throughput')
  passes = iter([3.0, 2.0])
  monkeypatch.setattr(decode_throughput, 'timed', lambda function: next(passes))
  monkeypatch.setattr(decode_throughput, 'needed_work', lambda *args: (70, 9e9))
  sources = ['s'] * 6
  translator = types.SimpleNamespace(prepare=lambda lines: lines, tokenizer=types.SimpleNamespace(
      encode=lambda lines: [[5, 1] for _ in lines]), search_tokens=lambda *args, **kwargs: None)
  flags = types.SimpleNamespace(tokens_per_batch=None, alpha=None, repeats=2)
  found = decode_throughput.warm_search(flags, translator, sources, 5)
  assert found['ours'] == 3.0 and found['work'] == (0, 70, 9e9, 2.0)


def test_decode_throughput_tables_divide_the_right_way(capsys):
  """The tables' ratios by hand: time x CT2 is our time over CTranslate2's (its rate over ours: 200 / 100 = 2.00),
  cold and warm x CT2 our process's seconds over its (12 / 3, 6 / 3), lines identical a percentage; row-steps
  computed over needed (150 / 120 = 1.25x), GFLOP needed, their rate over the warm pass (60 GFLOP / 2 s = 30.0)
  and that over the matmul's (30 / 300 = 0.100)."""
  decode_throughput = _bench_module('decode_throughput')
  row = {'input': 'in (6)', 'search': 'beam 5', 'programs': '3', 'ours': 100.0, 'theirs': 200.0,
         'cold': (12.0, 500.0, 'p', 13.0), 'warm': (6.0, 400.0, 'p', 6.5), 'ct2': (3.0, 100.0), 'identical': 0.875,
         'work': (150, 120, 60e9, 2.0), 'rss': [600.0, 650.0]}
  decode_throughput.print_table([row])
  cells = capsys.readouterr().out.strip().splitlines()[-1].strip('| ').split(' | ')
  assert cells[3:6] == ['100.0', '200.0', '2.00'] and cells[9:12] == ['4.00', '2.00', '87.5%'], cells
  decode_throughput.print_work_table([row], 300e9)
  cells = capsys.readouterr().out.strip().splitlines()[-1].strip('| ').split(' | ')
  assert cells[2:5] == ['150 / 120 (1.25x)', '60.0', '30.0 (0.100)'], cells


def test_decode_throughput_process_times(monkeypatch, tmp_path):
  """The decode command's programs from its log line (compiled; loaded from the cache and as saved executables
  together) and its seconds to its output's last write; CTranslate2's process's seconds to its output written,
  not to its exit after the warm passes."""
  decode_throughput = _bench_module('decode_throughput')
  output = tmp_path / 'out.de'
  output.write_text('x\n')
  os.utime(output, (1000.0, 1004.5))
  monkeypatch.setattr(decode_throughput.time, 'time', lambda: 1000.0)
  log = ('I0 decode.py:1] Programs: 7 compiled, 2 loaded from the compilation cache, 3 loaded as saved executables '
         '(4.3 s)')
  monkeypatch.setattr(decode_throughput, 'run_process', lambda command, env=None: (9.0, 321.0, log))
  flags = types.SimpleNamespace(workdir='w', checkpoint='latest', alpha=None, dtype=None, tokens_per_batch=None)
  found = decode_throughput.decode_command(flags, 'in.en', str(output), 5, str(tmp_path / 'cache'))
  assert found == (4.5, 321.0, '7 compiled, 5 loaded, 4.3 s', 9.0)
  ct2_log = 'written at 1002.5\npeak RSS when written 204800 kB\nwarm seconds 0.75\n'
  monkeypatch.setattr(decode_throughput, 'run_process', lambda command, env=None: (9.0, 999.0, ct2_log))
  config = types.SimpleNamespace(length_penalty_alpha=1.0, max_decode_extra_length=50, decode_tokens_per_batch=512)
  translator = types.SimpleNamespace(config=config, lowercase=False)
  flags = types.SimpleNamespace(alpha=None, threads=1, tokens_per_batch=None, compute_type='float32',
                                omp_wait_policy=None)
  assert decode_throughput.ctranslate2_process(flags, translator, 'm', 'in.en', 'out', 5, 1) == (2.5, 200.0, 0.75)


def test_decode_throughput_row_steps_count_sentences_beams_and_steps(monkeypatch):
  """RowSteps counts each program call's sentences x beams (one row in greedy search) x the steps it ran: begin
  6 x 5 x 3, a segment from step 3 to 7 2 x 5 x 4, a greedy one from 10 to 14 2 x 1 x 4: 138. Catches the beams
  left out and a segment's steps counted from 0 rather than from where it started."""
  decode_throughput = _bench_module('decode_throughput')
  state = lambda index: types.SimpleNamespace(index=index)
  begin = lambda model, params, src, *args, **options: ('inputs', state(3), 'live')
  segment = lambda model, params, inputs, begun, *args, **options: (state(begun.index + 4), 'live')
  monkeypatch.setattr(decode_throughput.batch_search, '_programs_for', lambda options: (begin, segment))
  with decode_throughput.RowSteps() as counted:
    counted_begin, counted_segment = decode_throughput.batch_search._programs_for({})
    counted_begin(None, None, types.SimpleNamespace(shape=(6, 10)), 0, 0, cache_length=10, beam_size=5)
    counted_segment(None, None, types.SimpleNamespace(src=types.SimpleNamespace(shape=(2, 10))), state(3), 0,
                    beam_size=5)
    counted_segment(None, None, types.SimpleNamespace(src=types.SimpleNamespace(shape=(2, 10))), state(10), 0,
                    beam_size=0)
  assert counted.count == 6 * 5 * 3 + 2 * 5 * 4 + 2 * 1 * 4


def test_decode_throughput_run_process_s_peak_rss_in_megabytes():
  """A command's peak RSS in MB (of 1,024 KB), as /usr/bin/time reports it, against the peak (VmHWM) the child
  reads of itself after holding 100 MB; its wall seconds. Catches KB divided by 1,000 (2.4% more MB)."""
  decode_throughput = _bench_module('decode_throughput')
  child = ("import sys, time; held = bytearray(100 << 20); time.sleep(0.2); print([l.split()[1] for l in "
           "open('/proc/self/status') if l.startswith('VmHWM:')][0], file=sys.stderr)")
  seconds, megabytes, log = decode_throughput.run_process([sys.executable, '-c', child])
  assert megabytes == pytest.approx(int(log.split()[0]) / 1024, rel=0.005) and megabytes > 100
  assert seconds >= 0.2



def test_ctranslate2_export_measures_ctranslate2_in_a_process_of_its_own(tmp_path, monkeypatch):
  """bench/ctranslate2_export.py's CTranslate2 translations run in a fresh process each, with the translations an
  in-process translate_batch gives. Catches them run in the bench's process, where an int8 model's translation
  left the float32 greedy search that followed 3.5x slower."""
  ctranslate2 = pytest.importorskip('ctranslate2')
  from flaxformer_nmt.serving import ctranslate2 as export  # pylint: disable=import-outside-toplevel
  from conftest import tiny_model  # pylint: disable=import-outside-toplevel
  vocabulary = ['<pad>', '<unk>', '<s>', '</s>'] + [f'w{i}' for i in range(12)]
  model, params = tiny_model()
  spec = export.ctranslate2_spec(export.jax_to_numpy(params), model.config, vocabulary)
  spec.validate()
  spec.optimize()
  spec.save(str(tmp_path))
  pieces = [['w1', 'w2', 'w3'], ['w4'], ['w5', 'w6', 'w7', 'w8', 'w9']]
  limits = [len(p) + 3 for p in pieces]
  options = dict(beam_size=2, length_penalty=1.0, max_decoding_length=max(limits), max_batch_size=64,
                 batch_type='examples', suppress_sequences=[['<pad>'], ['<s>']])
  translator = ctranslate2.Translator(str(tmp_path), device='cpu', compute_type='float32', intra_threads=1)
  expected = [r.hypotheses[0][:n] for r, n in zip(translator.translate_batch(pieces, **options), limits)]

  class Refused:
    def Translator(self, *args, **kwargs):  # pylint: disable=invalid-name
      raise AssertionError('CTranslate2 translated in the bench\'s process')
  monkeypatch.setitem(sys.modules, 'ctranslate2', Refused())
  found, seconds = _bench_module('ctranslate2_export').theirs(tmp_path, 'float32', pieces, 2, 1.0, 1, limits)
  assert found == expected and seconds > 0


def _gpu_session(tmp_path, stub_lines, *stages, **variables):
  """bench/gpu_session.sh `stages` run with a stand-in Python (`stub_lines` after setup's query); its stdout."""
  stub = tmp_path / 'python'
  stub.write_text('#!/usr/bin/env bash\n[ "$1" = - ] && exit 0\n' + ''.join(line + '\n' for line in stub_lines))
  stub.chmod(0o755)
  env = dict(os.environ, OUT=str(tmp_path / 'out'), PY=str(stub), **variables)
  result = subprocess.run(['bash', os.path.join(BENCH, 'gpu_session.sh'), *stages], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
  return result.stdout


def test_gpu_session_smoke_shrinks_every_train_step_it_times(tmp_path):
  """SMOKE=1 (a CPU's rehearsal): each bench/train_throughput.py run of the throughput, memory and profile stages
  times the tiny config (its last --configs, which absl keeps). Catches a stage left at the big model's steps."""
  calls = tmp_path / 'calls'
  _gpu_session(tmp_path, [f'echo "$*" >> {calls}'], 'throughput', 'memory', 'profile', SMOKE='1')
  runs = [line.split() for line in calls.read_text().splitlines() if 'bench/train_throughput.py' in line]
  configs = [[value for flag, value in zip(run, run[1:]) if flag == '--configs'][-1] for run in runs]
  assert configs == ['multi30k_tiny'] * 6, runs


def test_gpu_session_trains_multi30k_in_a_new_workdir_each_time(tmp_path):
  """The multi30k stage run twice (a rerun on a warm machine) trains from scratch both times. Catches a fixed
  workdir that the second run's trainer resumes, its minutes already trained."""
  calls = tmp_path / 'calls'
  stub = ['[ "$2" = flaxformer_nmt.train ] || exit 0', 'while [ "$1" != --workdir ]; do shift; done',
          f'echo "$2 $(ls -A "$2" 2>/dev/null | wc -l)" >> {calls}', 'mkdir -p "$2" && touch "$2/metrics.jsonl"']
  try:
    _gpu_session(tmp_path, stub, 'multi30k', 'multi30k')
    seen = [line.split() for line in calls.read_text().splitlines()]
  finally:
    for line in calls.read_text().splitlines() if calls.exists() else []:
      shutil.rmtree(line.split()[0], ignore_errors=True)
  assert len(seen) == 2 and seen[0][0] != seen[1][0] and [files for _, files in seen] == ['0', '0'], seen
