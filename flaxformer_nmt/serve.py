r"""Serves trained models over HTTP: its own API, LibreTranslate's, metrics and a page (serving/server.py).

  python -m flaxformer_nmt.serve --workdir runs/m30k [--checkpoint averaged] [--host 127.0.0.1] [--port 8000]
  python -m flaxformer_nmt.serve --model en-de=runs/m30k --model de-en=runs/m30k_de_en
  python -m flaxformer_nmt.serve --backend ctranslate2 --model en-de=packages/translate-en_de-1_0.argosmodel

  curl -s localhost:8000/v1/translate -H 'Content-Type: application/json' \
      -d '{"text": ["A man is running."], "beam_size": 4}'

Open http://127.0.0.1:8000/ for the page, /docs for the API. Requests from all clients are batched together
(--max_batch_tokens, --max_wait_ms); /ready answers 200 once the searches are compiled (--warmup). SIGTERM (or
Ctrl-C) stops accepting connections, answers the requests already received, then exits 0. Needs the serve
extra: pip install -e ".[serve]". See docs/serving.md.
"""
import os
import signal
import sys
import threading

from absl import app, flags, logging

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.runtime import cache


def define_flags():
  from flaxformer_nmt.serving import server  # pylint: disable=g-import-not-at-top
  d = server.Settings()
  flags.DEFINE_string('workdir', None, 'A training workdir to serve (named after its languages, e.g. en-de).')
  flags.DEFINE_multi_string('model', [], 'NAME=PATH, repeatable: a workdir (--backend jax) or a CTranslate2 '
                            'export / Argos package (--backend ctranslate2) served as NAME.')
  flags.DEFINE_string('checkpoint', None, 'latest, averaged, best, last:K or a step (default: each workdir\'s '
                      'decode_checkpoint).')
  flags.DEFINE_enum('backend', 'jax', ['jax', 'ctranslate2'], 'jax: this toolkit\'s search on a workdir; '
                    'ctranslate2: an exported model (python -m flaxformer_nmt.export).')
  flags.DEFINE_enum('dtype', None, ['auto', 'float32', 'bfloat16'], 'Compute dtype of decoding (jax backend).')
  flags.DEFINE_string('device', 'cpu', 'ctranslate2 backend: cpu or cuda.')
  flags.DEFINE_integer('threads', 0, 'ctranslate2 backend: intra-op threads (0: its default).', lower_bound=0)
  flags.DEFINE_string('host', '127.0.0.1', 'Address to bind (0.0.0.0 exposes the server to the network).')
  flags.DEFINE_integer('port', 8000, 'Port to bind (0: one the system chooses).', lower_bound=0, upper_bound=65535)
  flags.DEFINE_integer('max_batch_tokens', d.max_batch_tokens, 'Source tokens per decoded batch.', lower_bound=1)
  flags.DEFINE_float('max_wait_ms', d.max_wait_ms, 'After a batch of several requests, how long the next one '
                     'gathers before it decodes (a request to an idle server is decoded at once).', lower_bound=0)
  flags.DEFINE_integer('batches_in_flight', d.batches_in_flight, 'Batches decoding at once, each in a thread of its '
                       'own (while one waits on the host, another computes).', lower_bound=1)
  flags.DEFINE_integer('max_queue', d.max_queue_sentences, 'Sentences waiting at most; more: 503 + Retry-After.',
                       lower_bound=1)
  flags.DEFINE_float('max_queue_wait_s', d.max_queue_wait_s, 'A request the queue would reach later than this '
                     '(at the measured decoding rate) gets 503 + Retry-After at once (0: later than --timeout_s).',
                     lower_bound=0)
  flags.DEFINE_float('timeout_s', d.timeout_s, 'A request not answered by then gets 504.')
  flags.DEFINE_integer('max_input_tokens', d.max_input_tokens, 'Source pieces per sentence at most (413 above).',
                       lower_bound=1)
  flags.DEFINE_integer('max_sentences', d.max_sentences, 'Sentences per request at most (413 above).', lower_bound=1)
  flags.DEFINE_integer('max_body_bytes', d.max_body_bytes, 'Request body size at most (413 above).', lower_bound=1)
  flags.DEFINE_integer('max_beam_size', d.max_beam_size, 'Largest beam_size a request may ask for.', lower_bound=0)
  flags.DEFINE_string('api_keys_file', None, 'A file of API keys, one a line (# comments): every route but '
                      '/health, the page and /docs, /redoc, /openapi.json then needs "Authorization: Bearer KEY".')
  flags.DEFINE_multi_string('cors_origin', [], 'An origin allowed to call the API from a browser (repeatable; '
                            'default: none, CORS off).')
  flags.DEFINE_enum('warmup', d.warmup, ['none', 'full'], 'full: compile (or load from the compilation cache) '
                    'every program the default search of up to --max_input_tokens pieces may run, before /ready; '
                    'none: compile on first use.')
  flags.DEFINE_bool('batch_invariant', False, 'jax backend: translations and scores independent of the other '
                    'requests batched with them, equal to the decode command\'s with --batch_invariant (a CPU with '
                    'bf16 dot, bfloat16 matmul operands); 21-42% fewer sentences/s (bench/RESULTS.md).')
  flags.DEFINE_float('switch_interval_ms', 1.0, 'Python\'s thread switch interval (its default: 5 ms).')
  flags.DEFINE_float('graceful_timeout_s', 60.0, 'On SIGTERM, how long to wait for the requests in flight.',
                     lower_bound=0)
  flags.DEFINE_float('keep_alive_s', 75.0, 'How long an idle connection stays open. Longer than the clients\' and '
                     'load balancers\' idle timeouts (httpx: 5 s, AWS ALB: 60 s), so that the server never closes a '
                     'connection a client is sending its next request on (the client would see a reset).',
                     lower_bound=0)
  for name in ('timeout_s', 'switch_interval_ms'):  # 0: every request would time out; Python refuses it
    flags.register_validator(name, lambda value: value > 0, message=f'--{name} must be > 0')


def read_api_keys(path):
  """The keys of an --api_keys_file: one a line, blank lines and # comments skipped."""
  with open(path, encoding='utf-8') as f:
    keys = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith('#'))
  if not keys:
    raise ValueError(f'{path} holds no API key')
  return keys


def model_paths(FLAGS):  # pylint: disable=invalid-name
  """[(name, path)] of --workdir and the --model NAME=PATH flags."""
  models = []
  for spec in FLAGS.model:
    name, sep, path = spec.partition('=')
    if not sep or not name or not path:
      raise ValueError(f'--model {spec!r}: give NAME=PATH')
    models.append((name, path))
  if FLAGS.workdir:
    from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    config = workdir_lib.load_config(FLAGS.workdir)
    models.insert(0, (f'{config.source_lang}-{config.target_lang}', FLAGS.workdir))
  if not models:
    raise ValueError('nothing to serve: give --workdir or --model NAME=PATH')
  names = [name for name, _ in models]
  if len(set(names)) != len(names):
    raise ValueError(f'two models share a name: {names} (use --model NAME=PATH)')
  return models


def load_backends(FLAGS):  # pylint: disable=invalid-name
  from flaxformer_nmt.serving import argos, batcher  # pylint: disable=g-import-not-at-top
  backends = {}
  for name, path in model_paths(FLAGS):
    if FLAGS.backend == 'ctranslate2':
      backends[name] = argos.CTranslate2Backend(path, device=FLAGS.device, threads=FLAGS.threads)
    else:
      backends[name] = batcher.JaxBackend(path, FLAGS.checkpoint, dtype=FLAGS.dtype,
                                          batch_invariant=FLAGS.batch_invariant)
    logging.info('Serving %s: %s of %s (%s)', name, backends[name].checkpoint, path, FLAGS.backend)
  return backends


def settings_of(FLAGS):  # pylint: disable=invalid-name
  from flaxformer_nmt.serving import server  # pylint: disable=g-import-not-at-top
  return server.Settings(
      max_batch_tokens=FLAGS.max_batch_tokens, max_wait_ms=FLAGS.max_wait_ms,
      batches_in_flight=FLAGS.batches_in_flight, max_queue_sentences=FLAGS.max_queue,
      max_queue_wait_s=FLAGS.max_queue_wait_s, timeout_s=FLAGS.timeout_s, max_input_tokens=FLAGS.max_input_tokens,
      max_sentences=FLAGS.max_sentences, max_body_bytes=FLAGS.max_body_bytes, max_beam_size=FLAGS.max_beam_size,
      api_keys=read_api_keys(FLAGS.api_keys_file) if FLAGS.api_keys_file else (),
      cors_origins=tuple(FLAGS.cors_origin), warmup=FLAGS.warmup)


# The flags one backend reads alone.
BACKEND_FLAGS = {'checkpoint': 'jax', 'dtype': 'jax', 'batch_invariant': 'jax', 'device': 'ctranslate2',
                 'threads': 'ctranslate2'}


def main(argv):
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  for name, backend in BACKEND_FLAGS.items():  # a flag of the other backend would be ignored
    if FLAGS[name].present and FLAGS.backend != backend:
      raise app.UsageError(f'--{name} is the {backend} backend\'s: not with --backend {FLAGS.backend}')
  try:
    import uvicorn  # pylint: disable=g-import-not-at-top
    from flaxformer_nmt.serving import server  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    sys.exit(f'error: serving needs the serve extra ({e}): pip install -e ".[serve]"')
  checkpoints_lib.quiet_orbax_logs()
  cache.use_compilation_cache()
  # The event loop (HTTP, queueing, refusals) and the search's host loop share the GIL: a short switch interval
  # lets the event loop take requests in while a batch decodes.
  sys.setswitchinterval(FLAGS.switch_interval_ms / 1000)
  try:
    application = server.create_app(load_backends(FLAGS), settings_of(FLAGS))
  except (OSError, ValueError) as e:
    sys.exit(f'error: {e}')
  config = uvicorn.Config(application, host=FLAGS.host, port=FLAGS.port, log_level='info',
                          timeout_graceful_shutdown=FLAGS.graceful_timeout_s, timeout_keep_alive=FLAGS.keep_alive_s)
  logging.info('Listening on http://%s:%d/', FLAGS.host, FLAGS.port)
  # uvicorn drains on SIGTERM and SIGINT (Ctrl-C), restores the handlers it found and raises the signal again:
  # with these the drained server then exits 0 instead of dying of the signal (or of a KeyboardInterrupt).
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda signum, frame: None)
  uvicorn.Server(config).run()
  logging.info('Stopped.')
  if any(t.name == server.WARM_UP_THREAD and t.is_alive() for t in threading.enumerate()):
    # Stopped while compiling: the interpreter's finalization would abort inside XLA (exit 134).
    logging.flush()
    os._exit(0)  # pylint: disable=protected-access


if __name__ == '__main__':
  define_flags()
  app.run(main)
