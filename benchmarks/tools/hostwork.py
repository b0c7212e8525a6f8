"""A stand-in for a GPU instance's per-batch host work, for ``benchmarks/isolation_bench.py`` (``--code-path``).

Its forward makes ``calls`` tiny torch calls, as a CUDA batch's launches, copies and syncs are (each lets go of the
GIL and takes it back), in ``waits`` groups, each followed by a sleep without the GIL (``device_ms`` in all), as an
instance waits on its stream while the device runs. It answers, in every row, the batch's host time: its wall time
less the sleeps asked for (so the time to take the GIL back after each counts as host time) and ``device_ms``.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class HostWork(nn.Module):
    def __init__(self, features: int, calls: int, device_ms: float, waits: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))
        self.calls, self.device_ms, self.waits = calls, device_ms, waits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(4)
        start = time.perf_counter()
        # As a CUDA batch: launches, a wait on the stream, more launches and copies, another wait...: the calls after
        # each wait take the GIL back from whatever holds it then.
        for _ in range(self.waits):
            for _ in range(self.calls // self.waits):
                t.add_(1)
            time.sleep(self.device_ms / 1000 / self.waits)
        host = time.perf_counter() - start - self.device_ms / 1000
        y = (x * self.scale)[:, :2]
        return torch.stack([y[:, 0] * 0 + host * 1000, y[:, 1] * 0 + self.device_ms], dim=1)


def build(features: int = 16, calls: int = 200, device_ms: float = 2.0, waits: int = 4) -> nn.Module:
    return HostWork(features, calls, device_ms, waits)
