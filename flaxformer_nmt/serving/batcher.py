"""Dynamic batching across requests, and the JAX search it runs.

Requests wait in a bounded queue, grouped by what their search depends on (the model, beam size, length
penalty, length limits). The batcher takes the group of the oldest waiting request and decodes it: at once
after a batch of one request (or on an idle server), else as soon as its sentences fill the token budget
(max_batch_tokens) or max_wait_s has passed since the last batch ended (the clients it answered send again
then); while a batch decodes, new requests gather for the next one. A batch's sentences are sorted by length
into the search's ladder of shapes (Translator.search_tokens), decoded with the decode command's search, and
handed back to each request in its order. Searches run on the batcher's worker threads, `in_flight` batches at
once (the server's --batches_in_flight: on a CPU one batch's search keeps about one core busy), and the event loop
stays free to answer, queue and refuse; requests that come while every worker is busy gather for the next batch.

A request is refused rather than answered late or wrongly: a full queue, or a queue that the measured rate (of the
batches that compiled no program; batches decoding at once add up) would not clear within max_queue_wait_s (or the
request's timeout), raises Overloaded (HTTP 503 with Retry-After); a request still unanswered at its deadline raises
DeadlineExceeded (504) and is taken out of the queue; a batch whose search raises answers its requests with
BatchFailed (500), and the next batch decodes as usual.
"""
import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import json
import math
import re
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging
from etils import epath

from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding.translator import Translator
from flaxformer_nmt.evaluation import attention as attention_lib
from flaxformer_nmt.models.tokens import BOS_ID, PAD_ID
from flaxformer_nmt.runtime import cache

RATE_SMOOTHING = 0.3  # weight of the newest batch in the source tokens per second the admission test uses


class Overloaded(Exception):
  """The queue cannot take the request now; retry_after: seconds after which it likely can."""

  def __init__(self, message, retry_after):
    super().__init__(message)
    self.retry_after = max(1, int(math.ceil(retry_after)))


class ShuttingDown(Overloaded):
  """The server is draining its queue before it exits."""


class DeadlineExceeded(Exception):
  """The request was not answered within its timeout."""


class BatchFailed(Exception):
  """The search of the request's batch raised."""


@dataclasses.dataclass(eq=False)
class Job:
  """One request's sentences (token ids ending with EOS) waiting in the queue."""
  key: tuple
  token_lists: list
  n_best: int
  attention: bool
  future: asyncio.Future
  arrived: float
  tokens: int = 0

  def __post_init__(self):
    self.tokens = sum(len(t) for t in self.token_lists)


class NoObserver:
  """What the batcher reports (the server's metrics implement the same methods)."""

  def queue_depth(self, sentences):
    pass

  def batch(self, sentences, source_tokens, target_tokens, seconds):
    pass


class Batcher:
  """Gathers the sentences of concurrent requests into batches for `run_batch` and hands the results back.

  run_batch(key, token_lists, n_best, attention) -> (results, target tokens): per sentence, in order, what the
  request gets back; it runs on one of the batcher's `in_flight` worker threads (batches decoding at once).
  `key` is what the request's search depends on: only requests of one key share a batch.
  """

  def __init__(self, run_batch: Callable, *, max_batch_tokens, max_wait_s, max_queue_sentences,
               max_queue_wait_s=None, observer=None, clock=time.monotonic, in_flight=1):
    self.run_batch, self.max_batch_tokens, self.max_wait_s = run_batch, max_batch_tokens, max_wait_s
    self.in_flight, self._running = in_flight, set()
    self.max_queue_wait_s = max_queue_wait_s
    self.max_queue_sentences, self.observer, self.clock = max_queue_sentences, observer or NoObserver(), clock
    self._pending = collections.OrderedDict()  # key -> deque of Jobs, the key of the oldest job first
    self._queued_sentences = self._queued_tokens = 0
    self._rate = None  # source tokens per second of the recent batches
    self._shared, self._shared_at = 0.0, time.perf_counter()  # _share_clock's
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix='search')
    self._wakeup, self._task, self._closing = None, None, False
    # After a batch of several requests, the next gathers for max_wait_s from the moment the device is free: the
    # clients just answered send again then. After a single request's batch, a request is decoded at once: one
    # client waits for nothing, and the requests that come while it decodes gather for the next batch.
    self._gather_from = -math.inf

  def start(self):
    self._wakeup = asyncio.Event()
    self._task = asyncio.get_running_loop().create_task(self._loop())

  async def run_on_worker(self, fn, *args):
    """fn(*args) on a worker thread (the batches themselves)."""
    return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

  def measured_rate(self, tokens_per_second):
    """Sets the admission test's rate (source tokens per second) before the first batch measures it (tests:
    until then the test is off, and only the queue's size refuses)."""
    self._rate = tokens_per_second

  @property
  def rate(self):
    """The admission test's source tokens per second (None before the first batch that compiled nothing): each
    batch's tokens over its share of the time (_share_clock), so that batches decoding at once add up."""
    return self._rate

  @property
  def queued_sentences(self):
    return self._queued_sentences

  async def submit(self, key, token_lists, *, n_best=1, attention=False, timeout=None):
    """The results of `token_lists` (run_batch's, in order) once their batch has decoded."""
    self._admit(len(token_lists), sum(len(t) for t in token_lists), timeout)
    job = Job(key, list(token_lists), n_best, attention, asyncio.get_running_loop().create_future(), self.clock())
    self._pending.setdefault(key, collections.deque()).append(job)
    self._count(job, +1)
    self._wakeup.set()
    try:
      return await asyncio.wait_for(asyncio.shield(job.future), timeout)
    except asyncio.TimeoutError:
      self._withdraw(job)
      raise DeadlineExceeded(f'not answered within the server\'s timeout of {timeout:g} s') from None
    except asyncio.CancelledError:  # the client went away
      self._withdraw(job)
      raise

  def _admit(self, sentences, tokens, timeout):
    """Raises Overloaded (ShuttingDown) where the queue cannot take `sentences` more now."""
    wait = (self._queued_tokens + tokens) / self._rate if self._rate else 0.0
    if self._closing:
      raise ShuttingDown('the server is shutting down', retry_after=1)
    if self._queued_sentences and self._queued_sentences + sentences > self.max_queue_sentences:
      raise Overloaded(f'the queue is full ({self._queued_sentences} sentences waiting, at most '
                       f'{self.max_queue_sentences})', retry_after=max(wait, self.max_wait_s))
    limit = min(t for t in (timeout, self.max_queue_wait_s, math.inf) if t)
    if self._queued_sentences and wait > limit:
      raise Overloaded(f'the queue would take about {wait:.1f} s to reach this request, over the limit of '
                       f'{limit:g} s', retry_after=wait - limit)

  def _count(self, job, sign):
    self._queued_sentences += sign * len(job.token_lists)
    self._queued_tokens += sign * job.tokens
    self.observer.queue_depth(self._queued_sentences)

  def _withdraw(self, job):
    """Takes a job that no longer waits for its answer out of the queue, if it is still there."""
    group = self._pending.get(job.key)
    if group is not None and job in group:
      group.remove(job)
      self._count(job, -1)
      if not group:
        del self._pending[job.key]

  async def _loop(self):
    while self._pending or self._running or not self._closing:
      if not self._pending or len(self._running) >= self.in_flight:
        self._wakeup.clear()
        await self._wakeup.wait()
        continue
      key = min(self._pending, key=lambda k: self._pending[k][0].arrived)
      group = self._pending[key]
      delay = self._gather_from + self.max_wait_s - self.clock()
      if delay > 0 and not self._closing and sum(j.tokens for j in group) < self.max_batch_tokens:
        self._wakeup.clear()
        try:
          await asyncio.wait_for(self._wakeup.wait(), delay)
        except asyncio.TimeoutError:
          pass
        continue
      jobs = self._take(key)
      task = asyncio.get_running_loop().create_task(self._decode(key, jobs))
      self._share_clock()  # before the count of running batches changes
      self._running.add(task)
      task.add_done_callback(functools.partial(self._decoded, several=len(jobs) > 1))

  def _decoded(self, task, several):
    """A batch's decode ended: its worker is free for the next batch."""
    self._share_clock()
    self._running.discard(task)
    self._gather_from = self.clock() if several else -math.inf
    self._wakeup.set()

  def _share_clock(self):
    """Seconds the batcher has decoded, each second split evenly among the batches running in it: a batch's share
    is each second it ran over the batches running then, and the shares of batches decoding at once add up to the
    time they took together. Read before each change of the running batches."""
    now = time.perf_counter()
    self._shared += (now - self._shared_at) / max(len(self._running), 1)
    self._shared_at = now
    return self._shared

  def _take(self, key):
    """The group's oldest jobs within the token budget (at least one), out of the queue."""
    group, jobs, tokens = self._pending[key], [], 0
    while group and (not jobs or tokens + group[0].tokens <= self.max_batch_tokens):
      job = group.popleft()
      self._count(job, -1)
      jobs.append(job)
      tokens += job.tokens
    if not group:
      del self._pending[key]
    return jobs

  async def _decode(self, key, jobs):
    token_lists = [t for job in jobs for t in job.token_lists]
    attention = [job.attention for job in jobs for _ in job.token_lists]
    n_best = max(job.n_best for job in jobs)
    start, shared = time.perf_counter(), self._share_clock()
    try:
      with cache.ProgramCounter() as programs:
        results, target_tokens = await self.run_on_worker(self.run_batch, key, token_lists, n_best, attention)
    except Exception as e:  # pylint: disable=broad-except  (answered to the batch's requests; serving goes on)
      logging.exception('A batch of %d sentences failed', len(token_lists))
      for job in jobs:
        if not job.future.done():
          job.future.set_exception(BatchFailed(f'the batch of this request failed: {type(e).__name__}: {e}'))
      return
    seconds, share = time.perf_counter() - start, self._share_clock() - shared
    tokens = sum(job.tokens for job in jobs)
    if not programs.names:  # a batch that compiled (or loaded) programs took longer than its decoding
      rate = tokens / max(share, 1e-6)
      self._rate = rate if self._rate is None else (1 - RATE_SMOOTHING) * self._rate + RATE_SMOOTHING * rate
    self.observer.batch(len(token_lists), tokens, target_tokens, seconds)
    offset = 0
    for job in jobs:
      if not job.future.done():
        job.future.set_result(results[offset:offset + len(job.token_lists)])
      offset += len(job.token_lists)

  async def close(self):
    """Refuses new requests, decodes those already queued, then stops the worker."""
    self._closing = True
    if self._task is not None:
      self._wakeup.set()
      await self._task
    self._executor.shutdown(wait=True)


@dataclasses.dataclass
class Sentence:
  """One sentence's answer: its n best (target ids ending with EOS, score), best first, and where asked for,
  its cross-attention [decoder layers, target pieces, source pieces], averaged over heads."""
  hypotheses: list
  attention: Any = None


class JaxBackend:
  """A trained workdir decoded with this toolkit's search (Translator), as the decode command decodes it."""

  name = 'jax'

  def __init__(self, workdir, checkpoint=None, dtype=None, batch_invariant=False):
    self.translator = Translator(workdir, checkpoint, dtype=dtype, batch_invariant=batch_invariant)
    self.config, self.tokenizer = self.translator.config, self.translator.tokenizer
    self.source_lang, self.target_lang = self.config.source_lang, self.config.target_lang
    self.workdir, self.checkpoint = str(workdir), self.translator.checkpoint
    self.max_position = int(self.config.model.max_position)
    self._description = self._describe()  # read once: the checkpoint served does not change

  @property
  def max_source_tokens(self):
    """The most source pieces (EOS not counted) the model translates without cutting them (fit_to_positions)."""
    return max(self.config.model.max_position - self.config.max_decode_extra_length, 2) - 1

  def defaults(self):
    return {'beam_size': int(self.config.beam_size), 'alpha': float(self.config.length_penalty_alpha),
            'max_len_a': 1.0, 'max_len_b': int(self.config.max_decode_extra_length)}

  def encode(self, texts):
    return self.tokenizer.encode(self.translator.prepare(texts), num_threads=1)

  def decode(self, ids):
    return self.tokenizer.decode(ids)

  def pieces(self, ids):
    return self.tokenizer.pieces(ids)

  def check_options(self, options):
    self.translator.check_options(**options)

  def search(self, token_lists, options, n_best, tokens_per_batch):
    """Per sentence its n_best [(target ids ending with EOS, score)]: Translator.search_tokens."""
    return self.translator.search_tokens(token_lists, n_best=n_best, tokens_per_batch=tokens_per_batch, **options)

  def attention(self, token_lists, target_lists):
    """Per (source, target) pair of token id lists: the head-averaged cross-attention [layers, T, S] of the
    model teacher-forced on BOS + target, rows in reading order (as the target ids)."""
    right_to_left = data_lib.right_to_left(self.config)
    model_order = [data_lib.reverse_before_eos(t) if right_to_left else t for t in target_lists]
    src = padded(token_lists)
    tgt_in = padded([[BOS_ID] + list(t) for t in model_order], rows=len(src))
    found = attention_lib.find_attention_weights(
        jax.device_get(_sown(self.translator.model, self.translator.params, src, tgt_in)))
    layers = sorted(layer for stack, layer, kind in found if (stack, kind) == ('decoder', 'cross_attention'))
    cross = np.stack([found[('decoder', layer, 'cross_attention')] for layer in layers], axis=1).mean(axis=2)
    maps = []
    for b, (source, target) in enumerate(zip(token_lists, target_lists)):
      weights = cross[b, :, :len(target), :len(source)]
      if right_to_left:  # rows back in reading order: the model wrote the last piece before EOS first
        weights = np.concatenate([weights[:, -2::-1], weights[:, -1:]], axis=1)
      maps.append(weights)
    return maps

  def run(self, options, token_lists, n_best, attention, tokens_per_batch):
    """[Sentence] of `token_lists` (none empty), the attention of those whose flag is set."""
    hypotheses = self.search(token_lists, options, n_best, tokens_per_batch)
    answers = [Sentence(h) for h in hypotheses]
    wanted = [i for i, flag in enumerate(attention) if flag]
    if wanted:
      maps = self.attention([token_lists[i] for i in wanted], [hypotheses[i][0][0] for i in wanted])
      for i, weights in zip(wanted, maps):
        answers[i].attention = weights
    return answers

  def warm_up(self, max_source_tokens, options, tokens_per_batch):
    """Compiles (or loads from the compilation cache) every program the search of sources of up to
    max_source_tokens pieces may run with these options (Translator.warm_up_ladder)."""
    self.translator.warm_up_ladder(max_source_length=max_source_tokens + 1, tokens_per_batch=tokens_per_batch,
                                   **options)

  def describe(self):
    """What /v1/models tells of the model, read at load: no request waits on metrics.jsonl (gs://...)."""
    return self._description

  def _describe(self):
    c = self.config
    steps = checkpoint_steps(self.checkpoint)
    return {'workdir': self.workdir, 'checkpoint': self.checkpoint, 'checkpoint_steps': steps,
            'validation_bleu': recorded_bleu(self.workdir, steps),
            'parameters': int(sum(x.size for x in jax.tree_util.tree_leaves(self.translator.params))),
            'config': {'encoder_layers': c.model.num_encoder_layers, 'decoder_layers': c.model.num_decoder_layers,
                       'd_model': c.model.d_model, 'd_ff': c.model.d_ff, 'heads': c.model.num_heads,
                       'vocab_size': self.tokenizer.vocab_size, 'pre_layer_norm': bool(c.model.pre_layer_norm),
                       'lowercase': bool(self.translator.lowercase)}}


def checkpoint_steps(description):
  """The training steps of a checkpoint description of Translator.checkpoint ('checkpoint 200', 'the average
  of checkpoints [100, 200]', 'the best checkpoint (step 200, bleu 12.3)')."""
  best = re.search(r'\(step (\d+)', description)
  return [int(best.group(1))] if best else [int(n) for n in re.findall(r'\d+', description)]


def recorded_bleu(workdir, steps):
  """{'step', 'bleu'} of the validation BLEU the training run logged (metrics.jsonl) at the newest of `steps`,
  else its newest before; None where it logged none."""
  path = epath.Path(workdir) / 'metrics.jsonl'
  if not path.exists():
    return None
  records = []
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
    except ValueError:  # a line cut by an interrupted write
      continue
    if isinstance(record.get('eval/bleu'), (int, float)) and math.isfinite(record['eval/bleu']):
      records.append({'step': int(record['step']), 'bleu': float(record['eval/bleu'])})
  newest = max(steps) if steps else math.inf
  before = [r for r in records if r['step'] <= newest]
  return before[-1] if before else None


def padded(token_lists, rows=None):
  """[rows, length] int32 of token lists padded with PAD: rows and length powers of two (length at least 16),
  so that few shapes are compiled."""
  rows = rows or 1 << (len(token_lists) - 1).bit_length()
  length = max(16, 1 << (max(map(len, token_lists)) - 1).bit_length())
  array = np.full((rows, length), PAD_ID, np.int32)
  for r, tokens in enumerate(token_lists):
    array[r, :len(tokens)] = tokens
  return array


@functools.partial(jax.jit, static_argnums=0)
def _sown(model, params, src, tgt_in):
  _, state = model.apply({'params': params}, src, tgt_in, mutable=['intermediates'])
  return state['intermediates']
