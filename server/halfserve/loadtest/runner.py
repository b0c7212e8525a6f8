"""The sweep: for each precision (or the one a running server serves), every concurrency level, measured alike.

Per level: optional warm-up at that concurrency (not measured), the server's ``/models/{m}/stats`` and CPU time
before, the level itself (by duration or by request count), the same after. The client's own ceiling (``GET
/health`` at the top concurrency) is measured once, against the first server.
"""

from __future__ import annotations

import asyncio
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import grpc
import httpx
import numpy as np

from halfserve.loadtest import LoadtestError
from halfserve.loadtest.client import LoadClient
from halfserve.loadtest.config import LoadtestConfig
from halfserve.loadtest.payload import (
    HEALTH,
    Protocol,
    RequestTemplate,
    Signature,
    build_template,
    check_signature,
    load_samples,
    random_sample_count,
    random_samples,
    served_precision,
)
from halfserve.loadtest.process import ManagedServer, process_cpu_seconds
from halfserve.loadtest.stats import LevelResult, ServerDelta, summarize, throughput_ratios
from halfserve.loadtest.target import check_url, grpc_target
from halfserve.loadtest.worker import MAX_ANSWER_BYTES
from halfserve.storage import MANIFEST, StoreError, check_name
from halfserve.version import __version__

if TYPE_CHECKING:
    from halfserve.loadtest.progress import SweepProgress


@dataclass
class ServerRun:
    """One server swept: how it was reached (started here or given by --url) and what it served."""

    precision: str
    served_precision: str | None
    url: str
    device: str | None
    started: bool
    ready_seconds: float | None = None
    warmup_seconds: float | None = None
    log: str | None = None
    command: list[str] | None = None
    grpc_target: str | None = None
    """``host:port`` of its gRPC service, for ``--protocol grpc``."""


@dataclass
class Sweep:
    """Everything measured by one load test run."""

    config: LoadtestConfig
    model: str = ""
    signature: Signature | None = None
    input_description: str = ""
    client_loop: str = ""
    client_ceiling: LevelResult | None = None
    servers: list[ServerRun] = field(default_factory=list)
    results: list[LevelResult] = field(default_factory=list)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    seconds: float = 0.0
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def finish(self) -> None:
        """Compute what depends on every level (the half/fp32 ratios) and the run's duration."""
        self.ratios = throughput_ratios(self.results)
        self.seconds = time.monotonic() - self._t0

    def machine(self) -> dict[str, Any]:
        from halfserve import hostinfo  # imports torch: only when the results are written

        return {
            **hostinfo.describe(),
            "platform": platform.platform(),
            "halfserve": __version__,
            "httpx": httpx.__version__,
            "client_event_loop": self.client_loop,
            "client_processes": self.config.client_processes,
        }


def _listing(http: httpx.Client, wanted: str | None) -> dict[str, Any]:
    """The ``GET /models`` entry of the model to load-test (the only one served when none is named)."""
    response = _get(http, "/models")
    if response.status_code != 200:
        raise LoadtestError(f"GET {http.base_url}/models answered {response.status_code}: {_shown(response.text)}")
    try:
        models = {str(m["name"]): m for m in response.json()["models"]}
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise LoadtestError(
            f"GET {http.base_url}/models: not a model listing ({type(e).__name__}: {_shown(e)})"
        ) from None
    if wanted is None:
        if len(models) != 1:
            raise LoadtestError(f"the server serves {len(models)} models ({_names(models)}); name one with --model")
        wanted = next(iter(models))
    if wanted not in models:
        raise LoadtestError(f"the server does not serve {wanted!r} (it serves: {_names(models) or 'nothing'})")
    try:
        # The name goes into every request's path: one the server could not have been given (``/``, ``..``,
        # control characters) would send the load elsewhere.
        check_name(wanted)
    except StoreError as e:
        raise LoadtestError(f"GET {http.base_url}/models: {e}") from None
    entry = models[wanted]
    if not isinstance(entry, dict):
        raise LoadtestError(f"GET {http.base_url}/models: the entry of {wanted!r} is not an object")
    if entry.get("state") != "ready":
        state, error = _shown(entry.get("state")), _shown(entry.get("error") or "not ready")
        raise LoadtestError(f"model {wanted!r} is {state}: {error}")
    return dict(entry)


def _shown(value: object, limit: int = 300) -> str:
    """What a server said, cut to ``limit`` characters and quoted where it holds a control character, so that an
    answer cannot write over the terminal's lines."""
    text = str(value)[:limit]
    return text if text.isprintable() else repr(text)


def _text(entry: dict[str, Any], key: str, where: str) -> str | None:
    """A listed field the run records and prints (device, version, precision): null, or a string or number, cut and
    quoted as :func:`_shown` does. Anything else is refused: an array nested near the parser's depth passes the
    parse and then crashed the report, whose copy of the sweep recurses into it."""
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise LoadtestError(f"{where}: {key} is {_json_type(value)}, expected a string or a number")
    return _shown(value, 40)


def _seconds(entry: dict[str, Any], key: str, where: str) -> float | None:
    """A listed duration the run records (``warmup_seconds``): null or a number; anything else is refused, as
    :func:`_text` refuses."""
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LoadtestError(f"{where}: {key} is {_json_type(value)}, expected a number")
    return float(value)


def _json_type(value: object) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return "a string" if isinstance(value, str) else "a number"


def _names(models: dict[str, Any], limit: int = 10) -> str:
    names = [repr(name) for name in list(models)[:limit]]
    return ", ".join(names) + (f" and {len(models) - limit} more" if len(models) > limit else "")


def _get(http: httpx.Client, path: str) -> httpx.Response:
    try:
        return _bounded(http, "GET", path)
    except httpx.TransportError as e:
        raise LoadtestError(f"GET {http.base_url}{path}: lost the server ({type(e).__name__}: {e})") from None


_BODY_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})
"""Headers about the answer's body as it travelled, not as it was read: dropped from the bounded copy."""


def _bounded(http: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """The answer, read whole within ``http``'s read timeout, from sending to the last byte (httpx bounds only each
    wait for a byte, so a server trickling its head or body would hold the run), and to at most
    :data:`MAX_ANSWER_BYTES`: a slow or hostile server fails the run instead of holding it."""
    seconds = http.timeout.read or 30.0
    try:
        # Cancelling the request's task at the deadline ends it wherever it waits, in the head as in the body, and
        # closes its connection: a thread blocked in a read could not be stopped that way.
        return asyncio.run(asyncio.wait_for(_read_whole(http, method, path, **kwargs), seconds))
    except TimeoutError:
        raise LoadtestError(f"{method} {http.base_url}{path}: no whole answer within {seconds:g} s") from None


async def _read_whole(http: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    body = bytearray()
    async with (
        httpx.AsyncClient(base_url=http.base_url, timeout=http.timeout) as client,
        client.stream(method, path, **kwargs) as response,
    ):
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_ANSWER_BYTES:
                raise LoadtestError(f"{method} {http.base_url}{path}: answer over {MAX_ANSWER_BYTES} bytes")
    headers = [(k, v) for k, v in response.headers.items() if k.lower() not in _BODY_HEADERS]
    return httpx.Response(response.status_code, headers=headers, content=bytes(body), request=response.request)


def _stats(http: httpx.Client, model: str) -> tuple[int, int]:
    response = _get(http, f"/models/{model}/stats")
    if response.status_code != 200:
        raise LoadtestError(f"GET /models/{model}/stats answered {response.status_code}: {_shown(response.text)}")
    try:
        stats = response.json()
        return int(stats["rows"]), int(stats["batches"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise LoadtestError(
            f"GET /models/{model}/stats: not the model's counts ({type(e).__name__}: {_shown(e)})"
        ) from None


def _probe(http: httpx.Client, template: RequestTemplate, protocol: Protocol) -> str | None:
    """Send one request before the load: a wrong input or a missing route fails here, with the server's answer."""
    if template.grpc_target is not None:
        return _probe_grpc(template, http.timeout.read or 30.0)
    try:
        response = _bounded(http, template.method, template.path, content=template.bodies[0], headers=template.headers)
    except httpx.TransportError as e:
        raise LoadtestError(f"{template.method} {http.base_url}{template.path}: {type(e).__name__}: {e}") from None
    if response.status_code == 404 and protocol is not Protocol.PREDICT and "/v2/" in template.path:
        raise LoadtestError(
            f"POST {template.path} answered 404: the server has no V2 inference route, or not this model "
            f"({_shown(response.text, 200)}); use --protocol predict"
        )
    if response.status_code != 200:
        raise LoadtestError(
            f"a first {template.method} {template.path} answered {response.status_code}: {_shown(response.text)}"
        )
    return served_precision(protocol, response.content, dict(response.headers))


def _probe_grpc(template: RequestTemplate, timeout: float) -> str | None:
    assert template.grpc_target is not None
    options = [("grpc.max_receive_message_length", MAX_ANSWER_BYTES)]
    with grpc.insecure_channel(template.grpc_target, options=options) as channel:
        try:
            answer = channel.unary_unary(template.path)(template.bodies[0], timeout=timeout)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            raise LoadtestError(
                f"a first gRPC ModelInfer to {template.grpc_target} answered {code}: {_shown(details)}"
            ) from None
    return served_precision(Protocol.GRPC, answer, {})


class Runner:
    """Runs a :class:`LoadtestConfig` and collects a :class:`Sweep`."""

    def __init__(self, config: LoadtestConfig, progress: SweepProgress) -> None:
        self.config = config
        self.progress = progress
        self.sweep = Sweep(config)
        self._samples: np.ndarray | None = None

    def run(self) -> Sweep:
        cfg = self.config
        if cfg.url is not None:
            base = check_url(cfg.url, allow_remote=cfg.allow_remote)
            run = ServerRun(precision="", served_precision=None, url=base, device=None, started=False)
            if cfg.protocol is Protocol.GRPC:
                run.grpc_target = grpc_target(cfg.grpc_url, base, cfg.allow_remote)
            self._sweep_server(run)
        else:
            if not (cfg.store / str(cfg.model) / MANIFEST).is_file():
                raise LoadtestError(f"--store {cfg.store}: no model {cfg.model!r} (no {cfg.model}/{MANIFEST} there)")
            cfg.out.mkdir(parents=True, exist_ok=True)
            for precision in cfg.precisions:
                self._sweep_started(precision)
        self.sweep.finish()
        return self.sweep

    def _sweep_started(self, precision: str) -> None:
        cfg = self.config
        assert cfg.model is not None
        log = cfg.out / f"server-{precision}.log"
        self.progress.note(f"starting halfserve serve --models {cfg.model} --precision {precision} (log: {log})")
        # The rows each request will carry, unless the load test's own server arguments say otherwise (the last wins):
        # by default a request may carry no more than one of the model's batches.
        rows = ("--max-request-rows", str(cfg.rows_per_request)) if cfg.rows_per_request > 1 else ()
        grpc_on = cfg.protocol is Protocol.GRPC
        with ManagedServer(
            cfg.store, cfg.model, precision, log, device=cfg.device, extra_args=(*rows, *cfg.server_args), grpc=grpc_on
        ) as server:
            ready = server.wait_ready()
            run = ServerRun(
                precision=precision,
                served_precision=None,
                url=server.url,
                device=None,
                started=True,
                ready_seconds=round(ready, 2),
                log=str(log),
                command=server.command,
                grpc_target=server.grpc_target,
            )
            self._sweep_server(run, pid=server.pid)

    def _samples_for(self, sig: Signature) -> np.ndarray:
        """The samples every server gets: read or generated once, so that each precision sees the same data."""
        cfg = self.config
        if self._samples is None:
            if cfg.input_file is not None:
                self._samples = load_samples(cfg.input_file, sig)
                self.sweep.input_description = f"{len(self._samples)} samples from {cfg.input_file}"
            else:
                count = random_sample_count(sig, cfg.rows_per_request)
                self._samples = random_samples(sig, count, cfg.seed)
                kind = "integers 0..9" if sig.is_integer else "uniform [0, 1)"
                self.sweep.input_description = f"{count} random samples, {kind}, seed {cfg.seed}"
        return self._samples

    def _sweep_server(self, run: ServerRun, pid: int | None = None) -> None:
        cfg = self.config
        with httpx.Client(base_url=run.url, timeout=cfg.timeout) as http:
            entry = _listing(http, cfg.model)
            model = str(entry["name"])
            where = f"GET {http.base_url}/models: the entry of {model!r}"
            version, listed_precision = _text(entry, "version", where), _text(entry, "precision", where)
            run.device = _text(entry, "device", where)
            run.warmup_seconds = _seconds(entry, "warmup_seconds", where)
            sig = Signature.from_listing(entry)
            check_signature(model, sig, cfg.rows_per_request)
            if self.sweep.signature is not None and sig != self.sweep.signature:
                raise LoadtestError(f"model {model!r} changed its input signature between servers")
            self.sweep.model, self.sweep.signature = model, sig
            samples = self._samples_for(sig)
            template = build_template(
                cfg.protocol, model, sig, samples, cfg.rows_per_request, grpc_target=run.grpc_target
            )
            # The precision labels each level in the report and on the terminal: quoted like the listed fields.
            served = _probe(http, template, cfg.protocol)
            run.served_precision = _shown(served, 40) if served else listed_precision
            run.precision = run.precision or run.served_precision or "unknown"
            self.sweep.servers.append(run)
            self.progress.note(
                f"{run.url}: {model} v{version} on {run.device} in {run.served_precision}, "
                f"{cfg.protocol} with {cfg.rows_per_request} row(s) per request"
            )
            with LoadClient(run.url, processes=cfg.client_processes, timeout=cfg.timeout, loop=cfg.loop) as client:
                self.sweep.client_loop = client.loop
                client.add_template("infer", template)
                if cfg.client_ceiling > 0 and self.sweep.client_ceiling is None:
                    self._measure_ceiling(client, run, pid)
                for c in cfg.concurrency:
                    self.sweep.results.append(self._level(client, http, run, model, c, pid))

    def _measure_ceiling(self, client: LoadClient, run: ServerRun, pid: int | None) -> None:
        top = max(self.config.concurrency)
        client.add_template("health", HEALTH)
        client.run("health", top, duration=min(1.0, self.config.client_ceiling))
        cpu0 = process_cpu_seconds(pid) if pid is not None else None
        sample = client.run("health", top, duration=self.config.client_ceiling)
        cpu1 = process_cpu_seconds(pid) if pid is not None else None
        server_cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        ceiling = summarize(
            sample,
            precision=run.precision,
            served_precision=None,
            protocol="GET /health",
            concurrency=top,
            rows_per_request=0,
            server=ServerDelta(rows=0, batches=0, cpu_s=server_cpu),
        )
        self.sweep.client_ceiling = ceiling
        self.progress.note(
            f"client ceiling (GET /health, {top} users, {self.config.client_processes} client process(es)): "
            f"{ceiling.req_per_s:,.0f} req/s at {ceiling.client_cpu_percent:.0f}% client CPU, "
            f"{ceiling.client_cpu_us_per_request or 0:.0f} us client CPU per request"
        )

    def _level(
        self, client: LoadClient, http: httpx.Client, run: ServerRun, model: str, c: int, pid: int | None
    ) -> LevelResult:
        cfg = self.config
        if cfg.warmup > 0:
            client.run("infer", c, duration=cfg.warmup)
        rows0, batches0 = _stats(http, model)
        cpu0 = process_cpu_seconds(pid) if pid is not None else None
        self.progress.start_level(f"{run.precision} c={c}", duration=cfg.duration, requests=cfg.requests)
        sample = client.run("infer", c, duration=cfg.duration, requests=cfg.requests, on_progress=self.progress.update)
        cpu1 = process_cpu_seconds(pid) if pid is not None else None
        rows1, batches1 = _stats(http, model)
        server_cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        ceiling = self.sweep.client_ceiling
        result = summarize(
            sample,
            precision=run.precision,
            served_precision=run.served_precision,
            protocol=str(cfg.protocol),
            concurrency=c,
            rows_per_request=cfg.rows_per_request,
            server=ServerDelta(rows=rows1 - rows0, batches=batches1 - batches0, cpu_s=server_cpu),
            client_ceiling_rps=ceiling.req_per_s if ceiling is not None else None,
        )
        self.progress.finish_level(result)
        return result
