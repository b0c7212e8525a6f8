#!/usr/bin/env bash
# A short session on a borrowed GPU machine with no internet, run from the repository root:
#
#   bash benchmarks/gpu_session.sh [tests] [bench] [aoti] [probes]  (default: tests, bench and aoti, in that order)
#
# It installs the Python packages the machine lacks from wheels carried in .whl/ (`bash benchmarks/gpu_kit.sh` builds
# .whl, .devkit and, with --peer, .kit: name them in the call's carry) into /tmp/site, first on
# PYTHONPATH after this tree, puts the wrk carried in .devkit/ on PATH, prints the GPU and torch, then runs each step
# under its own timeout:
#   tests  the tests marked gpu (python -m pytest -m gpu -x), from the files that mark any: collecting the others
#          would import packages the kit does not carry (tritonclient, schemathesis, scikit-learn)
#   bench  benchmarks/gpu_bench.py: ResNet-50, UINT8 images over V2 binary, fp16 and fp32, CUDA graphs, 4 front-ends,
#          wrk at c=16, 64 and 256, each level beside the in-process closed loop of as many clients and the forward
#          at the batch it allows; the Poisson sweep (highest rate with p99 <= 15 ms, fp16, at most 60 s); and, where
#          an interpreter imports pytriton, PyTriton serving the same model in fp16 driven by the same clients.
#          About 7-8 minutes with the peer, 4-5 without: with the peer, run `tests` and `bench` in separate calls
#          of a device whose commands stop at 10 minutes
#   aoti   compile: aoti against inductor: ready seconds cold and warm through the compile cache
#          (benchmarks/compile_cache_bench.py, each mode), then rows/s at batch 1 and 64 of eager, inductor and aoti
#          in-process (benchmarks/inductor_bench.py), fp16, digits_mlp and resnet_bench; a few minutes
#   probes the path's levers at concurrency 64 (docs/gpu.md), about 30 s: benchmarks/tools/torch_calls.py (a batch's
#          stream made current per batch, the output's copy and sync against one blocking copy, each idle and beside
#          a busy event loop; the seconds and device memory of page-locking a front-end's 256 MiB in the engine
#          process) and benchmarks/tools/output_copies.py (the copies of a batch's outputs out of an instance process)
# Into $OUT (what the device tool brings back: at most 8 files, 2 folders deep): summary.txt, setup.log, tests.log,
# bench-<variant>.log, bench.md (each run's gpu_bench.md), bench.tgz (every bench output folder), aoti.log and aoti.tgz
# (the aoti step's results; their tables are in summary.txt) and probes.log (each probe's JSON): run the steps as
# separate calls, each with an $OUT of its own.
#
# Environment:
#   PY               the interpreter (default: /opt/torch/.venv/bin/python3 where it exists, else python3)
#   OUT              where logs and results go (default: a new temporary folder)
#   WHL, SITE        the wheels to install and where (default: .whl and /tmp/site); nothing is installed without WHL
#   TESTS_TIMEOUT    seconds for the tests (default 150); BENCH_TIMEOUT: seconds per bench run (default 540);
#                    AOTI_TIMEOUT: seconds for the aoti step (default 400)
#   PYTRITON_PYTHON  the interpreter the PyTriton peer runs under (default: one built from .kit/, which
#                    `bash benchmarks/gpu_kit.sh --peer` makes here, where the call carries .kit; else $PY when it
#                    imports pytriton; else none: no peer). From .kit/: a venv over $PY's Python at /tmp/pytriton-peer,
#                    nvidia-pytriton, numpy 1.26 (pytriton 0.7.0 answered empty tensors under numpy 2.4) and the
#                    peer's other wheels in its own site-packages, then this tree, $SITE and $PY's packages (torch)
#                    through a .pth file: Triton's Python backend stub sees that venv's path, not PYTHONPATH.
#   PYTRITON_SITE    (a peer not from .kit/) a folder on that interpreter's default site path: a .pth file there
#                    names $SITE, since Triton's Python backend stub does not see PYTHONPATH
#   BENCH_ARGS       replaces the bench's arguments; EXTRA_BENCH_ARGS is added to them (e.g. --precisions fp16)
#   EXTRA_SERVE_ARGS runs the bench a second time, its servers given these halfserve serve flags (gpu_bench
#                    --serve-args), into bench/extra: e.g. '--placement instance_threads' beside the default (processes
#                    on CUDA) for a thread-vs-process comparison. Add it to the time: the in-process part runs again.
#   GPU_SESSION_CPU=1  the bench at a CPU's size (32x32, fp32, a second a level): to try this script on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z ${PY:-} ]]; then
    PY=python3
    [[ -x /opt/torch/.venv/bin/python3 ]] && PY=/opt/torch/.venv/bin/python3
fi
OUT=${OUT:-$(mktemp -d -t gpu_session.XXXXXX)}
WHL=${WHL:-.whl}
SITE=${SITE:-/tmp/site}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}
AOTI_TIMEOUT=${AOTI_TIMEOUT:-400}
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(tests bench aoti)
mkdir -p "$OUT"
summary=$OUT/summary.txt
setup=$OUT/setup.log
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

# --- the kit -------------------------------------------------------------------------------------------------------
# --target, not the interpreter's site-packages: nothing of the machine's own environment changes, and these wheels
# (the lock's versions) come before its packages on the path.
wheels=("$WHL"/*.whl)
if [[ -e ${wheels[0]} ]]; then
    mkdir -p "$SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}" >>"$setup" 2>&1 || note "setup: pip install failed, see setup.log"
    else
        # No pip in that environment: a wheel is a zip of what would be installed (dist-info and its entry points too).
        for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$SITE" >>"$setup" 2>&1; done
    fi
    note "setup: ${#wheels[@]} wheels from $WHL into $SITE"
fi
export PYTHONPATH=$PWD/server:$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
# The bench's servers need no gRPC, and a port of their own would clash with anything else listening on 8001.
export HALFSERVE_GRPC=${HALFSERVE_GRPC:-false}

if [[ -f .devkit/bin/wrk ]]; then
    # Copied out so that its modes can be set whatever the copy of this tree allows.
    kit=$(mktemp -d -t devkit.XXXXXX)
    cp -r .devkit/. "$kit/"
    chmod +x "$kit/bin/wrk" "$kit/root/usr/bin/wrk"
    export PATH=$kit/bin:$PATH
fi

# The PyTriton peer: an interpreter that imports it, and (where the kit's packages live outside the default site path)
# a .pth file its backend stub reads.
if [[ -z ${PYTRITON_PYTHON:-} && -f .kit/pytriton.tar.xz ]]; then
    peer_venv=/tmp/pytriton-peer
    rm -rf "$peer_venv"
    if "$PY" -m venv --without-pip "$peer_venv" >>"$setup" 2>&1; then
        peer_site=$("$peer_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        own_site=$("$PY" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])')
        mkdir -p "$peer_site"
        tar -C "$peer_site" -xJf .kit/pytriton.tar.xz && tar -C "$peer_site" -xJf .kit/numpy.tar.xz
        for w in .kit/peer/*.whl; do "$PY" -m zipfile -e "$w" "$peer_site" >>"$setup" 2>&1; done
        printf '%s\n' "$PWD/server" "$PWD" "$SITE" $own_site >"$peer_site/zz-halfserve-kit.pth"
        if "$peer_venv/bin/python" -c 'import numpy, pytriton.triton, torch, safetensors, pydantic
assert numpy.__version__.startswith("1."), numpy.__version__' >>"$setup" 2>&1; then
            PYTRITON_PYTHON=$peer_venv/bin/python
        else
            note "setup: the PyTriton peer from .kit does not import; see setup.log"
        fi
    else
        note "setup: no venv for the PyTriton peer ($PY -m venv failed); see setup.log"
    fi
fi
if [[ -z ${PYTRITON_PYTHON:-} ]] && "$PY" -c 'import pytriton' >/dev/null 2>&1; then PYTRITON_PYTHON=$PY; fi
if [[ -n ${PYTRITON_SITE:-} && -d ${PYTRITON_SITE} ]]; then
    printf '%s\n' "$SITE" >"$PYTRITON_SITE/halfserve-kit.pth" || note "setup: cannot write $PYTRITON_SITE/halfserve-kit.pth"
fi

{
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo "-")
    echo "host: $(hostname), $(nproc) cores, $(date -u +%FT%TZ), commit $commit"
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1; else echo "nvidia-smi: not on PATH"; fi
    "$PY" -c 'import sys, torch; c = torch.cuda.is_available(); print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "available", c, torch.cuda.get_device_name() if c else "")' 2>&1
    echo "wrk: $(command -v wrk || echo none) $(wrk -v 2>&1 | head -1)"
    echo "pytriton: ${PYTRITON_PYTHON:-none (no peer)}"
} | tee -a "$summary"
# A package missing from the kit fails here, in a line, rather than as a server that never became ready.
if ! "$PY" -c 'import halfserve.cli, halfserve.api, halfserve.multiproc, halfserve.loadtest.runner, fastapi, uvicorn, orjson' \
    >>"$setup" 2>&1; then
    note "setup: the server does not import; see setup.log"
    tail -5 "$setup" | tee -a "$summary"
    exit 1
fi
note "setup: the server imports"

# --- the steps -----------------------------------------------------------------------------------------------------
run_tests() {
    local files start=$SECONDS rc
    mapfile -t files < <(grep -rlE 'pytest\.mark\.gpu' tests --include='test_*.py' | sort)
    # Only the plugin the project's config needs: the machine's own may not load under the kit's pytest (anyio 4.14's
    # imports a name pytest 9 deprecates, an error under this project's filterwarnings).
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -k 10 "$TESTS_TIMEOUT" \
        "$PY" -m pytest -p pytest_asyncio.plugin -p pytest_timeout -p no:cacheprovider -m gpu -q -x "${files[@]}" >"$OUT/tests.log" 2>&1
    rc=$?
    note "tests: rc=$rc in $((SECONDS - start))s, ${#files[@]} files: $(tail -1 "$OUT/tests.log")"
}

bench_args() {
    local peer=""
    [[ -n ${PYTRITON_PYTHON:-} ]] && peer="--peer pytriton --pytriton-python $PYTRITON_PYTHON"
    if [[ -n ${BENCH_ARGS:-} ]]; then
        echo "$BENCH_ARGS"
    elif [[ ${GPU_SESSION_CPU:-0} == 1 ]]; then
        echo "--device cpu --image-size 32 --batch-sizes 1,2 --precisions fp32 --seconds 0.2 --instances 1" \
            "--instance-counts 1 --concurrency 1,2 --duration 1 --warmup 1 --wires uint8 --load-generator wrk" \
            "--wrk-threads 1 --poisson --poisson-start 10 --p99-limit-ms 2000 --poisson-seconds 2 --poisson-steps 2" \
            "$peer"
    else
        # Batch sizes: the buckets c / 2 instances pads to at c = 16, 64, 256 (8, 32, 128), for server / forward.
        # The peer warms every batch size up to 128 (cudnn tunes each shape once), as many as c=256 over 2 instances
        # forms; each Poisson sweep gets at most 40 s.
        echo "--batch-sizes 1,8,32,128 --concurrency 16,64,256 --duration 4 --seconds 0.8 --wires uint8" \
            "--http-workers 4 --load-generator wrk --instance-counts 1,2 --compile cuda_graphs" \
            "--poisson --p99-limit-ms 15 --poisson-seconds 2 --poisson-budget 40 --peer-max-batch 128" \
            "--peer-start-timeout 180 $peer"
    fi
}

run_bench() {
    local variants=("default:") name serve args start rc
    # The place for a comparison of server settings: one variant per entry, NAME:halfserve serve flags.
    [[ -n ${EXTRA_SERVE_ARGS:-} ]] && variants+=("extra:$EXTRA_SERVE_ARGS")
    read -r -a args <<<"$(bench_args) ${EXTRA_BENCH_ARGS:-}"
    for v in "${variants[@]}"; do
        name=${v%%:*} serve=${v#*:} start=$SECONDS
        timeout -k 15 "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_bench.py "${args[@]}" --serve-args="$serve" \
            --out "$OUT/bench/$name" >"$OUT/bench-$name.log" 2>&1
        rc=$?
        note "bench $name (serve flags: ${serve:-none}): rc=$rc in $((SECONDS - start))s"
        [[ $rc == 0 ]] || tail -3 "$OUT/bench-$name.log" | tee -a "$summary"
        if [[ -f $OUT/bench/$name/gpu_bench.json ]]; then
            "$PY" - "$OUT/bench/$name/gpu_bench.json" <<'PY' | tee -a "$summary"
import json
import sys

r = json.load(open(sys.argv[1]))
c = r.get("instances", {})
print(f"  {r['model']} {r['input_shape']} on {r['machine'].get('gpu', r['device'])}; {c.get('precision')} instances "
      f"at batch {c.get('batch')}: " + ", ".join(f"{n}: {v:.0f}" for n, v in c.get("rows_per_s", {}).items()))
for label, s in r.get("servers", {}).items():
    for x in s["summary"]["levels"]:
        print(f"  server {label} {x['precision']} c={x['concurrency']}: {x['rows_per_s']:.0f} rows/s, "
              f"p99 {x['p99_ms']:.1f} ms, batch {x['mean_batch'] or 0:.1f}, {x['server_over_ceiling']:.2f} of the "
              f"ceiling, {x.get('server_over_closed_loop', 0):.2f} of the closed loop, "
              f"{x.get('server_over_forward', 0):.2f} of the forward at batch {x.get('forward_batch')}, "
              f"errors {x['errors']}")
for name, p in r.get("peers", {}).items():
    print(f"  peer {name} {p['precision']}: ready {p['ready_seconds']} s, answer max|diff| "
          f"{p['answer_max_abs_diff_from_halfserve']}, top class agrees {p['answer_argmax_agrees']}")
    for x in p["levels"]:
        print(f"  peer {name} c={x['concurrency']}: {x['rows_per_s']:.0f} rows/s, p99 {x['p99_ms']:.1f} ms, "
              f"errors {x['errors']}")
for name, run in r.get("poisson", {}).items():
    print(f"  poisson {name} {run['precision']}: best {run['best_rate']} req/s with p99 <= {run['limit_ms']} ms "
          f"({len(run['trials'])} rates, {run['stopped']}, {run['seconds']} s)")
PY
            { echo "# bench $name"; cat "$OUT/bench/$name/gpu_bench.md"; } >>"$OUT/bench.md"
        fi
    done
    tar -czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
}

run_probes() {
    local tool start=$SECONDS rc
    for tool in torch_calls output_copies; do
        # Their JSON goes into probes.log (OUT empty: no file of their own); REPS at a CPU's size: a smoke run.
        OUT= REPS=$([[ ${GPU_SESSION_CPU:-0} == 1 ]] && echo 50 || echo 2000) PYTHONPATH=benchmarks:$PYTHONPATH \
            timeout -k 10 120 "$PY" "benchmarks/tools/$tool.py" >>"$OUT/probes.log" 2>&1
        rc=$?
        note "probes $tool: rc=$rc in $((SECONDS - start))s"
    done
}

run_aoti() {
    local start=$SECONDS rc=0 mode models=digits_mlp,resnet_bench device=cuda precision=fp16 sizes=1,64
    local modes=(inductor aoti) compiled=inductor,aoti rounds=3
    if [[ ${GPU_SESSION_CPU:-0} == 1 ]]; then  # a smoke of the step: aoti alone, the small model
        models=digits_mlp device=cpu precision=fp32 sizes=1,2 modes=(aoti) compiled=aoti rounds=1
    fi
    mkdir -p "$OUT/aoti"
    # One deadline for the whole step: its runs share AOTI_TIMEOUT (never 0 s, which timeout reads as none).
    local deadline=$((SECONDS + AOTI_TIMEOUT))
    left() { local n=$((deadline - SECONDS)); echo $((n > 1 ? n : 1)); }
    for mode in "${modes[@]}"; do
        timeout -k 10 "$(left)" "$PY" benchmarks/compile_cache_bench.py --compile "$mode" \
            --models "$models" --precision "$precision" --serve-args="--device $device --threads 1" \
            --out "$OUT/aoti/ready-$mode" >>"$OUT/aoti.log" 2>&1 || rc=$?
    done
    timeout -k 10 "$(left)" "$PY" benchmarks/inductor_bench.py --compile "$compiled" \
        --models "$models" --precisions "$precision" --batch-sizes "$sizes" --device "$device" --rounds "$rounds" \
        --out "$OUT/aoti/forward" >>"$OUT/aoti.log" 2>&1 || rc=$?
    note "aoti: rc=$rc in $((SECONDS - start))s"
    cat "$OUT"/aoti/*.md 2>/dev/null | tee -a "$summary"
    [[ $rc == 0 ]] || tail -5 "$OUT/aoti.log" | tee -a "$summary"
    tar -czf "$OUT/aoti.tgz" -C "$OUT" aoti && rm -rf "$OUT/aoti"
}

for step in "${steps[@]}"; do
    case $step in
        tests) run_tests ;;
        bench) run_bench ;;
        aoti) run_aoti ;;
        probes) run_probes ;;
        *) note "unknown step $step (tests, bench, aoti, probes)" ;;
    esac
done
echo "results in $OUT: $(cd "$OUT" && echo *)"
