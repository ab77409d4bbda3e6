"""The translation server (serving/server.py, batcher.py) on a toy trained workdir: every answer equals the offline
decode of the same sentences and options, also when many requests are batched together; each error has its
status and message; keys, CORS, LibreTranslate's API, metrics, readiness and the SIGTERM drain."""
import concurrent.futures
import itertools
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import conftest
import in_process
from conftest import built_once, small_config, write_toy_corpus

fastapi = pytest.importorskip('fastapi')
httpx = pytest.importorskip('httpx')
pytest.importorskip('prometheus_client')

from fastapi.testclient import TestClient  # pylint: disable=g-import-not-at-top,wrong-import-position

from flaxformer_nmt import decode as decode_command  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.evaluation import attention as attention_lib  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.serving import batcher as batcher_lib  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.serving import server  # pylint: disable=g-import-not-at-top,wrong-import-position
from flaxformer_nmt.training import loop as train  # pylint: disable=g-import-not-at-top,wrong-import-position

SENTENCES = ['a big dog runs .', 'the small red cat sleeps .', 'a man sees the ball .', 'the cat runs .',
             'a red ball', 'the big man sleeps . a dog sees the small cat .', 'dog', 'a small man sees a big red dog .']


def trained_workdir(tmp_path_factory):
  """A toy model trained long enough that different sentences translate differently; trained once per pytest
  run (test_argos.py and test_serve_browser.py serve it too)."""
  return built_once(tmp_path_factory, 'served_model', _train_served_model) / 'run'


def _train_served_model(root):
  config = small_config(write_toy_corpus(root / 'data'))
  config.num_train_steps = config.checkpoint_every_steps = config.eval_every_steps = 60
  config.learning_rate_scale = 0.5  # at 2.0 the toy stalls at one output on some stacks (jax 0.10.2)
  train.train_and_evaluate(config, str(root / 'run'))


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  return trained_workdir(tmp_path_factory)


@pytest.fixture(scope='module')
def backend(workdir):
  return batcher_lib.JaxBackend(workdir)


@pytest.fixture(scope='module')
def translator(backend):
  return backend.translator


def client(backends, **settings):
  """A TestClient (use it in `with`: the lifespan starts the batcher) of an app with no warm-up, batching as
  the offline decode does (small_config's decode_tokens_per_batch): both run the same compiled searches."""
  settings.setdefault('warmup', 'none')
  settings.setdefault('max_batch_tokens', 256)
  return TestClient(server.create_app(backends, server.Settings(**settings)))


def expected(translator, sentences, beam_size=None, alpha=None, n_best=1, max_length=None):
  """The offline decode of `sentences` with a request's options: [(text, score)] or [[(text, score)]]."""
  lengths = {} if max_length is None else {'max_len_a': 0, 'max_len_b': max_length}
  return translator.translate(sentences, beam_size=beam_size, alpha=alpha, n_best=n_best, return_scores=True,
                              **lengths)


def test_the_toy_model_translates_sentences_differently(translator):
  # Otherwise a server that swapped answers between sentences or requests would still pass.
  assert len(set(translator.translate(SENTENCES[:5]))) >= 4


REQUEST_OPTIONS = [{}, {'beam_size': 2}, {'beam_size': 0}, {'beam_size': 3, 'n_best': 2}, {'alpha': 0.0},
                   {'max_length': 3, 'beam_size': 2}, {'beam_size': 2, 'alpha': 1.5, 'n_best': 2}]


def check_answers(translator, payloads, answers):
  """Each /v1/translate answer against the offline decode of its texts (single sentences) with its options."""
  offline = {}
  for payload in payloads:
    options = tuple(sorted((k, payload[k]) for k in ('beam_size', 'alpha', 'n_best', 'max_length') if k in payload))
    if options not in offline:
      offline[options] = dict(zip(SINGLE, expected(translator, SINGLE, **dict(options))))
    n_best = dict(options).get('n_best', 1)
    assert len(answers[payloads.index(payload)]['translations']) == len(payload['text'])
    for entry, text in zip(answers[payloads.index(payload)]['translations'], payload['text']):
      hyps = offline[options][text] if n_best > 1 else [offline[options][text]]
      assert entry['text'] == hyps[0][0]
      assert entry['score'] == pytest.approx(hyps[0][1], abs=1e-4)
      if n_best > 1:
        assert [c['text'] for c in entry['n_best']] == [t for t, _ in hyps]
        np.testing.assert_allclose([c['score'] for c in entry['n_best']], [s for _, s in hyps], atol=1e-4)
      else:
        assert 'n_best' not in entry


SINGLE = [s for s in SENTENCES if s.count('.') <= 1]


def test_many_concurrent_mixed_requests_get_the_offline_decode(backend, translator):
  rng = np.random.default_rng(0)
  payloads = []
  for i in range(28):
    texts = [SINGLE[j] for j in rng.choice(len(SINGLE), size=rng.integers(1, 4))]
    payloads.append(dict(REQUEST_OPTIONS[i % len(REQUEST_OPTIONS)], text=texts, return_scores=True))
  # The first requests compile their searches: a long timeout.
  with client({'en-de': backend}, max_wait_ms=300, timeout_s=600) as c:
    with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
      answers = list(pool.map(lambda p: c.post('/v1/translate', json=p), payloads))
    metrics = c.get('/metrics').text
  assert [a.status_code for a in answers] == [200] * len(payloads), [a.text for a in answers if a.status_code != 200]
  assert {a.json()['model'] for a in answers} == {'en-de'}
  check_answers(translator, payloads, [a.json() for a in answers])
  batches = metric(metrics, 'flaxformer_nmt_batch_sentences_count')
  assert batches < len(payloads) - 10  # requests shared batches
  assert metric(metrics, 'flaxformer_nmt_batch_sentences_sum') == sum(len(p['text']) for p in payloads)


def test_default_answers_equal_the_decode_command(workdir, backend):
  result = in_process.run(decode_command, [f'--workdir={workdir}'], stdin=''.join(s + '\n' for s in SENTENCES[:5]))
  assert result.returncode == 0, result.stderr[-2000:]
  with client({'en-de': backend}) as c:
    answer = c.post('/v1/translate', json={'text': SENTENCES[:5]})
  assert [t['text'] for t in answer.json()['translations']] == result.stdout.splitlines()
  assert answer.json()['translations'][0].keys() == {'text'}  # optional fields only when asked for


def test_batch_invariant_answers_are_asked_of_the_jax_search_and_refused_where_it_cannot_give_them(workdir):
  # The flag reaches the jax backend's Translator (which refuses the toy's float32 matmuls, whose kernels change
  # with the row count), and a CTranslate2 backend refuses it rather than ignoring it.
  from flaxformer_nmt import serve as serve_command  # pylint: disable=g-import-not-at-top
  result = in_process.run(serve_command, [f'--workdir={workdir}', '--batch_invariant', '--warmup=none'])
  assert result.returncode != 0 and 'bfloat16 matmul operands' in result.stderr
  # Wrong rule caught: --checkpoint, --dtype (the jax backend's), --device and --threads (CTranslate2's) were
  # ignored by the other backend; a user asking for a checkpoint got another model's answers without a word.
  for flag, backend, other in (('--batch_invariant', 'jax', 'ctranslate2'), ('--checkpoint=best', 'jax', 'ctranslate2'),
                               ('--dtype=float32', 'jax', 'ctranslate2'), ('--device=cuda', 'ctranslate2', 'jax'),
                               ('--threads=2', 'ctranslate2', 'jax')):
    result = in_process.run(serve_command, [f'--model=en-de={workdir}', f'--backend={other}', flag])
    name = flag.split('=')[0]
    assert result.returncode != 0 and f'{name} is the {backend} backend\'s: not with --backend {other}' in result.stderr


def serve_until_it_would_listen(args, monkeypatch):
  """The serve command's main on `args` in this process, up to the uvicorn server it would start, which serves
  nothing: (its CompletedProcess, the uvicorn.Config options it gave, with the app)."""
  uvicorn = pytest.importorskip('uvicorn')
  from flaxformer_nmt import serve as serve_command  # pylint: disable=g-import-not-at-top
  started = []

  class Server:
    def __init__(self, config):
      started.append(config)

    def run(self):
      pass
  monkeypatch.setattr(uvicorn, 'Config', lambda app, **options: dict(options, app=app))
  monkeypatch.setattr(uvicorn, 'Server', Server)
  monkeypatch.setattr(signal, 'signal', lambda *args: None)  # the test process's handlers stay
  result = in_process.run(serve_command, args)
  assert result.returncode == 0, result.stderr[-2000:]
  return result, started[0]


def test_the_serve_commands_flags_reach_the_servers_settings(workdir, tmp_path, monkeypatch):
  # Wrong rules caught: a flag dropped or read into another field (--api_keys_file ignored left the server open to
  # anyone; --cors_origin, --max_queue, --max_queue_wait_s, --max_beam_size silently at their defaults), a comment
  # line of the keys file taken as a key, --workdir's model not the default beside --model ones.
  (tmp_path / 'keys').write_text('# the operators\nfirst-key\n\n  second-key  \n')
  values = {'max_batch_tokens': 300, 'max_wait_ms': 7.5, 'max_queue': 40, 'max_queue_wait_s': 1.5, 'timeout_s': 12.0,
            'max_input_tokens': 50, 'max_sentences': 9, 'max_body_bytes': 5000, 'max_beam_size': 3,
            'warmup': 'none', 'graceful_timeout_s': 4.0, 'keep_alive_s': 9.0}
  _, config = serve_until_it_would_listen(
      [f'--workdir={workdir}', f'--model=second={workdir}', f'--api_keys_file={tmp_path / "keys"}',
       '--cors_origin=http://a.test', '--cors_origin=http://b.test',
       *(f'--{name}={value}' for name, value in values.items())], monkeypatch)
  assert list(config['app'].state.service.backends) == ['en-de', 'second']  # --workdir's the default model
  assert config['app'].state.service.settings == server.Settings(
      max_batch_tokens=300, max_wait_ms=7.5, max_queue_sentences=40, max_queue_wait_s=1.5, timeout_s=12.0,
      max_input_tokens=50, max_sentences=9, max_body_bytes=5000, max_beam_size=3, api_keys=('first-key', 'second-key'),
      cors_origins=('http://a.test', 'http://b.test'), warmup='none')
  batcher = config['app'].state.service.batcher  # milliseconds to seconds (wrong rule caught: / 100)
  assert (batcher.max_batch_tokens, batcher.max_wait_s, batcher.max_queue_sentences, batcher.max_queue_wait_s) == (
      300, 7.5 / 1000, 40, 1.5)
  assert (config['timeout_graceful_shutdown'], config['timeout_keep_alive']) == (4.0, 9.0)


def test_paragraphs_are_split_into_sentences_and_rejoined_and_empty_texts_stay_empty(backend, translator):
  texts = ['a big dog runs . The small cat sleeps .', '', '   ', 'a red ball\nthe cat runs .\n\ndog']
  with client({'en-de': backend}) as c:
    answer = c.post('/v1/translate', json={'text': texts, 'return_scores': True}).json()['translations']
  first = expected(translator, ['a big dog runs .', 'The small cat sleeps .'])
  assert answer[0]['text'] == f'{first[0][0]} {first[1][0]}'
  assert answer[0]['score'] == pytest.approx(first[0][1] + first[1][1], abs=1e-4)
  assert answer[1] == {'text': '', 'score': 0.0} and answer[2] == {'text': '', 'score': 0.0}
  lines = [text for text, _ in expected(translator, ['a red ball', 'the cat runs .', 'dog'])]
  assert answer[3]['text'] == f'{lines[0]}\n{lines[1]}\n\n{lines[2]}'


def test_a_texts_n_best_are_its_best_choices_of_one_candidate_per_sentence(backend, translator):
  # The k-th candidate of every sentence together is not the text's k-th best: its second best changes one
  # sentence, not all of them. Against every combination of the sentences' candidates, ranked by summed score.
  sentences = ['a big dog runs .', 'The small cat sleeps .', 'A man sees the ball .']
  with client({'en-de': backend}) as c:
    entry = c.post('/v1/translate', json={'text': [' '.join(sentences)], 'beam_size': 3, 'n_best': 3,
                                          'return_scores': True}).json()['translations'][0]
  hyps = expected(translator, sentences, beam_size=3, n_best=3)
  combinations = sorted(itertools.product(*hyps), key=lambda c: -sum(score for _, score in c))[:3]
  assert [c['text'] for c in entry['n_best']] == [' '.join(text for text, _ in c) for c in combinations]
  np.testing.assert_allclose([c['score'] for c in entry['n_best']],
                             [sum(score for _, score in c) for c in combinations], atol=1e-4)
  assert entry['text'] == entry['n_best'][0]['text']


def test_best_combinations_ranks_like_every_combination_sorted():
  rng = np.random.default_rng(0)
  for sizes in ([3, 3, 3], [1, 4], [2], [5, 1, 2, 3]):
    lists = [sorted(rng.normal(size=n).tolist(), reverse=True) for n in sizes]
    every = sorted(itertools.product(*[range(n) for n in sizes]),
                   key=lambda c: -sum(lists[s][k] for s, k in enumerate(c)))
    n = min(4, len(every))
    found = server.best_combinations(lists, n)
    assert [indices for indices, _ in found] == every[:n], sizes
    np.testing.assert_allclose([score for _, score in found], [sum(lists[s][k] for s, k in enumerate(c))
                                                               for c in every[:n]])


def test_split_sentences_keeps_abbreviations_and_lower_case_continuations():
  assert server.split_text('Mr. Smith runs. He sees it! "Yes," she says.\nno. break here') == [
      ['Mr. Smith runs.', 'He sees it!', '"Yes," she says.'], ['no. break here']]
  assert server.split_text('') == [['']]
  # An acronym written with periods and ending in capitals is no sentence end (Multi30k's test2016 line 361),
  # also in brackets; the sentence after it still splits, and so does one after "p.m." (lower case, as Moses).
  assert server.split_text('A sign says E.S.E. Electronics. The (U.S.) Army came. It left at 5 p.m. Then') == [
      ['A sign says E.S.E. Electronics.', 'The (U.S.) Army came.', 'It left at 5 p.m.', 'Then']]
  # Runs of marks end a sentence once; an abbreviation is found after a long sentence, and none across the start
  # of its sentence (the last word is read from a window of the line's last characters).
  assert server.split_text('It ends... Then more!!! And?! So ' + '.' * 5000) == [
      ['It ends...', 'Then more!!!', 'And?!', 'So ' + '.' * 5000]]
  long = 'A ' + 'very ' * 40 + 'long line by Dr. Who. Dr. Nobody came. Then'
  assert server.split_text(long) == [[long[:long.index(' Dr. Nobody')], 'Dr. Nobody came.', 'Then']]
  # "No." and "Nr." hold a sentence together before a number only (Moses' rule); a lone digit is no initial.
  assert server.split_text('Is it raining? No. It is sunny. See No. 5 and J. Smith. He counted to 3. Then') == [
      ['Is it raining?', 'No.', 'It is sunny.', 'See No. 5 and J. Smith.', 'He counted to 3.', 'Then']]


def test_attention_is_the_teacher_forced_cross_attention_of_the_answer(backend, translator):
  sentence = 'a small man sees a big red dog .'
  with client({'en-de': backend}) as c:
    one = c.post('/v1/translate', json={'text': [sentence], 'return_attention': True}).json()['translations'][0]
    two = c.post('/v1/translate', json={'text': ['a red ball . ' + sentence.capitalize()],
                                        'return_attention': True}).json()['translations'][0]
    # With the n best too, the attention is the best translation's (wrong rule caught: another hypothesis's).
    n_best = c.post('/v1/translate', json={'text': [sentence], 'return_attention': True, 'n_best': 3}).json()[
        'translations'][0]
  reference = attention_lib.attention_maps(translator, [sentence])[0]
  assert one['text'] == reference['translation'] == n_best['text']
  for attention in (one['attention'], n_best['attention']):
    assert attention['source_tokens'] == reference['source_pieces']
    assert attention['target_tokens'] == reference['target_pieces']
    np.testing.assert_allclose(attention['weights'], reference['cross'].mean(axis=1), atol=2e-6)
  # Two sentences: each one's map on the diagonal, nothing between them.
  first = attention_lib.attention_maps(translator, ['a red ball .'])[0]
  weights = np.asarray(two['attention']['weights'])
  t, s = len(first['target_pieces']), len(first['source_pieces'])
  assert two['attention']['source_tokens'][:s] == first['source_pieces']
  np.testing.assert_allclose(weights[:, :t, :s], first['cross'].mean(axis=1), atol=2e-6)
  assert not weights[:, :t, s:].any() and not weights[:, t:, :s].any()
  np.testing.assert_allclose(weights[:, t:, s:].sum(axis=-1), 1.0, atol=1e-4)


def metric(text, name, **labels):
  """The value of one sample of the Prometheus text `text` (0 where absent)."""
  wanted = ','.join(f'{k}="{v}"' for k, v in sorted(labels.items()))
  for line in text.splitlines():
    match = re.fullmatch(r'([a-z_]+)(?:\{(.*)\})? (\S+)', line)
    if match and match.group(1) == name and ','.join(sorted((match.group(2) or '').split(','))).strip(',') == wanted:
      return float(match.group(3))
  return 0.0


BAD_REQUESTS = [  # (body, status, message)
    (b'{"text": [', 422, 'the body is not valid JSON (Expecting value at position 10)'),
    (json.dumps({'text': ['a dog'], 'beam_size': 'four'}), 422, 'beam_size: Input should be a valid integer'),
    (json.dumps({'text': ['a dog', 3]}), 422, 'text.1: Input should be a valid string'),
    (json.dumps({'text': 'a dog'}), 422, 'text: Input should be a valid list'),
    (json.dumps({'text': ['a dog'], 'beam': 2}), 422, 'beam: Extra inputs are not permitted'),
    (json.dumps({'beam_size': 2}), 422, 'text: Field required'),
    (json.dumps({'text': ['a dog'], 'beam_size': -1}), 422, 'beam_size: Input should be greater than or equal to 0'),
    (b'{"text": ["a \xff dog"]}', 400, 'the request body is not valid UTF-8 (invalid start byte at byte 13)'),
    (json.dumps({'text': ['a dog'], 'beam_size': 9}), 400, 'beam_size=9 is over the server\'s limit '
     '--max_beam_size=8'),
    (json.dumps({'text': ['a dog'], 'beam_size': 2, 'n_best': 3}), 400, 'n_best=3 must be between 1 and the beam '
     'size (2)'),
    (json.dumps({'text': ['a dog'], 'max_length': 1024}), 400, 'max_length=1024 is over the model\'s limit of '
     '1023 target pieces'),
    (json.dumps({'text': ['a .', 'b .', 'c . D .']}), 413, 'the request holds 4 sentences; the limit is '
     '--max_sentences=3'),
    (json.dumps({'model': 'fr-en', 'text': ['a dog']}), 404, 'model \'fr-en\' is not served; this server serves '
     'en-de (en->de)'),
    (json.dumps({'text': ['a dog' * 60]}), 413, 'the request body is over the limit of 200 bytes (--max_body_bytes)'),
    # JSON may escape a lone surrogate, which no tokenizer takes (was a plain-text 500).
    ('{"text": ["a dog", "a \\ud800 dog"]}', 400, 'text[1] is not valid Unicode (surrogates not allowed at character '
     '2)'),
    ('{"text": ["a dog"], "alpha": Infinity}', 422, 'alpha: Input should be a finite number'),
    # A finite alpha past float32's powers zeroes every score: the beam then ranks nothing.
    (json.dumps({'text': ['a dog'], 'alpha': 1e308}), 422, 'alpha: Input should be less than or equal to 10'),
]


@pytest.mark.parametrize('body,status,message', BAD_REQUESTS)
def test_bad_requests_get_one_clear_error(backend, body, status, message):
  with client({'en-de': backend}, max_input_tokens=12, max_sentences=3, max_body_bytes=200) as c:
    answer = c.post('/v1/translate', content=body, headers={'Content-Type': 'application/json'})
    assert (answer.status_code, answer.json()) == (status, {'detail': message})
    assert c.post('/v1/translate', json={'text': ['a dog']}).status_code == 200  # and the server goes on


def test_a_request_exactly_at_a_limit_is_served(backend):
  # The limits are inclusive, as --help says ("at most"). Wrong rules caught: a body of exactly --max_body_bytes
  # refused (by its Content-Length, or counted as it streams in without one), beam_size=--max_beam_size refused.
  body = json.dumps({'text': ['a dog'], 'beam_size': 2}).encode()
  headers = {'Content-Type': 'application/json'}
  with client({'en-de': backend}, max_body_bytes=len(body), max_beam_size=2) as c:
    assert c.post('/v1/translate', content=body, headers=headers).status_code == 200
    assert c.post('/v1/translate', content=iter([body[:9], body[9:]]), headers=headers).status_code == 200  # chunked
    assert c.post('/v1/translate', content=body + b' ', headers=headers).status_code == 413
    assert c.post('/v1/translate', content=iter([body, b' ']), headers=headers).status_code == 413


def test_bodies_fastapi_cannot_parse_get_an_error_naming_the_problem(backend):
  with client({'en-de': backend}) as c:
    deep = c.post('/v1/translate', content='{"text": ' + '[' * 100_000, headers={'Content-Type': 'application/json'})
    form = c.post('/v1/translate', content='{"text": ["a dog"]}',  # curl -d without -H sends it so
                  headers={'Content-Type': 'application/x-www-form-urlencoded'})
    assert c.post('/v1/nothing').json() == {'detail': 'Not Found'}  # FastAPI's other errors as they were
  assert deep.status_code == 422
  assert deep.json()['detail'].startswith('the body is not valid JSON (maximum recursion depth exceeded')
  assert (form.status_code, form.json()) == (415, {'detail': 'send the body as JSON with Content-Type: '
                                                             'application/json (this request has Content-Type '
                                                             'application/x-www-form-urlencoded)'})


def test_line_breaks_come_back_as_they_were_sent(backend, translator):
  want = [text for text, _ in expected(translator, ['a red ball', 'the cat runs .', 'dog'])]
  with client({'en-de': backend}) as c:
    texts = ['a red ball\r\nthe cat runs .\r\n\r\ndog', 'a red ball\rdog\n']
    texts = [t['text'] for t in c.post('/v1/translate', json={'text': texts}).json()['translations']]
  assert texts == [want[0] + '\r\n' + want[1] + '\r\n\r\n' + want[2], want[0] + '\r' + want[2] + '\n']


def test_blank_lines_and_empty_texts_count_against_no_limit(backend):
  with client({'en-de': backend}, max_sentences=2) as c:
    answer = c.post('/v1/translate', json={'text': ['', '\n' * 50, 'a dog . The cat runs .'] + [''] * 50})
  assert answer.status_code == 200 and [t['text'] for t in answer.json()['translations']][:2] == ['', '\n' * 50]


@pytest.mark.parametrize('right_to_left, written, rows', [
    (False, ([11, 4, 10, 3], [13, 14, 15, 6, 9, 3]), ([0, 1, 2, 3], [0, 1, 2, 3, 4, 5])),
    # Read "11 4 10 </s>", written "10 4 11 </s>": piece 11 was predicted at step 2, EOS last.
    (True, ([10, 4, 11, 3], [9, 6, 15, 14, 13, 3]), ([2, 1, 0, 3], [4, 3, 2, 1, 0, 5]))])
def test_backend_attention_is_the_numpy_head_mean_of_each_layer_in_reading_order(right_to_left, written, rows):
  """JaxBackend.attention of a 2-layer, 4-head model against the NumPy cross-attention of that model teacher-forced
  on BOS + the target as the model writes it (right to left: reversed before EOS), averaged over heads, its rows
  in reading order: row t is the attention while the model predicted piece t of the answer. Catches layers in
  another order, a mean over layers or over the source instead of the heads, teacher forcing in reading order or
  without BOS, and rows left in the model's order or turned with EOS."""
  from test_against_numpy import np_transformer  # pylint: disable=g-import-not-at-top
  model, params = conftest.tiny_model()
  params = conftest.distinct_vectors(params)
  backend = batcher_lib.JaxBackend.__new__(batcher_lib.JaxBackend)  # the model alone, without a workdir
  backend.config = types.SimpleNamespace(target_right_to_left=right_to_left)
  backend.translator = types.SimpleNamespace(model=model, params=params)
  sources, targets = [[5, 9, 7, 12, 3], [8, 6, 3]], [[11, 4, 10, 3], [13, 14, 15, 6, 9, 3]]
  got = backend.attention(sources, targets)
  for source, target_in_model_order, order, weights in zip(sources, written, rows, got):
    found = {}
    np_transformer(params, np.array(source), np.array([2] + target_in_model_order[:-1]),
                   heads=model.config.num_heads, pre_ln=False, weights=found)
    layers = [np.mean(found[('decoder', layer, 'cross_attention')], axis=0) for layer in range(2)]  # [T, S] each
    np.testing.assert_allclose(weights, np.stack([layer[order] for layer in layers]), atol=1e-5)


def test_attention_larger_than_the_limit_is_refused_naming_it(backend, monkeypatch):
  sentence = 'a small man sees a big red dog .'
  with client({'en-de': backend}) as c:
    weights = np.asarray(c.post('/v1/translate', json={'text': [sentence], 'return_attention': True}).json()[
        'translations'][0]['attention']['weights'])
    monkeypatch.setattr(server, 'MAX_ATTENTION_WEIGHTS', 2 * weights.size - 1)
    # Two texts of the same sentence: 2 x the weights (a rule that counted one text, or the sources only, passes).
    refused = c.post('/v1/translate', json={'text': [sentence] * 2, 'return_attention': True})
    assert (refused.status_code, refused.json()) == (413, {'detail': (
        f'return_attention: the attention of this request holds {2 * weights.size} weights; the limit is '
        f'{2 * weights.size - 1} (ask for fewer or shorter texts at a time)')})
    assert c.post('/v1/translate', json={'text': [sentence] * 2}).status_code == 200
    monkeypatch.setattr(server, 'MAX_ATTENTION_WEIGHTS', 2 * weights.size)  # at the limit: served (not >=)
    assert c.post('/v1/translate', json={'text': [sentence] * 2, 'return_attention': True}).status_code == 200


def test_the_attention_limit_counts_every_decoder_layer(monkeypatch):
  """A text of two sentences from a 6-layer model, [6, 3, 4] and [6, 2, 5]: its picture is 6 layers x (3 + 2)
  target x (4 + 5) source pieces = 270 weights, refused over a limit of 269 and served at 270. Catches the layers
  left out of the count (the toy served above has one decoder layer)."""
  answers = [batcher_lib.Sentence([([7, 3], -1.0)], np.zeros((6, 3, 4), np.float32)),
             batcher_lib.Sentence([([8, 3], -1.0)], np.zeros((6, 2, 5), np.float32))]
  monkeypatch.setattr(server, 'MAX_ATTENTION_WEIGHTS', 269)
  with pytest.raises(server.ApiError, match='holds 270 weights; the limit is 269') as refused:
    server.check_attention_size([[[0, 1]]], answers)
  assert refused.value.status == 413
  monkeypatch.setattr(server, 'MAX_ATTENTION_WEIGHTS', 270)
  server.check_attention_size([[[0, 1]]], answers)


def test_the_token_limit_counts_the_model_pieces_and_a_longer_sentence_is_refused_not_cut(backend):
  pieces = len(backend.encode(['a big red dog sees the small cat .'])[0]) - 1
  with client({'en-de': backend}, max_input_tokens=pieces) as c:
    assert c.post('/v1/translate', json={'text': ['a big red dog sees the small cat .']}).status_code == 200
    answer = c.post('/v1/translate', json={'text': ['dog', 'a big red dog sees the small cat . .']})
  assert (answer.status_code, answer.json()) == (413, {'detail': (
      f'text[1] has a sentence of {pieces + 1} tokens; the limit is {pieces} (--max_input_tokens={pieces}, and what '
      'the model holds)')})


def test_a_sentence_longer_than_the_models_positions_allow_is_refused_not_cut(workdir, tmp_path):
  # A model of 24 positions with max_decode_extra_length 10 translates sources of 24 - 10 = 14 tokens, EOS included,
  # whole: 13 pieces (the search cuts longer ones to that, fit_to_positions). Wrong rule caught: a limit one piece
  # over, whose sentences were then cut silently, their last piece untranslated.
  shutil.copytree(workdir, tmp_path / 'run')
  config = json.loads((tmp_path / 'run' / 'config.json').read_text())
  config['model']['max_position'], config['max_length'] = 24, 24  # sinusoids: no parameter changes
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(config))
  with client({'en-de': batcher_lib.JaxBackend(tmp_path / 'run')}, max_input_tokens=100) as c:
    limit = c.get('/v1/models').json()['models'][0]['limits']['max_input_tokens']
    refused = c.post('/v1/translate', json={'text': ['a big dog runs and the small red cat sleeps near a man .']})
  assert limit == 24 - 10 - 1
  assert refused.status_code == 413 and 'the limit is 13 (--max_input_tokens=100' in refused.json()['detail']


class Gate:
  """A backend whose batches wait until released (and whose first batches may raise)."""

  def __init__(self, backend, failures=0):
    self.backend, self.failures = backend, failures
    self.entered, self.release = threading.Event(), threading.Event()
    self.warm_release = threading.Event()

  def __getattr__(self, name):
    return getattr(self.backend, name)

  def run(self, *args):
    self.entered.set()
    assert self.release.wait(30)
    if self.failures:
      self.failures -= 1
      raise RuntimeError('the device fell over')
    return self.backend.run(*args)

  def warm_up(self, *args):
    assert self.warm_release.wait(30)


def wait_until(condition, timeout=20):
  deadline = time.time() + timeout
  while not condition():
    assert time.time() < deadline, 'timed out'
    time.sleep(0.01)


def test_a_full_queue_answers_503_with_retry_after_and_the_queued_requests_still_get_answers(backend, translator):
  gate = Gate(backend)
  with client({'en-de': gate}, max_queue_sentences=2, max_wait_ms=0, batches_in_flight=1) as c, \
       concurrent.futures.ThreadPoolExecutor(2) as pool:
    first = pool.submit(c.post, '/v1/translate', json={'text': ['a big dog runs .']})
    assert gate.entered.wait(20)  # decoding, blocked
    second = pool.submit(c.post, '/v1/translate', json={'text': ['the cat runs .', 'a red ball']})
    service = c.app.state.service
    wait_until(lambda: service.batcher.queued_sentences == 2)
    refused = c.post('/v1/translate', json={'text': ['dog']})
    assert refused.status_code == 503
    assert refused.json()['detail'] == 'the queue is full (2 sentences waiting, at most 2)'
    assert int(refused.headers['Retry-After']) >= 1
    gate.release.set()
    assert first.result().json()['translations'][0]['text'] == expected(translator, ['a big dog runs .'])[0][0]
    assert [t['text'] for t in second.result().json()['translations']] == [
        text for text, _ in expected(translator, ['the cat runs .', 'a red ball'])]


def test_a_queue_that_would_take_too_long_to_reach_a_request_answers_503_at_once(backend):
  gate = Gate(backend)
  with client({'en-de': gate}, max_queue_wait_s=1.0, max_wait_ms=0, batches_in_flight=1) as c, \
       concurrent.futures.ThreadPoolExecutor(2) as pool:
    service = c.app.state.service
    decoding = pool.submit(c.post, '/v1/translate', json={'text': ['a big dog runs .']})
    assert gate.entered.wait(20)
    service.batcher.measured_rate(10.0)  # source tokens per second
    sentence = 'the cat runs .'
    tokens = len(backend.encode([sentence])[0])
    queued = pool.submit(c.post, '/v1/translate', json={'text': [sentence]})
    wait_until(lambda: service.batcher.queued_sentences == 1)
    refused = c.post('/v1/translate', json={'text': [sentence]})
    assert refused.json() == {'detail': f'the queue would take about {2 * tokens / 10:.1f} s to reach this request, '
                                        'over the limit of 1 s'}
    assert (refused.status_code, refused.headers['Retry-After']) == (503, str(math.ceil(2 * tokens / 10 - 1)))
    gate.release.set()
    assert decoding.result().status_code == 200 and queued.result().status_code == 200


def test_a_batch_that_compiles_leaves_the_admission_rate_alone():
  # The first batches after a start without warm-up (or of options not warmed up) compile: taken as the decoding
  # rate, their seconds made the admission test refuse with 503 ("about 56 s") requests answered in a few seconds.
  import asyncio  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  warm = jax.jit(lambda x: x + 1)
  warm(np.zeros(3)).block_until_ready()

  def run_batch(key, token_lists, n_best, attention):
    del n_best, attention
    if key == 'cold':  # a program this process has not compiled yet
      jax.jit(lambda x: x * 3)(np.zeros(len(token_lists) + 7)).block_until_ready()
      time.sleep(0.3)
    else:
      warm(np.zeros(3)).block_until_ready()
      time.sleep(0.02)
    return [[t] for t in token_lists], 0

  async def rates():
    batcher = batcher_lib.Batcher(run_batch, max_batch_tokens=100, max_wait_s=0, max_queue_sentences=10)
    batcher.start()
    found = []
    for key in ('cold', 'warm', 'cold'):
      await batcher.submit(key, [[5, 6, 7, 2]])
      found.append(batcher.rate)
    await batcher.close()
    return found

  after_cold, after_warm, after_cold_again = asyncio.run(rates())
  assert after_cold is None
  assert 0 < after_warm <= 4 / 0.02 and after_cold_again == after_warm


def test_batches_in_flight_are_measured_at_the_rate_they_clear_the_queue_together():
  # Two batches decoding at once clear the queue at both their tokens per second. Wrong rule caught: each batch's
  # tokens over its own seconds taken as the rate (half the queue's while both workers are busy), which refused
  # with 503 a request the queue reached within max_queue_wait_s (3 x 10 tokens queued: 0.6 s at 50 tokens/s,
  # reached after 0.4 s).
  import asyncio  # pylint: disable=g-import-not-at-top

  def run_batch(key, token_lists, n_best, attention):  # 0.2 s a batch, two at once as fast as one
    del key, n_best, attention
    time.sleep(0.2)
    return [list(t) for t in token_lists], 0

  async def scenario():
    batcher = batcher_lib.Batcher(run_batch, max_batch_tokens=10, max_wait_s=0, max_queue_sentences=100,
                                  max_queue_wait_s=0.5, in_flight=2)
    batcher.start()
    sentence = lambda i: [[i] * 9 + [2]]  # 10 tokens: one request a batch
    await asyncio.gather(*[batcher.submit('a', sentence(i)) for i in (3, 4)])
    rate = batcher.rate
    decoding = [asyncio.ensure_future(batcher.submit('a', sentence(i))) for i in (5, 6)]
    await asyncio.sleep(0.05)
    depth = batcher.queued_sentences
    queued = []
    for i in (7, 8, 9):
      queued.append(asyncio.ensure_future(batcher.submit('a', sentence(i))))
      await asyncio.sleep(0)
    answers = await asyncio.gather(*decoding, *queued, return_exceptions=True)
    await batcher.close()
    return rate, depth, answers

  rate, depth, answers = asyncio.run(scenario())
  assert 10 / 0.2 * 1.3 < rate <= 10 / 0.2 * 2 and depth == 0  # a batch alone: 50
  assert answers == [sentence for sentence in ([[i] * 9 + [2]] for i in (5, 6, 7, 8, 9))]


class EchoSearch:
  """A Batcher's run_batch that records each batch (key, token lists, n_best) and answers each sentence with its
  own token list; the first batch waits until released (the requests sent meanwhile queue behind it), and with
  fail=True every batch raises once released."""

  def __init__(self, fail=False):
    self.batches, self.fail = [], fail
    self.entered, self.release = threading.Event(), threading.Event()

  def __call__(self, key, token_lists, n_best, attention):
    del attention
    self.batches.append((key, [list(t) for t in token_lists], n_best))
    self.entered.set()
    assert self.release.wait(30)
    if self.fail:
      raise RuntimeError('the device fell over')
    return [list(t) for t in token_lists], 0


async def blocked_first_batch(batcher, search, sentences=((1, 2),)):
  """Starts `batcher` and submits one request of `sentences`; returns its task once its batch decodes (blocked in
  `search`)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  batcher.start()
  first = asyncio.ensure_future(batcher.submit('a', [list(s) for s in sentences]))
  for _ in range(2000):
    if search.entered.is_set() or first.done():
      break
    await asyncio.sleep(0.005)
  if first.done():
    first.result()  # raises what refused it
  assert search.entered.is_set()
  return first


def test_batches_take_the_oldest_keys_requests_in_order_within_the_token_budget():
  # Wrong rules caught: a batch that stops short of an exactly full budget (< for <=); a request over the whole
  # budget never taken (it waited for its timeout); the newest key decoded first; a batch asking for the fewest
  # n_best of its requests (a request's n best then repeated one translation); answers handed to the wrong request.
  import asyncio  # pylint: disable=g-import-not-at-top
  search = EchoSearch()
  requests = [('b', [[3, 4, 5], [6, 2]], 1), ('a', [list(range(7, 17))], 1), ('b', [[17, 18, 2]], 3),
              ('b', [[19, 2]], 2), ('a', [[20, 2]], 1)]  # (key, sentences, n_best) in order of arrival

  async def scenario():
    ticks = itertools.count()  # every request arrives after the one before it
    batcher = batcher_lib.Batcher(search, max_batch_tokens=8, max_wait_s=0, max_queue_sentences=100,
                                  clock=lambda: float(next(ticks)))
    first = await blocked_first_batch(batcher, search)
    queued = [asyncio.ensure_future(batcher.submit(key, lists, n_best=n_best)) for key, lists, n_best in requests]
    await asyncio.sleep(0.05)
    search.release.set()
    answers = await asyncio.wait_for(asyncio.gather(first, *queued), 20)
    await batcher.close()
    return answers

  answers = asyncio.run(scenario())
  assert answers == [[[1, 2]]] + [lists for _, lists, _ in requests]
  # Key b's oldest request first (5 of 8 tokens), then its next (3 more: exactly 8), not its third (2 more);
  # then key a's request of 10 tokens alone, then b's and a's last.
  assert search.batches == [('a', [[1, 2]], 1), ('b', [[3, 4, 5], [6, 2], [17, 18, 2]], 3),
                            ('a', [list(range(7, 17))], 1), ('b', [[19, 2]], 2), ('a', [[20, 2]], 1)]


def test_batches_in_flight_decode_at_once_and_the_rest_gather_until_one_ends():
  # With in_flight=2 a second request decodes while the first's batch does; the requests after them wait, and
  # gather into one batch, until a batch ends. Wrong rules caught: in_flight ignored (the second request waited
  # for the first batch), a third batch started beside the two, answers handed to the wrong request, and close()
  # returning before the running batches ended (their requests unanswered).
  import asyncio  # pylint: disable=g-import-not-at-top
  search, lock, running, most = EchoSearch(), threading.Lock(), [0], [0]

  def counted(*args):
    with lock:
      running[0] += 1
      most[0] = max(most[0], running[0])
    try:
      return search(*args)
    finally:
      with lock:
        running[0] -= 1

  async def scenario():
    batcher = batcher_lib.Batcher(counted, max_batch_tokens=100, max_wait_s=0, max_queue_sentences=100, in_flight=2)
    requests = [await blocked_first_batch(batcher, search), asyncio.ensure_future(batcher.submit('a', [[3, 2]]))]
    for _ in range(2000):
      if len(search.batches) == 2:
        break
      await asyncio.sleep(0.005)
    requests += [asyncio.ensure_future(batcher.submit('a', [[i, 2]])) for i in (4, 5)]
    await asyncio.sleep(0.05)
    started, closing = len(search.batches), asyncio.ensure_future(batcher.close())
    await asyncio.sleep(0.05)
    search.release.set()
    await asyncio.wait_for(closing, 20)
    return started, [r.result() if r.done() else None for r in requests]

  started, answers = asyncio.run(scenario())
  assert started == 2 and most[0] == 2
  assert answers == [[[1, 2]], [[3, 2]], [[4, 2]], [[5, 2]]]
  assert [sentences for _, sentences, _ in search.batches] == [[[1, 2]], [[3, 2]], [[4, 2], [5, 2]]]


def test_a_request_waits_for_no_gathering_after_a_lone_request_or_once_the_budget_is_full():
  # After a batch of several requests the next gathers for max_wait (30 s here); it does not after a batch of one
  # request, nor once its requests fill the token budget. Wrong rules caught: gathering after every batch (each
  # client of a quiet server waited max_wait), or until a full budget is exceeded rather than reached.
  import asyncio  # pylint: disable=g-import-not-at-top
  search = EchoSearch()

  async def scenario():
    batcher = batcher_lib.Batcher(search, max_batch_tokens=4, max_wait_s=30, max_queue_sentences=100)
    first = await blocked_first_batch(batcher, search)
    pair = [asyncio.ensure_future(batcher.submit('a', [[5, 2]])) for _ in range(2)]
    await asyncio.sleep(0.05)
    search.release.set()
    await asyncio.gather(first, *pair)  # two batches: the lone first request's, then the pair's
    full = await asyncio.wait_for(batcher.submit('a', [[6, 7, 8, 2]]), 10)  # 4 tokens: the budget, at once
    lone = await asyncio.wait_for(batcher.submit('a', [[9, 2]]), 10)  # after a batch of one request: at once
    await batcher.close()
    return full, lone

  assert asyncio.run(scenario()) == ([[6, 7, 8, 2]], [[9, 2]])
  assert [len(sentences) for _, sentences, _ in search.batches] == [1, 2, 1, 1]


def test_admission_refuses_by_queue_size_and_by_the_wait_within_the_request_timeout():
  # A request is refused (Overloaded: HTTP 503) where the queue cannot take its sentences, or where the measured
  # rate would reach it later than its limit: --max_queue_wait_s, or its timeout where that is shorter or
  # --max_queue_wait_s is 0. Retry-After is the wait past that limit, or the whole wait of a full queue, rounded up.
  # Wrong rules caught: a queue full one sentence early; the timeout not taken as a limit (with
  # --max_queue_wait_s=0 nothing was refused by the wait); a full queue's Retry-After of 1 s while its wait is 4;
  # a Retry-After rounded down (retried too early); an empty queue refusing a request larger than the queue.
  import asyncio  # pylint: disable=g-import-not-at-top
  search = EchoSearch()

  async def scenario():
    batcher = batcher_lib.Batcher(search, max_batch_tokens=100, max_wait_s=0, max_queue_sentences=3,
                                  max_queue_wait_s=0)
    first = await blocked_first_batch(batcher, search, [[1, 2]] * 4)  # more sentences than the queue holds
    batcher.measured_rate(3.0)  # source tokens per second
    queued = [asyncio.ensure_future(batcher.submit('a', [[3, 4, 2], [5, 6, 2]]))]  # 6 tokens: a wait of 2 s
    refusals = []
    for sentences, timeout in (([[7, 8, 9, 2]], 1.0), ([[10, 2]], None), ([[11, 2]], None)):
      await asyncio.sleep(0.01)
      queued.append(asyncio.ensure_future(batcher.submit('a', sentences, timeout=timeout)))
    await asyncio.sleep(0.01)
    for task in [t for t in queued if t.done()]:
      refusals.append((str(task.exception()), task.exception().retry_after))
      queued.remove(task)
    depth = batcher.queued_sentences
    search.release.set()
    answers = await asyncio.gather(first, *queued)
    await batcher.close()
    return refusals, depth, answers

  refusals, depth, answers = asyncio.run(scenario())
  # 6 + 4 tokens at 3 per second: 3.3 s, over the timeout of 1 s by 2.3; then the third sentence fills the queue,
  # and the fourth finds it full, (6 + 2 + 2) / 3 = 3.3 s from its turn.
  assert refusals == [('the queue would take about 3.3 s to reach this request, over the limit of 1 s', 3),
                      ('the queue is full (3 sentences waiting, at most 3)', 4)]
  assert depth == 3
  assert answers == [[[1, 2]] * 4, [[3, 4, 2], [5, 6, 2]], [[10, 2]]]


def test_a_failed_batch_answers_every_request_in_it():
  # Wrong rule caught: only the batch's first request got the error; the others waited for their timeout (504).
  import asyncio  # pylint: disable=g-import-not-at-top
  search = EchoSearch(fail=True)

  async def scenario():
    batcher = batcher_lib.Batcher(search, max_batch_tokens=100, max_wait_s=0, max_queue_sentences=100)
    first = await blocked_first_batch(batcher, search)
    queued = [asyncio.ensure_future(batcher.submit('a', [[i, 2]], timeout=10)) for i in (3, 4)]
    await asyncio.sleep(0.05)
    search.release.set()
    answers = await asyncio.gather(first, *queued, return_exceptions=True)
    await batcher.close()
    return answers

  answers = asyncio.run(scenario())
  assert [type(a) for a in answers] == [batcher_lib.BatchFailed] * 3
  assert str(answers[2]) == 'the batch of this request failed: RuntimeError: the device fell over'
  assert [len(sentences) for _, sentences, _ in search.batches] == [1, 2]


def test_a_request_past_the_timeout_gets_504_and_leaves_the_queue(backend):
  gate = Gate(backend)
  with client({'en-de': gate}, timeout_s=0.5, max_wait_ms=0, batches_in_flight=1) as c, \
       concurrent.futures.ThreadPoolExecutor(1) as pool:
    decoding = pool.submit(c.post, '/v1/translate', json={'text': ['a big dog runs .']})
    assert gate.entered.wait(20)
    queued = c.post('/v1/translate', json={'text': ['the cat runs .']})  # waits behind the blocked batch
    assert (queued.status_code, queued.json()) == (504, {'detail': 'not answered within the server\'s timeout of '
                                                                   '0.5 s'})
    assert c.app.state.service.batcher.queued_sentences == 0
    assert decoding.result().status_code == 504
    gate.release.set()
    assert c.post('/v1/translate', json={'text': ['dog']}).status_code == 200


def test_a_request_whose_client_went_away_leaves_the_queue_and_no_batch_decodes_it(backend):
  # On uvicorn (whose handlers run on after their client has gone), not the TestClient.
  uvicorn = pytest.importorskip('uvicorn')
  gate = Gate(backend)
  app = server.create_app({'en-de': gate}, server.Settings(warmup='none', max_wait_ms=0, max_batch_tokens=256,
                                                           batches_in_flight=1))  # the blocked batch holds the worker
  port = free_port()
  uvicorn_server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning'))
  thread = threading.Thread(target=uvicorn_server.run, daemon=True)
  thread.start()
  url, batcher = f'http://127.0.0.1:{port}', app.state.service.batcher
  try:
    wait_until(lambda: ready(url), timeout=60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      decoding = pool.submit(httpx.post, f'{url}/v1/translate', json={'text': ['a big dog runs .']}, timeout=60)
      assert gate.entered.wait(20)
      for path, body in (('/v1/translate', {'text': ['the cat runs .']}),
                         ('/translate', {'q': 'a red ball', 'source': 'en', 'target': 'de'})):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
          httpx.post(f'{url}{path}', json=body, timeout=1)
      wait_until(lambda: batcher.queued_sentences == 0, timeout=10)
      gate.release.set()
      assert decoding.result().status_code == 200
    metrics = httpx.get(f'{url}/metrics').text
    assert metric(metrics, 'flaxformer_nmt_batch_sentences_count') == 1
    assert metric(metrics, 'flaxformer_nmt_requests_total', route='/v1/translate', status='499') == 1
    assert metric(metrics, 'flaxformer_nmt_requests_total', route='/translate', status='499') == 1
  finally:
    gate.release.set()
    uvicorn_server.should_exit = True
    thread.join(30)


def test_a_failing_batch_answers_500_and_the_server_keeps_serving(backend, translator):
  gate = Gate(backend, failures=1)
  gate.release.set()
  with client({'en-de': gate}) as c:
    failed = c.post('/v1/translate', json={'text': ['a big dog runs .']})
    assert (failed.status_code, failed.json()) == (500, {'detail': 'the batch of this request failed: RuntimeError: '
                                                                   'the device fell over'})
    answer = c.post('/v1/translate', json={'text': ['a big dog runs .']})
    assert answer.json()['translations'][0]['text'] == expected(translator, ['a big dog runs .'])[0][0]


def test_ready_only_after_the_warm_up(backend):
  gate = Gate(backend)
  with client({'en-de': gate}, warmup='full') as c:
    assert (c.get('/ready').status_code, c.get('/ready').json()['ready']) == (503, False)
    assert c.get('/health').json() == {'status': 'ok'}
    refused = c.post('/v1/translate', json={'text': ['dog']})
    assert refused.status_code == 503 and refused.headers['Retry-After'] == '5'
    gate.warm_release.set()
    wait_until(lambda: c.get('/ready').status_code == 200)
    gate.release.set()
    assert c.post('/v1/translate', json={'text': ['dog']}).status_code == 200


class FailingWarmUp(Gate):
  def warm_up(self, *args):
    raise RuntimeError('out of memory')


def test_a_failed_warm_up_is_reported_and_refuses_without_retry_after(backend):
  with client({'en-de': FailingWarmUp(backend)}, warmup='full') as c:
    wait_until(lambda: c.get('/health').status_code == 503)
    reason = 'the warm-up failed: RuntimeError: out of memory'
    assert c.get('/health').json() == {'status': 'failed', 'reason': reason}
    assert c.get('/ready').json() == {'ready': False, 'reason': reason}
    refused = c.post('/v1/translate', json={'text': ['dog']})
  assert (refused.status_code, refused.json()) == (503, {'detail': f'the server cannot translate: {reason}'})
  assert 'Retry-After' not in refused.headers


def test_a_server_stopped_during_its_warm_up_does_not_wait_for_it(backend):
  gate = Gate(backend)
  start = time.time()
  with client({'en-de': gate}, warmup='full') as c:
    assert c.get('/ready').json() == {'ready': False, 'reason': 'warming up: compiling the searches'}
  assert time.time() - start < 10
  gate.warm_release.set()


def test_warm_up_compiles_the_searches_a_batch_then_runs(backend, traces):
  with client({'en-de': backend}, warmup='full', max_batch_tokens=64, max_input_tokens=14) as c:
    wait_until(lambda: c.get('/ready').status_code == 200, timeout=300)
    del traces[:]
    for count in (1, 2, 3):
      assert c.post('/v1/translate', json={'text': ['a big dog runs .'] * count}).status_code == 200
  assert traces == []


def test_api_keys_guard_every_route_but_health_and_the_page(backend):
  with client({'en-de': backend}, api_keys=('first-key', 'second-key')) as c:
    translate = {'text': ['a dog']}
    for route in ('/v1/models', '/metrics', '/ready', '/languages'):
      assert c.get(route).status_code == 401, route
    answer = c.post('/v1/translate', json=translate, headers={'Authorization': 'Bearer wrong'})
    assert answer.status_code == 401 and answer.headers['WWW-Authenticate'] == 'Bearer'
    assert answer.json() == {'detail': 'a valid API key is required: send the header "Authorization: Bearer KEY"'}
    assert c.post('/v1/translate', json=translate, headers={'Authorization': 'Bearer second-key'}).status_code == 200
    assert c.get('/health').status_code == 200 and c.get('/').status_code == 200
    assert c.get('/static/page.js').status_code == 200
    libre = {'q': 'a dog', 'source': 'en', 'target': 'de'}
    assert c.post('/translate', json=libre).json() == {
        'error': 'a valid API key is required: send the header "Authorization: Bearer KEY" or the api_key field'}
    assert c.post('/translate', json=dict(libre, api_key='first-key')).status_code == 200
    assert c.post('/translate', data=dict(libre, api_key='second-key')).status_code == 200
    # A JSON body without a Content-Type is read as JSON (libre_fields does), its key too.
    assert c.post('/translate', content=json.dumps(dict(libre, api_key='first-key'))).status_code == 200
    assert c.get('/languages?api_key=first-key').status_code == 200
    # Multipart forms (LibreTranslate's own page sends FormData), and a form's key in the query string.
    multipart = {k: (None, v) for k, v in libre.items()}
    assert c.post('/translate', files=dict(multipart, api_key=(None, 'first-key'))).status_code == 200
    assert c.post('/translate', files=multipart).status_code == 401
    assert c.post('/translate?api_key=second-key', data=libre).status_code == 200
    # The header on LibreTranslate's routes too, its scheme in any case (RFC 9110: case-insensitive). Wrong rules
    # caught: /translate reading the api_key field only; "bearer KEY" refused.
    assert c.post('/translate', json=libre, headers={'Authorization': 'Bearer first-key'}).status_code == 200
    assert c.get('/v1/models', headers={'Authorization': 'bearer second-key'}).status_code == 200


def test_keys_compare_in_constant_time_against_every_key(monkeypatch):
  keys = server.Keys(['abc', 'abd'])
  assert keys.accepts('abd') and not keys.accepts('ab') and not keys.accepts(None) and not keys.accepts('abcd')
  # Every key, through hmac.compare_digest, also after a match (a `==`, `in` or any() would stop early).
  compared = []
  compare_digest = server.hmac.compare_digest
  monkeypatch.setattr(server.hmac, 'compare_digest', lambda a, b: compared.append(b) or compare_digest(a, b))
  assert keys.accepts('abc') and compared == [b'abc', b'abd']


def test_cors_is_off_unless_an_origin_is_given(backend):
  preflight = {'Origin': 'http://app.test', 'Access-Control-Request-Method': 'POST'}
  with client({'en-de': backend}) as c:
    assert 'access-control-allow-origin' not in c.get('/health', headers={'Origin': 'http://app.test'}).headers
  with client({'en-de': backend}, cors_origins=('http://app.test',)) as c:
    assert c.options('/v1/translate', headers=preflight).headers['access-control-allow-origin'] == 'http://app.test'
    other = c.options('/v1/translate', headers=dict(preflight, Origin='http://other.test'))
    assert other.status_code == 400
    # A page sending its API key and JSON asks to send both headers first (wrong rule caught: Authorization not
    # allowed, so that a browser refused to send any request of a server with --api_keys_file).
    keyed = c.options('/v1/translate', headers=dict(preflight, **{
        'Access-Control-Request-Headers': 'authorization, content-type'}))
    assert keyed.status_code == 200, keyed.text
    assert {'authorization', 'content-type'} <= {
        h.strip().lower() for h in keyed.headers['access-control-allow-headers'].split(',')}


def test_a_page_of_an_allowed_origin_can_read_retry_after_and_www_authenticate(backend):
  # A browser hides the response headers CORS does not expose: a refusal's Retry-After would be unreadable.
  gate, origin = Gate(backend), {'Origin': 'http://app.test'}
  with client({'en-de': gate}, warmup='full', cors_origins=('http://app.test',), api_keys=('key',)) as c:
    refused = c.post('/v1/translate', json={'text': ['dog']}, headers=dict(origin, Authorization='Bearer key'))
    unauthorized = c.get('/v1/models', headers=origin)
  gate.warm_release.set()
  assert (refused.status_code, refused.headers['Retry-After'], unauthorized.status_code) == (503, '5', 401)
  for answer in (refused, unauthorized):
    exposed = {h.strip().lower() for h in answer.headers.get('access-control-expose-headers', '').split(',')}
    assert {'retry-after', 'www-authenticate'} <= exposed


def test_an_unexpected_error_is_a_500_a_page_of_an_allowed_origin_can_read(backend, monkeypatch):
  # Catches the 500 answered outside the CORS middleware: the browser then sees a network error, not the message.
  monkeypatch.setattr(server.Metrics, 'render', lambda self: 1 / 0)
  with client({'en-de': backend}, cors_origins=('http://app.test',)) as c:
    failed = c.get('/metrics', headers={'Origin': 'http://app.test'})
    assert c.get('/health').status_code == 200
  assert (failed.status_code, failed.json()) == (500, {'detail': 'internal error: ZeroDivisionError'})
  assert failed.headers['access-control-allow-origin'] == 'http://app.test'


def test_libretranslate_refusals_are_in_its_shape_and_name_its_fields(backend):
  beam = backend.defaults()['beam_size']
  long_q = 'dog ' * 300
  pieces, limit = len(backend.encode([long_q])[0]) - 1, min(127, backend.max_source_tokens)
  with client({'en-de': backend}) as c:
    errors = [({'q': 'a', 'source': 'en', 'target': 'fr'}, 404,
               'no model translates en to fr; this server serves en-de (en->de)'),
              ({'source': 'en', 'target': 'de'}, 400, 'Invalid request: missing q parameter'),
              # An empty q too, as LibreTranslate answers it (wrong rule caught: translated to "").
              ({'q': '', 'source': 'en', 'target': 'de'}, 400, 'Invalid request: missing q parameter'),
              ({'q': 'a', 'source': 'en', 'target': 'de', 'format': 'html'}, 400,
               'format \'html\' is not supported: only "text"'),
              ({'q': 5, 'source': 'en', 'target': 'de'}, 422, 'q: must be a string or a list of strings'),
              # (wrong rule caught: a list of anything let in, then a 500 where a text was no string)
              ({'q': ['a', 5], 'source': 'en', 'target': 'de'}, 422, 'q: must be a string or a list of strings'),
              # Errors name LibreTranslate's fields, not /v1's.
              ({'q': 'a', 'source': 'en', 'target': 'de', 'alternatives': 4}, 400, 'alternatives=4 is over the '
               f'limit of {beam - 1} (the model\'s beam size {beam} less one)'),
              ({'q': ['a', long_q], 'source': 'en', 'target': 'de'}, 413, f'q[1] has a sentence of {pieces} tokens; '
               f'the limit is {limit} (--max_input_tokens=127, and what the model holds)')]
    for body, status, message in errors:
      answer = c.post('/translate', json=body)
      assert (answer.status_code, answer.json()) == (status, {'error': message})
    answer = c.post('/translate', content='{"q": "a \\ud800", "source": "en", "target": "de"}')
    assert (answer.status_code, answer.json()) == (400, {'error': 'q is not valid Unicode (surrogates not allowed at '
                                                                  'character 2)'})
    # Percent-escapes that unescape to no UTF-8 are refused, not replaced.
    answer = c.post('/translate', content=b'q=a+%FF+dog&source=en&target=de',
                    headers={'Content-Type': 'application/x-www-form-urlencoded'})
    assert (answer.status_code, answer.json()) == (400, {'error': 'the form is not valid UTF-8 once unescaped '
                                                                  '(invalid start byte)'})


def test_libretranslate_routes(backend, translator):
  texts = ['a big dog runs .', 'the cat runs .']
  want = [text for text, _ in expected(translator, texts)]
  with client({'en-de': backend}) as c:
    assert c.post('/translate', json={'q': texts[0], 'source': 'en', 'target': 'de', 'format': 'text'}).json() == {
        'translatedText': want[0]}
    assert c.post('/translate', json={'q': texts, 'source': 'en', 'target': 'de'}).json() == {
        'translatedText': want}
    form = c.post('/translate', data={'q': texts[1], 'source': 'auto', 'target': 'de', 'alternatives': '1'}).json()
    nbest = expected(translator, [texts[1]], n_best=2)[0]
    assert form == {'translatedText': nbest[0][0], 'alternatives': [nbest[1][0]],
                    'detectedLanguage': {'confidence': 100.0, 'language': 'en'}}
    # A list of texts gets a list of each field (LibreTranslate's shape). Wrong rules caught: only the first
    # text's alternatives, or one detectedLanguage for all.
    listed = c.post('/translate', json={'q': texts, 'source': 'auto', 'target': 'de', 'alternatives': 1}).json()
    nbests = expected(translator, texts, n_best=2)
    assert listed == {'translatedText': [n[0][0] for n in nbests], 'alternatives': [[n[1][0]] for n in nbests],
                      'detectedLanguage': [{'confidence': 100.0, 'language': 'en'}] * 2}
    assert c.get('/languages').json() == [{'code': 'de', 'name': 'German', 'targets': []},
                                          {'code': 'en', 'name': 'English', 'targets': ['de']}]
    # As LibreTranslate (Flask's request.values): a form's fields from the query string too, the body's first;
    # no format is text; FastAPI's own errors in LibreTranslate's {"error"} shape.
    assert c.post(f'/translate?q={texts[0]}&source=en&target=de').json() == {'translatedText': want[0]}
    answer = c.post(f'/translate?q={texts[0]}&target=fr', data={'q': texts[1], 'source': 'en', 'target': 'de'})
    assert answer.json() == {'translatedText': want[1]}
    assert c.post('/translate', json={'q': texts[0], 'source': 'en', 'target': 'de', 'format': None}).json() == {
        'translatedText': want[0]}
    # Multipart forms as LibreTranslate's own page sends them (FormData); a part that is a file is no field.
    answer = c.post('/translate?source=en', files={'q': (None, texts[1]), 'target': (None, 'de'),
                                                   'source': (None, 'en'), 'format': (None, 'text'),
                                                   'alternatives': ('a.txt', b'2', 'text/plain')})
    assert answer.json() == {'translatedText': want[1]}
    answer = c.post('/translate', content=b'--x\r\nContent-Disposition: form-data; name="q"\r\n\r\na dog',
                    headers={'Content-Type': 'multipart/form-data'})  # no boundary
    assert answer.status_code == 400 and answer.json()['error'].startswith('the multipart form could not be read (')
    answer = c.get('/translate')
    assert (answer.status_code, answer.json()) == (405, {'error': 'Method Not Allowed'})
    assert answer.headers['allow'] == 'POST'


def test_libretranslate_fields_python_cannot_read_get_a_client_error_not_500(backend):
  libre = '"q": "a dog", "source": "en", "target": "de"'
  alternatives = 'alternatives: must be a whole number >= 0'
  with client({'en-de': backend}) as c:
    answers = [c.post('/translate', content='{"q": "a dog", "source": "\\ud800", "target": "de"}'),
               c.post('/translate', content='{' + libre + ', "alternatives": "\u00b2"}'),  # a digit int() refuses
               c.post('/translate', data={'q': 'a dog', 'source': 'en', 'target': 'de', 'alternatives': '9' * 5000}),
               c.post('/translate', content='{"q": ' + '[' * 100_000)]  # deeper than json.loads recurses
  assert [(a.status_code, a.json()['error']) for a in answers[:3]] == [
      (404, 'no model translates \\ud800 to de; this server serves en-de (en->de)'), (422, alternatives),
      (422, alternatives)]
  assert answers[3].status_code == 422 and answers[3].json()['error'].startswith('the body is not valid JSON (')


def test_api_keys_python_cannot_read_get_401_not_500(backend):
  libre = {'q': 'a', 'source': 'en', 'target': 'de'}
  with client({'en-de': backend}, api_keys=('first-key',)) as c:
    answers = [c.post('/translate', content='{"q": "a", "source": "en", "target": "de", "api_key": "\\ud800"}'),
               c.post('/translate', content='{"q": ' + '[' * 100_000)]
    assert [a.status_code for a in answers] == [401, 401]
    assert c.post('/translate', json=dict(libre, api_key='first-key')).status_code == 200


def test_metrics_count_requests_batches_and_tokens(backend, translator):
  with client({'en-de': backend}) as c:
    for text in (['a big dog runs .'], ['the cat runs .', 'a red ball']):
      assert c.post('/v1/translate', json={'text': text}).status_code == 200
    assert c.post('/v1/translate', json={'text': 'not a list', 'n_best': 'x'}).status_code == 422
    assert c.post('/translate', json={'q': 'a dog', 'source': 'en', 'target': 'de'}).status_code == 200
    for path in ('/nothing', '/v1/nothing/1', '/v1/nothing/2'):  # a client's typos or a scanner's guesses
      assert c.get(path).status_code == 404
    text = c.get('/metrics').text
  assert metric(text, 'flaxformer_nmt_requests_total', route='/v1/translate', status='200') == 2
  assert metric(text, 'flaxformer_nmt_requests_total', route='/v1/translate', status='422') == 1
  assert metric(text, 'flaxformer_nmt_requests_total', route='/translate', status='200') == 1
  # Paths no route serves share one label (wrong rule caught: one series per path sent, without bound).
  assert metric(text, 'flaxformer_nmt_requests_total', route='other', status='404') == 3
  assert 'nothing' not in text
  assert metric(text, 'flaxformer_nmt_request_seconds_count', route='/v1/translate') == 3
  assert metric(text, 'flaxformer_nmt_batch_sentences_sum') == 4
  sources = ['a big dog runs .', 'the cat runs .', 'a red ball', 'a dog']
  tokens = translator.search_tokens(translator.tokenizer.encode(sources))
  assert metric(text, 'flaxformer_nmt_target_tokens_total') == sum(len(h[0][0]) for h in tokens)
  assert metric(text, 'flaxformer_nmt_batch_source_tokens_sum') == sum(
      len(t) for t in translator.tokenizer.encode(sources))
  assert metric(text, 'flaxformer_nmt_queue_sentences') == 0
  # One batch: its seconds observed, and the throughput gauge its target tokens over those seconds (wrong rules
  # caught: the batch's seconds not observed; the gauge set to the token count).
  with client({'en-de': backend}) as c:
    assert c.post('/v1/translate', json={'text': ['a big dog runs .']}).status_code == 200
    one = c.get('/metrics').text
  assert metric(one, 'flaxformer_nmt_batch_seconds_count') == 1
  assert metric(one, 'flaxformer_nmt_target_tokens_per_second') == pytest.approx(
      metric(one, 'flaxformer_nmt_target_tokens_total') / metric(one, 'flaxformer_nmt_batch_seconds_sum'), rel=1e-6)


def test_models_lists_checkpoint_size_settings_and_bleu(backend, translator, workdir, monkeypatch):
  bleu = batcher_lib.recorded_bleu(workdir, [60])
  # Read at load, not per request on the event loop (wrong rule caught: metrics.jsonl parsed at each GET).
  monkeypatch.setattr(batcher_lib, 'recorded_bleu', lambda *_: pytest.fail('metrics.jsonl read for a request'))
  with client({'en-de': backend, 'second': backend}) as c:
    models = c.get('/v1/models').json()['models']
    # A request naming no model gets the first served, as /v1/models lists it (wrong rule caught: another one).
    assert [c.post('/v1/translate', json=dict({'text': ['dog']}, **name)).json()['model']
            for name in ({}, {'model': 'second'})] == ['en-de', 'second']
  assert [m['name'] for m in models] == ['en-de', 'second']
  model = models[0]
  assert (model['source_lang'], model['target_lang'], model['checkpoint'], model['checkpoint_steps']) == (
      'en', 'de', translator.checkpoint, [60])
  assert model['parameters'] == sum(x.size for x in jax_leaves(translator.params))
  assert model['defaults'] == {'beam_size': translator.config.beam_size,
                               'alpha': translator.config.length_penalty_alpha, 'max_len_a': 1.0,
                               'max_len_b': translator.config.max_decode_extra_length}
  assert model['config']['d_model'] == 32 and model['backend'] == 'jax'
  assert model['validation_bleu'] == bleu


def jax_leaves(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_leaves(tree)


def test_recorded_bleu_is_the_newest_at_or_before_the_checkpoint(tmp_path):
  records = [{'step': 5, 'eval/bleu': 1.5}, {'step': 10, 'eval/loss': 2.0}, {'step': 10, 'eval/bleu': 3.0},
             {'step': 20, 'eval/bleu': 7.0}]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records) + '{"step": 2')
  assert batcher_lib.recorded_bleu(tmp_path, [5, 15]) == {'step': 10, 'bleu': 3.0}
  assert batcher_lib.recorded_bleu(tmp_path, [4]) is None
  assert batcher_lib.checkpoint_steps('the best checkpoint (step 200, bleu 12.3)') == [200]
  assert batcher_lib.checkpoint_steps('the average of checkpoints [100, 200]') == [100, 200]


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


# Ctrl-C exited 130 with a KeyboardInterrupt's traceback after the drain (uvicorn raises the signal again).
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['sigterm', 'ctrl_c'])
def test_sigterm_or_ctrl_c_drains_the_requests_in_flight_then_exits_0(workdir, translator, tmp_path, signum):
  port = free_port()
  with open(tmp_path / 'server.log', 'w', encoding='utf-8') as log:
    process = subprocess.Popen([sys.executable, '-m', 'flaxformer_nmt.serve', f'--workdir={workdir}',
                                f'--port={port}', '--warmup=none'], env=conftest.subprocess_env(), stdout=log,
                               stderr=subprocess.STDOUT, preexec_fn=conftest.as_a_foreground_job)
  url, finished = f'http://127.0.0.1:{port}', []

  def post(texts):
    answer = httpx.post(f'{url}/v1/translate', json={'text': texts}, timeout=120)
    finished.append(time.time())
    return answer
  try:
    wait_until(lambda: ready(url), timeout=180)
    texts = SENTENCES * 12  # about 800 source tokens: a batch (--max_batch_tokens 2048) holds two such requests
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      answers = [pool.submit(post, texts) for _ in range(4)]
      # Signalled while a batch decodes and requests wait behind it (compiled programs may decode all in 0.2 s).
      wait_until(lambda: metric(httpx.get(f'{url}/metrics').text, 'flaxformer_nmt_queue_sentences') > 0)
      signalled = time.time()
      process.send_signal(signum)
      want = translator.translate(texts)
      answered = 0
      for answer in answers:
        # A request that connects after the signal is refused, as it should be: the wait above sees the queue,
        # not the connections of all four (on a busy machine the last one may connect after the signal).
        if isinstance(answer.exception(), httpx.ConnectError):
          continue
        assert answer.result().status_code == 200
        assert [t['text'] for t in answer.result().json()['translations']] == want
        answered += 1
    assert answered >= 2  # the requests decoding and waiting at the signal, at least
    assert max(finished) > signalled  # answered after the signal: drained, not cut off
    assert process.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
      httpx.get(f'{url}/health')
  finally:
    if process.poll() is None:
      process.kill()
  output = (tmp_path / 'server.log').read_text()
  assert 'Application shutdown complete' in output and 'Stopped.' in output, output[-3000:]


@pytest.mark.parametrize('port', [65536 + 8000, -1])
def test_a_port_outside_0_to_65535_is_refused_before_anything_loads(tmp_path, port):
  """The socket layer took --port modulo 65536: --port=73536 served on 8000, logging 'Listening on ...:73536'."""
  result = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.serve', f'--workdir={tmp_path / "none"}',
                           f'--port={port}'], env=conftest.subprocess_env(), capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 1
  assert f'flag --port={port}: {port} is not an integer in the range [0, 65535]' in result.stderr, result.stderr


@pytest.mark.parametrize('flag', ['--switch_interval_ms=0', '--timeout_s=0', '--max_batch_tokens=0',
                                  '--graceful_timeout_s=-1'])
def test_a_limit_or_timing_flag_out_of_range_is_refused_naming_it(tmp_path, flag):
  """--switch_interval_ms=0 crashed with Python's ValueError, --timeout_s=0 answered every request 504,
  --max_batch_tokens=0 every one 500, and a negative --graceful_timeout_s cut the requests in flight on SIGTERM."""
  from flaxformer_nmt import serve as serve_command  # pylint: disable=g-import-not-at-top
  result = in_process.run(serve_command, [f'--workdir={tmp_path / "none"}', flag])
  assert result.returncode == 1 and f'flag {flag.split("=")[0]}=' in result.stderr, result.stderr


def test_sigterm_during_the_warm_up_exits_0(workdir, tmp_path):
  # The interpreter's exit used to abort inside XLA while the warm-up thread compiled (exit 134).
  port = free_port()
  with open(tmp_path / 'server.log', 'w', encoding='utf-8') as log:
    process = subprocess.Popen([sys.executable, '-m', 'flaxformer_nmt.serve', f'--workdir={workdir}',
                                f'--port={port}', '--warmup=full'], env=conftest.subprocess_env(), stdout=log,
                               stderr=subprocess.STDOUT)
  url = f'http://127.0.0.1:{port}'
  try:
    wait_until(lambda: status(f'{url}/ready') is not None, timeout=180)
    assert status(f'{url}/ready') == 503  # still compiling
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
  finally:
    if process.poll() is None:
      process.kill()


def status(url):
  """The status code of GET url, None while nothing listens."""
  try:
    return httpx.get(url, timeout=2).status_code
  except httpx.TransportError:
    return None


def ready(url):
  try:
    return httpx.get(f'{url}/ready', timeout=2).status_code == 200
  except httpx.TransportError:
    return False
