"""The KServe V2 gRPC protocol's messages, built from the protocol's own ``.proto`` files.

``protos/`` holds Triton's ``grpc_service.proto`` and ``model_config.proto`` (the ``inference`` package: the KServe
V2 service and Triton's extensions to it, the superset that ``tritonclient.grpc`` and KServe's clients speak) and the
``grpc.health.v1`` ``health.proto``, unchanged, and ``descriptors.binpb``, their compiled ``FileDescriptorSet``
(``scripts/gen-grpc-descriptors``). The message classes are made from it at import, in a descriptor pool of this
module's own rather than protobuf's default one:

* no generated ``_pb2`` code to ship, so no pin between the protoc that generated it and the protobuf runtime
  installed (generated code refuses an older runtime, and warns on a newer major);
* a process that also imports ``tritonclient.grpc`` (a test, a client embedding the server) or another copy of the
  health service registers the same message names in the default pool from files of its own; in one pool those
  would collide, in two they cannot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"

_POOL = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(
    (Path(__file__).parent / "protos" / "descriptors.binpb").read_bytes()
).file:
    _POOL.Add(_file)


def message(full_name: str) -> Any:
    """The message class called ``full_name`` (``inference.ModelInferRequest``)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(full_name))


def methods(service: str) -> dict[str, tuple[Any, Any, bool, bool]]:
    """``service``'s methods by name: request class, response class, client streaming, server streaming."""
    return {
        m.name: (
            message_factory.GetMessageClass(m.input_type),
            message_factory.GetMessageClass(m.output_type),
            m.client_streaming,
            m.server_streaming,
        )
        for m in _POOL.FindServiceByName(service).methods
    }


InferParameter = message("inference.InferParameter")
ModelInferRequest = message("inference.ModelInferRequest")
ModelInferResponse = message("inference.ModelInferResponse")
ModelStreamInferResponse = message("inference.ModelStreamInferResponse")
ModelConfig = message("inference.ModelConfig")
ModelStatistics = message("inference.ModelStatistics")
HealthCheckResponse = message("grpc.health.v1.HealthCheckResponse")
