"""The Poisson sweep: the highest request rate a server answers with p99 <= a limit under Poisson arrivals.

MLPerf's Server scenario asks this, and perf_analyzer's ``--request-distribution poisson --request-rate-range``
measures it. perf_analyzer does not run on the hosts this project measures on (the peers kit's binary needs
tritonclient 2.51's glibc and libb64), so this is a Python open-loop client speaking the same KServe V2 binary
requests as the rest of gpu_bench.py:

* open loop: requests are sent at times drawn beforehand (exponential gaps from a seeded RNG), whether or not
  earlier ones have been answered, so a slow server shows as latency, never as a lower offered rate;
* each request is timed from its scheduled send time, so a client that falls behind its schedule counts against
  the rate (the send lag is reported beside, to tell the client's lag from the server's);
* several client processes may share a rate (each a Poisson stream of rate / processes: their sum is Poisson).

The sweep: rates rise by a factor until one fails (p99 over the limit, or any error), then bisect between the last
passing and first failing rate until they are within a resolution, bounded in steps and in seconds. The decision rule
(:func:`next_rate`, :func:`best_rate`) is pure, tested on made-up measurements in tests/unit/test_poisson_sweep.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Trial:
    """One rate measured: what was offered and what came back."""

    rate: float
    """Requests/s offered (the Poisson process's rate, all client processes together)."""
    p99_ms: float | None
    """99th percentile latency from each request's scheduled send time to its answer (None: nothing answered)."""
    errors: int = 0
    """Requests answered with a non-2xx status or not answered at all (time-outs, refused connections)."""
    requests: int = 0
    answered_per_s: float = 0.0
    p50_ms: float | None = None
    send_lag_p99_ms: float = 0.0
    """How late the client sent, at p99: a large lag means the client, not the server, could not keep the rate."""


def passes(trial: Trial, limit_ms: float) -> bool:
    """A rate passes when nothing failed and p99 is within the limit."""
    return trial.errors == 0 and trial.p99_ms is not None and trial.p99_ms <= limit_ms


def best_rate(trials: Sequence[Trial], limit_ms: float) -> float | None:
    """The highest passing rate below the lowest failing one (a pass above a fail is noise, not capacity); None when
    no rate passed."""
    failing = [t.rate for t in trials if not passes(t, limit_ms)]
    ceiling = min(failing, default=float("inf"))
    passing = [t.rate for t in trials if passes(t, limit_ms) and t.rate < ceiling]
    return max(passing, default=None)


def next_rate(
    trials: Sequence[Trial],
    limit_ms: float,
    *,
    start: float,
    growth: float = 2.0,
    resolution: float = 0.1,
    min_rate: float = 1.0,
    max_steps: int = 10,
) -> float | None:
    """The next rate to try given the trials so far, or None when the sweep is done.

    ``start`` first; while every rate passes, the highest times ``growth``; once one fails, the midpoint between the
    highest passing rate below the lowest failing one (0 when none passed) and that failing rate, until the two are
    within ``resolution`` of the failing rate, the failing rate is below ``min_rate``, or ``max_steps`` trials ran.
    """
    if growth <= 1 or not 0 < resolution < 1 or start <= 0:
        raise ValueError("growth must be > 1, resolution in (0, 1) and start > 0")
    if len(trials) >= max_steps:
        return None
    if not trials:
        return start
    failing = [t.rate for t in trials if not passes(t, limit_ms)]
    if not failing:
        return max(t.rate for t in trials) * growth
    high = min(failing)
    low = best_rate(trials, limit_ms) or 0.0
    if high - low <= resolution * high or high <= min_rate:
        return None
    return (low + high) / 2


def sweep(
    measure: Callable[[float], Trial],
    limit_ms: float,
    *,
    start: float,
    seconds_per_rate: float,
    budget_seconds: float,
    growth: float = 2.0,
    resolution: float = 0.1,
    max_steps: int = 10,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Run :func:`next_rate`'s rates through ``measure`` until it says done or the next trial (``seconds_per_rate``,
    as ``measure`` takes) would end past ``budget_seconds``; the trials and the best rate."""
    trials: list[Trial] = []
    began = clock()
    stopped = "done"
    while rate := next_rate(trials, limit_ms, start=start, growth=growth, resolution=resolution, max_steps=max_steps):
        if clock() - began + seconds_per_rate > budget_seconds:
            stopped = "budget"
            break
        trials.append(measure(rate))
    if len(trials) >= max_steps:
        stopped = "steps"
    return {
        "limit_ms": limit_ms,
        "best_rate": best_rate(trials, limit_ms),
        "stopped": stopped,
        "seconds": round(clock() - began, 1),
        "trials": [asdict(t) for t in trials],
    }


async def _open_loop(
    url: str, body: bytes, headers: dict[str, str], rate: float, seconds: float, warmup: float, seed: int, at: float
) -> tuple[list[float], list[float], int, int]:
    """One client process's Poisson stream from wall-clock time ``at``: (latencies, send lags, errors, requests),
    counting only requests scheduled after ``warmup`` seconds."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, int(rate * (seconds + warmup) * 1.5) + 16)
    times = np.cumsum(gaps)
    times = times[times < seconds + warmup]
    latencies: list[float] = []
    lags: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    async with httpx.AsyncClient(limits=limits, timeout=10.0) as client:
        loop = asyncio.get_running_loop()
        origin = loop.time() + max(0.0, at - time.time())

        async def send(scheduled: float, counted: bool) -> None:
            nonlocal errors
            due = origin + scheduled
            lag = loop.time() - due
            try:
                ok = (await client.post(url, content=body, headers=headers)).is_success
            except httpx.HTTPError:
                ok = False
            if counted:
                lags.append(lag)
                if ok:
                    latencies.append(loop.time() - due)
                else:
                    errors += 1

        tasks = []
        for scheduled in times:
            delay = origin + scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(float(scheduled), scheduled >= warmup)))
        await asyncio.gather(*tasks)
    return latencies, lags, errors, int((times >= warmup).sum())


def _client(args: tuple[str, bytes, dict[str, str], float, float, float, int, float]) -> tuple[Any, ...]:
    coro = _open_loop(*args)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def measure_rate(
    url: str,
    body: bytes,
    headers: dict[str, str],
    rate: float,
    *,
    seconds: float,
    warmup: float = 1.0,
    processes: int = 1,
    seed: int = 0,
) -> Trial:
    """``rate`` requests/s of Poisson arrivals at ``url`` for ``warmup`` + ``seconds``, from ``processes`` client
    processes (each seeded differently, all starting at the same wall-clock time)."""
    at = time.time() + 1.0  # the processes' start-up is not part of the schedule
    jobs = [(url, body, headers, rate / processes, seconds, warmup, seed + i, at) for i in range(processes)]
    if processes == 1:
        results = [_client(jobs[0])]
    else:
        with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_client, jobs))
    latencies = [x for r in results for x in r[0]]
    lags = [x for r in results for x in r[1]]
    errors = sum(r[2] for r in results)
    requests = sum(r[3] for r in results)
    ms = np.asarray(latencies) * 1000
    return Trial(
        rate=round(rate, 1),
        p99_ms=round(float(np.percentile(ms, 99)), 2) if latencies else None,
        errors=errors,
        requests=requests,
        answered_per_s=round(len(latencies) / seconds, 1),
        p50_ms=round(float(np.percentile(ms, 50)), 2) if latencies else None,
        send_lag_p99_ms=round(float(np.percentile(np.asarray(lags or [0.0]) * 1000, 99)), 2),
    )
