"""What the benchmarks share: this tree's package on ``sys.path``, ImageNet's normalisation, wrk and its request
scripts, the server under test, and result files.

Imported as ``import common`` by every script in this folder (a script's own folder is on ``sys.path`` when it runs),
before anything from ``halfserve``: importing it puts the source root (``server/``) and the repository root first on
``sys.path``, and the source root first on the ``PYTHONPATH`` of the processes the scripts start, so the scripts and
their servers run the ``halfserve`` of this tree whether or not the project is installed. It is the only module here
that changes ``sys.path``. The tools in ``tools/`` run with this folder on ``PYTHONPATH`` (see README.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
"""The repository root."""
SRC = ROOT / "server"
"""The source root: the package ``halfserve`` is ``server/halfserve/``."""
sys.path[:0] = [str(SRC), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from halfserve.manifest import Normalize  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
"""Where committed results live."""

IMAGENET = Normalize(scale=1 / 255, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
"""ImageNet's normalisation of UINT8 RGB images, done by the server on the device."""

LUA = """
wrk.method = "POST"
{headers}local f = io.open(os.getenv("HALFSERVE_BODY"), "rb")
wrk.body = f:read("*a")
f:close()
"""

PROTOCOLS = ("predict", "v2-json", "v2-binary")
HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class Protocol:
    """One way of asking for an inference: the URL path, the request body and the wrk script that posts it."""

    name: str
    path: str
    body: Path
    script: Path
    headers: dict[str, str]
    """What the request sends beside Host and Content-Length: its Content-Type and any other header."""


WIRE_DTYPES = {"FP32": "<f4", "FP16": "<f2", "UINT8": "u1"}
"""numpy dtypes of the V2 datatypes a binary body may carry."""


def make_protocol(
    name: str, model: str, input_name: str, sample: np.ndarray, folder: Path, datatype: str = "FP32"
) -> Protocol:
    """Write the body and wrk script of protocol ``name`` for one sample into ``folder``.

    JSON bodies carry ``sample``'s (float64, rounded) values as written, V2 JSON declaring them ``datatype`` (FP32
    for the 16-bit floats JSON cannot carry); the binary body carries them as ``datatype``.
    """
    batch = [1, *sample.shape]
    extra: dict[str, str] = {}
    if name == "predict":
        path, content_type = "/predict", "application/json"
        body = json.dumps({"model": model, "inputs": [sample.tolist()]}).encode()
    elif name == "v2-json":
        path, content_type = f"/v2/models/{model}/infer", "application/json"
        declared = "FP32" if datatype in ("FP16", "BF16") else datatype  # an integer input takes no FP32 data
        tensor = {"name": input_name, "shape": batch, "datatype": declared, "data": sample.ravel().tolist()}
        body = json.dumps({"inputs": [tensor]}).encode()
    elif name == "v2-binary":
        path, content_type = f"/v2/models/{model}/infer", "application/octet-stream"
        raw = sample.astype(WIRE_DTYPES[datatype]).tobytes()
        tensor = {
            "name": input_name,
            "shape": batch,
            "datatype": datatype,
            "parameters": {"binary_data_size": len(raw)},
        }
        header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
        body = header + raw
        extra = {HEADER_LENGTH: str(len(header))}
    else:
        raise ValueError(f"unknown protocol {name!r} (known: {', '.join(PROTOCOLS)})")
    return write_protocol(name, path, body, {"Content-Type": content_type, **extra}, folder)


def sample_protocols(
    model: str, names: list[str], folder: Path, store: Path = ROOT / "model_store"
) -> dict[str, Protocol]:
    """The body and wrk script of each protocol in ``names`` (:func:`make_protocol`), written into ``folder``, for one
    seeded sample of ``model``'s first input: what the ceiling, the probes and the in-process cost post.

    Also run by the shell scripts, as ``python benchmarks/common.py MODEL FOLDER NAME...``.
    """
    spec = json.loads((store / model / "config.json").read_text())["inputs"][0]
    sample = np.random.default_rng(42).standard_normal(spec["shape"]).round(6).astype(np.float32)
    return {n: make_protocol(n, model, spec["name"], sample, folder, spec["datatype"]) for n in names}


def write_protocol(name: str, path: str, body: bytes, headers: dict[str, str], folder: Path) -> Protocol:
    """``body`` and the wrk script that posts it to ``path`` with ``headers``, written into ``folder``."""
    body_path = folder / f"{name}.body"
    body_path.write_bytes(body)
    script = folder / f"{name}.lua"
    lines = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in headers.items())
    script.write_text(LUA.format(headers=lines))
    return Protocol(name, path, body_path, script, headers)


def source_path(tree: Path) -> str:
    """The ``PYTHONPATH`` that imports ``tree``'s own package: its source root ``server/`` (``halfserve``), or the tree
    itself for a revision from before the package was renamed (a top-level ``server`` package)."""
    src = tree / "server"
    return os.pathsep.join([str(src), str(tree)]) if (src / "halfserve").is_dir() else str(tree)


def checkout(rev: str, folder: Path) -> tuple[Path, str]:
    """The source tree of ``rev`` (``.``: this one), in a git worktree at ``folder``, and its commit (with
    ``+changes`` for this tree when ``server/`` has uncommitted changes); :func:`remove_checkout` takes it away."""
    if rev == ".":
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "server"], cwd=ROOT, capture_output=True, text=True)
        return ROOT, head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(folder), rev], cwd=ROOT, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    return folder, commit.stdout.strip()


def remove_checkout(tree: Path) -> None:
    """Remove a worktree :func:`checkout` made (this tree stays)."""
    if tree != ROOT:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)


def parse_wrk(text: str) -> dict[str, float]:
    def ms(token: str) -> float:
        m = re.match(r"([\d.]+)(us|ms|s)", token)
        assert m, token
        v = float(m.group(1))
        return v / 1000 if m.group(2) == "us" else v if m.group(2) == "ms" else v * 1000

    lat = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", text, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", text).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    socket_errors = re.search(r"Socket errors: (.*)", text)
    return {
        "rps": rps,
        "requests": total,
        "non_2xx": int(errors.group(1)) if errors else 0,
        "socket_errors": socket_errors.group(1) if socket_errors else "",  # type: ignore[dict-item]
        "p50_ms": ms(lat["50"]),
        "p90_ms": ms(lat["90"]),
        "p99_ms": ms(lat["99"]),
    }


def wrk(
    url: str, connections: int, seconds: float, script: Path | None, body: Path | None, threads: int = 1
) -> dict[str, float]:
    cmd = [os.environ.get("WRK", "wrk"), f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency"]
    cmd += ["--timeout", "10s"]
    if script is not None:
        cmd += ["-s", str(script)]
    env = {**os.environ, "HALFSERVE_BODY": str(body or "")}
    text = subprocess.run([*cmd, url], capture_output=True, text=True, check=True, env=env).stdout
    return parse_wrk(text)


def start_server(
    store_dir: Path, model: str, port: int, *args: str, source: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``halfserve serve`` of the tree at ``source`` (python -m puts it first on the path), with ``env`` added to
    this process's environment, once it answers ready."""
    cmd = [
        sys.executable,
        "-m",
        "halfserve",
        "serve",
        "--store",
        str(store_dir),
        "--models",
        model,
        "--port",
        str(port),
    ]
    full_env = {**os.environ, **(env or {})}
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen([*cmd, *args], stdout=quiet, stderr=quiet, cwd=source, env=full_env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, 120)
    except RuntimeError:
        proc.kill()
        raise
    return proc


def wait_ready(
    url: str, proc: subprocess.Popen[Any], timeout: float, interval: float = 0.1, log: Path | None = None
) -> float:
    """Wait until ``url`` answers 200 while ``proc`` (the server that serves it) runs; the seconds it took.

    Raises RuntimeError when ``proc`` exits first or ``timeout`` seconds pass, with the last lines of ``log`` (the
    server's output) where one is given. The caller stops ``proc``.
    """
    began = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{_name(proc)} exited with {proc.returncode} before {url} answered{_tail(log)}")
        if time.perf_counter() - began > timeout:
            raise RuntimeError(f"{_name(proc)}: {url} did not answer 200 within {timeout:g} s{_tail(log)}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.perf_counter() - began
        except httpx.TransportError:
            pass
        time.sleep(interval)


def _name(proc: subprocess.Popen[Any]) -> str:
    args = proc.args
    return str(args[0] if isinstance(args, list | tuple) else args)


def _tail(log: Path | None) -> str:
    return f"; {log}:\n{log.read_text(errors='replace')[-3000:]}" if log is not None and log.exists() else ""


def stats(port: int, model: str) -> dict[str, float]:
    s = httpx.get(f"http://127.0.0.1:{port}/models/{model}/stats").json()
    return {"rows": s["rows"], "batches": s["batches"]}


def write_results(prefix: Path, result: object, md: str) -> None:
    """``result`` as ``<prefix>.json`` and its table as ``<prefix>.md``."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    prefix.with_suffix(".md").write_text(md + "\n")


if __name__ == "__main__":
    sample_protocols(sys.argv[1], sys.argv[3:], Path(sys.argv[2]))


def emit(name: str, result: object) -> None:
    """A probe's ``result`` printed as JSON, and written to ``$OUT/<name>.json`` where ``OUT`` is set."""
    text = json.dumps(result, indent=2)
    print(text)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(text + "\n")
