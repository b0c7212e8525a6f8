"""The set of served models: loading from the store, one engine and batcher per model, readiness and draining."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from halfserve import (
    calibration,
    compilecache,
    fidelity,
    handlers,
    livefidelity,
    outputcheck,
    padding,
    storage,
    store,
    text,
)
from halfserve import precision as prec
from halfserve.batching import Batcher, BatchObserver
from halfserve.engine import runners
from halfserve.engine.core import Engine, module_bytes
from halfserve.engine.intraop import fixed_timing
from halfserve.engine.protocol import EngineError, ModelEngine
from halfserve.engine.traced import TraceRefused
from halfserve.errors import ModelNotReadyError
from halfserve.execution import Batching
from halfserve.fallback import VersionFallback
from halfserve.indices import index_limits
from halfserve.isolated.engine import ProcessEngine
from halfserve.livedemotion import LiveDemotion
from halfserve.loadfidelity import LoadFidelity
from halfserve.manifest import Manifest, Precision, load_manifest
from halfserve.placement import Placement, available_cores, choose, in_process, pads_to_buckets
from halfserve.precision import resolve_device
from halfserve.served import PrecisionSource, ServedModel
from halfserve.serving import ModelState, Runner, find, why_model_not_ready
from halfserve.settings import Settings
from halfserve.storage import ReportedError, StoreError
from halfserve.store import LoadedModel

log = logging.getLogger(__name__)

_PLACED = {
    Placement.INSTANCE_THREADS: "",
    Placement.EVENT_LOOP: " on the event loop's thread",
    Placement.BESIDE_LOOP: " traced, beside the event loop",
    Placement.INSTANCE_PROCESSES: " in processes of their own",
}
"""How the ready log line says where a model's batches run."""

CUDA_GIL_SWITCH_INTERVAL_MS = 0.5
"""The switch interval when serving on CUDA: at Python's 5 ms, engine threads wait on the event loop for the GIL
between their copies and kernels (see ``Settings.gil_switch_interval_ms``)."""

ObserverFactory = Callable[[str, int, str], BatchObserver]
"""Makes the batch observer of a model (name, version, precision served), e.g. :meth:`Metrics.batch_observer`."""


def gil_switch_interval_ms(settings: Settings, device_type: str) -> float | None:
    """The interpreter's switch interval to serve with: the setting, else :data:`CUDA_GIL_SWITCH_INTERVAL_MS` on a
    CUDA device; None leaves Python's default. Applied once, by the server's lifespan (it is process-wide)."""
    if settings.gil_switch_interval_ms is not None:
        return settings.gil_switch_interval_ms
    return CUDA_GIL_SWITCH_INTERVAL_MS if device_type == "cuda" else None


class ModelRepository:
    """Loads the store's models and owns their engines and batchers."""

    def __init__(self, settings: Settings, observe: ObserverFactory | None = None) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.models: dict[str, ServedModel] = {}
        self.observe = observe
        self.precisions: dict[str, Precision] = {}
        """Precisions set at run time, per model; they outrank the settings and the manifest, across reloads."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._fallback = VersionFallback(settings.store, self._register, self._load)
        self._fidelity = LoadFidelity(settings, self.device, self._engine)
        self._demotion = LiveDemotion(settings, self.device, self.models, self._lock, self._swap)

    def _lock(self, name: str) -> asyncio.Lock:
        """Serialises the management calls (load, unload, precision switch) on one model."""
        return self._locks.setdefault(name, asyncio.Lock())

    def discover(self) -> None:
        """Validate the manifests of the models to serve and what their architectures build against their checkpoints,
        and register them. A version whose architecture is refused or does not build (or fit its checkpoint) is passed
        over for the newest older one that does (unless the version is pinned); a model with no such version is
        registered as failed, with the reason, and one whose manifest cannot be read is left out, logged. The others
        are served; when none is left to serve, this fails fast, naming each file and field."""
        root = self.settings.store
        names = self.settings.models or storage.model_folders(root)
        if not names:
            raise StoreError(f"{root}: no model folder with a {storage.MANIFEST}")
        failures = []
        for name in names:
            try:
                served = self._register(name)
            except (StoreError, OSError) as e:  # one malformed model folder must not keep the others from serving
                failures.append(str(e))
                log.error("model %r cannot be served: %s", name, e)  # repr: a newline in a name cannot forge lines
                continue
            served = self._fallback.checked(served)
            if served.state is ModelState.FAILED:
                failures.append(served.error or "")
            self.models[name] = served
        if len(failures) == len(names):
            raise StoreError("; ".join(failures))

    def fixed_shapes(self) -> bool:
        """Whether every registered model's engine pads batches to bucket sizes on this device."""
        return all(pads_to_buckets(m.manifest.execution, self.device) for m in self.models.values())

    def _register(self, name: str, version: int | None = None) -> ServedModel:
        model_dir = self.settings.store / storage.check_name(name)
        manifest = load_manifest(model_dir)
        version = storage.resolve_version(model_dir, version if version is not None else manifest.version)
        return ServedModel(name, manifest, version, self._batching(manifest))

    def _batching(self, manifest: Manifest) -> Batching:
        s, b = self.settings, manifest.batching
        return Batching(
            max_batch_size=s.max_batch_size or b.max_batch_size,
            max_delay_ms=b.max_delay_ms if s.max_delay_ms is None else s.max_delay_ms,
            max_queue_rows=max(s.max_queue_rows or b.max_queue_rows, s.max_batch_size or b.max_batch_size),
            request_timeout_ms=s.request_timeout_ms or b.request_timeout_ms,
            adaptive_delay=b.adaptive_delay if s.adaptive_delay is None else s.adaptive_delay,
            group_lengths=b.group_lengths,
        )

    async def load_all(self) -> None:
        """Load and warm every discovered model, one after another: its newest version that loads (see
        :meth:`halfserve.fallback.VersionFallback.load_newest`); a model none of whose versions loads is marked
        failed."""
        for served in list(self.models.values()):
            if served.state is ModelState.FAILED:  # refused at discovery, with its reason
                continue
            async with self._lock(served.name):
                self.models[served.name] = await self._fallback.load_newest(served)

    def _observer(self, served: ServedModel, engine: ModelEngine) -> BatchObserver | None:
        return self.observe(served.name, served.version, engine.precision.value) if self.observe else None

    async def _engine(
        self, served: ServedModel, loaded: LoadedModel, precision: Precision, plan: tuple[str, ...] | None = None
    ) -> ModelEngine:
        """A new engine for ``served`` cast from ``loaded``'s host weights, warmed up unless warm-up is off, built
        where :func:`halfserve.placement.choose` places it: instance processes that read the same checkpoint and warm
        up in parallel, or an engine in this process with the runner of its placement. It keeps ``plan``'s modules in
        fp32 (by default the model's own plan for ``precision``, :meth:`ServedModel.plan_for`)."""
        kept = served.plan_for(precision) if plan is None else plan
        max_batch_size = served.batching.max_batch_size
        # Built (and timed) only where the choice needs it, in its worker thread; cached, so the engine timed is the
        # engine served.
        measured = functools.cache(functools.partial(self._in_process_engine, served, loaded, precision, kept))
        setting = self.settings.placement
        placement = await asyncio.to_thread(choose, setting, served.manifest.execution, self.device, measured)
        if placement is Placement.INSTANCE_PROCESSES:
            fixed = self.fixed_shapes()
            # A process that died, failed or ran out of time starting fails the load as a checkpoint that fails
            # does (a 400, the engine it would have replaced serving on), not as the server's own error.
            try:
                processes = await ProcessEngine.start(
                    self.settings, loaded, precision, self.device, max_batch_size, fixed, kept
                )
            except EngineError as e:
                raise ReportedError(str(e)) from None
            served.warmup_seconds = processes.warmup_seconds
            return processes
        engine = measured()
        try:
            await asyncio.to_thread(runners.place, engine, placement, max_batch_size)
        except TraceRefused as e:
            log.info("model %s: batches run eagerly, not as a traced graph beside the event loop: %s", served.name, e)
            runners.place(engine, in_process(engine, setting.placement, traced=False), max_batch_size)
        return engine

    def _in_process_engine(
        self, served: ServedModel, loaded: LoadedModel, precision: Precision, kept: tuple[str, ...]
    ) -> Engine:
        """An engine in this process, warmed up and its intra-op threads settled on a CPU (unless warm-up is off); it
        blocks, so run it off the event loop."""
        max_batch_size = served.batching.max_batch_size
        cache = compilecache.from_setting(self.settings.compile_cache, self.settings.store)
        engine = Engine(
            loaded, precision, self.device, max_batch_size=max_batch_size, fp32_modules=kept, compile_cache=cache
        )
        if self.settings.warmup:
            try:
                served.warmup_seconds = engine.warmup(max_batch_size)
                if self.settings.threads is None and self.device.type == "cpu":
                    given = self.settings.forward_seconds
                    timing = None if given is None else fixed_timing(given)
                    engine.settle_threads(max_batch_size, available_cores(), timing)
            except BaseException:
                engine.close()
                raise
        return engine

    @staticmethod
    async def _check_padding(served: ServedModel, loaded: LoadedModel) -> None:
        """Refuse a model whose answers change with padding (:mod:`halfserve.padding`), before an engine is built."""
        served.calibration = await asyncio.to_thread(calibration.source_of, loaded.path.parent)
        served.padding = await asyncio.to_thread(padding.at_load, loaded)

    async def _load(self, served: ServedModel) -> None:
        precision = self.precisions.get(served.name) or self.settings.precision or served.manifest.precision
        loaded = await asyncio.to_thread(store.load, self.settings.store, served.name, served.version)
        if loaded.manifest.text is not None:
            # A text model's tokenizer is read here too, so a missing or unreadable one fails the load, not requests.
            try:
                await asyncio.to_thread(text.encoder, self.settings.store, served.name, served.version, loaded.manifest)
            except text.TextError as e:
                raise StoreError(str(e)) from None
        if loaded.manifest.handler is not None:  # built here, so one that cannot be built fails the load
            built = handlers.handler_in_time(
                self.settings.store,
                served.name,
                served.version,
                loaded.manifest.handler,
                (),
                loaded.manifest.batching.max_batch_size,
                self.settings.max_image_pixels,
            )
            try:
                await built
            except handlers.HandlerLoadError as e:  # past the build's limit too: it runs on, holding only its own lock
                raise StoreError(str(e)) from None
        await self._check_padding(served, loaded)
        await asyncio.to_thread(outputcheck.at_load, loaded)  # a manifest that lies to clients fails here, not requests
        served.index_limits = await asyncio.to_thread(index_limits, loaded.module, loaded.manifest)
        held_to = self._fidelity.held_to(loaded.manifest)
        try:
            engine = await self._engine(served, loaded, precision)
        except Exception as e:  # its warm-up: the model's forward in that precision (fp32's ran in outputcheck)
            half = prec.resolve(precision, self.device)
            if half is Precision.FP32:
                raise
            reason = fidelity.forward_fails(half, e)
            if held_to is None:  # served in its half precision unmeasured, as the operator asked: it cannot be
                raise StoreError(
                    f"{reason}; the fidelity check is off for it, so it is served in {half.value} or not at all: "
                    "serve it in fp32 (--precision fp32, or the manifest's precision), or turn the check on"
                ) from None
            engine = await self._fidelity.unrunnable(served, loaded, half, held_to, reason)
        if engine.precision is not Precision.FP32 and held_to is not None:
            try:
                engine = await self._fidelity.check(served, loaded, engine, held_to)
            except BaseException:
                engine.close()
                raise
        rows, in_flight = engine.batches(served.batching.max_batch_size)
        batcher = Batcher(
            self._runner(served, loaded, engine),
            max_batch_size=rows,
            max_delay=served.batching.max_delay_ms / 1000.0,
            max_queue_rows=served.batching.max_queue_rows,
            adaptive_delay=served.batching.adaptive_delay,
            concurrency=in_flight,
            observer=self._observer(served, engine),
        )
        batcher.start()
        served.loaded, served.host_weight_bytes = loaded, module_bytes(loaded.module)
        served.engine, served.batcher, served.precision = engine, batcher, engine.precision
        served.precision_source = self._precision_source(served)
        served.state = ModelState.READY
        info = engine.info
        log.info(
            "model %s v%d ready on %s in %s (warm-up %.2fs; %d instance(s)%s, buckets %s, CUDA graphs %s, inductor %s)",
            served.name,
            served.version,
            engine.device,
            engine.precision.value,
            served.warmup_seconds,
            info.instances,
            _PLACED[info.placement],
            list(info.buckets) or "off",
            f"captured in {info.graph_capture_seconds:.2f}s" if info.cuda_graphs else "off",
            f"compiled in {info.inductor_compile_seconds:.2f}s" if info.inductor else "off",
        )

    def _precision_source(self, served: ServedModel) -> PrecisionSource:
        """What decided the precision a model was loaded in (see :attr:`ServedModel.precision_source`)."""
        if served.fp32_fallback is not None:
            return PrecisionSource.FIDELITY_FALLBACK
        if served.mixed is not None and served.mixed.plan is not None:
            return PrecisionSource.MIXED_PLAN
        if served.name in self.precisions:
            return PrecisionSource.OPERATOR
        return PrecisionSource.SERVER if self.settings.precision is not None else PrecisionSource.MANIFEST

    async def load(self, name: str, version: int | None = None, precision: Precision | None = None) -> ServedModel:
        """Load (or reload) ``name`` from the store without a restart, warmed up before it serves.

        ``version`` defaults to the store's served version (the manifest's pin, else the highest); ``precision``
        sets the model's precision from now on. A model being served keeps answering from its old instance until
        the new one is warm, then the old one drains; a model not being served shows as loading (so readiness
        answers "not ready") until it is warm. If loading fails, the model is left as it was: one being served keeps
        serving, with the version that failed and why in its ``failed_versions``; one that is not, asked for no
        particular version, is served from its newest older version that loads, as at start-up.

        Raises :class:`StoreError` for a model or version the store does not hold, or a checkpoint that fails.
        """
        if not (self.settings.store / storage.check_name(name) / storage.MANIFEST).is_file():
            raise StoreError(f"model {name!r} is not in the store {self.settings.store}")
        async with self._lock(name):
            served = self._register(name, version)
            old = self.models.get(name)
            if old is None or old.batcher is None:
                self.models[name] = served
            before = self.precisions.get(name)
            if precision is not None:
                self.precisions[name] = precision
            try:
                served = await self._fallback.load_or_older(served, old, asked_for_version=version is not None)
            except BaseException:
                _restore(self.precisions, name, before)
                if old is None:
                    self.models.pop(name, None)
                else:
                    self.models[name] = old
                raise
            self.models[name] = served
            if old is not None:
                # Newer versions that failed are still passed over: a reload of the one served keeps naming those
                # the store still holds.
                present = set(storage.versions(self.settings.store / name))
                passed_over = {v: e for v, e in old.failed_versions.items() if v > served.version and v in present}
                served.failed_versions = {**passed_over, **served.failed_versions}
                if old is not served:
                    old.successor = served
                await self._release(old)
            return served

    async def reload(self, name: str, precision: Precision | None = None) -> ServedModel:
        """Read the version ``name`` serves (or last served) again from the store; see :meth:`load`."""
        return await self.load(name, self.get(name).version, precision)

    async def unload(self, name: str) -> None:
        """Stop serving ``name``: queued requests are answered, then the engine is released."""
        async with self._lock(name):
            served = self.get(name)
            served.state = ModelState.UNLOADED
            await self._release(served)

    async def set_precision(self, name: str, precision: Precision) -> ServedModel:
        """Serve ``name`` in ``precision`` from now on, without re-reading its checkpoint or failing a request.

        A new engine is cast from the fp32 weights kept on the host and warmed up while the old one serves; then the
        batcher hands its next batch to the new engine, and the old one is released once its running batch is done.
        Raises :class:`ModelNotReadyError` unless the model is being served.
        """
        async with self._lock(name):
            served = self.get(name)
            batcher, old, loaded = served.batcher, served.engine, served.loaded
            if served.state is not ModelState.READY or batcher is None or old is None or loaded is None:
                raise ModelNotReadyError(f"model {name!r} is {served.state.value}; load it first")
            target, fallback = self._switch_target(served, precision)
            if target is old.precision:
                self.precisions[name] = precision
                served.switched(precision, target, fallback)
                return served

            def switched() -> None:
                self.precisions[name] = precision
                served.switched(precision, target, fallback)

            try:
                await self._swap(served, batcher, old, loaded, target, switched, None)
            except (StoreError, ModelNotReadyError):
                raise
            except Exception as e:  # its forward in that precision (its warm-up): the old engine serves on
                raise StoreError(f"its forward fails in {target.value}: {type(e).__name__}: {e}") from None
            return served

    async def _swap(
        self,
        served: ServedModel,
        batcher: Batcher,
        old: ModelEngine,
        loaded: LoadedModel,
        target: Precision,
        switched: Callable[[], None],
        plan: tuple[str, ...] | None,
    ) -> None:
        """Hand ``served``'s batcher a new engine in ``target`` (keeping ``plan``'s modules in fp32, by default the
        model's own plan), cast from the host weights and warmed up while ``old`` serves; ``old`` is released once its
        running batch is answered. ``switched`` records why, as the new engine takes over (so ``/models`` never shows
        the new precision with the old reason)."""
        engine = await self._engine(served, loaded, target, plan)
        if served.batcher is not batcher:  # released (shutdown) while the new engine warmed up
            engine.close()
            raise ModelNotReadyError(f"model {served.name!r} was released during the precision switch")
        batcher.runner, batcher.observer = self._runner(served, loaded, engine), self._observer(served, engine)
        served.engine, served.precision = engine, engine.precision
        switched()
        await asyncio.to_thread(old.close)  # returns once the batch running on it (if any) is answered
        served.retired_overflows += old.overflows
        served.retired_fp32_reruns += old.fp32_reruns
        log.info("model %s switched from %s to %s", served.name, old.precision.value, engine.precision.value)

    def _runner(self, served: ServedModel, loaded: LoadedModel, engine: ModelEngine) -> Runner:
        """The batcher's runner for ``engine``: tapped for live fidelity (:mod:`halfserve.livefidelity`) where the
        model is served in a half precision held to a fidelity bar, and the sampling rate is not 0."""
        held_to = self._fidelity.held_to(loaded.manifest)
        settings = livefidelity.LiveSettings.of(self.settings)
        if held_to is None or not livefidelity.samples_live(loaded.manifest, engine.precision, settings):
            return engine.run
        if served.live is None:
            loop = asyncio.get_running_loop()

            def below(reason: str) -> None:  # on the live fidelity worker's thread
                loop.call_soon_threadsafe(self._demotion.below_bar, served, reason)

            served.live = livefidelity.LiveFidelity(served.name, loaded, held_to, settings, below)
            served.live.start()
        return served.live.tap(engine.run, engine.precision)

    def _switch_target(self, served: ServedModel, precision: Precision) -> tuple[Precision, str | None]:
        """The precision a switch to ``precision`` serves, and the fallback reason when that is fp32 in its stead:
        ``auto`` re-applies the load's fallback where it resolves to the half precision measured below its bar; a
        named precision is the operator's choice and is served as named."""
        resolved = prec.resolve(precision, self.device)
        shortfall = served.fidelity_shortfall
        if precision is Precision.AUTO and shortfall is not None and resolved is served.shortfall_precision:
            return Precision.FP32, shortfall
        return resolved, None

    @staticmethod
    async def _release(served: ServedModel) -> None:
        batcher, engine, live = served.batcher, served.engine, served.live
        served.batcher = None
        if batcher is not None:
            await batcher.stop()
            served.final_stats = batcher.stats
        if engine is not None:
            # Off the event loop: it waits for instance threads or processes to end (seconds for a hung one).
            await asyncio.to_thread(engine.close)
        served.engine = None
        if live is not None:
            await asyncio.to_thread(live.close)  # its worker's current rerun ends first

    @property
    def ready(self) -> bool:
        """True when every model that is not unloaded is loaded and warmed up."""
        live = [m for m in self.models.values() if m.state is not ModelState.UNLOADED]
        return bool(live) and all(why_model_not_ready(m) is None for m in live)

    def get(self, name: str | None) -> ServedModel:
        """The model called ``name``; ``None`` means the only model when exactly one is served."""
        return find(self.models, name)

    def stored_models(self) -> list[str]:
        """The names of the models in the store, served or not (:meth:`halfserve.serving.ModelAdmin.stored_models`)."""
        return storage.model_names(self.settings.store)

    def stored_versions(self, name: str) -> list[int] | None:
        """The versions of ``name`` in the store (see :meth:`halfserve.serving.ModelAdmin.stored_versions`)."""
        return storage.stored_versions(self.settings.store, name)

    async def close(self) -> None:
        """Drain every batcher (queued requests are answered), then release the engines."""
        await self._demotion.finish()  # a demotion under way finishes its switch first
        for served in self.models.values():
            await self._release(served)


def _restore(overrides: dict[str, Precision], name: str, value: Precision | None) -> None:
    if value is None:
        overrides.pop(name, None)
    else:
        overrides[name] = value
