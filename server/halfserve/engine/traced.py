"""A CPU forward that runs beside the event loop without the GIL: the model traced into a TorchScript graph, launched
with ``torch.jit.fork`` into torch's inter-op thread pool.

Where the event loop bounds throughput (a small model on few cores), a forward on the loop's own thread holds up
every request while it runs, and a forward on an instance thread waits for the GIL before each of its layers while
the loop, busy with requests, keeps taking it back. A traced graph runs all its layers in C++: the loop launches it
(about 10 us) and goes on reading and answering requests, and learns that it finished by looking (:meth:`done`), so
neither side waits for the other.

Tracing records the operations one batch runs. A model whose forward branches on its input's values in Python would
be recorded down one branch: tracing says so with a ``TracerWarning``, which refuses the trace here, and the graph
must give the eager model's outputs exactly on the batches it is checked on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

_TracerWarning: type[Warning] = torch.jit.TracerWarning  # type: ignore[attr-defined]


class _Forward(nn.Module):
    """The engine's whole forward (its input preparation, the model, its output) as one module to trace."""

    def __init__(self, model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model  # registered, so the trace takes its weights as parameters rather than constants
        self._forward = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


class _Launch(nn.Module):
    """Scripted around the traced graph: ``torch.jit.fork`` called from TorchScript runs it on the inter-op pool (called
    from Python it would run at once, holding the GIL)."""

    def __init__(self, graph: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.graph = graph

    def forward(self, x: torch.Tensor) -> torch.jit.Future[torch.Tensor]:
        return torch.jit.fork(self.graph, x)


class TraceRefused(Exception):
    """The model cannot run as a traced graph (the message says why); it runs eagerly instead."""


class TracedForward:
    """A traced forward, launched in torch's inter-op pool: :meth:`launch` returns at once with its future."""

    def __init__(self, launcher: torch.jit.ScriptModule) -> None:
        self._launcher = launcher

    @classmethod
    def trace(
        cls, model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], batches: Sequence[torch.Tensor]
    ) -> TracedForward:
        """Trace ``forward`` (which runs ``model``) on the first of ``batches`` and check it gives exactly what
        ``forward`` gives on each of them; raises :class:`TraceRefused` otherwise."""
        module = _Forward(model, forward).eval()
        with torch.inference_mode():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", _TracerWarning)
                warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.jit")
                try:
                    graph = torch.jit.trace(module, batches[0], check_trace=False)
                except Exception as e:
                    raise TraceRefused(f"tracing failed: {type(e).__name__}: {e}") from None
            for w in caught:
                if issubclass(w.category, _TracerWarning):
                    raise TraceRefused(f"tracing warned: {str(w.message).splitlines()[0]}")
            for x in batches:
                want = forward(x)
                try:
                    got = graph(x)
                except Exception as e:
                    raise TraceRefused(f"the graph failed on {len(x)} rows: {type(e).__name__}: {e}") from None
                if not isinstance(got, torch.Tensor) or not torch.equal(got, want):
                    raise TraceRefused(f"the graph's output differs from the model's on {len(x)} rows")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.jit")
                launcher = torch.jit.script(_Launch(graph))
        except Exception as e:
            raise TraceRefused(f"scripting its launch failed: {type(e).__name__}: {e}") from None
        return cls(launcher)

    def launch(self, x: torch.Tensor) -> torch.Future[torch.Tensor]:
        """Start a forward of ``x`` on the inter-op pool: its future (:meth:`torch.Future.done`, ``value`` raises the
        forward's error). ``x`` must stay alive until it is done: its memory may belong to a numpy array, whose
        release would need the GIL on the pool's thread."""
        with torch.inference_mode():
            future: torch.Future[torch.Tensor] = self._launcher(x)
        return future
