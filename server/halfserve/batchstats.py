"""What a batcher has done: kept by the batcher (:mod:`halfserve.batching`), read by the statistics routes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class BatchStats:
    """What a batcher has done: counts, a histogram of batch sizes and summed queue / compute time."""

    requests: int = 0
    rows: int = 0
    batches: int = 0
    failed_batches: int = 0
    rejected: int = 0
    expired: int = 0
    split_retries: int = 0
    """Failed batches rerun as two smaller ones to isolate the failing requests."""
    oom_shrinks: int = 0
    """Times the runner reported a batch too large and the batch size was halved."""
    batch_sizes: Counter[int] = field(default_factory=Counter)
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0
    queued_chunks: int = 0
    """How many chunks ``queue_seconds`` sums over (a request spanning batches waits once per chunk)."""
    succeeded: int = 0
    """Requests answered with their outputs."""
    failed: int = 0
    """Requests answered with an error: rejected, expired, failed batch, shutting down or abandoned by the caller."""
    success_seconds: float = 0.0
    """Summed time from submit to answer of the succeeded requests; ``fail_seconds`` likewise for the failed."""
    fail_seconds: float = 0.0
    batch_compute_seconds: dict[int, float] = field(default_factory=dict)
    """Summed runner time of the successful batches, per batch size (the keys of ``batch_sizes``)."""
    last_inference: float = 0.0
    """Wall-clock time (``time.time()``) the last successful batch finished; 0 before the first."""

    def snapshot(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "rows": self.rows,
            "batches": self.batches,
            "failed_batches": self.failed_batches,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "rejected": self.rejected,
            "expired": self.expired,
            "split_retries": self.split_retries,
            "oom_shrinks": self.oom_shrinks,
            "mean_batch_size": self.rows / self.batches if self.batches else 0.0,
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "queue_seconds": self.queue_seconds,
            "compute_seconds": self.compute_seconds,
            "success_seconds": self.success_seconds,
        }
