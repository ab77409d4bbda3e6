"""The server's page in a real headless Chromium (Playwright, the system's browser): it loads the models, translates a
sentence, lists the n best and draws the cross-attention heatmap, each cell the weight the model gave; a
screenshot is saved."""
import contextlib
import json
import os
import shutil
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from test_serve import trained_workdir

pytest.importorskip('fastapi')
uvicorn = pytest.importorskip('uvicorn')
playwright_api = pytest.importorskip('playwright.sync_api')

from flaxformer_nmt.evaluation import attention as attention_lib  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.serving import batcher as batcher_lib  # pylint: disable=g-import-not-at-top
from flaxformer_nmt.serving import server  # pylint: disable=g-import-not-at-top,wrong-import-position

BROWSERS = ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable')
SENTENCE = 'a small man sees a big red dog .'


def browser_binary():
  """$CHROMIUM, or the first Chromium on PATH (Debian: apt-get install chromium)."""
  if os.environ.get('CHROMIUM'):
    return os.environ['CHROMIUM']
  return next((path for path in map(shutil.which, BROWSERS) if path), None)


@pytest.fixture(scope='module')
def backend(tmp_path_factory):
  return batcher_lib.JaxBackend(trained_workdir(tmp_path_factory))


@contextlib.contextmanager
def serving(backend, **settings):
  """The app on uvicorn in a thread, at http://127.0.0.1:PORT."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  app = server.create_app({'en-de': backend}, server.Settings(warmup='none', **settings))
  uvicorn_server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning'))
  thread = threading.Thread(target=uvicorn_server.run, daemon=True)
  thread.start()
  deadline = time.time() + 60
  while not uvicorn_server.started:
    assert time.time() < deadline and thread.is_alive(), 'the server did not start'
    time.sleep(0.05)
  try:
    yield f'http://127.0.0.1:{port}'
  finally:
    uvicorn_server.should_exit = True
    thread.join(60)


@pytest.fixture(scope='module')
def live_server(backend):
  with serving(backend) as url:
    yield url


def api_translate(url, text, **fields):
  """The API's own answer for `text` (one entry of POST /v1/translate)."""
  request = urllib.request.Request(f'{url}/v1/translate', json.dumps({'text': [text], **fields}).encode(),
                                   {'Content-Type': 'application/json'})
  with urllib.request.urlopen(request, timeout=120) as response:
    return json.load(response)['translations'][0]


def wait_until_answered(page):
  page.wait_for_function('!document.querySelector("#translate").disabled && '
                         'document.querySelector("#status").textContent !== "Translating…"', timeout=120_000)


def open_page(page, url):
  """The page at `url`, once it has listed the served models."""
  page.goto(url)
  page.wait_for_function('document.querySelectorAll("#model option").length > 0')


def translate_on_page(page, text):
  """Types `text` into the source box, clicks Translate and waits for the answer (or an error)."""
  page.fill('#source', text)
  page.click('#translate')
  wait_until_answered(page)


@pytest.fixture
def page():
  binary = browser_binary()
  if binary is None:
    pytest.skip(f'no Chromium to drive: none of {BROWSERS} is on PATH and $CHROMIUM is not set '
                '(apt-get install chromium)')
  with playwright_api.sync_playwright() as p:
    browser = p.chromium.launch(executable_path=binary, headless=True, args=['--no-sandbox'])
    try:
      yield browser.new_page(viewport={'width': 1200, 'height': 900})
    finally:
      browser.close()


def cells(page):
  """{(row, column): weight} of the heatmap's cells."""
  found = page.eval_on_selector_all('#heatmap rect.cell', 'cells => cells.map(c => [+c.dataset.row, '
                                    '+c.dataset.col, +c.dataset.weight])')
  return {(r, c): w for r, c, w in found}


def test_the_page_translates_and_draws_the_cross_attention(live_server, page, backend, tmp_path):
  translator = backend.translator
  open_page(page, live_server)
  assert page.input_value('#beam-size') == str(translator.config.beam_size)
  page.fill('#source', SENTENCE)
  page.fill('#n-best', '2')
  page.click('#translate')
  page.wait_for_function('document.querySelector("#translation").textContent.length > 0', timeout=120_000)
  n_best = translator.translate([SENTENCE], n_best=2)[0]
  assert page.text_content('#translation') == n_best[0]
  items = page.eval_on_selector_all('#n-best-list li', 'items => items.map(i => i.firstChild.textContent)')
  assert items == n_best
  reference = attention_lib.attention_maps(translator, [SENTENCE])[0]
  sources, targets = reference['source_pieces'], reference['target_pieces']
  assert page.eval_on_selector_all('#heatmap .source-label', 'ls => ls.map(l => l.textContent)') == sources
  assert page.eval_on_selector_all('#heatmap .target-label', 'ls => ls.map(l => l.textContent)') == targets
  drawn = cells(page)
  assert sorted(drawn) == [(r, c) for r in range(len(targets)) for c in range(len(sources))]
  average = reference['cross'].mean(axis=(0, 1))  # the default choice: all layers, heads averaged
  np.testing.assert_allclose([[drawn[(r, c)] for c in range(len(sources))] for r in range(len(targets))],
                             average, atol=1e-5)
  layers = page.eval_on_selector_all('#layer option', 'options => options.map(o => o.value)')
  assert layers == ['mean'] + [str(layer) for layer in range(len(reference['cross']))]
  page.select_option('#layer', '0')
  first = cells(page)
  np.testing.assert_allclose([[first[(r, c)] for c in range(len(sources))] for r in range(len(targets))],
                             reference['cross'][0].mean(axis=0), atol=1e-5)
  page.screenshot(path=str(tmp_path / 'serving_page.png'), full_page=True)
  assert (tmp_path / 'serving_page.png').stat().st_size > 10_000


def test_the_page_shows_the_servers_error(live_server, page):
  open_page(page, live_server)
  translate_on_page(page, SENTENCE)
  assert page.text_content('#translation') and cells(page)
  page.fill('#beam-size', '99')
  page.fill('#source', 'a big dog sees a small red man .')
  page.click('#translate')
  page.wait_for_function('document.querySelector("#status").className === "error"')
  assert page.text_content('#status') == '400: beam_size=99 is over the server\'s limit --max_beam_size=8'
  # The answer to the text before is not left beside the error, as if it were this text's.
  assert page.text_content('#translation') == ''
  assert page.eval_on_selector_all('#n-best-list li', 'items => items.length') == 0
  assert not cells(page)


def test_an_empty_beam_size_field_translates_with_the_models_default(live_server, page, backend):
  open_page(page, live_server)
  page.fill('#beam-size', '')
  page.fill('#source', SENTENCE)
  page.click('#translate')
  page.wait_for_function('document.querySelector("#status").textContent.endsWith(" ms") || '
                         'document.querySelector("#status").className === "error"', timeout=120_000)
  assert page.get_attribute('#status', 'class') != 'error', page.text_content('#status')
  assert page.text_content('#translation') == backend.translator.translate([SENTENCE])[0]


def test_a_large_attention_map_is_drawn(live_server, page):
  # One layer (as a CTranslate2 model's) of 135,000 weights, under the server's limit of 250,000: more than
  # Math.max(...weights) takes as arguments.
  rows, columns = 300, 450
  weights = [[[(r * columns + c) % 97 / 96 for c in range(columns)] for r in range(rows)]]
  answer = {'model': 'en-de', 'translations': [{
      'text': 'x', 'score': -1.0, 'attention': {'source_tokens': [f's{c}' for c in range(columns)],
                                                'target_tokens': [f't{r}' for r in range(rows)], 'weights': weights}}]}
  open_page(page, live_server)
  page.route('**/v1/translate', lambda route: route.fulfill(json=answer))
  page.fill('#source', SENTENCE)
  page.click('#translate')
  page.wait_for_function('document.querySelector("#status").textContent.endsWith(" ms") || '
                         'document.querySelector("#status").className === "error"', timeout=120_000)
  assert page.get_attribute('#status', 'class') != 'error', page.text_content('#status')
  assert page.eval_on_selector_all('#heatmap rect.cell', 'cells => cells.length') == rows * columns
  # The largest weight is drawn in the top colour.
  assert page.get_attribute('#heatmap rect[data-row="0"][data-col="96"]', 'fill') == 'rgb(253,231,37)'


# Delays the page's first POST /v1/translate answer by 3 s (after the server has answered); window.delayedDone
# is set once the page has it.
DELAY_FIRST_ANSWER = """(() => {
  const fetch = window.fetch;
  let calls = 0;
  window.fetch = async (url, init) => {
    const response = await fetch(url, init);
    if (String(url).endsWith('/v1/translate') && ++calls === 1) {
      await new Promise((resolve) => setTimeout(resolve, 3000));
      setTimeout(() => { window.delayedDone = true; }, 0);
    }
    return response;
  };
})()"""


def test_an_older_answer_does_not_overwrite_a_newer_one(live_server, page, backend):
  newer = 'the cat runs .'
  translator = backend.translator
  assert translator.translate([SENTENCE])[0] != translator.translate([newer])[0]
  open_page(page, live_server)
  page.evaluate(DELAY_FIRST_ANSWER)
  page.fill('#source', SENTENCE)
  page.click('#translate')
  page.fill('#source', newer)
  page.press('#source', 'Control+Enter')  # while the first request is in flight
  page.wait_for_function('window.delayedDone === true', timeout=120_000)
  page.wait_for_timeout(500)
  wait_until_answered(page)
  expected = api_translate(live_server, newer, n_best=int(page.input_value('#n-best')), return_attention=True)
  assert page.text_content('#translation') == expected['text']
  assert page.eval_on_selector_all('#heatmap .source-label', 'ls => ls.map(l => l.textContent)') == (
      expected['attention']['source_tokens'])
  assert page.get_attribute('#status', 'class') != 'error', page.text_content('#status')


def test_a_blank_source_is_not_sent_and_clears_the_answer(live_server, page):
  open_page(page, live_server)
  translate_on_page(page, SENTENCE)
  assert page.text_content('#translation')
  posts = []
  page.on('request', lambda request: posts.append(request.url) if request.method == 'POST' else None)
  page.fill('#source', '  \n ')
  page.click('#translate')
  wait_until_answered(page)
  page.wait_for_timeout(300)
  assert not posts
  assert page.text_content('#translation') == ''
  assert page.eval_on_selector_all('#n-best-list li', 'items => items.length') == 0
  assert not cells(page)
  assert page.text_content('#status') == 'Nothing to translate: enter a text.'


def test_a_text_whose_attention_is_over_the_limit_is_still_translated(live_server, page, backend):
  too_large = ('return_attention: the attention of this request holds 658560 weights; the limit is 250000 (ask for '
               'fewer or shorter texts at a time)')

  def handle(route):
    if route.request.post_data_json.get('return_attention'):
      route.fulfill(status=413, json={'detail': too_large})
    else:
      route.continue_()
  open_page(page, live_server)
  page.route('**/v1/translate', handle)
  translate_on_page(page, SENTENCE)
  assert page.text_content('#translation') == backend.translator.translate([SENTENCE])[0]
  assert page.get_attribute('#status', 'class') != 'error'
  assert page.text_content('#status').endswith('the cross-attention is not drawn: 413: ' + too_large)
  assert not cells(page)


def test_the_n_best_keep_the_line_breaks(live_server, page):
  text = f'{SENTENCE}\nthe cat runs .'
  open_page(page, live_server)
  page.fill('#n-best', '2')
  translate_on_page(page, text)
  expected = [c['text'] for c in api_translate(live_server, text, n_best=2)['n_best']]
  assert all('\n' in t for t in expected)
  shown = page.eval_on_selector_all('#n-best-list li', 'items => items.map(i => i.innerText)')
  assert len(shown) == 2 and all(s.startswith(t) for s, t in zip(shown, expected)), (shown, expected)


def test_with_api_keys_the_page_asks_for_one_then_works(backend, page):
  with serving(backend, api_keys=('page-key',)) as url:
    page.goto(url)
    page.wait_for_function('document.querySelector("#status").className === "error"')
    assert 'API key' in page.text_content('#status')
    page.fill('#api-key', 'page-key')
    page.press('#api-key', 'Tab')
    page.wait_for_function('document.querySelectorAll("#model option").length > 0')
    page.wait_for_timeout(300)
    assert page.get_attribute('#status', 'class') != 'error', page.text_content('#status')
    assert page.text_content('#status') == ''
    translate_on_page(page, SENTENCE)
    assert page.text_content('#translation') == backend.translator.translate([SENTENCE])[0]
