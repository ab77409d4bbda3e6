r"""Averages the parameters of the last K checkpoints saved at the regular interval (or of chosen steps) of a
workdir: K is config.average_last_checkpoints, the window the trainer averages when it ends, unless --last is given.

  python -m flaxformer_nmt.average --workdir runs/m30k
  python -m flaxformer_nmt.average --workdir runs/m30k --last 5
  python -m flaxformer_nmt.average --workdir runs/m30k --steps 1500,1750
  python -m flaxformer_nmt.decode --workdir runs/m30k --checkpoint averaged ...

The result goes to `{workdir}/averaged/`; decode loads it with `--checkpoint averaged`. The workdir of an
ensemble (config.ensemble_members) averages each member's checkpoints into its own averaged/.
"""
import sys

from absl import app, flags

from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.checkpointing import workdir as workdir_lib


DEFAULT_LAST = 5  # --last of a workdir whose trainer averaged nothing (config.average_last_checkpoints=0)


def window(workdir, last):
  """`last` (--last), else the K the workdir's trainer averages (config.average_last_checkpoints; DEFAULT_LAST
  where that is 0)."""
  if last is not None:
    return last
  return workdir_lib.load_config(workdir).average_last_checkpoints or DEFAULT_LAST


def parse_steps(values):
  """--steps' checkpoint steps as ints, or None where the flag is not given."""
  if not values:
    return None
  try:
    return [int(v) for v in values]
  except ValueError:
    raise ValueError(f'--steps={",".join(values)}: checkpoint steps are whole numbers, e.g. 1500,1750') from None


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir.')
  flags.DEFINE_integer('last', None, 'Average the newest K checkpoints saved at the regular interval (a final save '
                       'off it is left out). Default: the workdir\'s config.average_last_checkpoints, or '
                       f'{DEFAULT_LAST} where that is 0.')
  flags.DEFINE_list('steps', None, 'Average exactly these steps instead of --last.')
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if flags.FLAGS['steps'].present and not flags.FLAGS.steps:  # --steps= would average the default window
    raise app.UsageError('--steps is empty: give the checkpoint steps to average, e.g. 1500,1750')
  if flags.FLAGS.steps and flags.FLAGS.last is not None:
    raise app.UsageError('--last and --steps each choose the checkpoints to average: give one')
  checkpoints_lib.quiet_orbax_logs()
  try:
    chosen = parse_steps(flags.FLAGS.steps)
    # An ensemble's workdir (config.ensemble_members): each member averages its own checkpoints.
    for workdir in workdir_lib.member_workdirs(flags.FLAGS.workdir):
      last = None if chosen else window(workdir, flags.FLAGS.last)
      steps = checkpoints_lib.average_last(workdir, last, chosen)
      print(f'averaged checkpoints {steps} -> {workdir}/{checkpoints_lib.AVERAGED_DIR}')
  except (checkpoints_lib.AveragingError, OSError, ValueError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
