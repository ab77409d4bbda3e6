"""Multi30k English->German in the style of the fairseq Transformer-tiny of Wu et al. 2021 ("Good for
Misconceived Reasons", 41.02 lowercased tokenized BLEU on test2016): d_model 128, FFN 256, 4 heads, 4+4
post-LN layers, dropout 0.3, label smoothing 0.1, Adam(0.9, 0.98) with fairseq's inverse_sqrt schedule (peak
0.005, 2,000 warmup steps), 8k updates of ~8k tokens (their 2 x 4,096), the last 10 checkpoints averaged,
beam 5; sized for 150 minutes on two CPU cores.

Its runs on two CPU cores (bench/RESULTS.md): 36.81 and 38.64 lc-tok BLEU on test2016 after 119 and 106
minutes, the second with the average of its last 10 checkpoints; the CPU gives it a third of the anchor's
updates, and configs/multi30k_best.py (a wider model) learns faster per CPU-minute. This project differs from
the anchor in its 8k joint sentencepiece BPE on raw cased text (they train on lowercased tokenized text) and
in 4,096 tokens per update (fairseq's --max-tokens 4096 on one GPU, without --update-freq 2: at 8,192 the
CPU step takes twice as long).
"""
from flaxformer_nmt import config
from flaxformer_nmt.data import download


def get_config():
  c = config.base_config()
  c.data_dir = download.multi30k_data_dir()
  c.data_download = 'multi30k'
  c.eval_split = 'valid'
  c.max_length = 128
  c.tokens_per_batch = 4096  # fairseq --max-tokens 4096 (their --update-freq 2 halves the updates a CPU gets)
  c.vocab_size = 8000
  c.sentencepiece_max_chars = 0

  c.model.num_encoder_layers = 4
  c.model.num_decoder_layers = 4
  c.model.d_model = 128
  c.model.d_ff = 256
  c.model.num_heads = 4
  c.model.dropout_rate = 0.3
  c.model.attention_dropout_rate = 0.0  # fairseq's default for the transformer architectures
  c.model.relu_dropout_rate = 0.0
  c.label_smoothing = 0.1

  c.learning_rate_schedule = 'inverse_sqrt'
  c.learning_rate = 0.005
  c.warmup_steps = 2000
  c.adam_b1, c.adam_b2, c.adam_eps = 0.9, 0.98, 1e-8  # fairseq --adam-betas '(0.9, 0.98)', its default eps
  c.weight_decay = 0.0
  c.num_train_steps = 8000
  c.max_train_minutes = 150.0  # the backstop of the 150-minute budget (evaluation time included)
  c.log_every_steps = 50
  c.eval_every_steps = 500
  c.checkpoint_every_steps = 100
  c.keep_checkpoints = 12
  c.average_last_checkpoints = 10  # the last 1,000 updates
  c.eval_bleu_every_steps = 1000
  c.eval_bleu_beam_size = 0  # greedy: the curve's cost stays ~1% of training
  c.eval_bleu_tok_ref_dir = config.shared_data_dir('multi30k_tok')
  c.best_checkpoint_metric = 'bleu'

  c.decode_checkpoint = 'averaged'  # Wu et al. report the average of the last 10
  c.beam_size = 5
  c.length_penalty_alpha = 1.0
  c.decode_tokens_per_batch = 4096
  return c
