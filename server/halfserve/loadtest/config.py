"""What a load test run is asked to do: the options, validated once, before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from halfserve.loadtest import LoadtestError
from halfserve.loadtest.payload import Protocol

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)
PRECISIONS = ("fp16", "bf16", "autocast", "fp32", "auto")


@dataclass(frozen=True)
class LoadtestConfig:
    """Everything a load test run needs; validated at construction."""

    model: str | None = None
    url: str | None = None
    """A running server's base URL; ``None`` starts ``halfserve serve`` per precision (self-contained)."""
    store: Path = Path("model_store")
    precisions: tuple[str, ...] = ("bf16", "fp32")
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    duration: float | None = 10.0
    requests: int | None = None
    warmup: float = 1.0
    protocol: Protocol = Protocol.PREDICT
    grpc_url: str | None = None
    """``host:port`` of a running server's gRPC service for ``--protocol grpc`` (default: ``url``'s host, port
    8001)."""
    input_file: Path | None = None
    rows_per_request: int = 1
    out: Path = Path("loadtest_results")
    device: str | None = None
    progress: bool = True
    allow_remote: bool = False
    timeout: float = 30.0
    client_processes: int = 1
    client_ceiling: float = 3.0
    """Seconds of ``GET /health`` at the top concurrency to measure the client's own ceiling; 0 skips it."""
    loop: str = "uvloop"
    seed: int = 0
    server_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise LoadtestError(f"--concurrency: expected positive integers, got {list(self.concurrency)}")
        if (self.duration is None) == (self.requests is None):
            raise LoadtestError("give one of --duration and --requests")
        if self.duration is not None and self.duration <= 0:
            raise LoadtestError(f"--duration: expected seconds > 0, got {self.duration}")
        if self.requests is not None and self.requests < 1:
            raise LoadtestError(f"--requests: expected at least 1, got {self.requests}")
        if self.warmup < 0 or self.client_ceiling < 0:
            raise LoadtestError("--warmup and --client-ceiling take seconds >= 0")
        if self.rows_per_request < 1:
            raise LoadtestError(f"--rows-per-request: expected at least 1, got {self.rows_per_request}")
        if self.timeout <= 0:
            raise LoadtestError(f"--timeout: expected seconds > 0, got {self.timeout}")
        if self.url is None:
            if self.model is None:
                raise LoadtestError("--model is required when the load test starts the server (no --url)")
            unknown = [p for p in self.precisions if p not in PRECISIONS]
            if unknown or not self.precisions:
                raise LoadtestError(f"--precisions: expected some of {', '.join(PRECISIONS)}, got {self.precisions}")
            if len(set(self.precisions)) != len(self.precisions):
                raise LoadtestError(f"--precisions: each precision once, got {','.join(self.precisions)}")


def default_precisions(device: str | None) -> tuple[str, ...]:
    """fp16 and fp32 where the server will run on CUDA, bf16 and fp32 on a CPU."""
    from halfserve.engine.core import resolve_device

    try:
        on_cuda = resolve_device(device or "auto").type == "cuda"
    except (ValueError, RuntimeError) as e:
        raise LoadtestError(f"--device {device}: {e}") from None
    return ("fp16", "fp32") if on_cuda else ("bf16", "fp32")
