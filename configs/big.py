"""Transformer big (Vaswani et al. 2017, Table 3): base with d_model 1024, d_ff 4096, 16 heads, dropout 0.3,
300k steps, the last 20 checkpoints averaged, on local text.

  python -m flaxformer_nmt.train --config configs/big.py --config.data_dir=DIR --workdir runs/big

No BLEU measured with it yet.
"""
from flaxformer_nmt import config


def get_config():
  return config.make_big(config.base_config())
