"""Server settings: ``HALFSERVE_*`` environment variables and ``halfserve serve`` flags map onto the same fields."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from halfserve.execution import Isolation
from halfserve.manifest import Precision
from halfserve.placement import PlacementSetting

MIN_ADMIN_TOKEN = 16
"""Shortest admin token accepted."""
MAX_IMAGE_PIXELS = 25_000_000
"""The default ``max_image_pixels``: a request's photos are held to it, and ``halfserve import``'s calibration photos
by default too (``--max-image-pixels``)."""
MOST_IMAGE_PIXELS = 89_478_485
"""The highest pixel limit either takes: Pillow's ``Image.MAX_IMAGE_PIXELS``, past which Pillow warns of a
decompression bomb (and refuses past twice it), so that the limit, not Pillow's guard, is what bounds a photo."""


class LogLevel(str, Enum):
    """The least severe log lines written."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(str, Enum):
    """How log lines are written."""

    TEXT = "text"
    """``time level logger: message``, for people."""
    JSON = "json"
    """One JSON object per line, with the request id and other fields as keys, for log collectors."""


class FidelityCheck(str, Enum):
    """Whether the models served in a half precision are held to a fidelity bar at load (:mod:`halfserve.fidelity`)."""

    DEFAULT = "default"
    """Each is held to its manifest's bar (the default bar where it sets none): measured against fp32 at load, or
    taken from its version's precision record where that was measured under the load's conditions
    (:mod:`halfserve.precision_record`)."""
    OFF = "off"
    """None is measured: each is served in the half precision asked for, whatever its manifest's bar."""
    MEASURE = "measure"
    """As ``default``, but measured at every load even where the version's precision record matches the load."""


class LiveFidelityAction(str, Enum):
    """What live fidelity does when a model's window falls below its fidelity bar."""

    DEMOTE = "demote"
    """Serve the model in fp32 from then on, the reason in ``/models``, the log and the metrics."""
    ALERT = "alert"
    """Log a WARNING and count it in the metrics; the model keeps its precision."""


MAX_THREADS = 1024
"""Most torch intra-op threads ``threads`` may ask for: more than any host's cores; 100,000 had exhausted the host's
processes (forks failed machine-wide) before the server aborted."""
MAX_TOKEN_FILE_BYTES = 4096
"""Most bytes ``admin_token_file`` may hold: a token is tens of characters, and a file past this (``/dev/zero``, a
log named by mistake) is refused rather than read into memory."""


def _token_file(path: Path) -> str:
    """The token ``path`` holds: one line, surrounding whitespace dropped; a file that is not a regular file (a FIFO
    would block the start), larger than :data:`MAX_TOKEN_FILE_BYTES`, or not UTF-8 is refused, naming it."""
    where = f"admin_token_file: {path}"
    try:
        if path.exists() and not path.is_file():
            raise ValueError(f"{where}: not a regular file")
        with path.open("rb") as f:
            data = f.read(MAX_TOKEN_FILE_BYTES + 1)
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise ValueError(f"{where}: more than {MAX_TOKEN_FILE_BYTES} bytes; expected one line, the token")
        return data.decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"admin_token_file: cannot read {path}: {e}") from None


def _check_token(token: str) -> None:
    """A token a client can send as ``Authorization: Bearer <token>``, long enough not to be guessed."""
    if len(token) < MIN_ADMIN_TOKEN:
        raise ValueError(
            f"admin_token: at least {MIN_ADMIN_TOKEN} characters (a guessable token is no protection); "
            "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        # A second line in a token file had been taken into the token, which no client can send: every call a 401.
        raise ValueError(
            "admin_token: printable ASCII without spaces or line breaks, as a bearer token is sent (a token file "
            "holds one line)"
        )


class Settings(BaseSettings):
    """Everything the server reads at start-up. Per-model settings live in each model's manifest."""

    # Inputs are left out of errors: a refused admin token had been printed in the refusal ("input_value=...").
    model_config = SettingsConfigDict(
        env_prefix="HALFSERVE_", extra="forbid", use_attribute_docstrings=True, hide_input_in_errors=True
    )
    # Each field's docstring is its description: the first sentence is its ``halfserve serve --help`` line
    # (halfserve.cli builds the flags from these fields), the rest its documentation.

    store: Path = Path("model_store")
    """The model store folder."""
    code_path: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    """Folders put on the import path at start-up, after the installed packages, for ``package.module:factory``
    architectures (``os.pathsep``-separated in the environment, like ``PYTHONPATH``)."""
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Serve only these models (comma-separated in the environment); empty serves every model in the store."""
    host: str = "127.0.0.1"
    """The address to bind."""
    port: int = Field(default=8000, ge=0, le=65535)
    """The HTTP port."""
    grpc: bool = True
    """Serve the KServe V2 protocol over gRPC too (``inference.GRPCInferenceService`` and ``grpc.health.v1``), on
    ``host``:``grpc_port``."""
    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """The gRPC port (Triton's default, 8001)."""
    torchserve_management_port: int | None = Field(default=None, ge=1, le=65535)
    """Serve TorchServe's management API, its read side (``GET /models``, ``GET /models/{name}``), on
    ``host``:this port, as TorchServe's 8081; off by default. Answered by the process that holds the models (with
    ``http_workers``, the engine process), under the same connection limits and ``Host`` checks as the main port."""
    grpc_max_streams: int = Field(default=1024, ge=1, le=65536)
    """Calls (HTTP/2 streams) one gRPC connection may have open at once; the server advertises it, and a client that
    opens more has them refused by the protocol (``SETTINGS_MAX_CONCURRENT_STREAMS``). A client near the limit has
    calls refused even where it keeps to it (a stream it sees closed still counts here for a moment): with 32, 200
    calls at once on one channel lost 40-80%. So it is far above what a load generator opens on one channel (as
    ``max_connections``); what the calls hold is bounded by ``grpc_pending_bytes`` and ``max_connections``."""
    grpc_idle_timeout: float = Field(default=60.0, gt=0.0, le=86400.0)
    """Seconds a ``ModelStreamInfer`` stream may wait for its next request. A gRPC connection with no call in progress
    is closed (``GOAWAY``; clients reconnect on their next call) after ``header_timeout``, or this if shorter: an idle
    connection holds one of ``max_connections``."""
    grpc_pending_bytes: int = Field(default=256 * 2**20, ge=2**20)
    """Bytes that gRPC calls still receiving their request message may hold in all. Each such call is counted at the
    largest message the server accepts (the models' largest request, at most ``max_body_bytes``); a call past the
    budget is refused (``RESOURCE_EXHAUSTED``) before its message is read."""
    grpc_peer_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """The share of ``grpc_pending_bytes``' calls (at least one) that calls from one client address may hold, so one
    client cannot take them all; a client behind a proxy shares its address with the proxy's other clients."""
    grpc_peer_connections: int = Field(default=128, ge=1)
    """gRPC connections one client address may hold; its newest past this are closed within half a second (on Linux),
    so one client cannot hold every one of ``max_connections``."""
    grpc_receive_grace: float = Field(default=2.0, gt=0.0, le=3600.0)
    """Seconds a gRPC call, or a stream between requests, waits for its request message before its share of
    ``grpc_pending_bytes`` may go to a call that needs it (the waiting one then ends, ``DEADLINE_EXCEEDED``): a
    client's message comes with its call, so a silent call holds its share only while no one else needs it."""
    grpc_compression: bool = False
    """Accept gzip- and deflate-compressed gRPC messages. Off: refused (``UNIMPLEMENTED``), as no ratio can be
    checked (the gRPC runtime inflates a message before the server sees it) and zeros compress a thousandfold. On: a
    message still inflates to no more than the largest message the server accepts."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``."""
    precision: Precision | None = None
    """Override every manifest's precision; ``fp32`` is the fallback switch. A half precision named here is still held
    to each model's fidelity bar (``fidelity_bar``)."""
    fidelity_bar: FidelityCheck = FidelityCheck.DEFAULT
    """``default``: every model served in a half precision is held to its fidelity bar at load, measured against fp32
    unless its version's precision record matches the load, and one below its bar is served with a mixed-precision
    plan or in fp32 instead; ``measure``: as ``default``, but measured at every load whatever the record; ``off``: no
    model is measured, each is served in the precision asked for."""
    mixed_search_seconds: float = Field(default=120.0, ge=0.0, le=3600.0)
    """How long a load may search for a mixed-precision plan (:mod:`halfserve.mixed`: the fewest modules kept in fp32
    so a model below its fidelity bar in half precision meets it) before serving the whole model in fp32, and a live
    fidelity demotion may search one on live rows; 0: no search, a model below its bar is served in fp32 as it is."""
    live_fidelity_rate: float = Field(default=0.001, ge=0.0, le=1.0)
    """Share of the rows answered in a half precision that are rerun in fp32 off the request path and compared (live
    fidelity, :mod:`halfserve.livefidelity`), after each newly served half precision's first ``live_fidelity_min_rows``
    rows, which are all (its probation); 0 turns it off. Models whose fidelity is not checked are not sampled."""
    live_fidelity_cpu_share: float = Field(default=0.1, gt=0.0, le=1.0)
    """Share of one CPU core the fp32 reruns of live fidelity may take: after each rerun the worker waits in
    proportion to the rerun's time."""
    live_fidelity_window: int = Field(default=1000, ge=1, le=1_000_000)
    """Rows compared per model that live fidelity's figures are taken over (the last ones)."""
    live_fidelity_min_rows: int = Field(default=100, ge=1)
    """Rows the window must hold before its figures can demote a model (or alert), so a few odd rows cannot; a newly
    served half precision's first this many rows are all compared (its probation)."""
    live_fidelity_action: LiveFidelityAction = LiveFidelityAction.DEMOTE
    """What a window below the model's fidelity bar does: ``demote`` serves the model in fp32 from then on (until it
    is reloaded or the operator switches its precision); ``alert`` logs a WARNING and counts it in the metrics."""
    max_batch_size: int | None = Field(default=None, ge=1, le=8192)
    """Override every manifest's ``batching.max_batch_size``."""
    max_delay_ms: float | None = Field(default=None, ge=0.0, le=10_000.0)
    """Override every manifest's ``batching.max_delay_ms``."""
    max_queue_rows: int | None = Field(default=None, ge=1)
    """Override every manifest's ``batching.max_queue_rows``: rows queued beyond it are answered 503."""
    adaptive_delay: bool | None = None
    """Override every manifest's ``batching.adaptive_delay``."""
    request_timeout_ms: float | None = Field(default=None, gt=0.0, le=3_600_000.0)
    """Override every manifest's ``request_timeout_ms``: a request whose rows have not all started by then gets 504."""
    max_body_bytes: int = Field(default=64 * 2**20, ge=1024)
    """Largest request body accepted; a larger one gets 413 before it is read."""
    max_request_rows: int | None = Field(default=None, ge=1)
    """Most rows (samples) one inference request may carry (never more than a model's ``max_queue_rows``); unset: a
    model's ``max_batch_size``, as Triton holds a request's batch to it, so no request costs more than one batch."""
    max_request_elements: int = Field(default=2**24, ge=1)
    """Most input values one inference request may carry (rows times the per-sample size)."""
    max_compression_ratio: float = Field(default=100.0, ge=1.0)
    """How many times its own size a gzip or deflate body may inflate to (past the first MiB, which any body may
    fill): tensors of zeros compress a thousandfold, and would cost that much more compute than their bytes."""
    max_json_values: int = Field(default=2**19, ge=1024)
    """Most values and containers a JSON body may hold (its commas, ``[`` and ``{``), counted before it is parsed:
    parsing builds a Python object per value, so a small body of ``[],[],...`` costs seconds and gigabytes. Larger
    tensors travel as binary data (the binary tensor extension, or raw)."""
    max_text_bytes: int = Field(default=2**20, ge=1)
    """Most UTF-8 bytes of text one request to a text model may carry, all its rows together (each text is also held
    to its manifest's ``text.max_bytes``): what bounds the time one request keeps a tokenizing thread."""
    max_image_pixels: int = Field(default=MAX_IMAGE_PIXELS, ge=1, le=MOST_IMAGE_PIXELS)
    """Most pixels (width times height, read from its header before decoding) one image sent to an image model may
    have; more is a 413. At most Pillow's own decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``)."""
    max_request_images: int = Field(default=16, ge=1)
    """Most images one request to an image model may carry (each is also a row, held to ``max_request_rows``)."""
    max_shm_regions: int = Field(default=256, ge=1, le=65536)
    """Most system shared memory regions registered at once; one more is refused (413) until one is unregistered.
    Each region keeps a file descriptor open in the engine process and in each front-end, and a process out of
    descriptors drops new connections: the server raises its soft open-file limit to the hard one at start and warns
    when that cannot hold the connections and regions together (:mod:`halfserve.openfiles`). Triton's clients
    register a region or two per tensor they hand over (tritonclient's examples two per client process,
    perf_analyzer one per input and output), so 256 is dozens of client processes on the host."""
    handler_queue_bytes: int = Field(default=256 * 2**20, ge=2**20)
    """Bytes of payloads that the requests to one handler model (its manifest's ``handler`` section) may hold while
    they are queued or in a batch running, in each process that answers them: a request past it is refused 503 (413
    where it alone is larger), as a full queue is."""
    header_timeout: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Seconds a connection may take to send a request's line and headers, from when it opens or the request's first
    byte arrives; then 408 and the connection is closed (an idle or trickling connection holds a socket)."""
    body_timeout: float = Field(default=30.0, gt=0.0, le=3600.0)
    """Seconds a request body may go without a byte arriving; then 408 and the connection is closed. On the gRPC
    port, the seconds a call's request message may take to arrive whole, from the call's start
    (``DEADLINE_EXCEEDED``)."""
    min_body_rate: int = Field(default=16384, ge=1)
    """Bytes per second a request body must arrive at, on average, once its first ``body_timeout`` seconds are over
    (a body must be whole within ``body_timeout`` plus its size over this rate); then 408 and the connection is closed.
    The gap of ``body_timeout`` alone is no bound: a byte every 20 s would hold a connection for ever."""
    http_pending_bytes: int = Field(default=256 * 2**20, ge=2**20)
    """Bytes that HTTP request bodies still arriving may hold in all, in each process that reads them (the server, or
    each of ``http_workers``), counted as they arrive. Past it, the slowest body arriving for 0.5 s or more gives its
    bytes up (503) to one that needs them, or, where none is that slow, the body asking is refused (503)."""
    http_peer_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """The share of ``http_pending_bytes`` that the bodies of one client address may hold (429 past it), so one client
    cannot take it all; a client behind a proxy shares its address with the proxy's other clients."""
    send_timeout: float = Field(default=30.0, gt=0.0, le=3600.0)
    """Seconds what the server has to send on a connection may wait for the client to read it (its answers past the
    socket's buffers, or the rest of a closed connection's); then the connection is dropped. A client that pipelines
    requests and reads no answer would otherwise hold its connection for ever."""
    max_url_bytes: int = Field(default=8192, ge=256)
    """Longest request target (path and query); a longer one gets 414 before it is read whole."""
    max_header_bytes: int = Field(default=65536, ge=1024)
    """Most bytes of header names and values in one request; more gets 431 before they are read whole."""
    max_connections: int = Field(default=1024, ge=1)
    """Open HTTP connections per process; one more is answered 503 and closed, except that 32 more are read for a
    health or readiness probe, which is answered (so a cap held by slow clients does not fail the probes). The gRPC
    port takes as many connections (one more is closed at once), and runs as many inference calls at once (one more is
    ``RESOURCE_EXHAUSTED``)."""
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Names the ``Host`` header may carry besides IP addresses, ``localhost`` (and ``*.localhost``) and ``host``
    (``api.example.com``, ``*.example.com``; comma-separated in the environment); any other name is a 400, so a name
    rebound to this server's address (DNS rebinding) reads nothing. ``*``: any name. Health and readiness probes answer
    whatever the Host."""
    drain_timeout: float = Field(default=30.0, ge=0.0, le=3600.0)
    """Seconds from a shutdown signal to exit: requests in flight get this long, then are cancelled (503)."""
    tf32: bool = False
    """Let fp32 matmuls and cuDNN convolutions use TF32 on Ampere and newer GPUs. Off (the default), fp32 is IEEE fp32
    everywhere, so the fp32 fallback and fp32 benchmarks are the real thing; torch's own default lets cuDNN use TF32."""
    http_workers: int = Field(default=1, ge=1, le=64)
    """HTTP front-end processes. Above 1, that many processes accept connections and decode and encode requests,
    and this one runs the engines and batches their requests together (see :mod:`halfserve.multiproc`)."""
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    """torch intra-op threads. Unset: on a CPU, each model's engine times a forward of a full batch at warm-up and
    takes every core this process may run on, or every core but one where that forward is shorter than the event
    loop's work on the batch's requests (:func:`halfserve.placement.intra_op_threads`): on 2 cores the benchmark MLP
    answered 13-15% more requests on one thread, while a convolutional model lost a third of its throughput on one."""
    forward_seconds: float | None = Field(default=None, gt=0.0)
    """Seconds a CPU model's forward of a full batch takes, for ``threads`` and ``placement`` to be decided from
    instead of timing one at warm-up: the same choices on every start,
    whatever else the host runs meanwhile (every model, at any thread count). Unset: timed at warm-up."""
    placement: PlacementSetting = PlacementSetting.AUTO
    """Where every model's batches run (:class:`halfserve.placement.Placement`): ``auto`` (chosen per model at its
    load), ``instance_threads`` (each batch on an idle instance's thread), ``event_loop`` (on the event loop's own
    thread: a CPU model with one instance),
    ``beside_loop`` (a CPU model's forward as a traced TorchScript graph in torch's inter-op pool, launched from the
    event loop and run beside it without the GIL, two batches of up to half ``max_batch_size`` in flight: one instance
    and one input, not with padding, ``inductor`` or autocast, and a model that traces to a graph giving its outputs
    exactly), ``instance_processes`` (each instance a process of its own, fed through shared memory). A placement a
    model cannot take is decided for it as by ``auto``. ``auto``: per model (:func:`halfserve.placement.choose`), its
    manifest's ``execution.isolation``, else processes on CUDA; on a CPU, on the event loop where the forward of a full
    batch, timed at warm-up, is shorter than the loop's work on the batch's requests and settles on one intra-op thread
    (a longer one keeps its thread, so the loop goes on reading requests while it runs), and beside the loop where that
    forward also takes 10% or more of the loop's work on a full batch of 32 rows or more."""
    forward_on_event_loop: bool | None = None
    """Deprecated (one release): ``placement``. ``true`` is ``event_loop``, ``false`` ``instance_threads``."""
    pipeline_forward: bool | None = None
    """Deprecated (one release): ``placement``. ``true`` is ``beside_loop``; ``false`` has no equivalent (say
    ``placement`` instead)."""
    gil_switch_interval_ms: float | None = Field(default=None, gt=0.0, le=100.0)
    """The interpreter's thread switch interval. Unset: 0.5 ms when serving on CUDA (Python's 5 ms default otherwise).
    The event loop decodes request bodies holding the GIL; an engine thread that let go of it for a copy or a kernel
    waits up to this long to get it back, several times per batch."""
    instance_isolation: Isolation | None = None
    """Deprecated (one release): ``placement``. ``process`` is ``instance_processes``, ``thread``
    ``instance_threads``."""
    instance_batch_timeout: float = Field(default=300.0, ge=1.0, le=86400.0)
    """Seconds an instance process may take over one batch before it is taken for hung (stopped, deadlocked, in an
    endless kernel): then it is killed and restarted, and its batch rerun one request per batch. Generous: a first
    batch of a new shape may tune kernels for seconds."""
    instance_start_timeout: float = Field(default=900.0, gt=0.0, le=86400.0)
    """Seconds an instance process may take to start: to load, warm up and say it is ready (a start, a restart, a
    precision switch's or a reload's new processes). Past it the process is killed and its start failed: a load or a
    switch answers as a failed load, the engine it would have replaced serving on, and a restart is tried again after
    its back-off. Generous: CUDA graphs, compiles and cuDNN tuning of a large model on a slow host take minutes."""
    warmup: bool = True
    """Warm every model up at load (each batch bucket, CUDA graphs, compiles) before it takes requests."""
    compile_cache: str = "auto"
    """Where ``inductor`` models keep their compiled artifacts between starts: a folder, ``auto``
    (``<store>/.cache/compile``) or ``off``. A folder others can write to, or that cannot be written, is not used (a
    WARNING at the first such model's warm-up); one inside a model's folder is refused (:mod:`halfserve.compilecache`).
    """
    admin_token: SecretStr | None = None
    """Bearer token for the management calls (load, unload, reload, precision); without one they answer 403. At
    least 16 characters. Prefer the environment or ``admin_token_file``: a command-line flag shows in ``ps``."""
    admin_token_file: Path | None = None
    """A file holding the admin token (a Kubernetes or Docker secret), read once at start: one line, surrounding
    whitespace dropped, at most 4096 bytes."""
    docs: bool = True
    """Serve Swagger UI at ``/docs`` (a pinned release with subresource integrity, loaded by the browser from
    jsDelivr). ``/openapi.json`` is served either way."""
    log_level: LogLevel = LogLevel.INFO
    """The least severe log lines written."""
    log_format: LogFormat = LogFormat.TEXT
    """``text`` for people, ``json`` (one object per line) for log collectors."""
    access_log: bool = False
    """Log every request; inference requests with their request id, model, precision, status and duration."""

    @field_validator("code_path", mode="before")
    @classmethod
    def _paths(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p.strip()]
        return value

    @field_validator("models", "allowed_hosts", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.admin_token_file is not None:
            if self.admin_token is not None:
                raise ValueError("admin_token and admin_token_file: give one, not both")
            self.admin_token = SecretStr(_token_file(self.admin_token_file))
        if self.admin_token is not None:
            _check_token(self.admin_token.get_secret_value())
        self._take_placement_aliases()
        if self.grpc and self.grpc_port == self.port != 0:  # port 0 is any free port: each listener gets its own
            # Said here rather than as the second listener's "address already in use" after the models loaded.
            raise ValueError(
                f"grpc_port ({self.grpc_port}) is also the HTTP port: give --grpc-port another port, or --no-grpc"
            )
        taken = {self.port: "port", **({self.grpc_port: "grpc_port"} if self.grpc else {})}
        if self.torchserve_management_port in taken.keys() - {0}:
            raise ValueError(
                f"torchserve_management_port ({self.torchserve_management_port}) is already "
                f"{taken[self.torchserve_management_port]}: give it a port of its own"
            )
        if self.compile_cache not in ("auto", "off"):
            folder, store = Path(self.compile_cache).resolve(), self.store.resolve()
            inside = folder.relative_to(store).parts if folder.is_relative_to(store) else ()
            if inside and not inside[0].startswith("."):
                raise ValueError(f"compile_cache: {self.compile_cache} is inside a model's folder in the store")
        if self.live_fidelity_min_rows > self.live_fidelity_window:
            raise ValueError(
                f"live_fidelity_min_rows ({self.live_fidelity_min_rows}) must be at most live_fidelity_window "
                f"({self.live_fidelity_window}): a window that never holds that many rows could never demote"
            )
        if (
            self.max_queue_rows is not None
            and self.max_batch_size is not None
            and self.max_queue_rows < self.max_batch_size
        ):
            raise ValueError(
                f"max_queue_rows ({self.max_queue_rows}) must be at least max_batch_size ({self.max_batch_size})"
            )
        return self

    def _take_placement_aliases(self) -> None:
        """Map the deprecated placement flags onto ``placement``, refusing two that disagree."""
        named: dict[str, PlacementSetting] = {}
        if self.forward_on_event_loop is not None:
            on_loop = self.forward_on_event_loop
            named["forward_on_event_loop"] = (
                PlacementSetting.EVENT_LOOP if on_loop else PlacementSetting.INSTANCE_THREADS
            )
        if self.pipeline_forward is False:
            raise ValueError("pipeline_forward=false: deprecated, and has no placement of its own; set placement")
        if self.pipeline_forward:
            named["pipeline_forward"] = PlacementSetting.BESIDE_LOOP
        if self.instance_isolation is not None:
            named["instance_isolation"] = (
                PlacementSetting.INSTANCE_PROCESSES
                if self.instance_isolation is Isolation.PROCESS
                else PlacementSetting.INSTANCE_THREADS
            )
        if self.placement is not PlacementSetting.AUTO:
            named["placement"] = self.placement
        if len(set(named.values())) > 1:
            said = ", ".join(f"{k} ({v.value})" for k, v in named.items())
            raise ValueError(f"placement: {said} disagree; set placement alone")
        if named:
            self.placement = next(iter(named.values()))
