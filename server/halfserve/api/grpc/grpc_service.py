"""The KServe V2 protocol over gRPC: ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``.

It runs on the app's event loop (grpcio's asyncio server), in the process that owns the models, and reaches them
through the same :class:`~halfserve.serving.ModelService` as the HTTP routes: a gRPC inference is queued on the same
batcher, so gRPC and HTTP requests share batches. A ``ModelInferRequest`` is translated into the V2 data plane's
request (:mod:`halfserve.api.grpc.grpc_codec`) and decoded, submitted and encoded by it
(:mod:`halfserve.api.dataplane`), as an HTTP request is, so limits and messages are the same; a refusal
(:class:`~halfserve.api.errors.RefusedError`, and the domain errors through theirs) maps onto a gRPC status code once
(:data:`CODES`), with the message HTTP answers too.

Management calls (repository load and unload and index, shared memory registration) need the admin token as the
``authorization: Bearer <token>`` metadata, as the HTTP routes need the header.

Limits of the transport itself (:mod:`halfserve.api.grpc.grpc_limits`): a message over the largest request a served
model takes (at most ``max_body_bytes``) is refused (``RESOURCE_EXHAUSTED``) before it is read whole, compressed ones
unless ``grpc_compression``, metadata over ``max_header_bytes`` too; a connection that has not finished its HTTP/2
handshake within ``header_timeout`` is closed, one without a call for as long too, and one past
``max_connections``; a connection has at most ``grpc_max_streams`` calls open. A call's request message must arrive
whole within ``body_timeout`` (``DEADLINE_EXCEEDED``), and calls receiving one share ``grpc_pending_bytes``; at most
``max_connections`` inference calls run at once (one more is ``RESOURCE_EXHAUSTED``), and a stream has at most
:data:`STREAM_IN_FLIGHT` requests in flight, each until its answer is written. The health checks are counted in none
of these but their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc
from google.protobuf import json_format

from halfserve import grpc_messages as pb
from halfserve import text
from halfserve.api.access import admitted_regions, check_admin, of_version, why_not_ready
from halfserve.api.admin import index_entries, load_from_store, model_config, model_stats, refuse_overrides
from halfserve.api.dataplane.bounds import row_limit
from halfserve.api.dataplane.decode import decode, tokenize
from halfserve.api.dataplane.infer import infer
from halfserve.api.dataplane.metadata import EXTENSIONS, SERVER_NAME, metadata
from halfserve.api.dataplane.refusals import Refusal, refused
from halfserve.api.errors import APIError, RefusedError, forget, from_exception, held
from halfserve.api.grpc.grpc_codec import infer_request, infer_response
from halfserve.api.grpc.grpc_limits import PROBES, Admission, message_cap, parse, server_options, store_models
from halfserve.api.grpc.grpc_peers import PeerConnections
from halfserve.errors import InvalidInputError
from halfserve.manifest import sample_values
from halfserve.metrics import request_labels
from halfserve.serving import (
    AppState,
    Interface,
    LocalModel,
    ModelAdmin,
    ModelHandle,
    Prediction,
    check_ready,
    why_model_not_ready,
)
from halfserve.version import __version__

log = logging.getLogger(__name__)

CODES: dict[Refusal, grpc.StatusCode] = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Refusal.TOO_SLOW: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.TOO_MANY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Refusal.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.NO_ROOM: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.FAILED: grpc.StatusCode.INTERNAL,
}
"""The gRPC status code of each refusal: of a :class:`RefusedError` and of the domain errors the data plane and the
models raise, mapped here once."""

STREAM_IN_FLIGHT = 256
"""Most requests of one ``ModelStreamInfer`` stream in flight at once, from when one is read until its answer is
written: the stream is read no further until one is (HTTP/2 flow control then holds the client back), so a client
that does not read its answers holds no more than this many."""

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Call = Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[Any]]


class GrpcRefusal(Exception):
    """A domain error as gRPC answers it: its code and message, made afresh so that no traceback (and no request in
    its frames) outlives the call."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, e: Exception) -> GrpcRefusal:
        answer = refused(e)
        return cls(CODES[answer.refusal], answer.message)


def _refusal(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message that answer ``e``."""
    if isinstance(e, GrpcRefusal):
        return e.code, e.message
    if isinstance(e, RefusedError):
        return CODES[e.refusal], e.message
    refusal = GrpcRefusal.of(e)
    return refusal.code, refusal.message


def _client(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port (``ipv4:127.0.0.1:5000`` -> ``127.0.0.1``), for the admin lockout."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[")
    return peer


def _authorization(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""


class InferenceService:
    """The RPCs of ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` over an app's state."""

    def __init__(self, state: AppState, admission: Admission) -> None:
        self.state = state
        self.admission = admission

    # Helpers ---------------------------------------------------------------------------------------------------

    def _admin(self, context: grpc.aio.ServicerContext) -> None:
        check_admin(self.state, _client(context), _authorization(context))

    def _model(self, name: str, version: str, field: str = "name") -> ModelHandle:
        """The model ``name`` (the request's ``field``; empty: the only one served) at ``version``."""
        service = self.state.service
        if not name and len(models := service.models) > 1:  # the request's field named, not HTTP's "model"
            raise InvalidInputError(f"{field}: several models are served ({', '.join(models)}); name one in {field}")
        return of_version(service.get(name or None), version)

    def _repository(self) -> ModelAdmin:
        repo = self.state.repository
        if repo is None:
            raise RefusedError(Refusal.UNAVAILABLE, "this process serves no model repository")
        return repo

    def _local(self, name: str, version: str) -> LocalModel:
        return of_version(self._repository().get(name), version)

    # Health and metadata ---------------------------------------------------------------------------------------

    async def server_live(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.message("inference.ServerLiveResponse")(live=True)

    async def server_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.message("inference.ServerReadyResponse")(ready=why_not_ready(self.state) is None)

    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        served = self._model(request.name, request.version)
        return pb.message("inference.ModelReadyResponse")(ready=why_model_not_ready(served) is None)

    async def server_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        message = pb.message("inference.ServerMetadataResponse")
        return message(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        served = self._model(request.name, request.version)
        described = metadata(served)
        del described["parameters"]  # Triton's ModelMetadataResponse has no such field: gRPC clients read /models
        return json_format.ParseDict(described, pb.message("inference.ModelMetadataResponse")())

    async def model_config(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        served = self._local(request.name, request.version)
        device = self._repository().device
        config = json_format.ParseDict(model_config(served, device.type, device.index), pb.ModelConfig())
        return pb.message("inference.ModelConfigResponse")(config=config)

    async def model_statistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.name:
            served = self._local(request.name, request.version)
            check_ready(served, request.version or None)
            stats = served.batch_stats
            if stats is None:  # unloaded between the check and here
                raise RefusedError(Refusal.UNAVAILABLE, f"model {request.name!r} is {served.state.value}")
            counted = [(served, stats)]
        else:
            counted = [(m, s) for m in self._repository().models.values() if (s := m.batch_stats) is not None]
        response = pb.message("inference.ModelStatisticsResponse")()
        for m, s in counted:
            json_format.ParseDict(model_stats(m, s), response.model_stats.add())
        return response

    async def health_check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """``""`` (the server): SERVING while it answers, a liveness probe; ``inference.GRPCInferenceService``:
        SERVING once every model is loaded and warm and until a drain starts, a readiness probe."""
        status = pb.HealthCheckResponse.ServingStatus
        if request.service == "":
            return pb.HealthCheckResponse(status=status.Value("SERVING"))
        if request.service != pb.SERVICE:
            raise RefusedError(
                Refusal.NOT_FOUND, f"service: unknown service {request.service!r}; known: '', {pb.SERVICE!r}"
            )
        ready = why_not_ready(self.state) is None
        return pb.HealthCheckResponse(status=status.Value("SERVING" if ready else "NOT_SERVING"))

    # Inference -------------------------------------------------------------------------------------------------

    async def _infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """One inference, answered or raised; counted in the metrics under ``protocol="grpc"``."""
        start = time.perf_counter()
        served: ModelHandle | None = None
        result: Prediction | None = None
        status = 200
        try:
            served = self._model(request.model_name, request.model_version, "model_name")
            check_ready(served, request.model_version or None)
            settings = self.state.settings
            typed = await infer_request(request, served, settings)
            text.CLIENT.set(_client(context))  # whose turn its texts take on the tokenizing threads
            regions = partial(admitted_regions, self.state, _client(context), _authorization(context))
            client = context.time_remaining()  # before decoding: what that takes is spent from it (req.timeout)
            req = await tokenize(decode(typed, served, settings, regions), served, settings, client)
            try:
                result = await infer(self.state, served, req.inputs, req.timeout(client))
            except asyncio.CancelledError:  # the client went away (a drain's cut-off is an APIError)
                status = 499
                raise
            return infer_response(served, req, result)
        except Exception as e:
            status = from_exception(e).status  # the metrics count gRPC's requests by the status HTTP's would have
            # An APIError (a held one among them) is answered as itself; a domain error by its refusal's code.
            err = e if isinstance(e, APIError) else GrpcRefusal.of(e)
            if status >= 500:
                log.warning("gRPC ModelInfer failed: %s", err)
            forget(e)  # the payload its tracebacks hold is freed with the request, not by a later collection
            try:
                raise err from None
            finally:
                # Its traceback holds this frame, and the frame the request: kept here, the error would make a cycle
                # that only a full collection frees, every refused request in it.
                del err
        finally:
            self._record(served, result, status, time.perf_counter() - start)

    def _record(self, served: ModelHandle | None, result: Prediction | None, status: int, seconds: float) -> None:
        metrics = self.state.metrics
        if metrics is not None:
            model, precision, rows = request_labels(served, result)
            metrics.request(model, precision, Interface.GRPC, status, rows, seconds)

    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        with self.admission.inference():
            return await self._infer(request, context)

    async def model_stream_infer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Requests in, responses out as each is answered (not in order: a client matches them by ``id``); an error
        answers its request with ``error_message`` and the stream goes on. A stream with no request in flight that
        sends none for ``grpc_idle_timeout`` is ended (``DEADLINE_EXCEEDED``)."""
        answers: asyncio.Queue[Any | None] = asyncio.Queue()  # at most STREAM_IN_FLIGHT: each holds a slot of room
        room = asyncio.Semaphore(STREAM_IN_FLIGHT)
        running: set[asyncio.Task[None]] = set()
        failure: list[APIError] = []

        async def answer(request: Any) -> None:
            try:
                response = pb.ModelStreamInferResponse(infer_response=await self._infer(request, context))
            except (APIError, GrpcRefusal) as e:
                await held(e)
                response = pb.ModelStreamInferResponse(error_message=e.message)
                response.infer_response.id = request.id
                response.infer_response.model_name = request.model_name
            answers.put_nowait(response)

        async def next_request() -> bytes | None:
            """The stream's next message; a stream idle (nothing in flight) past the idle timeout fails."""
            idle = self.state.settings.grpc_idle_timeout
            reading = asyncio.ensure_future(self.admission.receive(context, _client(context), probe=False, stream=True))
            try:
                while not (await asyncio.wait({reading}, timeout=idle))[0]:
                    if not running:
                        raise RefusedError(Refusal.TOO_SLOW, f"stream: no request for {idle:g} s (grpc_idle_timeout)")
                return reading.result()
            finally:
                reading.cancel()

        async def read() -> None:
            try:
                with self.admission.inference():
                    while True:
                        await room.acquire()  # a slot for the next request's answer, freed once it is written
                        if (raw := await next_request()) is None:
                            break
                        try:
                            request = await parse(raw, pb.ModelInferRequest, "ModelInferRequest", self._values)
                        except APIError as e:
                            answers.put_nowait(pb.ModelStreamInferResponse(error_message=e.message))
                            continue
                        task = asyncio.create_task(answer(request))
                        running.add(task)
                        task.add_done_callback(running.discard)
                    await asyncio.gather(*running)
            except APIError as e:
                failure.append(e.with_traceback(None))  # its traceback holds this frame and the last message
                # A stream ended by its reading (idle, or its slot given up) still sends the answers in flight.
                await asyncio.gather(*running, return_exceptions=True)
            finally:
                answers.put_nowait(None)  # the end of the stream, however the reading ended

        reader = asyncio.create_task(read())
        try:
            while (response := await answers.get()) is not None:
                yield response  # back here once grpcio has written it
                room.release()
            await reader  # a failure to read the stream fails the call
            if failure:
                await context.abort(*_refusal(failure[0]))
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    def _values(self, model_name: str) -> tuple[int, str]:
        """Most values one input of a request to ``model_name`` may hold, and the setting that decides it: the
        model's most rows of its values per row, within ``max_request_elements`` (that alone where no such model is
        served: the request is refused by name once parsed). Called in a worker thread for a large message."""
        settings = self.state.settings
        most = settings.max_request_elements, "max_request_elements"
        try:
            served = self.state.service.get(model_name or None)
        except Exception:
            return most
        rows, setting = row_limit(settings, served.batching)
        per_row = max(sample_values(served.manifest), 1)
        if rows * per_row >= most[0]:
            return most
        return rows * per_row, f"model {served.name!r}: {rows} rows ({setting}) of {per_row} values"

    # Repository and shared memory (management: the admin token) -------------------------------------------------

    async def repository_index(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._admin(context)
        response = pb.message("inference.RepositoryIndexResponse")()
        for entry in index_entries(self._repository(), request.ready):
            response.models.add(**{k: str(v) for k, v in entry.items()})
        return response

    async def repository_model_load(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._admin(context)
        refuse_overrides(request.parameters)
        await load_from_store(self._repository(), request.model_name)
        await self.state.publish()
        return pb.message("inference.RepositoryModelLoadResponse")()

    async def repository_model_unload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._admin(context)
        await self._repository().unload(request.model_name)
        await self.state.publish()
        return pb.message("inference.RepositoryModelUnloadResponse")()

    async def shm_status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._admin(context)
        regions = self.state.regions.regions
        if request.name and request.name not in regions:
            raise RefusedError(Refusal.NOT_FOUND, f"no shared memory region {request.name!r} is registered")
        response = pb.message("inference.SystemSharedMemoryStatusResponse")()
        for name, region in regions.items():
            if not request.name or name == request.name:
                json_format.ParseDict(region.status(), response.regions[name])
        return response

    async def shm_register(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._admin(context)
        self.state.regions.register(request.name, request.key, request.offset, request.byte_size)
        await self.state.publish()
        return pb.message("inference.SystemSharedMemoryRegisterResponse")()

    async def shm_unregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._admin(context)
        self.state.regions.unregister(request.name or None)
        await self.state.publish()
        return pb.message("inference.SystemSharedMemoryUnregisterResponse")()

    async def cuda_shm_status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.message("inference.CudaSharedMemoryStatusResponse")()

    async def cuda_shm_register(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise RefusedError(
            Refusal.INVALID, "CUDA shared memory is not supported; register system shared memory instead"
        )

    async def cuda_shm_unregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.message("inference.CudaSharedMemoryUnregisterResponse")()

    # Registration ------------------------------------------------------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """The generic handlers of both services (a method not listed here answers ``UNIMPLEMENTED``)."""
        implemented = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
            "ModelStreamInfer": self.model_stream_infer,
            "ModelConfig": self.model_config,
            "ModelStatistics": self.model_statistics,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_model_load,
            "RepositoryModelUnload": self.repository_model_unload,
            "SystemSharedMemoryStatus": self.shm_status,
            "SystemSharedMemoryRegister": self.shm_register,
            "SystemSharedMemoryUnregister": self.shm_unregister,
            "CudaSharedMemoryStatus": self.cuda_shm_status,
            "CudaSharedMemoryRegister": self.cuda_shm_register,
            "CudaSharedMemoryUnregister": self.cuda_shm_unregister,
        }
        return [
            self._generic(pb.SERVICE, implemented),
            self._generic(pb.HEALTH_SERVICE, {"Check": self.health_check}),
        ]

    def _generic(self, service: str, implemented: dict[str, Any]) -> grpc.GenericRpcHandler:
        """Every method takes its request messages as bytes, read through :attr:`admission` (their deadline and
        budget) and parsed here: grpcio would parse a unary call's message before any of this code ran, on the
        event loop, with a malformed one logged as an error with its traceback."""
        methods = pb.methods(service)
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for name, fn in implemented.items():
            request, response, client_streaming, server_streaming = methods[name]
            if client_streaming and server_streaming:
                handlers[name] = grpc.stream_stream_rpc_method_handler(
                    fn, response_serializer=response.SerializeToString
                )
            else:
                # Registered as client streaming, which is a unary call on the wire: the handler starts before the
                # message is read, so the read can be bounded.
                handlers[name] = grpc.stream_unary_rpc_method_handler(
                    self._unary(name, fn, request), response_serializer=response.SerializeToString
                )
        return grpc.method_handlers_generic_handler(service, handlers)

    def _unary(self, name: str, handler: Handler, message: Any) -> Call:
        """``handler`` over the call's one request message, with its :class:`APIError` (and the domain errors)
        answered as their gRPC status."""
        probe = name in PROBES
        infer = name == "ModelInfer"
        what = message.DESCRIPTOR.name

        async def answer(context: grpc.aio.ServicerContext) -> Any:
            raw = await self.admission.receive(context, _client(context), probe=probe)
            if raw is None:
                raise RefusedError(Refusal.INVALID, "request: the call ended before its request message")
            request = await parse(raw, message, what, self._values if infer else None)
            return await handler(request, context)

        async def call(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            # The message lives in answer's frame only, and nothing of its error outlives the except (a traceback
            # holds the frames it passed): grpcio keeps the error abort raises, and this frame with it, in a cycle
            # until a full collection, which must hold no request.
            try:
                return await answer(context)
            except Exception as e:
                await held(e)
                code, details = _refusal(e)
            await context.abort(code, details)

        return call


class GrpcServer:
    """The gRPC server of an app: started by its lifespan, stopped when a drain begins."""

    def __init__(self, state: AppState) -> None:
        settings = state.settings
        repo = state.repository
        models = (
            [] if repo is None else store_models(settings, [(m.manifest, m.batching) for m in repo.models.values()])
        )
        self.message_cap = message_cap(settings, models) if models else settings.max_body_bytes
        # No maximum_concurrent_rpcs: grpcio counts every call in it, a silent one and a health check alike, and
        # refuses them all once it is reached; Admission counts only what costs.
        self.server = grpc.aio.server(options=server_options(settings, self.message_cap))
        service = InferenceService(state, Admission(settings, self.message_cap))
        self.server.add_generic_rpc_handlers(service.handlers())
        host = settings.host
        self.address = f"[{host}]:{settings.grpc_port}" if ":" in host else f"{host}:{settings.grpc_port}"
        self.per_peer = settings.grpc_peer_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._peers: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    def _why_not_bound(self) -> str:
        """Why the gRPC address cannot be bound, as the operating system says it (``Address already in use``)."""
        host, port = self.address.rpartition(":")[0].strip("[]"), int(self.address.rpartition(":")[2])
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, where = infos[0]
            with socket.socket(family, kind, proto) as probe:
                probe.bind(where)
        except OSError as e:
            return e.strerror or str(e)
        return "the address could not be bound"

    async def start(self) -> int:
        """Bind and serve; the bound port (the one asked for, or the one chosen for port 0)."""
        try:
            port: int = self.server.add_insecure_port(self.address)
        except RuntimeError:
            port = 0
        if port == 0:  # grpcio's own error says only "Failed to bind": the reason is the socket's
            raise OSError(f"gRPC: cannot listen on {self.address} (--grpc-port): {self._why_not_bound()}")
        await self.server.start()
        self._loop = asyncio.get_running_loop()
        self._peers = asyncio.create_task(PeerConnections(port, self.per_peer).run())
        log.info("gRPC (KServe V2) on %s", self.address.rsplit(":", 1)[0] + f":{port}")
        return port

    def begin_stop(self, grace: float) -> None:
        """Stop taking calls now; those in progress get ``grace`` seconds to finish, then are cancelled. Safe from a
        signal handler: the stop itself is scheduled on the server's loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop, grace)

    def _stop(self, grace: float) -> None:
        if self._peers is not None:
            self._peers.cancel()
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self.server.stop(grace))

    async def stopped(self, grace: float) -> None:
        """Stop (if not begun already) and return once every call has ended."""
        if self._loop is None:
            return
        self._stop(grace)
        assert self._stopping is not None
        with contextlib.suppress(asyncio.CancelledError):
            await self._stopping
