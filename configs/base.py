"""Transformer base (Vaswani et al. 2017, Table 3): 6+6 layers, d_model 512, d_ff 2048, 8 heads,
dropout 0.1, label smoothing 0.1, warmup 4000, ~25k source + 25k target tokens per step, 37k shared vocab.

The data directory must hold `{split}.{lang}` files: `--config.data_dir=/path/to/wmt14`.
"""
from flaxformer_nmt import config


def get_config():
  return config.base_config()
