"""The app's own cost per request: event-loop CPU per inference request, in process, with no HTTP server or client.

The server's throughput on a small model is bounded by its event loop: each request's routing, decoding, batching,
answering, metrics and encoding run there, holding the GIL. Under wrk on a shared 2-core host that cost is hard to
see through the noise of the load generator and the machine; here the ASGI app is called directly, by ``--clients``
concurrent callers in this process (each sends its next request when its answer arrives, as a load generator's
connection would), and the loop thread's CPU time (``time.thread_time``) is divided by the requests answered.
The engine's threads run the forward beside it as in the server. What this leaves out (uvicorn's protocol, the
socket reads and writes) is the same for every route and every source tree.

Routes: ``health`` (``GET /health``, through FastAPI's stack), ``predict`` (``POST /predict``, one JSON sample) and
``v2-binary`` (``POST /v2/models/MODEL/infer``, the sample as binary data, binary output). Source trees are compared
interleaved, each in its own process (a rev is a commit, checked out in a temporary git worktree, or ``.``)::

    python benchmarks/app_cost.py --revs HEAD~3,. --rounds 5 --out benchmarks/results/app-cost-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
"""The repository root. Not put on ``sys.path``: a run measures the package of the tree it runs in (its working
directory and ``PYTHONPATH``), whichever tree this script comes from."""

ROUTES = ("health", "predict", "v2-binary")


def requests(model: str, store: Path, folder: Path) -> dict[str, dict[str, Any]]:
    """Each route's method, path, headers and body file (written into ``folder``): one seeded sample of the model's
    first input, as :func:`common.sample_protocols` writes it for wrk."""
    import common  # here, not at the top: it puts this tree's server on sys.path, which a measured run must not

    routes: dict[str, dict[str, Any]] = {"health": {"method": "GET", "path": "/health", "headers": {}, "body": None}}
    for name, proto in common.sample_protocols(model, ["predict", "v2-binary"], folder, store).items():
        routes[name] = {"method": "POST", "path": proto.path, "headers": proto.headers, "body": str(proto.body)}
    return routes


async def _call(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-length", b"%d" % len(body)), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # the client stays connected
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


class _Load:
    """Callers of one route: each sends its next request when its answer arrives."""

    def __init__(self, app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.app, self.request = app, (method, path, headers, body)
        self.answered = self.failures = 0
        self.stop = False

    async def client(self) -> None:
        while not self.stop:
            status = await _call(self.app, *self.request)
            self.answered += 1
            if status != 200:
                self.failures += 1
            await asyncio.sleep(0)  # a route that never waits would otherwise never let the others run

    async def timed(self, seconds: float) -> tuple[int, float, float]:
        """Requests answered, loop CPU seconds and wall seconds over ``seconds``."""
        self.answered = 0
        cpu, wall = time.thread_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        return self.answered, time.thread_time() - cpu, time.perf_counter() - wall


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from halfserve.app import create_app
        from halfserve.settings import Settings
    except ModuleNotFoundError:  # a revision from before the package was renamed: its package is ``server``
        from server.app import create_app  # type: ignore[no-redef]
        from server.settings import Settings  # type: ignore[no-redef]

    settings = Settings(
        store=Path(args.store), models=[args.model], precision=args.precision, grpc=False, access_log=False
    )
    app = create_app(settings)
    routes = json.loads(Path(args.requests).read_text())
    results: dict[str, Any] = {}
    async with app.router.lifespan_context(app):
        for _ in range(600):
            if await _call(app, "GET", "/ready", [], b"") == 200:
                break
            await asyncio.sleep(0.1)
        else:
            raise SystemExit("the model did not become ready")
        for route in args.routes:
            r = routes[route]
            headers = [(k.lower().encode(), v.encode()) for k, v in r["headers"].items()]
            body = Path(r["body"]).read_bytes() if r["body"] else b""
            load = _Load(app, r["method"], r["path"], headers, body)
            tasks = [asyncio.create_task(load.client()) for _ in range(args.clients)]
            await load.timed(args.warmup)
            n, cpu, wall = await load.timed(args.seconds)
            load.stop = True
            await asyncio.gather(*tasks)
            if load.failures:
                raise SystemExit(f"{route}: {load.failures} requests failed")
            results[route] = {"requests": n, "loop_cpu_us": cpu / n * 1e6, "req_per_s": n / wall}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revs", default=".", help="comma-separated source trees, interleaved (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--model", default="digits_mlp")
    p.add_argument("--store", default=str(ROOT / "model_store"))
    p.add_argument("--precision", default="fp32")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--out", help="folder for app_cost.json and app_cost.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--requests", help=argparse.SUPPRESS)  # the child's: the routes' requests, as requests() writes
    args = p.parse_args()
    args.routes = args.routes.split(",")
    if args.child:
        print(json.dumps(asyncio.run(measure(args))))
        return
    import common  # the parent's only: a measured run imports its own tree's server

    revs = args.revs.split(",")
    runs: dict[str, list[dict[str, Any]]] = {rev: [] for rev in revs}
    tmp = Path(tempfile.mkdtemp(prefix="app-cost-"))
    trees: dict[str, Path] = {}
    try:
        routes = tmp / "requests.json"
        routes.write_text(json.dumps(requests(args.model, Path(args.store), tmp)))
        for i, rev in enumerate(revs):
            trees[rev], _ = common.checkout(rev, tmp / f"tree-{i}")
        child = [
            *("--routes", ",".join(args.routes), "--model", args.model, "--store", args.store),
            *("--precision", args.precision, "--clients", str(args.clients)),
            *("--seconds", str(args.seconds), "--warmup", str(args.warmup), "--requests", str(routes)),
        ]
        for r in range(args.rounds):
            for rev in revs:
                # This script in every run, so every rev is measured alike; the server is the rev's own (its tree is
                # the working directory and PYTHONPATH, and this script puts nothing ahead of them).
                out = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), *child, "--child"],
                    cwd=trees[rev],
                    env={**os.environ, "PYTHONPATH": common.source_path(trees[rev])},
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                result = json.loads(out.strip().splitlines()[-1])
                runs[rev].append(result)
                line = "  ".join(f"{k} {v['loop_cpu_us']:.1f} us ({v['req_per_s']:,.0f}/s)" for k, v in result.items())
                print(f"round {r + 1} {rev}: {line}", flush=True)
    finally:
        for tree in trees.values():
            common.remove_checkout(tree)
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, revs, runs)


def report(args: argparse.Namespace, revs: list[str], runs: dict[str, list[dict[str, Any]]]) -> None:
    from halfserve import hostinfo  # this tree's: main() imported common, which put it on sys.path

    host = hostinfo.describe()
    where = (
        f"{host['cpu']} ({host['cores']} cores, {host['cpu_capability']}, native bf16 {host['native_bf16']}), "
        f"{host['allocator']}, torch {host['torch']}, Python {host['python']}"
    )
    lines = [
        f"# Event-loop CPU per request, in process ({args.model}, {args.precision}, {args.clients} callers)",
        "",
        where,
        "",
        "| rev | " + " | ".join(f"{r} us (median, min-max)" for r in args.routes) + " |",
        "|---|" + "---:|" * len(args.routes),
    ]
    for rev in revs:
        cells = []
        for route in args.routes:
            xs = [run[route]["loop_cpu_us"] for run in runs[rev]]
            cells.append(f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})")
        lines.append(f"| {rev} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "app_cost.md").write_text(text)
        (out / "app_cost.json").write_text(json.dumps({"host": host, "args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
