"""``halfserve loadtest``: sweep concurrency against a server, per precision, and report throughput and latency.

The load comes from separate client processes (:mod:`halfserve.loadtest.worker`, driven through
:mod:`halfserve.loadtest.client`), so the load generator never shares an interpreter with the orchestration:
:mod:`halfserve.loadtest.runner` starts servers (:mod:`halfserve.loadtest.process`), reads their statistics and collects
the levels (:mod:`halfserve.loadtest.stats`); :mod:`halfserve.loadtest.report` writes JSON, Markdown and a plot.
Request bodies are encoded once, in :mod:`halfserve.loadtest.payload`. ``python -m halfserve.loadtest.make_bench_model``
writes the benchmark model ``resnet_bench``.
"""

from __future__ import annotations

__all__ = ["LoadtestError"]


class LoadtestError(Exception):
    """A load test cannot run as asked; the message says why (printed as one line, exit code 2)."""
