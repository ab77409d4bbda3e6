r"""Trains a Transformer: `python -m flaxformer_nmt.train --config configs/multi30k.py --workdir runs/m30k`.

Fields of the config are overridden with `--config.field=value` (e.g. `--config.num_train_steps=500`). The
workdir receives the vocabulary (vocab.model), the config (config.json), checkpoints, TensorBoard event files
(tensorboard/) and the logged metrics (metrics.jsonl). Rerunning the same command resumes from the newest
checkpoint. With config.ensemble_members > 1 the command trains that many runs in turn, in
{workdir}/member0, member1, ... (training/ensemble.py). The loop is training/loop.py.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.config import ConfigError
from flaxformer_nmt.data import corpus as data_lib
from flaxformer_nmt.data import tokenizer as tokenizer_lib
from flaxformer_nmt.runtime import cache
from flaxformer_nmt.runtime import distributed
from flaxformer_nmt.runtime import flags as cli
from flaxformer_nmt.runtime import host_memory
from flaxformer_nmt.runtime import sharding
from flaxformer_nmt.training import ensemble
from flaxformer_nmt.training import warm_start
from flaxformer_nmt.training.loop import train_and_evaluate
from flaxformer_nmt.training.metrics import NonFiniteError


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Python config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory (or gs:// URL) for the vocabulary, checkpoints and logs.')
  flags.DEFINE_enum('distributed', 'auto', distributed.MODES,
                    'Multi-host start: auto (coordinator address, srun step, Open MPI or Cloud TPU VM), on, off.')
  flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS).')
  flags.DEFINE_integer('num_processes', None, 'Processes in the job (default: $JAX_NUM_PROCESSES).')
  flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1 (default: $JAX_PROCESS_ID).')
  flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if message := cli.unmakeable_directory('workdir', flags.FLAGS.workdir):  # before the data is read
    sys.exit(message)
  if host_memory.keep_freed_memory():  # before the first computation starts XLA's threads (host_memory.py)
    logging.info('Host memory: freed buffers kept for reuse (%s=0 turns it off)', host_memory.ENV)
  checkpoints_lib.quiet_orbax_logs()
  try:
    # Before anything starts the backend: it fixes the CPU client's devices.
    if sharding.split_host_cpu(flags.FLAGS.config.cpu_devices):
      logging.info('Host CPU split into %d devices (config.cpu_devices)', flags.FLAGS.config.cpu_devices)
  except sharding.MeshError as e:
    sys.exit(f'error: {e}')
  try:
    distributed.initialize(flags.FLAGS.distributed, flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                           flags.FLAGS.process_id)
  except distributed.DistributedError as e:
    sys.exit(f'error: {e}')
  cache.use_compilation_cache()  # a resumed or repeated run loads its train step and searches
  try:
    if flags.FLAGS.config.ensemble_members > 1:  # several runs in turn, in member directories
      ensemble.train_members(flags.FLAGS.config, flags.FLAGS.workdir, train_and_evaluate)
      ensemble.score_on_validation(flags.FLAGS.config, flags.FLAGS.workdir)  # once all members have finished
    else:
      train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  except (data_lib.DataError, ConfigError, tokenizer_lib.TokenizerError, NonFiniteError,
          checkpoints_lib.AveragingError, checkpoints_lib.CheckpointMismatchError,
          checkpoints_lib.CheckpointStorageError, checkpoints_lib.CheckpointsDamagedError,
          warm_start.WarmStartError, sharding.MeshError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli.parse_flags)
