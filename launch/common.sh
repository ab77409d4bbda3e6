# Shared by the launch scripts (sourced, not run).

# The trainer's own flags, which a flag file may hold beside the config: preparation skips them (--undefok).
TRAINER_FLAGS="workdir,distributed,coordinator_address,num_processes,process_id"

# The arguments of "$@" that describe the config (--config FILE and every --config.FIELD override, in either
# the --flag=value or the --flag value form, or a bare --config.BOOL_FIELD, and any --flagfile), printed one per
# line: `python -m flaxformer_nmt.corpora prepare` gets exactly the config the trainers get, and none of the
# trainer's own flags (--workdir, ...); those a flag file holds it is told to skip.
config_args() {
  local flagfile=0
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --config=*|--config.*=*) printf '%s\n' "$1"; shift ;;
      --flagfile=*) printf '%s\n' "$1"; flagfile=1; shift ;;
      --flagfile) printf '%s\n' "$1"; flagfile=1; shift; if [[ $# -gt 0 ]]; then printf '%s\n' "$1"; shift; fi ;;
      --config|--config.*)  # a bare --config.BOOL_FIELD takes no value: the next flag is not its value
        printf '%s\n' "$1"; shift
        if [[ $# -gt 0 && "$1" != --* ]]; then printf '%s\n' "$1"; shift; fi ;;
      *) shift ;;
    esac
  done
  if [[ "$flagfile" == 1 ]]; then printf '%s\n' "--undefok=$TRAINER_FLAGS"; fi
}

# Shell-quoted words, joined by spaces (one remote command line); no words: nothing, and status 0 (set -e).
quote() { if [[ $# -gt 0 ]]; then printf '%q ' "$@"; fi; }
