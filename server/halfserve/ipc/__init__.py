"""How the server's processes talk: frames, shared memory and channels, the same for both process families.

With ``--http-workers N`` front-end processes talk to the engine process (:mod:`halfserve.multiproc`); with
``execution.isolation: "process"`` the server process talks to its instance processes (:mod:`halfserve.isolated`).
Both speak what is here, and neither imports the other:

* :mod:`~halfserve.ipc.frames`: frames on a stream socket (``<II`` lengths, an orjson header, a payload), and the
  error for one that is not a frame;
* :mod:`~halfserve.ipc.tensors`: named tensors' places in a header, their bytes in a payload, dtypes on the wire;
* :mod:`~halfserve.ipc.memory`: ``memfd`` shared memory both ends map: a front-end's slots, an instance's input and
  output regions;
* :mod:`~halfserve.ipc.exports`: the engine process's memory (front-ends' slots) exported to instance processes, and
  their end that maps it;
* :mod:`~halfserve.ipc.channel`: a channel's blocking end, for a process without an event loop.

Nothing here imports torch or an HTTP or gRPC library: page-locking, where a process wants it, is passed in.
"""
