"""Serving from several processes (``--http-workers N``): HTTP front-ends in front of one engine process.

With ``--http-workers N`` (N > 1) the server runs N front-end processes that accept the clients' connections, parse
and validate requests and encode the answers, and one engine process that owns the models, batches every front-end's
requests together and runs them on the device. One Python process parses HTTP at a few thousand requests per second
(profiled: about 250 us of event-loop time per 150 KB image request on a 16-core host); a GPU forward at batch 64
takes a fraction of that per row, so on a GPU host the event loop, not the device, is the limit without this.

Each front-end holds one Unix-socket connection to the engine process and one shared memory (a ``memfd``, sent over
that socket with ``SCM_RIGHTS``, so it needs no ``/dev/shm`` space and leaves no file behind), cut into slots. A
request's input is copied once into a free slot; the engine process batches a numpy view of it (no copy), writes the
output rows into the same slot and answers with their dtype and shape. Inputs or outputs larger than a slot
travel inline on the socket instead. Frames are ``<II`` (header length, payload length), an orjson header, then the
payload; a connection's requests are answered out of order, by id. Requests carry named tensors, as the serving
contract does (:mod:`halfserve.serving`), and failures the contract's domain errors, by name.

The engine process stays authoritative: it checks the model and version of every request itself, and its model's
``submit`` refuses one it cannot take now, so a front-end's copy of the model table only has to be recent enough to
decode requests (and to refuse a model unloaded or failed as the routes do in one process). It is pushed within
:data:`TABLE_POLL_S` of any change; a change made through the API is answered only once every front-end has applied it
(:meth:`~halfserve.multiproc.engine_side.Backplane.publish`), so a client's next request finds it whichever front-end
takes it. Front-ends send the per-request metrics (status, rows, latency) here in batches, so ``/metrics`` counts every
front-end's requests.

The package, split by concern; each part imports the routes only through :func:`halfserve.api.http.answer_first`.
The frames, the slots and the named tensors in them are :mod:`halfserve.ipc`'s, as instance processes' are; errors
cross as the contract's domain errors (:func:`halfserve.errors.error_to_wire`):

* :mod:`~halfserve.multiproc.engine_side`: the engine process's end
  (:class:`~halfserve.multiproc.engine_side.Backplane`);
* :mod:`~halfserve.multiproc.client`: a front-end's end, as a :class:`~halfserve.serving.ModelService`;
* :mod:`~halfserve.multiproc.frontend`: the front-end's ASGI app, which relays what it does not answer, and exits
  once its connection to the engine process is lost;
* :mod:`~halfserve.multiproc.supervisor`: spawning, restarting and stopping the front-ends.
"""
