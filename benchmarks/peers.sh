#!/usr/bin/env bash
# halfserve beside the peers (TorchServe, MLServer, LitServe, a naive FastAPI app) on the peers kit's MLP
# (256-1024-1024-10, one sample per request, wrk -t1), in interleaved rounds: per round the kit sweeps each peer, then
# each halfserve variant as its EXTRA target, all at the same concurrency levels. halfserve serves the shipped
# digits_mlp, the same architecture, in fp32 as the peers do.
#
#   benchmarks/peers.sh OUT_DIR
#
# Needs the kit set up (../shared/peers/setup.sh, with PEERS_WORK) and wrk. Environment: PEERS (the kit's folder,
# default ../shared/peers beside the repository), PEERS_WORK (default /tmp/peers-work), ROUNDS (2), SYSTEMS (the
# peers, default all four), CONCURRENCY ("1 8 32 64"), WARMUP (3 s), DURATION (10 s), VARIANTS (halfserve options per
# variant, separated by "|", after --precision fp32; default: the peers' batching, max batch 32 and a fixed 5 ms
# delay; then halfserve's own defaults, whose adaptive delay --adaptive-delay names; then those defaults with the
# default precision too, --precision auto: bf16 on a CPU with native bf16, fp32 on others, fp16 on CUDA).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:?usage: benchmarks/peers.sh OUT_DIR}" && cd "$1" && pwd)"
PEERS="${PEERS:-$ROOT/../shared/peers}"
export PEERS_WORK="${PEERS_WORK:-/tmp/peers-work}"
export CONCURRENCY="${CONCURRENCY:-1 8 32 64}" WARMUP="${WARMUP:-3}" DURATION="${DURATION:-10}"
ROUNDS="${ROUNDS:-2}"
SYSTEMS_ALL="${SYSTEMS-fastapi litserve mlserver torchserve}"
VARIANTS="${VARIANTS:---max-batch-size 32 --max-delay-ms 5 --no-adaptive-delay|--adaptive-delay|--adaptive-delay --precision auto}"
PORT=8090

body="$(mktemp)"
trap 'rm -f "$body"; [[ -z "${pid:-}" ]] || kill "$pid" 2>/dev/null || true' EXIT
# One sample of 256 floats, as the peers' bodies carry one.
python - "$body" <<'PY'
import json
import sys

import numpy as np

sample = np.random.default_rng(42).standard_normal(256).round(6).tolist()
with open(sys.argv[1], "w") as f:
    json.dump({"model": "digits_mlp", "inputs": [sample]}, f)
PY

runs=()
for round in $(seq 1 "$ROUNDS"); do
  parts=()
  if [[ -n "$SYSTEMS_ALL" ]]; then
    RUN_NAME="peers-round$round" SYSTEMS="$SYSTEMS_ALL" RESULTS="$OUT/round$round-peers" bash "$PEERS/bench.sh" run
    parts+=("$OUT/round$round-peers")
  fi
  i=0
  IFS='|' read -r -a variants <<<"$VARIANTS"
  for variant in "${variants[@]}"; do
    i=$((i + 1))
    name="halfserve-$i"
    # shellcheck disable=SC2086  # the variant is a list of options
    python -m halfserve serve --store "$ROOT/model_store" --models digits_mlp --port "$PORT" --precision fp32 \
      --no-grpc $variant >"$OUT/$name-round$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
      sleep 0.2
    done
    SYSTEMS="" EXTRA_URL="http://127.0.0.1:$PORT/predict" EXTRA_BODY="$body" EXTRA_NAME="$name" \
      RESULTS="$OUT/round$round-$name" bash "$PEERS/bench.sh" run
    echo "$name: halfserve serve --precision fp32 ${variant:-(defaults)}" >"$OUT/round$round-$name/variant.txt"
    parts+=("$OUT/round$round-$name")
    kill -TERM "$pid"
    wait "$pid" || true
    pid=""
  done
  # One summary per round, every server in it, for the kit's combine.py.
  mkdir -p "$OUT/round$round"
  python3 - "$OUT/round$round/summary.json" "${parts[@]}" <<'PY'
import json
import sys

merged = {}
for folder in sys.argv[2:]:
    summary = json.load(open(f"{folder}/summary.json"))
    merged.update(summary.get("runs", summary))
json.dump({"runs": merged}, open(sys.argv[1], "w"), indent=1)
PY
  runs+=("round$round=$OUT/round$round")
done
python3 "$PEERS/combine.py" -o "$OUT/combined.md" "${runs[@]}"
cat "$OUT/combined.md"
