"""Transformer big (Vaswani et al. 2017, Table 3): base with d_model 1024, d_ff 4096, 16 heads, dropout 0.3,
300k steps, averaging of the last 20 checkpoints."""
from flaxformer_nmt import config


def get_config():
  return config.make_big(config.base_config())
