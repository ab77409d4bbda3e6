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
    ids = self.tokenizer.encode([tokenizer_lib.prepare_text(text, tokenizer_lib.lowercase_of(self.config))])[0]
    space = self.tokenizer.sp.piece_to_id('\u2581')
    return [t for i, t in enumerate(ids) if not (t == space and i + 1 < len(ids) and ids[i + 1] == self.mask_id)]

  def predict_ids(self, token_lists, top_k=5):
    """For each token list, per mask (in order), the top_k [(piece id, probability)]."""
    token_lists = [list(t) for t in token_lists]
    if not token_lists:
      return []
    width = batching.bucket_length(max(len(t) for t in token_lists), self.config.length_buckets)
    if width > self.config.model.max_position:
      raise ValueError(f'a text of {width} tokens exceeds the model\'s {self.config.model.max_position} positions')
    tokens = batching.pad_rows(token_lists, len(token_lists), width)
    probs, ids = jax.device_get(self._predict(self.params, tokens, top_k=int(top_k)))
    return [[[(int(ids[b, t, j]), float(probs[b, t, j])) for j in range(top_k)]
             for t, token in enumerate(row) if token == self.mask_id]
            for b, row in enumerate(token_lists)]

  def fill(self, texts, top_k=5):
    """For each text (str with `<mask>`s), per mask, the top_k (piece as text, probability, the text with
    this mask filled by the piece and the other masks left as they are)."""
    if top_k < 1:
      raise ValueError(f'top_k must be at least 1, not {top_k}')
    token_lists = [self.encode(text) for text in texts]
    for number, ids in enumerate(token_lists, start=1):
      if self.mask_id not in ids:
        raise ValueError(f'text {number} has no {MASK}: {texts[number - 1]!r}')
    results = []
    for ids, masks in zip(token_lists, self.predict_ids(token_lists, top_k)):
      positions = [t for t, token in enumerate(ids) if token == self.mask_id]
      per_mask = []
      for position, candidates in zip(positions, masks):
        per_mask.append([(self.tokenizer.decode([piece]), prob, self._text(ids, position, piece))
                         for piece, prob in candidates])
      results.append(per_mask)
    return results

  def _text(self, ids, position, piece):
    """The text of `ids` with `piece` at `position`, the other masks written as <mask>."""
    filled = list(ids)
    filled[position] = piece
    text = [self.tokenizer.sp.id_to_piece(t) for t in filled if t != tokenizer_lib.EOS_ID]
    return self.tokenizer.sp.decode_pieces(text).replace(MASK, f' {MASK}').strip().replace('  ', ' ')


def format_results(text, per_mask):
  lines = [text]
  for m, candidates in enumerate(per_mask, start=1):
    lines.append(f'  mask {m}/{len(per_mask)}')
    width = max(len(piece) for piece, _, _ in candidates)
    lines += [f'    {prob:.4f}  {piece:<{width}}  {filled}' for piece, prob, filled in candidates]
  return lines
