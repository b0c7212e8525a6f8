"""Prometheus metrics: what the server has answered, how it batched it, and what it holds on its device.

Three sources feed one registry (one per app, so apps built side by side in one process do not share counters):

* per request, from the inference routes (:meth:`Metrics.request`): requests and rows by model, precision,
  protocol and status, and the end-to-end latency of the answered ones;
* per batch, from each model's batcher (a :class:`~halfserve.batching.BatchObserver`): batch sizes, queue and compute
  time, and Triton's ``inference_count`` (rows) / ``execution_count`` (batches);
* at scrape time, from the repository (as :class:`WatchedModel` sees it): models loaded, their state, weight bytes
  on the device, queue depth, and the engines' overflow and fp32-rerun counts.

Counters fed per request or per batch live as long as the app, across reloads and precision switches; the engines'
counts start afresh when a model is (re)loaded, as Triton's do.

The per-request cost is a dictionary lookup and three updates of label children resolved once per label set:
resolving ``.labels(...)`` on every request would cost several times more than the updates themselves.
"""

from __future__ import annotations

import bisect
from collections import Counter as Counter_
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from halfserve.manifest import Precision
from halfserve.serving import Interface, ModelHandle, ModelState, Prediction

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Seconds, for request latency, queue time and compute time: sub-millisecond for a small model on a GPU up to the
tens of seconds a deadline allows."""
BATCH_BUCKETS = tuple(float(2**i) for i in range(14))
"""Rows per batch: powers of two from 1 to 8192, the largest ``max_batch_size`` a manifest may set."""


_Children = tuple["Counter", "Counter", "Histogram | None"]


class EngineFacts(Protocol):
    """What a served model's engine serves on (an engine's ``info``), as a scrape reads it."""

    @property
    def device(self) -> str: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def weight_dtype(self) -> str: ...
    @property
    def weight_bytes(self) -> int: ...


class WatchedEngine(Protocol):
    @property
    def info(self) -> EngineFacts: ...
    @property
    def real_elements(self) -> int: ...
    @property
    def padded_elements(self) -> int: ...


class WatchedQueue(Protocol):
    @property
    def queued_rows(self) -> int: ...


class WindowFigures(Protocol):
    """Live fidelity's figures over its window (a :class:`halfserve.fidelity.Fidelity`)."""

    @property
    def top1_agreement(self) -> float | None: ...
    @property
    def min_cosine(self) -> float | None: ...
    @property
    def max_rel_error(self) -> float | None: ...


class WatchedLive(Protocol):
    """A model's live fidelity (:class:`halfserve.livefidelity.LiveFidelity`) as a scrape reads it."""

    @property
    def rows_compared(self) -> int: ...
    @property
    def rows_dropped(self) -> int: ...
    @property
    def shortfalls(self) -> int: ...
    @property
    def action(self) -> str: ...
    @property
    def window_rows(self) -> int: ...
    def figures(self) -> WindowFigures | None: ...


class WatchedModel(Protocol):
    """A served model as a scrape reads it: the repository's models, typed here so the metrics (and the routes that
    render them) load neither the repository nor the batcher."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def state(self) -> ModelState: ...
    @property
    def engine(self) -> WatchedEngine | None: ...
    @property
    def batcher(self) -> WatchedQueue | None: ...
    @property
    def host_weight_bytes(self) -> int: ...
    @property
    def overflows(self) -> int: ...
    @property
    def fp32_reruns(self) -> int: ...
    @property
    def fp32_fallback(self) -> str | None: ...
    @property
    def live(self) -> WatchedLive | None: ...


class Metrics:
    """The server's metrics: fed by the routes and the batchers, read out by ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["model", "precision", "protocol", "status"]
        self.requests = Counter(
            "halfserve_requests", "Inference requests answered, by HTTP status.", labels, registry=r
        )
        self.rows = Counter(
            "halfserve_request_rows",
            "Rows (samples) of the inference requests answered with outputs.",
            labels,
            registry=r,
        )
        self.latency = Histogram(
            "halfserve_request_duration_seconds",
            "End-to-end time of inference requests answered with outputs, from routing to the response.",
            ["model", "precision", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "halfserve_batch_size", "Rows per batch run.", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "halfserve_queue_duration_seconds",
            "Time a request's rows waited in the queue before their batch was cut (once per batch a request spans).",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_time = Histogram(
            "halfserve_compute_duration_seconds",
            "Time a batch took on its engine: copy to the device, cast, forward and copy back.",
            ["model", "precision"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Triton's names (nv_inference_count, nv_inference_exec_count): their ratio is the mean batch size.
        self.inference_count = Counter(
            "halfserve_inference_count", "Rows inferred (Triton's inference_count).", ["model", "version"], registry=r
        )
        self.execution_count = Counter(
            "halfserve_execution_count", "Batches run (Triton's execution_count).", ["model", "version"], registry=r
        )
        self._children: dict[tuple[str, str, Interface, int], _Children] = {}

    def request(self, model: str, precision: str, interface: Interface, status: int, rows: int, seconds: float) -> None:
        """Count one inference request; ``rows`` and ``seconds`` count only when it was answered with outputs."""
        key = (model, precision, interface, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = self._resolve(key)
        requests, rows_counter, latency = children
        requests.inc()
        if latency is not None:
            rows_counter.inc(rows)
            latency.observe(seconds)

    def _resolve(self, key: tuple[str, str, Interface, int]) -> _Children:
        model, precision, interface, status = key
        labels = (model, precision, interface.value, str(status))
        ok = 200 <= status < 300
        return (
            self.requests.labels(*labels),
            self.rows.labels(*labels),
            self.latency.labels(model, precision, interface.value) if ok else None,
        )

    def batch_observer(self, model: str, version: int, precision: str) -> BatchMetrics:
        """The observer a batcher of ``model`` reports its batches to (a :class:`~halfserve.batching.BatchObserver`),
        for as long as it serves ``precision``."""
        return BatchMetrics(self, model, str(version), precision)

    def watch(self, models: Callable[[], Iterable[WatchedModel]]) -> None:
        """Read the served models' state, weights, queues and engine counters at every scrape."""
        self.registry.register(_ModelsCollector(models))

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


def request_labels(served: ModelHandle | None, prediction: Prediction | None) -> tuple[str, str, int]:
    """What a request is counted and logged under: its model (empty before one is known), the precision that
    answered it (else the model's), and the rows answered."""
    model = served.name if served is not None else ""
    if prediction is not None:
        return model, prediction.precision, prediction.rows
    precision = served.precision.value if served is not None and served.precision is not None else ""
    return model, precision, 0


def observe_all(histogram: Histogram, values: list[float]) -> None:
    """What ``histogram.observe`` of each of ``values`` does, with one update per bucket the values fall in and one of
    the sum, where ``observe`` locks and updates both per value: a batch's queue waits are dozens of values at once.

    It reads the histogram's bucket bounds and values (prometheus_client keeps no public way to add several
    observations at once); a histogram without them gets ``observe`` per value.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    # The first bucket whose upper bound is >= the value, as observe finds it (the last bound is +Inf).
    counts = Counter_(bisect.bisect_left(bounds, v) for v in values)
    for i, n in counts.items():
        buckets[i].inc(n)
    total.inc(sum(values))


class BatchMetrics:
    """A model's batch metrics with their label children resolved once."""

    __slots__ = ("_compute", "_executions", "_inferences", "_queue", "_size")

    def __init__(self, metrics: Metrics, model: str, version: str, precision: str) -> None:
        self._size = metrics.batch_size.labels(model)
        self._queue = metrics.queue_time.labels(model)
        self._compute = metrics.compute_time.labels(model, precision)
        self._inferences = metrics.inference_count.labels(model, version)
        self._executions = metrics.execution_count.labels(model, version)

    def queued(self, waits: list[float]) -> None:
        observe_all(self._queue, waits)

    def ran(self, rows: int, seconds: float) -> None:
        self._size.observe(rows)
        self._compute.observe(seconds)
        self._inferences.inc(rows)
        self._executions.inc()


class _ModelsCollector(Collector):
    """Gauges and counters read from the repository when scraped."""

    def __init__(self, models: Callable[[], Iterable[WatchedModel]]) -> None:
        self._models = models

    def describe(self) -> Iterable[Metric]:
        return []  # families are known only from the models present at scrape time

    def collect(self) -> Iterator[Metric]:
        loaded = GaugeMetricFamily("halfserve_models_loaded", "Models loaded, warmed up and serving.")
        state = GaugeMetricFamily(
            "halfserve_model_state",
            "1 for the state each known model is in (loading, ready, failed, unloaded).",
            labels=["model", "version", "state"],
        )
        weights = GaugeMetricFamily(
            "halfserve_model_weight_bytes",
            "Bytes of weights (parameters and buffers) each model holds on its serving device, in its serving dtype: "
            "half of the fp32 figure in fp16 or bf16.",
            labels=["model", "version", "precision", "device", "dtype"],
        )
        fp32_host = GaugeMetricFamily(
            "halfserve_model_host_fp32_bytes",
            "Bytes of the fp32 weights kept on the host, for precision switches and overflow reruns.",
            labels=["model", "version"],
        )
        queue = GaugeMetricFamily(
            "halfserve_queue_rows", "Rows accepted and waiting to be cut into a batch.", labels=["model"]
        )
        overflows = CounterMetricFamily(
            "halfserve_overflows",
            "Batch chunks whose half-precision output was not finite for finite input, since the model was loaded.",
            labels=["model"],
        )
        reruns = CounterMetricFamily(
            "halfserve_fp32_reruns",
            "Batch chunks rerun in fp32 because their half-precision output overflowed, since the model was loaded.",
            labels=["model"],
        )
        padding = CounterMetricFamily(
            "halfserve_padded_elements",
            "Values run as padding of variable-length inputs (to each batch's length and bucket), since the model was "
            "loaded; padding waste is this over halfserve_real_elements.",
            labels=["model"],
        )
        real = CounterMetricFamily(
            "halfserve_real_elements",
            "Values of variable-length inputs that requests sent, run since load.",
            labels=["model"],
        )
        fallback = GaugeMetricFamily(
            "halfserve_model_fp32_fallback",
            "1 for a model served in fp32 because its half precision fell below its fidelity bar (at load, or on "
            "sampled real rows: live fidelity).",
            labels=["model", "version"],
        )
        live = _LiveFamilies()
        ready = 0
        for served in list(self._models()):
            version = str(served.version)
            state.add_metric([served.name, version, served.state.value], 1)
            engine, batcher = served.engine, served.batcher
            if engine is None or batcher is None:
                continue
            ready += 1
            info = engine.info
            labels = [served.name, version, info.precision.value, info.device, info.weight_dtype]
            weights.add_metric(labels, info.weight_bytes)
            fp32_host.add_metric([served.name, version], served.host_weight_bytes)
            queue.add_metric([served.name], batcher.queued_rows)
            overflows.add_metric([served.name], served.overflows)
            reruns.add_metric([served.name], served.fp32_reruns)
            fallback.add_metric([served.name, version], 1 if served.fp32_fallback else 0)
            if engine.real_elements:
                padding.add_metric([served.name], engine.padded_elements)
                real.add_metric([served.name], engine.real_elements)
            if served.live is not None:
                live.add(served.name, served.live)
        loaded.add_metric([], ready)
        yield from (loaded, state, weights, fp32_host, queue, overflows, reruns, fallback, padding, real)
        yield from live.families()


class _LiveFamilies:
    """Live fidelity's metrics (:mod:`halfserve.livefidelity`), read from the models at a scrape."""

    def __init__(self) -> None:
        self.rows = CounterMetricFamily(
            "halfserve_live_fidelity_rows",
            "Rows answered in a half precision, sampled, rerun in fp32 and compared, since the model was loaded.",
            labels=["model"],
        )
        self.dropped = CounterMetricFamily(
            "halfserve_live_fidelity_dropped_rows",
            "Sampled rows dropped before their fp32 rerun (the queue was full: reruns held to their CPU share lag).",
            labels=["model"],
        )
        self.shortfalls = CounterMetricFamily(
            "halfserve_live_fidelity_shortfalls",
            "Times a model's window of compared rows fell below its fidelity bar, by what was done (demote, alert).",
            labels=["model", "action"],
        )
        self.window = GaugeMetricFamily(
            "halfserve_live_fidelity_window_rows", "Compared rows in the model's window.", labels=["model"]
        )
        self.top1 = GaugeMetricFamily(
            "halfserve_live_fidelity_top1_agreement",
            "Share of the window's rows whose top class is fp32's (class scores outputs).",
            labels=["model"],
        )
        self.cosine = GaugeMetricFamily(
            "halfserve_live_fidelity_min_cosine",
            "Lowest cosine similarity with fp32 over the window's rows (outputs of several values per row).",
            labels=["model"],
        )
        self.rel_error = GaugeMetricFamily(
            "halfserve_live_fidelity_max_rel_error",
            "Largest error from fp32 over the window's rows, relative to the largest fp32 magnitude (outputs of one "
            "value per row).",
            labels=["model"],
        )

    def add(self, model: str, live: WatchedLive) -> None:
        self.rows.add_metric([model], live.rows_compared)
        self.dropped.add_metric([model], live.rows_dropped)
        self.shortfalls.add_metric([model, live.action], live.shortfalls)
        self.window.add_metric([model], live.window_rows)
        figures = live.figures()
        if figures is None:
            return
        for family, value in (
            (self.top1, figures.top1_agreement),
            (self.cosine, figures.min_cosine),
            (self.rel_error, figures.max_rel_error),
        ):
            if value is not None:
                family.add_metric([model], value)

    def families(self) -> tuple[Metric, ...]:
        return (self.rows, self.dropped, self.shortfalls, self.window, self.top1, self.cosine, self.rel_error)
