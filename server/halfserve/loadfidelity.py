"""The fidelity step of a load: a model about to be served in a half precision is held to its bar, by its version's
precision record (:mod:`halfserve.precision_record`) where that was measured under this load's conditions, else by
measuring it against fp32 (:mod:`halfserve.fidelity`). Below its bar it is served with a mixed-precision plan
(:mod:`halfserve.mixed`) where one meets the bar, else in fp32, and ``/models``, the log and the record shown say
which, and why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch

from halfserve import fidelity, mixed, precision_record
from halfserve import precision as prec
from halfserve.engine.protocol import ModelEngine
from halfserve.manifest import Manifest, Precision
from halfserve.served import ServedModel
from halfserve.settings import FidelityCheck, Settings
from halfserve.store import LoadedModel

log = logging.getLogger("halfserve.repository")
"""Logged as the repository's, whose load this step is."""

EngineFactory = Callable[[ServedModel, LoadedModel, Precision], Awaitable[ModelEngine]]
"""Builds (and warms) an engine for a model in a precision, placed as the repository places it; an engine built in a
half precision keeps the modules of ``ServedModel.plan_for`` in fp32."""


class LoadFidelity:
    """Holds each load of a half-precision engine to its model's fidelity bar."""

    def __init__(self, settings: Settings, device: torch.device, engine: EngineFactory) -> None:
        self.settings = settings
        self.device = device
        self._engine = engine

    def held_to(self, manifest: Manifest) -> fidelity.Bar | None:
        """The fidelity bar a model served in a half precision must meet at load; ``None``: it is not measured."""
        if self.settings.fidelity_bar is FidelityCheck.OFF:
            return None
        held_to = fidelity.bar(manifest)
        return held_to if held_to.check else None

    async def check(
        self, served: ServedModel, loaded: LoadedModel, engine: ModelEngine, held_to: fidelity.Bar
    ) -> ModelEngine:
        """The engine to serve instead of ``engine`` (a half-precision one): ``engine`` itself where it meets
        ``held_to``, else one with a mixed-precision plan that does, else an fp32 one. ``engine`` is closed when it is
        not the one returned."""
        served.fidelity_bar = held_to.as_dict()
        half = engine.precision.value
        record = await asyncio.to_thread(self._record, loaded, engine, held_to)
        own: precision_record.PrecisionRecord | None = None
        samples: fidelity.Samples | None = None
        trusted = record.trusted
        if trusted is not None:
            log.info("model %s: %s not measured at load: %s", served.name, half, record.why())
            served.fidelity = trusted.fidelity
            reason = fidelity.shortfall(trusted.fidelity, held_to)
        else:
            log.info("model %s: %s measured against fp32 at load: %s", served.name, half, record.why())
            samples = await asyncio.to_thread(fidelity.samples, loaded)
            try:
                reason, own = await self._measure(served, loaded, engine, held_to, samples, record.under)
            except fidelity.HalfForwardError as e:
                served.precision_record = record.shown(None)
                engine.close()
                return await self.unrunnable(served, loaded, engine.precision, held_to, str(e))
        served.precision_record = record.shown(own)
        if reason is None:
            if served.fidelity is not None and (open_question := fidelity.caveat(served.fidelity)) is not None:
                log.info("model %s: %s meets its bar, %s", served.name, half, open_question)
            return engine
        stored = tuple(record.stored.fp32_modules) if record.stored is not None else ()
        planned = await self._mixed_plan(served, loaded, engine, held_to, stored, samples)
        if planned is not None:
            # The record shown says what is served: its figures are the whole half model's, its plan the one served.
            served.precision_record = record.shown(own, served.plan_for(engine.precision))
            engine.close()
            return planned
        served.fidelity_shortfall, served.shortfall_precision = reason, engine.precision
        log.warning(
            "model %s is served in fp32, not %s: %s; %s", served.name, half, reason, fidelity.how_to_override(half)
        )
        served.fp32_fallback = reason
        engine.close()
        return await self._engine(served, loaded, Precision.FP32)

    async def unrunnable(
        self, served: ServedModel, loaded: LoadedModel, half: Precision, held_to: fidelity.Bar, reason: str
    ) -> ModelEngine:
        """An fp32 engine for a model whose forward in ``half`` raises (``reason``): a fidelity failure, shown and
        logged as one; no mixed-precision plan is searched (each try would run the forward that raises)."""
        served.fidelity_bar = held_to.as_dict()
        served.fidelity_shortfall, served.shortfall_precision = reason, half
        log.warning("model %s is served in fp32, not %s: %s", served.name, half.value, reason)
        served.fp32_fallback = reason
        return await self._engine(served, loaded, Precision.FP32)

    async def _mixed_plan(
        self,
        served: ServedModel,
        loaded: LoadedModel,
        engine: ModelEngine,
        held_to: fidelity.Bar,
        stored: tuple[str, ...],
        samples: fidelity.Samples | None,
    ) -> ModelEngine | None:
        """An engine with the fewest modules kept in fp32 that meets ``held_to`` (:mod:`halfserve.mixed`; the version's
        ``stored`` plan where it still does), searched within ``mixed_search_seconds`` on ``samples`` (read here where
        the load measured nothing); ``None`` where there is none."""
        limit, batch, precision = self.settings.mixed_search_seconds, served.batching.max_batch_size, engine.precision
        if limit <= 0 or precision not in mixed.HALVES:
            return None
        found = await asyncio.to_thread(
            mixed.find, loaded, precision, self.device, held_to, limit, batch, None, stored, samples
        )
        served.mixed = found
        if found.plan is None:
            log.info("model %s: no mixed-precision plan meets its bar: %s", served.name, found.reason)
            return None
        plan = found.plan
        log.warning(
            "model %s is served mixed, %s with %d of %d modules in fp32 (%s): that meets its bar",
            *(served.name, precision.value, len(plan.modules), plan.candidates, ", ".join(plan.modules)),
        )
        return await self._engine(served, loaded, precision)

    def _record(self, loaded: LoadedModel, engine: ModelEngine, held_to: fidelity.Bar) -> precision_record.AtLoad:
        """The version's precision record checked against this load's conditions."""
        version_dir = loaded.path.parent
        kind = prec.device_kind(engine.device)
        under = precision_record.conditions(version_dir, loaded.manifest, engine.precision, held_to, kind)
        return precision_record.at_load(version_dir, under, self.settings.fidelity_bar is FidelityCheck.MEASURE)

    @staticmethod
    async def _measure(
        served: ServedModel,
        loaded: LoadedModel,
        engine: ModelEngine,
        held_to: fidelity.Bar,
        samples: fidelity.Samples,
        under: precision_record.Conditions,
    ) -> tuple[str | None, precision_record.PrecisionRecord | None]:
        """Measure a half-precision engine against fp32 on ``samples`` (the version's calibration, else random); returns
        why it is not to be served (``None``: it meets ``held_to``) and the record of the measurement ``under`` this
        load's conditions."""
        half = engine.precision.value
        try:
            measured = await asyncio.to_thread(
                fidelity.measure, engine, loaded, samples.rows, served.batching.max_batch_size, samples.source
            )
        except (fidelity.UnanswerableError, fidelity.HalfForwardError):
            raise  # fp32's own answers (no precision serves the model), or the half forward's failure (fp32 does)
        except Exception as e:
            if samples.source is not fidelity.Source.RANDOM:
                raise  # the operator's own samples fail the model: as any load failure
            # Random samples may be inputs the model cannot take (ids past its vocabulary, values it refuses): its
            # half precision is then unproven, so it is not what is served.
            return f"{half} could not be measured against fp32 on random samples ({e}); give calibration samples", None
        served.fidelity = measured
        log.info(
            "model %s: %s vs fp32 on %d %s samples in %.2fs: top-1 agreement %s, lowest cosine %s, max abs/rel error "
            "%s/%s",
            served.name,
            half,
            measured.samples,
            measured.source,
            measured.seconds,
            _figure(measured.top1_agreement, ".4f"),
            _figure(measured.min_cosine, ".6f"),
            _figure(measured.max_abs_error, ".3g"),
            _figure(measured.max_rel_error, ".3g"),
        )
        engine.real_elements = engine.padded_elements = 0  # padding waste counts requests, not samples
        return fidelity.shortfall(measured, held_to), precision_record.measured(under, measured)


def _figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
