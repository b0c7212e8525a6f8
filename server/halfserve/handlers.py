"""A team's own pre- and post-processing code (the manifest's ``handler`` section), TorchServe-handler style: built
once per loaded version, and called on threads of its own, never on the event loop.

Its calls are bounded as tokenizing is: at most :data:`HANDLER_THREADS` run and :data:`HANDLER_QUEUE` wait; one more
is refused busy (a 503 with ``Retry-After``). A call past the section's ``timeout_s`` is answered as timed out, but
Python cannot stop a thread: the call runs on, and keeps its place in the bound until it returns, so handlers that
hang fill the bound and their model's requests are refused busy rather than piling up threads. A handler that keeps a
batch's state on itself (the ``torchserve`` style) runs one call at a time, a call past its limit included: the next
waits for it as for a thread (:func:`wait_free`).

Torch-free: the code is resolved through :mod:`halfserve.models`, imported where a handler is first built (the load
path), so the data plane that calls handlers loads no torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfserve import images
from halfserve.handlerinput import HandlerSection, HandlerStyle
from halfserve.settings import MAX_IMAGE_PIXELS

HANDLER_THREADS = max(2, os.cpu_count() or 2)
"""Threads that run one model's handler calls (each model has its own, started as its calls need them)."""
HANDLER_QUEUE = 64
"""One model's handler calls that may wait for a thread; one more is refused busy."""
CONTENT_TYPE = "content_type"
"""The key of a payload's content type in a request as a handler is given it, beside its field's bytes."""
REASON_CHARS = 300
"""Longest reason an answer quotes from a handler's exception."""
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Stage(str, enum.Enum):
    """Which of a handler's methods runs."""

    PREPROCESS = "preprocess"
    POSTPROCESS = "postprocess"


class HandlerError(Exception):
    """Base of a handler call's failures; the message is one line naming the stage."""


class HandlerLoadError(HandlerError):
    """The handler cannot be built: not found, refused by the trust rule, or without the methods it needs."""


class HandlerRaisedError(HandlerError):
    """The handler's own code raised; the message is ``handler <stage> failed: <type>: <reason>``."""


class HandlerInputTooLargeError(HandlerRaisedError):
    """The handler refused an image over the server's pixel limit (TorchServe's ``VisionHandler`` holds images to
    ``--max-image-pixels``): the request's excess, answered as the server's own image decoding answers it (413)."""


def too_large(error: BaseException) -> bool:
    """Whether a handler's exception is an image over the server's pixel limit (:class:`HandlerInputTooLargeError`)."""
    return isinstance(error, images.ImageTooLargeError)


class HandlerBusyError(HandlerError):
    """As many handler calls run and wait as the bound holds."""


class HandlerTimeoutError(HandlerError):
    """A handler call ran past its section's ``timeout_s``."""


def request(field: str, data: bytes | str, content_type: str) -> dict[str, Any]:
    """TorchServe's shape of one request as a handler is given it: ``{"body": bytes}`` or ``{"data": bytes}`` (a
    text in place of the bytes where TorchServe hands one), with the content type."""
    return {field: data, CONTENT_TYPE: content_type}


def one_line(e: BaseException, before: str = "") -> str:
    """``before`` then ``<type>: <message>`` of ``e``, on one line, without object addresses, cut to
    :data:`REASON_CHARS`: what a client is told of a handler's exception (never its traceback)."""
    text = _ADDRESS.sub("", " ".join(f"{before}{type(e).__name__}: {e}".split()))
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


@dataclass(frozen=True)
class _Raised:
    """What a call on a handler thread raised, returned instead of raised so that a call the caller stopped waiting
    for leaves no unretrieved exception behind."""

    error: BaseException


_built: dict[tuple[str, str, int, str, int], Any] = {}
_build_locks: dict[tuple[str, str, int, str, int], threading.Lock] = {}
_locks_lock = threading.Lock()
BUILD_TIMEOUT_S = 120.0
"""Longest a version's load waits for its handler to be built (a TorchServe handler's ``initialize`` included): past
it the version fails to load, naming the handler; the build runs on, holding only its own model's lock."""


def build(
    section: HandlerSection,
    code_path: Sequence[Path] = (),
    name: str = "",
    folder: Path | None = None,
    batch_size: int = 1,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> Any:
    """A fresh handler of ``section``: its ``code`` resolved under the trust rule (from ``code_path``, the operator's
    folders, which a front-end process registers here first) and called with no arguments, or for the ``torchserve``
    style built and initialized as TorchServe does (model ``name``, its files in ``folder``, the server's
    ``max_image_pixels``: :mod:`halfserve.tscompat`);
    :class:`HandlerLoadError` says why not."""
    from halfserve import models, tscompat  # torch: only where a handler is built, never by the data plane's import

    torchserve = section.style is HandlerStyle.TORCHSERVE
    try:
        models.add_code_path(code_path)
        with tscompat.shadowing() if torchserve else contextlib.nullcontext():
            factory = models.resolve_code(section.code, "handler")
    except (models.UnknownArchitectureError, tscompat.TorchServeHandlerError) as e:
        raise HandlerLoadError(str(e)) from None
    if not callable(factory):
        raise HandlerLoadError(f"handler {section.code!r}: {type(factory).__name__} object is not callable")
    try:
        handler = (
            tscompat.build(factory, section.code, name, folder, batch_size, max_image_pixels)
            if torchserve
            else factory()
        )
    except tscompat.TorchServeHandlerError as e:
        raise HandlerLoadError(str(e)) from None
    except Exception as e:
        raise HandlerLoadError(f"handler {section.code!r}: building it failed: {one_line(e)}") from None
    missing = [s.value for s in Stage if not callable(getattr(handler, s.value, None))]
    if missing:
        raise HandlerLoadError(f"handler {section.code!r}: {type(handler).__name__} has no {' or '.join(missing)}")
    return handler


def handler(
    store: Path,
    name: str,
    version: int,
    section: HandlerSection,
    code_path: Sequence[Path] = (),
    batch_size: int = 1,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> Any:
    """Model ``name``'s version's handler, built the first time it is asked for in this process (the load asks, so
    that one that cannot be built fails the load, not requests; a front-end process builds its own on its first
    request, importing torch then). It blocks while it builds: see :func:`built`."""
    key = (str(store), name, version, section.code, max_image_pixels)
    with _locks_lock:  # held only to find the model's own lock: a handler that hangs in its build holds no other's
        lock = _build_locks.setdefault(key, threading.Lock())
    with lock:
        found = _built.get(key)
        if found is None:
            from halfserve import models  # torch, as build imports it: only where a handler is built

            models.forbid_store(store)  # a front-end process builds here first: its store's modules never run
            folder = store / name / str(version)
            found = _built[key] = build(section, code_path, name, folder, batch_size, max_image_pixels)
    return found


def built(store: Path, name: str, version: int, section: HandlerSection, max_image_pixels: int) -> Any:
    """The handler :func:`handler` built already, or ``None`` (then build it off the event loop)."""
    return _built.get((str(store), name, version, section.code, max_image_pixels))


def past_build_limit(section: HandlerSection) -> str:
    """Why a version whose handler's build ran past :data:`BUILD_TIMEOUT_S` is refused."""
    return f"handler {section.code!r}: building it (its initialize) ran past {BUILD_TIMEOUT_S:g} s"


def build_within(section: HandlerSection, *args: Any) -> Any:
    """:func:`build` (``args`` its other arguments) on a daemon thread, waited for :data:`BUILD_TIMEOUT_S` at most:
    past it, :class:`HandlerLoadError`. A build that hangs runs on in its thread, which does not hold the process's
    exit (an import that refused it ends)."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(build(section, *args))
        except BaseException as e:  # the caller's, to raise in its own thread
            done.set_exception(e)

    threading.Thread(target=run, name="halfserve-handler-build", daemon=True).start()
    try:
        return done.result(BUILD_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise HandlerLoadError(past_build_limit(section)) from None


_building: dict[tuple[str, str, int, str, int], tuple[asyncio.Future[Any], float]] = {}
"""The builds running now, from :func:`handler_in_time`, with when each runs past :data:`BUILD_TIMEOUT_S`."""


async def handler_in_time(
    store: Path,
    name: str,
    version: int,
    section: HandlerSection,
    code_path: Sequence[Path] = (),
    batch_size: int = 1,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
) -> Any:
    """:func:`handler`, built on a thread, never on the event loop, within :data:`BUILD_TIMEOUT_S` of the build's
    start: past it :class:`HandlerLoadError` (:func:`past_build_limit`), the build running on. One build of a handler
    at a time: a caller that comes while one runs waits for that one, to the same limit, and holds no thread meanwhile
    (a caller that waited on the build's lock held one for as long as a build hung, and every request came to wait
    so)."""
    found = built(store, name, version, section, max_image_pixels)
    if found is not None:
        return found
    key = (str(store), name, version, section.code, max_image_pixels)
    building = _building.get(key)
    if building is None:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[Any] = loop.create_future()

        def work() -> None:  # on the build's thread
            outcome = _guarded(lambda: handler(store, name, version, section, code_path, batch_size, max_image_pixels))
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (a shutdown): nobody waits for it
                loop.call_soon_threadsafe(_settle, started, outcome)

        # A daemon, not the loop's default executor: a build that hangs holds neither that executor's threads nor
        # the process's exit (asyncio.run's end and the interpreter's both wait for those without a limit).
        threading.Thread(target=work, name=f"halfserve-build-{name}", daemon=True).start()
        building = _building[key] = started, time.monotonic() + BUILD_TIMEOUT_S
        started.add_done_callback(lambda done: _built_or_failed(key, done))
    future, deadline = building
    try:
        return await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise HandlerLoadError(past_build_limit(section)) from None


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if isinstance(outcome, _Raised):
        future.set_exception(outcome.error)
    else:
        future.set_result(outcome)


def _built_or_failed(key: tuple[str, str, int, str, int], done: asyncio.Future[Any]) -> None:
    del _building[key]  # a build that failed is tried again by the next caller, as a load tries it again
    if not done.cancelled():
        done.exception()  # retrieved, for a build that failed after every caller stopped waiting


_running: dict[str, int] = {}
"""Calls running or waiting for a thread, per model: each has threads and a bound of its own, so a handler that hangs
holds its own model's threads, never another model's."""
_executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def _threads(model: str) -> concurrent.futures.ThreadPoolExecutor:
    found = _executors.get(model)
    if found is None:  # threads start as calls need them: a model whose handler is idle holds none
        found = _executors[model] = concurrent.futures.ThreadPoolExecutor(
            HANDLER_THREADS, thread_name_prefix=f"{_THREAD_PREFIX}{model}"
        )
    return found


_THREAD_PREFIX = "halfserve-handler-"
_calling: dict[threading.Thread, str] = {}
"""The handler threads in a call now, with their model's name."""
_calling_lock = threading.Lock()


def abandon(deadline: float) -> dict[str, int]:
    """At a shutdown: stop every model's handler threads, wait for the calls still running until ``deadline`` (a
    :func:`time.monotonic` time), and return the models whose calls still run then, with how many.

    The threads are not daemons (the executor's), and the interpreter's exit joins them without a limit: a call that
    hangs past its time limit held the process's exit for as long as it slept, or forever. The caller ends the process
    without that join when any are left (:meth:`halfserve.httpserver.DrainingServer.exit_past_drain`)."""
    for executor in _executors.values():
        executor.shutdown(wait=False, cancel_futures=True)  # idle threads end now; waiting calls never start
    with _calling_lock:
        calling = list(_calling)
    for thread in calling:  # a thread ends as its call returns: its executor is shut down
        thread.join(max(0.0, deadline - time.monotonic()))
    left: dict[str, int] = {}
    with _calling_lock:
        for model in _calling.values():
            left[model] = left.get(model, 0) + 1
    return left


def _guarded(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except BaseException as e:  # a SystemExit from the team's code is that request's failure too
        # Only its type and words are read. Its traceback held this thread's frames, one of which the _Raised in turn,
        # and the payloads they read: a cycle only a collection of the older generations freed, seldom on a busy
        # server (60 requests of 16 failing payloads of 160 KB had grown it by 166 MB).
        e.__traceback__ = e.__context__ = e.__cause__ = None
        return _Raised(e)


def running(model: str) -> int:
    """Model ``model``'s handler calls running or waiting for a thread now, those past their time limit included."""
    return _running.get(model, 0)


_stuck: dict[str, int] = {}
"""Bytes of payloads that calls past their time limit still hold, per model, until they return."""


def _unstuck(model: str, weight: int) -> None:
    _stuck[model] -= weight


def stuck_bytes(model: str) -> int:
    """Bytes of payloads model ``model``'s calls past their time limit still hold (``weight`` of :func:`run`)."""
    return _stuck.get(model, 0)


_calls: dict[int, concurrent.futures.Future[Any]] = {}
"""The call each handler object that runs one call at a time runs now, by the object's id, until the call returns (one
past its time limit included). The call's own function holds the object, so an id here is never another's."""
_calls_lock = threading.Lock()


def running_call(handler: object) -> concurrent.futures.Future[Any] | None:
    """The call ``handler`` runs now (recorded by :func:`hold`), or ``None``."""
    with _calls_lock:
        return _calls.get(id(handler))


def hold(handler: object, call: concurrent.futures.Future[Any]) -> None:
    """Record ``call`` as the one ``handler`` runs, until it is done (or withdrawn before it ran)."""
    key = id(handler)
    with _calls_lock:
        _calls[key] = call

    def done(_: object) -> None:
        with _calls_lock:
            if _calls.get(key) is call:
                del _calls[key]

    call.add_done_callback(done)


def occupied(stage: Stage, model: str, timeout_s: float) -> str:
    """Why a call waited for its handler in vain: an earlier call, past its time limit, still runs on it."""
    return (
        f"handler {stage.value}: the handler of model {model!r} still ran an earlier call past its time limit after "
        f"{timeout_s:g} s (a torchserve-style handler runs one call at a time)"
    )


def wait_free(handler: object, timeout_s: float) -> bool:
    """Whether ``handler`` runs no call (:func:`hold`) now or within ``timeout_s``, waiting on this thread."""
    deadline = time.monotonic() + timeout_s
    while (prior := running_call(handler)) is not None:
        left = deadline - time.monotonic()
        if left <= 0 or not concurrent.futures.wait([prior], left).done:
            return False
    return True


async def _free(handler: object, timeout_s: float) -> bool:
    """:func:`wait_free` on the event loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (prior := running_call(handler)) is not None:
        left = deadline - loop.time()
        if left <= 0:
            return False
        # asyncio.wait, never wait_for: a wrapped future cancelled by a timeout would cancel the call it wraps.
        done, _ = await asyncio.wait([asyncio.wrap_future(prior)], timeout=left)
        if not done:
            return False
    return True


async def run(
    stage: Stage,
    call: Callable[[], Any],
    timeout_s: float,
    model: str,
    weight: int = 0,
    exclusive: object | None = None,
) -> Any:
    """``call()`` on one of model ``model``'s handler threads within ``timeout_s`` of its start:
    :class:`HandlerRaisedError` when it raises, :class:`HandlerTimeoutError` past the limit (it runs on, see the
    module), :class:`HandlerBusyError` when the model's bound is full or no thread came free within ``timeout_s``
    (calls past their limit hold them all; the call is withdrawn, never run): the time limit is the call's own, not
    its wait for a thread, which another request's call may hold. ``weight`` (the bytes of the payloads the call
    reads) is counted in :func:`stuck_bytes` from its time limit until it returns. ``exclusive``, the handler object
    where it runs one call at a time: the call first waits up to ``timeout_s`` for the object's earlier call to
    return, and is refused busy, never run, if it does not."""
    if exclusive is not None and not await _free(exclusive, timeout_s):
        raise HandlerBusyError(occupied(stage, model, timeout_s))
    held = running(model)
    if held >= HANDLER_THREADS + HANDLER_QUEUE:
        raise HandlerBusyError(
            f"handler {stage.value}: {held} handler calls of model {model!r} are running or waiting, as many as the "
            "server holds for one model"
        )
    loop = asyncio.get_running_loop()
    _running[model] = held + 1

    def finished(_: object) -> None:  # on the loop, when the thread returns: a stuck call keeps its place
        _running[model] -= 1

    began = asyncio.Event()

    def started() -> Any:  # on the handler thread
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (a shutdown): nobody waits for it
            loop.call_soon_threadsafe(began.set)
        thread = threading.current_thread()
        with _calling_lock:
            _calling[thread] = model
        try:
            return _guarded(call)
        finally:
            with _calling_lock:
                del _calling[thread]

    queued = _threads(model).submit(started)
    if exclusive is not None:  # recorded before any await: a call after this one on the loop waits for it
        hold(exclusive, queued)
    future = asyncio.wrap_future(queued, loop=loop)
    future.add_done_callback(finished)
    try:
        await asyncio.wait_for(began.wait(), timeout_s)
    except TimeoutError:
        if queued.cancel():  # still waiting for a thread: withdrawn, it never runs (False: it has just started)
            raise HandlerBusyError(
                f"handler {stage.value}: no handler thread of model {model!r} came free within {timeout_s:g} s "
                "(calls past their time limit hold them)"
            ) from None
    try:
        result = await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        if weight and not future.done():
            _stuck[model] = _stuck.get(model, 0) + weight
            future.add_done_callback(lambda _: _unstuck(model, weight))
        raise HandlerTimeoutError(
            f"handler {stage.value} ran past its time limit of {timeout_s:g} s (handler.timeout_s)"
        ) from None
    if isinstance(result, _Raised):
        kind = HandlerInputTooLargeError if too_large(result.error) else HandlerRaisedError
        raise kind(one_line(result.error, f"handler {stage.value} failed: "))
    return result
