"""The decoder-only LM and the masked LM (lm.py), generation (generate.py) and their data, against
independent computations: NumPy losses and nucleus sets, full-prefix reruns, counts of the masking."""
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import distinct_vectors
from flaxformer_nmt import config as config_lib
from flaxformer_nmt.data import batching
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import packing
from flaxformer_nmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from flaxformer_nmt.decoding import generator as generate
from flaxformer_nmt.models import lm
from flaxformer_nmt.models import transformer as model_lib
from flaxformer_nmt.runtime import flops as flops_lib
from flaxformer_nmt.training import step as train_step_lib

VOCAB = 24


def tiny(task, pre_layer_norm=False, vocab_size=VOCAB, sharpen=3.0):
  config = model_lib.ModelConfig(vocab_size=vocab_size, num_encoder_layers=2, num_decoder_layers=2, d_model=32,
                                 d_ff=64, num_heads=4, dropout_rate=0.0, pre_layer_norm=pre_layer_norm,
                                 max_position=128, dtype='float32', architecture=lm.ARCHITECTURES[task])
  model = lm.build(task, config, mask_id=4)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), *((dummy, dummy) if task == 'translation' else (dummy,)))['params']
  # Sharper than the init distribution: clear winners for greedy search, peaked sampling distributions.
  return model, jax.tree_util.tree_map(lambda x: x * sharpen if x.ndim == 2 else x, params)


def param_shapes(params):
  return sorted(('/'.join(k.key for k in path), tuple(v.shape))
                for path, v in jax.tree_util.tree_flatten_with_path(params)[0])


# The encoder-decoder's parameter tree before the stacks were made reusable (written out from that
# version's model.init): checkpoints of translation runs must keep loading.
_LAYER = {
    'encoder_0': [('attention_block/norm/bias', (8,)), ('attention_block/norm/scale', (8,)),
                  ('feed_forward/wi/bias', (16,)), ('feed_forward/wi/kernel', (8, 16)), ('feed_forward/wo/bias', (8,)),
                  ('feed_forward/wo/kernel', (16, 8)), ('feed_forward_block/norm/bias', (8,)),
                  ('feed_forward_block/norm/scale', (8,)), ('self_attention/output/kernel', (8, 8)),
                  ('self_attention/qkv/kernel', (8, 24))],
    'decoder_0': [('cross_attention/kv/kernel', (8, 16)), ('cross_attention/output/kernel', (8, 8)),
                  ('cross_attention/query/kernel', (8, 8)), ('cross_block/norm/bias', (8,)),
                  ('cross_block/norm/scale', (8,)), ('feed_forward/wi/bias', (16,)),
                  ('feed_forward/wi/kernel', (8, 16)),
                  ('feed_forward/wo/bias', (8,)), ('feed_forward/wo/kernel', (16, 8)),
                  ('feed_forward_block/norm/bias', (8,)), ('feed_forward_block/norm/scale', (8,)),
                  ('self_attention/output/kernel', (8, 8)), ('self_attention/qkv/kernel', (8, 24)),
                  ('self_block/norm/bias', (8,)), ('self_block/norm/scale', (8,))],
}


@pytest.mark.parametrize('pre_layer_norm', [False, True])
def test_the_translation_models_parameter_tree_is_unchanged(pre_layer_norm):
  config = model_lib.ModelConfig(vocab_size=11, num_encoder_layers=1, num_decoder_layers=1, d_model=8, d_ff=16,
                                 num_heads=2, pre_layer_norm=pre_layer_norm)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = jax.eval_shape(lambda: model_lib.Transformer(config).init(jax.random.PRNGKey(0), dummy, dummy))['params']
  expected = [(f'{layer}/{name}', shape) for layer, names in _LAYER.items() for name, shape in names]
  expected.append(('shared_embedding/embedding', (11, 8)))
  if pre_layer_norm:
    expected += [(f'{stack}_norm/{p}', (8,)) for stack in ('encoder', 'decoder') for p in ('bias', 'scale')]
  assert param_shapes(params) == sorted(expected)


def test_the_lm_is_decoder_layers_without_cross_attention_and_a_tied_embedding():
  model, params = tiny('lm', pre_layer_norm=True)
  names = [name for name, _ in param_shapes(params)]
  assert {n.split('/')[0] for n in names} == {'decoder_0', 'decoder_1', 'decoder_norm', 'shared_embedding'}
  assert not any('cross' in n for n in names)
  # Tied: the logits are the final states times the embedding matrix, no other output weights.
  tokens = jnp.array([[BOS_ID, 5, 6, 7]])
  _, state = model.apply({'params': params}, tokens, True, capture_intermediates=True, mutable=['intermediates'])
  normed = np.asarray(state['intermediates']['decoder_norm']['__call__'][0])
  expected = normed @ np.asarray(params['shared_embedding']['embedding']).T
  np.testing.assert_allclose(model.apply({'params': params}, tokens), expected, rtol=1e-5, atol=1e-5)


def test_no_information_flows_from_future_tokens():
  model, params = tiny('lm')
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(np.concatenate([[BOS_ID], rng.integers(5, VOCAB, 9)])[None], jnp.int32)
  logits = np.asarray(model.apply({'params': params}, tokens))
  for t in range(tokens.shape[1] - 1):
    # Every token after t replaced by another one (never by itself).
    later = np.asarray(tokens[0, t + 1:])
    other = 5 + (later - 5 + rng.integers(1, VOCAB - 5, later.size)) % (VOCAB - 5)
    changed = tokens.at[0, t + 1:].set(jnp.asarray(other))
    changed = np.asarray(model.apply({'params': params}, changed))
    np.testing.assert_allclose(changed[0, :t + 1], logits[0, :t + 1], atol=1e-5)
    assert not np.allclose(changed[0, t + 1], logits[0, t + 1], atol=1e-5)


def test_the_mlm_head_is_dense_gelu_layer_norm_then_the_tied_embedding_plus_a_bias():
  """BERT's prediction head over the encoder's output, written out in NumPy (float64, erf GELU), with every
  bias and LayerNorm vector made distinct from its init (all zeros or ones, where a dropped one goes unseen)."""
  model, params = tiny('mlm', sharpen=1.0)
  params = distinct_vectors(params)
  tokens = jnp.array([[5, 6, 4, 8, 9, EOS_ID], [7, 4, EOS_ID, PAD_ID, PAD_ID, PAD_ID]])
  with jax.default_matmul_precision('highest'):
    logits = np.asarray(model.apply({'params': params}, tokens))
    encoded = np.asarray(model.apply({'params': params}, tokens, method=lambda m, t: m.encode(t)), np.float64)
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  h = encoded @ p['head_dense']['kernel'] + p['head_dense']['bias']
  h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
  mean, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
  h = (h - mean) / np.sqrt(var + 1e-5) * p['head_norm']['scale'] + p['head_norm']['bias']
  expected = h @ p['shared_embedding']['embedding'].T + p['head_bias']
  real = np.asarray(tokens) != PAD_ID
  np.testing.assert_allclose(logits[real], expected[real], rtol=1e-4, atol=1e-4)


def test_the_mlm_sees_both_sides():
  model, params = tiny('mlm')
  tokens = jnp.array([[5, 6, 4, 8, 9, EOS_ID]])
  logits = model.apply({'params': params}, tokens)
  later = model.apply({'params': params}, tokens.at[0, 4].set(12))
  assert not np.allclose(logits[0, 2], later[0, 2], atol=1e-5)  # the mask's prediction reads the right side


# --- BERT masking ------------------------------------------------------------------------------------------

def test_bert_masking_selects_15_percent_and_splits_80_10_10():
  rng = np.random.default_rng(1)
  vocab = 5000
  tokens = rng.integers(5, vocab, (400, 250))
  lengths = rng.integers(1, 251, 400)
  tokens[np.arange(250)[None] >= lengths[:, None]] = PAD_ID
  tokens[np.arange(400), lengths - 1] = EOS_ID
  tokens = jnp.asarray(tokens, jnp.int32)
  inputs, targets = jax.device_get(lm.bert_mask(jax.random.PRNGKey(3), tokens, mask_id=4, vocab_size=vocab))
  tokens = np.asarray(tokens)
  ordinary = (tokens != PAD_ID) & (tokens != EOS_ID)
  selected = targets != PAD_ID
  assert not selected[~ordinary].any()  # padding and EOS are never selected
  np.testing.assert_array_equal(targets[selected], tokens[selected])
  np.testing.assert_array_equal(inputs[~selected], tokens[~selected])  # unselected tokens are left alone
  n = ordinary.sum()
  # Binomial standard deviations: sqrt(.15 * .85 / n) ~ 0.0011 for n ~ 50k; sqrt(.8 * .2 / 7.5k) ~ 0.0046.
  assert abs(selected.sum() / n - 0.15) < 0.005
  masked = (inputs == 4) & selected
  random = (inputs != 4) & (inputs != tokens) & selected
  kept = (inputs == tokens) & selected
  k = selected.sum()
  assert abs(masked.sum() / k - 0.8) < 0.02
  assert abs(random.sum() / k - 0.1) < 0.015  # (a random draw equal to the token: 1 in 5000, counted as kept)
  assert abs(kept.sum() / k - 0.1) < 0.015
  assert inputs[random].min() >= 5 and inputs[random].max() < vocab  # never a reserved id or the mask
  assert np.unique(inputs[random]).size > 100  # spread over the vocabulary


def test_mlm_loss_counts_only_the_selected_positions():
  model, params = tiny('mlm', sharpen=1.0)
  tokens = jnp.asarray(np.random.default_rng(2).integers(5, VOCAB, (4, 12)), jnp.int32).at[:, -1].set(EOS_ID)
  tokens = tokens.at[2, 7:].set(PAD_ID)
  batch = {'src': tokens}
  sums = train_step_lib.eval_step(params, batch, model=model, label_smoothing=0.0, task='mlm')
  # The same masking, recomputed outside the step, and the loss over the selected positions in NumPy.
  inputs, targets = lm.bert_mask(lm.eval_mask_rng(tokens), tokens, mask_id=4, vocab_size=VOCAB)
  logits = np.asarray(model.apply({'params': params}, inputs), np.float64)
  targets = np.asarray(targets)
  rows, cols = np.nonzero(targets != PAD_ID)
  assert len(rows) > 0
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -log_probs[rows, cols, targets[rows, cols]]
  assert float(sums['target_tokens']) == len(rows)
  np.testing.assert_allclose(float(sums['nll_sum']), nll.sum(), rtol=1e-5)
  hits = (logits[rows, cols].argmax(-1) == targets[rows, cols]).sum()
  assert float(sums['correct']) == hits


def test_the_train_steps_masking_changes_with_the_step_and_repeats_at_the_same_step(monkeypatch):
  """Rule: the real train step draws the MLM's masks from the step (a new mask at every step), and the same
  state at the same step masks the same positions (an exact resume masks as the straight run did)."""
  model, params = tiny('mlm', sharpen=1.0)
  optimizer, schedule = train_step_lib.make_optimizer(config_lib.base_config())
  state = train_step_lib.init_state(model, optimizer, seed=0).replace(params=params)
  tokens = jnp.asarray(np.random.default_rng(4).integers(5, VOCAB, (8, 32)), jnp.int32)
  masks, bert_mask = [], lm.bert_mask

  def recorded(rng, tokens, **options):  # bert_mask, its targets (PAD where not selected) kept
    inputs, targets = bert_mask(rng, tokens, **options)
    jax.debug.callback(lambda t: masks.append(np.asarray(t) != PAD_ID), targets)
    return inputs, targets
  monkeypatch.setattr(lm, 'bert_mask', recorded)
  step = jax.jit(lambda s: train_step_lib.train_step(s, {'src': tokens}, model=model, optimizer=optimizer,
                                                     schedule=schedule, label_smoothing=0.0, task='mlm'))
  for number in (3, 4, 3):
    jax.block_until_ready(step(state.replace(step=jnp.asarray(number, jnp.int32))))
  assert len(masks) == 3 and all(m.sum() > 0 for m in masks)
  assert not np.array_equal(masks[0], masks[1])  # steps 3 and 4
  np.testing.assert_array_equal(masks[0], masks[2])  # step 3 twice


def test_bert_masking_draws_each_input_with_bert_probabilities_over_a_small_vocabulary():
  """Over three ordinary ids (5, 6, 7 after the mask id 4) the input at a selected position is written out per
  outcome: the mask with 0.8, the token itself with 0.1 + 0.1 / 3 (kept, or drawn), each other ordinary id with
  0.1 / 3, and never a reserved id. Catches the random draw starting at the mask id or a reserved id, and BOS
  (the row's first token here) selected."""
  vocab, ordinary = 8, np.array([5, 6, 7])
  tokens = np.random.default_rng(11).choice(ordinary, size=(600, 400))
  tokens[:, 0], tokens[:, -1] = BOS_ID, EOS_ID
  inputs, targets = jax.device_get(lm.bert_mask(jax.random.PRNGKey(5), jnp.asarray(tokens, jnp.int32), mask_id=4,
                                                vocab_size=vocab))
  selected = targets != PAD_ID
  assert not selected[:, 0].any() and not selected[:, -1].any()
  np.testing.assert_array_equal(inputs[~selected], tokens[~selected])
  chosen, original = inputs[selected], tokens[selected]
  assert set(np.unique(chosen).tolist()) <= {4, 5, 6, 7}
  k = len(chosen)  # about 0.15 * 600 * 398 = 36k: standard deviations below 0.0025
  assert abs(np.mean(chosen == 4) - 0.8) < 0.01
  assert abs(np.mean(chosen == original) - (0.1 + 0.1 / 3)) < 0.008
  for v in ordinary:
    other = (original != v)
    assert abs(np.mean(chosen[other] == v) - 0.1 / 3) < 0.006, (v, k)


def test_validation_masks_depend_on_the_batch_content_and_repeat_for_the_same_batch():
  """eval_mask_rng: the same batch masks the same positions at every evaluation; a batch of the same shape with
  other tokens masks other positions."""
  tokens = jnp.asarray(np.random.default_rng(12).integers(5, VOCAB, (8, 64)), jnp.int32)
  other = 5 + (tokens - 4) % (VOCAB - 5)  # every token replaced by another ordinary one
  selected = lambda t: np.asarray(lm.bert_mask(lm.eval_mask_rng(t), t, mask_id=4, vocab_size=VOCAB)[1]) != PAD_ID
  np.testing.assert_array_equal(selected(tokens), selected(tokens))
  assert not np.array_equal(selected(tokens), selected(other))


def test_the_lm_loss_predicts_each_next_token_of_the_batch_text():
  """What the LM's loss is taken over (lm.forward on a batch built by make_batch), against NumPy: the input row
  BOS + text, each position scored on the token after it (the text, then EOS), padding unscored. Catches
  targets or inputs shifted by another position, or the targets fed as the input."""
  model, params = tiny('lm', sharpen=1.0)
  rng = np.random.default_rng(13)
  sentences = [list(rng.integers(5, VOCAB, size=n)) + [EOS_ID] for n in (4, 7, 1, 9)]
  batch = {k: jnp.asarray(v) for k, v in batching.make_batch(sentences, sentences, 4, 12).items()}
  logits, targets, _ = lm.forward('lm', model, params, batch, True)
  logits, targets = np.asarray(logits, np.float64), np.asarray(targets)
  inputs = np.full((4, 12), PAD_ID, np.int32)
  for r, s in enumerate(sentences):
    inputs[r, :len(s)] = [BOS_ID] + s[:-1]
  expected = np.asarray(model.apply({'params': params}, jnp.asarray(inputs)), np.float64)
  nll = lambda lp, r, t, target: -(lp[r, t, target] - np.log(np.exp(lp[r, t]).sum()))
  want = sum(nll(expected, r, t, target) for r, s in enumerate(sentences) for t, target in enumerate(s))
  scored = [(r, t) for r, t in zip(*np.nonzero(targets != PAD_ID))]
  assert len(scored) == sum(map(len, sentences))
  got = sum(nll(logits, r, t, targets[r, t]) for r, t in scored)
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize('task', ['lm', 'mlm'])
def test_a_packed_row_computes_each_example_as_it_would_alone(task):
  """Rule (packing.py): examples packed into one row attend only to themselves, positions restarting with each.
  lm.forward's logits over a row of three packed sentences, at each sentence's positions, against the model run
  on that sentence alone (its input: BOS + text for the LM, the masked text for the MLM, the masks taken from
  the packed row's own bert_mask). Catches the packed row's segments or positions not passed to the model."""
  model, params = tiny(task, sharpen=1.0)
  rng = np.random.default_rng(15)
  sentences = [[int(t) for t in rng.integers(5, VOCAB, n)] + [EOS_ID] for n in (3, 6, 2)]
  batch = {k: jnp.asarray(v) for k, v in packing.make_packed_batch(sentences, sentences, [[0, 1, 2]], 1, 16).items()}
  logits, _, _ = lm.forward(task, model, params, batch, True)
  if task == 'lm':
    row = np.asarray(batch['tgt_in'][0])
  else:
    row = np.asarray(lm.bert_mask(lm.eval_mask_rng(batch['src']), batch['src'], mask_id=4, vocab_size=VOCAB)[0][0])
  offset = 0
  for sentence in sentences:
    n = len(sentence)
    alone = model.apply({'params': params}, jnp.asarray(row[None, offset:offset + n]))
    np.testing.assert_allclose(np.asarray(logits)[0, offset:offset + n], np.asarray(alone)[0], atol=1e-4)
    offset += n
  assert offset < 16  # padding after the examples


# --- Generation ----------------------------------------------------------------------------------------------

def _generate(model, params, prompts, seeds, **options):
  width = 8
  rows = batching.pad_rows([[BOS_ID] + p for p in prompts], len(prompts), width)
  lengths = np.array([1 + len(p) for p in prompts], np.int32)
  keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
  defaults = dict(max_new_tokens=10, greedy=False, temperature=1.0, top_k=0, top_p=1.0)
  return np.asarray(generate.generate_tokens(model, params, rows, lengths, keys, **{**defaults, **options}))


PROMPTS = [[5, 6, 7], [9], [], [10, 11, 12, 13, 14]]


def test_greedy_generation_equals_argmax_of_full_reruns():
  model, params = tiny('lm')
  out = _generate(model, params, PROMPTS, [0, 1, 2, 3], greedy=True)
  # One compiled program for every length: the sequence right-padded to 16 (the causal mask keeps the padding
  # out of the positions read, as test_no_information_flows_from_future_tokens checks).
  full_model = jax.jit(lambda tokens: model.apply({'params': params}, tokens))
  for row, prompt in enumerate(PROMPTS):
    sequence = [BOS_ID] + prompt
    assert list(out[row, :len(prompt)]) == prompt  # the prompt is kept
    for _ in range(10):  # an independent loop: the whole sequence through the model at every step
      padded = np.full((1, 16), PAD_ID, np.int32)
      padded[0, :len(sequence)] = sequence
      logits = np.array(full_model(jnp.asarray(padded)))[0, len(sequence) - 1]
      logits[[PAD_ID, BOS_ID]] = -np.inf
      sequence.append(int(logits.argmax()))
      if sequence[-1] == EOS_ID:
        break
    generated = list(out[row, :len(sequence) - 1])
    assert generated == sequence[1:]


def tiny_generator(monkeypatch, model, params):
  """A Generator around a tiny LM (no workdir: loader.load_for_inference returns it), its search's outputs
  [N, positions] kept in `generator.outputs`."""
  loaded = types.SimpleNamespace(config=types.SimpleNamespace(model=model.config), tokenizer=None, model=model,
                                 params=params, description='tiny')
  monkeypatch.setattr(generate.loader, 'load_for_inference', lambda *args, **kwargs: loaded)
  generator = generate.Generator('tiny')
  generator.outputs, search = [], generator._generate

  def recorded(*args, **kwargs):
    tokens = search(*args, **kwargs)
    generator.outputs.append(np.asarray(tokens))
    return tokens
  generator._generate = recorded
  return generator


def test_a_prompt_fits_where_bos_prompt_and_new_tokens_fit_the_positions(monkeypatch):
  """Rule: BOS + prompt + max_new_tokens <= max_position (the final EOS is never fed back); the padded
  prompts stay within the positions too, and the tokens are those of full reruns at every position."""
  model, params = tiny('lm')  # max_position 128
  generator = tiny_generator(monkeypatch, model, params)
  prompts = [[7, 8], list(np.random.default_rng(6).integers(5, VOCAB, 101))]  # BOS + 101 + 26 new = 128
  out = generator.generate_ids(prompts, max_new_tokens=26, greedy=True)
  assert generator.outputs[-1].shape[1] <= 128  # the positions the search holds
  assert generator.generate_ids(prompts, max_new_tokens=26, greedy=True, use_cache=False) == out
  full_model = jax.jit(lambda tokens: model.apply({'params': params}, tokens))
  for prompt, [new] in zip(prompts, out):  # an independent loop: argmax of full reruns over all 128 positions
    sequence, expected = [BOS_ID] + [int(t) for t in prompt], []
    while len(expected) < 26:
      padded = np.full((1, 128), PAD_ID, np.int32)
      padded[0, :len(sequence)] = sequence
      logits = np.array(full_model(jnp.asarray(padded)))[0, len(sequence) - 1]
      logits[[PAD_ID, BOS_ID]] = -np.inf
      if logits.argmax() == EOS_ID:
        break
      sequence.append(int(logits.argmax()))
      expected.append(sequence[-1])
    assert new == expected
  assert len(out[1][0]) == 26  # this prompt's last new token read position 127
  with pytest.raises(ValueError, match=r"^prompts\[1\]: BOS \+ 101 prompt tokens \+ 27 new tokens exceed the "
                     r"model's 128 positions$"):
    generator.generate_ids(prompts, max_new_tokens=27, greedy=True)


@pytest.mark.parametrize('temperature', [1e9, float('inf')])
def test_a_high_temperature_keeps_the_length_limit_and_the_forbidden_tokens(monkeypatch, temperature):
  """Rule: the temperature flattens the allowed tokens only; PAD and BOS are never drawn and a row stops at
  max_new_tokens (EOS forced), however high the temperature (a division of NEG_INF by it would free them)."""
  model, params = tiny('lm', sharpen=1.0)
  generator = tiny_generator(monkeypatch, model, params)
  out = generator.generate_ids(PROMPTS, max_new_tokens=3, temperature=temperature, num_samples=8, seed=1)
  new = [ids for samples in out for ids in samples]
  assert all(len(ids) <= 3 for ids in new)
  assert not {PAD_ID, BOS_ID} & {t for ids in new for t in ids}
  assert len({t for ids in new for t in ids}) > 10  # spread over the vocabulary
  # Wrong rule caught: one message listed every condition and every value, naming none as the one at fault.
  for bad in (dict(temperature=float('nan')), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
              dict(max_new_tokens=0), dict(num_samples=0)):
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=rf'^{name}={value}: give '):
      generator.generate_ids(PROMPTS, **bad)


def test_a_seed_outside_int32_is_a_value_error_naming_it(monkeypatch):
  """Rule: the PRNG key takes an int32; a larger --seed is the command's one-line error, not an OverflowError."""
  model, params = tiny('lm')
  generator = tiny_generator(monkeypatch, model, params)
  assert generator.generate_ids([[7]], max_new_tokens=2, seed=2**31 - 1)
  for seed in (2**31, -2**31 - 1):
    with pytest.raises(ValueError, match=rf'^seed={seed}: give an integer from -2147483648 to 2147483647$'):
      generator.generate_ids([[7]], max_new_tokens=2, seed=seed)


@pytest.mark.parametrize('prompt, continuation, starts_word, expected', [
    ('Ein Mann', 'reitet ein Pferd.', True, 'Ein Mann reitet ein Pferd.'),  # a new word: one space
    ('Ein Man', 'n reitet', False, 'Ein Mann reitet'),  # the prompt's last word continued: no space
    ('Ein  Mann \t', 'reitet', True, 'Ein  Mann reitet'),  # trailing whitespace replaced, the rest as typed
    ('Über 😀', 'ein', True, 'Über 😀 ein'),  # characters outside a vocabulary kept
    ('', 'Ein Mann', True, 'Ein Mann'),  # unconditional: the continuation alone
    ('Ein Mann ', '', False, 'Ein Mann '),  # nothing generated: the prompt as it is
])
def test_the_prompt_text_is_joined_to_its_continuation(prompt, continuation, starts_word, expected):
  """Rule: the output is the prompt as given, then the continuation, a space between them where it starts a word."""
  assert generate.join_continuation(prompt, continuation, starts_word) == expected


@pytest.mark.parametrize('options', [dict(greedy=True), dict(temperature=0.8, top_k=5), dict(top_p=0.9)])
def test_generation_with_the_cache_equals_generation_without_it(options):
  model, params = tiny('lm', pre_layer_norm=True)
  cached = _generate(model, params, PROMPTS, [0, 1, 2, 3], use_cache=True, **options)
  uncached = _generate(model, params, PROMPTS, [0, 1, 2, 3], use_cache=False, **options)
  np.testing.assert_array_equal(cached, uncached)


def test_sampling_is_reproducible_from_the_seed_and_independent_of_the_batch():
  model, params = tiny('lm', sharpen=1.0)
  first = _generate(model, params, PROMPTS, [0, 1, 2, 3])
  np.testing.assert_array_equal(first, _generate(model, params, PROMPTS, [0, 1, 2, 3]))
  other = _generate(model, params, PROMPTS, [7, 8, 9, 10])
  assert not np.array_equal(first, other)
  # A row's sample depends on its key alone, not on the other rows of its batch.
  alone = _generate(model, params, [PROMPTS[2]], [2])
  np.testing.assert_array_equal(alone[0], first[2])


def test_sample_j_of_prompt_i_is_the_same_in_any_batch(monkeypatch):
  """Rule: sample j of prompt i depends on the seed, i and j only: the last two prompts generated on their own
  (first_prompt=2) give the samples they got after the first two; the same prompt text as prompt 0 and 2 is
  sampled differently, and so are the samples of one prompt. Prompts of 15 and 16 tokens fill one and two
  16-position widths with BOS (catches a width rounded without BOS, which cuts the prompt)."""
  model, params = tiny('lm', sharpen=1.0)
  generator = tiny_generator(monkeypatch, model, params)
  rng = np.random.default_rng(8)
  prompts = [[5, 6], [int(t) for t in rng.integers(5, VOCAB, 15)], [5, 6], [int(t) for t in rng.integers(5, VOCAB, 16)]]
  options = dict(max_new_tokens=6, temperature=2.0, num_samples=3, seed=4)
  together = generator.generate_ids(prompts, **options)
  assert generator.generate_ids(prompts[2:], first_prompt=2, **options) == together[2:]
  assert together[0] != together[2]  # prompt number 0 and 2: other draws
  assert all(len({tuple(ids) for ids in samples}) > 1 for samples in together)  # not one sample drawn 3 times


def nucleus_numpy(probs, p):
  """The smallest set of most likely tokens with total probability >= p (a loop, as the definition)."""
  order = sorted(range(len(probs)), key=lambda i: -probs[i])
  chosen, total = set(), 0.0
  for i in order:
    chosen.add(i)
    total += probs[i]
    if total >= p:
      break
  return chosen


@pytest.mark.parametrize('p', [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_exactly_the_smallest_set_reaching_p(p):
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(64, 40)) * 2
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  kept = np.asarray(generate.top_p_filter(jnp.asarray(log_probs, jnp.float32), p)) > generate.NEG_INF / 2
  for row in range(len(logits)):
    assert set(np.flatnonzero(kept[row])) == nucleus_numpy(np.exp(log_probs[row]), p)


def sampling_distribution(logits, temperature, top_k, top_p):
  """The distribution a sampled token is drawn from, by its definition: softmax(logits / temperature) over the
  allowed tokens (PAD and BOS never), the top_k most likely kept and renormalized, then the smallest most likely
  set reaching top_p (nucleus_numpy) kept and renormalized."""
  scaled = np.asarray(logits, np.float64) / temperature
  allowed = ~np.isin(np.arange(len(scaled)), [PAD_ID, BOS_ID])
  p = np.where(allowed, np.exp(scaled - scaled[allowed].max()), 0.0)
  p /= p.sum()
  if top_k:
    p = np.where(p >= np.sort(p)[::-1][top_k - 1], p, 0.0)
    p /= p.sum()
  p = np.where(np.isin(np.arange(len(p)), list(nucleus_numpy(p, top_p))), p, 0.0)
  return p / p.sum()


@pytest.mark.parametrize('temperature, top_k, top_p', [(0.5, 0, 1.0), (1.0, 3, 0.6), (2.0, 4, 0.9)])
def test_sampled_tokens_follow_the_tempered_top_k_then_top_p_distribution(monkeypatch, temperature, top_k, top_p):
  """Rule: a token is drawn from softmax(logits / temperature) cut to the top_k, renormalized, then cut to the
  top_p nucleus (the order of Hugging Face's sampler), each step with a fresh draw. A model that gives the same
  logits at every step, 20,000 rows of BOS alone: the frequencies of the first and second tokens against the
  NumPy distribution, within 5 binomial standard deviations, and the two tokens independent (equal with
  probability sum p^2). Catches the temperature applied twice or not at all, top-p before top-k (at 0.6 over
  top-3 here they keep 3 tokens instead of 2), top-p over unnormalized probabilities, the same key at every step."""
  logits = np.array([2.0, 0.4, 3.0, -1.0, 1.0, 0.8, 0.55, 0.2, -0.3, 0.9])  # no ties; PAD and BOS most likely
  rows = 20000
  steps = lambda tokens, index, cache: (jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (rows, len(logits))), cache)
  monkeypatch.setattr(generate, '_step_functions', lambda *args: (steps, jnp.zeros(())))
  keys = jax.vmap(jax.random.key)(jnp.arange(rows))
  out = np.asarray(generate.generate_tokens(
      None, None, jnp.full((rows, 1), BOS_ID, jnp.int32), jnp.ones(rows, jnp.int32), keys, max_new_tokens=2,
      greedy=False, temperature=temperature, top_k=top_k, top_p=top_p))
  expected = sampling_distribution(logits, temperature, top_k, top_p)
  assert (expected > 0).sum() >= 2  # something to draw from
  first, second = out[:, 0], out[out[:, 0] != EOS_ID, 1]
  for tokens in (first, second):
    counts = np.bincount(tokens, minlength=len(logits))
    sd = np.sqrt(expected * (1 - expected) / len(tokens))
    np.testing.assert_array_less(np.abs(counts / len(tokens) - expected), 5 * sd + 1e-9)
  same = (out[:, 0] == out[:, 1])[out[:, 0] != EOS_ID]
  repeat = (expected ** 2).sum() / (1 - expected[EOS_ID])  # P(second == first | first is not EOS)
  assert abs(same.mean() - repeat) < 5 * np.sqrt(repeat * (1 - repeat) / len(same))


def test_top_k_keeps_the_k_most_likely():
  log_probs = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
  kept = np.asarray(generate.top_k_filter(log_probs, 2)) > generate.NEG_INF / 2
  assert list(np.flatnonzero(kept[0])) == [1, 3]


# --- Data and FLOPs ------------------------------------------------------------------------------------------

def test_split_long_cuts_lines_into_pieces():
  lines = [[5, 6, 7, EOS_ID], list(range(5, 15)) + [EOS_ID], [8, EOS_ID]]
  corpus = data_lib.TokenizedCorpus.from_lists(lines, lines)
  cut = data_lib.split_long(corpus, 4)
  expected = [[5, 6, 7, EOS_ID], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, EOS_ID], [8, EOS_ID]]
  assert [list(cut.source[i]) for i in range(len(cut))] == expected
  assert cut.target is cut.source


@pytest.mark.parametrize('task', ['lm', 'mlm'])
def test_flops_count_the_models_own_matmul_weights(task):
  model, params = tiny(task)
  # Matmul weights per token, read off the parameter tree: kernels plus the (tied) vocabulary projection.
  kernels = sum(int(np.prod(v.shape)) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]
                if path[-1].key in ('kernel', 'embedding'))
  layers, d, length, tokens = 2, 32, 16, 100
  expected = tokens * (2 * kernels + layers * 4 * length * d)  # + attention scores and weighted values
  if task == 'lm':
    assert flops_lib.forward_flops(model.config, VOCAB, 0, tokens, 0, length) == expected
  else:
    assert flops_lib.forward_flops(model.config, VOCAB, tokens, 15, length, 0) == expected
