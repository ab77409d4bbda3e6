"""A decoder-only language model (GPT-style, config.task=lm) on the German side of Multi30k (29k sentences),
sized like configs/multi30k.py's decoder: 3 layers, d_model 256, 4 heads, an 8k sentencepiece vocabulary
learnt from the German text. About 20 minutes on two CPU cores; validation perplexity per token on
valid.de. Generate with `python -m flaxformer_nmt.generate --workdir W --prompt "Ein Mann"`.
"""
from flaxformer_nmt import config
from flaxformer_nmt.data import download


def get_config():
  c = config.base_config()
  c.task = 'lm'
  # Reads {split}.de (target_lang) from ../shared/data/multi30k when present, else from the user cache,
  # downloading Multi30k there on first use, as configs/multi30k.py does.
  c.data_dir = download.multi30k_data_dir()
  c.data_download = 'multi30k'
  c.source_lang, c.target_lang = 'en', 'de'
  c.eval_split = 'valid'
  c.max_length = 128
  c.tokens_per_batch = 4096
  # Sentences packed into rows of 64 tokens (as nanoGPT and the Flax lm1b example pack): one batch shape,
  # one compilation of the train step, little padding.
  c.packed_length = 64
  # Validation rows padded to 64 as well: one more compilation (the eval step), not one per length bucket.
  c.length_buckets = (64,)
  c.vocab_size = 8000
  c.sentencepiece_max_chars = 0

  c.model.num_encoder_layers = 0
  c.model.num_decoder_layers = 3
  c.model.d_model = 256
  c.model.d_ff = 1024
  c.model.num_heads = 4
  c.model.dropout_rate = 0.1

  c.label_smoothing = 0.0  # the loss is the perplexity's NLL, as nanoGPT and the Flax lm1b example train
  c.warmup_steps = 500
  c.num_train_steps = 100_000
  c.max_train_minutes = 20.0
  c.log_every_steps = 50
  c.eval_every_steps = 200
  c.checkpoint_every_steps = 100
  c.keep_checkpoints = 10
  c.average_last_checkpoints = 5
  return c
