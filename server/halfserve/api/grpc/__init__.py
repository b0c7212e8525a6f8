"""KServe V2 over gRPC: the service (:mod:`.grpc_service`), its messages to and from the data plane
(:mod:`.grpc_codec`), the transport's limits (:mod:`.grpc_limits`) and its connections (:mod:`.grpc_peers`)."""
