#!/usr/bin/env bash
# The HTTP ceiling beside the inference routes: one halfserve server, wrk -t1 at one concurrency, interleaved rounds
# of GET /health (what the HTTP stack and wrk manage with no model: the ceiling), POST /predict (one JSON sample) and
# POST /v2/models/MODEL/infer (the same sample as V2 binary data, binary output). Each route's req/s and p99 per
# round, and per round /predict / /health and V2 binary / /predict.
#
#   benchmarks/ceiling.sh OUT_DIR [server options...]
#
# Environment: MODEL (digits_mlp; the sample has its first input's shape), ROUNDS (3), CONNECTIONS (64), DURATION
# (8 s), WARMUP (2 s), PORT (8095). Server options default to "--precision fp32" (what peers.sh compares with the peers).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:?usage: benchmarks/ceiling.sh OUT_DIR [server options...]}" && cd "$1" && pwd)"
shift
OPTIONS=("$@")
[[ ${#OPTIONS[@]} -gt 0 ]] || OPTIONS=(--precision fp32)
MODEL="${MODEL:-digits_mlp}" ROUNDS="${ROUNDS:-3}" CONNECTIONS="${CONNECTIONS:-64}"
DURATION="${DURATION:-8}" WARMUP="${WARMUP:-2}" PORT="${PORT:-8095}"
URL="http://127.0.0.1:$PORT"

work="$(mktemp -d)"
trap 'rm -rf "$work"; [[ -z "${pid:-}" ]] || kill "$pid" 2>/dev/null || true' EXIT
# The bodies and wrk scripts the other benchmarks post, for one seeded sample of the model's first input.
python "$ROOT/benchmarks/common.py" "$MODEL" "$work" predict v2-binary

python -m halfserve serve --store "$ROOT/model_store" --models "$MODEL" --port "$PORT" --no-grpc "${OPTIONS[@]}" \
  >"$OUT/server.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
  curl -sf "$URL/ready" >/dev/null && break
  sleep 0.2
done
curl -sf "$URL/ready" >/dev/null

run() {  # route name, then wrk's arguments after the URL's options
  local name=$1 seconds=$2
  shift 2
  HALFSERVE_BODY="$work/$name.body" wrk -t1 -c"$CONNECTIONS" -d"${seconds}s" --latency "$@" >"$work/$name.txt"
  awk -v name="$name" '/Requests\/sec/{r=$2} /^ +99%/{p=$2} END{printf "%s %s %s\n", name, r, p}' "$work/$name.txt"
}
routes=(health predict v2-binary)
args_health=("$URL/health")
args_predict=(-s "$work/predict.lua" "$URL/predict")
args_v2_binary=(-s "$work/v2-binary.lua" "$URL/v2/models/$MODEL/infer")
for name in "${routes[@]}"; do
  var="args_${name//-/_}[@]"
  run "$name" "$WARMUP" "${!var}" >/dev/null
done
: >"$OUT/rounds.txt"
for round in $(seq 1 "$ROUNDS"); do
  for name in "${routes[@]}"; do
    var="args_${name//-/_}[@]"
    echo "$round $(run "$name" "$DURATION" "${!var}")" | tee -a "$OUT/rounds.txt"
  done
done
kill -TERM "$pid"
wait "$pid" || true
pid=""

python - "$OUT" "$MODEL" "$CONNECTIONS" "$DURATION" "${OPTIONS[*]}" "$ROOT" <<'PY'
import json
import sys
from collections import defaultdict

out, model, connections, duration, options, root = sys.argv[1:]
sys.path.insert(0, root)
from halfserve import hostinfo  # noqa: E402

host = hostinfo.describe()
rounds: dict[int, dict[str, tuple[float, str]]] = defaultdict(dict)
for line in open(f"{out}/rounds.txt"):
    r, name, rps, p99 = line.split()
    rounds[int(r)][name] = (float(rps), p99)
lines = [
    f"# The HTTP ceiling beside the inference routes ({model}, halfserve serve {options}, wrk -t1 -c{connections}, "
    f"{duration} s per run, rounds interleaved)",
    "",
    f"{host['cpu']} ({host['cores']} cores, {host['cpu_capability']}, native bf16 {host['native_bf16']}), "
    f"{host['allocator']}, torch {host['torch']}",
    "",
    "| round | GET /health req/s (p99) | POST /predict req/s (p99) | V2 binary req/s (p99) | /predict / /health "
    "| V2 binary / /predict |",
    "|---:|---:|---:|---:|---:|---:|",
]
for r, row in sorted(rounds.items()):
    (h, hp), (p, pp), (v, vp) = row["health"], row["predict"], row["v2-binary"]
    lines.append(f"| {r} | {h:,.0f} ({hp}) | {p:,.0f} ({pp}) | {v:,.0f} ({vp}) | {p / h:.2f} | {v / p:.2f} |")
text = "\n".join(lines) + "\n"
print(text)
open(f"{out}/ceiling.md", "w").write(text)
summary = {"host": host, "model": model, "options": options, "connections": int(connections), "rounds": rounds}
json.dump(summary, open(f"{out}/ceiling.json", "w"), indent=1)
PY
