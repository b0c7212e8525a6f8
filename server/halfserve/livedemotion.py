"""A served model that live fidelity (:mod:`halfserve.livefidelity`) found below its bar, demoted: served from then on
with a mixed-precision plan searched on the rows live fidelity sampled, where one meets the bar on them, else in fp32
(``--live-fidelity-action demote``, the default), or only said so (``alert``). The demotion is the repository's
precision switch, so no request fails: the new engine takes over the batcher once it is warm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch

from halfserve import fidelity, mixed
from halfserve.batching import Batcher
from halfserve.engine.protocol import ModelEngine
from halfserve.errors import ModelNotReadyError
from halfserve.manifest import Precision
from halfserve.served import PrecisionSource, ServedModel
from halfserve.settings import LiveFidelityAction, Settings
from halfserve.store import LoadedModel

log = logging.getLogger(__name__)

Swap = Callable[
    [ServedModel, Batcher, ModelEngine, LoadedModel, Precision, Callable[[], None], tuple[str, ...] | None],
    Awaitable[None],
]
"""The repository's precision switch (:meth:`halfserve.repository.ModelRepository._swap`): a served model's batcher
handed a new engine in a precision, keeping a plan's modules in fp32, with what to record as it takes over."""


class LiveDemotion:
    """The demotions of a repository's models (``models``, by name), each under the model's management ``lock`` and
    made by its precision ``swap``."""

    def __init__(
        self,
        settings: Settings,
        device: torch.device,
        models: dict[str, ServedModel],
        lock: Callable[[str], asyncio.Lock],
        swap: Swap,
    ) -> None:
        self.settings, self.device = settings, device
        self._models, self._lock, self._swap = models, lock, swap
        self._tasks: set[asyncio.Task[None]] = set()
        """Demotions under way (held so they are not collected before they finish)."""

    def below_bar(self, served: ServedModel, reason: str) -> None:
        """Live fidelity's window of ``served`` fell below its bar: demote it (a task of its own, on the event loop),
        or only say so."""
        precision = served.precision.value if served.precision is not None else "?"
        if self.settings.live_fidelity_action is LiveFidelityAction.ALERT:
            log.warning(
                "model %s: live fidelity: %s; still served in %s (--live-fidelity-action alert)",
                served.name,
                reason,
                precision,
            )
            return
        log.warning("model %s is demoted from %s by live fidelity: %s", served.name, precision, reason)
        task = asyncio.get_running_loop().create_task(self._demote(served, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _demote(self, served: ServedModel, reason: str) -> None:
        """Serve ``served`` from now on (until it is reloaded or the operator switches its precision) with a
        mixed-precision plan searched on the rows live fidelity sampled, where one meets its bar on them, else in fp32,
        through the precision switch: no request fails."""
        try:
            async with self._lock(served.name):
                batcher, old, loaded = served.batcher, served.engine, served.loaded
                if self._models.get(served.name) is not served or batcher is None or old is None or loaded is None:
                    return  # reloaded, unloaded or released meanwhile: the window was about another load
                if old.precision is Precision.FP32:
                    return  # the operator switched it meanwhile
                found = await self._plan(served, loaded, old.precision, reason)
                target: Precision
                plan: tuple[str, ...] | None
                if found is not None and found.plan is not None:
                    target, plan = old.precision, found.plan.modules

                    def demoted() -> None:
                        served.mixed = found
                        served.precision_source = PrecisionSource.LIVE_MIXED_PLAN

                else:
                    target, plan = Precision.FP32, None

                    def demoted() -> None:
                        served.fp32_fallback = f"live fidelity: {reason}"
                        served.precision_source = PrecisionSource.LIVE_FIDELITY

                await self._swap(served, batcher, old, loaded, target, demoted, plan)
                log.warning(
                    "model %s is demoted by live fidelity to %s",
                    served.name,
                    f"{target.value} with {', '.join(plan)} in fp32" if plan else "fp32",
                )
        except ModelNotReadyError:
            return  # released while the new engine warmed up: nothing is served to demote
        except Exception:
            log.exception("model %s: the demotion by live fidelity failed; still served as before", served.name)

    async def _plan(
        self, served: ServedModel, loaded: LoadedModel, half: Precision, reason: str
    ) -> mixed.Outcome | None:
        """A mixed-precision plan for ``half`` searched on the rows live fidelity sampled, within
        ``mixed_search_seconds``; ``None`` where none is searched: the search is off, ``half`` has no plans, or the
        model is already served with one (which fell short too)."""
        live, limit = served.live, self.settings.mixed_search_seconds
        if live is None or limit <= 0 or half not in mixed.HALVES or served.plan_for(half):
            return None
        rows = await asyncio.to_thread(live.recent)
        if rows is None:
            return None
        samples = fidelity.Samples(rows, fidelity.Source.LIVE)
        batch = served.batching.max_batch_size
        found = await asyncio.to_thread(
            mixed.find, loaded, half, self.device, live.held_to, limit, batch, None, (), samples
        )
        if found.plan is None:
            log.warning("model %s: no mixed-precision plan meets its bar on live rows: %s", served.name, found.reason)
        else:
            found.reason = f"searched on {len(rows)} rows of live traffic, after live fidelity's {reason}"
        return found

    async def finish(self) -> None:
        """Wait for the demotions under way: each finishes its switch (its new engine is warm in seconds), so it is
        not torn down half built."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
