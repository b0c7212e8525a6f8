#!/usr/bin/env bash
# The PyTriton peer's interpreter (gpu_bench.py --peer pytriton, tests/e2e/test_gpu_bench.py):
#
#   bash benchmarks/pytriton_venv.sh DIR      (with the project's environment active; prints DIR/bin/python)
#
# A virtual environment at DIR with nvidia-pytriton 0.7.0 from benchmarks/pytriton-constraints.txt (numpy 1.26: the
# peer needs numpy<2), and a .pth file naming the active environment's site-packages after its own, for torch,
# safetensors and pydantic: nothing of the project's environment changes, and no second torch is installed.
# Idempotent: an environment already built there is kept.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir=${1:?usage: pytriton_venv.sh DIR}
python=${PYTHON:-python}
if [[ ! -f $dir/.peer-ok ]]; then
    rm -rf -- "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check \
        -c "$root/benchmarks/pytriton-constraints.txt" nvidia-pytriton numpy
    site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/zz-project.pth"
    "$dir/bin/python" -c 'import pytriton, torch, safetensors, pydantic, numpy; assert numpy.__version__.startswith("1.")'
    touch "$dir/.peer-ok"
fi
echo "$dir/bin/python"
