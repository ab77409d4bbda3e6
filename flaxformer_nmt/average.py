r"""Averages the parameters of the last K checkpoints (or of chosen steps) of a workdir.

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


def define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir.')
  flags.DEFINE_integer('last', 5, 'Average the newest K checkpoints.')
  flags.DEFINE_list('steps', None, 'Average exactly these steps instead of --last.')
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  checkpoints_lib.quiet_orbax_logs()
  try:
    # An ensemble's workdir (config.ensemble_members): each member averages its own checkpoints.
    for workdir in workdir_lib.member_workdirs(flags.FLAGS.workdir):
      steps = checkpoints_lib.average_last(workdir, flags.FLAGS.last, flags.FLAGS.steps)
      print(f'averaged checkpoints {steps} -> {workdir}/{checkpoints_lib.AVERAGED_DIR}')
  except (checkpoints_lib.AveragingError, FileNotFoundError, ValueError) as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
