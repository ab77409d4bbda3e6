"""Validation BLEU while training: translate the validation split with the parameters in memory and score it.

Every `config.eval_bleu_every_steps` the trainer calls `ValidationBleu.evaluate(step, params)`: the first
`eval_bleu_max_sentences` pairs of `eval_split` are translated with the decode command's batched search (beam
`eval_bleu_beam_size`, 0 = greedy, the config's length penalty) jitted once over the training parameters as
they lie on the devices (replicated or FSDP-sharded: no checkpoint is read, no parameter gathered on a host),
then scored with sacreBLEU (13a; case-insensitive for a config with `lowercase`) and, where
`{eval_bleu_tok_ref_dir}/{eval_split}.{target_lang}` exists, the lowercased Moses-tokenized BLEU of the Multi30k
papers (evaluate.py). The translations are written to `{workdir}/eval/hyp_STEP.txt` (one line per validation
sentence, in order) so a score can be checked.

Several hosts: every host runs the same jitted search on the same batches (a collective when the parameters
are sharded), so none waits in a collective the others skip; process 0 scores, writes the file, and its
numbers are broadcast so every host takes the same best-checkpoint decision.
"""
import time

import jax
import numpy as np
import sacrebleu
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from flaxformer_nmt import config as config_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib
from flaxformer_nmt.data import corpora
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.decoding import batch_search
from flaxformer_nmt.decoding.ladder import Ladder
from flaxformer_nmt.decoding import translator as translator_lib
from flaxformer_nmt.evaluation import bleu as evaluate
from flaxformer_nmt.models.transformer import with_vocabulary_kernel
from flaxformer_nmt.runtime import distributed
from flaxformer_nmt.runtime import sharding

HYPOTHESES_DIR = 'eval'
# Numeric results, in the order they are broadcast from process 0.
_NUMBERS = ('eval/bleu', 'eval/tok_bleu', 'eval/bleu_length_ratio', 'eval/bleu_brevity_penalty')


def hypotheses_path(workdir, step):
  return epath.Path(workdir) / HYPOTHESES_DIR / f'hyp_{int(step)}.txt'


def tokenized_reference_path(config):
  """`{eval_bleu_tok_ref_dir}/{eval_split}.{target_lang}`, or None when not configured or absent."""
  path = config_lib.tokenized_reference(config)
  return epath.Path(path) if path and epath.Path(path).exists() else None


class ValidationBleu:
  """The validation sentences, tokenized and batched once, and the jitted search that translates them."""

  def __init__(self, config, tokenizer, workdir, mesh):
    self.config, self.tokenizer, self.workdir = config, tokenizer, epath.Path(workdir)
    self.every = config.eval_bleu_every_steps
    if not self.enabled:
      return
    pairs = corpora.open_split(config, config.eval_split)
    count = min(config.eval_bleu_max_sentences or len(pairs), len(pairs))
    sources, self.references = pairs.read(range(count))
    self.tok_references = None
    tok_path = tokenized_reference_path(config)
    if tok_path is not None:
      # Line i of the tokenized references is line i of the split's files, whose dropped pairs leave gaps.
      lines = getattr(pairs, 'line_indices', range(count))[:count]
      tok_lines = evaluate.read_text(tok_path)
      num_lines = getattr(pairs, 'num_lines', len(pairs))  # a text split's lines, its dropped pairs included
      if len(tok_lines) != num_lines:  # another corpus's references
        raise data_lib.DataError(f'{tok_path}: {len(tok_lines)} lines, but {config.eval_split} has {num_lines} '
                                 f'({pairs.description}): set --config.eval_bleu_tok_ref_dir to its tokenized '
                                 'references, or empty')
      self.tok_references = [tok_lines[i] for i in lines]
    elif config.eval_bleu_tok_ref_dir:
      logging.warning('No %s.%s in %s (config.eval_bleu_tok_ref_dir): validation BLEU is sacreBLEU only, without '
                      'the lowercased tokenized BLEU', config.eval_split, config.target_lang,
                      config.eval_bleu_tok_ref_dir)
    self.token_lists = tokenizer.encode(sources)
    # The model as translator_lib.Translator builds it: attention and remat chosen for decoding on this machine (the
    # parameters are the same whatever the training run chose).
    decode_config = config.copy_and_resolve_references()
    decode_config.model.attention_impl, decode_config.model.remat = 'auto', 'none'
    self.model = workdir_lib.build_model(decode_config, tokenizer)
    # One process: the search runs on one device. Replicated over the mesh it would run whole on every device,
    # the same search twice on a CPU split into two (config.cpu_devices): 5.7 s for Multi30k's valid against 4.2 s
    # on one (bench/RESULTS.md). Several hosts: every host runs the same global program.
    self.to_search_device = jax.process_count() == 1 and mesh.devices.size > 1
    if self.to_search_device:
      mesh = sharding.make_mesh(devices=[mesh.devices.flat[0]])
    self.replicated = sharding.replicated(mesh)
    # The decode command's search and ladder (batch_search.py); several hosts search each batch in one program
    # on the device, whose results every host reads whole.
    self.options = dict(beam_size=config.eval_bleu_beam_size, alpha=float(config.length_penalty_alpha),
                        extra_length=config.max_decode_extra_length, scores=False)
    self.ladder = Ladder(config.decode_tokens_per_batch, self.model.config.max_position)

  @property
  def enabled(self):
    return self.every > 0

  def due(self, step, done=False):
    return self.enabled and (step % self.every == 0 or done)

  def translate(self, params):
    """Detokenized translations of the validation sources, in order (the same on every host)."""
    if self.to_search_device:
      params = jax.device_put(params, self.replicated)
    params = with_vocabulary_kernel(self.model.config, params)  # as the decode command's search reads them
    # The same rows on every host: replicated global arrays (one process: just a device copy).
    place = lambda tree: jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)), tree)
    several = jax.process_count() > 1
    found = batch_search.search_batches(self.model, params, self.token_lists, self.ladder, self.options, place=place,
                                        on_device=True if several else None, out_sharding=self.replicated,
                                        in_flight=None if len(self.replicated.device_set) == 1 else 1)
    return ['' if f is None else self.tokenizer.decode(translator_lib.reading_order(self.config, f[0][0]))
            for f in found]

  def score(self, hypotheses):
    """({metric name: number}, sacreBLEU signature) of `hypotheses` against the validation references."""
    # The references were read as the model reads text: lowercased for a model of config.lowercase, whose
    # sacreBLEU the signature then marks case-insensitive (case:lc).
    bleu = sacrebleu.BLEU(lowercase=self.config.lowercase)
    result = bleu.corpus_score(hypotheses, [self.references])
    numbers = {'eval/bleu': result.score, 'eval/tok_bleu': float('nan'),
               'eval/bleu_length_ratio': result.sys_len / max(result.ref_len, 1),
               'eval/bleu_brevity_penalty': result.bp}
    if self.tok_references is not None:
      numbers['eval/tok_bleu'], _ = evaluate.tokenized_bleu(hypotheses, self.tok_references,
                                                            self.config.target_lang)
    return numbers, str(bleu.get_signature())

  def evaluate(self, step, params):
    """The metrics of one evaluation at `step`: BLEU (and tokenized BLEU), length ratio, brevity penalty,
    seconds, and the signature (process 0; the numbers are the same on every host)."""
    start = time.time()
    hypotheses = self.translate(params)
    numbers, signature = {name: 0.0 for name in _NUMBERS}, ''
    if distributed.is_leader():
      numbers, signature = self.score(hypotheses)
      path = hypotheses_path(self.workdir, step)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(''.join(line + '\n' for line in hypotheses), encoding='utf-8')
    if jax.process_count() > 1:
      shared = multihost_utils.broadcast_one_to_all(np.array([numbers[n] for n in _NUMBERS], np.float64))
      numbers = dict(zip(_NUMBERS, (float(x) for x in shared)))
    if np.isnan(numbers['eval/tok_bleu']):
      del numbers['eval/tok_bleu']
    metrics = {**numbers, 'eval/bleu_seconds': time.time() - start,
               'eval/bleu_sentences': len(hypotheses), 'eval/bleu_signature': signature}
    tok = f' | lc-tok BLEU {metrics["eval/tok_bleu"]:.2f}' if 'eval/tok_bleu' in metrics else ''
    logging.info('step %d | validation BLEU %.2f%s | length ratio %.3f | %d sentences, %s, %.1f s | %s', step,
                 metrics['eval/bleu'], tok, metrics['eval/bleu_length_ratio'], len(hypotheses),
                 'greedy' if not self.options['beam_size'] else f'beam {self.options["beam_size"]}',
                 metrics['eval/bleu_seconds'], signature)
    return metrics
