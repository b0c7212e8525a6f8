#!/usr/bin/env bash
# halfserve's own server (uvicorn, its protocol's direct routes) against the same app under granian, ASGI and RSGI
# (benchmarks/tools/granian_app.py): interleaved rounds, a fresh server each, wrk -t1 -c64 on GET /health and
# POST /predict (one JSON sample of the model's first input). Per run: req/s, p99, and the serving process's CPU
# per request (all its threads, from /proc; granian's worker process, not its supervisor).
#
#   GRANIAN=/path/to/venv/bin/granian benchmarks/tools/granian_probe.sh OUT_DIR
#
# Environment: GRANIAN (granian's executable, in a virtual environment that also has this project), MODEL
# (digits_mlp), PRECISION (fp32), ROUNDS (2), DURATION (4 s), WARMUP (2 s), PORT (8094).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="$(mkdir -p "${1:?usage: GRANIAN=... benchmarks/tools/granian_probe.sh OUT_DIR}" && cd "$1" && pwd)"
GRANIAN="${GRANIAN:?set GRANIAN to the granian executable}"
MODEL="${MODEL:-digits_mlp}" PRECISION="${PRECISION:-fp32}" ROUNDS="${ROUNDS:-2}"
DURATION="${DURATION:-4}" WARMUP="${WARMUP:-2}" PORT="${PORT:-8094}"
URL="http://127.0.0.1:$PORT"
export HALFSERVE_STORE="$ROOT/model_store" HALFSERVE_MODELS="$MODEL" HALFSERVE_PRECISION="$PRECISION"
export HALFSERVE_GRPC=false

work="$(mktemp -d)"
trap 'rm -rf "$work"; [[ -z "${pid:-}" ]] || kill "$pid" 2>/dev/null || true' EXIT
python "$ROOT/benchmarks/common.py" "$MODEL" "$work" predict

cpu_seconds() {  # utime + stime of a process, all its threads
  awk -v hz="$(getconf CLK_TCK)" '{sub(/.*\) /, ""); print ($12 + $13) / hz}' "/proc/$1/stat"
}

start() {  # server name: sets pid (what to stop) and serving (whose CPU counts)
  case "$1" in
    uvicorn) python -m halfserve serve --port "$PORT" --no-grpc >"$OUT/$1.log" 2>&1 & ;;
    granian-asgi | granian-rsgi)
      "$GRANIAN" --interface "${1#granian-}" --workers 1 --loop uvloop --port "$PORT" --no-ws \
        --working-dir "$ROOT/benchmarks/tools" "granian_app:${1#granian-}" >"$OUT/$1.log" 2>&1 &
      ;;
  esac
  pid=$!
  for _ in $(seq 1 300); do
    curl -sf "$URL/health" >/dev/null && [[ "$(curl -s -o /dev/null -w '%{http_code}' -X POST \
      -H 'content-type: application/json' --data-binary "@$work/predict.body" "$URL/predict")" == 200 ]] && break
    sleep 0.2
  done
  serving=$(pgrep -P "$pid" -f granian | head -1 || true)
  serving=${serving:-$pid}
}

measure() {  # server, route
  local args=("$URL/health")
  [[ $2 == predict ]] && args=(-s "$work/predict.lua" "$URL/predict")
  HALFSERVE_BODY="$work/predict.body" wrk -t1 -c64 -d"${WARMUP}s" "${args[@]}" >/dev/null
  local before after
  before=$(cpu_seconds "$serving")
  HALFSERVE_BODY="$work/predict.body" wrk -t1 -c64 -d"${DURATION}s" --latency "${args[@]}" >"$work/wrk.txt"
  after=$(cpu_seconds "$serving")
  awk -v server="$1" -v route="$2" -v cpu="$(echo "$after - $before" | bc)" '
    /requests in/ {n = $1} /Requests\/sec/ {r = $2} /^ +99%/ {p = $2}
    END {printf "| %s | %s | %.0f | %s | %.0f |\n", server, route, r, p, cpu / n * 1e6}' "$work/wrk.txt"
}

{
  echo "# halfserve under uvicorn and under $("$GRANIAN" --version 2>/dev/null | tail -1) ($MODEL, $PRECISION, wrk -t1 -c64, ${DURATION} s a run)"
  echo
  python - "$ROOT" <<'PY'
import sys

sys.path.insert(0, sys.argv[1])
from halfserve import hostinfo  # noqa: E402

host = hostinfo.describe()
print(
    f"{host['cpu']} ({host['cores']} cores, {host['cpu_capability']}, native bf16 {host['native_bf16']}), "
    f"{host['allocator']}, torch {host['torch']}"
)
PY
  echo
  echo "| server | route | req/s | p99 | server CPU us/request |"
  echo "|---|---|---:|---:|---:|"
  for round in $(seq 1 "$ROUNDS"); do
    for server in uvicorn granian-asgi granian-rsgi; do
      start "$server"
      for route in health predict; do
        measure "$server" "$route"
      done
      kill -TERM "$pid"
      wait "$pid" 2>/dev/null || true
      pid=
    done
  done
} | tee "$OUT/granian_probe.md"
