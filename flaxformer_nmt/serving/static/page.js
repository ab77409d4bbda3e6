// The translation page: POST /v1/translate with n_best, scores and attention; draws the cross-attention as an
// SVG heatmap (target pieces as rows, source pieces as columns, averaged over heads, one layer or all).
'use strict';

const $ = (id) => document.getElementById(id);
const SVG = 'http://www.w3.org/2000/svg';
const CELL = 26;
// Viridis, five stops: weight 0 (dark violet) to the map's largest weight (yellow).
const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
let models = [];
let lastAttention = null;
let requestId = 0;  // the latest translate request's number
let inFlight = null;  // its AbortController while it runs

function requestHeaders() {
  const headers = {'Content-Type': 'application/json'};
  const key = $('api-key').value.trim();
  if (key) headers['Authorization'] = 'Bearer ' + key;
  return headers;
}

function showStatus(message, isError) {
  $('status').textContent = message;
  $('status').className = isError ? 'error' : '';
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.detail || body.error || JSON.stringify(body)}`;
  } catch (e) {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModels() {
  let response;
  try {
    response = await fetch('/v1/models', {headers: requestHeaders()});
  } catch (e) {
    showStatus('Models: the server did not answer: ' + e, true);
    return;
  }
  if (!response.ok) {
    showStatus('Models: ' + await errorText(response), true);
    return;
  }
  models = (await response.json()).models;
  if ($('status').textContent.startsWith('Models: ')) showStatus('', false);
  const select = $('model');
  select.replaceChildren(...models.map((m) => new Option(`${m.name} (${m.source_lang} → ${m.target_lang})`, m.name)));
  chooseModel();
}

function chooseModel() {
  const model = models.find((m) => m.name === $('model').value);
  if (!model) return;
  $('beam-size').value = model.defaults.beam_size;
  $('beam-size').max = model.limits.max_beam_size;
  $('n-best').value = Math.min(3, Math.max(1, model.defaults.beam_size));
  const bleu = model.validation_bleu ? `, validation BLEU ${model.validation_bleu.bleu.toFixed(2)}` : '';
  $('model-info').textContent = `${model.checkpoint}, ${model.parameters ?? '?'} parameters${bleu}`;
}

function clearResults() {
  $('translation').textContent = '';
  $('n-best-list').replaceChildren();
  lastAttention = null;
  $('layer').replaceChildren(new Option('average of all layers', 'mean'));
  drawHeatmap();
}

async function translate() {
  // A newer request supersedes the one in flight: its answer is dropped, whenever it comes.
  const id = ++requestId;
  if (inFlight) inFlight.abort();
  inFlight = null;
  const text = $('source').value;
  if (!text.trim()) {
    clearResults();
    showStatus('Nothing to translate: enter a text.', false);
    $('translate').disabled = false;
    return;
  }
  const typed = parseInt($('beam-size').value, 10);
  const beamSize = Number.isNaN(typed) ? null : typed;  // an empty field: the model's default
  const model = models.find((m) => m.name === $('model').value);
  const beam = beamSize ?? (model ? model.defaults.beam_size : 1);
  const nBest = Math.max(1, Math.min(parseInt($('n-best').value, 10) || 1, Math.max(beam, 1)));
  const body = {model: $('model').value || null, text: [text], beam_size: beamSize, n_best: nBest,
                return_scores: true, return_attention: true};
  const controller = new AbortController();
  inFlight = controller;
  $('translate').disabled = true;
  showStatus('Translating…', false);
  const started = performance.now();
  const post = () => fetch('/v1/translate', {method: 'POST', headers: requestHeaders(), body: JSON.stringify(body),
                                             signal: controller.signal});
  try {
    let response = await post();
    let note = '';
    if (response.status === 413 && id === requestId) {
      // Perhaps only the attention map is over the server's limit: the translation alone may still fit.
      note = await errorText(response);
      body.return_attention = false;
      response = await post();
    }
    if (id !== requestId) return;
    if (!response.ok) {
      const message = await errorText(response);
      if (id !== requestId) return;
      clearResults();
      showStatus(message, true);
      return;
    }
    const entry = (await response.json()).translations[0];
    if (id !== requestId) return;
    render(entry);
    const elapsed = `${Math.round(performance.now() - started)} ms`;
    showStatus(note ? `${elapsed}; the cross-attention is not drawn: ${note}` : elapsed, false);
  } catch (e) {
    if (id !== requestId) return;
    clearResults();
    showStatus('The server did not answer: ' + e, true);
  } finally {
    if (id === requestId) {
      $('translate').disabled = false;
      inFlight = null;
    }
  }
}

function render(entry) {
  $('translation').textContent = entry.text;
  const candidates = entry.n_best || [{text: entry.text, score: entry.score}];
  $('n-best-list').replaceChildren(...candidates.map((c) => {
    const item = document.createElement('li');
    item.textContent = c.text;
    const score = document.createElement('span');
    score.className = 'score';
    score.textContent = c.score.toFixed(3);
    item.append(score);
    return item;
  }));
  lastAttention = entry.attention;
  const layers = lastAttention ? lastAttention.weights.length : 0;
  const options = [new Option('average of all layers', 'mean')];
  for (let l = 0; l < layers; l++) options.push(new Option(`layer ${l + 1}`, String(l)));
  $('layer').replaceChildren(...options);
  drawHeatmap();
}

function layerWeights(attention, choice) {
  if (choice !== 'mean') return attention.weights[parseInt(choice, 10)];
  const layers = attention.weights;
  return layers[0].map((row, r) => row.map((_, c) => layers.reduce((sum, w) => sum + w[r][c], 0) / layers.length));
}

function color(value) {
  const x = Math.min(Math.max(value, 0), 1) * (STOPS.length - 1);
  const i = Math.min(Math.floor(x), STOPS.length - 2);
  const t = x - i;
  const rgb = STOPS[i].map((a, k) => Math.round(a + (STOPS[i + 1][k] - a) * t));
  return `rgb(${rgb.join(',')})`;
}

function svgElement(name, attributes, text) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text !== undefined) element.textContent = text;
  return element;
}

function drawHeatmap() {
  const svg = $('heatmap');
  svg.replaceChildren();
  if (!lastAttention || !lastAttention.weights.length) {
    svg.setAttribute('width', 0);
    svg.setAttribute('height', 0);
    return;
  }
  const weights = layerWeights(lastAttention, $('layer').value);
  const sources = lastAttention.source_tokens, targets = lastAttention.target_tokens;
  const left = 12 + 8 * Math.max(...targets.map((t) => t.length));
  const top = 12 + 6 * Math.max(...sources.map((t) => t.length));
  let largest = 1e-9;  // a loop: spreading a large map into Math.max's arguments overflows the stack
  for (const row of weights) for (const w of row) largest = Math.max(largest, w);
  svg.setAttribute('width', left + CELL * sources.length + 10);
  svg.setAttribute('height', top + CELL * targets.length + 10);
  sources.forEach((piece, c) => {
    const x = left + CELL * c + CELL / 2, y = top - 6;
    svg.append(svgElement('text', {x, y, transform: `rotate(-60 ${x} ${y})`, class: 'source-label'}, piece));
  });
  targets.forEach((piece, r) => {
    svg.append(svgElement('text', {x: left - 6, y: top + CELL * r + CELL / 2 + 4, 'text-anchor': 'end',
                                   class: 'target-label'}, piece));
    weights[r].forEach((w, c) => {
      const cell = svgElement('rect', {x: left + CELL * c, y: top + CELL * r, width: CELL - 1, height: CELL - 1,
                                       fill: color(w / largest), class: 'cell', 'data-row': r, 'data-col': c,
                                       'data-weight': w});
      cell.append(svgElement('title', {}, `${piece} ← ${sources[c]}: ${w.toFixed(3)}`));
      svg.append(cell);
    });
  });
}

$('translate').addEventListener('click', translate);
$('model').addEventListener('change', chooseModel);
$('layer').addEventListener('change', drawHeatmap);
$('api-key').addEventListener('change', loadModels);
$('source').addEventListener('keydown', (e) => { if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) translate(); });
loadModels();
