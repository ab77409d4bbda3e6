"""Configuration fields shared by every config, at the values of Transformer base.

Every field the trainer, the model and the decoder read lives here; configs/*.py start from `base_config()` and
change what differs, so `--config.field=value` overrides work the same everywhere and an unknown field is
an error.

`validate(config)` holds every rule a config must follow before training starts, each error naming the field and
the values it takes. This module imports nothing from the package: every other layer may read its constants.
"""
import importlib.util
import re

import ml_collections
from etils import epath

class ConfigError(ValueError):
  """A config that cannot be trained, or that does not match the workdir: the message names the field."""


def load_config_file(path, *args):
  """get_config(*args) of the config file at `path`, loaded by path: configs/ is not a package on sys.path, so
  programs run from any directory."""
  spec = importlib.util.spec_from_file_location(f'_config_{epath.Path(path).stem}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*args)


# The values of the fields that take a name, in the order the errors list them.
TASKS = ('translation', 'lm', 'mlm')  # config.task
DATA_SOURCES = ('text', 'tfds')  # config.data_source
SCHEDULES = ('paper', 'inverse_sqrt')  # config.learning_rate_schedule
DATA_DOWNLOADS = ('', 'multi30k')  # config.data_download: '' never downloads
# The field that sets each schedule's peak learning rate (what lowers the rate of a run that diverges).
PEAK_FIELDS = {'paper': 'learning_rate_scale', 'inverse_sqrt': 'learning_rate'}
BEST_CHECKPOINT_METRICS = ('bleu', 'tok_bleu', 'loss', 'nll')  # config.best_checkpoint_metric, or '' (off)
MODEL_DTYPES = ('auto', 'float32', 'bfloat16', 'float16')  # config.model.dtype
ATTENTION_IMPLS = ('auto', 'xla', 'cudnn', 'einsum')  # config.model.attention_impl
REMAT_POLICIES = ('none', 'full', 'dots')  # config.model.remat
MATMUL_PRECISIONS = ('auto', 'float32', 'bfloat16')  # config.model.matmul_precision
# JAX's key generators (config.prng_impl); the default is JAX's own.
PRNG_IMPLS = ('threefry2x32', 'rbg', 'unsafe_rbg')
DEFAULT_PRNG_IMPL = 'threefry2x32'
# The names of one set of parameters of a workdir: config.decode_checkpoint, decode's and export's --checkpoint.
CHECKPOINT_NAMES = 'latest, averaged, best, last:K or a step'


def is_checkpoint_name(name):
  """Whether `name` is one of CHECKPOINT_NAMES (last:K with K >= 1)."""
  return re.fullmatch(r'latest|averaged|best|last:[1-9][0-9]*|[0-9]+', str(name)) is not None


def base_config():
  """Every field, at Transformer base's values, section by section along the data's road."""
  c = ml_collections.ConfigDict()
  _task_fields(c)
  _data_fields(c)
  _vocabulary_fields(c)
  _model_fields(c)
  _optimization_fields(c)
  _device_fields(c)
  _loop_fields(c)
  _decoding_fields(c)
  return c


def _task_fields(c):
  """What is trained (models/lm.py): translation, or a language model on one side of the text."""
  # 'translation' (encoder-decoder, source -> target), 'lm' (decoder-only language model,
  # generate.py) or 'mlm' (encoder-only masked language model, fill_mask.py). lm and mlm read monolingual
  # text: the `target_lang` side of a parallel corpus (`{data_dir}/{split}.{target_lang}`), the files
  # `text_train_file` / `text_eval_file` when set (any text, one sentence or document a line), or the
  # `tfds_text_feature` of a TFDS builder (e.g. tfds_name='lm1b', eval_split='test').
  c.task = 'translation'
  c.text_train_file = ''
  c.text_eval_file = ''
  c.tfds_text_feature = 'text'


def _data_fields(c):
  """Where the text comes from (data/corpora.py) and how it is batched (data/batching.py, data/packing.py)."""
  # 'text': `{data_dir}/{split}.{lang}` parallel text, line i of one side translating
  # line i of the other. 'tfds': the TensorFlow Datasets builder `tfds_name` (e.g. 'wmt14_translate/de-en'),
  # prepared as array_record under `tfds_data_dir` ('' = TFDS's default, ~/tensorflow_datasets).
  c.data_source = 'text'
  c.data_dir = ''  # required for 'text': --config.data_dir=DIR
  c.tfds_name = ''
  c.tfds_data_dir = ''
  # The direction: source and target are chosen by language name, whatever order the corpus stores them in.
  c.source_lang = 'en'
  c.target_lang = 'de'
  c.train_split = 'train'
  c.eval_split = 'valid'
  # Pairs with more subword tokens than this on either side are dropped from training.
  c.max_length = 256
  # A pair with one empty side, or a line longer than max_line_chars, is an error naming the file and line
  # (misaligned or broken files); with skip_bad_pairs it is dropped and counted instead.
  c.max_line_chars = 10_000
  c.skip_bad_pairs = False
  # True: every line is lowercased as it is read (training and validation text, so the vocabulary too, and
  # decode's inputs), as the Multi30k papers train (their corpus is the lowercased `lc.norm.tok` text). The
  # translations are lowercase, and sacreBLEU and chrF then compare case-insensitively (signature `case:lc`).
  # Off by default: the paper trains on cased text.
  c.lowercase = False
  # Token budget per step, counted on the padded batch, per side: the paper's ~25k source + ~25k target.
  c.tokens_per_batch = 25_000
  # > 0: pack several examples into each row of this many tokens a side (segment ids keep them apart, positions
  # restart per example), as the Flax WMT example does with 256; every batch then has one shape and little
  # padding. 0: one example per row, rows grouped by length bucket. Validation batches are never packed.
  c.packed_length = 0
  # Packed rows still open to new examples (packing.plan_rows): an example joins the oldest open row it fits.
  # 1 fills one row at a time (next fit: 85% real target tokens on Multi30k at 64 tokens); 16 gives 94% while
  # the shuffle still decides which examples share a row.
  c.packing_open_rows = 16
  # Padded lengths are rounded up to one of these, so the train step compiles once per bucket.
  c.length_buckets = (8, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
  c.seed = 0
  # The generator of the dropout keys (and of the initial parameters): JAX's default 'threefry2x32' (the same
  # bits on every backend and sharding), or 'rbg' / 'unsafe_rbg' (XLA's RngBitGenerator, cheaper to draw):
  # configs/multi30k_best.py's CPU step 601 ms with threefry, 569 ms with 'rbg' (an Intel Xeon with AMX,
  # bench/RESULTS.md). A run keeps its generator: resuming with another is refused.
  c.prng_impl = DEFAULT_PRNG_IMPL
  # Rows of every planned training batch are a multiple of this. The plan (and so an exact resume) depends on
  # it, never on the machine: batches are padded with empty rows to a multiple of devices x microbatches,
  # which a multiple of the device count here avoids.
  c.batch_rows_multiple = 1
  # A checkpoint's data position belongs to the batching it was planned with (tokens_per_batch, length_buckets,
  # max_length, packed_length, packing_open_rows, batch_rows_multiple, bpe_dropout, bidirectional_epochs, the
  # training data): resuming with another is an error, unless this is True, which continues in the same epoch
  # with the new batches (and a warning).
  c.allow_batching_change = False
  # Threads sentencepiece tokenizes with (0 = all cores); the ids are cached in {workdir}/tokenized/.
  c.tokenize_threads = 0
  # Batches padded ahead of the train step by a background thread (0 = build them in the loop).
  c.prefetch_batches = 4


def _vocabulary_fields(c):
  """The joint vocabulary (data/tokenizer.py): one sentencepiece model learnt from both sides of the training text,
  stored in the workdir."""
  c.vocab_size = 37_000
  c.sentencepiece_model_type = 'bpe'
  c.sentencepiece_character_coverage = 1.0
  # Characters of training text (both sides, pairs drawn at random) that sentencepiece learns from; 0 = all.
  # The Flax WMT example's 10M keeps vocabulary training to minutes on a 4.5M-pair corpus.
  c.sentencepiece_max_chars = 10_000_000
  # BPE-dropout (Provilkov et al. 2020; not in the paper): every training epoch segments its sentences anew,
  # each merge of the BPE vocabulary skipped with this probability, so the model sees a word in many pieces;
  # 0 = off (one deterministic segmentation, the paper's). Validation, BLEU and decoding keep the deterministic
  # pieces. Each epoch's sample is saved in {workdir}/tokenized/ (sentencepiece's draws are not repeatable
  # across processes), so a resume and the other hosts read it. Part of the batching (a resume needs the same
  # value). Costs per epoch: reading and sampling the training text again (1-5 s of one core for Multi30k's 29k
  # pairs, in the input thread, beside training), and longer sequences (Multi30k's training pairs at 8k, EOS
  # included: +19% pieces at 0.05, +38% at 0.1; 3 and 9 pairs past 64 keep their pieces), so fewer pairs per
  # token budget.
  c.bpe_dropout = 0.0
  # Bidirectional training (Ding et al. 2021, "BiT"; not in the paper): the first this many epochs hold every
  # training pair twice, as it is and reversed (target -> source, no tag: the joint vocabulary and tied embeddings
  # let one model learn both directions), twice the batches an epoch; later epochs the given direction only.
  # The paper pretrains so for the first third of the steps. 0 = off. Part of the batching.
  c.bidirectional_epochs = 0
  # Right-to-left targets (not in the paper): the model reads the source as usual and writes the target from its
  # last token to its first (EOS still last), so that its errors differ from a left-to-right model's and it can
  # rescore the latter's n best (Sennrich et al. 2016, Edinburgh's WMT16 systems; Liu et al. 2016). Decoding
  # turns its output back to reading order. Part of the data (a resume needs the same value).
  c.target_right_to_left = False


def _model_fields(c):
  """The Transformer's shape and numerics (models/transformer.py)."""
  c.model = ml_collections.ConfigDict()
  c.model.num_encoder_layers = 6
  c.model.num_decoder_layers = 6
  c.model.d_model = 512
  c.model.d_ff = 2048
  c.model.num_heads = 8
  c.model.dropout_rate = 0.1  # P_drop: sublayer outputs and embedding sums.
  c.model.attention_dropout_rate = 0.0  # on attention weights (not in the paper).
  c.model.relu_dropout_rate = 0.0  # inside the feed-forward block (not in the paper).
  # Source word dropout (Sennrich and Zhang 2019; not in the paper): in training each source token's embedding
  # is zeroed with this probability, its position kept. 0 = off.
  c.model.source_word_dropout = 0.0
  c.model.pre_layer_norm = False  # the paper is post-LN: LayerNorm(x + Sublayer(x)).
  c.model.max_position = 1024  # rows of the sinusoidal table.
  # 'auto': bfloat16 on GPU/TPU, float32 on CPU (where bf16 matmuls are slower). Params stay float32.
  c.model.dtype = 'auto'
  # How attention is computed (the parameters are the same either way): 'auto' = cuDNN flash attention on
  # GPU in bf16/fp16, XLA elsewhere; or 'xla', 'cudnn', 'einsum' (explicit weights, the portable reference).
  c.model.attention_impl = 'auto'
  # Recompute activations in the backward pass to fit longer batches: 'none', 'full' (keep nothing per
  # layer) or 'dots' (keep the matmul outputs, recompute the rest).
  c.model.remat = 'none'
  # The operands of the projection/feed-forward/output matmuls: 'float32', or 'bfloat16' (rounded to bf16,
  # float32 accumulation and results, as TPU's default precision): 1.3-1.4x faster train steps on CPUs with
  # AVX512-BF16 or AMX (AMD Zen 4, Intel Sapphire Rapids); 'auto' picks bfloat16 on such CPUs only. float32
  # by default, as the paper's model (the Multi30k CPU configs use 'auto').
  c.model.matmul_precision = 'float32'


def _optimization_fields(c):
  """Adam, its schedule, the loss, and how long to train (training/step.py)."""
  # Adam(0.9, 0.98, 1e-9), lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
  # learning_rate_schedule 'paper' is that formula; 'inverse_sqrt' is fairseq's: a peak `learning_rate`
  # reached linearly at warmup_steps, then decaying as peak * sqrt(warmup / step) (learning_rate_scale and
  # d_model do not enter it).
  c.learning_rate_schedule = 'paper'
  c.learning_rate = 0.0  # the peak of 'inverse_sqrt' (fairseq --lr); unused by 'paper'.
  c.learning_rate_scale = 1.0
  c.warmup_steps = 4000
  # > 0: the learning rate falls linearly to 0 over the last cooldown_steps of num_train_steps (times the
  # schedule above; the decay of warmup-stable-decay schedules). 0 (the paper): no cooldown. A run stopped early by
  # max_train_minutes never reaches the ramp's end: size num_train_steps to the time.
  c.cooldown_steps = 0
  c.adam_b1 = 0.9
  c.adam_b2 = 0.98
  c.adam_eps = 1e-9
  # > 0: decoupled weight decay (AdamW; fairseq's Adam --weight-decay): p -= lr * weight_decay * p each step,
  # on every parameter. The paper uses none.
  c.weight_decay = 0.0
  c.label_smoothing = 0.1
  # > 0: R-Drop (Liang et al. 2021; not in the paper): each example runs twice under two dropout masks and the
  # loss adds this weight times the symmetric KL divergence of the two predictions (the authors use 5 on
  # IWSLT14 De-En with dropout 0.3). Each step computes twice its rows: halve tokens_per_batch to keep the
  # step's cost. 0 = off. Needs dropout (otherwise the two predictions are the same), not for the MLM (whose two
  # copies would get different masks).
  c.rdrop_alpha = 0.0
  # > 0: the train step projects the decoder's states onto the vocabulary, computes the loss and its gradient a
  # chunk of about this many target tokens at a time (train_step.chunked_vocabulary_loss), never holding the
  # [tokens, vocabulary] logits or their gradient: the same update in less memory (base at 16,384 tokens: 31%
  # fewer temporaries with 1,024), for larger token budgets. 0 = the plain path (whole logits). Translation
  # only; not with R-Drop (which compares whole predictions).
  c.vocabulary_loss_chunk_tokens = 0
  c.grad_clip_norm = 0.0  # 0 disables clipping.
  # A step whose loss or gradient is NaN/Inf is never applied. False: stop with an error naming the step
  # (the last checkpoint stays good). True: skip such updates, count them, and go on.
  c.skip_nonfinite_updates = False
  # Microbatches per update (lax.scan inside the step): the token budget on fewer devices, at the memory of
  # one microbatch. Each step's rows must divide by it (and by the device count).
  c.grad_accumulation_steps = 1
  c.num_train_steps = 100_000
  # Fine-tuning / warm start (training/warm_start.py): a new run takes its parameters (only) from this training
  # workdir or checkpoint directory; init_checkpoint picks latest, averaged, best or a step of a workdir.
  c.init_from = ''
  c.init_checkpoint = 'latest'
  # > 0: also stop after this much training time, with a final checkpoint and (if configured) the average; a
  # warning then says the cooldown was cut. It is counted across resumes (saved with each checkpoint, as
  # fairseq's --stop-time-hours counts its cumulative training time); the time between a stop and its resume is
  # not. A larger value on resume trains on. `bench/train_throughput.py --fit_minutes M` prints the
  # num_train_steps that fit M minutes on this machine.
  c.max_train_minutes = 0.0
  # > 1: train this many independent runs in turn, one command, into {workdir}/member0, member1, ... (seeds
  # seed, seed+1, ...; one vocabulary, member0's; each member gets max_train_minutes / ensemble_members), and
  # decode {workdir} as their ensemble (the members' probabilities averaged at every step: training/ensemble.py).
  # Rerunning the command resumes the member in progress. 1 (the default): one model, as the paper trains.
  c.ensemble_members = 1


def _device_fields(c):
  """The device mesh, steps per call, FLOP accounting and profiling (runtime/sharding.py, runtime/flops.py)."""
  # A ('data', 'fsdp') mesh over every device of every host; -1 = whatever the other axis
  # leaves. Default: data parallel everywhere. fsdp_parallelism > 1 splits parameters and optimizer state
  # over that many devices (for models that do not fit replicated).
  c.data_parallelism = -1
  c.fsdp_parallelism = 1
  # > 0: present the host CPU to JAX as this many devices (sharding.split_host_cpu; set it to the cores), so a
  # CPU-only run splits each batch over them like any data-parallel mesh: the same update, with the small
  # operations of a small model running side by side (about 1.3x the tiny recipe's step on 2 cores). 0: JAX's
  # default, one CPU device. No effect on a GPU or TPU host's accelerators.
  c.cpu_devices = 0
  # Train steps per call of the compiled program (a lax.scan over that many batches): the same updates, with one
  # host dispatch for all of them, for models whose step is short beside the host's work on it (a small model
  # on a GPU). Needs packed batches (packed_length > 0, one shape); logging, evaluation and checkpoint
  # intervals are multiples of it. A stop signal is acted on after the call's last step.
  c.steps_per_dispatch = 1
  # Per-device peak FLOP/s for MFU; 0 = from the table in runtime/flops.py (GPU/TPU), no MFU where unknown (CPU).
  c.peak_flops_per_device = 0.0
  # > 0: trace this many steps with jax.profiler from step profile_start_step (after compilation) into
  # {workdir}/profile (TensorBoard's profile tab or Perfetto).
  c.profile_steps = 0
  c.profile_start_step = 10


def _loop_fields(c):
  """Logging, evaluation and checkpoints (training/loop.py, checkpointing/, training/validation.py)."""
  c.log_every_steps = 100
  c.eval_every_steps = 1000
  c.checkpoint_every_steps = 1000
  c.checkpoint_every_minutes = 0.0  # > 0: also save when this much time has passed since the last save.
  c.keep_checkpoints = 6  # one more than averaged: room for an off-interval final save
  # > 0: when training ends, average the newest K checkpoints saved at the regular interval (step a multiple
  # of checkpoint_every_steps; the final save of a run that stops off it is left out) into {workdir}/averaged
  # (decode --checkpoint averaged); fewer than K is a warning. The paper: last 5 (base), written every 10
  # minutes; last 20 (big).
  c.average_last_checkpoints = 5
  # Validation BLEU while training (training/validation.py): every eval_bleu_every_steps (0 = off), translate the first
  # eval_bleu_max_sentences (0 = all) of eval_split with the current parameters, beam eval_bleu_beam_size
  # (0 = greedy), and log sacreBLEU (13a; case-insensitive for a config with `lowercase`) and, where
  # `{eval_bleu_tok_ref_dir}/{eval_split}.{target_lang}` exists, lowercased Moses-tokenized BLEU; the
  # translations go to {workdir}/eval/hyp_STEP.txt.
  c.eval_bleu_every_steps = 0
  c.eval_bleu_beam_size = 0
  c.eval_bleu_max_sentences = 0
  c.eval_bleu_tok_ref_dir = ''
  # Keep the parameters of the best evaluation in {workdir}/best (never rotated; decode --checkpoint best):
  # 'bleu' or 'tok_bleu' (highest validation BLEU, needs eval_bleu_every_steps), 'loss' or 'nll' (lowest
  # validation loss, at each eval_every_steps); '' = off.
  c.best_checkpoint_metric = ''
  # Multi30k only: 'multi30k' fetches the corpus (data/download.py's pinned files, sha256-checked) into data_dir
  # when its files are absent; '' = never download.
  c.data_download = ''


def _decoding_fields(c):
  """What decode, export and visualize use by default (decoding/)."""
  # The parameters decode, export and visualize use when --checkpoint is not given: latest, averaged, best,
  # last:K or a step. A recipe sets the one it chose on validation, so its README command decodes what its
  # results table reports.
  c.decode_checkpoint = 'latest'
  c.beam_size = 4
  c.length_penalty_alpha = 0.6
  c.max_decode_extra_length = 50  # output at most source length + 50 tokens.
  c.decode_tokens_per_batch = 8192  # source tokens per decode batch (before the beam).


def make_big(c):
  """Transformer big (Table 3) from a base config: d_model 1024, d_ff 4096, 16 heads, dropout 0.3, 300k steps,
  the last 20 checkpoints averaged."""
  c.model.d_model = 1024
  c.model.d_ff = 4096
  c.model.num_heads = 16
  c.model.dropout_rate = 0.3
  c.num_train_steps = 300_000
  c.keep_checkpoints = 21
  c.average_last_checkpoints = 20
  c.decode_checkpoint = 'averaged'
  return c


def use_wmt14_ende(c):
  """The paper's WMT14 English->German setting (section 5.1) on a config: TFDS `wmt14_translate/de-en` (about
  4.5M pairs) read En->De, newstest2013 for development, a shared 37k vocabulary learnt from 10M characters,
  ~25k source + 25k target tokens per step, checkpoints every 10 minutes."""
  c.data_source = 'tfds'
  c.tfds_name = 'wmt14_translate/de-en'
  c.source_lang, c.target_lang = 'en', 'de'  # TFDS stores the pairs as (de, en)
  c.train_split = 'train'
  c.eval_split = 'validation'  # newstest2013; 'test' is newstest2014
  c.vocab_size = 37_000
  c.sentencepiece_max_chars = 10_000_000
  c.tokens_per_batch = 25_000
  c.max_length = 256
  c.warmup_steps = 4000
  c.checkpoint_every_minutes = 10.0
  c.checkpoint_every_steps = 1_000_000  # time decides, as in the paper
  c.eval_every_steps = 2000
  return c


# --- Validation ---------------------------------------------------------------------------------------------

def validate(config):
  """Raises ConfigError, naming the field and the values it takes, for a config that cannot be trained. The
  trainer calls it before it reads or writes anything. (Whether this machine can run the model, e.g. cuDNN
  attention, is the model's to say when it is built.)"""
  _validate_fields(config)
  _validate_names(config)
  _validate_counts(config)
  _validate_data(config)
  _validate_schedule(config)
  _validate_optimizer(config)
  _validate_model(config)
  _validate_translation_options(config)
  _validate_checkpoints(config)
  _validate_dispatch(config)
  _validate_regularizers(config)


def _validate_fields(config):
  """Every field is one of base_config's: a config file that sets another (a misspelt or retired name) would be
  trained without it doing anything."""
  base = base_config()
  for section, fields, known in (('', config, base), ('model.', config.model, base.model)):
    for field in fields:
      if field not in known:
        raise ConfigError(f'config.{section}{field} is not a field of base_config (every config starts from it): '
                          'remove it or correct its name')


def _validate_names(config):
  for field, allowed in (('task', TASKS), ('data_source', DATA_SOURCES), ('data_download', DATA_DOWNLOADS),
                         ('learning_rate_schedule', SCHEDULES),
                         ('prng_impl', PRNG_IMPLS), ('best_checkpoint_metric', ('',) + BEST_CHECKPOINT_METRICS),
                         ('model.dtype', MODEL_DTYPES), ('model.attention_impl', ATTENTION_IMPLS),
                         ('model.remat', REMAT_POLICIES), ('model.matmul_precision', MATMUL_PRECISIONS)):
    value = config.model[field[len('model.'):]] if field.startswith('model.') else config[field]
    if value not in allowed:
      raise ConfigError(f'config.{field}={value!r}: use one of {allowed}')
  if not is_checkpoint_name(config.decode_checkpoint):
    raise ConfigError(f'config.decode_checkpoint={config.decode_checkpoint!r}: use {CHECKPOINT_NAMES}')


def _validate_counts(config):
  for field in ('tokens_per_batch', 'log_every_steps', 'eval_every_steps', 'checkpoint_every_steps',
                'grad_accumulation_steps', 'batch_rows_multiple'):
    if config[field] <= 0:
      raise ConfigError(f'config.{field}={config[field]!r}: use a positive number')
  for field in ('eval_bleu_every_steps', 'eval_bleu_beam_size', 'eval_bleu_max_sentences', 'bidirectional_epochs',
                'vocabulary_loss_chunk_tokens'):
    if not isinstance(config[field], int) or config[field] < 0:
      raise ConfigError(f'config.{field}={config[field]!r} counts: use 0 (off) or more')
  if not isinstance(config.ensemble_members, int) or config.ensemble_members < 1:
    raise ConfigError(f'config.ensemble_members={config.ensemble_members!r} counts the runs trained and decoded '
                      'together: use 1 (one model) or more')


def _validate_data(config):
  files_named = config.task != 'translation' and config.text_train_file and config.text_eval_file
  if config.data_source == 'text' and not config.data_dir and not files_named:
    raise ConfigError('config.data_dir is empty: pass --config.data_dir=DIR holding {split}.{lang} files')
  if config.data_source == 'tfds' and not config.tfds_name:
    raise ConfigError("config.tfds_name is empty: name a TFDS builder, e.g. 'wmt14_translate/de-en'")
  for field in ('max_length', 'packed_length'):
    if config[field] > config.model.max_position:
      raise ConfigError(f'config.{field}={config[field]} exceeds config.model.max_position='
                        f'{config.model.max_position}: positions past it would all share its encoding. Lower '
                        f'{field} or raise model.max_position (a new model).')
  if config.packed_length and (not isinstance(config.packing_open_rows, int) or config.packing_open_rows < 1):
    raise ConfigError(f'config.packing_open_rows={config.packing_open_rows!r}: use 1 (next fit) or more (with none '
                      'open, every example would get a packed row of its own)')
  if not 0.0 <= config.bpe_dropout <= 1.0:
    raise ConfigError(f'config.bpe_dropout={config.bpe_dropout} is a probability: use 0 (off) to 1')
  if config.bpe_dropout and (config.sentencepiece_model_type != 'bpe' or config.task != 'translation'):
    raise ConfigError(f'config.bpe_dropout={config.bpe_dropout} needs a translation task with a BPE vocabulary '
                      f"(config.sentencepiece_model_type='bpe'; now {config.sentencepiece_model_type!r}, task "
                      f'{config.task!r})')


def _validate_schedule(config):
  for field in ('num_train_steps', 'warmup_steps'):  # the warm-up divides by its steps: 0 gives no rate at all
    if not isinstance(config[field], int) or config[field] < 1:
      raise ConfigError(f'config.{field}={config[field]!r}: use a whole number >= 1')
  if not 0.0 <= config.label_smoothing < 1.0:
    raise ConfigError(f'config.label_smoothing={config.label_smoothing} is a probability mass: use 0 (off) to '
                      'below 1')
  peak = PEAK_FIELDS.get(config.learning_rate_schedule)
  if peak and config[peak] <= 0:
    raise ConfigError(f'config.{peak}={config[peak]}: config.learning_rate_schedule='
                      f'{config.learning_rate_schedule!r} needs a peak learning rate > 0')
  if not 0 <= config.cooldown_steps <= config.num_train_steps:
    raise ConfigError(f'config.cooldown_steps={config.cooldown_steps}: use 0 (no cooldown) to config.num_train_steps='
                      f'{config.num_train_steps} (the ramp ends at the last update)')


def _validate_optimizer(config):
  """Adam's coefficients, weight decay and clipping. A beta of 1 or more, or an epsilon of 0 (where a dead ReLU
  leaves a gradient of 0, its update is 0 / 0), makes a finite gradient's update NaN."""
  for field in ('adam_b1', 'adam_b2'):
    if not 0.0 <= config[field] < 1.0:
      raise ConfigError(f'config.{field}={config[field]} is a moment decay rate: use 0 to below 1')
  if not config.adam_eps > 0.0:
    raise ConfigError(f'config.adam_eps={config.adam_eps}: use a number > 0 (the paper 1e-9, fairseq 1e-8)')
  for field in ('weight_decay', 'grad_clip_norm'):
    if not config[field] >= 0.0:
      raise ConfigError(f'config.{field}={config[field]}: use 0 (off) or more')


def _validate_model(config):
  """The model's shape, dropout rates and the mesh it trains on."""
  m = config.model
  for field, least in (('d_model', 1), ('d_ff', 1), ('num_heads', 1), ('num_encoder_layers', 0),
                       ('num_decoder_layers', 0)):
    if not isinstance(m[field], int) or m[field] < least:
      raise ConfigError(f'config.model.{field}={m[field]!r}: use a whole number >= {least}')
  stack = {'lm': 'num_decoder_layers', 'mlm': 'num_encoder_layers'}.get(config.task)
  if stack and m[stack] < 1:  # else the model is the embedding alone, trained without a word
    raise ConfigError(f'config.model.{stack}={m[stack]}: the {config.task} model (config.task={config.task!r}) is '
                      'made of these layers: use 1 or more')
  if m.d_model % m.num_heads:
    raise ConfigError(f'config.model.d_model={m.d_model} is not divisible by config.model.num_heads={m.num_heads}: '
                      'each head takes d_model / num_heads features')
  if m.d_model % 2:
    raise ConfigError(f'config.model.d_model={m.d_model} is odd: the sinusoidal positions pair a sine and a cosine '
                      'per frequency, so d_model must be even')
  for field in ('dropout_rate', 'attention_dropout_rate', 'relu_dropout_rate'):
    if not 0.0 <= m[field] < 1.0:
      raise ConfigError(f'config.model.{field}={m[field]} is a probability: use 0 (off) to below 1')
  buckets = config.length_buckets
  if not buckets or not all(isinstance(b, int) and b > 0 for b in buckets) or list(buckets) != sorted(buckets):
    raise ConfigError(f'config.length_buckets={buckets!r}: use increasing whole numbers of tokens, e.g. '
                      '"(16, 32, 64)"')
  for field in ('data_parallelism', 'fsdp_parallelism'):
    if not isinstance(config[field], int) or not (config[field] == -1 or config[field] >= 1):
      raise ConfigError(f'config.{field}={config[field]!r}: use a number of devices >= 1, or -1 (what the other '
                        'axis leaves)')


def _validate_checkpoints(config):
  """config.decode_checkpoint names a checkpoint the run will have, and what keeps one exists."""
  if not isinstance(config.keep_checkpoints, int) or config.keep_checkpoints < 0:
    raise ConfigError(f'config.keep_checkpoints={config.keep_checkpoints!r}: use 0 (keep all) or more')
  if config.decode_checkpoint == 'averaged' and config.average_last_checkpoints <= 0:
    raise ConfigError("config.decode_checkpoint='averaged' needs config.average_last_checkpoints > 0 (now "
                      f'{config.average_last_checkpoints}): nothing would be averaged')
  if config.decode_checkpoint == 'best' and not config.best_checkpoint_metric:
    raise ConfigError("config.decode_checkpoint='best' needs config.best_checkpoint_metric (now ''): no best "
                      'checkpoint would be kept')
  if config.average_last_checkpoints > config.keep_checkpoints > 0:
    raise ConfigError(f'config.average_last_checkpoints={config.average_last_checkpoints} needs '
                      f'config.keep_checkpoints >= it (now {config.keep_checkpoints})')
  metric = config.best_checkpoint_metric
  if metric in ('bleu', 'tok_bleu') and config.eval_bleu_every_steps <= 0:
    raise ConfigError(f'config.best_checkpoint_metric={metric!r} needs validation BLEU: set '
                      'config.eval_bleu_every_steps > 0')
  reference = tokenized_reference(config)
  if metric == 'tok_bleu' and not (reference and epath.Path(reference).exists()):
    raise ConfigError(f"config.best_checkpoint_metric='tok_bleu' needs the tokenized validation reference "
                      f'{reference or "(config.eval_bleu_tok_ref_dir is empty)"}')


def _validate_dispatch(config):
  """config.steps_per_dispatch: the steps of one call share a batch shape, and every step that logs, evaluates or
  saves ends a call."""
  many = config.steps_per_dispatch
  if not isinstance(many, int) or many < 1:
    raise ConfigError(f'config.steps_per_dispatch={many!r} counts train steps per call: use 1 or more')
  if many == 1:
    return
  if not config.packed_length:
    raise ConfigError(f'config.steps_per_dispatch={many} needs batches of one shape: set config.packed_length '
                      '(e.g. 64 or 128), or use steps_per_dispatch=1')
  for field in ('log_every_steps', 'eval_every_steps', 'checkpoint_every_steps', 'eval_bleu_every_steps'):
    if config[field] % many:
      raise ConfigError(f'config.{field}={config[field]} is not a multiple of config.steps_per_dispatch={many}: '
                        'each call runs that many steps, so use a multiple of it')


def tokenized_reference(config):
  """`{eval_bleu_tok_ref_dir}/{eval_split}.{target_lang}`, the reference of lowercased tokenized validation
  BLEU; None where eval_bleu_tok_ref_dir is empty."""
  if not config.eval_bleu_tok_ref_dir:
    return None
  return str(epath.Path(config.eval_bleu_tok_ref_dir) / f'{config.eval_split}.{config.target_lang}')


def _validate_regularizers(config):
  word_dropout = config.model.source_word_dropout
  if not 0.0 <= word_dropout < 1.0:
    raise ConfigError(f'config.model.source_word_dropout={word_dropout} is a probability: use 0 (off) to below 1')
  alpha = config.rdrop_alpha
  if alpha < 0:
    raise ConfigError(f'config.rdrop_alpha={alpha} is a weight: use 0 (off) or more')
  if alpha and config.task == 'mlm':
    raise ConfigError(f'config.rdrop_alpha={alpha} is not for the MLM: its two copies of an example would be '
                      'masked differently')
  m = config.model
  if alpha and not any((m.dropout_rate, m.attention_dropout_rate, m.relu_dropout_rate, m.source_word_dropout)):
    raise ConfigError(f'config.rdrop_alpha={alpha} needs dropout (config.model.dropout_rate, attention_dropout_rate, '
                      'relu_dropout_rate or source_word_dropout > 0): without it both predictions are the same')
  if config.vocabulary_loss_chunk_tokens and alpha:
    raise ConfigError(f'config.vocabulary_loss_chunk_tokens={config.vocabulary_loss_chunk_tokens} cannot go with '
                      f'config.rdrop_alpha={alpha}: R-Drop compares whole predictions, which the chunked loss never '
                      'holds')


def _validate_translation_options(config):
  """Options only the translation task has, and those right-to-left targets cannot go with."""
  translation_only = {
      'model.source_word_dropout': (config.model.source_word_dropout, 'needs a source'),
      'bidirectional_epochs': (config.bidirectional_epochs, 'reverses translation pairs'),
      'vocabulary_loss_chunk_tokens': (config.vocabulary_loss_chunk_tokens, "projects the translation decoder's "
                                       'states'),
      'ensemble_members': (config.ensemble_members > 1 and config.ensemble_members, 'decodes the members together '
                           '(generate and fill_mask take one model)'),
      'target_right_to_left': (config.target_right_to_left, 'reverses the targets'),
      'eval_bleu_every_steps': (config.eval_bleu_every_steps, 'translates the validation set'),
      'best_checkpoint_metric': (config.best_checkpoint_metric in ('bleu', 'tok_bleu') and
                                 config.best_checkpoint_metric, 'is validation BLEU'),
  }
  if config.task != 'translation':
    for field, (value, what) in translation_only.items():
      if value:
        raise ConfigError(f'config.{field}={value!r} {what}: it is for the translation task, not {config.task!r}')
  if config.target_right_to_left:
    for field in ('bpe_dropout', 'bidirectional_epochs'):
      if config[field]:
        raise ConfigError(f'config.target_right_to_left trains on reversed targets; config.{field}='
                          f'{config[field]!r} cannot go with it (it re-reads or swaps the targets)')
