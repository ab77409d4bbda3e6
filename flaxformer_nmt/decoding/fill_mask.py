"""Fill-mask with an encoder-only masked LM (config.task='mlm'): the top-k pieces and their probabilities at each
<mask>; the fill_mask command's library."""
import functools

import jax

from flaxformer_nmt.data import batching
from flaxformer_nmt.checkpointing import loader
from flaxformer_nmt.data import tokenizer as tokenizer_lib

MASK = tokenizer_lib.MASK_PIECE


def _top_k_probabilities(model, params, tokens, top_k):
  """(probabilities [B, T, k], piece ids [B, T, k]) of the k most likely pieces at every position."""
  logits = model.apply({'params': params}, tokens, True)
  return jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)


class FillMask:
  """A trained masked language model, loaded once, predicting the pieces behind `<mask>`s."""

  def __init__(self, workdir, checkpoint='latest'):
    loaded = loader.load_for_inference(workdir, checkpoint, task='mlm')
    self.config, self.tokenizer, self.model = loaded.config, loaded.tokenizer, loaded.model
    self.mask_id = self.tokenizer.mask_id
    self.params, self.checkpoint = loaded.params, loaded.description
    self._predict = jax.jit(functools.partial(_top_k_probabilities, self.model), static_argnames='top_k')

  def encode(self, text):
    """Token ids of a text with `<mask>`s (EOS appended). sentencepiece writes a lone word-start piece '▁'
    before a mask that follows a space; the mask stands for a whole piece, word start included, as the
    masked pieces in training did, so that lone piece is dropped."""
    ids = self.tokenizer.encode([self._prepared(text)])[0]
    space = self.tokenizer.sp.piece_to_id('\u2581')
    return [t for i, t in enumerate(ids) if not (t == space and i + 1 < len(ids) and ids[i + 1] == self.mask_id)]

  def _prepared(self, text):
    return tokenizer_lib.prepare_text(text, tokenizer_lib.lowercase_of(self.config))

  @property
  def vocab_size(self):
    return self.model.config.vocab_size

  def check_top_k(self, top_k):
    if not 1 <= top_k <= self.vocab_size:
      raise ValueError(f'top_k={top_k}: give 1 to {self.vocab_size} (the vocabulary\'s size)')

  def encode_checked(self, texts, names=None):
    """`encode` of each text, each checked for a <mask> and for the model's positions; a ValueError names the
    first text that fails by names[i] (default: text i + 1)."""
    names = names or [f'text {i}' for i in range(1, len(texts) + 1)]
    max_position = self.config.model.max_position
    token_lists = [self.encode(text) for text in texts]
    for name, text, ids in zip(names, texts, token_lists):
      if self.mask_id not in ids:
        raise ValueError(f'{name}: no {MASK} in {text!r}')
      if len(ids) > max_position:
        raise ValueError(f'{name}: {len(ids)} tokens (EOS included) exceed the model\'s {max_position} positions')
    return token_lists

  def predict_ids(self, token_lists, top_k=5):
    """For each token list, per mask (in order), the top_k [(piece id, probability)]."""
    self.check_top_k(top_k)
    token_lists = [list(t) for t in token_lists]
    if not token_lists:
      return []
    max_position = self.config.model.max_position
    longest = max(range(len(token_lists)), key=lambda b: len(token_lists[b]))
    if len(token_lists[longest]) > max_position:
      raise ValueError(f'token_lists[{longest}]: {len(token_lists[longest])} tokens exceed the model\'s '
                       f'{max_position} positions')
    # The length bucket, at most the positional table's length.
    width = min(batching.bucket_length(len(token_lists[longest]), self.config.length_buckets), max_position)
    tokens = batching.pad_rows(token_lists, len(token_lists), width)
    probs, ids = jax.device_get(self._predict(self.params, tokens, top_k=int(top_k)))
    return [[[(int(ids[b, t, j]), float(probs[b, t, j])) for j in range(top_k)]
             for t, token in enumerate(row) if token == self.mask_id]
            for b, row in enumerate(token_lists)]

  def fill(self, texts, top_k=5):
    """For each text (str with `<mask>`s), per mask, the top_k (piece as text, probability, the text with
    this mask filled by the piece and the other masks left as they are)."""
    return self.fill_ids(texts, self.encode_checked(texts), top_k)

  def fill_ids(self, texts, token_lists, top_k=5):
    """`fill` of texts whose `encode_checked` ids are token_lists."""
    results = []
    for text, masks in zip(texts, self.predict_ids(token_lists, top_k)):
      results.append([[(self.tokenizer.decode([piece]), prob, self._text(text, m, piece)) for piece, prob in candidates]
                      for m, candidates in enumerate(masks)])
    return results

  def _text(self, text, m, piece):
    """The text (as the model reads it: lowercased for a lowercasing model) with its mask m filled by `piece`,
    its other masks left as <mask>: its own characters around the mask, characters the vocabulary lacks included
    (text written back from ids shows them as ⁇). A piece that starts a word follows a space; any other continues
    the word before the mask."""
    parts = self._prepared(text).split(MASK)
    before, after = MASK.join(parts[:m + 1]).rstrip(), MASK.join(parts[m + 1:])
    word = self.tokenizer.sp.id_to_piece(piece)
    if word.startswith('\u2581'):
      return (before + ' ' if before else '') + word[1:].replace('\u2581', ' ') + after
    return before + self.tokenizer.decode([piece]) + after


def format_results(text, per_mask):
  lines = [text]
  for m, candidates in enumerate(per_mask, start=1):
    lines.append(f'  mask {m}/{len(per_mask)}')
    width = max(len(piece) for piece, _, _ in candidates)
    lines += [f'    {prob:.4f}  {piece:<{width}}  {filled}' for piece, prob, filled in candidates]
  return lines
