"""Transformer big (Vaswani et al. 2017, Table 3): base with d_model 1024, d_ff 4096, 16 heads, dropout 0.3,
300k steps, averaging of the last 20 checkpoints."""
from flaxformer_nmt import config


def get_config():
  c = config.base_config()
  c.model.d_model = 1024
  c.model.d_ff = 4096
  c.model.num_heads = 16
  c.model.dropout_rate = 0.3
  c.num_train_steps = 300_000
  c.keep_checkpoints = 20
  c.average_last_checkpoints = 20
  return c
