"""From what the client measured over a level to the numbers a report shows: pure functions, no I/O.

A level's latency percentiles are over its successful requests only (an error's latency says little about serving);
errors are counted by HTTP status and, for transport failures, by exception type, so that
``requests == successes + errors`` always holds.
"""

from __future__ import annotations

import base64
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

CLIENT_BOUND_SHARE = 0.8
"""A level at this share of the client's own ceiling (req/s against ``GET /health``) may be limited by the client."""
CLIENT_BOUND_CPU = 0.9
"""A client process busy this share of the level's wall time is saturated: its numbers are the client's."""
FP32 = "fp32"


@dataclass(frozen=True)
class LevelSample:
    """What one or more client processes measured over one level."""

    latencies: np.ndarray
    """Seconds from sending to having read the whole response, of each successful (200) request."""
    errors_by_status: dict[str, int] = field(default_factory=dict)
    errors_by_exception: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    """From the first request sent to the last response read."""
    client_cpu_s: float = 0.0
    """CPU time the client process(es) used over the level."""
    processes: int = 1

    @property
    def successes(self) -> int:
        return len(self.latencies)

    @property
    def errors(self) -> int:
        return sum(self.errors_by_status.values()) + sum(self.errors_by_exception.values())

    @property
    def requests(self) -> int:
        return self.successes + self.errors

    def to_message(self) -> dict[str, Any]:
        """A JSON-safe form (latencies as base64 of little-endian float64, exact and compact)."""
        return {
            "latencies": base64.b64encode(np.asarray(self.latencies, dtype="<f8").tobytes()).decode("ascii"),
            "errors_by_status": self.errors_by_status,
            "errors_by_exception": self.errors_by_exception,
            "elapsed_s": self.elapsed_s,
            "client_cpu_s": self.client_cpu_s,
        }

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> LevelSample:
        return cls(
            latencies=np.frombuffer(base64.b64decode(msg["latencies"]), dtype="<f8").astype(np.float64),
            errors_by_status={str(k): int(v) for k, v in msg["errors_by_status"].items()},
            errors_by_exception={str(k): int(v) for k, v in msg["errors_by_exception"].items()},
            elapsed_s=float(msg["elapsed_s"]),
            client_cpu_s=float(msg["client_cpu_s"]),
        )

    @classmethod
    def merge(cls, parts: Sequence[LevelSample]) -> LevelSample:
        """One level run by several client processes side by side, as one sample."""
        if len(parts) == 1:
            return parts[0]
        status: Counter[str] = Counter()
        exceptions: Counter[str] = Counter()
        for p in parts:
            status.update(p.errors_by_status)
            exceptions.update(p.errors_by_exception)
        return cls(
            latencies=np.concatenate([p.latencies for p in parts]) if parts else np.empty(0),
            errors_by_status=dict(status),
            errors_by_exception=dict(exceptions),
            elapsed_s=max((p.elapsed_s for p in parts), default=0.0),
            client_cpu_s=sum(p.client_cpu_s for p in parts),
            processes=sum(p.processes for p in parts),
        )


@dataclass(frozen=True)
class ServerDelta:
    """What the server reported over a level: ``/models/{m}/stats`` differences, and its CPU time when known."""

    rows: int
    batches: int
    cpu_s: float | None = None

    @property
    def mean_batch_size(self) -> float | None:
        return self.rows / self.batches if self.batches > 0 else None


@dataclass
class LevelResult:
    """One concurrency level of one precision: the row of the report."""

    precision: str
    served_precision: str | None
    protocol: str
    concurrency: int
    rows_per_request: int
    requests: int
    successes: int
    errors: int
    errors_by_status: dict[str, int]
    errors_by_exception: dict[str, int]
    rows: int
    elapsed_s: float
    req_per_s: float
    rows_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    mean_ms: float | None
    mean_batch_size: float | None
    server_rows: int | None
    server_batches: int | None
    client_cpu_percent: float
    client_cpu_us_per_request: float | None
    server_cpu_percent: float | None
    server_cpu_us_per_request: float | None
    client_bound: bool
    throughput_vs_fp32: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: np.ndarray, q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ascending ``sorted_values``: always an observed value,
    so p50 <= p90 <= p99 <= max holds by construction."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    rank = min(n, max(1, math.ceil(q / 100 * n)))
    return float(sorted_values[rank - 1])


def latency_summary(latencies_s: np.ndarray) -> dict[str, float | None]:
    """p50, p90, p99, max and mean in milliseconds (all ``None`` without a success)."""
    keys = ("p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms")
    if len(latencies_s) == 0:
        return dict.fromkeys(keys)
    ms = np.sort(np.asarray(latencies_s, dtype=np.float64)) * 1000.0
    return {
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": float(ms[-1]),
        "mean_ms": float(ms.mean()),
    }


def _per_request_us(cpu_s: float | None, requests: int) -> float | None:
    return cpu_s / requests * 1e6 if cpu_s is not None and requests > 0 else None


def summarize(
    sample: LevelSample,
    *,
    precision: str,
    served_precision: str | None,
    protocol: str,
    concurrency: int,
    rows_per_request: int,
    server: ServerDelta | None = None,
    client_ceiling_rps: float | None = None,
) -> LevelResult:
    """The report row for one level."""
    elapsed = sample.elapsed_s
    rows = sample.successes * rows_per_request
    req_per_s = sample.requests / elapsed if elapsed > 0 else 0.0
    client_share = sample.client_cpu_s / (elapsed * sample.processes) if elapsed > 0 else 0.0
    bound = client_share >= CLIENT_BOUND_CPU or (
        client_ceiling_rps is not None
        and client_ceiling_rps > 0
        and req_per_s >= CLIENT_BOUND_SHARE * client_ceiling_rps
    )
    server_cpu = server.cpu_s if server is not None else None
    return LevelResult(
        precision=precision,
        served_precision=served_precision,
        protocol=protocol,
        concurrency=concurrency,
        rows_per_request=rows_per_request,
        requests=sample.requests,
        successes=sample.successes,
        errors=sample.errors,
        errors_by_status=dict(sorted(sample.errors_by_status.items())),
        errors_by_exception=dict(sorted(sample.errors_by_exception.items())),
        rows=rows,
        elapsed_s=elapsed,
        req_per_s=req_per_s,
        rows_per_s=rows / elapsed if elapsed > 0 else 0.0,
        **latency_summary(sample.latencies),
        mean_batch_size=server.mean_batch_size if server is not None else None,
        server_rows=server.rows if server is not None else None,
        server_batches=server.batches if server is not None else None,
        client_cpu_percent=100.0 * sample.client_cpu_s / elapsed if elapsed > 0 else 0.0,
        client_cpu_us_per_request=_per_request_us(sample.client_cpu_s, sample.requests),
        server_cpu_percent=100.0 * server_cpu / elapsed if server_cpu is not None and elapsed > 0 else None,
        server_cpu_us_per_request=_per_request_us(server_cpu, sample.requests),
        client_bound=bound,
    )


def throughput_ratios(results: Iterable[LevelResult]) -> dict[str, dict[str, float]]:
    """Rows/s of each precision over fp32's, per concurrency level both ran: ``{"bf16/fp32": {"1": 1.02, "8": 1.31}}``.

    Also fills each result's ``throughput_vs_fp32``. Empty when fp32 was not run, or nothing else was.
    """
    rows = list(results)
    base = {(r.protocol, r.concurrency): r.rows_per_s for r in rows if r.precision == FP32}
    ratios: dict[str, dict[str, float]] = {}
    for r in rows:
        ref = base.get((r.protocol, r.concurrency))
        if not ref:
            continue
        r.throughput_vs_fp32 = r.rows_per_s / ref
        if r.precision != FP32:
            ratios.setdefault(f"{r.precision}/{FP32}", {})[str(r.concurrency)] = r.throughput_vs_fp32
    return ratios
