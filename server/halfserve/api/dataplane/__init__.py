"""The KServe V2 data plane: one inference, whichever protocol carries it.

HTTP (:mod:`halfserve.api.http.v2`) and gRPC (:mod:`halfserve.api.grpc.grpc_service`) only translate their wire to and
from it; the data plane imports neither, nor FastAPI, Starlette, uvicorn, grpc or torch:

* :mod:`.json_request`: an HTTP request's JSON header and binary data as the typed
  :class:`~.request.InferRequest` (gRPC reads its own message into one: :mod:`halfserve.api.grpc.grpc_codec`);
* :mod:`.decode`: an :class:`~.request.InferRequest` (its tensors as JSON data, binary data, shared memory, texts) as
  the named numpy arrays a :class:`~halfserve.serving.ModelHandle` takes, checked against the model's signature;
* :mod:`.signature`: a tensor's shape against its input's spec, one rule for ``/predict`` and V2;
* :mod:`.outputs`: which outputs go back and how (binary data or JSON, top classes, shared memory);
* :mod:`.plan`: what a header decided, kept, so a header seen before is neither parsed nor checked again;
* :mod:`.infer`: the one way a request is submitted: the deadline, a client gone, a drain, the domain errors;
* :mod:`.encode`: the outputs as the response's entries and binary data;
* :mod:`.metadata`: the server's and a model's metadata;
* :mod:`.request`: the values they pass along (the typed request, the decoded request, an output's request).
"""
