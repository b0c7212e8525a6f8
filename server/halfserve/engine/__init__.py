"""A model's engine: the model on its device under a precision policy, and one runner per placement.

* :mod:`~halfserve.engine.protocol`: what the rest of the server uses of an engine (:class:`ModelEngine`), a
  placement's :class:`BatchRunner`, the engine's errors and :class:`EngineInfo`.
* :mod:`~halfserve.engine.core`: :class:`Engine`, the in-process engine (model, precision, staging, warm-up).
* :mod:`~halfserve.engine.inputs`: how the model takes a batch (input order, normalisation).
* :mod:`~halfserve.engine.faults`: the faults of a forward it recognises: out of memory, a half precision's overflow.
* :mod:`~halfserve.engine.intraop`: torch's intra-op threads per instance thread, settled on a timed forward.
* :mod:`~halfserve.engine.threads`, :mod:`~halfserve.engine.loop`, :mod:`~halfserve.engine.pipelined`: the runners
  of :attr:`~halfserve.placement.Placement.INSTANCE_THREADS`, ``EVENT_LOOP`` and ``BESIDE_LOOP``, built by
  :mod:`~halfserve.engine.runners` (the traced graph of ``BESIDE_LOOP``: :mod:`~halfserve.engine.traced`); instance
  processes are :mod:`halfserve.isolated`'s :class:`~halfserve.isolated.engine.ProcessEngine`.
"""
