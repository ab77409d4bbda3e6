"""Helper for test_distributed.py: one of several training processes on this machine (CPU), joined through
jax.distributed as the hosts of a cluster are (distributed.initialize with an explicit coordinator).

  python tests/multiprocess_train.py PORT PROCESS_ID NUM_PROCESSES DATA_DIR WORKDIR NUM_STEPS [FIELD=VALUE ...]

FIELD=VALUE: a config field and a Python literal. Prints `RESULT process=I devices=D step=S loss=L`, S being the
newest checkpoint's step.
"""
import ast
import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

sys.path.insert(0, os.path.dirname(__file__))
from conftest import small_config  # pylint: disable=wrong-import-position


def main():
  port, process_id, num_processes, data_dir, workdir, num_steps = sys.argv[1:7]
  import jax  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.runtime import distributed
  from flaxformer_nmt.training import loop as train  # pylint: disable=g-import-not-at-top
  assert distributed.initialize('auto', f'localhost:{port}', int(num_processes), int(process_id))
  assert jax.process_count() == int(num_processes) and jax.process_index() == int(process_id)
  config = small_config(data_dir)
  config.num_train_steps = int(num_steps)
  config.average_last_checkpoints = 2  # the collective averaging at the end
  for override in sys.argv[7:]:
    field, value = override.split('=')
    config[field] = ast.literal_eval(value)
  metrics = train.train_and_evaluate(config, workdir)
  step = max(int(p) for p in os.listdir(os.path.join(workdir, 'checkpoints')) if p.isdigit())
  print(f'RESULT process={jax.process_index()} devices={jax.device_count()} step={step} '
        f'loss={metrics["train/loss"]:.6f}', flush=True)


if __name__ == '__main__':
  main()
