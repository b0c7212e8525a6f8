#!/usr/bin/env bash
# wrk without installing anything: Debian's package and the LuaJIT it links, fetched with apt-get download and
# unpacked into DIR, with DIR/bin/wrk a wrapper that finds the library wherever DIR is moved (gpu_kit.sh's .devkit
# travels to a GPU machine; .ci/run puts DIR/bin on PATH):
#
#   bash benchmarks/wrk_kit.sh DIR
set -euo pipefail
dir=${1:?usage: wrk_kit.sh DIR}
mkdir -p "$dir/bin"
debs=$(mktemp -d)
trap 'rm -rf "$debs"' EXIT
(cd "$debs" && apt-get download wrk libluajit2-5.1-2 >/dev/null 2>&1) || { echo "wrk_kit: apt-get download wrk failed" >&2; exit 1; }
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$dir/root"; done
cat >"$dir/bin/wrk" <<'SH'
#!/bin/sh
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH=$here/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec "$here/root/usr/bin/wrk" "$@"
SH
chmod +x "$dir/bin/wrk"
