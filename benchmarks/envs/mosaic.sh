#!/usr/bin/env bash
# A virtual environment for MosaicML Streaming, apart from the project's .venv: streaming pins
# numpy<2.2 and transformers<5 and imports torchvision, none of which fits .venv.
# benchmarks/shards_bench.py runs its rows with this environment's python in a subprocess.
#
#   bash benchmarks/envs/mosaic.sh [DIR]     (DIR defaults to $STOKER_MOSAIC_VENV or the
#                                             clone's build/mosaic-venv; prints its python)
#
# torch is pinned to the CPU build (2.13.0): an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
dir="${1:-${STOKER_MOSAIC_VENV:-$(cd "$(dirname "$0")/../.." && pwd)/build/mosaic-venv}}"
python="${PYTHON:-python3}"
if [ ! -x "$dir/bin/python" ]; then
    "$python" -m venv "$dir"
fi
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
printf 'torch==2.13.0\n' > "$constraints"
"$dir/bin/python" -m pip install --quiet --upgrade pip
"$dir/bin/python" -m pip install --quiet --no-compile -c "$constraints" \
    'torch==2.13.0' 'mosaicml-streaming==0.13.0' boto3 Pillow psutil
echo "$dir/bin/python"
