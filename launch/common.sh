# Shared by the launch scripts (sourced, not run).

# The arguments of "$@" that describe the config (--config FILE and every --config.FIELD override, in either
# the --flag=value or the --flag value form, or a bare --config.BOOL_FIELD), printed one per line:
# `python -m flaxformer_nmt.corpora prepare` gets exactly the config the trainers get, and none of the trainer's
# own flags (--workdir, ...).
config_args() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --config=*|--config.*=*) printf '%s\n' "$1"; shift ;;
      --config|--config.*)  # a bare --config.BOOL_FIELD takes no value: the next flag is not its value
        printf '%s\n' "$1"; shift
        if [[ $# -gt 0 && "$1" != --* ]]; then printf '%s\n' "$1"; shift; fi ;;
      *) shift ;;
    esac
  done
}

# Shell-quoted words, joined by spaces (one remote command line); no words: nothing, and status 0 (set -e).
quote() { if [[ $# -gt 0 ]]; then printf '%q ' "$@"; fi; }
