"""Transformer base (Vaswani et al. 2017, Table 3): 6+6 layers, d_model 512, d_ff 2048, 8 heads, dropout 0.1,
label smoothing 0.1, warmup 4000, ~25k source + 25k target tokens per step, 37k shared vocabulary, on local text.

  python -m flaxformer_nmt.train --config configs/base.py --config.data_dir=DIR --workdir runs/base

DIR holds `{split}.{lang}` files (train, valid; .en and .de). No BLEU measured with it yet (configs/wmt14_ende_base.py
reads WMT14 from TFDS).
"""
from flaxformer_nmt import config


def get_config():
  return config.base_config()
