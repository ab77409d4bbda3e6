r"""Transformer base on WMT14 English->German, as in the paper (Vaswani et al. 2017, Table 3, section 5):
100k steps of ~25k+25k tokens, checkpoints every 10 minutes, the last 5 averaged.

Data: TFDS `wmt14_translate/de-en` (about 4.5M pairs) read En->De, validation loss on newstest2013; newstest2014
is the builder's `test` split:

  python -m flaxformer_nmt.train --config configs/wmt14_ende_base.py --workdir runs/wmt14_base
  python -m flaxformer_nmt.corpora export --config configs/wmt14_ende_base.py --split test --output_dir data/wmt14
  python -m flaxformer_nmt.decode --workdir runs/wmt14_base --checkpoint averaged \
      --input data/wmt14/test.en --reference data/wmt14/test.de

The first run downloads and prepares the corpus (TensorFlow is needed for that step: pip install
"flaxformer_nmt[tfds]"); --config.tfds_data_dir=gs://... keeps it in a bucket. The same settings serve
`wmt17_translate/de-en` (--config.tfds_name) and, with --config.target_lang=fr, `wmt14_translate/fr-en`.
No BLEU measured with it yet.
"""
from flaxformer_nmt import config


def get_config():
  c = config.use_wmt14_ende(config.base_config())
  c.num_train_steps = 100_000
  c.keep_checkpoints = 6
  c.average_last_checkpoints = 5
  c.decode_checkpoint = 'averaged'  # the paper's base numbers are those of the average
  return c
