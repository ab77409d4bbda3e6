"""Multi30k English->German in about an hour on two CPU cores: Transformer-tiny (4+4 pre-LN layers, d_model 128,
2.3M parameters), 6,500 steps of 4,096 tokens, decoded from the average of the last 5 checkpoints with beam 5.

  python -m flaxformer_nmt.train --config configs/multi30k.py --workdir runs/m30k

Measured on 2 cores of an AMD EPYC Zen 4: 57 minutes, valid 41.99, test2016 40.28 lowercased tokenized BLEU.
Where the CPU has no bf16 dot instructions a step takes about twice as long and the run about two hours;
`python bench/train_throughput.py --configs multi30k --fit_minutes 60` prints the num_train_steps that fit an
hour there.
"""
from flaxformer_nmt import config
from flaxformer_nmt.data import download


def get_config():
  c = download.use_multi30k(config.base_config())  # the cache's corpus, lowercased, packed 64-token rows, 8k vocab

  c.model.num_encoder_layers = 4
  c.model.num_decoder_layers = 4
  c.model.d_model = 128
  c.model.d_ff = 256
  c.model.num_heads = 4
  c.model.dropout_rate = 0.3
  c.model.pre_layer_norm = True  # x + Dropout(Sublayer(LayerNorm(x))); the paper is post-LN
  c.model.matmul_precision = 'auto'  # bfloat16 operands where the CPU has bf16 dot instructions
  c.cpu_devices = 2  # the host CPU as two devices, each step's rows split over them

  c.label_smoothing = 0.2
  c.learning_rate_schedule = 'inverse_sqrt'  # fairseq's: linear to the peak, then peak * sqrt(warmup / step)
  c.learning_rate = 0.005  # the peak
  c.warmup_steps = 2000
  c.num_train_steps = 6500
  c.cooldown_steps = 3250  # the learning rate linear to zero over the second half

  c.log_every_steps = 50
  c.eval_every_steps = 500
  c.eval_bleu_every_steps = 1000
  c.eval_bleu_beam_size = 0  # greedy
  c.best_checkpoint_metric = 'bleu'
  c.checkpoint_every_steps = 200
  c.keep_checkpoints = 12
  c.average_last_checkpoints = 5  # into {workdir}/averaged when training ends

  c.decode_checkpoint = 'averaged'
  c.beam_size = 5
  c.length_penalty_alpha = 2.0
  c.decode_tokens_per_batch = 4096
  return c
