#!/usr/bin/env bash
# What benchmarks/gpu_session.sh installs on a GPU machine that reaches no package index, built here, where PyPI and
# Debian's archive can be reached, from the repository root:
#
#   bash benchmarks/gpu_kit.sh [--peer]
#
# Writes (each git-ignored through .git/info/exclude; name them in the device call's carry):
#   .whl/      the lock's wheels (constraints.txt, for Python $PYVER on manylinux x86-64) of what the server and the
#              gpu tests import and the device image lacks (docs/gpu.md: its packages are listed by the device tool)
#   .devkit/   wrk and LuaJIT from Debian packages, unpacked, with bin/wrk a wrapper that finds the library
#   .kit/      with --peer, the PyTriton peer: nvidia-pytriton 0.7.0's files less the Python backend stubs for other
#              Pythons and the libpython 3.13 only one of those needs (pytriton.tar.xz), numpy 1.26.4 (numpy.tar.xz:
#              pytriton answered empty tensors under numpy 2.4) and the wheels of its other needs
#              (benchmarks/pytriton-constraints.txt's versions; peer/)
# and prints what would travel (tracked files and these) against the device tool's 64 MiB. gpu_session.sh builds the
# peer's interpreter from .kit/ (a venv over the machine's Python, these packages first).
#
# Environment: PYVER (3.12, the device image's Python), PLATFORMS (manylinux tags pip may match).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
peer=0
[[ ${1:-} == --peer ]] && peer=1
py=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))

for d in .whl .devkit .kit; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude; done
rm -rf .whl .devkit
mkdir -p .whl .devkit
((peer)) && rm -rf .kit && mkdir -p .kit/peer
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

platforms=()
for tag in ${PLATFORMS:-manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 \
    manylinux_2_34_x86_64 manylinux_2_35_x86_64}; do platforms+=(--platform "$tag"); done
download() {  # download DIR NAME==VERSION ...: wheels only, for the device's Python and platform, no dependencies
    local dir=$1
    shift
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$dir" "$@" 2>&1 |
        grep -v "^WARNING: Location" || true
    local want=$# got
    got=$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)
    ((got >= want)) || { echo "gpu_kit: $got of $want wheels downloaded into $dir" >&2; exit 1; }
}
# NAME -> NAME==VERSION as a lock pins it for the device's Python (its markers evaluated there).
pinned() {
    "$py" - "$PYVER" "$@" <<'PY'
import sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
ver, names = sys.argv[1], sys.argv[3:]
env = {"python_full_version": ver + ".3", "python_version": ver, "sys_platform": "linux", "os_name": "posix",
       "platform_system": "Linux", "platform_machine": "x86_64", "platform_python_implementation": "CPython",
       "implementation_name": "cpython", "extra": ""}
pins = {}
for line in open(sys.argv[2]):
    line = line.split("#", 1)[0].strip()
    if line:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            pins[canonicalize_name(req.name)] = str(req.specifier)
missing = [n for n in names if canonicalize_name(n) not in pins]
if missing:
    sys.exit(f"gpu_kit: not pinned in {sys.argv[2]}: {', '.join(missing)}")
print(" ".join(f"{n}{pins[canonicalize_name(n)]}" for n in names))
PY
}

# The server, its front-ends and the gpu tests' plugins; the image has torch, numpy, grpcio, protobuf, pillow,
# safetensors, prometheus-client, httpx, anyio, h11, uvloop, pytest-timeout and click.
server=(fastapi starlette annotated-doc opentelemetry-api uvicorn httptools python-dotenv pydantic pydantic-core
    pydantic-settings annotated-types typing-inspection typing-extensions orjson pytest pluggy iniconfig pytest-asyncio
    pytest-timeout)
# shellcheck disable=SC2046
download .whl $(pinned constraints.txt "${server[@]}")
echo "gpu_kit: .whl: ${#server[@]} wheels, $(du -sh .whl | cut -f1)"

# wrk: the bench's load generator; Debian's build links LuaJIT, which the image lacks.
bash benchmarks/wrk_kit.sh .devkit
echo "gpu_kit: .devkit: $(.devkit/bin/wrk -v 2>&1 | head -1)"

if ((peer)); then
    # The peer's needs beyond what the image has (it has wrapt, typer, typing-inspect, aiohttp, grpcio, protobuf,
    # ml-dtypes).
    needs=(tritonclient python-rapidjson geventhttpclient gevent zope.event zope.interface greenlet brotli pyzmq sh
        importlib_metadata lazy-importer zipp urllib3 certifi)
    # shellcheck disable=SC2046
    download .kit/peer $(pinned benchmarks/pytriton-constraints.txt "${needs[@]}")
    # shellcheck disable=SC2046
    download "$tmp/big" $(pinned benchmarks/pytriton-constraints.txt nvidia-pytriton numpy)
    for name in nvidia_pytriton numpy; do
        rm -rf "$tmp/x" && mkdir "$tmp/x"
        # Extracted keeping each member's mode: tritonserver must stay executable.
        "$py" - "$tmp"/big/"$name"-*.whl "$tmp/x" <<'PY'
import os
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel:
    for member in wheel.infolist():
        path = wheel.extract(member, sys.argv[2])
        mode = (member.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
        stubs=("$tmp"/x/pytriton/tritonserver/python_backend_stubs/*)
        for stub in "${stubs[@]}"; do
            [[ -e $stub && $(basename "$stub") != "$PYVER" ]] && rm -rf "$stub"
        done
        rm -rf "$tmp"/x/nvidia_pytriton.libs/libpython3-*.13.so* "$tmp"/x/numpy/*/tests "$tmp"/x/numpy/tests
        tar -C "$tmp/x" -cf - . | xz -T0 -9 >".kit/${name%%_*}.tar.xz"
    done
    mv .kit/nvidia.tar.xz .kit/pytriton.tar.xz
    echo "gpu_kit: .kit: $(ls .kit/peer | wc -l) peer wheels, pytriton and numpy, $(du -sh .kit | cut -f1)"
fi

tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
kit=$(du -cb .whl .devkit $( ((peer)) && echo .kit) | tail -1 | cut -f1)
total=$((tracked + kit))
echo "gpu_kit: travels $((total / 1024 / 1024)) MiB of 64 (tracked files $((tracked / 1024 / 1024)) MiB, kit $((kit / 1024 / 1024)) MiB)"
((total < LIMIT)) || { echo "gpu_kit: over the device tool's 64 MiB: leave out --peer" >&2; exit 1; }
echo "gpu_kit: carry: .whl .devkit$( ((peer)) && echo ' .kit')"
