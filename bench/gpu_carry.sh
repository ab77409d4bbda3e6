#!/usr/bin/env bash
# Makes what bench/gpu_session.sh takes to a GPU machine that has no network, in the repository's root (all
# git-ignored), and prints its size (the device tool carries at most 64 MiB with the working tree):
#   gpu_carry/m30k   a trained Multi30k workdir, slimmed to config.json, vocab.model and averaged/
#   gpu_carry/data   multi30k/ and multi30k_tok/ (the corpus and its tokenized references)
#   .whl             wheels for Python 3.12 of the dependencies that the GPU image lacks (WHEELS: their names,
#                    default ml-collections, tensorboardX, sacremoses and the joblib and tqdm it imports; their
#                    versions within pyproject.toml's pins). Naming more (the server's fastapi and uvicorn, say)
#                    means naming what each needs that the image lacks too: each wheel comes without its
#                    dependencies. gpu_session.sh's setup installs only what the image lacks or has outside the
#                    pins, and names what it could not.
#
#   bash bench/gpu_carry.sh runs/m30k [DATA]    # DATA: the folder holding multi30k/ and multi30k_tok/ (default:
#                                               # the download cache, $FLAXFORMER_NMT_CACHE or ~/.cache/flaxformer_nmt)
#
# Then one device call names `gpu_carry` and `.whl` in carry and runs, for example,
# `bash bench/gpu_session.sh env decode training` (bench/gpu_session.sh's header lists the stages).
set -euo pipefail
[ -f pyproject.toml ] || { echo "gpu_carry.sh: run it from the repository's root" >&2; exit 2; }
workdir=${1:?usage: bash bench/gpu_carry.sh WORKDIR [DATA]}
data=${2:-${FLAXFORMER_NMT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flaxformer_nmt}}
PY=${PY:-python3}
for path in "$workdir/config.json" "$workdir/vocab.model" "$workdir/averaged" "$data/multi30k/test2016.en" \
            "$data/multi30k_tok/test2016.de"; do
  [ -e "$path" ] || { echo "gpu_carry.sh: $path is missing" >&2; exit 2; }
done

rm -rf gpu_carry .whl
mkdir -p gpu_carry/m30k gpu_carry/data .whl
cp "$workdir/config.json" "$workdir/vocab.model" gpu_carry/m30k/
cp -r "$workdir/averaged" gpu_carry/m30k/
cp -r "$data/multi30k" "$data/multi30k_tok" gpu_carry/data/

# Each wheel's requirement as pyproject.toml pins it (its optional dependencies too); a name it does not pin
# is taken as given
requirements=$($PY - ${WHEELS:-ml-collections tensorboardX sacremoses joblib tqdm} <<'EOF'
import sys, tomllib
from packaging.requirements import Requirement
with open('pyproject.toml', 'rb') as f:
  project = tomllib.load(f)['project']
pins = {}
for requirement in map(Requirement, project['dependencies'] + sum(project['optional-dependencies'].values(), [])):
  pins[requirement.name.lower()] = str(requirement)
print('\n'.join(pins.get(name.lower(), name) for name in sys.argv[1:]))
EOF
)
mapfile -t requirements <<< "$requirements"
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${requirements[@]}"

ls .whl
du -sh gpu_carry .whl
echo "# the working tree that travels besides: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1)"
