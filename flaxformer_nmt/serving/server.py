"""The translation server's application: its own API, a LibreTranslate-compatible one, status, metrics, the page.

  POST /v1/translate  {"model", "text": [...], "beam_size", "n_best", "alpha", "max_length", "return_scores",
                       "return_attention"} -> {"model", "translations": [{"text", "score", "n_best", "attention"}]}
  POST /translate     LibreTranslate's {"q", "source", "target", "format", "alternatives", "api_key"}
                      -> {"translatedText"} (JSON or form-encoded, as LibreTranslate's clients send it)
  GET  /languages     LibreTranslate's [{"code", "name", "targets"}]
  GET  /v1/models     the models served, their checkpoints, sizes, decode settings and validation BLEU
  GET  /health        200 while the process runs (no key needed)
  GET  /ready         200 once the warm-up has compiled the searches, 503 before
  GET  /metrics       Prometheus text format
  GET  /              the page: translate, n best, cross-attention heatmap (static/, no external resources)
  GET  /docs          FastAPI's OpenAPI page

Each text is split into lines and each line into sentences; the sentences of all requests are batched
(batcher.py) and every translation is rejoined in place (one space between sentences, lines as they were).
An empty text translates to an empty string. See docs/serving.md.
"""
import asyncio
import contextlib
import dataclasses
import heapq
import hmac
import json
import pathlib
import re
import threading
import time
import urllib.parse
from typing import Optional

import fastapi
import fastapi.exception_handlers
import numpy as np
import prometheus_client
import pydantic
from absl import logging as absl_logging
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses, staticfiles
from starlette import exceptions as starlette_exceptions
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request

from flaxformer_nmt.serving import argos
from flaxformer_nmt.serving import batcher as batcher_lib

STATIC_DIR = pathlib.Path(__file__).parent / 'static'
LIBRE_PATHS = ('/translate', '/languages')
PUBLIC_PATHS = ('/health', '/', '/favicon.ico', '/docs', '/docs/oauth2-redirect', '/openapi.json', '/redoc')
WARMUP_LEVELS = ('none', 'full')
# The largest alpha a request may ask for: the search's float32 length penalty ((5 + n) / 6)^alpha overflows past
# about 17 for an output of 1,000 pieces, which zeroes every score.
MAX_ALPHA = 10.0


@dataclasses.dataclass
class Settings:
  """The server's limits and batching (serve.py's flags)."""
  max_batch_tokens: int = 2048
  max_wait_ms: float = 20.0
  batches_in_flight: int = 2
  max_queue_sentences: int = 2048
  max_queue_wait_s: float = 3.0
  timeout_s: float = 30.0
  max_input_tokens: int = 127
  max_sentences: int = 128
  max_body_bytes: int = 1 << 20
  max_beam_size: int = 8
  api_keys: tuple = ()
  cors_origins: tuple = ()
  warmup: str = 'full'


class ApiError(Exception):
  """An answer other than 200: its status, message and headers."""

  def __init__(self, status, message, headers=None):
    super().__init__(message)
    self.status, self.message, self.headers = status, message, headers


def error_response(path, status, message, headers=None):
  """LibreTranslate's {"error": message} on its routes, FastAPI's {"detail": message} on the others."""
  message = message.encode('utf-8', 'backslashreplace').decode('utf-8')  # a lone surrogate the client sent
  body = {'error': message} if path in LIBRE_PATHS else {'detail': message}
  return responses.JSONResponse(body, status, headers=headers)


# A match starts where a run of marks starts (the look-behind): otherwise a long run of marks with no space after
# it is tried from each of its characters, in time quadratic in the run.
_SENTENCE_END = re.compile(r'(?<![.!?\u2026])[.!?\u2026]+["\'\u201d\u2019)\]]*\s+')
_LAST_WORD_CHARS = 100  # the last word before a mark is read from this many characters (an abbreviation is shorter)
ABBREVIATIONS = frozenset('mr mrs ms dr prof st sr jr vs etc e.g i.e no nr ca bzw z.b usw'.split())
NUMERIC_ONLY = frozenset('no nr'.split())  # abbreviations only before a number (No. 5), as in Moses' lists
_ACRONYM = re.compile(r'\.([^\W\d_]+)\.+$')  # a word ending in a period, letters and a period (U.S., p.m.)


def split_sentences(line):
  """The sentences of one line of text: a break after . ! ? (and closing quotes) followed by white space and an
  upper-case letter, digit or opening quote, but not after an abbreviation (Mr., Dr., z.B., ...), an initial
  (J. Smith) or an acronym written with periods whose last letters are capitals (the U.S. Army, E.S.E.
  Electronics, a Ph.D. Student: Moses' sentence splitter's rule); a mark standing alone ("runs . The") always
  ends a sentence."""
  sentences, start = [], 0
  for match in _SENTENCE_END.finditer(line):
    following = line[match.end():match.end() + 2]
    words = line[max(start, match.start() - _LAST_WORD_CHARS):match.start() + 1].split()
    word = words[-1].rstrip('.').lower() if words else ''
    starts = following[:1].isupper() or following[:1].isdigit() or (
        following[:1] in '"\'\u201c\u201e(' and following[1:2].isupper())
    abbreviation = word in ABBREVIATIONS and not (word in NUMERIC_ONLY and not following[:1].isdigit())
    initial = len(word) == 1 and not word.isdigit()  # J. Smith; not "counted to 3. Then"
    if starts and (not word or (not abbreviation and not initial and not _acronym(words[-1]))):
      sentences.append(line[start:match.end()].strip())
      start = match.end()
  sentences.append(line[start:].strip())
  return sentences


def _acronym(word):
  """Whether a word ends as U.S., E.S.E. or Ph.D. do: a period, capitals, a period (not p.m.)."""
  match = _ACRONYM.search(word)
  return bool(match) and match.group(1).isupper()


_LINE_BREAK = re.compile(r'\r\n|\r|\n')


def split_text(text):
  """A text as lines of sentences: [[sentence, ...], ...] (the breaks between the lines: line_breaks)."""
  return [split_sentences(line) for line in _LINE_BREAK.split(text)]


def line_breaks(text):
  """The line breaks of a text in order (\\n, \\r\\n or \\r), which its translation keeps."""
  return _LINE_BREAK.findall(text)


class TranslateRequest(pydantic.BaseModel):
  """POST /v1/translate."""
  model_config = pydantic.ConfigDict(extra='forbid', strict=True)
  model: Optional[str] = pydantic.Field(None, description='A served model\'s name (GET /v1/models); default: the '
                                        'first.')
  text: list[str] = pydantic.Field(..., description='Texts to translate; each may hold several sentences and '
                                   'lines.')
  beam_size: Optional[int] = pydantic.Field(None, ge=0, description='0: greedy; default: the model\'s.')
  n_best: int = pydantic.Field(1, ge=1, description='Translations per text, best first (at most beam_size).')
  alpha: Optional[float] = pydantic.Field(None, ge=0, le=MAX_ALPHA, allow_inf_nan=False,
                                          description='Length penalty exponent (0 to 10); default: the model\'s.')
  max_length: Optional[int] = pydantic.Field(None, ge=1, description='At most this many target pieces per '
                                             'sentence (default: source length + the model\'s extra length).')
  return_scores: bool = False
  return_attention: bool = False


class Metrics:
  """The server's Prometheus metrics, in a registry of its own."""

  def __init__(self):
    self.registry = r = prometheus_client.CollectorRegistry()
    prefix = 'flaxformer_nmt_'
    self.requests = prometheus_client.Counter(f'{prefix}requests', 'HTTP requests by route and status',
                                              ['route', 'status'], registry=r)
    self.latency = prometheus_client.Histogram(f'{prefix}request_seconds', 'HTTP request latency', ['route'],
                                               buckets=(.01, .025, .05, .1, .25, .5, 1, 2, 4, 8, 15, 30, 60),
                                               registry=r)
    self.batch_sentences = prometheus_client.Histogram(
        f'{prefix}batch_sentences', 'Sentences per decoded batch', buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        registry=r)
    self.batch_tokens = prometheus_client.Histogram(
        f'{prefix}batch_source_tokens', 'Source tokens per decoded batch',
        buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384), registry=r)
    self.batch_seconds = prometheus_client.Histogram(f'{prefix}batch_seconds', 'Decoding time per batch',
                                                     buckets=(.01, .05, .1, .25, .5, 1, 2, 4, 8, 16), registry=r)
    self.queue = prometheus_client.Gauge(f'{prefix}queue_sentences', 'Sentences waiting for a batch', registry=r)
    self.target_tokens = prometheus_client.Counter(f'{prefix}target_tokens', 'Target tokens generated', registry=r)
    self.tokens_per_second = prometheus_client.Gauge(f'{prefix}target_tokens_per_second',
                                                     'Target tokens per second of the latest batch', registry=r)

  def request(self, route, status, seconds):
    self.requests.labels(route, str(status)).inc()
    self.latency.labels(route).observe(seconds)

  def queue_depth(self, sentences):
    self.queue.set(sentences)

  def batch(self, sentences, source_tokens, target_tokens, seconds):
    self.batch_sentences.observe(sentences)
    self.batch_tokens.observe(source_tokens)
    self.batch_seconds.observe(seconds)
    self.target_tokens.inc(target_tokens)
    self.tokens_per_second.set(target_tokens / max(seconds, 1e-9))

  def render(self):
    return prometheus_client.generate_latest(self.registry)


class Keys:
  """API keys (constant-time comparison against every key); none: every request is let in."""

  def __init__(self, keys):
    self.keys = [k.encode('utf-8') for k in keys]

  def accepts(self, key):
    if key is None:
      return False
    given, found = key.encode('utf-8', 'surrogatepass'), False  # JSON may escape a lone surrogate: no key
    for k in self.keys:
      found |= hmac.compare_digest(given, k)
    return found

  def bearer(self, headers):
    scheme, _, key = headers.get('authorization', '').partition(' ')
    return self.accepts(key.strip()) if scheme.lower() == 'bearer' else False


async def libre_api_key(scope, body):
  """LibreTranslate's api_key field, read as libre_fields reads the request; None where it cannot be read."""
  try:
    key = (await libre_fields(scope, body)).get('api_key')
  except ApiError:
    return None
  return key if isinstance(key, str) else None


class Guard:
  """ASGI middleware in front of every route: the API key, the request body's size limit and its UTF-8; and a
  route's unexpected exception answered 500 here, inside the CORS middleware, so that a page can read it (Starlette
  answers it outside every middleware, with no CORS headers)."""

  def __init__(self, app, max_body_bytes, keys):
    self.app, self.max_body_bytes, self.keys = app, max_body_bytes, keys

  async def __call__(self, scope, receive, send):
    if scope['type'] != 'http':
      return await self.app(scope, receive, send)
    path, headers = scope['path'], Headers(scope=scope)
    needs_key = bool(self.keys.keys) and path not in PUBLIC_PATHS and not path.startswith('/static/')
    unauthorized = ('a valid API key is required: send the header "Authorization: Bearer KEY"'
                    + (' or the api_key field' if path in LIBRE_PATHS else ''))
    if needs_key and path not in LIBRE_PATHS and not self.keys.bearer(headers):
      return await error_response(path, 401, unauthorized, {'WWW-Authenticate': 'Bearer'})(scope, receive, send)
    body = b''
    if scope['method'] in ('POST', 'PUT', 'PATCH'):
      body, error = await self._read_body(headers, receive)
      if error is not None:
        return await error_response(path, *error)(scope, receive, send)
    if needs_key and path in LIBRE_PATHS and not (
        self.keys.bearer(headers) or self.keys.accepts(await libre_api_key(scope, body))):
      return await error_response(path, 401, unauthorized, {'WWW-Authenticate': 'Bearer'})(scope, receive, send)
    replayed, started = False, False

    async def replay():
      nonlocal replayed
      if not replayed:
        replayed = True
        return {'type': 'http.request', 'body': body, 'more_body': False}
      return await receive()

    async def send_started(message):
      nonlocal started
      started = started or message['type'] == 'http.response.start'
      await send(message)
    try:
      return await self.app(scope, replay, send_started)
    except Exception as e:  # pylint: disable=broad-except
      if started:  # too late for a response of its own
        raise
      absl_logging.exception('%s %s failed', scope['method'], path)
      return await error_response(path, 500, f'internal error: {type(e).__name__}')(scope, receive, send)

  async def _read_body(self, headers, receive):
    """(the body, None) or (b'', (status, message)) where it is too large or not UTF-8."""
    too_large = (413, f'the request body is over the limit of {self.max_body_bytes} bytes (--max_body_bytes)')
    length = headers.get('content-length')
    if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
      return b'', too_large
    chunks, size = [], 0
    while True:
      message = await receive()
      if message['type'] == 'http.disconnect':
        break
      chunk = message.get('body', b'')
      size += len(chunk)
      if size > self.max_body_bytes:
        return b'', too_large
      chunks.append(chunk)
      if not message.get('more_body', False):
        break
    body = b''.join(chunks)
    try:
      body.decode('utf-8')
    except UnicodeDecodeError as e:
      return b'', (400, f'the request body is not valid UTF-8 ({e.reason} at byte {e.start})')
    return body, None


class RequestMetrics:
  """ASGI middleware counting every request by route and status, and timing it."""

  def __init__(self, app, metrics, routes):
    self.app, self.metrics, self.routes = app, metrics, routes

  async def __call__(self, scope, receive, send):
    if scope['type'] != 'http':
      return await self.app(scope, receive, send)
    start, status = time.perf_counter(), [500]

    async def send_status(message):
      if message['type'] == 'http.response.start':
        status[0] = message['status']
      await send(message)
    try:
      await self.app(scope, receive, send_status)
    finally:
      path = scope['path']
      route = path if path in self.routes else '/static' if path.startswith('/static/') else 'other'
      self.metrics.request(route, status[0], time.perf_counter() - start)


class Service:
  """The models served (name -> backend, the first the default) and the batcher their searches share."""

  def __init__(self, backends, settings, metrics):
    if not backends:
      raise ValueError('no model to serve')
    self.backends, self.settings = dict(backends), settings
    self.batcher = batcher_lib.Batcher(self._run_batch, max_batch_tokens=settings.max_batch_tokens,
                                       max_wait_s=settings.max_wait_ms / 1000,
                                       max_queue_sentences=settings.max_queue_sentences,
                                       max_queue_wait_s=settings.max_queue_wait_s, observer=metrics,
                                       in_flight=settings.batches_in_flight)
    self.ready, self.warmup_error = False, None
    # Never more than the model translates whole: a longer source is refused, not cut.
    self.input_limits = {name: min(settings.max_input_tokens, b.max_source_tokens) for name, b in backends.items()}

  def _run_batch(self, key, token_lists, n_best, attention):
    name, options = key[0], dict(key[1])
    answers = self.backends[name].run(options, token_lists, n_best, attention, self.settings.max_batch_tokens)
    return answers, sum(len(a.hypotheses[0][0]) for a in answers)

  def served(self):
    return ', '.join(f'{n} ({b.source_lang}->{b.target_lang})' for n, b in self.backends.items())

  def resolve(self, name):
    """(name, backend) of a request's model (None: the first served); 404 naming those served."""
    name = next(iter(self.backends)) if name is None else name
    if name not in self.backends:
      raise ApiError(404, f'model {name!r} is not served; this server serves {self.served()}')
    return name, self.backends[name]

  def by_languages(self, source, target):
    """The first model from `source` ('auto': any) to `target`; 404 naming those served."""
    for name, backend in self.backends.items():
      if backend.target_lang == target and source in ('auto', backend.source_lang):
        return name, backend
    raise ApiError(404, f'no model translates {source} to {target}; this server serves {self.served()}')

  def options(self, backend, beam_size=None, n_best=1, alpha=None, max_length=None):
    """The search options of a request with the model's defaults filled in; 400 naming the field or limit."""
    options = backend.defaults()
    if beam_size is not None:
      if beam_size > self.settings.max_beam_size:
        raise ApiError(400, f'beam_size={beam_size} is over the server\'s limit --max_beam_size='
                       f'{self.settings.max_beam_size}')
      options['beam_size'] = beam_size
    if alpha is not None:
      options['alpha'] = float(alpha)
    if max_length is not None:
      if max_length >= backend.max_position:
        raise ApiError(400, f'max_length={max_length} is over the model\'s limit of {backend.max_position - 1} '
                       'target pieces')
      options['max_len_a'], options['max_len_b'] = 0.0, int(max_length)
    if not 1 <= n_best <= max(options['beam_size'], 1):
      raise ApiError(400, f'n_best={n_best} must be between 1 and the beam size ({options["beam_size"]})')
    try:
      backend.check_options(dict(options, n_best=n_best))
    except ValueError as e:
      raise ApiError(400, str(e)) from None
    return options

  def _encode(self, name, backend, texts, names):
    """(per text its lines of sentence indices, the sentences' token ids); 400 or 413 naming the text (`names`,
    as the request calls each) or the limit. Blank lines and empty texts count against no limit."""
    layout, sentences = [], []
    for text, text_name in zip(texts, names):
      try:
        text.encode('utf-8')
      except UnicodeEncodeError as e:  # JSON may escape a lone surrogate (\ud800), which is no text
        raise ApiError(400, f'{text_name} is not valid Unicode ({e.reason} at character {e.start})') from None
      lines = []
      for line in split_text(text):
        lines.append(list(range(len(sentences), len(sentences) + len(line))))
        sentences += line
      layout.append(lines)
    count = sum(1 for sentence in sentences if sentence)
    if count > self.settings.max_sentences:
      raise ApiError(413, f'the request holds {count} sentences; the limit is --max_sentences='
                     f'{self.settings.max_sentences}')
    token_lists = backend.encode(sentences)
    limit = self.input_limits[name]
    for text_name, lines in zip(names, layout):
      for i in (i for line in lines for i in line):
        if len(token_lists[i]) - 1 > limit:
          raise ApiError(413, f'{text_name} has a sentence of {len(token_lists[i]) - 1} tokens; the limit is '
                         f'{limit} (--max_input_tokens={self.settings.max_input_tokens}, and what the model holds)')
    return layout, token_lists

  async def translate(self, name, texts, options, n_best=1, scores=False, attention=False, names=None):
    """The answer entries of `texts`, in order (see the module docstring); names: how errors call each text
    (default text[0], text[1], ...). Splitting, encoding and the answers' rendering run off the event loop."""
    if not self.ready:
      if self.warmup_error:
        raise ApiError(503, f'the server cannot translate: {self.warmup_error}')
      raise ApiError(503, 'the server is warming up (compiling its searches): see GET /ready', {'Retry-After': '5'})
    backend = self.backends[name]
    names = names or [f'text[{i}]' for i in range(len(texts))]
    layout, token_lists = await asyncio.to_thread(self._encode, name, backend, texts, names)
    nonempty = [i for i, tokens in enumerate(token_lists) if len(tokens) > 1]
    key = (name, tuple(sorted(options.items())))
    try:
      found = await self.batcher.submit(key, [token_lists[i] for i in nonempty], n_best=n_best, attention=attention,
                                        timeout=self.settings.timeout_s) if nonempty else []
    except batcher_lib.Overloaded as e:
      raise ApiError(503, str(e), {'Retry-After': str(e.retry_after)}) from None
    except batcher_lib.DeadlineExceeded as e:
      raise ApiError(504, str(e)) from None
    except batcher_lib.BatchFailed as e:
      raise ApiError(500, str(e)) from None
    answers = [None] * len(token_lists)
    for i, answer in zip(nonempty, found):
      answers[i] = answer
    if attention:
      check_attention_size(layout, answers)
    return await asyncio.to_thread(lambda: [
        text_answer(backend, lines, line_breaks(text), token_lists, answers, n_best, scores, attention)
        for lines, text in zip(layout, texts)])


# return_attention's weights a request may ask for (layers x target x source pieces of each text, summed):
# about 2 MB of JSON.
MAX_ATTENTION_WEIGHTS = 250_000


def check_attention_size(layout, answers):
  """413 where the attention pictures of a request's texts would hold more than MAX_ATTENTION_WEIGHTS weights."""
  total = 0
  for lines in layout:
    shapes = [answers[i].attention.shape for line in lines for i in line if answers[i] is not None]  # [layers, T, S]
    if shapes:
      total += shapes[0][0] * sum(shape[1] for shape in shapes) * sum(shape[2] for shape in shapes)
  if total > MAX_ATTENTION_WEIGHTS:
    raise ApiError(413, f'return_attention: the attention of this request holds {total} weights; the limit is '
                   f'{MAX_ATTENTION_WEIGHTS} (ask for fewer or shorter texts at a time)')


def best_combinations(score_lists, n):
  """The n best choices of one candidate per sentence, by summed score, best first: [(indices, score)].
  score_lists: per sentence its candidates' scores, best first (the k-th of every sentence together is not
  the text's k-th best: its second best changes one sentence, not all of them)."""
  if not score_lists:
    return [((), 0.0)] * n
  start = (0,) * len(score_lists)
  total = lambda indices: sum(scores[k] for scores, k in zip(score_lists, indices))
  heap, seen, found = [(-total(start), start)], {start}, []
  while heap and len(found) < n:
    negative, indices = heapq.heappop(heap)
    found.append((indices, -negative))
    for s in range(len(indices)):
      if indices[s] + 1 < len(score_lists[s]):
        following = indices[:s] + (indices[s] + 1,) + indices[s + 1:]
        if following not in seen:
          seen.add(following)
          heapq.heappush(heap, (-total(following), following))
  return found + [found[-1]] * (n - len(found))  # fewer combinations than asked (one candidate each): repeated


def text_answer(backend, lines, breaks, token_lists, answers, n_best, scores, attention):
  """One text's entry of /v1/translate: its sentences' translations rejoined in place, its lines joined by
  `breaks` (the text's line breaks); its n best: the n best combinations of its sentences' candidates."""
  answered = [i for line in lines for i in line if answers[i] is not None]
  position = {i: p for p, i in enumerate(answered)}

  def candidate(indices, score):
    translated = [' '.join(t for t in (backend.decode(answers[i].hypotheses[indices[position[i]]][0])
                                       for i in line if answers[i] is not None) if t) for line in lines]
    text = translated[0] + ''.join(b + t for b, t in zip(breaks, translated[1:]))
    return {'text': text, 'score': float(score)}
  combinations = best_combinations([[h[1] for h in answers[i].hypotheses[:n_best]] for i in answered], n_best)
  candidates = [candidate(indices, score) for indices, score in combinations]
  entry = {'text': candidates[0]['text']}
  if scores:
    entry['score'] = candidates[0]['score']
  if n_best > 1:
    entry['n_best'] = candidates
  if attention:
    entry['attention'] = attention_entry(backend, [(token_lists[i], answers[i]) for line in lines for i in line
                                                   if answers[i] is not None])
  return entry


def attention_entry(backend, pairs):
  """{'source_tokens', 'target_tokens', 'weights' [layers][target][source]} of a text's sentences: each
  sentence's cross-attention (averaged over heads) on the diagonal, zero between sentences."""
  source_tokens, target_tokens, blocks = [], [], []
  for source_ids, answer in pairs:
    source_tokens += backend.pieces(source_ids)
    target_tokens += backend.pieces(answer.hypotheses[0][0])
    blocks.append(answer.attention)
  layers = blocks[0].shape[0] if blocks else 0
  weights = np.zeros((layers, len(target_tokens), len(source_tokens)), np.float32)
  row = column = 0
  for block in blocks:
    weights[:, row:row + block.shape[1], column:column + block.shape[2]] = block
    row, column = row + block.shape[1], column + block.shape[2]
  return {'source_tokens': source_tokens, 'target_tokens': target_tokens,
          'weights': np.round(weights.astype(np.float64), 6).tolist()}


WARM_UP_THREAD = 'warm-up'


def in_daemon_thread(fn, *args):
  """An awaitable of fn(*args) run on a daemon thread: a server stopped while it runs exits without waiting.
  (The warm-up runs so; no batch runs before it has ended, as requests are refused until then.)"""
  loop = asyncio.get_running_loop()
  future = loop.create_future()

  def settle(method, value):
    if not future.done():
      method(value)

  def target():
    try:
      result, method = fn(*args), future.set_result
    except Exception as e:  # pylint: disable=broad-except  (raised where the future is awaited)
      result, method = e, future.set_exception
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
      loop.call_soon_threadsafe(settle, method, result)
  threading.Thread(target=target, name=WARM_UP_THREAD, daemon=True).start()
  return future


async def warm_up(service):
  """Compiles each model's searches (Settings.warmup), then marks the service ready."""
  settings = service.settings
  try:
    for name, backend in service.backends.items():
      if settings.warmup == 'none':
        continue
      start = time.perf_counter()
      await in_daemon_thread(backend.warm_up, service.input_limits[name], service.options(backend),
                             settings.max_batch_tokens)
      absl_logging.info('Warmed up model %s (%s) in %.1f s', name, settings.warmup, time.perf_counter() - start)
    service.ready = True
  except Exception as e:  # pylint: disable=broad-except  (/ready reports it)
    absl_logging.exception('The warm-up failed')
    service.warmup_error = f'the warm-up failed: {type(e).__name__}: {e}'


def validation_error(request, error):
  """422 naming each field that is missing, of the wrong type or out of range, or where the JSON breaks; 415 for
  a body sent as other than JSON (FastAPI reads no fields from it)."""
  content_type = request.headers.get('content-type', '')
  # A body FastAPI did not read as JSON fails as a whole (older FastAPI reads one without a Content-Type as JSON).
  unread = all(tuple(e.get('loc', ())) == ('body',) for e in error.errors())
  if 'json' not in content_type and unread:
    given = f'Content-Type {content_type}' if content_type else 'no Content-Type'
    return error_response(request.url.path, 415, f'send the body as JSON with Content-Type: application/json (this '
                          f'request has {given})')
  messages = []
  for e in error.errors():
    location = [str(part) for part in e.get('loc', ()) if part != 'body']
    if e.get('type') == 'json_invalid':
      messages.append(f'the body is not valid JSON ({e.get("ctx", {}).get("error", e.get("msg"))} at position '
                      f'{location[-1] if location else "?"})')
    else:
      messages.append(f'{".".join(location) or "body"}: {e.get("msg")}')
  return error_response(request.url.path, 422, '; '.join(messages))


async def http_error(request, error):
  """FastAPI's HTTP errors as it answers them (as {"error": ...} on LibreTranslate's routes: a 405), but for its
  400 of a JSON body it could not parse for another reason than a syntax error (arrays nested deeper than
  json.loads recurses): 422 saying why."""
  if isinstance(error.__cause__, (ValueError, RecursionError)):
    return error_response(request.url.path, 422, f'the body is not valid JSON ({error.__cause__})')
  if request.url.path in LIBRE_PATHS:
    return error_response(request.url.path, error.status_code, str(error.detail), getattr(error, 'headers', None))
  return await fastapi.exception_handlers.http_exception_handler(request, error)


async def libre_fields(scope, body):
  """LibreTranslate's request fields, from a JSON object or a form-encoded or multipart body (its own page sends
  FormData); a form's fields may also come in the query string (LibreTranslate reads Flask's request.values), the
  body's first."""
  content_type = Headers(scope=scope).get('content-type', '')
  query = form_fields(scope['query_string'])
  if 'x-www-form-urlencoded' in content_type or not (body or content_type):
    return {**query, **form_fields(body)}
  if 'multipart/form-data' in content_type:
    return {**query, **await multipart_fields(scope, body)}
  if 'json' in content_type or not content_type:
    try:
      data = json.loads(body) if body else {}
    except (ValueError, RecursionError) as e:  # RecursionError: arrays or objects nested too deep
      raise ApiError(422, f'the body is not valid JSON ({e})') from None
    if not isinstance(data, dict):
      raise ApiError(422, 'the body must be a JSON object')
    return data
  raise ApiError(415, f'send JSON, application/x-www-form-urlencoded or multipart/form-data, not {content_type}')


async def multipart_fields(scope, body):
  """{name: first value} of the text fields of a multipart/form-data body (Starlette's parser, python-multipart)."""
  async def receive():
    return {'type': 'http.request', 'body': body, 'more_body': False}
  try:
    form = await Request(scope, receive).form()
  except Exception as e:  # pylint: disable=broad-except  # the parser's errors (a bad boundary, a cut body)
    raise ApiError(400, f'the multipart form could not be read ({getattr(e, "detail", e)})') from None
  fields = {}
  for name, value in form.multi_items():
    if isinstance(value, str):  # files are no LibreTranslate field
      fields.setdefault(name, value)
  return fields


def form_fields(encoded):
  """{name: first value} of an application/x-www-form-urlencoded form."""
  try:  # percent-escapes may spell bytes that are no UTF-8
    fields = urllib.parse.parse_qs(encoded.decode('utf-8'), keep_blank_values=True, errors='strict')
  except UnicodeDecodeError as e:
    raise ApiError(400, f'the form is not valid UTF-8 once unescaped ({e.reason})') from None
  return {k: v[0] for k, v in fields.items()}


def libre_request(data):
  """(texts, whether q was one string, source, target, alternatives) of a LibreTranslate request."""
  for field in ('q', 'source', 'target'):
    if data.get(field) in (None, ''):
      raise ApiError(400, f'Invalid request: missing {field} parameter')
  q = data['q']
  if not (isinstance(q, str) or (isinstance(q, list) and all(isinstance(t, str) for t in q))):
    raise ApiError(422, 'q: must be a string or a list of strings')
  if data.get('format') in (None, ''):  # as LibreTranslate: no format is text
    data = dict(data, format='text')
  for field in ('source', 'target', 'format'):
    if not isinstance(data.get(field, 'text'), str):
      raise ApiError(422, f'{field}: must be a string')
  if data.get('format', 'text') != 'text':
    raise ApiError(400, f'format {data["format"]!r} is not supported: only "text"')
  alternatives = data.get('alternatives', 0)
  if isinstance(alternatives, str) and alternatives.isdecimal():
    with contextlib.suppress(ValueError):  # past int's limit of digits: refused below
      alternatives = int(alternatives)
  if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
    raise ApiError(422, 'alternatives: must be a whole number >= 0')
  return [q] if isinstance(q, str) else q, isinstance(q, str), data['source'], data['target'], alternatives


CLIENT_CLOSED = 499  # nginx's status of a request whose client closed the connection before the answer


async def unless_client_leaves(http_request, work):
  """The result of the coroutine `work`; where the client closes its connection first, `work` is cancelled (its
  sentences leave the batcher's queue) and ApiError(499) raised. uvicorn lets a request's handler run on after
  its client has gone."""
  task = asyncio.ensure_future(work)

  async def disconnected():
    while (await http_request.receive())['type'] != 'http.disconnect':
      pass
  watch = asyncio.ensure_future(disconnected())
  try:
    done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
  finally:
    watch.cancel()
    task.cancel()  # nothing where it has finished
  if task not in done:
    await asyncio.gather(task, return_exceptions=True)
    raise ApiError(CLIENT_CLOSED, 'the client closed the connection before the answer')
  return task.result()


def add_api_routes(app, service):
  """POST /v1/translate and GET /v1/models."""
  @app.post('/v1/translate')
  async def translate(request: TranslateRequest, http_request: fastapi.Request):
    """Translates each text (sentences split and rejoined); optional fields only when asked for."""
    name, backend = service.resolve(request.model)
    options = service.options(backend, request.beam_size, request.n_best, request.alpha, request.max_length)
    translations = await unless_client_leaves(http_request, service.translate(
        name, request.text, options, request.n_best, request.return_scores, request.return_attention))
    # Plain JSON (FastAPI's encoder walks every attention weight again, on the event loop).
    return responses.JSONResponse({'model': name, 'translations': translations})

  @app.get('/v1/models')
  async def models():
    """The models served: languages, checkpoint, parameters, config, decode defaults, validation BLEU."""
    return {'models': [dict(name=name, backend=b.name, source_lang=b.source_lang, target_lang=b.target_lang,
                            **b.describe(), defaults=b.defaults(),
                            limits={'max_input_tokens': service.input_limits[name],
                                    'max_sentences': service.settings.max_sentences,
                                    'max_beam_size': service.settings.max_beam_size})
                       for name, b in service.backends.items()]}


def add_libretranslate_routes(app, service):
  """LibreTranslate's POST /translate and GET /languages."""
  @app.post('/translate')
  async def libre_translate(request: fastapi.Request):
    """LibreTranslate's translate: {"q", "source", "target", "format": "text"} -> {"translatedText"}."""
    texts, single, source, target, alternatives = libre_request(await libre_fields(request.scope, await request.body()))
    name, backend = service.by_languages(source, target)
    beam_size = backend.defaults()['beam_size']
    if alternatives >= max(beam_size, 1):
      raise ApiError(400, f'alternatives={alternatives} is over the limit of {max(beam_size - 1, 0)} (the model\'s '
                     f'beam size {beam_size} less one)')
    options = service.options(backend, n_best=alternatives + 1)
    names = ['q'] if single else [f'q[{i}]' for i in range(len(texts))]
    found = await unless_client_leaves(request, service.translate(name, texts, options, n_best=alternatives + 1,
                                                                  names=names))
    translated = [t['text'] for t in found]
    body = {'translatedText': translated[0] if single else translated}
    if alternatives:
      others = [[c['text'] for c in t['n_best'][1:]] for t in found]
      body['alternatives'] = others[0] if single else others
    if source == 'auto':
      detected = {'confidence': 100.0, 'language': backend.source_lang}
      body['detectedLanguage'] = detected if single else [detected] * len(texts)
    return body

  @app.get('/languages')
  async def languages():
    """LibreTranslate's languages: every language served, with the targets it translates to."""
    targets = {}
    for backend in service.backends.values():
      targets.setdefault(backend.source_lang, set()).add(backend.target_lang)
      targets.setdefault(backend.target_lang, set())
    return [{'code': code, 'name': argos.language_name(code), 'targets': sorted(t)}
            for code, t in sorted(targets.items())]


def add_status_routes(app, service, metrics):
  """GET /health, /ready, /metrics, and the page."""
  @app.get('/health')
  async def health():
    if service.warmup_error:  # the process cannot translate: a supervisor should restart it
      return responses.JSONResponse({'status': 'failed', 'reason': service.warmup_error}, 503)
    return {'status': 'ok'}

  @app.get('/ready')
  async def ready():
    if service.ready:
      return {'ready': True}
    reason = service.warmup_error or 'warming up: compiling the searches'
    return responses.JSONResponse({'ready': False, 'reason': reason}, 503)

  @app.get('/metrics')
  async def prometheus_metrics():
    return responses.Response(metrics.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

  @app.get('/', include_in_schema=False)
  async def page():
    return responses.FileResponse(STATIC_DIR / 'index.html')

  app.mount('/static', staticfiles.StaticFiles(directory=STATIC_DIR), name='static')


def create_app(backends, settings=None):
  """The FastAPI application serving `backends` ({name: backend}, batcher.JaxBackend or
  argos.CTranslate2Backend); its lifespan starts the batcher and the warm-up, and drains the queue at the end."""
  settings = settings or Settings()
  if settings.warmup not in WARMUP_LEVELS:
    raise ValueError(f'warmup must be one of {WARMUP_LEVELS}, not {settings.warmup!r}')
  metrics = Metrics()
  service = Service(backends, settings, metrics)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    service.batcher.start()
    warming = asyncio.get_running_loop().create_task(warm_up(service))
    try:
      yield
    finally:
      warming.cancel()  # a warm-up still running is left to its daemon thread
      await service.batcher.close()

  app = fastapi.FastAPI(title='flaxformer_nmt translation server', lifespan=lifespan,
                        description='Translations of the models served, batched across requests.')
  app.state.service, app.state.metrics = service, metrics
  app.add_exception_handler(ApiError, lambda request, e: error_response(request.url.path, e.status, e.message,
                                                                        e.headers))
  app.add_exception_handler(fastapi_exceptions.RequestValidationError, validation_error)
  app.add_exception_handler(starlette_exceptions.HTTPException, http_error)
  add_api_routes(app, service)
  add_libretranslate_routes(app, service)
  add_status_routes(app, service, metrics)
  app.add_middleware(Guard, max_body_bytes=settings.max_body_bytes, keys=Keys(settings.api_keys))
  if settings.cors_origins:
    # A browser shows a page only the headers exposed: a refusal's Retry-After and WWW-Authenticate are not by default.
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=['GET', 'POST'],
                       allow_headers=['Authorization', 'Content-Type'],
                       expose_headers=['Retry-After', 'WWW-Authenticate'])
  routes = {route.path for route in app.routes if hasattr(route, 'path') and route.path != '/static'}
  app.add_middleware(RequestMetrics, metrics=metrics, routes=routes)
  return app
