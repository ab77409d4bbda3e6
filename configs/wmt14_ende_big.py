"""Transformer big on WMT14 English->German, as in the paper (Table 3): d_model 1024, d_ff 4096, 16 heads,
dropout 0.3, 300k steps, the last 20 checkpoints (written every 10 minutes) averaged. Data, vocabulary,
batches and evaluation as configs/wmt14_ende_base.py (newstest2013 development, newstest2014 test).

  python -m flaxformer_nmt.train --config configs/wmt14_ende_big.py --workdir runs/wmt14_big

No BLEU measured with it yet.
"""
from flaxformer_nmt import config


def get_config():
  return config.make_big(config.use_wmt14_ende(config.base_config()))
